//! Rollout correction: importance sampling (IS) and rejection sampling (RS) between the
//! policy of the rollout engine that generated a batch and the trainer's policy, with the
//! train–inference mismatch metrics.
//!
//! Follows verl's `verl/trainer/ppo/rollout_corr_helper.py` at commit `b178a3cd` (2026-01-29;
//! `compute_rollout_correction_weights`, `compute_rollout_rejection_mask`, `compute_is_metrics`,
//! `compute_rs_metrics`, `compute_offpolicy_metrics`), its `RolloutCorrectionConfig` presets
//! (`verl/trainer/config/algorithm.py`) and how `core_algos.py` applies the result
//! (`pg_losses * rollout_is_weights` before `agg_loss`; the rejection mask replaces the response
//! mask; `compute_policy_loss_bypass_mode` with `loss_type = "ppo_clip"`), plus NeMo-RL's
//! `token_mult_prob_error` (`nemo_rl/algorithms/loss/loss_functions.py`, `ClippedPGLossFn`,
//! commit `7ea279ab`).
//!
//! With `log r = log π_trainer − log π_rollout` per response token (`π_trainer` = the
//! trainer's old policy in verl's decoupled mode, its current policy, detached, in bypass
//! mode) and `log r̄ = clamp(log r, −20, 20)` (verl's `SAFETY_BOUND`):
//!
//! - **Truncated IS** ([`RolloutIs`], verl's `rollout_is`): `token`: `w_t = min(exp(log r̄_t), C)`;
//!   `sequence`: `w_b = min(exp(clamp(Σ_t log r_t, −20, 20)), C)` given to every token of
//!   sequence `b` (verl has no geometric-mean IS weight: the geometric mean is a rejection
//!   criterion, `seq_mean_k1`). Optionally divided by their batch mean
//!   (`rollout_is_batch_normalize`). The weights multiply the per-token policy loss before
//!   aggregation and are constants (detached).
//! - **Rejection sampling** ([`RsCriterion`], verl's `rollout_rs`): per token
//!   `k1 = −log r̄`, `k2 = ½ (log r̄)²`, `k3 = exp(log r̄) − 1 − log r̄`, used per token
//!   (`token_k*`) or as the sum / mean / max over the response tokens of a sequence
//!   (`seq_sum_k*`, `seq_mean_k*`, `seq_max_k*`). A `k1` statistic is kept inside
//!   `[ln lower, ln upper]`, a `k2`/`k3` statistic at most `upper`; several criteria must all
//!   pass. Rejected tokens (whole sequences for `seq_*`) leave the response mask, so they drop
//!   out of every loss term and of the aggregation's denominators, exactly as verl's modified
//!   `response_mask` does.
//! - **Masked IS** (verl's "Seq-MIS", [`RolloutCorrection::decoupled_seq_is_rs`]) is the
//!   composition of the two: sequence IS weights, and sequences whose ratio leaves the bounds
//!   rejected (`seq_sum_k1`); the kept ones keep their (truncated) ratio as weight, as in verl.
//!
//! Note on `k1` bounds, as in verl's code: the statistic is `−log r = log(π_rollout/π_trainer)`,
//! so `[lower, upper]` bounds `1/r`; a kept sequence has `1/upper ≤ r ≤ 1/lower`. For verl's
//! reciprocal bounds (`lower = 1/upper`, the default for one number) this is `[lower, upper]`.
//!
//! Deviations from verl, all in metrics only: sequence-level statistics (max/min/fractions,
//! perplexities, `chi2_seq`, `rollout_rs_seq_masked_fraction`) are taken over the sequences with
//! at least one response token (verl sometimes averages over every row, empty rows included),
//! and verl's `+ 1e-8` guards on denominators that are never zero here are left out.

use std::str::FromStr;

use burn::tensor::{Bool, DType, Tensor, TensorData};

use super::mask::ResponseMask;
use crate::ModelError;

/// Bound on log-ratios before they are exponentiated (verl's `SAFETY_BOUND`).
const SAFETY_BOUND: f64 = 20.0;

/// Below this, a batch-normalisation factor is not applied (verl's `weights_mean > 1e-8`).
const BATCH_NORM_MIN: f64 = 1e-8;

/// The aggregation level of the IS weights (verl's `rollout_is`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsLevel {
    /// One weight per token, `min(r_t, C)` (verl `token`, "Token-TIS").
    Token,
    /// One weight per sequence, `min(Π_t r_t, C)` (verl `sequence`, "Seq-TIS").
    Sequence,
}

impl IsLevel {
    /// verl's name of the level.
    pub fn verl_name(self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::Sequence => "sequence",
        }
    }
}

impl FromStr for IsLevel {
    type Err = ModelError;

    /// Parses verl's names, `token` and `sequence`.
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "token" => Ok(Self::Token),
            "sequence" => Ok(Self::Sequence),
            other => Err(ModelError::invalid(
                "rollout_is",
                format!("unknown level {other:?}; expected token or sequence"),
            )),
        }
    }
}

/// Truncated importance sampling (verl's `rollout_is`, `rollout_is_threshold`,
/// `rollout_is_batch_normalize`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RolloutIs {
    /// Token or sequence weights.
    pub level: IsLevel,
    /// The cap `C > 0` of the weights (verl default 2).
    pub threshold: f64,
    /// Divide the truncated weights by their mean over the batch (tokens for
    /// [`IsLevel::Token`], non-empty sequences for [`IsLevel::Sequence`]), unless that mean is
    /// ≤ 1e-8. The mean is over the batch given, not over data-parallel ranks (verl averages
    /// over every rank when `torch.distributed` is initialised).
    pub batch_normalize: bool,
}

impl RolloutIs {
    /// Token-level weights capped at `threshold`, without batch normalisation.
    pub fn token(threshold: f64) -> Self {
        Self {
            level: IsLevel::Token,
            threshold,
            batch_normalize: false,
        }
    }

    /// Sequence-level weights capped at `threshold`, without batch normalisation.
    pub fn sequence(threshold: f64) -> Self {
        Self {
            level: IsLevel::Sequence,
            threshold,
            batch_normalize: false,
        }
    }

