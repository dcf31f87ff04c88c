//! `MoeOps` on Burn's Cube backend against the Flex implementation and the per-group references
//! of `testing.rs`: every op forward, the differentiable ones backward through `Autodiff` on the
//! Cube device. Also the other backend extensions a training step needs: the differentiable
//! collectives (`CollectiveOps`, 1 and 2 in-process ranks) and the FP8 GEMMs (`Fp8Ops`).
//!
//! Run: `cargo test -p moe-backend --features vulkan --test cube -- --test-threads=1` (any
//! Vulkan device; `.ci/gpu-lavapipe` runs it on Mesa's lavapipe and llvmpipe).
//!
//! Devices. Every op runs on the default Vulkan device (`cube()`, SPIR-V). The grouped-GEMM
//! tests run a second time on Burn's wgpu runtime pinned to OpenGL (`gl()`, WGSL → GLSL; on CI
//! Mesa's llvmpipe), because the two devices run different kernel bodies on a CPU driver:
//! CubeCL 0.11.3's SPIR-V compiler emits invalid SPIR-V for any shared memory on a Vulkan
//! device without `VK_KHR_workgroup_memory_explicit_layout` (lavapipe segfaults creating the
//! pipeline), so on lavapipe the grouped GEMM runs its shared-memory-free *direct* kernel, while
//! the WGSL path lowers shared memory correctly and runs the *tiled* kernel a GPU runs (see
//! `src/ops/cube/gemm.rs`). On a GPU the Vulkan device runs the tiled kernel itself; skip the
//! `_on_gl` tests where the machine has no OpenGL driver. For the same CubeCL bug Burn's own
//! shared-memory kernels (`Tensor::sum`, the dense `matmul`) cannot run on lavapipe: gradients
//! are seeded with `backward()` on the full output (ones) rather than `.sum().backward()`, and
//! the per-group matmul reference is Burn's matmul on Flex (independent of the `gemm`-crate code
//! of the Flex `MoeOps`). Burn's `sum_dim`, which the Autodiff wrapper uses for the
//! routing-weight gradient, takes a shared-memory-free strategy at these sizes and runs on the
//! Cube device.
//!
//! Tolerances: index outputs and row moves (permute, sort_chunks, drop-and-pad) exact; sums
//! (unpermute, SwiGLU, d_probs) `1e-6` relative + `1e-6` absolute (`1e-5` relative where a
//! transcendental feeds them: the driver's `tanh` / `exp` differ from Rust's libm by a few ulps);
//! grouped GEMMs (f32, reduction lengths ≤ 200) `1e-5` relative + `1e-5` absolute, since the
//! Cube kernels add the terms in a different order than Flex's `gemm`.
#![cfg(feature = "vulkan")]

#[allow(dead_code)]
#[path = "../src/testing.rs"]
mod testing;

use std::sync::OnceLock;

use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::{Bool, DType, Device, DeviceKind, Int, Tensor, TensorData};
use moe_backend::ops::{
    CubeGemmKernel, GroupSizes, PermuteMode, RowIdMap, WeightLayout, attach_loss, grouped_matmul,
    grouped_matmul_wgrad, int_tensor_to_usize, last_cube_gemm_kernel, permute,
    permute_with_indices, set_cube_gemm_kernel, sort_chunks_by_idxs, swiglu_with_probs,
    topk_indices, unpermute,
};
use testing::{SplitMix, assert_close, int_tensor, reference_grouped_matmul, tensor, values};

/// The default Vulkan device (SPIR-V).
fn cube() -> Device {
    Device::vulkan(DeviceKind::DefaultDevice)
}

/// Burn's wgpu runtime pinned to OpenGL (WGSL), initialised once per process.
fn gl() -> Device {
    static GL: OnceLock<Device> = OnceLock::new();
    GL.get_or_init(|| {
        Device::wgpu_options()
            .graphics_api(WgpuBackend::Gl)
            .init()
            .expect("OpenGL wgpu device (on Debian: libegl1, libegl-mesa0, libgl1-mesa-dri)")
    })
    .clone()
}

fn flex() -> Device {
    Device::flex()
}

/// Random routing: every token picks `k` distinct experts among the first `used` experts.
fn random_routing(rng: &mut SplitMix, t: usize, e: usize, k: usize, used: usize) -> Vec<bool> {
    let mut map = vec![false; t * e];
    for tok in 0..t {
        for ex in rng.distinct(used, k) {
            map[tok * e + ex] = true;
        }
    }
    map
}

