//! Rollouts for RL: batched generation with a KV cache, HF-style sampling, the log-probability
//! of every sampled token and, for MoE models, the experts every position was routed to.
//!
//! # Sampling
//!
//! [`SamplingConfig`] follows HF transformers' logits processors, applied in HF's order to the
//! last position's logits (f32 logits, processed in f64):
//!
//! 1. **temperature** `T`: `logits / T`; `T = 0` means greedy decoding (the first maximal
//!    logit, `torch.argmax`'s tie rule), as HF's `do_sample=False`;
//! 2. **top-k** (`TopKLogitsWarper`): tokens whose logit is below the `k`-th largest are
//!    removed; like HF (`scores < topk(scores, k)[-1]`), tokens tied with the `k`-th largest
//!    are kept, so more than `k` tokens may survive;
//! 3. **top-p** (`TopPLogitsWarper`), on the softmax of what is left: the smallest set of most
//!    likely tokens whose cumulative probability is `≥ p` is kept, i.e. a token is removed iff
//!    the tokens strictly more likely than it (ties: lower id first) already hold `≥ p`; at
//!    least one token is always kept, and `p = 1` disables the step (HF adds no warper);
//!
//! then a draw from the renormalised distribution ([`sampling_distribution`]).
//!
//! # Batching
//!
//! The attention layers and [`KvCache`](crate::layers::kv_cache::KvCache) have no padding mask
//! and one sequence length per cache, so left-padded prompts of different lengths cannot share
//! a cache. [`generate_batch`] therefore groups the prompts **by length**: each group is
//! prefilled as one `[B, P]` batch with its own cache and decoded in lock-step, one `[B, 1]`
//! step at a time. A sequence that has finished keeps being fed its last token (its outputs are
//! discarded; rows never interact: attention is per row and the MoE routing is per token and
//! dropless) until every sequence of its group has finished. Prompts of distinct lengths are
//! thus decoded one after another, each exactly as alone.
//!
//! # Reproducibility
//!
//! Sequence `i` of a call draws from its own SplitMix64 stream seeded from
//! `(config.seed, i)`: the same seed and prompts give the same rollouts, and the random numbers
//! of sequence `i` do not depend on the other prompts nor on how they were grouped. (Its logits
//! may still differ in the last bits with the size of its batch — GEMM blocking — so a draw
//! that falls within ~1e-7 of a cumulative-probability boundary could, in principle, pick the
//! neighbouring token.)

use burn::tensor::{DType, Device, Int, Tensor};

use crate::ModelError;
use crate::causal_lm::{CausalLm, token_ids};
use crate::replay::{ReplaySpec, RouterReplayFile};

/// How [`generate_batch`] chooses tokens and when it stops (HF `GenerationConfig` semantics,
/// see the [module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature, finite and `≥ 0`; `0` is greedy decoding.
    pub temperature: f64,
    /// Keep only the `k ≥ 1` most likely tokens (and those tied with the `k`-th); `None`: all.
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to
    /// `≥ p`, with `p ∈ [0, 1]` (`1` or `None`: all).
    pub top_p: Option<f64>,
    /// Tokens to generate at most per sequence (`≥ 1`).
    pub max_new_tokens: usize,
    /// A sequence ends after producing one of these ids (the stop token is returned).
    pub stop_tokens: Vec<i64>,
    /// Seed of the per-sequence random generators (ignored by greedy decoding).
    pub seed: u64,
}

impl SamplingConfig {
    /// Greedy decoding of at most `max_new_tokens` tokens, no stop token.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            max_new_tokens,
            stop_tokens: Vec::new(),
            seed: 0,
        }
    }

    /// Sampling at `temperature` from the full distribution, at most `max_new_tokens` tokens,
    /// no stop token.
    pub fn sample(temperature: f64, max_new_tokens: usize, seed: u64) -> Self {
        Self {
            temperature,
            seed,
            ..Self::greedy(max_new_tokens)
        }
    }

    /// Whether this is greedy decoding (`temperature == 0`).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the settings; errors are [`ModelError::InvalidInput`] naming the field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let invalid = |what, reason: String| Err(ModelError::InvalidInput { what, reason });
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return invalid(
                "temperature",
                format!("must be a finite number ≥ 0 (0 = greedy), got {t}"),
            );
        }
        if self.top_k == Some(0) {
            return invalid("top_k", "must be at least 1 (None keeps all)".to_owned());
        }
        if let Some(p) = self.top_p
            && !(0.0..=1.0).contains(&p)
        {
            return invalid("top_p", format!("must be in [0, 1], got {p}"));
        }
        if self.max_new_tokens == 0 {
            return invalid("max_new_tokens", "must be at least 1".to_owned());
        }
        if let Some(bad) = self.stop_tokens.iter().find(|&&t| t < 0) {
            return invalid("stop_tokens", format!("token id {bad} is negative"));
        }
        Ok(())
    }
}

