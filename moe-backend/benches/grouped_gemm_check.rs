//! Grouped GEMM on a GPU, correctness first, then speed: `ops::grouped_matmul` (fprop `x·Wᵀ`,
//! dgrad `dy·W`) and `ops::grouped_matmul_wgrad` (wgrad `dyᵀ·x`) on Burn's Cube backend,
//! each against the device's own dense matmul run per group (the independent reference), at
//! the expert shapes of DeepSeek-V3 (hidden 7168, expert width 2048, 256 experts, top-8) and
//! Qwen3-30B-A3B (hidden 2048, expert width 768, 128 experts, top-8), 4096 tokens each.
//!
//! What each case checks (`"status": "pass"` only when all hold):
//! - the routing is ragged (random top-k) and has empty groups: the first, the last and every
//!   11th expert get no token, so a kernel that mishandles an empty group or the group edges
//!   is caught;
//! - NaN-poisoned outputs: before every checked call, a tensor of the output's size filled
//!   with NaN is allocated, written and freed, so the memory pool hands its pages to the
//!   output (CubeCL reuses freed blocks of the same size); an output row the kernel forgets to
//!   write reads NaN (best effort: the pool may pick other pages);
//! - no NaN in the output, and `max|out − ref| ≤ tol · max|ref|` (f32 5e-3, which allows a
//!   TF32 dense reference; bf16/f16 2e-2), for the empty groups of wgrad `ref = 0` exactly.
//!
//! Timing (unless `--no-time`): median of `--iters` calls after one warm-up, each call ending
//! with one element read back (waits for the device); every grouped op against one dense
//! matmul of equal FLOPs on the same device (`ratio = grouped TFLOP/s / dense TFLOP/s`).
//!
//! Kernels (`--kernels auto,tiled,direct,cmma,cublas`, default `auto`): every op runs once per
//! listed grouped-GEMM candidate of the Cube backend (`ops::set_cube_gemm_kernel`), checked
//! against the same references; a candidate the device cannot run with the dtype (`cmma` with
//! f32, or without tensor-core fragments; `cublas` off CUDA or without libcublas) falls back,
//! and its cases are recorded `"skipped"` with the kernel that ran. For `cublas` the JSON also
//! names the library (`"cublas"`: version and whether `cublasGemmGroupedBatchedEx` exists, or
//! why it cannot load) and each case the route that ran (`"cublas_route"`: `grouped` or
//! `per_group`). With several kernels timed, the last line names the *choice*: the kernel that passed
//! every case with the least total time (`"choice"` in the JSON) — what `MOE_CUBE_GEMM` should
//! be set to on that device.
//!
//! Output: a line per case, and with `--json PATH` one JSON object rewritten after every case
//! (a timeout or crash keeps the cases done). A case that panics is recorded as `"error"` and
//! the next one runs.
//!
//! Run: `cargo bench -p moe-backend --features cuda --bench grouped_gemm_check -- --device cuda
//! [--dtype f32|bf16|f16] [--shapes deepseek_v3,qwen3_30b_a3b|quick] [--kernels LIST]
//! [--iters N] [--no-time] [--json PATH]`; with `--features vulkan`, `--device vulkan|gl` (`gl`: llvmpipe on a CPU,
//! `--shapes quick`). The device is probed first (`moe_backend::devices`): no driver or no
//! device ends the run with exit code 3 and a named error, not a panic. The full shapes need
//! CUDA: the expert weights are one buffer each (7.5 GiB in bf16 for DeepSeek-V3), over
//! Vulkan's storage-binding limits (the `cube_ops` bench chunks them for Vulkan).

use std::cell::LazyCell;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use moe_backend::ops::{
    CubeGemmKernel, GroupSizes, WeightLayout, cublas_library_info, grouped_matmul,
    grouped_matmul_wgrad, last_cube_gemm_kernel, last_cublas_route, set_cube_gemm_kernel,
};
use serde_json::{Value, json};