    /// Errors (naming `rollout_is_threshold`) unless the cap is a finite number > 0.
    pub fn validate(&self) -> Result<(), ModelError> {
        let c = self.threshold;
        if !(c.is_finite() && c > 0.0) {
            return Err(ModelError::invalid(
                "rollout_is_threshold",
                format!("the IS weight cap must be a finite number > 0, got {c}"),
            ));
        }
        Ok(())
    }
}

/// The per-token divergence a rejection criterion is built on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Divergence {
    /// `−log r̄`, with lower and upper ratio bounds.
    K1,
    /// `½ (log r̄)²`, upper bound only.
    K2,
    /// `exp(log r̄) − 1 − log r̄`, upper bound only.
    K3,
}

/// Where a rejection criterion is evaluated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RsLevel {
    Token,
    SeqSum,
    SeqMean,
    SeqMax,
}

/// The rejection-sampling options of verl's `rollout_rs` (`SUPPORTED_ROLLOUT_RS_OPTIONS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RsOption {
    /// `token_k1`: each token's `−log r̄` within the log of the ratio bounds.
    TokenK1,
    /// `token_k2`: each token's `½ (log r̄)²` at most the bound.
    TokenK2,
    /// `token_k3`: each token's `exp(log r̄) − 1 − log r̄` at most the bound.
    TokenK3,
    /// `seq_sum_k1`: the sequence's `Σ −log r̄` within the log of the ratio bounds.
    SeqSumK1,
    /// `seq_sum_k2`: the sequence's sum of `k2`.
    SeqSumK2,
    /// `seq_sum_k3`: the sequence's sum of `k3`.
    SeqSumK3,
    /// `seq_mean_k1`: the sequence's mean `−log r̄` (a geometric-mean ratio bound, "Geo-RS").
    SeqMeanK1,
    /// `seq_mean_k2`: the sequence's mean `k2`.
    SeqMeanK2,
    /// `seq_mean_k3`: the sequence's mean `k3` ("K3-RS").
    SeqMeanK3,
    /// `seq_max_k2`: the sequence's largest `k2`.
    SeqMaxK2,
    /// `seq_max_k3`: the sequence's largest `k3`.
    SeqMaxK3,
}

impl RsOption {
    /// Every option, in verl's order.
    pub const ALL: [RsOption; 11] = [
        Self::TokenK1,
        Self::TokenK2,
        Self::TokenK3,
        Self::SeqSumK1,
        Self::SeqSumK2,
        Self::SeqSumK3,
        Self::SeqMeanK1,
        Self::SeqMeanK2,
        Self::SeqMeanK3,
        Self::SeqMaxK2,
        Self::SeqMaxK3,
    ];

    /// verl's name of the option.
    pub fn verl_name(self) -> &'static str {
        match self {
            Self::TokenK1 => "token_k1",
            Self::TokenK2 => "token_k2",
            Self::TokenK3 => "token_k3",
            Self::SeqSumK1 => "seq_sum_k1",
            Self::SeqSumK2 => "seq_sum_k2",
            Self::SeqSumK3 => "seq_sum_k3",
            Self::SeqMeanK1 => "seq_mean_k1",
            Self::SeqMeanK2 => "seq_mean_k2",
            Self::SeqMeanK3 => "seq_mean_k3",
            Self::SeqMaxK2 => "seq_max_k2",
            Self::SeqMaxK3 => "seq_max_k3",
        }
    }

    /// Whether the option bounds `k1` with a lower and an upper ratio bound.
    pub fn is_k1(self) -> bool {
        self.divergence() == Divergence::K1
    }

    /// Whether the option rejects whole sequences.
    pub fn is_sequence_level(self) -> bool {
        self.level() != RsLevel::Token
    }

    fn divergence(self) -> Divergence {
        match self {
            Self::TokenK1 | Self::SeqSumK1 | Self::SeqMeanK1 => Divergence::K1,
            Self::TokenK2 | Self::SeqSumK2 | Self::SeqMeanK2 | Self::SeqMaxK2 => Divergence::K2,
            Self::TokenK3 | Self::SeqSumK3 | Self::SeqMeanK3 | Self::SeqMaxK3 => Divergence::K3,
        }
    }

    fn level(self) -> RsLevel {
        match self {
            Self::TokenK1 | Self::TokenK2 | Self::TokenK3 => RsLevel::Token,
            Self::SeqSumK1 | Self::SeqSumK2 | Self::SeqSumK3 => RsLevel::SeqSum,
            Self::SeqMeanK1 | Self::SeqMeanK2 | Self::SeqMeanK3 => RsLevel::SeqMean,
            Self::SeqMaxK2 | Self::SeqMaxK3 => RsLevel::SeqMax,
        }
    }
}

impl FromStr for RsOption {
    type Err = ModelError;

    /// Parses verl's option names (`token_k1`, …, `seq_max_k3`).
    fn from_str(s: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .find(|o| o.verl_name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|o| o.verl_name()).collect();
                ModelError::invalid(
                    "rollout_rs",
                    format!("unknown option {s:?}; expected one of {}", names.join(", ")),
                )
            })
    }
}

/// One rejection criterion: an option and its threshold (one entry of verl's `rollout_rs`
/// with its `rollout_rs_threshold`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RsCriterion {
    /// The statistic and where it is evaluated.
    pub option: RsOption,
    /// `k1` options: the lower ratio bound (`> 0`, `≤ upper`); `None` ⇒ `1 / upper`, as verl
    /// reads a single number. Must be `None` for `k2`/`k3` options.
    pub lower: Option<f64>,
    /// `k1` options: the upper ratio bound; `k2`/`k3` options: the largest divergence kept.
    /// A finite number `> 0`.
    pub upper: f64,
}

impl RsCriterion {
    /// A criterion with an upper bound (for `k1`, the lower bound is `1 / upper`).
    pub fn new(option: RsOption, upper: f64) -> Self {
        Self {
            option,
            lower: None,
            upper,
        }
    }

    /// A `k1` criterion with explicit ratio bounds (verl's `"lower_upper"`).
    pub fn ratio_bounds(option: RsOption, lower: f64, upper: f64) -> Self {
        Self {
            option,
            lower: Some(lower),
            upper,
        }
    }

