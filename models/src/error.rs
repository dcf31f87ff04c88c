//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a model configuration, or building, sharding,
/// running or training a model.
///
/// Config errors name the offending `config.json` field (or fields), so a user can fix the file
/// without reading our source; tensor errors name the tensor, input errors the input
/// ([`InvalidInput`](Self::InvalidInput)), layout errors the parallel degree at fault
/// ([`Layout`](Self::Layout)), and requests that are valid but not implemented say so
/// ([`Unsupported`](Self::Unsupported)).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file we tried to read.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The config text is not valid JSON, or not a JSON object.
    #[error("config is not a valid JSON object: {reason}")]
    InvalidJson {
        /// What the JSON parser reported.
        reason: String,
    },
    /// An error inside a config file, with the file's path attached.
    #[error("{path}: {source}")]
    InFile {
        /// The config file.
        path: PathBuf,
        /// The error found in it.
        source: Box<ModelError>,
    },
    /// `model_type` is absent or names a model this parser does not handle.
    #[error("config field `model_type` is {found}, expected \"{expected}\"")]
    WrongModelType {
        /// The model type this parser accepts.
        expected: &'static str,
        /// What the config holds (`absent` if missing).
        found: String,
    },
    /// A required field is absent (or `null` where `null` is not allowed).
    #[error("config field `{field}` is missing{detail}")]
    MissingField {
        /// The field name as spelled in `config.json`.
        field: &'static str,
        /// Extra context, empty or starting with `: `.
        detail: String,
    },
    /// A field holds a JSON value of the wrong type.
    #[error("config field `{field}` must be {expected}, found {found}")]
    WrongType {
        /// The field name as spelled in `config.json`.
        field: String,
        /// The JSON type we need, e.g. "a non-negative integer".
        expected: &'static str,
        /// The JSON value we found.
        found: String,
    },
    /// A field has the right type but an unusable value.
    #[error("config field `{field}` is invalid: {reason}")]
    InvalidValue {
        /// The field name as spelled in `config.json`.
        field: String,
        /// Why the value is rejected.
        reason: String,
    },
    /// Two accepted spellings of one concept are both present and disagree.
    #[error("config fields `{first}` and `{second}` are both set and disagree ({a} vs {b})")]
    ConflictingFields {
        /// The first spelling.
        first: &'static str,
        /// The second spelling.
        second: &'static str,
        /// The value under `first`.
        a: String,
        /// The value under `second`.
        b: String,
    },
    /// A tensor the model needs is absent from the weight source.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// The HF tensor name.
        name: String,
    },
    /// A checkpoint tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// The HF tensor name.
        name: String,
        /// The shape the model needs.
        expected: Vec<usize>,
        /// The shape found in the checkpoint.
        found: Vec<usize>,
    },
    /// The weight source failed to produce a tensor (I/O, dtype, corrupt data).
    #[error("cannot read tensor `{name}`: {reason}")]
    TensorRead {
        /// The HF tensor name.
        name: String,
        /// What went wrong.
        reason: String,
    },
    /// Routed experts are stored both stacked and per expert in one checkpoint
    /// (docs/models.md §HF tensor names).
    #[error(
        "experts under `{prefix}` mix the stacked layout (`{stacked}`) with per-expert tensors \
         (`{per_expert}`); a checkpoint must use one layout"
    )]
    MixedExpertLayout {
        /// The `...mlp.experts` prefix.
        prefix: String,
        /// A stacked tensor that is present.
        stacked: String,
        /// A per-expert tensor that is present.
        per_expert: String,
    },
    /// A caller-provided input (token ids, labels, generation settings) is unusable.
    #[error("invalid input `{what}`: {reason}")]
    InvalidInput {
        /// Which input.
        what: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A parallel layout this model cannot run under: a degree that does not divide what it
    /// splits (`tp` and the attention heads, ...) or a kind of parallelism that is not
    /// implemented (`pp`, `cp`).
    #[error("invalid parallel layout (`{field}`): {reason}")]
    Layout {
        /// The layout degree at fault (`tp`, `ep`, `pp`/`cp`, ...).
        field: &'static str,
        /// Why the model cannot be split this way, with the numbers involved.
        reason: String,
    },
    /// A valid request this model or code path does not implement (e.g. FP8 compute for a
    /// model without it, or two options that cannot be combined).
    #[error("`{feature}` is not supported: {reason}")]
    Unsupported {
        /// The feature or option asked for, as spelled in the API (`fp8`, `muon`, ...).
        feature: &'static str,
        /// What is missing.
        reason: String,
    },
    /// A step's loss (or one of its router / MTP losses) is NaN or infinite on some rank: the
    /// step was refused on every rank before the optimizer updated anything (Megatron's
    /// `--check-for-nan-in-loss-and-grad`). Non-finite gradients arrive as
    /// [`moe_backend::BackendError::NonFiniteGradients`] inside [`ModelError::Backend`].
    #[error(
        "non-finite {what} on rank {rank}: the step was refused before the optimizer updated \
         anything"
    )]
    NonFiniteLoss {
        /// Which value: `loss`, `aux loss`, `MTP loss` or `objective` (a loss hook's).
        what: String,
        /// The lowest global rank that saw it.
        rank: usize,
    },
    /// Packing information or an attention mask is unusable (the error names the field).
    #[error("invalid packing: {0}")]
    Packing(#[from] crate::packing::PackingError),
    /// An MoE layer of `moe-backend` reported an error.
    #[error("MoE layer: {0}")]
    Backend(#[from] moe_backend::BackendError),
    /// A parameter that the model's parallel plan does not classify (or classifies twice).
    #[error(transparent)]
    Plan(#[from] crate::param_plan::PlanError),
    /// A checkpoint-format error of moe-bridge (reading, validating or writing a checkpoint),
    /// as the bridge reported it: its message names the file and tensor.
    #[error(transparent)]
    Bridge(#[from] moe_bridge::BridgeError),
}

impl ModelError {
    /// Whether the error is a refused non-finite step (loss or gradients): a
    /// [`Trainer`](crate::train::Trainer) step that failed this way changed nothing.
    pub fn is_non_finite(&self) -> bool {
        matches!(
            self,
            ModelError::NonFiniteLoss { .. }
                | ModelError::Backend(moe_backend::BackendError::NonFiniteGradients { .. })
        )
    }

    /// Wraps `self` with the path of the file it was found in.
    pub fn in_file(self, path: impl Into<PathBuf>) -> Self {
        ModelError::InFile {
            path: path.into(),
            source: Box::new(self),
        }
    }

    /// Shorthand for [`ModelError::Layout`].
    pub(crate) fn layout(field: &'static str, reason: impl Into<String>) -> Self {
        ModelError::Layout {
            field,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`ModelError::Unsupported`].
    pub(crate) fn unsupported(feature: &'static str, reason: impl Into<String>) -> Self {
        ModelError::Unsupported {
            feature,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`ModelError::InvalidInput`].
    pub(crate) fn input(what: &'static str, reason: impl Into<String>) -> Self {
        ModelError::InvalidInput {
            what,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`ModelError::InvalidValue`].
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ModelError::InvalidValue {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