/// One set of expert shapes.
#[derive(Debug, Clone, Copy)]
struct Shapes {
    name: &'static str,
    tokens: usize,
    hidden: usize,
    width: usize,
    experts: usize,
    top_k: usize,
}

const DEEPSEEK_V3: Shapes = Shapes {
    name: "deepseek_v3",
    tokens: 4096,
    hidden: 7168,
    width: 2048,
    experts: 256,
    top_k: 8,
};

const QWEN3_30B_A3B: Shapes = Shapes {
    name: "qwen3_30b_a3b",
    tokens: 4096,
    hidden: 2048,
    width: 768,
    experts: 128,
    top_k: 8,
};

const QUICK: Shapes = Shapes {
    name: "quick",
    tokens: 64,
    hidden: 96,
    width: 80,
    experts: 24,
    top_k: 3,
};

/// Command-line options.
struct Options {
    device: String,
    dtype: DType,
    shapes: Vec<Shapes>,
    iters: usize,
    time: bool,
    json: Option<String>,
    /// Grouped-GEMM kernels of the Cube backend to check and time, in order.
    kernels: Vec<CubeGemmKernel>,
}

fn parse_args() -> Result<Options, String> {
    let mut opts = Options {
        device: "cuda".into(),
        dtype: DType::F32,
        shapes: vec![DEEPSEEK_V3, QWEN3_30B_A3B],
        iters: 5,
        time: true,
        json: None,
        kernels: vec![CubeGemmKernel::Auto],
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} expects a value"));
        match a.as_str() {
            "--device" => opts.device = value()?,
            "--dtype" => {
                opts.dtype = match value()?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    other => return Err(format!("--dtype expects f32|bf16|f16, got {other:?}")),
                }
            }
            "--shapes" => {
                opts.shapes = value()?
                    .split(',')
                    .map(|s| match s {
                        "deepseek_v3" => Ok(DEEPSEEK_V3),
                        "qwen3_30b_a3b" => Ok(QWEN3_30B_A3B),
                        "quick" => Ok(QUICK),
                        other => Err(format!(
                            "--shapes expects deepseek_v3,qwen3_30b_a3b,quick; got {other:?}"
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--iters" => {
                opts.iters = value()?
                    .parse()
                    .map_err(|_| "--iters expects a count".to_string())?;
                if opts.iters == 0 {
                    return Err("--iters must be at least 1".into());
                }
            }
            "--kernels" => {
                opts.kernels = value()?
                    .split(',')
                    .map(|k| {
                        k.parse::<CubeGemmKernel>()
                            .map_err(|e| format!("--kernels: {e}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--no-time" => opts.time = false,
            "--json" => opts.json = Some(value()?),
            // `cargo bench` passes `--bench`; ignore it and other harness flags.
            _ => {}
        }
    }
    Ok(opts)
}

/// The device `name`, probed before Burn opens its runtime.
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
            "--device {other}: not available in this binary (built with: {})",
            built_devices()
        )),
    }
}

fn built_devices() -> &'static str {
    if cfg!(all(feature = "cuda", feature = "vulkan")) {
        "cuda, vulkan, gl"
    } else if cfg!(feature = "cuda") {
        "cuda"
    } else if cfg!(feature = "vulkan") {
        "vulkan, gl"
    } else {
        "no GPU runtime"
    }
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

/// Whether expert `e` of `experts` is left without tokens (first, last, every 11th).
fn empty_expert(e: usize, experts: usize) -> bool {
    e == 0 || e + 1 == experts || e % 11 == 5
}

/// Group sizes of a random top-k routing over the non-empty experts.
fn group_sizes(s: &Shapes, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix(seed);
    let live: Vec<usize> = (0..s.experts)
        .filter(|&e| !empty_expert(e, s.experts))
        .collect();
    let mut sizes = vec![0usize; s.experts];
    let mut all = live.clone();
    for _ in 0..s.tokens {
        for i in 0..s.top_k.min(all.len()) {
            let j = i + (rng.next() % (all.len() - i) as u64) as usize;
            all.swap(i, j);
            sizes[all[i]] += 1;
        }
    }
    sizes
}

/// Waits for the device by reading one element back.
fn sync<const D: usize>(t: &Tensor<D>) {
    let _ = t.clone().flatten::<1>(0, D - 1).slice(0..1).into_data();
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
        .map(|&x| i32::try_from(x).expect("group size fits in i32"))
        .collect();
    Tensor::from_data(TensorData::new(v, [values.len()]), device)
}

/// Frees a NaN-filled tensor of `shape` so the pool hands its pages to the next output.
fn poison<const D: usize>(shape: [usize; D], device: &Device, dtype: DType) {
    let t = Tensor::<D>::full(shape, f32::NAN, (device, dtype));
    sync(&t);
    drop(t);
}

/// `(max|got − want|, max|want|, got has NaN)`, computed on the device in f32.
fn compare<const D: usize>(got: &Tensor<D>, want: &Tensor<D>) -> (f64, f64, bool) {
    let g = got.clone().cast(DType::F32);
    let w = want.clone().cast(DType::F32);
    let nan = g.clone().is_nan().any().into_scalar::<bool>();
    let err = (g - w.clone()).abs().max().into_scalar::<f32>() as f64;
    let scale = w.abs().max().into_scalar::<f32>() as f64;
    (err, scale, nan)
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 5e-3,
        _ => 2e-2,
    }
}

/// The per-group reference: `per_group(rows of g)` for each group, concatenated along rows.
fn rows_of(t: &Tensor<2>, sizes: &[usize]) -> Vec<Option<Tensor<2>>> {
    let mut row = 0;
    sizes
        .iter()
        .map(|&n| {
            let part = (n > 0).then(|| t.clone().slice(row..row + n));
            row += n;
            part
        })
        .collect()
}

fn expert(w: &Tensor<3>, g: usize) -> Tensor<2> {
    let [_, a, b] = w.dims();
    w.clone().slice(g..g + 1).reshape([a, b])
}

/// One checked (and timed) op; returns its JSON record.
struct Case<'a> {
    shapes: &'a Shapes,
    op: &'static str,
    flops: f64,
    /// The kernel asked for (`set_cube_gemm_kernel`).
    kernel: CubeGemmKernel,
}

impl Case<'_> {
    /// `grouped_gemm_{op}_{shapes}_{kernel}`.
    fn name(&self) -> String {
        format!(
            "grouped_gemm_{}_{}_{}",
            self.op, self.shapes.name, self.kernel
        )
    }
}

