//! Upcycling: turn the shipped dense Qwen3 fixture into a Qwen3-MoE checkpoint
//! (docs/checkpoints.md §Upcycling) and compare the two models' logits on the fixture's golden
//! input.
//!
//! Run: `cargo run --release --example upcycle` (G = 1 and G = 2 into a temporary directory),
//! or with options:
//!
//! ```text
//! cargo run --release --example upcycle -- --out DIR [--experts 4] [--topk 2]
//!     [--granularity 2] [--seed 0] [--pre-softmax] [--logits FILE]
//! ```
//!
//! `--logits FILE` also writes the upcycled model's logits (`F32 [2, 12, V]`, key `logits`)
//! as safetensors; `tests/check_upcycle.py` compares them with transformers.

use std::error::Error;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor};
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::safetensors::{OwnedTensor, SafetensorsFile, write_safetensors};
use moe_models::upcycle::{RouterMode, UpcycleOptions, upcycle};
use moe_models::{Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn input_ids(device: &Device) -> Result<Tensor<2, Int>> {
    let golden = SafetensorsFile::open(fixtures().join("qwen3.golden.safetensors"))?;
    Ok(Tensor::from_data(
        golden.tensor("input_ids")?.to_tensor_data()?,
        device,
    ))
}

fn host(t: Tensor<3>) -> Result<(Vec<usize>, Vec<f32>)> {
    let dims = t.dims().to_vec();
    let values = t
        .into_data()
        .try_into_vec_as::<f32>()
        .map_err(|e| format!("logits: {e:?}"))?;
    Ok((dims, values))
}

/// Upcycles with `opts` into `out`, prints the logit difference to the dense model and
/// returns the MoE logits.
fn run(
    opts: &UpcycleOptions,
    out: &Path,
    dense: &[f32],
    device: &Device,
) -> Result<(Vec<usize>, Vec<f32>)> {
    let summary = upcycle(&fixtures().join("qwen3"), out, opts)?;
    let s = summary.scale;
    println!(
        "upcycled E={} k={} G={} (R={}, F/G={}, s={}, c={:.4}) into {} ({} tensors, {} bytes)",
        s.experts,
        s.topk,
        s.granularity,
        s.expansion,
        s.moe_intermediate,
        s.scale,
        s.weight_multiplier,
        summary.target.display(),
        summary.tensors,
        summary.total_size
    );
    let cfg = Qwen3MoeConfig::from_file(out.join("config.json"))?;
    let model = Qwen3MoeForCausalLM::from_weights(&cfg, &HfCheckpoint::open(out)?, device)?;
    let (dims, moe) = host(model.forward(input_ids(device)?)?.logits)?;
    let max_abs = moe
        .iter()
        .zip(dense)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = dense.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    println!(
        "  max |logit(MoE) − logit(dense)| = {max_abs:.3e} (max |logit| = {scale:.3}, \
         relative {:.3e})",
        max_abs / scale
    );
    Ok((dims, moe))
}

fn main() -> Result<()> {
    let mut opts = UpcycleOptions {
        experts: 4,
        topk: 2,
        ..UpcycleOptions::default()
    };
    let (mut out, mut logits_file, mut granularity) = (None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--out" => out = Some(PathBuf::from(value()?)),
            "--logits" => logits_file = Some(PathBuf::from(value()?)),
            "--experts" => opts.experts = value()?.parse()?,
            "--topk" => opts.topk = value()?.parse()?,
            "--granularity" => granularity = Some(value()?.parse()?),
            "--seed" => opts.seed = value()?.parse()?,
            "--pre-softmax" => opts.router_mode = RouterMode::PreSoftmax,
            "--overwrite" => opts.overwrite = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }

    let device = Device::flex();
    let dense_dir = fixtures().join("qwen3");
    let cfg = Qwen3Config::from_file(dense_dir.join("config.json"))?;
    let dense = Qwen3ForCausalLM::from_weights(&cfg, &HfCheckpoint::open(&dense_dir)?, &device)?;
    let (_, dense_logits) = host(dense.forward(input_ids(&device)?)?)?;

    match out {
        Some(out) => {
            opts.granularity = granularity.unwrap_or(1);
            let (dims, moe) = run(&opts, &out, &dense_logits, &device)?;
            if let Some(path) = logits_file {
                let t = OwnedTensor::from_f32("logits", dims, &moe)?;
                write_safetensors(&path, &[t.view()])?;
                println!("  wrote {}", path.display());
            }
        }
        None => {
            let tmp =
                std::env::temp_dir().join(format!("moe-upcycle-example-{}", std::process::id()));
            for g in granularity.map_or(vec![1, 2], |g| vec![g]) {
                opts.granularity = g;
                run(&opts, &tmp.join(format!("g{g}")), &dense_logits, &device)?;
            }
            std::fs::remove_dir_all(&tmp)?;
        }
    }
    Ok(())
}
