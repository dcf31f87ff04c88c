//! The HF ↔ canonical name-mapping registry (docs/checkpoints.md §Name mapping).
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
//! - The HF tensors (names, shapes, FP8 scale companions) a config implies
//!   ([`ExpectedTable`], built with the checked [`ExpectedBuilder`]), the shape source of
//!   checkpoint validation.
//!
//! The per-model tables (rules and expected tensors of Qwen3, Qwen3-MoE and DeepSeek-V3) are
//! moe-models'; the formats receive them through a [`ModelSchema`](crate::schema::ModelSchema).
//!
//! The FP8 load hook (dequantising each HF tensor read by a rule) is
//! [`HfCheckpoint::read_dequantized`](crate::hf::HfCheckpoint::read_dequantized).

mod convert;
mod expected;
mod pattern;
mod registry;
mod report;
mod rule;

pub use convert::{canonical_tensors, canonical_to_hf, read_canonical, read_canonical_experts};
pub use expected::{ExpectedBuilder, ExpectedHf, ExpectedTable, HfRole, MAX_ELEMENTS, MAX_TENSORS};
pub use pattern::{CaptureKind, Captures, Pattern};
pub use registry::{ExpertLayout, Registry};
pub use report::{ExpectedTensor, LoadReport, Mismatch};
pub use rule::{HfPiece, HfTarget, ResolvedCanon, ResolvedHf, Rule, RuleKind};
