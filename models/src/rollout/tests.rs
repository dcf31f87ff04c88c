use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use safetensors::{Dtype, SafeTensors};

use super::*;
use crate::causal_lm::{GenerationConfig, generate};
use crate::replay::{RouterReplayModel, record_routing, replay_routing};
use crate::weights::WeightSource;
use crate::{DeepseekV3Config, Qwen3Config, Qwen3MoeConfig};
use crate::{DeepseekV3ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM};

// ---------------------------------------------------------------------------------------------
// Fixtures (the committed tiny HF checkpoints, read as `models/tests/common` does).

struct FixtureSource(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl FixtureSource {
    fn open(dir: &Path) -> Self {
        let bytes = std::fs::read(dir.join("model.safetensors")).expect("read fixture");
        let st = SafeTensors::deserialize(&bytes).expect("parse fixture");
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                assert_eq!(view.dtype(), Dtype::F32, "{name}");
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (name, (view.shape().to_vec(), values))
            })
            .collect();
        Self(tensors)
    }
}

impl WeightSource for FixtureSource {
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        self.0
            .get(hf_name)
            .cloned()
            .ok_or_else(|| ModelError::MissingTensor {
                name: hf_name.to_owned(),
            })
    }

    fn contains(&self, hf_name: &str) -> bool {
        self.0.contains_key(hf_name)
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn qwen3() -> Qwen3ForCausalLM {
    let dir = fixture("qwen3");
    let config = Qwen3Config::from_file(dir.join("config.json")).unwrap();
    Qwen3ForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &Device::flex()).unwrap()
}

fn qwen3_moe() -> Qwen3MoeForCausalLM {
    let dir = fixture("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).unwrap();
    Qwen3MoeForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &Device::flex()).unwrap()
}

fn deepseek() -> DeepseekV3ForCausalLM {
    let dir = fixture("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).unwrap();
    DeepseekV3ForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &Device::flex())
        .unwrap()
}

/// Prompts of lengths 3, 1, 5, 3, 3, 2: three share a batch, the others run alone.
fn prompts() -> Vec<Vec<i64>> {
    vec![
        vec![1, 2, 3],
        vec![7],
        vec![5, 6, 7, 8, 9],
        vec![4, 5, 6],
        vec![200, 17, 3],
        vec![255, 0],
    ]
}

fn ids(tokens: &[i64]) -> Tensor<2, Int> {
    token_ids(tokens, [1, tokens.len()], 256, &Device::flex()).unwrap()
}

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

// ---------------------------------------------------------------------------------------------
// An independent HF-style reference of the logits processors: full-vocabulary probabilities
// after `scores / T`, `TopKLogitsWarper` and `TopPLogitsWarper` (ascending sort + cumsum).

fn hf_reference(logits: &[f32], t: f64, top_k: Option<usize>, top_p: Option<f64>) -> Vec<f64> {
    let v = logits.len();
    let mut scores: Vec<f64> = logits.iter().map(|&x| f64::from(x) / t).collect();
    if let Some(k) = top_k {
        let mut sorted = scores.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k.min(v) - 1];
        for s in &mut scores {
            if *s < kth {
                *s = f64::NEG_INFINITY;
            }
        }
    }
    let softmax = |scores: &[f64]| -> Vec<f64> {
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|x| x / z).collect()
    };
    if let Some(p) = top_p.filter(|&p| p < 1.0) {
        let probs = softmax(&scores);
        // Ascending; among equal probabilities the higher id first (removed first).
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]).then(b.cmp(&a)));
        let mut cum = 0.0;
        for (n, &i) in order.iter().enumerate() {
            cum += probs[i];
            if cum <= 1.0 - p && n < v - 1 {
                scores[i] = f64::NEG_INFINITY;
            }
        }
    }
    softmax(&scores)
}

/// Deterministic pseudo-random logits.
fn random_logits(seed: u64, v: usize, scale: f64) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..v)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * scale) as f32)
        .collect()
}

