//! Where the parameters of one rank's model shard lie in the canonical, layout-independent
//! tensors of a distributed checkpoint (checkpoints.md §3): canonical fqn, global shape, the
//! rank's box ([`ShardingPlan::rank_shard`]) and the orientation of Burn's storage.
//!
//! Supported: Qwen3-MoE shards ([`moe_models::distributed::ParallelQwen3Moe`]`::model`), the
//! model [`moe_models::train::Trainer`] trains. Burn `Linear`s store `[in, out]` (the block
//! is their transpose); stacked experts store `fc1 [L, 2F, H]`, the same row-major order as
//! the canonical `gate_up_proj [L, 2, F, H]` block; a router's aux-loss-free expert bias is
//! the buffer `mlp.gate.e_score_correction_bias`.

use std::collections::HashMap;

use burn::module::{Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::Tensor;
use moe_backend::experts::GroupedExperts;
use moe_backend::layer::MoeLayer;
use moe_backend::optim::{ParamPlacement, transpose_2d};
use moe_models::layers::{Attention, Mlp, RmsNorm};
use moe_models::qwen3_moe::{Qwen3MoeFeedForward, Qwen3MoeForCausalLM};

use super::index::TensorKind;
use super::sharding::{ShardRule, ShardingPlan, shard_rule};
use crate::BridgeError;

/// One parameter (or buffer) of a rank's shard and its place in the checkpoint.
#[derive(Debug, Clone)]
pub struct PlacedTensor {
    /// Burn parameter id.
    pub id: ParamId,
    /// `Param` (trainable) or `Buffer` (e.g. the expert bias).
    pub kind: TensorKind,
    /// Canonical fqn, global shape, this rank's box and orientation.
    pub placement: ParamPlacement,
    /// Whether this rank's copy is the main replica (the one saved).
    pub main_replica: bool,
    /// The values in canonical orientation (row-major over `placement.shape`), when asked for.
    pub values: Option<Vec<f32>>,
}

/// How a Burn parameter relates to its canonical block.
#[derive(Debug, Clone, Copy)]
enum Storage {
    /// Same shape and order.
    Same,
    /// 2-D transpose (`Linear` `[in, out]`).
    Transposed,
    /// Stacked gated experts `[L, 2F, H]` as `[L, 2, F, H]`.
    GatedExperts,
}

struct Walk<'a> {
    plan: &'a ShardingPlan,
    rank: usize,
    with_values: bool,
    out: Vec<PlacedTensor>,
}

fn unsupported(fqn: &str, what: &str) -> BridgeError {
    BridgeError::Sharding {
        tensor: fqn.to_owned(),
        reason: format!("{what} has no canonical checkpoint tensor (not supported)"),
    }
}

