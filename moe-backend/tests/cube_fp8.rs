//! `Fp8Ops` on Burn's Cube backend (device quantisation kernels + the Cube grouped GEMM) against
//! the Flex emulation (`fp8::gemm`, host codec of `fp8/formats.rs`).
//!
//! Run: `cargo test -p moe-backend --features vulkan --test cube_fp8 -- --test-threads=1` (any
//! Vulkan device; on CI Mesa's lavapipe, as `tests/cube.rs`).
//!
//! Two kinds of checks:
//! - **Quantised values, bit for bit.** With an identity operand on the other side, every
//!   output of an FP8 GEMM has exactly one non-zero product, so it is the quantised value times
//!   the (exact) decoded identity entry: the device's `dq(q(·))` is read back exactly through
//!   the public op. Sweeps of every finite FP8 code, every midpoint between adjacent codes (ties
//!   to even) and one f32 ulp either side, subnormals, underflow to ±0, saturation (blocks that
//!   hold ±inf get scale 1, so larger finite values saturate), zero blocks and random magnitudes
//!   over 40 binades, for E4M3 and E5M2, power-of-two and exact scales: the activations rowwise
//!   (fprop), the weights in `b×b` blocks (fprop with `x = I`), the output gradients rowwise
//!   (dgrad) and columnwise per group (wgrad, tiles restarting at every group, an empty group).
//!   Compared with Flex and with the host quantiser (`quantize_blockwise` /
//!   `quantize_columnwise`) with `==`.
//! - **Whole GEMMs**, random data, uneven groups with an empty one and partial blocks, forward
//!   and backward through `Autodiff`, and the dense FP8 linear (`fp8_linear`, and
//!   `fp8_linear_forward` on a Burn `Linear`, whose weight reaches the op as a transposed view):
//!   relative L2 error against Flex `≤ 1e-5` (the decoded operands are identical; only the
//!   summation order of the GEMMs differs).
#![cfg(feature = "vulkan")]

use burn::module::Param;
use burn::nn::LinearConfig;
use std::sync::OnceLock;

use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::{DType, Device, DeviceKind, Tensor, TensorData};
use moe_backend::fp8::{
    Fp8Format, Fp8Recipe, fp8_grouped_matmul, fp8_linear, fp8_linear_forward, quantize_blockwise,
    quantize_columnwise,
};

fn cube() -> Device {
    Device::vulkan(DeviceKind::DefaultDevice)
}

/// Burn's wgpu runtime pinned to OpenGL (WGSL; Mesa's llvmpipe on CI), where the grouped GEMM
/// runs its tiled shared-memory kernel (see `tests/cube.rs`).
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

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }
}

fn tensor<const D: usize>(v: &[f32], shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), (device, DType::F32))
}

fn read<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 tensor")
}

fn identity(n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    v
}

