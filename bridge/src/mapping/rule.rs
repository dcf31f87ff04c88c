//! Rules of the mapping registry and what resolving a name through them yields.

use super::pattern::Pattern;
use crate::safetensors::Dtype;

/// How HF tensors relate to canonical ones (docs/checkpoints.md §Name mapping).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleKind {
    /// One HF tensor is one canonical tensor; `export_dtype` forces a dtype on export (e.g.
    /// `e_score_correction_bias` as F32).
    Direct {
        /// HF name pattern.
        hf: Pattern,
        /// Canonical name pattern (same captures).
        canon: Pattern,
        /// Dtype written on HF export, if forced.
        export_dtype: Option<Dtype>,
    },
    /// Per-expert HF tensors stacked into one canonical tensor per layer. With one HF part
    /// (`down_proj`) HF expert `e` is `canon[e]` (`[E, H, Im]`); with several parts
    /// (`gate_proj`, `up_proj`) part `p` of expert `e` is `canon[e, p]` (`[E, 2, Im, H]`).
    StackExperts {
        /// Canonical name pattern.
        canon: Pattern,
        /// HF patterns, one per part, each with an `{e}` expert wildcard.
        hf_parts: Vec<Pattern>,
    },
    /// HF tensors already stacked over experts (the in-memory HF 5.23 layout). With
    /// `split_parts = Some(P)` HF `[E, P·Im, H]` is canonical `[E, P, Im, H]` (a reshape);
    /// `None` means identical shapes.
    FusedExperts {
        /// HF name pattern.
        hf: Pattern,
        /// Canonical name pattern.
        canon: Pattern,
        /// Number of parts HF dim 1 is split into.
        split_parts: Option<usize>,
    },
    /// HF tensors consumed by no canonical tensor (scales used by the FP8 hook, RoPE buffers,
    /// MTP copies of shared tensors).
    Ignore {
        /// HF name pattern.
        hf: Pattern,
        /// Why it is ignored.
        reason: &'static str,
    },
}

/// One registry entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// What the rule does.
    pub kind: RuleKind,
}

impl Rule {
    /// `Direct(hf ↔ canon)`.
    pub fn direct(hf: &str, canon: &str) -> Self {
        Self {
            kind: RuleKind::Direct {
                hf: Pattern::new(hf),
                canon: Pattern::new(canon),
                export_dtype: None,
            },
        }
    }

    /// `Direct(name ↔ name)`: the HF name is the canonical name.
    pub fn same(name: &str) -> Self {
        Self::direct(name, name)
    }

    /// `Direct(name ↔ name)` exported as `dtype`.
    pub fn same_as_dtype(name: &str, dtype: Dtype) -> Self {
        Self {
            kind: RuleKind::Direct {
                hf: Pattern::new(name),
                canon: Pattern::new(name),
                export_dtype: Some(dtype),
            },
        }
    }

    /// `StackExperts(canon ↔ hf_parts)`.
    pub fn stack_experts(canon: &str, hf_parts: &[&str]) -> Self {
        Self {
            kind: RuleKind::StackExperts {
                canon: Pattern::new(canon),
                hf_parts: hf_parts.iter().map(|p| Pattern::new(p)).collect(),
            },
        }
    }

    /// `FusedExperts(hf ↔ canon)`.
    pub fn fused_experts(hf: &str, canon: &str, split_parts: Option<usize>) -> Self {
        Self {
            kind: RuleKind::FusedExperts {
                hf: Pattern::new(hf),
                canon: Pattern::new(canon),
                split_parts,
            },
        }
    }

    /// `Ignore(hf)`.
    pub fn ignore(hf: &str, reason: &'static str) -> Self {
        Self {
            kind: RuleKind::Ignore {
                hf: Pattern::new(hf),
                reason,
            },
        }
    }

    /// The rule's HF patterns.
    pub fn hf_patterns(&self) -> Vec<&Pattern> {
        match &self.kind {
            RuleKind::Direct { hf, .. }
            | RuleKind::FusedExperts { hf, .. }
            | RuleKind::Ignore { hf, .. } => vec![hf],
            RuleKind::StackExperts { hf_parts, .. } => hf_parts.iter().collect(),
        }
    }

    /// The rule's canonical pattern (`None` for `Ignore`).
    pub fn canon_pattern(&self) -> Option<&Pattern> {
        match &self.kind {
            RuleKind::Direct { canon, .. }
            | RuleKind::StackExperts { canon, .. }
            | RuleKind::FusedExperts { canon, .. } => Some(canon),
            RuleKind::Ignore { .. } => None,
        }
    }

    /// Checks the rule's patterns agree: same capture kinds on both sides; `{e}` exactly in the
    /// HF parts of `StackExperts` and nowhere else. Returns a description of the problem.
    pub fn check(&self) -> Result<(), String> {
        let Some(canon) = self.canon_pattern() else {
            return Ok(());
        };
        if canon.has_expert() {
            return Err(format!(
                "canonical pattern `{canon}` has an expert wildcard"
            ));
        }
        let stacked = matches!(self.kind, RuleKind::StackExperts { .. });
        for hf in self.hf_patterns() {
            if hf.capture_kinds() != canon.capture_kinds() {
                return Err(format!("`{hf}` and `{canon}` capture different wildcards"));
            }
            if hf.has_expert() != stacked {
                return Err(format!("`{hf}`: expert wildcard {{e}} misplaced"));
            }
        }
        Ok(())
    }
}

/// Where an HF tensor goes: the result of resolving an HF name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfTarget {
    /// The whole canonical tensor `canon`.
    Direct {
        /// Canonical name.
        canon: String,
        /// Dtype forced on export, if any.
        export_dtype: Option<Dtype>,
    },
    /// One expert's slice `canon[expert]` or `canon[expert, part]`.
    ExpertSlice {
        /// Canonical (stacked) name.
        canon: String,
        /// Expert index.
        expert: usize,
        /// Part index (`Some` for multi-part stacks such as gate/up).
        part: Option<usize>,
    },
    /// The whole stacked canonical tensor, HF dim 1 split into `split_parts` when `Some`.
    Fused {
        /// Canonical name.
        canon: String,
        /// Number of parts HF dim 1 is split into.
        split_parts: Option<usize>,
    },
    /// Consumed by no canonical tensor.
    Ignored {
        /// Why.
        reason: &'static str,
    },
}

impl HfTarget {
    /// The canonical name, if the tensor maps to one.
    pub fn canon(&self) -> Option<&str> {
        match self {
            HfTarget::Direct { canon, .. }
            | HfTarget::ExpertSlice { canon, .. }
            | HfTarget::Fused { canon, .. } => Some(canon),
            HfTarget::Ignored { .. } => None,
        }
    }
}

/// An HF name resolved through a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedHf {
    /// Index of the rule that matched (first match wins).
    pub rule: usize,
    /// Where the tensor goes.
    pub target: HfTarget,
}

/// One HF tensor feeding a canonical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfPiece {
    /// HF name.
    pub hf: String,
    /// Expert index, for per-expert pieces.
    pub expert: Option<usize>,
    /// Part index, for multi-part stacks.
    pub part: Option<usize>,
}

/// A canonical name resolved to the HF tensors that make it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedCanon {
    /// Index of the rule used.
    pub rule: usize,
    /// The HF tensors, experts outer and parts inner.
    pub pieces: Vec<HfPiece>,
    /// Dtype forced on export, if any.
    pub export_dtype: Option<Dtype>,
    /// For fused HF tensors: HF dim 1 is canonical dims 1–2 split into this many parts.
    pub split_parts: Option<usize>,
}