    /// Errors (naming `rollout_rs_threshold` and the option) unless the bounds are finite and
    /// positive, `lower ≤ upper`, and a lower bound is given only to a `k1` option.
    pub fn validate(&self) -> Result<(), ModelError> {
        let name = self.option.verl_name();
        let field = "rollout_rs_threshold";
        let upper = self.upper;
        if !(upper.is_finite() && upper > 0.0) {
            return Err(ModelError::invalid(
                field,
                format!("the upper bound of {name} must be a finite number > 0, got {upper}"),
            ));
        }
        match (self.lower, self.option.is_k1()) {
            (Some(lower), true) => {
                if !(lower.is_finite() && lower > 0.0) {
                    return Err(ModelError::invalid(
                        field,
                        format!(
                            "the lower bound of {name} must be a finite number > 0, got {lower}"
                        ),
                    ));
                }
                if lower > upper {
                    return Err(ModelError::invalid(
                        field,
                        format!(
                            "the lower bound {lower} of {name} exceeds its upper bound {upper}"
                        ),
                    ));
                }
            }
            (Some(lower), false) => {
                return Err(ModelError::invalid(
                    field,
                    format!(
                        "{name} takes an upper bound only, got the lower bound {lower} (only k1 \
                         options have ratio bounds)"
                    ),
                ));
            }
            (None, _) => {}
        }
        Ok(())
    }

    /// `(lower, upper)` bounds on the option's statistic: `(ln lower, ln upper)` for `k1`,
    /// `(None, upper)` otherwise. Assumes [`validate`](Self::validate) passed.
    fn statistic_bounds(&self) -> (Option<f64>, f64) {
        if self.option.is_k1() {
            let lower = self.lower.unwrap_or(1.0 / self.upper);
            (Some(lower.ln()), self.upper.ln())
        } else {
            (None, self.upper)
        }
    }

    /// Parses verl's `rollout_rs` (comma-separated options; repeats dropped) and
    /// `rollout_rs_threshold` (one entry for every option, or one shared by all; `k1` entries
    /// are `"lower_upper"` or one number `u` meaning `1/u_u`; other entries one number), as
    /// verl's `_parse_rollout_rs_thresholds` does, then validates each criterion.
    pub fn parse_list(
        rollout_rs: &str,
        rollout_rs_threshold: &str,
    ) -> Result<Vec<Self>, ModelError> {
        let mut options: Vec<RsOption> = Vec::new();
        for name in rollout_rs
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let option: RsOption = name.parse()?;
            if !options.contains(&option) {
                options.push(option);
            }
        }
        if options.is_empty() {
            return Err(ModelError::invalid(
                "rollout_rs",
                format!("no option in {rollout_rs:?}"),
            ));
        }
        let specs: Vec<&str> = rollout_rs_threshold
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let specs: Vec<&str> = match specs.len() {
            0 => {
                return Err(ModelError::invalid(
                    "rollout_rs_threshold",
                    format!("no threshold in {rollout_rs_threshold:?}"),
                ));
            }
            1 => vec![specs.first().copied().unwrap_or_default(); options.len()],
            n if n == options.len() => specs,
            n => {
                return Err(ModelError::invalid(
                    "rollout_rs_threshold",
                    format!(
                        "{n} thresholds for {} options: give one shared threshold or one per \
                         option",
                        options.len()
                    ),
                ));
            }
        };
        let number = |option: RsOption, text: &str| {
            text.trim().parse::<f64>().map_err(|_| {
                ModelError::invalid(
                    "rollout_rs_threshold",
                    format!(
                        "invalid number {text:?} in the threshold of {}",
                        option.verl_name()
                    ),
                )
            })
        };
        let mut criteria = Vec::with_capacity(options.len());
        for (option, spec) in options.into_iter().zip(specs) {
            let criterion = match spec.split_once('_') {
                Some((lower, upper)) if option.is_k1() => {
                    Self::ratio_bounds(option, number(option, lower)?, number(option, upper)?)
                }
                Some(_) => {
                    return Err(ModelError::invalid(
                        "rollout_rs_threshold",
                        format!(
                            "{} takes a single upper bound without '_', got {spec:?}",
                            option.verl_name()
                        ),
                    ));
                }
                None => Self::new(option, number(option, spec)?),
            };
            criterion.validate()?;
            criteria.push(criterion);
        }
        Ok(criteria)
    }
}

/// Rollout correction settings (verl's `algorithm.rollout_correction`). The default corrects
/// nothing and only measures the mismatch (verl's `disabled()` preset).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RolloutCorrection {
    /// Truncated IS weights on the policy loss (`None` ⇒ none).
    pub rollout_is: Option<RolloutIs>,
    /// Rejection criteria, all of which a token must pass (empty ⇒ no rejection).
    pub rollout_rs: Vec<RsCriterion>,
    /// verl's bypass mode: the batch's `old_logprobs` are the rollout engine's (verl's
    /// `apply_bypass_mode`), PPO's ratio `π_θ / π_rollout` is the correction, and IS/RS compare
    /// the current policy (detached) with the rollout policy. IS weights are then measured but
    /// not applied (verl's `ppo_clip` loss type would count them twice).
    pub bypass_mode: bool,
}

impl RolloutCorrection {
    /// verl's `decoupled_token_is`: token-level truncated IS ("Token-TIS", verl default 2).
    pub fn decoupled_token_is(threshold: f64) -> Self {
        Self {
            rollout_is: Some(RolloutIs::token(threshold)),
            ..Self::default()
        }
    }

    /// verl's `decoupled_seq_is`: sequence-level truncated IS ("Seq-TIS", verl default 2).
    pub fn decoupled_seq_is(threshold: f64) -> Self {
        Self {
            rollout_is: Some(RolloutIs::sequence(threshold)),
            ..Self::default()
        }
    }

    /// verl's `decoupled_seq_is_rs` ("Seq-MIS"): sequence IS weights, and sequences whose
    /// `seq_sum_k1` leaves `[lower, upper]` rejected (verl defaults 2 and `0.5_2.0`).
    pub fn decoupled_seq_is_rs(is_threshold: f64, lower: f64, upper: f64) -> Self {
        Self {
            rollout_is: Some(RolloutIs::sequence(is_threshold)),
            rollout_rs: vec![RsCriterion::ratio_bounds(RsOption::SeqSumK1, lower, upper)],
            bypass_mode: false,
        }
    }