fn bool_tensor(map: &[bool], t: usize, e: usize, device: &Device) -> Tensor<2, Bool> {
    Tensor::from_data(TensorData::new(map.to_vec(), [t, e]), device)
}

fn ints<const D: usize>(t: Tensor<D, Int>) -> Vec<usize> {
    int_tensor_to_usize(t)
}

/// (T, H, E, k, experts used): T = 1, k = E, zero-token experts, odd sizes, H > one cube.
const CASES: [(usize, usize, usize, usize, usize); 6] = [
    (1, 3, 4, 2, 4),
    (13, 5, 7, 3, 7),
    (5, 4, 4, 4, 4),
    (9, 6, 8, 2, 3),
    (33, 17, 12, 5, 11),
    (70, 300, 16, 4, 9),
];

/// Permuted rows, `sorted_indices`, `probs_index`, `tokens_per_expert`, permuted probs.
type Permuted = (Vec<f64>, Vec<usize>, Vec<usize>, Vec<usize>, Vec<f64>);

/// Routing index, permuted rows and permuted probs of one device.
fn permute_on(
    device: &Device,
    xv: &[f64],
    pv: &[f64],
    map: &[bool],
    dims: (usize, usize, usize),
    mode: PermuteMode,
) -> Permuted {
    let (t, h, e) = dims;
    let out = permute(
        tensor(xv.to_vec(), [t, h], device, DType::F32),
        bool_tensor(map, t, e, device),
        Some(tensor(pv.to_vec(), [t, e], device, DType::F32)),
        mode,
    )
    .expect("permute");
    (
        values(out.rows),
        ints(out.row_id_map.sorted_indices),
        ints(out.row_id_map.probs_index),
        ints(out.row_id_map.tokens_per_expert),
        values(out.probs.expect("probs")),
    )
}

#[test]
fn permute_equals_flex_dropless_and_drop_and_pad() {
    let mut rng = SplitMix::new(11);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        let (xv, pv) = (rng.values(t * h), rng.values(t * e));
        let mut modes = vec![PermuteMode::Dropless];
        for cap in [1, t.div_ceil(2), t] {
            modes.push(PermuteMode::DropAndPad { capacity: cap });
        }
        for mode in modes {
            let got = permute_on(&cube(), &xv, &pv, &map, (t, h, e), mode);
            let want = permute_on(&flex(), &xv, &pv, &map, (t, h, e), mode);
            assert_eq!(got, want, "case {t},{h},{e},{k} {mode:?}");
        }
    }
}

#[test]
fn spec_ep2_vector_and_drop_and_pad_order() {
    // docs/routing-and-dispatch.md §EP2 worked example: rank 0 tokens a -> {0,2}, b -> {1,3}.
    let idx = int_tensor(vec![0, 2, 1, 3], [2, 2], &cube());
    let x = tensor(vec![1.0, 2.0], [2, 1], &cube(), DType::F32);
    let out = permute_with_indices(x, idx, None, 4, PermuteMode::Dropless).expect("permute");
    assert_eq!(ints(out.row_id_map.sorted_indices), vec![0, 1, 0, 1]);
    // Expert 0: tokens 1,2,4 routed (cap 2 drops 4); expert 1: token 3, pads 0; expert 2: none.
    let (t, e) = (5, 3);
    let mut map = vec![false; t * e];
    for (tok, ex) in [(1, 0), (2, 0), (4, 0), (3, 1)] {
        map[tok * e + ex] = true;
    }
    let x = tensor(
        (0..t).map(|v| v as f64).collect(),
        [t, 1],
        &cube(),
        DType::F32,
    );
    let mode = PermuteMode::DropAndPad { capacity: 2 };
    let out = permute(x, bool_tensor(&map, t, e, &cube()), None, mode).expect("permute");
    assert_eq!(
        ints(out.row_id_map.sorted_indices.clone()),
        vec![1, 2, 3, 0, 0, 1]
    );
    assert_eq!(out.row_id_map.tokens_per_expert_host(), vec![2; e]);
    assert_eq!(values(out.rows), vec![1.0, 2.0, 3.0, 0.0, 0.0, 1.0]);
}

fn row_id_map(idx: &[usize], t: usize, device: &Device) -> RowIdMap {
    let n = idx.len();
    RowIdMap {
        sorted_indices: int_tensor(idx.iter().map(|&v| v as i64).collect(), [n], device),
        probs_index: int_tensor(vec![0; n], [n], device),
        tokens_per_expert: int_tensor(vec![n as i64], [1], device),
        num_tokens: t,
        num_experts: 1,
    }
}

