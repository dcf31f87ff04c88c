//! Rollout correction against plain `f64` references written from verl's definitions
//! (`rollout_corr_helper.py`: `compute_rollout_correction_weights`, `compute_is_metrics`,
//! `compute_rollout_rejection_mask`, `compute_rs_metrics`, `compute_offpolicy_metrics`) as loops
//! over host vectors, never calling the code under test; gradients included. One fixed batch
//! checks every metric against numbers worked out by hand.

use std::f64::consts::LN_2;

use burn::tensor::{DType, Tensor};
use moe_backend::testing::SplitMix as Rng;

use super::super::tests::{
    AGGS, Batch, RefPolicy, assert_close, host, leaf, ref_agg_weights, ref_aggregate, ref_gspo,
    ref_kl, ref_ppo, response_mask, scalar, tensor,
};
use super::*;
use crate::rl::{
    GspoConfig, KlEstimator, LossAgg, ObjectiveOutput, PolicyBatch, PolicyLoss, PolicyObjective,
    PpoConfig,
};

/// A random [`Batch`] with rollout log-probs `old − δ`, `δ` uniform in `±spread` (NaN off the
/// response tokens, like every input of the batch).
fn rollout_for(rng: &mut Rng, batch: &Batch, spread: f64) -> Vec<f64> {
    batch
        .old
        .iter()
        .zip(&batch.mask)
        .map(|(&old, &m)| {
            let delta = rng.uniform(-spread, spread);
            if m { old - delta } else { f64::NAN }
        })
        .collect()
}

/// `log r = trainer − rollout` (NaN off the response tokens).
fn log_ratios(trainer: &[f64], rollout: &[f64]) -> Vec<f64> {
    trainer.iter().zip(rollout).map(|(t, r)| t - r).collect()
}

/// Rows with at least one response token.
fn nonempty_rows(mask: &[bool], [b, s]: [usize; 2]) -> Vec<usize> {
    (0..b)
        .filter(|&r| (0..s).any(|t| mask[r * s + t]))
        .collect()
}

/// `Σ_t log r` over the response tokens of row `r`.
fn row_sum(mask: &[bool], s: usize, lr: &[f64], r: usize) -> f64 {
    (0..s)
        .filter(|&t| mask[r * s + t])
        .map(|t| lr[r * s + t])
        .sum()
}

fn max_of(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().fold(f64::NEG_INFINITY, f64::max)
}

