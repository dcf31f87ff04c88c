//! Reassembling a full model from the shards of every rank, for HF export during training
//! (RL loops hand fresh weights to an inference engine after every step).
//!
//! Every rank calls [`gather_full`] with its shard; the
//! parameters are gathered one tensor at a time over the groups that split them (vocabulary
//! and TP-sharded columns/rows over `tp`; experts over `expt_tp` for their FFN blocks, then over
//! `ep` for the expert axis) and every rank returns the full model, ready for
//! [`crate::export::export_hf_tensors`]. Peak memory is the full model on each rank (fine for
//! models that fit one host); [`crate::weight_sync`] streams the same tensors to rank 0 one
//! bucket at a time instead.

use burn::module::{ModuleMapper, Param};
use burn::tensor::Tensor;
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::parallel::GroupFamily;

use super::{ShardModel, ShardRule, Sharded, err};
use crate::ModelError;
use crate::param_plan::{ParallelPlan, PlanError, Planned, Storage};

struct Gatherer {
    tp: Comm,
    ep: Comm,
    expt_tp: Comm,
    plan: ParallelPlan,
    layers: usize,
    path: Vec<String>,
    error: Option<ModelError>,
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

/// The Burn dimension holding canonical dimension `dim` of a tensor stored as `storage`
/// (`None` for the gate/up halves of gated experts, handled apart).
fn burn_dim(storage: Storage, rank: usize, dim: usize) -> Option<usize> {
    match storage {
        Storage::Same => Some(dim),
        Storage::Transposed => Some(rank - 1 - dim),
        // Burn [E, 2F, H] is canonical [E, 2, F, H].
        Storage::GatedExperts => match dim {
            0 => Some(0),
            3 => Some(2),
            _ => None,
        },
    }
}

impl Gatherer {
    /// The full tensor of this rank's block `t` at `path`, gathered over the groups its plan
    /// entry splits it over.
    fn gather<const D: usize>(&self, path: &str, t: Tensor<D>) -> Result<Tensor<D>, ModelError> {
        let t = t.detach();
        let resolved = self.plan.resolve(path, self.layers)?;
        let storage = resolved.entry.storage;
        let dim_of = |canonical: usize| {
            burn_dim(storage, D, canonical).ok_or_else(|| {
                ModelError::from(PlanError::Mismatch {
                    family: self.plan.family(),
                    path: path.to_owned(),
                    reason: format!("no canonical dim {canonical} in {storage:?} storage"),
                })
            })
        };
        match resolved.entry.split {
            ShardRule::Replicated => Ok(t),
            ShardRule::Tp { dim } => gather_dim(&self.tp, t, dim_of(dim)?),
            ShardRule::ExpertReplicated => gather_dim(&self.ep, t, dim_of(0)?),
            ShardRule::Expert { etp_dim } => {
                let t = if storage == Storage::GatedExperts && etp_dim == 2 {
                    // [E, 2F/etp, H]: gate and up halves are gathered separately over ETP.
                    let rows = t.dims()[1];
                    let gate = gather_dim(&self.expt_tp, t.clone().narrow(1, 0, rows / 2), 1)?;
                    let up = gather_dim(&self.expt_tp, t.narrow(1, rows / 2, rows / 2), 1)?;
                    Tensor::cat(vec![gate, up], 1)
                } else {
                    gather_dim(&self.expt_tp, t, dim_of(etp_dim)?)?
                };
                gather_dim(&self.ep, t, dim_of(0)?)
            }
        }
    }
}

impl ModuleMapper for Gatherer {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let path = self.path.join(".");
        let (id, value, _) = param.consume();
        // A packed FP8 primary weight is gathered as its decoded values (its element view
        // is not its values); the gathered full model holds plain f32 parameters.
        match self.gather(&path, moe_backend::fp8::dequantize_param(value.clone())) {
            Ok(full) => Param::initialized(id, full),
            Err(e) => {
                self.error = Some(e);
                Param::initialized(id, value)
            }
        }
    }
}

/// The full tensors of any planned model reassembled from every rank's shard `model`
/// (collective: call on every rank), each gathered over the groups its plan entry splits it
/// over; replicated tensors are this rank's copies. Only tensors change: fields derived from
/// shapes (e.g. [`crate::layers::Attention::with_local_heads`]) and the routers' training
/// losses are the caller's to reset (as [`gather_full`] does).
pub fn gather_planned<M: Planned>(model: &M, groups: &GroupComms) -> Result<M, ModelError> {
    super::check_no_pp(groups)?;
    let mut g = Gatherer {
        tp: groups.comm(GroupFamily::Tp).clone(),
        ep: groups.comm(GroupFamily::Ep).clone(),
        expt_tp: groups.comm(GroupFamily::ExptTp).clone(),
        plan: M::parallel_plan(),
        layers: model.main_layers(),
        path: Vec::new(),
        error: None,
    };
    let full = model.clone().map(&mut g);
    match g.error {
        Some(e) => Err(e),
        None => Ok(full),
    }
}