fn dense(dist: &[(usize, f64)], v: usize) -> Vec<f64> {
    let mut out = vec![0.0; v];
    for &(t, p) in dist {
        out[t] = p;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Chi-square goodness of fit.

/// `ln Γ(x)`, Lanczos (g = 7, n = 9), x > 0.
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Regularised upper incomplete gamma `Q(a, x)` (series / continued fraction).
fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut sum, mut term, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * front
    } else {
        // Lentz's method for the continued fraction.
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-15 {
                break;
            }
        }
        front * h
    }
}

#[test]
fn chi_square_tail_matches_known_values() {
    // χ²(1) > 3.841 has p = 0.05; χ²(10) > 18.307 has p = 0.05; χ²(2) > x has p = e^{-x/2}.
    assert!((gamma_q(0.5, 3.841_458_8 / 2.0) - 0.05).abs() < 1e-6);
    assert!((gamma_q(5.0, 18.307_038 / 2.0) - 0.05).abs() < 1e-6);
    assert!((gamma_q(1.0, 7.0 / 2.0) - (-3.5f64).exp()).abs() < 1e-12);
}

/// Pearson's χ² of `counts` against `probs` (bins with expected count < 5 are pooled into
/// one); returns `(statistic, degrees of freedom, p-value)`.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize, f64) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e == 0.0 {
            assert_eq!(c, 0, "a token of probability 0 was drawn");
        } else if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp;
        bins += 1;
    }
    let df = bins.saturating_sub(1).max(1);
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

// ---------------------------------------------------------------------------------------------
// Configuration and processors.

#[test]
fn invalid_settings_are_rejected_with_the_field_named() {
    let ok = SamplingConfig::sample(0.7, 4, 1);
    assert!(ok.validate().is_ok());
    assert!(SamplingConfig::greedy(1).validate().is_ok());
    let cases = [
        (
            "temperature",
            SamplingConfig {
                temperature: -0.1,
                ..ok.clone()
            },
        ),
        (
            "temperature",
            SamplingConfig {
                temperature: f64::NAN,
                ..ok.clone()
            },
        ),
        (
            "temperature",
            SamplingConfig {
                temperature: f64::INFINITY,
                ..ok.clone()
            },
        ),
        (
            "top_k",
            SamplingConfig {
                top_k: Some(0),
                ..ok.clone()
            },
        ),
        (
            "top_p",
            SamplingConfig {
                top_p: Some(1.5),
                ..ok.clone()
            },
        ),
        (
            "top_p",
            SamplingConfig {
                top_p: Some(-0.1),
                ..ok.clone()
            },
        ),
        (
            "top_p",
            SamplingConfig {
                top_p: Some(f64::NAN),
                ..ok.clone()
            },
        ),
        (
            "max_new_tokens",
            SamplingConfig {
                max_new_tokens: 0,
                ..ok.clone()
            },
        ),
        (
            "stop_tokens",
            SamplingConfig {
                stop_tokens: vec![3, -1],
                ..ok.clone()
            },
        ),
    ];
    for (field, cfg) in cases {
        let err = cfg.validate().unwrap_err();
        assert!(
            matches!(&err, ModelError::InvalidInput { what, .. } if *what == field),
            "{field}: {err}"
        );
    }
    // The same errors come out of generate_batch, plus the model-dependent checks.
    let model = qwen3();
    let err = |p: &[Vec<i64>], c: &SamplingConfig| generate_batch(&model, p, c).unwrap_err();
    assert!(
        err(
            &[vec![1]],
            &SamplingConfig {
                top_k: Some(0),
                ..ok.clone()
            }
        )
        .to_string()
        .contains("top_k")
    );
    assert!(
        err(&[vec![1], vec![]], &ok)
            .to_string()
            .contains("prompt 1 is empty")
    );
    assert!(err(&[vec![1, 256]], &ok).to_string().contains("256"));
    let stop = SamplingConfig {
        stop_tokens: vec![256],
        ..ok.clone()
    };
    assert!(err(&[vec![1]], &stop).to_string().contains("stop_tokens"));
    assert!(generate_batch(&model, &[], &ok).unwrap().is_empty());
}

