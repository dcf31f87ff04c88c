//! AllGather dispatcher (docs/routing-and-dispatch.md §AllGather dispatcher): every rank of `tp_ep`
//! sees every token of the group, computes its local experts' share and reduce-scatters the partial
//! outputs back.

use std::ops::Range;

use burn::tensor::{Bool, Tensor};

use super::{CombineState, Dispatched, SplitPlan, TokenDispatcher, check_inputs, permute_rows};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};
use crate::ops::unpermute;
use crate::parallel::local_expert_range;

/// AllGather token dispatcher over the `tp_ep` group (size `ETP·EP`, ETP fastest).
#[derive(Debug, Clone)]
pub struct AllGatherDispatcher {
    tp_ep: Comm,
    num_experts: usize,
    local: Range<usize>,
}

impl AllGatherDispatcher {
    /// A dispatcher for `num_experts` experts spread over `ep` EP ranks with `etp`-way expert
    /// TP; `tp_ep` is this rank's `tp_ep` group.
    pub fn new(tp_ep: Comm, num_experts: usize, ep: usize, etp: usize) -> Result<Self> {
        if tp_ep.size() != ep * etp {
            return Err(BackendError::Layout {
                field: "tp_ep",
                detail: format!(
                    "group of {} ranks but ep·etp = {ep}·{etp} = {}",
                    tp_ep.size(),
                    ep * etp
                ),
            });
        }
        let ep_rank = tp_ep.rank() / etp;
        let local = local_expert_range(num_experts, ep, ep_rank)?;
        Ok(Self {
            tp_ep,
            num_experts,
            local,
        })
    }
}

impl TokenDispatcher for AllGatherDispatcher {
    fn local_experts(&self) -> Range<usize> {
        self.local.clone()
    }

    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, Bool>,
    ) -> Result<Dispatched> {
        const OP: &str = "AllGatherDispatcher::dispatch";
        check_inputs(OP, &hidden, &probs, &routing_map, self.num_experts)?;
        let (hidden, probs, map, input_splits) = if self.tp_ep.size() > 1 {
            let (hidden, sizes) = self.tp_ep.all_gather_v(hidden)?;
            let (probs, _) = self.tp_ep.all_gather_v(probs)?;
            let (map, _) = self.tp_ep.all_gather_v(routing_map.int())?;
            (hidden, probs, map.greater_elem(0), sizes)
        } else {
            let t = hidden.dims()[0];
            (hidden, probs, routing_map, vec![t])
        };
        let tg = hidden.dims()[0];
        let local_map = map.slice([0..tg, self.local.clone()]);
        let local_probs = probs.slice([0..tg, self.local.clone()]);
        let (rows, probs, row_id_map) = permute_rows(OP, hidden, local_probs, local_map)?;
        Ok(Dispatched {
            rows,
            probs,
            tokens_per_local_expert: row_id_map.tokens_per_expert_host(),
            state: CombineState {
                row_id_map,
                sender_map: None,
                plan: SplitPlan {
                    input_splits,
                    ..SplitPlan::default()
                },
            },
        })
    }

    fn combine(&self, expert_out: Tensor<2>, state: CombineState) -> Result<Tensor<2>> {
        let y = unpermute(expert_out, &state.row_id_map, None)?;
        if self.tp_ep.size() > 1 {
            self.tp_ep
                .reduce_scatter_v(y, &state.plan.input_splits, ReduceOp::Sum)
        } else {
            Ok(y)
        }
    }
}
