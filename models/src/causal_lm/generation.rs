//! Greedy and seeded sampled generation with a KV cache.
//!
//! The prompt is run once (prefill), then one token per step is fed back with the cache, as HF
//! `generate(..., use_cache=True)` does. Greedy decoding picks the first maximal logit (the
//! same tie rule as `torch.argmax`); sampling is reproducible for a given seed.

use burn::tensor::{DType, Device};

use super::{CausalLm, token_ids};
use crate::ModelError;

/// How the next token is chosen from the last position's logits.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// The most likely token (first index on ties).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, optionally restricted to the `top_k` most
    /// likely tokens, from a generator seeded with `seed`.
    Sample {
        /// Softmax temperature (> 0).
        temperature: f64,
        /// Keep only the `top_k` most likely tokens (`None` = all).
        top_k: Option<usize>,
        /// Seed of the random generator.
        seed: u64,
    },
}

/// Settings of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Tokens to produce at most.
    pub max_new_tokens: usize,
    /// Token choice rule.
    pub sampling: Sampling,
    /// Generation stops after producing one of these (it is included in the output).
    pub eos_token_ids: Vec<usize>,
}

impl GenerationConfig {
    /// Greedy decoding of `max_new_tokens` tokens with no end-of-sequence token.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::Greedy,
            eos_token_ids: Vec::new(),
        }
    }
}

/// SplitMix64: a small, seedable generator (reproducible across platforms).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Continues `prompt` (token ids of one sequence) with up to `config.max_new_tokens` tokens
/// and returns the new tokens only.
pub fn generate<M: CausalLm + ?Sized>(
    model: &M,
    prompt: &[usize],
    config: &GenerationConfig,
    device: &Device,
) -> Result<Vec<usize>, ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidInput {
            what: "prompt",
            reason: "the prompt is empty".to_owned(),
        });
    }
    if let Sampling::Sample {
        temperature, top_k, ..
    } = &config.sampling
    {
        if !(temperature.is_finite() && *temperature > 0.0) {
            return Err(ModelError::InvalidInput {
                what: "temperature",
                reason: format!("must be a positive number, got {temperature}"),
            });
        }
        if *top_k == Some(0) {
            return Err(ModelError::InvalidInput {
                what: "top_k",
                reason: "must be at least 1".to_owned(),
            });
        }
    }
    let vocab = model.vocab_size();
    let mut rng = match config.sampling {
        Sampling::Sample { seed, .. } => Some(SplitMix64(seed)),
        Sampling::Greedy => None,
    };
    let mut cache = model.new_cache();
    let mut input: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut out = Vec::with_capacity(config.max_new_tokens);
    while out.len() < config.max_new_tokens {
        let ids = token_ids(&input, [1, input.len()], vocab, device)?;
        let logits = model.forward_cached(ids, &mut cache)?;
        let [_, s, v] = logits.dims();
        let last = logits
            .narrow(1, s - 1, 1)
            .reshape([v])
            .cast(DType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .map_err(|e| ModelError::InvalidInput {
                what: "logits",
                reason: format!("cannot read logits back: {e:?}"),
            })?;
        let next = match (&config.sampling, rng.as_mut()) {
            (
                Sampling::Sample {
                    temperature, top_k, ..
                },
                Some(rng),
            ) => sample(&last, *temperature, *top_k, rng),
            _ => argmax(&last),
        };
        out.push(next);
        if config.eos_token_ids.contains(&next) {
            break;
        }
        input = vec![next as i64];
    }
    Ok(out)
}

/// Index of the first maximal value (NaNs are never chosen unless all are NaN).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] || values[best].is_nan() {
            best = i;
        }
    }
    best
}

/// A draw from `softmax(values / temperature)` restricted to the `top_k` largest values.
fn sample(values: &[f32], temperature: f64, top_k: Option<usize>, rng: &mut SplitMix64) -> usize {
    let mut order: Vec<usize> = (0..values.len()).collect();
    // Descending by value, ties to the lower index (stable sort).
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    order.truncate(top_k.unwrap_or(values.len()).min(values.len()));
    let max = f64::from(values[order[0]]);
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(values[i]) - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (&i, &w) in order.iter().zip(&weights) {
        if u < w {
            return i;
        }
        u -= w;
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn sampling_is_seeded_and_respects_top_k() {
        let logits = [0.0, 1.0, 0.5, 3.0, -2.0];
        let draw = |seed| {
            let mut rng = SplitMix64(seed);
            (0..50)
                .map(|_| sample(&logits, 1.0, None, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut rng = SplitMix64(3);
        for _ in 0..100 {
            let t = sample(&logits, 5.0, Some(2), &mut rng);
            assert!(t == 3 || t == 1, "{t}");
        }
        // A tiny temperature is greedy.
        assert_eq!(sample(&logits, 1e-6, None, &mut rng), 3);
    }
}
