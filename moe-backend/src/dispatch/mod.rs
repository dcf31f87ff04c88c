//! Token dispatchers: move each token's routed copies to the ranks owning the chosen experts
//! and bring the expert outputs back (docs/routing-and-dispatch.md §Token dispatchers).
//!
//! Every dispatcher implements [`TokenDispatcher`]: [`dispatch`](TokenDispatcher::dispatch)
//! turns local tokens `[T, H]` with `probs`/`routing_map [T, E]` into rows for this rank's `L`
//! local experts, in expert-major order (`tokens_per_local_expert` rows each) with one routing
//! weight per row; [`combine`](TokenDispatcher::combine) takes the experts' output rows and
//! returns `[T, H]` (the sum of every token's weighted expert outputs). All communication is
//! differentiable ([`crate::comm`]), so the backward pass runs the transposed exchanges.
//!
//! - [`LocalDispatcher`]: EP = ETP = 1, permute/unpermute only.
//! - [`AllGatherDispatcher`]: all-gather every token over `tp_ep`, compute the local experts'
//!   share, reduce-scatter back (buffer `[|tp_ep|·T, H]`, independent of k).
//! - [`AllToAllDispatcher`]: permute, all-to-all over `ep`, all-gather over `expt_tp`, sort
//!   chunks by local expert; combine is the exact inverse (receive `≈ k·T` rows).
//! - [`FlexDispatcher`]: each token crosses to a destination rank of `tp_ep` once, however many
//!   of that rank's experts it chose, with its local-expert multihot and probs; the receiver
//!   permutes locally and reduces a token's local experts before sending the result back.

mod all_gather;
mod all_to_all;
mod flex;
#[cfg(test)]
mod tests;

use std::fmt;
use std::ops::Range;

use burn::tensor::{Bool, Tensor};

use crate::error::{BackendError, Result};
use crate::ops::{PermuteMode, RowIdMap, permute, unpermute};

pub use all_gather::AllGatherDispatcher;
pub use all_to_all::AllToAllDispatcher;
pub use flex::FlexDispatcher;

/// Rows for this rank's experts, produced by [`TokenDispatcher::dispatch`].
#[derive(Debug, Clone)]
pub struct Dispatched {
    /// `[N_local, H]` rows in local-expert-major order.
    pub rows: Tensor<2>,
    /// `[N_local]` routing weight of every row.
    pub probs: Tensor<1>,
    /// Rows per local expert (`L` entries).
    pub tokens_per_local_expert: Vec<usize>,
    /// What [`TokenDispatcher::combine`] needs to undo the dispatch.
    pub state: CombineState,
}

/// Bookkeeping carried from dispatch to combine.
#[derive(Debug, Clone)]
pub struct CombineState {
    pub(crate) row_id_map: RowIdMap,
    /// Flex: the sender-side token -> destination-rank permutation.
    pub(crate) sender_map: Option<RowIdMap>,
    /// Dispatcher-specific split sizes (empty for the local dispatcher).
    pub(crate) plan: SplitPlan,
}

/// Split sizes of the collectives of one dispatch.
#[derive(Debug, Clone, Default)]
pub(crate) struct SplitPlan {
    /// AllGather: rows contributed by each `tp_ep` member. AlltoAll: rows sent to each EP rank.
    pub(crate) input_splits: Vec<usize>,
    /// AlltoAll: rows received from each EP rank.
    pub(crate) output_splits: Vec<usize>,
    /// AlltoAll: rows received (after A2A) by each ETP member.
    pub(crate) output_splits_tp: Vec<usize>,
    /// AlltoAll: chunk sizes in `(tp, ep, l)` order.
    pub(crate) chunks_tp_ep_l: Vec<usize>,
}

/// Moves tokens to the ranks owning their experts and back.
pub trait TokenDispatcher: fmt::Debug + Send + Sync {
    /// Global ids of the experts this rank computes.
    fn local_experts(&self) -> Range<usize>;

    /// `hidden [T, H]`, `probs [T, E]`, `routing_map [T, E]` -> rows for the local experts.
    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, Bool>,
    ) -> Result<Dispatched>;

    /// Expert output rows (same order as the dispatched rows, already weighted by the routing
    /// probs) -> `[T, H]`.
    fn combine(&self, expert_out: Tensor<2>, state: CombineState) -> Result<Tensor<2>>;
}

/// EP = ETP = 1: every expert is local; dispatch is a permute, combine an unpermute.
#[derive(Debug, Clone)]
pub struct LocalDispatcher {
    num_experts: usize,
}

impl LocalDispatcher {
    /// A dispatcher for `num_experts` local experts.
    pub fn new(num_experts: usize) -> Self {
        Self { num_experts }
    }
}

/// Permutes `hidden` by `routing_map`, returning rows, per-row probs and the row map.
pub(crate) fn permute_rows(
    op: &'static str,
    hidden: Tensor<2>,
    probs: Tensor<2>,
    routing_map: Tensor<2, Bool>,
) -> Result<(Tensor<2>, Tensor<1>, RowIdMap)> {
    let permuted = permute(hidden, routing_map, Some(probs), PermuteMode::Dropless)?;
    let probs = permuted.probs.ok_or_else(|| BackendError::Shape {
        op,
        detail: "permute returned no probs".into(),
    })?;
    Ok((permuted.rows, probs, permuted.row_id_map))
}

fn check_inputs(
    op: &'static str,
    hidden: &Tensor<2>,
    probs: &Tensor<2>,
    routing_map: &Tensor<2, Bool>,
    num_experts: usize,
) -> Result<()> {
    let [t, _] = hidden.dims();
    if probs.dims() != [t, num_experts] || routing_map.dims() != [t, num_experts] {
        return Err(BackendError::Shape {
            op,
            detail: format!(
                "hidden {:?} needs probs and routing_map of [{t}, {num_experts}], got {:?} and {:?}",
                hidden.dims(),
                probs.dims(),
                routing_map.dims()
            ),
        });
    }
    Ok(())
}

impl TokenDispatcher for LocalDispatcher {
    fn local_experts(&self) -> Range<usize> {
        0..self.num_experts
    }

    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, Bool>,
    ) -> Result<Dispatched> {
        const OP: &str = "LocalDispatcher::dispatch";
        check_inputs(OP, &hidden, &probs, &routing_map, self.num_experts)?;
        let (rows, probs, row_id_map) = permute_rows(OP, hidden, probs, routing_map)?;
        Ok(Dispatched {
            rows,
            probs,
            tokens_per_local_expert: row_id_map.tokens_per_expert_host(),
            state: CombineState {
                row_id_map,
                sender_map: None,
                plan: SplitPlan::default(),
            },
        })
    }

    fn combine(&self, expert_out: Tensor<2>, state: CombineState) -> Result<Tensor<2>> {
        unpermute(expert_out, &state.row_id_map, None)
    }
}
