//! MoE kernels on Burn's Cube backend (default Vulkan device, or OpenGL with `--device gl`), each
//! against a baseline measured on the same device in the same run:
//!
//! (a) grouped GEMM (`ops::grouped_matmul`, group sizes on the device) at DeepSeek-V3 expert
//!     shapes — hidden 7168, expert width 2048, 256 experts, top-8 of 4096 tokens (32768 rows),
//!     group sizes from a random top-8 routing — over one dense Burn matmul of equal FLOPs;
//! (b) permute (`MoeOps::moe_permute`, a row gather into `[32768, 7168]`) over a device copy of
//!     the same bytes (an elementwise `x · 1` of a `[32768, 7168]` tensor).
//!
//! Run: `cargo bench -p moe-backend --features vulkan --bench cube_ops -- [--quick]
//! [--dtype f32|f16|bf16] [--iters N] [--device vulkan|gl] [--json PATH]`. `--json` also writes
//! every measured case (shapes, dtype, ms, TFLOP/s or GB/s, the ratios grouped/dense and
//! permute/copy) as one JSON object to `PATH`. `--quick` uses small shapes (seconds
//! on Mesa's CPU drivers). `MOE_CUBE_GEMM=tiled|direct|cmma|cublas` forces a grouped-GEMM kernel body
//! (default: cmma for BF16/F16 where the device has tensor-core fragments, else tiled, direct on
//! software Vulkan devices; see `src/ops/cube/gemm.rs`). On lavapipe
//! the dense baseline (Burn's shared-memory matmul) hits the CubeCL SPIR-V bug described there and
//! crashes the driver: use `--device gl` (llvmpipe, WGSL) for a smoke run on a CPU.
//! Timing: one warm-up call, then the median of `--iters` calls; each call ends by reading one
//! element back, which waits for all queued work on the device.
//!
//! The expert weights are bound per launch in chunks of experts of at most 1 GiB (Vulkan
//! storage-buffer bindings are limited to 4 GiB, often less); each chunk is one grouped GEMM
//! launch over that chunk's contiguous rows.

use std::time::Instant;

use burn::backend::Dispatch;
use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::{DType, Device, DeviceKind, Distribution, Int, Tensor, TensorData};
use moe_backend::ops::{GroupSizes, MoeOps, WeightLayout, grouped_matmul};
use serde_json::{Value, json};

/// Benchmark shapes.
struct Shapes {
    tokens: usize,
    hidden: usize,
    width: usize,
    experts: usize,
    top_k: usize,
}

const FULL: Shapes = Shapes {
    tokens: 4096,
    hidden: 7168,
    width: 2048,
    experts: 256,
    top_k: 8,
};

const QUICK: Shapes = Shapes {
    tokens: 256,
    hidden: 512,
    width: 256,
    experts: 16,
    top_k: 4,
};

/// Command-line options.
struct Options {
    quick: bool,
    dtype: DType,
    iters: usize,
    /// `--device gl`: Burn's wgpu runtime on OpenGL instead of the default Vulkan device.
    gl: bool,
    /// `--json PATH`: also write every measured case as one JSON object.
    json: Option<String>,
}

fn parse_args() -> Result<Options, String> {
    let mut opts = Options {
        quick: false,
        dtype: DType::F32,
        iters: 5,
        gl: false,
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => opts.quick = true,
            "--dtype" => {
                opts.dtype = match args.next().as_deref() {
                    Some("f32") => DType::F32,
                    Some("f16") => DType::F16,
                    Some("bf16") => DType::BF16,
                    other => return Err(format!("--dtype expects f32|f16|bf16, got {other:?}")),
                }
            }
            "--iters" => {
                opts.iters = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&v: &usize| v > 0)
                    .ok_or("--iters expects a positive integer")?
            }
            "--device" => {
                opts.gl = match args.next().as_deref() {
                    Some("vulkan") => false,
                    Some("gl") => true,
                    other => return Err(format!("--device expects vulkan|gl, got {other:?}")),
                }
            }
            "--json" => opts.json = Some(args.next().ok_or("--json expects a path")?),
            // `cargo bench` passes `--bench`; ignore it and other harness flags.
            _ => {}
        }
    }
    Ok(opts)
}

