//! The RL losses against plain `f64` references written from the formulas (loops over host
//! vectors, never calling the code under test), on seeded random inputs, gradients included.

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use moe_backend::testing::{SplitMix as Rng, finite_difference};

use super::*;
use crate::ModelError;

/// `n` values uniform in `[lo, hi)`.
pub(super) trait UniformValues {
    fn values_in(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64>;
}

impl UniformValues for Rng {
    fn values_in(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

pub(super) fn ad() -> Device {
    Device::flex().autodiff()
}

pub(super) fn tensor(values: &[f64], shape: [usize; 2], dtype: DType) -> Tensor<2> {
    Tensor::<2>::from_data(TensorData::new(values.to_vec(), shape), (&ad(), DType::F64)).cast(dtype)
}

pub(super) fn leaf(values: &[f64], shape: [usize; 2]) -> Tensor<2> {
    tensor(values, shape, DType::F64).require_grad()
}

pub(super) fn host<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.try_into_vec_as::<f64>().expect("float values")
}

pub(super) fn scalar(t: Tensor<1>) -> f64 {
    host(t)[0]
}

pub(super) fn response_mask(bits: &[bool], [b, s]: [usize; 2]) -> ResponseMask {
    let t = Tensor::<2, Bool>::from_data(TensorData::new(bits.to_vec(), [b, s]), &ad());
    ResponseMask::from_bool(t).expect("mask")
}

pub(super) fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// A random batch: row 1 has no response token, row 0 is all response tokens, the others
/// random; masked positions hold NaN in every input.
#[derive(Clone)]
pub(super) struct Batch {
    pub(super) b: usize,
    pub(super) s: usize,
    pub(super) mask: Vec<bool>,
    pub(super) logp: Vec<f64>,
    pub(super) old: Vec<f64>,
    pub(super) adv: Vec<f64>,
}

impl Batch {
    /// `log π − log π_old` uniform in `±spread`; one advantage per sequence when `per_seq`.
    pub(super) fn random(rng: &mut Rng, [b, s]: [usize; 2], spread: f64, per_seq: bool) -> Self {
        let mut mask: Vec<bool> = (0..b * s).map(|_| rng.uniform(0.0, 1.0) < 0.7).collect();
        mask[..s].iter_mut().for_each(|m| *m = true);
        mask[s..2 * s].iter_mut().for_each(|m| *m = false);
        let logp = rng.values_in(b * s, -3.0, -0.05);
        let old: Vec<f64> = logp
            .iter()
            .map(|lp| lp - rng.uniform(-spread, spread))
            .collect();
        let adv = if per_seq {
            let seq = rng.values_in(b, -2.0, 2.0);
            (0..b * s).map(|i| seq[i / s]).collect()
        } else {
            rng.values_in(b * s, -2.0, 2.0)
        };
        let mut batch = Self {
            b,
            s,
            mask,
            logp,
            old,
            adv,
        };
        batch.poison_padding();
        batch
    }

    /// Makes every token of `row` a response token with `log π − log π_old ≈ delta` and
    /// advantage `adv`.
    pub(super) fn force_row(&mut self, rng: &mut Rng, row: usize, delta: f64, adv: f64) {
        for i in row * self.s..(row + 1) * self.s {
            self.mask[i] = true;
            self.logp[i] = rng.uniform(-3.0, -0.05);
            self.old[i] = self.logp[i] - delta * rng.uniform(0.9, 1.1);
            self.adv[i] = adv;
        }
    }

    /// Token `i` of row 0 (always a response token): `log π − log π_old = delta`, advantage
    /// `adv`.
    fn force_token(&mut self, i: usize, delta: f64, adv: f64) {
        assert!(self.mask[i]);
        self.old[i] = self.logp[i] - delta;
        self.adv[i] = adv;
    }

    /// One token clipped above (`A > 0`), one below (`A < 0`), one where a dual clip with
    /// `c ≤ 3` binds (`A < 0`, `ρ ≈ 4.5`).
    fn force_clipping(&mut self) {
        self.force_token(0, 0.5, 1.0);
        self.force_token(1, -0.5, -1.0);
        self.force_token(2, 1.5, -0.8);
    }

    fn poison_padding(&mut self) {
        for i in 0..self.b * self.s {
            if !self.mask[i] {
                self.logp[i] = f64::NAN;
                self.old[i] = f64::NAN;
                self.adv[i] = f64::NAN;
            }
        }
    }

    pub(super) fn shape(&self) -> [usize; 2] {
        [self.b, self.s]
    }

