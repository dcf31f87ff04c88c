//! Grouped-query attention with per-head QK RMSNorm (Qwen3 / Qwen3-MoE,
//! docs/models.md §Qwen3 and its attention) and the shared causal attention core
//! (docs/models.md §Shared building blocks).
//!
//! Options of the newer families, each following transformers 5.23:
//! - sliding-window attention (`sliding_window`; `masking_utils.sliding_window_overlay`: query
//!   `i` sees key `j` iff `i − w < j ≤ i`, by index along the row), per layer;
//! - learned attention sinks (`sinks [nh]`, gpt-oss `modeling_gpt_oss.eager_attention_forward`:
//!   one extra logit per head joins every row's softmax and its column is dropped);
//! - partial rotary (`partial_rotary_factor`, GLM-4.5 `modeling_glm4_moe.apply_rotary_pos_emb`:
//!   only the first `int(hd·factor)` dims of q and k are rotated, rotate-half).

use std::convert::Infallible;

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use moe_backend::fp8::{Fp8Recipe, linear_maybe_fp8};

use super::kv_cache::LayerCache;
use super::rms_norm::{RmsNorm, RmsNormConfig};
use super::rope::{RopeTables, RotaryEmbedding, apply_rotary, rotary_dim};
use crate::ModelError;
use crate::config::RopeParameters;

/// Configuration of an [`Attention`] block.
#[derive(Config, Debug)]
pub struct AttentionConfig {
    /// Model width `H`.
    pub hidden_size: usize,
    /// Query heads `nh`.
    pub num_attention_heads: usize,
    /// Key/value heads `nkv` (divides `nh`).
    pub num_key_value_heads: usize,
    /// Per-head size `hd` (may differ from `H / nh`).
    pub head_dim: usize,
    /// Epsilon of the QK norms.
    #[config(default = 1e-6)]
    pub rms_norm_eps: f64,
    /// Biases on q/k/v/o projections.
    #[config(default = false)]
    pub attention_bias: bool,
    /// Whether `attention_bias` puts a bias on `o_proj` too (`false`: on q/k/v only, as
    /// GLM-4.5's attention, whose `o_proj` never has one).
    #[config(default = true)]
    pub o_proj_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    #[config(default = true)]
    pub qk_norm: bool,
    /// Sliding-window attention of this layer (HF `sliding_window` on a `"sliding_attention"`
    /// layer): a query sees the keys of the last `w` positions, itself included (`None`: full
    /// causal attention).
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Learned attention sinks (gpt-oss): a parameter `self_attn.sinks [nh]` whose entry is one
    /// extra logit in every softmax row of its head.
    #[config(default = false)]
    pub sinks: bool,
    /// Share of each head's dims that RoPE rotates (GLM-4.5 `partial_rotary_factor`; the first
    /// `int(hd·factor)` dims, see [`rotary_dim`]). The RoPE tables the block is run with must
    /// have that width ([`AttentionConfig::rotary_embedding`]).
    #[config(default = 1.0)]
    pub partial_rotary_factor: f64,
}

/// HF's initialiser of the sinks (`GptOssPreTrainedModel._init_weights`: normal with the
/// config's default `initializer_range`, 0.02).
const SINKS_INIT_STD: f64 = 0.02;