/// Why a rollout ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A token of [`SamplingConfig::stop_tokens`] was produced (it is the last token).
    Stop,
    /// [`SamplingConfig::max_new_tokens`] tokens were produced.
    Length,
}

/// One generated continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// The generated ids (not the prompt), the stop token included when there is one.
    pub tokens: Vec<i64>,
    /// `logprobs[i] = log_softmax(logits)[tokens[i]]` of the **unmodified** model distribution
    /// (temperature 1, no top-k/top-p) at the position that produced token `i` — the behaviour
    /// log-probabilities RL frameworks compare against the trainer's (e.g. for importance
    /// ratios). Computed in f64 from the f32 logits of the cached forward.
    pub logprobs: Vec<f32>,
    /// Log-probability of each token under the distribution it was actually drawn from (after
    /// temperature, top-k and top-p, renormalised); `0` for greedy decoding.
    pub sampling_logprobs: Vec<f32>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
    /// For MoE models: per generated token `i`, the experts selected at the position that
    /// produced it (position `P − 1 + i` of `prompt ++ tokens`), row-major `[L, k]` ids for the
    /// `L` MoE layers in ascending decoder-layer order ([`ReplaySpec::moe_layers`]). `None` for
    /// dense models.
    pub routed_experts: Option<Vec<Vec<i32>>>,
    /// For MoE models: the same for the prompt positions `0..P − 1` (`P − 1` rows). Together,
    /// `prompt_routed_experts ++ routed_experts` is the routing of every position of
    /// `prompt ++ tokens[..n − 1]`, the input whose outputs score the `n` tokens (see
    /// [`Rollout::router_replay`]).
    pub prompt_routed_experts: Option<Vec<Vec<i32>>>,
}

impl Rollout {
    /// The routing of this rollout as a [`RouterReplayFile`] for a forward of
    /// `input_ids = prompt ++ tokens[..n − 1]` (`T = P + n − 1` rows, one sequence): replaying
    /// it with [`crate::replay::replay_routing`] reproduces the generator's routing at every
    /// position whose output scores a generated token. The last generated token is never fed
    /// to the model, so it has no routing; a trainer running on the full `prompt ++ tokens`
    /// may route that last position freely (in a causal model it only affects its own,
    /// unused, output). `None` for dense models; errors if `spec` does not match the recorded
    /// rows.
    pub fn router_replay(&self, spec: &ReplaySpec) -> Result<Option<RouterReplayFile>, ModelError> {
        let (Some(prompt), Some(generated)) = (&self.prompt_routed_experts, &self.routed_experts)
        else {
            return Ok(None);
        };
        let (layers, k) = (spec.moe_layers.len(), spec.topk);
        let rows: Vec<&Vec<i32>> = prompt.iter().chain(generated).collect();
        if let Some(bad) = rows.iter().find(|r| r.len() != layers * k) {
            return Err(ModelError::InvalidInput {
                what: "router replay",
                reason: format!(
                    "a recorded row has {} ids, the spec needs L·k = {layers}·{k}",
                    bad.len()
                ),
            });
        }
        let mut file = RouterReplayFile::new(spec.model_type, k, rows.len());
        for (l, &layer) in spec.moe_layers.iter().enumerate() {
            let ids = rows
                .iter()
                .flat_map(|r| r[l * k..(l + 1) * k].iter().copied())
                .collect();
            file.insert_layer(layer, ids)?;
        }
        Ok(Some(file))
    }
}

/// Output of [`RolloutModel::forward_cached_routing`].
#[derive(Debug, Clone)]
pub struct CachedForward {
    /// Logits `[B, S, V]`.
    pub logits: Tensor<3>,
    /// For an MoE model, the `[B·S, k]` selected experts of every MoE layer in ascending layer
    /// order (rows `b·S + s`); `None` for a dense model.
    pub topk_indices: Option<Vec<Tensor<2, Int>>>,
}

/// A causal LM [`generate_batch`] can roll out: a [`CausalLm`] on a known device that, when it
/// is an MoE, reports the experts each position was routed to.
pub trait RolloutModel: CausalLm {
    /// The device the model's parameters (and so its inputs) live on.
    fn device(&self) -> Device;