#[test]
fn processors_follow_hf_order_and_boundaries() {
    let ln = |p: f64| p.ln() as f32;
    let logits = [ln(0.5), ln(0.3), ln(0.15), ln(0.05)];
    let kept = |top_k, top_p, t| {
        let cfg = SamplingConfig {
            top_k,
            top_p,
            ..SamplingConfig::sample(t, 1, 0)
        };
        let mut ids: Vec<usize> = sampling_distribution(&logits, &cfg)
            .unwrap()
            .iter()
            .map(|d| d.0)
            .collect();
        ids.sort_unstable();
        ids
    };
    // Top-p keeps the smallest set whose mass reaches p (at least one token).
    assert_eq!(kept(None, Some(0.4), 1.0), [0]);
    assert_eq!(kept(None, Some(0.75), 1.0), [0, 1]);
    assert_eq!(kept(None, Some(0.85), 1.0), [0, 1, 2]);
    assert_eq!(kept(None, Some(0.0), 1.0), [0]);
    assert_eq!(kept(None, Some(1.0), 1.0), [0, 1, 2, 3]);
    // Temperature comes first: at T = 3 the distribution is flatter, so p = 0.75 needs more.
    assert_eq!(kept(None, Some(0.75), 3.0), [0, 1, 2]);
    // Top-k before top-p: p is measured on the renormalised top-2 (0.625, 0.375).
    assert_eq!(kept(None, Some(0.6), 1.0), [0, 1]);
    assert_eq!(kept(Some(2), Some(0.6), 1.0), [0]);
    assert_eq!(kept(Some(2), Some(0.65), 1.0), [0, 1]);
    // HF keeps every token tied with the k-th logit.
    let tied = [1.0, 3.0, 3.0, 2.0];
    let cfg = SamplingConfig {
        top_k: Some(1),
        ..SamplingConfig::sample(1.0, 1, 0)
    };
    let dist = sampling_distribution(&tied, &cfg).unwrap();
    assert_eq!(dist, [(1, 0.5), (2, 0.5)]);
    // Greedy: the first maximum, probability 1.
    assert_eq!(
        sampling_distribution(&tied, &SamplingConfig::greedy(1)).unwrap(),
        [(1, 1.0)]
    );
    // Bad logits are errors.
    let cfg = SamplingConfig::sample(1.0, 1, 0);
    assert!(sampling_distribution(&[0.0, f32::NAN], &cfg).is_err());
    assert!(sampling_distribution(&[f32::NEG_INFINITY; 3], &cfg).is_err());
    assert_eq!(
        sampling_distribution(&[f32::NEG_INFINITY, 0.0], &cfg).unwrap(),
        [(1, 1.0)]
    );
}

