//! `fc1` from and to the fused, interleaved gate/up layout of transformers 5.23 `GptOssExperts`.
//!
//! transformers stores `gate_up_proj [L, H, 2F]` in input-output orientation with gate and up
//! interleaved along the last dim (`[..., ::2]` gate, `[..., 1::2]` up) and `gate_up_proj_bias
//! [L, 2F]` likewise. [`GroupedExperts`](super::GroupedExperts) keeps `fc1 [L, 2F, H]` in
//! output-input orientation with rows `[gate (F); up (F)]`:
//!
//! `fc1[l, r, h] = gate_up_proj[l, h, π(r)]`, `fc1_bias[l, r] = gate_up_proj_bias[l, π(r)]`,
//! with `π(r) = 2r` for `r < F` and `π(r) = 2(r − F) + 1` for `r ≥ F` (in PyTorch:
//! `torch.cat([w[..., ::2], w[..., 1::2]], -1).transpose(1, 2)`). `down_proj [L, F, H]` is
//! `fc2 [L, H, F]` transposed (`fc2 = down_proj.transpose(1, 2)`); `down_proj_bias [L, H]` is
//! `fc2_bias` as it is. The functions here are exact (pure data movement) and each pair is
//! mutually inverse.

use burn::tensor::Tensor;

use crate::error::{BackendError, Result};

fn even_width(op: &'static str, dims: &[usize]) -> Result<usize> {
    match dims.last() {
        Some(&w) if w > 0 && w % 2 == 0 => Ok(w / 2),
        _ => Err(BackendError::Shape {
            op,
            detail: format!("shape {dims:?} needs an even, non-zero gate/up width"),
        }),
    }
}

/// `[L, H, 2F]` interleaved gate/up (input-output, transformers `gate_up_proj`) ->
/// `fc1 [L, 2F, H]` with rows `[gate; up]`.
pub fn fc1_from_interleaved(gate_up: Tensor<3>) -> Result<Tensor<3>> {
    let [l, h, two_f] = gate_up.dims();
    let f = even_width("fc1_from_interleaved", &[l, h, two_f])?;
    Ok(gate_up
        .reshape([l, h, f, 2])
        .swap_dims(2, 3)
        .reshape([l, h, two_f])
        .swap_dims(1, 2))
}

/// `fc1 [L, 2F, H]` with rows `[gate; up]` -> `[L, H, 2F]` interleaved gate/up
/// (input-output, transformers `gate_up_proj`); the inverse of [`fc1_from_interleaved`].
pub fn fc1_to_interleaved(fc1: Tensor<3>) -> Result<Tensor<3>> {
    let [l, two_f, h] = fc1.dims();
    let f = even_width("fc1_to_interleaved", &[l, h, two_f])?;
    Ok(fc1
        .swap_dims(1, 2)
        .reshape([l, h, 2, f])
        .swap_dims(2, 3)
        .reshape([l, h, two_f]))
}

/// `[L, 2F]` interleaved gate/up bias (transformers `gate_up_proj_bias`) -> `fc1_bias [L, 2F]`
/// as `[gate; up]`.
pub fn fc1_bias_from_interleaved(bias: Tensor<2>) -> Result<Tensor<2>> {
    let [l, two_f] = bias.dims();
    let f = even_width("fc1_bias_from_interleaved", &[l, two_f])?;
    Ok(bias.reshape([l, f, 2]).swap_dims(1, 2).reshape([l, two_f]))
}

/// `fc1_bias [L, 2F]` as `[gate; up]` -> `[L, 2F]` interleaved (transformers
/// `gate_up_proj_bias`); the inverse of [`fc1_bias_from_interleaved`].
pub fn fc1_bias_to_interleaved(bias: Tensor<2>) -> Result<Tensor<2>> {
    let [l, two_f] = bias.dims();
    let f = even_width("fc1_bias_to_interleaved", &[l, two_f])?;
    Ok(bias.reshape([l, 2, f]).swap_dims(1, 2).reshape([l, two_f]))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device};

    use super::*;
    use crate::testing::{tensor, values};

    #[test]
    fn interleaved_gate_up_maps_to_gate_then_up_rows_and_back() {
        let device = Device::flex();
        let (l, h, f) = (2, 3, 4);
        // Value encodes (expert, input, column) so the expected permutation is written out.
        let code = |e: usize, i: usize, c: usize| (e * 1000 + i * 100 + c) as f64;
        let gate_up: Vec<f64> = (0..l * h * 2 * f)
            .map(|n| code(n / (h * 2 * f), n / (2 * f) % h, n % (2 * f)))
            .collect();
        let t = tensor(gate_up.clone(), [l, h, 2 * f], &device, DType::F64);
        let fc1 = fc1_from_interleaved(t).unwrap();
        assert_eq!(fc1.dims(), [l, 2 * f, h]);
        let got = values(fc1.clone());
        for e in 0..l {
            for r in 0..2 * f {
                let col = if r < f { 2 * r } else { 2 * (r - f) + 1 };
                for i in 0..h {
                    assert_eq!(got[(e * 2 * f + r) * h + i], code(e, i, col), "{e} {r} {i}");
                }
            }
        }
        assert_eq!(values(fc1_to_interleaved(fc1).unwrap()), gate_up);

        let bias: Vec<f64> = (0..l * 2 * f)
            .map(|n| code(n / (2 * f), 0, n % (2 * f)))
            .collect();
        let b = fc1_bias_from_interleaved(tensor(bias.clone(), [l, 2 * f], &device, DType::F64))
            .unwrap();
        let got = values(b.clone());
        for e in 0..l {
            for r in 0..2 * f {
                let col = if r < f { 2 * r } else { 2 * (r - f) + 1 };
                assert_eq!(got[e * 2 * f + r], code(e, 0, col));
            }
        }
        assert_eq!(values(fc1_bias_to_interleaved(b).unwrap()), bias);
    }

    #[test]
    fn odd_gate_up_width_is_a_shape_error() {
        let device = Device::flex();
        let t = tensor(vec![0.0; 2 * 3 * 5], [2, 3, 5], &device, DType::F32);
        assert!(matches!(
            fc1_from_interleaved(t),
            Err(BackendError::Shape {
                op: "fc1_from_interleaved",
                ..
            })
        ));
    }
}
