//! Expert capacity, token dropping and padding
//! (docs/routing-and-dispatch.md §Capacity, dropping and padding).

use burn::tensor::{Bool, Int, Tensor};

use super::config::DropPolicy;
use crate::error::{BackendError, Result};
use crate::ops::{routing_map_from_indices, topk_indices};

/// `cap = max(ceil(T·k/E · cf), min_capacity)`
/// (docs/routing-and-dispatch.md §Capacity, dropping and padding; Megatron `get_capacity` with
/// `num_tokens = T·k`).
pub fn expert_capacity(
    num_tokens: usize,
    topk: usize,
    num_experts: usize,
    capacity_factor: f64,
    min_capacity: Option<usize>,
) -> usize {
    let cap = ((num_tokens * topk) as f64 / num_experts as f64 * capacity_factor).ceil();
    // `cap` is finite and non-negative for validated configs; `as` saturates otherwise.
    (cap as usize).max(min_capacity.unwrap_or(0))
}

/// Per-expert selection of exactly `capacity` rows
/// (docs/routing-and-dispatch.md §Capacity, dropping and padding): column `e` of the result holds
/// the `capacity` best routed tokens of `routing_map[:, e]` — by descending `probs[:, e]`
/// ([`DropPolicy::Probs`]) or by ascending token index ([`DropPolicy::Position`]), ties to the
/// lower token index — followed, when an expert has fewer routed tokens, by unrouted tokens in
/// ascending index. Requires `capacity ≤ T`.
pub fn capacity_mask(
    probs: Tensor<2>,
    routing_map: Tensor<2, Bool>,
    capacity: usize,
    policy: DropPolicy,
) -> Result<Tensor<2, Bool>> {
    let [t, e] = routing_map.dims();
    if capacity > t {
        return Err(BackendError::Config {
            field: "capacity_factor",
            detail: format!("capacity {capacity} exceeds the {t} tokens available"),
        });
    }
    let device = routing_map.device();
    if capacity == 0 {
        return Ok(Tensor::<2, Int>::zeros([t, e], &device).greater_elem(0));
    }
    // Sort key per (token, expert): routed entries rank above every unrouted one.
    let key = match policy {
        // probs ≥ 0 on routed entries, so −1 puts unrouted entries last.
        DropPolicy::Probs => probs
            .detach()
            .mask_fill(routing_map.clone().bool_not(), -1.0),
        DropPolicy::Position => routing_map.float(),
    };
    let rows = topk_indices(key.transpose(), capacity)?; // [E, cap] token indices
    Ok(routing_map_from_indices(rows, t).transpose())
}

/// Result of [`apply_capacity`].
#[derive(Clone, Debug)]
pub struct Dropped {
    /// `[T, E]` probs after dropping (zero outside `routing_map`; padded rows carry 0).
    pub probs: Tensor<2>,
    /// `[T, E]` final routing map.
    pub routing_map: Tensor<2, Bool>,
    /// The expert capacity `cap`.
    pub capacity: usize,
}

/// Capacity settings for [`apply_capacity`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapacitySpec {
    /// Capacity factor `cf ≥ 0`.
    pub capacity_factor: f64,
    /// Lower bound on the capacity.
    pub min_capacity: Option<usize>,
    /// Which tokens are dropped first.
    pub drop_policy: DropPolicy,
    /// Every expert gets exactly `cap` rows.
    pub pad_to_capacity: bool,
}