impl AttentionConfig {
    fn check(&self) -> Result<(), ModelError> {
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::invalid(
                "num_key_value_heads",
                format!(
                    "{} must divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(ModelError::invalid(
                "sliding_window",
                "must be positive (a query always sees itself)",
            ));
        }
        self.rotary_dim()?;
        Ok(())
    }

    /// The rotated width of each head, `int(hd · partial_rotary_factor)` (even, positive).
    pub fn rotary_dim(&self) -> Result<usize, ModelError> {
        rotary_dim(self.head_dim, self.partial_rotary_factor)
    }

    /// The rotary embedding this block runs with: `params`' frequencies over
    /// [`rotary_dim`](Self::rotary_dim) (HF computes the inverse frequencies over the rotated
    /// width, `_compute_default_rope_parameters`).
    pub fn rotary_embedding(&self, params: &RopeParameters) -> Result<RotaryEmbedding, ModelError> {
        RotaryEmbedding::new(params, self.rotary_dim()?)
    }

    /// Creates the block with Burn's default initialisation (norm weights at one).
    pub fn init(&self, device: &Device) -> Result<Attention, ModelError> {
        self.check()?;
        let (h, q, kv) = self.widths();
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        let (bias, o_bias) = (self.attention_bias, self.has_o_proj_bias());
        let norm = || {
            self.qk_norm.then(|| {
                RmsNormConfig::new(self.head_dim)
                    .with_epsilon(self.rms_norm_eps)
                    .init(device)
            })
        };
        let sinks = self.sinks.then(|| {
            Initializer::Normal {
                mean: 0.0,
                std: SINKS_INIT_STD,
            }
            .init([self.num_attention_heads], device)
        });
        Ok(self.assemble(
            [
                linear(h, q, bias),
                linear(h, kv, bias),
                linear(h, kv, bias),
                linear(q, h, o_bias),
            ],
            norm(),
            norm(),
            sinks,
        ))
    }

    /// Whether `o_proj` carries a bias (`attention_bias` and `o_proj_bias`).
    pub fn has_o_proj_bias(&self) -> bool {
        self.attention_bias && self.o_proj_bias
    }

    /// Checks that the block splits over `tp` tensor-parallel ranks: query and KV heads
    /// divisible by `tp` (the q/k/v biases are column-parallel and split with their heads; the
    /// bias of the row-parallel `o_proj` is added once after the reduction by the parallel
    /// stack, [`Attention::forward_partial`]).
    pub fn check_split(&self, tp: usize) -> Result<(), ModelError> {
        self.check()?;
        if !self.num_attention_heads.is_multiple_of(tp)
            || !self.num_key_value_heads.is_multiple_of(tp)
        {
            return Err(ModelError::layout(
                "tp",
                format!(
                    "{} query / {} KV heads cannot be split over tp = {tp}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        Ok(())
    }

    fn widths(&self) -> (usize, usize, usize) {
        (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
    }

    fn assemble(
        &self,
        [q_proj, k_proj, v_proj, o_proj]: [Linear; 4],
        q_norm: Option<RmsNorm>,
        k_norm: Option<RmsNorm>,
        sinks: Option<Param<Tensor<1>>>,
    ) -> Attention {
        // Local head counts from the (possibly sharded) projections' shapes (`lazy_shape`
        // keeps a randomly initialised block lazy).
        let num_heads = q_proj.weight.lazy_shape()[1] / self.head_dim.max(1);
        let num_kv_heads = k_proj.weight.lazy_shape()[1] / self.head_dim.max(1);
        Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            sinks,
            num_heads,
            num_kv_heads,
            head_dim: self.head_dim,
            sliding_window: self.sliding_window,
            fp8: None,
        }
    }
}

/// GQA self-attention, HF `Qwen3Attention` (docs/models.md §Qwen3 and its attention):
/// `q = q_norm(q_proj(x))`, `k = k_norm(k_proj(x))` per head, RoPE on q and k, causal softmax with
/// `scale = hd^-0.5`; optionally within a sliding window, with learned sinks and with RoPE on
/// the first dims only (the module docs).
#[derive(Module, Debug)]
pub struct Attention {
    /// `H → nh·hd`.
    pub q_proj: Linear,
    /// `H → nkv·hd`.
    pub k_proj: Linear,
    /// `H → nkv·hd`.
    pub v_proj: Linear,
    /// `nh·hd → H`.
    pub o_proj: Linear,
    /// Per-head query norm `[hd]` (Qwen3).
    pub q_norm: Option<RmsNorm>,
    /// Per-head key norm `[hd]` (Qwen3).
    pub k_norm: Option<RmsNorm>,
    /// Learned attention sinks `[nh]` (gpt-oss `self_attn.sinks`; this rank's heads under TP,
    /// split like `q_proj`'s output).
    pub sinks: Option<Param<Tensor<1>>>,
    /// `nh`.
    pub num_heads: usize,
    /// `nkv`.
    pub num_kv_heads: usize,
    /// `hd`.
    pub head_dim: usize,
    /// The layer's sliding window (`None`: full causal attention), see
    /// [`AttentionConfig::sliding_window`].
    #[module(skip)]
    pub sliding_window: Option<usize>,
    /// FP8 recipe of the four projections (docs/fp8.md §Recipes; `None`: the parameters'
    /// precision). QK-norms, RoPE and the softmax core stay in high precision
    /// (docs/fp8.md §Selective precision).
    #[module(skip)]
    pub fp8: Option<Fp8Recipe>,
}

impl Attention {
    /// The block with its head counts recomputed from its projections' shapes: after a
    /// generic sharding ([`crate::param_plan::shard_by_plan`]) narrowed `q_proj`/`k_proj` to
    /// this rank's heads, `num_heads` / `num_kv_heads` become the local counts. An error when
    /// a projection width is not a multiple of `head_dim`, or the local query heads are not a
    /// multiple of the local KV heads.
    pub fn with_local_heads(mut self) -> Result<Self, ModelError> {
        let hd = self.head_dim;
        let q = self.q_proj.weight.lazy_shape()[1];
        let kv = self.k_proj.weight.lazy_shape()[1];
        if hd == 0 || !q.is_multiple_of(hd) || !kv.is_multiple_of(hd) {
            return Err(ModelError::invalid(
                "head_dim",
                format!("projection widths {q} (q) / {kv} (kv) are not multiples of {hd}"),
            ));
        }
        let (heads, kv_heads) = (q / hd, kv / hd);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(ModelError::invalid(
                "num_key_value_heads",
                format!("{kv_heads} local KV heads must divide {heads} local query heads"),
            ));
        }
        if let Some(sinks) = &self.sinks {
            let n = sinks.lazy_shape()[0];
            if n != heads {
                return Err(ModelError::invalid(
                    "sinks",
                    format!("{n} sinks for {heads} (local) query heads"),
                ));
            }
        }
        self.num_heads = heads;
        self.num_kv_heads = kv_heads;
        Ok(self)
    }

    /// `x [B, S, H] → [B, S, H]` for positions `cache.seq_len()..` (0 without a cache);
    /// `rope` holds the tables of exactly those `S` positions. New keys/values are appended to
    /// `cache`.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let Ok(out) = self.forward_inner(x, rope, None, cache, Ok::<_, Infallible>, false, true);
        out
    }

    /// [`forward`](Self::forward) without a cache, under `mask` (`[B, S, S]`, replacing the
    /// causal mask: packed documents, padding; see [`AttentionMask`]; `None`: causal); `rope`
    /// then usually holds per-row tables.
    pub fn forward_masked(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
    ) -> Tensor<3> {
        let Ok(out) = self.forward_inner(x, rope, mask, None, Ok::<_, Infallible>, false, true);
        out
    }

    /// [`forward_masked`](Self::forward_masked) whose keys and values are passed through
    /// `exchange` (`[B, nkv, S, d] → [B, nkv, Sk, d]`, e.g. the context-parallel all-gather
    /// along the sequence) before the attention; `mask` is then `[B, S, Sk]`.
    pub fn forward_exchanged<E>(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        exchange: impl FnMut(Tensor<4>) -> Result<Tensor<4>, E>,
        recompute_core: bool,
    ) -> Result<Tensor<3>, E> {
        self.forward_inner(x, rope, mask, None, exchange, recompute_core, true)
    }

    /// This rank's heads' partial output for the parallel stack: as
    /// [`forward_exchanged`](Self::forward_exchanged) (or the cached
    /// [`forward`](Self::forward) with `cache`) without `o_proj`'s bias, which the caller adds
    /// once after the tensor-parallel reduction ([`Self::output_bias`]).
    pub fn forward_partial<E>(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        cache: Option<&mut LayerCache>,
        exchange: impl FnMut(Tensor<4>) -> Result<Tensor<4>, E>,
        recompute_core: bool,
    ) -> Result<Tensor<3>, E> {
        self.forward_inner(x, rope, mask, cache, exchange, recompute_core, false)
    }

    /// `o_proj`'s bias `[H]`, if any.
    pub fn output_bias(&self) -> Option<Tensor<1>> {
        self.o_proj.bias.as_ref().map(|b| b.val())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_inner<E>(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        cache: Option<&mut LayerCache>,
        mut exchange: impl FnMut(Tensor<4>) -> Result<Tensor<4>, E>,
        recompute_core: bool,
        o_bias: bool,
    ) -> Result<Tensor<3>, E> {
        let [b, s, _] = x.dims();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let heads = |t: Tensor<3>, n: usize, norm: &Option<RmsNorm>| {
            let t = t.reshape([b, s, n, hd]);
            let t = match norm {
                Some(norm) => norm.forward(t),
                None => t,
            };
            t.swap_dims(1, 2)
        };
        let fp8 = self.fp8.as_ref();
        let q = heads(
            linear_maybe_fp8(&self.q_proj, x.clone(), fp8),
            nh,
            &self.q_norm,
        );
        let k = heads(
            linear_maybe_fp8(&self.k_proj, x.clone(), fp8),
            nkv,
            &self.k_norm,
        );
        let v = heads(linear_maybe_fp8(&self.v_proj, x, fp8), nkv, &None);
        let q = apply_rotary(q, rope);
        let k = apply_rotary(k, rope);
        let window = self.sliding_window;
        let (offset, k, v) = match cache {
            Some(cache) => {
                // A sliding layer keeps the last `w − 1` keys, all a later query can see
                // (HF `DynamicSlidingWindowLayer`); the core sees the cached keys from
                // position `start`, so the queries sit `offset − start` after the first.
                let offset = cache.seq_len();
                let (start, k, v) = cache.append_within(k, v, window.map(|w| w - 1));
                (offset - start, k, v)
            }
            None => (0, exchange(k)?, exchange(v)?),
        };
        let scale = (hd as f64).powf(-0.5);
        let options = CoreOptions {
            sliding_window: window,
            sinks: self.sinks.as_ref().map(|s| s.val()),
        };
        let out = attention_core_with(q, k, v, scale, mask, offset, recompute_core, &options);
        let out = out.swap_dims(1, 2).reshape([b, s, nh * hd]);
        if o_bias || self.o_proj.bias.is_none() {
            return Ok(linear_maybe_fp8(&self.o_proj, out, fp8));
        }
        let weight_only = Linear {
            weight: self.o_proj.weight.clone(),
            bias: None,
        };
        Ok(linear_maybe_fp8(&weight_only, out, fp8))
    }
}

/// Which keys each query may see, `[B, S, Sk]` (`true` = masked out), for batches whose rows
/// are not one plain causal sequence: packed documents (block-diagonal causal) and padding
/// (padded keys masked out; a padded query sees only itself, so its softmax row stays
/// finite). Built once per forward and shared by every layer.
///
/// A sliding-window layer further hides the keys `w` or more positions before the query; the
/// mask therefore knows where its queries and keys sit along the row (their index in the
/// unsplit row, e.g. global positions under context parallelism). Without explicit positions
/// query `i` sits at `Sk − S + i` and key `j` at `j`.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    blocked: Tensor<3, Bool>,
    positions: Option<(Tensor<1, Int>, Tensor<1, Int>)>,
}

impl AttentionMask {
    /// The causal mask within documents: `doc_ids [B, S]` gives every token's document (equal
    /// ids = same document; give every padding token an id of its own); query `i` sees key
    /// `j` iff `j ≤ i` and `doc_ids[b, j] = doc_ids[b, i]`.
    pub fn from_document_ids(doc_ids: Tensor<2, Int>) -> Self {
        let [b, s] = doc_ids.dims();
        let device = doc_ids.device();
        let queries = doc_ids.clone().reshape([b, s, 1]).expand([b, s, s]);
        let keys = doc_ids.reshape([b, 1, s]).expand([b, s, s]);
        let causal = Tensor::<2, Bool>::tril_mask([s, s], 0, &device)
            .unsqueeze::<3>()
            .expand([b, s, s]);
        Self {
            blocked: queries.not_equal(keys).bool_or(causal),
            positions: None,
        }
    }

    /// A mask from an explicit `[B, S, Sk]` tensor (`true` = masked out). Every query must see
    /// at least one key.
    pub fn from_blocked(blocked: Tensor<3, Bool>) -> Self {
        Self {
            blocked,
            positions: None,
        }
    }

    /// The mask with its queries at row positions `queries` (`S` of them) and its keys at
    /// `keys` (`Sk`), for the sliding windows of the layers that have one.
    pub fn with_positions(mut self, queries: &[usize], keys: &[usize]) -> Self {
        let device = self.blocked.device();
        let ints = |p: &[usize]| {
            let v: Vec<i64> = p.iter().map(|&x| x as i64).collect();
            Tensor::<1, Int>::from_data(TensorData::new(v, [p.len()]), &device)
        };
        self.positions = Some((ints(queries), ints(keys)));
        self
    }

    /// `[B, S, Sk]`, `true` = masked out.
    pub fn blocked(&self) -> &Tensor<3, Bool> {
        &self.blocked
    }

    /// `[S, Sk]`: `true` where the key sits `window` or more positions before the query
    /// (outside a sliding window of `window` keys).
    pub fn outside_window(&self, window: usize) -> Tensor<2, Bool> {
        let [_, s, sk] = self.blocked.dims();
        let device = self.blocked.device();
        let (queries, keys) = match &self.positions {
            Some((q, k)) => (q.clone(), k.clone()),
            None => (
                Tensor::<1, Int>::arange(sk as i64 - s as i64..sk as i64, &device),
                Tensor::<1, Int>::arange(0..sk as i64, &device),
            ),
        };
        let distance =
            queries.reshape([s, 1]).expand([s, sk]) - keys.reshape([1, sk]).expand([s, sk]);
        distance.greater_equal_elem(window as i64)
    }
}

/// `[B, nkv, S, d] → [B, nkv·rep, S, d]`, kv head `j` serving query heads `j·rep..(j+1)·rep`.
pub fn repeat_kv(x: Tensor<4>, rep: usize) -> Tensor<4> {
    if rep == 1 {
        return x;
    }
    let [b, n, s, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, n, rep, s, d])
        .reshape([b, n * rep, s, d])
}

