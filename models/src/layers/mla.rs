//! Multi-head latent attention (DeepSeek-V3 `DeepseekV3Attention`,
//! docs/models.md §Multi-head latent attention).
//!
//! Queries go through an optional low-rank bottleneck (`q_a_proj → q_a_layernorm → q_b_proj`,
//! or a plain `q_proj`); keys and values share a compressed latent `kv_c` (normed) plus one
//! rotary key `k_rot` shared by all heads. The cache holds the latents (`kv_c`, rotated
//! `k_rot`), which `kv_b_proj` expands per call, as HF 5.23 does.

use std::convert::Infallible;

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use super::attention::{AttentionMask, attention_core};
use super::kv_cache::LayerCache;
use super::rms_norm::{RmsNorm, RmsNormConfig};
use super::rope::{RopeTables, apply_rotary, apply_rotary_interleaved, yarn_get_mscale};
use crate::ModelError;
use crate::config::{RopeParameters, RopeScaling};

/// Epsilon of `q_a_layernorm` and `kv_a_layernorm`: HF and the official code build them with
/// the default 1e-6 whatever `rms_norm_eps` is (docs/models.md §Multi-head latent attention).
pub const MLA_LATENT_NORM_EPS: f64 = 1e-6;

/// Softmax scale of MLA (docs/models.md §Multi-head latent attention): `d_qk^-0.5`, times `m²` with
/// `m = get_mscale(factor, mscale_all_dim)` for YaRN when `mscale_all_dim` is non-zero.
pub fn mla_softmax_scale(qk_head_dim: usize, rope: &RopeParameters) -> f64 {
    let scale = (qk_head_dim as f64).powf(-0.5);
    match &rope.scaling {
        RopeScaling::Yarn(y) => match y.mscale_all_dim {
            Some(all) if all != 0.0 => {
                let m = yarn_get_mscale(y.factor, all);
                scale * m * m
            }
            _ => scale,
        },
        RopeScaling::Default => scale,
    }
}

/// Configuration of an [`Mla`] block.
#[derive(Config, Debug)]
pub struct MlaConfig {
    /// Model width `H`.
    pub hidden_size: usize,
    /// Heads `nh`.
    pub num_heads: usize,
    /// Key/value compression rank.
    pub kv_lora_rank: usize,
    /// Per-head q/k dims without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per-head q/k dims with RoPE (one shared key head).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims.
    pub v_head_dim: usize,
    /// Softmax scale (see [`mla_softmax_scale`]).
    pub softmax_scale: f64,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    #[config(default = false)]
    pub attention_bias: bool,
    /// RoPE dims stored as interleaved pairs.
    #[config(default = true)]
    pub rope_interleave: bool,
    /// Query compression rank; `None` ⇒ plain `q_proj`.
    pub q_lora_rank: Option<usize>,
}

impl MlaConfig {
    fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Creates the block with Burn's default initialisation (norm weights at one).
    pub fn init(&self, device: &Device) -> Mla {
        let lin = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        let norm = |n| {
            RmsNormConfig::new(n)
                .with_epsilon(MLA_LATENT_NORM_EPS)
                .init(device)
        };
        let (h, nh, b) = (self.hidden_size, self.num_heads, self.attention_bias);
        let q_out = nh * self.qk_head_dim();
        let query = match self.q_lora_rank {
            None => MlaQuery::Direct(lin(h, q_out, false)),
            Some(r) => MlaQuery::LowRank(LowRankQuery {
                q_a_proj: lin(h, r, b),
                q_a_layernorm: norm(r),
                q_b_proj: lin(r, q_out, false),
            }),
        };
        self.assemble(
            query,
            [
                lin(h, self.kv_lora_rank + self.qk_rope_head_dim, b),
                lin(
                    self.kv_lora_rank,
                    nh * (self.qk_nope_head_dim + self.v_head_dim),
                    false,
                ),
                lin(nh * self.v_head_dim, h, b),
            ],
            norm(self.kv_lora_rank),
        )
    }

    /// Checks that the block splits over `tp` tensor-parallel ranks: heads divisible by
    /// `tp`, and no bias on the row-parallel `o_proj` (it would be added once per rank).
    pub fn check_split(&self, tp: usize) -> Result<(), ModelError> {
        if !self.num_heads.is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!("{} heads cannot be split over tp = {tp}", self.num_heads),
            ));
        }
        if self.attention_bias && tp > 1 {
            return Err(ModelError::layout(
                "tp",
                "`o_proj` is row-parallel with a bias, which tp > 1 does not support",
            ));
        }
        Ok(())
    }

    fn assemble(
        &self,
        query: MlaQuery,
        [kv_a_proj_with_mqa, kv_b_proj, o_proj]: [Linear; 3],
        kv_a_layernorm: RmsNorm,
    ) -> Mla {
        // The local head count of a (possibly sharded) `kv_b_proj` (`lazy_shape` keeps a
        // randomly initialised block lazy).
        let num_heads =
            kv_b_proj.weight.lazy_shape()[1] / (self.qk_nope_head_dim + self.v_head_dim).max(1);
        Mla {
            query,
            kv_a_proj_with_mqa,
            kv_a_layernorm,
            kv_b_proj,
            o_proj,
            num_heads,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            softmax_scale: self.softmax_scale,
            rope_interleave: self.rope_interleave,
        }
    }
}

