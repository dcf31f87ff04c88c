//! Building blocks shared by the model families (models.md §1).

pub mod mlp;
pub mod rms_norm;

pub use mlp::{Mlp, MlpConfig};
pub use rms_norm::{RmsNorm, RmsNormConfig};
