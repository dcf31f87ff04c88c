//! The ordered rule list and name resolution in both directions
//! (docs/checkpoints.md §Name mapping).

use std::path::Path;

use super::rule::{HfPiece, HfTarget, ResolvedCanon, ResolvedHf, Rule, RuleKind};
use crate::BridgeError;

/// How a checkpoint stores routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One HF tensor per expert and projection (what `save_pretrained` writes).
    PerExpert,
    /// HF tensors stacked over experts (HF 5.23 in-memory layout).
    Stacked,
}

/// An ordered list of mapping rules for one model family; first match wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registry {
    name: String,
    rules: Vec<Rule>,
}

impl Registry {
    /// A registry named `name` (used in errors); fails if a rule's patterns disagree.
    pub fn new(name: impl Into<String>, rules: Vec<Rule>) -> Result<Self, BridgeError> {
        let name = name.into();
        for (i, rule) in rules.iter().enumerate() {
            rule.check().map_err(|reason| BridgeError::InvalidRule {
                registry: name.clone(),
                rule: i,
                reason,
            })?;
        }
        Ok(Self { name, rules })
    }

    /// The registry's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rules, in match order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Resolves an HF name through the first rule that matches it (`None`: unexpected key).
    pub fn hf_to_canon(&self, hf: &str) -> Option<ResolvedHf> {
        self.rules.iter().enumerate().find_map(|(rule, r)| {
            let target = match &r.kind {
                RuleKind::Direct {
                    hf: pattern,
                    canon,
                    export_dtype,
                } => HfTarget::Direct {
                    canon: canon.fill(&pattern.matches(hf)?)?,
                    export_dtype: *export_dtype,
                },
                RuleKind::StackExperts { canon, hf_parts } => {
                    let (part, captures) = hf_parts
                        .iter()
                        .enumerate()
                        .find_map(|(p, pattern)| Some((p, pattern.matches(hf)?)))?;
                    HfTarget::ExpertSlice {
                        canon: canon.fill(&captures)?,
                        expert: captures.expert?,
                        part: (hf_parts.len() > 1).then_some(part),
                    }
                }
                RuleKind::FusedExperts {
                    hf: pattern,
                    canon,
                    split_parts,
                } => HfTarget::Fused {
                    canon: canon.fill(&pattern.matches(hf)?)?,
                    split_parts: *split_parts,
                },
                RuleKind::Ignore {
                    hf: pattern,
                    reason,
                } => {
                    pattern.matches(hf)?;
                    HfTarget::Ignored { reason }
                }
            };
            Some(ResolvedHf { rule, target })
        })
    }

    /// Resolves a canonical name to the HF tensors that make it up, for a checkpoint with
    /// `num_experts` routed experts stored in `layout` (exporters use
    /// [`ExpertLayout::PerExpert`]). `None` when no rule produces `canon`.
    pub fn canon_to_hf(
        &self,
        canon: &str,
        num_experts: usize,
        layout: ExpertLayout,
    ) -> Option<ResolvedCanon> {
        self.rules.iter().enumerate().find_map(|(rule, r)| {
            let resolved = |pieces, export_dtype, split_parts| ResolvedCanon {
                rule,
                pieces,
                export_dtype,
                split_parts,
            };
            match &r.kind {
                RuleKind::Direct {
                    hf,
                    canon: pattern,
                    export_dtype,
                } => {
                    let name = hf.fill(&pattern.matches(canon)?)?;
                    let piece = HfPiece {
                        hf: name,
                        expert: None,
                        part: None,
                    };
                    Some(resolved(vec![piece], *export_dtype, None))
                }
                RuleKind::StackExperts {
                    canon: pattern,
                    hf_parts,
                } if layout == ExpertLayout::PerExpert => {
                    let mut captures = pattern.matches(canon)?;
                    let multi = hf_parts.len() > 1;
                    let mut pieces = Vec::with_capacity(num_experts * hf_parts.len());
                    for expert in 0..num_experts {
                        captures.expert = Some(expert);
                        for (part, hf) in hf_parts.iter().enumerate() {
                            pieces.push(HfPiece {
                                hf: hf.fill(&captures)?,
                                expert: Some(expert),
                                part: multi.then_some(part),
                            });
                        }
                    }
                    Some(resolved(pieces, None, None))
                }
                RuleKind::FusedExperts {
                    hf,
                    canon: pattern,
                    split_parts,
                } if layout == ExpertLayout::Stacked => {
                    let name = hf.fill(&pattern.matches(canon)?)?;
                    let piece = HfPiece {
                        hf: name,
                        expert: None,
                        part: None,
                    };
                    Some(resolved(vec![piece], None, *split_parts))
                }
                _ => None,
            }
        })
    }

