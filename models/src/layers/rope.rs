//! Rotary position embeddings: default and YaRN frequencies, rotate-half and interleaved layouts
//! (docs/models.md §RoPE and YaRN, §Qwen3 and its attention), on the whole head or on its first
//! dims only (partial rotary, GLM-4.5: transformers 5.23 `modeling_glm4_moe.apply_rotary_pos_emb`
//! and `modeling_rope_utils._compute_default_rope_parameters`).

use burn::tensor::{Device, Tensor, TensorData};

use crate::ModelError;
use crate::config::{RopeParameters, RopeScaling, YarnParameters};

/// `get_mscale(s, m) = 1` if `s ≤ 1`, else `0.1·m·ln s + 1` (HF `yarn_get_mscale`).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The rotated width of a head of `head_dim` under `partial_rotary_factor` (HF:
/// `int(head_dim * partial_rotary_factor)`, truncated); an error naming
/// `partial_rotary_factor` unless the factor is in `(0, 1]` and the width even and positive.
pub fn rotary_dim(head_dim: usize, partial_rotary_factor: f64) -> Result<usize, ModelError> {
    let f = partial_rotary_factor;
    if !(f.is_finite() && f > 0.0 && f <= 1.0) {
        return Err(ModelError::invalid(
            "partial_rotary_factor",
            format!("must be in (0, 1], got {f}"),
        ));
    }
    let dim = (head_dim as f64 * f) as usize;
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(ModelError::invalid(
            "partial_rotary_factor",
            format!(
                "{f} × head_dim {head_dim} gives {dim} rotated dims; they must be even and positive"
            ),
        ));
    }
    Ok(dim)
}

/// Inverse frequencies and attention factor of one RoPE configuration (HF's
/// `*RotaryEmbedding` buffers). Holds no parameters; the cos/sin tables are built per call.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// `[dim / 2]` inverse frequencies, computed in f32 as HF does.
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (1 for default RoPE; YaRN's `attention_factor`).
    attention_factor: f64,
}

