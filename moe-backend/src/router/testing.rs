//! Host-side helpers and naive references for the router tests (feature `testing`).
//!
//! The references are plain loops over host `f64` values written from the formulas of
//! docs/routing-and-dispatch.md.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

/// An f64 tensor from host values.
pub fn f64_tensor<const D: usize>(values: &[f64], shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), shape),
        (device, DType::F64),
    )
}

/// Float tensor values as f64.
pub fn host_f64<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data().try_into_vec_as::<f64>().expect("float data")
}

/// Int tensor values as usize.
pub fn host_usize<const D: usize>(t: Tensor<D, Int>) -> Vec<usize> {
    crate::ops::int_tensor_to_usize(t)
}

/// Bool tensor values.
pub fn host_bool<const D: usize>(t: Tensor<D, Bool>) -> Vec<bool> {
    host_usize(t.int()).into_iter().map(|v| v != 0).collect()
}

/// Deterministic pseudo-random values in `[-2, 2)`.
pub fn lcg_values(n: usize, seed: u64) -> Vec<f64> {
    crate::testing::SplitMix::new(seed)
        .values(n)
        .into_iter()
        .map(|v| 2.0 * v)
        .collect()
}

/// Naive top-k of one row: descending value, ties to the lower index.
pub fn ref_topk(row: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Naive softmax of one row.
pub fn ref_softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Naive `x·Wᵀ` for `x [T, H]`, `W [E, H]`.
pub fn ref_logits(x: &[f64], w: &[f64], t: usize, h: usize, e: usize) -> Vec<f64> {
    let mut out = vec![0.0; t * e];
    for r in 0..t {
        for c in 0..e {
            out[r * e + c] = (0..h).map(|j| x[r * h + j] * w[c * h + j]).sum();
        }
    }
    out
}

/// Naive switch loss `coeff · E/(k·T²) · Σ_e (Σ_t P_te) · c_e` over the rows `rows` of `p`.
pub fn ref_aux_loss(p: &[f64], e: usize, k: usize, rows: &[usize], coeff: f64) -> f64 {
    let t = rows.len() as f64;
    let mut counts = vec![0.0; e];
    let mut sums = vec![0.0; e];
    for &r in rows {
        let row = &p[r * e..(r + 1) * e];
        for c in ref_topk(row, k) {
            counts[c] += 1.0;
        }
        for c in 0..e {
            sums[c] += row[c];
        }
    }
    let dot: f64 = sums.iter().zip(&counts).map(|(s, c)| s * c).sum();
    coeff * dot * e as f64 / (k as f64 * t * t)
}

/// Naive capacity selection of one expert column
/// (docs/routing-and-dispatch.md §Capacity, dropping and padding): routed tokens by descending prob
/// ([`DropPolicy::Probs`](super::DropPolicy::Probs), ties to the lower index) or by ascending
/// index, then unrouted tokens ascending; the first `cap` are kept.
pub fn ref_capacity_column(
    probs: &[f64],
    routed: &[bool],
    cap: usize,
    by_probs: bool,
) -> Vec<bool> {
    let mut order: Vec<usize> = (0..probs.len()).filter(|&i| routed[i]).collect();
    if by_probs {
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    }
    order.extend((0..probs.len()).filter(|&i| !routed[i]));
    let mut out = vec![false; probs.len()];
    for &i in order.iter().take(cap) {
        out[i] = true;
    }
    out
}

/// Column counts of a row-major `[rows, cols]` bool map, restricted to `rows_used`.
pub fn ref_column_counts(map: &[bool], cols: usize, rows_used: &[usize]) -> Vec<f64> {
    let mut counts = vec![0.0; cols];
    for &r in rows_used {
        for c in 0..cols {
            if map[r * cols + c] {
                counts[c] += 1.0;
            }
        }
    }
    counts
}