/// What an attention core does besides the causal (or explicit) mask.
#[derive(Debug, Clone, Default)]
pub struct CoreOptions {
    /// Hide the keys `w` or more positions before the query (HF `sliding_window_overlay`:
    /// key `j` is seen by query `i` iff `j > i − w`).
    pub sliding_window: Option<usize>,
    /// Per-head sink logits `[nh]` (gpt-oss): each joins its head's softmax rows as one more
    /// column, which is then dropped, so a row's probabilities sum to less than one.
    pub sinks: Option<Tensor<1>>,
}

/// Query rows per block of [`causal_attention`]: below two blocks it runs in one piece.
const CAUSAL_QUERY_BLOCK: usize = 128;

/// Causal attention core (docs/models.md §Shared building blocks): `softmax(q·kᵀ·scale + mask)` in
/// f32, cast to q's dtype, `· v`.
///
/// `q [B, nh, S, d]`, `k [B, nkv, Sk, d]`, `v [B, nkv, Sk, dv]` with `nkv | nh` (GQA); query `i`
/// sits at absolute position `offset + i` and sees keys `0..=offset + i`. Returns
/// `[B, nh, S, dv]`.
///
/// Long sequences run in blocks of 128 query rows, each against the keys its last row can
/// see: the scores of keys no row of the block sees are never computed (a causal mask hides
/// them, they only add exact zeros), which saves about
/// `(n − 1) / 2n` of the score and softmax work (and stored probabilities) for `n` blocks:
/// 37.5% at `S = 512`, as the block skipping of fused attention kernels does.
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    offset: usize,
) -> Tensor<4> {
    causal_attention_with(q, k, v, scale, offset, &CoreOptions::default())
}

