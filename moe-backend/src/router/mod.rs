//! Phase 1 of an MoE layer, **route**: [`TopKRouter`] (Megatron-Core `TopKRouter`;
//! docs/routing-and-dispatch.md, from §Gating to §Aux-loss-free expert bias, and §Router replay).
//!
//! One forward runs, in Megatron's order: gating `logits = x·Wᵀ (+ b)` in the router dtype →
//! z-loss → score function + (group-limited) top-k or replayed indices → capacity dropping /
//! padding → load-balancing losses (attached to `probs`) → expert-bias counting.
//!
//! | file | concern |
//! |---|---|
//! | [`config`] | [`TopKRouterConfig`] and its validation |
//! | [`scoring`] | gating, score functions, top-k probs, aux-loss scores |
//! | [`topk`] | plain and group-limited top-k, [`compute_routing`] |
//! | [`capacity`] | capacity formula, dropping and padding |
//! | [`aux_loss`] | switch loss and its three forms, z-loss |
//! | [`expert_bias`] | aux-loss-free bias update |
//! | [`replay`] | router replay |
//! | [`state`] | [`RouterState`]: counts and replay buffer kept across forwards |
//!
//! **State design.** Parameters (gating weight, optional bias, expert bias) live in the
//! [`TopKRouter`] module; the expert bias is a `Param` that never requires a gradient so it is
//! saved and loaded with the module. Everything else that changes across forwards lives in a
//! caller-owned [`RouterState`]: `forward(&self, …, &RouterState, …)` only reads it and returns
//! a [`RouterStateUpdate`] that the caller commits (see [`state`] for why).
//!
//! **Gradients.** The losses are computed only when the logits are tracked by autodiff (the
//! Burn counterpart of Megatron's `training and torch.is_grad_enabled()`); they are attached
//! with [`attach_loss`] (`MoEAuxLossAutoScaler`) and never enter the main loss.

pub mod aux_loss;
pub mod capacity;
pub mod config;
pub mod expert_bias;
pub mod replay;
pub mod scoring;
pub mod state;
pub mod topk;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

use burn::module::{Module, Param};
use burn::tensor::{Bool, Int, Tensor};

pub use aux_loss::{CountGroup, CountReducer, RouterLoss, RouterLossKind, switch_loss};
pub use config::{AuxLossSpec, AuxLossType, DropPolicy, GroupLimitConfig, TopKRouterConfig};
pub use replay::{ReplayMode, RouterReplay};
pub use scoring::{ScoreFunction, ScoreSpec};
pub use state::{RouterState, RouterStateUpdate};
pub use topk::{Routing, compute_routing};

use crate::error::{BackendError, Result};
use crate::ops::{attach_loss, int_tensor_to_usize, routing_map_from_indices, topk_indices};
use aux_loss::{AuxInputs, GlobalCounts, LossContext, column_counts, load_balancing_loss};
use capacity::{CapacitySpec, apply_capacity};

/// Top-k router (docs/routing-and-dispatch.md, from §Gating to §Aux-loss-free expert bias, and
/// §Router replay). Create it with [`TopKRouterConfig::init`].
#[derive(Module, Debug)]
pub struct TopKRouter {
    /// `[E, H]` gating weight, PyTorch orientation (`logits = x·Wᵀ`).
    pub weight: Param<Tensor<2>>,
    /// `[E]` optional gating bias.
    pub bias: Option<Param<Tensor<1>>>,
    /// `[E]` f32 aux-loss-free expert bias (selection only; no gradient, never optimised);
    /// `None` unless [`TopKRouterConfig::enable_expert_bias`].
    pub expert_bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    config: TopKRouterConfig,
}

/// Per-call inputs of [`TopKRouter::forward`] besides the tokens.
#[derive(Clone)]
pub struct RouteOptions<'a> {
    /// `[T]` padding mask, `true` = padded row (Megatron's convention). Padded rows are left out of
    /// the losses, the counts and the capacity competition
    /// (docs/routing-and-dispatch.md §Load-balancing losses and z-loss). In a group whose counts
    /// are summed (`tp_cp`, `tp_dp_cp`) every rank passes a mask or none: with masks the ranks may
    /// hold different numbers of valid rows, so the loss token totals come from the summed counts
    /// and the z-loss sums its row count over `tp_cp`.
    pub padding_mask: Option<Tensor<1, Bool>>,
    /// `B`, sequences in the micro-batch; rows are `t = s·B + b` unless
    /// [`row_sequences`](Self::row_sequences) is set (used by `seq_aux_loss`).
    pub batch_size: usize,
    /// `[T]` the sequence (`0..B`) of each row, for other row orders (used by
    /// `seq_aux_loss`; e.g. a sequence-parallel slice of batch-major rows).
    pub row_sequences: Option<&'a [usize]>,
    /// Upstream gradient of the attached losses: the trainer's main-loss backward scale
    /// (the attachment of docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
    pub grad_scale: f64,
    /// Sums aux-loss counts over process groups; required when a group size is > 1.
    pub count_reducer: Option<&'a dyn CountReducer>,
    /// Compute the training-only outputs (router losses, expert-bias counts) even when the
    /// input is not recorded for a backward pass: the first pass of a recomputed region
    /// ([`crate::recompute`]), whose second pass does the recording.
    pub training: bool,
}

