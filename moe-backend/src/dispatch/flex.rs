//! Flex dispatcher (docs/routing-and-dispatch.md §Flex dispatcher): one copy of a token per
//! destination rank of `tp_ep`, however many of that rank's experts it chose; local permute on the
//! receiver; the token's local-expert outputs are summed before they travel back.

use std::ops::Range;

use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::{CombineState, Dispatched, SplitPlan, TokenDispatcher, check_inputs, permute_rows};
use crate::comm::Comm;
use crate::error::{BackendError, Result};
use crate::ops::{PermuteMode, int_tensor_to_usize, permute, unpermute};
use crate::parallel::local_expert_range;

/// Flex token dispatcher over the `tp_ep` group (size `ETP·EP`, ETP fastest). With ETP > 1 a
/// token goes to every ETP member of the owning EP rank, and their partial outputs are summed
/// on the way back.
#[derive(Debug, Clone)]
pub struct FlexDispatcher {
    tp_ep: Comm,
    num_experts: usize,
    ep: usize,
    etp: usize,
    local: Range<usize>,
}

impl FlexDispatcher {
    /// A dispatcher for `num_experts` experts over `ep` EP ranks with `etp`-way expert TP.
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
        let local = local_expert_range(num_experts, ep, tp_ep.rank() / etp)?;
        Ok(Self {
            tp_ep,
            num_experts,
            ep,
            etp,
            local,
        })
    }

    fn local_len(&self) -> usize {
        self.num_experts / self.ep
    }
}

impl TokenDispatcher for FlexDispatcher {
    fn local_experts(&self) -> Range<usize> {
        self.local.clone()
    }

    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, Bool>,
    ) -> Result<Dispatched> {
        const OP: &str = "FlexDispatcher::dispatch";
        check_inputs(OP, &hidden, &probs, &routing_map, self.num_experts)?;
        let [t, _] = hidden.dims();
        let (ep, etp, l) = (self.ep, self.etp, self.local_len());
        let p = ep * etp;
        let device = hidden.device();
        // Per token and destination member d = e·ETP + j: does it pick an expert of EP rank e?
        let map_int = routing_map.int().reshape([t, ep, 1, l]);
        let map_dest = map_int.clone().repeat_dim(2, etp).reshape([t, p, l]);
        let dest_mask = map_dest.clone().sum_dim(2).reshape([t, p]).greater_elem(0);
        // Rows destination-major, ascending token inside each destination.
        let sent = permute(hidden, dest_mask, None, PermuteMode::Dropless)?;
        let send_counts = sent.row_id_map.tokens_per_expert_host();
        // Row r carries token t_r to destination d_r: its local multihot and probs.
        let dest_of_row: Vec<usize> = send_counts
            .iter()
            .enumerate()
            .flat_map(|(d, &c)| std::iter::repeat_n(d, c))
            .collect();
        let tokens = int_tensor_to_usize(sent.row_id_map.sorted_indices.clone());
        let flat: Vec<i32> = tokens
            .iter()
            .zip(&dest_of_row)
            .map(|(&tok, &d)| (tok * p + d) as i32)
            .collect();
        let rows = flat.len();
        let flat = Tensor::<1, Int>::from_data(TensorData::new(flat, [rows]), &device);
        let probs_dest = probs
            .reshape([t, ep, 1, l])
            .repeat_dim(2, etp)
            .reshape([t * p, l])
            .select(0, flat.clone());
        let map_rows = map_dest.reshape([t * p, l]).select(0, flat);
        // Exchange counts, then rows, probs and multihots.
        let counts = Tensor::<1, Int>::from_data(
            TensorData::new(
                send_counts.iter().map(|&c| c as i32).collect::<Vec<_>>(),
                [p],
            ),
            &device,
        );
        let ones = vec![1; p];
        let recv_counts = int_tensor_to_usize(self.tp_ep.all_to_all_v(counts, &ones, &ones)?);
        let x = self
            .tp_ep
            .all_to_all_v(sent.rows, &send_counts, &recv_counts)?;
        let local_probs = self
            .tp_ep
            .all_to_all_v(probs_dest, &send_counts, &recv_counts)?;
        let local_map = self
            .tp_ep
            .all_to_all_v(map_rows, &send_counts, &recv_counts)?
            .greater_elem(0);
        let (rows, probs, row_id_map) = permute_rows(OP, x, local_probs, local_map)?;
        Ok(Dispatched {
            rows,
            probs,
            tokens_per_local_expert: row_id_map.tokens_per_expert_host(),
            state: CombineState {
                row_id_map,
                sender_map: Some(sent.row_id_map),
                plan: SplitPlan {
                    input_splits: send_counts,
                    output_splits: recv_counts,
                    ..SplitPlan::default()
                },
            },
        })
    }

    fn combine(&self, expert_out: Tensor<2>, state: CombineState) -> Result<Tensor<2>> {
        // Sum each received token's local experts, send one row back per (token, rank).
        let per_token = unpermute(expert_out, &state.row_id_map, None)?;
        let back = self.tp_ep.all_to_all_v(
            per_token,
            &state.plan.output_splits,
            &state.plan.input_splits,
        )?;
        let sender = state.sender_map.ok_or_else(|| BackendError::Shape {
            op: "FlexDispatcher::combine",
            detail: "combine state was not produced by a FlexDispatcher".into(),
        })?;
        unpermute(back, &sender, None)
    }
}
