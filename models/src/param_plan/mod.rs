//! Each model's **parallel plan** (docs/parallelism.md §The parallel plan): one declarative table
//! per model, keyed by Burn module path, that says for every parameter and buffer
//!
//! - its canonical HF name (docs/checkpoints.md §Canonical names and sharding: HF names, routed
//!   experts stacked per MoE layer) and how the Burn tensor relates to it ([`Storage`]: identity,
//!   `[in, out]` transpose, gated experts `[E, 2F, H]` ≡ `[E, 2, F, H]`);
//! - how it is split over the ranks of a stage ([`ShardRule`]: replicated, TP along a
//!   canonical dimension (vocabulary rows for embeddings and the LM head), EP × ETP);
//! - how its gradient is reduced ([`GradClass`]: a [`ParamClass`] of
//!   docs/parallelism.md §Gradient reduction and scaling, or a buffer that is not optimised, such
//!   as DeepSeek-V3's expert bias);
//! - whether it may be held and computed in FP8 (docs/fp8.md §Recipes).
//!
//! Gradient classes, gathering a shard back to the full tensor, checkpoint placement and the
//! FP8 primary-weight selection read the plan; a parameter the plan does not classify is an
//! error naming its path ([`PlanError`] via [`ParallelPlan::resolve`]), never a default.
//!
//! Patterns are dotted Burn module paths (`model.layers.*.self_attn.q_proj.weight`); `*`
//! matches one path segment and captures it. HF templates substitute captures: `{0}` is the
//! first capture, `{0+L}` the first capture plus the model's number of main decoder layers
//! (DeepSeek-V3 stores MTP module `j` as layer `num_hidden_layers + j`). Every parameter must
//! match exactly one entry ([`ParallelPlan::resolve`] refuses ambiguity too).

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use moe_backend::optim::{MatrixAxis, MuonMatrix, ParamClass, ParamInfo};

use crate::ModelError;
use moe_bridge::dist::ShardRule;

pub mod hf_names;
mod load;
pub mod model_shape;
pub mod release_layout;
mod shard;

pub use load::{load_by_plan, load_planned, load_with};
pub use model_shape::{AttentionShape, ModelShape};
pub use release_layout::ReleaseLayout;
pub use shard::{shard_by_plan, shard_planned};

/// A model with a parallel plan: the trainer, gathering, checkpoint placement and HF export
/// read every parameter's entry from it. A user's own model implements it to get the same.
pub trait Planned: Module {
    /// The model's plan.
    fn parallel_plan() -> ParallelPlan;

    /// Number of main decoder layers (the `{0+L}` templates: DeepSeek-V3 stores MTP module
    /// `j` as layer `main_layers + j`).
    fn main_layers(&self) -> usize;

    /// The gradient class of every trainable parameter, from the plan (what
    /// [`moe_backend::optim::DistributedAdamW::with_classes`] asks); an unplanned parameter is
    /// an error naming it.
    fn param_classes(&self) -> Result<ParamClasses, ModelError>
    where
        Self: Sized,
    {
        Self::parallel_plan().classes(self, self.main_layers())
    }

    /// What Muon does with every trainable parameter, from the plan (what
    /// [`moe_backend::optim::MuonAdamW::new`] asks): see [`ParallelPlan::muon_matrices`].
    fn muon_matrices(&self) -> Result<MuonMatrices, ModelError>
    where
        Self: Sized,
    {
        Ok(Self::parallel_plan().muon_matrices(self, self.main_layers())?)
    }
}

/// Muon's view of a module's parameters by Burn path ([`ParallelPlan::muon_matrices`]).
#[derive(Debug, Clone)]
pub struct MuonMatrices {
    matrices: HashMap<String, Option<MuonMatrix>>,
}

impl MuonMatrices {
    /// Muon's selection for the optimizers: the matrix view of the parameter at
    /// `info.path`, `None` for AdamW (and for a path the plan did not see).
    pub fn select(&self, info: &ParamInfo) -> Option<MuonMatrix> {
        self.matrices.get(&info.path).copied().flatten()
    }
}