/// The query projection: plain (`q_lora_rank = None`) or through a normed low-rank latent.
// One value per layer: the size difference between variants is immaterial, and boxing would
// hide the module from Burn's derive.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum MlaQuery {
    /// `q_proj`: `H → nh·d_qk`.
    Direct(Linear),
    /// `q_b_proj(q_a_layernorm(q_a_proj(x)))`.
    LowRank(LowRankQuery),
}

/// The low-rank query path of [`MlaQuery::LowRank`].
#[derive(Module, Debug)]
pub struct LowRankQuery {
    /// `H → q_lora`.
    pub q_a_proj: Linear,
    /// Norm of the query latent `[q_lora]`.
    pub q_a_layernorm: RmsNorm,
    /// `q_lora → nh·d_qk`, per head rows `[nope | rope]`.
    pub q_b_proj: Linear,
}

impl MlaQuery {
    /// `x [B, S, H] → [B, S, nh·d_qk]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            Self::Direct(q_proj) => q_proj.forward(x),
            Self::LowRank(q) => q
                .q_b_proj
                .forward(q.q_a_layernorm.forward(q.q_a_proj.forward(x))),
        }
    }
}

/// Multi-head latent attention with HF parameter names.
#[derive(Module, Debug)]
pub struct Mla {
    /// Query projection (`q_proj`, or `q_a_proj`/`q_a_layernorm`/`q_b_proj`).
    pub query: MlaQuery,
    /// `H → kv_lora + rope`, rows `[c_kv ; k_pe]`.
    pub kv_a_proj_with_mqa: Linear,
    /// Norm of the key/value latent `[kv_lora]`.
    pub kv_a_layernorm: RmsNorm,
    /// `kv_lora → nh·(nope + v)`, per head rows `[nope | v]`.
    pub kv_b_proj: Linear,
    /// `nh·v → H`.
    pub o_proj: Linear,
    /// `nh`.
    pub num_heads: usize,
    /// Key/value latent rank.
    pub kv_lora_rank: usize,
    /// Per-head dims without RoPE.
    pub qk_nope_head_dim: usize,
    /// Rotary dims.
    pub qk_rope_head_dim: usize,
    /// Per-head value dims.
    pub v_head_dim: usize,
    /// Softmax scale.
    pub softmax_scale: f64,
    /// Interleaved rotary layout.
    pub rope_interleave: bool,
}

impl Mla {
    /// The block with its head count read from its (possibly TP-sharded) `kv_b_proj`: after
    /// loading one rank's shard, `num_heads` becomes this rank's local count.
    pub fn with_local_heads(mut self) -> Self {
        self.num_heads = self.kv_b_proj.weight.lazy_shape()[1]
            / (self.qk_nope_head_dim + self.v_head_dim).max(1);
        self
    }