    /// [`CausalLm::forward_cached`] plus, for an MoE model, the experts every position was
    /// routed to.
    fn forward_cached_routing(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut crate::layers::kv_cache::KvCache,
    ) -> Result<CachedForward, ModelError> {
        Ok(CachedForward {
            logits: self.forward_cached(input_ids, cache)?,
            topk_indices: None,
        })
    }
}

/// Every model of a family at `world = 1`: its forward on the single-rank context, recording
/// the experts of every MoE layer.
impl<M: crate::distributed::ShardModel + CausalLm> RolloutModel for M {
    fn device(&self) -> Device {
        crate::weights::module_device(self)
    }

    fn forward_cached_routing(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut crate::layers::kv_cache::KvCache,
    ) -> Result<CachedForward, ModelError> {
        let shape = M::stack_shape(self.model_config())?;
        let moe = shape.num_experts.is_some();
        let ctx = crate::distributed::ParallelContext::local(
            shape.num_experts,
            shape.vocab_size,
            shape.rope,
        )?;
        let mut trace = crate::distributed::RouterTrace::recording(1.0, None);
        let out = ctx.logits(self, input_ids, None, Some(cache), &mut trace)?;
        Ok(CachedForward {
            logits: out.logits,
            topk_indices: moe.then_some(trace.selected),
        })
    }
}

/// A sharded model under any layout (every rank of a replica runs the same loop).
impl<M: crate::distributed::ShardModel> RolloutModel for crate::distributed::Sharded<M> {
    fn device(&self) -> Device {
        crate::weights::module_device(&self.model)
    }
}

/// SplitMix64 (Steele et al.): a small seedable generator, identical on every platform.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

/// SplitMix64's output function (a bijective 64-bit mixer).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    /// The token id.
    pub token: i64,
    /// `log_softmax(logits)[token]` of the unmodified logits (temperature 1).
    pub logprob: f32,
    /// Log-probability under the processed distribution it was drawn from (0 when greedy).
    pub sampling_logprob: f32,
}

/// Draws tokens from last-position logits with HF's processors ([module docs](self)), from a
/// seeded generator: the one [`generate_batch`] uses for each sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: SplitMix64,
}

impl Sampler {
    /// The generator of sequence `index` of a [`generate_batch`] call with `seed`.
    pub fn new(seed: u64, index: usize) -> Self {
        Self {
            rng: SplitMix64(mix64(seed ^ mix64(index as u64 ^ 0x5DEE_CE66_D1CE_4E5B))),
        }
    }

    /// The next token for `logits` (one position, `[V]`) under `config` (not re-validated):
    /// the first maximal logit when greedy, else a draw from [`sampling_distribution`].
    /// Errors if a logit is NaN or `+∞`, or all are `−∞`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        config: &SamplingConfig,
    ) -> Result<SampledToken, ModelError> {
        let max = check_logits(logits)?;
        let (token, sampling_logprob) = if config.is_greedy() {
            (argmax(logits), 0.0)
        } else {
            let dist = sampling_distribution(logits, config)?;
            let u = self.rng.next_f64();
            let mut cum = 0.0;
            let mut pick = dist[dist.len() - 1];
            for &(t, p) in &dist {
                cum += p;
                if u < cum {
                    pick = (t, p);
                    break;
                }
            }
            (pick.0, pick.1.ln())
        };
        let log_z = max
            + logits
                .iter()
                .map(|&x| (f64::from(x) - max).exp())
                .sum::<f64>()
                .ln();
        Ok(SampledToken {
            token: token as i64,
            logprob: (f64::from(logits[token]) - log_z) as f32,
            sampling_logprob: sampling_logprob as f32,
        })
    }
}

/// The largest logit, after checking none is NaN or `+∞` and not all are `−∞`.
fn check_logits(logits: &[f32]) -> Result<f64, ModelError> {
    let bad = |reason: String| ModelError::InvalidInput {
        what: "logits",
        reason,
    };
    if let Some(i) = logits
        .iter()
        .position(|x| x.is_nan() || *x == f32::INFINITY)
    {
        return Err(bad(format!("logit {i} is {}", logits[i])));
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err(bad("every logit is −∞ (or there are none)".to_owned()));
    }
    Ok(f64::from(max))
}

