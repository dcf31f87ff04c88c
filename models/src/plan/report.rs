//! A whole layout plan: per pipeline stage, the parameters, state memory, activation memory and
//! per-layer / per-step communication of one rank, with a JSON rendering.

use moe_backend::parallel::ParallelLayout;
use moe_backend::parallel::pipeline::{PipelineSplit, StageParts};
use serde_json::{Value, json};

use super::activations::{ActivationBytes, ActivationOptions, Recompute, chunk_activations};
use super::comm::{CommOptions, Dispatcher, Routing, StepTraffic, chunk_traffic};
use super::memory::{MemoryOptions, OptimizerDtype, StateBytes, state_bytes};
use super::shape::PlannedModel;
use super::{PlanError, RankParams, planner_split, rank_chunks, split_layout};

/// Everything a plan depends on besides the model and the layout.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Sequence length.
    pub seq: usize,
    /// Micro-batch size.
    pub micro_batch: usize,
    /// Global batch (sequences per step); `None`: `4·pp` micro-batches per step.
    pub global_batch: Option<usize>,
    /// Virtual pipeline stages per rank when the layout gives none (`layout.vpp == 1`); the
    /// layout's `vpp=V` is the source otherwise, and a different value here (> 1) is refused
    /// naming `vpp` (see [`plan_vpp`]). 1: the layout's.
    pub vpp: usize,
    /// FP8 activations (linear inputs) and FP8 primary weights.
    pub fp8: bool,
    /// Recomputation.
    pub recompute: Recompute,
    /// Memory-efficient permutation.
    pub memory_efficient_permutation: bool,
    /// Adam moment precision.
    pub optimizer_dtype: OptimizerDtype,
    /// ZeRO-1 distributed optimizer.
    pub distributed_optimizer: bool,
    /// Token dispatcher.
    pub dispatcher: Dispatcher,
    /// Training precision: BF16 mixed precision (Megatron's `--bf16`, the default) or f32;
    /// parameters, activations and the dispatched tokens take its bytes (main weights,
    /// gradients and moments as [`MemoryOptions::precision`] says).
    pub precision: moe_backend::optim::Precision,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            seq: 4096,
            micro_batch: 1,
            global_batch: None,
            vpp: 1,
            fp8: false,
            recompute: Recompute::None,
            memory_efficient_permutation: false,
            optimizer_dtype: OptimizerDtype::Fp32,
            distributed_optimizer: true,
            dispatcher: Dispatcher::AllToAll,
            precision: moe_backend::optim::Precision::Bf16,
        }
    }
}

impl PlanOptions {
    /// Micro-batches per step under `layout`.
    pub fn microbatches(&self, layout: &ParallelLayout) -> Result<usize, PlanError> {
        match self.global_batch {
            None => Ok(4 * layout.pp),
            Some(g) => {
                let per = self.micro_batch * layout.dp;
                if per == 0 || g % per != 0 || g == 0 {
                    return Err(PlanError::Option {
                        option: "global-batch",
                        detail: format!(
                            "{g} sequences are not a multiple of micro-batch × dp = {per}"
                        ),
                    });
                }
                Ok(g / per)
            }
        }
    }

    /// The activation model's settings.
    pub fn activations(&self, microbatches: usize) -> ActivationOptions {
        ActivationOptions {
            seq: self.seq,
            micro_batch: self.micro_batch,
            microbatches,
            vpp: self.vpp,
            act_bytes: self.precision.param_bytes(),
            fp8: self.fp8,
            recompute: self.recompute.clone(),
            memory_efficient_permutation: self.memory_efficient_permutation,
        }
    }

    /// The memory model's settings.
    pub fn memory(&self) -> MemoryOptions {
        MemoryOptions {
            fp8_weights: self.fp8,
            optimizer_dtype: self.optimizer_dtype,
            distributed_optimizer: self.distributed_optimizer,
            precision: self.precision,
        }
    }

    /// The communication model's settings (activations in the precision's bytes, f32
    /// probabilities).
    pub fn comm(&self, microbatches: usize) -> CommOptions {
        CommOptions {
            seq: self.seq,
            micro_batch: self.micro_batch,
            microbatches,
            vpp: self.vpp,
            act_bytes: self.precision.param_bytes(),
            prob_bytes: 4,
            int_bytes: 8,
            dispatcher: self.dispatcher,
        }
    }
}

/// One rank of one pipeline stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    /// Stage index.
    pub stage: usize,
    /// What the rank holds: its virtual stages (chunks `0..vpp`, virtual stage
    /// `chunk · pp + stage`), from the plan's pipeline split.
    pub chunks: Vec<StageParts>,
    /// Parameters held.
    pub params: RankParams,
    /// Weights, gradients, master weights, moments.
    pub state: StateBytes,
    /// Peak activations by module.
    pub activations: ActivationBytes,
    /// Communication (uniform routing, `tp_ep` member 0).
    pub traffic: StepTraffic,
}

