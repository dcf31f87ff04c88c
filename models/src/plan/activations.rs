//! Activation memory per GPU, by module: the tensors a training forward keeps for its backward
//! (Megatron-Core with Transformer Engine semantics), divided by sequence/tensor/context
//! parallelism, times the micro-batches a pipeline stage holds in flight.
//!
//! Saved tensors per token (elements, `a` bytes each unless stated; `T` = local tokens):
//! - norms: each RMSNorm keeps its input; its output is kept as the input of the following
//!   linear layers (shared by all of them).
//! - attention (flash): query, key, value, output, and the f32 log-sum-exp per head; Qwen3's
//!   QK-norm keeps the pre-norm queries and keys; MLA keeps the latent down-projections
//!   (`q_lora`, `kv_lora`) before and after their norms.
//! - dense MLP / shared experts (SwiGLU): fc1 output `2F` and activation output `F` (the fc1
//!   input is the norm output).
//! - router: f32 scores and a bool routing map `[T, E]`, f32 top-k probabilities `[T, k]`;
//!   permutation: an int32 row map `[T, k]`.
//! - routed experts (uniform routing, expected rows): fc1 input `k·h·ETP` (after the ETP
//!   all-gather), fc1 output `2·k·F`, activation output `k·F`; unpermute keeps the returned
//!   expert output `k·h` to form the router-probability gradient, which memory-efficient
//!   permutation removes (the report's §4.1.2: probabilities applied before fc2).
//! - embedding: int64 token ids; LM head and loss (last stage): final-norm input and output and
//!   the f32 softmax of this rank's vocabulary columns.
//!
//! FP8 (`fp8`) stores the tensors kept only as linear-layer inputs in one byte: norm outputs,
//! MLA latent norm outputs, routed fc1 inputs and every fc2 input. Recomputed modules drop what
//! they would recompute (Megatron's `--recompute-modules`); full recomputation keeps only each
//! layer's input plus one layer's activations while it is recomputed.

use moe_backend::parallel::ParallelLayout;
use moe_backend::parallel::pipeline::StageParts;

use super::shape::{AttentionShape, ModelShape};

pub use crate::recompute::{Recompute, RecomputeModule};

/// Settings of the activation model.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivationOptions {
    /// Sequence length.
    pub seq: usize,
    /// Micro-batch size.
    pub micro_batch: usize,
    /// Micro-batches per step (`global batch / (micro_batch · dp)`).
    pub microbatches: usize,
    /// Virtual pipeline stages per rank (interleaved 1F1B when > 1).
    pub vpp: usize,
    /// Bytes of a stored activation element (2 for BF16).
    pub act_bytes: usize,
    /// Store linear-layer inputs in FP8 (1 byte).
    pub fp8: bool,
    /// Recomputation.
    pub recompute: Recompute,
    /// Memory-efficient permutation (router probabilities applied before fc2).
    pub memory_efficient_permutation: bool,
}

impl Default for ActivationOptions {
    fn default() -> Self {
        Self {
            seq: 4096,
            micro_batch: 1,
            microbatches: 1,
            vpp: 1,
            act_bytes: 2,
            fp8: false,
            recompute: Recompute::None,
            memory_efficient_permutation: false,
        }
    }
}

/// Activation bytes by module.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ActivationBytes {
    /// Layer norms (inputs and outputs).
    pub norms: f64,
    /// Attention (projections, MLA latents, QK-norm, flash-attention tensors).
    pub attention: f64,
    /// Dense MLPs.
    pub dense_mlp: f64,
    /// Router scores, routing map and probabilities.
    pub router: f64,
    /// Permutation row maps.
    pub permute: f64,
    /// Routed experts (fc1 input, fc1 output, activation output).
    pub experts: f64,
    /// Unpermute (returned expert outputs kept for the probability gradient).
    pub unpermute: f64,
    /// Shared experts.
    pub shared_experts: f64,
    /// Embedding inputs, LM head and loss.
    pub embedding_head: f64,
    /// Layer inputs kept by full recomputation, plus one recomputed layer.
    pub recompute_checkpoints: f64,
}

impl ActivationBytes {
    /// Sum of all modules.
    pub fn total(&self) -> f64 {
        self.norms
            + self.attention
            + self.dense_mlp
            + self.router
            + self.permute
            + self.experts
            + self.unpermute
            + self.shared_experts
            + self.embedding_head
            + self.recompute_checkpoints
    }

    fn add_scaled(&mut self, o: &ActivationBytes, s: f64) {
        self.norms += o.norms * s;
        self.attention += o.attention * s;
        self.dense_mlp += o.dense_mlp * s;
        self.router += o.router * s;
        self.permute += o.permute * s;
        self.experts += o.experts * s;
        self.unpermute += o.unpermute * s;
        self.shared_experts += o.shared_experts * s;
        self.embedding_head += o.embedding_head * s;
        self.recompute_checkpoints += o.recompute_checkpoints * s;
    }