    /// The expert layout of a checkpoint with HF tensor `names`: `None` when it has no routed
    /// experts, an error naming one tensor of each kind when it mixes both layouts. `path`
    /// names the checkpoint in errors.
    pub fn detect_layout<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        path: &Path,
    ) -> Result<Option<ExpertLayout>, BridgeError> {
        let mut per_expert = None;
        let mut stacked = None;
        for name in names {
            match self.hf_to_canon(name).map(|r| r.target) {
                Some(HfTarget::ExpertSlice { .. }) => per_expert = per_expert.or(Some(name)),
                Some(HfTarget::Fused { .. }) => stacked = stacked.or(Some(name)),
                _ => {}
            }
        }
        match (per_expert, stacked) {
            (Some(per_expert), Some(stacked)) => Err(BridgeError::MixedExpertLayout {
                path: path.to_path_buf(),
                per_expert: per_expert.to_owned(),
                stacked: stacked.to_owned(),
            }),
            (Some(_), None) => Ok(Some(ExpertLayout::PerExpert)),
            (None, Some(_)) => Ok(Some(ExpertLayout::Stacked)),
            (None, None) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::Dtype;

    fn registry() -> Registry {
        Registry::new(
            "test",
            vec![
                Rule::ignore("**_scale_inv", "fp8 scale"),
                Rule::same_as_dtype(
                    "model.layers.*.mlp.gate.e_score_correction_bias",
                    Dtype::F32,
                ),
                Rule::stack_experts(
                    "model.layers.*.mlp.experts.gate_up_proj",
                    &[
                        "model.layers.*.mlp.experts.{e}.gate_proj.weight",
                        "model.layers.*.mlp.experts.{e}.up_proj.weight",
                    ],
                ),
                Rule::stack_experts(
                    "model.layers.*.mlp.experts.down_proj",
                    &["model.layers.*.mlp.experts.{e}.down_proj.weight"],
                ),
                Rule::fused_experts(
                    "model.layers.*.mlp.experts.gate_up_proj",
                    "model.layers.*.mlp.experts.gate_up_proj",
                    Some(2),
                ),
                Rule::direct("old.*.w", "new.*.weight"),
            ],
        )
        .unwrap()
    }

    #[test]
    fn first_match_wins_and_resolves_both_ways() {
        let r = registry();
        let got = r
            .hf_to_canon("model.layers.2.mlp.experts.5.up_proj.weight")
            .unwrap();
        assert_eq!(got.rule, 2);
        assert_eq!(
            got.target,
            HfTarget::ExpertSlice {
                canon: "model.layers.2.mlp.experts.gate_up_proj".into(),
                expert: 5,
                part: Some(1)
            }
        );
        let down = r
            .hf_to_canon("model.layers.2.mlp.experts.5.down_proj.weight")
            .unwrap();
        assert!(matches!(
            down.target,
            HfTarget::ExpertSlice {
                part: None,
                expert: 5,
                ..
            }
        ));
        // The ignore rule comes first, even for a name another rule would take.
        let scale = r.hf_to_canon("old.1.w_scale_inv").unwrap();
        assert!(matches!(scale.target, HfTarget::Ignored { .. }));
        assert_eq!(r.hf_to_canon("old.x.w"), None);
        let back = r
            .canon_to_hf(
                "model.layers.2.mlp.experts.gate_up_proj",
                2,
                ExpertLayout::PerExpert,
            )
            .unwrap();
        let names: Vec<&str> = back.pieces.iter().map(|p| p.hf.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.2.mlp.experts.0.gate_proj.weight",
                "model.layers.2.mlp.experts.0.up_proj.weight",
                "model.layers.2.mlp.experts.1.gate_proj.weight",
                "model.layers.2.mlp.experts.1.up_proj.weight",
            ]
        );
        let fused = r
            .canon_to_hf(
                "model.layers.2.mlp.experts.gate_up_proj",
                2,
                ExpertLayout::Stacked,
            )
            .unwrap();
        assert_eq!(fused.rule, 4);
        assert_eq!(fused.split_parts, Some(2));
        let bias = r
            .canon_to_hf(
                "model.layers.0.mlp.gate.e_score_correction_bias",
                0,
                ExpertLayout::PerExpert,
            )
            .unwrap();
        assert_eq!(bias.export_dtype, Some(Dtype::F32));
        assert_eq!(
            r.canon_to_hf("new.4.weight", 0, ExpertLayout::PerExpert)
                .unwrap()
                .pieces[0]
                .hf,
            "old.4.w"
        );
        assert!(
            r.canon_to_hf("nothing", 0, ExpertLayout::PerExpert)
                .is_none()
        );
    }

    #[test]
    fn layout_detection_rejects_a_mix() {
        let r = registry();
        let p = Path::new("ckpt");
        let per = ["model.layers.0.mlp.experts.0.up_proj.weight", "x"];
        assert_eq!(
            r.detect_layout(per, p).unwrap(),
            Some(ExpertLayout::PerExpert)
        );
        let stacked = ["model.layers.0.mlp.experts.gate_up_proj"];
        assert_eq!(
            r.detect_layout(stacked, p).unwrap(),
            Some(ExpertLayout::Stacked)
        );
        assert_eq!(r.detect_layout(["x"], p).unwrap(), None);
        let mix = [
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.3.down_proj.weight",
        ];
        let err = r.detect_layout(mix, p).unwrap_err();
        assert!(matches!(err, BridgeError::MixedExpertLayout { .. }));
        assert!(err.to_string().contains("experts.3.down_proj"));
    }

    #[test]
    fn inconsistent_rules_are_rejected() {
        for bad in [
            Rule::direct("a.*.b", "a.b"),
            Rule::direct("a.**", "a.*"),
            Rule::direct("a.{e}", "a.*"),
            Rule::stack_experts("x.*", &["x.*.y"]),
            Rule::fused_experts("x.{e}", "x.*", None),
        ] {
            let err = Registry::new("bad", vec![bad]).unwrap_err();
            assert!(matches!(err, BridgeError::InvalidRule { .. }), "{err}");
        }
    }
}
