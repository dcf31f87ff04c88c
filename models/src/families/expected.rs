//! The HF tensors a family's config implies, derived from its plan
//! ([`Family::expected_tensors`]'s default; docs/models.md §HF tensor names): the family's own
//! model of the config, built lazily as [`param_count`](super::param_count) builds it (shapes
//! only, nothing allocated), walked parameter by parameter through its plan rows
//! ([`ParallelPlan::resolve`](crate::param_plan::ParallelPlan::resolve): canonical HF name,
//! storage, split), each emitted as the release stores it. Adding a parameter to a model and
//! its plan adds it to the table; no family writes a table.
//!
//! The rules, those of HF export ([`crate::export`]), which writes what this table expects:
//! - a tensor with a release layout of the plan
//!   ([`ReleaseLayout`](crate::param_plan::ReleaseLayout)) is expected in its stored shape
//!   whatever the expert layout (gpt-oss's fused experts), and as an MXFP4 pair where the
//!   family's release may store it so ([`Family::release_mxfp4`]);
//! - routed experts (plan split over EP) are stacked canonical tensors in
//!   [`ExpertLayout::Stacked`] and one tensor per expert and projection in
//!   [`ExpertLayout::PerExpert`], named by
//!   [`ParallelPlan::per_expert_names`](crate::param_plan::ParallelPlan::per_expert_names) as
//!   export names them;
//! - every other tensor is its canonical tensor (Burn's `[in, out]` linears transposed back);
//! - every matrix has its optional FP8 `*_scale_inv` companion of block `block`
//!   (moe-bridge's [`ExpectedBuilder`]);
//! - a tied LM head (`tie_word_embeddings`: the model has none) is optional, of the
//!   embedding's shape; the copies an export writes twice ([`Family::export_copies`], the
//!   MTP layers' embedding and head) are optional, of their source's shape.
//!
//! Bad input first: an absurd config would make the model itself hang or allocate, so its
//! sizes ([`FamilyConfig::sizes`]) are bounded before it is built ([`check_sizes`]), and every
//! product after that is checked by the [`ExpectedBuilder`] against
//! [`MAX_TENSORS`] / [`MAX_ELEMENTS`](moe_bridge::mapping::MAX_ELEMENTS), each refusal a [`BridgeError::InvalidConfig`] naming the
//! field.

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::dist::ShardRule;
use moe_bridge::mapping::{ExpectedBuilder, ExpectedTable, ExpertLayout, MAX_TENSORS};

use super::{Family, FamilyConfig};
use crate::ModelError;
use crate::config::ConfigSizes;
use crate::distributed::ShardModel;
use crate::param_plan::{Planned, Storage, hf_names};

pub use crate::config::MAX_DIM;

/// Tensors a decoder layer may hold besides three per routed expert (the bound of
/// [`check_sizes`]; DeepSeek-V3's MTP layer has 28).
const PER_LAYER: u128 = 32;

/// Refuses a config whose sizes are not plausible before any model of it is built: a size
/// above [`MAX_DIM`], or layers × (32 + 3 × experts) tensors (× 2 with the FP8 scales) above
/// [`MAX_TENSORS`]. Errors are [`BridgeError::InvalidConfig`] naming the field(s); `path`
/// names the config.
pub fn check_sizes(sizes: &ConfigSizes, path: &Path) -> Result<(), BridgeError> {
    let invalid = |field: &str, reason: String| BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field: field.to_owned(),
        reason,
    };
    let (layers_field, layers) = sizes.layers;
    let experts = sizes.experts.map_or(0, |(_, e)| e);
    let all = [(layers_field, layers)].into_iter().chain(sizes.experts);
    for (field, value) in all.chain(sizes.dims.iter().copied()) {
        if value > MAX_DIM {
            return Err(invalid(
                field,
                format!("{value} is above {MAX_DIM}; the config is not plausible"),
            ));
        }
    }
    let per_layer = PER_LAYER + 3 * experts as u128;
    // ×2 for the scale companions.
    let count = (layers as u128) * per_layer * 2 + 8;
    if count > MAX_TENSORS {
        let field = match sizes.experts {
            Some((e, _)) => format!("{layers_field}/{e}"),
            None => layers_field.to_owned(),
        };
        return Err(invalid(
            &field,
            format!(
                "implies about {count} tensors (more than {MAX_TENSORS}); the config is not \
                 plausible"
            ),
        ));
    }
    Ok(())
}

