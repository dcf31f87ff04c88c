//! Fine-tuning any family on in-process ranks: the library side of `examples/finetune.rs`.
//!
//! Loads an HF directory of any family, shards it under a [`ParallelLayout`] on a
//! [`World`](crate::backend::comm::World) of threads and trains it with
//! [`Trainer`] on a small built-in corpus: arithmetic token
//! sequences `a, a+d, a+2d, …` (mod V) with `d ∈ {1, 2, 3}`, which a model can learn from a few
//! dozen steps, so the falling loss is visible.

use std::path::PathBuf;

use burn::tensor::Device;
use moe_backend::comm::{Comm, WorldConfig};
use moe_backend::parallel::ParallelLayout;
use moe_bridge::hf::HfCheckpoint;
use moe_models::distributed::ShardModel;
use moe_models::families::{Family, FamilyConfig};
use moe_models::hf::{ConfigVisitor, ModelConfig};
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::weights::WeightLoader;

use crate::launch::{Placement, run_spmd};

/// Everything that can stop a fine-tuning run.
#[derive(Debug, thiserror::Error)]
pub enum FinetuneError {
    /// Reading the checkpoint failed.
    #[error(transparent)]
    Bridge(#[from] moe_bridge::BridgeError),
    /// The model rejected its configuration or input.
    #[error(transparent)]
    Model(#[from] moe_models::ModelError),
    /// Layout or communication failure.
    #[error(transparent)]
    Backend(#[from] moe_backend::BackendError),
}

/// The model the jobs default to: the tiny random MoE checkpoint shipped in the repository.
pub const DEFAULT_MODEL_DIR: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");

/// Settings of [`finetune`].
#[derive(Debug, Clone)]
pub struct FinetuneOptions {
    /// HF model directory of any family (default: the tiny MoE fixture shipped in the repo).
    pub model_dir: PathBuf,
    /// Layout string, e.g. `tp=2,ep=4` (world derived: attention TP2 × DP2, experts EP4).
    pub layout: String,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per data-parallel replica per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Trainer settings (learning rate, optimizer, dispatcher, aux-loss coefficient).
    pub trainer: TrainerConfig,
}

impl Default for FinetuneOptions {
    fn default() -> Self {
        Self {
            model_dir: PathBuf::from(crate::finetune::DEFAULT_MODEL_DIR),
            layout: "tp=2,ep=4".into(),
            steps: 150,
            batch: 4,
            seq_len: 16,
            trainer: TrainerConfig {
                lr: 3e-3,
                ..TrainerConfig::default()
            },
        }
    }
}

/// Per-step results, averaged over ranks.
#[derive(Debug, Clone, Default)]
pub struct FinetuneReport {
    /// Mean cross-entropy per step.
    pub losses: Vec<f32>,
    /// Load-balancing loss per step (mean over MoE layers, without its coefficient), averaged
    /// over the data-parallel replicas.
    pub aux_losses: Vec<f32>,
    /// Global gradient norm per step.
    pub grad_norms: Vec<f64>,
    /// Target tokens per second summed over data-parallel replicas (mean over steps).
    pub tokens_per_second: f64,
    /// The layout that ran.
    pub layout: String,
}

/// The built-in corpus: `batch` arithmetic sequences for `(step, replica)`.
pub fn corpus_batch(
    step: usize,
    replica: usize,
    batch: usize,
    seq_len: usize,
    vocab: usize,
) -> Vec<i64> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ ((step as u64) << 20) ^ (replica as u64 + 1);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ids = Vec::with_capacity(batch * seq_len);
    for _ in 0..batch {
        let start = next() % vocab as u64;
        let stride = 1 + next() % 3;
        for i in 0..seq_len as u64 {
            ids.push(((start + i * stride) % vocab as u64) as i64);
        }
    }
    ids
}

/// Runs the fine-tuning job on in-process ranks; `on_step(step, mean_loss)` is called after
/// every step with the mean loss over ranks (from rank 0's thread).
pub fn finetune(
    options: &FinetuneOptions,
    on_step: &(dyn Fn(usize, &FinetuneReport) + Sync),
) -> Result<FinetuneReport, FinetuneError> {
    finetune_on(&Placement::Threads { world: 0 }, options, on_step)
}

/// [`finetune`] wherever `placement` puts the ranks: threads of this process (the layout's
/// world), or this process as one rank of a job a launcher started (`torchrun`, `mpirun`,
/// `srun`; see [`crate::launch`]). Returns this process's report (rank 0's for threads).
pub fn finetune_on(
    placement: &Placement,
    options: &FinetuneOptions,
    on_step: &(dyn Fn(usize, &FinetuneReport) + Sync),
) -> Result<FinetuneReport, FinetuneError> {
    let (placement, layout) = placement.resolve(&options.layout)?;
    let checkpoint = HfCheckpoint::open(&options.model_dir)?;
    let config = ModelConfig::from_dir(&options.model_dir)?;
    let job = Job {
        placement: &placement,
        layout: &layout,
        checkpoint: &checkpoint,
        options,
        on_step,
    };
    config.visit(job)?
}

/// [`finetune_on`] for the family of the model's `config.json`.
struct Job<'a> {
    placement: &'a Placement,
    layout: &'a ParallelLayout,
    checkpoint: &'a HfCheckpoint,
    options: &'a FinetuneOptions,
    on_step: &'a (dyn Fn(usize, &FinetuneReport) + Sync),
}

impl ConfigVisitor for Job<'_> {
    type Output = Result<FinetuneReport, FinetuneError>;

    fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
        let device = Device::flex().autodiff();
        let loader = WeightLoader::new(self.checkpoint, &device);
        let full = <F::Model as ShardModel>::from_loader(config, &loader)?;
        let (options, vocab) = (self.options, config.vocab_size());
        tracing::info!(layout = %self.layout, steps = options.steps, "fine-tuning");
        let report = run_spmd(self.placement, WorldConfig::default().timeout, |ctx| {
            let groups = ctx.process_groups(self.layout)?;
            let world = ctx.world()?;
            let settings = options.trainer.clone();
            let mut trainer = Trainer::new(&full, &groups, world.clone(), settings, &device)
                .map_err(to_backend)?;
            train_steps(&mut trainer, &world, options, 0, vocab, self.on_step)
        })?;
        Ok(report)
    }
}

/// One rank's part of a fine-tuning run: `options.steps` steps of `trainer` on the built-in
/// corpus ([`corpus_batch`] of steps `first_step..first_step + options.steps`, this rank's
/// data-parallel replica). Every rank of `world` calls it; the losses are averaged over the
/// ranks and `on_step(step, report so far)` runs on rank 0 after every step.
pub fn train_steps<M: ShardModel>(
    trainer: &mut Trainer<M>,
    world: &Comm,
    options: &FinetuneOptions,
    first_step: usize,
    vocab: usize,
    on_step: &(dyn Fn(usize, &FinetuneReport) + Sync),
) -> Result<FinetuneReport, moe_backend::BackendError> {
    let layout = trainer.process_groups().layout.clone();
    let replica = trainer.model().replica;
    let replicas = trainer.model().replicas as f64;
    let mut report = FinetuneReport {
        layout: layout.to_string(),
        ..FinetuneReport::default()
    };
    for step in first_step..first_step + options.steps {
        let ids = corpus_batch(step, replica, options.batch, options.seq_len, vocab);
        let batch = TrainBatch::causal(ids, options.batch).map_err(to_backend)?;
        let stats = trainer.step(&batch).map_err(to_backend)?;
        // Mean loss over ranks (every TP rank of a replica reports its replica's loss).
        let sums = burn::tensor::Tensor::<1>::from_data(
            [
                stats.loss,
                stats.aux_loss,
                (stats.tokens_per_second / layout.tp as f64) as f32,
            ],
            &Device::flex(),
        );
        let sums = world
            .all_reduce(sums, moe_backend::comm::ReduceOp::Sum)?
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default();
        let n = layout.world as f32;
        report
            .losses
            .push(sums.first().copied().unwrap_or(f32::NAN) / n);
        // A replica's router loss is the sum of its ranks' parts.
        report
            .aux_losses
            .push(sums.get(1).copied().unwrap_or(f32::NAN) / replicas as f32);
        report.grad_norms.push(stats.grad_norm);
        report.tokens_per_second +=
            sums.get(2).copied().unwrap_or(0.0) as f64 * (replicas / replicas.max(1.0));
        if world.rank() == 0 {
            on_step(step, &report);
        }
    }
    report.tokens_per_second /= options.steps.max(1) as f64;
    Ok(report)
}

pub(crate) fn to_backend(e: moe_models::ModelError) -> moe_backend::BackendError {
    match e {
        moe_models::ModelError::Backend(b) => b,
        moe_models::ModelError::Layout { field, reason } => moe_backend::BackendError::Layout {
            field,
            detail: reason,
        },
        other => moe_backend::BackendError::Config {
            field: "model",
            detail: other.to_string(),
        },
    }
}
