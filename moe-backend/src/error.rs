//! Errors of the `moe-backend` crate.

use thiserror::Error;

/// Everything that can go wrong in `moe-backend` on bad input or configuration.
///
/// Messages name the operation, argument or configuration field involved.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BackendError {
    /// A tensor argument has the wrong rank, shape or length.
    #[error("{op}: {detail}")]
    Shape {
        /// Operation that rejected the input.
        op: &'static str,
        /// What was expected and what was given.
        detail: String,
    },
    /// Group or split sizes do not add up to the number of rows.
    #[error("{op}: sizes sum to {sum} but the input has {rows} rows")]
    SizeSum {
        /// Operation that rejected the input.
        op: &'static str,
        /// Σ sizes.
        sum: usize,
        /// Rows of the input.
        rows: usize,
    },
    /// An index is out of range or a permutation is malformed.
    #[error("{op}: {detail}")]
    Index {
        /// Operation that rejected the input.
        op: &'static str,
        /// The offending index and the valid range.
        detail: String,
    },
    /// An inconsistent configuration value.
    #[error("invalid config field `{field}`: {detail}")]
    Config {
        /// Name of the configuration field.
        field: &'static str,
        /// Why the value is rejected.
        detail: String,
    },
    /// Router replay was asked for decisions that were not recorded.
    #[error("router replay: {0}")]
    Replay(String),
}

/// Shorthand result type of this crate.
pub type Result<T> = core::result::Result<T, BackendError>;
