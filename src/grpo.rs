//! GRPO on a verifiable synthetic task: the library side of `examples/grpo.rs`.
//!
//! The tiny Qwen3-MoE of `tests/fixtures/qwen3_moe` (random weights, 256-token vocabulary)
//! learns to **copy the first digit of its prompt**: a prompt is `prompt_len` random digits
//! (tokens `0..10`), the answer is one sampled token, and a rule scores it ([`reward`]): 1 for
//! the prompt's first digit, 0.1 for another digit, 0 otherwise. A random policy scores ≈ 0.01.
//! The policy loss carries an entropy bonus: without it the policy collapses onto one digit
//! for every prompt within a few dozen steps, after which every sample of a group is the same
//! and GRPO's advantages vanish.
//!
//! Every step runs the whole RL loop on the ranks of a parallel layout (threads, or processes
//! under a launcher; experts sharded with EP):
//! 1. **weight sync**: the trained shards stream into every rank's forward-only rollout model
//!    ([`moe_models::weight_sync`]: rank 0 assembles one HF tensor at a time from the shards
//!    that hold its pieces and broadcasts the buckets, f32 so that the rollouts' log-probabilities
//!    are the trainer's; no rank gathers the whole training model);
//! 2. **rollouts**: each data-parallel replica samples `samples` answers for each of its
//!    `prompts_per_replica` prompts ([`generate_batch`], with the behaviour log-probabilities);
//! 3. **rewards → advantages**: the rule above, then GRPO's group-normalised advantages over
//!    the samples of each prompt ([`grpo_advantages`]);
//! 4. **policy update**: PPO's clipped objective ([`ppo_loss`]) on the answer tokens, with the
//!    sharded model's vocab-parallel log-probabilities, through the trainer's loss hook
//!    ([`Trainer::step_with_logprobs`], on the last pipeline stage under any layout): one ZeRO-1
//!    AdamW step.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{DType, Device, Tensor, TensorData};
use moe_backend::BackendError;
use moe_backend::comm::{Comm, GroupComms, ReduceOp, WorldConfig};
use moe_backend::parallel::GroupFamily;
use moe_backend::parallel::ParallelLayout;
use moe_bridge::hf::HfCheckpoint;
use moe_models::CausalLm;
use moe_models::distributed::ShardModel;
use moe_models::families::Family;
use moe_models::hf::{ConfigVisitor, ModelConfig};
use moe_models::rl::{
    LossAgg, MismatchMetrics, PpoConfig, ResponseMask, RolloutCorrection, aggregate,
    grpo_advantages, ppo_loss, rollout_correction, token_advantages,
};
use moe_models::rollout::{SamplingConfig, generate_batch};
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::weight_sync::{
    ModelReceiver, SyncDest, SyncDtype, SyncOptions, WeightSyncError, sync_weights,
};
use moe_models::weights::WeightLoader;

use crate::finetune::{FinetuneError, to_backend};
use crate::launch::{Placement, run_spmd};

/// Settings of a GRPO run.
#[derive(Debug, Clone)]
pub struct GrpoOptions {
    /// HF Qwen3-MoE directory (default: the tiny fixture shipped in the repo).
    pub model_dir: PathBuf,
    /// Layout, e.g. `ep=4` (experts over 4 ranks, 4 data-parallel replicas).
    pub layout: String,
    /// Policy updates.
    pub steps: usize,
    /// Prompts per data-parallel replica per step.
    pub prompts_per_replica: usize,
    /// Sampled answers per prompt (GRPO's group size).
    pub samples: usize,
    /// Digits per prompt.
    pub prompt_len: usize,
    /// Learning rate of the policy update.
    pub lr: f64,
    /// Sampling temperature of the rollouts.
    pub temperature: f64,
    /// Coefficient of the entropy bonus of the policy loss.
    pub entropy_coef: f64,
    /// Seed of the prompts and the sampling.
    pub seed: u64,
}

impl Default for GrpoOptions {
    fn default() -> Self {
        Self {
            model_dir: PathBuf::from(crate::finetune::DEFAULT_MODEL_DIR),
            layout: "ep=4".into(),
            steps: 300,
            prompts_per_replica: 4,
            samples: 8,
            prompt_len: 1,
            lr: 1e-3,
            temperature: 1.0,
            entropy_coef: 0.05,
            seed: 7,
        }
    }
}

