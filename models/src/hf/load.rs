//! HF checkpoints as model weights: moe-bridge's [`HfCheckpoint`] implements
//! [`WeightSource`], and [`load_causal_lm`] builds whichever model `config.json` names.
//!
//! - Every tensor goes through the FP8 load hook of docs/checkpoints.md §FP8 release format
//!   (dequantised iff one byte wide with a `<name>_scale_inv`, to BF16 then widened to f32 — the
//!   values transformers sees), so an FP8 release checkpoint loads like its BF16 dequantisation.
//! - [`ModelConfig`] parses `config.json` by `model_type` (any family of
//!   [`crate::family`]) without touching the weights: enough for shape-only parameter counts.
//! - [`AnyCausalLm`] is any family's model, with forward, losses and generation delegated to
//!   the family.
//! - Loading validates first ([`HfCheckpoint::check`]): errors are [`BridgeError`]s (as
//!   [`ModelError::Bridge`]) naming the file and tensor: a corrupt or truncated shard is
//!   reported as the reader saw it, an ambiguous shard set as
//!   [`BridgeError::TensorInTwoShards`] and its siblings, a missing weight as
//!   [`BridgeError::MissingWeight`], a shape contradicting the config as
//!   [`BridgeError::ConfigMismatch`], an integer weight as [`BridgeError::DtypeMismatch`], a
//!   bad config as [`BridgeError::InvalidConfig`] or [`BridgeError::UnknownModelType`]; a
//!   parallel layout the model cannot run under stays a [`ModelError`].

mod any_lm;

use std::any::Any;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use moe_backend::comm::GroupComms;
use moe_bridge::BridgeError;
use moe_bridge::fp8::DEFAULT_BLOCK_SIZE;
use moe_bridge::hf::{CONFIG_FILE, HfCheckpoint, read_json};
use moe_bridge::mapping::{ExpectedTable, ExpertLayout};
use moe_bridge::safetensors::elem::{bf16_bits_to_f32, f32_to_bf16_bits};
use serde_json::Value;

use crate::causal_lm::ParamCount;
use crate::distributed::{DispatcherKind, LoadShard, ShardModel};
use crate::family::{Family, FamilyConfig, FamilyVisitor, MODEL_TYPES, visit_family};
use crate::weights::{WeightLoader, check_box};
use crate::{ModelError, WeightSource};

pub use crate::causal_lm::LmLosses;
pub use any_lm::{AnyCausalLm, ModelVisitor, ModelVisitorMut};

/// The outcome of [`HfCheckpoint::check`] for these models: the parsed [`ModelConfig`], the
/// expert layout, the expected tensors, unused tensors and warnings.
pub type CheckReport = moe_bridge::hf::CheckReport<ModelConfig>;

/// The plan of the family `checkpoint`'s `config.json` names, when that plan stores tensors in
/// a release layout ([`crate::param_plan::ReleaseLayout`]); `None` without a config, with an
/// unreadable one or one of an unknown family (the weights are then read as stored).
fn release_plan(checkpoint: &HfCheckpoint) -> Option<crate::param_plan::ParallelPlan> {
    let config = checkpoint.config_json_opt().ok()??;
    let model_type = config.get("model_type")?.as_str()?;
    crate::families::plan_of(model_type).filter(|p| p.has_release_layouts())
}

/// `checkpoint` as a [`CheckpointSource`] of f32 weights under its family's release plan.
fn as_source(checkpoint: &HfCheckpoint) -> CheckpointSource<'_> {
    CheckpointSource {
        checkpoint,
        precision: WeightPrecision::F32,
        first_error: RefCell::new(None),
        plan: release_plan(checkpoint),
    }
}

