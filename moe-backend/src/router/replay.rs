//! Router replay (docs/routing-and-dispatch.md §Router replay): record the natural top-k indices of
//! a forward, or force the indices of a later forward (e.g. to reproduce an inference engine's
//! routing in RL).

use burn::tensor::{Int, Tensor};

use crate::error::{BackendError, Result};
use crate::ops::int_tensor_to_usize;

/// What a router forward does with its replay buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplayMode {
    /// Normal routing; the buffer is ignored.
    #[default]
    Off,
    /// Normal routing; the natural indices `[T, k]` are stored when the forward is committed.
    Record,
    /// The stored indices replace the top-k selection (`REPLAY_FORWARD`); probs are gathered
    /// at them and normalised / scaled as usual.
    ReplayForward,
}

/// Per-layer replay buffer: one `[T, k]` index tensor, recorded or forced.
///
/// Megatron's `REPLAY_BACKWARD` (popping indices during activation recompute) has no
/// counterpart: Burn recomputes inside the autodiff graph and never calls the router again.
#[derive(Clone, Debug, Default)]
pub struct RouterReplay {
    mode: ReplayMode,
    indices: Option<Tensor<2, Int>>,
}

impl RouterReplay {
    /// The current mode.
    pub fn mode(&self) -> ReplayMode {
        self.mode
    }

    /// Sets the mode of the following forwards.
    pub fn set_mode(&mut self, mode: ReplayMode) {
        self.mode = mode;
    }

    /// The stored indices `[T, k]`, if any.
    pub fn indices(&self) -> Option<&Tensor<2, Int>> {
        self.indices.as_ref()
    }

    /// Stores indices `[T, k]` to replay: recorded ones, or forced ones from elsewhere.
    pub fn set_indices(&mut self, indices: Tensor<2, Int>) {
        self.indices = Some(indices);
    }

    /// Drops the stored indices.
    pub fn clear(&mut self) {
        self.indices = None;
    }

    /// The stored indices checked for a `[T, k]` routing over `num_experts` experts: right
    /// shape, in range, distinct within each row.
    pub fn replay_indices(&self, t: usize, k: usize, num_experts: usize) -> Result<Tensor<2, Int>> {
        let idx = self.indices.clone().ok_or_else(|| {
            BackendError::Replay("replay requested but nothing was recorded".into())
        })?;
        if idx.dims() != [t, k] {
            return Err(BackendError::Replay(format!(
                "stored indices have shape {:?}, the forward needs [{t}, {k}]",
                idx.dims()
            )));
        }
        let host = int_tensor_to_usize(idx.clone().clamp_min(-1).add_scalar(1));
        for (row, chunk) in host.chunks(k.max(1)).enumerate() {
            for (j, &v) in chunk.iter().enumerate() {
                if v == 0 || v > num_experts {
                    return Err(BackendError::Replay(format!(
                        "row {row}: expert index out of range 0..{num_experts}"
                    )));
                }
                if chunk[..j].contains(&v) {
                    return Err(BackendError::Replay(format!(
                        "row {row}: expert {} selected twice",
                        v - 1
                    )));
                }
            }
        }
        Ok(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn router_replay_rejects_missing_misshaped_and_invalid_indices() {
        let device = Device::flex();
        let mut replay = RouterReplay::default();
        assert!(matches!(
            replay.replay_indices(2, 2, 4),
            Err(BackendError::Replay(_))
        ));
        replay.set_indices(Tensor::from_data([[0, 1], [2, 3]], &device));
        assert!(replay.replay_indices(2, 2, 4).is_ok());
        assert!(matches!(
            replay.replay_indices(3, 2, 4),
            Err(BackendError::Replay(_))
        ));
        assert!(matches!(
            replay.replay_indices(2, 1, 4),
            Err(BackendError::Replay(_))
        ));
        assert!(matches!(
            replay.replay_indices(2, 2, 3),
            Err(BackendError::Replay(_))
        ));
        replay.set_indices(Tensor::from_data([[0, 0], [2, 3]], &device));
        assert!(matches!(
            replay.replay_indices(2, 2, 4),
            Err(BackendError::Replay(_))
        ));
        replay.set_indices(Tensor::from_data([[-1, 0], [2, 3]], &device));
        assert!(matches!(
            replay.replay_indices(2, 2, 4),
            Err(BackendError::Replay(_))
        ));
        replay.clear();
        assert!(replay.indices().is_none());
    }
}
