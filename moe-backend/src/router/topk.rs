//! Expert selection: plain and group-limited top-k
//! (docs/routing-and-dispatch.md §Score functions and top-k, §Group-limited top-k) and
//! `topk_routing_with_score_function`.

use burn::tensor::{Bool, IndexingUpdateOp, Int, Tensor};

use super::config::GroupLimitConfig;
use super::scoring::ScoreSpec;
use crate::error::{BackendError, Result};
use crate::ops::{routing_map_from_indices, topk_indices};

/// Group-limited top-k (docs/routing-and-dispatch.md §Group-limited top-k) of `selection [T, E]`:
/// group score = sum of the top `group_score_topk` scores of each of the `num_groups` groups; the
/// `group_topk` best groups are kept (ties → lower group index), the other experts are masked with
/// −inf, and the top `k` of the masked scores are returned (`[T, k]`, descending, ties → lower
/// index).
pub fn group_limited_topk(
    selection: Tensor<2>,
    k: usize,
    group: &GroupLimitConfig,
) -> Result<Tensor<2, Int>> {
    let [t, e] = selection.dims();
    let g = group.num_groups;
    if g == 0 || !e.is_multiple_of(g) {
        return Err(BackendError::Config {
            field: "group_limit",
            detail: format!("num_groups = {g} must divide {e} experts"),
        });
    }
    let per_group = e / g;
    let grouped = selection.clone().reshape([t * g, per_group]);
    let best = topk_indices(grouped.clone(), group.group_score_topk)?;
    let group_scores = grouped.gather(1, best).sum_dim(1).reshape([t, g]);
    let kept = topk_indices(group_scores, group.group_topk)?;
    let kept_experts: Tensor<2, Bool> = routing_map_from_indices(kept, g)
        .reshape([t, g, 1])
        .expand([t, g, per_group])
        .reshape([t, e]);
    let masked = selection.mask_fill(kept_experts.bool_not(), f64::NEG_INFINITY);
    topk_indices(masked, k)
}

/// Top-`k` expert indices of `selection [T, E]`, group-limited when `group` is given.
pub fn select_topk(
    selection: Tensor<2>,
    k: usize,
    group: Option<&GroupLimitConfig>,
) -> Result<Tensor<2, Int>> {
    match group {
        Some(g) => group_limited_topk(selection, k, g),
        None => topk_indices(selection, k),
    }
}