/// How a Burn parameter relates to its canonical (HF, PyTorch `[out, in]`) tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Same shape and element order.
    Same,
    /// A 2-D transpose (Burn's `Linear` stores `[in, out]`).
    Transposed,
    /// Stacked gated experts: Burn `[E, 2F, H]` (gate rows then up rows per expert) is the
    /// canonical `[E, 2, F, H]`.
    GatedExperts,
}

/// How a tensor's gradient is reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradClass {
    /// A trainable parameter of this class.
    Param(ParamClass),
    /// A buffer (no gradient, not optimised; e.g. the expert bias, which moves by its own
    /// update rule). Replicated buffers are identical on every rank.
    Buffer,
}

/// One row of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    /// Burn module path pattern (`*` matches one segment).
    pub module: String,
    /// Canonical HF name template (`{0}`, `{0+L}`: see the module docs).
    pub hf: String,
    /// Burn tensor vs canonical tensor.
    pub storage: Storage,
    /// Split over the ranks of a stage (canonical dimensions).
    pub split: ShardRule,
    /// Gradient reduction.
    pub grad: GradClass,
    /// Whether FP8 primary weights and FP8 GEMMs may hold/use it.
    pub fp8: bool,
}

/// The plan of one model family: every parameter's entry.
#[derive(Debug, Clone)]
pub struct ParallelPlan {
    family: &'static str,
    entries: Vec<PlanEntry>,
    expert_projections: hf_names::ExpertProjections,
    release_layouts: Vec<(String, ReleaseLayout)>,
    mxfp4: Option<Mxfp4Release>,
}

/// The tensors a family's HF release stores as MXFP4 pairs (`<name>_blocks`,
/// `<name>_scales`, moe-bridge's `mxfp4` codec) and the `quantization_config` it writes:
/// transformers 5.23's `Mxfp4Config` (`quant_method: "mxfp4"`, the modules left unquantised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mxfp4Release {
    /// HF name templates of the packed tensors (`{0}` matches one numeric segment).
    pub tensors: Vec<String>,
    /// `quantization_config.modules_to_not_convert` (transformers' module patterns).
    pub modules_to_not_convert: Vec<String>,
}

impl Mxfp4Release {
    /// The release's `quantization_config`.
    pub fn quantization_config(&self) -> serde_json::Value {
        serde_json::json!({
            "modules_to_not_convert": self.modules_to_not_convert,
            "quant_method": "mxfp4",
        })
    }
}

/// Whether the dotted `name` fits `template` (a `{…}` segment matches one numeric segment).
fn fits_template(template: &str, name: &str) -> bool {
    let (t, n): (Vec<&str>, Vec<&str>) = (template.split('.').collect(), name.split('.').collect());
    t.len() == n.len()
        && t.iter().zip(&n).all(|(t, s)| {
            if t.starts_with('{') {
                !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
            } else {
                t == s
            }
        })
}