fn record(
    case: &Case,
    opts: &Options,
    ran: CubeGemmKernel,
    (err, scale, nan): (f64, f64, bool),
    times: Option<(f64, f64)>,
) -> Value {
    let tol = tolerance(opts.dtype);
    let rel = if scale > 0.0 { err / scale } else { err };
    let pass = !nan && rel.is_finite() && rel <= tol;
    let mut v = json!({
        "case": case.name(),
        "op": case.op,
        "shapes": case.shapes.name,
        "kernel": case.kernel.name(),
        "kernel_ran": ran.name(),
        "dtype": format!("{:?}", opts.dtype).to_lowercase(),
        "status": if pass { "pass" } else { "fail" },
        "max_abs_err": err,
        "max_abs_ref": scale,
        "rel_err": rel,
        "tol": tol,
        "nan_in_output": nan,
        "flops": case.flops,
    });
    if ran == CubeGemmKernel::Cublas {
        v["cublas_route"] = json!(last_cublas_route().map(|r| r.name()));
    }
    let timing = times.map(|(grouped, dense)| {
        let (tg, td) = (case.flops / grouped / 1e12, case.flops / dense / 1e12);
        v["ms"] = json!(grouped * 1e3);
        v["tflops"] = json!(tg);
        v["dense_ms"] = json!(dense * 1e3);
        v["dense_tflops"] = json!(td);
        v["ratio_grouped_over_dense"] = json!(tg / td.max(f64::MIN_POSITIVE));
        format!(
            "; {:.3} ms {tg:.1} TFLOP/s, dense {:.3} ms {td:.1} TFLOP/s, ratio {:.3}",
            grouped * 1e3,
            dense * 1e3,
            tg / td.max(f64::MIN_POSITIVE)
        )
    });
    println!(
        "{:<46} {:>4}  [{ran}] rel err {rel:.2e} (tol {tol:.0e}){}{}",
        case.name(),
        if pass { "pass" } else { "FAIL" },
        if nan { ", NaN in output" } else { "" },
        timing.unwrap_or_default()
    );
    v
}

