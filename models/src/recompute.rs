//! What activation recompute a training step asks for (Megatron's `--recompute-granularity`
//! / `--recompute-modules`): [`Recompute`] and [`RecomputeModule`]. The parallel context
//! applies it; the planner ([`crate::plan::activations`]) counts its memory.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

/// A `--recompute` value that is not understood (what is wrong).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--recompute: {0}")]
pub struct RecomputeParseError(pub String);

/// A module Megatron can recompute selectively (`--recompute-modules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RecomputeModule {
    /// Core attention (flash: only the log-sum-exp is dropped).
    CoreAttn,
    /// SwiGLU activation of the routed experts.
    MoeAct,
    /// Input and pre-MLP layer norms (their outputs).
    Layernorm,
    /// MLA up-projections and RoPE (the attention query, key and value).
    MlaUpProj,
    /// Dense MLP layers.
    Mlp,
    /// The whole MoE layer (router, dispatch, experts, combine, shared experts).
    Moe,
    /// Shared experts.
    SharedExperts,
}

impl RecomputeModule {
    /// Every module, with its Megatron name.
    pub const ALL: [(RecomputeModule, &'static str); 7] = [
        (Self::CoreAttn, "core_attn"),
        (Self::MoeAct, "moe_act"),
        (Self::Layernorm, "layernorm"),
        (Self::MlaUpProj, "mla_up_proj"),
        (Self::Mlp, "mlp"),
        (Self::Moe, "moe"),
        (Self::SharedExperts, "shared_experts"),
    ];
}

impl FromStr for RecomputeModule {
    type Err = RecomputeParseError;

    fn from_str(s: &str) -> Result<Self, RecomputeParseError> {
        Self::ALL
            .iter()
            .find(|(_, name)| *name == s)
            .map(|(m, _)| *m)
            .ok_or_else(|| {
                RecomputeParseError(format!(
                    "unknown module `{s}` (expected one of {})",
                    Self::ALL.map(|(_, n)| n).join(", ")
                ))
            })
    }
}

impl fmt::Display for RecomputeModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = Self::ALL
            .iter()
            .find(|(m, _)| m == self)
            .map(|(_, n)| *n)
            .unwrap_or("?");
        f.write_str(name)
    }
}

/// Activation recomputation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Everything is kept.
    #[default]
    None,
    /// The listed modules are recomputed.
    Selective(BTreeSet<RecomputeModule>),
    /// Whole layers are recomputed from their inputs.
    Full,
}

impl FromStr for Recompute {
    type Err = RecomputeParseError;

    /// `none`, `full`, `selective` (Megatron's default module list: `core_attn`), or a
    /// comma-separated module list (`mla_up_proj,moe_act,layernorm`), optionally prefixed by
    /// `selective:`.
    fn from_str(s: &str) -> Result<Self, RecomputeParseError> {
        let s = s.trim();
        match s {
            "" | "none" => Ok(Self::None),
            "full" => Ok(Self::Full),
            "selective" => Ok(Self::Selective([RecomputeModule::CoreAttn].into())),
            list => {
                let list = list.strip_prefix("selective:").unwrap_or(list);
                let modules = list
                    .split(',')
                    .map(|m| m.trim().parse())
                    .collect::<Result<BTreeSet<_>, _>>()?;
                Ok(Self::Selective(modules))
            }
        }
    }
}

impl Recompute {
    /// Whether module `m` is recomputed selectively.
    pub fn has(&self, m: RecomputeModule) -> bool {
        matches!(self, Self::Selective(set) if set.contains(&m))
    }
}
