//! AlltoAll dispatcher (docs/routing-and-dispatch.md §AlltoAll dispatcher): permute, all-to-all
//! over `ep`, all-gather over `expt_tp`, sort chunks by local expert; combine is the exact inverse.

use std::ops::Range;

use burn::tensor::{Bool, Int, Tensor};

use super::{CombineState, Dispatched, SplitPlan, TokenDispatcher, check_inputs, permute_rows};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};
use crate::ops::{int_tensor_to_usize, sort_chunks_by_idxs, unpermute};
use crate::parallel::local_expert_range;

/// AlltoAll token dispatcher.
#[derive(Debug, Clone)]
pub struct AllToAllDispatcher {
    ep: Comm,
    expt_tp: Comm,
    tp_ep: Comm,
    num_experts: usize,
    local: Range<usize>,
}

impl AllToAllDispatcher {
    /// A dispatcher for `num_experts` experts over this rank's `ep`, `expt_tp` and `tp_ep`
    /// groups (`tp_ep` member `e·ETP + t` is EP rank `e`, ETP rank `t`).
    pub fn new(ep: Comm, expt_tp: Comm, tp_ep: Comm, num_experts: usize) -> Result<Self> {
        let (epn, tpn) = (ep.size(), expt_tp.size());
        if tp_ep.size() != epn * tpn || tp_ep.rank() != ep.rank() * tpn + expt_tp.rank() {
            return Err(BackendError::Layout {
                field: "tp_ep",
                detail: format!(
                    "tp_ep {:?} is not the ETP-fastest product of ep {:?} and expt_tp {:?}",
                    tp_ep.ranks(),
                    ep.ranks(),
                    expt_tp.ranks()
                ),
            });
        }
        let local = local_expert_range(num_experts, epn, ep.rank())?;
        Ok(Self {
            ep,
            expt_tp,
            tp_ep,
            num_experts,
            local,
        })
    }

    /// The preprocess splits (docs/routing-and-dispatch.md §AlltoAll dispatcher) from the
    /// per-expert counts `counts [E]` of this rank, on the routing's device: all-gathered over
    /// `tp_ep` as they are and read back once (the one host synchronisation of the dispatch:
    /// the all-to-all's splits are host sizes, as in Megatron's `.cpu()` of its splits).
    fn plan(&self, counts: Tensor<1, Int>) -> Result<(SplitPlan, Vec<usize>)> {
        let (epn, tpn) = (self.ep.size(), self.expt_tp.size());
        let l = self.local.len();
        let e = self.num_experts;
        if epn == 1 && tpn == 1 {
            let n = int_tensor_to_usize(counts);
            let input_splits: Vec<usize> = n.chunks(l).map(|c| c.iter().sum()).collect();
            let plan = SplitPlan {
                input_splits: input_splits.clone(),
                output_splits: input_splits,
                output_splits_tp: vec![n.iter().sum()],
                chunks_tp_ep_l: n.to_vec(),
            };
            return Ok((plan, n));
        }
        let g = int_tensor_to_usize(self.tp_ep.all_gather(counts.reshape([1, e]))?);
        // This rank's own counts are its row of the gather.
        let me = self.tp_ep.rank();
        let n = g
            .get(me * e..(me + 1) * e)
            .ok_or_else(|| BackendError::Shape {
                op: "AllToAllDispatcher::plan",
                detail: format!(
                    "{} gathered counts for {} members of {e} experts",
                    g.len(),
                    tpn * epn
                ),
            })?;
        let input_splits: Vec<usize> = n.chunks(l).map(|c| c.iter().sum()).collect();
        // gl[t][ep][l] = g[(ep·tpn + t)·E + local.start + l]
        let at = |t: usize, s: usize, j: usize| g[(s * tpn + t) * e + self.local.start + j];
        let mut chunks = Vec::with_capacity(tpn * epn * l);
        let mut output_splits_tp = vec![0; tpn];
        let mut output_splits = vec![0; epn];
        let mut per_expert = vec![0; l];
        for (t, tp_total) in output_splits_tp.iter_mut().enumerate() {
            for (s, ep_total) in output_splits.iter_mut().enumerate() {
                for (j, total) in per_expert.iter_mut().enumerate() {
                    let c = at(t, s, j);
                    chunks.push(c);
                    *tp_total += c;
                    *total += c;
                    if t == self.expt_tp.rank() {
                        *ep_total += c;
                    }
                }
            }
        }
        let plan = SplitPlan {
            input_splits,
            output_splits,
            output_splits_tp,
            chunks_tp_ep_l: chunks,
        };
        Ok((plan, per_expert))
    }