#[test]
fn unpermute_equals_flex_with_and_without_probs_and_is_deterministic() {
    let mut rng = SplitMix::new(12);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        // Expert-major row order of this routing, from Flex.
        let perm = permute(
            tensor(vec![0.0; t], [t, 1], &flex(), DType::F32),
            bool_tensor(&map, t, e, &flex()),
            None,
            PermuteMode::Dropless,
        )
        .expect("permute");
        let idx = ints(perm.row_id_map.sorted_indices);
        let n = idx.len();
        let (rv, wv) = (rng.values(n * h), rng.values(n));
        for weighted in [false, true] {
            let run = |device: &Device| {
                let probs = weighted.then(|| tensor(wv.clone(), [n], device, DType::F32));
                let rows = tensor(rv.clone(), [n, h], device, DType::F32);
                values(unpermute(rows, &row_id_map(&idx, t, device), probs).expect("unpermute"))
            };
            let got = run(&cube());
            assert_close(&got, &run(&flex()), 1e-6, 1e-6, "unpermute vs flex");
            assert_eq!(got, run(&cube()), "unpermute is not deterministic");
        }
    }
    // Arbitrary (non expert-major) indices with repeats and a token that gets no row.
    let idx = [2usize, 0, 2, 3, 1, 0, 2, 2, 0];
    let (t, h, n) = (5, 3, idx.len());
    let (rv, wv) = (rng.values(n * h), rng.values(n));
    let run = |device: &Device| {
        let rows = tensor(rv.clone(), [n, h], device, DType::F32);
        let probs = tensor(wv.clone(), [n], device, DType::F32);
        values(unpermute(rows, &row_id_map(&idx, t, device), Some(probs)).expect("unpermute"))
    };
    assert_close(
        &run(&cube()),
        &run(&flex()),
        1e-6,
        1e-6,
        "unpermute arbitrary idx",
    );
}

/// Forward and both gradients of `permute -> tanh -> weighted unpermute` on one device.
fn permute_unpermute_grads(
    device: &Device,
    map: &[bool],
    dims: (usize, usize, usize),
    data: (&[f64], &[f64], &[f64]),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, h, e) = dims;
    let (xv, pv, rv) = data;
    let ad = device.clone().autodiff();
    let x = tensor(xv.to_vec(), [t, h], &ad, DType::F32).require_grad();
    let p = tensor(pv.to_vec(), [t, e], &ad, DType::F32).require_grad();
    let perm = permute(
        x.clone(),
        bool_tensor(map, t, e, &ad),
        Some(p.clone()),
        PermuteMode::Dropless,
    )
    .expect("permute");
    // Weighted by the permuted probs: d probs flows through the weighted unpermute (Burn's
    // `sum_dim` on the device) and the permute of probs back to the `[T, E]` routing weights.
    let y = unpermute(perm.rows.tanh(), &perm.row_id_map, perm.probs).expect("unpermute");
    let grads = (y.clone() * tensor(rv.to_vec(), [t, h], &ad, DType::F32)).backward();
    (
        values(y),
        values(x.grad(&grads).expect("dx")),
        values(p.grad(&grads).expect("d probs")),
    )
}

#[test]
fn permute_unpermute_backward_equals_flex() {
    let mut rng = SplitMix::new(13);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        let (xv, pv, rv) = (rng.values(t * h), rng.values(t * e), rng.values(t * h));
        let data = (&xv[..], &pv[..], &rv[..]);
        let got = permute_unpermute_grads(&cube(), &map, (t, h, e), data);
        let want = permute_unpermute_grads(&flex(), &map, (t, h, e), data);
        // tanh differs by a few ulps between Vulkan and Rust's libm.
        assert_close(&got.0, &want.0, 1e-5, 1e-6, "forward");
        assert_close(&got.1, &want.1, 1e-5, 1e-6, "d tokens");
        assert_close(&got.2, &want.2, 1e-5, 1e-6, "d probs");
    }
}

/// Forward, dx and dw of a grouped GEMM on one device (Autodiff).
fn gmm_on(
    device: &Device,
    sizes: &[usize],
    (k, m): (usize, usize),
    layout: WeightLayout,
    data: (&[f64], &[f64], &[f64]),
    device_sizes: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n: usize = sizes.iter().sum();
    let g = sizes.len();
    let wshape = match layout {
        WeightLayout::OutIn => [g, m, k],
        WeightLayout::InOut => [g, k, m],
    };
    let ad = device.clone().autodiff();
    let x = tensor(data.0.to_vec(), [n, k], &ad, DType::F32).require_grad();
    let w = tensor(data.1.to_vec(), wshape, &ad, DType::F32).require_grad();
    let gs = if device_sizes {
        let t = int_tensor(sizes.iter().map(|&s| s as i64).collect(), [g], &ad);
        GroupSizes::Device(Box::new(t))
    } else {
        GroupSizes::Host(sizes.to_vec())
    };
    let y = grouped_matmul(x.clone(), w.clone(), &gs, layout).expect("gmm");
    let grads = (y.clone() * tensor(data.2.to_vec(), [n, m], &ad, DType::F32)).backward();
    (
        values(y),
        values(x.grad(&grads).expect("dx")),
        values(w.grad(&grads).expect("dw")),
    )
}

