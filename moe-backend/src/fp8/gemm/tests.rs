//! FP8 grouped GEMMs against a naive reference: quantise → dequantise with an independent
//! fake-quant (per-block amax loop, the scale formula of docs/fp8.md §Scaling, the `float8` crate's
//! E4M3 codec), then an f64 triple-loop product.
//!
//! Tolerance: the kernel accumulates the same dequantised products in f32 in a different
//! order, so `|y − ref| ≤ K·2⁻²³·Σₖ|aₖ·bₖ|` (recursive-summation bound γ_K with u = 2⁻²⁴,
//! doubled for the per-K-block partial sums), plus 1e-30 for exact zeros.

use burn::tensor::{DType, Device, Tensor};

use super::*;
use crate::fp8::{Fp8Format, fp8_grouped_matmul, fp8_linear};
use crate::testing::{SplitMix, tensor, values};

/// Fake-quantised `[rows, cols]` (row-major) with `[b0, b1]` blocks, E4M3, in f64.
fn fake_quant(x: &[f32], rows: usize, cols: usize, block: [usize; 2], pow2: bool) -> Vec<f64> {
    let [b0, b1] = block;
    let mut out = vec![0f64; x.len()];
    for bi in 0..rows.div_ceil(b0) {
        for bj in 0..cols.div_ceil(b1) {
            let r = bi * b0..((bi + 1) * b0).min(rows);
            let c = bj * b1..((bj + 1) * b1).min(cols);
            let mut amax = 0f32;
            for i in r.clone() {
                for j in c.clone() {
                    amax = amax.max(x[i * cols + j].abs());
                }
            }
            let mut scale = if amax == 0.0 { 1.0 } else { 448.0 / amax };
            if pow2 {
                scale = 2f32.powi(scale.log2().floor() as i32);
            }
            for i in r.clone() {
                for j in c.clone() {
                    let q = float8::F8E4M3::from_f32(x[i * cols + j] * scale).to_f32();
                    out[i * cols + j] = f64::from(q * (1.0 / scale));
                }
            }
        }
    }
    out
}

/// Rows `r0..r1` of a row-major matrix with `cols` columns.
fn rows_of(x: &[f32], cols: usize, r0: usize, r1: usize) -> &[f32] {
    &x[r0 * cols..r1 * cols]
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|j| (0..rows).map(move |i| x[i * cols + j]))
        .collect()
}

/// `a [p, k] · b [q, k]ᵀ` in f64, with `Σ|a·b|` per element.
fn matmul_tn(a: &[f64], b: &[f64], p: usize, q: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0f64; p * q];
    let mut mag = vec![0f64; p * q];
    for i in 0..p {
        for j in 0..q {
            for kk in 0..k {
                let v = a[i * k + kk] * b[j * k + kk];
                out[i * q + j] += v;
                mag[i * q + j] += v.abs();
            }
        }
    }
    (out, mag)
}

fn check(got: &[f64], want: &[f64], mag: &[f64], k: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let u = (k.max(1) as f64) * 2f64.powi(-23);
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        assert!(
            (g - w).abs() <= u * m + 1e-30,
            "{what}[{i}]: {g} vs {w} (Σ|ab| {m})"
        );
    }
}

fn random(n: usize, rng: &mut SplitMix, outlier_every: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = rng.uniform(-1.0, 1.0) as f32;
            if i % outlier_every == 7 { v * 300.0 } else { v }
        })
        .collect()
}

