//! One training step of a small Qwen3-MoE (forward + backward + ZeRO-1 AdamW step) on the Flex
//! CPU backend, in tokens/s, against PyTorch + transformers 5.23 training the same model in the
//! same run (`benches/torch_train_step.py`, when `benches/.venv` holds PyTorch), plus a dense
//! GEMM baseline of the same run.
//!
//! Model: 4 layers, hidden 1024, every layer a sparse MoE block of 32 experts, top-4
//! (`norm_topk_prob`), expert width 512; GQA attention 8 query / 4 KV heads of 128 with QK
//! norm; vocabulary 8192, untied LM head; f32. Batch: 4 rows of 512 tokens (2048 tokens per
//! step), the same token ids on both sides (a 64-bit LCG). Training: [`TrainerConfig`]'s
//! defaults (AdamW lr 1e-3, no weight decay, grad clip 1.0, ZeRO-1 over a one-rank world,
//! load-balancing loss 1e-3); PyTorch: `torch.optim.AdamW` with the same settings, the
//! same clip, HF's load-balancing loss with the same coefficient, `torch.set_num_threads` =
//! rayon threads. One warm-up step, then the median of `MOE_BENCH_ITERS` (3) timed steps.
//!
//! Run: `cargo bench --bench train_step`.
//! Env: `MOE_BENCH_ITERS` (default 3); `MOE_BENCH_TORCH_PYTHON` (python with torch; default
//! `benches/.venv/bin/python` if present, `none` to skip); `MOE_BENCH_TORCH_EXPERTS`
//! (transformers' experts path: `grouped_mm` (default, the faster on this machine), `eager`,
//! or `auto` to time both and keep the faster); `MOE_BENCH_TORCH_ADAMW` (`fused` (default),
//! `foreach`, `default`); `MOE_BENCH_BREAKDOWN=1` also times forward, backward and the
//! optimizer step separately on both sides; `MOE_BENCH_RECOMPUTE=1` trains on a device with
//! Burn's gradient checkpointing (memory-bound operations recomputed in the backward; the peak
//! RSS is printed either way); `MOE_BENCH_CACHE_OFF=1` turns the block cache
//! off for the Rust side.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Tensor};
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::Qwen3MoeConfig;
use moe_models::distributed::CausalLmShard;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

/// Freed step buffers are parked for reuse (see `moe_backend::alloc`), as the training
/// examples do, with a budget that holds one step's large blocks: the ZeRO-1 optimizer step
/// alone allocates several buffers of the 0.92 GB of parameters (flat gradients, the shard
/// round trips through the collectives, the gathered parameters). With the examples' 4 GiB
/// the step took twice as long (page faults; BENCHMARKS.md); peak RSS (~13 GB) is the same.
/// `MOE_BENCH_CACHE_OFF=1` measures with the system allocator's behaviour instead.
#[global_allocator]
static ALLOC: moe_backend::alloc::LargeBlockCache =
    moe_backend::alloc::LargeBlockCache::new(16 << 20, 10 << 30);

const LAYERS: usize = 4;
const HIDDEN: usize = 1024;
const EXPERTS: usize = 32;
const TOP_K: usize = 4;
const WIDTH: usize = 512;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 128;
const VOCAB: usize = 8192;
const SEQ: usize = 512;
const BATCH: usize = 4;
const IDS_SEED: u64 = 7;

fn config() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        intermediate_size: 3 * HIDDEN,
        moe_intermediate_size: WIDTH,
        num_hidden_layers: LAYERS,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        num_experts: EXPERTS,
        num_experts_per_tok: TOP_K,
        norm_topk_prob: true,
        ..Qwen3MoeConfig::default()
    }
}

/// Token ids shared with `torch_train_step.py`: a 64-bit LCG, `(state >> 33) % vocab`.
fn lcg_ids(n: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect()
}

/// Model FLOPs of one training step (3x the forward): every matmul of the forward (attention
/// projections, router, the k routed experts' three GEMMs, LM head) at `2·m·k·n`, plus the
/// attention scores and weighted sum over the full `S x S` square (no causal halving).
fn step_flops() -> f64 {
    let attn_proj = HIDDEN * (HEADS * HEAD_DIM * 2 + KV_HEADS * HEAD_DIM * 2);
    let per_layer = attn_proj + HIDDEN * EXPERTS + TOP_K * 3 * HIDDEN * WIDTH;
    let matmul_params = LAYERS * per_layer + HIDDEN * VOCAB;
    let tokens = (BATCH * SEQ) as f64;
    let fwd = 2.0 * matmul_params as f64 * tokens
        + (LAYERS * 2 * 2 * SEQ * HEAD_DIM * HEADS) as f64 * tokens;
    3.0 * fwd
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The size of rayon's global pool (which Flex runs on), found as rayon finds it:
/// `RAYON_NUM_THREADS`, else the available parallelism.
fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
}