impl Default for RouteOptions<'_> {
    fn default() -> Self {
        Self {
            padding_mask: None,
            batch_size: 1,
            row_sequences: None,
            grad_scale: 1.0,
            count_reducer: None,
            training: false,
        }
    }
}

impl<'a> RouteOptions<'a> {
    /// Sets the `[T]` padding mask (`true` = padded).
    pub fn with_padding_mask(mut self, mask: Tensor<1, Bool>) -> Self {
        self.padding_mask = Some(mask);
        self
    }

    /// Computes the training-only outputs without a recorded input ([`Self::training`]).
    pub fn with_training(mut self, training: bool) -> Self {
        self.training = training;
        self
    }

    /// Sets the number of sequences `B`.
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Sets the sequence of each row (`seq_aux_loss` with rows not in `[S, B]` order).
    pub fn with_row_sequences(mut self, rows: &'a [usize]) -> Self {
        self.row_sequences = Some(rows);
        self
    }

    /// Sets the gradient scale of the attached losses.
    pub fn with_grad_scale(mut self, grad_scale: f64) -> Self {
        self.grad_scale = grad_scale;
        self
    }

    /// Sets the count reducer used for group sizes > 1.
    pub fn with_count_reducer(mut self, reducer: &'a dyn CountReducer) -> Self {
        self.count_reducer = Some(reducer);
        self
    }
}

/// Result of a router forward.
#[derive(Clone, Debug)]
pub struct RouterOutput {
    /// `[T, E]` logits in the router dtype (z-loss attached).
    pub logits: Tensor<2>,
    /// `[T, E]` routing weights, zero outside `routing_map`, differentiable w.r.t. the gate
    /// parameters and the input; the load-balancing losses are attached to it.
    pub probs: Tensor<2>,
    /// `[T, E]` final selection (after capacity).
    pub routing_map: Tensor<2, Bool>,
    /// `[T, k]` natural (or replayed) selection before capacity, descending score.
    pub topk_indices: Tensor<2, Int>,
    /// `[E]` `routing_map.sum(0)`.
    pub tokens_per_expert: Vec<usize>,
    /// Expert capacity, when a capacity factor is set.
    pub capacity: Option<usize>,
    /// Losses computed by this forward (empty unless grad-enabled), for logging.
    pub losses: Vec<RouterLoss>,
    /// State changes to apply with [`RouterState::commit`].
    pub state_update: RouterStateUpdate,
}

impl RouterOutput {
    /// The logged loss of one kind, if it was computed.
    pub fn loss(&self, kind: RouterLossKind) -> Option<&RouterLoss> {
        self.losses.iter().find(|l| l.kind == kind)
    }
}

/// Valid (non-padded) rows of a forward.
struct ValidRows {
    /// `[T, 1]`, true = valid.
    rows: Tensor<2, Bool>,
    /// `[T, E]`, true = valid.
    cells: Tensor<2, Bool>,
    count: usize,
}

impl TopKRouter {
    /// The configuration the router was created with.
    pub fn config(&self) -> &TopKRouterConfig {
        &self.config
    }

