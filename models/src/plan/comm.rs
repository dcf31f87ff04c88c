//! Communication per layer and per step, by collective family, as payload bytes one rank
//! addresses to the other members of its groups (the in-process communicator's
//! [`Traffic`](moe_backend::comm::Traffic) counts the same quantity): an all-gather sends the
//! rank's block to every other member, a reduce-scatter every block but its own, an all-to-all
//! every block addressed elsewhere, an all-reduce its whole buffer to every other member.
//!
//! Collectives follow this project's implementation (models/src/distributed,
//! docs/routing-and-dispatch.md §Token dispatchers,
//! docs/parallelism.md §Distributed optimizer (ZeRO-1)):
//! - TP with sequence parallelism: attention and dense MLPs all-gather their normed input and
//!   reduce-scatter their output (backward: the transposes), the vocab-parallel embedding
//!   reduce-scatters, the head all-gathers, the cross-entropy all-reduces three f32 values per
//!   token; the optimizer sums sequence-parallel gradients over `tp`.
//! - EP: AlltoAll dispatcher = per-expert count all-gather over `tp_ep`, token and probability
//!   all-to-all over `ep`, ETP all-gather / reduce-scatter over `expt_tp`, and the inverse to
//!   combine; backward runs each transpose. AllGather dispatcher = all-gather of tokens,
//!   probabilities and routing map over `tp_ep`, reduce-scatter back.
//! - DP: ZeRO-1 reduce-scatter + all-gather of the f32 gradient/parameter buffers over `dp_cp`
//!   (dense) and `expt_dp` (experts); the f64 gradient-norm all-reduce over the world; the f32
//!   target-token count of the global batch all-reduced over `dp_cp`; the trainer's non-finite
//!   check, three f32 all-reduced over the world per step.
//! - PP (estimate; not implemented in-process): each chunk sends its `[N/(tp·cp), h]` output
//!   forward and its input gradient backward.
//! - CP: every attention layer all-gathers this rank's keys and values (GQA: its heads'
//!   `k`, `v` of the rank's `N/cp` tokens; MLA: the compressed latent and the shared rotary
//!   key, not head-split) over `cp` forward, and reduce-scatters their gradients backward;
//!   the step sums the replica's logged loss values (cross-entropy, aux) and target count
//!   over `cp` (one more f32 of each per MTP depth, which the shape does not carry).

use moe_backend::parallel::ParallelLayout;
use moe_backend::parallel::pipeline::StageParts;

use super::shape::ModelShape;
use super::{PlanError, RankParams};

/// Token dispatcher of the MoE layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dispatcher {
    /// All-to-all over `ep` (+ ETP all-gather / reduce-scatter).
    #[default]
    AllToAll,
    /// All-gather over `tp_ep`, reduce-scatter back.
    AllGather,
}

/// Bytes by collective family.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FamilyBytes {
    /// Dense tensor parallel (`tp`, incl. sequence parallelism).
    pub tp: f64,
    /// Context parallel (`cp`).
    pub cp: f64,
    /// Expert parallel all-to-all (`ep`).
    pub ep: f64,
    /// Expert tensor parallel (`expt_tp`).
    pub expt_tp: f64,
    /// Count exchange / AllGather dispatcher (`tp_ep`).
    pub tp_ep: f64,
    /// Dense gradient reduce-scatter and parameter all-gather (`dp_cp`).
    pub dp_cp: f64,
    /// Expert gradient reduce-scatter and parameter all-gather (`expt_dp`).
    pub expt_dp: f64,
    /// Pipeline send/recv (`pp`).
    pub pp: f64,
    /// Gradient-norm all-reduce (all ranks).
    pub world: f64,
}