/// A parameter the plan does not cover, or covers twice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No entry matches the parameter's path.
    #[error("the {family} parallel plan has no entry for parameter `{path}`")]
    Unclassified {
        /// Model family.
        family: &'static str,
        /// Burn module path of the parameter.
        path: String,
    },
    /// Several entries match.
    #[error("the {family} parallel plan matches parameter `{path}` with `{first}` and `{second}`")]
    Ambiguous {
        /// Model family.
        family: &'static str,
        /// Burn module path of the parameter.
        path: String,
        /// First matching pattern.
        first: String,
        /// Second matching pattern.
        second: String,
    },
    /// The entry does not fit the tensor (a buffer that requires grad, a split of a
    /// dimension the storage does not have).
    #[error("the {family} plan entry for `{path}` does not fit the tensor: {reason}")]
    Mismatch {
        /// Model family.
        family: &'static str,
        /// The parameter's path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A template refers to a capture the pattern does not have, or a capture is not a
    /// number where the template adds to it.
    #[error("the {family} plan entry `{pattern}` cannot name `{path}`: {reason}")]
    Template {
        /// Model family.
        family: &'static str,
        /// The entry's pattern.
        pattern: String,
        /// The parameter's path.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// A parameter resolved against a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved<'a> {
    /// The matching entry.
    pub entry: &'a PlanEntry,
    /// The canonical HF name.
    pub hf_name: String,
}

impl ParallelPlan {
    /// A plan of `family` from its entries (routed experts stored per expert under Llama's
    /// projection names, [`hf_names::ExpertProjections::LLAMA`]).
    pub fn new(family: &'static str, entries: Vec<PlanEntry>) -> Self {
        Self {
            family,
            entries,
            expert_projections: hf_names::ExpertProjections::LLAMA,
            release_layouts: Vec::new(),
            mxfp4: None,
        }
    }

    /// The same plan whose HF release stores the canonical tensors named by the templates
    /// (`{0}` matches one numeric segment) in another layout ([`ReleaseLayout`]): loading an
    /// HF checkpoint converts them to the canonical layout, HF export converts back; the
    /// canonical tensors (distributed checkpoints, resharding, weight sync) are unchanged.
    pub fn with_release_layouts(mut self, layouts: Vec<(String, ReleaseLayout)>) -> Self {
        self.release_layouts = layouts;
        self
    }

    /// How the HF release stores canonical tensor `name`, when not as the canonical tensor.
    pub fn release_layout(&self, name: &str) -> Option<ReleaseLayout> {
        self.release_layouts
            .iter()
            .find(|(template, _)| fits_template(template, name))
            .map(|(_, layout)| *layout)
    }

    /// The same plan whose HF release stores some tensors as MXFP4 ([`Mxfp4Release`]): what
    /// an MXFP4 export (`moe export --dtype mxfp4`) packs.
    pub fn with_mxfp4_release(mut self, release: Mxfp4Release) -> Self {
        self.mxfp4 = Some(release);
        self
    }

    /// The family's MXFP4 release, if its release stores any tensor as MXFP4.
    pub fn mxfp4_release(&self) -> Option<&Mxfp4Release> {
        self.mxfp4.as_ref()
    }

    /// Whether the HF release stores tensor `name` (its HF name) as an MXFP4 pair.
    pub fn is_mxfp4(&self, name: &str) -> bool {
        self.mxfp4
            .as_ref()
            .is_some_and(|m| m.tensors.iter().any(|t| fits_template(t, name)))
    }

    /// Whether any tensor of the plan has a [`ReleaseLayout`].
    pub fn has_release_layouts(&self) -> bool {
        !self.release_layouts.is_empty()
    }

    /// The same plan with the routed experts' per-expert HF tensors named by `projs`
    /// (`{experts}.{e}.{projs.gate}.weight`, …): what loading, export and weight sync write
    /// and read for a per-expert checkpoint. Canonical (stacked) names are unchanged.
    pub fn with_expert_projections(mut self, projs: hf_names::ExpertProjections) -> Self {
        self.expert_projections = projs;
        self
    }

    /// The per-expert projection names of the routed experts (see
    /// [`with_expert_projections`](Self::with_expert_projections)).
    pub fn expert_projections(&self) -> hf_names::ExpertProjections {
        self.expert_projections
    }

    /// The per-expert HF tensors of expert `e` of the stacked routed-expert tensor `name`
    /// (`{experts}.{proj}`, stored as `storage`), in the order a per-expert checkpoint
    /// stores them, each with its rows of the expert's `[rows, cols]` slice: gated experts
    /// (`gate_up_proj [E, 2F, H]`) are the expert's gate then up projection (`F` rows each);
    /// any other stacked tensor is one projection, `down_proj` under the family's
    /// per-expert name ([`expert_projections`](Self::expert_projections)). HF export and the
    /// expected-tensor table both name per-expert tensors through this; `None` for a name
    /// without an experts prefix or a storage that is not stacked.
    pub fn per_expert_names(
        &self,
        name: &str,
        storage: Storage,
        e: usize,
        rows: usize,
    ) -> Option<Vec<(String, std::ops::Range<usize>)>> {
        let (experts, proj) = name.rsplit_once('.')?;
        let projs = self.expert_projections;
        let one = |p: &str| hf_names::expert_proj_weight(experts, e, p);
        match storage {
            Storage::GatedExperts if rows.is_multiple_of(2) => {
                let f = rows / 2;
                Some(vec![(one(projs.gate), 0..f), (one(projs.up), f..rows)])
            }
            Storage::Same => {
                let proj = if proj == hf_names::DOWN_PROJ {
                    projs.down
                } else {
                    proj
                };
                Some(vec![(one(proj), 0..rows)])
            }
            _ => None,
        }
    }

    /// The model family (`qwen3_moe`, …).
    pub fn family(&self) -> &'static str {
        self.family
    }

    /// The entries, in table order.
    pub fn entries(&self) -> &[PlanEntry] {
        &self.entries
    }

    /// The entry of the parameter at Burn path `path` and its canonical HF name;
    /// `main_layers` is the model's number of main decoder layers (`{0+L}` templates).
    pub fn resolve(&self, path: &str, main_layers: usize) -> Result<Resolved<'_>, PlanError> {
        let mut found: Option<(&PlanEntry, Vec<&str>)> = None;
        for entry in &self.entries {
            if let Some(captures) = match_pattern(&entry.module, path) {
                if let Some((first, _)) = &found {
                    return Err(PlanError::Ambiguous {
                        family: self.family,
                        path: path.to_owned(),
                        first: first.module.clone(),
                        second: entry.module.clone(),
                    });
                }
                found = Some((entry, captures));
            }
        }
        let (entry, captures) = found.ok_or_else(|| PlanError::Unclassified {
            family: self.family,
            path: path.to_owned(),
        })?;
        let hf_name =
            render(&entry.hf, &captures, main_layers).map_err(|reason| PlanError::Template {
                family: self.family,
                pattern: entry.module.clone(),
                path: path.to_owned(),
                reason,
            })?;
        Ok(Resolved { entry, hf_name })
    }

    /// Every float parameter and buffer of `module` resolved against the plan, in visiting
    /// order; the first one the plan does not classify is an error naming it.
    pub fn walk<M: Module>(
        &self,
        module: &M,
        main_layers: usize,
    ) -> Result<Vec<PlannedTensor>, PlanError> {
        let mut visitor = PathVisitor::default();
        module.visit(&mut visitor);
        visitor
            .found
            .into_iter()
            .map(|(path, id, shape, trainable)| {
                let resolved = self.resolve(&path, main_layers)?;
                let hf_name = resolved.hf_name;
                let entry = resolved.entry.clone();
                // A lazy (not yet materialised) tensor will require grad as its plan says.
                let trainable = trainable.unwrap_or(matches!(entry.grad, GradClass::Param(_)));
                Ok(PlannedTensor {
                    path,
                    id,
                    shape,
                    trainable,
                    hf_name,
                    entry,
                })
            })
            .collect()
    }

    /// What Muon does with every trainable parameter of `module` (Megatron's and Keller's
    /// convention, read from the plan instead of guessed from names): 2-D weights and
    /// stacked 3-D expert weights are Muon matrices, except biases, 2-D expert parameters,
    /// the embedding and the output layer (AdamW). A matrix's rows are output features when
    /// it is stored as the canonical `[out, in]` (the router, stacked experts) and input
    /// features for Burn's transposed `Linear`; its tensor-parallel split is the plan's:
    /// canonical dim 0 (column-parallel) or 1 (row-parallel) over `tp`, the ETP dimension of
    /// the stacked experts over `expt_tp`.
    pub fn muon_matrices<M: Module>(
        &self,
        module: &M,
        main_layers: usize,
    ) -> Result<MuonMatrices, PlanError> {
        let mut matrices = HashMap::new();
        for t in self.walk(module, main_layers)? {
            let GradClass::Param(class) = t.entry.grad else {
                continue;
            };
            if !t.trainable {
                continue;
            }
            let is_bias = t.path.rsplit('.').next() == Some("bias");
            let matrix = if !(2..=3).contains(&t.shape.len())
                || is_bias
                || hf_names::mentions_embedding_or_head(&t.hf_name)
            {
                None
            } else if t.shape.len() == 3 {
                let split = match t.entry.split {
                    ShardRule::Expert { etp_dim } if class.is_expert() => {
                        // Stacked gate/up `[E, 2F, H]` (canonical `[E, 2, F, H]`) splits its
                        // rows; a canonical `[E, out, in]` stored as is splits dim 1 (rows)
                        // or dim 2 (columns).
                        Some(match (t.entry.storage, etp_dim) {
                            (Storage::GatedExperts, _) | (_, 1) => MatrixAxis::Rows,
                            _ => MatrixAxis::Cols,
                        })
                    }
                    _ => None,
                };
                Some(MuonMatrix {
                    rows_are_outputs: true,
                    split,
                })
            } else if class.is_expert() {
                None
            } else {
                let canonical = t.entry.storage == Storage::Same;
                let split = match (t.entry.split, class) {
                    (ShardRule::Tp { dim }, ParamClass::DenseTpSharded) => {
                        // Canonical dim 0 is the output rows; Burn's `Linear` stores `[in, out]`.
                        Some(if (dim == 0) == canonical {
                            MatrixAxis::Rows
                        } else {
                            MatrixAxis::Cols
                        })
                    }
                    _ => None,
                };
                Some(MuonMatrix {
                    rows_are_outputs: canonical,
                    split,
                })
            };
            matrices.insert(t.path, matrix);
        }
        Ok(MuonMatrices { matrices })
    }

    /// The gradient class of every trainable parameter of `module` by Burn path (what
    /// [`moe_backend::optim::DistributedAdamW::with_classes`] asks), checked complete: a
    /// trainable parameter planned as a buffer, or a buffer planned as a parameter, is an
    /// error as well.
    pub fn classes<M: Module>(
        &self,
        module: &M,
        main_layers: usize,
    ) -> Result<ParamClasses, ModelError> {
        let mut classes = HashMap::new();
        for t in self.walk(module, main_layers)? {
            match (t.entry.grad, t.trainable) {
                (GradClass::Param(class), true) => {
                    classes.insert(t.path, class);
                }
                (GradClass::Buffer, false) => {}
                (GradClass::Param(_), false) => {
                    // A frozen parameter (e.g. a Muon view) is simply not optimised.
                }
                (GradClass::Buffer, true) => {
                    return Err(PlanError::Mismatch {
                        family: self.family,
                        reason: format!("{} requires grad but is planned as a buffer", t.hf_name),
                        path: t.path,
                    }
                    .into());
                }
            }
        }
        Ok(ParamClasses {
            family: self.family,
            classes,
        })
    }
}

