//! [`MoeLayer`]: route → dispatch (permute) → experts → combine (unpermute), plus shared
//! experts, on one rank (docs/routing-and-dispatch.md §The MoE layer forward).

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::dispatch::{LocalDispatcher, TokenDispatcher};
use crate::error::BackendError;
use crate::experts::{
    ExpertActivation, GroupedExperts, GroupedExpertsConfig, SharedExperts, SharedExpertsConfig,
};
use crate::fp8::Fp8Recipe;
use crate::router::{RouteOptions, RouterOutput, RouterState, TopKRouter, TopKRouterConfig};

/// Configuration of a [`MoeLayer`].
#[derive(Config, Debug)]
pub struct MoeLayerConfig {
    /// Router configuration (also fixes `hidden_size`, `num_experts` and `topk`).
    pub router: TopKRouterConfig,
    /// Expert FFN width `F` (`moe_ffn_hidden_size`).
    pub ffn_hidden_size: usize,
    /// Expert activation ([`ExpertActivation::clamped_swiglu`] for gpt-oss's clamped SwiGLU).
    #[config(default = "ExpertActivation::SwiGlu")]
    pub activation: ExpertActivation,
    /// Per-expert `fc1` / `fc2` biases (gpt-oss's `gate_up_proj_bias` / `down_proj_bias`).
    #[config(default = false)]
    pub experts_bias: bool,
    /// Width of the shared-expert MLP (`moe_ffn_hidden_size · n_shared`), if any.
    #[config(default = "None")]
    pub shared_ffn_hidden_size: Option<usize>,
    /// Gate the shared-expert output with `sigmoid(x · g)`.
    #[config(default = false)]
    pub shared_gate: bool,
    /// Standard deviation of the expert weight initialisation.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// FP8 recipe for the routed experts' GEMMs (`None`: high precision). The router, the
    /// shared experts and the combine stay in high precision (docs/fp8.md §Selective precision).
    #[config(default = "None")]
    pub fp8: Option<Fp8Recipe>,
}

impl MoeLayerConfig {
    /// Builds the layer, validating every sub-configuration.
    pub fn init(&self, device: &Device) -> crate::Result<MoeLayer> {
        let router = self.router.init(device)?;
        let experts = GroupedExpertsConfig::new(
            self.router.num_experts,
            self.router.hidden_size,
            self.ffn_hidden_size,
        )
        .with_activation(self.activation)
        .with_bias(self.experts_bias)
        .with_init_std(self.init_std)
        .with_fp8(self.fp8)
        .init(device)?;
        let shared_experts = match self.shared_ffn_hidden_size {
            Some(f) => Some(
                SharedExpertsConfig::new(self.router.hidden_size, f)
                    .with_gate(self.shared_gate)
                    .init(device)?,
            ),
            None if self.shared_gate => {
                return Err(BackendError::Config {
                    field: "shared_gate",
                    detail: "a shared-expert gate needs shared_ffn_hidden_size".into(),
                });
            }
            None => None,
        };
        Ok(MoeLayer {
            router,
            experts,
            shared_experts,
        })
    }
}

/// Output of [`MoeLayer::forward`].
#[derive(Clone, Debug)]
pub struct MoeLayerOutput {
    /// `[T, H]` layer output (routed + shared).
    pub output: Tensor<2>,
    /// The router's decisions, logged losses and pending state update.
    pub routing: RouterOutput,
}