    /// Sets the router's training losses and the sizes of the groups their counts are summed
    /// over (a sharded model's router: `tp_cp` / `tp_dp_cp` of its rank): the load-balancing
    /// losses `aux_losses` and the z-loss coefficient. The rest of the configuration (and the
    /// parameters) is unchanged; the result is validated.
    pub fn set_losses(
        &mut self,
        aux_losses: Vec<AuxLossSpec>,
        z_loss_coeff: Option<f64>,
        tp_cp_size: usize,
        tp_dp_cp_size: usize,
    ) -> crate::Result<()> {
        let mut config = self.config.clone();
        config.aux_losses = aux_losses;
        config.z_loss_coeff = z_loss_coeff;
        config.tp_cp_size = tp_cp_size;
        config.tp_dp_cp_size = tp_dp_cp_size;
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// Sets the aux-loss-free balancing rate (`bias += rate · sign(mean(c) − c)` per update;
    /// Megatron's `moe_router_bias_update_rate`); validated.
    pub fn set_expert_bias_update_rate(&mut self, rate: f64) -> crate::Result<()> {
        let mut config = self.config.clone();
        config.expert_bias_update_rate = rate;
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// A fresh [`RouterState`] for this router.
    pub fn init_state(&self) -> RouterState {
        RouterState::new(self.config.num_experts)
    }

    /// Routes `x [S, B, H]` (Megatron layout); rows are flattened as `t = s·B + b` and
    /// `options.batch_size` is set to `B`.
    pub fn forward_sbh(
        &self,
        x: Tensor<3>,
        state: &RouterState,
        options: &RouteOptions<'_>,
    ) -> Result<RouterOutput> {
        let [s, b, h] = x.dims();
        let options = options.clone().with_batch_size(b);
        self.forward(x.reshape([s * b, h]), state, &options)
    }

    /// Routes `x [T, H]` (docs/routing-and-dispatch.md, from §Gating to §Router replay). Reads
    /// `state` (global-aux counts, replay buffer); returns the decisions, the logged losses and the
    /// state update to commit.
    pub fn forward(
        &self,
        x: Tensor<2>,
        state: &RouterState,
        options: &RouteOptions<'_>,
    ) -> Result<RouterOutput> {
        let cfg = &self.config;
        let (e, k) = (cfg.num_experts, cfg.topk);
        let [t, h] = x.dims();
        let shape_err = |detail: String| BackendError::Shape {
            op: "TopKRouter::forward",
            detail,
        };
        if h != cfg.hidden_size {
            return Err(shape_err(format!(
                "input has {h} features, hidden_size is {}",
                cfg.hidden_size
            )));
        }
        if state.num_experts() != e {
            return Err(shape_err(format!(
                "state has {} experts, router {e}",
                state.num_experts()
            )));
        }
        if options.batch_size == 0 {
            return Err(shape_err("batch_size must be ≥ 1".into()));
        }
        let valid = valid_rows(options.padding_mask.as_ref(), t, e)?;
        let n_valid = valid.as_ref().map_or(t, |v| v.count);
        let logits = scoring::gating(
            x,
            self.weight.val(),
            self.bias.as_ref().map(Param::val),
            cfg.router_dtype,
        );
        let grad_enabled = logits.is_tracked() || options.training;
        // Per-token-loss mode pre-multiplies attached losses by valid_tokens·|tp_cp|
        // (docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
        let token_scale = if cfg.per_token_loss {
            (n_valid * cfg.tp_cp_size) as f64
        } else {
            1.0
        };
        let mut losses = Vec::new();

        // 1. z-loss, attached to the logits: the mean over the valid rows of `tp_cp`. With a
        // padding mask the ranks may hold different numbers of valid rows, so their count is
        // summed over `tp_cp` (every rank of the group passes a mask or none).
        let logits = match cfg.z_loss_coeff {
            Some(coeff) if coeff > 0.0 && grad_enabled => {
                let rows = valid.as_ref().map(|v| v.rows.clone());
                let (rows_total, coeff_share) = match (&valid, options.count_reducer) {
                    (Some(_), Some(reducer)) if cfg.tp_cp_size > 1 => {
                        let mut total = [n_valid as f64];
                        reducer.all_reduce_sum(CountGroup::TpCp, &mut total)?;
                        (total[0] as usize, coeff)
                    }
                    _ => (n_valid, coeff / cfg.tp_cp_size as f64),
                };
                let z = aux_loss::z_loss(logits.clone(), rows, rows_total, coeff_share);
                losses.push(RouterLoss {
                    kind: RouterLossKind::Z,
                    coeff,
                    loss: z.clone().detach(),
                });
                attach_loss(logits, z.mul_scalar(token_scale), options.grad_scale)
            }
            _ => logits,
        };

        // 2. Score function + top-k, or replayed indices.
        let forced = match state.replay.mode() {
            ReplayMode::ReplayForward => Some(state.replay.replay_indices(t, k, e)?),
            _ => None,
        };
        let routing = compute_routing(
            logits.clone(),
            &cfg.score_spec(),
            k,
            cfg.group_limit.as_ref(),
            self.expert_bias.as_ref().map(Param::val),
            forced,
        )?;

        // 3. Capacity.
        let (mut probs, routing_map, capacity) = match cfg.effective_capacity_factor() {
            None => (routing.probs, routing.routing_map, None),
            Some(capacity_factor) => {
                let spec = CapacitySpec {
                    capacity_factor,
                    min_capacity: cfg.min_capacity,
                    drop_policy: cfg.drop_policy,
                    pad_to_capacity: cfg.pad_to_capacity,
                };
                let v = valid.as_ref().map(|v| (v.cells.clone(), v.count));
                let d = apply_capacity(routing.probs, routing.routing_map, v, k, &spec)?;
                (d.probs, d.routing_map, Some(d.capacity))
            }
        };

        // 4. Load-balancing losses, attached to the probs.
        let mut global_aux_counts = None;
        if grad_enabled && cfg.has_aux_loss() {
            let inputs = self.aux_inputs(logits.clone(), valid.as_ref(), n_valid)?;
            let ctx = LossContext {
                num_experts: e,
                topk: k,
                tp_cp_size: cfg.tp_cp_size,
                tp_dp_cp_size: cfg.tp_dp_cp_size,
                batch_size: options.batch_size,
                row_sequences: options.row_sequences,
                reducer: options.count_reducer,
                padded: valid.is_some(),
            };
            let global = GlobalCounts {
                tokens_per_expert: state.global_tokens_per_expert(),
                steps: state.global_aux_steps(),
            };
            for spec in cfg.aux_losses.iter().filter(|s| s.coeff != 0.0) {
                let (loss, counts) =
                    load_balancing_loss(spec.kind, spec.coeff, &inputs, &ctx, global)?;
                if counts.is_some() {
                    global_aux_counts = counts;
                }
                losses.push(RouterLoss {
                    kind: spec.kind.into(),
                    coeff: spec.coeff,
                    loss: loss.clone().detach(),
                });
                probs = attach_loss(probs, loss.mul_scalar(token_scale), options.grad_scale);
            }
        }

        // 5. Expert-bias counts of the final map's valid rows.
        let expert_load = (grad_enabled && self.expert_bias.is_some()).then(|| {
            column_counts(match &valid {
                Some(v) => routing_map.clone().bool_and(v.cells.clone()),
                None => routing_map.clone(),
            })
        });
        let recorded_indices =
            (state.replay.mode() == ReplayMode::Record).then(|| routing.indices.clone());
        let tokens_per_expert =
            int_tensor_to_usize(routing_map.clone().int().sum_dim(0).reshape([e]));
        Ok(RouterOutput {
            logits,
            probs,
            routing_map,
            topk_indices: routing.indices,
            tokens_per_expert,
            capacity,
            losses,
            state_update: RouterStateUpdate {
                expert_load,
                global_aux_counts,
                recorded_indices,
            },
        })
    }

    /// Aux-loss inputs `P` and `M`
    /// (docs/routing-and-dispatch.md §Load-balancing losses and z-loss), with padded rows zeroed /
    /// unselected.
    fn aux_inputs(
        &self,
        logits: Tensor<2>,
        valid: Option<&ValidRows>,
        n_valid: usize,
    ) -> Result<AuxInputs> {
        let scores = scoring::aux_loss_scores(logits, self.config.score_function);
        let idx = topk_indices(scores.clone().detach(), self.config.topk)?;
        let topk_map = routing_map_from_indices(idx, self.config.num_experts);
        Ok(match valid {
            Some(v) => AuxInputs {
                scores: scores.mask_fill(v.cells.clone().bool_not(), 0.0),
                topk_map: topk_map.bool_and(v.cells.clone()),
                num_valid: n_valid,
            },
            None => AuxInputs {
                scores,
                topk_map,
                num_valid: n_valid,
            },
        })
    }
}

/// Checks a `[T]` padding mask (`true` = padded) and turns it into valid-row masks.
fn valid_rows(mask: Option<&Tensor<1, Bool>>, t: usize, e: usize) -> Result<Option<ValidRows>> {
    let Some(mask) = mask else {
        return Ok(None);
    };
    if mask.dims() != [t] {
        return Err(BackendError::Shape {
            op: "TopKRouter::forward",
            detail: format!("padding mask has shape {:?}, expected [{t}]", mask.dims()),
        });
    }
    let rows = mask.clone().bool_not().reshape([t, 1]);
    let count = int_tensor_to_usize(rows.clone().int().sum())
        .first()
        .copied()
        .unwrap_or(0);
    Ok(Some(ValidRows {
        cells: rows.clone().expand([t, e]),
        rows,
        count,
    }))
}
