//! Streaming export of a live model's weights in HF layout and names
//! (docs/checkpoints.md §Minimal loadable export, §Canonical names and sharding), e.g. to hand
//! fresh weights to an inference engine after every RL step.
//!
//! [`export_hf_tensors`] returns an [`HfTensors`] iterator over `(hf_name, TensorData)`:
//! - names are HF's (`model.layers.{l}.self_attn.q_proj.weight`, …) with routed experts
//!   **per expert** (`…mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`, or the
//!   projection names of the model's plan,
//!   [`ParallelPlan::expert_projections`](crate::param_plan::ParallelPlan::expert_projections));
//! - orientation is PyTorch `[out, in]` (Burn's `[in, out]` linears are transposed);
//! - a tied `lm_head` is omitted; DeepSeek-V3's `e_score_correction_bias` is F32; every other
//!   tensor keeps the parameter dtype (f32 by default); DeepSeek-V3 MTP layers are exported as
//!   `model.layers.{N+j}.*` without the `embed_tokens` / `shared_head.head` copies (as stored by
//!   our checkpoints, docs/checkpoints.md §Canonical names and sharding; see
//!   [`HfTensors::with_mtp_copies`]).
//!
//! Memory is bounded by one tensor: the iterator knows every name, shape and dtype up front
//! ([`HfTensors::specs`], so a writer can plan shards before any data moves) and pulls each
//! tensor to the host only when it is yielded. Weights are a snapshot taken when the iterator
//! is created (tensor handles are cheap clones; later optimizer steps do not change it).
//! [`for_each_hf_tensor`] is the callback form; moe-bridge's `live_export` writes an HF
//! directory from it (BF16/F32/FP8).
//!
//! Routed experts come per expert by default; [`export_hf_tensors_as`] with [`ExpertNames::Fused`]
//! yields HF's fused layout instead, one `…mlp.experts.gate_up_proj [E, 2·Im, H]` (rows
//! `[gate; up]` per expert) and one `…mlp.experts.down_proj [E, H, Im]` per MoE layer (the
//! canonical stacked tensors of docs/checkpoints.md §Canonical names and sharding).
//!
//! **Scope: one rank holding the whole model.** Under TP/EP each rank holds a shard:
//! [`crate::weight_sync`] streams the full tensors of a sharded model from this iterator's
//! rank-local entries, gathering one tensor at a time to one rank.

use std::collections::VecDeque;

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData};

use crate::ModelError;
use crate::param_plan::{GradClass, ParallelPlan, PlanError, Planned, Storage, hf_names};
use moe_bridge::dist::ShardRule;

/// Name, shape and dtype of one exported tensor, known before its data is fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensorSpec {
    /// HF tensor name.
    pub name: String,
    /// Shape, PyTorch orientation.
    pub shape: Vec<usize>,
    /// dtype of the data the iterator yields.
    pub dtype: DType,
}

impl HfTensorSpec {
    /// `product(shape) · dtype size` in bytes.
    pub fn num_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// How routed experts are named (and shaped) in HF layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertNames {
    /// One tensor per expert and projection:
    /// `…mlp.experts.{e}.{gate_proj,up_proj}.weight [Im, H]`, `…down_proj.weight [H, Im]`.
    #[default]
    PerExpert,
    /// HF's fused layout, per MoE layer: `…mlp.experts.gate_up_proj [E, 2·Im, H]` (each
    /// expert's gate rows, then its up rows) and `…mlp.experts.down_proj [E, H, Im]`.
    Fused,
}

/// A device tensor the iterator pulls to the host only when asked (a cheap handle: the data
/// stays on the device until [`fetch`](LazyTensor::fetch)).
pub(crate) trait LazyTensor: Send {
    /// The handle of `len` entries of `dim` from `start` (still lazy).
    fn narrow(&self, dim: usize, start: usize, len: usize) -> Box<dyn LazyTensor>;
    /// The values on the host (row-major, the parameter's dtype).
    fn fetch(&self) -> TensorData;
}

impl<const D: usize> LazyTensor for Tensor<D> {
    fn narrow(&self, dim: usize, start: usize, len: usize) -> Box<dyn LazyTensor> {
        Box::new(self.clone().narrow(dim, start, len))
    }

    fn fetch(&self) -> TensorData {
        self.clone().into_data()
    }
}

/// Streaming iterator over `(hf_name, TensorData)`; see the module docs.
pub struct HfTensors {
    specs: Vec<HfTensorSpec>,
    pending: VecDeque<(usize, Box<dyn LazyTensor>)>,
    experts: ExpertNames,
}