/// Grouped GEMM forward, dgrad and wgrad on `device` against Flex and a per-group reference.
fn check_grouped_matmul(device: &Device) {
    let mut rng = SplitMix::new(14);
    let shapes = [(9, 5), (70, 130), (16, 64), (1, 1)];
    for sizes in [
        vec![3, 0, 5, 1],
        vec![0, 0, 7],
        vec![1],
        vec![70, 0, 129, 2, 0],
        vec![0, 200, 0, 64, 65, 0],
    ] {
        let n: usize = sizes.iter().sum();
        let g = sizes.len();
        for (k, m) in shapes {
            for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                let (xv, wv, rv) = (rng.values(n * k), rng.values(g * m * k), rng.values(n * m));
                let data = (&xv[..], &wv[..], &rv[..]);
                let what = format!("sizes {sizes:?} k {k} m {m} {layout:?}");
                let got = gmm_on(device, &sizes, (k, m), layout, data, true);
                let want = gmm_on(&flex(), &sizes, (k, m), layout, data, false);
                assert_close(&got.0, &want.0, 1e-5, 1e-5, &format!("forward {what}"));
                assert_close(&got.1, &want.1, 1e-5, 1e-5, &format!("dgrad {what}"));
                assert_close(&got.2, &want.2, 1e-5, 1e-5, &format!("wgrad {what}"));
                // Empty groups get exactly zero weight gradient.
                for (gi, &s) in sizes.iter().enumerate() {
                    if s == 0 {
                        let block = &got.2[gi * m * k..(gi + 1) * m * k];
                        assert!(block.iter().all(|&v| v == 0.0), "{what}: group {gi}");
                    }
                }
                // Per-group reference by Burn's own matmul (on Flex; see module docs).
                let wshape = if layout == WeightLayout::OutIn {
                    [g, m, k]
                } else {
                    [g, k, m]
                };
                let reference = reference_grouped_matmul(
                    tensor(xv.clone(), [n, k], &flex(), DType::F32),
                    tensor(wv.clone(), wshape, &flex(), DType::F32),
                    &sizes,
                    layout == WeightLayout::OutIn,
                );
                assert_close(&got.0, &values(reference), 1e-5, 1e-5, &what);
            }
        }
    }
}

#[test]
fn grouped_matmul_forward_and_backward_equal_flex_and_reference() {
    check_grouped_matmul(&cube());
}

#[test]
fn grouped_matmul_forward_and_backward_equal_flex_and_reference_on_gl() {
    check_grouped_matmul(&gl());
}

/// The mantissa bits of a half-precision float dtype (BF16 7, F16 10).
fn mantissa_bits(dtype: DType) -> i32 {
    match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        other => panic!("{other:?} is not a half-precision dtype"),
    }
}

/// `x · wᵀ` (OutIn) or `x · w` (InOut) per group, in f64 on the host: `[n, m]`.
fn host_grouped_matmul(
    x: &[f64],
    w: &[f64],
    sizes: &[usize],
    (k, m): (usize, usize),
    layout: WeightLayout,
) -> Vec<f64> {
    let mut out = Vec::new();
    let mut row = 0;
    for (g, &s) in sizes.iter().enumerate() {
        for r in row..row + s {
            for c in 0..m {
                let wv = |kk: usize| match layout {
                    WeightLayout::OutIn => w[(g * m + c) * k + kk],
                    WeightLayout::InOut => w[(g * k + kk) * m + c],
                };
                out.push((0..k).map(|kk| x[r * k + kk] * wv(kk)).sum());
            }
        }
        row += s;
    }
    out
}