impl WeightSource for HfCheckpoint {
    /// [`HfCheckpoint::read_f32`]: FP8 weights dequantised per
    /// docs/checkpoints.md §FP8 release format (to BF16, then widened), every other float dtype
    /// widened to f32, MXFP4 pairs decoded (`moe_bridge::mxfp4`), and a tensor the plan of the
    /// config's family stores in a release layout converted to the canonical one, as
    /// [`load_causal_lm`] reads it. A tensor absent from the checkpoint is
    /// [`ModelError::MissingTensor`]; any read failure is [`ModelError::TensorRead`] whose
    /// reason is the bridge error (naming the file).
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        as_source(self).tensor_f32(hf_name)
    }

    fn contains(&self, hf_name: &str) -> bool {
        HfCheckpoint::contains(self, hf_name) || self.is_mxfp4(hf_name)
    }

    /// [`HfCheckpoint::read_box_f32`]: only the box is read (positioned reads; an FP8 weight's
    /// box with the scales of the blocks it touches; a release-layout tensor the box's experts
    /// whole, converted). The canonical shape must be `global` ([`ModelError::TensorShape`]
    /// otherwise); read failures are [`ModelError::TensorRead`] whose reason is the bridge
    /// error (naming the file).
    fn tensor_box_f32(
        &self,
        hf_name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        as_source(self).tensor_box_f32(hf_name, global, offsets, shape)
    }
}

/// Precision of the weights handed to a model (compute stays f32: the arithmetic policy of
/// docs/models.md §Goldens and parity tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPrecision {
    /// Values as stored, widened to f32 (the default and the parity setting).
    #[default]
    F32,
    /// Every value rounded once (RNE) to bf16 before widening, as a bf16 copy of the model
    /// would hold it.
    Bf16,
}

/// A [`WeightSource`] over a checkpoint that keeps the first [`BridgeError`] it met, so that a
/// failed load can report the reader's own error (truncated file, bad header) rather than its
/// string form, and that optionally rounds values to bf16.
struct CheckpointSource<'a> {
    checkpoint: &'a HfCheckpoint,
    precision: WeightPrecision,
    first_error: RefCell<Option<BridgeError>>,
    /// The plan of the family being loaded: its release layouts convert at read time.
    plan: Option<crate::param_plan::ParallelPlan>,
}

impl CheckpointSource<'_> {
    fn round(&self, values: &mut [f32]) {
        if self.precision == WeightPrecision::Bf16 {
            for v in values {
                *v = bf16_bits_to_f32(f32_to_bf16_bits(*v));
            }
        }
    }

    fn read_error(&self, name: &str, e: BridgeError) -> ModelError {
        let reason = e.to_string();
        self.first_error.borrow_mut().get_or_insert(e);
        ModelError::TensorRead {
            name: name.to_owned(),
            reason,
        }
    }

    /// The decoded MXFP4 weight `name` (`<name>_blocks`, `<name>_scales`) in the parameter
    /// orientation: the stored `[..., out, in]` matrix with its last two dims swapped, as
    /// transformers' `convert_moe_packed_tensors` hands it to the model.
    fn mxfp4(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        (self.checkpoint.read_mxfp4_param(name)).map_err(|e| self.read_error(name, e))
    }

    /// The box of the tensor `name` as the checkpoint stores it (shape `global`), an MXFP4
    /// pair decoded.
    fn stored_box(
        &self,
        name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        check_box(name, global, offsets, shape)?;
        if !self.checkpoint.contains(name) && self.checkpoint.is_mxfp4(name) {
            let (found, values) = self.mxfp4(name)?;
            if found != global {
                return Err(ModelError::TensorShape {
                    name: name.to_owned(),
                    expected: global.to_vec(),
                    found,
                });
            }
            let mut values = crate::weights::slice_box(&values, global, offsets, shape);
            self.round(&mut values);
            return Ok(values);
        }
        let stored = self
            .checkpoint
            .info(name)
            .map_err(|_| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        if stored.shape != global {
            return Err(ModelError::TensorShape {
                name: name.to_owned(),
                expected: global.to_vec(),
                found: stored.shape.clone(),
            });
        }
        let mut values = (self.checkpoint.read_box_f32(name, offsets, shape))
            .map_err(|e| self.read_error(name, e))?;
        self.round(&mut values);
        Ok(values)
    }

    /// The stored shape of `name` (an MXFP4 pair: its decoded, transposed shape).
    fn stored_shape(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        if let Ok(info) = self.checkpoint.info(name) {
            return Ok(info.shape.clone());
        }
        if self.checkpoint.is_mxfp4(name) {
            return Ok(self.mxfp4(name)?.0);
        }
        Err(ModelError::MissingTensor {
            name: name.to_owned(),
        })
    }
}