/// Routing decision of [`compute_routing`] (before capacity).
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[T, k]` selected experts, descending selection score (or as forced).
    pub indices: Tensor<2, Int>,
    /// `[T, E]` dense probs, zero outside the selection; differentiable.
    pub probs: Tensor<2>,
    /// `[T, E]` selection mask.
    pub routing_map: Tensor<2, Bool>,
}

/// `topk_routing_with_score_function` (docs/routing-and-dispatch.md §Score functions and top-k):
/// scores `logits [T, E]`, selects `k` experts per row (group-limited when `group` is set;
/// `expert_bias [E]` shifts the selection only), computes the normalised and scaled probs and
/// scatters them into dense `[T, E]`.
///
/// With `forced = Some(indices [T, k])` (router replay) the selection is skipped and the probs are
/// gathered at the forced indices, then normalised and scaled the same way
/// (docs/routing-and-dispatch.md §Router replay). Forced indices must be in range and distinct per
/// row (checked by the caller).
pub fn compute_routing(
    logits: Tensor<2>,
    spec: &ScoreSpec,
    k: usize,
    group: Option<&GroupLimitConfig>,
    expert_bias: Option<Tensor<1>>,
    forced: Option<Tensor<2, Int>>,
) -> Result<Routing> {
    let [t, e] = logits.dims();
    let scores = spec.scores(logits, expert_bias);
    let indices = match forced {
        Some(idx) => {
            if idx.dims() != [t, k] {
                return Err(BackendError::Shape {
                    op: "compute_routing",
                    detail: format!("forced indices {:?}, expected [{t}, {k}]", idx.dims()),
                });
            }
            idx
        }
        None => select_topk(scores.selection, k, group)?,
    };
    let topk_probs = spec.topk_probs(scores.source, indices.clone());
    let device = topk_probs.device();
    let probs = Tensor::<2>::zeros([t, e], (&device, topk_probs.dtype())).scatter(
        1,
        indices.clone(),
        topk_probs,
        IndexingUpdateOp::Add,
    );
    let routing_map = routing_map_from_indices(indices.clone(), e);
    Ok(Routing {
        indices,
        probs,
        routing_map,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::scoring::ScoreFunction;
    use crate::router::testing::{f64_tensor, host_f64, host_usize, lcg_values, ref_topk};
    use burn::tensor::Device;

    /// Naive group-limited top-k on one row (docs/routing-and-dispatch.md §Group-limited top-k).
    fn ref_group_topk(row: &[f64], k: usize, g: &GroupLimitConfig) -> Vec<usize> {
        let per = row.len() / g.num_groups;
        let group_scores: Vec<f64> = (0..g.num_groups)
            .map(|gi| {
                let grp = &row[gi * per..(gi + 1) * per];
                ref_topk(grp, g.group_score_topk)
                    .iter()
                    .map(|&i| grp[i])
                    .sum()
            })
            .collect();
        let kept = ref_topk(&group_scores, g.group_topk);
        let masked: Vec<f64> = row
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if kept.contains(&(i / per)) {
                    v
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        ref_topk(&masked, k)
    }

    #[test]
    fn router_group_limited_topk_spans_at_most_g_groups() {
        // docs/routing-and-dispatch.md §Acceptance properties, item 6: E=16, k=4, (g, G) ∈ {(3, 8),
        // (2, 4)}; m = k / g as in Megatron.
        let device = Device::flex();
        let (t, e, k) = (64, 16, 4);
        for (g, groups) in [(3, 8), (2, 4)] {
            let cfg = GroupLimitConfig::new(groups, g, (k / g).max(1));
            let values = lcg_values(t * e, 7 + g as u64);
            let idx = host_usize(
                group_limited_topk(f64_tensor(&values, [t, e], &device), k, &cfg).unwrap(),
            );
            let per = e / groups;
            for r in 0..t {
                let row_idx = &idx[r * k..(r + 1) * k];
                let mut used: Vec<usize> = row_idx.iter().map(|i| i / per).collect();
                used.sort_unstable();
                used.dedup();
                assert!(used.len() <= g, "row {r} uses groups {used:?}");
                let want = ref_group_topk(&values[r * e..(r + 1) * e], k, &cfg);
                assert_eq!(row_idx, &want[..], "row {r} (g={g}, G={groups})");
            }
        }
    }

    #[test]
    fn router_topk_ties_resolve_to_lower_index() {
        let device = Device::flex();
        // All-equal logits: post-softmax selects experts 0..k, probs 1/k.
        let spec = ScoreSpec {
            function: ScoreFunction::Softmax,
            pre_softmax: false,
            normalize: true,
            scaling_factor: None,
        };
        let r = compute_routing(
            f64_tensor(&[0.0; 8], [1, 8], &device),
            &spec,
            3,
            None,
            None,
            None,
        )
        .unwrap();
        assert_eq!(host_usize(r.indices), vec![0, 1, 2]);
        let p = host_f64(r.probs);
        assert_eq!(&p[..4], &[1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]);
        // Tied groups: the lower group index wins.
        let cfg = GroupLimitConfig::new(4, 1, 1);
        let idx = group_limited_topk(f64_tensor(&[1.0; 8], [1, 8], &device), 2, &cfg).unwrap();
        assert_eq!(host_usize(idx), vec![0, 1]);
    }

    #[test]
    fn router_forced_indices_are_honoured() {
        let device = Device::flex();
        let spec = ScoreSpec {
            function: ScoreFunction::Sigmoid,
            pre_softmax: false,
            normalize: true,
            scaling_factor: None,
        };
        let logits = f64_tensor(&[3.0, 2.0, 1.0, 0.0], [1, 4], &device);
        let forced = Tensor::<2, Int>::from_data([[3, 1]], &device);
        let r = compute_routing(logits, &spec, 2, None, None, Some(forced)).unwrap();
        assert_eq!(host_usize(r.indices), vec![3, 1]);
        let p = host_f64(r.probs);
        let (a, b) = (0.5, 1.0 / (1.0 + (-2.0f64).exp()));
        assert!((p[3] - a / (a + b + 1e-20)).abs() < 1e-15 && p[0] == 0.0 && p[2] == 0.0);
    }
}