/// The full model reassembled from every rank's shard (collective: call on every rank), MTP
/// modules included. The replicated tensors (norms, routers and their expert bias, shared
/// experts, latent projections) are this rank's copies; the model is then a single-rank model
/// again ([`ShardModel::into_single_rank`]: full head counts, routers without the shard's
/// training losses and their groups, as loaded from HF).
pub fn gather_full<M: ShardModel>(
    shard: &Sharded<M>,
    groups: &GroupComms,
) -> Result<M, ModelError> {
    gather_planned(&shard.model, groups)?.into_single_rank()
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Int, Tensor};
    use moe_backend::BackendError;
    use moe_backend::comm::World;
    use moe_backend::parallel::ParallelLayout;

    use super::*;
    use crate::distributed::DispatcherKind;
    use crate::export::export_hf_tensors;
    use crate::{DeepseekV3Config, DeepseekV3ForCausalLM};

    fn f32s<const D: usize>(t: Tensor<D>) -> Vec<u32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32")
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    /// What the gathered model is compared on: its HF tensors (names, shapes, bytes) and the
    /// bits of its main and MTP logits.
    /// Asserts two bit-vectors of f32 values agree within `1e-6` (absolute and relative).
    fn close(got: &[u32], want: &[u32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{what}: element {i}: {g} vs {w}"
            );
        }
    }

    type Fingerprint = (Vec<(String, Vec<usize>, Vec<u8>)>, Vec<u32>, Vec<Vec<u32>>);

    fn fingerprint(model: &DeepseekV3ForCausalLM) -> Fingerprint {
        let tensors = export_hf_tensors(model)
            .expect("export")
            .map(|(name, data)| (name, data.shape().to_vec(), data.as_bytes().to_vec()))
            .collect();
        let ids = Tensor::<2, Int>::from_data([[1, 5, 9, 2, 7, 3]], &Device::flex());
        let out = model.forward(ids.clone()).expect("forward");
        let mtp = model.forward_mtp(ids, out.hidden).expect("forward_mtp");
        (
            tensors,
            f32s(out.logits),
            mtp.into_iter().map(f32s).collect(),
        )
    }

    /// Shards of a DeepSeek-V3 with two MTP modules, gathered back under TP, EP and ETP
    /// layouts, export the original tensors (MTP layers included) and compute the same main
    /// and MTP logits (the MTP blocks get their full head count back).
    #[test]
    fn gathered_deepseek_v3_includes_the_mtp_modules() {
        for q_lora_rank in [Some(8), None] {
            let config = DeepseekV3Config {
                vocab_size: 32,
                hidden_size: 16,
                intermediate_size: 24,
                moe_intermediate_size: 8,
                num_hidden_layers: 2,
                first_k_dense_replace: 1,
                num_attention_heads: 2,
                n_routed_experts: 4,
                num_experts_per_tok: 2,
                n_group: 2,
                topk_group: 1,
                n_shared_experts: 1,
                q_lora_rank,
                kv_lora_rank: 8,
                qk_nope_head_dim: 4,
                qk_rope_head_dim: 4,
                v_head_dim: 4,
                num_nextn_predict_layers: 2,
                ..DeepseekV3Config::default()
            };
            let full = config.init(&Device::flex()).expect("init");
            let want = fingerprint(&full);
            assert!(
                want.0
                    .iter()
                    .any(|(n, ..)| n == "model.layers.3.eh_proj.weight")
            );
            for (world, spec) in [(2, "tp=2"), (4, "tp=2,ep=2,etp=2"), (4, "tp=2,ep=4")] {
                let layout = ParallelLayout::parse(world, spec).expect("layout");
                let (full_ref, layout_ref) = (&full, &layout);
                let results = World::run(world, |ctx| {
                    let pg = ctx.process_groups(layout_ref)?;
                    let be = |e: ModelError| BackendError::Replay(e.to_string());
                    let shard =
                        Sharded::shard(full_ref, &pg, DispatcherKind::AllToAll).map_err(be)?;
                    assert_eq!(
                        shard.model.mtp[1].block.self_attn.num_heads,
                        2 / layout_ref.tp
                    );
                    let gathered = gather_full(&shard, &pg).map_err(be)?;
                    Ok(fingerprint(&gathered))
                });
                for (rank, got) in results.into_iter().enumerate() {
                    let got = got.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
                    assert!(
                        got.0 == want.0,
                        "{spec} rank {rank}: exported tensors differ"
                    );
                    // The gathered weights are rebuilt by concatenation, so a GEMM may see
                    // another memory layout and round differently in the last bit.
                    close(&got.1, &want.1, &format!("{spec} rank {rank}: main logits"));
                    assert_eq!(got.2.len(), want.2.len());
                    for (j, (g, w)) in got.2.iter().zip(&want.2).enumerate() {
                        close(g, w, &format!("{spec} rank {rank}: MTP depth {j} logits"));
                    }
                }
            }
        }
    }
}