#[test]
fn processors_match_an_hf_style_reference_on_random_logits() {
    let v = 97;
    let mut checked = 0;
    for seed in 0..40u64 {
        let logits = random_logits(seed, v, 4.0);
        for (t, top_k, top_p) in [
            (1.0, None, None),
            (0.5, Some(10), None),
            (2.0, None, Some(0.9)),
            (0.8, Some(30), Some(0.7)),
            (1.3, Some(5), Some(0.3)),
            (0.3, Some(96), Some(0.95)),
            (1.0, Some(200), Some(0.5)),
        ] {
            let cfg = SamplingConfig {
                top_k,
                top_p,
                ..SamplingConfig::sample(t, 1, 0)
            };
            let ours = dense(&sampling_distribution(&logits, &cfg).unwrap(), v);
            let want = hf_reference(&logits, t, top_k, top_p);
            for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-12,
                    "seed {seed} T {t} k {top_k:?} p {top_p:?} token {i}: {a} vs {b}"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 280);
}

#[test]
fn sampler_logprobs_are_of_the_unmodified_and_the_sampling_distribution() {
    let logits = random_logits(5, 50, 3.0);
    let cfg = SamplingConfig {
        top_k: Some(8),
        top_p: Some(0.8),
        ..SamplingConfig::sample(0.7, 1, 0)
    };
    let full = hf_reference(&logits, 1.0, None, None);
    let target = hf_reference(&logits, 0.7, Some(8), Some(0.8));
    let mut sampler = Sampler::new(9, 0);
    for _ in 0..200 {
        let s = sampler.sample(&logits, &cfg).unwrap();
        let t = s.token as usize;
        assert!(target[t] > 0.0);
        assert!((f64::from(s.logprob) - full[t].ln()).abs() < 1e-5);
        assert!((f64::from(s.sampling_logprob) - target[t].ln()).abs() < 1e-5);
    }
    let g = Sampler::new(0, 0)
        .sample(&logits, &SamplingConfig::greedy(1))
        .unwrap();
    assert_eq!(g.token as usize, argmax(&logits));
    assert_eq!(g.sampling_logprob, 0.0);
}

// ---------------------------------------------------------------------------------------------
// (a) Greedy batched generation equals the single-sequence greedy generator.

fn assert_greedy_matches_generate<M: RolloutModel>(name: &str, model: &M) {
    let n = 8;
    let rollouts = generate_batch(model, &prompts(), &SamplingConfig::greedy(n)).unwrap();
    assert_eq!(rollouts.len(), prompts().len());
    for (p, r) in prompts().iter().zip(&rollouts) {
        let prompt: Vec<usize> = p.iter().map(|&t| t as usize).collect();
        let want = generate(
            model,
            &prompt,
            &GenerationConfig::greedy(n),
            &model.device(),
        )
        .unwrap();
        let got: Vec<usize> = r.tokens.iter().map(|&t| t as usize).collect();
        println!("{name}: prompt {p:?} → {got:?}");
        assert_eq!(got, want, "{name}: prompt {p:?}");
        assert_eq!(r.finish_reason, FinishReason::Length);
        assert_eq!((r.logprobs.len(), r.sampling_logprobs.len()), (n, n));
        assert!(r.sampling_logprobs.iter().all(|&l| l == 0.0));
    }
}

#[test]
fn greedy_batch_equals_single_sequence_greedy_qwen3() {
    assert_greedy_matches_generate("qwen3", &qwen3());
}

#[test]
fn greedy_batch_equals_single_sequence_greedy_qwen3_moe() {
    assert_greedy_matches_generate("qwen3_moe", &qwen3_moe());
}

#[test]
fn greedy_batch_equals_single_sequence_greedy_deepseek_v3() {
    assert_greedy_matches_generate("deepseek_v3", &deepseek());
}

// ---------------------------------------------------------------------------------------------
// (b) KV-cache decoding equals recomputing the full forward at every step, and
// (e) the returned logprobs are log_softmax of the full forward's logits at the sampled token.

fn sampled_config() -> SamplingConfig {
    SamplingConfig {
        top_k: Some(40),
        top_p: Some(0.95),
        ..SamplingConfig::sample(1.2, 6, 2024)
    }
}

/// The logits of every `(sequence, step)`.
type StepLogits = BTreeMap<(usize, usize), Vec<f32>>;

/// Rollouts and the logits of every `(sequence, step)` they were sampled from.
fn observed<M: RolloutModel>(model: &M, cfg: &SamplingConfig) -> (Vec<Rollout>, StepLogits) {
    let mut seen = BTreeMap::new();
    let rollouts = generate_batch_observed(model, &prompts(), cfg, &mut |i, step, logits| {
        assert!(seen.insert((i, step), logits.to_vec()).is_none());
    })
    .unwrap();
    (rollouts, seen)
}

fn assert_cache_matches_full_forward<M: RolloutModel>(
    name: &str,
    model: &M,
    full: impl Fn(Tensor<2, Int>) -> Tensor<3>,
) {
    let (rollouts, seen) = observed(model, &sampled_config());
    let mut worst = 0f32;
    for (i, (p, r)) in prompts().iter().zip(&rollouts).enumerate() {
        for step in 0..r.tokens.len() {
            // Recompute everything, without a cache, for the prefix the step saw.
            let prefix: Vec<i64> = p.iter().chain(&r.tokens[..step]).copied().collect();
            let logits = host(full(ids(&prefix)));
            let last = &logits[(prefix.len() - 1) * 256..];
            let cached = &seen[&(i, step)];
            let err = last
                .iter()
                .zip(cached)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name}: prompt {i} step {step}: {err}");
        }
    }
    println!("{name}: max |cached − full| logit error {worst:.2e}");
}