    /// verl's `decoupled_geo_rs` ("Geo-RS"): sequences rejected on their geometric-mean ratio
    /// (`seq_mean_k1`, verl default `0.999_1.001`), no IS weights.
    pub fn decoupled_geo_rs(lower: f64, upper: f64) -> Self {
        Self {
            rollout_rs: vec![RsCriterion::ratio_bounds(RsOption::SeqMeanK1, lower, upper)],
            ..Self::default()
        }
    }

    /// verl's `decoupled_geo_rs_token_tis`: Geo-RS and token-level truncated IS.
    pub fn decoupled_geo_rs_token_tis(is_threshold: f64, lower: f64, upper: f64) -> Self {
        Self {
            rollout_is: Some(RolloutIs::token(is_threshold)),
            ..Self::decoupled_geo_rs(lower, upper)
        }
    }

    /// verl's `decoupled_k3_rs` ("K3-RS"): sequences whose mean `k3` exceeds `threshold`
    /// rejected (`seq_mean_k3`, verl default 0.01), no IS weights.
    pub fn decoupled_k3_rs(threshold: f64) -> Self {
        Self {
            rollout_rs: vec![RsCriterion::new(RsOption::SeqMeanK3, threshold)],
            ..Self::default()
        }
    }

    /// verl's `decoupled_k3_rs_token_tis`: K3-RS and token-level truncated IS.
    pub fn decoupled_k3_rs_token_tis(is_threshold: f64, rs_threshold: f64) -> Self {
        Self {
            rollout_is: Some(RolloutIs::token(is_threshold)),
            ..Self::decoupled_k3_rs(rs_threshold)
        }
    }

    /// verl's `bypass_ppo_clip_geo_rs`: bypass mode with Geo-RS.
    pub fn bypass_ppo_clip_geo_rs(lower: f64, upper: f64) -> Self {
        Self {
            bypass_mode: true,
            ..Self::decoupled_geo_rs(lower, upper)
        }
    }

    /// verl's `bypass_ppo_clip_k3_rs`: bypass mode with K3-RS.
    pub fn bypass_ppo_clip_k3_rs(threshold: f64) -> Self {
        Self {
            bypass_mode: true,
            ..Self::decoupled_k3_rs(threshold)
        }
    }

    /// Errors (naming the field) if the IS cap or a rejection threshold is invalid, or an
    /// option is listed twice.
    pub fn validate(&self) -> Result<(), ModelError> {
        if let Some(is) = &self.rollout_is {
            is.validate()?;
        }
        for (i, criterion) in self.rollout_rs.iter().enumerate() {
            criterion.validate()?;
            if self.rollout_rs[..i]
                .iter()
                .any(|c| c.option == criterion.option)
            {
                return Err(ModelError::invalid(
                    "rollout_rs",
                    format!("option {} is listed twice", criterion.option.verl_name()),
                ));
            }
        }
        Ok(())
    }
}

/// Train–inference mismatch of one batch, over its response tokens, with
/// `log r = log π_trainer − log π_rollout` (verl's `compute_offpolicy_metrics` names, logged
/// as `rollout_corr/<name>`, and NeMo-RL's `token_mult_prob_error`). Sequence statistics are
/// over the sequences with a response token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MismatchMetrics {
    /// `mean(log π_rollout − log π_trainer)`: k1 estimate of `KL(π_rollout ‖ π_trainer)`.
    pub kl: f64,
    /// `mean(exp(log r) − log r − 1)`: k3 estimate of `KL(π_rollout ‖ π_trainer)` (unclamped;
    /// NeMo-RL's `gen_kl_error` with `k3`).
    pub k3_kl: f64,
    /// `mean(exp(|log r|))` (NeMo-RL's `token_mult_prob_error`; 1 when the engines agree).
    pub token_mult_prob_error: f64,
    /// `mean(exp(log r̄)²) − 1`: token-level χ² divergence.
    pub chi2_token: f64,
    /// `mean_b(exp(2 · clamp(Σ_t log r, ±20))) − 1`: sequence-level χ² divergence.
    pub chi2_seq: f64,
    /// `mean_b(exp(−mean_t log π_trainer))`: the trainer's perplexity, averaged over sequences.
    pub training_ppl: f64,
    /// `mean_b(−mean_t log π_trainer)`.
    pub training_log_ppl: f64,
    /// `mean_b(exp(−mean_t log π_rollout))`.
    pub rollout_ppl: f64,
    /// `mean_b(−mean_t log π_rollout)`.
    pub rollout_log_ppl: f64,
    /// `mean_b(d_b)` with `d_b = mean_t log π_rollout − mean_t log π_trainer`.
    pub log_ppl_diff: f64,
    /// `mean_b(|d_b|)`.
    pub log_ppl_abs_diff: f64,
    /// `max_b d_b`.
    pub log_ppl_diff_max: f64,
    /// `min_b d_b`.
    pub log_ppl_diff_min: f64,
    /// `mean_b(exp(d_b))`: the mean ratio of the trainer's to the rollout's perplexity.
    pub ppl_ratio: f64,
}

/// Statistics of the IS weights before truncation (verl's `compute_is_metrics`, logged as
/// `rollout_corr/rollout_is_<name>`), `w` the token weights (`exp(log r̄)`) or the sequence
/// weights (`exp(clamp(Σ log r, ±20))`, repeated on each token for token means), and
/// `w' = clamp(w, 1/C, C)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IsMetrics {
    /// Mean of `w` over response tokens.
    pub mean: f64,
    /// Largest `w` (sequence level: `exp(min(max_b Σ log r, 20))`).
    pub max: f64,
    /// Smallest `w` (sequence level: `exp(min_b Σ log r)`, unclamped as in verl).
    pub min: f64,
    /// Fraction of tokens (sequences) with `w > C` (`ratio_fraction_high`).
    pub ratio_fraction_high: f64,
    /// Fraction of tokens (sequences) with `w < 1/C` (`ratio_fraction_low`).
    pub ratio_fraction_low: f64,
    /// Standard deviation of `w'` over response tokens (0 for a single token).
    pub std: f64,
    /// `1 / mean((w' / mean(w'))²)` over response tokens (`eff_sample_size`).
    pub eff_sample_size: f64,
    /// The mean the applied weights were divided by, with `batch_normalize` (1 when it was
    /// ≤ 1e-8 and not applied); `None` without.
    pub batch_norm_factor: Option<f64>,
}