    /// `x [B, S, H] → [B, S, H]` at positions `cache.seq_len()..`; `rope` holds the tables of
    /// exactly those positions (dim `qk_rope_head_dim`). The latents are appended to `cache`.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let Ok(out) = self.forward_inner(x, rope, None, cache, Ok::<_, Infallible>, false);
        out
    }

    /// [`forward`](Self::forward) without a cache, under `mask` (`[B, S, S]`, replacing the
    /// causal mask: packed documents, padding; see [`AttentionMask`]; `None`: causal).
    pub fn forward_masked(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
    ) -> Tensor<3> {
        let Ok(out) = self.forward_inner(x, rope, mask, None, Ok::<_, Infallible>, false);
        out
    }

    /// [`forward_masked`](Self::forward_masked) whose compressed latents (`kv_c [B, 1, S, r]`
    /// and the shared rotary key `[B, 1, S, rot]`) are passed through `exchange` (e.g. the
    /// context-parallel all-gather along the sequence) before the per-head keys and values
    /// are formed; `mask` is then `[B, S, Sk]`.
    pub fn forward_exchanged<E>(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        exchange: impl FnMut(Tensor<4>) -> Result<Tensor<4>, E>,
        recompute_core: bool,
    ) -> Result<Tensor<3>, E> {
        self.forward_inner(x, rope, mask, None, exchange, recompute_core)
    }

    fn forward_inner<E>(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        cache: Option<&mut LayerCache>,
        mut exchange: impl FnMut(Tensor<4>) -> Result<Tensor<4>, E>,
        recompute_core: bool,
    ) -> Result<Tensor<3>, E> {
        let [b, s, _] = x.dims();
        let (nh, nope, rot, dv) = (
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        );
        let q = self
            .query
            .forward(x.clone())
            .reshape([b, s, nh, nope + rot])
            .swap_dims(1, 2);
        let q_nope = q.clone().narrow(3, 0, nope);
        let q_rot = q.narrow(3, nope, rot);

        let ckv = self.kv_a_proj_with_mqa.forward(x);
        let kv_c = self
            .kv_a_layernorm
            .forward(ckv.clone().narrow(2, 0, self.kv_lora_rank))
            .reshape([b, 1, s, self.kv_lora_rank]);
        let k_rot = ckv
            .narrow(2, self.kv_lora_rank, rot)
            .reshape([b, 1, s, rot]);
        let rotate = |t| {
            if self.rope_interleave {
                apply_rotary_interleaved(t, rope)
            } else {
                apply_rotary(t, rope)
            }
        };
        let q_rot = rotate(q_rot);
        let k_rot = rotate(k_rot);
        let (offset, kv_c, k_rot) = match cache {
            Some(cache) => {
                let offset = cache.seq_len();
                let (c, r) = cache.append(kv_c, k_rot);
                (offset, c, r)
            }
            None => (0, exchange(kv_c)?, exchange(k_rot)?),
        };
        let sk = kv_c.dims()[2];
        let kv = self
            .kv_b_proj
            .forward(kv_c.reshape([b, sk, self.kv_lora_rank]))
            .reshape([b, sk, nh, nope + dv])
            .swap_dims(1, 2);
        let k_nope = kv.clone().narrow(3, 0, nope);
        let v = kv.narrow(3, nope, dv);
        let key = Tensor::cat(vec![k_nope, k_rot.expand([b, nh, sk, rot])], 3);
        let query = Tensor::cat(vec![q_nope, q_rot], 3);
        let out = attention_core(
            query,
            key,
            v,
            self.softmax_scale,
            mask,
            offset,
            recompute_core,
        );
        Ok(self
            .o_proj
            .forward(out.swap_dims(1, 2).reshape([b, s, nh * dv])))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, Tolerance};

    use super::*;
    use crate::config::{RopeParameters, YarnParameters};
    use crate::layers::rope::RotaryEmbedding;

    #[test]
    fn softmax_scale_matches_the_spec_goldens() {
        let yarn = |factor, orig| RopeParameters {
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
        let official = mla_softmax_scale(192, &yarn(40.0, 4096));
        assert!((official - 0.1352337788608801).abs() < 1e-15, "{official}");
        let tiny = mla_softmax_scale(16, &yarn(4.0, 128));
        assert!((tiny - 0.32411924819517657).abs() < 1e-15, "{tiny}");
        assert_eq!(mla_softmax_scale(16, &RopeParameters::default()), 0.25);
    }

    #[test]
    fn left_padded_rows_equal_their_unpadded_sequences() {
        // Row 0 is left-padded by 2, row 1 is full: each row's real tokens equal the sequence
        // run alone (HF positions cumsum(mask) − 1).
        let device = Device::flex();
        let mla = MlaConfig::new(16, 2, 6, 4, 4, 8, 0.3)
            .with_q_lora_rank(Some(8))
            .init(&device);
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 4).unwrap();
        let x = Tensor::<3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let mask = vec![0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        let layout = crate::packing::SequenceLayout::from_attention_mask(2, 5, mask).unwrap();
        let packed = crate::packing::PackedInputs::new(&layout, &rope, &device);
        let out = mla.forward_masked(x.clone(), &packed.rope, Some(&packed.mask));
        for (row, start) in [(0, 2), (1, 0)] {
            let len = 5 - start;
            let alone = mla.forward(
                x.clone().narrow(0, row, 1).narrow(1, start, len),
                &rope.tables(0, len, &device),
                None,
            );
            out.clone()
                .narrow(0, row, 1)
                .narrow(1, start, len)
                .into_data()
                .assert_approx_eq::<f32>(&alone.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
        }
    }

    #[test]
    fn cached_decoding_matches_the_full_forward_with_and_without_q_lora() {
        let device = Device::flex();
        for q_lora in [Some(8), None] {
            let mla = MlaConfig::new(16, 2, 6, 4, 4, 8, 0.3)
                .with_q_lora_rank(q_lora)
                .init(&device);
            let rope = RotaryEmbedding::new(&RopeParameters::default(), 4).unwrap();
            let x = Tensor::<3>::random([2, 4, 16], Distribution::Normal(0.0, 1.0), &device);
            let full = mla.forward(x.clone(), &rope.tables(0, 4, &device), None);
            let mut cache = LayerCache::default();
            let a = mla.forward(
                x.clone().narrow(1, 0, 3),
                &rope.tables(0, 3, &device),
                Some(&mut cache),
            );
            let b = mla.forward(
                x.narrow(1, 3, 1),
                &rope.tables(3, 1, &device),
                Some(&mut cache),
            );
            Tensor::cat(vec![a, b], 1)
                .into_data()
                .assert_approx_eq::<f32>(&full.into_data(), Tolerance::rel_abs(1e-4, 1e-5));
        }
    }
}