/// What a GRPO run measured (this process's view; every rank sees the same rewards).
#[derive(Debug, Clone, Default)]
pub struct GrpoReport {
    /// Mean reward of each step's rollouts (before that step's update), over all replicas.
    pub mean_rewards: Vec<f64>,
    /// Fraction of answers that copied the first digit, per step.
    pub exact: Vec<f64>,
    /// Per step, the rollout–trainer mismatch on the answer tokens, averaged over replicas
    /// (NeMo-RL's `token_mult_prob_error`, mean `exp(|log π_trainer − log π_rollout|)`): 1 when
    /// the rollout model, synced every step, gives the trainer's log-probabilities.
    pub token_mult_prob_error: Vec<f64>,
    /// Per step, the K3 estimate of `KL(π_rollout ‖ π_trainer)` on the answer tokens, averaged
    /// over replicas (verl's `rollout_corr/rollout_k3_kl`).
    pub rollout_k3_kl: Vec<f64>,
    /// Wall time of the run.
    pub seconds: f64,
    /// The layout that ran.
    pub layout: String,
}

/// Tokens a prompt is made of (the digits).
pub const DIGITS: i64 = 10;

/// The task's rule: 1 for answering with the prompt's first digit, 0.1 for any other digit,
/// 0 for a token that is not a digit.
pub fn reward(prompt: &[i64], answer: &[i64]) -> f64 {
    match (answer.first(), prompt.first()) {
        (Some(&a), Some(&t)) if a == t => 1.0,
        (Some(&a), _) if (0..DIGITS).contains(&a) => 0.1,
        _ => 0.0,
    }
}

/// Prompt `index` of `replica` at `step`: `len` digits from a seeded generator.
pub fn prompt(seed: u64, step: usize, replica: usize, index: usize, len: usize) -> Vec<i64> {
    let mut x = seed
        ^ 0x9e37_79b9_7f4a_7c15
        ^ ((step as u64) << 32)
        ^ ((replica as u64) << 16)
        ^ index as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % DIGITS as u64) as i64
        })
        .collect()
}

/// Runs GRPO on in-process ranks; `on_step(step, report so far)` runs on rank 0.
pub fn grpo(
    options: &GrpoOptions,
    on_step: &(dyn Fn(usize, &GrpoReport) + Sync),
) -> Result<GrpoReport, FinetuneError> {
    grpo_on(&Placement::Threads { world: 0 }, options, on_step)
}

/// [`grpo`] wherever `placement` puts the ranks (threads, or this process as one rank of a
/// launched job); returns this process's report.
pub fn grpo_on(
    placement: &Placement,
    options: &GrpoOptions,
    on_step: &(dyn Fn(usize, &GrpoReport) + Sync),
) -> Result<GrpoReport, FinetuneError> {
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

/// [`grpo_on`] for the family of the model's `config.json`.
struct Job<'a> {
    placement: &'a Placement,
    layout: &'a ParallelLayout,
    checkpoint: &'a HfCheckpoint,
    options: &'a GrpoOptions,
    on_step: &'a (dyn Fn(usize, &GrpoReport) + Sync),
}

impl ConfigVisitor for Job<'_> {
    type Output = Result<GrpoReport, FinetuneError>;

    fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
        let device = Device::flex().autodiff();
        let loader = WeightLoader::new(self.checkpoint, &device);
        let full = <F::Model as ShardModel>::from_loader(config, &loader)?;
        run_grpo(
            &full,
            self.placement,
            self.layout,
            self.options,
            self.on_step,
            &device,
        )
    }
}

