//! Progress display on stderr (hidden automatically when stderr is not a terminal) and model
//! loading shared by the commands.

use std::time::Duration;

use anyhow::Context;
use burn::tensor::Device;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::models::hf::{AnyCausalLm, ModelConfig, WeightPrecision, load_checked};
use indicatif::{ProgressBar, ProgressStyle};

/// Runs `work` under a spinner labelled `message`, clearing it afterwards.
pub fn with_spinner<T>(message: &str, work: impl FnOnce() -> T) -> T {
    let bar = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
        bar.set_style(style);
    }
    bar.set_message(message.to_owned());
    bar.enable_steady_tick(Duration::from_millis(120));
    let out = work();
    bar.finish_and_clear();
    out
}

/// A bar over `len` steps labelled `message`.
pub fn bar(len: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg} {wide_bar} {pos}/{len} [{elapsed}]") {
        bar.set_style(style);
    }
    bar.set_message(message.to_owned());
    bar
}

/// Resolves `model` (directory or hub-cache id), opens it and builds the model its
/// `config.json` names on `device`.
pub fn load_model(
    model: &str,
    precision: WeightPrecision,
    device: &Device,
) -> anyhow::Result<AnyCausalLm> {
    let failed = || format!("cannot load model {model}");
    let checkpoint = HfCheckpoint::open_model(model).with_context(failed)?;
    let config = ModelConfig::from_dir(checkpoint.dir()).with_context(failed)?;
    tracing::info!(
        model = %checkpoint.dir().display(),
        model_type = config.model_type(),
        tensors = checkpoint.len(),
        shards = checkpoint.shard_paths().len(),
        "loading"
    );
    let started = std::time::Instant::now();
    // Validates the checkpoint against its config before reading any weight.
    let (loaded, report) = with_spinner("loading weights", || {
        load_checked(&checkpoint, precision, device)
    })
    .with_context(failed)?;
    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    tracing::info!(seconds = started.elapsed().as_secs_f64(), "loaded");
    Ok(loaded)
}