#[test]
fn kv_cache_decode_matches_full_recompute_qwen3() {
    let m = qwen3();
    assert_cache_matches_full_forward("qwen3", &m, |ids| m.forward(ids).unwrap());
}

#[test]
fn kv_cache_decode_matches_full_recompute_qwen3_moe() {
    let m = qwen3_moe();
    assert_cache_matches_full_forward("qwen3_moe", &m, |ids| m.forward(ids).unwrap().logits);
}

#[test]
fn kv_cache_decode_matches_full_recompute_deepseek_v3() {
    let m = deepseek();
    assert_cache_matches_full_forward("deepseek_v3", &m, |ids| m.forward(ids).unwrap().logits);
}

fn assert_logprobs_match_full_forward<M: RolloutModel>(
    name: &str,
    model: &M,
    full: impl Fn(Tensor<2, Int>) -> Tensor<3>,
) {
    let cfg = sampled_config();
    let (rollouts, seen) = observed(model, &cfg);
    let mut worst = 0f64;
    for (i, (p, r)) in prompts().iter().zip(&rollouts).enumerate() {
        let seq: Vec<i64> = p.iter().chain(&r.tokens).copied().collect();
        let logp = host(log_softmax(full(ids(&seq)), 2));
        for (step, &token) in r.tokens.iter().enumerate() {
            let pos = p.len() - 1 + step;
            let want = f64::from(logp[pos * 256 + token as usize]);
            let err = (f64::from(r.logprobs[step]) - want).abs();
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name}: prompt {i} step {step}: {err}");
            // The sampling log-probability is that of the processed distribution.
            let target = hf_reference(&seen[&(i, step)], cfg.temperature, cfg.top_k, cfg.top_p);
            let t = token as usize;
            assert!(target[t] > 0.0, "{name}: token {t} outside top-k/top-p");
            assert!((f64::from(r.sampling_logprobs[step]) - target[t].ln()).abs() < 1e-5);
        }
    }
    println!("{name}: max |logprob − log_softmax(full forward)| {worst:.2e}");
}

#[test]
fn logprobs_are_log_softmax_of_the_full_forward() {
    let m = qwen3_moe();
    assert_logprobs_match_full_forward("qwen3_moe", &m, |ids| m.forward(ids).unwrap().logits);
    let m = qwen3();
    assert_logprobs_match_full_forward("qwen3", &m, |ids| m.forward(ids).unwrap());
    let m = deepseek();
    assert_logprobs_match_full_forward("deepseek_v3", &m, |ids| m.forward(ids).unwrap().logits);
}

// ---------------------------------------------------------------------------------------------
// (c) Sampling frequencies against the target distribution.

