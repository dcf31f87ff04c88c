//! Which box of each canonical tensor a rank holds under a [`ParallelLayout`], and whether that
//! copy is the main replica that writes it (docs/checkpoints.md §Canonical names and sharding, and
//! the main replicas of §Distributed checkpoint format).
//!
//! How each tensor is split ([`ShardRule`]) is the models' knowledge: a [`ShardingPlan`] is
//! built with the split rule of the model it places ([`ShardRuleFn`]; moe-models'
//! `distributed::shard_rule`, read from the models' parallel plans). For the built-in models
//! that table is:
//!
//! | tensor | split |
//! |---|---|
//! | `embed_tokens`, `lm_head`, `q/k/v_proj` (+ biases; DeepSeek's `q_proj` when `q_lora_rank` is unset), `q_b_proj`, `kv_b_proj`, dense `gate_proj`/`up_proj` | TP dim 0 |
//! | `o_proj.weight`, dense `down_proj` | TP dim 1 |
//! | `experts.gate_up_proj [E,2,Im,H]`, `experts.down_proj [E,H,Im]` | EP dim 0, ETP dim 2 |
//! | everything else: norms (incl. `q_a_layernorm`, `kv_a_layernorm`, MTP `enorm`/`hnorm`/`shared_head.norm`), router `gate.weight`, `e_score_correction_bias`, `q_a_proj`, `kv_a_proj_with_mqa`, `o_proj.bias`, the shared experts `mlp.shared_experts.*`, MTP `eh_proj` | replicated |
//!
//! The shared experts are replicated as the sharded models hold them (they run on the
//! sequence-parallel tokens, their gradients summed over TP); Megatron shards them over TP like
//! the dense MLPs.
//!
//! Main replicas: TP-sharded dense tensors are written by `dp_cp` rank 0, replicated dense
//! tensors by `tp` rank 0 ∧ `dp_cp` rank 0, expert tensors by `expt_dp` rank 0. With PP a
//! tensor lives only on the stage owning its layer (layers split evenly in order; MTP layers,
//! `model.norm` and `lm_head` on the last stage; `embed_tokens` on the first). Optimizer state
//! `optim.<state>.<fqn>` follows its parameter.

use moe_backend::parallel::{GroupFamily, GroupTable, ParallelLayout, ProcessGroups};

use super::region::TensorBox;
use crate::BridgeError;

/// How a canonical tensor is split over the ranks of one pipeline stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRule {
    /// Every rank of the owning stage holds the whole tensor.
    Replicated,
    /// Split over dense TP along `dim`.
    Tp {
        /// The split dimension.
        dim: usize,
    },
    /// Routed experts: dim 0 split over EP, `etp_dim` over expert TP.
    Expert {
        /// The dimension split over ETP.
        etp_dim: usize,
    },
    /// A per-expert tensor every expert-TP rank holds whole (e.g. the bias of a row-parallel
    /// expert projection, added after the reduction): dim 0 split over EP only.
    ExpertReplicated,
}

/// The split of a canonical parameter (or buffer) by name: the model's table (moe-models'
/// `distributed::shard_rule` for the built-in models). Optimizer-state names reach it as the
/// name of their parameter ([`param_fqn`]).
pub type ShardRuleFn = fn(&str) -> ShardRule;

/// Where a canonical tensor lives along the pipeline: the model's knowledge (moe-models'
/// `hf_names::stage_place` for the built-in models), given to [`ShardingPlan::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagePlace {
    /// On the first stage (the embedding, and tensors outside any layer by default).
    First,
    /// Decoder layer `i`: on the stage owning it, or the last stage when `i` is beyond the
    /// main layers (MTP layers).
    Layer(usize),
    /// On the last stage (the final norm and the LM head).
    Last,
}

/// The pipeline placement of a canonical parameter (or buffer) by name. Optimizer-state names
/// reach it as the name of their parameter ([`param_fqn`]).
pub type StageFn = fn(&str) -> StagePlace;