impl std::fmt::Debug for HfTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTensors")
            .field("tensors", &self.specs.len())
            .field("remaining", &self.pending.len())
            .finish()
    }
}

impl HfTensors {
    fn new(experts: ExpertNames) -> Self {
        Self {
            specs: Vec::new(),
            pending: VecDeque::new(),
            experts,
        }
    }

    /// The tensors not yet yielded, each with its spec and its lazy device handle (the weight
    /// sync slices and fetches them itself).
    pub(crate) fn into_lazy(self) -> Vec<(HfTensorSpec, Box<dyn LazyTensor>)> {
        let specs = self.specs;
        self.pending
            .into_iter()
            .map(|(i, lazy)| (specs[i].clone(), lazy))
            .collect()
    }

    /// Every tensor's spec, in yield order (including those already yielded).
    pub fn specs(&self) -> &[HfTensorSpec] {
        &self.specs
    }

    /// Σ bytes of every tensor.
    pub fn total_bytes(&self) -> u64 {
        self.specs.iter().map(HfTensorSpec::num_bytes).sum()
    }

    fn push<const D: usize>(&mut self, name: String, tensor: Tensor<D>) {
        self.specs.push(HfTensorSpec {
            name,
            shape: tensor.dims().to_vec(),
            dtype: tensor.dtype(),
        });
        self.pending
            .push_back((self.specs.len() - 1, Box::new(tensor)));
    }

    /// Also emits the MTP layers' copies `model.layers.{N+j}.embed_tokens.weight` and
    /// `…shared_head.head.weight` of a model with `depths` MTP modules after its `layers` main
    /// layers (the DeepSeek-V3 / GLM-4.5 release layout, docs/checkpoints.md §Minimal loadable
    /// export), from its `embedding [V, H]` and untied `head [V, H]` (the embedding when
    /// tied). Call it before consuming the iterator; a model without its embedding (a pipeline
    /// stage) has no copies to emit.
    pub fn with_mtp_copies(
        mut self,
        layers: usize,
        depths: usize,
        embedding: Option<Tensor<2>>,
        head: Option<Tensor<2>>,
    ) -> Self {
        let Some(embed) = embedding else {
            return self;
        };
        for j in 0..depths {
            let (embed_copy, head_copy) = hf_names::mtp_copy_names(layers + j);
            self.push(embed_copy, embed.clone());
            self.push(head_copy, head.clone().unwrap_or_else(|| embed.clone()));
        }
        self
    }
}

impl Iterator for HfTensors {
    type Item = (String, TensorData);

    fn next(&mut self) -> Option<Self::Item> {
        let (i, lazy) = self.pending.pop_front()?;
        Some((self.specs[i].name.clone(), lazy.fetch()))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.pending.len(), Some(self.pending.len()))
    }
}

impl ExactSizeIterator for HfTensors {}

/// A model that can stream its weights in HF layout.
pub trait ExportHf {
    /// The streaming iterator with routed experts named as `experts` says (see the module
    /// docs; models without routed experts ignore it).
    /// An error names a parameter the model's plan does not place.
    fn hf_tensors_as(&self, experts: ExpertNames) -> Result<HfTensors, ModelError>;

    /// The streaming iterator, routed experts per expert (see the module docs).
    fn hf_tensors(&self) -> Result<HfTensors, ModelError> {
        self.hf_tensors_as(ExpertNames::PerExpert)
    }

    /// The parallel plan the model exports by (its family's [`Planned::parallel_plan`]): what
    /// a consumer converting its tensors reads the family's release layouts from (the weight
    /// sync). `None` (the default) for a model without one.
    fn export_plan(&self) -> Option<ParallelPlan> {
        None
    }
}

/// Places each tensor of a module in the iterator by its plan entry (see the module docs).
struct PlanExport {
    plan: ParallelPlan,
    layers: usize,
    path: Vec<String>,
    out: HfTensors,
    /// A layer's stacked gate/up projections (experts prefix, name, tensor) waiting for its
    /// `down_proj` (per-expert order).
    gate_up: Option<(String, String, Tensor<3>)>,
    error: Option<ModelError>,
}