/// Index of the first maximal value.
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The distribution a non-greedy [`SamplingConfig`] draws from for `logits` (one position):
/// the kept tokens with their renormalised probabilities (all > 0, summing to 1), after
/// temperature, top-k and top-p in HF's order ([module docs](self)). Tokens are listed by id,
/// or by descending probability (ties by id) when top-p is active. For `temperature = 0` this
/// is the argmax with probability 1. Errors on NaN/`+∞` logits or when all are `−∞`.
pub fn sampling_distribution(
    logits: &[f32],
    config: &SamplingConfig,
) -> Result<Vec<(usize, f64)>, ModelError> {
    let max = check_logits(logits)?;
    if config.is_greedy() {
        return Ok(vec![(argmax(logits), 1.0)]);
    }
    let v = logits.len();
    // Top-k (HF keeps every token tied with the k-th largest logit); temperature > 0 keeps
    // the order, so this is the same on raw logits.
    let mut kept: Vec<usize> = match config.top_k {
        Some(k) if k < v => {
            let mut sorted = logits.to_vec();
            sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            let kth = sorted[k - 1];
            (0..v).filter(|&i| logits[i] >= kth).collect()
        }
        _ => (0..v).collect(),
    };
    kept.retain(|&i| logits[i] > f32::NEG_INFINITY);
    let t = config.temperature;
    let mut dist: Vec<(usize, f64)> = kept
        .iter()
        .map(|&i| (i, ((f64::from(logits[i]) - max) / t).exp()))
        .collect();
    // Underflowed tokens (tiny temperatures) can never be drawn; the maximum always stays.
    dist.retain(|d| d.1 > 0.0);
    normalise(&mut dist);
    if let Some(p) = config.top_p.filter(|&p| p < 1.0) {
        // Descending probability, ties to the lower id (stable sort of id-ordered tokens).
        dist.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut above = 0.0;
        let keep = dist
            .iter()
            .position(|&(_, q)| {
                let stop = above >= p;
                above += q;
                stop
            })
            .unwrap_or(dist.len())
            .max(1);
        dist.truncate(keep);
        normalise(&mut dist);
    }
    Ok(dist)
}

fn normalise(dist: &mut [(usize, f64)]) {
    let total: f64 = dist.iter().map(|d| d.1).sum();
    for d in dist {
        d.1 /= total;
    }
}

/// Continues every prompt (token ids, any lengths ≥ 1) with up to `config.max_new_tokens`
/// tokens, with a KV cache: one [`Rollout`] per prompt, in order.
///
/// Prompts of equal length are prefilled and decoded together as one batch; prompts of
/// different lengths in separate batches (see the [module docs](self) for why and for the
/// seeding). Errors if `config` is invalid, a prompt is empty, or a prompt or stop id is
/// outside the vocabulary.
pub fn generate_batch<M: RolloutModel + ?Sized>(
    model: &M,
    prompts: &[Vec<i64>],
    config: &SamplingConfig,
) -> Result<Vec<Rollout>, ModelError> {
    generate_batch_observed(model, prompts, config, &mut |_, _, _| {})
}

/// State of one sequence during decoding.
struct Sequence {
    sampler: Sampler,
    rollout: Rollout,
    done: bool,
}