impl RotaryEmbedding {
    /// Frequencies for rotary dimension `dim` (even) under `params`.
    pub fn new(params: &RopeParameters, dim: usize) -> Result<Self, ModelError> {
        if dim == 0 || !dim.is_multiple_of(2) {
            return Err(ModelError::invalid(
                "head_dim",
                format!("the rotary dimension must be even and positive, got {dim}"),
            ));
        }
        let theta = params.rope_theta;
        // HF: `base ** (arange(0, dim, 2).float() / dim)` in f32.
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|j| (theta as f32).powf((2 * j) as f32 / dim as f32))
            .collect();
        match &params.scaling {
            RopeScaling::Default => Ok(Self {
                inv_freq: pos_freqs.iter().map(|p| 1.0 / p).collect(),
                attention_factor: 1.0,
            }),
            RopeScaling::Yarn(y) => Ok(Self::yarn(y, theta, dim, &pos_freqs)),
        }
    }

    /// HF `_compute_yarn_parameters` (docs/models.md §RoPE and YaRN).
    fn yarn(y: &YarnParameters, theta: f64, dim: usize, pos_freqs: &[f32]) -> Self {
        let factor = y.factor;
        let corr = |rotations: f64| {
            dim as f64
                * (y.original_max_position_embeddings as f64
                    / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min((dim - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let inv_freq = pos_freqs
            .iter()
            .enumerate()
            .map(|(j, &p)| {
                let extra = 1.0 / p;
                let inter = 1.0 / (factor as f32 * p);
                let ramp = ((j as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extra_factor = 1.0 - ramp;
                inter * (1.0 - extra_factor) + extra * extra_factor
            })
            .collect();
        let attention_factor =
            y.attention_factor
                .unwrap_or_else(|| match (y.mscale, y.mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        yarn_get_mscale(factor, m) / yarn_get_mscale(factor, a)
                    }
                    _ => yarn_get_mscale(factor, 1.0),
                });
        Self {
            inv_freq,
            attention_factor,
        }
    }

    /// The `[dim / 2]` inverse frequencies.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor applied to cos and sin.
    pub fn attention_factor(&self) -> f64 {
        self.attention_factor
    }

    /// The rotary dimension the tables cover (`2 · inv_freq.len()`).
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// cos/sin tables `[1, len, dim]` (`cat(freqs, freqs)`) for positions `offset..offset + len`
    /// (the same for every row).
    pub fn tables(&self, offset: usize, len: usize, device: &Device) -> RopeTables {
        let positions: Vec<usize> = (offset..offset + len).collect();
        self.tables_at(&positions, [1, len], device)
    }

    /// cos/sin tables `[rows, len, dim]` for per-row positions (`positions [rows, len]`,
    /// row-major), e.g. packed documents whose positions restart at 0
    /// ([`crate::packing::SequenceLayout::position_ids`]).
    pub fn tables_at(
        &self,
        positions: &[usize],
        [rows, len]: [usize; 2],
        device: &Device,
    ) -> RopeTables {
        let half = self.inv_freq.len();
        let dim = 2 * half;
        let scale = self.attention_factor as f32;
        let mut cos = Vec::with_capacity(rows * len * dim);
        let mut sin = Vec::with_capacity(rows * len * dim);
        // Missing positions (a short slice) count as 0.
        let all = positions.iter().copied().chain(std::iter::repeat(0));
        for pos in all.take(rows * len) {
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| pos as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos() * scale));
                sin.extend(angles.iter().map(|a| a.sin() * scale));
            }
        }
        RopeTables {
            cos: Tensor::from_data(TensorData::new(cos, [rows, len, dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [rows, len, dim]), device),
        }
    }
}

/// cos and sin tables for a run of positions, each `[R, S, dim]`: `R = 1` when every row of the
/// batch sits at the same positions, `R = B` for per-row positions (packed sequences).
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `cos(cat(freqs, freqs)) · attention_factor`.
    pub cos: Tensor<3>,
    /// `sin(cat(freqs, freqs)) · attention_factor`.
    pub sin: Tensor<3>,
}

/// `cat(−x[..., d/2:], x[..., :d/2])` on the last dimension.
fn rotate_half(x: Tensor<4>) -> Tensor<4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.narrow(3, d / 2, d / 2);
    Tensor::cat(vec![x2.neg(), x1], 3)
}

/// Rotate-half RoPE of `x [B, heads, S, d]`: `x·cos + rotate_half(x)·sin` (tables of one row
/// broadcast over the batch, or one per row). Tables narrower than the head (`dim < d`,
/// partial rotary) rotate the first `dim` dims and pass the rest through unchanged, as HF's
/// `apply_rotary_pos_emb` of GLM-4.5 does.
pub fn apply_rotary(x: Tensor<4>, tables: &RopeTables) -> Tensor<4> {
    let dtype = x.dtype();
    let d = x.dims()[3];
    let dim = tables.cos.dims()[2];
    let cos = tables.cos.clone().cast(dtype).unsqueeze_dim::<4>(1);
    let sin = tables.sin.clone().cast(dtype).unsqueeze_dim::<4>(1);
    if dim < d {
        let rot = x.clone().narrow(3, 0, dim);
        let pass = x.narrow(3, dim, d - dim);
        return Tensor::cat(vec![rot.clone() * cos + rotate_half(rot) * sin, pass], 3);
    }
    x.clone() * cos + rotate_half(x) * sin
}