/// A Mixture-of-Experts layer on one rank: every expert is local (EP = 1).
///
/// ```
/// use burn::tensor::{Device, Tensor, Distribution};
/// use moe_backend::layer::MoeLayerConfig;
/// use moe_backend::router::{RouteOptions, TopKRouterConfig};
///
/// let device = Device::flex();
/// // 8 experts, top-2, hidden 16, expert width 32.
/// let layer = MoeLayerConfig::new(TopKRouterConfig::new(16, 8, 2), 32).init(&device)?;
/// let x = Tensor::<2>::random([5, 16], Distribution::Normal(0.0, 1.0), &device);
/// let state = layer.router.init_state();
/// let out = layer.forward(x, &state, &RouteOptions::default())?;
/// assert_eq!(out.output.dims(), [5, 16]);
/// assert_eq!(out.routing.tokens_per_expert.iter().sum::<usize>(), 5 * 2);
/// # Ok::<(), moe_backend::BackendError>(())
/// ```
#[derive(Module, Debug)]
pub struct MoeLayer {
    /// Top-k router.
    pub router: TopKRouter,
    /// Routed experts.
    pub experts: GroupedExperts,
    /// Optional shared experts.
    pub shared_experts: Option<SharedExperts>,
}

impl MoeLayer {
    /// The same layer with its routed-expert GEMMs in FP8 (`Some(recipe)`) or high precision.
    pub fn with_fp8_experts(mut self, recipe: Option<Fp8Recipe>) -> crate::Result<Self> {
        self.experts = self.experts.with_fp8(recipe)?;
        Ok(self)
    }

    /// `x [T, H] -> [T, H]`. Reads the router state (replay, global aux counts); apply
    /// `output.routing.state_update` to it with `RouterState::commit` after the step.
    pub fn forward(
        &self,
        x: Tensor<2>,
        state: &RouterState,
        options: &RouteOptions<'_>,
    ) -> crate::Result<MoeLayerOutput> {
        let dispatcher = LocalDispatcher::new(self.router.config().num_experts);
        self.forward_with(x, state, options, &dispatcher)
    }

    /// [`forward`](MoeLayer::forward) with expert parallelism: `dispatcher` moves the routed
    /// tokens to the ranks owning their experts, and `self.experts` holds this rank's local
    /// experts ([`GroupedExperts::shard`]). The router is replicated on every rank.
    pub fn forward_with(
        &self,
        x: Tensor<2>,
        state: &RouterState,
        options: &RouteOptions<'_>,
        dispatcher: &dyn TokenDispatcher,
    ) -> crate::Result<MoeLayerOutput> {
        self.forward_recomputing(x, state, options, dispatcher, MoeRecompute::default())
    }

    /// [`forward_with`](MoeLayer::forward_with) recomputing the parts `recompute` names in the
    /// backward pass instead of keeping their activations ([`crate::recompute`]).
    pub fn forward_recomputing(
        &self,
        x: Tensor<2>,
        state: &RouterState,
        options: &RouteOptions<'_>,
        dispatcher: &dyn TokenDispatcher,
        recompute: MoeRecompute,
    ) -> crate::Result<MoeLayerOutput> {
        let execution = MoeExecution {
            recompute,
            ..MoeExecution::default()
        };
        self.forward_executing(x, state, options, dispatcher, &execution)
    }