    pub(super) fn mask(&self) -> ResponseMask {
        response_mask(&self.mask, self.shape())
    }
}

pub(super) const AGGS: [LossAgg; 5] = [
    LossAgg::TokenMean,
    LossAgg::SeqMeanTokenSum,
    LossAgg::SeqMeanTokenMean,
    LossAgg::SeqMeanTokenSumNorm { scale: None },
    LossAgg::SeqMeanTokenSumNorm { scale: Some(64) },
];

/// verl's `agg_loss` over host values (masked values are skipped, so NaN there is harmless).
pub(super) fn ref_aggregate(l: &[f64], mask: &[bool], [b, s]: [usize; 2], agg: LossAgg) -> f64 {
    let mut seq_sums = Vec::new();
    let mut seq_lens = Vec::new();
    for row in 0..b {
        let (mut sum, mut n) = (0.0, 0usize);
        for col in 0..s {
            if mask[row * s + col] {
                sum += l[row * s + col];
                n += 1;
            }
        }
        seq_sums.push(sum);
        seq_lens.push(n);
    }
    let tokens: usize = seq_lens.iter().sum();
    let nonempty = seq_lens.iter().filter(|&&n| n > 0).count() as f64;
    let total: f64 = seq_sums.iter().sum();
    match agg {
        LossAgg::TokenMean => total / tokens as f64,
        LossAgg::SeqMeanTokenSum => total / nonempty,
        LossAgg::SeqMeanTokenMean => {
            let mut acc = 0.0;
            for (sum, &n) in seq_sums.iter().zip(&seq_lens) {
                if n > 0 {
                    acc += sum / n as f64;
                }
            }
            acc / nonempty
        }
        LossAgg::SeqMeanTokenSumNorm { scale } => total / scale.unwrap_or(s) as f64,
    }
}

/// `∂ aggregate / ∂ l` (the aggregation is linear, so a difference quotient is exact up to
/// rounding); 0 at masked positions.
pub(super) fn ref_agg_weights(mask: &[bool], shape: [usize; 2], agg: LossAgg) -> Vec<f64> {
    let zeros = vec![0.0; mask.len()];
    finite_difference(|l| ref_aggregate(l, mask, shape, agg), &zeros, 0.5)
}

#[test]
fn rl_aggregate_matches_reference_in_every_mode() {
    let mut rng = Rng::new(1);
    let shape = [5, 7];
    let batch = Batch::random(&mut rng, shape, 1.0, false);
    let mask = batch.mask();
    assert_eq!(mask.lengths()[1], 0);
    assert_eq!(mask.num_nonempty(), 4);
    let mut l = rng.values_in(35, -2.0, 2.0);
    for (v, &m) in l.iter_mut().zip(&batch.mask) {
        if !m {
            *v = f64::NAN;
        }
    }
    for agg in AGGS {
        let x = leaf(&l, shape);
        let loss = aggregate(x.clone(), &mask, agg).unwrap();
        let want = ref_aggregate(&l, &batch.mask, shape, agg);
        assert_close(&[scalar(loss.clone())], &[want], 1e-12, agg.verl_name());
        let grad = host(x.grad(&loss.backward()).unwrap());
        let weights = ref_agg_weights(&batch.mask, shape, agg);
        assert_close(&grad, &weights, 1e-12, "aggregate gradient");
        assert_eq!(
            agg.verl_name().parse::<LossAgg>().unwrap().verl_name(),
            agg.verl_name()
        );
    }
    // Spot values: the empty row is excluded from the sequence means.
    let ones = vec![1.0; 35];
    let n = mask.num_tokens() as f64;
    let x = tensor(&ones, shape, DType::F64);
    let seq_sum = aggregate(x.clone(), &mask, LossAgg::SeqMeanTokenSum).unwrap();
    assert_close(
        &[scalar(seq_sum)],
        &[n / 4.0],
        1e-12,
        "seq-mean-token-sum of ones",
    );
    let seq_mean = aggregate(x, &mask, LossAgg::SeqMeanTokenMean).unwrap();
    assert_close(
        &[scalar(seq_mean)],
        &[1.0],
        1e-12,
        "seq-mean-token-mean of ones",
    );
    assert!("token-sum".parse::<LossAgg>().is_err());
}

pub(super) struct RefPolicy {
    pub(super) loss: f64,
    /// Per-token `∂ l / ∂ log π` (0 at masked positions), before aggregation.
    pub(super) token_grad: Vec<f64>,
    pub(super) token_loss: Vec<f64>,
    pub(super) clip_fraction: f64,
    pub(super) dual_clip_fraction: f64,
    pub(super) approx_kl: f64,
    clipped_low: usize,
    clipped_high: usize,
}

impl RefPolicy {
    fn grad(&self, batch: &Batch, agg: LossAgg) -> Vec<f64> {
        let w = ref_agg_weights(&batch.mask, batch.shape(), agg);
        w.iter().zip(&self.token_grad).map(|(w, d)| w * d).collect()
    }
}

/// `clip(x, lo, hi)` and its derivative factor.
fn clip(x: f64, lo: f64, hi: f64) -> (f64, f64) {
    if x < lo {
        (lo, 0.0)
    } else if x > hi {
        (hi, 0.0)
    } else {
        (x, 1.0)
    }
}

/// PPO per token, from the formulas of verl's `compute_policy_loss_vanilla`.
pub(super) fn ref_ppo(batch: &Batch, logp: &[f64], cfg: &PpoConfig) -> RefPolicy {
    let n = batch.b * batch.s;
    let (mut token_loss, mut token_grad) = (vec![0.0; n], vec![0.0; n]);
    let (mut clipped, mut dual, mut kl, mut tokens) = (0usize, 0usize, 0.0, 0usize);
    let (mut clipped_low, mut clipped_high) = (0, 0);
    for i in 0..n {
        if !batch.mask[i] {
            continue;
        }
        tokens += 1;
        let a = batch.adv[i];
        let (x, dx) = clip(logp[i] - batch.old[i], -20.0, 20.0);
        kl -= x;
        let (r, dr) = (x.exp(), x.exp() * dx);
        let (rc, drc_factor) = clip(r, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
        let (l1, d1) = (-a * r, -a * dr);
        let (l2, d2) = (-a * rc, -a * dr * drc_factor);
        let (mut l, mut d) = if l2 > l1 { (l2, d2) } else { (l1, d1) };
        if l2 > l1 {
            clipped += 1;
            if r < 1.0 {
                clipped_low += 1;
            } else {
                clipped_high += 1;
            }
        }
        if let Some(c) = cfg.dual_clip
            && a < 0.0
            && l > -a * c
        {
            dual += 1;
            (l, d) = (-a * c, 0.0);
        }
        token_loss[i] = l;
        token_grad[i] = d;
    }
    RefPolicy {
        loss: ref_aggregate(&token_loss, &batch.mask, batch.shape(), cfg.agg),
        token_grad,
        token_loss,
        clip_fraction: clipped as f64 / tokens as f64,
        dual_clip_fraction: dual as f64 / tokens as f64,
        approx_kl: kl / tokens as f64,
        clipped_low,
        clipped_high,
    }
}

fn check_policy(
    out: PolicyLossOutput,
    want: &RefPolicy,
    logp: &Tensor<2>,
    batch: &Batch,
    agg: LossAgg,
    tol: f64,
) {
    assert_close(&[scalar(out.loss.clone())], &[want.loss], tol, "loss");
    assert_close(
        &[out.clip_fraction],
        &[want.clip_fraction],
        1e-12,
        "clip fraction",
    );
    assert_close(
        &[out.dual_clip_fraction],
        &[want.dual_clip_fraction],
        1e-12,
        "dual-clip fraction",
    );
    assert_close(&[out.approx_kl], &[want.approx_kl], tol, "approx kl");
    let grad = host(logp.grad(&out.loss.backward()).unwrap());
    assert!(
        grad.iter().all(|g| g.is_finite()),
        "finite gradient: {grad:?}"
    );
    assert_close(&grad, &want.grad(batch, agg), tol, "gradient");
}

#[test]
fn rl_ppo_matches_reference_with_both_clips_and_dual_clip() {
    let mut rng = Rng::new(2);
    let configs = [
        PpoConfig::default(),
        PpoConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: None,
            agg: LossAgg::TokenMean,
        },
        PpoConfig {
            clip_low: 0.1,
            clip_high: 0.3,
            dual_clip: Some(2.0),
            agg: LossAgg::TokenMean,
        },
    ];
    for (k, base) in configs.iter().enumerate() {
        for agg in AGGS {
            let cfg = PpoConfig { agg, ..*base };
            let mut batch = Batch::random(&mut rng, [6, 9], 1.6, k == 2);
            batch.force_clipping();
            // One token far past the log-ratio clamp, with A < 0 (only the clamp bounds it
            // without dual clip).
            batch.force_token(3, 25.0, -0.5);
            let want = ref_ppo(&batch, &batch.logp, &cfg);
            assert!(
                want.clipped_low > 0 && want.clipped_high > 0,
                "both clip directions"
            );
            if cfg.dual_clip.is_some() {
                assert!(want.dual_clip_fraction > 0.0, "dual clip active");
            }
            let logp = leaf(&batch.logp, batch.shape());
            let out = ppo_loss(
                logp.clone(),
                tensor(&batch.old, batch.shape(), DType::F64),
                tensor(&batch.adv, batch.shape(), DType::F64),
                &batch.mask(),
                &cfg,
            )
            .unwrap();
            check_policy(out, &want, &logp, &batch, agg, 1e-10);
        }
    }
}

#[test]
fn rl_ppo_reference_gradient_matches_finite_differences() {
    // Validates the reference's analytic derivative itself (no clamp-bound token here).
    let mut rng = Rng::new(3);
    let cfg = PpoConfig {
        agg: LossAgg::SeqMeanTokenMean,
        ..PpoConfig::default()
    };
    let mut batch = Batch::random(&mut rng, [4, 6], 1.6, false);
    batch.force_clipping();
    let want = ref_ppo(&batch, &batch.logp, &cfg);
    assert!(want.dual_clip_fraction > 0.0 && want.clipped_low > 0 && want.clipped_high > 0);
    let masked: Vec<f64> = batch
        .logp
        .iter()
        .zip(&batch.mask)
        .map(|(&v, &m)| if m { v } else { 0.0 })
        .collect();
    let fd = finite_difference(|lp| ref_ppo(&batch, lp, &cfg).loss, &masked, 1e-6);
    assert_close(
        &want.grad(&batch, cfg.agg),
        &fd,
        1e-6,
        "analytic vs finite difference",
    );
    assert!(want.token_loss.iter().all(|l| l.is_finite()));
}

#[test]
fn rl_ppo_in_f32_matches_the_f64_reference() {
    let mut rng = Rng::new(4);
    let cfg = PpoConfig::default();
    let batch = Batch::random(&mut rng, [3, 5], 1.0, false);
    let want = ref_ppo(&batch, &batch.logp, &cfg);
    let logp = tensor(&batch.logp, batch.shape(), DType::F32).require_grad();
    let out = ppo_loss(
        logp.clone(),
        tensor(&batch.old, batch.shape(), DType::F32),
        tensor(&batch.adv, batch.shape(), DType::F64),
        &batch.mask(),
        &cfg,
    )
    .unwrap();
    assert_eq!(out.loss.dtype(), DType::F32);
    check_policy(out, &want, &logp, &batch, cfg.agg, 2e-5);
}

/// GSPO per token, from the paper and verl's `compute_policy_loss_gspo` (GSPO-token
/// gradient: `∂ s_bt / ∂ log π_bt = s_b`, zero past the clamp at 10).
pub(super) fn ref_gspo(batch: &Batch, cfg: &GspoConfig) -> RefPolicy {
    let (b, s) = (batch.b, batch.s);
    let (mut token_loss, mut token_grad) = (vec![0.0; b * s], vec![0.0; b * s]);
    let (mut clipped, mut kl, mut tokens) = (0usize, 0.0, 0usize);
    let (mut clipped_low, mut clipped_high) = (0, 0);
    for row in 0..b {
        let idx: Vec<usize> = (row * s..(row + 1) * s)
            .filter(|&i| batch.mask[i])
            .collect();
        if idx.is_empty() {
            continue;
        }
        let mean = idx
            .iter()
            .map(|&i| batch.logp[i] - batch.old[i])
            .sum::<f64>()
            / idx.len() as f64;
        let (log_s, dlog) = if mean > 10.0 {
            (10.0, 0.0)
        } else {
            (mean, 1.0)
        };
        let ratio = log_s.exp();
        let (rc, factor) = clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
        for &i in &idx {
            tokens += 1;
            kl -= batch.logp[i] - batch.old[i];
            let a = batch.adv[i];
            let (l1, d1) = (-a * ratio, -a * ratio * dlog);
            let (l2, d2) = (-a * rc, -a * ratio * dlog * factor);
            if l2 > l1 {
                clipped += 1;
                if ratio < 1.0 {
                    clipped_low += 1;
                } else {
                    clipped_high += 1;
                }
                (token_loss[i], token_grad[i]) = (l2, d2);
            } else {
                (token_loss[i], token_grad[i]) = (l1, d1);
            }
        }
    }
    RefPolicy {
        loss: ref_aggregate(&token_loss, &batch.mask, batch.shape(), cfg.agg),
        token_grad,
        token_loss,
        clip_fraction: clipped as f64 / tokens as f64,
        dual_clip_fraction: 0.0,
        approx_kl: kl / tokens as f64,
        clipped_low,
        clipped_high,
    }
}

/// The paper's sequence-level objective `(1/B⁺) Σ_b max(−A_b s_b, −A_b clip(s_b))` with
/// per-sequence advantages, as a plain function of all log-probs (for finite differences).
fn ref_gspo_sequence_objective(batch: &Batch, logp: &[f64], cfg: &GspoConfig) -> f64 {
    let (b, s) = (batch.b, batch.s);
    let (mut total, mut sequences) = (0.0, 0.0);
    for row in 0..b {
        let idx: Vec<usize> = (row * s..(row + 1) * s)
            .filter(|&i| batch.mask[i])
            .collect();
        if idx.is_empty() {
            continue;
        }
        let mean = idx.iter().map(|&i| logp[i] - batch.old[i]).sum::<f64>() / idx.len() as f64;
        let ratio = mean.min(10.0).exp();
        let a = batch.adv[idx[0]];
        let rc = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
        total += (-a * ratio).max(-a * rc);
        sequences += 1.0;
    }
    total / sequences
}

#[test]
fn rl_gspo_matches_reference_and_the_sequence_level_gradient() {
    let mut rng = Rng::new(5);
    let defaults = GspoConfig::default();
    assert_eq!((defaults.clip_low, defaults.clip_high), (3e-4, 4e-4));
    for agg in AGGS {
        let cfg = GspoConfig { agg, ..defaults };
        for per_seq in [true, false] {
            let mut batch = Batch::random(&mut rng, [12, 6], 2e-3, per_seq);
            // Sequence 0 past the clamp at 10, with A < 0 so that the unclipped, clamped
            // branch is taken; sequences 2 and 3 clipped above and below.
            batch.force_row(&mut rng, 0, 11.0, -0.7);
            batch.force_row(&mut rng, 2, 1e-3, 1.0);
            batch.force_row(&mut rng, 3, -1e-3, -1.0);
            let want = ref_gspo(&batch, &cfg);
            assert!(
                want.clipped_low > 0 && want.clipped_high > 0,
                "both clip directions"
            );
            let logp = leaf(&batch.logp, batch.shape());
            let out = gspo_loss(
                logp.clone(),
                tensor(&batch.old, batch.shape(), DType::F64),
                tensor(&batch.adv, batch.shape(), DType::F64),
                &batch.mask(),
                &cfg,
            )
            .unwrap();
            check_policy(out, &want, &logp, &batch, agg, 1e-9);
            assert!(want.token_loss.iter().all(|l| l.is_finite()));
        }
    }
    // Per-sequence advantages + seq-mean-token-mean: GSPO-token's gradient is the gradient
    // of the sequence-level objective, checked by central differences.
    let mut batch = Batch::random(&mut rng, [12, 6], 2e-3, true);
    batch.force_row(&mut rng, 2, 1e-3, 1.0);
    batch.force_row(&mut rng, 3, -1e-3, -1.0);
    let want = ref_gspo(&batch, &defaults);
    assert!(want.clipped_low > 0 && want.clipped_high > 0);
    let logp = leaf(&batch.logp, batch.shape());
    let out = gspo_loss(
        logp.clone(),
        tensor(&batch.old, batch.shape(), DType::F64),
        tensor(&batch.adv, batch.shape(), DType::F64),
        &batch.mask(),
        &defaults,
    )
    .unwrap();
    let value = scalar(out.loss.clone());
    let grad = host(logp.grad(&out.loss.backward()).unwrap());
    let masked: Vec<f64> = batch
        .logp
        .iter()
        .zip(&batch.mask)
        .map(|(&v, &m)| if m { v } else { 0.0 })
        .collect();
    let objective = |lp: &[f64]| ref_gspo_sequence_objective(&batch, lp, &defaults);
    assert_close(&[value], &[objective(&masked)], 1e-12, "sequence objective");
    let fd = finite_difference(objective, &masked, 1e-7);
    assert_close(&grad, &fd, 1e-5, "GSPO gradient vs finite difference");
}

/// verl's `kl_penalty` per token and its derivative in `log π`.
pub(super) fn ref_kl(lp: f64, reference: f64, estimator: KlEstimator) -> (f64, f64) {
    let d = lp - reference;
    match estimator {
        KlEstimator::K1 => (d, 1.0),
        KlEstimator::Abs => (d.abs(), d.signum()),
        KlEstimator::K2 => (0.5 * d * d, d),
        KlEstimator::K3 => {
            let (k, dk) = clip(reference - lp, -20.0, 20.0);
            let value = k.exp() - k - 1.0;
            let dvalue = (k.exp() - 1.0) * -dk;
            let (v, factor) = clip(value, -10.0, 10.0);
            (v, dvalue * factor)
        }
    }
}

#[test]
fn rl_kl_estimators_match_reference_values_and_gradients() {
    let mut rng = Rng::new(6);
    let shape = [4, 6];
    let lp = rng.values_in(24, -4.0, -0.1);
    let mut reference: Vec<f64> = lp.iter().map(|v| v - rng.uniform(-3.0, 3.0)).collect();
    // Past the log-ratio clamp both ways, and past the value clamp (k3 = 11 for d = 12).
    reference[0] = lp[0] + 25.0;
    reference[1] = lp[1] - 25.0;
    reference[2] = lp[2] - 12.0;
    let upstream = rng.values_in(24, -1.0, 1.0);
    for estimator in [
        KlEstimator::K1,
        KlEstimator::Abs,
        KlEstimator::K2,
        KlEstimator::K3,
    ] {
        let x = leaf(&lp, shape);
        let kl = kl_penalty(x.clone(), tensor(&reference, shape, DType::F64), estimator).unwrap();
        let want: Vec<(f64, f64)> = lp
            .iter()
            .zip(&reference)
            .map(|(&a, &r)| ref_kl(a, r, estimator))
            .collect();
        let values: Vec<f64> = want.iter().map(|w| w.0).collect();
        assert_close(&host(kl.clone()), &values, 1e-12, "kl values");
        let grads = (kl * tensor(&upstream, shape, DType::F64)).sum().backward();
        let grad = host(x.grad(&grads).unwrap());
        let expected: Vec<f64> = want.iter().zip(&upstream).map(|(w, u)| w.1 * u).collect();
        assert_close(&grad, &expected, 1e-12, "kl gradient");
        if estimator == KlEstimator::K3 {
            assert!(values.iter().all(|&v| (0.0..=10.0).contains(&v)));
            assert_eq!(values[0], 10.0);
            assert_eq!(grad[0..3], [0.0, 0.0, 0.0]);
        }
    }
    assert_eq!(
        "low_var_kl".parse::<KlEstimator>().unwrap(),
        KlEstimator::K3
    );
    assert_eq!("mse".parse::<KlEstimator>().unwrap(), KlEstimator::K2);
    assert!("full".parse::<KlEstimator>().is_err());
    let err = kl_penalty(
        tensor(&lp, shape, DType::F64),
        tensor(&lp[..20], [4, 5], DType::F64),
        KlEstimator::K1,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "ref_logprobs",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn rl_entropy_from_logits_matches_reference() {
    let mut rng = Rng::new(7);
    let (b, s, v) = (2, 3, 5);
    let logits = rng.values_in(b * s * v, -3.0, 3.0);
    let want: Vec<f64> = logits
        .chunks(v)
        .map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
            row.iter()
                .map(|x| {
                    let p = (x - m).exp() / z;
                    -p * p.ln()
                })
                .sum()
        })
        .collect();
    let t = Tensor::<3>::from_data(TensorData::new(logits, [b, s, v]), (&ad(), DType::F64));
    assert_close(&host(entropy_from_logits(t)), &want, 1e-12, "entropy");
}

#[test]
fn rl_objective_combines_policy_entropy_and_kl() {
    let mut rng = Rng::new(8);
    let ppo = PpoConfig {
        clip_high: 0.28,
        agg: LossAgg::SeqMeanTokenMean,
        ..PpoConfig::default()
    };
    let objective = PolicyObjective {
        policy_loss: PolicyLoss::Ppo(ppo),
        kl_coef: 0.05,
        kl_estimator: KlEstimator::K3,
        entropy_coef: 0.01,
        rollout_correction: None,
    };
    let batch = Batch::random(&mut rng, [5, 8], 1.2, true);
    let shape = batch.shape();
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
    let mask = batch.mask();
    let logp = leaf(&batch.logp, shape);
    let ent = leaf(&entropy, shape);
    let out = objective
        .compute(PolicyBatch {
            logprobs: logp.clone(),
            old_logprobs: tensor(&batch.old, shape, DType::F64),
            advantages: tensor(&batch.adv, shape, DType::F64),
            mask: &mask,
            ref_logprobs: Some(tensor(&reference, shape, DType::F64)),
            entropy: Some(ent.clone()),
            rollout_logprobs: None,
        })
        .unwrap();
    let pg = ref_ppo(&batch, &batch.logp, &ppo);
    let kl: Vec<(f64, f64)> = batch
        .logp
        .iter()
        .zip(&reference)
        .map(|(&a, &r)| ref_kl(a, r, KlEstimator::K3))
        .collect();
    let kl_values: Vec<f64> = kl.iter().map(|k| k.0).collect();
    let kl_loss = ref_aggregate(&kl_values, &batch.mask, shape, ppo.agg);
    let ent_loss = ref_aggregate(&entropy, &batch.mask, shape, ppo.agg);
    let total = pg.loss - 0.01 * ent_loss + 0.05 * kl_loss;
    let m = out.metrics;
    assert_close(
        &[
            m.loss,
            m.pg_loss,
            m.kl.unwrap(),
            m.entropy.unwrap(),
            m.approx_kl,
        ],
        &[total, pg.loss, kl_loss, ent_loss, pg.approx_kl],
        1e-10,
        "metrics",
    );
    assert_close(&[scalar(out.loss.clone())], &[total], 1e-10, "total loss");
    assert_eq!(
        (m.clip_fraction, m.dual_clip_fraction),
        (pg.clip_fraction, pg.dual_clip_fraction)
    );
    let grads = out.loss.backward();
    let w = ref_agg_weights(&batch.mask, shape, ppo.agg);
    let want_logp: Vec<f64> = (0..w.len())
        .map(|i| {
            if batch.mask[i] {
                w[i] * (pg.token_grad[i] + 0.05 * kl[i].1)
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

    // GSPO through the objective, metrics only for absent terms.
    let gspo = PolicyObjective {
        policy_loss: PolicyLoss::Gspo(GspoConfig::default()),
        ..PolicyObjective::default()
    };
    let out = gspo
        .compute(PolicyBatch {
            logprobs: tensor(&batch.logp, shape, DType::F64),
            old_logprobs: tensor(&batch.old, shape, DType::F64),
            advantages: tensor(&batch.adv, shape, DType::F64),
            mask: &mask,
            ref_logprobs: None,
            entropy: None,
            rollout_logprobs: None,
        })
        .unwrap();
    let want = ref_gspo(&batch, &GspoConfig::default());
    assert_close(&[out.metrics.loss], &[want.loss], 1e-10, "gspo objective");
    assert_eq!((out.metrics.kl, out.metrics.entropy), (None, None));
}

#[test]
fn rl_grpo_advantages_match_hand_computed_values() {
    // Group 1: mean 0.5, unbiased std √(1/3); group 2: all equal ⇒ 0.
    let rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0];
    let eps = 1e-6;
    let a = grpo_advantages(&rewards, 4, true, eps).unwrap();
    let z = 0.5 / ((1.0f64 / 3.0).sqrt() + eps);
    assert_close(&a, &[z, -z, -z, z, 0.0, 0.0, 0.0, 0.0], 1e-15, "grpo");
    let a = grpo_advantages(&rewards, 4, false, eps).unwrap();
    assert_eq!(a, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]);
    // Group of 3: [3, 0, 6] ⇒ mean 3, std 3: advantages 0, −1, 1 (eps = 0).
    let a = grpo_advantages(&[3.0, 0.0, 6.0], 3, true, 0.0).unwrap();
    assert_eq!(a, [0.0, -1.0, 1.0]);
    // verl: a group of one has mean 0 and std 1.
    assert_eq!(
        grpo_advantages(&[0.5, -2.0], 1, true, 0.0).unwrap(),
        [0.5, -2.0]
    );
    assert!(grpo_advantages(&[], 2, true, eps).unwrap().is_empty());
    for (rewards, group) in [(&[1.0, 2.0, 3.0][..], 2), (&[1.0][..], 0)] {
        let err = grpo_advantages(rewards, group, true, eps).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::InvalidInput {
                    what: "group_size",
                    ..
                }
            ),
            "{err}"
        );
    }
    let err = grpo_advantages(&[1.0, f64::NAN], 2, true, eps).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "rewards",
                ..
            }
        ),
        "{err}"
    );
    assert!(grpo_advantages(&[1.0, 2.0], 2, true, -1.0).is_err());

    // Broadcast over the response tokens.
    let bits = [true, true, false, false, false, false, true, true, true];
    let mask = response_mask(&bits, [3, 3]);
    let t = token_advantages(&[2.0, -1.0, 0.5], &mask, DType::F64).unwrap();
    assert_eq!(host(t), [2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5]);
    for bad in [&[1.0, 2.0][..], &[1.0, f64::INFINITY, 0.0][..]] {
        let err = token_advantages(bad, &mask, DType::F32).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::InvalidInput {
                    what: "advantages",
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn rl_masks_from_floats_and_input_errors() {
    let shape = [2, 3];
    let bits = [true, false, true, false, false, false];
    let floats: Vec<f64> = bits.iter().map(|&b| f64::from(u8::from(b))).collect();
    let from_float = ResponseMask::from_float(tensor(&floats, shape, DType::F32)).unwrap();
    assert_eq!(from_float.lengths(), [2, 0]);
    assert_eq!(from_float.dims(), shape);
    let mut bad = floats.clone();
    bad[4] = 0.5;
    let err = ResponseMask::from_float(tensor(&bad, shape, DType::F64)).unwrap_err();
    assert!(err.to_string().contains("[1, 1]"), "{err}");

    let mask = response_mask(&bits, shape);
    let ok = tensor(&[-1.0; 6], shape, DType::F64);
    let wrong = tensor(&[-1.0; 8], [2, 4], DType::F64);
    let cfg = PpoConfig::default();
    let run = |lp: &Tensor<2>, old: &Tensor<2>, adv: &Tensor<2>, cfg: &PpoConfig| {
        ppo_loss(lp.clone(), old.clone(), adv.clone(), &mask, cfg).unwrap_err()
    };
    for (err, what) in [
        (run(&wrong, &ok, &ok, &cfg), "logprobs"),
        (run(&ok, &wrong, &ok, &cfg), "old_logprobs"),
        (run(&ok, &ok, &wrong, &cfg), "advantages"),
    ] {
        match err {
            ModelError::InvalidInput { what: w, reason } => {
                assert_eq!(w, what);
                assert!(
                    reason.contains("[2, 4]") && reason.contains("[2, 3]"),
                    "{reason}"
                );
            }
            other => panic!("{other}"),
        }
    }
    let err = gspo_loss(
        wrong.clone(),
        ok.clone(),
        ok.clone(),
        &mask,
        &GspoConfig::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "logprobs",
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        aggregate(wrong, &mask, LossAgg::TokenMean).unwrap_err(),
        ModelError::InvalidInput {
            what: "loss_mat",
            ..
        }
    ));

    // A batch without response tokens has no loss.
    let empty = response_mask(&[false; 6], shape);
    for agg in AGGS {
        let err = aggregate(ok.clone(), &empty, agg).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::InvalidInput {
                    what: "response_mask",
                    ..
                }
            ),
            "{err}"
        );
    }
    assert!(ppo_loss(ok.clone(), ok.clone(), ok.clone(), &empty, &cfg).is_err());
    let zero_scale = LossAgg::SeqMeanTokenSumNorm { scale: Some(0) };
    assert!(aggregate(ok.clone(), &mask, zero_scale).is_err());

    // Invalid clip settings name their field.
    let bad_configs = [
        (
            PpoConfig {
                clip_low: -0.1,
                ..cfg
            },
            "clip_ratio_low",
        ),
        (
            PpoConfig {
                clip_low: 1.5,
                ..cfg
            },
            "clip_ratio_low",
        ),
        (
            PpoConfig {
                clip_high: f64::NAN,
                ..cfg
            },
            "clip_ratio_high",
        ),
        (
            PpoConfig {
                dual_clip: Some(1.0),
                ..cfg
            },
            "clip_ratio_c",
        ),
        (
            PpoConfig {
                dual_clip: Some(f64::INFINITY),
                ..cfg
            },
            "clip_ratio_c",
        ),
    ];
    for (bad, field) in bad_configs {
        match run(&ok, &ok, &ok, &bad) {
            ModelError::InvalidValue { field: f, .. } => assert_eq!(f, field),
            other => panic!("{other}"),
        }
    }
    let bad_gspo = GspoConfig {
        clip_high: -1e-4,
        ..GspoConfig::default()
    };
    assert!(matches!(
        gspo_loss(ok.clone(), ok.clone(), ok.clone(), &mask, &bad_gspo).unwrap_err(),
        ModelError::InvalidValue { .. }
    ));

    // Objective: a non-zero coefficient needs its input.
    let batch = |ref_logprobs, entropy| PolicyBatch {
        logprobs: ok.clone(),
        old_logprobs: ok.clone(),
        advantages: ok.clone(),
        mask: &mask,
        ref_logprobs,
        entropy,
        rollout_logprobs: None,
    };
    let with_kl = PolicyObjective {
        kl_coef: 0.1,
        ..PolicyObjective::default()
    };
    let err = with_kl.compute(batch(None, None)).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "ref_logprobs",
                ..
            }
        ),
        "{err}"
    );
    let with_entropy = PolicyObjective {
        entropy_coef: 0.1,
        ..PolicyObjective::default()
    };
    let err = with_entropy.compute(batch(None, None)).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "entropy",
                ..
            }
        ),
        "{err}"
    );
    let err = with_entropy
        .compute(batch(None, Some(tensor(&[1.0; 8], [2, 4], DType::F64))))
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "entropy",
                ..
            }
        ),
        "{err}"
    );
    let err = with_kl
        .compute(batch(Some(tensor(&[1.0; 8], [2, 4], DType::F64)), None))
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidInput {
                what: "ref_logprobs",
                ..
            }
        ),
        "{err}"
    );
    let nan_coef = PolicyObjective {
        kl_coef: f64::NAN,
        ..PolicyObjective::default()
    };
    assert!(matches!(
        nan_coef.compute(batch(None, None)).unwrap_err(),
        ModelError::InvalidValue { .. }
    ));
}
