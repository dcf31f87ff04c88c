//! Loss aggregation and the clipped policy losses (PPO, GSPO).

use std::str::FromStr;

use burn::tensor::{DType, Tensor, TensorData};

use super::mask::ResponseMask;
use crate::ModelError;

/// Bound on `|log π − log π_old|` before the ratio is exponentiated (verl clamps
/// `negative_approx_kl` to `[-20, 20]` in `compute_policy_loss_vanilla`).
const PPO_LOG_RATIO_BOUND: f64 = 20.0;

/// Upper bound on GSPO's log sequence ratio (verl clamps `log_seq_importance_ratio` at 10).
const GSPO_LOG_RATIO_MAX: f64 = 10.0;

/// How a per-token loss matrix `l [B, S]` becomes one scalar (verl's `loss_agg_mode`).
///
/// With `m` the response mask, `n_b = Σ_t m_bt` the response tokens of sequence `b`,
/// `N = Σ_b n_b` and `B⁺` the number of sequences with `n_b > 0`:
///
/// | mode | value | verl |
/// |---|---|---|
/// | [`TokenMean`](Self::TokenMean) | `Σ_bt m·l / N` | `token-mean` |
/// | [`SeqMeanTokenSum`](Self::SeqMeanTokenSum) | `Σ_b (Σ_t m·l) / B⁺` | `seq-mean-token-sum` |
/// | [`SeqMeanTokenMean`](Self::SeqMeanTokenMean) | `Σ_{b: n_b>0} (Σ_t m·l / n_b) / B⁺` | `seq-mean-token-mean` |
/// | [`SeqMeanTokenSumNorm`](Self::SeqMeanTokenSumNorm) | `Σ_bt m·l / C` | `seq-mean-token-sum-norm` |
///
/// Sequences without a response token are left out of the sequence means (as in current verl,
/// which divides by the number of non-empty sequences); a batch without any response token is
/// an error in every mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LossAgg {
    /// Mean over every response token of the batch.
    #[default]
    TokenMean,
    /// Mean over sequences of the sum over their tokens.
    SeqMeanTokenSum,
    /// Mean over sequences of the mean over their tokens (GSPO's choice).
    SeqMeanTokenMean,
    /// Sum over the batch divided by a constant `C` (Dr. GRPO's normaliser): `scale`, or the
    /// mask's sequence length `S` when `None` (verl's `loss_scale_factor`). Not divided by
    /// the number of sequences, as in verl.
    SeqMeanTokenSumNorm {
        /// The constant `C`; `None` ⇒ `S`.
        scale: Option<usize>,
    },
}

impl LossAgg {
    /// verl's name of the mode.
    pub fn verl_name(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::SeqMeanTokenSum => "seq-mean-token-sum",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::SeqMeanTokenSumNorm { .. } => "seq-mean-token-sum-norm",
        }
    }
}

impl FromStr for LossAgg {
    type Err = ModelError;

    /// Parses verl's names (`seq-mean-token-sum-norm` gets `scale: None`).
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "token-mean" => Ok(Self::TokenMean),
            "seq-mean-token-sum" => Ok(Self::SeqMeanTokenSum),
            "seq-mean-token-mean" => Ok(Self::SeqMeanTokenMean),
            "seq-mean-token-sum-norm" => Ok(Self::SeqMeanTokenSumNorm { scale: None }),
            other => Err(ModelError::invalid(
                "loss_agg_mode",
                format!(
                    "unknown mode {other:?}; expected token-mean, seq-mean-token-sum, \
                     seq-mean-token-mean or seq-mean-token-sum-norm"
                ),
            )),
        }
    }
}

