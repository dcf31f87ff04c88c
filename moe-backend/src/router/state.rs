//! Mutable per-layer router state that is not a parameter: expert-bias token counts
//! (docs/routing-and-dispatch.md §Aux-loss-free expert bias), global-aux-loss running counts
//! (§Load-balancing losses and z-loss) and the replay buffer (§Router replay).
//!
//! Design: [`TopKRouter::forward`](super::TopKRouter::forward) takes `&self` and only *reads*
//! a [`RouterState`]; everything a forward would change is returned as a
//! [`RouterStateUpdate`] inside its output, and the caller applies it with
//! [`RouterState::commit`]. Forwards stay pure (a repeated forward, e.g. an activation
//! recompute or an evaluation pass, changes nothing unless committed), clones of the module
//! never share hidden state, and distributed code can reduce the counts before using them.

use burn::tensor::{Int, Tensor};

use super::replay::RouterReplay;
use crate::error::{BackendError, Result};

/// State changes produced by one router forward; apply them with [`RouterState::commit`].
#[derive(Clone, Debug, Default)]
pub struct RouterStateUpdate {
    /// `[E]` expert-bias counts `final_map[valid].sum(0)` of a grad-enabled forward with the
    /// expert bias enabled.
    pub expert_load: Option<Vec<f64>>,
    /// `[E]` this micro-batch's reduced `global_aux_loss` counts `c_mb`.
    pub global_aux_counts: Option<Vec<f64>>,
    /// `[T, k]` natural top-k indices when the replay mode is
    /// [`ReplayMode::Record`](super::replay::ReplayMode::Record).
    pub recorded_indices: Option<Tensor<2, Int>>,
}

/// Per-layer router state (one per [`TopKRouter`](super::TopKRouter)).
#[derive(Clone, Debug)]
pub struct RouterState {
    local_tokens_per_expert: Vec<f64>,
    global_tokens_per_expert: Vec<f64>,
    global_aux_steps: usize,
    /// Replay mode and buffer.
    pub replay: RouterReplay,
}

impl RouterState {
    /// Empty state for `num_experts` experts.
    pub fn new(num_experts: usize) -> Self {
        Self {
            local_tokens_per_expert: vec![0.0; num_experts],
            global_tokens_per_expert: vec![0.0; num_experts],
            global_aux_steps: 0,
            replay: RouterReplay::default(),
        }
    }

    /// `E`.
    pub fn num_experts(&self) -> usize {
        self.local_tokens_per_expert.len()
    }

    /// Applies the changes of one forward: accumulates expert-bias and global-aux counts and
    /// stores recorded replay indices.
    pub fn commit(&mut self, update: &RouterStateUpdate) -> Result<()> {
        let e = self.num_experts();
        for counts in [&update.expert_load, &update.global_aux_counts]
            .into_iter()
            .flatten()
        {
            if counts.len() != e {
                return Err(BackendError::Shape {
                    op: "RouterState::commit",
                    detail: format!("{} counts for {e} experts", counts.len()),
                });
            }
        }
        if let Some(load) = &update.expert_load {
            add_into(&mut self.local_tokens_per_expert, load);
        }
        if let Some(counts) = &update.global_aux_counts {
            add_into(&mut self.global_tokens_per_expert, counts);
            self.global_aux_steps += 1;
        }
        if let Some(idx) = &update.recorded_indices {
            self.replay.set_indices(idx.clone());
        }
        Ok(())
    }

    /// `local_tokens_per_expert [E]`: expert-bias counts accumulated since the last update.
    pub fn local_tokens_per_expert(&self) -> &[f64] {
        &self.local_tokens_per_expert
    }

    /// Returns the accumulated expert-bias counts and resets them to zero (for distributed
    /// code that all-reduces them before
    /// [`update_expert_bias_with_counts`](super::TopKRouter::update_expert_bias_with_counts)).
    pub fn take_local_tokens_per_expert(&mut self) -> Vec<f64> {
        let e = self.num_experts();
        std::mem::replace(&mut self.local_tokens_per_expert, vec![0.0; e])
    }

    /// Running `global_aux_loss` counts `G` of the current global batch.
    pub fn global_tokens_per_expert(&self) -> &[f64] {
        &self.global_tokens_per_expert
    }

    /// Micro-batches `n` counted into [`global_tokens_per_expert`](Self::global_tokens_per_expert).
    pub fn global_aux_steps(&self) -> usize {
        self.global_aux_steps
    }

    /// Sets the running `global_aux_loss` counts `G` and their micro-batch count `n` (for
    /// callers that keep them outside the state, e.g. across the fresh states of a sharded
    /// forward).
    pub fn set_global_aux(&mut self, tokens_per_expert: &[f64], steps: usize) -> Result<()> {
        if tokens_per_expert.len() != self.num_experts() {
            return Err(BackendError::Shape {
                op: "RouterState::set_global_aux",
                detail: format!(
                    "{} counts for {} experts",
                    tokens_per_expert.len(),
                    self.num_experts()
                ),
            });
        }
        self.global_tokens_per_expert = tokens_per_expert.to_vec();
        self.global_aux_steps = steps;
        Ok(())
    }

    /// Resets the global-aux-loss counts; call once per global batch.
    pub fn reset_global_aux(&mut self) {
        self.global_tokens_per_expert
            .iter_mut()
            .for_each(|c| *c = 0.0);
        self.global_aux_steps = 0;
    }
}

fn add_into(acc: &mut [f64], values: &[f64]) {
    acc.iter_mut().zip(values).for_each(|(a, v)| *a += v);
}
