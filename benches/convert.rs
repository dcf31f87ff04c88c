//! HF → distributed checkpoint conversion throughput and memory (issue 6).
//!
//! Writes a synthetic BF16 Qwen3-MoE HF checkpoint of ≥ 2 GB (per-expert tensors, 500 MB
//! shards) into a temporary directory, then measures
//! - a plain copy of the same safetensors files (8 MiB read/write buffer, fsync per file — the
//!   conversion fsyncs its files too), and
//! - `moe_bridge::dist::convert::convert_hf_to_dist` to a distributed checkpoint under
//!   `world=8,tp=2,ep=8` (attention TP2 × DP4, experts EP8), committed atomically,
//!
//! and reports throughput (source bytes / s), their ratio (target ≥ 0.5) and the conversion's
//! peak resident memory: `VmHWM` of a fresh child process (this binary re-executed) that runs
//! only the conversion (Linux only), against 3 × the largest tensor (the target, plus a fixed
//! overhead: the process's RSS at start).
//!
//! Run: `cargo bench --bench convert` (size via `CONVERT_BENCH_LAYERS`, default 10 ≈ 2.2 GB;
//! layout via `CONVERT_BENCH_LAYOUT`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use moe_backend::parallel::ParallelLayout;
use moe_backend::testing::XorShift64;
use moe_bridge::dist::DistCheckpoint;
use moe_bridge::dist::convert::convert_hf_to_dist_with;
use moe_bridge::safetensors::{Dtype, HfDirWriter, OwnedTensor, ShardPlan};
use moe_models::hf::ModelConfig;
use serde_json::json;

const HIDDEN: usize = 1024;
const VOCAB: usize = 65536;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const EXPERTS: usize = 32;
const MOE_WIDTH: usize = 1024;

/// A `/proc/self/status` field in bytes (`None` off Linux).
fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The synthetic model's HF tensors: name → shape (all BF16).
fn model_tensors(layers: usize) -> BTreeMap<String, Vec<usize>> {
    let mut t = BTreeMap::new();
    t.insert("model.embed_tokens.weight".to_owned(), vec![VOCAB, HIDDEN]);
    t.insert("lm_head.weight".to_owned(), vec![VOCAB, HIDDEN]);
    t.insert("model.norm.weight".to_owned(), vec![HIDDEN]);
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![HIDDEN]),
            ("post_attention_layernorm.weight", vec![HIDDEN]),
            ("self_attn.q_proj.weight", vec![HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.k_proj.weight", vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.v_proj.weight", vec![KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.o_proj.weight", vec![HIDDEN, HEADS * HEAD_DIM]),
            ("self_attn.q_norm.weight", vec![HEAD_DIM]),
            ("self_attn.k_norm.weight", vec![HEAD_DIM]),
            ("mlp.gate.weight", vec![EXPERTS, HIDDEN]),
        ] {
            t.insert(p(name), shape);
        }
        for e in 0..EXPERTS {
            for proj in ["gate_proj", "up_proj"] {
                t.insert(
                    p(&format!("mlp.experts.{e}.{proj}.weight")),
                    vec![MOE_WIDTH, HIDDEN],
                );
            }
            t.insert(
                p(&format!("mlp.experts.{e}.down_proj.weight")),
                vec![HIDDEN, MOE_WIDTH],
            );
        }
    }
    t
}

/// Writes the synthetic checkpoint; returns (total tensor bytes, largest tensor bytes).
fn write_model(dir: &Path, layers: usize) -> (u64, u64) {
    let tensors = model_tensors(layers);
    let sizes: BTreeMap<String, u64> = tensors
        .iter()
        .map(|(n, s)| (n.clone(), (s.iter().product::<usize>() * 2) as u64))
        .collect();
    let plan = ShardPlan::greedy(&sizes, 500_000_000);
    let mut writer = HfDirWriter::create(dir, plan, true).expect("create HF writer");
    let mut rng = XorShift64::new(0x9E37_79B9_7F4A_7C15);
    for (name, shape) in &tensors {
        let n: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(n * 2);
        for _ in 0..n {
            // Small BF16 values: sign + exponent around 2^-4, random mantissa.
            let bits = 0x3D00u16 | (rng.next_u64() as u16 & 0x807F);
            bytes.extend_from_slice(&bits.to_le_bytes());
        }
        let t = OwnedTensor::new(name.clone(), Dtype::BF16, shape.clone(), bytes).expect("tensor");
        writer.push(t).expect("push tensor");
    }
    let config = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_experts": EXPERTS, "num_experts_per_tok": 4, "moe_intermediate_size": MOE_WIDTH,
        "intermediate_size": 4 * HIDDEN, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": false, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    });
    writer.write_json("config.json", &config).expect("config");
    writer.finish().expect("finish HF checkpoint");
    (
        sizes.values().sum(),
        sizes.values().copied().max().unwrap_or(0),
    )
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
}

