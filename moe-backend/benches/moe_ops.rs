//! MoE op benchmarks on the Flex CPU backend, each against a baseline measured in the same run:
//!
//! (a) grouped GEMM throughput over one dense GEMM of the same FLOPs (balanced and skewed);
//! (b) permute + unpermute bandwidth over a `memcpy` of the same bytes;
//! (c) MoE layer forward+backward tokens/s at a Qwen3-30B-A3B layer shape, its effective
//!     GFLOP/s over the dense GEMM rate, and (when `benches/.venv` holds PyTorch) the ratio over
//!     transformers' `Qwen3MoeSparseMoeBlock` with `grouped_mm` run by `benches/torch_moe_block.py`.
//!
//! Run: `cargo bench -p moe-backend --bench moe_ops` (add `-- --quick` for smaller shapes,
//! `-- --only=gemm|permute|parts|layer` for one part; the dense baseline always runs).
//! Env: `MOE_BENCH_ITERS` (default 3), `MOE_BENCH_TORCH_PYTHON` (python with torch; default
//! `benches/.venv/bin/python` if present, `none` to skip).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use moe_backend::layer::MoeLayerConfig;
use moe_backend::ops::{GroupSizes, PermuteMode, WeightLayout, grouped_matmul, permute, unpermute};
use moe_backend::router::{RouteOptions, TopKRouterConfig};

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

fn sync(t: Tensor<2>) {
    // Flex executes eagerly; reading one element makes sure the work happened.
    let _ = t.slice([0..1, 0..1]).into_data();
}

fn grouped_vs_dense(
    label: &str,
    sizes: &[usize],
    (k, m): (usize, usize),
    layout: WeightLayout,
    iters: usize,
    dense_s: f64,
) {
    let device = Device::flex();
    let n: usize = sizes.iter().sum();
    let x = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.0), &device);
    let shape = match layout {
        WeightLayout::OutIn => [sizes.len(), m, k],
        WeightLayout::InOut => [sizes.len(), k, m],
    };
    let w = Tensor::<3>::random(shape, Distribution::Normal(0.0, 0.02), &device);
    let gs = GroupSizes::Host(sizes.to_vec());
    let t = median_secs(iters, || {
        sync(grouped_matmul(x.clone(), w.clone(), &gs, layout).expect("gmm"))
    });
    let label = format!("{label}_{layout:?}");
    let gflops = 2.0 * (n * k * m) as f64 / t / 1e9;
    println!(
        "grouped_gemm_{label}: {t:.4} s, {gflops:.1} GFLOP/s, ratio_vs_dense: {:.3}",
        dense_s / t
    );
}

