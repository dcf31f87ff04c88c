//! Router state across ranks: a [`CountReducer`] over the real process groups, and the expert-bias
//! update after the data-parallel sync with counts summed over `tp_dp_cp`
//! (docs/routing-and-dispatch.md §Aux-loss-free expert bias,
//! docs/parallelism.md §Gradient reduction and scaling, step 4).

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::comm::{Comm, GroupComms, ReduceOp};
use crate::error::{BackendError, Result};
use crate::parallel::GroupFamily;
use crate::router::{CountGroup, CountReducer, RouterState, TopKRouter};

/// Sums router counts over this rank's `tp_cp` / `tp_dp_cp` communicators.
#[derive(Debug, Clone)]
pub struct GroupCountReducer {
    tp_cp: Comm,
    tp_dp_cp: Comm,
}

impl GroupCountReducer {
    /// The reducer of a rank's groups.
    pub fn new(groups: &GroupComms) -> Self {
        Self {
            tp_cp: groups.comm(GroupFamily::TpCp).clone(),
            tp_dp_cp: groups.comm(GroupFamily::TpDpCp).clone(),
        }
    }
}

/// Element-wise f64 sum of `counts` over `comm` (in place).
fn sum_over(comm: &Comm, counts: &mut [f64]) -> Result<()> {
    let t = Tensor::<1>::from_data(
        TensorData::new(counts.to_vec(), [counts.len()]),
        (&Device::flex(), DType::F64),
    );
    let summed = comm
        .all_reduce(t, ReduceOp::Sum)?
        .into_data()
        .try_into_vec::<f64>()
        .map_err(|e| BackendError::Shape {
            op: "GroupCountReducer",
            detail: format!("summed counts unreadable: {e:?}"),
        })?;
    counts.copy_from_slice(&summed);
    Ok(())
}

impl CountReducer for GroupCountReducer {
    fn all_reduce_sum(&self, group: CountGroup, counts: &mut [f64]) -> Result<()> {
        match group {
            CountGroup::TpCp => sum_over(&self.tp_cp, counts),
            CountGroup::TpDpCp => sum_over(&self.tp_dp_cp, counts),
        }
    }
}

/// Aux-loss-free expert-bias update on every rank: the counts accumulated in `state` are
/// summed over `tp_dp_cp`, then every replica of the router applies the same update. Call once
/// per global batch, after the gradient sync.
pub fn update_expert_bias_distributed(
    router: &mut TopKRouter,
    state: &mut RouterState,
    groups: &GroupComms,
) -> Result<()> {
    let mut counts = state.take_local_tokens_per_expert();
    sum_over(groups.comm(GroupFamily::TpDpCp), &mut counts)?;
    router.update_expert_bias_with_counts(&counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;
    use crate::parallel::{ParallelLayout, replicate};
    use crate::router::{RouteOptions, TopKRouterConfig};
    use crate::testing::{SplitMix, tensor};

    #[test]
    fn distributed_expert_bias_update_equals_one_rank_with_all_tokens() {
        let (h, e, k, t) = (8, 8, 2, 6);
        // Expert-bias counts are collected by training (grad-enabled) forwards.
        let device = Device::flex().autodiff();
        let router = replicate(
            &TopKRouterConfig::new(h, e, k)
                .with_score_function(crate::router::ScoreFunction::Sigmoid)
                .with_enable_expert_bias(true)
                .with_expert_bias_update_rate(0.1)
                .with_init_std(0.5)
                .init(&device)
                .unwrap(),
        );
        let data = |r: usize| {
            let mut rng = SplitMix::new(40 + r as u64);
            (0..t * h)
                .map(|_| rng.uniform(-1.0, 1.0))
                .collect::<Vec<f64>>()
        };
        for (world, spec) in [(4, "ep=4"), (4, "tp=2,ep=2")] {
            // Reference: one router sees every rank's tokens.
            let mut reference = replicate(&router);
            let mut state = reference.init_state();
            for r in 0..world {
                let x = tensor(data(r), [t, h], &device, DType::F32);
                let out = reference
                    .forward(x, &state, &RouteOptions::default())
                    .unwrap();
                state.commit(&out.state_update).unwrap();
            }
            reference.update_expert_bias(&mut state).unwrap();
            let expected = reference.expert_bias_values().unwrap().unwrap();
            let layout = ParallelLayout::parse(world, spec).unwrap();
            let (router_ref, layout_ref) = (&router, &layout);
            let got = World::run(world, |ctx| {
                let groups = ctx.process_groups(layout_ref)?;
                let mut mine = replicate(router_ref);
                let mut state = mine.init_state();
                let x = tensor(data(ctx.rank()), [t, h], &device, DType::F32);
                let out = mine.forward(x, &state, &RouteOptions::default())?;
                state.commit(&out.state_update)?;
                update_expert_bias_distributed(&mut mine, &mut state, &groups)?;
                mine.expert_bias_values()
            });
            for (r, bias) in got.into_iter().enumerate() {
                assert_eq!(bias.unwrap().unwrap(), expected, "{spec} rank {r}");
            }
            assert_ne!(expected, router.expert_bias_values().unwrap().unwrap());
        }
    }
}
