//! Where the parameters of one rank's model shard lie in the canonical, layout-independent tensors
//! of a distributed checkpoint (docs/checkpoints.md §Canonical names and sharding): canonical fqn,
//! global shape, the rank's box ([`ShardingPlan::rank_shard`]) and the orientation of Burn's
//! storage.
//!
//! Every model the [`Trainer`](crate::train::Trainer) trains is placed the same way
//! ([`PlacedModel`], implemented for every [`Planned`] model): its parallel plan
//! ([`crate::param_plan`]) gives each parameter's canonical name, how Burn stores it
//! (`Linear`s `[in, out]` are the transpose of the block; stacked experts `fc1 [L, 2F, H]`
//! have the row-major order of the canonical `gate_up_proj [L, 2, F, H]`) and how the model
//! splits it, which decides each rank's box. A parameter the plan does not classify is an
//! error naming it.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor};
use moe_backend::optim::{ParamPlacement, transpose_2d};
use moe_bridge::BridgeError;
use moe_bridge::dist::index::TensorKind;
use moe_bridge::dist::sharding::{ShardRule, ShardingPlan};

use crate::param_plan::{ParallelPlan, Planned, Storage};

/// A model whose rank shards a distributed checkpoint can place: the training checkpoint
/// functions ([`super::train_state`]) save and restore any such model's shard.
pub trait PlacedModel: Module {
    /// `num_hidden_layers` of the main model: the layers [`ShardingPlan::new`] spreads over
    /// pipeline stages (MTP modules, stored as layers `N + j`, belong to the last stage).
    fn num_main_layers(&self) -> usize;

    /// The placement of every parameter and buffer of `self`, rank `rank`'s shard under
    /// `plan`'s layout, in module order; `with_values` also copies their values (canonical
    /// orientation). Errors name the tensor whose shard does not match the layout or the
    /// checkpoint's sharding rules, or that the model's parallel plan does not classify.
    fn placements(
        &self,
        plan: &ShardingPlan,
        rank: usize,
        with_values: bool,
    ) -> Result<Vec<PlacedTensor>, BridgeError>;
}

impl<M: Planned> PlacedModel for M {
    fn num_main_layers(&self) -> usize {
        self.main_layers()
    }

    fn placements(
        &self,
        plan: &ShardingPlan,
        rank: usize,
        with_values: bool,
    ) -> Result<Vec<PlacedTensor>, BridgeError> {
        let mut w = Walk::new(plan, rank, with_values);
        let mut visitor = PlanVisitor {
            plan: M::parallel_plan(),
            layers: self.main_layers(),
            path: Vec::new(),
            walk: &mut w,
            error: None,
        };
        self.visit(&mut visitor);
        match visitor.error {
            Some(e) => Err(e),
            None => Ok(w.out),
        }
    }
}

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
    /// Whether it is a copy of a tensor another pipeline stage owns (the last stage's
    /// embedding for a tied output layer or MTP): restored, never saved (nor its optimizer
    /// state).
    pub copy: bool,
    /// The dtype the shard holds the tensor in (BF16 for the trainable parameters of a BF16
    /// mixed-precision run, docs/training-and-rl.md §Mixed precision (BF16)).
    pub dtype: DType,
    /// The values in canonical orientation (row-major over `placement.shape`), when asked for.
    pub values: Option<Vec<f32>>,
}

struct Walk<'a> {
    plan: &'a ShardingPlan,
    rank: usize,
    with_values: bool,
    out: Vec<PlacedTensor>,
}