/// The GRPO loop on the ranks of `placement`, from the whole model `full`.
fn run_grpo<M: ShardModel + CausalLm + Sync>(
    full: &M,
    placement: &Placement,
    layout: &ParallelLayout,
    options: &GrpoOptions,
    on_step: &(dyn Fn(usize, &GrpoReport) + Sync),
    device: &Device,
) -> Result<GrpoReport, FinetuneError> {
    let (placement, layout) = (placement.clone(), layout.clone());
    let trainer_config = TrainerConfig {
        lr: options.lr,
        // The policy objective alone (the router loss is a pre-training regulariser).
        aux_loss_coeff: 0.0,
        ..TrainerConfig::default()
    };
    let start = Instant::now();
    let report = run_spmd(&placement, WorldConfig::default().timeout, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let world = ctx.world()?;
        let mut trainer =
            Trainer::new(full, &groups, world.clone(), trainer_config.clone(), device)
                .map_err(to_backend)?;
        let replica = trainer.model().replica;
        let mut report = GrpoReport {
            layout: layout.to_string(),
            ..GrpoReport::default()
        };
        // This rank's rollout model (forward-only); every step's sync overwrites its weights.
        let mut policy = full.clone().valid();
        for step in 0..options.steps {
            sync_policy(&trainer, &groups, &world, &mut policy)?;
            let (mean, exact, mismatch) =
                grpo_step(&mut trainer, &policy, options, step, replica).map_err(to_backend)?;
            let [token_mult_prob_error, k3_kl] = stage_mismatch(&groups, mismatch)?;
            // Every TP rank of a replica holds the same rollouts: the world mean weights the
            // replicas equally.
            let sums = Tensor::<1>::from_data(
                [
                    mean as f32,
                    exact as f32,
                    token_mult_prob_error as f32,
                    k3_kl as f32,
                ],
                &Device::flex(),
            );
            let sums = world
                .all_reduce(sums, ReduceOp::Mean)?
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap_or_default();
            report
                .mean_rewards
                .push(f64::from(sums.first().copied().unwrap_or(f32::NAN)));
            report
                .exact
                .push(f64::from(sums.get(1).copied().unwrap_or(f32::NAN)));
            report
                .token_mult_prob_error
                .push(f64::from(sums.get(2).copied().unwrap_or(f32::NAN)));
            report
                .rollout_k3_kl
                .push(f64::from(sums.get(3).copied().unwrap_or(f32::NAN)));
            if ctx.rank() == 0 {
                on_step(step, &report);
            }
        }
        Ok(report)
    })?;
    Ok(GrpoReport {
        seconds: start.elapsed().as_secs_f64(),
        ..report
    })
}

/// Step 1, weight sync (collective): the trained shards stream into `policy`, this rank's
/// rollout model, in f32 buckets that rank 0 assembles and broadcasts to every rank.
fn sync_policy<M: ShardModel>(
    trainer: &Trainer<M>,
    groups: &GroupComms,
    world: &Comm,
    policy: &mut M,
) -> Result<(), BackendError> {
    let options = SyncOptions {
        dtype: SyncDtype::F32,
        dest: SyncDest::Broadcast(world.clone()),
        ..SyncOptions::default()
    };
    let mut receiver = ModelReceiver::new(policy, &Device::flex());
    match sync_weights(&trainer.model().model, groups, options, Some(&mut receiver)) {
        Ok(_) => Ok(()),
        Err(WeightSyncError::Comm(e)) => Err(e),
        Err(e) => Err(BackendError::Config {
            field: "weight_sync",
            detail: e.to_string(),
        }),
    }
}