/// Asserts `got == want` elementwise (±0 equal, NaN equal to NaN), naming the first difference with its bits.
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i] != want[i] && !(got[i].is_nan() && want[i].is_nan()))
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} values differ; first at {i}: got {:e} ({:#010x}), want {:e} \
             ({:#010x})",
            bad.len(),
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// `‖a − b‖₂ / ‖b‖₂`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (f64::from(*x) - f64::from(*y)).powi(2);
        den += f64::from(*y).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The values the codec must handle in a block whose scale is 1: every finite code of
/// `format`, every midpoint between adjacent codes and one f32 ulp either side, values past
/// the largest finite code (up to 1e30; a block amax near `f32::MAX` dequantises to ±inf on
/// both backends, which the identity GEMM turns into NaN), underflow; both signs.
fn codec_values(format: Fp8Format) -> Vec<f32> {
    let max_code: u8 = match format {
        Fp8Format::E4M3 => 0x7E,
        Fp8Format::E5M2 => 0x7B,
    };
    let fmax = format.max();
    let mut v = Vec::new();
    for c in 0..=max_code {
        let a = format.decode(c);
        v.push(a);
        if c < max_code {
            let mid = (a + format.decode(c + 1)) / 2.0;
            v.extend([
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ]);
        }
    }
    let tie_above_max = match format {
        Fp8Format::E4M3 => 464.0f32,
        Fp8Format::E5M2 => 61440.0,
    };
    v.extend([
        f32::from_bits(fmax.to_bits() + 1),
        tie_above_max,
        f32::from_bits(tie_above_max.to_bits() + 1),
        fmax * 1.5,
        1e30,
        1e-30,
        f32::MIN_POSITIVE,
    ]);
    let negative: Vec<f32> = v.iter().map(|x| -x).collect();
    v.extend(negative);
    v
}

/// `[rows, width]` activations covering the codec (rows starting with ±inf: scale 1), random
/// magnitudes over 40 binades (scales of every kind), an all-zero row and one of tiny values.
fn sweep_matrix(format: Fp8Format, width: usize, rng: &mut Rng) -> (Vec<f32>, usize) {
    let mut out = Vec::new();
    for (i, chunk) in codec_values(format).chunks(width - 1).enumerate() {
        out.push(if i % 2 == 0 {
            f32::INFINITY
        } else {
            f32::NEG_INFINITY
        });
        out.extend_from_slice(chunk);
        out.resize(out.len().next_multiple_of(width), 0.0);
    }
    for _ in 0..24 {
        let base = (rng.next() % 40) as i32 - 20;
        for _ in 0..width {
            let e = base + (rng.next() % 12) as i32;
            out.push(rng.unit() * 2f32.powi(e));
        }
    }
    out.extend(std::iter::repeat_n(0.0, width));
    out.extend((0..width).map(|i| (i as f32 - 60.0) * 1e-12));
    let rows = out.len() / width;
    (out, rows)
}

/// `y = fp8_grouped_matmul(x, w)` on `device` (one group).
fn fprop(
    x: &[f32],
    w: &[f32],
    n: usize,
    k: usize,
    m: usize,
    recipe: &Fp8Recipe,
    device: &Device,
) -> Vec<f32> {
    let x = tensor(x, [n, k], device);
    let w = tensor(w, [1, m, k], device);
    read(fp8_grouped_matmul(x, w, &[n], recipe).expect("fp8 fprop"))
}

fn recipes() -> Vec<(&'static str, Fp8Recipe)> {
    vec![
        ("e4m3 pow2", Fp8Recipe::new()),
        (
            "e4m3 exact scales",
            Fp8Recipe::new().with_pow2_scales(false),
        ),
        (
            "e5m2 pow2",
            Fp8Recipe::new()
                .with_activation_format(Fp8Format::E5M2)
                .with_weight_format(Fp8Format::E5M2)
                .with_grad_format(Fp8Format::E5M2),
        ),
        (
            "e5m2 exact scales, b = 32",
            Fp8Recipe::new()
                .with_block_size(32)
                .with_pow2_scales(false)
                .with_activation_format(Fp8Format::E5M2)
                .with_weight_format(Fp8Format::E5M2)
                .with_grad_format(Fp8Format::E5M2),
        ),
    ]
}

/// The decoded value of 1 in a block whose amax is 1 (the identity operand's entries).
fn one(format: Fp8Format, recipe: &Fp8Recipe) -> f32 {
    let q = quantize_blockwise(&[1.0], 1, 1, [1, 1], format, recipe.pow2_scales).expect("q");
    q.dequantize()[0]
}

/// Activations (fprop, rowwise `1×b`) and weights (`b×b`): device `dq(q(·))` equals the host
/// quantiser and Flex bit for bit.
#[test]
fn device_quantisation_of_activations_and_weights_equals_the_host_codec() {
    let mut rng = Rng(7);
    for (name, recipe) in recipes() {
        let b = recipe.block_size;
        // Activations: x [n, k] · Iᵀ = dq(q(x)) · one.
        let k = 160;
        let (x, n) = sweep_matrix(recipe.activation_format, k, &mut rng);
        let eye = identity(k);
        let got = fprop(&x, &eye, n, k, k, &recipe, &cube());
        let flex_y = fprop(&x, &eye, n, k, k, &recipe, &flex());
        let d = one(recipe.weight_format, &recipe);
        let host: Vec<f32> = quantize_blockwise(
            &x,
            n,
            k,
            [1, b],
            recipe.activation_format,
            recipe.pow2_scales,
        )
        .expect("host quantise")
        .dequantize()
        .iter()
        .map(|v| v * d)
        .collect();
        assert_same(
            &got,
            &host,
            &format!("{name}: activations vs host quantiser"),
        );
        assert_same(&got, &flex_y, &format!("{name}: activations vs Flex"));

        // Weights: I · dq(q(W))ᵀ = dq(q(W))ᵀ · one; W [m, k] with m, k over several blocks.
        let (m, k) = (200, 160);
        let (sweep, _) = sweep_matrix(recipe.weight_format, k, &mut rng);
        let w: Vec<f32> = sweep.iter().copied().cycle().take(m * k).collect();
        let eye = identity(k);
        let got = fprop(&eye, &w, k, k, m, &recipe, &cube());
        let flex_y = fprop(&eye, &w, k, k, m, &recipe, &flex());
        let d = one(recipe.activation_format, &recipe);
        let wq = quantize_blockwise(&w, m, k, [b, b], recipe.weight_format, recipe.pow2_scales)
            .expect("host quantise")
            .dequantize();
        let host: Vec<f32> = (0..k * m)
            .map(|idx| wq[(idx % m) * k + idx / m] * d)
            .collect();
        assert_same(&got, &host, &format!("{name}: weights vs host quantiser"));
        assert_same(&got, &flex_y, &format!("{name}: weights vs Flex"));
    }
}

/// `(y, dx, dW)` of `fp8_grouped_matmul` on `device` with upstream gradient `up`.
#[allow(clippy::too_many_arguments)]
fn grouped_on(
    device: &Device,
    x: &[f32],
    w: &[f32],
    up: &[f32],
    sizes: &[usize],
    (n, k, m): (usize, usize, usize),
    recipe: &Fp8Recipe,
) -> [Vec<f32>; 3] {
    let ad = device.clone().autodiff();
    let xt = tensor(x, [n, k], &ad).require_grad();
    let wt = tensor(w, [sizes.len(), m, k], &ad).require_grad();
    let y = fp8_grouped_matmul(xt.clone(), wt.clone(), sizes, recipe).expect("fp8 gemm");
    let grads = (y.clone() * tensor(up, [n, m], &ad)).backward();
    [
        read(y),
        read(xt.grad(&grads).expect("dx")),
        read(wt.grad(&grads).expect("dW")),
    ]
}

/// Output gradients: rowwise in dgrad (`dx = dq(q(dy)) · I`) and columnwise per group in wgrad
/// (`x_g` = distinct unit rows, so `dW_g[:, k(t)] = dq(q_col(dy_g))[t, :]`), device = host
/// quantiser = Flex bit for bit, with tiles restarting at every group and an empty group.
#[test]
fn device_quantisation_of_gradients_rowwise_and_columnwise_equals_the_host_codec() {
    let mut rng = Rng(11);
    for (name, recipe) in recipes() {
        let b = recipe.block_size;
        let m = 160; // = k: W is the identity
        let k = m;
        let sizes = [150, 0, 100, 7];
        let n: usize = sizes.iter().sum();
        let (sweep, _) = sweep_matrix(recipe.grad_format, m, &mut rng);
        let up: Vec<f32> = sweep.iter().copied().cycle().take(n * m).collect();
        // Row t of group g is the unit vector e_{(t - start_g) mod k}.
        let mut x = vec![0f32; n * k];
        let mut start = 0;
        for &s in &sizes {
            for t in start..start + s {
                x[t * k + (t - start) % k] = 1.0;
            }
            start += s;
        }
        let w: Vec<f32> = (0..sizes.len()).flat_map(|_| identity(k)).collect();
        let dims = (n, k, m);
        let [y, dx, dw] = grouped_on(&cube(), &x, &w, &up, &sizes, dims, &recipe);
        let [fy, fdx, fdw] = grouped_on(&flex(), &x, &w, &up, &sizes, dims, &recipe);
        assert_same(&y, &fy, &format!("{name}: y vs Flex"));
        assert_same(&dx, &fdx, &format!("{name}: dx vs Flex"));
        assert_same(&dw, &fdw, &format!("{name}: dW vs Flex"));

        // Host: dx = dq(q_row(dy)) · one(weight).
        let d_w = one(recipe.weight_format, &recipe);
        let host_dx: Vec<f32> =
            quantize_blockwise(&up, n, m, [1, b], recipe.grad_format, recipe.pow2_scales)
                .expect("host quantise")
                .dequantize()
                .iter()
                .map(|v| v * d_w)
                .collect();
        assert_same(
            &dx,
            &host_dx,
            &format!("{name}: dgrad operand vs host quantiser"),
        );

        // Host: dW_g[j, (t - start) mod k] = dq(q_col(dy_g))[j, t] · one(activation).
        let d_x = one(recipe.activation_format, &recipe);
        let mut host_dw = vec![0f32; sizes.len() * m * k];
        let mut start = 0;
        for (g, &s) in sizes.iter().enumerate() {
            let q = quantize_columnwise(
                &up[start * m..(start + s) * m],
                s,
                m,
                b,
                recipe.grad_format,
                recipe.pow2_scales,
            )
            .expect("host quantise")
            .dequantize(); // [m, s]
            for j in 0..m {
                for t in 0..s {
                    host_dw[g * m * k + j * k + t % k] += q[j * s + t] * d_x;
                }
            }
            start += s;
        }
        assert_same(
            &dw,
            &host_dw,
            &format!("{name}: wgrad operands vs host quantiser"),
        );
    }
}

/// Random data: fprop, dgrad and wgrad through `Autodiff` on `device` equal Flex within
/// relative L2 `1e-5`, for uneven groups with an empty one, partial blocks, every recipe
/// variant.
fn check_grouped(device: &Device) {
    let mut rng = Rng(21);
    for (name, recipe) in recipes() {
        for (sizes, k, m) in [
            (vec![37, 0, 150, 5], 160, 200),
            (vec![0, 9], 40, 24),
            (vec![130], 256, 128),
        ] {
            let n: usize = sizes.iter().sum();
            let x = rng.values(n * k);
            let w: Vec<f32> = rng
                .values(sizes.len() * m * k)
                .iter()
                .map(|v| v * 0.1)
                .collect();
            let up = rng.values(n * m);
            let got = grouped_on(device, &x, &w, &up, &sizes, (n, k, m), &recipe);
            let want = grouped_on(&flex(), &x, &w, &up, &sizes, (n, k, m), &recipe);
            for (i, what) in ["y", "dx", "dW"].iter().enumerate() {
                let err = rel_l2(&got[i], &want[i]);
                assert!(
                    err <= 1e-5,
                    "{name} sizes {sizes:?} k {k} m {m}: {what} relative L2 {err:e}"
                );
            }
        }
    }
}

#[test]
fn grouped_forward_and_backward_equal_flex() {
    check_grouped(&cube());
}

/// The same on OpenGL (WGSL), where the grouped GEMM runs its tiled kernel.
#[test]
fn grouped_forward_and_backward_equal_flex_on_gl() {
    check_grouped(&gl());
}

/// `(y, dx, dW)` of the dense FP8 linears on `device`: `fp8_linear` (`[M, K]` weight) and
/// `fp8_linear_forward` (a Burn `Linear`, weight `[K, M]` reaching the op as a transposed
/// view), both with upstream `up`.
fn dense_on(
    device: &Device,
    x: &[f32],
    w: &[f32],
    up: &[f32],
    (n, k, m): (usize, usize, usize),
) -> Vec<Vec<f32>> {
    let ad = device.clone().autodiff();
    let recipe = Fp8Recipe::new();
    let xt = tensor(x, [n, k], &ad).require_grad();
    let wt = tensor(w, [m, k], &ad).require_grad();
    let y = fp8_linear(xt.clone(), wt.clone(), &recipe).expect("fp8 linear");
    let grads = (y.clone() * tensor(up, [n, m], &ad)).backward();
    let mut out = vec![
        read(y),
        read(xt.grad(&grads).expect("dx")),
        read(wt.grad(&grads).expect("dW")),
    ];
    // The same weight as a Burn Linear ([in, out]).
    let mut linear = LinearConfig::new(k, m).with_bias(false).init(&ad);
    let w_in_out: Vec<f32> = (0..k * m).map(|i| w[(i % m) * k + i / m]).collect();
    linear.weight = Param::from_tensor(tensor(&w_in_out, [k, m], &ad));
    let xt = tensor(x, [n, k], &ad).require_grad();
    let y = fp8_linear_forward(&linear, xt.clone(), &recipe);
    let grads = (y.clone() * tensor(up, [n, m], &ad)).backward();
    out.extend([
        read(y),
        read(xt.grad(&grads).expect("dx")),
        read(linear.weight.val().grad(&grads).expect("dW")),
    ]);
    out
}

/// The dense FP8 linear (one group) forward and backward equal Flex within relative L2 `1e-5`.
#[test]
fn dense_fp8_linear_forward_and_backward_equal_flex() {
    let mut rng = Rng(5);
    let (n, k, m) = (33, 200, 144);
    let x = rng.values(n * k);
    let w = rng.values(m * k);
    let up = rng.values(n * m);
    let got = dense_on(&cube(), &x, &w, &up, (n, k, m));
    let want = dense_on(&flex(), &x, &w, &up, (n, k, m));
    let names = [
        "fp8_linear y",
        "fp8_linear dx",
        "fp8_linear dW",
        "fp8_linear_forward y",
        "fp8_linear_forward dx",
        "fp8_linear_forward dW",
    ];
    for (i, what) in names.iter().enumerate() {
        let err = rel_l2(&got[i], &want[i]);
        assert!(err <= 1e-5, "{what}: relative L2 {err:e}");
    }
}