impl FamilyBytes {
    /// `(name, bytes)` of every family.
    pub fn families(&self) -> [(&'static str, f64); 9] {
        [
            ("tp", self.tp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("expt_tp", self.expt_tp),
            ("tp_ep", self.tp_ep),
            ("dp_cp", self.dp_cp),
            ("expt_dp", self.expt_dp),
            ("pp", self.pp),
            ("world", self.world),
        ]
    }

    /// All families together.
    pub fn total(&self) -> f64 {
        self.families().iter().map(|(_, b)| b).sum()
    }

    fn add_scaled(&mut self, o: &FamilyBytes, s: f64) {
        self.tp += o.tp * s;
        self.cp += o.cp * s;
        self.ep += o.ep * s;
        self.expt_tp += o.expt_tp * s;
        self.tp_ep += o.tp_ep * s;
        self.dp_cp += o.dp_cp * s;
        self.expt_dp += o.expt_dp * s;
        self.pp += o.pp * s;
        self.world += o.world * s;
    }
}

/// Settings of the communication model.
#[derive(Debug, Clone, PartialEq)]
pub struct CommOptions {
    /// Sequence length.
    pub seq: usize,
    /// Sequences per micro-batch and data-parallel replica.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Virtual pipeline stages per rank.
    pub vpp: usize,
    /// Bytes of an activation element (2 for BF16, 4 for f32).
    pub act_bytes: usize,
    /// Bytes of a router probability (f32: 4).
    pub prob_bytes: usize,
    /// Bytes of an integer count / routing-map element.
    pub int_bytes: usize,
    /// Token dispatcher.
    pub dispatcher: Dispatcher,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self {
            seq: 4096,
            micro_batch: 1,
            microbatches: 1,
            vpp: 1,
            act_bytes: 2,
            prob_bytes: 4,
            int_bytes: 8,
            dispatcher: Dispatcher::AllToAll,
        }
    }
}

/// Tokens routed to each expert by each source rank of one MoE layer:
/// `counts[member][expert]`, `member = ep_rank·etp + etp_rank` in the `tp_ep` group.
pub type LayerRouting = Vec<Vec<f64>>;

/// Routing the EP volumes are computed for.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Routing {
    /// Every rank sends `T·k/E` rows to every expert.
    #[default]
    Uniform,
    /// Measured counts of every MoE layer, in layer order.
    Measured(Vec<LayerRouting>),
}

/// One layer's forward + backward traffic for one micro-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerTraffic {
    /// Layer index.
    pub layer: usize,
    /// MoE layer.
    pub moe: bool,
    /// Bytes by family.
    pub bytes: FamilyBytes,
}

/// Per-step traffic of one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTraffic {
    /// Layers of the rank's stage (per micro-batch, forward + backward).
    pub layers: Vec<LayerTraffic>,
    /// Embedding, head and loss per micro-batch.
    pub embedding_head: FamilyBytes,
    /// Pipeline sends per micro-batch.
    pub pipeline: FamilyBytes,
    /// Optimizer step (once per step).
    pub optimizer: FamilyBytes,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Whole step.
    pub total: FamilyBytes,
}

/// Forward + backward EP traffic of one MoE layer for the rank that is member `me` of `tp_ep`.
pub fn moe_layer_traffic(
    shape: &ModelShape,
    layout: &ParallelLayout,
    opts: &CommOptions,
    routing: &LayerRouting,
    me: usize,
) -> Result<FamilyBytes, PlanError> {
    let (ep, etp) = (layout.ep, layout.etp);
    let n = ep * etp;
    let e = shape.experts;
    if routing.len() != n
        || routing.iter().any(|r| r.len() != e)
        || me >= n
        || !e.is_multiple_of(ep)
    {
        return Err(PlanError::Routing(format!(
            "need {n} members × {e} experts (experts divisible by ep = {ep}), member {me}"
        )));
    }
    let (h, a, pb, ib) = (
        shape.hidden as f64,
        opts.act_bytes as f64,
        opts.prob_bytes as f64,
        opts.int_bytes as f64,
    );
    let mut b = FamilyBytes::default();
    match opts.dispatcher {
        Dispatcher::AllGather => {
            if n > 1 {
                let rows = |m: usize| routing[m].iter().sum::<f64>() / shape.top_k as f64;
                let mine = rows(me);
                let others: f64 = (0..n).filter(|&m| m != me).map(rows).sum();
                let (nf, ef) = ((n - 1) as f64, e as f64);
                // Forward: tokens, probabilities [T, E] and map [T, E] gathered, output
                // reduce-scattered; backward: the transposes of tokens, probabilities, output.
                b.tp_ep = nf * mine * (h * a + ef * pb + ef * ib)
                    + others * h * a
                    + others * (h * a + ef * pb)
                    + nf * mine * h * a;
            }
        }
        Dispatcher::AllToAll => {
            if n > 1 {
                b.tp_ep = (n - 1) as f64 * e as f64 * ib;
            }
            let l = e / ep;
            let (e_me, t_me) = (me / etp, me % etp);
            let to_ep = |src: usize, dst_ep: usize| -> f64 {
                routing[src][dst_ep * l..(dst_ep + 1) * l].iter().sum()
            };
            let sent: f64 = (0..ep).filter(|&j| j != e_me).map(|j| to_ep(me, j)).sum();
            let from = |s: usize, t: usize| to_ep(s * etp + t, e_me);
            let received: f64 = (0..ep).filter(|&s| s != e_me).map(|s| from(s, t_me)).sum();
            let mine: f64 = (0..ep).map(|s| from(s, t_me)).sum();
            let other_tp: f64 = (0..etp)
                .filter(|&t| t != t_me)
                .map(|t| (0..ep).map(|s| from(s, t)).sum::<f64>())
                .sum();
            // Tokens: dispatch + combine, forward + backward; probabilities: forward dispatch
            // and its backward.
            b.ep = 2.0 * (sent + received) * h * a + (sent + received) * pb;
            let gathered = (etp - 1) as f64 * mine;
            b.expt_tp = 2.0 * (gathered + other_tp) * h * a + (gathered + other_tp) * pb;
        }
    }
    Ok(b)
}