/// Steps 2–4 of this rank (the policy synced); returns this replica's mean reward, exact-copy
/// rate and the rollout–trainer mismatch of its answer tokens ([`rollout_correction`]'s
/// metrics, measured on the trainer's log-probabilities before the update; `None` off the
/// last pipeline stage, where the policy loss runs).
fn grpo_step<M: ShardModel + CausalLm>(
    trainer: &mut Trainer<M>,
    policy: &M,
    options: &GrpoOptions,
    step: usize,
    replica: usize,
) -> Result<(f64, f64, Option<MismatchMetrics>), moe_models::ModelError> {
    // 2. Rollouts: `samples` answers per prompt, the same on every TP rank of the replica
    // (same model, same seed).
    let prompts: Vec<Vec<i64>> = (0..options.prompts_per_replica)
        .map(|i| prompt(options.seed, step, replica, i, options.prompt_len))
        .collect();
    let repeated: Vec<Vec<i64>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), options.samples))
        .collect();
    let sampling = SamplingConfig {
        temperature: options.temperature,
        top_k: None,
        top_p: None,
        max_new_tokens: 1,
        stop_tokens: Vec::new(),
        seed: options.seed ^ ((step as u64) << 20) ^ replica as u64,
    };
    let rollouts = generate_batch(policy, &repeated, &sampling)?;
    // 3. Rewards and group-normalised advantages.
    let rewards: Vec<f64> = repeated
        .iter()
        .zip(&rollouts)
        .map(|(p, r)| reward(p, &r.tokens))
        .collect();
    let exact = rewards.iter().filter(|&&r| r >= 1.0 - 1e-12).count() as f64 / rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    let advantages = grpo_advantages(&rewards, options.samples, true, 1e-6)?;
    // 4. The policy update on prompt + answer; only the answer token counts.
    let rows = repeated.len();
    let seq = options.prompt_len + 1;
    let ids: Vec<i64> = repeated
        .iter()
        .zip(&rollouts)
        .flat_map(|(p, r)| p.iter().copied().chain(r.tokens.iter().copied().take(1)))
        .collect();
    let answer_at = seq - 2; // position t predicts token t + 1
    let mut mask = vec![0f32; rows * (seq - 1)];
    let mut old = vec![0f32; rows * (seq - 1)];
    for (row, r) in rollouts.iter().enumerate() {
        mask[row * (seq - 1) + answer_at] = 1.0;
        old[row * (seq - 1) + answer_at] = r.logprobs.first().copied().unwrap_or(0.0);
    }
    let mut mismatch = None;
    let batch = TrainBatch::causal(ids, rows)?;
    // The policy loss of the trainer's log-probs, on the last pipeline stage (every layout).
    trainer.step_with_logprobs(std::slice::from_ref(&batch), |_, _, lp| {
        let dev = lp.logprobs.device();
        let mask = ResponseMask::from_float(Tensor::<2>::from_data(
            TensorData::new(mask.clone(), [rows, seq - 1]),
            &dev,
        ))?;
        let old = Tensor::<2>::from_data(TensorData::new(old.clone(), [rows, seq - 1]), &dev);
        let adv = token_advantages(&advantages, &mask, DType::F32)?.to_device(&dev);
        // The rollout engine's log-probabilities against the trainer's (metrics only).
        let measured = rollout_correction(
            lp.logprobs.clone(),
            old.clone(),
            &mask,
            &RolloutCorrection::default(),
        )?;
        mismatch = Some(measured.metrics.mismatch);
        let out = ppo_loss(lp.logprobs, old, adv, &mask, &PpoConfig::default())?;
        // Entropy bonus: keeps the samples of a group diverse, so their advantages carry a
        // signal after the format is learned.
        let entropy = aggregate(lp.entropy, &mask, LossAgg::TokenMean)?;
        Ok((out.loss - entropy.mul_scalar(options.entropy_coef), rows))
    })?;
    Ok((mean, exact, mismatch))
}

/// The last pipeline stage's mismatch metrics (where the policy loss ran) on every stage:
/// `[token_mult_prob_error, rollout_k3_kl]`.
fn stage_mismatch(
    groups: &GroupComms,
    mismatch: Option<MismatchMetrics>,
) -> Result<[f64; 2], BackendError> {
    let pp = groups.comm(GroupFamily::Pp);
    let last = pp.size() - 1;
    let local = match (&mismatch, pp.rank() == last) {
        (Some(m), _) => [m.token_mult_prob_error as f32, m.k3_kl as f32],
        (None, false) => [0.0; 2],
        (None, true) => {
            return Err(BackendError::Config {
                field: "rollouts",
                detail: "the policy update ran no forward on the last pipeline stage".into(),
            });
        }
    };
    let t = Tensor::<1>::from_data(local, &Device::flex());
    let v = pp
        .broadcast(t, last)?
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    Ok([
        f64::from(v.first().copied().unwrap_or(f32::NAN)),
        f64::from(v.get(1).copied().unwrap_or(f32::NAN)),
    ])
}
