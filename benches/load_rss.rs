//! Peak resident memory of ONE rank loading its shard of a large HF checkpoint (issue 15,
//! item 3: a rank only ever holds its own shard).
//!
//! Writes a synthetic BF16 Qwen3-MoE HF checkpoint of about 4 GB (64 experts per layer,
//! per-expert tensors, 1 GB shard files) into a temporary directory (deleted at the end), then
//! runs each measurement in a fresh child process (this binary re-executed, so the peak is not
//! hidden by the generator's allocations) and reads its `VmHWM` from `/proc/self/status`:
//!
//! - `shard`: rank 0 of the layout validates the directory and reads only its own boxes
//!   (`moe_models::hf::load_shard_checked`), as `moe train` does;
//! - `full`: the path `moe train` took before sharded loading, on rank 0: the whole model
//!   (`Qwen3MoeForCausalLM::from_weights`), then its shard (`Sharded::<Qwen3MoeForCausalLM>::shard`).
//!
//! The other ranks of the in-process world only build their process groups and return, so the
//! child's memory is rank 0's. Weights are held in f32 (the training precision), so a shard
//! takes twice its BF16 bytes; the goal is a peak of about one shard plus the largest tensor
//! (plus the process's start-up RSS), not the whole model.
//!
//! Run: `cargo bench --bench load_rss` (size via `LOAD_RSS_LAYERS`, default 19 ≈ 4.1 GB;
//! layouts via `LOAD_RSS_LAYOUTS`, default `8:ep=8;8:tp=2,ep=8`; `LOAD_RSS_FULL=0` skips the
//! full-load contrast).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use burn::tensor::Device;
use moe_backend::BackendError;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_backend::testing::XorShift64;
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::safetensors::{Dtype, HfDirWriter, OwnedTensor, ShardPlan};
use moe_models::Qwen3MoeForCausalLM;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::export::{ExpertNames, export_hf_tensors_as};
use moe_models::hf::{ModelConfig, load_shard_checked};
use serde_json::json;

const HIDDEN: usize = 1024;
const VOCAB: usize = 32768;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const EXPERTS: usize = 64;
const MOE_WIDTH: usize = 512;

/// A `/proc/self/status` field in bytes (`None` off Linux).
fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mb(bytes: f64) -> f64 {
    bytes / 1e6
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
    let plan = ShardPlan::greedy(&sizes, 1_000_000_000);
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
        "norm_topk_prob": true,
    });
    writer.write_json("config.json", &config).expect("config");
    writer.finish().expect("finish HF checkpoint");
    (
        sizes.values().sum(),
        sizes.values().copied().max().unwrap_or(0),
    )
}

/// Environment variable that makes the binary run one measurement:
/// `<hf dir>\n<shard|full>\n<world>\n<layout>`.
const CHILD_ENV: &str = "MOE_LOAD_RSS_CHILD";

/// The child: rank 0 loads its shard (`shard`) or the full model and then its shard (`full`);
/// prints `seconds=`, `peak=` (VmHWM bytes), `rss_start=` and `shard=` (the shard's bytes).
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split('\n').collect();
    let [dir, mode, world, layout] = parts[..] else {
        panic!("bad {CHILD_ENV}");
    };
    let world: usize = world.parse().expect("world");
    let layout = ParallelLayout::parse(world, layout).expect("layout");
    let ckpt = HfCheckpoint::open(dir).expect("open");
    let config = ModelConfig::from_dir(dir).expect("config");
    let config = config
        .get::<moe_models::qwen3_moe::Qwen3Moe>()
        .expect("not qwen3_moe")
        .clone();
    let rss_start = status_bytes("VmRSS:").unwrap_or(0);
    let t = Instant::now();
    let kind = DispatcherKind::AllToAll;
    let device = Device::flex();
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        if ctx.rank() != 0 {
            return Ok(0);
        }
        let be = |e: String| BackendError::Replay(e);
        let shard = match mode {
            "shard" => {
                load_shard_checked::<Qwen3MoeForCausalLM>(&ckpt, &pg, kind, &device)
                    .map_err(|e| be(e.to_string()))?
                    .0
            }
            _ => {
                let full = Qwen3MoeForCausalLM::from_weights(&config, &ckpt, &device)
                    .map_err(|e| be(e.to_string()))?;
                Sharded::<Qwen3MoeForCausalLM>::shard(&full, &pg, kind)
                    .map_err(|e| be(e.to_string()))?
            }
        };
        Ok(export_hf_tensors_as(&shard.model, ExpertNames::Fused)
            .expect("export")
            .total_bytes())
    });
    let seconds = t.elapsed().as_secs_f64();
    let shard = results
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank 0 loads");
    let peak = status_bytes("VmHWM:").unwrap_or(0);
    println!("seconds={seconds}\npeak={peak}\nrss_start={rss_start}\nshard={shard}");
}

/// Runs one measurement in a child; returns (seconds, peak, rss_start, shard bytes).
fn measure(dir: &Path, mode: &str, world: usize, layout: &str) -> [f64; 4] {
    let out = std::process::Command::new(std::env::current_exe().expect("current exe"))
        .env(
            CHILD_ENV,
            format!("{}\n{mode}\n{world}\n{layout}", dir.display()),
        )
        .output()
        .expect("run the measurement child");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{mode} child failed: {report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| -> f64 {
        report
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    [
        field("seconds="),
        field("peak="),
        field("rss_start="),
        field("shard="),
    ]
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let layers: usize = std::env::var("LOAD_RSS_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(19);
    let layouts = std::env::var("LOAD_RSS_LAYOUTS").unwrap_or_else(|_| "8:ep=8;8:tp=2,ep=8".into());
    let full = std::env::var("LOAD_RSS_FULL").map_or(true, |v| v != "0");
    let base = std::env::temp_dir().join(format!("moe-load-rss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("temp dir");
    let hf = base.join("hf");

    let t = Instant::now();
    let (total, largest) = write_model(&hf, layers);
    let (total, largest) = (total as f64, largest as f64);
    println!(
        "synthetic Qwen3-MoE HF checkpoint: {layers} layers, {EXPERTS} experts, BF16, \
         {:.1} MB of tensors (f32 in memory: {:.1} MB), largest tensor {:.1} MB BF16 \
         ({:.1} MB f32), written in {:.1} s",
        mb(total),
        mb(2.0 * total),
        mb(largest),
        mb(2.0 * largest),
        t.elapsed().as_secs_f64()
    );
    let mut runs: Vec<(String, &str)> = layouts
        .split(';')
        .map(|l| (l.to_owned(), "shard"))
        .collect();
    if full && let Some(first) = runs.first().map(|(l, _)| l.clone()) {
        runs.push((first, "full"));
    }
    for (spec, mode) in runs {
        let (world, layout) = spec.split_once(':').expect("layout as world:spec");
        let world: usize = world.parse().expect("world");
        let [seconds, peak, start, shard] = measure(&hf, mode, world, layout);
        let what = match mode {
            "shard" => "sharded load",
            _ => "full load, then shard(full) (the path `moe train` took before)",
        };
        println!(
            "rank 0 of world={world},{layout}, {what}: peak RSS {:.1} MB (VmHWM; {:.1} MB at \
             start, +{:.1} MB); shard {:.1} MB f32; shard + largest tensor (f32) {:.1} MB; \
             full model {:.1} MB f32; (peak - start) / shard = {:.2}; {seconds:.1} s",
            mb(peak),
            mb(start),
            mb(peak - start),
            mb(shard),
            mb(shard + 2.0 * largest),
            mb(2.0 * total),
            (peak - start) / shard
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}
