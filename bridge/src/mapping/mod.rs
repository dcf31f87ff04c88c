//! The HF ↔ canonical name-mapping registry (checkpoints.md §4).
//!
//! - [`Pattern`]: `*` = `\d+`, `**` = `.*`, `{e}` = the expert index; anchored.
//! - [`Rule`]: `Direct` (optional export dtype), `StackExperts` (per-expert HF tensors ↔ one
//!   stacked canonical tensor), `FusedExperts` (HF stacked ↔ canonical, reshape only), `Ignore`.
//! - [`Registry`]: ordered rules, first match wins, resolution both ways
//!   ([`Registry::hf_to_canon`], [`Registry::canon_to_hf`]), per-checkpoint expert layout
//!   detection that rejects a mix ([`Registry::detect_layout`]).
//! - [`LoadReport`]: missing / unexpected / mismatched / duplicate tensors; strict or not.
//! - Conversion: [`read_canonical`] stacks per-expert HF tensors (through the FP8 hook),
//!   [`read_canonical_experts`] reads one EP rank's experts, [`canonical_to_hf`] splits for export.
//! - Tables for [`qwen3`], [`qwen3_moe`] and [`deepseek_v3`] ([`for_model_type`]).
//! - The HF tensors (names, shapes, FP8 scale companions) a config implies
//!   ([`expected_hf_tensors`]), the shape source of checkpoint validation.
//!
//! The FP8 load hook (dequantising each HF tensor read by a rule) is
//! [`HfCheckpoint::read_dequantized`](crate::hf::HfCheckpoint::read_dequantized).

mod convert;
mod expected;
mod models;
mod pattern;
mod registry;
mod report;
mod rule;

pub use convert::{canonical_tensors, canonical_to_hf, read_canonical, read_canonical_experts};
pub use expected::{
    ExpectedHf, ExpectedTable, HfRole, MAX_ELEMENTS, MAX_TENSORS, deepseek_v3_expected,
    expected_hf_tensors, qwen3_expected, qwen3_moe_expected,
};
pub use models::{KNOWN_MODEL_TYPES, deepseek_v3, for_config, for_model_type, qwen3, qwen3_moe};
pub use pattern::{CaptureKind, Captures, Pattern};
pub use registry::{ExpertLayout, Registry};
pub use report::{ExpectedTensor, LoadReport, Mismatch};
pub use rule::{HfPiece, HfTarget, ResolvedCanon, ResolvedHf, Rule, RuleKind};