impl StagePlan {
    /// State plus activations.
    pub fn memory(&self) -> f64 {
        self.state.total() + self.activations.total()
    }

    /// Whether the rank holds the embedding.
    pub fn holds_embedding(&self) -> bool {
        self.chunks.iter().any(|p| p.embedding)
    }

    /// Whether the rank holds the final norm, the head and the loss.
    pub fn holds_head(&self) -> bool {
        self.chunks.iter().any(|p| p.loss)
    }

    /// MTP modules the rank holds (their parameters are not planned).
    pub fn mtp_modules(&self) -> usize {
        self.chunks.iter().map(|p| p.mtp.len()).sum()
    }

    /// Decoder layers the rank holds.
    pub fn layer_count(&self) -> usize {
        self.chunks.iter().map(|p| p.layers.len()).sum()
    }
}

/// A layout's plan.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutPlan {
    /// The layout.
    pub layout: ParallelLayout,
    /// Virtual pipeline stages per rank (the layout's, or [`PlanOptions::vpp`]).
    pub vpp: usize,
    /// The explicit pipeline layout (the layout's `pp_layout`), `None` for the planner's
    /// contiguous split ([`super::planner_split`]).
    pub pipeline_layout: Option<String>,
    /// The split the stages follow.
    pub split: PipelineSplit,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Every stage.
    pub stages: Vec<StagePlan>,
}

impl LayoutPlan {
    /// The stage with the largest memory.
    pub fn peak(&self) -> Option<&StagePlan> {
        self.stages
            .iter()
            .max_by(|a, b| a.memory().total_cmp(&b.memory()))
    }

    /// Peak bytes per GPU.
    pub fn peak_memory(&self) -> f64 {
        self.peak().map(StagePlan::memory).unwrap_or(0.0)
    }

    /// Largest per-step traffic of a rank.
    pub fn max_step_bytes(&self) -> f64 {
        self.stages
            .iter()
            .map(|s| s.traffic.total.total())
            .fold(0.0, f64::max)
    }

    /// JSON rendering (bytes, and GB = 1e9 bytes where named `_gb`).
    pub fn to_json(&self) -> Value {
        let gb = |b: f64| b / 1e9;
        let families = |f: &super::comm::FamilyBytes| {
            Value::Object(
                f.families()
                    .iter()
                    .map(|(n, b)| (n.to_string(), json!(b)))
                    .collect(),
            )
        };
        let stages: Vec<Value> = self
            .stages
            .iter()
            .map(|s| {
                let modules: serde_json::Map<String, Value> = s
                    .activations
                    .modules()
                    .iter()
                    .map(|(n, b)| (n.to_string(), json!(gb(*b))))
                    .collect();
                let chunks: Vec<Value> = s
                    .chunks
                    .iter()
                    .enumerate()
                    .map(|(chunk, p)| {
                        json!({
                            "virtual_stage": chunk * self.layout.pp + s.stage,
                            "layers": [p.layers.start, p.layers.end],
                            "embedding": p.embedding,
                            "mtp": [p.mtp.start, p.mtp.end],
                            "loss": p.loss,
                        })
                    })
                    .collect();
                json!({
                    "stage": s.stage,
                    "chunks": chunks,
                    "layers": s.layer_count(),
                    "embedding": s.holds_embedding(),
                    "head": s.holds_head(),
                    "mtp_modules": s.mtp_modules(),
                    "params": s.params.total(),
                    "dense_params": s.params.dense_sharded + s.params.dense_replicated,
                    "expert_params": s.params.expert,
                    "weights_grads_gb": gb(s.state.weights_grads()),
                    "master_optimizer_gb": gb(s.state.master_optimizer()),
                    "activations_gb": gb(s.activations.total()),
                    "activations_by_module_gb": modules,
                    "total_gb": gb(s.memory()),
                    "comm": {
                        "per_layer_per_microbatch": s.traffic.layers.iter().map(|l| json!({
                            "layer": l.layer, "moe": l.moe, "bytes": families(&l.bytes),
                        })).collect::<Vec<_>>(),
                        "embedding_head_per_microbatch": families(&s.traffic.embedding_head),
                        "pipeline_per_microbatch": families(&s.traffic.pipeline),
                        "optimizer": families(&s.traffic.optimizer),
                        "step": families(&s.traffic.total),
                        "step_total_bytes": s.traffic.total.total(),
                    },
                })
            })
            .collect();
        json!({
            "layout": self.layout.to_string(),
            "vpp": self.vpp,
            "pipeline_layout": self.pipeline_layout,
            "pipeline_split": split_layout(&self.split),
            "microbatches": self.microbatches,
            "peak_gb": gb(self.peak_memory()),
            "stages": stages,
        })
    }
}