impl Walk<'_> {
    fn add<const D: usize>(
        &mut self,
        fqn: String,
        param: &Param<Tensor<D>>,
        storage: Storage,
    ) -> Result<(), BridgeError> {
        let burn_shape = param.shape().to_vec();
        let shape = match (storage, burn_shape.as_slice()) {
            (Storage::Same, _) => burn_shape.clone(),
            (Storage::Transposed, [a, b]) => vec![*b, *a],
            (Storage::GatedExperts, [l, f2, h]) if f2 % 2 == 0 => vec![*l, 2, f2 / 2, *h],
            _ => {
                return Err(BridgeError::Sharding {
                    tensor: fqn,
                    reason: format!("unexpected parameter shape {burn_shape:?}"),
                });
            }
        };
        let layout = self.plan.layout();
        let mut global_shape = shape.clone();
        match shard_rule(&fqn) {
            ShardRule::Replicated => {}
            ShardRule::Tp { dim } => global_shape[dim] *= layout.tp,
            ShardRule::Expert { etp_dim } => {
                global_shape[0] *= layout.ep;
                global_shape[etp_dim] *= layout.etp;
            }
        }
        let shard = self
            .plan
            .rank_shard(&fqn, &global_shape, self.rank)?
            .ok_or_else(|| BridgeError::Sharding {
                tensor: fqn.clone(),
                reason: format!("rank {} does not own it under {layout}", self.rank),
            })?;
        if shard.tensor_box.shape != shape {
            return Err(BridgeError::Sharding {
                tensor: fqn,
                reason: format!(
                    "rank {} holds a {shape:?} block, the layout {layout} gives it {:?}",
                    self.rank, shard.tensor_box.shape
                ),
            });
        }
        let value = param.val();
        let kind = if value.is_require_grad() {
            TensorKind::Param
        } else {
            TensorKind::Buffer
        };
        let values = if self.with_values {
            let v = value
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| BridgeError::Sharding {
                    tensor: fqn.clone(),
                    reason: format!("values unreadable as f32: {e:?}"),
                })?;
            Some(match (storage, burn_shape.as_slice()) {
                (Storage::Transposed, [a, b]) => transpose_2d(&v, *a, *b),
                _ => v,
            })
        } else {
            None
        };
        self.out.push(PlacedTensor {
            id: param.id,
            kind,
            placement: ParamPlacement {
                fqn,
                global_shape,
                offsets: shard.tensor_box.offsets,
                shape,
                transposed: matches!(storage, Storage::Transposed),
            },
            main_replica: shard.main_replica,
            values,
        });
        Ok(())
    }

    fn linear(&mut self, prefix: &str, linear: &Linear) -> Result<(), BridgeError> {
        self.add(
            format!("{prefix}.weight"),
            &linear.weight,
            Storage::Transposed,
        )?;
        if let Some(bias) = &linear.bias {
            self.add(format!("{prefix}.bias"), bias, Storage::Same)?;
        }
        Ok(())
    }

    fn norm(&mut self, prefix: &str, norm: &RmsNorm) -> Result<(), BridgeError> {
        self.add(format!("{prefix}.weight"), &norm.weight, Storage::Same)
    }

    fn embedding(&mut self, fqn: &str, e: &Embedding) -> Result<(), BridgeError> {
        self.add(fqn.to_owned(), &e.weight, Storage::Same)
    }

    fn attention(&mut self, p: &str, a: &Attention) -> Result<(), BridgeError> {
        for (name, linear) in [
            ("q_proj", &a.q_proj),
            ("k_proj", &a.k_proj),
            ("v_proj", &a.v_proj),
            ("o_proj", &a.o_proj),
        ] {
            self.linear(&format!("{p}.{name}"), linear)?;
        }
        if let Some(n) = &a.q_norm {
            self.norm(&format!("{p}.q_norm"), n)?;
        }
        if let Some(n) = &a.k_norm {
            self.norm(&format!("{p}.k_norm"), n)?;
        }
        Ok(())
    }

    fn mlp(&mut self, p: &str, mlp: &Mlp) -> Result<(), BridgeError> {
        self.linear(&format!("{p}.gate_proj"), &mlp.gate_proj)?;
        self.linear(&format!("{p}.up_proj"), &mlp.up_proj)?;
        self.linear(&format!("{p}.down_proj"), &mlp.down_proj)
    }

    fn experts(&mut self, p: &str, experts: &GroupedExperts) -> Result<(), BridgeError> {
        if !experts.activation.is_gated() {
            return Err(unsupported(
                &format!("{p}.gate_up_proj"),
                "a non-gated expert fc1",
            ));
        }
        if experts.fc1_bias.is_some() || experts.fc2_bias.is_some() {
            return Err(unsupported(
                &format!("{p}.fc1_bias"),
                "an expert bias vector",
            ));
        }
        self.add(
            format!("{p}.gate_up_proj"),
            &experts.fc1,
            Storage::GatedExperts,
        )?;
        self.add(format!("{p}.down_proj"), &experts.fc2, Storage::Same)
    }

    fn moe(&mut self, p: &str, moe: &MoeLayer) -> Result<(), BridgeError> {
        let router = &moe.router;
        self.add(format!("{p}.gate.weight"), &router.weight, Storage::Same)?;
        if router.bias.is_some() {
            return Err(unsupported(&format!("{p}.gate.bias"), "a router bias"));
        }
        if let Some(bias) = &router.expert_bias {
            self.add(
                format!("{p}.gate.e_score_correction_bias"),
                bias,
                Storage::Same,
            )?;
        }
        if moe.shared_experts.is_some() {
            return Err(unsupported(
                &format!("{p}.shared_experts"),
                "Qwen3-MoE shared experts",
            ));
        }
        self.experts(&format!("{p}.experts"), &moe.experts)
    }
}

/// The placement of every parameter and buffer of `model`, rank `rank`'s shard of a Qwen3-MoE
/// under `plan`'s layout, in module order; `with_values` also copies their values (canonical
/// orientation). Errors name the tensor whose shard does not match the layout.
pub fn qwen3_moe_placements(
    model: &Qwen3MoeForCausalLM,
    plan: &ShardingPlan,
    rank: usize,
    with_values: bool,
) -> Result<Vec<PlacedTensor>, BridgeError> {
    let mut w = Walk {
        plan,
        rank,
        with_values,
        out: Vec::new(),
    };
    let m = &model.model;
    w.embedding("model.embed_tokens.weight", &m.embed_tokens)?;
    for (l, layer) in m.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        w.norm(&format!("{p}.input_layernorm"), &layer.input_layernorm)?;
        w.attention(&format!("{p}.self_attn"), &layer.self_attn)?;
        w.norm(
            &format!("{p}.post_attention_layernorm"),
            &layer.post_attention_layernorm,
        )?;
        match &layer.mlp {
            Qwen3MoeFeedForward::Dense(mlp) => w.mlp(&format!("{p}.mlp"), mlp)?,
            Qwen3MoeFeedForward::Sparse(block) => w.moe(&format!("{p}.mlp"), &block.moe)?,
        }
    }
    w.norm("model.norm", &m.norm)?;
    if let Some(head) = &model.lm_head {
        w.linear("lm_head", head)?;
    }
    Ok(w.out)
}

/// Placements by parameter id.
pub fn by_id(placed: &[PlacedTensor]) -> HashMap<ParamId, &PlacedTensor> {
    placed.iter().map(|p| (p.id, p)).collect()
}
