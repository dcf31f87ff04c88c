//! Qwen3-MoE training steps ([`Trainer`]: forward + backward + ZeRO-1 AdamW step, one rank) on
//! Burn's Cube backend (`--device cuda` in a `cuda` build; the default Vulkan device, or OpenGL
//! with `--device gl`, in a `vulkan` build), in tokens/s and
//! MFU, with the device's dense matmul measured in the same run as the baseline.
//!
//! Model (random weights; f32 parameters and activations unless `--bf16`), default sized for one H200 within
//! Vulkan's buffer limit (below): hidden 2048, 2 layers, every layer a sparse MoE block of 64
//! experts, top-8 (`norm_topk_prob`), expert width 640; GQA attention 16 query / 4 KV heads
//! of 128 with QK norm; vocabulary 32768, untied LM head: 0.659 B parameters, 0.218 B active
//! per token, of which 0.151 B matmul weights (the counts are printed). Batch: `--micro`
//! micro-batches (default 8) of `--batch` sequences (default 1) of `--seq` tokens (default
//! 4096), i.e. 32768 tokens and ≈ 33 model TFLOP per step. Selective recompute of the
//! attention core (Megatron's `core_attn`, the default of `--recompute selective`): the
//! `[B, heads, S, S]` scores of this model's attention are not kept for the backward pass.
//! Why so small: `DistributedAdamW` keeps the expert gradients (and parameters, moments) as
//! one flat f32 tensor per class (`ParamTable::flatten_grads_on`), one device buffer, and
//! CubeCL's wgpu runtime caps a buffer at the storage-binding size, which wgpu-hal clamps to
//! `i32::MAX` (2 GiB) unless the device has 64-bit shader indexing: these experts take
//! 1.875 GiB (2 layers x 64 x 3 x 2048 x 640 x 4 bytes). The bench prints a warning above
//! that size. A model that fills the H200 (e.g. `--layers 12 --width 768`: 3.9 B parameters,
//! ≈ 80-95 GB of weights, gradients and AdamW state) needs those flat buffers split into
//! buckets first (a library change).
//! `--quick`: a small model (seconds on Mesa's llvmpipe).
//!
//! Model FLOPs (Megatron / PaLM convention; recomputation is not counted, the causal mask
//! halves the attention term): per token `6 · N_active + 6 · L · nh · hd · S`, where
//! `N_active` counts the matmul weights a token passes through (attention q/k/v/o, the router,
//! the `k` routed experts' three matrices or a dense layer's MLP, the LM head; not the
//! embedding lookup nor the norms) and `6 · L · nh · hd · S` is PaLM's `12 · L · H · Q · T`
//! halved for causal attention. MFU = model FLOPs per step / step time / peak:
//! `--peak-tflops` (default 989, the H200's dense BF16 tensor-core peak) and also against
//! `--peak-f32-tflops` (default 67, the H200's FP32 non-tensor-core peak, the ceiling of an f32
//! run); both are printed and written.
//!
//! Precision: f32 by default (what Mesa's drivers can run); `--bf16` trains with Megatron's
//! BF16 mixed precision (`TrainerConfig::precision`: BF16 parameters, activations and
//! gradients, f32 main weights, moments and gradient accumulation; the grouped GEMMs then run
//! the tensor-core kernel where the device has it, `MOE_CUBE_GEMM` overrides) and measures the
//! dense baselines in BF16.
//!
//! Run: `cargo bench -p moe-models --features vulkan --bench cube_train_step -- [--quick]
//! [--device vulkan|gl|cuda] [--steps N] [--warmup N] [--json PATH] [--layers N] [--hidden N]
//! [--experts N] [--top-k N] [--width N] [--heads N] [--kv-heads N] [--head-dim N]
//! [--vocab N] [--seq N] [--batch N] [--micro N] [--recompute none|selective|full]
//! [--peak-tflops X] [--peak-f32-tflops X] [--bf16]`. On lavapipe Burn's dense matmul crashes the
//! driver (see `tests/cube_training.rs`): use `--device gl` (llvmpipe) on a CPU.
//! Timing: `--warmup` steps (default 1), then `--steps` timed steps (default 3), each step's
//! wall time (the step reads its loss and gradient norm back, which waits for the device);
//! the median is reported. The JSON file is rewritten after every timed step, so a run cut
//! short by a timeout still leaves the steps done so far.