/// One tensor of a module resolved against its plan.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    /// Burn module path.
    pub path: String,
    /// Burn parameter id.
    pub id: ParamId,
    /// Shape of the Burn tensor (this rank's shard when the module is one).
    pub shape: Vec<usize>,
    /// Whether it requires grad (a parameter rather than a buffer).
    pub trainable: bool,
    /// Canonical HF name.
    pub hf_name: String,
    /// The plan entry.
    pub entry: PlanEntry,
}

/// Gradient classes of a module's trainable parameters, by Burn path.
#[derive(Debug, Clone)]
pub struct ParamClasses {
    family: &'static str,
    classes: HashMap<String, ParamClass>,
}

impl ParamClasses {
    /// The class of the parameter at `path`.
    pub fn get(&self, path: &str) -> Result<ParamClass, PlanError> {
        self.classes
            .get(path)
            .copied()
            .ok_or_else(|| PlanError::Unclassified {
                family: self.family,
                path: path.to_owned(),
            })
    }

    /// A classifier for the optimizers. Every path the optimizers visit was resolved when
    /// `self` was built from the same module; a path that was not (a module changed in
    /// between) is classified `Dense` and reported by [`Self::check`].
    pub fn classifier(&self) -> impl Fn(&str, bool) -> ParamClass + '_ {
        move |path: &str, _in_experts: bool| self.get(path).unwrap_or(ParamClass::Dense)
    }

    /// Errors unless every trainable parameter of `module` has a class here.
    pub fn check<M: Module>(&self, module: &M) -> Result<(), PlanError> {
        let mut visitor = PathVisitor::default();
        module.visit(&mut visitor);
        for (path, _, _, trainable) in visitor.found {
            if trainable != Some(false) {
                self.get(&path)?;
            }
        }
        Ok(())
    }
}

