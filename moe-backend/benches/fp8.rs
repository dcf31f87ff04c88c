//! FP8 benchmarks (docs/fp8.md §Scaling, §Recipes, §FP8 primary weights), each against a baseline
//! measured in the same run:
//!
//! (a) blockwise / per-tensor / columnwise quantise and dequantise bandwidth over a `memcpy`
//!     of the f32 buffer (traffic = bytes read + bytes written);
//! (b) the emulated FP8 grouped GEMM (tile dequantisation into f32 `gemm` calls) over the f32
//!     grouped GEMM of the same shape;
//! (c) memory of FP8 primary weights (E4M3 bytes + f32 128×128 block scales) against BF16
//!     weights: measured by quantising a synthetic one-layer model, and by shape arithmetic
//!     for a Qwen3-30B-A3B-shaped model (linear layers in FP8; embeddings, LM head, router and
//!     norms stay BF16, docs/fp8.md §Selective precision);
//! (d) the ZeRO-1 optimizer step with f32 parameters against FP8 primary expert weights on 4
//!     in-process ranks: expert-data-parallel bytes sent per rank and step time.
//!
//! Run: `cargo bench -p moe-backend --bench fp8` (add `-- --quick` for smaller shapes).
//! Env: `MOE_BENCH_ITERS` (default 3).

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use moe_backend::fp8::{
    Fp8Format, Fp8Recipe, fp8_grouped_matmul, quantize_blockwise, quantize_columnwise,
    quantize_per_tensor,
};
use moe_backend::ops::kernels::zeroed;
use moe_backend::ops::{GroupSizes, WeightLayout, grouped_matmul};

fn median_secs(iters: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Deterministic normal-ish data (sum of 4 uniforms) with rare 100x outliers.
fn data(n: usize) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut u = move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n)
        .map(|i| {
            let v = u() + u() + u() + u();
            if i % 10_007 == 0 { v * 100.0 } else { v }
        })
        .collect()
}

fn sync(t: Tensor<2>) {
    // Flex executes eagerly; reading one element makes sure the work happened.
    let _ = t.slice([0..1, 0..1]).into_data();
}

fn codecs(rows: usize, cols: usize, iters: usize) {
    let n = rows * cols;
    let x = data(n);
    let gb = |bytes: usize, t: f64| bytes as f64 / t / 1e9;
    let copy_t = median_secs(iters, || {
        let mut out = zeroed::<f32>(n);
        out.copy_from_slice(&x);
        std::hint::black_box(&out);
    });
    let copy_gbs = gb(8 * n, copy_t);
    println!("memcpy_f32 [{rows},{cols}]: {copy_t:.4} s, {copy_gbs:.2} GB/s (baseline)");
    let report = |label: &str, t: f64, bytes: usize| {
        let r = gb(bytes, t);
        println!(
            "{label} [{rows},{cols}]: {t:.4} s, {r:.2} GB/s, ratio_vs_memcpy: {:.3}",
            r / copy_gbs
        );
    };
    let e4m3 = Fp8Format::E4M3;
    let quant_bytes = 5 * n; // read f32, write one byte per element (scales are negligible)
    for (label, block) in [
        ("quantize_blockwise_128x128", [128, 128]),
        ("quantize_rowwise_1x128", [1, 128]),
    ] {
        let t = median_secs(iters, || {
            std::hint::black_box(quantize_blockwise(&x, rows, cols, block, e4m3, true).ok());
        });
        report(label, t, quant_bytes);
    }
    let t = median_secs(iters, || {
        std::hint::black_box(quantize_per_tensor(&x, rows, cols, e4m3, false).ok());
    });
    report("quantize_per_tensor_current", t, quant_bytes);
    let t = median_secs(iters, || {
        std::hint::black_box(quantize_columnwise(&x, rows, cols, 128, e4m3, true).ok());
    });
    report("quantize_columnwise_transposed_128x1", t, quant_bytes);
    for (label, block) in [
        ("dequantize_blockwise_128x128", [128, 128]),
        ("dequantize_rowwise_1x128", [1, 128]),
    ] {
        let Ok(q) = quantize_blockwise(&x, rows, cols, block, e4m3, true) else {
            return;
        };
        let t = median_secs(iters, || {
            let mut out = zeroed::<f32>(n);
            let _ = q.dequantize_into(&mut out);
            std::hint::black_box(&out);
        });
        report(label, t, 5 * n);
    }
}