impl PlanExport {
    /// Expert `i`'s per-expert tensors of the stacked tensor `name` (`[E, rows, cols]`,
    /// stored as `storage`), named as the plan names them
    /// ([`ParallelPlan::per_expert_names`]): a gated `[E, 2F, H]` `fc1` is the expert's
    /// `gate_proj` and `up_proj` rows.
    fn push_expert(&mut self, name: &str, storage: Storage, i: usize, t: &Tensor<3>) {
        let [_, rows, cols] = t.dims();
        let Some(names) = self.plan.per_expert_names(name, storage, i, rows) else {
            self.error.get_or_insert_with(|| {
                ModelError::from(PlanError::Mismatch {
                    family: self.plan.family(),
                    path: name.to_owned(),
                    reason: format!("stacked experts {storage:?} of {rows} rows per expert"),
                })
            });
            return;
        };
        let one = t.clone().narrow(0, i, 1).reshape([rows, cols]);
        for (hf, range) in names {
            let n = range.len();
            self.out.push(hf, one.clone().narrow(0, range.start, n));
        }
    }

    /// Emits a waiting gate/up tensor on its own (a layer without a stacked `down_proj`).
    fn flush_gate_up(&mut self) {
        if let Some((_, name, fc1)) = self.gate_up.take() {
            for i in 0..fc1.dims()[0] {
                self.push_expert(&name, Storage::GatedExperts, i, &fc1);
            }
        }
    }