impl Walk<'_> {
    fn new(plan: &ShardingPlan, rank: usize, with_values: bool) -> Walk<'_> {
        Walk {
            plan,
            rank,
            with_values,
            out: Vec::new(),
        }
    }

    /// Places `param` as canonical `fqn`, which the model's plan splits by `rule` (the rule
    /// decides this rank's box, so a model whose names the built-in plans do not know is
    /// placed by its own plan).
    fn add<const D: usize>(
        &mut self,
        fqn: String,
        param: &Param<Tensor<D>>,
        storage: Storage,
        rule: ShardRule,
    ) -> Result<(), BridgeError> {
        let burn_shape = param.shape().to_vec();
        let shape = match (storage, burn_shape.as_slice()) {
            (Storage::Same, _) => burn_shape.clone(),
            (Storage::Transposed, [a, b]) => vec![*b, *a],
            (Storage::GatedExperts, [l, f2, h]) if f2 % 2 == 0 => vec![*l, 2, f2 / 2, *h],
            (Storage::GatedExperts, [l, f2]) if f2 % 2 == 0 => vec![*l, 2, f2 / 2],
            _ => {
                return Err(BridgeError::Sharding {
                    tensor: fqn,
                    reason: format!("unexpected parameter shape {burn_shape:?}"),
                });
            }
        };
        let layout = self.plan.layout();
        let mut global_shape = shape.clone();
        let mut scale = |dim: usize, parts: usize| match global_shape.get_mut(dim) {
            Some(extent) => {
                *extent *= parts;
                Ok(())
            }
            None => Err(BridgeError::Sharding {
                tensor: fqn.clone(),
                reason: format!("{rule:?} splits dim {dim} of a {burn_shape:?} parameter"),
            }),
        };
        match rule {
            ShardRule::Replicated => {}
            ShardRule::Tp { dim } => scale(dim, layout.tp)?,
            ShardRule::Expert { etp_dim } => {
                scale(0, layout.ep)?;
                scale(etp_dim, layout.etp)?;
            }
            ShardRule::ExpertReplicated => scale(0, layout.ep)?,
        }
        // A tensor this rank's pipeline stage does not own is a copy of the owner's (the
        // last stage's embedding for a tied output layer or the MTP modules): restored from
        // the owner's box, never written.
        let (shard, copy) = match self
            .plan
            .rank_shard_by(&fqn, &global_shape, self.rank, rule)?
        {
            Some(shard) => (shard, false),
            None => (
                self.plan
                    .copy_shard_by(&fqn, &global_shape, self.rank, rule)?,
                true,
            ),
        };
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
        let dtype = value.dtype();
        let kind = if value.is_require_grad() {
            TensorKind::Param
        } else {
            TensorKind::Buffer
        };
        let values = if self.with_values {
            // A packed FP8 primary weight reads as its decoded values.
            let v = moe_backend::fp8::dequantize_param(value)
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
            copy,
            dtype,
            values,
        });
        Ok(())
    }
}

/// Visits a module's tensors with their paths and places each by its plan entry.
struct PlanVisitor<'a, 'w> {
    plan: ParallelPlan,
    layers: usize,
    path: Vec<String>,
    walk: &'a mut Walk<'w>,
    error: Option<BridgeError>,
}

impl ModuleVisitor for PlanVisitor<'_, '_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let path = self.path.join(".");
        let placed = match self.plan.resolve(&path, self.layers) {
            Ok(r) => {
                let (storage, rule) = (r.entry.storage, r.entry.split);
                self.walk.add(r.hf_name, param, storage, rule)
            }
            Err(e) => Err(BridgeError::Sharding {
                tensor: path,
                reason: e.to_string(),
            }),
        };
        if let Err(e) = placed {
            self.error = Some(e);
        }
    }
}

