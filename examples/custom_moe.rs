//! Your own MoE model, trained under any parallel layout with no change inside the crates.
//!
//! The model below is none of the built-in families: a **parallel-block** MoE transformer
//! (GPT-J / PaLM style) where attention and the MoE layer read the same normed input,
//! `x + attn(norm(x)) + moe(norm(x))`. It is a plain `#[derive(Module)]` built from Burn
//! modules and the crate's building blocks ([`Attention`], [`RmsNorm`], [`MoeLayer`]). Three
//! things make it a parallel model:
//!
//! 1. its **parallel plan** ([`Planned`]), declared with the same row builders as the built-in
//!    models ([`rows`]): which parameters are split over TP, EP × ETP or replicated, and how
//!    each gradient is reduced;
//! 2. its **shard** ([`ParallelCausalLm::shard`]): the plan cuts this rank's tensors out of the
//!    full model ([`shard_planned`]), or reads only them from a weight source
//!    ([`LoadShard::load_shard`], [`load_planned`]);
//! 3. its **forward**, written once against a [`ParallelContext`] (vocab-parallel embedding,
//!    sequence-parallel attention, MoE token dispatch, vocab-parallel head and loss), which is
//!    the single-rank model at `world = 1`.
//!
//! [`Trainer`] then trains it under any layout. `main` trains it on 4 in-process ranks with
//! attention TP2 × DP2 and experts EP4 (`tp=2,ep=4`), next to the `world = 1` run of the same
//! global batches: the losses agree to f32 rounding.
//!
//! Run: `cargo run --release --example custom_moe`.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::Device;
use burn_moe::backend::BackendError;
use burn_moe::backend::comm::{GroupComms, World};
use burn_moe::backend::fp8::Fp8Recipe;
use burn_moe::backend::layer::{MoeLayer, MoeLayerConfig};
use burn_moe::backend::parallel::{ParallelLayout, replicate};
use burn_moe::backend::router::{TopKRouter, TopKRouterConfig};
use burn_moe::models::config::RopeParameters;
use burn_moe::models::distributed::{
    CausalLmShard, DispatcherKind, LoadShard, ParallelCausalLm, ParallelContext, TrainForward,
};
use burn_moe::models::layers::{
    Attention, AttentionConfig, RmsNorm, RmsNormConfig, RotaryEmbedding,
};
use burn_moe::models::param_plan::{ParallelPlan, Planned, load_planned, rows, shard_planned};
use burn_moe::models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use burn_moe::models::{ModelError, WeightSource};

/// Sizes of the parallel-block MoE model.
#[derive(Debug, Clone, PartialEq)]
pub struct ParallelBlockMoeConfig {
    /// Vocabulary size (divisible by `tp`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Number of blocks.
    pub num_layers: usize,
    /// Query heads (divisible by `tp`).
    pub num_heads: usize,
    /// Key/value heads (divisible by `tp`).
    pub num_kv_heads: usize,
    /// Per-head size.
    pub head_dim: usize,
    /// Routed experts (divisible by `ep`).
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Expert FFN width (divisible by `etp`).
    pub moe_ffn: usize,
}