fn gemm(experts: usize, rows: usize, k: usize, m: usize, iters: usize) {
    let device = Device::flex();
    let n = experts * rows;
    let x = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<3>::random([experts, m, k], Distribution::Normal(0.0, 0.02), &device);
    let sizes = vec![rows; experts];
    let gs = GroupSizes::Host(sizes.clone());
    let f32_t = median_secs(iters, || {
        sync(grouped_matmul(x.clone(), w.clone(), &gs, WeightLayout::OutIn).expect("gmm"))
    });
    let recipe = Fp8Recipe::new();
    let fp8_t = median_secs(iters, || {
        sync(fp8_grouped_matmul(x.clone(), w.clone(), &sizes, &recipe).expect("fp8 gmm"))
    });
    let flops = 2.0 * (n * k * m) as f64;
    println!(
        "grouped_gemm_f32 {experts}x{rows} rows, K={k}, M={m}: {f32_t:.4} s, {:.1} GFLOP/s (baseline)",
        flops / f32_t / 1e9
    );
    println!(
        "grouped_gemm_fp8_emulated (quantise x and W + tile-dequant GEMM): {fp8_t:.4} s, \
         {:.1} GFLOP/s, ratio_vs_f32: {:.3}",
        flops / fp8_t / 1e9,
        f32_t / fp8_t
    );
}

/// BF16 bytes and FP8-primary bytes (1 byte per element + 4 bytes per 128×128 block) of a
/// `[rows, cols]` linear weight.
fn linear_bytes(rows: usize, cols: usize) -> (u64, u64) {
    let n = (rows * cols) as u64;
    let blocks = (rows.div_ceil(128) * cols.div_ceil(128)) as u64;
    (2 * n, n + 4 * blocks)
}

fn primary_weight_memory(quick: bool) {
    // (1) Measured: quantise every linear weight of one synthetic MoE layer.
    let (h, f, e, heads, kv, hd) = if quick {
        (512, 256, 8, 8, 2, 64)
    } else {
        (2048, 768, 32, 32, 4, 128)
    };
    let shapes: Vec<(usize, usize)> =
        [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd)]
            .into_iter()
            .chain((0..e).flat_map(|_| [(2 * f, h), (h, f)]))
            .collect();
    let (mut bf16, mut fp8) = (0u64, 0u64);
    for &(r, c) in &shapes {
        let w = data(r * c);
        let Ok(q) = quantize_blockwise(&w, r, c, [128, 128], Fp8Format::E4M3, true) else {
            return;
        };
        bf16 += 2 * (r * c) as u64;
        fp8 += q.nbytes() as u64;
        assert_eq!(linear_bytes(r, c).1, q.nbytes() as u64);
    }
    println!(
        "fp8_primary_weights_measured (1 layer: attention + {e} experts, H={h}, F={f}): \
         bf16 {:.1} MiB, fp8+scales {:.1} MiB, saved {:.1}%",
        bf16 as f64 / (1 << 20) as f64,
        fp8 as f64 / (1 << 20) as f64,
        100.0 * (1.0 - fp8 as f64 / bf16 as f64)
    );
    // (2) Shape arithmetic: Qwen3-30B-A3B (48 layers, H=2048, 128 experts of F=768,
    // 32 query / 4 KV heads of 128, vocab 151936, untied head).
    let (layers, h, f, e, heads, kv, hd, vocab) = (48, 2048, 768, 128, 32, 4, 128, 151_936);
    let mut linear = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd)].to_vec();
    for _ in 0..e {
        linear.extend([(f, h), (f, h), (h, f)]);
    }
    let (mut lin_bf16, mut lin_fp8) = (0u64, 0u64);
    for &(r, c) in &linear {
        let (b, q) = linear_bytes(r, c);
        lin_bf16 += b;
        lin_fp8 += q;
    }
    let per_layer_hp = 2 * (e * h + 2 * h + 2 * hd) as u64; // router, 2 norms, q/k norms
    let rest = 2 * (2 * vocab * h + h) as u64; // embeddings, LM head, final norm
    let bf16_total = layers * (lin_bf16 + per_layer_hp) + rest;
    let fp8_total = layers * (lin_fp8 + per_layer_hp) + rest;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "fp8_primary_weights_qwen3_30b_a3b (shape arithmetic): bf16 {:.2} GiB, fp8+scales+bf16 \
         rest {:.2} GiB, saved {:.2} GiB ({:.1}%); linear layers alone {:.2} -> {:.2} GiB",
        gib(bf16_total),
        gib(fp8_total),
        gib(bf16_total - fp8_total),
        100.0 * (1.0 - fp8_total as f64 / bf16_total as f64),
        gib(layers * lin_bf16),
        gib(layers * lin_fp8)
    );
}