impl WeightSource for CheckpointSource<'_> {
    /// The whole canonical tensor (see [`tensor_box_f32`](Self::tensor_box_f32)).
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let stored = self.stored_shape(hf_name)?;
        let offsets = vec![0; stored.len()];
        let values = self.stored_box(hf_name, &stored, &offsets, &stored)?;
        match self.plan.as_ref().and_then(|p| p.release_layout(hf_name)) {
            Some(layout) => Ok((
                layout.canonical_shape(hf_name, &stored)?,
                layout.to_canonical(hf_name, &stored, &values)?,
            )),
            None => Ok((stored, values)),
        }
    }

    fn contains(&self, hf_name: &str) -> bool {
        self.checkpoint.contains(hf_name) || self.checkpoint.is_mxfp4(hf_name)
    }

    /// The box of the canonical tensor `hf_name`: FP8 weights dequantised, MXFP4 pairs
    /// decoded (`moe_bridge::mxfp4`), and a tensor the family's plan stores in a release
    /// layout ([`crate::param_plan::ReleaseLayout`]) read for the box's experts and converted
    /// to the canonical layout.
    fn tensor_box_f32(
        &self,
        hf_name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        check_box(hf_name, global, offsets, shape)?;
        let Some(layout) = self.plan.as_ref().and_then(|p| p.release_layout(hf_name)) else {
            return self.stored_box(hf_name, global, offsets, shape);
        };
        // The box's experts (dim 0 in both layouts) whole, converted, then cut.
        let stored = layout.stored_shape(hf_name, global)?;
        let mut s_offsets = vec![0; stored.len()];
        let mut s_shape = stored.clone();
        s_offsets[0] = offsets[0];
        s_shape[0] = shape[0];
        let values = self.stored_box(hf_name, &stored, &s_offsets, &s_shape)?;
        let canonical = layout.to_canonical(hf_name, &s_shape, &values)?;
        let mut c_global = global.to_vec();
        c_global[0] = shape[0];
        let mut c_offsets = offsets.to_vec();
        c_offsets[0] = 0;
        Ok(crate::weights::slice_box(
            &canonical, &c_global, &c_offsets, shape,
        ))
    }
}

/// A model family whose rank shards load straight from an HF directory: its
/// [`LoadShard::Config`] is a family's config ([`ModelConfig::config_as`]).
pub trait HfShard: LoadShard {
    /// This family's configuration in `config`, `None` for another family.
    fn config_of(config: &ModelConfig) -> Option<&Self::Config>;

    /// The family's parallel plan (its release layouts convert tensors on read).
    fn plan() -> crate::param_plan::ParallelPlan;
}

impl<M: ShardModel> HfShard for M {
    fn config_of(config: &ModelConfig) -> Option<&M::Config> {
        config.config_as::<M::Config>()
    }

    fn plan() -> crate::param_plan::ParallelPlan {
        <M as crate::param_plan::Planned>::parallel_plan()
    }
}

/// This rank's shard of model family `M` (layout of `groups`, dispatcher `kind`) read straight
/// from `checkpoint` onto `device`, after validating the checkpoint against its config
/// ([`HfCheckpoint::check`]: config, shard set, presence, shapes and dtypes of every tensor,
/// reading nothing beyond the headers), so that a checkpoint that does not fit the model fails
/// before any rank allocates its shard, with an error naming the tensor and what was expected.
/// Only this rank's box of each tensor is read (an FP8 weight's box dequantised with the
/// scales of its blocks): the rank holds its shard plus one box, never the whole model.
/// Returns the shard and the validation report.
///
/// Errors: a config of another model family is [`BridgeError::InvalidConfig`] naming
/// `model_type`; the rest as [`load_checked`].
pub fn load_shard_checked<M: HfShard>(
    checkpoint: &HfCheckpoint,
    groups: &GroupComms,
    kind: DispatcherKind,
    device: &Device,
) -> Result<(M::Shard, CheckReport), ModelError> {
    let report = checkpoint.check::<ModelConfig>()?;
    let config = M::config_of(&report.config).ok_or_else(|| BridgeError::InvalidConfig {
        path: checkpoint.dir().join(CONFIG_FILE),
        field: "model_type".to_owned(),
        reason: format!(
            "\"{}\" is not the model family being loaded",
            report.config.model_type()
        ),
    })?;
    let source = CheckpointSource {
        checkpoint,
        precision: WeightPrecision::F32,
        first_error: RefCell::new(None),
        plan: Some(M::plan()),
    };
    let shard = M::load_shard(config, &source, groups, kind, device).map_err(|err| match source
        .first_error
        .take()
    {
        Some(read_error) => read_error.into(),
        None => load_error(err, checkpoint.dir()),
    })?;
    Ok((shard, report))
}