use std::sync::Mutex;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use moe_backend::comm::World;
use moe_backend::optim::Precision;
use moe_backend::parallel::ParallelLayout;
use moe_models::Qwen3MoeConfig;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use serde_json::{Value, json};

/// Command-line options.
#[derive(Debug, Clone)]
struct Options {
    quick: bool,
    /// `--device`: `cuda` (feature `cuda`), `vulkan` or `gl` (feature `vulkan`).
    device: String,
    steps: usize,
    warmup: usize,
    json: Option<String>,
    layers: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    width: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
    micro: usize,
    recompute: String,
    peak_tflops: f64,
    peak_f32_tflops: f64,
    /// `--bf16`: Megatron's BF16 mixed precision (`TrainerConfig::precision`), the dense
    /// baselines in BF16 too; default f32 (`--fp32`).
    bf16: bool,
}

impl Options {
    fn h200() -> Self {
        Self {
            quick: false,
            device: if cfg!(feature = "vulkan") {
                "vulkan".into()
            } else {
                "cuda".into()
            },
            steps: 3,
            warmup: 1,
            json: None,
            layers: 2,
            hidden: 2048,
            experts: 64,
            top_k: 8,
            width: 640,
            heads: 16,
            kv_heads: 4,
            head_dim: 128,
            vocab: 32768,
            seq: 4096,
            batch: 1,
            micro: 8,
            recompute: "selective".into(),
            peak_tflops: 989.0,
            peak_f32_tflops: 67.0,
            bf16: false,
        }
    }

    /// `--quick`: a model llvmpipe trains in seconds.
    fn quick(self) -> Self {
        Self {
            quick: true,
            layers: 2,
            hidden: 128,
            experts: 8,
            top_k: 2,
            width: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            vocab: 512,
            seq: 64,
            batch: 2,
            micro: 2,
            ..self
        }
    }
}

fn parse_args() -> Result<Options, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = Options::h200();
    // `--quick` first, so explicit sizes override it.
    if args.iter().any(|a| a == "--quick") {
        opts = opts.quick();
    }
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} expects a value"));
        let mut num = |name: &str| -> Result<usize, String> {
            value()?
                .parse()
                .ok()
                .filter(|&v: &usize| v > 0)
                .ok_or(format!("{name} expects a positive integer"))
        };
        match a.as_str() {
            "--quick" => {}
            "--device" => opts.device = value()?,
            "--steps" => opts.steps = num("--steps")?,
            "--warmup" => {
                opts.warmup = value()?
                    .parse()
                    .map_err(|_| "--warmup expects an integer")?
            }
            "--json" => opts.json = Some(value()?),
            "--layers" => opts.layers = num("--layers")?,
            "--hidden" => opts.hidden = num("--hidden")?,
            "--experts" => opts.experts = num("--experts")?,
            "--top-k" => opts.top_k = num("--top-k")?,
            "--width" => opts.width = num("--width")?,
            "--heads" => opts.heads = num("--heads")?,
            "--kv-heads" => opts.kv_heads = num("--kv-heads")?,
            "--head-dim" => opts.head_dim = num("--head-dim")?,
            "--vocab" => opts.vocab = num("--vocab")?,
            "--seq" => opts.seq = num("--seq")?,
            "--batch" => opts.batch = num("--batch")?,
            "--micro" => opts.micro = num("--micro")?,
            "--recompute" => opts.recompute = value()?,
            "--bf16" => opts.bf16 = true,
            "--fp32" => opts.bf16 = false,
            "--peak-tflops" | "--peak-f32-tflops" => {
                let v: f64 = value()?
                    .parse()
                    .ok()
                    .filter(|&v: &f64| v > 0.0)
                    .ok_or(format!("{a} expects a positive number"))?;
                if a == "--peak-tflops" {
                    opts.peak_tflops = v;
                } else {
                    opts.peak_f32_tflops = v;
                }
            }
            // `cargo bench` passes `--bench`; ignore it and other harness flags.
            _ => {}
        }
    }
    Ok(opts)
}