#[test]
fn sampled_frequencies_fit_the_processed_distribution() {
    let model = qwen3_moe();
    let prompt = vec![3i64, 14, 15, 92];
    let logits = host(model.forward(ids(&prompt)).unwrap().logits);
    let logits = logits[3 * 256..].to_vec();
    let (min, max) = logits
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    println!("logits range [{min:.3}, {max:.3}]");
    let alpha = 1e-3;
    for (t, top_k, top_p) in [
        (1.0, None, None),
        (0.7, Some(12), None),
        (1.0, None, Some(0.3)),
        (0.5, Some(40), Some(0.6)),
        (0.25, Some(20), Some(0.9)),
    ] {
        let cfg = SamplingConfig {
            top_k,
            top_p,
            ..SamplingConfig::sample(t, 1, 77)
        };
        let target = hf_reference(&logits, t, top_k, top_p);
        let kept = target.iter().filter(|&&p| p > 0.0).count();
        // Many draws through the generator's own sampler, from the one forward.
        let n = 4000;
        let mut counts = vec![0usize; 256];
        let mut sampler = Sampler::new(cfg.seed, 0);
        for _ in 0..n {
            counts[sampler.sample(&logits, &cfg).unwrap().token as usize] += 1;
        }
        for (tok, &c) in counts.iter().enumerate() {
            assert!(
                c == 0 || target[tok] > 0.0,
                "token {tok} outside the kept set"
            );
        }
        let (stat, df, p) = chi_square(&counts, &target);
        println!(
            "T {t} top_k {top_k:?} top_p {top_p:?}: {kept} kept, sampler ×{n}: \
             χ² = {stat:.2}, df = {df}, p = {p:.4}"
        );
        assert!(
            p > alpha,
            "sampler frequencies off: χ² {stat} df {df} p {p}"
        );

        // Full generate_batch runs: the same prompt many times in one batch, one token each;
        // every sequence draws from its own stream.
        let runs = 600;
        let prompts = vec![prompt.clone(); runs];
        let mut row_logits = vec![Vec::new(); runs];
        let rollouts = generate_batch_observed(&model, &prompts, &cfg, &mut |i, _, l| {
            row_logits[i] = l.to_vec()
        })
        .unwrap();
        let mut counts = vec![0usize; 256];
        for (r, l) in rollouts.iter().zip(&row_logits) {
            let tok = r.tokens[0] as usize;
            assert!(
                hf_reference(l, t, top_k, top_p)[tok] > 0.0,
                "token {tok} outside the kept set"
            );
            counts[tok] += 1;
        }
        let (stat, df, p) = chi_square(&counts, &target);
        println!("    generate_batch ×{runs}: χ² = {stat:.2}, df = {df}, p = {p:.4}");
        assert!(
            p > alpha,
            "rollout frequencies off: χ² {stat} df {df} p {p}"
        );
    }
    // The test has power: draws at T = 0.7 are rejected against the T = 1 target.
    let cfg = SamplingConfig {
        top_k: Some(12),
        ..SamplingConfig::sample(0.7, 1, 5)
    };
    let mut counts = vec![0usize; 256];
    let mut sampler = Sampler::new(cfg.seed, 0);
    for _ in 0..4000 {
        counts[sampler.sample(&logits, &cfg).unwrap().token as usize] += 1;
    }
    let (stat, df, p) = chi_square(&counts, &hf_reference(&logits, 1.0, Some(12), None));
    println!("T 0.7 draws against the T 1 target: χ² = {stat:.2}, df = {df}, p = {p:.2e}");
    assert!(p < alpha, "a wrong temperature went undetected");
}

// ---------------------------------------------------------------------------------------------
// (d) Stop tokens and lengths; reproducibility; routed experts.

#[test]
fn stop_tokens_end_a_sequence_and_max_new_tokens_ends_it_with_length() {
    let model = qwen3();
    let greedy = generate_batch(&model, &prompts(), &SamplingConfig::greedy(8)).unwrap();
    // Stop at the 4th greedy token of prompt 0 (at its first occurrence).
    let stop = greedy[0].tokens[3];
    let cfg = SamplingConfig {
        stop_tokens: vec![stop],
        ..SamplingConfig::greedy(8)
    };
    let stopped = generate_batch(&model, &prompts(), &cfg).unwrap();
    for (g, s) in greedy.iter().zip(&stopped) {
        match g.tokens.iter().position(|&t| t == stop) {
            Some(at) => {
                assert_eq!(s.tokens, g.tokens[..=at], "stops at the first stop token");
                assert_eq!(s.finish_reason, FinishReason::Stop);
                assert_eq!(s.logprobs, g.logprobs[..=at]);
            }
            // Sequences batched with a stopped one are unaffected by it.
            None => assert_eq!(s, g),
        }
    }
    assert!(stopped[0].tokens.len() <= 4);
    // Sampling: the stop token is last iff the reason is Stop, and lengths are bounded.
    let cfg = SamplingConfig {
        stop_tokens: (0..256).filter(|t| t % 3 == 0).collect(),
        ..SamplingConfig::sample(1.0, 5, 3)
    };
    for r in generate_batch(&model, &prompts(), &cfg).unwrap() {
        let last_stops = cfg.stop_tokens.contains(r.tokens.last().unwrap());
        assert_eq!(r.finish_reason == FinishReason::Stop, last_stops);
        assert!(
            !r.tokens[..r.tokens.len() - 1]
                .iter()
                .any(|t| cfg.stop_tokens.contains(t))
        );
        if !last_stops {
            assert_eq!(r.tokens.len(), 5);
        }
    }
    let one = generate_batch(&model, &prompts(), &SamplingConfig::greedy(1)).unwrap();
    assert!(
        one.iter()
            .all(|r| r.tokens.len() == 1 && r.finish_reason == FinishReason::Length)
    );
}