/// [`causal_attention`] with a sliding window and/or sinks. A block of query rows also skips
/// the keys before the window of its first row.
pub fn causal_attention_with(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    offset: usize,
    options: &CoreOptions,
) -> Tensor<4> {
    let s = q.dims()[2];
    let sk = k.dims()[2];
    if s < 2 * CAUSAL_QUERY_BLOCK {
        return causal_block(q, k, v, scale, offset, options);
    }
    let blocks = (0..s)
        .step_by(CAUSAL_QUERY_BLOCK)
        .map(|r0| {
            let rows = CAUSAL_QUERY_BLOCK.min(s - r0);
            // Keys visible to the block's last row (all of them once `offset` reaches past),
            // from the first key in the window of its first row.
            let end = (offset + r0 + rows).min(sk);
            let start = options
                .sliding_window
                .map_or(0, |w| (offset + r0 + 1).saturating_sub(w))
                .min(end);
            causal_block(
                q.clone().narrow(2, r0, rows),
                k.clone().narrow(2, start, end - start),
                v.clone().narrow(2, start, end - start),
                scale,
                offset + r0 - start,
                options,
            )
        })
        .collect();
    Tensor::cat(blocks, 2)
}

/// `softmax` of f32 `scores [B, nh, S, Sk]` along the keys, with each head's sink logit as one
/// more column that is dropped afterwards (gpt-oss `eager_attention_forward`).
fn probabilities(scores: Tensor<4>, sinks: Option<&Tensor<1>>) -> Tensor<4> {
    let Some(sinks) = sinks else {
        return softmax(scores, 3);
    };
    let [b, nh, s, sk] = scores.dims();
    let sink = sinks
        .clone()
        .cast(DType::F32)
        .reshape([1, nh, 1, 1])
        .expand([b, nh, s, 1]);
    softmax(Tensor::cat(vec![scores, sink], 3), 3).narrow(3, 0, sk)
}