fn skewed_sizes(experts: usize, rows: usize) -> Vec<usize> {
    // Zipf(1) over experts, remainder to expert 0.
    let weights: Vec<f64> = (0..experts).map(|e| 1.0 / (e + 1) as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut sizes: Vec<usize> = weights
        .iter()
        .map(|w| (w / total * rows as f64) as usize)
        .collect();
    let assigned: usize = sizes.iter().sum();
    sizes[0] += rows - assigned;
    sizes
}

fn torch_python() -> Option<PathBuf> {
    match std::env::var("MOE_BENCH_TORCH_PYTHON") {
        Ok(v) if v == "none" => None,
        Ok(v) => Some(PathBuf::from(v)),
        Err(_) => {
            let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../benches/.venv/bin/python");
            p.exists().then_some(p)
        }
    }
}

fn torch_tokens_per_s(
    python: &PathBuf,
    threads: usize,
    tokens: usize,
    iters: usize,
) -> Option<f64> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../benches/torch_moe_block.py");
    let out = Command::new(python)
        .arg(script)
        .args([
            "--threads",
            &threads.to_string(),
            "--tokens",
            &tokens.to_string(),
        ])
        .args(["--iters", &iters.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines() {
        if line.starts_with("torch_") {
            println!("  {line}");
        }
    }
    text.lines()
        .find_map(|l| l.strip_prefix("torch_moe_fwd_bwd_tokens_per_s: "))
        .and_then(|v| v.trim().parse().ok())
}

/// Freed multi-gigabyte step buffers are parked for reuse (see `moe_backend::alloc`); the
/// layer bench measures with the cache off and on.
#[global_allocator]
static ALLOC: moe_backend::alloc::LargeBlockCache =
    moe_backend::alloc::LargeBlockCache::new(16 << 20, 6 << 30);

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = std::env::var("MOE_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let threads = rayon::current_num_threads();
    let (experts, k_dim, m_dim, rows) = if quick {
        (32, 512, 256, 4096)
    } else {
        (128, 2048, 768, 16384)
    };
    println!("threads: {threads}");
    println!(
        "x86 avx512f: {}",
        cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx512f")
    );

    // (a) Dense baseline: one Flex matmul of [rows, K] x [K, M], same engine (gemm) as ours.
    let device = Device::flex();
    let a = Tensor::<2>::random([rows, k_dim], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<2>::random([k_dim, m_dim], Distribution::Normal(0.0, 0.02), &device);
    let dense_s = median_secs(iters, || sync(a.clone().matmul(b.clone())));
    let dense_gflops = 2.0 * (rows * k_dim * m_dim) as f64 / dense_s / 1e9;
    println!(
        "dense_gemm [{rows},{k_dim}]x[{k_dim},{m_dim}]: {dense_s:.4} s, {dense_gflops:.1} GFLOP/s"
    );
    drop((a, b));
    let only = std::env::args().find_map(|a| a.strip_prefix("--only=").map(str::to_owned));
    let run = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let balanced = vec![rows / experts; experts];
    let mut hot = vec![0; experts];
    hot.iter_mut().take(8).for_each(|s| *s = rows / 8);
    for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
        if !run("gemm") {
            break;
        }
        let km = (k_dim, m_dim);
        grouped_vs_dense("balanced", &balanced, km, layout, iters, dense_s);
        let skewed = skewed_sizes(experts, rows);
        grouped_vs_dense("skewed_zipf", &skewed, km, layout, iters, dense_s);
        grouped_vs_dense("hot8_rest_empty", &hot, km, layout, iters, dense_s);
    }

    // (b) permute + unpermute vs memcpy of the same bytes.
    if run("permute") {
        permute_vs_memcpy(quick, iters);
    }
    if run("parts") {
        layer_gemms(quick, iters, dense_gflops);
    }
    if run("layer") {
        moe_layer(quick, iters, threads, dense_gflops);
    }
}

/// The six grouped GEMMs of the MoE layer's forward and backward at its shape (balanced
/// routing), each over the dense GEMM rate: where the layer's time goes.
fn layer_gemms(quick: bool, iters: usize, dense_gflops: f64) {
    let (tokens, hidden, n_exp, k, width) = if quick {
        (512, 512, 32, 8, 256)
    } else {
        (2048, 2048, 128, 8, 768)
    };
    let device = Device::flex();
    let n = tokens * k;
    let sizes = GroupSizes::Host(vec![n / n_exp; n_exp]);
    let rand2 = |r, c| Tensor::<2>::random([r, c], Distribution::Normal(0.0, 1.0), &device);
    let rand3 = |a, b| Tensor::<3>::random([n_exp, a, b], Distribution::Normal(0.0, 0.02), &device);
    let x = rand2(n, hidden);
    let h = rand2(n, width);
    let dy2 = rand2(n, hidden);
    let dy1 = rand2(n, 2 * width);
    let w1 = rand3(2 * width, hidden);
    let w2 = rand3(hidden, width);
    let report = |name: &str, flops: f64, t: f64| {
        let g = flops / t / 1e9;
        println!(
            "layer_gemm {name}: {t:.4} s, {g:.1} GFLOP/s, ratio_vs_dense: {:.3}",
            g / dense_gflops
        );
    };
    let f1 = 2.0 * (n * hidden * 2 * width) as f64;
    let f2 = 2.0 * (n * width * hidden) as f64;
    let gmm = |a: &Tensor<2>, w: &Tensor<3>, l| {
        sync(grouped_matmul(a.clone(), w.clone(), &sizes, l).expect("gmm"))
    };
    let t = median_secs(iters, || gmm(&x, &w1, WeightLayout::OutIn));
    report("fc1 fprop [N,H]x[2F,H]^T", f1, t);
    let t = median_secs(iters, || gmm(&h, &w2, WeightLayout::OutIn));
    report("fc2 fprop [N,F]x[H,F]^T", f2, t);
    let t = median_secs(iters, || gmm(&dy2, &w2, WeightLayout::InOut));
    report("fc2 dgrad [N,H]x[H,F]", f2, t);
    let t = median_secs(iters, || gmm(&dy1, &w1, WeightLayout::InOut));
    report("fc1 dgrad [N,2F]x[2F,H]", f1, t);
    let wg = |a: &Tensor<2>, b: &Tensor<2>| {
        let out =
            moe_backend::ops::grouped_matmul_wgrad(a.clone(), b.clone(), &sizes).expect("wgrad");
        let _ = out.slice([0..1, 0..1, 0..1]).into_data();
    };
    let t = median_secs(iters, || wg(&dy2, &h));
    report("fc2 wgrad [H,n]x[n,F]", f2, t);
    let t = median_secs(iters, || wg(&dy1, &x));
    report("fc1 wgrad [2F,n]x[n,H]", f1, t);
}

fn permute_vs_memcpy(quick: bool, iters: usize) {
    let device = Device::flex();
    let (t, h, e, topk) = if quick {
        (512, 512, 32, 8)
    } else {
        (2048, 2048, 128, 8)
    };
    let x = Tensor::<2>::random([t, h], Distribution::Normal(0.0, 1.0), &device);
    let scores = Tensor::<2>::random([t, e], Distribution::Uniform(0.0, 1.0), &device);
    let idx = moe_backend::ops::topk_indices(scores, topk).expect("topk");
    let map = moe_backend::ops::routing_map_from_indices(idx, e);
    let n = t * topk;
    let perm_s = median_secs(iters, || {
        let p = permute(x.clone(), map.clone(), None, PermuteMode::Dropless).expect("permute");
        sync(p.rows);
    });
    let perm = permute(x.clone(), map.clone(), None, PermuteMode::Dropless).expect("permute");
    let unperm_s = median_secs(iters, || {
        sync(unpermute(perm.rows.clone(), &perm.row_id_map, None).expect("unpermute"))
    });
    let src = vec![1.0f32; n * h];
    let memcpy_s = median_secs(iters, || {
        // Same allocation path as the kernels' outputs (huge-page advice included).
        let mut dst = moe_backend::ops::kernels::zeroed::<f32>(n * h);
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
    });
    // Traffic: permute reads + writes N·H; unpermute reads N·H, writes T·H; memcpy of N·H
    // moves 2·N·H. Bandwidths in GB/s of read + written bytes.
    let bytes = ((3 * n + t) * h * 4) as f64;
    let ours_bw = bytes / (perm_s + unperm_s) / 1e9;
    let memcpy_bw = (2 * n * h * 4) as f64 / memcpy_s / 1e9;
    println!(
        "permute [{t}x{h}, k={topk}, E={e}]: {perm_s:.4} s; unpermute: {unperm_s:.4} s; {ours_bw:.2} GB/s; memcpy {memcpy_bw:.2} GB/s; ratio: {:.3}",
        ours_bw / memcpy_bw
    );
}

/// (c) MoE layer forward + backward at the Qwen3-30B-A3B layer shape.
fn moe_layer(quick: bool, iters: usize, threads: usize, dense_gflops: f64) {
    let (tokens, hidden, n_exp, k, width) = if quick {
        (512, 512, 32, 8, 256)
    } else {
        (2048, 2048, 128, 8, 768)
    };
    let ad = Device::flex().autodiff();
    let layer = MoeLayerConfig::new(TopKRouterConfig::new(hidden, n_exp, k), width)
        .init(&ad)
        .expect("layer");
    let state = layer.router.init_state();
    let x = Tensor::<2>::random([tokens, hidden], Distribution::Normal(0.0, 1.0), &ad);
    let gy = Tensor::<2>::random([tokens, hidden], Distribution::Normal(0.0, 1.0), &ad);
    let opts = RouteOptions::default();
    let step = || {
        let x = x.clone().require_grad();
        let out = layer.forward(x.clone(), &state, &opts).expect("forward");
        let grads = (out.output * gy.clone()).sum().backward();
        std::hint::black_box(x.grad(&grads));
    };
    let flops = 3.0 * 2.0 * (tokens * k * hidden * width) as f64 * 3.0;
    // Without the block cache every step faults its buffers in again (the system allocator's
    // default).
    ALLOC.set_enabled(false);
    let cold_s = median_secs(iters, step);
    ALLOC.set_enabled(true);
    let fb_s = median_secs(iters, step);
    println!(
        "moe_layer fwd+bwd without the block cache: {cold_s:.3} s, {:.1} tokens/s, {:.1} GFLOP/s effective, ratio_vs_dense: {:.3}",
        tokens as f64 / cold_s,
        flops / cold_s / 1e9,
        flops / cold_s / 1e9 / dense_gflops
    );
    let fwd_s = median_secs(iters, || {
        let out = layer.forward(x.clone(), &state, &opts).expect("forward");
        sync(out.output);
    });
    let tps = tokens as f64 / fb_s;
    let eff = flops / fb_s / 1e9;
    println!(
        "moe_layer [T={tokens} H={hidden} E={n_exp} k={k} F={width}] fwd+bwd: {fb_s:.3} s, {tps:.1} tokens/s, {eff:.1} GFLOP/s effective, ratio_vs_dense: {:.3}",
        eff / dense_gflops
    );
    println!(
        "moe_layer fwd: {fwd_s:.3} s, {:.1} tokens/s",
        tokens as f64 / fwd_s
    );
    if !quick && let Some(py) = torch_python() {
        match torch_tokens_per_s(&py, threads, tokens, iters) {
            Some(torch) => println!("ratio_vs_torch_grouped_mm (tokens/s): {:.2}", tps / torch),
            None => println!("torch reference failed to run with {}", py.display()),
        }
    }
}