/// Grouped GEMM forward, dgrad and wgrad with half-precision operands (`dtype`: BF16, or F16
/// where the device lacks BF16) on `device`, against f64 references of the same (rounded)
/// operands: every output is the f32-accumulated sum rounded once, so within half an ulp of
/// `dtype` (2⁻⁸ relative for BF16, 2⁻¹¹ for F16) plus the f32 accumulation's rounding.
/// Also the accumulator itself: `2^(p+1) + 1 + 1` with `p` mantissa bits is `2^(p+1) + 2` in
/// f32 (a half-precision accumulator would keep `2^(p+1)`).
fn check_grouped_matmul_half(device: &Device, dtype: DType) {
    let ad = device.clone().autodiff();
    let big = 2f64.powi(mantissa_bits(dtype) + 1);
    let x = tensor(vec![big, 1.0, 1.0], [1, 3], &ad, dtype);
    let w = tensor(vec![1.0; 3], [1, 1, 3], &ad, dtype);
    let y = grouped_matmul(x, w, &GroupSizes::Host(vec![1]), WeightLayout::OutIn).expect("gmm");
    assert_eq!(y.dtype(), dtype);
    assert_eq!(values(y), vec![big + 2.0], "{dtype:?}: f32 accumulation");

    let rtol = 2f64.powi(-(mantissa_bits(dtype) + 1));
    let atol = 1e-4;
    let mut rng = SplitMix::new(41);
    for sizes in [vec![3, 0, 5, 1], vec![70, 0, 129, 2, 0]] {
        let n: usize = sizes.iter().sum();
        let g = sizes.len();
        for (k, m) in [(9, 5), (70, 130)] {
            for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
                let wshape = match layout {
                    WeightLayout::OutIn => [g, m, k],
                    WeightLayout::InOut => [g, k, m],
                };
                let x = tensor(rng.values(n * k), [n, k], &ad, dtype).require_grad();
                let w = tensor(rng.values(g * m * k), wshape, &ad, dtype).require_grad();
                let r = tensor(rng.values(n * m), [n, m], &ad, dtype);
                // The operands as they are held (rounded to `dtype`).
                let (xv, wv, rv) = (values(x.clone()), values(w.clone()), values(r.clone()));
                let sizes_t = int_tensor(sizes.iter().map(|&s| s as i64).collect(), [g], &ad);
                let gs = GroupSizes::Device(Box::new(sizes_t));
                let y = grouped_matmul(x.clone(), w.clone(), &gs, layout).expect("gmm");
                assert_eq!(y.dtype(), dtype);
                let grads = (y.clone() * r).backward();
                let (dx, dw) = (x.grad(&grads).expect("dx"), w.grad(&grads).expect("dw"));
                assert_eq!((dx.dtype(), dw.dtype()), (dtype, dtype));
                let what = format!("{dtype:?} sizes {sizes:?} k {k} m {m} {layout:?}");
                let want_y = host_grouped_matmul(&xv, &wv, &sizes, (k, m), layout);
                assert_close(&values(y), &want_y, rtol, atol, &format!("forward {what}"));
                // dx = dy · W per group (W as `[m, k]` in OutIn, `[k, m]` in InOut).
                let flip = match layout {
                    WeightLayout::OutIn => WeightLayout::InOut,
                    WeightLayout::InOut => WeightLayout::OutIn,
                };
                let want_dx = host_grouped_matmul(&rv, &wv, &sizes, (m, k), flip);
                assert_close(&values(dx), &want_dx, rtol, atol, &format!("dgrad {what}"));
                // dW_g = dy_gᵀ · x_g (OutIn) or x_gᵀ · dy_g (InOut); empty groups exactly 0.
                let mut want_dw = vec![0.0; g * m * k];
                let mut row = 0;
                for (gi, &s) in sizes.iter().enumerate() {
                    for i in 0..m {
                        for j in 0..k {
                            let v: f64 =
                                (row..row + s).map(|t| rv[t * m + i] * xv[t * k + j]).sum();
                            let at = match layout {
                                WeightLayout::OutIn => (gi * m + i) * k + j,
                                WeightLayout::InOut => (gi * k + j) * m + i,
                            };
                            want_dw[at] = v;
                        }
                    }
                    row += s;
                }
                assert_close(&values(dw), &want_dw, rtol, atol, &format!("wgrad {what}"));
            }
        }
    }
}

/// The half-precision dtypes `device` holds: BF16 where it has it, else F16 (lavapipe has no
/// BF16 arithmetic; say which ran).
fn half_dtypes(device: &Device) -> Vec<DType> {
    let dtypes: Vec<DType> = [DType::BF16, DType::F16]
        .into_iter()
        .filter(|d| device.supports_dtype(*d))
        .collect();
    eprintln!("half-precision dtypes of {device:?}: {dtypes:?}");
    assert!(!dtypes.is_empty(), "{device:?} holds neither BF16 nor F16");
    dtypes
}