/// Checks and times fprop, dgrad and wgrad at `s`; pushes one record per op.
fn run_shapes(s: &Shapes, opts: &Options, device: &Device, out: &mut dyn FnMut(Value)) {
    let sizes = group_sizes(s, 42);
    let n: usize = sizes.iter().sum();
    let (h, f, e) = (s.hidden, s.width, s.experts);
    let dt = opts.dtype;
    let dist = Distribution::Uniform(-1.0, 1.0);
    let x = Tensor::<2>::random([n, h], dist, (device, dt));
    let w = Tensor::<3>::random([e, f, h], dist, (device, dt));
    let dy = Tensor::<2>::random([n, f], dist, (device, dt));
    let gs = GroupSizes::Device(Box::new(int_vec(&sizes, device)));
    let flops = 2.0 * n as f64 * h as f64 * f as f64;
    let empty = sizes.iter().filter(|&&c| c == 0).count();
    println!(
        "== {}: {n} rows ({} tokens, top-{}), hidden {h}, width {f}, {e} experts ({empty} empty, \
         largest group {}), {:?}",
        s.name,
        s.tokens,
        s.top_k,
        sizes.iter().max().copied().unwrap_or(0),
        dt
    );
    let x_rows = rows_of(&x, &sizes);
    let dy_rows = rows_of(&dy, &sizes);
    let time = |grouped: &dyn Fn() -> Tensor<2>, dense: &dyn Fn() -> Tensor<2>| {
        opts.time.then(|| {
            (
                median_secs(opts.iters, || sync(&grouped())),
                median_secs(opts.iters, || sync(&dense())),
            )
        })
    };
    // The references, once per op (the device's dense matmul per group).
    let fprop_ref = || {
        let parts: Vec<Tensor<2>> = (0..e)
            .filter_map(|g| {
                x_rows[g]
                    .as_ref()
                    .map(|xg| xg.clone().matmul(expert(&w, g).transpose()))
            })
            .collect();
        Tensor::cat(parts, 0)
    };
    let dgrad_ref = || {
        let parts: Vec<Tensor<2>> = (0..e)
            .filter_map(|g| {
                dy_rows[g]
                    .as_ref()
                    .map(|dyg| dyg.clone().matmul(expert(&w, g)))
            })
            .collect();
        Tensor::cat(parts, 0)
    };
    let wgrad_ref = || {
        let parts: Vec<Tensor<2>> = (0..e)
            .map(|g| match (&dy_rows[g], &x_rows[g]) {
                (Some(dyg), Some(xg)) => dyg.clone().transpose().matmul(xg.clone()),
                _ => Tensor::<2>::zeros([f, h], (device, dt)),
            })
            .collect();
        Tensor::stack::<3>(parts, 0)
    };
    // Computed on first use: a case that errors before its comparison needs none.
    let fprop_ref = LazyCell::new(fprop_ref);
    let dgrad_ref = LazyCell::new(dgrad_ref);
    let wgrad_ref = LazyCell::new(wgrad_ref);

    for &kernel in &opts.kernels {
        set_cube_gemm_kernel(kernel);
        // A requested kernel the device cannot run falls back: skip the duplicate.
        let ran = |case: &Case| -> Result<CubeGemmKernel, Value> {
            let ran = last_cube_gemm_kernel().unwrap_or(kernel);
            if kernel != CubeGemmKernel::Auto && ran != kernel {
                let library = match (kernel, cublas_library_info()) {
                    (CubeGemmKernel::Cublas, Err(e)) => format!(" ({e})"),
                    _ => String::new(),
                };
                let why =
                    format!("{kernel} cannot run here with {dt:?}{library}; {ran} ran instead");
                println!("{:<46} skip  {why}", case.name());
                return Err(json!({"case": case.name(), "op": case.op,
                    "shapes": case.shapes.name, "kernel": kernel.name(),
                    "kernel_ran": ran.name(), "status": "skipped", "reason": why}));
            }
            Ok(ran)
        };

        // fprop: y = x · W_gᵀ per group.
        let case = Case {
            shapes: s,
            op: "fprop",
            flops,
            kernel,
        };
        let result = guarded(&case, || {
            poison([n, f], device, dt);
            let y = grouped_matmul(x.clone(), w.clone(), &gs, WeightLayout::OutIn)
                .map_err(|e| e.to_string())?;
            let ran = match ran(&case) {
                Ok(k) => k,
                Err(skipped) => return Ok(skipped),
            };
            let cmp = compare(&y, &fprop_ref);
            let w_dense = expert(&w, 1).transpose(); // [h, f]
            let times = time(
                &|| grouped_matmul(x.clone(), w.clone(), &gs, WeightLayout::OutIn).expect("fprop"),
                &|| x.clone().matmul(w_dense.clone()),
            );
            Ok(record(&case, opts, ran, cmp, times))
        });
        out(result);

        // dgrad: dx = dy · W_g per group.
        let case = Case {
            shapes: s,
            op: "dgrad",
            flops,
            kernel,
        };
        let result = guarded(&case, || {
            poison([n, h], device, dt);
            let dx = grouped_matmul(dy.clone(), w.clone(), &gs, WeightLayout::InOut)
                .map_err(|e| e.to_string())?;
            let ran = match ran(&case) {
                Ok(k) => k,
                Err(skipped) => return Ok(skipped),
            };
            let cmp = compare(&dx, &dgrad_ref);
            let w_dense = expert(&w, 1); // [f, h]
            let times = time(
                &|| grouped_matmul(dy.clone(), w.clone(), &gs, WeightLayout::InOut).expect("dgrad"),
                &|| dy.clone().matmul(w_dense.clone()),
            );
            Ok(record(&case, opts, ran, cmp, times))
        });
        out(result);

        // wgrad: dW_g = dy_gᵀ · x_g per group, zero for the empty groups.
        let case = Case {
            shapes: s,
            op: "wgrad",
            flops,
            kernel,
        };
        let result = guarded(&case, || {
            poison([e, f, h], device, dt);
            let dw = grouped_matmul_wgrad(dy.clone(), x.clone(), &gs).map_err(|e| e.to_string())?;
            let ran = match ran(&case) {
                Ok(k) => k,
                Err(skipped) => return Ok(skipped),
            };
            let cmp = compare(&dw, &wgrad_ref);
            let dy_t = dy.clone().transpose();
            let times = opts.time.then(|| {
                (
                    median_secs(opts.iters, || {
                        sync(&grouped_matmul_wgrad(dy.clone(), x.clone(), &gs).expect("wgrad"))
                    }),
                    median_secs(opts.iters, || sync(&dy_t.clone().matmul(x.clone()))),
                )
            });
            Ok(record(&case, opts, ran, cmp, times))
        });
        out(result);
    }
}

