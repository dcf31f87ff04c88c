//! Reference implementations and helpers for tests (feature `testing`).
//!
//! The references are written with plain Burn tensor ops and per-expert / per-group loops, the way
//! docs/routing-and-dispatch.md states each operation, independent of the [`crate::ops`] kernels
//! they check.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

/// SplitMix64: a tiny deterministic generator so tests need no RNG dependency.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// New generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next raw 64-bit value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in `[-1, 1)`.
    pub fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.uniform(-1.0, 1.0)).collect()
    }

    /// `k` distinct values of `0..n` in random order.
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    /// A uniformly chosen element of `items` (non-empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// xorshift64 (Marsaglia's `13, 7, 17` triple): the token-id stream of the integration tests.
///
/// The state is used as given (no seed mixing), so a test keeps its exact stream by passing the
/// same initial state; it must not be zero. [`SplitMix`] is the generator for new tests.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// New generator starting from `state` (non-zero).
    pub fn new(state: u64) -> Self {
        Self(state)
    }

    /// Next raw 64-bit value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value reduced modulo `n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `n` token ids in `0..vocab`: `next_u64() % vocab` each.
    pub fn ids(&mut self, n: usize, vocab: usize) -> Vec<i64> {
        (0..n).map(|_| self.below(vocab as u64) as i64).collect()
    }
}

/// Redraws the float parameters of a module from a [`SplitMix`] stream (see [`redraw`]).
struct Redraw {
    rng: SplitMix,
    half_width: f64,
}

impl ModuleMapper for Redraw {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            let (dtype, device, grad) = (t.dtype(), t.device(), t.is_require_grad());
            let shape: [usize; D] = t.shape().dims();
            let old = values(t.clone());
            if old.iter().all(|&v| v == old[0]) {
                return t;
            }
            let new = self.rng.values(old.len());
            let new = new.into_iter().map(|u| u * self.half_width).collect();
            let fresh = tensor(new, shape, &device, dtype);
            if grad { fresh.require_grad() } else { fresh }
        })
    }
}

/// `module` with every float parameter that its initialiser drew at random replaced by values
/// drawn uniformly with standard deviation `std` from `SplitMix::new(seed)` (parameters whose
/// values are all equal, such as zero biases or unit norm weights, are kept). Parameter ids,
/// dtypes, devices and `require_grad` are kept.
///
/// Burn's initialisers draw from a process-wide generator that tests running at once share, so
/// a test built on `init` alone sees different weights on every run; this makes its weights, and
/// so its tolerances, reproducible.
pub fn redraw<M: Module>(module: M, seed: u64, std: f64) -> M {
    module.map(&mut Redraw {
        rng: SplitMix::new(seed),
        half_width: std * 3f64.sqrt(),
    })
}

/// A float tensor of `dtype` from f64 values.
pub fn tensor<const D: usize>(
    values: Vec<f64>,
    shape: [usize; D],
    device: &Device,
    dtype: DType,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), (device, dtype))
}

/// An `i32` int tensor from host values.
pub fn int_tensor<const D: usize>(
    values: Vec<i64>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Int> {
    let v: Vec<i32> = values.into_iter().map(|x| x as i32).collect();
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// A tensor's values as f64.
pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data()
        .convert::<f64>()
        .try_into_vec::<f64>()
        .unwrap_or_else(|e| panic!("cannot read tensor: {e:?}"))
}

/// Asserts `|a - b| <= atol + rtol·|b|` elementwise, naming `what` and the first bad index.
pub fn assert_close(a: &[f64], b: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(
        a.len(),
        b.len(),
        "{what}: length {} vs {}",
        a.len(),
        b.len()
    );
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = atol + rtol * y.abs();
        assert!(
            (x - y).abs() <= tol || (x.is_nan() && y.is_nan()),
            "{what}: index {i}: {x} vs {y} (tol {tol})"
        );
    }
}