/// A parsed `config.json` of any family in the list ([`crate::family`]): the family's own
/// config type behind one type, for tools that pick the model at run time. Get the typed config
/// back with [`get`](Self::get) / [`config_as`](Self::config_as), or run code generic over the
/// family with [`visit`](Self::visit).
#[derive(Debug, Clone)]
pub struct ModelConfig {
    inner: Arc<dyn DynConfig>,
}

/// What [`ModelConfig`] asks of a family's config, object-safe.
trait DynConfig: std::fmt::Debug + Send + Sync {
    fn model_type(&self) -> &'static str;
    fn architecture(&self) -> &'static str;
    fn validate(&self) -> Result<(), ModelError>;
    fn param_count(&self) -> Result<ParamCount, ModelError>;
    fn vocab_size(&self) -> usize;
    fn num_layers(&self) -> usize;
    fn hidden_size(&self) -> usize;
    fn experts(&self) -> Option<(usize, usize)>;
    fn warnings(&self) -> Vec<String>;
    fn as_any(&self) -> &dyn Any;
    fn expected(
        &self,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError>;
    fn export_copies(&self, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)>;
}

/// A config of family `F`.
struct Typed<F: Family>(F::Config);

impl<F: Family> std::fmt::Debug for Typed<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<F: Family> DynConfig for Typed<F> {
    fn model_type(&self) -> &'static str {
        F::MODEL_TYPE
    }

    fn architecture(&self) -> &'static str {
        F::ARCHITECTURE
    }

    fn validate(&self) -> Result<(), ModelError> {
        self.0.validate()
    }

    fn param_count(&self) -> Result<ParamCount, ModelError> {
        crate::families::param_count::<F>(&self.0)
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }

    fn num_layers(&self) -> usize {
        self.0.num_layers()
    }

    fn hidden_size(&self) -> usize {
        self.0.hidden_size()
    }

    fn experts(&self) -> Option<(usize, usize)> {
        self.0.experts()
    }

    fn warnings(&self) -> Vec<String> {
        self.0.warnings()
    }

    fn as_any(&self) -> &dyn Any {
        &self.0
    }

    fn expected(
        &self,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError> {
        F::expected_tensors(&self.0, layout, path, block)
    }

    fn export_copies(&self, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        F::export_copies(&self.0, has)
    }
}

/// Code generic over a family given its config ([`ModelConfig::visit`]).
pub trait ConfigVisitor {
    /// What the visit returns.
    type Output;
    /// Runs for family `F` and its config.
    fn visit<F: Family>(self, config: &F::Config) -> Self::Output;
}

impl ModelConfig {
    /// The config of family `F`.
    pub fn new<F: Family>(config: F::Config) -> Self {
        Self {
            inner: Arc::new(Typed::<F>(config)),
        }
    }

    /// The typed config when it is family `F`'s.
    pub fn get<F: Family>(&self) -> Option<&F::Config> {
        self.config_as::<F::Config>()
    }