/// Runs under the automatic kernel choice, then with the tensor-core kernel requested (`cmma`:
/// where the device has no cooperative matrices — lavapipe — the automatic scalar body runs,
/// which `last_cube_gemm_kernel` shows). Any body is correct, so a test running meanwhile is
/// unaffected by the process-wide request.
#[test]
fn grouped_matmul_in_half_precision_accumulates_in_f32() {
    let device = cube();
    for dtype in half_dtypes(&device) {
        check_grouped_matmul_half(&device, dtype);
        let auto = last_cube_gemm_kernel().expect("a grouped GEMM ran");
        set_cube_gemm_kernel(CubeGemmKernel::Cmma);
        let outcome = std::panic::catch_unwind(|| check_grouped_matmul_half(&device, dtype));
        let ran = last_cube_gemm_kernel();
        set_cube_gemm_kernel(CubeGemmKernel::Auto);
        eprintln!("{dtype:?}: auto ran {auto}; cmma requested, {ran:?} ran");
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
        // Only a device with the fragments runs cmma, and then the automatic choice is cmma.
        assert!(
            ran == Some(auto) || (ran == Some(CubeGemmKernel::Cmma)),
            "{dtype:?}: cmma requested, {ran:?} ran (auto: {auto})"
        );
        assert_eq!(
            ran == Some(CubeGemmKernel::Cmma),
            auto == CubeGemmKernel::Cmma
        );
    }
}

/// `wgrad(a, b)` and its gradients on one device.
fn wgrad_on(
    device: &Device,
    sizes: &[usize],
    (p, q): (usize, usize),
    data: (&[f64], &[f64], &[f64]),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n: usize = sizes.iter().sum();
    let g = sizes.len();
    let ad = device.clone().autodiff();
    let a = tensor(data.0.to_vec(), [n, p], &ad, DType::F32).require_grad();
    let b = tensor(data.1.to_vec(), [n, q], &ad, DType::F32).require_grad();
    let out = grouped_matmul_wgrad(a.clone(), b.clone(), &GroupSizes::Host(sizes.to_vec()))
        .expect("wgrad");
    let grads = (out.clone() * tensor(data.2.to_vec(), [g, p, q], &ad, DType::F32)).backward();
    (
        values(out),
        values(a.grad(&grads).expect("da")),
        values(b.grad(&grads).expect("db")),
    )
}

/// The wgrad op and its backward on `device` against Flex.
fn check_wgrad(device: &Device) {
    let mut rng = SplitMix::new(15);
    for (sizes, p, q) in [
        (vec![3, 0, 2], 4, 3),
        (vec![0, 100, 0, 17], 65, 70),
        (vec![0, 0], 3, 2),
    ] {
        let n: usize = sizes.iter().sum();
        let g = sizes.len();
        let (av, bv, rv) = (rng.values(n * p), rng.values(n * q), rng.values(g * p * q));
        let data = (&av[..], &bv[..], &rv[..]);
        let got = wgrad_on(device, &sizes, (p, q), data);
        let want = wgrad_on(&flex(), &sizes, (p, q), data);
        assert_close(&got.0, &want.0, 1e-5, 1e-5, "wgrad forward");
        assert_close(&got.1, &want.1, 1e-5, 1e-5, "d lhs");
        assert_close(&got.2, &want.2, 1e-5, 1e-5, "d rhs");
    }
}

#[test]
fn wgrad_op_and_its_backward_equal_flex() {
    check_wgrad(&cube());
}

#[test]
fn wgrad_op_and_its_backward_equal_flex_on_gl() {
    check_wgrad(&gl());
}

#[test]
fn sort_chunks_reproduces_spec_vector_and_inverts_in_backward() {
    let ad = cube().autodiff();
    let x = tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0], [5, 1], &ad, DType::F32).require_grad();
    let y = sort_chunks_by_idxs(x.clone(), &[1, 1, 2, 1], &[0, 2, 1, 3]).expect("sort");
    assert_eq!(values(y.clone()), vec![1.0, 3.0, 4.0, 2.0, 5.0]);
    let upstream = tensor(vec![10.0, 20.0, 30.0, 40.0, 50.0], [5, 1], &ad, DType::F32);
    let grads = (y * upstream).backward();
    assert_eq!(
        values(x.grad(&grads).expect("grad")),
        vec![10.0, 40.0, 20.0, 30.0, 50.0]
    );
    // Empty chunk, wider rows.
    let mut rng = SplitMix::new(16);
    let xv = rng.values(3 * 7);
    let run = |device: &Device| {
        let x = tensor(xv.clone(), [3, 7], device, DType::F32);
        values(sort_chunks_by_idxs(x, &[1, 1, 0, 1], &[3, 2, 1, 0]).expect("sort"))
    };
    assert_eq!(run(&cube()), run(&flex()));
}