fn torch_python() -> Option<PathBuf> {
    match std::env::var("MOE_BENCH_TORCH_PYTHON") {
        Ok(v) if v == "none" => None,
        Ok(v) => Some(PathBuf::from(v)),
        Err(_) => Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/.venv/bin/python")),
    }
}

fn has_torch(python: &PathBuf) -> bool {
    Command::new(python)
        .args(["-c", "import torch, transformers"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What the Rust side measured: median step seconds, losses of the timed steps and the
/// optional forward / backward / optimizer medians.
struct Measured {
    step_s: f64,
    losses: Vec<f32>,
    aux: f32,
    breakdown: Option<[f64; 3]>,
}

fn train(iters: usize, breakdown: bool) -> Measured {
    let device = if std::env::var("MOE_BENCH_RECOMPUTE").is_ok_and(|v| v == "1") {
        println!("recompute: Burn's gradient checkpointing of memory-bound operations");
        Device::flex().autodiff().gradient_checkpointing()
    } else {
        Device::flex().autodiff()
    };
    let full = config().init(&device).expect("model");
    let layout = ParallelLayout::single();
    let ids = lcg_ids(BATCH * SEQ, VOCAB, IDS_SEED);
    let batch = TrainBatch::causal(ids.clone(), BATCH).expect("batch");
    let mut results = World::run(1, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let mut trainer = Trainer::new(
            &full,
            &groups,
            ctx.world()?,
            TrainerConfig::default(),
            &device,
        )
        .expect("trainer");
        trainer.step(&batch).expect("warm-up step");
        let mut times = Vec::with_capacity(iters);
        let mut losses = Vec::with_capacity(iters);
        let mut aux = 0.0;
        for _ in 0..iters {
            let start = Instant::now();
            let stats = trainer.step(&batch).expect("step");
            times.push(start.elapsed().as_secs_f64());
            losses.push(stats.loss);
            aux = stats.aux_loss;
        }
        // The same step as `Trainer::step` (one micro-batch, one replica: the objective is the
        // loss itself, router losses already attached), cut into its three phases.
        let breakdown = breakdown.then(|| {
            let lr = trainer.lr();
            let (shard, optimizer) = trainer.parts_mut();
            let mut parts = [vec![], vec![], vec![]];
            for _ in 0..iters {
                let t0 = Instant::now();
                let out = shard
                    .forward_train(&ids, &ids, BATCH, &device, 1.0, false)
                    .expect("forward");
                let _ = out.loss.clone().into_data(); // Flex is eager; read to be sure.
                let t1 = Instant::now();
                let grads = GradientsParams::from_grads(out.loss.backward(), shard.model());
                let t2 = Instant::now();
                optimizer
                    .step_in_place(lr, shard.model_mut(), grads)
                    .expect("optimizer step");
                let t3 = Instant::now();
                for (p, (a, b)) in parts.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
                    p.push((b - a).as_secs_f64());
                }
            }
            parts.map(median)
        });
        Ok(Measured {
            step_s: median(times),
            losses,
            aux,
            breakdown,
        })
    });
    results.swap_remove(0).expect("rank 0")
}

fn run_torch(python: &PathBuf, threads: usize, iters: usize, breakdown: bool) -> Option<String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/torch_train_step.py");
    let experts = std::env::var("MOE_BENCH_TORCH_EXPERTS").unwrap_or_else(|_| "grouped_mm".into());
    let adamw = std::env::var("MOE_BENCH_TORCH_ADAMW").unwrap_or_else(|_| "fused".into());
    let n = |v: usize| v.to_string();
    let out = Command::new(python)
        .arg(script)
        .args(["--threads", &n(threads), "--iters", &n(iters)])
        .args(["--layers", &n(LAYERS), "--hidden", &n(HIDDEN)])
        .args([
            "--experts",
            &n(EXPERTS),
            "--top-k",
            &n(TOP_K),
            "--width",
            &n(WIDTH),
        ])
        .args(["--heads", &n(HEADS), "--kv-heads", &n(KV_HEADS)])
        .args(["--head-dim", &n(HEAD_DIM), "--vocab", &n(VOCAB)])
        .args([
            "--seq",
            &n(SEQ),
            "--batch",
            &n(BATCH),
            "--ids-seed",
            &IDS_SEED.to_string(),
        ])
        .args(["--experts-impl", &experts, "--adamw", &adamw, "--json"])
        .env("MOE_BENCH_BREAKDOWN", if breakdown { "1" } else { "0" })
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// GFLOP/s of one Flex matmul `[m,k]x[k,n]` (median after a warm-up), printed.
fn dense_gemm((m, k, n): (usize, usize, usize), iters: usize) -> f64 {
    let dev = Device::flex();
    let a = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 1.0), &dev);
    let b = Tensor::<2>::random([k, n], Distribution::Normal(0.0, 0.02), &dev);
    let gemm = || {
        let _ = a.clone().matmul(b.clone()).slice([0..1, 0..1]).into_data();
    };
    gemm();
    let times = (0..iters.max(3))
        .map(|_| {
            let t = Instant::now();
            gemm();
            t.elapsed().as_secs_f64()
        })
        .collect();
    let s = median(times);
    let gflops = 2.0 * (m * k * n) as f64 / s / 1e9;
    println!("dense_gemm [{m},{k}]x[{k},{n}]: {s:.4} s, {gflops:.1} GFLOP/s");
    gflops
}