    /// The typed config when it is a `C`.
    pub fn config_as<C: 'static>(&self) -> Option<&C> {
        self.inner.as_any().downcast_ref::<C>()
    }

    /// Runs `visitor` for this config's family (an error for a family not in the list).
    pub fn visit<V: ConfigVisitor>(&self, visitor: V) -> Result<V::Output, ModelError> {
        struct With<'a, V>(&'a ModelConfig, V);
        impl<V: ConfigVisitor> FamilyVisitor for With<'_, V> {
            type Output = Option<V::Output>;
            fn visit<F: Family>(self) -> Option<V::Output> {
                let config = self.0.get::<F>()?;
                Some(self.1.visit::<F>(config))
            }
        }
        visit_family(self.model_type(), With(self, visitor))
            .flatten()
            .ok_or_else(|| {
                ModelError::unsupported(
                    "model_type",
                    format!(
                        "family `{}` is not in the family list ({})",
                        self.model_type(),
                        MODEL_TYPES.join(", ")
                    ),
                )
            })
    }

    /// Reads `<dir>/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let path = dir.as_ref().join(CONFIG_FILE);
        Self::from_json(&read_json(&path)?, &path)
    }

    /// Parses a `config.json` already read as JSON; `path` names it in errors.
    ///
    /// Errors: [`BridgeError::InvalidConfig`] when `model_type` is absent or the config is
    /// invalid (a field of the wrong JSON type, out of range, contradicting another field, or
    /// sizes implying an implausible model; naming the field), [`BridgeError::UnknownModelType`]
    /// for a model type no family has.
    pub fn from_json(config: &Value, path: &Path) -> Result<Self, BridgeError> {
        let model_type = match config.get("model_type") {
            Some(Value::String(s)) => s.as_str(),
            other => {
                return Err(BridgeError::InvalidConfig {
                    path: path.to_path_buf(),
                    field: "model_type".to_owned(),
                    reason: match other {
                        None => "missing".to_owned(),
                        Some(v) => format!("{v} is not a string"),
                    },
                });
            }
        };
        struct Parse<'a>(&'a str);
        impl FamilyVisitor for Parse<'_> {
            type Output = Result<ModelConfig, ModelError>;
            fn visit<F: Family>(self) -> Self::Output {
                F::Config::from_json_str(self.0).map(ModelConfig::new::<F>)
            }
        }
        let text = config.to_string();
        let parsed = visit_family(model_type, Parse(&text)).ok_or_else(|| {
            BridgeError::UnknownModelType {
                path: path.to_path_buf(),
                model_type: model_type.to_owned(),
                known: MODEL_TYPES.join(", "),
            }
        })?;
        let config = parsed.map_err(|e| config_error(e, path))?;
        config.validate().map_err(|e| config_error(e, path))?;
        // Plausible sizes: every implied shape computable without overflow, bounded tensor and
        // parameter counts (so that later size arithmetic cannot overflow either).
        config.expected_hf_tensors(ExpertLayout::PerExpert, path, DEFAULT_BLOCK_SIZE)?;
        Ok(config)
    }

    /// HF `model_type`.
    pub fn model_type(&self) -> &'static str {
        self.inner.model_type()
    }

    /// HF architecture class name (`config.json` `architectures[0]`).
    pub fn architecture(&self) -> &'static str {
        self.inner.architecture()
    }

    /// Checks the configuration's internal consistency.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.inner.validate()
    }

    /// Shape-only parameter counts (nothing is allocated; [`crate::families::param_count`]).
    pub fn param_count(&self) -> Result<ParamCount, ModelError> {
        self.inner.param_count()
    }

    /// Vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Number of decoder layers (MTP layers not included).
    pub fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }

    /// `(routed experts, experts per token)` for MoE models, `None` for dense ones.
    pub fn experts(&self) -> Option<(usize, usize)> {
        self.inner.experts()
    }

    /// Configuration warnings worth showing a user (e.g. DeepSeek-V3's YaRN factor check).
    pub fn warnings(&self) -> Vec<String> {
        self.inner.warnings()
    }

    /// The HF tensors this config implies ([`Family::expected_tensors`]).
    pub fn expected_hf_tensors(
        &self,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError> {
        self.inner.expected(layout, path, block)
    }

    /// Tensors an export writes twice ([`Family::export_copies`]).
    pub fn export_copies(&self, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        self.inner.export_copies(has)
    }
}