impl ParallelBlockMoeConfig {
    /// A tiny model for the CPU.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 64,
            hidden_size: 32,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            num_experts: 8,
            top_k: 2,
            moe_ffn: 32,
        }
    }

    /// The full (unsharded) model with random weights.
    pub fn init(&self, device: &Device) -> Result<ParallelBlockMoe, ModelError> {
        let h = self.hidden_size;
        let layers = (0..self.num_layers)
            .map(|_| {
                Ok(ParallelBlock {
                    norm: RmsNormConfig::new(h).init(device),
                    self_attn: AttentionConfig::new(
                        h,
                        self.num_heads,
                        self.num_kv_heads,
                        self.head_dim,
                    )
                    .init(device)?,
                    moe: MoeLayerConfig::new(
                        TopKRouterConfig::new(h, self.num_experts, self.top_k),
                        self.moe_ffn,
                    )
                    .with_init_std(0.1)
                    .init(device)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(ParallelBlockMoe {
            embed_tokens: EmbeddingConfig::new(self.vocab_size, h).init(device),
            layers,
            norm: RmsNormConfig::new(h).init(device),
            lm_head: LinearConfig::new(h, self.vocab_size)
                .with_bias(false)
                .init(device),
            config: self.clone(),
        })
    }
}

/// One block: `x + attn(norm(x)) + moe(norm(x))`.
#[derive(Module, Debug)]
pub struct ParallelBlock {
    /// The block's one pre-norm.
    pub norm: RmsNorm,
    /// GQA attention.
    pub self_attn: Attention,
    /// Routed experts.
    pub moe: MoeLayer,
}

/// The parallel-block MoE causal LM (a full model, or one rank's shard of it).
#[derive(Module, Debug)]
pub struct ParallelBlockMoe {
    /// Token embedding.
    pub embed_tokens: Embedding,
    /// The blocks.
    pub layers: Vec<ParallelBlock>,
    /// Final norm.
    pub norm: RmsNorm,
    /// Untied LM head.
    pub lm_head: Linear,
    /// Sizes (of the full model).
    #[module(skip)]
    pub config: ParallelBlockMoeConfig,
}

/// 1. The parallel plan: Burn module paths → HF names, splits and gradient classes.
impl Planned for ParallelBlockMoe {
    fn parallel_plan() -> ParallelPlan {
        let mut entries = rows::embedding("embed_tokens", "model.embed_tokens");
        entries.extend(rows::norm(
            "layers.*.norm",
            "model.layers.{0}.input_layernorm",
        ));
        entries.extend(rows::gqa(
            "layers.*.self_attn",
            "model.layers.{0}.self_attn",
        ));
        entries.extend(rows::moe("layers.*.moe", "model.layers.{0}.mlp", false));
        entries.extend(rows::norm("norm", "model.norm"));
        entries.extend(rows::column("lm_head", "lm_head", false, false));
        ParallelPlan::new("parallel_block_moe", entries)
    }

    fn main_layers(&self) -> usize {
        self.layers.len()
    }
}

/// One rank's shard and its parallel context.
#[derive(Debug, Clone)]
pub struct ParallelBlockMoeShard {
    /// This rank's parameters.
    pub model: ParallelBlockMoe,
    ctx: ParallelContext,
}

impl ParallelBlockMoeConfig {
    /// This rank's parallel context under the layout of `groups`.
    pub fn context(
        &self,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<ParallelContext, ModelError> {
        let rope = RotaryEmbedding::new(&RopeParameters::default(), self.head_dim)?;
        ParallelContext::new(groups, kind, Some(self.num_experts), self.vocab_size, rope)
    }
}

impl ParallelBlockMoeShard {
    /// The shard of the cut `model`: attention takes its local head counts from the cut
    /// shapes.
    fn new(mut model: ParallelBlockMoe, ctx: ParallelContext) -> Result<Self, ModelError> {
        model.layers = model
            .layers
            .into_iter()
            .map(|mut block| {
                block.self_attn = block.self_attn.with_local_heads()?;
                Ok(block)
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self { model, ctx })
    }
}

/// 2. Sharding: the plan cuts this rank's tensors out of the full model.
impl ParallelCausalLm for ParallelBlockMoe {
    type Shard = ParallelBlockMoeShard;

    fn shard(
        &self,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<ParallelBlockMoeShard, ModelError> {
        let ctx = self.config.context(groups, kind)?;
        let model = shard_planned(self, &ctx.shard_spec())?;
        ParallelBlockMoeShard::new(model, ctx)
    }

    fn with_fp8(self, _recipe: Fp8Recipe, _linears: bool) -> Result<Self, ModelError> {
        Err(ModelError::Unsupported {
            feature: "fp8",
            reason: "the parallel-block example model has no FP8 path".into(),
        })
    }
}

/// 2b. Sharded loading: this rank's boxes read straight from a weight source (an HF
///     directory, a distributed checkpoint's export, a live model) by the plan, into a
///     template whose lazily initialised parameters are never allocated at full size.
impl LoadShard for ParallelBlockMoe {
    type Config = ParallelBlockMoeConfig;

    fn load_shard(
        config: &ParallelBlockMoeConfig,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<ParallelBlockMoeShard, ModelError> {
        let ctx = config.context(groups, kind)?;
        let model = load_planned(&config.init(device)?, source, &ctx.shard_spec(), device)?;
        ParallelBlockMoeShard::new(model, ctx)
    }

    /// A shard at local shapes whose values a restore overwrites (randomly initialised here).
    fn shard_skeleton(
        config: &ParallelBlockMoeConfig,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<ParallelBlockMoeShard, ModelError> {
        let ctx = config.context(groups, kind)?;
        let model = shard_planned(&config.init(device)?, &ctx.shard_spec())?;
        ParallelBlockMoeShard::new(model, ctx)
    }
}

/// 3. The forward, written once against the parallel context.
impl CausalLmShard for ParallelBlockMoeShard {
    type Model = ParallelBlockMoe;

    fn model(&self) -> &ParallelBlockMoe {
        &self.model
    }

    fn model_mut(&mut self) -> &mut ParallelBlockMoe {
        &mut self.model
    }

    fn loss_groups(&self) -> (usize, usize) {
        self.ctx.loss_groups()
    }

    fn context_mut(&mut self) -> &mut ParallelContext {
        &mut self.ctx
    }

    fn begin_global_batch(&self) {
        self.ctx.reset_global_aux();
    }

    fn sequence_positions(&self, s: usize) -> Vec<usize> {
        self.ctx.sequence_positions(s)
    }

    fn forward_train_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        _mtp: bool,
    ) -> Result<TrainForward, ModelError> {
        let (ctx, m, b) = (&self.ctx, &self.model, batch.batch);
        let p = ctx.prepare(&batch.input_ids, &batch.labels, b, batch.layout(), device)?;
        let mut trace = p.trace(aux_grad_scale);
        // This rank's sequence-parallel block of the embedded tokens.
        // (Under context parallelism `p.ids` are this rank's two chunks of every row.)
        let mut x = ctx.embed(&m.embed_tokens, &p.ids, b)?;
        for block in &m.layers {
            // x + attn(norm(x)): attention on the gathered sequence, this rank's heads (and
            // the keys of the other context-parallel ranks).
            let inputs = ctx.masked_inputs(&p);
            let attn = ctx.attention_block(x.clone(), &block.norm, &block.self_attn, b, inputs)?;
            // + moe(norm(x)): this rank's tokens dispatched to the experts' ranks.
            let moe = ctx.moe(&block.moe, block.norm.forward(x), b, &mut trace)?;
            x = attn + moe;
        }
        let expert_load = std::mem::take(&mut trace.expert_load);
        let out = ctx.head_loss(
            x,
            &m.norm,
            Some(&m.lm_head),
            Some(&m.embed_tokens),
            &p.targets,
            trace,
        )?;
        Ok(TrainForward {
            loss: out.loss,
            mtp_losses: Vec::new(),
            router_losses: out.router_losses,
            expert_load,
        })
    }

    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        self.model
            .layers
            .iter_mut()
            .map(|block| &mut block.moe.router)
            .collect()
    }
}

/// Tokens per sequence.
pub const SEQ: usize = 16;
/// Sequences per micro-batch.
pub const MICRO_BATCH: usize = 2;
/// Micro-batches per global batch (split over the data-parallel replicas; one rank alone
/// accumulates them all).
pub const MICRO_BATCHES: usize = 2;

/// Sequence `i` of step `step`: counting up from a pseudo-random start (a task the model
/// learns within a few dozen steps).
pub fn sequence(step: usize, i: usize, vocab: usize) -> Vec<i64> {
    let start = (step * 7919 + i * 104_729) % vocab;
    (0..SEQ).map(|j| ((start + j) % vocab) as i64).collect()
}

/// Micro-batch `m` of the global batch at `step`.
pub fn micro_batch(step: usize, m: usize, vocab: usize) -> Result<TrainBatch, ModelError> {
    let ids: Vec<i64> = (m * MICRO_BATCH..(m + 1) * MICRO_BATCH)
        .flat_map(|i| sequence(step, i, vocab))
        .collect();
    TrainBatch::causal(ids, MICRO_BATCH)
}

/// Replica `r`'s micro-batches (of `replicas`) at `step`: a contiguous share of the global
/// batch's micro-batches, so that every layout sees the same global batch (the routers'
/// load-balancing loss is per micro-batch, so the split into micro-batches is part of the
/// global batch).
pub fn replica_batches(
    step: usize,
    r: usize,
    replicas: usize,
    vocab: usize,
) -> Result<Vec<TrainBatch>, ModelError> {
    if replicas == 0 || !MICRO_BATCHES.is_multiple_of(replicas) {
        return Err(ModelError::Layout {
            field: "dp",
            reason: format!("{MICRO_BATCHES} micro-batches do not split over {replicas} replicas"),
        });
    }
    let per = MICRO_BATCHES / replicas;
    (r * per..(r + 1) * per)
        .map(|m| micro_batch(step, m, vocab))
        .collect()
}

/// `ModelError` inside a [`World::run`] closure.
pub fn be(e: ModelError) -> BackendError {
    BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// Trains `start` for `steps` under `spec` on `world` in-process ranks; every rank returns its
/// replica index, its step statistics and its trained shard.
pub fn train(
    start: &ParallelBlockMoe,
    world: usize,
    spec: &str,
    steps: usize,
    config: &TrainerConfig,
) -> Result<Vec<(usize, Vec<StepStats>, ParallelBlockMoe)>, BackendError> {
    let layout = ParallelLayout::parse(world, spec)?;
    let replicas = layout.dp;
    let vocab = start.config.vocab_size;
    let device = Device::flex().autodiff();
    World::run(world, |rank| {
        let pg = rank.process_groups(&layout)?;
        let mut trainer =
            Trainer::new(start, &pg, rank.world()?, config.clone(), &device).map_err(be)?;
        let replica = trainer.model().ctx.replica();
        let mut stats = Vec::new();
        for step in 0..steps {
            let micro = replica_batches(step, replica, replicas, vocab).map_err(be)?;
            stats.push(trainer.step_micro_batches(&micro).map_err(be)?);
        }
        Ok((replica, stats, trainer.model().model().clone()))
    })
    .into_iter()
    .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    burn_moe::init_logging();
    let config = ParallelBlockMoeConfig::tiny();
    let start = replicate(&config.init(&Device::flex().autodiff())?);
    let params = start.num_params();
    let steps = 30;
    let trainer = TrainerConfig {
        lr: 3e-3,
        ..TrainerConfig::default()
    };
    println!("parallel-block MoE: {params} parameters, {steps} steps");
    let one = train(&start, 1, "", steps, &trainer)?;
    let four = train(&start, 4, "tp=2,ep=4", steps, &trainer)?;
    for step in 0..steps {
        // The global loss of the 4-rank run: the token-weighted mean over its replicas (each
        // replica's TP ranks report the same value).
        let (mut sum, mut tokens) = (0.0f64, 0usize);
        let mut seen = Vec::new();
        for (replica, stats, _) in &four {
            if !seen.contains(replica) {
                seen.push(*replica);
                sum += f64::from(stats[step].loss) * stats[step].tokens as f64;
                tokens += stats[step].tokens;
            }
        }
        if step % 5 == 0 || step + 1 == steps {
            println!(
                "step {:>2}: loss world=1 {:.6}   world=4 (tp=2,ep=4) {:.6}",
                step + 1,
                one[0].1[step].loss,
                sum / tokens as f64
            );
        }
    }
    Ok(())
}