/// SplitMix64, so the routing is reproducible without an RNG dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Random top-k routing: per expert, the ascending token list (expert-major row order).
fn random_routing(s: &Shapes, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = SplitMix(seed);
    let mut per_expert = vec![Vec::new(); s.experts];
    for tok in 0..s.tokens {
        let mut all: Vec<usize> = (0..s.experts).collect();
        for i in 0..s.top_k {
            let j = i + (rng.next() % (s.experts - i) as u64) as usize;
            all.swap(i, j);
            per_expert[all[i]].push(tok);
        }
    }
    per_expert
}

/// Waits for the device by reading one element back.
fn sync(t: &Tensor<2>) {
    let _ = t.clone().slice([0..1, 0..1]).into_data();
}

fn median_secs(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
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

fn int_vec(values: &[usize], device: &Device) -> Tensor<1, Int> {
    let v: Vec<i32> = values
        .iter()
        .map(|&x| i32::try_from(x).expect("index fits in i32"))
        .collect();
    Tensor::from_data(TensorData::new(v, [values.len()]), device)
}

fn bench_grouped_gemm(
    s: &Shapes,
    routing: &[Vec<usize>],
    opts: &Options,
    device: &Device,
) -> Value {
    let sizes: Vec<usize> = routing.iter().map(Vec::len).collect();
    let n: usize = sizes.iter().sum();
    let (h, f) = (s.hidden, s.width);
    let elem = opts.dtype.size();
    let per_expert_bytes = f * h * elem;
    let chunk = ((1usize << 30) / per_expert_bytes).clamp(1, s.experts);
    let dist = Distribution::Uniform(-1.0, 1.0);
    let x = Tensor::<2>::random([n, h], dist, (device, opts.dtype));
    // One launch per chunk of experts: (rows of the chunk, weights, device group sizes).
    let mut launches = Vec::new();
    let mut row = 0;
    for e0 in (0..s.experts).step_by(chunk) {
        let e1 = (e0 + chunk).min(s.experts);
        let rows: usize = sizes[e0..e1].iter().sum();
        let w = Tensor::<3>::random([e1 - e0, f, h], dist, (device, opts.dtype));
        let gs = GroupSizes::Device(Box::new(int_vec(&sizes[e0..e1], device)));
        launches.push((x.clone().slice(row..row + rows), w, gs));
        row += rows;
    }
    let grouped = median_secs(opts.iters, || {
        let mut last = None;
        for (xc, w, gs) in &launches {
            let y = grouped_matmul(xc.clone(), w.clone(), gs, WeightLayout::OutIn)
                .expect("grouped gemm");
            last = Some(y);
        }
        if let Some(y) = last {
            sync(&y);
        }
    });
    let w_dense = Tensor::<2>::random([h, f], dist, (device, opts.dtype));
    let dense = median_secs(opts.iters, || sync(&x.clone().matmul(w_dense.clone())));
    let flops = 2.0 * n as f64 * h as f64 * f as f64;
    let (tg, td) = (flops / grouped / 1e12, flops / dense / 1e12);
    println!(
        "grouped GEMM [{n} x {h}] x {} experts [{f} x {h}]ᵀ (top-{} of {} tokens; group sizes \
         min {} max {}; {} launch(es) of <= {chunk} experts): {:.3} ms, {tg:.2} TFLOP/s",
        s.experts,
        s.top_k,
        s.tokens,
        sizes.iter().min().copied().unwrap_or(0),
        sizes.iter().max().copied().unwrap_or(0),
        launches.len(),
        grouped * 1e3,
    );
    println!(
        "dense matmul [{n} x {h}] x [{h} x {f}] (Burn, same FLOPs): {:.3} ms, {td:.2} TFLOP/s",
        dense * 1e3
    );
    let ratio = tg / td.max(f64::MIN_POSITIVE);
    println!("ratio grouped/dense = {ratio:.3} (target >= 0.8)");
    json!({
        "grouped_gemm": {
            "rows": n, "hidden": h, "width": f, "experts": s.experts, "top_k": s.top_k,
            "tokens": s.tokens,
            "group_size_min": sizes.iter().min().copied().unwrap_or(0),
            "group_size_max": sizes.iter().max().copied().unwrap_or(0),
            "launches": launches.len(), "experts_per_launch": chunk,
            "flops": flops, "ms": grouped * 1e3, "tflops": tg,
        },
        "dense_matmul": { "m": n, "k": h, "n": f, "flops": flops, "ms": dense * 1e3, "tflops": td },
        "ratio_grouped_over_dense": ratio,
    })
}

fn bench_permute(s: &Shapes, routing: &[Vec<usize>], opts: &Options, device: &Device) -> Value {
    let sorted: Vec<usize> = routing.iter().flatten().copied().collect();
    let n = sorted.len();
    let h = s.hidden;
    let dist = Distribution::Uniform(-1.0, 1.0);
    let tokens = Tensor::<2>::random([s.tokens, h], dist, (device, opts.dtype));
    let idx = int_vec(&sorted, device);
    let permute = || {
        Tensor::<2>::from_dispatch(Dispatch::moe_permute(
            tokens.clone().into_dispatch(),
            idx.clone().into_dispatch(),
        ))
    };
    let t_perm = median_secs(opts.iters, || sync(&permute()));
    let rows = Tensor::<2>::random([n, h], dist, (device, opts.dtype));
    let t_copy = median_secs(opts.iters, || sync(&(rows.clone() * 1.0)));
    // Both read and write N·H elements.
    let bytes = 2.0 * (n * h * opts.dtype.size()) as f64;
    let (bp, bc) = (bytes / t_perm / 1e9, bytes / t_copy / 1e9);
    println!(
        "permute [{} x {h}] -> [{n} x {h}]: {:.3} ms, {bp:.1} GB/s",
        s.tokens,
        t_perm * 1e3
    );
    println!(
        "device copy [{n} x {h}] (elementwise x * 1): {:.3} ms, {bc:.1} GB/s",
        t_copy * 1e3
    );
    let ratio = bp / bc.max(f64::MIN_POSITIVE);
    println!("ratio permute/copy = {ratio:.3} (target >= 0.5)");
    json!({
        "permute": {
            "tokens": s.tokens, "rows": n, "hidden": h, "bytes": bytes,
            "ms": t_perm * 1e3, "gbps": bp,
        },
        "copy": { "rows": n, "hidden": h, "bytes": bytes, "ms": t_copy * 1e3, "gbps": bc },
        "ratio_permute_over_copy": ratio,
    })
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("cube_ops: {e}");
            std::process::exit(2);
        }
    };
    let shapes = if opts.quick { &QUICK } else { &FULL };
    let device = if opts.gl {
        match Device::wgpu_options().graphics_api(WgpuBackend::Gl).init() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("cube_ops: no OpenGL wgpu device: {e}");
                std::process::exit(1);
            }
        }
    } else {
        Device::vulkan(DeviceKind::DefaultDevice)
    };
    println!(
        "cube_ops: {} shapes, dtype {:?}, {} timed iterations, device {device:?}, \
         MOE_CUBE_GEMM={}",
        if opts.quick { "quick" } else { "DeepSeek-V3" },
        opts.dtype,
        opts.iters,
        std::env::var("MOE_CUBE_GEMM").unwrap_or_else(|_| "auto".into())
    );
    let routing = random_routing(shapes, 42);
    let gemm = bench_grouped_gemm(shapes, &routing, &opts, &device);
    let permute = bench_permute(shapes, &routing, &opts, &device);
    if let Some(path) = &opts.json {
        let report = json!({
            "bench": "cube_ops",
            "shapes": if opts.quick { "quick" } else { "deepseek_v3" },
            "dtype": format!("{:?}", opts.dtype).to_lowercase(),
            "iters": opts.iters,
            "device": format!("{device:?}"),
            "moe_cube_gemm": std::env::var("MOE_CUBE_GEMM").unwrap_or_else(|_| "auto".into()),
            "grouped_gemm": gemm,
            "permute": permute,
        });
        let text = serde_json::to_string_pretty(&report).expect("json") + "\n";
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("cube_ops: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
