//! Naive reference implementations for tests (plain loops over `f32` slices, accumulated in
//! `f64`). Compiled for this crate's tests and, with the `testing` feature, for other crates'.
//!
//! Weights use the checkpoint (PyTorch) layout `[out, in]`, row-major, so these functions are
//! independent of how Burn modules store them.

/// HF RMSNorm of each row of `x` (`cols` values per row): `w[j] · x[j] / sqrt(mean(x²) + eps)`.
///
/// # Panics
///
/// If `x.len()` is not a multiple of `cols` or `weight.len() != cols`.
pub fn rms_norm(x: &[f32], cols: usize, weight: &[f32], eps: f64) -> Vec<f32> {
    assert_eq!(weight.len(), cols, "weight length must equal cols");
    assert_eq!(x.len() % cols, 0, "x length must be a multiple of cols");
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let mean_sq = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / cols as f64;
        let inv_rms = 1.0 / (mean_sq + eps).sqrt();
        for (&v, &w) in row.iter().zip(weight) {
            out.push((f64::from(v) * inv_rms * f64::from(w)) as f32);
        }
    }
    out
}

/// `y = x · wᵀ` for `x` `[T, in]` and `w` `[out, in]`, giving `[T, out]`.
///
/// # Panics
///
/// If the lengths are inconsistent with `inp`.
pub fn linear(x: &[f32], inp: usize, w: &[f32]) -> Vec<f32> {
    assert_eq!(x.len() % inp, 0, "x length must be a multiple of in");
    assert_eq!(w.len() % inp, 0, "w length must be a multiple of in");
    let mut out = Vec::with_capacity(x.len() / inp * (w.len() / inp));
    for row in x.chunks(inp) {
        for w_row in w.chunks(inp) {
            let dot: f64 = row
                .iter()
                .zip(w_row)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            out.push(dot as f32);
        }
    }
    out
}

/// `silu(v) = v · sigmoid(v)`.
pub fn silu(v: f32) -> f32 {
    let v = f64::from(v);
    (v / (1.0 + (-v).exp())) as f32
}

/// Dense SwiGLU MLP `down(silu(gate(x)) ⊙ up(x))` for `x` `[T, hidden]`, with
/// `gate`, `up` `[I, hidden]` and `down` `[hidden, I]`.
///
/// # Panics
///
/// If the weight lengths are inconsistent with `hidden`.
pub fn swiglu_mlp(x: &[f32], hidden: usize, gate: &[f32], up: &[f32], down: &[f32]) -> Vec<f32> {
    let g = linear(x, hidden, gate);
    let u = linear(x, hidden, up);
    let act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
    let inter = gate.len() / hidden;
    linear(&act, inter, down)
}