/// Aggregates the per-token losses `loss_mat [B, S]` over the response tokens of `mask`
/// (see [`LossAgg`] for the formulas). Returns `[1]`, differentiable through `loss_mat`;
/// masked positions are ignored (even if NaN) and get a zero gradient.
///
/// Errors if the shapes differ, the batch has no response token, or a
/// [`LossAgg::SeqMeanTokenSumNorm`] scale is 0.
pub fn aggregate(
    loss_mat: Tensor<2>,
    mask: &ResponseMask,
    agg: LossAgg,
) -> Result<Tensor<1>, ModelError> {
    mask.check("loss_mat", &loss_mat)?;
    mask.check_nonempty()?;
    let [batch, seq] = mask.dims();
    let dtype = loss_mat.dtype();
    let masked = mask.zero_masked(loss_mat);
    // `mul_scalar(1/n)`, not `div_scalar(n)`: Burn 0.22.1's autodiff takes the reciprocal of a
    // `div_scalar` divisor in f32 in the backward pass (f32-rounded gradients of f64 losses).
    Ok(match agg {
        LossAgg::TokenMean => masked.sum().mul_scalar(1.0 / mask.num_tokens() as f64),
        LossAgg::SeqMeanTokenSum => masked.sum().mul_scalar(1.0 / mask.num_nonempty() as f64),
        LossAgg::SeqMeanTokenMean => {
            let sequences = mask.num_nonempty() as f64;
            let weights: Vec<f64> = mask
                .lengths()
                .iter()
                .map(|&n| {
                    if n == 0 {
                        0.0
                    } else {
                        1.0 / (n as f64 * sequences)
                    }
                })
                .collect();
            let device = masked.device();
            let weights =
                Tensor::<2>::from_data(TensorData::new(weights, [batch, 1]), (&device, DType::F64))
                    .cast(dtype);
            (masked * weights).sum()
        }
        LossAgg::SeqMeanTokenSumNorm { scale } => {
            let scale = scale.unwrap_or(seq);
            if scale == 0 {
                return Err(ModelError::invalid(
                    "loss_scale_factor",
                    "the seq-mean-token-sum-norm scale must be positive",
                ));
            }
            masked.sum().mul_scalar(1.0 / scale as f64)
        }
    })
}

/// Clipped PPO settings (verl's actor `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`,
/// `loss_agg_mode`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PpoConfig {
    /// `ε_low`: the ratio is clipped below at `1 − ε_low`; in `[0, 1]`.
    pub clip_low: f64,
    /// `ε_high`: the ratio is clipped above at `1 + ε_high` (DAPO's clip-higher uses 0.28);
    /// `≥ 0`.
    pub clip_high: f64,
    /// Dual-clip bound `c > 1` (arXiv 1912.09729): for `A < 0` the loss is at most `−c·A`.
    /// `None` disables it (verl always applies it, with `c = 3` by default).
    pub dual_clip: Option<f64>,
    /// How token losses are aggregated.
    pub agg: LossAgg,
}

impl Default for PpoConfig {
    /// verl's defaults: `ε = 0.2` both ways, `c = 3`, `token-mean`.
    fn default() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: Some(3.0),
            agg: LossAgg::TokenMean,
        }
    }
}

impl PpoConfig {
    /// Errors (naming the field) unless `0 ≤ clip_low ≤ 1`, `clip_high ≥ 0` and the dual-clip
    /// bound is `> 1`, all finite.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_clip(self.clip_low, self.clip_high)?;
        if let Some(c) = self.dual_clip
            && !(c.is_finite() && c > 1.0)
        {
            return Err(ModelError::invalid(
                "clip_ratio_c",
                format!("the dual-clip bound must be a finite number > 1, got {c}"),
            ));
        }
        Ok(())
    }
}

/// GSPO settings (arXiv 2507.18071).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GspoConfig {
    /// `ε_low`: the sequence ratio is clipped below at `1 − ε_low`; in `[0, 1]`.
    pub clip_low: f64,
    /// `ε_high`: the sequence ratio is clipped above at `1 + ε_high`; `≥ 0`.
    pub clip_high: f64,
    /// How token losses are aggregated (verl always uses `seq-mean-token-mean` for GSPO).
    pub agg: LossAgg,
}

impl Default for GspoConfig {
    /// The paper's ranges `ε_low = 3e-4`, `ε_high = 4e-4` and `seq-mean-token-mean`.
    fn default() -> Self {
        Self {
            clip_low: 3e-4,
            clip_high: 4e-4,
            agg: LossAgg::SeqMeanTokenMean,
        }
    }
}

impl GspoConfig {
    /// Errors (naming the field) unless `0 ≤ clip_low ≤ 1` and `clip_high ≥ 0`, both finite.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_clip(self.clip_low, self.clip_high)
    }
}

fn check_clip(low: f64, high: f64) -> Result<(), ModelError> {
    if !(low.is_finite() && (0.0..=1.0).contains(&low)) {
        return Err(ModelError::invalid(
            "clip_ratio_low",
            format!("must be in [0, 1] (the lower ratio bound 1 − ε must be ≥ 0), got {low}"),
        ));
    }
    if !(high.is_finite() && high >= 0.0) {
        return Err(ModelError::invalid(
            "clip_ratio_high",
            format!("must be a finite number ≥ 0, got {high}"),
        ));
    }
    Ok(())
}