/// Plain userspace copy (8 MiB buffer) of `files` into `out`, fsyncing each; returns bytes.
fn plain_copy(files: &[PathBuf], out: &Path) -> u64 {
    std::fs::create_dir_all(out).expect("create copy dir");
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    for src in files {
        let mut input = File::open(src).expect("open source");
        let name = src.file_name().expect("file name");
        let mut output = File::create(out.join(name)).expect("create copy");
        loop {
            let n = input.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            output.write_all(&buf[..n]).expect("write");
            total += n as u64;
        }
        output.sync_all().expect("fsync copy");
    }
    total
}

/// Environment variable that makes the binary run only the conversion:
/// `<hf dir>\n<out root>\n<layout>`.
const CHILD_ENV: &str = "MOE_CONVERT_BENCH_CHILD";

/// The child: converts, prints `seconds=`, `peak=` (VmHWM bytes) and `rss_start=`.
fn child(spec: &str) {
    let mut parts = spec.splitn(3, '\n');
    let (Some(hf), Some(out), Some(layout)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("bad {CHILD_ENV}");
    };
    let layout = ParallelLayout::parse_spec(layout).expect("layout");
    let rss_start = status_bytes("VmRSS:").unwrap_or(0);
    let t = Instant::now();
    convert_hf_to_dist_with::<ModelConfig>(Path::new(hf), Path::new(out), &layout, 0, &mut |_| {})
        .expect("conversion");
    let seconds = t.elapsed().as_secs_f64();
    let peak = status_bytes("VmHWM:").unwrap_or(0);
    println!("seconds={seconds}\npeak={peak}\nrss_start={rss_start}");
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let layers: usize = std::env::var("CONVERT_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let layout_spec =
        std::env::var("CONVERT_BENCH_LAYOUT").unwrap_or_else(|_| "world=8,tp=2,ep=8".into());
    ParallelLayout::parse_spec(&layout_spec).expect("layout");
    let base = std::env::temp_dir().join(format!("moe-convert-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("temp dir");
    let hf = base.join("hf");

    let t = Instant::now();
    let (total, largest) = write_model(&hf, layers);
    let files = safetensors_files(&hf);
    let file_bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    println!(
        "synthetic HF checkpoint: {layers} layers, {EXPERTS} experts, BF16, {} files, \
         {:.1} MB of tensors ({:.1} MB on disk), largest tensor {:.1} MB (written in {:.1} s)",
        files.len(),
        mb(total),
        mb(file_bytes),
        mb(largest),
        t.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let copied = plain_copy(&files, &base.join("copy"));
    let copy_s = t.elapsed().as_secs_f64();
    println!(
        "plain copy:  {:.1} MB in {copy_s:.2} s = {:.0} MB/s",
        mb(copied),
        mb(copied) / copy_s
    );
    std::fs::remove_dir_all(base.join("copy")).expect("remove copy");

    // The conversion runs in a fresh child process (this binary, re-executed) so that its
    // peak RSS is not hidden by memory the generator above left in the allocator.
    let out = base.join("dist");
    let child = std::process::Command::new(std::env::current_exe().expect("current exe"))
        .env(
            CHILD_ENV,
            format!("{}\n{}\n{layout_spec}", hf.display(), out.display()),
        )
        .output()
        .expect("run the conversion child");
    let report = String::from_utf8_lossy(&child.stdout).into_owned();
    assert!(
        child.status.success(),
        "conversion child failed: {report}{}",
        String::from_utf8_lossy(&child.stderr)
    );
    let field = |key: &str| -> f64 {
        report
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    let (convert_s, peak, rss_start) = (field("seconds="), field("peak="), field("rss_start="));
    let ckpt = DistCheckpoint::open::<ModelConfig>(&out).expect("open result");
    let chunks: usize = ckpt.index().tensors.values().map(|e| e.chunks.len()).sum();
    println!(
        "convert:     {} canonical tensors, {chunks} chunks under `{layout_spec}` in \
         {convert_s:.2} s = {:.0} MB/s ({})",
        ckpt.index().tensors.len(),
        mb(total) / convert_s,
        ckpt.dir().display()
    );
    println!(
        "throughput ratio convert/copy = {:.2} (target >= 0.5)",
        copy_s / convert_s
    );
    println!(
        "peak RSS of the conversion process: {:.1} MB (VmHWM; {:.1} MB at start); \
         largest tensor {:.1} MB, 3 x largest = {:.1} MB; peak - start = {:.2} x largest",
        mb(peak as u64),
        mb(rss_start as u64),
        mb(largest),
        mb(3 * largest),
        (peak - rss_start) / largest as f64
    );
    let _ = std::fs::remove_dir_all(&base);
}
