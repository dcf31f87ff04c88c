//! Gating, score functions and top-k probabilities (docs/routing-and-dispatch.md §Gating,
//! §Score functions and top-k, and the loss inputs and z-loss of
//! §Load-balancing losses and z-loss).

use burn::config::Config;
use burn::tensor::activation::{sigmoid, softmax, softplus};
use burn::tensor::{FloatDType, Int, Tensor};

/// Score function applied to the router logits
/// (docs/routing-and-dispatch.md §Score functions and top-k).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ScoreFunction {
    /// Softmax over experts (pre- or post-top-k, see [`ScoreSpec::pre_softmax`]).
    Softmax,
    /// `sigmoid(logits)`.
    Sigmoid,
    /// `sqrt(softplus(logits))`.
    SqrtSoftplus,
}

/// How selected experts' probabilities are computed from the logits (the table of
/// docs/routing-and-dispatch.md §Score functions and top-k).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreSpec {
    /// Score function.
    pub function: ScoreFunction,
    /// Softmax only: softmax over all `E` experts before the top-k, no renormalisation.
    pub pre_softmax: bool,
    /// Sigmoid / sqrt-softplus only: renormalise the `k > 1` selected probs to sum to 1.
    pub normalize: bool,
    /// Multiplies the selected probs.
    pub scaling_factor: Option<f64>,
}

/// Score tensors of one forward: what the top-k selects on and what probs are gathered from.
#[derive(Clone, Debug)]
pub struct Scores {
    /// `[T, E]` differentiable tensor the selected probs are gathered from: softmax scores
    /// (pre-softmax), the logits (post-softmax) or the unbiased sigmoid / sqrt-softplus scores.
    pub source: Tensor<2>,
    /// `[T, E]` detached selection scores (`source`, plus the expert bias when given).
    pub selection: Tensor<2>,
}

/// Router gating (docs/routing-and-dispatch.md §Gating): `logits = x·Wᵀ (+ b)` with `x [T, H]`,
/// `W [E, H]`, `b [E]`, all cast to `dtype` before the matmul. Output `[T, E]` in `dtype`.
pub fn gating(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    dtype: FloatDType,
) -> Tensor<2> {
    let logits = x.cast(dtype).matmul(weight.cast(dtype).transpose());
    match bias {
        Some(b) => logits + b.cast(dtype).unsqueeze_dim(0),
        None => logits,
    }
}

/// Scores of `logits [T, E]` over all experts: softmax, sigmoid or sqrt-softplus.
fn base_scores(logits: Tensor<2>, function: ScoreFunction) -> Tensor<2> {
    match function {
        ScoreFunction::Softmax => softmax(logits, 1),
        ScoreFunction::Sigmoid => sigmoid(logits),
        ScoreFunction::SqrtSoftplus => softplus(logits, 1.0).sqrt(),
    }
}

impl ScoreSpec {
    /// Computes the selection scores of `logits [T, E]` (the table of
    /// docs/routing-and-dispatch.md §Score functions and top-k). `expert_bias [E]` is added to the
    /// selection scores only (sigmoid / sqrt-softplus).
    pub fn scores(&self, logits: Tensor<2>, expert_bias: Option<Tensor<1>>) -> Scores {
        let source = match self.function {
            ScoreFunction::Softmax if !self.pre_softmax => logits,
            f => base_scores(logits, f),
        };
        let detached = source.clone().detach();
        let selection = match expert_bias {
            Some(b) if self.function != ScoreFunction::Softmax => {
                detached + b.detach().cast(source.dtype()).unsqueeze_dim(0)
            }
            _ => detached,
        };
        Scores { source, selection }
    }

    /// Probabilities of the experts `indices [T, k]` gathered from `source [T, E]`, normalised and
    /// scaled as in docs/routing-and-dispatch.md §Score functions and top-k. Output `[T, k]`,
    /// differentiable through `source`.
    pub fn topk_probs(&self, source: Tensor<2>, indices: Tensor<2, Int>) -> Tensor<2> {
        let k = indices.dims()[1];
        let gathered = source.gather(1, indices);
        let probs = match self.function {
            ScoreFunction::Softmax if self.pre_softmax => gathered,
            ScoreFunction::Softmax => softmax(gathered, 1),
            _ if k > 1 && self.normalize => {
                let denom = gathered.clone().sum_dim(1).add_scalar(1e-20);
                gathered / denom
            }
            _ => gathered,
        };
        match self.scaling_factor {
            Some(s) => probs.mul_scalar(s),
            None => probs,
        }
    }
}

/// Aux-loss input `P [T, E]` (docs/routing-and-dispatch.md §Load-balancing losses and z-loss):
/// `softmax(logits)` for softmax routers, otherwise the sigmoid / sqrt-softplus scores normalised
/// over all experts (`s / (Σ_E s + 1e-20)`).
pub fn aux_loss_scores(logits: Tensor<2>, function: ScoreFunction) -> Tensor<2> {
    let scores = base_scores(logits, function);
    if function == ScoreFunction::Softmax {
        return scores;
    }
    let denom = scores.clone().sum_dim(1).add_scalar(1e-20);
    scores / denom
}