/// Placements by parameter id.
pub fn by_id(placed: &[PlacedTensor]) -> HashMap<ParamId, &PlacedTensor> {
    placed.iter().map(|p| (p.id, p)).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::path::Path;

    use crate::DeepseekV3Config;
    use crate::deepseek_v3::{DeepseekV3FeedForward, DeepseekV3ForCausalLM};
    use crate::distributed::{DispatcherKind, Sharded};
    use burn::module::{ModuleVisitor, Param, ParamId};
    use burn::tensor::{Device, Tensor};
    use moe_backend::BackendError;
    use moe_backend::comm::World;
    use moe_backend::parallel::ParallelLayout;

    use super::*;
    use moe_bridge::dist::region::TensorBox;
    use moe_bridge::dist::validate::check_tiling;
    use moe_bridge::fp8::DEFAULT_BLOCK_SIZE;
    use moe_bridge::mapping::{ExpertLayout, HfRole, canonical_tensors};

    use crate::families::Family;
    use crate::families::shard_rule;
    use crate::param_plan::hf_names::stage_place;

    /// A random DeepSeek-V3 with every part the walk knows: a dense layer, an MoE layer with a
    /// shared expert and group-limited routing, one MTP module; the low-rank or the plain
    /// query path. Heads and vocabulary divide by 2, experts by 8, expert width by 2.
    pub(crate) fn tiny_deepseek_config(q_lora_rank: Option<usize>) -> DeepseekV3Config {
        DeepseekV3Config {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 2,
            first_k_dense_replace: 1,
            num_attention_heads: 2,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_group: 4,
            topk_group: 2,
            n_shared_experts: 1,
            q_lora_rank,
            kv_lora_rank: 8,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 4,
            v_head_dim: 4,
            num_nextn_predict_layers: 1,
            ..DeepseekV3Config::default()
        }
    }

    /// Every parameter id of a module, in visiting order.
    struct Ids(Vec<ParamId>);

    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }

    fn be(e: impl std::fmt::Display) -> BackendError {
        BackendError::Replay(e.to_string())
    }

    /// `(fqn, global shape, box, main replica)` of every tensor one rank holds.
    type RankTensors = Vec<(String, Vec<usize>, TensorBox, bool)>;

    /// Every rank of `layout` shards `full` and places its shard; each rank's parameter ids
    /// are placed exactly once.
    fn place_every_rank(full: &DeepseekV3ForCausalLM, layout: &ParallelLayout) -> Vec<RankTensors> {
        World::run(layout.world, |ctx| {
            let groups = ctx.process_groups(layout)?;
            let shard =
                Sharded::<DeepseekV3ForCausalLM>::shard(full, &groups, DispatcherKind::AllToAll)
                    .map_err(be)?;
            let plan = ShardingPlan::new(
                layout,
                Some(full.num_main_layers()),
                shard_rule,
                stage_place,
            )
            .map_err(be)?;
            let placed = shard
                .model
                .placements(&plan, ctx.rank(), false)
                .map_err(be)?;
            let mut ids = Ids(Vec::new());
            shard.model.visit(&mut ids);
            let mut times: HashMap<ParamId, usize> = ids.0.iter().map(|id| (*id, 0)).collect();
            for p in &placed {
                let n = times.get_mut(&p.id).unwrap_or_else(|| {
                    panic!(
                        "{layout}: {} is not a parameter of the shard",
                        p.placement.fqn
                    )
                });
                *n += 1;
            }
            assert_eq!(
                ids.0.len(),
                placed.len(),
                "{layout}: parameters vs placements"
            );
            assert!(
                times.values().all(|&n| n == 1),
                "{layout}: a parameter placed other than once"
            );
            Ok(placed
                .into_iter()
                .map(|p| {
                    let pl = p.placement;
                    let b = TensorBox::new(pl.offsets, pl.shape);
                    (pl.fqn, pl.global_shape, b, p.main_replica)
                })
                .collect())
        })
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{layout} rank {r}: {e}")))
        .collect()
    }

    /// The canonical tensors (name → global shape, `None` for stacked experts) a HF
    /// checkpoint of `config` converts to: the names the checkpoint conversion writes.
    fn canonical_of(config: &DeepseekV3Config) -> BTreeMap<String, Option<Vec<usize>>> {
        let table = crate::deepseek_v3::DeepseekV3::expected_tensors(
            config,
            ExpertLayout::PerExpert,
            Path::new("config.json"),
            DEFAULT_BLOCK_SIZE,
        )
        .unwrap();
        let hf: Vec<(&String, &Vec<usize>)> = table
            .iter()
            .filter(|(_, e)| e.required && e.role == HfRole::Weight)
            .map(|(n, e)| (n, &e.shape))
            .collect();
        let registry = crate::hf::mapping::for_family::<crate::deepseek_v3::DeepseekV3>();
        canonical_tensors(&registry, hf.iter().map(|(n, _)| n.as_str()))
            .into_iter()
            .map(|(canon, experts)| {
                let shape = match experts {
                    Some(_) => None,
                    None => hf
                        .iter()
                        .find(|(n, _)| **n == canon)
                        .map(|(_, s)| (*s).clone()),
                };
                (canon, shape)
            })
            .collect()
    }

    #[test]
    fn deepseek_v3_shards_are_placed_once_and_tile_every_tensor() {
        let device = Device::flex();
        for q_lora_rank in [Some(8), None] {
            let config = tiny_deepseek_config(q_lora_rank);
            let full = config.init(&device).unwrap();
            let canonical = canonical_of(&config);
            for name in [
                "model.layers.2.eh_proj.weight",
                "model.layers.2.shared_head.norm.weight",
                "model.layers.2.mlp.gate.e_score_correction_bias",
                "model.layers.2.mlp.experts.gate_up_proj",
                "model.layers.1.mlp.shared_experts.down_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
            ] {
                assert!(canonical.contains_key(name), "{name}");
            }
            for (world, spec) in [
                (1, ""),
                (2, "tp=2"),
                (4, "tp=2,ep=2"),
                (4, "ep=4"),
                (4, "tp=2,ep=2,etp=2"),
                (4, "tp=2,ep=4"),
                (4, "ep=2,etp=2"),
            ] {
                let layout = ParallelLayout::parse(world, spec).unwrap();
                let ranks = place_every_rank(&full, &layout);
                let mut tensors: BTreeMap<String, (Vec<usize>, Vec<TensorBox>, usize)> =
                    BTreeMap::new();
                for rank in &ranks {
                    for (fqn, global, b, main) in rank {
                        let e = tensors
                            .entry(fqn.clone())
                            .or_insert_with(|| (global.clone(), Vec::new(), 0));
                        assert_eq!(&e.0, global, "{spec}: {fqn}: global shapes differ");
                        e.2 += 1;
                        if *main {
                            e.1.push(b.clone());
                        }
                    }
                }
                // Exactly the canonical tensors of a converted HF checkpoint, same shapes.
                let names: Vec<&String> = tensors.keys().collect();
                let want: Vec<&String> = canonical.keys().collect();
                assert_eq!(names, want, "{spec} q_lora_rank {q_lora_rank:?}: tensors");
                for (fqn, (global, boxes, holders)) in &tensors {
                    if let Some(Some(shape)) = canonical.get(fqn) {
                        assert_eq!(global, shape, "{spec}: {fqn}: global shape");
                    }
                    assert_eq!(*holders, world, "{spec}: {fqn}: every rank holds a box");
                    check_tiling(boxes, global)
                        .unwrap_or_else(|e| panic!("{spec} q_lora {q_lora_rank:?}: {fqn}: {e}"));
                }
                // TP halves the MTP block's head projections; the shared experts stay whole.
                let held = |fqn: &str| {
                    let t = ranks[0].iter().find(|t| t.0 == fqn).unwrap();
                    (t.2.shape.clone(), t.1.clone())
                };
                let (kv_b, kv_b_global) = held("model.layers.2.self_attn.kv_b_proj.weight");
                assert_eq!(kv_b[0] * layout.tp, kv_b_global[0], "{spec}: kv_b_proj");
                let (shared, shared_global) =
                    held("model.layers.1.mlp.shared_experts.gate_proj.weight");
                assert_eq!(shared, shared_global, "{spec}: shared experts");
            }
        }
    }

    #[test]
    fn unplanned_tensors_are_errors_naming_them() {
        let config = tiny_deepseek_config(Some(8));
        let full = config.init(&Device::flex()).unwrap();
        let layout = ParallelLayout::parse(1, "").unwrap();
        let plan = ShardingPlan::new(&layout, Some(2), shard_rule, stage_place).unwrap();
        // A shared-expert output gate has no canonical tensor.
        let mut gated = full.clone();
        if let DeepseekV3FeedForward::Moe(block) = &mut gated.mtp[0].block.mlp {
            let shared = block.moe.shared_experts.as_mut().unwrap();
            shared.gate = Some(burn::nn::LinearConfig::new(16, 1).init(&Device::flex()));
        }
        let err = gated.placements(&plan, 0, false).unwrap_err();
        assert!(
            err.to_string()
                .contains("`mtp.0.block.mlp.Moe.moe.shared_experts.gate.weight`"),
            "{err}"
        );
        // A biased dense MLP projection: the plan has no entry for the bias.
        let mut biased = full.clone();
        if let DeepseekV3FeedForward::Dense(mlp) = &mut biased.model.layers[0].mlp {
            mlp.gate_proj = burn::nn::LinearConfig::new(16, 24).init(&Device::flex());
        }
        let err = biased.placements(&plan, 0, false).unwrap_err();
        assert!(
            err.to_string()
                .contains("`model.layers.0.mlp.Dense.gate_proj.bias`"),
            "{err}"
        );
        // The values come in canonical orientation, one per element of the box.
        let placed = full.placements(&plan, 0, true).unwrap();
        for p in &placed {
            let n: usize = p.placement.shape.iter().product();
            assert_eq!(
                p.values.as_ref().map(Vec::len),
                Some(n),
                "{}",
                p.placement.fqn
            );
        }
    }
}