/// A [`ModelError`] of building the model of the config at `path`, as the
/// [`BridgeError::InvalidConfig`] naming its field.
fn config_error(err: ModelError, path: &Path) -> BridgeError {
    let field = match &err {
        ModelError::MissingField { field, .. } => (*field).to_owned(),
        ModelError::WrongType { field, .. } | ModelError::InvalidValue { field, .. } => {
            field.clone()
        }
        ModelError::ConflictingFields { first, second, .. } => format!("{first}/{second}"),
        _ => "(config)".to_owned(),
    };
    BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field,
        reason: err.to_string(),
    }
}

/// The HF tensors family `F`'s `config` implies in expert layout `layout`, derived from its
/// plan (see the module docs); `path` names the config in errors, `block` is the FP8 block
/// size of the scale companions.
pub fn derive_expected<F: Family + ?Sized>(
    config: &F::Config,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    check_sizes(&config.sizes(), path)?;
    let device = burn::tensor::Device::flex();
    let template =
        <F::Model as ShardModel>::template(config, &device).map_err(|e| config_error(e, path))?;
    let tied = <F::Model as ShardModel>::stack_shape(config)
        .map_err(|e| config_error(e, path))?
        .pipeline
        .tied;
    let plan = <F::Model as Planned>::parallel_plan();
    let tensors = plan
        .walk(&template, config.num_layers())
        .map_err(|e| config_error(e.into(), path))?;
    let mut b = ExpectedBuilder::new(path, block);
    let mut shapes = std::collections::HashMap::new();
    let unfit = |name: &str, reason: String| BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field: "(sizes)".to_owned(),
        reason: format!("`{name}`: {reason}"),
    };
    for t in tensors {
        let (name, entry) = (t.hf_name, t.entry);
        let canonical = match (entry.storage, t.shape.as_slice()) {
            (Storage::Transposed, &[i, o]) => vec![o, i],
            (Storage::Transposed, s) => {
                return Err(unfit(&name, format!("a transposed tensor of shape {s:?}")));
            }
            _ => t.shape,
        };
        shapes.insert(name.clone(), canonical.clone());
        if let Some(release) = plan.release_layout(&name) {
            let stored = (release.stored_shape(&name, &canonical))
                .map_err(|e| unfit(&name, e.to_string()))?;
            match F::release_mxfp4(&name, &canonical) {
                Some(blocks) => b.weight_or_mxfp4(name, stored, blocks)?,
                None => b.weight(name, stored)?,
            }
            continue;
        }
        let expert = matches!(
            entry.split,
            ShardRule::Expert { .. } | ShardRule::ExpertReplicated
        );
        if !expert || layout == ExpertLayout::Stacked {
            b.weight(name, canonical)?;
            continue;
        }
        let &[experts, rows, cols] = canonical.as_slice() else {
            return Err(unfit(
                &name,
                format!("stacked experts of shape {canonical:?}"),
            ));
        };
        for e in 0..experts {
            let names = plan
                .per_expert_names(&name, entry.storage, e, rows)
                .ok_or_else(|| unfit(&name, format!("stacked experts of shape {canonical:?}")))?;
            for (hf, range) in names {
                b.weight(hf, vec![range.len(), cols])?;
            }
        }
    }
    let (embed, head) = (hf_names::embed_weight(), hf_names::lm_head_weight());
    let planned_head = plan.entries().iter().any(|e| e.hf == head);
    if tied
        && planned_head
        && !shapes.contains_key(&head)
        && let Some(shape) = shapes.get(&embed)
    {
        b.insert(head.clone(), shape.clone(), false)?;
        shapes.insert(head, shape.clone());
    }
    for (copy, source) in F::export_copies(config, &|n| shapes.contains_key(n)) {
        if let Some(shape) = shapes.get(&source) {
            b.insert(copy, shape.clone(), false)?;
        }
    }
    Ok(b.finish())
}