/// A policy loss and the metrics verl logs with it.
#[derive(Clone, Debug)]
pub struct PolicyLossOutput {
    /// `[1]` aggregated loss, differentiable through `logprobs`.
    pub loss: Tensor<1>,
    /// Fraction of response tokens where the clipped term is the larger one
    /// (`actor/pg_clipfrac`).
    pub clip_fraction: f64,
    /// Fraction of response tokens with `A < 0` where the dual clip bounds the loss
    /// (`actor/pg_clipfrac_lower`; 0 without dual clip and for GSPO).
    pub dual_clip_fraction: f64,
    /// Mean over response tokens of `log π_old − log π` (`actor/ppo_kl`; for PPO after the
    /// log-ratio clamp).
    pub approx_kl: f64,
}

/// A policy loss's per-token values `[B, S]` (differentiable through `logprobs`; finite at
/// masked positions) and its metrics, before aggregation.
pub(crate) struct TokenLosses {
    /// The per-token loss `l`.
    pub(crate) token_loss: Tensor<2>,
    /// See [`PolicyLossOutput::clip_fraction`].
    pub(crate) clip_fraction: f64,
    /// See [`PolicyLossOutput::dual_clip_fraction`].
    pub(crate) dual_clip_fraction: f64,
    /// See [`PolicyLossOutput::approx_kl`].
    pub(crate) approx_kl: f64,
}

impl TokenLosses {
    /// [`aggregate`]s the token losses into a [`PolicyLossOutput`].
    pub(crate) fn aggregate(
        self,
        mask: &ResponseMask,
        agg: LossAgg,
    ) -> Result<PolicyLossOutput, ModelError> {
        Ok(PolicyLossOutput {
            loss: aggregate(self.token_loss, mask, agg)?,
            clip_fraction: self.clip_fraction,
            dual_clip_fraction: self.dual_clip_fraction,
            approx_kl: self.approx_kl,
        })
    }
}

/// The checked, masked inputs of a policy loss: `(logprobs, old_logprobs, advantages)`.
fn policy_inputs(
    logprobs: Tensor<2>,
    old_logprobs: Tensor<2>,
    advantages: Tensor<2>,
    mask: &ResponseMask,
) -> Result<(Tensor<2>, Tensor<2>, Tensor<2>), ModelError> {
    mask.check("logprobs", &logprobs)?;
    mask.check("old_logprobs", &old_logprobs)?;
    mask.check("advantages", &advantages)?;
    mask.check_nonempty()?;
    let dtype = logprobs.dtype();
    Ok((
        mask.zero_masked(logprobs),
        mask.zero_masked(old_logprobs.detach().cast(dtype)),
        mask.zero_masked(advantages.detach().cast(dtype)),
    ))
}

/// Clipped PPO policy loss (verl's `compute_policy_loss_vanilla`), per token:
///
/// - `ρ = exp(clamp(log π − log π_old, −20, 20))`;
/// - `l = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))`;
/// - with dual clip `c` and `A < 0`: `l = min(l, −c·A)`;
///
/// then aggregated with `config.agg`. `logprobs`, `old_logprobs`, `advantages` are
/// `[B, S]` like `mask`; only `logprobs` is differentiated. The gradient follows the active
/// branch (zero where the ratio is clipped, or where the dual clip binds).
///
/// Errors if a shape differs from the mask's, the batch has no response token, or the
/// config is invalid ([`PpoConfig::validate`]).
pub fn ppo_loss(
    logprobs: Tensor<2>,
    old_logprobs: Tensor<2>,
    advantages: Tensor<2>,
    mask: &ResponseMask,
    config: &PpoConfig,
) -> Result<PolicyLossOutput, ModelError> {
    ppo_token_losses(logprobs, old_logprobs, advantages, mask, config)?.aggregate(mask, config.agg)
}