/// Prefixes of optimizer-state fqns (`optim.<state>.<param fqn>`).
pub const OPTIM_STATES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// The parameter fqn of an optimizer-state fqn (`optim.exp_avg.x` → `x`); other fqns unchanged.
pub fn param_fqn(fqn: &str) -> &str {
    if let Some(rest) = fqn.strip_prefix("optim.") {
        for state in OPTIM_STATES {
            if let Some(param) = rest.strip_prefix(state).and_then(|r| r.strip_prefix('.')) {
                return param;
            }
        }
    }
    fqn
}

/// The box one rank holds and whether it writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    /// The rank's box of the global tensor.
    pub tensor_box: TensorBox,
    /// Whether this copy is the main replica (the one written to checkpoints).
    pub main_replica: bool,
}

/// The sharding of canonical tensors under one layout, for every rank.
#[derive(Debug, Clone)]
pub struct ShardingPlan {
    layout: ParallelLayout,
    ranks: Vec<ProcessGroups>,
    num_layers: Option<usize>,
    rule: ShardRuleFn,
    stage: StageFn,
    /// The pipeline stage of every main decoder layer, when the model's split is not the even
    /// one (an explicit pipeline layout, virtual stages).
    layer_stages: Option<Vec<usize>>,
}

impl ShardingPlan {
    /// The plan for `layout` of a model whose tensors `rule` splits and `stage` places along
    /// the pipeline; `num_layers` (the config's `num_hidden_layers`) is required when
    /// `pp > 1` to assign layers to stages.
    pub fn new(
        layout: &ParallelLayout,
        num_layers: Option<usize>,
        rule: ShardRuleFn,
        stage: StageFn,
    ) -> Result<Self, BridgeError> {
        let fail = |reason: String| BridgeError::Sharding {
            tensor: String::new(),
            reason,
        };
        if layout.pp > 1 && num_layers.is_none_or(|n| n == 0) {
            return Err(fail(format!(
                "pp = {} needs the number of layers to place layers on stages",
                layout.pp
            )));
        }
        let table = GroupTable::new(layout).map_err(|e| fail(e.to_string()))?;
        let ranks = (0..layout.world)
            .map(|r| table.for_rank(r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fail(e.to_string()))?;
        Ok(Self {
            layout: layout.clone(),
            ranks,
            num_layers,
            rule,
            stage,
            layer_stages: None,
        })
    }

    /// The plan with decoder layer `i` on pipeline stage `stages[i]` (a model split by an
    /// explicit pipeline layout or over virtual stages) instead of the even split; refused
    /// unless it names a stage below `pp` for each of the `num_layers` layers.
    pub fn with_layer_stages(mut self, stages: Vec<usize>) -> Result<Self, BridgeError> {
        let pp = self.layout.pp;
        let n = self.num_layers.unwrap_or(0);
        if stages.len() != n || stages.iter().any(|&s| s >= pp) {
            return Err(BridgeError::Sharding {
                tensor: String::new(),
                reason: format!(
                    "layer stages {stages:?} do not place {n} layers on {pp} pipeline stages"
                ),
            });
        }
        self.layer_stages = Some(stages);
        Ok(self)
    }

    /// The split of canonical tensor (or optimizer state) `fqn`: the plan's rule for its
    /// parameter ([`param_fqn`]).
    pub fn rule_of(&self, fqn: &str) -> ShardRule {
        (self.rule)(param_fqn(fqn))
    }

    /// The layout.
    pub fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// The pipeline stage owning `fqn`.
    pub fn stage_of(&self, fqn: &str) -> usize {
        let pp = self.layout.pp;
        if pp == 1 {
            return 0;
        }
        let last = pp - 1;
        match (self.stage)(param_fqn(fqn)) {
            StagePlace::First => 0,
            StagePlace::Last => last,
            StagePlace::Layer(l) => match (&self.layer_stages, self.num_layers) {
                (Some(stages), _) => stages.get(l).copied().unwrap_or(last),
                (None, Some(n)) if l < n => l * pp / n,
                _ => last,
            },
        }
    }

    /// The box of `fqn` (global shape `global_shape`) that `rank` holds, `None` when its
    /// pipeline stage does not own the tensor.
    pub fn rank_shard(
        &self,
        fqn: &str,
        global_shape: &[usize],
        rank: usize,
    ) -> Result<Option<RankShard>, BridgeError> {
        self.rank_shard_by(fqn, global_shape, rank, self.rule_of(fqn))
    }

    /// [`rank_shard`](Self::rank_shard) with the split `rule` given by the caller (a model's
    /// parallel plan) instead of the plan's rule for the name: how a model whose tensor names
    /// the plan's rule does not know (a user's own model) is placed.
    pub fn rank_shard_by(
        &self,
        fqn: &str,
        global_shape: &[usize],
        rank: usize,
        rule: ShardRule,
    ) -> Result<Option<RankShard>, BridgeError> {
        let fail = |reason: String| BridgeError::Sharding {
            tensor: fqn.to_owned(),
            reason,
        };
        let groups = self.ranks.get(rank).ok_or_else(|| {
            fail(format!(
                "rank {rank} outside a world of {}",
                self.layout.world
            ))
        })?;
        if groups.pp_rank() != self.stage_of(fqn) {
            return Ok(None);
        }
        let index = |f: GroupFamily| groups.get(f).index;
        let mut b = TensorBox::full(global_shape);
        let mut split = |dim: usize, parts: usize, part: usize, what: &str| {
            let Some(&extent) = global_shape.get(dim) else {
                return Err(fail(format!(
                    "{what} splits dim {dim} of a rank-{} tensor",
                    global_shape.len()
                )));
            };
            if !extent.is_multiple_of(parts) {
                return Err(fail(format!(
                    "dim {dim} of {global_shape:?} is not divisible by {what} = {parts}"
                )));
            }
            b.shape[dim] = extent / parts;
            b.offsets[dim] = part * (extent / parts);
            Ok(())
        };
        let main_replica = match rule {
            ShardRule::Replicated => index(GroupFamily::Tp) == 0 && index(GroupFamily::DpCp) == 0,
            ShardRule::Tp { dim } => {
                split(dim, self.layout.tp, index(GroupFamily::Tp), "tp")?;
                index(GroupFamily::DpCp) == 0
            }
            ShardRule::Expert { etp_dim } => {
                split(0, self.layout.ep, index(GroupFamily::Ep), "ep")?;
                split(etp_dim, self.layout.etp, index(GroupFamily::ExptTp), "etp")?;
                index(GroupFamily::ExptDp) == 0
            }
            ShardRule::ExpertReplicated => {
                split(0, self.layout.ep, index(GroupFamily::Ep), "ep")?;
                index(GroupFamily::ExptTp) == 0 && index(GroupFamily::ExptDp) == 0
            }
        };
        Ok(Some(RankShard {
            tensor_box: b,
            main_replica,
        }))
    }

    /// The box of `fqn` that `rank` holds as a copy of a tensor another pipeline stage owns
    /// (the last stage's copy of the embedding for a tied output layer or MTP modules): the
    /// box it would hold on the owning stage, never the main replica (restored from the
    /// checkpoint, never written).
    pub fn copy_shard_by(
        &self,
        fqn: &str,
        global_shape: &[usize],
        rank: usize,
        rule: ShardRule,
    ) -> Result<RankShard, BridgeError> {
        let owner = self.stage_of(fqn);
        let groups = self.ranks.get(rank).ok_or_else(|| BridgeError::Sharding {
            tensor: fqn.to_owned(),
            reason: format!("rank {rank} outside a world of {}", self.layout.world),
        })?;
        // The rank at this rank's place on the owning stage: same coordinates, other pp rank.
        let peer = (0..self.layout.world).find(|&r| {
            let g = &self.ranks[r];
            g.pp_rank() == owner
                && [
                    GroupFamily::Tp,
                    GroupFamily::Ep,
                    GroupFamily::ExptTp,
                    GroupFamily::DpCp,
                ]
                .iter()
                .all(|&f| g.get(f).index == groups.get(f).index)
        });
        let peer = peer.ok_or_else(|| BridgeError::Sharding {
            tensor: fqn.to_owned(),
            reason: format!("no rank of pipeline stage {owner} matches rank {rank}"),
        })?;
        let shard = self
            .rank_shard_by(fqn, global_shape, peer, rule)?
            .ok_or_else(|| BridgeError::Sharding {
                tensor: fqn.to_owned(),
                reason: format!("stage {owner} does not own it"),
            })?;
        Ok(RankShard {
            main_replica: false,
            ..shard
        })
    }

    /// The main-replica boxes of `fqn`, `(writer rank, box)` in rank order: exactly one copy of
    /// every element.
    pub fn main_boxes(
        &self,
        fqn: &str,
        global_shape: &[usize],
    ) -> Result<Vec<(usize, TensorBox)>, BridgeError> {
        let mut out = Vec::new();
        for rank in 0..self.layout.world {
            if let Some(shard) = self.rank_shard(fqn, global_shape, rank)?
                && shard.main_replica
            {
                out.push((rank, shard.tensor_box));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::testing::{SplitMix, random_layout, tiny_moe_tensors, tiny_rule, tiny_stage};
    use crate::dist::validate::check_tiling;

    #[test]
    fn optimizer_states_take_their_parameters_rule() {
        assert_eq!(param_fqn("optim.exp_avg_sq.a.b"), "a.b");
        assert_eq!(param_fqn("optim.other.a"), "optim.other.a");
        let layout = ParallelLayout::parse(1, "").unwrap();
        let plan = ShardingPlan::new(&layout, None, tiny_rule, tiny_stage).unwrap();
        assert_eq!(
            plan.rule_of("optim.master.model.layers.0.mlp.up_proj.weight"),
            ShardRule::Tp { dim: 0 }
        );
        assert_eq!(
            plan.rule_of("optim.other.lm_head.weight"),
            ShardRule::Replicated
        );
    }

    #[test]
    fn expert_boxes_follow_ep_and_etp_ranks() {
        // world 8, etp 2, ep 2, edp 2 (docs/parallelism.md §Group test vectors):
        // ep [[0,2],[1,3],..].
        let layout = ParallelLayout::parse(8, "tp=2,etp=2,ep=2").unwrap();
        let plan = ShardingPlan::new(&layout, None, tiny_rule, tiny_stage).unwrap();
        let shape = [8, 2, 32, 64];
        let fqn = "model.layers.1.mlp.experts.gate_up_proj";
        let r2 = plan.rank_shard(fqn, &shape, 2).unwrap().unwrap();
        assert_eq!(
            r2.tensor_box,
            TensorBox::new(vec![4, 0, 0, 0], vec![4, 2, 16, 64])
        );
        assert!(r2.main_replica);
        let r1 = plan.rank_shard(fqn, &shape, 1).unwrap().unwrap();
        assert_eq!(r1.tensor_box.offsets, vec![0, 0, 16, 0]);
        assert!(
            !plan
                .rank_shard(fqn, &shape, 4)
                .unwrap()
                .unwrap()
                .main_replica
        );
        let err = plan.rank_shard(fqn, &[3, 2, 32, 64], 0).unwrap_err();
        assert!(err.to_string().contains("not divisible by ep"), "{err}");
    }

    #[test]
    fn a_models_stage_placement_replaces_the_default() {
        fn place(name: &str) -> StagePlace {
            match name.strip_prefix("blocks.") {
                Some(rest) => StagePlace::Layer(rest[..1].parse().unwrap()),
                None if name == "head" => StagePlace::Last,
                None => StagePlace::First,
            }
        }
        let layout = ParallelLayout::parse(2, "pp=2").unwrap();
        let plan = ShardingPlan::new(&layout, Some(4), tiny_rule, place).unwrap();
        assert_eq!(plan.stage_of("embed"), 0);
        assert_eq!(plan.stage_of("blocks.1.w"), 0);
        assert_eq!(plan.stage_of("blocks.3.w"), 1);
        assert_eq!(plan.stage_of("optim.master.blocks.2.w"), 1);
        assert_eq!(plan.stage_of("blocks.7.w"), 1);
        assert_eq!(plan.stage_of("head"), 1);
    }

    #[test]
    fn pipeline_stages_own_their_layers() {
        let layout = ParallelLayout::parse(4, "pp=2,tp=2").unwrap();
        assert!(ShardingPlan::new(&layout, None, tiny_rule, tiny_stage).is_err());
        let plan = ShardingPlan::new(&layout, Some(4), tiny_rule, tiny_stage).unwrap();
        assert_eq!(plan.stage_of("model.embed_tokens.weight"), 0);
        assert_eq!(plan.stage_of("model.layers.1.mlp.gate.weight"), 0);
        assert_eq!(plan.stage_of("model.layers.2.mlp.gate.weight"), 1);
        assert_eq!(plan.stage_of("model.layers.4.enorm.weight"), 1);
        assert_eq!(plan.stage_of("model.layers.5.mlp.gate.weight"), 1);
        assert_eq!(plan.stage_of("lm_head.weight"), 1);
        let boxes = plan.main_boxes("lm_head.weight", &[32, 16]).unwrap();
        let ranks: Vec<usize> = boxes.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, [2, 3]);
    }

    #[test]
    fn mtp_layers_beyond_num_layers_are_placed_without_pipeline() {
        // MTP module 0 of a 2-layer model is layer 2: every rank of a pp = 1 plan holds it.
        let layout = ParallelLayout::parse(4, "tp=2,ep=2").unwrap();
        let plan = ShardingPlan::new(&layout, Some(2), tiny_rule, tiny_stage).unwrap();
        for (fqn, shape) in [
            ("model.layers.2.eh_proj.weight", vec![16, 32]),
            ("model.layers.2.self_attn.q_b_proj.weight", vec![16, 8]),
            ("model.layers.2.mlp.experts.down_proj", vec![4, 16, 8]),
        ] {
            assert_eq!(plan.stage_of(fqn), 0);
            for rank in 0..4 {
                assert!(plan.rank_shard(fqn, &shape, rank).unwrap().is_some());
            }
            let boxes: Vec<TensorBox> = plan
                .main_boxes(fqn, &shape)
                .unwrap()
                .into_iter()
                .map(|(_, b)| b)
                .collect();
            check_tiling(&boxes, &shape).unwrap();
        }
    }

    #[test]
    fn main_replicas_cover_every_element_once_for_random_layouts() {
        let mut rng = SplitMix::new(7);
        let tensors = tiny_moe_tensors();
        for _ in 0..60 {
            let layout = random_layout(&mut rng, 8);
            let plan = ShardingPlan::new(&layout, Some(3), tiny_rule, tiny_stage).unwrap();
            for t in &tensors {
                let boxes: Vec<TensorBox> = plan
                    .main_boxes(&t.fqn, &t.global_shape)
                    .unwrap()
                    .into_iter()
                    .map(|(_, b)| b)
                    .collect();
                check_tiling(&boxes, &t.global_shape)
                    .unwrap_or_else(|e| panic!("{layout}: {}: {e}", t.fqn));
                // Every rank of the owning stage holds a box.
                let holders = (0..layout.world)
                    .filter(|&r| {
                        plan.rank_shard(&t.fqn, &t.global_shape, r)
                            .unwrap()
                            .is_some()
                    })
                    .count();
                assert_eq!(holders, layout.world / layout.pp);
            }
        }
    }
}