/// RoPE for checkpoints that store rotary dims as interleaved pairs (`rope_interleave`,
/// docs/models.md §RoPE and YaRN): de-interleave `[x0, x1, x2, …] → [x0, x2, …, x1, x3, …]`, then
/// [`apply_rotary`]. The output stays de-interleaved; q and k must both go through it.
pub fn apply_rotary_interleaved(x: Tensor<4>, tables: &RopeTables) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    let deinterleaved = x
        .reshape([b, h, s, d / 2, 2])
        .swap_dims(3, 4)
        .reshape([b, h, s, d]);
    apply_rotary(deinterleaved, tables)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RopeParameters, RopeScaling, YarnParameters};

    fn yarn(dim: usize, factor: f64, orig: usize) -> RotaryEmbedding {
        let params = RopeParameters {
            rope_theta: 10000.0,
            scaling: RopeScaling::Yarn(YarnParameters {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: Some(1.0),
                mscale_all_dim: Some(1.0),
                attention_factor: None,
                truncate: true,
            }),
        };
        RotaryEmbedding::new(&params, dim).unwrap()
    }

    #[test]
    fn yarn_matches_the_spec_goldens() {
        // docs/models.md §RoPE and YaRN: official DeepSeek-V3 (dim 64, factor 40, orig 4096).
        let r = yarn(64, 40.0, 4096);
        let f = r.inv_freq();
        for (got, want) in f[..3].iter().zip([1.0, 0.7498942, 0.5623413]) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert!(
            (f[31] - 3.3338036e-6).abs() / 3.3338036e-6 < 1e-5,
            "{}",
            f[31]
        );
        assert_eq!(r.attention_factor(), 1.0);
        // Tiny fixture (dim 8, factor 4, orig 128).
        let r = yarn(8, 4.0, 128);
        for (got, want) in r.inv_freq().iter().zip([1.0, 0.0625, 0.0025, 0.00025]) {
            assert!((got - want).abs() / want < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn interleaved_and_rotate_half_give_equal_dot_products() {
        // docs/models.md §Goldens and parity tests, item 4: q·k is layout independent when q and k
        // use the same layout.
        let device = Device::flex();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let tables = rope.tables(3, 4, &device);
        let q = Tensor::<4>::random([1, 1, 4, 8], burn::tensor::Distribution::Default, &device);
        let k = Tensor::<4>::random([1, 1, 4, 8], burn::tensor::Distribution::Default, &device);
        let dots = |q: Tensor<4>, k: Tensor<4>| q.matmul(k.swap_dims(2, 3));
        let interleaved = dots(
            apply_rotary_interleaved(q.clone(), &tables),
            apply_rotary_interleaved(k.clone(), &tables),
        );
        // The same vectors stored de-interleaved, rotated with rotate_half.
        let perm = |x: Tensor<4>| {
            x.reshape([1, 1, 4, 4, 2])
                .swap_dims(3, 4)
                .reshape([1, 1, 4, 8])
        };
        let plain = dots(
            apply_rotary(perm(q), &tables),
            apply_rotary(perm(k), &tables),
        );
        interleaved
            .into_data()
            .assert_approx_eq::<f32>(&plain.into_data(), burn::tensor::Tolerance::default());
    }

    #[test]
    fn per_row_tables_equal_offset_tables() {
        let device = Device::flex();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let rows = rope.tables_at(&[0, 1, 2, 5, 6, 7], [2, 3], &device);
        assert_eq!(rows.cos.dims(), [2, 3, 8]);
        for (row, offset) in [(0, 0), (1, 5)] {
            let want = rope.tables(offset, 3, &device);
            for (got, want) in [(&rows.cos, &want.cos), (&rows.sin, &want.sin)] {
                got.clone()
                    .narrow(0, row, 1)
                    .into_data()
                    .assert_eq(&want.clone().into_data(), true);
            }
        }
    }

    #[test]
    fn relative_positions_only() {
        // RoPE dot products depend on the position difference only.
        let device = Device::flex();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 16).unwrap();
        let q = Tensor::<4>::random([1, 1, 1, 16], burn::tensor::Distribution::Default, &device);
        let k = Tensor::<4>::random([1, 1, 1, 16], burn::tensor::Distribution::Default, &device);
        let dot = |pq: usize, pk: usize| {
            let q = apply_rotary(q.clone(), &rope.tables(pq, 1, &device));
            let k = apply_rotary(k.clone(), &rope.tables(pk, 1, &device));
            (q * k).sum().into_scalar::<f32>()
        };
        assert!((dot(5, 2) - dot(13, 10)).abs() < 1e-4);
    }
}