/// References for one grouped problem: `(y, |y|), (dx, |dx|), (dW, |dW|)`.
#[allow(clippy::type_complexity)]
fn references(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    sizes: &[usize],
    (k, m): (usize, usize),
    pow2: bool,
) -> [(Vec<f64>, Vec<f64>); 3] {
    let mut y = (Vec::new(), Vec::new());
    let mut dx = (Vec::new(), Vec::new());
    let mut dw = (Vec::new(), Vec::new());
    let mut r0 = 0;
    for (g, &s) in sizes.iter().enumerate() {
        let (r1, wg) = (r0 + s, &w[g * m * k..(g + 1) * m * k]);
        let wq = fake_quant(wg, m, k, [128, 128], pow2);
        let xq = fake_quant(rows_of(x, k, r0, r1), s, k, [1, 128], pow2);
        let (yg, yg_mag) = matmul_tn(&xq, &wq, s, m, k);
        y.0.extend(yg);
        y.1.extend(yg_mag);
        // dgrad: dy rowwise 1x128 along M, times Wᵀ quantised as W (blocks are symmetric).
        let dyq = fake_quant(rows_of(dy, m, r0, r1), s, m, [1, 128], pow2);
        let wq32: Vec<f32> = wq.iter().map(|&v| v as f32).collect();
        let wt = transpose(&wq32, m, k)
            .into_iter()
            .map(f64::from)
            .collect::<Vec<_>>();
        let (dxg, dxg_mag) = matmul_tn(&dyq, &wt, s, k, m);
        dx.0.extend(dxg);
        dx.1.extend(dxg_mag);
        // wgrad: dy_gᵀ and x_gᵀ quantised in 1x128 tiles along the group's tokens.
        let dyt = fake_quant(
            &transpose(rows_of(dy, m, r0, r1), s, m),
            m,
            s,
            [1, 128],
            pow2,
        );
        let xt = fake_quant(
            &transpose(rows_of(x, k, r0, r1), s, k),
            k,
            s,
            [1, 128],
            pow2,
        );
        let (dwg, dwg_mag) = matmul_tn(&dyt, &xt, m, k, s);
        dw.0.extend(dwg);
        dw.1.extend(dwg_mag);
        r0 = r1;
    }
    [y, dx, dw]
}

fn as_f64(v: Vec<f32>) -> Vec<f64> {
    v.into_iter().map(f64::from).collect()
}

