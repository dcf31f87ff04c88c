//! The small JSON training state of a training checkpoint (step, data-loader position, RNG
//! seed), stored in the index's `objects` under [`TRAIN_STATE_OBJECT`]. moe-models saves and
//! restores the tensors of a trainer around it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::load::DistCheckpoint;
use crate::BridgeError;

/// Key of [`TrainState`] in the index's `objects`.
pub const TRAIN_STATE_OBJECT: &str = "train_state";

/// Small JSON training state saved with the tensors.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Position of the data loader: global batches consumed (the next batch's index).
    pub data_position: u64,
    /// Seed of the run's random streams (data order, sampling).
    pub rng_seed: u64,
    /// Anything else the training loop needs to resume (scheduler, router statistics, …).
    #[serde(default)]
    pub extra: BTreeMap<String, Value>,
}

/// The [`TrainState`] stored in `ckpt`, if any.
pub fn read_train_state(ckpt: &DistCheckpoint) -> Result<Option<TrainState>, BridgeError> {
    let Some(value) = ckpt.index().objects.get(TRAIN_STATE_OBJECT) else {
        return Ok(None);
    };
    serde_json::from_value(value.clone())
        .map(Some)
        .map_err(|e| BridgeError::TrainState {
            path: ckpt.dir().to_path_buf(),
            field: format!("objects.{TRAIN_STATE_OBJECT}"),
            reason: e.to_string(),
        })
}