/// The per-token losses of [`ppo_loss`] before aggregation, with its metrics.
pub(crate) fn ppo_token_losses(
    logprobs: Tensor<2>,
    old_logprobs: Tensor<2>,
    advantages: Tensor<2>,
    mask: &ResponseMask,
    config: &PpoConfig,
) -> Result<TokenLosses, ModelError> {
    config.validate()?;
    let (logp, old, adv) = policy_inputs(logprobs, old_logprobs, advantages, mask)?;
    let log_ratio = (logp - old).clamp(-PPO_LOG_RATIO_BOUND, PPO_LOG_RATIO_BOUND);
    let ratio = log_ratio.clone().exp();
    let neg_adv = adv.clone().neg();
    let unclipped = neg_adv.clone() * ratio.clone();
    let clipped = neg_adv.clone() * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high);
    let clip_fraction =
        mask.host_fraction(clipped.clone().detach().greater(unclipped.clone().detach()))?;
    let mut token_loss = unclipped.max_pair(clipped);
    let mut dual_clip_fraction = 0.0;
    if let Some(c) = config.dual_clip {
        let bound = neg_adv.mul_scalar(c);
        let negative = adv.lower_elem(0.0);
        let binds = token_loss.clone().detach().greater(bound.clone());
        dual_clip_fraction = mask.host_fraction(binds.bool_and(negative.clone()))?;
        let bounded = token_loss.clone().min_pair(bound);
        token_loss = token_loss.mask_where(negative, bounded);
    }
    let approx_kl = mask.host_mean(log_ratio.neg())?;
    Ok(TokenLosses {
        token_loss,
        clip_fraction,
        dual_clip_fraction,
        approx_kl,
    })
}

/// GSPO policy loss (arXiv 2507.18071, verl's `compute_policy_loss_gspo`).
///
/// The sequence ratio `s_b = exp(Σ_t m·(log π − log π_old) / max(n_b, 1))` (the geometric mean
/// of the token ratios) is given to every token `t` of sequence `b` in GSPO-token form,
/// `log s_bt = log π_bt − sg[log π_bt] + sg[log s_b]` (`sg` = stop-gradient), clamped at 10
/// as in verl: its value is `s_b` and its gradient that of `s_b · π_bt / sg[π_bt]`, so each
/// token's gradient is `s_b · ∇ log π_bt`. Then per token
/// `l = max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high))`, aggregated with `config.agg`. With
/// per-sequence advantages and [`LossAgg::SeqMeanTokenMean`] this is exactly the gradient of
/// the sequence-level GSPO objective.
///
/// Errors as [`ppo_loss`].
pub fn gspo_loss(
    logprobs: Tensor<2>,
    old_logprobs: Tensor<2>,
    advantages: Tensor<2>,
    mask: &ResponseMask,
    config: &GspoConfig,
) -> Result<PolicyLossOutput, ModelError> {
    gspo_token_losses(logprobs, old_logprobs, advantages, mask, config)?.aggregate(mask, config.agg)
}

/// The per-token losses of [`gspo_loss`] before aggregation, with its metrics.
pub(crate) fn gspo_token_losses(
    logprobs: Tensor<2>,
    old_logprobs: Tensor<2>,
    advantages: Tensor<2>,
    mask: &ResponseMask,
    config: &GspoConfig,
) -> Result<TokenLosses, ModelError> {
    config.validate()?;
    let (logp, old, adv) = policy_inputs(logprobs, old_logprobs, advantages, mask)?;
    let [batch, _] = mask.dims();
    let dtype = logp.dtype();
    let device = logp.device();
    let log_ratio = logp.clone().detach() - old;
    let inv_len: Vec<f64> = mask
        .lengths()
        .iter()
        .map(|&n| 1.0 / n.max(1) as f64)
        .collect();
    let inv_len =
        Tensor::<2>::from_data(TensorData::new(inv_len, [batch, 1]), (&device, DType::F64))
            .cast(dtype);
    let seq_log_ratio = log_ratio.clone().sum_dim(1) * inv_len;
    let log_s = (logp.clone() - logp.detach() + seq_log_ratio).clamp_max(GSPO_LOG_RATIO_MAX);
    let s = log_s.exp();
    let neg_adv = adv.neg();
    let unclipped = neg_adv.clone() * s.clone();
    let clipped = neg_adv * s.clamp(1.0 - config.clip_low, 1.0 + config.clip_high);
    let clip_fraction =
        mask.host_fraction(clipped.clone().detach().greater(unclipped.clone().detach()))?;
    let token_loss = unclipped.max_pair(clipped);
    Ok(TokenLosses {
        token_loss,
        clip_fraction,
        dual_clip_fraction: 0.0,
        approx_kl: mask.host_mean(log_ratio.neg())?,
    })
}