/// [`causal_attention`] in one piece: the whole `[B, nh, S, Sk]` scores, masked.
fn causal_block(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    offset: usize,
    options: &CoreOptions,
) -> Tensor<4> {
    let [b, nh, s, _] = q.dims();
    let [_, nkv, sk, _] = k.dims();
    let rep = nh / nkv;
    let k = repeat_kv(k, rep);
    let v = repeat_kv(v, rep);
    let dtype = q.dtype();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let device = scores.device();
    let mut mask = Tensor::<2, Bool>::tril_mask([s, sk], offset as i64, &device);
    if let Some(w) = options.sliding_window {
        // `triu_mask(o)` hides key `j < i + o`: here `j ≤ offset + i − w`.
        let outside = Tensor::<2, Bool>::triu_mask([s, sk], offset as i64 - w as i64 + 1, &device);
        mask = mask.bool_or(outside);
    }
    let mask = mask.unsqueeze::<4>().expand([b, nh, s, sk]);
    let scores = scores.cast(DType::F32).mask_fill(mask, f32::NEG_INFINITY);
    probabilities(scores, options.sinks.as_ref())
        .cast(dtype)
        .matmul(v)
}

/// The attention core of [`causal_attention`] with an explicit [`AttentionMask`] `[B, S, Sk]`
/// (shared by the heads) instead of the causal one: `softmax(q·kᵀ·scale + mask)` in f32, cast
/// to q's dtype, `· v`. The mask is broadcast over the heads; nothing larger than the
/// `[B, nh, S, Sk]` scores is built.
pub fn masked_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: &AttentionMask,
) -> Tensor<4> {
    masked_attention_with(q, k, v, scale, mask, &CoreOptions::default())
}

/// [`masked_attention`] with a sliding window (on the mask's positions) and/or sinks.
pub fn masked_attention_with(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: &AttentionMask,
    options: &CoreOptions,
) -> Tensor<4> {
    let [b, nh, s, _] = q.dims();
    let [_, nkv, sk, _] = k.dims();
    let rep = nh / nkv;
    let k = repeat_kv(k, rep);
    let v = repeat_kv(v, rep);
    let dtype = q.dtype();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let mut blocked = mask.blocked.clone();
    if let Some(w) = options.sliding_window {
        let outside = mask.outside_window(w).unsqueeze::<3>().expand([b, s, sk]);
        blocked = blocked.bool_or(outside);
    }
    let blocked = blocked.unsqueeze_dim::<4>(1).expand([b, nh, s, sk]);
    let scores = scores
        .cast(DType::F32)
        .mask_fill(blocked, f32::NEG_INFINITY);
    probabilities(scores, options.sinks.as_ref())
        .cast(dtype)
        .matmul(v)
}

/// The attention core of a forward: [`masked_attention`] under `mask`, [`causal_attention`]
/// at `offset` otherwise. With `recompute` (Megatron's `core_attn` selective recompute) the
/// scores and probabilities `[B, nh, S, Sk]` are not kept for the backward pass: `q`, `k`
/// and `v` are, and the core runs again there ([`moe_backend::recompute`]).
pub fn attention_core(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: Option<&AttentionMask>,
    offset: usize,
    recompute: bool,
) -> Tensor<4> {
    attention_core_with(
        q,
        k,
        v,
        scale,
        mask,
        offset,
        recompute,
        &CoreOptions::default(),
    )
}