/// Uniform routing of `tokens` local tokens per member.
pub fn uniform_routing(shape: &ModelShape, layout: &ParallelLayout, tokens: f64) -> LayerRouting {
    let per_expert = tokens * shape.top_k as f64 / shape.experts as f64;
    vec![vec![per_expert; shape.experts]; layout.ep * layout.etp]
}

/// ZeRO-1 traffic of one optimizer step: ring reduce-scatter + all-gather of the f32 buffers
/// (padded to a multiple of the group size), the TP sum of sequence-parallel gradients, the
/// world all-reduce of the f64 norm (see [`super::zero1_step_bytes`]) and the `dp_cp`
/// all-reduce of the global batch's f32 target-token count (per-token loss normalisation).
pub fn optimizer_traffic(params: &RankParams, layout: &ParallelLayout) -> FamilyBytes {
    let ring = |len: u64, n: usize| {
        let n = n as u64;
        (2 * (n - 1) * len.div_ceil(n) * 4) as f64
    };
    FamilyBytes {
        dp_cp: ring(params.trainable_dense(), layout.dp * layout.cp)
            + ((layout.dp * layout.cp - 1) * 4) as f64,
        expt_dp: ring(params.expert, layout.edp),
        // The replica's logged loss sums (two f32) and target count (one f32) over `cp`.
        cp: ((layout.cp - 1) * 12) as f64,
        tp: ((layout.tp - 1) as u64 * params.trainable_replicated() * 4) as f64,
        world: ((layout.world - 1) * 8) as f64,
        ..FamilyBytes::default()
    }
}

/// Per-layer and per-step traffic of a rank of pipeline stage `stage` that is member
/// `tp_ep_member` of its `tp_ep` group, holding `params`, with `opts.vpp` contiguous virtual
/// stages per rank ([`super::default_chunks`]); see [`chunk_traffic`] for an explicit split.
#[allow(clippy::too_many_arguments)]
pub fn step_traffic(
    shape: &ModelShape,
    params: &RankParams,
    layout: &ParallelLayout,
    opts: &CommOptions,
    stage: usize,
    tp_ep_member: usize,
    routing: &Routing,
) -> Result<StepTraffic, PlanError> {
    let chunks = super::default_chunks(shape.layers(), 0, layout.pp, opts.vpp.max(1), stage);
    chunk_traffic(
        shape,
        params,
        layout,
        opts,
        stage,
        &chunks,
        tp_ep_member,
        routing,
    )
}

