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

use std::collections::HashMap;
use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::dist::ShardRule;
use moe_bridge::mapping::{ExpectedBuilder, ExpectedTable, ExpertLayout, MAX_TENSORS};

use super::{Family, FamilyConfig};
use crate::ModelError;
use crate::config::ConfigSizes;
use crate::distributed::ShardModel;
use crate::param_plan::{ParallelPlan, Planned, Storage, hf_names};

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
    let mut b = ExpectedBuilder::new(path, block);
    let mut shapes = emit_module(
        &mut b,
        &template,
        &plan,
        config.num_layers(),
        layout,
        &F::release_mxfp4,
        path,
    )?;
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

/// Where a release may store a canonical tensor as an MXFP4 pair (as
/// [`Family::release_mxfp4`]: name, canonical shape → the shape its blocks decode to).
pub type ReleaseMxfp4 = dyn Fn(&str, &[usize]) -> Option<Vec<usize>>;

/// Adds to `b` the HF tensors a release stores for every parameter of `module` (a model built
/// lazily or not: only shapes are read) by its plan rows (see the module docs; `main_layers`
/// for the `{0+L}` templates, `mxfp4` as [`Family::release_mxfp4`]); returns every canonical
/// tensor's shape by name. What [`derive_expected`] builds a family's table with, before the
/// tied head and the export copies.
pub fn emit_module<M: burn::module::Module>(
    b: &mut ExpectedBuilder<'_>,
    module: &M,
    plan: &ParallelPlan,
    main_layers: usize,
    layout: ExpertLayout,
    mxfp4: &ReleaseMxfp4,
    path: &Path,
) -> Result<HashMap<String, Vec<usize>>, BridgeError> {
    let tensors = (plan.walk(module, main_layers)).map_err(|e| config_error(e.into(), path))?;
    let mut shapes = HashMap::new();
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
            match mxfp4(&name, &canonical) {
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
    Ok(shapes)
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::tensor::Device;
    use moe_bridge::mapping::HfRole;

    use super::*;
    use crate::layers::{RmsNorm, RmsNormConfig};
    use crate::param_plan::rows::{column, embedding, norm};

    /// A toy decoder layer: a norm and one projection.
    #[derive(Module, Debug)]
    struct Layer {
        norm: RmsNorm,
        up: Linear,
    }

    /// The same layer with one more parameter: a biased gate projection.
    #[derive(Module, Debug)]
    struct LayerWithGate {
        norm: RmsNorm,
        up: Linear,
        gate: Linear,
    }

    #[derive(Module, Debug)]
    struct Toy<L: Module> {
        embed_tokens: Embedding,
        layers: Vec<L>,
    }

    const H: usize = 16;
    const F: usize = 32;
    const V: usize = 40;

    fn rows() -> Vec<crate::param_plan::PlanEntry> {
        let mut rows = embedding("embed_tokens", "model.embed_tokens");
        rows.extend(norm("layers.*.norm", "model.layers.{0}.input_layernorm"));
        rows.extend(column(
            "layers.*.up",
            "model.layers.{0}.mlp.up_proj",
            false,
            true,
        ));
        rows
    }

    fn table<M: Module>(module: &M, plan: &ParallelPlan) -> ExpectedTable {
        let path = Path::new("config.json");
        let mut b = ExpectedBuilder::new(path, [16, 16]);
        let none = |_: &str, _: &[usize]| None;
        emit_module(
            &mut b,
            module,
            plan,
            2,
            ExpertLayout::PerExpert,
            &none,
            path,
        )
        .unwrap();
        b.finish()
    }

    /// Adding a parameter to a model and one row to its plan adds its tensors (weight, bias,
    /// the weight's FP8 scale companion) to the table, with no table code: the toy model's
    /// tables before and after differ by exactly those, shapes in HF's `[out, in]`.
    #[test]
    fn a_new_parameter_and_its_plan_row_show_up_in_the_table() {
        let device = Device::flex();
        let norm = || RmsNormConfig::new(H).init(&device);
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(&device);
        let embed = || EmbeddingConfig::new(V, H).init(&device);
        let before = Toy {
            embed_tokens: embed(),
            layers: (0..2)
                .map(|_| Layer {
                    norm: norm(),
                    up: linear(H, F, false),
                })
                .collect(),
        };
        let after = Toy {
            embed_tokens: embed(),
            layers: (0..2)
                .map(|_| LayerWithGate {
                    norm: norm(),
                    up: linear(H, F, false),
                    gate: linear(H, F, true),
                })
                .collect(),
        };
        let old = table(&before, &ParallelPlan::new("toy", rows()));
        // The new parameter unplanned is an error naming it, never a silent omission.
        let path = Path::new("config.json");
        let mut b = ExpectedBuilder::new(path, [16, 16]);
        let none = |_: &str, _: &[usize]| None;
        let plan = ParallelPlan::new("toy", rows());
        let err = emit_module(
            &mut b,
            &after,
            &plan,
            2,
            ExpertLayout::PerExpert,
            &none,
            path,
        )
        .unwrap_err();
        assert!(err.to_string().contains("layers.0.gate.weight"), "{err}");

        let mut with_gate = rows();
        with_gate.extend(column(
            "layers.*.gate",
            "model.layers.{0}.mlp.gate_proj",
            true,
            true,
        ));
        let new = table(&after, &ParallelPlan::new("toy", with_gate));
        assert_eq!(
            old.len(),
            2 + 2 * 3,
            "embed (+scale), per layer norm, up (+scale)"
        );
        assert_eq!(old["model.embed_tokens.weight"].shape, [V, H]);
        assert_eq!(old["model.layers.1.mlp.up_proj.weight"].shape, [F, H]);
        let added: Vec<_> = new.keys().filter(|k| !old.contains_key(*k)).collect();
        assert!(old.iter().all(|(k, v)| new.get(k) == Some(v)));
        assert_eq!(added.len(), 2 * 3, "{added:?}");
        for l in 0..2 {
            let p = format!("model.layers.{l}.mlp.gate_proj");
            let w = &new[&format!("{p}.weight")];
            assert_eq!((w.shape.as_slice(), w.required), (&[F, H][..], true));
            assert_eq!(new[&format!("{p}.bias")].shape, [F]);
            let s = &new[&format!("{p}.weight_scale_inv")];
            assert_eq!(
                (s.shape.as_slice(), s.role),
                (&[2, 1][..], HfRole::ScaleInv)
            );
        }
    }

    /// The size bound names the field and runs before anything is built.
    #[test]
    fn check_sizes_names_the_field() {
        let path = Path::new("config.json");
        let sizes = |layers, experts| ConfigSizes {
            layers: ("num_hidden_layers", layers),
            experts: Some(("num_experts", experts)),
            dims: vec![("hidden_size", 64), ("head_dim", MAX_DIM + 1)],
        };
        let err = check_sizes(&sizes(2, 8), path).unwrap_err().to_string();
        assert!(
            err.contains("head_dim") && err.contains("not plausible"),
            "{err}"
        );
        let ok = |s: ConfigSizes| ConfigSizes { dims: vec![], ..s };
        assert!(
            check_sizes(&ok(sizes(61, 256)), path).is_ok(),
            "DeepSeek-V3's sizes"
        );
        // 10⁷ tensors: (32 + 3·E)·2 per layer.
        let err = check_sizes(&ok(sizes(20_000, 100)), path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_hidden_layers/num_experts"), "{err}");
        assert!(check_sizes(&ok(sizes(10_000, 100)), path).is_ok());
    }
}