/// A [`ModelError`] found while parsing `path`, as a [`BridgeError::InvalidConfig`] naming the
/// field.
fn config_error(err: ModelError, path: &Path) -> BridgeError {
    let field = match &err {
        ModelError::MissingField { field, .. } => (*field).to_owned(),
        ModelError::WrongType { field, .. } | ModelError::InvalidValue { field, .. } => {
            field.clone()
        }
        ModelError::ConflictingFields { first, second, .. } => format!("{first}/{second}"),
        ModelError::WrongModelType { .. } => "model_type".to_owned(),
        _ => "(config)".to_owned(),
    };
    BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field,
        reason: err.to_string(),
    }
}

/// Opens the HF checkpoint in `dir` (single file or sharded) and builds the model its
/// `config.json` names, with f32 weights on `device`.
///
/// Errors: see the module docs; no input makes this panic.
pub fn load_causal_lm(dir: impl AsRef<Path>, device: &Device) -> Result<AnyCausalLm, ModelError> {
    let checkpoint = HfCheckpoint::open(dir)?;
    load_from_checkpoint(&checkpoint, WeightPrecision::F32, device)
}

/// Builds the model `checkpoint`'s `config.json` names, with weights of `precision`, after
/// validating the checkpoint against the config ([`HfCheckpoint::check`]; its warnings are
/// dropped, see [`load_checked`]).
pub fn load_from_checkpoint(
    checkpoint: &HfCheckpoint,
    precision: WeightPrecision,
    device: &Device,
) -> Result<AnyCausalLm, ModelError> {
    load_checked(checkpoint, precision, device).map(|(model, _)| model)
}

/// [`load_from_checkpoint`] that also returns the validation report (its warnings are for the
/// user: unused tensors, FP8 weights value-cast, config findings).
///
/// Nothing is read beyond the shard headers before the checkpoint has passed
/// [`HfCheckpoint::check`]: a missing, mis-shaped or integer weight, an ambiguous shard set or
/// an invalid config is an error naming the file and tensor or field.
pub fn load_checked(
    checkpoint: &HfCheckpoint,
    precision: WeightPrecision,
    device: &Device,
) -> Result<(AnyCausalLm, CheckReport), ModelError> {
    let report = checkpoint.check::<ModelConfig>()?;
    struct PlanOf;
    impl ConfigVisitor for PlanOf {
        type Output = crate::param_plan::ParallelPlan;
        fn visit<F: Family>(self, _: &F::Config) -> Self::Output {
            <F::Model as crate::param_plan::Planned>::parallel_plan()
        }
    }
    let source = CheckpointSource {
        checkpoint,
        precision,
        first_error: RefCell::new(None),
        plan: Some(report.config.visit(PlanOf)?),
    };
    struct Build<'a>(&'a CheckpointSource<'a>, &'a Device);
    impl ConfigVisitor for Build<'_> {
        type Output = Result<AnyCausalLm, ModelError>;
        fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
            let loader = WeightLoader::new(self.0, self.1);
            F::Model::from_loader(config, &loader).map(AnyCausalLm::new::<F>)
        }
    }
    let built = report.config.visit(Build(&source, device))?;
    let model = built.map_err(|err| match source.first_error.into_inner() {
        Some(read_error) => read_error.into(),
        None => load_error(err, checkpoint.dir()),
    })?;
    Ok((model, report))
}

/// A model-building error that is not a read error: the checkpoint lacks or mis-shapes a
/// tensor ([`BridgeError::IncompleteCheckpoint`]), the config is at fault
/// ([`BridgeError::InvalidConfig`] naming the field), or the model cannot run as asked (a
/// parallel layout, an unsupported setting: the model's own error).
fn load_error(err: ModelError, dir: &Path) -> ModelError {
    let path: PathBuf = dir.to_path_buf();
    match err {
        ModelError::MissingTensor { .. }
        | ModelError::TensorShape { .. }
        | ModelError::TensorRead { .. }
        | ModelError::MixedExpertLayout { .. } => BridgeError::IncompleteCheckpoint {
            path,
            summary: err.to_string(),
        }
        .into(),
        ModelError::Layout { .. } | ModelError::Unsupported { .. } | ModelError::Bridge(_) => err,
        other => config_error(other, &dir.join(CONFIG_FILE)).into(),
    }
}

#[cfg(test)]
mod tests;
