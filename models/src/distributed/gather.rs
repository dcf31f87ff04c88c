//! Reassembling a full model from the shards of every rank, for HF export during training
//! (RL loops hand fresh weights to an inference engine after every step).
//!
//! Every rank calls [`gather_full_qwen3_moe`] / [`gather_full_deepseek_v3`] with its shard; the
//! parameters are gathered one tensor at a time over the groups that split them (vocabulary
//! and TP-sharded columns/rows over `tp`; experts over `expt_tp` for their FFN blocks, then over
//! `ep` for the expert axis) and every rank returns the full model, ready for
//! [`crate::export::export_hf_tensors`]. Peak memory is the full model on each rank (fine for
//! models that fit one host; a rank-0-only streaming gather would bound it by one tensor).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::optim::ParamClass;
use moe_backend::parallel::GroupFamily;

use super::{ParallelDeepseekV3, ParallelQwen3Moe, err, param_class};
use crate::ModelError;
use crate::deepseek_v3::DeepseekV3ForCausalLM;
use crate::qwen3_moe::Qwen3MoeForCausalLM;

struct Gatherer {
    tp: Comm,
    ep: Comm,
    expt_tp: Comm,
    path: Vec<String>,
    expert_depth: usize,
    error: Option<ModelError>,
}

/// How a TP-sharded Burn weight is split (Burn `Linear` is `[in, out]`).
fn tp_split_dim(path: &str) -> usize {
    // Row-parallel: o_proj, down_proj (input rows split); embeddings: vocabulary rows.
    if path.contains("o_proj") || path.contains("down_proj") || path.contains("embed_tokens") {
        0
    } else {
        // Column-parallel (q/k/v, q_b_proj, kv_b_proj, gate/up, lm_head): output columns.
        1
    }
}

fn gather_dim<const D: usize>(
    comm: &Comm,
    t: Tensor<D>,
    dim: usize,
) -> Result<Tensor<D>, ModelError> {
    if comm.size() == 1 {
        return Ok(t);
    }
    let moved = t.swap_dims(0, dim);
    Ok(comm.all_gather(moved).map_err(err)?.swap_dims(0, dim))
}

impl Gatherer {
    fn gather<const D: usize>(&self, path: &str, t: Tensor<D>) -> Result<Tensor<D>, ModelError> {
        let t = t.detach();
        match param_class(path, self.expert_depth > 0) {
            ParamClass::Expert if path.ends_with("fc1") => {
                // [L, 2F/etp, H]: gate and up halves are gathered separately over ETP.
                let rows = t.dims()[1];
                let gate = gather_dim(&self.expt_tp, t.clone().narrow(1, 0, rows / 2), 1)?;
                let up = gather_dim(&self.expt_tp, t.narrow(1, rows / 2, rows / 2), 1)?;
                gather_dim(&self.ep, Tensor::cat(vec![gate, up], 1), 0)
            }
            ParamClass::Expert if path.ends_with("fc2") => {
                let t = gather_dim(&self.expt_tp, t, 2)?;
                gather_dim(&self.ep, t, 0)
            }
            ParamClass::Expert => gather_dim(&self.ep, t, 0),
            ParamClass::DenseTpSharded if D >= 2 => gather_dim(&self.tp, t, tp_split_dim(path)),
            ParamClass::DenseTpSharded => gather_dim(&self.tp, t, 0),
            _ => Ok(t),
        }
    }
}

impl ModuleMapper for Gatherer {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        if container_type == "Struct:GroupedExperts" || self.expert_depth > 0 {
            self.expert_depth += 1;
        }
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
        self.expert_depth = self.expert_depth.saturating_sub(1);
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let path = self.path.join(".");
        let (id, value, _) = param.consume();
        match self.gather(&path, value.clone()) {
            Ok(full) => Param::initialized(id, full),
            Err(e) => {
                self.error = Some(e);
                Param::initialized(id, value)
            }
        }
    }
}

fn gatherer(groups: &GroupComms) -> Gatherer {
    Gatherer {
        tp: groups.comm(GroupFamily::Tp).clone(),
        ep: groups.comm(GroupFamily::Ep).clone(),
        expt_tp: groups.comm(GroupFamily::ExptTp).clone(),
        path: Vec::new(),
        expert_depth: 0,
        error: None,
    }
}

/// The full Qwen3-MoE reassembled from every rank's shard (collective: call on every rank).
pub fn gather_full_qwen3_moe(
    shard: &ParallelQwen3Moe,
    groups: &GroupComms,
) -> Result<Qwen3MoeForCausalLM, ModelError> {
    let mut g = gatherer(groups);
    let mut full = shard.model.clone().map(&mut g);
    if let Some(e) = g.error {
        return Err(e);
    }
    let config = full.config().clone();
    for layer in &mut full.model.layers {
        layer.self_attn.num_heads = config.num_attention_heads;
        layer.self_attn.num_kv_heads = config.num_key_value_heads;
        // The shard's routers carry the training losses of its groups; the full model is a
        // single-rank model without them (as loaded from HF).
        if let crate::qwen3_moe::Qwen3MoeFeedForward::Sparse(block) = &mut layer.mlp {
            block
                .moe
                .router
                .set_losses(Vec::new(), None, 1, 1)
                .map_err(super::err)?;
        }
    }
    Ok(full)
}

/// The full DeepSeek-V3 reassembled from every rank's shard (collective: call on every rank).
pub fn gather_full_deepseek_v3(
    shard: &ParallelDeepseekV3,
    groups: &GroupComms,
) -> Result<DeepseekV3ForCausalLM, ModelError> {
    let mut g = gatherer(groups);
    let mut full = shard.model.clone().map(&mut g);
    if let Some(e) = g.error {
        return Err(e);
    }
    let heads = full.config().num_attention_heads;
    for layer in &mut full.model.layers {
        layer.self_attn.num_heads = heads;
    }
    Ok(full)
}