fn config(o: &Options) -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: o.vocab,
        hidden_size: o.hidden,
        intermediate_size: 3 * o.hidden,
        moe_intermediate_size: o.width,
        num_hidden_layers: o.layers,
        num_attention_heads: o.heads,
        num_key_value_heads: o.kv_heads,
        head_dim: o.head_dim,
        num_experts: o.experts,
        num_experts_per_tok: o.top_k,
        norm_topk_prob: true,
        max_position_embeddings: o.seq.max(4096),
        ..Qwen3MoeConfig::default()
    }
}

/// Matmul weights a token passes through (see the module docs): attention, router, `k`
/// experts (or the dense MLP), LM head.
fn matmul_active_params(c: &Qwen3MoeConfig) -> u64 {
    let (h, nh, nkv, hd) = (
        c.hidden_size as u64,
        c.num_attention_heads as u64,
        c.num_key_value_heads as u64,
        c.head_dim as u64,
    );
    let attn = 2 * h * nh * hd + 2 * h * nkv * hd;
    let mut n = c.vocab_size as u64 * h; // LM head (untied)
    for layer in 0..c.num_hidden_layers {
        n += attn
            + if c.is_moe_layer(layer) {
                c.num_experts as u64 * h
                    + c.num_experts_per_tok as u64 * 3 * h * c.moe_intermediate_size as u64
            } else {
                3 * h * c.intermediate_size as u64
            };
    }
    n
}

/// Model FLOPs per token: `6 · N_active + 6 · L · nh · hd · S`.
fn flops_per_token(c: &Qwen3MoeConfig, seq: usize) -> f64 {
    6.0 * matmul_active_params(c) as f64
        + 6.0 * (c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq) as f64
}

/// Token ids: a 64-bit LCG, `(state >> 33) % vocab`.
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The device's dense matmul `[m, k] × [k, n]` in `dtype`: TFLOP/s, median of `iters` after a
/// warm-up.
fn dense_matmul(
    device: &Device,
    (m, k, n): (usize, usize, usize),
    iters: usize,
    dtype: DType,
) -> Value {
    let a = Tensor::<2>::random([m, k], Distribution::Uniform(-1.0, 1.0), (device, dtype));
    let b = Tensor::<2>::random([k, n], Distribution::Uniform(-1.0, 1.0), (device, dtype));
    let run = || {
        let _ = a.clone().matmul(b.clone()).slice([0..1, 0..1]).into_data();
    };
    run();
    let s = median(
        (0..iters)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let tflops = 2.0 * (m * k * n) as f64 / s / 1e12;
    let name = dtype_name(dtype);
    println!(
        "dense matmul {name} [{m} x {k}] x [{k} x {n}]: {:.3} ms, {tflops:.3} TFLOP/s",
        s * 1e3
    );
    json!({ "m": m, "k": k, "n": n, "dtype": name, "ms": s * 1e3, "tflops": tflops })
}

/// `"bf16"` / `"f32"`.
fn dtype_name(dtype: DType) -> &'static str {
    if dtype == DType::BF16 { "bf16" } else { "f32" }
}

/// The device `name`, probed before Burn opens its runtime (`moe_backend::devices`): a machine
/// without the driver or a device gets a named error instead of a panic in CubeCL's thread.
fn open_device(name: &str) -> Result<Device, String> {
    match name {
        #[cfg(feature = "cuda")]
        "cuda" => {
            moe_backend::devices::probe_cuda().map_err(|e| e.to_string())?;
            Ok(Device::cuda(0))
        }
        #[cfg(feature = "vulkan")]
        "vulkan" => {
            moe_backend::devices::probe_vulkan().map_err(|e| e.to_string())?;
            Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice))
        }
        #[cfg(feature = "vulkan")]
        "gl" => Device::wgpu_options()
            .graphics_api(burn::tensor::wgpu::WgpuBackend::Gl)
            .init()
            .map_err(|e| format!("--device gl: no OpenGL wgpu device: {e}")),
        other => Err(format!(
            "--device {other}: not available in this binary (features: {}{})",
            if cfg!(feature = "cuda") { "cuda " } else { "" },
            if cfg!(feature = "vulkan") {
                "vulkan"
            } else {
                ""
            }
        )),
    }
}

