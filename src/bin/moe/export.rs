//! `moe export`: HF → HF export (FP8 → BF16, stacked → per-expert names, re-sharding), or a
//! distributed checkpoint → HF (`moe export <checkpoint> --out <hf-dir>`).

use std::path::PathBuf;

use anyhow::Context;
use burn_moe::bridge::export::{ExportOptions, export_hf, parse_size};
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::Dtype;
use burn_moe::models::hf::ModelConfig;

/// Arguments of `moe export`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A distributed checkpoint (root or `iter_*` directory) to export instead of `--model`.
    #[arg(
        value_name = "CHECKPOINT",
        conflicts_with = "model",
        required_unless_present = "model"
    )]
    pub checkpoint: Option<PathBuf>,
    /// Source HF checkpoint directory or hub-cache model id.
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// Output directory (written to a temporary directory and renamed into place).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Float dtype of the exported weights (FP8 weights are dequantised to it). By default each
    /// tensor keeps its dtype: FP8 weights of an HF source become bf16, FP8 weights stored in a
    /// distributed checkpoint stay FP8 with their `*_scale_inv` and `quantization_config`, and
    /// the checkpoint of a `--bf16` run gives bf16 (its f32 main weights rounded once);
    /// `f32` exports such a checkpoint's f32 main weights. The DeepSeek-V3 router bias always
    /// stays f32. `mxfp4` writes the release format of a model whose release stores MXFP4
    /// tensors (gpt-oss): those packed as `*_blocks` / `*_scales` (the OCP MX rule), the rest
    /// bf16, the release's `quantization_config`; refused for other models.
    #[arg(long, value_enum)]
    pub dtype: Option<ExportDtype>,
    /// With `--dtype mxfp4`: the MXFP4 release (HF directory) the weights came from; its block
    /// scales are kept wherever a block's values still fit them exactly, so weights that did
    /// not change re-pack to the release's bytes.
    #[arg(long, value_name = "DIR")]
    pub mxfp4_reference: Option<PathBuf>,
    /// Largest shard, e.g. `5GB` (10^9 bytes), `500MB`, `2GiB` or a byte count.
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
    /// Replace the output directory if it exists.
    #[arg(long)]
    pub overwrite: bool,
    /// Add DeepSeek-V3 MTP copies of `embed_tokens` and `shared_head.head` when the source
    /// lacks them (as the release checkpoints store them).
    #[arg(long)]
    pub emit_mtp_copies: bool,
}

/// `--dtype` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportDtype {
    /// bfloat16.
    Bf16,
    /// float32.
    F32,
    /// MXFP4 for the tensors the model's release packs, bfloat16 for the rest.
    Mxfp4,
}

/// Runs `moe export`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let options = ExportOptions {
        dtype: args.dtype.map(|d| match d {
            ExportDtype::Bf16 | ExportDtype::Mxfp4 => Dtype::BF16,
            ExportDtype::F32 => Dtype::F32,
        }),
        max_shard_size: args.max_shard_size,
        overwrite: args.overwrite,
        emit_mtp_copies: args.emit_mtp_copies,
        mxfp4: args.dtype == Some(ExportDtype::Mxfp4),
        mxfp4_reference: args.mxfp4_reference.clone(),
    };
    if let Some(checkpoint) = &args.checkpoint {
        let ckpt = burn_moe::bridge::dist::DistCheckpoint::open::<ModelConfig>(checkpoint)?;
        let summary = crate::progress::with_spinner("exporting", || {
            burn_moe::bridge::dist::convert::export_dist_to_hf::<ModelConfig>(
                &ckpt, &args.out, &options,
            )
        })
        .with_context(|| format!("export of {} failed", checkpoint.display()))?;
        println!(
            "wrote {}: {} tensors, {} bytes in {} shard(s)",
            summary.target.display(),
            summary.tensors,
            summary.total_size,
            summary.shards
        );
        return Ok(());
    }
    let model = args.model.clone().unwrap_or_default();
    let failed = || format!("export of {model} failed");
    let source = HfCheckpoint::open_model(&model).with_context(failed)?;
    // Validated before anything is written (export_hf checks again; headers only).
    let report = source.check::<ModelConfig>().with_context(failed)?;
    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    tracing::info!(
        source = %source.dir().display(),
        target = %args.out.display(),
        tensors = source.len(),
        "exporting"
    );
    let summary = crate::progress::with_spinner("exporting", || {
        export_hf::<ModelConfig>(&source, &args.out, &options)
    })
    .with_context(failed)?;
    if !summary.dropped.is_empty() {
        tracing::info!(
            dropped = summary.dropped.len(),
            "source tensors not exported"
        );
        tracing::debug!(dropped = ?summary.dropped);
    }
    println!(
        "wrote {}: {} tensors, {} bytes in {} shard(s)",
        summary.target.display(),
        summary.tensors,
        summary.total_size,
        summary.shards
    );
    Ok(())
}