#[test]
fn same_seed_same_rollouts_independent_of_the_other_prompts() {
    let model = qwen3_moe();
    let cfg = SamplingConfig::sample(1.5, 6, 42);
    let a = generate_batch(&model, &prompts(), &cfg).unwrap();
    assert_eq!(a, generate_batch(&model, &prompts(), &cfg).unwrap());
    let other = generate_batch(
        &model,
        &prompts(),
        &SamplingConfig {
            seed: 43,
            ..cfg.clone()
        },
    )
    .unwrap();
    assert_ne!(a, other);
    // Sequence i's stream depends on (seed, i) only: changing the other prompts (and so the
    // batches sequence 0 is grouped into) changes nothing for it.
    // The logits themselves may differ in the last bits with the batch size (GEMM blocking),
    // so the log-probabilities are compared to 1e-5.
    let mut changed = prompts();
    changed[3] = vec![9, 9];
    changed[4] = vec![8];
    let b = generate_batch(&model, &changed, &cfg).unwrap();
    for i in [0, 2] {
        assert_eq!(a[i].tokens, b[i].tokens);
        assert_eq!(a[i].routed_experts, b[i].routed_experts);
        assert_eq!(a[i].finish_reason, b[i].finish_reason);
        for (x, y) in a[i].logprobs.iter().zip(&b[i].logprobs) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}

#[test]
fn routed_experts_are_recorded_and_replay_the_generator_routing() {
    fn check<M: RolloutModel + RouterReplayModel>(name: &str, model: &M) {
        let spec = model.replay_spec();
        let (l, k) = (spec.moe_layers.len(), spec.topk);
        let rollouts = generate_batch(model, &prompts(), &sampled_config()).unwrap();
        for (p, r) in prompts().iter().zip(&rollouts) {
            let routed = r.routed_experts.as_ref().expect("MoE routing");
            let prompt_routed = r.prompt_routed_experts.as_ref().expect("prompt routing");
            assert_eq!(routed.len(), r.tokens.len());
            assert_eq!(prompt_routed.len(), p.len() - 1);
            assert!(
                routed
                    .iter()
                    .chain(prompt_routed)
                    .all(|row| row.len() == l * k)
            );
            // The natural routing of a full forward over prompt ++ tokens[..n-1] is the one
            // recorded during cached generation, and replaying it reproduces the forward.
            let n = r.tokens.len();
            let seq: Vec<i64> = p.iter().chain(&r.tokens[..n - 1]).copied().collect();
            let file = r.router_replay(&spec).unwrap().expect("a replay file");
            assert_eq!(file.num_tokens, seq.len());
            let (logits, natural) = record_routing(model, ids(&seq)).unwrap();
            assert_eq!(natural, file, "{name}: prompt {p:?}");
            let (replayed, _) = replay_routing(model, ids(&seq), &file).unwrap();
            assert_eq!(host(replayed), host(logits));
        }
        println!(
            "{name}: routed experts recorded for {} rollouts",
            rollouts.len()
        );
    }
    check("qwen3_moe", &qwen3_moe());
    check("deepseek_v3", &deepseek());
    let dense = generate_batch(&qwen3(), &prompts(), &sampled_config()).unwrap();
    assert!(dense.iter().all(|r| {
        r.routed_experts.is_none()
            && r.prompt_routed_experts.is_none()
            && r.router_replay(&ReplaySpec {
                model_type: "qwen3",
                moe_layers: vec![],
                mtp_layers: vec![],
                topk: 0,
                num_experts: 0,
            })
            .unwrap()
            .is_none()
    }));
}