#[test]
fn topk_indices_equal_flex_with_ties() {
    let s = tensor(
        vec![0.5, 0.5, 0.5, 0.5, 1.0, 3.0, 1.0, 3.0],
        [2, 4],
        &cube(),
        DType::F32,
    );
    assert_eq!(
        int_tensor_to_usize(topk_indices(s, 3).expect("topk")),
        vec![0, 1, 2, 1, 3, 0]
    );
    let mut rng = SplitMix::new(17);
    let (t, e) = (37, 64);
    // Quantised scores: many ties.
    let sv: Vec<f64> = rng
        .values(t * e)
        .iter()
        .map(|v| (v * 8.0).round())
        .collect();
    for k in [1, 6, 64] {
        let run = |device: &Device| {
            let s = tensor(sv.clone(), [t, e], device, DType::F32);
            int_tensor_to_usize(topk_indices(s, k).expect("topk"))
        };
        assert_eq!(run(&cube()), run(&flex()), "k = {k}");
    }
}

/// SwiGLU forward and gradients on one device.
fn swiglu_on(
    device: &Device,
    (n, f): (usize, usize),
    data: (&[f64], &[f64], &[f64]),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let ad = device.clone().autodiff();
    let h = tensor(data.0.to_vec(), [n, 2 * f], &ad, DType::F32).require_grad();
    let p = tensor(data.1.to_vec(), [n], &ad, DType::F32).require_grad();
    let z = swiglu_with_probs(h.clone(), p.clone()).expect("swiglu");
    let grads = (z.clone() * tensor(data.2.to_vec(), [n, f], &ad, DType::F32)).backward();
    (
        values(z),
        values(h.grad(&grads).expect("dh")),
        values(p.grad(&grads).expect("dp")),
    )
}

#[test]
fn swiglu_forward_and_backward_equal_flex() {
    let mut rng = SplitMix::new(18);
    for (n, f) in [(5, 3), (1, 1), (33, 130)] {
        let (hv, pv, rv) = (rng.values(n * 2 * f), rng.values(n), rng.values(n * f));
        let data = (&hv[..], &pv[..], &rv[..]);
        let got = swiglu_on(&cube(), (n, f), data);
        let want = swiglu_on(&flex(), (n, f), data);
        assert_close(&got.0, &want.0, 1e-5, 1e-6, "swiglu forward");
        assert_close(&got.1, &want.1, 1e-5, 1e-6, "swiglu d hidden");
        assert_close(&got.2, &want.2, 1e-5, 1e-5, "swiglu d probs");
    }
}

#[test]
fn attach_loss_is_identity_and_sends_constant_grad() {
    let ad = cube().autodiff();
    let x = tensor(vec![1.0, 2.0], [2], &ad, DType::F32).require_grad();
    let l_in = tensor(vec![3.0], [1], &ad, DType::F32).require_grad();
    let y = attach_loss(x.clone(), l_in.clone() * l_in.clone(), 0.5);
    assert_eq!(values(y.clone()), vec![1.0, 2.0]);
    let grads = (y * 4.0).backward();
    assert_eq!(values(x.grad(&grads).expect("dx")), vec![4.0, 4.0]);
    assert_eq!(values(l_in.grad(&grads).expect("dl")), vec![3.0]);
}

/// Outputs and input gradients of a chain of differentiable collectives on `device`, for
/// every rank of an in-process world of `world` ranks: `y = all_to_all_v(all_gather_v(x) ⊙
/// w)` (backward: all-to-all back, then reduce-scatter) and `z = all_reduce(x[..3]) ⊙ u` (identity
/// backward), each seeded with `backward()` on the full output. Also returns the number of
/// transport calls each rank's world communicator saw.
type CollectiveRun = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, u64);

