//! Distributed-checkpoint commands: `moe convert` (HF → distributed), `moe reshard`
//! (distributed → distributed under another layout) and `moe validate`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn_moe::backend::parallel::ParallelLayout;
use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::dist::commit::TempDirState;
use burn_moe::bridge::dist::convert::{ConvertOptions, convert_hf_to_dist_opts, reshard};
use burn_moe::bridge::hf::{HfCheckpoint, resolve_model_dir};
use burn_moe::models::hf::ModelConfig;

/// Arguments of `moe convert`.
#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Source HF checkpoint: a directory, or a hub id `org/name[@revision]` found in the hub
    /// cache (downloaded into it when built with the `hub` feature).
    #[arg(long, value_name = "DIR|ORG/NAME[@REV]")]
    pub from_hf: String,
    /// Checkpoint root (the new `iter_*` directory and `latest` are written there).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Target layout, e.g. `world=4,tp=2,ep=4` (omitted sizes are 1).
    #[arg(long)]
    pub layout: String,
    /// Step recorded in the checkpoint.
    #[arg(long, default_value_t = 0)]
    pub step: u64,
    /// Store blockwise FP8 weights dequantised to BF16 instead of keeping their FP8 bytes and
    /// `*_scale_inv` block scales (the default keeps FP8 end to end).
    #[arg(long)]
    pub dequantize: bool,
}

/// Arguments of `moe reshard`.
#[derive(Debug, clap::Args)]
pub struct ReshardArgs {
    /// Checkpoint root (its `latest`) or one `iter_*` directory.
    pub checkpoint: PathBuf,
    /// Output checkpoint root.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// New layout.
    #[arg(long)]
    pub layout: String,
}

/// Arguments of `moe validate`.
#[derive(Debug, clap::Args)]
pub struct ValidateArgs {
    /// Checkpoint root or one `iter_*` directory.
    pub checkpoint: PathBuf,
}

/// Runs `moe convert`: the source is validated against its `config.json` before anything is
/// written (warnings go to stderr as `warning: …`); a failed validation leaves `--out`
/// untouched.
pub fn convert(args: ConvertArgs) -> anyhow::Result<()> {
    let layout = ParallelLayout::parse_spec(&args.layout)?;
    let failed = || format!("conversion of {} failed", args.from_hf);
    let source = resolve_model_dir(&args.from_hf).with_context(failed)?;
    let report = HfCheckpoint::open(&source)
        .and_then(|source| source.check::<ModelConfig>())
        .with_context(failed)?;
    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    let bar = crate::progress::bar(0, "converting");
    let opts = ConvertOptions {
        step: args.step,
        keep_fp8: !args.dequantize,
    };
    let dir =
        convert_hf_to_dist_opts::<ModelConfig>(&source, &args.out, &layout, &opts, &mut |p| {
            bar.set_length(p.total_bytes);
            bar.set_position(p.bytes);
            bar.set_message(p.tensor.clone());
        })
        .with_context(failed)?;
    bar.finish_and_clear();
    println!("wrote {} ({layout})", dir.display());
    Ok(())
}

/// Runs `moe reshard`.
pub fn reshard_cmd(args: ReshardArgs) -> anyhow::Result<()> {
    let layout = ParallelLayout::parse_spec(&args.layout)?;
    let ckpt = DistCheckpoint::open::<ModelConfig>(&args.checkpoint)?;
    let dir = crate::progress::with_spinner("resharding", || {
        reshard::<ModelConfig>(&ckpt, &args.out, &layout)
    })?;
    println!("wrote {} ({layout})", dir.display());
    Ok(())
}

/// Runs `moe validate`: validates the checkpoint and warns about the temporary save
/// directories of its root (saves in progress, or left by saves that died); those do not make
/// the checkpoint invalid.
pub fn validate(args: ValidateArgs) -> anyhow::Result<()> {
    let opened = DistCheckpoint::open::<ModelConfig>(&args.checkpoint);
    // The root is the parent of the resolved `iter_*` directory; when nothing resolves, the
    // path given may still be a root holding only temporary directories.
    let root = match &opened {
        Ok(ckpt) => ckpt.dir().parent().map(Path::to_path_buf),
        Err(_) => Some(args.checkpoint.clone()),
    };
    if let Some(root) = root {
        warn_temp_dirs(&root);
    }
    let ckpt = opened?;
    ckpt.validate::<ModelConfig>()?;
    println!(
        "{}: valid ({} tensors, every element covered exactly once and finite)",
        ckpt.dir().display(),
        ckpt.index().tensors.len()
    );
    Ok(())
}

/// Prints one warning (stderr) per temporary save directory of `root`.
fn warn_temp_dirs(root: &Path) {
    let dirs = match DistCheckpoint::temp_dirs(root) {
        Ok(dirs) => dirs,
        Err(e) => {
            eprintln!("warning: cannot list the temporary save directories: {e}");
            return;
        }
    };
    for dir in dirs {
        let what = match dir.state {
            TempDirState::Stale => "stale temporary save directory, removed by the next save",
            TempDirState::Live => "a save in progress",
            TempDirState::Pending => {
                "temporary save directory, possibly a save in progress; \
                 removed by a save once idle past its grace period"
            }
        };
        eprintln!("warning: {}: {what} ({})", dir.path.display(), dir.reason);
    }
}
