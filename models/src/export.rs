//! Streaming export of a live model's weights in HF layout and names (checkpoints.md §1, §3),
//! e.g. to hand fresh weights to an inference engine after every RL step.
//!
//! [`export_hf_tensors`] returns an [`HfTensors`] iterator over `(hf_name, TensorData)`:
//! - names are HF's (`model.layers.{l}.self_attn.q_proj.weight`, …) with routed experts
//!   **per expert** (`…mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`);
//! - orientation is PyTorch `[out, in]` (Burn's `[in, out]` linears are transposed);
//! - a tied `lm_head` is omitted; DeepSeek-V3's `e_score_correction_bias` is F32; every other
//!   tensor keeps the parameter dtype (f32 by default); DeepSeek-V3 MTP layers are exported as
//!   `model.layers.{N+j}.*` without the `embed_tokens` / `shared_head.head` copies (as stored
//!   by our checkpoints, §3; see [`HfTensors::with_mtp_copies`]).
//!
//! Memory is bounded by one tensor: the iterator knows every name, shape and dtype up front
//! ([`HfTensors::specs`], so a writer can plan shards before any data moves) and pulls each
//! tensor to the host only when it is yielded. Weights are a snapshot taken when the iterator
//! is created (tensor handles are cheap clones; later optimizer steps do not change it).
//! [`for_each_hf_tensor`] is the callback form; moe-bridge's `live_export` writes an HF
//! directory from it (BF16/F32/FP8).
//!
//! Routed experts come per expert by default; [`export_hf_tensors_as`] with
//! [`ExpertNames::Fused`] yields HF's fused layout instead, one `…mlp.experts.gate_up_proj
//! [E, 2·Im, H]` (rows `[gate; up]` per expert) and one `…mlp.experts.down_proj [E, H, Im]`
//! per MoE layer (the canonical stacked tensors of checkpoints.md §3).
//!
//! **Scope: one rank holding the whole model.** Under TP/EP each rank holds a shard:
//! [`crate::weight_sync`] streams the full tensors of a sharded model from this iterator's
//! rank-local entries, gathering one tensor at a time to one rank.

use std::collections::VecDeque;

use burn::nn::{Embedding, Linear};
use burn::tensor::{DType, Tensor, TensorData};
use moe_backend::experts::GroupedExperts;