/// [`generate_batch`], calling `observe(sequence, step, logits)` with the `[V]` logits each
/// token is sampled from (tests compare them with full forwards).
fn generate_batch_observed<M: RolloutModel + ?Sized>(
    model: &M,
    prompts: &[Vec<i64>],
    config: &SamplingConfig,
    observe: &mut dyn FnMut(usize, usize, &[f32]),
) -> Result<Vec<Rollout>, ModelError> {
    config.validate()?;
    let vocab = model.vocab_size();
    if let Some(bad) = config
        .stop_tokens
        .iter()
        .find(|&&t| t as u64 >= vocab as u64)
    {
        return Err(ModelError::InvalidInput {
            what: "stop_tokens",
            reason: format!("token id {bad} is outside 0..{vocab}"),
        });
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ModelError::InvalidInput {
            what: "prompts",
            reason: format!("prompt {i} is empty"),
        });
    }
    // Groups of equal prompt length, each in order of first appearance.
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        match groups.iter_mut().find(|(len, _)| *len == p.len()) {
            Some((_, members)) => members.push(i),
            None => groups.push((p.len(), vec![i])),
        }
    }
    let mut out: Vec<Option<Rollout>> = vec![None; prompts.len()];
    let device = model.device();
    for (len, members) in groups {
        let ids: Vec<i64> = members
            .iter()
            .flat_map(|&i| prompts[i].iter().copied())
            .collect();
        let input = token_ids(&ids, [members.len(), len], vocab, &device).map_err(|e| match e {
            ModelError::InvalidInput { reason, .. } => ModelError::InvalidInput {
                what: "prompts",
                reason,
            },
            e => e,
        })?;
        let rollouts = decode_group(model, &members, input, config, &device, observe)?;
        for (&i, r) in members.iter().zip(rollouts) {
            out[i] = Some(r);
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// Prefills `input [B, P]` (the prompts of sequences `members`) and decodes the group in
/// lock-step until every sequence has finished.
fn decode_group<M: RolloutModel + ?Sized>(
    model: &M,
    members: &[usize],
    mut input: Tensor<2, Int>,
    config: &SamplingConfig,
    device: &Device,
    observe: &mut dyn FnMut(usize, usize, &[f32]),
) -> Result<Vec<Rollout>, ModelError> {
    let b = members.len();
    let mut seqs: Vec<Sequence> = members
        .iter()
        .map(|&i| Sequence {
            sampler: Sampler::new(config.seed, i),
            rollout: Rollout {
                tokens: Vec::with_capacity(config.max_new_tokens),
                logprobs: Vec::with_capacity(config.max_new_tokens),
                sampling_logprobs: Vec::with_capacity(config.max_new_tokens),
                finish_reason: FinishReason::Length,
                routed_experts: None,
                prompt_routed_experts: None,
            },
            done: false,
        })
        .collect();
    let mut cache = model.new_cache();
    for step in 0..config.max_new_tokens {
        let CachedForward {
            logits,
            topk_indices: routing,
        } = model.forward_cached_routing(input, &mut cache)?;
        let [_, s, v] = logits.dims();
        let last = host_f32(logits.narrow(1, s - 1, 1).reshape([b, v]))?;
        let routing = routing.map(host_routing).transpose()?;
        for (row, seq) in seqs.iter_mut().enumerate() {
            if seq.done {
                continue;
            }
            let logits = &last[row * v..(row + 1) * v];
            observe(members[row], step, logits);
            let next = seq.sampler.sample(logits, config)?;
            let r = &mut seq.rollout;
            r.tokens.push(next.token);
            r.logprobs.push(next.logprob);
            r.sampling_logprobs.push(next.sampling_logprob);
            if let Some((layers, k)) = &routing {
                // Row `row·S + pos` of every layer, concatenated over layers.
                let at = |pos: usize| -> Vec<i32> {
                    layers
                        .iter()
                        .flat_map(|ids| ids[(row * s + pos) * k..(row * s + pos + 1) * k].to_vec())
                        .collect()
                };
                if step == 0 {
                    r.prompt_routed_experts = Some((0..s - 1).map(at).collect());
                }
                r.routed_experts
                    .get_or_insert_with(Vec::new)
                    .push(at(s - 1));
            }
            if config.stop_tokens.contains(&next.token) {
                (seq.done, r.finish_reason) = (true, FinishReason::Stop);
            } else if r.tokens.len() == config.max_new_tokens {
                (seq.done, r.finish_reason) = (true, FinishReason::Length);
            }
        }
        if seqs.iter().all(|q| q.done) {
            break;
        }
        // Finished rows are fed their last token again; their outputs are ignored.
        let next: Vec<i64> = seqs
            .iter()
            .map(|q| q.rollout.tokens.last().copied().unwrap_or(0))
            .collect();
        input = token_ids(&next, [b, 1], model.vocab_size(), device)?;
    }
    Ok(seqs.into_iter().map(|q| q.rollout).collect())
}

fn read_error(what: &str, e: impl std::fmt::Debug) -> ModelError {
    ModelError::InvalidInput {
        what: "logits",
        reason: format!("cannot read {what} back: {e:?}"),
    }
}

/// Host f32 values of a tensor.
fn host_f32(t: Tensor<2>) -> Result<Vec<f32>, ModelError> {
    t.cast(DType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| read_error("logits", e))
}

/// Host ids of every layer's `[T, k]` routing, and `k`.
fn host_routing(layers: Vec<Tensor<2, Int>>) -> Result<(Vec<Vec<i32>>, usize), ModelError> {
    let k = layers.first().map_or(0, |t| t.dims()[1]);
    let ids = layers
        .into_iter()
        .map(|t| {
            t.into_data()
                .try_into_vec_as::<i32>()
                .map_err(|e| read_error("routed experts", e))
        })
        .collect::<Result<_, _>>()?;
    Ok((ids, k))
}

#[cfg(test)]
mod tests;