    /// [`forward_with`](MoeLayer::forward_with) run as `execution` says: recompute, and the
    /// shared experts overlapping the token dispatch (Megatron's `moe_shared_expert_overlap`:
    /// the dispatcher's communication runs on a scoped thread while this thread computes the
    /// shared experts; the result is the same bit for bit).
    pub fn forward_executing(
        &self,
        x: Tensor<2>,
        state: &RouterState,
        options: &RouteOptions<'_>,
        dispatcher: &dyn TokenDispatcher,
        execution: &MoeExecution<'_>,
    ) -> crate::Result<MoeLayerOutput> {
        let local = dispatcher.local_experts();
        if local.len() != self.experts.num_experts() {
            return Err(BackendError::Config {
                field: "experts",
                detail: format!(
                    "the dispatcher routes to {} local experts ({local:?}) but the layer holds {}",
                    local.len(),
                    self.experts.num_experts()
                ),
            });
        }
        let routing = self.router.forward(x.clone(), state, options)?;
        let recompute = execution.recompute;
        let event = |e: OverlapEvent| {
            if let Some(observer) = execution.observer {
                observer.event(e);
            }
        };
        let shared = |x: Tensor<2>| -> Option<Tensor<2>> {
            let shared = self.shared_experts.as_ref()?;
            event(OverlapEvent::SharedStart);
            let out = if recompute.shared_experts {
                crate::recompute::recompute_module(shared, x, |m: &SharedExperts, x| m.forward(x))
            } else {
                shared.forward(x)
            };
            event(OverlapEvent::SharedEnd);
            Some(out)
        };
        let dispatch = || {
            event(OverlapEvent::DispatchStart);
            // The router already applied capacity (dropping and padding) to the map.
            let dispatched = dispatcher.dispatch(
                x.clone(),
                routing.probs.clone(),
                routing.routing_map.clone(),
            );
            event(OverlapEvent::DispatchEnd);
            dispatched
        };
        let (dispatched, shared_out) =
            if execution.overlap_shared_experts && self.shared_experts.is_some() {
                std::thread::scope(|scope| {
                    let moving = std::thread::Builder::new()
                        .name("moe-dispatch".into())
                        .spawn_scoped(scope, dispatch)
                        .map_err(|e| BackendError::Config {
                            field: "overlap_shared_experts",
                            detail: format!("cannot start the dispatch thread: {e}"),
                        })?;
                    let shared_out = shared(x.clone());
                    let dispatched = moving.join().unwrap_or_else(|payload| {
                        // A panic in the dispatcher is the dispatcher's: raise it here.
                        std::panic::resume_unwind(payload)
                    });
                    Ok::<_, BackendError>((dispatched, shared_out))
                })?
            } else {
                let dispatched = dispatch();
                (dispatched, None)
            };
        let dispatched = dispatched?;
        let expert_out = self.experts.forward_recomputing(
            dispatched.rows,
            &dispatched.tokens_per_local_expert,
            dispatched.probs,
            recompute.activation,
        )?;
        let mut output = dispatcher.combine(expert_out, dispatched.state)?;
        let shared_out = match shared_out {
            Some(out) => Some(out),
            None => shared(x),
        };
        if let Some(shared_out) = shared_out {
            output = output + shared_out;
        }
        Ok(MoeLayerOutput { output, routing })
    }
}

/// How an MoE layer's forward runs ([`MoeLayer::forward_executing`]).
#[derive(Clone, Copy, Default)]
pub struct MoeExecution<'a> {
    /// What the layer recomputes in the backward pass.
    pub recompute: MoeRecompute,
    /// Megatron's `moe_shared_expert_overlap`: the shared experts run while the token
    /// dispatch (permute and its communication) is in flight. The backward pass is not
    /// overlapped.
    pub overlap_shared_experts: bool,
    /// Told when the dispatch and the shared experts start and end (tests, profiling).
    pub observer: Option<&'a dyn OverlapObserver>,
}

impl std::fmt::Debug for MoeExecution<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeExecution")
            .field("recompute", &self.recompute)
            .field("overlap_shared_experts", &self.overlap_shared_experts)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// The points of an MoE forward an [`OverlapObserver`] is told about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlapEvent {
    /// The token dispatch starts (on the dispatch thread when overlapped).
    DispatchStart,
    /// The token dispatch has returned.
    DispatchEnd,
    /// The shared experts start.
    SharedStart,
    /// The shared experts' output is computed.
    SharedEnd,
}

/// Receives the [`OverlapEvent`]s of an MoE forward (from the dispatch thread too).
pub trait OverlapObserver: Sync {
    /// One event.
    fn event(&self, event: OverlapEvent);
}

/// What an MoE layer recomputes in the backward pass (Megatron's `moe_act` and
/// `shared_experts` selective recompute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoeRecompute {
    /// The routed experts' activation and `fc2`: only the `fc1` output is kept, not the
    /// activation that `fc2`'s weight gradient needs.
    pub activation: bool,
    /// The shared experts: only their input is kept.
    pub shared_experts: bool,
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod clamped_swiglu_tests;