/// Checks that `layout` divides the model's heads, vocabulary, widths, experts and layers.
pub fn check_fit(
    model: &PlannedModel,
    layout: &ParallelLayout,
    opts: &PlanOptions,
) -> Result<(), PlanError> {
    let shape = model.shape();
    let tp = layout.tp;
    let mut bad = Vec::new();
    let heads = shape.attention.heads();
    if !heads.is_multiple_of(tp) {
        bad.push(format!("{heads} heads over tp = {tp}"));
    }
    if let super::shape::AttentionShape::Gqa { kv_heads, .. } = shape.attention
        && kv_heads % tp != 0
    {
        bad.push(format!("{kv_heads} KV heads over tp = {tp}"));
    }
    if !shape.dense_ffn.is_multiple_of(tp) {
        bad.push(format!("dense width {} over tp = {tp}", shape.dense_ffn));
    }
    if !shape.experts.is_multiple_of(layout.ep) {
        bad.push(format!("{} experts over ep = {}", shape.experts, layout.ep));
    }
    if !shape.moe_ffn.is_multiple_of(layout.etp) {
        bad.push(format!(
            "expert width {} over etp = {}",
            shape.moe_ffn, layout.etp
        ));
    }
    let virtual_stages = layout.pp * plan_vpp(layout, opts)?;
    if layout.pp_layout.is_none() && shape.layers() < virtual_stages {
        bad.push(format!(
            "{} layers over {virtual_stages} (virtual) stages",
            shape.layers()
        ));
    }
    let tokens = opts.seq * opts.micro_batch;
    if !tokens.is_multiple_of(tp * layout.cp) {
        bad.push(format!(
            "{tokens} tokens per micro-batch over tp·cp = {}",
            tp * layout.cp
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(PlanError::Unfit {
            layout: layout.to_string(),
            detail: bad.join("; "),
        })
    }
}

/// Virtual pipeline stages per rank of a plan: the layout's `vpp`, or `opts.vpp` when the layout
/// has none (`vpp == 1`). Refused naming `vpp` when both are above 1 and differ, or when
/// `vpp > 1` without pipeline parallelism (Megatron refuses interleaving without PP).
pub fn plan_vpp(layout: &ParallelLayout, opts: &PlanOptions) -> Result<usize, PlanError> {
    let (from_layout, from_opts) = (layout.vpp.max(1), opts.vpp.max(1));
    if from_layout > 1 && from_opts > 1 && from_layout != from_opts {
        return Err(PlanError::Option {
            option: "vpp",
            detail: format!(
                "{from_opts} contradicts the layout's vpp={from_layout} (give one of them)"
            ),
        });
    }
    let vpp = from_layout.max(from_opts);
    if vpp > 1 && layout.pp == 1 {
        return Err(PlanError::Option {
            option: "vpp",
            detail: format!("vpp = {vpp} virtual stages need pipeline parallelism (pp > 1)"),
        });
    }
    Ok(vpp)
}

/// Plans every stage of `layout` for `model`: the layers of each stage follow the layout's
/// explicit pipeline layout (`pp_layout`) or the planner's contiguous split over
/// `pp · vpp` virtual stages ([`super::planner_split`]; refusals name `pipeline_layout`, `pp`
/// or `vpp`).
pub fn plan_layout(
    model: &PlannedModel,
    layout: &ParallelLayout,
    opts: &PlanOptions,
) -> Result<LayoutPlan, PlanError> {
    check_fit(model, layout, opts)?;
    let shape = model.shape();
    let vpp = plan_vpp(layout, opts)?;
    let split = planner_split(
        shape.layers(),
        model.mtp_modules(),
        layout.pp,
        vpp,
        layout.pp_layout.as_deref(),
    )?;
    let opts = &PlanOptions {
        vpp,
        ..opts.clone()
    };
    let m = opts.microbatches(layout)?;
    let act = opts.activations(m);
    let mem = opts.memory();
    let comm = opts.comm(m);
    let stages = (0..layout.pp)
        .map(|stage| -> Result<StagePlan, PlanError> {
            let chunks = rank_chunks(&split, stage);
            let params = model.chunk_params(layout, &chunks)?;
            Ok(StagePlan {
                stage,
                params,
                state: state_bytes(&params, layout, &mem),
                activations: chunk_activations(&shape, layout, &act, stage, &chunks),
                traffic: chunk_traffic(
                    &shape,
                    &params,
                    layout,
                    &comm,
                    stage,
                    &chunks,
                    0,
                    &Routing::Uniform,
                )?,
                chunks,
            })
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    Ok(LayoutPlan {
        layout: layout.clone(),
        vpp,
        pipeline_layout: layout.pp_layout.clone(),
        split,
        microbatches: m,
        stages,
    })
}
