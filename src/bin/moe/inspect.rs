//! `moe inspect <model>`: what a checkpoint holds, without loading its weights, and whether
//! it is valid: the config parsed and validated, then (when weights are present) the shard
//! set, every implied tensor's presence, shape and dtype ([`HfCheckpoint::check`]); an invalid
//! checkpoint is a non-zero exit after the summary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use burn_moe::bridge::fp8::{is_scale_inv, scale_inv_name};
use burn_moe::bridge::hf::{CONFIG_FILE, HfCheckpoint, resolve_model_dir};
use burn_moe::models::ParamCount;
use burn_moe::models::hf::ModelConfig;

/// Arguments of `moe inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF checkpoint directory, hub-cache model id, directory with only a `config.json`, or a
    /// `config.json` file (parameter counts only).
    pub model: String,
}

/// Per-dtype totals.
#[derive(Default)]
struct DtypeTotals {
    tensors: usize,
    elements: u64,
    bytes: u64,
}

/// Runs `moe inspect`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (dir, config_path) = locate(&args.model)?;
    let config = ModelConfig::from_dir(&dir)
        .with_context(|| format!("cannot read the model config {}", config_path.display()))?;
    println!("model:        {}", dir.display());
    println!(
        "architecture: {} (model_type {})",
        config.architecture(),
        config.model_type()
    );
    let experts = match config.experts() {
        Some((e, k)) => format!(", {e} routed experts, top-{k}"),
        None => ", dense".to_owned(),
    };
    println!(
        "shape:        {} layers, hidden {}, vocab {}{experts}",
        config.num_layers(),
        config.hidden_size(),
        config.vocab_size()
    );
    print_counts(&config.param_count()?);
    for warning in config.warnings() {
        println!("warning:      {warning}");
    }
    let has_weights = dir.join(burn_moe::bridge::hf::SINGLE_FILE).is_file()
        || dir.join(burn_moe::bridge::hf::INDEX_FILE).is_file();
    if !has_weights {
        println!("weights:      none (config only)");
        return Ok(());
    }
    let checkpoint = HfCheckpoint::open(&dir)?;
    // Every shard header valid and the shard set unambiguous before anything is listed.
    checkpoint.verify_shards()?;
    print_weights(&checkpoint)?;
    // The weights against the config: shard set, presence, shapes, dtypes.
    let report = checkpoint.check::<ModelConfig>().with_context(|| {
        format!(
            "{} does not hold a valid {} checkpoint",
            dir.display(),
            config.model_type()
        )
    })?;
    // The report repeats the config's warnings (printed above) first.
    for warning in report.warnings.iter().skip(config.warnings().len()) {
        eprintln!("warning: {warning}");
    }
    println!(
        "validation:   ok ({} tensors match the config{})",
        checkpoint.len() - report.unused.len(),
        match report.unused.len() {
            0 => String::new(),
            n => format!(", {n} unused"),
        }
    );
    Ok(())
}

/// The directory to inspect and its `config.json`.
fn locate(model: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let path = Path::new(model);
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        anyhow::ensure!(
            path.file_name().is_some_and(|n| n == CONFIG_FILE),
            "{model}: expected a directory or a {CONFIG_FILE} file"
        );
        return Ok((dir, path.to_path_buf()));
    }
    let dir = if path.join(CONFIG_FILE).is_file() {
        path.to_path_buf()
    } else {
        resolve_model_dir(model)?
    };
    let config = dir.join(CONFIG_FILE);
    Ok((dir, config))
}

fn print_counts(count: &ParamCount) {
    println!(
        "parameters:   {} total, {} active per token",
        human(count.total as f64),
        human(count.active as f64)
    );
    if count.mtp > 0 {
        println!(
            "MTP:          {} more in multi-token-prediction layers ({} with them)",
            human(count.mtp as f64),
            human((count.total + count.mtp) as f64)
        );
    }
}

fn print_weights(checkpoint: &HfCheckpoint) -> anyhow::Result<()> {
    let mut totals: BTreeMap<String, DtypeTotals> = BTreeMap::new();
    let mut fp8 = 0usize;
    let mut scales = 0usize;
    let bar = crate::progress::bar(checkpoint.len() as u64, "reading headers");
    for name in checkpoint.tensor_names() {
        let info = checkpoint.info(name)?;
        let entry = totals.entry(info.dtype.to_string()).or_default();
        entry.tensors += 1;
        entry.elements += info.num_elements() as u64;
        entry.bytes += info.byte_len() as u64;
        if is_scale_inv(name) {
            scales += 1;
        } else if info.dtype.size() == 1 && checkpoint.contains(&scale_inv_name(name)) {
            fp8 += 1;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let shards = checkpoint.shard_paths();
    let layout = if checkpoint.is_sharded() {
        "sharded (model.safetensors.index.json)"
    } else {
        "single file"
    };
    println!(
        "checkpoint:   {layout}, {} file(s), {} tensors",
        shards.len(),
        checkpoint.len()
    );
    for shard in shards {
        let size = std::fs::metadata(shard).map(|m| m.len()).unwrap_or(0);
        println!(
            "  {} ({})",
            shard.file_name().map_or_else(
                || shard.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            human_bytes(size)
        );
    }
    println!("dtypes:");
    for (dtype, t) in &totals {
        println!(
            "  {dtype:<8} {:>6} tensors, {:>10} values, {}",
            t.tensors,
            human(t.elements as f64),
            human_bytes(t.bytes)
        );
    }
    if fp8 > 0 {
        let block = checkpoint.fp8_block_size()?;
        println!(
            "FP8:          yes, {fp8} blockwise-quantised weights ({scales} *_scale_inv), \
             block {}x{} (dequantised on load)",
            block[0], block[1]
        );
    } else {
        println!("FP8:          no");
    }
    Ok(())
}

/// `1.23B`, `45.6M`, `7.8K` or the plain number.
fn human(x: f64) -> String {
    for (scale, unit) in [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")] {
        if x >= scale {
            return format!("{:.2}{unit}", x / scale);
        }
    }
    format!("{x}")
}

/// `1.2 GB`-style sizes (10³ units, as HF shard limits).
fn human_bytes(bytes: u64) -> String {
    let x = bytes as f64;
    for (scale, unit) in [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")] {
        if x >= scale {
            return format!("{:.1} {unit}", x / scale);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human(671e9), "671.00B");
        assert_eq!(human(999.0), "999");
        assert_eq!(human_bytes(5_000_000_000), "5.0 GB");
        assert_eq!(human_bytes(12), "12 B");
    }
}