/// Applies the expert capacity to a top-`k` routing (`apply_router_token_dropping`,
/// docs/routing-and-dispatch.md §Capacity, dropping and padding).
///
/// `valid_rows [T, E]` (from a padding mask) removes padded tokens from the routing before the
/// capacity is enforced, and the capacity is computed from the number of valid tokens, so the
/// valid rows get the same result as a run without the padded rows. Padded rows may still be
/// used as zero-prob filler rows with `pad_to_capacity`.
pub fn apply_capacity(
    probs: Tensor<2>,
    routing_map: Tensor<2, Bool>,
    valid_rows: Option<(Tensor<2, Bool>, usize)>,
    topk: usize,
    spec: &CapacitySpec,
) -> Result<Dropped> {
    let [t, e] = routing_map.dims();
    let (routing_map, num_tokens) = match valid_rows {
        Some((valid, n)) => (routing_map.bool_and(valid), n),
        None => (routing_map, t),
    };
    let probs = probs.mask_fill(routing_map.clone().bool_not(), 0.0);
    let capacity = expert_capacity(num_tokens, topk, e, spec.capacity_factor, spec.min_capacity);
    if capacity > num_tokens {
        if spec.pad_to_capacity {
            return Err(BackendError::Config {
                field: "pad_to_capacity",
                detail: format!("capacity {capacity} exceeds the {num_tokens} tokens to pad with"),
            });
        }
        // No token is dropped.
        return Ok(Dropped {
            probs,
            routing_map,
            capacity,
        });
    }
    let mask = capacity_mask(
        probs.clone(),
        routing_map.clone(),
        capacity,
        spec.drop_policy,
    )?;
    let final_map = if spec.pad_to_capacity {
        mask
    } else {
        routing_map.bool_and(mask)
    };
    let probs = probs.mask_fill(final_map.clone().bool_not(), 0.0);
    Ok(Dropped {
        probs,
        routing_map: final_map,
        capacity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::testing::{f64_tensor, host_bool, host_f64, ref_capacity_column};
    use burn::tensor::Device;

    #[test]
    fn router_capacity_formula() {
        assert_eq!(expert_capacity(32, 2, 4, 1.0, None), 16);
        assert_eq!(expert_capacity(16, 2, 8, 0.6, None), 3); // ceil(2.4)
        assert_eq!(expert_capacity(16, 1, 8, 0.5, Some(4)), 4);
        assert_eq!(expert_capacity(10, 2, 4, 0.0, None), 0);
    }

    #[test]
    fn router_capacity_mask_matches_reference_with_ties() {
        let device = Device::flex();
        // 6 tokens, 2 experts; ties in probs resolve to the lower token index.
        let probs = [0.5, 0.0, 0.2, 0.7, 0.5, 0.0, 0.2, 0.3, 0.9, 0.0, 0.5, 0.0];
        let routed: Vec<bool> = probs.iter().map(|&p| p > 0.0).collect();
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            for cap in 0..=6 {
                let map = Tensor::<2, Bool>::from_data(
                    burn::tensor::TensorData::new(routed.clone(), [6, 2]),
                    &device,
                );
                let got = host_bool(
                    capacity_mask(f64_tensor(&probs, [6, 2], &device), map, cap, policy).unwrap(),
                );
                for col in 0..2 {
                    let p: Vec<f64> = (0..6).map(|r| probs[r * 2 + col]).collect();
                    let m: Vec<bool> = (0..6).map(|r| routed[r * 2 + col]).collect();
                    let want = ref_capacity_column(&p, &m, cap, policy == DropPolicy::Probs);
                    let got_col: Vec<bool> = (0..6).map(|r| got[r * 2 + col]).collect();
                    assert_eq!(got_col, want, "{policy:?} cap={cap} col={col}");
                }
            }
        }
    }

    #[test]
    fn router_pad_to_capacity_gives_exactly_cap_rows_with_zero_filler_probs() {
        let device = Device::flex();
        // Expert 0 is overloaded (4 tokens), expert 1 gets 1 token; T=4, k=1, cf=1 → cap=2.
        let probs = [0.9, 0.0, 0.8, 0.0, 0.0, 0.6, 0.7, 0.0];
        let map_host: Vec<bool> = probs.iter().map(|&p| p > 0.0).collect();
        let spec = CapacitySpec {
            capacity_factor: 1.0,
            min_capacity: None,
            drop_policy: DropPolicy::Probs,
            pad_to_capacity: true,
        };
        let map =
            Tensor::<2, Bool>::from_data(burn::tensor::TensorData::new(map_host, [4, 2]), &device);
        let out = apply_capacity(f64_tensor(&probs, [4, 2], &device), map, None, 1, &spec).unwrap();
        assert_eq!(out.capacity, 2);
        let m = host_bool(out.routing_map);
        let p = host_f64(out.probs);
        // Expert 0 keeps tokens 0 and 1 (largest probs); expert 1 keeps token 2 and pads with 0.
        assert_eq!(m, vec![true, true, true, false, false, true, false, false]);
        assert_eq!(p, vec![0.9, 0.0, 0.8, 0.0, 0.0, 0.6, 0.0, 0.0]);
        for col in 0..2 {
            assert_eq!((0..4).filter(|r| m[r * 2 + col]).count(), 2);
        }
    }
}
