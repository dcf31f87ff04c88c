//! Which dimension of each canonical tensor the sharded models split
//! (docs/checkpoints.md §Canonical names and sharding), by canonical name: the rule the distributed
//! checkpoint (handed to moe-bridge's `dist::ShardingPlan`, and through
//! [`ModelConfig`](crate::hf::ModelConfig)'s `ModelSchema::shard_rule` to its conversions) and the
//! weight sync ([`crate::weight_sync`]) read when they have a tensor name but no model.
//!
//! The rules are the models' parallel plans ([`crate::param_plan`]) read backwards: a name
//! takes the split of the plan entry whose HF template it matches (a `{…}` placeholder matches
//! one numeric segment). The plans of the families agree wherever their names meet (a
//! test checks it). A name no plan knows is replicated.
//!
//! Canonical names are HF names, except routed experts, stacked per MoE layer
//! (`…mlp.experts.gate_up_proj [E, 2, Im, H]` ≡ HF's fused `[E, 2·Im, H]`,
//! `…mlp.experts.down_proj [E, H, Im]`); orientation is PyTorch `[out, in]`.

use std::sync::OnceLock;

use super::plans;

/// How a canonical tensor is split over the ranks of one pipeline stage: moe-bridge's plain
/// data type, which the distributed checkpoint's resharding takes as its input.
pub use moe_bridge::dist::ShardRule;

/// One HF template of a plan as segments (`None`: a placeholder) and its split.
type Rule = (Vec<Option<String>>, ShardRule);

fn rules() -> &'static [Rule] {
    static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
    RULES.get_or_init(|| {
        plans()
            .iter()
            .flat_map(|plan| plan.entries().iter())
            .map(|e| {
                let segments =
                    e.hf.split('.')
                        .map(|s| (!s.starts_with('{')).then(|| s.to_owned()))
                        .collect();
                (segments, e.split)
            })
            .collect()
    })
}

