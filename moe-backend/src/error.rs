//! Errors of the `moe-backend` crate.

use thiserror::Error;

/// Everything that can go wrong in `moe-backend` on bad input or configuration.
///
/// Messages name the operation, argument or configuration field involved.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BackendError {
    /// The global gradient norm of a step is NaN or infinite: the optimizer refused the step
    /// before updating anything (Megatron's `--check-for-nan-in-loss-and-grad`). Every rank
    /// sees the same norm, so every rank refuses the same step.
    #[error(
        "{op}: the global gradient norm is {norm} (non-finite gradients in {groups}{}); the \
         step was refused before any parameter or optimizer state changed",
        rank.map_or(String::new(), |r| format!(", first on rank {r}"))
    )]
    NonFiniteGradients {
        /// The optimizer.
        op: &'static str,
        /// The global gradient norm.
        norm: f64,
        /// The lowest global rank whose gradient shards hold non-finite values, when known.
        rank: Option<usize>,
        /// Which parameter groups hold non-finite gradients on some rank (e.g. `dense
        /// parameters`, `expert parameters`, `Muon matrices`).
        groups: String,
    },
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
    /// An impossible parallel layout or group request.
    #[error("invalid parallel layout (`{field}`): {detail}")]
    Layout {
        /// Layout field or argument at fault (`tp`, `world`, `order`, ...).
        field: &'static str,
        /// Why it is rejected.
        detail: String,
    },
    /// A collective was called with arguments that are invalid or disagree across ranks
    /// (order, op, dtype, shapes, splits).
    #[error("{op} on group {group}: {detail}")]
    Collective {
        /// Collective name.
        op: &'static str,
        /// Global ranks of the group.
        group: String,
        /// What disagrees, naming ranks and call sites.
        detail: String,
    },
    /// Another rank failed, so the collective was abandoned.
    #[error("{op} on group {group} abandoned: rank {rank} failed: {reason}")]
    Aborted {
        /// Collective that was pending or being started.
        op: &'static str,
        /// Global ranks of the group.
        group: String,
        /// The rank that failed first.
        rank: usize,
        /// Its error or panic message.
        reason: String,
    },
    /// A collective did not complete within the world's timeout.
    #[error(
        "{op} on group {group} timed out after {seconds:.1} s waiting for ranks {waiting:?} (called at {site})"
    )]
    Timeout {
        /// Collective name.
        op: &'static str,
        /// Global ranks of the group.
        group: String,
        /// Ranks that never joined.
        waiting: Vec<usize>,
        /// Timeout in seconds.
        seconds: f64,
        /// Call site of the waiting rank.
        site: String,
    },
    /// The GPU runtime cannot serve this process: no driver, no device, or fewer devices than
    /// ranks on this node (see [`crate::devices`]).
    #[error(transparent)]
    Device(#[from] crate::devices::DeviceError),
    /// A rank's closure panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// Panic payload, when it was a string.
        message: String,
    },
}

/// Shorthand result type of this crate.
pub type Result<T> = core::result::Result<T, BackendError>;