    fn export<const D: usize>(&mut self, path: &str, t: Tensor<D>) -> Result<(), ModelError> {
        let r = self.plan.resolve(path, self.layers)?;
        let (name, entry) = (r.hf_name, r.entry);
        let mismatch = |reason: String| {
            ModelError::from(PlanError::Mismatch {
                family: self.plan.family(),
                path: path.to_owned(),
                reason,
            })
        };
        if entry.grad == GradClass::Buffer {
            // Buffers (DeepSeek-V3's expert bias) are stored in F32
            // (docs/checkpoints.md §Minimal loadable export).
            self.out.push(name, t.cast(DType::F32));
            return Ok(());
        }
        let release = match self.out.experts {
            ExpertNames::PerExpert => self.plan.release_layout(&name),
            ExpertNames::Fused => None,
        };
        if let Some(layout) = release {
            // The release's own layout of this tensor (HF export), from the canonical one.
            use crate::param_plan::ReleaseLayout as L;
            use moe_backend::experts::layout::{fc1_bias_to_interleaved, fc1_to_interleaved};
            let dims = t.dims();
            let backend = |e: moe_backend::BackendError| mismatch(e.to_string());
            match (layout, dims.as_slice()) {
                (L::InterleavedGateUp, &[a, b, c]) => {
                    let t3: Tensor<3> = t.reshape([a, b, c]);
                    self.out
                        .push(name, fc1_to_interleaved(t3).map_err(backend)?);
                }
                (L::InterleavedGateUpBias, &[a, b]) => {
                    let t2: Tensor<2> = t.reshape([a, b]);
                    self.out
                        .push(name, fc1_bias_to_interleaved(t2).map_err(backend)?);
                }
                (L::InputMajorExperts, &[a, b, c]) => {
                    let t3: Tensor<3> = t.reshape([a, b, c]);
                    self.out.push(name, t3.swap_dims(1, 2));
                }
                (L::Stacked, _) => self.out.push(name, t),
                (layout, dims) => {
                    return Err(mismatch(format!(
                        "a {layout:?} release tensor of shape {dims:?}"
                    )));
                }
            }
            return Ok(());
        }
        let expert = matches!(
            entry.split,
            ShardRule::Expert { .. } | ShardRule::ExpertReplicated
        );
        match entry.storage {
            Storage::Transposed => self.out.push(name, t.transpose()),
            Storage::Same | Storage::GatedExperts
                if !expert || self.out.experts == ExpertNames::Fused =>
            {
                self.out.push(name, t);
            }
            storage => {
                // Per expert: `…experts.gate_up_proj [E, 2F, H]` → `…experts.{e}.gate_proj
                // .weight [F, H]` and `…up_proj.weight`; any other stacked `…experts.X
                // [E, …]` → `…experts.{e}.X.weight`. HF's order is per expert (gate, up,
                // down), so gate/up wait for the layer's `down_proj`.
                let (prefix, _) = name
                    .rsplit_once('.')
                    .ok_or_else(|| mismatch(format!("`{name}` has no expert prefix")))?;
                let dims = t.dims();
                if D != 3 {
                    return Err(mismatch(format!("stacked experts of rank {D}")));
                }
                let t3: Tensor<3> = t.reshape([dims[0], dims[1], dims[2]]);
                if storage == Storage::GatedExperts {
                    self.flush_gate_up();
                    self.gate_up = Some((prefix.to_owned(), name, t3));
                } else {
                    let gate_up = match self.gate_up.take() {
                        Some((p, g, t)) if p == prefix => Some((g, t)),
                        other => {
                            self.gate_up = other;
                            self.flush_gate_up();
                            None
                        }
                    };
                    for i in 0..dims[0] {
                        if let Some((g, fc1)) = &gate_up {
                            self.push_expert(g, Storage::GatedExperts, i, fc1);
                        }
                        self.push_expert(&name, storage, i, &t3);
                    }
                    if let Some(e) = self.error.take() {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

impl ModuleVisitor for PlanExport {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_none() {
            let path = self.path.join(".");
            // An FP8 primary weight stored packed (E4M3 codes + block scales) exports its
            // decoded values: the packed tensor's element view is not its values.
            let value = moe_backend::fp8::dequantize_param(param.val());
            if let Err(e) = self.export(&path, value) {
                self.error = Some(e);
            }
        }
    }
}

/// Every model with a parallel plan exports through it: the plan names each tensor and says
/// how Burn stores it.
impl<M: Planned> ExportHf for M {
    fn hf_tensors_as(&self, experts: ExpertNames) -> Result<HfTensors, ModelError> {
        let mut v = PlanExport {
            plan: M::parallel_plan(),
            layers: self.main_layers(),
            path: Vec::new(),
            out: HfTensors::new(experts),
            gate_up: None,
            error: None,
        };
        self.visit(&mut v);
        v.flush_gate_up();
        match v.error {
            Some(e) => Err(e),
            None => Ok(v.out),
        }
    }

    fn export_plan(&self) -> Option<ParallelPlan> {
        Some(M::parallel_plan())
    }
}

/// The streaming HF iterator of `model` (see the module docs).
pub fn export_hf_tensors<M: ExportHf + ?Sized>(model: &M) -> Result<HfTensors, ModelError> {
    model.hf_tensors()
}

/// [`export_hf_tensors`] with routed experts named as `experts` says.
pub fn export_hf_tensors_as<M: ExportHf + ?Sized>(
    model: &M,
    experts: ExpertNames,
) -> Result<HfTensors, ModelError> {
    model.hf_tensors_as(experts)
}

/// Whether the HF tensor `name` is stored in F32 whatever the export dtype
/// (docs/checkpoints.md §Minimal loadable export: DeepSeek-V3's `e_score_correction_bias`).
pub fn keeps_f32(name: &str) -> bool {
    hf_names::is_expert_bias(name)
}

/// Calls `f(hf_name, data)` for every tensor of `model` in turn (one tensor on the host at a
/// time); stops at the first error (a parameter the plan does not place is one, converted by
/// `From<ModelError>`).
pub fn for_each_hf_tensor<M, E>(
    model: &M,
    mut f: impl FnMut(&str, TensorData) -> Result<(), E>,
) -> Result<(), E>
where
    M: ExportHf + ?Sized,
    E: From<ModelError>,
{
    for (name, data) in model.hf_tensors()? {
        f(&name, data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;
    use crate::Qwen3MoeConfig;
    use crate::qwen3_moe::Qwen3MoeFeedForward;

    #[test]
    fn specs_match_the_yielded_data_and_experts_are_split() {
        let device = Device::flex();
        let cfg = Qwen3MoeConfig {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            num_experts: 4,
            num_experts_per_tok: 2,
            norm_topk_prob: true,
            mlp_only_layers: vec![0],
            tie_word_embeddings: true,
            ..Qwen3MoeConfig::default()
        };
        let model = cfg.init(&device).unwrap();
        let iter = export_hf_tensors(&model).unwrap();
        let specs = iter.specs().to_vec();
        assert_eq!(iter.len(), specs.len());
        assert!(specs.iter().all(|s| s.name != "lm_head.weight"), "tied");
        let fc1 = match &model.model.layers[1].mlp {
            Qwen3MoeFeedForward::Sparse(b) => b.moe.experts.fc1.val(),
            Qwen3MoeFeedForward::Dense(_) => unreachable!(),
        };
        let fc1 = fc1.into_data().try_into_vec_as::<f32>().unwrap();
        let mut seen = 0;
        for ((name, data), spec) in iter.zip(&specs) {
            assert_eq!(name, spec.name);
            assert_eq!(data.shape().to_vec(), spec.shape, "{name}");
            assert_eq!(data.dtype(), spec.dtype, "{name}");
            if name == "model.layers.1.mlp.experts.2.up_proj.weight" {
                let v = data.try_into_vec_as::<f32>().unwrap();
                let start = (2 * 16 + 8) * 16;
                assert_eq!(v, fc1[start..start + 8 * 16]);
                seen += 1;
            }
            if name == "model.layers.0.self_attn.q_proj.weight" {
                assert_eq!(spec.shape, [32, 16], "[out, in]");
                seen += 1;
            }
        }
        assert_eq!(seen, 2);
    }
}
