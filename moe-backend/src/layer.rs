//! [`MoeLayer`]: route → dispatch (permute) → experts → combine (unpermute), plus shared
//! experts, on one rank (moe-ops §11).

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
    /// Expert activation.
    #[config(default = "ExpertActivation::SwiGlu")]
    pub activation: ExpertActivation,
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
    /// shared experts and the combine stay in high precision (fp8.md §7).
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
        // The router already applied capacity (dropping and padding) to the map.
        let dispatched = dispatcher.dispatch(
            x.clone(),
            routing.probs.clone(),
            routing.routing_map.clone(),
        )?;
        let expert_out = self.experts.forward_recomputing(
            dispatched.rows,
            &dispatched.tokens_per_local_expert,
            dispatched.probs,
            recompute.activation,
        )?;
        let mut output = dispatcher.combine(expert_out, dispatched.state)?;
        if let Some(shared) = &self.shared_experts {
            output = output
                + if recompute.shared_experts {
                    crate::recompute::recompute_module(shared, x, |m: &SharedExperts, x| {
                        m.forward(x)
                    })
                } else {
                    shared.forward(x)
                };
        }
        Ok(MoeLayerOutput { output, routing })
    }
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
