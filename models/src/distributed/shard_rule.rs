//! Which dimension of each canonical tensor the sharded models split (checkpoints.md §3),
//! by canonical name: the rule the distributed checkpoint (moe-bridge's `dist::sharding`,
//! which re-exports it) and the weight sync ([`crate::weight_sync`]) read when they have a
//! tensor name but no model.
//!
//! The rules are the models' parallel plans ([`crate::param_plan`]) read backwards: a name
//! takes the split of the plan entry whose HF template it matches (a `{…}` placeholder matches
//! one numeric segment). The plans of the three families agree wherever their names meet (a
//! test checks it). A name no plan knows is replicated.
//!
//! Canonical names are HF names, except routed experts, stacked per MoE layer
//! (`…mlp.experts.gate_up_proj [E, 2, Im, H]` ≡ HF's fused `[E, 2·Im, H]`,
//! `…mlp.experts.down_proj [E, H, Im]`); orientation is PyTorch `[out, in]`.

use std::sync::OnceLock;

use crate::param_plan::{deepseek_v3_plan, qwen3_moe_plan, qwen3_plan};

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
}

/// One HF template of a plan as segments (`None`: a placeholder) and its split.
type Rule = (Vec<Option<String>>, ShardRule);

fn rules() -> &'static [Rule] {
    static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
    RULES.get_or_init(|| {
        [qwen3_plan(), qwen3_moe_plan(), deepseek_v3_plan()]
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

    /// Every name any plan produces gets the same rule from every plan that produces it.
    #[test]
    fn the_plans_agree_on_every_name() {
        let plans: Vec<ParallelPlan> = vec![qwen3_plan(), qwen3_moe_plan(), deepseek_v3_plan()];
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
}