/// The split of the canonical tensor `name` (see the module docs).
pub fn shard_rule(name: &str) -> ShardRule {
    let segments: Vec<&str> = name.split('.').collect();
    rules()
        .iter()
        .find(|(template, _)| {
            template.len() == segments.len()
                && template.iter().zip(&segments).all(|(t, s)| match t {
                    Some(lit) => lit == s,
                    None => !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()),
                })
        })
        .map_or(ShardRule::Replicated, |(_, rule)| *rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::param_plan::ParallelPlan;
    use crate::param_plan::hf_names::stage_place;

    /// Every name any plan produces gets the same rule from every plan that produces it.
    #[test]
    fn the_plans_agree_on_every_name() {
        let plans: Vec<ParallelPlan> = plans();
        for plan in &plans {
            for e in plan.entries() {
                let name = e.hf.replace("{0+L}", "7").replace("{0}", "3");
                assert_eq!(shard_rule(&name), e.split, "{}: {name}", plan.family());
            }
        }
    }

    #[test]
    fn canonical_names_get_the_checkpoint_splits() {
        let cases = [
            ("model.embed_tokens.weight", ShardRule::Tp { dim: 0 }),
            ("lm_head.weight", ShardRule::Tp { dim: 0 }),
            (
                "model.layers.12.self_attn.q_proj.weight",
                ShardRule::Tp { dim: 0 },
            ),
            (
                "model.layers.0.self_attn.q_b_proj.weight",
                ShardRule::Tp { dim: 0 },
            ),
            (
                "model.layers.0.self_attn.kv_b_proj.weight",
                ShardRule::Tp { dim: 0 },
            ),
            (
                "model.layers.0.self_attn.o_proj.weight",
                ShardRule::Tp { dim: 1 },
            ),
            (
                "model.layers.0.mlp.down_proj.weight",
                ShardRule::Tp { dim: 1 },
            ),
            (
                "model.layers.0.mlp.gate_proj.weight",
                ShardRule::Tp { dim: 0 },
            ),
            (
                "model.layers.3.mlp.experts.gate_up_proj",
                ShardRule::Expert { etp_dim: 2 },
            ),
            (
                "model.layers.3.mlp.experts.down_proj",
                ShardRule::Expert { etp_dim: 2 },
            ),
            // Replicated: norms, router and its bias, MLA down-projections, shared experts,
            // MTP projections, and names no plan knows.
            ("model.layers.3.mlp.gate.weight", ShardRule::Replicated),
            (
                "model.layers.3.mlp.gate.e_score_correction_bias",
                ShardRule::Replicated,
            ),
            (
                "model.layers.3.self_attn.q_a_proj.weight",
                ShardRule::Replicated,
            ),
            (
                "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                ShardRule::Replicated,
            ),
            (
                "model.layers.3.mlp.shared_experts.gate_proj.weight",
                ShardRule::Replicated,
            ),
            ("model.layers.61.eh_proj.weight", ShardRule::Replicated),
            ("model.norm.weight", ShardRule::Replicated),
            (
                "model.layers.x.self_attn.q_proj.weight",
                ShardRule::Replicated,
            ),
            ("something.else", ShardRule::Replicated),
        ];
        for (name, rule) in cases {
            assert_eq!(shard_rule(name), rule, "{name}");
        }
    }

    /// The checkpoint table (moe-bridge's `dist::sharding` docs) through a `ShardingPlan` built
    /// with this rule: optimizer states take their parameter's split.
    #[test]
    fn sharding_plans_follow_the_table() {
        let layout = moe_backend::parallel::ParallelLayout::parse(1, "").unwrap();
        let plan =
            moe_bridge::dist::ShardingPlan::new(&layout, None, shard_rule, stage_place).unwrap();
        use ShardRule::*;
        for (name, rule) in [
            ("model.embed_tokens.weight", Tp { dim: 0 }),
            ("lm_head.weight", Tp { dim: 0 }),
            ("model.layers.0.self_attn.q_proj.weight", Tp { dim: 0 }),
            ("model.layers.0.self_attn.kv_b_proj.weight", Tp { dim: 0 }),
            ("model.layers.0.self_attn.q_a_proj.weight", Replicated),
            (
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                Replicated,
            ),
            ("model.layers.0.self_attn.o_proj.weight", Tp { dim: 1 }),
            ("model.layers.0.self_attn.q_a_layernorm.weight", Replicated),
            ("model.layers.0.self_attn.kv_a_layernorm.weight", Replicated),
            ("model.layers.0.self_attn.q_b_proj.weight", Tp { dim: 0 }),
            ("model.layers.0.self_attn.o_proj.bias", Replicated),
            (
                "model.layers.0.mlp.shared_experts.gate_proj.weight",
                Replicated,
            ),
            (
                "model.layers.0.mlp.shared_experts.up_proj.weight",
                Replicated,
            ),
            (
                "model.layers.0.mlp.shared_experts.down_proj.weight",
                Replicated,
            ),
            // MTP module 0 of a 3-layer model is layer 3.
            ("model.layers.3.enorm.weight", Replicated),
            ("model.layers.3.hnorm.weight", Replicated),
            ("model.layers.3.eh_proj.weight", Replicated),
            ("model.layers.3.shared_head.norm.weight", Replicated),
            ("model.layers.3.self_attn.kv_b_proj.weight", Tp { dim: 0 }),
            ("model.layers.3.self_attn.o_proj.weight", Tp { dim: 1 }),
            (
                "model.layers.3.mlp.experts.gate_up_proj",
                Expert { etp_dim: 2 },
            ),
            ("model.layers.0.mlp.down_proj.weight", Tp { dim: 1 }),
            (
                "model.layers.1.mlp.experts.gate_up_proj",
                Expert { etp_dim: 2 },
            ),
            (
                "optim.exp_avg.model.layers.1.mlp.experts.down_proj",
                Expert { etp_dim: 2 },
            ),
            (
                "optim.master.model.layers.0.mlp.up_proj.weight",
                Tp { dim: 0 },
            ),
            ("model.layers.1.mlp.gate.weight", Replicated),
            (
                "model.layers.1.mlp.gate.e_score_correction_bias",
                Replicated,
            ),
            ("model.layers.1.input_layernorm.weight", Replicated),
        ] {
            assert_eq!(plan.rule_of(name), rule, "{name}");
        }
    }
}
