//! Live-model HF export throughput and memory (issue 7): streams a randomly initialised
//! Qwen3-MoE through `moe_models::export` into an HF directory with
//! `moe_models::hf::live_export`, and compares with a plain copy of the same files.
//!
//! Run: `cargo bench --bench export` (sizes via `EXPORT_BENCH_LAYERS`, `EXPORT_BENCH_HIDDEN`,
//! `EXPORT_BENCH_EXPERTS`; defaults 4 layers, hidden 512, 32 experts of width 512 ≈ 0.4 GB f32).
//!
//! Reported: the in-process iterator alone (callback that drops each tensor; the first pass
//! also runs the backend's lazy random init), and per dtype the wall time and GB/s of bytes
//! written, a plain `std::fs::copy` + fsync of the written files (the export fsyncs every file
//! too), and the peak extra resident memory of the export (`VmHWM` after the export minus
//! `VmRSS` before it, the high-water mark reset through `/proc/self/clear_refs`; Linux only).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Device;
use moe_models::Qwen3MoeConfig;
use moe_models::export::for_each_hf_tensor;
use moe_models::hf::live_export::{LiveDtype, LiveExportOptions, export_live_model};
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A `/proc/self/status` field in bytes (`None` off Linux).
fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets `VmHWM` to the current RSS (Linux ≥ 4.0); false when not possible.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn dir_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn main() {
    let layers = env_usize("EXPORT_BENCH_LAYERS", 4);
    let hidden = env_usize("EXPORT_BENCH_HIDDEN", 512);
    let experts = env_usize("EXPORT_BENCH_EXPERTS", 32);
    let cfg = Qwen3MoeConfig {
        vocab_size: 8192,
        hidden_size: hidden,
        intermediate_size: 4 * hidden,
        moe_intermediate_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: hidden / 8,
        num_experts: experts,
        num_experts_per_tok: 2,
        norm_topk_prob: true,
        ..Qwen3MoeConfig::default()
    };
    let config = json!({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": hidden / 8, "num_experts": experts, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "dtype": "float32",
    });
    let device = Device::flex();
    let model = match cfg.init(&device) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cannot build the model: {e}");
            std::process::exit(1);
        }
    };
    let root = std::env::temp_dir().join(format!("moe-export-bench-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&root);
    println!(
        "Qwen3-MoE: {layers} layers, hidden {hidden}, {experts} experts of width {hidden}, \
         vocab {}",
        cfg.vocab_size
    );

    // The iterator alone (host transfers + slicing, no I/O). The first pass also runs the
    // backend's lazily evaluated random init, so it is reported separately.
    for pass in ["first pass", "second pass"] {
        let start = Instant::now();
        let mut bytes = 0u64;
        for_each_hf_tensor(&model, |_, data| {
            bytes += data.as_bytes().len() as u64;
            Ok::<(), moe_models::ModelError>(())
        })
        .expect("export");
        let secs = start.elapsed().as_secs_f64();
        println!(
            "iterator (callback, f32, {pass}): {:.1} MB in {secs:.3} s = {:.2} GB/s",
            mb(bytes),
            bytes as f64 / secs / 1e9
        );
    }

    for (label, dtype) in [
        ("f32", LiveDtype::F32),
        ("bf16", LiveDtype::BF16),
        ("fp8 128x128", LiveDtype::Fp8 { block: [128, 128] }),
    ] {
        let out = root.join(label.replace(' ', "_"));
        let opts = LiveExportOptions {
            dtype,
            max_shard_size: 100_000_000,
            overwrite: true,
        };
        let rss_before = status_bytes("VmRSS:");
        let peak_reset = reset_peak();
        let start = Instant::now();
        let summary = match export_live_model(&model, &config, None, &out, &opts) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{label}: export failed: {e}");
                std::process::exit(1);
            }
        };
        let secs = start.elapsed().as_secs_f64();
        let peak = status_bytes("VmHWM:");
        let extra = match (peak_reset, rss_before, peak) {
            (true, Some(b), Some(p)) => format!("{:.1} MB", mb(p.saturating_sub(b))),
            _ => "n/a (needs Linux /proc/self/clear_refs)".to_owned(),
        };
        let written: u64 = dir_files(&out)
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok().map(|m| m.len()))
            .sum();

        let copy_dir = root.join(format!("{}_copy", label.replace(' ', "_")));
        let _ = std::fs::remove_dir_all(&copy_dir);
        let _ = std::fs::create_dir_all(&copy_dir);
        let start = Instant::now();
        for f in dir_files(&out) {
            if let Some(name) = f.file_name() {
                let dst = copy_dir.join(name);
                let _ = std::fs::copy(&f, &dst);
                // The export fsyncs its files; so does the copy, for a fair comparison.
                let _ = std::fs::File::open(&dst).and_then(|file| file.sync_all());
            }
        }
        let copy_secs = start.elapsed().as_secs_f64();
        println!(
            "export {label:<11}: {:.1} MB ({} tensors, {} shards) in {secs:.3} s = {:.2} GB/s; \
             plain copy (+fsync) of the files {copy_secs:.3} s = {:.2} GB/s; peak extra memory {extra}",
            mb(written),
            summary.tensors,
            summary.shards,
            written as f64 / secs / 1e9,
            written as f64 / copy_secs / 1e9,
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