/// Runs one case, turning an error or a panic into an `"error"` record.
fn guarded(case: &Case, f: impl FnOnce() -> Result<Value, String>) -> Value {
    let name = case.name();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(f));
    let message = match outcome {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => e,
        Err(payload) => {
            let text = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            format!("panicked: {text}")
        }
    };
    println!("{name:<46} ERROR {message}");
    json!({"case": name, "op": case.op, "shapes": case.shapes.name,
           "kernel": case.kernel.name(), "status": "error", "error": message})
}

/// The kernel that passed every one of its cases with the least total time, and that time
/// (skipped cases, i.e. a kernel that fell back, disqualify it).
fn choose(cases: &[Value]) -> Option<(String, f64)> {
    let mut totals: Vec<(String, f64, bool)> = Vec::new();
    for c in cases {
        let Some(kernel) = c["kernel"].as_str() else {
            continue;
        };
        let at = match totals.iter().position(|(k, _, _)| k == kernel) {
            Some(i) => i,
            None => {
                totals.push((kernel.to_string(), 0.0, true));
                totals.len() - 1
            }
        };
        match (c["status"].as_str(), c["ms"].as_f64()) {
            (Some("pass"), Some(ms)) => totals[at].1 += ms,
            _ => totals[at].2 = false,
        }
    }
    totals
        .into_iter()
        .filter(|(_, _, ok)| *ok)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(k, ms, _)| (k, ms))
}