/// Collects `(path, id, shape, requires_grad)` of every float tensor of a module.
#[derive(Default)]
struct PathVisitor {
    path: Vec<String>,
    /// `(path, id, shape, requires grad)`; `None` for a lazy parameter.
    found: Vec<(String, ParamId, Vec<usize>, Option<bool>)>,
}

impl ModuleVisitor for PathVisitor {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        // Shapes and gradient settings without materialising a lazy parameter (a skeleton
        // model built at local shapes stays unallocated).
        let trainable = param
            .is_initialized()
            .then(|| param.val().is_require_grad());
        self.found.push((
            self.path.join("."),
            param.id,
            param.lazy_shape().to_vec(),
            trainable,
        ));
    }
}

/// `(Burn path, element count)` of every float parameter of `module`, read from the
/// (possibly lazy) shapes: a lazily initialised model is never allocated.
pub fn param_numels<M: Module>(module: &M) -> Vec<(String, usize)> {
    let mut visitor = PathVisitor::default();
    module.visit(&mut visitor);
    (visitor.found.into_iter())
        .map(|(path, _, shape, _)| (path, shape.iter().product()))
        .collect()
}

/// The captures of `path` against `pattern` (`*` = one segment), or `None`.
fn match_pattern<'p>(pattern: &str, path: &'p str) -> Option<Vec<&'p str>> {
    let mut captures = Vec::new();
    let mut pat = pattern.split('.');
    let mut segs = path.split('.');
    loop {
        match (pat.next(), segs.next()) {
            (None, None) => return Some(captures),
            (Some("*"), Some(seg)) => captures.push(seg),
            (Some(p), Some(seg)) if p == seg => {}
            _ => return None,
        }
    }
}