fn collectives_on(device: &Device, world: usize) -> Vec<CollectiveRun> {
    use moe_backend::comm::{ReduceOp, World};
    let out = World::run(world, |ctx| {
        let comm = ctx.world()?;
        let r = ctx.rank();
        let ad = device.clone().autodiff();
        let mut rng = SplitMix::new(100 + r as u64);
        let rows = 3 + r;
        let x = tensor(rng.values(rows * 4), [rows, 4], &ad, DType::F32).require_grad();
        let (gathered, sizes) = comm.all_gather_v(x.clone())?;
        let total: usize = sizes.iter().sum();
        let w = tensor(rng.values(total * 4), [total, 4], &ad, DType::F32);
        // Every rank splits the gathered rows alike: member j gets `send[j]` of them.
        let mut send = vec![total / world; world];
        send[0] += total % world;
        let recv = vec![send[r]; world];
        let y = comm.all_to_all_v(gathered * w, &send, &recv)?;
        let up = tensor(
            rng.values(world * send[r] * 4),
            [world * send[r], 4],
            &ad,
            DType::F32,
        );
        let grads = (y.clone() * up).backward();
        let dx1 = values(x.grad(&grads).expect("x grad (all-to-all chain)"));
        let x2 = x.clone().slice([0..3, 0..4]);
        let z = comm.all_reduce(x2, ReduceOp::Sum)?;
        let u = tensor(rng.values(12), [3, 4], &ad, DType::F32);
        let grads = (z.clone() * u).backward();
        let dx2 = values(x.grad(&grads).expect("x grad (all-reduce)"));
        Ok((values(y), dx1, values(z), dx2, comm.traffic().calls))
    });
    out.into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

/// Differentiable collectives (`CollectiveOps` on the Cube backend) on the Cube device equal
/// Flex (forward and backward), for 1 and 2 in-process ranks; with one rank no collective
/// reaches the transport (no host round trip).
#[test]
fn collectives_forward_and_backward_equal_flex() {
    for world in [1, 2] {
        let got = collectives_on(&cube(), world);
        let want = collectives_on(&flex(), world);
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = |s: &str| format!("world {world} rank {rank}: {s}");
            assert_close(
                &g.0,
                &w.0,
                1e-6,
                1e-7,
                &what("all_to_all_v(all_gather_v(x) * w)"),
            );
            assert_close(&g.1, &w.1, 1e-6, 1e-7, &what("its x gradient"));
            assert_close(&g.2, &w.2, 1e-6, 1e-7, &what("all_reduce"));
            assert_close(&g.3, &w.3, 1e-6, 1e-7, &what("its x gradient"));
            if world == 1 {
                assert_eq!(g.4, 0, "{}", what("transport calls of a single rank"));
            } else {
                assert!(g.4 > 0, "{}", what("transport calls"));
            }
        }
    }
}

/// Output and `(dx, dW)` of one FP8 grouped GEMM on `device`.
fn fp8_on(
    device: &Device,
    xv: &[f64],
    wv: &[f64],
    sizes: &[usize],
    dims: (usize, usize, usize),
    upstream: &[f64],
) -> [Vec<f64>; 3] {
    use moe_backend::fp8::{Fp8Recipe, fp8_grouped_matmul};
    let (n, k, m) = dims;
    let g = sizes.len();
    let ad = device.clone().autodiff();
    let x = tensor(xv.to_vec(), [n, k], &ad, DType::F32).require_grad();
    let w = tensor(wv.to_vec(), [g, m, k], &ad, DType::F32).require_grad();
    let y =
        fp8_grouped_matmul(x.clone(), w.clone(), sizes, &Fp8Recipe::default()).expect("fp8 gemm");
    let grads = (y.clone() * tensor(upstream.to_vec(), [n, m], &ad, DType::F32)).backward();
    [
        values(y),
        values(x.grad(&grads).expect("dx")),
        values(w.grad(&grads).expect("dW")),
    ]
}

/// `Fp8Ops` on the Cube backend (device quantisation + the Cube grouped GEMM) equals Flex:
/// fprop, dgrad and wgrad, with an empty group and partial 128-blocks. The decoded FP8
/// operands are identical (`tests/cube_fp8.rs` checks them bit for bit); the GEMMs add their
/// terms in a different order, hence `1e-5` relative + `1e-5` absolute.
#[test]
fn fp8_grouped_matmul_forward_and_backward_equal_flex() {
    let mut rng = SplitMix::new(21);
    let sizes = [5, 0, 9];
    let (n, k, m) = (14, 160, 72);
    let xv = rng.values(n * k);
    let wv = rng.values(sizes.len() * m * k);
    let up = rng.values(n * m);
    let got = fp8_on(&cube(), &xv, &wv, &sizes, (n, k, m), &up);
    let want = fp8_on(&flex(), &xv, &wv, &sizes, (n, k, m), &up);
    for (i, what) in ["y", "dx", "dW"].iter().enumerate() {
        assert_close(&got[i], &want[i], 1e-5, 1e-5, &format!("fp8 {what}"));
    }
}