/// Reference permute: rows expert-major, ascending token index within each expert, built with
/// one `select` per expert. Returns the rows and the token index of every row.
pub fn reference_permute(
    tokens: Tensor<2>,
    routing_map: &[bool],
    num_experts: usize,
) -> (Tensor<2>, Vec<usize>) {
    let [t, h] = tokens.dims();
    let device = tokens.device();
    let mut parts = Vec::new();
    let mut sorted = Vec::new();
    for e in 0..num_experts {
        let idx: Vec<usize> = (0..t)
            .filter(|&tok| routing_map[tok * num_experts + e])
            .collect();
        if idx.is_empty() {
            continue;
        }
        let it = int_tensor(
            idx.iter().map(|&i| i as i64).collect(),
            [idx.len()],
            &device,
        );
        parts.push(tokens.clone().select(0, it));
        sorted.extend(idx);
    }
    let rows = if parts.is_empty() {
        Tensor::<2>::zeros([0, h], (&device, tokens.dtype()))
    } else {
        Tensor::cat(parts, 0)
    };
    (rows, sorted)
}

/// Reference unpermute: `out[t] = Σ_{r: idx[r] = t} rows[r] · p_r`, one `slice` + add per row.
pub fn reference_unpermute(
    rows: Tensor<2>,
    sorted_indices: &[usize],
    probs: Option<Tensor<1>>,
    num_tokens: usize,
) -> Tensor<2> {
    let [n, h] = rows.dims();
    let device = rows.device();
    let mut out = Tensor::<2>::zeros([num_tokens, h], (&device, rows.dtype()));
    for (r, &tok) in sorted_indices.iter().enumerate().take(n) {
        let mut row = rows.clone().slice([r..r + 1, 0..h]);
        if let Some(p) = &probs {
            row = row * p.clone().slice(r..r + 1).reshape([1, 1]);
        }
        let cur = out.clone().slice([tok..tok + 1, 0..h]);
        out = out.slice_assign([tok..tok + 1, 0..h], cur + row);
    }
    out
}

/// Reference grouped GEMM: one `matmul` per non-empty group, concatenated.
/// `out_in = true`: `w [G, M, K]`, `Y_g = X_g W_gᵀ`; else `w [G, K, M]`, `Y_g = X_g W_g`.
pub fn reference_grouped_matmul(
    x: Tensor<2>,
    w: Tensor<3>,
    sizes: &[usize],
    out_in: bool,
) -> Tensor<2> {
    let [g, a, b] = w.dims();
    let m = if out_in { a } else { b };
    let device = x.device();
    let mut parts = Vec::new();
    let mut row = 0;
    for (group, &s) in sizes.iter().enumerate().take(g) {
        if s == 0 {
            continue;
        }
        let xg = x.clone().slice(row..row + s);
        let wg = w.clone().slice(group..group + 1).reshape([a, b]);
        let wg = if out_in { wg.transpose() } else { wg };
        parts.push(xg.matmul(wg));
        row += s;
    }
    if parts.is_empty() {
        Tensor::<2>::zeros([0, m], (&device, x.dtype()))
    } else {
        Tensor::cat(parts, 0)
    }
}

/// Central finite-difference gradient of `f` at `x` (evaluated in f64 on the host values).
pub fn finite_difference<F: Fn(&[f64]) -> f64>(f: F, x: &[f64], eps: f64) -> Vec<f64> {
    let mut probe = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = probe[i];
            probe[i] = orig + eps;
            let plus = f(&probe);
            probe[i] = orig - eps;
            let minus = f(&probe);
            probe[i] = orig;
            (plus - minus) / (2.0 * eps)
        })
        .collect()
}

/// A fresh directory under `std::env::temp_dir()`, removed (with its contents) on drop: what
/// the crates' file-writing tests work in.
#[derive(Debug)]
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// Creates `<tmp>/moe-<tag>-<pid>-<n>-<nanos>`.
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("moe-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// `self.path().join(name)`.
    pub fn join(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::XorShift64;

    /// The stream many tests' token ids are drawn from: pinned so an edit cannot silently
    /// change every caller's data (values from an independent Python implementation).
    #[test]
    fn xorshift64_stream_is_pinned() {
        let mut rng = XorShift64::new(0x2545_f491_4f6c_dd1d);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            first,
            [
                0x7f6c_280b_eaa8_e3e7,
                0xe471_1987_1cf9_abe0,
                0x3517_4a41_58b8_a0b7
            ]
        );
        let mut rng = XorShift64::new(0x2545_f491_4f6c_dd1d);
        assert_eq!(
            rng.ids(2, 1000),
            [(0x7f6c_280b_eaa8_e3e7u64 % 1000) as i64, 408]
        );
    }
}