/// [`attention_core`] with a sliding window and/or sinks ([`CoreOptions`]); under `recompute`
/// the sinks are a region input beside q, k and v (their gradient flows through the rerun).
#[allow(clippy::too_many_arguments)]
pub fn attention_core_with(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: Option<&AttentionMask>,
    offset: usize,
    recompute: bool,
    options: &CoreOptions,
) -> Tensor<4> {
    let window = options.sliding_window;
    let core = move |q, k, v, mask: Option<&AttentionMask>, sinks: Option<Tensor<1>>| {
        let options = CoreOptions {
            sliding_window: window,
            sinks,
        };
        match mask {
            Some(mask) => masked_attention_with(q, k, v, scale, mask, &options),
            None => causal_attention_with(q, k, v, scale, offset, &options),
        }
    };
    if !recompute {
        return core(q, k, v, mask, options.sinks.clone());
    }
    // One region input: q, k, v (and the sinks) flattened into one vector (the region's only
    // consumer).
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    let (nq, nk) = (qd.iter().product::<usize>(), kd.iter().product::<usize>());
    let nv = vd.iter().product::<usize>();
    let dtype = q.dtype();
    let mut parts = vec![q.reshape([nq]), k.reshape([nk]), v.reshape([nv])];
    let ns = options.sinks.as_ref().map_or(0, |s| s.dims()[0]);
    if let Some(sinks) = &options.sinks {
        parts.push(sinks.clone().cast(dtype));
    }
    let packed = Tensor::cat(parts, 0);
    let mask = mask.cloned();
    moe_backend::recompute::recompute(packed, move |p: Tensor<1>| {
        let q = p.clone().narrow(0, 0, nq).reshape(qd);
        let k = p.clone().narrow(0, nq, nk).reshape(kd);
        let v = p.clone().narrow(0, nq + nk, nv).reshape(vd);
        let sinks = (ns > 0).then(|| p.narrow(0, nq + nk + nv, ns));
        core(q, k, v, mask.as_ref(), sinks)
    })
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, Tolerance};

    use super::*;
    use crate::config::RopeParameters;
    use crate::layers::kv_cache::LayerCache;
    use crate::layers::rope::RotaryEmbedding;

    #[test]
    fn incremental_decoding_with_a_cache_matches_the_full_forward() {
        let device = Device::flex();
        let attn = AttentionConfig::new(16, 4, 2, 8).init(&device).unwrap();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let x = Tensor::<3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let full = attn.forward(x.clone(), &rope.tables(0, 5, &device), None);

        let mut cache = LayerCache::default();
        let head = attn.forward(
            x.clone().narrow(1, 0, 3),
            &rope.tables(0, 3, &device),
            Some(&mut cache),
        );
        let mut parts = vec![head];
        for pos in 3..5 {
            parts.push(attn.forward(
                x.clone().narrow(1, pos, 1),
                &rope.tables(pos, 1, &device),
                Some(&mut cache),
            ));
        }
        Tensor::cat(parts, 1)
            .into_data()
            .assert_approx_eq::<f32>(&full.into_data(), Tolerance::rel_abs(1e-5, 1e-5));
    }

    #[test]
    fn packed_documents_attend_only_within_themselves() {
        // Two documents (3 and 4 tokens) and one padding token in one row: each document's
        // output equals the document run alone at positions 0.., whatever the padding holds.
        let device = Device::flex();
        let attn = AttentionConfig::new(16, 4, 2, 8).init(&device).unwrap();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let x = Tensor::<3>::random([1, 8, 16], Distribution::Normal(0.0, 1.0), &device);
        let layout =
            crate::packing::SequenceLayout::from_cu_seqlens(1, 8, vec![vec![0, 3, 7]]).unwrap();
        let packed = crate::packing::PackedInputs::new(&layout, &rope, &device);
        let out = attn.forward_masked(x.clone(), &packed.rope, Some(&packed.mask));
        for (start, len) in [(0, 3), (3, 4)] {
            let alone = attn.forward(
                x.clone().narrow(1, start, len),
                &rope.tables(0, len, &device),
                None,
            );
            out.clone()
                .narrow(1, start, len)
                .into_data()
                .assert_approx_eq::<f32>(&alone.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
        }
        let values = out
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "padding stays finite");
    }

    /// The blocked causal attention equals the whole masked matrix (`causal_block`, the
    /// textbook formula) in values and in the gradients of q, k and v, for a sequence of
    /// uneven blocks, with and without an offset into a longer key sequence.
    #[test]
    fn blocked_causal_attention_equals_the_whole_masked_matrix() {
        let device = Device::flex().autodiff();
        let s = 2 * CAUSAL_QUERY_BLOCK + 37;
        for (offset, sk) in [(0, s), (9, s + 9)] {
            let leaf = |shape: [usize; 4]| {
                Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
            };
            let (q, k, v) = (leaf([1, 4, s, 8]), leaf([1, 2, sk, 8]), leaf([1, 2, sk, 6]));
            let w = Tensor::<4>::random([1, 4, s, 6], Distribution::Normal(0.0, 1.0), &device);
            let run = |blocked: bool| {
                let (q1, k1, v1) = (q.clone(), k.clone(), v.clone());
                let out = if blocked {
                    causal_attention(q1, k1, v1, 0.3, offset)
                } else {
                    causal_block(q1, k1, v1, 0.3, offset, &CoreOptions::default())
                };
                let grads = (out.clone() * w.clone()).sum().backward();
                let g = |t: &Tensor<4>| t.grad(&grads).expect("a gradient").into_data();
                (out.into_data(), g(&q), g(&k), g(&v))
            };
            let (a, b) = (run(true), run(false));
            // The gradients of k and v sum over the blocks in another order than the whole
            // matrix's GEMM (f32 rounding ~1e-6 at these sums of ~300 terms of size ~1); a
            // wrong mask or a key outside a block's range would differ by ~1e-1.
            let tol = Tolerance::rel_abs(1e-4, 1e-5);
            a.0.assert_approx_eq::<f32>(&b.0, tol);
            a.1.assert_approx_eq::<f32>(&b.1, tol);
            a.2.assert_approx_eq::<f32>(&b.2, tol);
            a.3.assert_approx_eq::<f32>(&b.3, tol);
        }
    }

    /// A block with biases, sinks of size ~1 and `window`, random weights.
    fn gpt_oss_like(window: Option<usize>, device: &Device) -> Attention {
        let mut attn = AttentionConfig::new(16, 4, 2, 8)
            .with_attention_bias(true)
            .with_qk_norm(false)
            .with_sinks(true)
            .with_sliding_window(window)
            .init(device)
            .unwrap();
        attn.sinks = Some(Param::from_tensor(Tensor::random(
            [4],
            Distribution::Normal(0.0, 1.0),
            device,
        )));
        attn
    }

    /// The whole sequence equals token-by-token decoding with the (window-trimmed) cache far
    /// past the window, with sinks; and the window and sinks change the output.
    #[test]
    fn decoding_past_the_window_with_sinks_matches_the_full_forward() {
        let device = Device::flex();
        let attn = gpt_oss_like(Some(3), &device);
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let x = Tensor::<3>::random([2, 9, 16], Distribution::Normal(0.0, 1.0), &device);
        let full = attn.forward(x.clone(), &rope.tables(0, 9, &device), None);
        let mut cache = LayerCache::default();
        let mut parts = vec![attn.forward(
            x.clone().narrow(1, 0, 4),
            &rope.tables(0, 4, &device),
            Some(&mut cache),
        )];
        for pos in 4..9 {
            parts.push(attn.forward(
                x.clone().narrow(1, pos, 1),
                &rope.tables(pos, 1, &device),
                Some(&mut cache),
            ));
            assert_eq!((cache.seq_len(), cache.held()), (pos + 1, 2));
        }
        Tensor::cat(parts, 1)
            .into_data()
            .assert_approx_eq::<f32>(&full.clone().into_data(), Tolerance::rel_abs(1e-5, 1e-5));
        let mut wide = attn.clone();
        wide.sliding_window = None;
        let mut sinkless = attn.clone();
        sinkless.sinks = None;
        for other in [wide, sinkless] {
            let o = other.forward(x.clone(), &rope.tables(0, 9, &device), None);
            let d = (o - full.clone()).abs().max().into_scalar::<f32>();
            assert!(d > 1e-3, "the option changes the output ({d})");
        }
    }

    /// The sliding window over a packed row: each document equals the document alone.
    #[test]
    fn packed_documents_slide_within_themselves() {
        let device = Device::flex();
        let attn = gpt_oss_like(Some(2), &device);
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let x = Tensor::<3>::random([1, 9, 16], Distribution::Normal(0.0, 1.0), &device);
        let layout =
            crate::packing::SequenceLayout::from_cu_seqlens(1, 9, vec![vec![0, 4, 9]]).unwrap();
        let packed = crate::packing::PackedInputs::new(&layout, &rope, &device);
        let out = attn.forward_masked(x.clone(), &packed.rope, Some(&packed.mask));
        for (start, len) in [(0, 4), (4, 5)] {
            let alone = attn.forward(
                x.clone().narrow(1, start, len),
                &rope.tables(0, len, &device),
                None,
            );
            out.clone()
                .narrow(1, start, len)
                .into_data()
                .assert_approx_eq::<f32>(&alone.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
        }
    }

    /// Tensor parallelism of sinks: each of 2 ranks holds half the heads (q/k/v columns, the
    /// sinks' entries, o_proj rows; o_proj's bias on one rank) and the sum of their partial
    /// outputs (TP's reduce) is the whole block's output.
    #[test]
    fn sinks_split_by_head_sum_to_the_whole_block() {
        let device = Device::flex();
        let attn = gpt_oss_like(Some(3), &device);
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let tables = rope.tables(0, 6, &device);
        let x = Tensor::<3>::random([2, 6, 16], Distribution::Normal(0.0, 1.0), &device);
        let full = attn.forward(x.clone(), &tables, None);
        let tp = 2;
        let column = |l: &Linear, r: usize| {
            let w = l.weight.val();
            let n = w.dims()[1] / tp;
            let mut l = l.clone();
            l.weight = Param::from_tensor(w.narrow(1, r * n, n));
            l.bias = l
                .bias
                .map(|b| Param::from_tensor(b.val().narrow(0, r * n, n)));
            l
        };
        let mut sum = Tensor::<3>::zeros(full.dims(), &device);
        for r in 0..tp {
            let mut shard = attn.clone();
            shard.q_proj = column(&attn.q_proj, r);
            shard.k_proj = column(&attn.k_proj, r);
            shard.v_proj = column(&attn.v_proj, r);
            let w = attn.o_proj.weight.val();
            let n = w.dims()[0] / tp;
            shard.o_proj.weight = Param::from_tensor(w.narrow(0, r * n, n));
            if r > 0 {
                shard.o_proj.bias = None;
            }
            let sinks = attn.sinks.as_ref().unwrap().val();
            shard.sinks = Some(Param::from_tensor(sinks.narrow(0, r * 2, 2)));
            let shard = shard.with_local_heads().unwrap();
            assert_eq!((shard.num_heads, shard.num_kv_heads), (2, 1));
            sum = sum + shard.forward(x.clone(), &tables, None);
        }
        sum.into_data()
            .assert_approx_eq::<f32>(&full.into_data(), Tolerance::rel_abs(1e-5, 1e-5));
        // A sink vector of the wrong length is refused naming it.
        let mut bad = attn.clone();
        bad.sinks = Some(Param::from_tensor(Tensor::zeros([3], &device)));
        let e = bad.with_local_heads().unwrap_err().to_string();
        assert!(e.contains("sinks"), "{e}");
    }

    /// The blocked causal core with a window (and sinks) equals the whole masked matrix, in
    /// values and gradients, including the blocks that skip keys before the window.
    #[test]
    fn blocked_sliding_attention_equals_the_whole_masked_matrix() {
        let device = Device::flex().autodiff();
        let s = 2 * CAUSAL_QUERY_BLOCK + 21;
        for (offset, sk, window) in [(0, s, 100), (5, s + 5, 7)] {
            let leaf = |shape: [usize; 4]| {
                Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
            };
            let (q, k, v) = (leaf([1, 4, s, 8]), leaf([1, 2, sk, 8]), leaf([1, 2, sk, 6]));
            let sinks =
                Tensor::<1>::random([4], Distribution::Normal(0.0, 1.0), &device).require_grad();
            let w = Tensor::<4>::random([1, 4, s, 6], Distribution::Normal(0.0, 1.0), &device);
            let options = CoreOptions {
                sliding_window: Some(window),
                sinks: Some(sinks.clone()),
            };
            let run = |blocked: bool| {
                let (q1, k1, v1) = (q.clone(), k.clone(), v.clone());
                let out = if blocked {
                    causal_attention_with(q1, k1, v1, 0.3, offset, &options)
                } else {
                    causal_block(q1, k1, v1, 0.3, offset, &options)
                };
                let grads = (out.clone() * w.clone()).sum().backward();
                let g4 = |t: &Tensor<4>| t.grad(&grads).expect("a gradient").into_data();
                let gs = sinks.grad(&grads).expect("a gradient").into_data();
                (out.into_data(), g4(&q), g4(&k), g4(&v), gs)
            };
            let (a, b) = (run(true), run(false));
            let tol = Tolerance::rel_abs(1e-4, 1e-5);
            a.0.assert_approx_eq::<f32>(&b.0, tol);
            a.1.assert_approx_eq::<f32>(&b.1, tol);
            a.2.assert_approx_eq::<f32>(&b.2, tol);
            a.3.assert_approx_eq::<f32>(&b.3, tol);
            a.4.assert_approx_eq::<f32>(&b.4, tol);
            // The whole matrix against the explicit mask of the same positions.
            let mask = AttentionMask::from_blocked(
                Tensor::<2, Bool>::tril_mask([s, sk], offset as i64, &device).unsqueeze::<3>(),
            );
            let masked =
                masked_attention_with(q.clone(), k.clone(), v.clone(), 0.3, &mask, &options);
            masked.into_data().assert_approx_eq::<f32>(&a.0, tol);
        }
    }

    /// Selective recompute of the core keeps the sinks' gradient.
    #[test]
    fn recomputed_core_keeps_the_sinks_gradient() {
        let device = Device::flex().autodiff();
        let leaf = |shape: [usize; 4]| {
            Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
        };
        let (q, k, v) = (leaf([1, 4, 6, 8]), leaf([1, 2, 6, 8]), leaf([1, 2, 6, 8]));
        let sinks =
            Tensor::<1>::random([4], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let options = CoreOptions {
            sliding_window: Some(2),
            sinks: Some(sinks.clone()),
        };
        let grad = |recompute: bool| {
            let out = attention_core_with(
                q.clone(),
                k.clone(),
                v.clone(),
                0.3,
                None,
                0,
                recompute,
                &options,
            );
            let grads = (out.clone() * out).sum().backward();
            sinks.grad(&grads).expect("sinks gradient").into_data()
        };
        grad(true).assert_approx_eq::<f32>(&grad(false), Tolerance::rel_abs(1e-5, 1e-6));
    }

    /// q/k/v biases split with their heads under TP; the row-parallel `o_proj`'s bias is left
    /// out of the partial output (the stack adds it once after the reduction) and splits fine.
    #[test]
    fn o_proj_bias_is_left_to_the_stack_under_tp() {
        let device = Device::flex();
        let qkv_only = AttentionConfig::new(16, 4, 2, 8)
            .with_attention_bias(true)
            .with_o_proj_bias(false);
        assert!(qkv_only.check_split(2).is_ok());
        let attn = qkv_only.init(&device).unwrap();
        assert!(attn.q_proj.bias.is_some() && attn.v_proj.bias.is_some());
        assert!(attn.o_proj.bias.is_none());
        let all = AttentionConfig::new(16, 4, 2, 8).with_attention_bias(true);
        assert!(all.check_split(2).is_ok());
        let attn = all.init(&device).unwrap();
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let tables = rope.tables(0, 5, &device);
        let x = Tensor::<3>::random([1, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let whole = attn.forward(x.clone(), &tables, None);
        let Ok(partial) = attn.forward_partial(x, &tables, None, None, Ok::<_, Infallible>, false);
        let bias = attn.output_bias().unwrap();
        (partial + bias.unsqueeze_dim::<2>(0).unsqueeze_dim(0))
            .into_data()
            .assert_approx_eq::<f32>(&whole.into_data(), Tolerance::rel_abs(1e-6, 1e-6));
    }

    #[test]
    fn first_position_attends_only_to_itself() {
        // With one key visible, the output of position 0 is v_0 (softmax of one score is 1).
        let device = Device::flex();
        let q = Tensor::<4>::random([1, 2, 3, 4], Distribution::Default, &device);
        let k = Tensor::<4>::random([1, 1, 3, 4], Distribution::Default, &device);
        let v = Tensor::<4>::random([1, 1, 3, 4], Distribution::Default, &device);
        let out = causal_attention(q, k, v.clone(), 0.5, 0);
        let first = out.narrow(2, 0, 1).narrow(1, 1, 1);
        first
            .into_data()
            .assert_approx_eq::<f32>(&v.narrow(2, 0, 1).into_data(), Tolerance::default());
    }
}