use crate::deepseek_v3::{DeepseekV3DecoderLayer, DeepseekV3FeedForward, DeepseekV3ForCausalLM};
use crate::layers::mla::MlaQuery;
use crate::layers::{Attention, Mlp, RmsNorm};
use crate::qwen3::Qwen3ForCausalLM;
use crate::qwen3_moe::{Qwen3MoeFeedForward, Qwen3MoeForCausalLM};

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

    fn linear(&mut self, prefix: &str, linear: &Linear) {
        self.push(format!("{prefix}.weight"), linear.weight.val().transpose());
        if let Some(bias) = &linear.bias {
            self.push(format!("{prefix}.bias"), bias.val());
        }
    }

    fn norm(&mut self, prefix: &str, norm: &RmsNorm) {
        self.push(format!("{prefix}.weight"), norm.weight.val());
    }

    fn embedding(&mut self, embedding: &Embedding) {
        self.push(
            "model.embed_tokens.weight".to_owned(),
            embedding.weight.val(),
        );
    }

    fn mlp(&mut self, prefix: &str, mlp: &Mlp) {
        self.linear(&format!("{prefix}.gate_proj"), &mlp.gate_proj);
        self.linear(&format!("{prefix}.up_proj"), &mlp.up_proj);
        self.linear(&format!("{prefix}.down_proj"), &mlp.down_proj);
    }

    fn attention(&mut self, prefix: &str, attn: &Attention) {
        for (name, linear) in [
            ("q_proj", &attn.q_proj),
            ("k_proj", &attn.k_proj),
            ("v_proj", &attn.v_proj),
            ("o_proj", &attn.o_proj),
        ] {
            self.linear(&format!("{prefix}.{name}"), linear);
        }
        for (name, norm) in [("q_norm", &attn.q_norm), ("k_norm", &attn.k_norm)] {
            if let Some(norm) = norm {
                self.norm(&format!("{prefix}.{name}"), norm);
            }
        }
    }

    /// HF tensors of stacked `fc1 [E, 2·Im, H]` (`[gate; up]`) and `fc2 [E, H, Im]`: per expert
    /// (each slice is cut on the device when yielded) or fused (the stacked tensors as they
    /// are), as [`ExpertNames`] says.
    fn experts(&mut self, prefix: &str, experts: &GroupedExperts) {
        if self.experts == ExpertNames::Fused {
            self.push(format!("{prefix}.gate_up_proj"), experts.fc1.val());
            self.push(format!("{prefix}.down_proj"), experts.fc2.val());
            return;
        }
        let [e, two_im, h] = experts.fc1.dims();
        let im = two_im / 2;
        let (fc1, fc2) = (experts.fc1.val(), experts.fc2.val());
        for i in 0..e {
            let p = format!("{prefix}.{i}");
            let rows = fc1.clone().narrow(0, i, 1);
            self.push(
                format!("{p}.gate_proj.weight"),
                rows.clone().narrow(1, 0, im).reshape([im, h]),
            );
            self.push(
                format!("{p}.up_proj.weight"),
                rows.narrow(1, im, im).reshape([im, h]),
            );
            self.push(
                format!("{p}.down_proj.weight"),
                fc2.clone().narrow(0, i, 1).reshape([h, im]),
            );
        }
    }

    fn head(&mut self, lm_head: Option<&Linear>, norm: &RmsNorm) {
        self.norm("model.norm", norm);
        if let Some(head) = lm_head {
            self.linear("lm_head", head);
        }
    }

    fn deepseek_layer(&mut self, p: &str, layer: &DeepseekV3DecoderLayer) {
        self.norm(&format!("{p}.input_layernorm"), &layer.input_layernorm);
        let a = format!("{p}.self_attn");
        let attn = &layer.self_attn;
        match &attn.query {
            MlaQuery::Direct(q) => self.linear(&format!("{a}.q_proj"), q),
            MlaQuery::LowRank(q) => {
                self.linear(&format!("{a}.q_a_proj"), &q.q_a_proj);
                self.norm(&format!("{a}.q_a_layernorm"), &q.q_a_layernorm);
                self.linear(&format!("{a}.q_b_proj"), &q.q_b_proj);
            }
        }
        self.linear(&format!("{a}.kv_a_proj_with_mqa"), &attn.kv_a_proj_with_mqa);
        self.norm(&format!("{a}.kv_a_layernorm"), &attn.kv_a_layernorm);
        self.linear(&format!("{a}.kv_b_proj"), &attn.kv_b_proj);
        self.linear(&format!("{a}.o_proj"), &attn.o_proj);
        self.norm(
            &format!("{p}.post_attention_layernorm"),
            &layer.post_attention_layernorm,
        );
        match &layer.mlp {
            DeepseekV3FeedForward::Dense(mlp) => self.mlp(&format!("{p}.mlp"), mlp),
            DeepseekV3FeedForward::Moe(block) => {
                let moe = &block.moe;
                self.push(format!("{p}.mlp.gate.weight"), moe.router.weight.val());
                if let Some(bias) = &moe.router.expert_bias {
                    self.push(
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        bias.val().cast(DType::F32),
                    );
                }
                self.experts(&format!("{p}.mlp.experts"), &moe.experts);
                if let Some(shared) = &moe.shared_experts {
                    let s = format!("{p}.mlp.shared_experts");
                    self.linear(&format!("{s}.gate_proj"), &shared.gate_proj);
                    self.linear(&format!("{s}.up_proj"), &shared.up_proj);
                    self.linear(&format!("{s}.down_proj"), &shared.down_proj);
                }
            }
        }
    }

    /// Also emits DeepSeek-V3 MTP copies `model.layers.{N+j}.embed_tokens.weight` and
    /// `…shared_head.head.weight` (the release layout, checkpoints.md §1); call it on the
    /// iterator of a [`DeepseekV3ForCausalLM`] before consuming it. No-op for other models.
    pub fn with_mtp_copies(mut self, model: &DeepseekV3ForCausalLM) -> Self {
        let n = model.model.layers.len();
        let embed = model.model.embed_tokens.weight.val();
        for j in 0..model.mtp.len() {
            let p = format!("model.layers.{}", n + j);
            self.push(format!("{p}.embed_tokens.weight"), embed.clone());
            match &model.lm_head {
                Some(head) => self.push(
                    format!("{p}.shared_head.head.weight"),
                    head.weight.val().transpose(),
                ),
                None => self.push(format!("{p}.shared_head.head.weight"), embed.clone()),
            }
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
    fn hf_tensors_as(&self, experts: ExpertNames) -> HfTensors;

    /// The streaming iterator, routed experts per expert (see the module docs).
    fn hf_tensors(&self) -> HfTensors {
        self.hf_tensors_as(ExpertNames::PerExpert)
    }
}

impl ExportHf for Qwen3ForCausalLM {
    fn hf_tensors_as(&self, experts: ExpertNames) -> HfTensors {
        let mut out = HfTensors::new(experts);
        out.embedding(&self.model.embed_tokens);
        for (l, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.norm(&format!("{p}.input_layernorm"), &layer.input_layernorm);
            out.attention(&format!("{p}.self_attn"), &layer.self_attn);
            out.norm(
                &format!("{p}.post_attention_layernorm"),
                &layer.post_attention_layernorm,
            );
            out.mlp(&format!("{p}.mlp"), &layer.mlp);
        }
        out.head(self.lm_head.as_ref(), &self.model.norm);
        out
    }
}

impl ExportHf for Qwen3MoeForCausalLM {
    fn hf_tensors_as(&self, experts: ExpertNames) -> HfTensors {
        let mut out = HfTensors::new(experts);
        out.embedding(&self.model.embed_tokens);
        for (l, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.norm(&format!("{p}.input_layernorm"), &layer.input_layernorm);
            out.attention(&format!("{p}.self_attn"), &layer.self_attn);
            out.norm(
                &format!("{p}.post_attention_layernorm"),
                &layer.post_attention_layernorm,
            );
            match &layer.mlp {
                Qwen3MoeFeedForward::Dense(mlp) => out.mlp(&format!("{p}.mlp"), mlp),
                Qwen3MoeFeedForward::Sparse(block) => {
                    out.push(
                        format!("{p}.mlp.gate.weight"),
                        block.moe.router.weight.val(),
                    );
                    out.experts(&format!("{p}.mlp.experts"), &block.moe.experts);
                }
            }
        }
        out.head(self.lm_head.as_ref(), &self.model.norm);
        out
    }
}

impl ExportHf for DeepseekV3ForCausalLM {
    fn hf_tensors_as(&self, experts: ExpertNames) -> HfTensors {
        let mut out = HfTensors::new(experts);
        out.embedding(&self.model.embed_tokens);
        let n = self.model.layers.len();
        for (l, layer) in self.model.layers.iter().enumerate() {
            out.deepseek_layer(&format!("model.layers.{l}"), layer);
        }
        for (j, mtp) in self.mtp.iter().enumerate() {
            let p = format!("model.layers.{}", n + j);
            out.norm(&format!("{p}.enorm"), &mtp.enorm);
            out.norm(&format!("{p}.hnorm"), &mtp.hnorm);
            out.linear(&format!("{p}.eh_proj"), &mtp.eh_proj);
            out.deepseek_layer(&p, &mtp.block);
            out.norm(&format!("{p}.shared_head.norm"), &mtp.shared_head_norm);
        }
        out.head(self.lm_head.as_ref(), &self.model.norm);
        out
    }
}

/// The streaming HF iterator of `model` (see the module docs).
pub fn export_hf_tensors<M: ExportHf + ?Sized>(model: &M) -> HfTensors {
    model.hf_tensors()
}

/// [`export_hf_tensors`] with routed experts named as `experts` says.
pub fn export_hf_tensors_as<M: ExportHf + ?Sized>(model: &M, experts: ExpertNames) -> HfTensors {
    model.hf_tensors_as(experts)
}

/// Whether the HF tensor `name` is stored in F32 whatever the export dtype (checkpoints.md §1:
/// DeepSeek-V3's `e_score_correction_bias`).
pub fn keeps_f32(name: &str) -> bool {
    name.ends_with("e_score_correction_bias")
}

/// Calls `f(hf_name, data)` for every tensor of `model` in turn (one tensor on the host at a
/// time); stops at the first error.
pub fn for_each_hf_tensor<M, E>(
    model: &M,
    mut f: impl FnMut(&str, TensorData) -> Result<(), E>,
) -> Result<(), E>
where
    M: ExportHf + ?Sized,
{
    for (name, data) in model.hf_tensors() {
        f(&name, data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;
    use crate::config::Qwen3MoeConfig;

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
        let iter = export_hf_tensors(&model);
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