/// Statistics of one rejection criterion (verl's `compute_rs_metrics`, logged as
/// `rollout_corr/rollout_rs_<option>_<name>`). For a sequence option the statistic of a token
/// is its sequence's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RsCriterionMetrics {
    /// The criterion.
    pub criterion: RsCriterion,
    /// Mean of the statistic over response tokens.
    pub mean: f64,
    /// Largest statistic (over tokens, or over sequences for a sequence option).
    pub max: f64,
    /// Smallest statistic.
    pub min: f64,
    /// Fraction of tokens (sequences) above the upper bound (`ln upper` for `k1`).
    pub fraction_high: f64,
    /// Fraction of tokens (sequences) below `ln lower` (`k1` only; 0 otherwise).
    pub fraction_low: f64,
    /// Fraction of response tokens this criterion rejects.
    pub masked_fraction: f64,
    /// Fraction of sequences in which it rejects a token.
    pub seq_masked_fraction: f64,
}

/// What rejection sampling removed (verl's `rollout_rs_masked_fraction`,
/// `rollout_rs_seq_masked_fraction`), and each criterion's statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct RsMetrics {
    /// Fraction of response tokens rejected by any criterion.
    pub masked_fraction: f64,
    /// Fraction of sequences with a rejected token.
    pub seq_masked_fraction: f64,
    /// One entry per criterion, in the configured order.
    pub criteria: Vec<RsCriterionMetrics>,
}

/// Everything [`rollout_correction`] measures in one batch.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutCorrectionMetrics {
    /// The train–inference mismatch.
    pub mismatch: MismatchMetrics,
    /// IS weight statistics, with [`RolloutCorrection::rollout_is`].
    pub is: Option<IsMetrics>,
    /// Rejection statistics, with [`RolloutCorrection::rollout_rs`].
    pub rs: Option<RsMetrics>,
}

impl RolloutCorrectionMetrics {
    /// Every value under verl's logging name (`rollout_corr/…`; NeMo-RL's name for
    /// `token_mult_prob_error`), for a metrics writer.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let m = &self.mismatch;
        let mut out: Vec<(String, f64)> = [
            ("kl", m.kl),
            ("k3_kl", m.k3_kl),
            ("token_mult_prob_error", m.token_mult_prob_error),
            ("chi2_token", m.chi2_token),
            ("chi2_seq", m.chi2_seq),
            ("training_ppl", m.training_ppl),
            ("training_log_ppl", m.training_log_ppl),
            ("rollout_ppl", m.rollout_ppl),
            ("rollout_log_ppl", m.rollout_log_ppl),
            ("log_ppl_diff", m.log_ppl_diff),
            ("log_ppl_abs_diff", m.log_ppl_abs_diff),
            ("log_ppl_diff_max", m.log_ppl_diff_max),
            ("log_ppl_diff_min", m.log_ppl_diff_min),
            ("ppl_ratio", m.ppl_ratio),
        ]
        .into_iter()
        .map(|(k, v)| (format!("rollout_corr/{k}"), v))
        .collect();
        if let Some(is) = &self.is {
            let mut values = vec![
                ("mean", is.mean),
                ("max", is.max),
                ("min", is.min),
                ("ratio_fraction_high", is.ratio_fraction_high),
                ("ratio_fraction_low", is.ratio_fraction_low),
                ("std", is.std),
                ("eff_sample_size", is.eff_sample_size),
            ];
            if let Some(f) = is.batch_norm_factor {
                values.push(("batch_norm_factor", f));
            }
            out.extend(
                values
                    .into_iter()
                    .map(|(k, v)| (format!("rollout_corr/rollout_is_{k}"), v)),
            );
        }
        if let Some(rs) = &self.rs {
            out.push((
                "rollout_corr/rollout_rs_masked_fraction".to_owned(),
                rs.masked_fraction,
            ));
            out.push((
                "rollout_corr/rollout_rs_seq_masked_fraction".to_owned(),
                rs.seq_masked_fraction,
            ));
            for c in &rs.criteria {
                let name = c.criterion.option.verl_name();
                for (k, v) in [
                    ("mean", c.mean),
                    ("max", c.max),
                    ("min", c.min),
                    ("fraction_high", c.fraction_high),
                    ("fraction_low", c.fraction_low),
                    ("masked_fraction", c.masked_fraction),
                    ("seq_masked_fraction", c.seq_masked_fraction),
                ] {
                    out.push((format!("rollout_corr/rollout_rs_{name}_{k}"), v));
                }
            }
        }
        out
    }
}

/// What [`rollout_correction`] returns.
#[derive(Clone, Debug)]
pub struct RolloutCorrectionOutput {
    /// `[B, S]` IS weights to multiply the per-token policy loss by (detached, in the dtype of
    /// the trainer log-probs, 0 outside the original response tokens; rejected tokens keep
    /// theirs, the mask drops them), with [`RolloutCorrection::rollout_is`].
    pub weights: Option<Tensor<2>>,
    /// The response mask without the rejected tokens (the input mask without rejection).
    pub mask: ResponseMask,
    /// The batch's metrics.
    pub metrics: RolloutCorrectionMetrics,
}

/// IS weights, rejection mask and mismatch metrics of one batch (verl's
/// `compute_rollout_correction_and_rejection_mask`).
///
/// `trainer_logprobs` are the trainer's `log π_old` (decoupled mode) or current `log π_θ`
/// (bypass mode), `rollout_logprobs` the rollout engine's, both `[B, S]` like `mask` and
/// detached here (rollout ones cast to the trainer's dtype); values outside the response tokens
/// are never read (they may be NaN). [`RolloutCorrection::bypass_mode`] plays no part here.
///
/// Errors if the settings are invalid, a shape differs from the mask's, the batch has no
/// response token, or a log-probability of a response token is not finite.
pub fn rollout_correction(
    trainer_logprobs: Tensor<2>,
    rollout_logprobs: Tensor<2>,
    mask: &ResponseMask,
    config: &RolloutCorrection,
) -> Result<RolloutCorrectionOutput, ModelError> {
    correction_named(
        (trainer_logprobs, "trainer_logprobs"),
        (rollout_logprobs, "rollout_logprobs"),
        mask,
        config,
    )
}