/// (d) FP8 primary weights in the ZeRO-1 optimizer, measured: a synthetic MoE layer on 4
/// in-process ranks (EP1, EDP4: every rank owns a quarter of every expert's master) takes one
/// optimizer step with f32 parameters and one with FP8 primary expert weights; reported are the
/// payload bytes each rank sends on `expt_dp` during the step (the gradient reduce-scatter is
/// f32 in both; the parameter all-gather moves 4 or 1 byte per element, plus the FP8 run's
/// packed amax all-reduce) and the step time.
fn primary_weight_step(quick: bool) {
    use burn::optim::GradientsParams;
    use moe_backend::comm::World;
    use moe_backend::layer::MoeLayerConfig;
    use moe_backend::optim::{
        DistributedAdamW, DistributedAdamWConfig, Fp8ParamLayout, Fp8PrimaryConfig,
    };
    use moe_backend::parallel::{GroupFamily, ParallelLayout, replicate};
    use moe_backend::router::TopKRouterConfig;

    let (h, f, e) = if quick {
        (256, 128, 8)
    } else {
        (1024, 512, 32)
    };
    let world = 4;
    let layout = ParallelLayout::parse(world, "").expect("layout");
    let device = Device::flex().autodiff();
    let layer = MoeLayerConfig::new(TopKRouterConfig::new(h, e, 2), f)
        .init(&device)
        .expect("layer");
    let layer = replicate(&layer);
    for fp8 in [false, true] {
        let (layout_ref, layer_ref) = (&layout, &layer);
        let out = World::run(world, move |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let layer = replicate(layer_ref);
            let mut optim = DistributedAdamW::new(
                &layer,
                &pg,
                ctx.world()?,
                DistributedAdamWConfig::default(),
            )?;
            let layer = if fp8 {
                let config = Fp8PrimaryConfig::from_recipe(&Fp8Recipe::new());
                optim.enable_fp8_primary_weights(layer, config, &Fp8ParamLayout::experts)?
            } else {
                layer
            };
            let comm = pg.comm(GroupFamily::ExptDp).clone();
            let before = comm.traffic().bytes_sent;
            let start = Instant::now();
            // Zero gradients: the step's communication and casts do not depend on values.
            let _ = optim.step(1e-3, layer, GradientsParams::new())?;
            let secs = start.elapsed().as_secs_f64();
            Ok((comm.traffic().bytes_sent - before, secs))
        });
        let (bytes, secs) = out
            .into_iter()
            .next()
            .and_then(|r| r.ok())
            .unwrap_or((0, 0.0));
        let elems = (e * (2 * f * h + h * f)) as f64;
        println!(
            "zero1_step_expert_traffic (4 ranks, EDP4, {e} experts H={h} F={f}, fp8_primary={fp8}): \
             {:.2} MB sent per rank, {:.2} bytes per expert parameter, step {secs:.3} s",
            bytes as f64 / 1e6,
            bytes as f64 / elems
        );
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters = std::env::var("MOE_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!("rayon threads: {}", rayon::current_num_threads());
    if quick {
        codecs(1024, 1024, iters);
        gemm(4, 128, 512, 512, iters);
    } else {
        codecs(8192, 4096, iters);
        gemm(16, 512, 2048, 768, iters);
    }
    primary_weight_memory(quick);
    primary_weight_step(quick);
}
