//! Training checkpoints of these models on moe-bridge's distributed checkpoint format
//! (docs/checkpoints.md §Training checkpoints).
//!
//! - [`placement`]: where each parameter of a rank's model shard lies in the canonical,
//!   layout-independent tensors ([`PlacedModel`], from the model's parallel plan): the model's
//!   plan applied to the bridge's generic box and chunk machinery.
//! - [`train_state`]: parameters, ZeRO-1 optimizer state (`optim.<state>.<fqn>`) and the
//!   bridge's [`TrainState`](moe_bridge::dist::TrainState), saved by every rank and restored
//!   under any layout ([`save_trainer`], [`restore_trainer`]).

pub mod placement;
pub mod train_state;

pub use placement::PlacedModel;
pub use train_state::{
    load_model_state, load_optimizer_state, restore_trainer, save_trainer, save_training_state,
};