    /// `(name, bytes)` of every module, in display order.
    pub fn modules(&self) -> [(&'static str, f64); 10] {
        [
            ("norms", self.norms),
            ("attention", self.attention),
            ("dense_mlp", self.dense_mlp),
            ("router", self.router),
            ("permute", self.permute),
            ("experts", self.experts),
            ("unpermute", self.unpermute),
            ("shared_experts", self.shared_experts),
            ("embedding_head", self.embedding_head),
            ("recompute_checkpoints", self.recompute_checkpoints),
        ]
    }
}

/// Saved bytes of one layer for one micro-batch on one rank, with everything kept
/// (no recomputation) or as `opts` says.
pub fn layer_activations(
    shape: &ModelShape,
    moe: bool,
    layout: &ParallelLayout,
    opts: &ActivationOptions,
    apply_recompute: bool,
) -> ActivationBytes {
    let none = Recompute::None;
    let rc = if apply_recompute {
        &opts.recompute
    } else {
        &none
    };
    // Local tokens: sequence parallelism splits over tp, context parallelism over cp.
    let t = (opts.seq * opts.micro_batch) as f64 / (layout.tp * layout.cp) as f64;
    let a = opts.act_bytes as f64;
    let lin = if opts.fp8 { 1.0 } else { a };
    let h = shape.hidden as f64;
    let mut b = ActivationBytes::default();

    // Norms: inputs (a) and outputs (linear inputs) of the input and pre-MLP norms.
    let norm_out = if rc.has(RecomputeModule::Layernorm) {
        0.0
    } else {
        lin
    };
    b.norms = 2.0 * t * h * (a + norm_out);

    // Attention.
    let (q, k, v, o) = shape.attention.qkvo();
    let heads = shape.attention.heads() as f64;
    let qkv = if rc.has(RecomputeModule::MlaUpProj)
        && matches!(shape.attention, AttentionShape::Mla { .. })
    {
        0.0
    } else {
        (q + k + v) as f64 * a
    };
    let lse = if rc.has(RecomputeModule::CoreAttn) {
        0.0
    } else {
        heads * 4.0
    };
    let extra = match shape.attention {
        AttentionShape::Gqa { qk_norm, .. } => {
            if qk_norm {
                (q + k) as f64 * a
            } else {
                0.0
            }
        }
        AttentionShape::Mla {
            q_lora_rank,
            kv_lora_rank,
            ..
        } => {
            let r = q_lora_rank.unwrap_or(0) as f64 + kv_lora_rank as f64;
            r * (a + lin)
        }
    };
    b.attention = t * (qkv + o as f64 * a + lse + extra);

    if moe {
        if rc.has(RecomputeModule::Moe) {
            return b;
        }
        let (e, kk) = (shape.experts as f64, shape.top_k as f64);
        let f = shape.moe_ffn as f64;
        b.router = t * (e * 5.0 + kk * 4.0);
        b.permute = t * kk * 4.0;
        let act = if rc.has(RecomputeModule::MoeAct) {
            0.0
        } else {
            lin
        };
        b.experts = t * kk * (h * layout.etp as f64 * lin + 2.0 * f * a + f * act);
        b.unpermute = if opts.memory_efficient_permutation {
            0.0
        } else {
            t * kk * h * a
        };
        if shape.shared_ffn > 0 && !rc.has(RecomputeModule::SharedExperts) {
            let fs = shape.shared_ffn as f64;
            b.shared_experts = t * (2.0 * fs * a + fs * lin);
        }
    } else if !rc.has(RecomputeModule::Mlp) {
        let f = shape.dense_ffn as f64;
        b.dense_mlp = t * (2.0 * f * a + f * lin);
    }
    b
}

/// In-flight micro-batches of each model chunk of pipeline stage `stage` at the start of the
/// steady state (the peak): 1F1B holds `min(pp − stage, m)`; interleaved 1F1B runs
/// `2·(pp − stage − 1) + (vpp − 1)·pp` warm-up forwards plus one, in groups of `pp` micro-batches
/// per chunk (Megatron's schedule). For the first stage and equal chunks this is Megatron's
/// `pp·(1 + (pp − 1)/(pp·vpp))` micro-batches of the stage.
pub fn in_flight_per_chunk(pp: usize, vpp: usize, stage: usize, microbatches: usize) -> Vec<usize> {
    let m = microbatches.max(1);
    if vpp <= 1 {
        return vec![(pp - stage).min(m)];
    }
    let forwards = (2 * (pp - stage - 1) + (vpp - 1) * pp + 1).min(m * vpp);
    let mut counts = vec![0; vpp];
    for k in 0..forwards {
        counts[(k / pp) % vpp] += 1;
    }
    counts
}

/// Layers of model chunk `chunk` of stage `stage` (virtual stage `stage + chunk·pp` of
/// `pp·vpp` contiguous virtual stages, the remainder on the earlier ones; the split without an
/// explicit layout, see [`super::planner_split`]).
pub fn chunk_layers(
    layers: usize,
    pp: usize,
    vpp: usize,
    stage: usize,
    chunk: usize,
) -> std::ops::Range<usize> {
    super::stage_layers(layers, pp * vpp, stage + chunk * pp)
}

/// Peak activation bytes of a rank of pipeline stage `stage`, by module, with `opts.vpp`
/// contiguous virtual stages per rank ([`super::default_chunks`]); see [`chunk_activations`]
/// for an explicit split.
pub fn stage_activations(
    shape: &ModelShape,
    layout: &ParallelLayout,
    opts: &ActivationOptions,
    stage: usize,
) -> ActivationBytes {
    let chunks = super::default_chunks(shape.layers(), 0, layout.pp, opts.vpp.max(1), stage);
    chunk_activations(shape, layout, opts, stage, &chunks)
}

/// Peak activation bytes of pipeline rank `stage` holding `chunks` (its virtual stages in chunk
/// order, see [`super::rank_chunks`]; their number is the schedule's `vpp`, `opts.vpp` is not
/// read), by module: each chunk's layers times its in-flight micro-batches, the token ids where a
/// chunk holds the embedding, the head and loss where it holds the loss.
pub fn chunk_activations(
    shape: &ModelShape,
    layout: &ParallelLayout,
    opts: &ActivationOptions,
    stage: usize,
    chunks: &[StageParts],
) -> ActivationBytes {
    let vpp = chunks.len().max(1);
    let counts = in_flight_per_chunk(layout.pp, vpp, stage, opts.microbatches);
    let t = (opts.seq * opts.micro_batch) as f64 / (layout.tp * layout.cp) as f64;
    let a = opts.act_bytes as f64;
    let h = shape.hidden as f64;
    let mut total = ActivationBytes::default();
    let mut largest_layer = 0.0f64;
    for (part, &n) in chunks.iter().zip(&counts) {
        let n = n as f64;
        for layer in part.layers.clone() {
            let moe = shape.moe_layers.get(layer).copied().unwrap_or(false);
            if opts.recompute == Recompute::Full {
                let kept = layer_activations(shape, moe, layout, opts, false);
                largest_layer = largest_layer.max(kept.total());
                total.recompute_checkpoints += n * t * h * a;
            } else {
                total.add_scaled(&layer_activations(shape, moe, layout, opts, true), n);
            }
        }
        if part.embedding {
            // Token ids (int64, replicated over tp).
            total.embedding_head += n * t * layout.tp as f64 * 8.0;
        }
        if part.loss {
            // Final-norm input and output (sequence-parallel) and the f32 softmax of this
            // rank's vocabulary columns for every token of the micro-batch: `(N/cp)·(V/tp)`.
            let logits = t * shape.vocab as f64 * 4.0;
            total.embedding_head += n * (2.0 * t * h * a + logits);
        }
    }
    total.recompute_checkpoints += largest_layer;
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_stage_in_flight_matches_megatrons_penalty() {
        // Megatron: activation × (1 + (pp − 1)/(pp·vpp)) of pp micro-batches of the stage.
        for (pp, vpp) in [(4, 4), (8, 4), (4, 6), (2, 2), (4, 12)] {
            let counts = in_flight_per_chunk(pp, vpp, 0, 1000);
            let stage_microbatches = counts.iter().sum::<usize>() as f64 / vpp as f64;
            let megatron = pp as f64 * (1.0 + (pp - 1) as f64 / (pp * vpp) as f64);
            assert!((stage_microbatches - megatron).abs() < 1e-12, "{pp} {vpp}");
        }
        assert_eq!(in_flight_per_chunk(4, 1, 0, 100), vec![4]);
        assert_eq!(in_flight_per_chunk(4, 1, 3, 100), vec![1]);
        assert_eq!(in_flight_per_chunk(4, 1, 0, 2), vec![2]);
        // PP4 × VPP4, first stage: 19 forwards, chunk 0 gets micro-batches 0–3 and 16–18.
        assert_eq!(in_flight_per_chunk(4, 4, 0, 128), vec![7, 4, 4, 4]);
    }

    #[test]
    fn recompute_parses_megatron_module_lists() {
        assert_eq!("none".parse::<Recompute>().unwrap(), Recompute::None);
        assert_eq!("full".parse::<Recompute>().unwrap(), Recompute::Full);
        assert_eq!(
            "selective".parse::<Recompute>().unwrap(),
            Recompute::Selective([RecomputeModule::CoreAttn].into())
        );
        assert_eq!(
            "mla_up_proj,moe_act,layernorm"
                .parse::<Recompute>()
                .unwrap(),
            Recompute::Selective(
                [
                    RecomputeModule::MlaUpProj,
                    RecomputeModule::MoeAct,
                    RecomputeModule::Layernorm
                ]
                .into()
            )
        );
        assert!("attention".parse::<Recompute>().is_err());
    }
}