/// Ragged and empty groups; K = 200 and M = 150 cut the last 128-blocks; a 130-row group
/// cuts the last wgrad token tile.
#[test]
fn kernels_equal_the_fake_quant_reference_for_ragged_groups_and_partial_blocks() {
    let mut rng = SplitMix::new(7);
    let (k, m) = (200, 150);
    let sizes = [0usize, 5, 130, 0, 1];
    let n: usize = sizes.iter().sum();
    let x = random(n * k, &mut rng, 331);
    let w = random(sizes.len() * m * k, &mut rng, 4001);
    let dy = random(n * m, &mut rng, 97);
    for pow2 in [true, false] {
        let recipe = Fp8Recipe::new().with_pow2_scales(pow2);
        let [y, dx, dw] = references(&x, &w, &dy, &sizes, (k, m), pow2);
        let got = fp8_grouped_fprop(&x, k, &w, m, &sizes, &recipe).unwrap();
        check(&as_f64(got), &y.0, &y.1, k, "fprop");
        let got = fp8_grouped_dgrad(&dy, m, &w, k, &sizes, &recipe).unwrap();
        check(&as_f64(got), &dx.0, &dx.1, m, "dgrad");
        let got = fp8_grouped_wgrad(&dy, m, &x, k, &sizes, &recipe).unwrap();
        check(&as_f64(got.clone()), &dw.0, &dw.1, 130, "wgrad");
        // Empty groups get an all-zero weight gradient.
        assert!(got[0..m * k].iter().all(|&v| v == 0.0));
        assert!(got[3 * m * k..4 * m * k].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn kernels_reject_inconsistent_sizes() {
    let recipe = Fp8Recipe::new();
    assert!(fp8_grouped_fprop(&[0.0; 6], 3, &[0.0; 6], 2, &[1, 0], &recipe).is_err());
    assert!(fp8_grouped_fprop(&[0.0; 6], 3, &[0.0; 5], 2, &[2], &recipe).is_err());
    assert!(fp8_grouped_wgrad(&[0.0; 4], 2, &[0.0; 6], 3, &[1, 2], &recipe).is_err());
    let bad = Fp8Recipe::new().with_block_size(0);
    assert!(fp8_grouped_fprop(&[0.0; 6], 3, &[0.0; 6], 2, &[2], &bad).is_err());
    let empty = fp8_grouped_fprop(&[], 0, &[], 4, &[0, 0], &recipe).unwrap();
    assert!(empty.is_empty());
}

/// Through the backend extension with autodiff (f32 and bf16 tensors): the output and both
/// gradients of `L = Σ y ⊙ R` (so `dy = R`) equal the references.
#[test]
fn autodiff_fp8_grouped_matmul_gives_fp8_dgrad_and_wgrad() {
    let device = Device::flex().autodiff();
    let mut rng = SplitMix::new(19);
    let (k, m) = (136, 40);
    let sizes = [3usize, 0, 140];
    let n: usize = sizes.iter().sum();
    let x = random(n * k, &mut rng, 53);
    let w = random(sizes.len() * m * k, &mut rng, 1009);
    let r = random(n * m, &mut rng, 29);
    let recipe = Fp8Recipe::new();
    let [y_ref, dx_ref, dw_ref] = references(&x, &w, &r, &sizes, (k, m), true);
    let xt = tensor(as_f64(x.clone()), [n, k], &device, DType::F32).require_grad();
    let wt = tensor(as_f64(w.clone()), [sizes.len(), m, k], &device, DType::F32).require_grad();
    let rt = tensor(as_f64(r.clone()), [n, m], &device, DType::F32);
    let y = fp8_grouped_matmul(xt.clone(), wt.clone(), &sizes, &recipe).unwrap();
    check(&values(y.clone()), &y_ref.0, &y_ref.1, k, "y");
    let grads = (y * rt).sum().backward();
    let dx: Tensor<2> = xt.grad(&grads).expect("dx");
    let dw: Tensor<3> = wt.grad(&grads).expect("dW");
    check(&values(dx), &dx_ref.0, &dx_ref.1, m, "dx");
    check(&values(dw), &dw_ref.0, &dw_ref.1, 140, "dW");

    // bf16 tensors: the inputs are bf16-exact reals, so the FP8 math is identical and only the
    // output is rounded once to bf16 (relative 2⁻⁸ of the f32 result).
    let xb = tensor(as_f64(x), [n, k], &device, DType::BF16);
    let xb32: Vec<f32> = values(xb.clone()).into_iter().map(|v| v as f32).collect();
    let wb = tensor(as_f64(w.clone()), [sizes.len(), m, k], &device, DType::F32);
    let yb = fp8_grouped_matmul(xb, wb, &sizes, &recipe).unwrap();
    let [y_ref_b, _, _] = references(&xb32, &w, &r, &sizes, (k, m), true);
    for (i, (g, want)) in values(yb).iter().zip(&y_ref_b.0).enumerate() {
        let tol = want.abs() * 2f64.powi(-8) + (k as f64) * 2f64.powi(-23) * y_ref_b.1[i];
        assert!(
            (g - want).abs() <= tol + 1e-30,
            "bf16 y[{i}]: {g} vs {want}"
        );
    }
}

#[test]
fn fp8_linear_is_a_one_group_gemm_and_inputs_are_validated() {
    let device = Device::flex();
    let mut rng = SplitMix::new(3);
    let (n, k, m) = (9, 260, 7);
    let x = random(n * k, &mut rng, 1000);
    let w = random(m * k, &mut rng, 1000);
    let recipe = Fp8Recipe::new().with_pow2_scales(false);
    let [y_ref, _, _] = references(&x, &w, &vec![0.0; n * m], &[n], (k, m), false);
    let xt = tensor(as_f64(x), [n, k], &device, DType::F32);
    let wt = tensor(as_f64(w), [m, k], &device, DType::F32);
    let y = fp8_linear(xt.clone(), wt.clone(), &recipe).unwrap();
    check(&values(y), &y_ref.0, &y_ref.1, k, "linear");
    let w3: Tensor<3> = wt.clone().unsqueeze_dim(0);
    assert!(fp8_grouped_matmul(xt.clone(), w3.clone(), &[n - 1], &recipe).is_err());
    assert!(fp8_grouped_matmul(xt.clone(), w3.clone(), &[n, 0], &recipe).is_err());
    let bad = Fp8Recipe::new().with_block_size(0);
    assert!(fp8_grouped_matmul(xt, w3, &[n], &bad).is_err());
    // E5M2 gradients are accepted (hybrid recipe).
    let _ = Fp8Recipe::new().with_grad_format(Fp8Format::E5M2);
}

/// A Burn `Linear` (weight `[in, out]`, bias) on a `[B, S, in]` input: the output is the
/// fake-quant product of the canonical `[out, in]` weight plus the f32 bias, and the gradients
/// are the FP8 dgrad / wgrad references (bias: the plain column sums of `dy`).
#[test]
fn fp8_linear_forward_runs_a_burn_linear_with_bias_and_gradients() {
    use burn::module::Param;
    use burn::nn::LinearConfig;

    let device = Device::flex().autodiff();
    let mut rng = SplitMix::new(41);
    let (b, s, k, m) = (2, 5, 140, 12);
    let n = b * s;
    let x = random(n * k, &mut rng, 77);
    let w_out_in = random(m * k, &mut rng, 501);
    let bias = random(m, &mut rng, 1000);
    let r = random(n * m, &mut rng, 31);
    let mut linear = LinearConfig::new(k, m).init(&device);
    let w_in_out = transpose(&w_out_in, m, k);
    linear.weight =
        Param::from_tensor(tensor(as_f64(w_in_out), [k, m], &device, DType::F32).require_grad());
    linear.bias = Some(Param::from_tensor(
        tensor(as_f64(bias.clone()), [m], &device, DType::F32).require_grad(),
    ));
    let recipe = Fp8Recipe::new();
    let [y_ref, dx_ref, dw_ref] = references(&x, &w_out_in, &r, &[n], (k, m), true);
    let xt = tensor(as_f64(x), [n, k], &device, DType::F32)
        .reshape([b, s, k])
        .require_grad();
    let y = crate::fp8::fp8_linear_forward(&linear, xt.clone(), &recipe);
    assert_eq!(y.dims(), [b, s, m]);
    let with_bias: Vec<f64> = y_ref
        .0
        .iter()
        .enumerate()
        .map(|(i, v)| v + f64::from(bias[i % m]))
        .collect();
    let mag: Vec<f64> = y_ref
        .1
        .iter()
        .enumerate()
        .map(|(i, v)| v + f64::from(bias[i % m].abs()))
        .collect();
    check(
        &values(y.clone().reshape([n, m])),
        &with_bias,
        &mag,
        k + 1,
        "y",
    );
    let rt = tensor(as_f64(r.clone()), [n, m], &device, DType::F32).reshape([b, s, m]);
    let grads = (y * rt).sum().backward();
    let dx: Tensor<3> = xt.grad(&grads).expect("dx");
    check(&values(dx.reshape([n, k])), &dx_ref.0, &dx_ref.1, m, "dx");
    // dW of the [in, out] parameter is the transpose of the canonical [out, in] wgrad.
    let dw: Tensor<2> = linear.weight.val().grad(&grads).expect("dW");
    let dw_canon = transpose(
        &values(dw).into_iter().map(|v| v as f32).collect::<Vec<_>>(),
        k,
        m,
    );
    check(&as_f64(dw_canon), &dw_ref.0, &dw_ref.1, n, "dW");
    let db: Tensor<1> = linear
        .bias
        .as_ref()
        .unwrap()
        .val()
        .grad(&grads)
        .expect("db");
    let db_ref: Vec<f64> = (0..m)
        .map(|j| (0..n).map(|i| f64::from(r[i * m + j])).sum())
        .collect();
    let db_mag: Vec<f64> = (0..m)
        .map(|j| (0..n).map(|i| f64::from(r[i * m + j].abs())).sum())
        .collect();
    check(&values(db), &db_ref, &db_mag, n, "db");
}