fn min_of(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// verl's `compute_rollout_correction_weights` (applied weights, 0 off the response tokens) and
/// `compute_is_metrics`, from the formulas.
fn ref_is(mask: &[bool], shape: [usize; 2], lr: &[f64], is: &RolloutIs) -> (Vec<f64>, IsMetrics) {
    let [b, s] = shape;
    let c = is.threshold;
    let tokens: Vec<usize> = (0..b * s).filter(|&i| mask[i]).collect();
    let rows = nonempty_rows(mask, shape);
    let n = tokens.len() as f64;
    // Weights before truncation, on every response token.
    let raw: Vec<f64> = (0..b * s)
        .map(|i| {
            if !mask[i] {
                0.0
            } else if is.level == IsLevel::Token {
                lr[i].clamp(-20.0, 20.0).exp()
            } else {
                row_sum(mask, s, lr, i / s).clamp(-20.0, 20.0).exp()
            }
        })
        .collect();
    let token_mean = |f: &dyn Fn(usize) -> f64| tokens.iter().map(|&i| f(i)).sum::<f64>() / n;
    let clamped = |i: usize| raw[i].clamp(1.0 / c, c);
    let e = token_mean(&clamped);
    let e2 = token_mean(&|i| clamped(i) * clamped(i));
    let indicator = |x: bool| if x { 1.0 } else { 0.0 };
    let (max, min, high, low) = if is.level == IsLevel::Token {
        (
            max_of(tokens.iter().map(|&i| raw[i])),
            min_of(tokens.iter().map(|&i| raw[i])),
            token_mean(&|i| indicator(raw[i] > c)),
            token_mean(&|i| indicator(raw[i] < 1.0 / c)),
        )
    } else {
        let sums: Vec<f64> = rows.iter().map(|&r| row_sum(mask, s, lr, r)).collect();
        let frac = |f: &dyn Fn(f64) -> bool| {
            sums.iter().filter(|&&l| f(l)).count() as f64 / rows.len() as f64
        };
        (
            max_of(sums.iter().copied()).min(20.0).exp(),
            min_of(sums.iter().copied()).exp(),
            frac(&|l| l > c.ln()),
            frac(&|l| l < (1.0 / c).ln()),
        )
    };
    let mut weights: Vec<f64> = raw.iter().map(|w| w.min(c)).collect();
    let mut factor = None;
    if is.batch_normalize {
        let batch_mean = if is.level == IsLevel::Token {
            token_mean(&|i| weights[i])
        } else {
            // One weight per non-empty sequence: its first response token's.
            rows.iter()
                .map(|&r| {
                    let first = (0..s).find(|&t| mask[r * s + t]).unwrap();
                    weights[r * s + first]
                })
                .sum::<f64>()
                / rows.len() as f64
        };
        if batch_mean > 1e-8 {
            weights.iter_mut().for_each(|w| *w /= batch_mean);
            factor = Some(batch_mean);
        } else {
            factor = Some(1.0);
        }
    }
    let metrics = IsMetrics {
        mean: token_mean(&|i| raw[i]),
        max,
        min,
        ratio_fraction_high: high,
        ratio_fraction_low: low,
        std: if tokens.len() > 1 {
            (e2 - e * e).max(0.0).sqrt()
        } else {
            0.0
        },
        eff_sample_size: 1.0 / token_mean(&|i| (clamped(i) / e).powi(2)),
        batch_norm_factor: factor,
    };
    (weights, metrics)
}

/// verl's per-token divergences of `compute_rollout_rejection_mask` at `log r`.
fn ref_divergence(option: RsOption, lr: f64) -> f64 {
    let x = lr.clamp(-20.0, 20.0);
    match option {
        RsOption::TokenK1 | RsOption::SeqSumK1 | RsOption::SeqMeanK1 => -x,
        RsOption::TokenK2 | RsOption::SeqSumK2 | RsOption::SeqMeanK2 | RsOption::SeqMaxK2 => {
            0.5 * x * x
        }
        _ => x.exp() - 1.0 - x,
    }
}

/// verl's `compute_rollout_rejection_mask` and `compute_rs_metrics`: the kept response tokens
/// and the metrics.
fn ref_rs(
    mask: &[bool],
    shape: [usize; 2],
    lr: &[f64],
    criteria: &[RsCriterion],
) -> (Vec<bool>, RsMetrics) {
    let [b, s] = shape;
    let tokens: Vec<usize> = (0..b * s).filter(|&i| mask[i]).collect();
    let rows = nonempty_rows(mask, shape);
    let (n, nrows) = (tokens.len() as f64, rows.len() as f64);
    let mut kept = mask.to_vec();
    let mut per_criterion = Vec::new();
    for criterion in criteria {
        let option = criterion.option;
        // Bounds on the statistic: k1 in log space with the reciprocal default.
        let (lo, hi) = if option.is_k1() {
            let lower = criterion.lower.unwrap_or(1.0 / criterion.upper);
            (Some(lower.ln()), criterion.upper.ln())
        } else {
            (None, criterion.upper)
        };
        let passes = |v: f64| v <= hi && lo.is_none_or(|lo| v >= lo);
        let token_stat = |i: usize| ref_divergence(option, lr[i]);
        let row_stat = |r: usize| {
            let values: Vec<f64> = (0..s)
                .filter(|&t| mask[r * s + t])
                .map(|t| token_stat(r * s + t))
                .collect();
            match option {
                RsOption::SeqSumK1 | RsOption::SeqSumK2 | RsOption::SeqSumK3 => {
                    values.iter().sum::<f64>()
                }
                RsOption::SeqMeanK1 | RsOption::SeqMeanK2 | RsOption::SeqMeanK3 => {
                    values.iter().sum::<f64>() / values.len() as f64
                }
                _ => max_of(values),
            }
        };
        // The statistic each response token is judged by.
        let judged = |i: usize| {
            if option.is_sequence_level() {
                row_stat(i / s)
            } else {
                token_stat(i)
            }
        };
        let rejected: Vec<usize> = tokens
            .iter()
            .copied()
            .filter(|&i| !passes(judged(i)))
            .collect();
        for &i in &rejected {
            kept[i] = false;
        }
        let (max, min, high, low) = if option.is_sequence_level() {
            let stats: Vec<f64> = rows.iter().map(|&r| row_stat(r)).collect();
            let frac =
                |f: &dyn Fn(f64) -> bool| stats.iter().filter(|&&v| f(v)).count() as f64 / nrows;
            (
                max_of(stats.iter().copied()),
                min_of(stats.iter().copied()),
                frac(&|v| v > hi),
                lo.map_or(0.0, |lo| frac(&|v| v < lo)),
            )
        } else {
            let frac = |f: &dyn Fn(f64) -> bool| {
                tokens.iter().filter(|&&i| f(token_stat(i))).count() as f64 / n
            };
            (
                max_of(tokens.iter().map(|&i| token_stat(i))),
                min_of(tokens.iter().map(|&i| token_stat(i))),
                frac(&|v| v > hi),
                lo.map_or(0.0, |lo| frac(&|v| v < lo)),
            )
        };
        let rejected_rows = rows
            .iter()
            .filter(|&&r| rejected.iter().any(|&i| i / s == r))
            .count();
        per_criterion.push(RsCriterionMetrics {
            criterion: *criterion,
            mean: tokens.iter().map(|&i| judged(i)).sum::<f64>() / n,
            max,
            min,
            fraction_high: high,
            fraction_low: low,
            masked_fraction: rejected.len() as f64 / n,
            seq_masked_fraction: rejected_rows as f64 / nrows,
        });
    }
    let dropped = tokens.iter().filter(|&&i| !kept[i]).count() as f64;
    let dropped_rows = rows
        .iter()
        .filter(|&&r| (0..s).any(|t| mask[r * s + t] && !kept[r * s + t]))
        .count() as f64;
    let metrics = RsMetrics {
        masked_fraction: dropped / n,
        seq_masked_fraction: dropped_rows / nrows,
        criteria: per_criterion,
    };
    (kept, metrics)
}

/// The policy loss of `batch` over the `kept` tokens with token losses times `weights`, from
/// the plain PPO/GSPO references: `(loss, ∂loss/∂log π, the reference policy over kept)`.
fn ref_corrected(
    batch: &Batch,
    kept: &[bool],
    weights: Option<&[f64]>,
    loss: &PolicyLoss,
) -> (f64, Vec<f64>, RefPolicy) {
    let sub = Batch {
        mask: kept.to_vec(),
        ..batch.clone()
    };
    let policy = match loss {
        PolicyLoss::Ppo(c) => ref_ppo(&sub, &sub.logp, c),
        PolicyLoss::Gspo(c) => ref_gspo(&sub, c),
    };
    let w = |i: usize| weights.map_or(1.0, |w| w[i]);
    let weighted: Vec<f64> = (0..kept.len())
        .map(|i| {
            if kept[i] {
                policy.token_loss[i] * w(i)
            } else {
                0.0
            }
        })
        .collect();
    let agg = loss.agg();
    let value = ref_aggregate(&weighted, kept, batch.shape(), agg);
    let agg_w = ref_agg_weights(kept, batch.shape(), agg);
    let grad = (0..kept.len())
        .map(|i| {
            if kept[i] {
                agg_w[i] * w(i) * policy.token_grad[i]
            } else {
                0.0
            }
        })
        .collect();
    (value, grad, policy)
}

fn objective(policy_loss: PolicyLoss, correction: Option<RolloutCorrection>) -> PolicyObjective {
    PolicyObjective {
        policy_loss,
        rollout_correction: correction,
        ..PolicyObjective::default()
    }
}

/// Runs `objective` on `batch` (decoupled: `rollout` as `rollout_logprobs`), returning the
/// output and the `logprobs` leaf.
fn run(
    objective: &PolicyObjective,
    batch: &Batch,
    rollout: Option<&[f64]>,
    dtype: DType,
) -> Result<(ObjectiveOutput, Tensor<2>), ModelError> {
    let shape = batch.shape();
    let logp = tensor(&batch.logp, shape, dtype).require_grad();
    let mask = batch.mask();
    let out = objective.compute(PolicyBatch {
        logprobs: logp.clone(),
        old_logprobs: tensor(&batch.old, shape, dtype),
        advantages: tensor(&batch.adv, shape, DType::F64),
        mask: &mask,
        ref_logprobs: None,
        entropy: None,
        rollout_logprobs: rollout.map(|r| tensor(r, shape, DType::F64)),
    })?;
    Ok((out, logp))
}

/// Compares the objective's loss, gradient and policy metrics with the reference.
fn check_objective(
    out: ObjectiveOutput,
    logp: &Tensor<2>,
    want: (f64, Vec<f64>, RefPolicy),
    tol: f64,
    what: &str,
) {
    let (loss, grad, policy) = want;
    assert_close(&[scalar(out.loss.clone())], &[loss], tol, what);
    assert_close(&[out.metrics.pg_loss], &[loss], tol, what);
    assert_close(
        &[out.metrics.clip_fraction, out.metrics.dual_clip_fraction],
        &[policy.clip_fraction, policy.dual_clip_fraction],
        1e-12,
        what,
    );
    assert_close(&[out.metrics.approx_kl], &[policy.approx_kl], tol, what);
    let got = host(logp.grad(&out.loss.backward()).unwrap());
    assert!(got.iter().all(|g| g.is_finite()), "{what}: finite gradient");
    assert_close(&got, &grad, tol, what);
}

fn check_is_metrics(got: &IsMetrics, want: &IsMetrics, tol: f64) {
    assert_close(
        &[
            got.mean,
            got.max,
            got.min,
            got.ratio_fraction_high,
            got.ratio_fraction_low,
            got.std,
            got.eff_sample_size,
        ],
        &[
            want.mean,
            want.max,
            want.min,
            want.ratio_fraction_high,
            want.ratio_fraction_low,
            want.std,
            want.eff_sample_size,
        ],
        tol,
        "IS metrics",
    );
    assert_eq!(
        got.batch_norm_factor.is_some(),
        want.batch_norm_factor.is_some()
    );
    if let (Some(g), Some(w)) = (got.batch_norm_factor, want.batch_norm_factor) {
        assert_close(&[g], &[w], tol, "batch norm factor");
    }
}

fn check_rs_metrics(got: &RsMetrics, want: &RsMetrics, tol: f64) {
    assert_close(
        &[got.masked_fraction, got.seq_masked_fraction],
        &[want.masked_fraction, want.seq_masked_fraction],
        1e-12,
        "RS fractions",
    );
    assert_eq!(got.criteria.len(), want.criteria.len());
    for (g, w) in got.criteria.iter().zip(&want.criteria) {
        let what = g.criterion.option.verl_name();
        assert_eq!(g.criterion, w.criterion);
        assert_close(&[g.mean, g.max, g.min], &[w.mean, w.max, w.min], tol, what);
        assert_close(
            &[
                g.fraction_high,
                g.fraction_low,
                g.masked_fraction,
                g.seq_masked_fraction,
            ],
            &[
                w.fraction_high,
                w.fraction_low,
                w.masked_fraction,
                w.seq_masked_fraction,
            ],
            1e-12,
            what,
        );
    }
}

/// An [8, 9] batch (row 1 empty, NaN off the response tokens) whose rollout log-probs differ
/// from `old` by up to ±0.8, with one token past the ±20 safety bound and sequences whose
/// log-ratio sums pass +20 and −20.
fn mismatched_batch(seed: u64) -> (Batch, Vec<f64>) {
    let mut rng = Rng::new(seed);
    let mut batch = Batch::random(&mut rng, [8, 9], 0.3, false);
    let mut rollout = rollout_for(&mut rng, &batch, 0.8);
    let s = batch.s;
    // Token 0 of row 0 (a response token): log r = 25.
    rollout[0] = batch.old[0] - 25.0;
    // Rows 4 and 5: every token a response token, log r ≈ +3 and −3 (sums ≈ ±27).
    for (row, delta) in [(4, 3.0), (5, -3.0)] {
        let adv = rng.uniform(-1.0, 1.0);
        batch.force_row(&mut rng, row, 0.2, adv);
        let span = row * s..(row + 1) * s;
        for (r, old) in rollout[span.clone()].iter_mut().zip(&batch.old[span]) {
            *r = old - delta * rng.uniform(0.9, 1.1);
        }
    }
    (batch, rollout)
}

const POLICY_LOSSES: [PolicyLoss; 3] = [
    PolicyLoss::Ppo(PpoConfig {
        clip_low: 0.2,
        clip_high: 0.2,
        dual_clip: Some(3.0),
        agg: LossAgg::TokenMean,
    }),
    PolicyLoss::Ppo(PpoConfig {
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: None,
        agg: LossAgg::TokenMean,
    }),
    PolicyLoss::Gspo(GspoConfig {
        clip_low: 0.05,
        clip_high: 0.08,
        agg: LossAgg::SeqMeanTokenMean,
    }),
];

fn with_agg(loss: PolicyLoss, agg: LossAgg) -> PolicyLoss {
    match loss {
        PolicyLoss::Ppo(c) => PolicyLoss::Ppo(PpoConfig { agg, ..c }),
        PolicyLoss::Gspo(c) => PolicyLoss::Gspo(GspoConfig { agg, ..c }),
    }
}

#[test]
fn rl_correction_truncated_is_matches_reference_with_gradients() {
    let (batch, rollout) = mismatched_batch(11);
    let shape = batch.shape();
    let mask = batch.mask();
    let lr = log_ratios(&batch.old, &rollout);
    for level in [IsLevel::Token, IsLevel::Sequence] {
        for threshold in [2.0, 1.2] {
            for batch_normalize in [false, true] {
                let is = RolloutIs {
                    level,
                    threshold,
                    batch_normalize,
                };
                let config = RolloutCorrection {
                    rollout_is: Some(is),
                    ..RolloutCorrection::default()
                };
                let (want_w, want_m) = ref_is(&batch.mask, shape, &lr, &is);
                // Both truncation and the safety bound are exercised.
                assert!(want_m.ratio_fraction_high > 0.0 && want_m.ratio_fraction_low > 0.0);
                let out = rollout_correction(
                    tensor(&batch.old, shape, DType::F64),
                    tensor(&rollout, shape, DType::F64),
                    &mask,
                    &config,
                )
                .unwrap();
                let got_w = host(out.weights.clone().unwrap());
                assert_close(&got_w, &want_w, 1e-12, "IS weights");
                check_is_metrics(out.metrics.is.as_ref().unwrap(), &want_m, 1e-12);
                assert!(out.metrics.rs.is_none());
                assert_eq!(out.mask.lengths(), mask.lengths());
                for (k, loss) in POLICY_LOSSES.iter().enumerate() {
                    for agg in AGGS.into_iter().skip(k % 2) {
                        let loss = with_agg(*loss, agg);
                        let obj = objective(loss, Some(config.clone()));
                        let (out, logp) = run(&obj, &batch, Some(&rollout), DType::F64).unwrap();
                        let want = ref_corrected(&batch, &batch.mask, Some(&want_w), &loss);
                        check_objective(out, &logp, want, 1e-10, "weighted policy loss");
                    }
                }
            }
        }
    }
    // In f32, against the same f64 reference.
    let is = RolloutIs::token(1.5);
    let (want_w, _) = ref_is(&batch.mask, shape, &lr, &is);
    let loss = POLICY_LOSSES[0];
    let obj = objective(loss, Some(RolloutCorrection::decoupled_token_is(1.5)));
    let (out, logp) = run(&obj, &batch, Some(&rollout), DType::F32).unwrap();
    assert_eq!(out.loss.dtype(), DType::F32);
    let want = ref_corrected(&batch, &batch.mask, Some(&want_w), &loss);
    check_objective(out, &logp, want, 2e-5, "f32 weighted policy loss");
}

/// A threshold for `option` that rejects some but not all of [`mismatched_batch`]'s tokens
/// (rows 4 and 5, far off-policy, are always rejected).
fn criterion_for(option: RsOption) -> RsCriterion {
    match option {
        // Asymmetric bounds pin verl's orientation: −log r ∈ [ln 0.6, ln 1.5].
        RsOption::TokenK1 => RsCriterion::ratio_bounds(option, 0.6, 1.5),
        RsOption::SeqSumK1 => RsCriterion::ratio_bounds(option, 0.4, 3.0),
        RsOption::SeqMeanK1 => RsCriterion::ratio_bounds(option, 0.9, 1.25),
        RsOption::TokenK2 | RsOption::TokenK3 => RsCriterion::new(option, 0.1),
        RsOption::SeqSumK2 | RsOption::SeqSumK3 => RsCriterion::new(option, 0.8),
        RsOption::SeqMeanK2 | RsOption::SeqMeanK3 => RsCriterion::new(option, 0.1),
        RsOption::SeqMaxK2 | RsOption::SeqMaxK3 => RsCriterion::new(option, 0.25),
    }
}

#[test]
fn rl_correction_every_rejection_option_matches_reference_with_gradients() {
    let (batch, rollout) = mismatched_batch(12);
    let shape = batch.shape();
    let mask = batch.mask();
    let lr = log_ratios(&batch.old, &rollout);
    let mut sets: Vec<Vec<RsCriterion>> = RsOption::ALL
        .iter()
        .map(|&o| vec![criterion_for(o)])
        .collect();
    // Chained criteria must all pass; a k1 option with the reciprocal default.
    sets.push(vec![
        RsCriterion::new(RsOption::TokenK1, 1.8),
        criterion_for(RsOption::SeqMaxK3),
    ]);
    sets.push(vec![
        criterion_for(RsOption::SeqMeanK1),
        criterion_for(RsOption::TokenK3),
        criterion_for(RsOption::SeqSumK2),
    ]);
    for criteria in sets {
        let config = RolloutCorrection {
            rollout_rs: criteria.clone(),
            ..RolloutCorrection::default()
        };
        let (kept, want) = ref_rs(&batch.mask, shape, &lr, &criteria);
        let names: Vec<&str> = criteria.iter().map(|c| c.option.verl_name()).collect();
        // Each criterion rejects something and keeps something.
        for c in &want.criteria {
            assert!(
                c.masked_fraction > 0.0 && c.masked_fraction < 1.0,
                "{names:?}: {c:?}"
            );
        }
        if criteria.len() == 1 && criteria[0].option.is_k1() {
            assert!(want.criteria[0].fraction_low > 0.0 && want.criteria[0].fraction_high > 0.0);
        }
        let out = rollout_correction(
            tensor(&batch.old, shape, DType::F64),
            tensor(&rollout, shape, DType::F64),
            &mask,
            &config,
        )
        .unwrap();
        assert!(out.weights.is_none() && out.metrics.is.is_none());
        let got_kept = host(out.mask.tensor().clone().float().cast(DType::F64));
        let want_kept: Vec<f64> = kept.iter().map(|&k| f64::from(u8::from(k))).collect();
        assert_eq!(got_kept, want_kept, "{names:?}: kept tokens");
        check_rs_metrics(out.metrics.rs.as_ref().unwrap(), &want, 1e-12);
        for loss in [POLICY_LOSSES[0], POLICY_LOSSES[2]] {
            for agg in [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean] {
                let loss = with_agg(loss, agg);
                let obj = objective(loss, Some(config.clone()));
                let (out, logp) = run(&obj, &batch, Some(&rollout), DType::F64).unwrap();
                let want = ref_corrected(&batch, &kept, None, &loss);
                check_objective(out, &logp, want, 1e-10, "policy loss after rejection");
            }
        }
    }
}

#[test]
fn rl_correction_masked_is_presets_and_rejection_in_every_term() {
    let (batch, rollout) = mismatched_batch(13);
    let shape = batch.shape();
    let lr = log_ratios(&batch.old, &rollout);
    // verl's presets.
    let seq_mis = RolloutCorrection::decoupled_seq_is_rs(2.0, 0.5, 2.0);
    assert_eq!(seq_mis.rollout_is, Some(RolloutIs::sequence(2.0)));
    assert_eq!(
        seq_mis.rollout_rs,
        [RsCriterion::ratio_bounds(RsOption::SeqSumK1, 0.5, 2.0)]
    );
    let geo = RolloutCorrection::decoupled_geo_rs_token_tis(2.0, 0.999, 1.001);
    assert_eq!(geo.rollout_is, Some(RolloutIs::token(2.0)));
    assert_eq!(geo.rollout_rs[0].option, RsOption::SeqMeanK1);
    let k3 = RolloutCorrection::bypass_ppo_clip_k3_rs(0.01);
    assert!(k3.bypass_mode && k3.rollout_is.is_none());
    assert_eq!(k3.rollout_rs, [RsCriterion::new(RsOption::SeqMeanK3, 0.01)]);

    // Seq-MIS: kept sequences weighted by their truncated ratio, the others out of the loss.
    let (weights, _) = ref_is(&batch.mask, shape, &lr, &RolloutIs::sequence(2.0));
    let (kept, _) = ref_rs(&batch.mask, shape, &lr, &seq_mis.rollout_rs);
    let rejected_rows = (0..batch.b)
        .filter(|&r| (0..batch.s).any(|t| batch.mask[r * batch.s + t] && !kept[r * batch.s + t]))
        .count();
    assert!(
        rejected_rows >= 2 && kept.iter().any(|&k| k),
        "some but not all rejected"
    );
    for agg in AGGS {
        let loss = with_agg(POLICY_LOSSES[1], agg);
        let (out, logp) = run(
            &objective(loss, Some(seq_mis.clone())),
            &batch,
            Some(&rollout),
            DType::F64,
        )
        .unwrap();
        let want = ref_corrected(&batch, &kept, Some(&weights), &loss);
        check_objective(out, &logp, want, 1e-10, "Seq-MIS");
    }

    // The KL and entropy terms are aggregated over the kept tokens too.
    let config = RolloutCorrection::decoupled_k3_rs_token_tis(1.5, 0.1);
    let (weights, _) = ref_is(&batch.mask, shape, &lr, &RolloutIs::token(1.5));
    let (kept, _) = ref_rs(&batch.mask, shape, &lr, &config.rollout_rs);
    let mut rng = Rng::new(14);
    let reference: Vec<f64> = batch
        .logp
        .iter()
        .map(|v| v + rng.uniform(-1.0, 1.0))
        .collect();
    let entropy: Vec<f64> = batch
        .mask
        .iter()
        .map(|&m| if m { rng.uniform(0.0, 3.0) } else { f64::NAN })
        .collect();
    let loss = with_agg(POLICY_LOSSES[0], LossAgg::SeqMeanTokenSum);
    let obj = PolicyObjective {
        kl_coef: 0.05,
        entropy_coef: 0.01,
        kl_estimator: KlEstimator::K3,
        ..objective(loss, Some(config))
    };
    let mask = batch.mask();
    let logp = leaf(&batch.logp, shape);
    let ent = leaf(&entropy, shape);
    let out = obj
        .compute(PolicyBatch {
            logprobs: logp.clone(),
            old_logprobs: tensor(&batch.old, shape, DType::F64),
            advantages: tensor(&batch.adv, shape, DType::F64),
            mask: &mask,
            ref_logprobs: Some(tensor(&reference, shape, DType::F64)),
            entropy: Some(ent.clone()),
            rollout_logprobs: Some(tensor(&rollout, shape, DType::F64)),
        })
        .unwrap();
    let (pg, pg_grad, _) = ref_corrected(&batch, &kept, Some(&weights), &loss);
    let kl: Vec<(f64, f64)> = batch
        .logp
        .iter()
        .zip(&reference)
        .map(|(&a, &r)| ref_kl(a, r, KlEstimator::K3))
        .collect();
    let kl_values: Vec<f64> = kl.iter().map(|k| k.0).collect();
    let kl_loss = ref_aggregate(&kl_values, &kept, shape, loss.agg());
    let ent_loss = ref_aggregate(&entropy, &kept, shape, loss.agg());
    let total = pg - 0.01 * ent_loss + 0.05 * kl_loss;
    assert_close(
        &[
            scalar(out.loss.clone()),
            out.metrics.kl.unwrap(),
            out.metrics.entropy.unwrap(),
        ],
        &[total, kl_loss, ent_loss],
        1e-10,
        "objective over the kept tokens",
    );
    let grads = out.loss.backward();
    let w = ref_agg_weights(&kept, shape, loss.agg());
    let want_logp: Vec<f64> = (0..w.len())
        .map(|i| {
            if kept[i] {
                pg_grad[i] + 0.05 * w[i] * kl[i].1
            } else {
                0.0
            }
        })
        .collect();
    let want_ent: Vec<f64> = w.iter().map(|w| -0.01 * w).collect();
    assert_close(
        &host(logp.grad(&grads).unwrap()),
        &want_logp,
        1e-10,
        "d/d logprobs",
    );
    assert_close(
        &host(ent.grad(&grads).unwrap()),
        &want_ent,
        1e-10,
        "d/d entropy",
    );
}

#[test]
fn rl_correction_bypass_mode_rejects_on_the_current_policy_without_weights() {
    let mut rng = Rng::new(15);
    let mut batch = Batch::random(&mut rng, [5, 8], 0.4, true);
    // Bypass: `old_logprobs` are the rollout engine's; row 3 drifts far.
    batch.force_row(&mut rng, 3, 0.5, 1.0);
    let shape = batch.shape();
    // log r = log π_θ − log π_rollout.
    let lr = log_ratios(&batch.logp, &batch.old);
    let correction = RolloutCorrection {
        rollout_is: Some(RolloutIs::sequence(2.0)),
        ..RolloutCorrection::bypass_ppo_clip_geo_rs(0.9, 1.1)
    };
    let (kept, want_rs) = ref_rs(&batch.mask, shape, &lr, &correction.rollout_rs);
    assert!(want_rs.masked_fraction > 0.0 && want_rs.masked_fraction < 1.0);
    let (_, want_is) = ref_is(&batch.mask, shape, &lr, &RolloutIs::sequence(2.0));
    for agg in AGGS {
        let loss = with_agg(POLICY_LOSSES[0], agg);
        let obj = objective(loss, Some(correction.clone()));
        let (out, logp) = run(&obj, &batch, None, DType::F64).unwrap();
        let rollout = out.rollout.clone().unwrap();
        check_rs_metrics(rollout.rs.as_ref().unwrap(), &want_rs, 1e-12);
        check_is_metrics(rollout.is.as_ref().unwrap(), &want_is, 1e-12);
        // IS weights are measured, not applied: PPO's ratio is already π_θ / π_rollout.
        let want = ref_corrected(&batch, &kept, None, &loss);
        check_objective(out, &logp, want, 1e-10, "bypass");
    }
    let obj = objective(POLICY_LOSSES[0], Some(correction));
    let err = run(&obj, &batch, Some(&batch.old), DType::F64).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "rollout_logprobs",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn rl_correction_rejecting_everything_gives_a_zero_loss() {
    let (batch, rollout) = mismatched_batch(16);
    // No token has |log r| this small.
    let config = RolloutCorrection {
        rollout_rs: vec![RsCriterion::new(RsOption::TokenK2, 1e-30)],
        ..RolloutCorrection::decoupled_token_is(2.0)
    };
    let entropy: Vec<f64> = batch
        .mask
        .iter()
        .map(|&m| if m { 1.0 } else { f64::NAN })
        .collect();
    let obj = PolicyObjective {
        entropy_coef: 0.01,
        ..objective(POLICY_LOSSES[0], Some(config))
    };
    let shape = batch.shape();
    let mask = batch.mask();
    let logp = leaf(&batch.logp, shape);
    let ent = leaf(&entropy, shape);
    let out = obj
        .compute(PolicyBatch {
            logprobs: logp.clone(),
            old_logprobs: tensor(&batch.old, shape, DType::F64),
            advantages: tensor(&batch.adv, shape, DType::F64),
            mask: &mask,
            ref_logprobs: None,
            entropy: Some(ent.clone()),
            rollout_logprobs: Some(tensor(&rollout, shape, DType::F64)),
        })
        .unwrap();
    let rs = out.rollout.as_ref().unwrap().rs.as_ref().unwrap();
    assert_eq!((rs.masked_fraction, rs.seq_masked_fraction), (1.0, 1.0));
    assert_eq!(scalar(out.loss.clone()), 0.0);
    assert_eq!(
        (out.metrics.loss, out.metrics.pg_loss, out.metrics.entropy),
        (0.0, 0.0, Some(0.0))
    );
    let grads = out.loss.backward();
    assert!(host(logp.grad(&grads).unwrap()).iter().all(|&g| g == 0.0));
    assert!(host(ent.grad(&grads).unwrap()).iter().all(|&g| g == 0.0));
}

/// A [3, 3] batch by hand, `log r = old − rollout`:
///
/// - row 0: two response tokens, `old = [−1, −2]`, `rollout = [−1 − ln 2, −2 + ln 2]`, so
///   `log r = [ln 2, −ln 2]`;
/// - row 1: no response token (NaN everywhere);
/// - row 2: three, `old = [−0.5, −1.5, −1]`, `rollout = [−0.5, −1.5 − ln 2, −1 − ln 2]`, so
///   `log r = [0, ln 2, ln 2]`.
fn hand_batch() -> (Vec<bool>, Vec<f64>, Vec<f64>) {
    let nan = f64::NAN;
    let mask = vec![true, true, false, false, false, false, true, true, true];
    let old = vec![-1.0, -2.0, nan, nan, nan, nan, -0.5, -1.5, -1.0];
    let rollout = vec![
        -1.0 - LN_2,
        -2.0 + LN_2,
        nan,
        nan,
        nan,
        nan,
        -0.5,
        -1.5 - LN_2,
        -1.0 - LN_2,
    ];
    (mask, old, rollout)
}

#[test]
fn rl_correction_metrics_equal_hand_computed_values() {
    let (bits, old, rollout) = hand_batch();
    let shape = [3, 3];
    let mask = response_mask(&bits, shape);
    let correct = |config: &RolloutCorrection| {
        rollout_correction(
            tensor(&old, shape, DType::F64),
            tensor(&rollout, shape, DType::F64),
            &mask,
            config,
        )
        .unwrap()
    };
    let out = correct(&RolloutCorrection::default());
    assert!(out.weights.is_none() && out.metrics.is.is_none() && out.metrics.rs.is_none());
    let m = out.metrics.mismatch;
    let e = std::f64::consts::E;
    // log r over the 5 response tokens: [ln2, −ln2, 0, ln2, ln2].
    let want = [
        // kl = mean(−log r) = −(ln2 − ln2 + 0 + ln2 + ln2) / 5
        -2.0 * LN_2 / 5.0,
        // k3 = e^x − x − 1: ln2 → 1 − ln2 (three times), −ln2 → ln2 − 1/2, 0 → 0;
        // sum 3 − 3ln2 + ln2 − 1/2 = 5/2 − 2 ln2
        (2.5 - 2.0 * LN_2) / 5.0,
        // e^|x| = [2, 2, 1, 2, 2]: 9/5
        1.8,
        // e^{2x} = [4, 1/4, 1, 4, 4]: 13.25/5 − 1
        1.65,
        // sequence sums 0 and 2 ln2: (e^0 + e^{4 ln2}) / 2 − 1 = (1 + 16)/2 − 1
        7.5,
        // mean old per sequence: −3/2 and −1: (e^{3/2} + e^1) / 2
        (e.powf(1.5) + e) / 2.0,
        // (3/2 + 1) / 2
        1.25,
        // mean rollout per sequence: −3/2 and (−3 − 2 ln2)/3 = −1 − 2ln2/3:
        // (e^{3/2} + e^{1 + 2 ln2/3}) / 2 = (e^{3/2} + e · 2^{2/3}) / 2
        (e.powf(1.5) + e * 2f64.powf(2.0 / 3.0)) / 2.0,
        // (3/2 + 1 + 2ln2/3) / 2
        (2.5 + 2.0 * LN_2 / 3.0) / 2.0,
        // d = mean rollout − mean old = [0, −2ln2/3]: mean −ln2/3
        -LN_2 / 3.0,
        // mean |d| = ln2/3
        LN_2 / 3.0,
        // max d = 0
        0.0,
        // min d = −2 ln2 / 3
        -2.0 * LN_2 / 3.0,
        // mean e^d = (1 + 2^{−2/3}) / 2
        (1.0 + 2f64.powf(-2.0 / 3.0)) / 2.0,
    ];
    let got = [
        m.kl,
        m.k3_kl,
        m.token_mult_prob_error,
        m.chi2_token,
        m.chi2_seq,
        m.training_ppl,
        m.training_log_ppl,
        m.rollout_ppl,
        m.rollout_log_ppl,
        m.log_ppl_diff,
        m.log_ppl_abs_diff,
        m.log_ppl_diff_max,
        m.log_ppl_diff_min,
        m.ppl_ratio,
    ];
    assert_close(&got, &want, 1e-14, "mismatch metrics");

    // Token TIS, C = 1.5: w = e^{log r} = [2, 1/2, 1, 2, 2].
    let out = correct(&RolloutCorrection::decoupled_token_is(1.5));
    let is = out.metrics.is.unwrap();
    // w' = clamp(w, 2/3, 3/2) = [3/2, 2/3, 1, 3/2, 3/2]: mean 37/30, mean of squares
    // (3·9/4 + 4/9 + 1)/5 = 59/36; variance 59/36 − (37/30)² = 106/900.
    let (mean_c, mean_sq) = (37.0 / 30.0, 59.0 / 36.0);
    assert_close(
        &[
            is.mean,                // (2 + 1/2 + 1 + 2 + 2) / 5
            is.max,                 // 2
            is.min,                 // 1/2
            is.ratio_fraction_high, // w > 3/2: 3 of 5
            is.ratio_fraction_low,  // w < 2/3: 1 of 5
            is.std,                 // √106 / 30
            is.eff_sample_size,     // (37/30)² / (59/36)
        ],
        &[
            1.5,
            2.0,
            0.5,
            0.6,
            0.2,
            106f64.sqrt() / 30.0,
            mean_c * mean_c / mean_sq,
        ],
        1e-14,
        "token IS metrics",
    );
    assert_eq!(is.batch_norm_factor, None);
    // Applied: min(w, 3/2), 0 off the response tokens.
    let want_w = [1.5, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.5, 1.5];
    assert_close(&host(out.weights.unwrap()), &want_w, 1e-14, "token weights");
    // Batch-normalised: the truncated mean is 6/5.
    let mut config = RolloutCorrection::decoupled_token_is(1.5);
    if let Some(is) = config.rollout_is.as_mut() {
        is.batch_normalize = true;
    }
    let out = correct(&config);
    let factor = out.metrics.is.unwrap().batch_norm_factor.unwrap();
    assert_close(&[factor], &[1.2], 1e-14, "token batch-norm factor");
    let normalised: Vec<f64> = want_w.iter().map(|w| w / 1.2).collect();
    assert_close(
        &host(out.weights.unwrap()),
        &normalised,
        1e-14,
        "normalised",
    );

    // Sequence TIS, C = 3: sums [0, 2 ln2] ⇒ w = [1, 4] on 2 and 3 tokens.
    let mut config = RolloutCorrection::decoupled_seq_is(3.0);
    let out = correct(&config);
    let is = out.metrics.is.unwrap();
    // w' = clamp(w, 1/3, 3) = [1, 3]: token-weighted mean (2 + 9)/5 = 11/5, mean of squares
    // (2 + 27)/5 = 29/5, variance 29/5 − 121/25 = 24/25.
    assert_close(
        &[
            is.mean,                // (2·1 + 3·4) / 5
            is.max,                 // 4
            is.min,                 // 1
            is.ratio_fraction_high, // 2 ln2 > ln 3: 1 of 2 sequences
            is.ratio_fraction_low,  // none below −ln 3
            is.std,                 // √24 / 5
            is.eff_sample_size,     // (11/5)² / (29/5) = 121/145
        ],
        &[2.8, 4.0, 1.0, 0.5, 0.0, 24f64.sqrt() / 5.0, 121.0 / 145.0],
        1e-14,
        "sequence IS metrics",
    );
    let want_w = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0];
    assert_close(
        &host(out.weights.unwrap()),
        &want_w,
        1e-14,
        "sequence weights",
    );
    // Batch-normalised over the 2 sequences: (1 + 3) / 2 = 2.
    if let Some(is) = config.rollout_is.as_mut() {
        is.batch_normalize = true;
    }
    let out = correct(&config);
    let factor = out.metrics.is.unwrap().batch_norm_factor.unwrap();
    assert_close(&[factor], &[2.0], 1e-14, "sequence batch-norm factor");
    let normalised: Vec<f64> = want_w.iter().map(|w| w / 2.0).collect();
    assert_close(
        &host(out.weights.unwrap()),
        &normalised,
        1e-14,
        "normalised",
    );

    // Rejection: token_k1 within [0.45, 1.5] and seq_mean_k3 ≤ 0.22.
    // token_k1 = −log r = [−ln2, ln2, 0, −ln2, −ln2] against [ln 0.45, ln 1.5] ≈ [−0.80, 0.41]:
    // only token 1 (ln2 > ln 1.5) is rejected.
    // seq_mean_k3: row 0 (1 − ln2 + ln2 − 1/2)/2 = 1/4 > 0.22 (rejected), row 2
    // 2(1 − ln2)/3 ≈ 0.2046 (kept).
    let config = RolloutCorrection {
        rollout_rs: vec![
            RsCriterion::ratio_bounds(RsOption::TokenK1, 0.45, 1.5),
            RsCriterion::new(RsOption::SeqMeanK3, 0.22),
        ],
        ..RolloutCorrection::default()
    };
    let out = correct(&config);
    assert_eq!(out.mask.lengths(), [0, 0, 3]);
    let rs = out.metrics.rs.clone().unwrap();
    // Both tokens of row 0 rejected: 2 of 5 tokens, 1 of 2 sequences.
    assert_close(
        &[rs.masked_fraction, rs.seq_masked_fraction],
        &[0.4, 0.5],
        1e-15,
        "rejected",
    );
    let k1 = &rs.criteria[0];
    assert_close(
        &[
            k1.mean,                // (−ln2 + ln2 + 0 − ln2 − ln2) / 5
            k1.max,                 // ln2
            k1.min,                 // −ln2
            k1.fraction_high,       // 1 of 5 above ln 1.5
            k1.fraction_low,        // none below ln 0.45
            k1.masked_fraction,     // 1 of 5
            k1.seq_masked_fraction, // 1 of 2
        ],
        &[-2.0 * LN_2 / 5.0, LN_2, -LN_2, 0.2, 0.0, 0.2, 0.5],
        1e-15,
        "token_k1",
    );
    let k3 = &rs.criteria[1];
    let row2 = 2.0 * (1.0 - LN_2) / 3.0;
    assert_close(
        &[
            k3.mean,                // (2 · 1/4 + 3 · row2) / 5
            k3.max,                 // 1/4
            k3.min,                 // row2
            k3.fraction_high,       // 1 of 2 sequences
            k3.fraction_low,        // k3 has no lower bound
            k3.masked_fraction,     // 2 of 5 tokens
            k3.seq_masked_fraction, // 1 of 2
        ],
        &[(0.5 + 3.0 * row2) / 5.0, 0.25, row2, 0.5, 0.0, 0.4, 0.5],
        1e-15,
        "seq_mean_k3",
    );

    // verl's logging names.
    let scalars = out.metrics.clone();
    let names: Vec<String> = scalars.scalars().into_iter().map(|(k, _)| k).collect();
    for name in [
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/token_mult_prob_error",
        "rollout_corr/chi2_seq",
        "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/rollout_rs_token_k1_masked_fraction",
        "rollout_corr/rollout_rs_seq_mean_k3_fraction_high",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
    }
    let with_is = correct(&RolloutCorrection::decoupled_token_is(1.5)).metrics;
    let values = with_is.scalars();
    let mean = values
        .iter()
        .find(|(k, _)| k == "rollout_corr/rollout_is_mean")
        .map(|(_, v)| *v)
        .unwrap();
    assert_close(&[mean], &[1.5], 1e-14, "logged rollout_is_mean");
}

#[test]
fn rl_correction_without_a_correction_only_measures() {
    let (batch, rollout) = mismatched_batch(17);
    let loss = POLICY_LOSSES[0];
    let plain = objective(loss, None);
    let (with, logp) = run(&plain, &batch, Some(&rollout), DType::F64).unwrap();
    let (without, _) = run(&plain, &batch, None, DType::F64).unwrap();
    assert!(without.rollout.is_none());
    assert_eq!(scalar(with.loss.clone()), scalar(without.loss));
    let want = ref_corrected(&batch, &batch.mask, None, &loss);
    let measured = with.rollout.clone().unwrap();
    assert!(measured.is.is_none() && measured.rs.is_none());
    // The same numbers as the metrics-only correction of the same batch.
    let direct = rollout_correction(
        tensor(&batch.old, batch.shape(), DType::F64),
        tensor(&rollout, batch.shape(), DType::F64),
        &batch.mask(),
        &RolloutCorrection::default(),
    )
    .unwrap();
    assert_eq!(measured, direct.metrics);
    // Token k1 of the mismatch metrics: mean over response tokens of −log r.
    let lr = log_ratios(&batch.old, &rollout);
    let (n, sum) = lr
        .iter()
        .zip(&batch.mask)
        .filter(|(_, m)| **m)
        .fold((0.0, 0.0), |(n, s), (x, _)| (n + 1.0, s - x));
    assert_close(&[measured.mismatch.kl], &[sum / n], 1e-12, "kl");
    check_objective(with, &logp, want, 1e-10, "uncorrected loss");
}

#[test]
fn rl_correction_refuses_bad_settings_and_inputs() {
    let field_of = |err: ModelError| match err {
        ModelError::InvalidValue { field, .. } => field,
        other => panic!("{other}"),
    };
    for c in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let err = RolloutCorrection::decoupled_token_is(c)
            .validate()
            .unwrap_err();
        assert_eq!(field_of(err), "rollout_is_threshold");
    }
    let bad_rs = [
        RsCriterion::new(RsOption::TokenK2, 0.0),
        RsCriterion::new(RsOption::SeqMeanK3, f64::NAN),
        RsCriterion::new(RsOption::SeqSumK1, -2.0),
        RsCriterion::ratio_bounds(RsOption::TokenK1, 1.5, 0.5),
        RsCriterion::ratio_bounds(RsOption::SeqMeanK1, 0.0, 1.5),
        RsCriterion::ratio_bounds(RsOption::SeqSumK1, f64::NAN, 1.5),
        RsCriterion::ratio_bounds(RsOption::SeqMaxK2, 0.5, 1.5),
    ];
    for criterion in bad_rs {
        let config = RolloutCorrection {
            rollout_rs: vec![criterion],
            ..RolloutCorrection::default()
        };
        let err = config.validate().unwrap_err();
        let text = err.to_string();
        assert_eq!(field_of(err), "rollout_rs_threshold");
        assert!(text.contains(criterion.option.verl_name()), "{text}");
    }
    let twice = RolloutCorrection {
        rollout_rs: vec![
            RsCriterion::new(RsOption::TokenK3, 1.0),
            RsCriterion::new(RsOption::TokenK3, 2.0),
        ],
        ..RolloutCorrection::default()
    };
    assert_eq!(field_of(twice.validate().unwrap_err()), "rollout_rs");
    let ok = RsCriterion::ratio_bounds(RsOption::TokenK1, 0.8, 0.8);
    assert!(ok.validate().is_ok(), "lower = upper is allowed");

    // verl's option and threshold strings.
    let parsed = RsCriterion::parse_list("token_k1, seq_max_k3", "0.4_1.8,3.0").unwrap();
    assert_eq!(
        parsed,
        [
            RsCriterion::ratio_bounds(RsOption::TokenK1, 0.4, 1.8),
            RsCriterion::new(RsOption::SeqMaxK3, 3.0),
        ]
    );
    let shared = RsCriterion::parse_list("seq_mean_k1,seq_mean_k1,token_k2", "2").unwrap();
    assert_eq!(
        shared,
        [
            RsCriterion::new(RsOption::SeqMeanK1, 2.0),
            RsCriterion::new(RsOption::TokenK2, 2.0),
        ]
    );
    assert_eq!(shared[0].statistic_bounds(), (Some(0.5f64.ln()), 2f64.ln()));
    for (rs, threshold, field) in [
        ("token_k4", "1", "rollout_rs"),
        (" , ", "1", "rollout_rs"),
        ("token_k2", "0.5_2", "rollout_rs_threshold"),
        ("token_k1,token_k2,token_k3", "1,2", "rollout_rs_threshold"),
        ("token_k1", "abc", "rollout_rs_threshold"),
        ("token_k1", "", "rollout_rs_threshold"),
        ("token_k1", "2_1", "rollout_rs_threshold"),
        ("seq_sum_k3", "-1", "rollout_rs_threshold"),
    ] {
        let err = RsCriterion::parse_list(rs, threshold).unwrap_err();
        assert_eq!(field_of(err), field, "{rs} {threshold}");
    }
    for option in RsOption::ALL {
        assert_eq!(option.verl_name().parse::<RsOption>().unwrap(), option);
    }
    assert_eq!("sequence".parse::<IsLevel>().unwrap(), IsLevel::Sequence);
    assert_eq!(
        field_of("geometric".parse::<IsLevel>().unwrap_err()),
        "rollout_is"
    );

    // Bad settings reach the objective's caller too.
    let (batch, rollout) = mismatched_batch(18);
    let bad = objective(
        POLICY_LOSSES[0],
        Some(RolloutCorrection::decoupled_seq_is_rs(2.0, 2.0, 0.5)),
    );
    let err = run(&bad, &batch, Some(&rollout), DType::F64).unwrap_err();
    assert_eq!(field_of(err), "rollout_rs_threshold");

    // Missing, misshapen or non-finite rollout log-probs.
    let input_of = |err: ModelError| match err {
        ModelError::InvalidInput { what, reason } => (what, reason),
        other => panic!("{other}"),
    };
    let corrected = objective(
        POLICY_LOSSES[0],
        Some(RolloutCorrection::decoupled_token_is(2.0)),
    );
    let (what, _) = input_of(run(&corrected, &batch, None, DType::F64).unwrap_err());
    assert_eq!(what, "rollout_logprobs");
    let mask = batch.mask();
    let shape = batch.shape();
    let err = rollout_correction(
        tensor(&batch.old, shape, DType::F64),
        tensor(&rollout[..63], [7, 9], DType::F64),
        &mask,
        &RolloutCorrection::default(),
    )
    .unwrap_err();
    let (what, reason) = input_of(err);
    assert_eq!(what, "rollout_logprobs");
    assert!(
        reason.contains("[7, 9]") && reason.contains("[8, 9]"),
        "{reason}"
    );
    // A response token of row 2 with a NaN or infinite rollout log-prob.
    let token = (2 * 9..3 * 9).find(|&i| batch.mask[i]).unwrap();
    for bad in [f64::NAN, f64::NEG_INFINITY] {
        let mut poisoned = rollout.clone();
        poisoned[token] = bad;
        let (what, reason) =
            input_of(run(&corrected, &batch, Some(&poisoned), DType::F64).unwrap_err());
        assert_eq!(what, "rollout_logprobs");
        assert!(reason.contains("sequence 2"), "{reason}");
    }
    let mut poisoned_old = batch.clone();
    poisoned_old.old[token] = f64::INFINITY;
    let (what, _) =
        input_of(run(&corrected, &poisoned_old, Some(&rollout), DType::F64).unwrap_err());
    assert_eq!(what, "old_logprobs");
    // An empty batch has nothing to correct.
    let empty = response_mask(&[false; 72], shape);
    let (what, _) = input_of(
        rollout_correction(
            tensor(&batch.old, shape, DType::F64),
            tensor(&rollout, shape, DType::F64),
            &empty,
            &RolloutCorrection::default(),
        )
        .unwrap_err(),
    );
    assert_eq!(what, "response_mask");
    // Misshapen IS weights handed to the policy loss.
    let err = POLICY_LOSSES[0]
        .compute(
            tensor(&batch.logp, shape, DType::F64),
            tensor(&batch.old, shape, DType::F64),
            tensor(&batch.adv, shape, DType::F64),
            &mask,
            Some(tensor(&rollout[..63], [7, 9], DType::F64)),
        )
        .unwrap_err();
    assert_eq!(input_of(err).0, "rollout_is_weights");
}