fn write_json(path: Option<&str>, value: &Value) {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(value).expect("json");
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("cube_train_step: cannot write {path}: {e}");
        }
    }
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("cube_train_step: {e}");
            std::process::exit(2);
        }
    };
    let device = match open_device(&opts.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cube_train_step: error: {e}");
            std::process::exit(3);
        }
    };
    if opts.bf16 && !device.supports_dtype(DType::BF16) {
        eprintln!("cube_train_step: error: --bf16: {device:?} has no BF16 (use --fp32)");
        std::process::exit(3);
    }
    let config = config(&opts);
    let count = match moe_models::families::param_count::<moe_models::qwen3_moe::Qwen3Moe>(&config)
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cube_train_step: error: {e}");
            std::process::exit(3);
        }
    };
    let matmul_active = matmul_active_params(&config);
    let tokens_per_step = opts.micro * opts.batch * opts.seq;
    let fpt = flops_per_token(&config, opts.seq);
    let dtype = if opts.bf16 { DType::BF16 } else { DType::F32 };
    println!(
        "cube_train_step: {} model, device {device:?}, {}; {} layers, hidden {}, {} experts \
         top-{} width {}, heads {}/{}x{}, vocab {}; {:.1} M parameters, {:.1} M active \
         ({:.1} M matmul weights per token); {} micro-batch(es) of {} x {} tokens = \
         {tokens_per_step} tokens per step; recompute {}; {:.3} GFLOP per token",
        if opts.quick { "quick" } else { "H200-sized" },
        if opts.bf16 {
            "bf16 mixed precision"
        } else {
            "f32"
        },
        opts.layers,
        opts.hidden,
        opts.experts,
        opts.top_k,
        opts.width,
        opts.heads,
        opts.kv_heads,
        opts.head_dim,
        opts.vocab,
        count.total as f64 / 1e6,
        count.active as f64 / 1e6,
        matmul_active as f64 / 1e6,
        opts.micro,
        opts.batch,
        opts.seq,
        opts.recompute,
        fpt / 1e9,
    );
    let expert_bytes = (0..config.num_hidden_layers)
        .filter(|&l| config.is_moe_layer(l))
        .count() as u64
        * (config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 4) as u64;
    if expert_bytes > i32::MAX as u64 {
        println!(
            "warning: the optimizer's flat expert buffer is {:.2} GiB, over the 2 GiB a wgpu \
             buffer may hold without 64-bit shader indexing: expect an allocation failure",
            expert_bytes as f64 / (1u64 << 30) as f64
        );
    }
    let mut report = json!({
        "bench": "cube_train_step",
        "device": format!("{device:?}"),
        "quick": opts.quick,
        "dtype": dtype_name(dtype),
        "model": {
            "layers": opts.layers, "hidden": opts.hidden, "experts": opts.experts,
            "top_k": opts.top_k, "moe_width": opts.width, "heads": opts.heads,
            "kv_heads": opts.kv_heads, "head_dim": opts.head_dim, "vocab": opts.vocab,
            "params_total": count.total, "params_active": count.active,
            "matmul_params_active": matmul_active,
        },
        "batch": {
            "seq": opts.seq, "sequences_per_micro_batch": opts.batch,
            "micro_batches": opts.micro, "tokens_per_step": tokens_per_step,
        },
        "recompute": opts.recompute,
        "expert_flat_buffer_bytes": expert_bytes,
        "flops_per_token": fpt,
        "flops_formula": "6*N_active_matmul + 6*L*heads*head_dim*seq (PaLM, causal-halved)",
        "peak_tflops": opts.peak_tflops,
        "peak_f32_tflops": opts.peak_f32_tflops,
    });
    // Dense baselines on the same device, before the model takes its memory: the routed
    // experts' rows of one micro-batch through one expert-width projection, and the tokens of
    // one micro-batch through a hidden x hidden projection.
    let t_micro = opts.batch * opts.seq;
    let iters = if opts.quick { 3 } else { 5 };
    let dense = vec![
        dense_matmul(
            &device,
            (t_micro * opts.top_k, opts.hidden, opts.width),
            iters,
            dtype,
        ),
        dense_matmul(&device, (t_micro, opts.hidden, opts.hidden), iters, dtype),
    ];
    let dense_best = dense
        .iter()
        .filter_map(|d| d["tflops"].as_f64())
        .fold(0.0, f64::max);
    report["dense_matmul"] = Value::Array(dense);
    write_json(opts.json.as_deref(), &report);

    let train_config = TrainerConfig {
        recompute: opts.recompute.parse().unwrap_or_else(|e| {
            eprintln!("cube_train_step: --recompute {}: {e}", opts.recompute);
            std::process::exit(2);
        }),
        precision: if opts.bf16 {
            Precision::Bf16
        } else {
            Precision::F32
        },
        ..TrainerConfig::default()
    };
    let ad = device.clone().autodiff();
    let t0 = Instant::now();
    let full = config.init(&ad).expect("model init");
    let micro: Vec<TrainBatch> = (0..opts.micro)
        .map(|m| {
            let ids = lcg_ids(opts.batch * opts.seq, opts.vocab, 7 + m as u64);
            TrainBatch::causal(ids, opts.batch).expect("batch")
        })
        .collect();
    let layout = ParallelLayout::single();
    let report = Mutex::new(report);
    let opts = &opts;
    let mut out = World::run(1, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let mut trainer =
            Trainer::new(&full, &groups, ctx.world()?, train_config.clone(), &ad).expect("trainer");
        println!(
            "init (model + trainer): {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        for w in 0..opts.warmup {
            let t = Instant::now();
            let s = trainer.step_micro_batches(&micro).expect("warm-up step");
            println!(
                "warm-up step {w}: {:.2} s, loss {:.4}",
                t.elapsed().as_secs_f64(),
                s.loss
            );
        }
        let mut times = Vec::new();
        let mut losses = Vec::new();
        for i in 0..opts.steps {
            let t = Instant::now();
            let s = trainer.step_micro_batches(&micro).expect("step");
            let secs = t.elapsed().as_secs_f64();
            times.push(secs);
            losses.push(s.loss);
            let step_s = median(times.clone());
            let tok_s = tokens_per_step as f64 / step_s;
            let achieved = fpt * tok_s / 1e12;
            let mfu = achieved / opts.peak_tflops;
            let mfu_f32 = achieved / opts.peak_f32_tflops;
            let ratio = achieved / dense_best.max(f64::MIN_POSITIVE);
            println!(
                "step {i}: {secs:.3} s, loss {:.4}, grad norm {:.3}; median {:.3} s: \
                 {tok_s:.0} tokens/s, {achieved:.3} model TFLOP/s, MFU {:.3}% of {} \
                 (bf16 peak), {:.3}% of {} (f32 peak), {ratio:.3} of the dense matmul",
                s.loss,
                s.grad_norm,
                step_s,
                mfu * 100.0,
                opts.peak_tflops,
                mfu_f32 * 100.0,
                opts.peak_f32_tflops,
            );
            let mut report = report.lock().expect("report");
            report["step_seconds"] = json!(times);
            report["losses"] = json!(losses);
            report["median_step_seconds"] = json!(step_s);
            report["tokens_per_second"] = json!(tok_s);
            report["model_tflops"] = json!(achieved);
            report["mfu"] = json!(mfu);
            report["mfu_f32_peak"] = json!(mfu_f32);
            report["ratio_model_over_dense_matmul"] = json!(ratio);
            write_json(opts.json.as_deref(), &report);
        }
        Ok(())
    });
    out.swap_remove(0).expect("rank 0");
}
