//! Checkpoint I/O for burn-moe: HuggingFace safetensors checkpoints in and out, and (later) the
//! distributed checkpoint format of checkpoints.md §6.
//!
//! - [`safetensors`]: header parsing and validation that never panics on bad input and accepts
//!   the FP8 dtypes of release checkpoints.
//!
//! Errors are one [`BridgeError`] enum whose messages name the file and tensor involved.

mod error;
pub mod safetensors;

pub use error::BridgeError;