/// Row-wise `logsumexp(logits)` (`[T, E] -> [T, 1]`), stable for large logits.
pub fn logsumexp_rows(logits: Tensor<2>) -> Tensor<2> {
    let max = logits.clone().detach().max_dim(1);
    (logits - max.clone()).exp().sum_dim(1).log() + max
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::testing::{f64_tensor, host_f64};
    use burn::tensor::Device;

    fn spec(function: ScoreFunction, pre_softmax: bool) -> ScoreSpec {
        ScoreSpec {
            function,
            pre_softmax,
            normalize: true,
            scaling_factor: None,
        }
    }

    fn softmax_ref(v: &[f64]) -> Vec<f64> {
        let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = v.iter().map(|x| (x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn router_gating_matches_host_matmul_with_bias() {
        let device = Device::flex();
        let (t, h, e) = (3, 4, 2);
        let x: Vec<f64> = (0..t * h).map(|i| (i as f64 * 0.37).sin()).collect();
        let w: Vec<f64> = (0..e * h).map(|i| (i as f64 * 0.11).cos()).collect();
        let b = vec![0.5, -0.25];
        let logits = gating(
            f64_tensor(&x, [t, h], &device),
            f64_tensor(&w, [e, h], &device),
            Some(Tensor::<1>::from_data(
                burn::tensor::TensorData::new(b.clone(), [e]),
                (&device, burn::tensor::DType::F64),
            )),
            FloatDType::F64,
        );
        let got = host_f64(logits);
        for r in 0..t {
            for c in 0..e {
                let want: f64 = (0..h).map(|j| x[r * h + j] * w[c * h + j]).sum::<f64>() + b[c];
                assert!((got[r * e + c] - want).abs() < 1e-12, "({r},{c})");
            }
        }
    }

    #[test]
    fn router_topk_probs_match_reference_for_every_score_function() {
        let device = Device::flex();
        let row = [0.3, -1.2, 2.0, 0.7];
        let logits = f64_tensor(&row, [1, 4], &device);
        let idx = Tensor::<2, Int>::from_data([[2, 3]], &device);
        // post-softmax: softmax over the two selected logits.
        let post = spec(ScoreFunction::Softmax, false);
        let s = post.scores(logits.clone(), None);
        let got = host_f64(post.topk_probs(s.source, idx.clone()));
        let want = softmax_ref(&[2.0, 0.7]);
        assert!((got[0] - want[0]).abs() < 1e-15 && (got[1] - want[1]).abs() < 1e-15);
        // pre-softmax: softmax over all experts, no renormalisation.
        let pre = spec(ScoreFunction::Softmax, true);
        let s = pre.scores(logits.clone(), None);
        let got = host_f64(pre.topk_probs(s.source, idx.clone()));
        let full = softmax_ref(&row);
        assert!((got[0] - full[2]).abs() < 1e-15 && (got[1] - full[3]).abs() < 1e-15);
        // sigmoid / sqrt-softplus: normalised over the selection, then scaled.
        type Reference = fn(f64) -> f64;
        let pointwise: [(ScoreFunction, Reference); 2] = [
            (ScoreFunction::Sigmoid, |x| 1.0 / (1.0 + (-x).exp())),
            (ScoreFunction::SqrtSoftplus, |x| (1.0 + x.exp()).ln().sqrt()),
        ];
        for (function, f) in pointwise {
            let mut sp = spec(function, false);
            sp.scaling_factor = Some(2.5);
            let s = sp.scores(logits.clone(), None);
            let got = host_f64(sp.topk_probs(s.source, idx.clone()));
            let (a, b) = (f(2.0), f(0.7));
            let want = [2.5 * a / (a + b + 1e-20), 2.5 * b / (a + b + 1e-20)];
            for i in 0..2 {
                assert!(
                    (got[i] - want[i]).abs() < 1e-14,
                    "{function:?}: {got:?} vs {want:?}"
                );
            }
            sp.normalize = false;
            let s = sp.scores(logits.clone(), None);
            let got = host_f64(sp.topk_probs(s.source, idx.clone()));
            assert!(
                (got[0] - 2.5 * a).abs() < 1e-14,
                "{function:?} unnormalised"
            );
        }
    }

    #[test]
    fn router_expert_bias_changes_selection_only() {
        let device = Device::flex();
        let logits = f64_tensor(&[0.0, 1.0], [1, 2], &device);
        let bias = Tensor::<1>::from_data(
            burn::tensor::TensorData::new(vec![5.0f64, 0.0], [2]),
            (&device, burn::tensor::DType::F64),
        );
        let s = spec(ScoreFunction::Sigmoid, false).scores(logits, Some(bias));
        let sel = host_f64(s.selection);
        let src = host_f64(s.source);
        assert!((sel[0] - (0.5 + 5.0)).abs() < 1e-15);
        assert!((src[0] - 0.5).abs() < 1e-15, "the source stays unbiased");
    }

    #[test]
    fn router_aux_scores_and_logsumexp_match_reference() {
        let device = Device::flex();
        let row = [1.0, -2.0, 0.5];
        let p = host_f64(aux_loss_scores(
            f64_tensor(&row, [1, 3], &device),
            ScoreFunction::Sigmoid,
        ));
        let s: Vec<f64> = row.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
        let sum: f64 = s.iter().sum();
        for i in 0..3 {
            assert!((p[i] - s[i] / (sum + 1e-20)).abs() < 1e-15);
        }
        let big = [1000.0, 999.0, -5.0];
        let lse = host_f64(logsumexp_rows(f64_tensor(&big, [1, 3], &device)));
        let want = 1000.0 + (1.0 + (-1.0f64).exp() + (-1005.0f64).exp()).ln();
        assert!((lse[0] - want).abs() < 1e-12, "{lse:?} vs {want}");
    }
}
