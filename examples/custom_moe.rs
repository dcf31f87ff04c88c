//! Your own MoE model, trained under any parallel layout with no change inside the crates.
//!
//! The model below is none of the built-in families: a **parallel-block** MoE transformer
//! (GPT-J / PaLM style) where attention and the MoE layer read the same normed input,
//! `x + attn(norm(x)) + moe(norm(x))`. It is a plain `#[derive(Module)]` built from Burn
//! modules and the crate's building blocks ([`Attention`], [`RmsNorm`], [`MoeLayer`]), written
//! once against a [`ParallelContext`] (vocab-parallel embedding, sequence-parallel attention,
//! MoE token dispatch, vocab-parallel head and loss), which is the single-rank model at
//! `world = 1`. Four impls make it a family the crates run under every layout (TP/SP/CP/PP/
//! EP/ETP/DP), exactly as the built-in families ([`burn_moe::models::families`]):
//!
//! 1. [`Planned`]: its **parallel plan**, declared with the same row builders as the built-in
//!    models ([`rows`]): which parameters are split over TP, EP × ETP or replicated, and how
//!    each gradient is reduced (and the HF names checkpoints and exports use);
//! 2. [`DecoderStack`](burn_moe::models::distributed::DecoderStack): its embedding, blocks, final norm and head (one macro line for a
//!    model with these parts as fields; the block's **forward** is the model's own code);
//! 3. [`ShardModel`]: its config's shape, its lazily built template and pipeline stages
//!    (loading, checkpoints and the planner cut them by the plan) and its blocks;
//! 4. [`LayerParts`](burn_moe::models::distributed::LayerParts): a block's attention and MoE layer (loading, FP8 and the routers read them;
//!    one macro line for a block with these parts as fields).
//!
//! The one generic sharded model ([`burn_moe::models::distributed::Sharded`]) and the
//! [`Trainer`] then do the rest. `main` trains it on 4 in-process ranks with attention
//! TP2 × DP2 and experts EP4 (`tp=2,ep=4`), next to the `world = 1` run of the same global
//! batches: the losses agree to f32 rounding.
//!
//! Run: `cargo run --release --example custom_moe`.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_moe::backend::BackendError;
use burn_moe::backend::comm::World;
use burn_moe::backend::layer::{MoeLayer, MoeLayerConfig};
use burn_moe::backend::parallel::{ParallelLayout, replicate};
use burn_moe::backend::router::TopKRouterConfig;
use burn_moe::models::ModelError;
use burn_moe::models::config::RopeParameters;
use burn_moe::models::distributed::{
    AttentionInputs, CausalLmShard, ParallelContext, PipelineModel, RouterTrace, ShardModel,
    StackShape,
};
use burn_moe::models::layers::{
    Attention, AttentionConfig, LayerStack, RmsNorm, RmsNormConfig, RotaryEmbedding,
};
use burn_moe::models::param_plan::{ParallelPlan, Planned, rows};
use burn_moe::models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use burn_moe::models::weights::StageHolding;

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
            embed_tokens: Some(EmbeddingConfig::new(self.vocab_size, h).init(device)),
            layers: LayerStack::new(layers),
            norm: Some(RmsNormConfig::new(h).init(device)),
            lm_head: Some(
                LinearConfig::new(h, self.vocab_size)
                    .with_bias(false)
                    .init(device),
            ),
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

impl ParallelBlock {
    /// The block on this rank's sequence-parallel rows `x`: attention on the gathered sequence
    /// (this rank's heads), the MoE layer on this rank's tokens (dispatched to the experts'
    /// ranks); the single-rank block at `world = 1`.
    pub fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let attn = ctx.attention_block(x.clone(), &self.norm, &self.self_attn, batch, inputs)?;
        Ok(attn + ctx.moe(&self.moe, self.norm.forward(x), batch, trace)?)
    }
}

/// The parallel-block MoE causal LM: the whole model, or one rank's shard of it (a pipeline
/// stage holds only its layers, the first stage the embedding, the last the head).
#[derive(Module, Debug)]
pub struct ParallelBlockMoe {
    /// Token embedding.
    pub embed_tokens: Option<Embedding>,
    /// The blocks (named by their global index).
    pub layers: LayerStack<ParallelBlock>,
    /// Final norm.
    pub norm: Option<RmsNorm>,
    /// Untied LM head.
    pub lm_head: Option<Linear>,
    /// Sizes (of the full model).
    #[module(skip)]
    pub config: ParallelBlockMoeConfig,
}

// ---- The family: plan, forward, shape. Everything above is the model itself. ----

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
        self.config.num_layers
    }
}

// 2. The forward: the model's embedding, blocks (`ParallelBlock::forward_in`), final norm and
//    head as a `DecoderStack`, and its pipeline stages.
burn_moe::models::flat_decoder_stack!(ParallelBlockMoe, ParallelBlock);

/// 3. The shape the parallel context needs, the (lazy) template loading cuts by the plan into
///    a rank's shard or a pipeline stage's part, and where its blocks are.
impl ShardModel for ParallelBlockMoe {
    type Config = ParallelBlockMoeConfig;

    fn model_config(&self) -> &ParallelBlockMoeConfig {
        &self.config
    }

    fn stack_shape(c: &ParallelBlockMoeConfig) -> Result<StackShape, ModelError> {
        Ok(StackShape {
            pipeline: PipelineModel {
                layers: c.num_layers,
                mtp: 0,
                tied: false,
                hidden: c.hidden_size,
            },
            num_experts: Some(c.num_experts),
            vocab_size: c.vocab_size,
            rope: RotaryEmbedding::new(&RopeParameters::default(), c.head_dim)?,
        })
    }

    fn template(c: &ParallelBlockMoeConfig, device: &Device) -> Result<Self, ModelError> {
        c.init(device)
    }

    fn select_stage(self, stage: &StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }
}

// 4. What the generic shard code reads of a block: its attention and its MoE layer (loading
//    fixes the attention's local heads; the routers, FP8 and gathering follow from these).
burn_moe::models::layer_parts!(ParallelBlock, Attention, attention = self_attn, moe = moe);

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
        let replica = trainer.model().replica;
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