/// [`rollout_correction`] with the names its errors give the two inputs.
pub(crate) fn correction_named(
    (trainer_logprobs, trainer_name): (Tensor<2>, &'static str),
    (rollout_logprobs, rollout_name): (Tensor<2>, &'static str),
    mask: &ResponseMask,
    config: &RolloutCorrection,
) -> Result<RolloutCorrectionOutput, ModelError> {
    config.validate()?;
    mask.check(trainer_name, &trainer_logprobs)?;
    mask.check(rollout_name, &rollout_logprobs)?;
    mask.check_nonempty()?;
    let dtype = trainer_logprobs.dtype();
    let [batch, seq] = mask.dims();
    let trainer = mask.zero_masked(trainer_logprobs.detach());
    let rollout = mask.zero_masked(rollout_logprobs.detach().cast(dtype));
    let log_ratio = trainer.clone() - rollout.clone();
    let safe = log_ratio.clone().clamp(-SAFETY_BOUND, SAFETY_BOUND);

    let mut rows = Rows::new(mask);
    let bad_trainer = rows.count(trainer.clone().is_finite().bool_not());
    let bad_rollout = rows.count(rollout.clone().is_finite().bool_not());
    let sum_log_ratio = rows.sum(log_ratio.clone());
    let sum_trainer = rows.sum(trainer);
    let sum_rollout = rows.sum(rollout);
    let sum_k3 =
        rows.sum(mask.zero_masked((log_ratio.clone().exp() - log_ratio.clone()).sub_scalar(1.0)));
    let sum_mult = rows.sum(mask.zero_masked(log_ratio.clone().abs().exp()));
    let sum_chi2 = rows.sum(mask.zero_masked(safe.clone().mul_scalar(2.0).exp()));

    // Token-level IS weights before truncation (`exp(log r̄)`, 0 off the response tokens).
    let token_weights = mask.zero_masked(safe.clone().exp());
    let is_columns = match &config.rollout_is {
        Some(is) if is.level == IsLevel::Token => {
            let c = is.threshold;
            let clamped = mask.zero_masked(token_weights.clone().clamp(1.0 / c, c));
            Some(TokenIsColumns {
                sum: rows.sum(token_weights.clone()),
                max: rows.max(token_weights.clone()),
                min: rows.min(token_weights.clone()),
                high: rows.count(token_weights.clone().greater_elem(c)),
                low: rows.count(token_weights.clone().lower_elem(1.0 / c)),
                clamped_sum: rows.sum(clamped.clone()),
                clamped_sq_sum: rows.sum(clamped.square()),
                truncated_sum: rows.sum(token_weights.clone().clamp_max(c)),
            })
        }
        _ => None,
    };

    // Rejection: per-criterion keep flags on the response tokens, and their statistics.
    let mut keep_all: Option<Tensor<2, Bool>> = None;
    let mut rs_columns = Vec::with_capacity(config.rollout_rs.len());
    for criterion in &config.rollout_rs {
        let (lower, upper) = criterion.statistic_bounds();
        let stat = match criterion.option.divergence() {
            Divergence::K1 => safe.clone().neg(),
            Divergence::K2 => safe.clone().square().mul_scalar(0.5),
            Divergence::K3 => (safe.clone().exp() - safe.clone()).sub_scalar(1.0),
        };
        let stat = mask.zero_masked(stat);
        let (keep, columns) = match criterion.option.level() {
            RsLevel::Token => {
                let keep = within(stat.clone(), lower, upper);
                let columns = RsColumns::Token {
                    sum: rows.sum(stat.clone()),
                    max: rows.max(stat.clone()),
                    min: rows.min(stat.clone()),
                    high: rows.count(stat.clone().greater_elem(upper)),
                    low: lower.map(|lo| rows.count(stat.lower_elem(lo))),
                };
                (keep, columns)
            }
            level => {
                let seq_stat = match level {
                    RsLevel::SeqSum => stat.sum_dim(1),
                    RsLevel::SeqMean => {
                        let inv_len = mask.lengths().iter().map(|&n| 1.0 / n.max(1) as f64);
                        stat.sum_dim(1) * per_row(inv_len.collect(), &log_ratio)
                    }
                    _ => {
                        // verl's `_sequence_max`: a sequence without tokens has statistic 0.
                        let max = stat
                            .mask_fill(mask.tensor().clone().bool_not(), f64::NEG_INFINITY)
                            .max_dim(1);
                        let empty = max.clone().equal_elem(f64::NEG_INFINITY);
                        max.mask_fill(empty, 0.0)
                    }
                };
                let keep = within(seq_stat.clone(), lower, upper).expand([batch, seq]);
                (keep, RsColumns::Sequence(rows.push(seq_stat)))
            }
        };
        let rejected = rows.count(keep.clone().bool_not());
        rs_columns.push((*criterion, columns, rejected));
        keep_all = Some(match keep_all {
            Some(all) => all.bool_and(keep),
            None => keep,
        });
    }
    let rejected_all = keep_all
        .as_ref()
        .map(|keep| rows.count(keep.clone().bool_not()));

    let values = rows.read()?;
    let lengths = mask.lengths();
    let nonempty: Vec<usize> = (0..batch).filter(|&b| lengths.get(b) != Some(&0)).collect();
    for (column, name) in [(bad_trainer, trainer_name), (bad_rollout, rollout_name)] {
        if let Some(b) = (0..batch).find(|&b| values.get(b, column) > 0.0) {
            return Err(ModelError::InvalidInput {
                what: name,
                reason: format!(
                    "{} non-finite value(s) at response tokens of sequence {b}",
                    values.get(b, column)
                ),
            });
        }
    }
    let tokens = mask.num_tokens() as f64;
    let sequences = nonempty.len() as f64;
    let token_mean = |column: usize| values.column_sum(column) / tokens;
    let seq_values =
        |f: &dyn Fn(usize) -> f64| -> Vec<f64> { nonempty.iter().map(|&b| f(b)).collect() };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let len = |b: usize| lengths.get(b).copied().unwrap_or(0) as f64;

    // Mismatch metrics.
    let mismatch = {
        let mean_train = seq_values(&|b| values.get(b, sum_trainer) / len(b));
        let mean_roll = seq_values(&|b| values.get(b, sum_rollout) / len(b));
        let diff: Vec<f64> = mean_roll
            .iter()
            .zip(&mean_train)
            .map(|(r, t)| r - t)
            .collect();
        let chi2_seq = seq_values(&|b| {
            (2.0 * values
                .get(b, sum_log_ratio)
                .clamp(-SAFETY_BOUND, SAFETY_BOUND))
            .exp()
        });
        MismatchMetrics {
            kl: -token_mean(sum_log_ratio),
            k3_kl: token_mean(sum_k3),
            token_mult_prob_error: token_mean(sum_mult),
            chi2_token: token_mean(sum_chi2) - 1.0,
            chi2_seq: mean(&chi2_seq) - 1.0,
            training_ppl: mean(&mean_train.iter().map(|m| (-m).exp()).collect::<Vec<_>>()),
            training_log_ppl: -mean(&mean_train),
            rollout_ppl: mean(&mean_roll.iter().map(|m| (-m).exp()).collect::<Vec<_>>()),
            rollout_log_ppl: -mean(&mean_roll),
            log_ppl_diff: mean(&diff),
            log_ppl_abs_diff: mean(&diff.iter().map(|d| d.abs()).collect::<Vec<_>>()),
            log_ppl_diff_max: diff.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            log_ppl_diff_min: diff.iter().copied().fold(f64::INFINITY, f64::min),
            ppl_ratio: mean(&diff.iter().map(|d| d.exp()).collect::<Vec<_>>()),
        }
    };

    // IS weights and their metrics.
    let (weights, is_metrics) = match &config.rollout_is {
        None => (None, None),
        Some(is) => {
            let c = is.threshold;
            let (mut metrics, truncated_mean, weights) = match &is_columns {
                Some(col) => {
                    let clamped_mean = token_mean(col.clamped_sum);
                    let clamped_sq_mean = token_mean(col.clamped_sq_sum);
                    let metrics = IsMetrics {
                        mean: token_mean(col.sum),
                        max: seq_values(&|b| values.get(b, col.max))
                            .into_iter()
                            .fold(f64::NEG_INFINITY, f64::max),
                        min: seq_values(&|b| values.get(b, col.min))
                            .into_iter()
                            .fold(f64::INFINITY, f64::min),
                        ratio_fraction_high: token_mean(col.high),
                        ratio_fraction_low: token_mean(col.low),
                        std: spread(tokens, clamped_mean, clamped_sq_mean),
                        eff_sample_size: clamped_mean * clamped_mean / clamped_sq_mean,
                        batch_norm_factor: None,
                    };
                    let truncated = token_weights.clamp_max(c);
                    (metrics, token_mean(col.truncated_sum), truncated)
                }
                None => {
                    // Sequence level: everything follows from the per-sequence log-ratio sums.
                    let log_sums = seq_values(&|b| values.get(b, sum_log_ratio));
                    let weight = |l: f64| l.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp();
                    let token_weighted = |f: &dyn Fn(f64) -> f64| {
                        nonempty
                            .iter()
                            .map(|&b| len(b) * f(values.get(b, sum_log_ratio)))
                            .sum::<f64>()
                            / tokens
                    };
                    let clamp_w = |l: f64| weight(l).clamp(1.0 / c, c);
                    let clamped_mean = token_weighted(&clamp_w);
                    let clamped_sq_mean = token_weighted(&|l| clamp_w(l).powi(2));
                    let fraction = |f: &dyn Fn(f64) -> bool| {
                        log_sums.iter().filter(|&&l| f(l)).count() as f64 / sequences
                    };
                    let max_log = log_sums.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let min_log = log_sums.iter().copied().fold(f64::INFINITY, f64::min);
                    let metrics = IsMetrics {
                        mean: token_weighted(&weight),
                        max: max_log.min(SAFETY_BOUND).exp(),
                        min: min_log.exp(),
                        ratio_fraction_high: fraction(&|l| l > c.ln()),
                        ratio_fraction_low: fraction(&|l| l < (1.0 / c).ln()),
                        std: spread(tokens, clamped_mean, clamped_sq_mean),
                        eff_sample_size: clamped_mean * clamped_mean / clamped_sq_mean,
                        batch_norm_factor: None,
                    };
                    let truncated_mean = mean(
                        &log_sums
                            .iter()
                            .map(|&l| weight(l).min(c))
                            .collect::<Vec<_>>(),
                    );
                    let seq_weights = log_ratio
                        .clone()
                        .sum_dim(1)
                        .clamp(-SAFETY_BOUND, SAFETY_BOUND)
                        .exp()
                        .clamp_max(c);
                    let weights = seq_weights * mask.to_float(dtype);
                    (metrics, truncated_mean, weights)
                }
            };
            let weights = if is.batch_normalize {
                if truncated_mean > BATCH_NORM_MIN {
                    metrics.batch_norm_factor = Some(truncated_mean);
                    weights.mul_scalar(1.0 / truncated_mean)
                } else {
                    metrics.batch_norm_factor = Some(1.0);
                    weights
                }
            } else {
                weights
            };
            (Some(weights.detach()), Some(metrics))
        }
    };

    // Rejection metrics and the new mask.
    let (kept, rs_metrics) = match (keep_all, rejected_all) {
        (Some(keep), Some(rejected_all)) => {
            let seq_fraction = |column: usize| {
                nonempty
                    .iter()
                    .filter(|&&b| values.get(b, column) > 0.0)
                    .count() as f64
                    / sequences
            };
            let criteria = rs_columns
                .iter()
                .map(|(criterion, columns, rejected)| {
                    let (lower, upper) = criterion.statistic_bounds();
                    let (mean, max, min, fraction_high, fraction_low) = match *columns {
                        RsColumns::Token {
                            sum,
                            max,
                            min,
                            high,
                            low,
                        } => (
                            token_mean(sum),
                            seq_values(&|b| values.get(b, max))
                                .into_iter()
                                .fold(f64::NEG_INFINITY, f64::max),
                            seq_values(&|b| values.get(b, min))
                                .into_iter()
                                .fold(f64::INFINITY, f64::min),
                            token_mean(high),
                            low.map_or(0.0, token_mean),
                        ),
                        RsColumns::Sequence(column) => {
                            let stats = seq_values(&|b| values.get(b, column));
                            let fraction = |f: &dyn Fn(f64) -> bool| {
                                stats.iter().filter(|&&s| f(s)).count() as f64 / sequences
                            };
                            (
                                nonempty
                                    .iter()
                                    .map(|&b| len(b) * values.get(b, column))
                                    .sum::<f64>()
                                    / tokens,
                                stats.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                                stats.iter().copied().fold(f64::INFINITY, f64::min),
                                fraction(&|s| s > upper),
                                lower.map_or(0.0, |lo| fraction(&|s| s < lo)),
                            )
                        }
                    };
                    RsCriterionMetrics {
                        criterion: *criterion,
                        mean,
                        max,
                        min,
                        fraction_high,
                        fraction_low,
                        masked_fraction: token_mean(*rejected),
                        seq_masked_fraction: seq_fraction(*rejected),
                    }
                })
                .collect();
            let metrics = RsMetrics {
                masked_fraction: token_mean(rejected_all),
                seq_masked_fraction: seq_fraction(rejected_all),
                criteria,
            };
            let kept = ResponseMask::from_bool(mask.tensor().clone().bool_and(keep))?;
            (kept, Some(metrics))
        }
        _ => (mask.clone(), None),
    };

    Ok(RolloutCorrectionOutput {
        weights,
        mask: kept,
        metrics: RolloutCorrectionMetrics {
            mismatch,
            is: is_metrics,
            rs: rs_metrics,
        },
    })
}

/// `sqrt(max(E[x²] − E[x]², 0))`, 0 for a single token (verl's clamped-weight std).
fn spread(tokens: f64, mean: f64, sq_mean: f64) -> f64 {
    if tokens > 1.0 {
        (sq_mean - mean * mean).max(0.0).sqrt()
    } else {
        0.0
    }
}

/// `lower ≤ x ≤ upper` (no lower bound when `None`).
fn within<const D: usize>(x: Tensor<D>, lower: Option<f64>, upper: f64) -> Tensor<D, Bool> {
    let below_upper = x.clone().lower_equal_elem(upper);
    match lower {
        Some(lo) => x.greater_equal_elem(lo).bool_and(below_upper),
        None => below_upper,
    }
}

/// `[B, 1]` values on the device and dtype of `like`.
fn per_row(values: Vec<f64>, like: &Tensor<2>) -> Tensor<2> {
    let rows = values.len();
    Tensor::<2>::from_data(
        TensorData::new(values, [rows, 1]),
        (&like.device(), DType::F64),
    )
    .cast(like.dtype())
}

/// Column indices of the token-level IS statistics.
struct TokenIsColumns {
    sum: usize,
    max: usize,
    min: usize,
    high: usize,
    low: usize,
    clamped_sum: usize,
    clamped_sq_sum: usize,
    truncated_sum: usize,
}

/// Column indices of one rejection criterion's statistics.
enum RsColumns {
    /// Per-row sum, max, min, counts above and (for `k1`) below the bounds.
    Token {
        sum: usize,
        max: usize,
        min: usize,
        high: usize,
        low: Option<usize>,
    },
    /// The per-sequence statistic.
    Sequence(usize),
}

/// Per-row (`[B, 1]`) reductions gathered into one host read.
struct Rows {
    mask: Tensor<2, Bool>,
    columns: Vec<Tensor<2>>,
}

impl Rows {
    fn new(mask: &ResponseMask) -> Self {
        Self {
            mask: mask.tensor().clone(),
            columns: Vec::new(),
        }
    }

    /// Adds a `[B, 1]` column; returns its index.
    fn push(&mut self, column: Tensor<2>) -> usize {
        self.columns.push(column.cast(DType::F64));
        self.columns.len() - 1
    }

    /// Row sums of `x`, which must be 0 off the response tokens.
    fn sum(&mut self, x: Tensor<2>) -> usize {
        self.push(x.sum_dim(1))
    }

    /// Row counts of the response tokens where `flag` holds.
    fn count(&mut self, flag: Tensor<2, Bool>) -> usize {
        self.push(flag.bool_and(self.mask.clone()).float().sum_dim(1))
    }

    /// Row maxima over the response tokens (−∞ for an empty row).
    fn max(&mut self, x: Tensor<2>) -> usize {
        let off = self.mask.clone().bool_not();
        self.push(x.mask_fill(off, f64::NEG_INFINITY).max_dim(1))
    }

    /// Row minima over the response tokens (+∞ for an empty row).
    fn min(&mut self, x: Tensor<2>) -> usize {
        let off = self.mask.clone().bool_not();
        self.push(x.mask_fill(off, f64::INFINITY).min_dim(1))
    }

    /// Reads every column back at once.
    fn read(self) -> Result<RowValues, ModelError> {
        let width = self.columns.len();
        let values = Tensor::cat(self.columns, 1)
            .try_into_vec_as::<f64>()
            .map_err(|e| ModelError::InvalidInput {
                what: "rollout_logprobs",
                reason: format!("cannot read the correction statistics from the device: {e}"),
            })?;
        Ok(RowValues { width, values })
    }
}

/// The host copy of [`Rows`]: `values[row · width + column]`.
struct RowValues {
    width: usize,
    values: Vec<f64>,
}

impl RowValues {
    fn get(&self, row: usize, column: usize) -> f64 {
        self.values
            .get(row * self.width + column)
            .copied()
            .unwrap_or(f64::NAN)
    }

    fn column_sum(&self, column: usize) -> f64 {
        (0..self.values.len() / self.width.max(1))
            .map(|row| self.get(row, column))
            .sum()
    }
}

#[cfg(test)]
mod tests;