/// Per-layer and per-step traffic of pipeline rank `stage` holding `chunks` (its virtual stages
/// in chunk order, see [`super::rank_chunks`]; their number is the schedule's `vpp`, `opts.vpp`
/// is not read), member `tp_ep_member` of its `tp_ep` group, holding `params`: the chunks'
/// layers, the embedding / head collectives where a chunk holds the embedding / the loss, and
/// the pipeline sends of every chunk.
#[allow(clippy::too_many_arguments)]
pub fn chunk_traffic(
    shape: &ModelShape,
    params: &RankParams,
    layout: &ParallelLayout,
    opts: &CommOptions,
    stage: usize,
    chunks: &[StageParts],
    tp_ep_member: usize,
    routing: &Routing,
) -> Result<StepTraffic, PlanError> {
    let (tp, cp) = (layout.tp as f64, layout.cp as f64);
    let vpp = chunks.len().max(1);
    let (h, a) = (shape.hidden as f64, opts.act_bytes as f64);
    // Tokens of one micro-batch of a replica on this CP rank, and this rank's SP block.
    let n = (opts.seq * opts.micro_batch) as f64 / cp;
    let sp_block = n / tp;
    // One SP all-gather (or reduce-scatter) of `[N, h]`.
    let sp = (tp - 1.0) * sp_block * h * a;
    // What each attention layer all-gathers over `cp` per token of the rank.
    let kv_local = n * shape.attention.cp_exchange_width(layout.tp) * a;
    let measured = match routing {
        Routing::Measured(layers) => {
            let moe_count = shape.moe_layers.iter().filter(|&&m| m).count();
            if layers.len() != moe_count {
                return Err(PlanError::Routing(format!(
                    "{} measured MoE layers for a model with {moe_count}",
                    layers.len()
                )));
            }
            Some(layers)
        }
        Routing::Uniform => None,
    };
    let uniform = uniform_routing(shape, layout, sp_block);
    let mut layers = Vec::new();
    let mut moe_index = 0;
    let chunk_ids: Vec<usize> = chunks.iter().flat_map(|p| p.layers.clone()).collect();
    for layer in 0..shape.layers() {
        let moe = shape.moe_layers[layer];
        let mut b = FamilyBytes {
            tp: 4.0 * sp,
            cp: 2.0 * (cp - 1.0) * kv_local,
            ..FamilyBytes::default()
        };
        if moe {
            let r = match measured {
                Some(layers) => &layers[moe_index],
                None => &uniform,
            };
            moe_index += 1;
            b.add_scaled(
                &moe_layer_traffic(shape, layout, opts, r, tp_ep_member)?,
                1.0,
            );
        } else {
            b.tp += 4.0 * sp;
        }
        if chunk_ids.contains(&layer) {
            layers.push(LayerTraffic {
                layer,
                moe,
                bytes: b,
            });
        }
    }
    let mut embedding_head = FamilyBytes::default();
    if chunks.iter().any(|p| p.embedding) {
        embedding_head.tp += 2.0 * sp;
    }
    if chunks.iter().any(|p| p.loss) {
        // Head input all-gather + its backward, three f32 cross-entropy all-reduces of `[N]`.
        embedding_head.tp += 2.0 * sp + 3.0 * (tp - 1.0) * n * 4.0;
    }
    let mut pipeline = FamilyBytes::default();
    for chunk in 0..vpp {
        let virtual_stage = stage + chunk * layout.pp;
        let sends =
            usize::from(virtual_stage + 1 < layout.pp * vpp) + usize::from(virtual_stage > 0);
        pipeline.pp += sends as f64 * sp_block * h * a;
    }
    let optimizer = optimizer_traffic(params, layout);
    let m = opts.microbatches.max(1) as f64;
    let mut total = optimizer;
    // The trainer's non-finite check (on by default): one f32 flag per logged loss
    // (cross-entropy, aux; one more per MTP depth, which the shape does not carry) and the
    // lowest bad rank's slot, all-reduced over the world once per step.
    total.world += ((layout.world - 1) * 3 * 4) as f64;
    for l in &layers {
        total.add_scaled(&l.bytes, m);
    }
    total.add_scaled(&embedding_head, m);
    total.add_scaled(&pipeline, m);
    Ok(StepTraffic {
        layers,
        embedding_head,
        pipeline,
        optimizer,
        microbatches: opts.microbatches.max(1),
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::shape::AttentionShape;

    fn shape(experts: usize, k: usize, h: usize) -> ModelShape {
        ModelShape {
            vocab: 16,
            hidden: h,
            attention: AttentionShape::Gqa {
                heads: 2,
                kv_heads: 2,
                head_dim: 4,
                qk_norm: true,
            },
            moe_layers: vec![true],
            dense_ffn: 8,
            experts,
            top_k: k,
            moe_ffn: 8,
            shared_ffn: 0,
            tied_embeddings: false,
        }
    }

    #[test]
    fn uniform_all_to_all_matches_the_spec_formula() {
        // docs/parallelism.md §Planner formulas: T·k·h·bytes·(EP−1)/EP per direction; dispatch +
        // combine, forward + backward = 4×. V4 example: T = 4096, k = 6, h = 7168, BF16, EP64 ⇒
        // 1323 MiB.
        let s = shape(384, 6, 7168);
        let layout = ParallelLayout::parse(64, "ep=64").unwrap();
        let opts = CommOptions::default();
        let r = uniform_routing(&s, &layout, 4096.0);
        let b = moe_layer_traffic(&s, &layout, &opts, &r, 5).unwrap();
        let tokens = b.ep - 2.0 * 4096.0 * 6.0 * 63.0 / 64.0 * 4.0; // minus probabilities
        assert_eq!(tokens / (1024.0 * 1024.0), 1323.0);
    }
}
