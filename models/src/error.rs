//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a model configuration or building a model.
///
/// Config errors name the offending `config.json` field (or fields), so a user can fix the file
/// without reading our source.
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
}

impl ModelError {
    /// Wraps `self` with the path of the file it was found in.
    pub fn in_file(self, path: impl Into<PathBuf>) -> Self {
        ModelError::InFile {
            path: path.into(),
            source: Box::new(self),
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