    fn chunk_count(&self) -> usize {
        self.ep.size() * self.expt_tp.size()
    }
}

/// Reorders 1-D `x` like [`sort_chunks_by_idxs`].
fn sort_chunks_1d(x: Tensor<1>, sizes: &[usize], order: &[usize]) -> Result<Tensor<1>> {
    let n = x.dims()[0];
    Ok(sort_chunks_by_idxs(x.reshape([n, 1]), sizes, order)?.reshape([n]))
}

impl TokenDispatcher for AllToAllDispatcher {
    fn local_experts(&self) -> Range<usize> {
        self.local.clone()
    }

    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, Bool>,
    ) -> Result<Dispatched> {
        const OP: &str = "AllToAllDispatcher::dispatch";
        check_inputs(OP, &hidden, &probs, &routing_map, self.num_experts)?;
        let (mut x, mut p, row_id_map) = permute_rows(OP, hidden, probs, routing_map)?;
        let (plan, tokens_per_local_expert) = self.plan(row_id_map.tokens_per_expert.clone())?;
        if self.ep.size() > 1 {
            x = self
                .ep
                .all_to_all_v(x, &plan.input_splits, &plan.output_splits)?;
            p = self
                .ep
                .all_to_all_v(p, &plan.input_splits, &plan.output_splits)?;
        }
        if self.expt_tp.size() > 1 {
            x = self.expt_tp.all_gather_v(x)?.0;
            p = self.expt_tp.all_gather_v(p)?.0;
        }
        let l = self.local.len();
        if l > 1 {
            // (tp, ep, l) -> (l, tp, ep): chunk c·L + l goes to position l·C + c.
            let c = self.chunk_count();
            let order: Vec<usize> = (0..l)
                .flat_map(|j| (0..c).map(move |i| i * l + j))
                .collect();
            x = sort_chunks_by_idxs(x, &plan.chunks_tp_ep_l, &order)?;
            p = sort_chunks_1d(p, &plan.chunks_tp_ep_l, &order)?;
        }
        Ok(Dispatched {
            rows: x,
            probs: p,
            tokens_per_local_expert,
            state: CombineState {
                row_id_map,
                sender_map: None,
                plan,
            },
        })
    }

    fn combine(&self, expert_out: Tensor<2>, state: CombineState) -> Result<Tensor<2>> {
        let plan = &state.plan;
        let mut y = expert_out;
        let l = self.local.len();
        if l > 1 {
            // (l, tp, ep) -> (tp, ep, l).
            let c = self.chunk_count();
            let sizes: Vec<usize> = (0..l)
                .flat_map(|j| (0..c).map(move |i| (i, j)))
                .map(|(i, j)| plan.chunks_tp_ep_l[i * l + j])
                .collect();
            let order: Vec<usize> = (0..c)
                .flat_map(|i| (0..l).map(move |j| j * c + i))
                .collect();
            y = sort_chunks_by_idxs(y, &sizes, &order)?;
        }
        if self.expt_tp.size() > 1 {
            y = self
                .expt_tp
                .reduce_scatter_v(y, &plan.output_splits_tp, ReduceOp::Sum)?;
        }
        if self.ep.size() > 1 {
            y = self
                .ep
                .all_to_all_v(y, &plan.output_splits, &plan.input_splits)?;
        }
        unpermute(y, &state.row_id_map, None)
    }
}