fn main() {
    let iters: usize = std::env::var("MOE_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let breakdown = std::env::var("MOE_BENCH_BREAKDOWN").is_ok_and(|v| v == "1");
    let threads = rayon_threads();
    let tokens = BATCH * SEQ;
    println!("threads: {threads}");
    println!(
        "x86 avx512f: {}",
        cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx512f")
    );

    // Dense baseline: one Flex matmul at the experts' fc shape with every routed row; also the
    // `moe_ops` bench's shape, to compare with its sections.
    let dense_gflops = dense_gemm((tokens * TOP_K, HIDDEN, WIDTH), iters);
    dense_gemm((16384, 2048, 768), iters);

    let flops = step_flops();
    println!(
        "model: Qwen3-MoE layers={LAYERS} H={HIDDEN} E={EXPERTS} k={TOP_K} F={WIDTH} \
         heads={HEADS}/{KV_HEADS}x{HEAD_DIM} V={VOCAB}, batch {BATCH}x{SEQ} = {tokens} tokens, \
         f32; {:.1} GFLOP per step",
        flops / 1e9
    );
    // PyTorch first: the Rust side's parked blocks would otherwise stay resident under it.
    let torch = torch_reference(threads, iters, breakdown);
    if std::env::var("MOE_BENCH_CACHE_OFF").is_ok_and(|v| v == "1") {
        ALLOC.set_enabled(false);
        println!("block cache: off");
    }
    let ours = train(iters, breakdown);
    let tps = tokens as f64 / ours.step_s;
    let gflops = flops / ours.step_s / 1e9;
    println!(
        "ours train step: {:.3} s, {tps:.1} tokens/s, {gflops:.1} GFLOP/s, {:.3} of dense; \
         losses {:?}, aux {:.4}",
        ours.step_s,
        gflops / dense_gflops,
        ours.losses,
        ours.aux
    );
    if let Some([f, b, o]) = ours.breakdown {
        println!("ours breakdown: forward {f:.3} s, backward {b:.3} s, optimizer {o:.3} s");
    }
    if let Some(peak) = peak_rss_gib() {
        println!("peak RSS of this process: {peak:.2} GiB");
    }
    if let Some((torch_tps, experts)) = torch {
        let torch_s = tokens as f64 / torch_tps;
        println!(
            "torch train step ({experts}): {torch_s:.3} s, {torch_tps:.1} tokens/s, \
             {:.1} GFLOP/s",
            flops / torch_s / 1e9
        );
        println!("ratio_vs_torch (tokens/s): {:.2}", tps / torch_tps);
    }
}

/// The process's peak resident set (`VmHWM` of /proc/self/status), in GiB (Linux only).
fn peak_rss_gib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / (1024.0 * 1024.0))
}

/// Runs `torch_train_step.py` when a python with torch is found, echoes its report and returns
/// its tokens/s and experts path.
fn torch_reference(threads: usize, iters: usize, breakdown: bool) -> Option<(f64, String)> {
    let py = torch_python()?;
    if !has_torch(&py) {
        println!(
            "PyTorch reference skipped: {} cannot import torch + transformers. Install with\n  \
             python3 -m venv benches/.venv && benches/.venv/bin/pip install torch==2.15.0 \
             transformers==5.23.0 safetensors accelerate",
            py.display()
        );
        return None;
    }
    let Some(text) = run_torch(&py, threads, iters, breakdown) else {
        println!("torch reference failed to run with {}", py.display());
        return None;
    };
    for line in text.lines().filter(|l| !l.starts_with('{')) {
        println!("  {line}");
    }
    let json: Option<serde_json::Value> = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok());
    let Some(json) = json else {
        println!("torch reference printed no JSON line");
        return None;
    };
    let tps = json["torch_train_tokens_per_s"].as_f64()?;
    let experts = json["torch_experts_implementation"].as_str()?.to_owned();
    Some((tps, experts))
}