fn write_json(path: &str, report: &Value) {
    let text = serde_json::to_string_pretty(report).unwrap_or_default() + "\n";
    if let Err(e) = std::fs::write(path, text) {
        eprintln!("grouped_gemm_check: cannot write {path}: {e}");
    }
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("grouped_gemm_check: {e}");
            std::process::exit(2);
        }
    };
    let device = match open_device(&opts.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("grouped_gemm_check: error: {e}");
            std::process::exit(3);
        }
    };
    let mut report = json!({
        "bench": "grouped_gemm_check",
        "device": opts.device,
        "dtype": format!("{:?}", opts.dtype).to_lowercase(),
        "op": "moe_backend::ops::grouped_matmul / grouped_matmul_wgrad (Cube backend)",
        "kernels": opts.kernels.iter().map(|k| k.name()).collect::<Vec<_>>(),
        "iters": opts.iters,
        "cases": [],
    });
    if opts.kernels.contains(&CubeGemmKernel::Cublas) {
        let info = cublas_library_info();
        println!("cublas: {}", info.as_ref().unwrap_or_else(|e| e).as_str());
        report["cublas"] = match info {
            Ok(text) => json!({"available": true, "library": text}),
            Err(why) => json!({"available": false, "reason": why}),
        };
    }
    if let Some(path) = &opts.json {
        write_json(path, &report);
    }
    let mut failed = 0;
    for s in &opts.shapes {
        let mut push = |v: Value| {
            if v["status"] != "pass" && v["status"] != "skipped" {
                failed += 1;
            }
            if let Some(cases) = report["cases"].as_array_mut() {
                cases.push(v);
            }
            if let Some(path) = &opts.json {
                write_json(path, &report);
            }
        };
        run_shapes(s, &opts, &device, &mut push);
    }
    if opts.time && opts.kernels.len() > 1 {
        let choice = choose(report["cases"].as_array().map(Vec::as_slice).unwrap_or(&[]));
        match &choice {
            Some((kernel, ms)) => println!(
                "choice: MOE_CUBE_GEMM={kernel} ({ms:.3} ms over every timed case; the fastest \
                 kernel that passed them all)"
            ),
            None => println!("choice: none (no kernel passed every case)"),
        }
        report["choice"] = json!(choice.map(|(k, ms)| json!({"kernel": k, "total_ms": ms})));
        if let Some(path) = &opts.json {
            write_json(path, &report);
        }
    }
    if failed > 0 {
        eprintln!("grouped_gemm_check: {failed} case(s) failed");
        std::process::exit(1);
    }
}