/// `template` with `{i}` replaced by capture `i` and `{i+L}` by capture `i` plus `layers`.
fn render(template: &str, captures: &[&str], layers: usize) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 8);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..]
            .find('}')
            .map(|c| open + c)
            .ok_or_else(|| format!("unclosed `{{` in `{template}`"))?;
        let spec = &rest[open + 1..close];
        let (index, add_layers) = match spec.strip_suffix("+L") {
            Some(i) => (i, true),
            None => (spec, false),
        };
        let capture = index
            .parse::<usize>()
            .ok()
            .and_then(|i| captures.get(i))
            .ok_or_else(|| format!("no capture `{spec}`"))?;
        if add_layers {
            let n = capture
                .parse::<usize>()
                .map_err(|_| format!("capture `{capture}` is not an index"))?;
            out.push_str(&(n + layers).to_string());
        } else {
            out.push_str(capture);
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Builders of plan entries: the rows of the built-in tables, public so that a user's own
/// model ([`Planned`]) declares its plan the same way, e.g.
///
/// ```
/// use moe_models::param_plan::{ParallelPlan, rows};
///
/// let mut entries = rows::embedding("embed_tokens", "model.embed_tokens");
/// entries.extend(rows::gqa("layers.*.self_attn", "model.layers.{0}.self_attn"));
/// entries.extend(rows::moe("layers.*.mlp", "model.layers.{0}.mlp", false));
/// entries.extend(rows::column("lm_head", "lm_head", false, false));
/// let plan = ParallelPlan::new("my_moe", entries);
/// assert!(plan.resolve("layers.3.mlp.experts.fc1", 0).is_ok());
/// ```
///
/// Every builder takes the Burn module path pattern `m` (`*` matches one segment) and the HF
/// module name template `hf` (`{0}`: the first capture), and returns the entries of that
/// module's parameters.
pub mod rows {
    use super::hf_names::{self as n, join};
    use super::{GradClass, PlanEntry, ShardRule, Storage};
    use moe_backend::optim::ParamClass;

    fn entry(
        module: String,
        hf: String,
        storage: Storage,
        split: ShardRule,
        grad: GradClass,
        fp8: bool,
    ) -> PlanEntry {
        PlanEntry {
            module,
            hf,
            storage,
            split,
            grad,
            fp8,
        }
    }

    /// Burn `{m}.weight` (+ `{m}.bias`) of a column-parallel linear: output features over TP
    /// (the bias with them).
    pub fn column(m: &str, hf: &str, bias: bool, fp8: bool) -> Vec<PlanEntry> {
        let tp = ParamClass::DenseTpSharded;
        let mut rows = vec![
            entry(
                format!("{m}.weight"),
                format!("{hf}.weight"),
                Storage::Transposed,
                ShardRule::Tp { dim: 0 },
                GradClass::Param(tp),
                fp8,
            ),
            entry(
                format!("{m}.bias"),
                format!("{hf}.bias"),
                Storage::Same,
                ShardRule::Tp { dim: 0 },
                GradClass::Param(tp),
                false,
            ),
        ];
        rows.truncate(if bias { 2 } else { 1 });
        rows
    }

    /// A row-parallel linear: input features over TP; its bias is added once to the
    /// sequence-parallel output, replicated with summed gradients.
    pub fn row(m: &str, hf: &str, bias: bool, fp8: bool) -> Vec<PlanEntry> {
        let mut rows = vec![
            entry(
                format!("{m}.weight"),
                format!("{hf}.weight"),
                Storage::Transposed,
                ShardRule::Tp { dim: 1 },
                GradClass::Param(ParamClass::DenseTpSharded),
                fp8,
            ),
            entry(
                format!("{m}.bias"),
                format!("{hf}.bias"),
                Storage::Same,
                ShardRule::Replicated,
                GradClass::Param(ParamClass::DenseSequenceParallel),
                false,
            ),
        ];
        rows.truncate(if bias { 2 } else { 1 });
        rows
    }

    /// A linear replicated on every TP rank and fed sequence-parallel (or head-split)
    /// activations: gradients summed over TP.
    pub fn replicated(m: &str, hf: &str, bias: bool, fp8: bool) -> Vec<PlanEntry> {
        let sp = GradClass::Param(ParamClass::DenseSequenceParallel);
        let mut rows = vec![
            entry(
                format!("{m}.weight"),
                format!("{hf}.weight"),
                Storage::Transposed,
                ShardRule::Replicated,
                sp,
                fp8,
            ),
            entry(
                format!("{m}.bias"),
                format!("{hf}.bias"),
                Storage::Same,
                ShardRule::Replicated,
                sp,
                false,
            ),
        ];
        rows.truncate(if bias { 2 } else { 1 });
        rows
    }

    /// An RMSNorm `{m}.weight`: replicated, gradients summed over TP.
    pub fn norm(m: &str, hf: &str) -> Vec<PlanEntry> {
        vec![entry(
            format!("{m}.weight"),
            format!("{hf}.weight"),
            Storage::Same,
            ShardRule::Replicated,
            GradClass::Param(ParamClass::DenseSequenceParallel),
            false,
        )]
    }

    /// A vocab-parallel embedding (rows of the vocabulary over TP).
    pub fn embedding(m: &str, hf: &str) -> Vec<PlanEntry> {
        vec![entry(
            format!("{m}.weight"),
            format!("{hf}.weight"),
            Storage::Same,
            ShardRule::Tp { dim: 0 },
            GradClass::Param(ParamClass::DenseTpSharded),
            false,
        )]
    }

    /// A dense SwiGLU MLP (`gate_proj`/`up_proj` column-, `down_proj` row-parallel).
    pub fn mlp(m: &str, hf: &str) -> Vec<PlanEntry> {
        let [gate, up, down] = n::MLP_PROJS;
        let mut rows = column(&join(m, gate), &join(hf, gate), false, true);
        rows.extend(column(&join(m, up), &join(hf, up), false, true));
        rows.extend(row(&join(m, down), &join(hf, down), false, true));
        rows
    }

    /// An MoE layer (`moe_backend::MoeLayer` at Burn path `m`, HF `mlp` module `hf`): the
    /// router weight (HF `gate.weight`) replicated with summed gradients, the expert bias
    /// (`gate.e_score_correction_bias`) a replicated buffer, routed experts stacked over
    /// EP × ETP, and (with `shared`) the shared experts replicated.
    pub fn moe(m: &str, hf: &str, shared: bool) -> Vec<PlanEntry> {
        let expert = GradClass::Param(ParamClass::Expert);
        let mut rows = vec![
            entry(
                format!("{m}.router.weight"),
                n::weight(&join(hf, n::ROUTER)),
                Storage::Same,
                ShardRule::Replicated,
                GradClass::Param(ParamClass::DenseSequenceParallel),
                false,
            ),
            entry(
                format!("{m}.router.expert_bias"),
                format!("{hf}.{}.{}", n::ROUTER, n::EXPERT_BIAS),
                Storage::Same,
                ShardRule::Replicated,
                GradClass::Buffer,
                false,
            ),
            entry(
                format!("{m}.experts.fc1"),
                n::stacked_gate_up(&join(hf, n::EXPERTS)),
                Storage::GatedExperts,
                ShardRule::Expert { etp_dim: 2 },
                expert,
                true,
            ),
            entry(
                format!("{m}.experts.fc2"),
                n::stacked_down(&join(hf, n::EXPERTS)),
                Storage::Same,
                ShardRule::Expert { etp_dim: 2 },
                expert,
                true,
            ),
        ];
        if shared {
            let shared = n::SHARED_EXPERTS;
            for proj in n::MLP_PROJS {
                rows.extend(replicated(
                    &format!("{m}.{shared}.{proj}"),
                    &format!("{hf}.{shared}.{proj}"),
                    false,
                    true,
                ));
            }
        }
        rows
    }

    /// Qwen3 GQA attention at Burn path `m` (HF `self_attn` module `hf`): q/k/v
    /// column-parallel by head, `o_proj` row-parallel, QK-norms replicated.
    pub fn gqa(m: &str, hf: &str) -> Vec<PlanEntry> {
        let mut rows = Vec::new();
        for proj in [n::Q_PROJ, n::K_PROJ, n::V_PROJ] {
            rows.extend(column(&join(m, proj), &join(hf, proj), true, true));
        }
        rows.extend(row(&join(m, n::O_PROJ), &join(hf, n::O_PROJ), true, true));
        for qk_norm in [n::Q_NORM, n::K_NORM] {
            rows.extend(norm(&join(m, qk_norm), &join(hf, qk_norm)));
        }
        rows
    }
}

#[cfg(test)]
mod tests;
