//! BF16 mixed precision (Megatron's `--bf16` recipe, docs/training-and-rl.md §Mixed precision (BF16))
//! on the golden runs' data and settings (bytes of a text, gradient accumulation over 2
//! micro-batches, clipping, AdamW; cross-entropy only, as the PyTorch reference):
//!
//! - for Qwen3-MoE, DeepSeek-V3 and dense Qwen3, the per-step losses of 50 BF16 steps stay
//!   within 2% of the f32 run's (DeepSeek-V3: at lr 1e-3; 5% at the others' lr 3e-3, where
//!   PyTorch's own BF16 run leaves its f32 run by 4.3%, see its tests), and both runs match PyTorch
//!   runs of the same recipe (`tests/fixtures/make_bf16_training_goldens.py`) within
//!   [`F32_RTOL`] and [`BF16_RTOL`];
//! - the shard's trainable parameters are BF16 and equal the optimizer's f32 main weights
//!   rounded to nearest even after every step; buffers (the expert bias) stay f32;
//! - the same BF16 run under several layouts equals the `world=1` BF16 run within
//!   [`LAYOUT_RTOL`];
//! - BF16 gradient reduction (`accumulate_allreduce_grads_in_fp32 = false`) trains too.

mod common;

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor, bf16};
use moe_backend::comm::World;
use moe_backend::optim::Precision;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_models::distributed::{CausalLmShard, ParallelCausalLm};
use moe_models::qwen3::Qwen3ForCausalLM;
use moe_models::qwen3_moe::Qwen3MoeForCausalLM;
use moe_models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3MoeConfig};

/// The golden runs' shape (`tests/fixtures/make_bf16_training_goldens.py`).
const STEPS: usize = 50;
const MICRO: usize = 2;
const MBS: usize = 2;
const S: usize = 32;
/// The golden runs' learning rate, and the lower one of DeepSeek-V3's second pair of runs.
const LR: f64 = 3e-3;
const LOW_LR: f64 = 1e-3;

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

fn golden() -> common::Golden {
    common::Golden::open("bf16_training")
}

/// The golden token ids `[STEPS, MICRO, MBS, S]` (bytes of a text).
fn golden_ids() -> Vec<i64> {
    let (shape, ids) = golden().i64("input_ids");
    assert_eq!(shape, [STEPS, MICRO, MBS, S]);
    ids
}

/// Micro-batch `m` of step `step` of the golden runs.
fn micro_batch(ids: &[i64], step: usize, m: usize) -> TrainBatch {
    let at = (step * MICRO + m) * MBS * S;
    TrainBatch::causal(ids[at..at + MBS * S].to_vec(), MBS).expect("batch")
}

/// The golden runs' settings: the trainer's defaults (AdamW β 0.9 / 0.999, ε 1e-8, no weight
/// decay, clipping at 1.0) with lr 3e-3 and no router aux loss, z-loss, expert-bias update or
/// MTP loss (the PyTorch reference trains on the cross-entropy alone).
fn config(precision: Precision) -> TrainerConfig {
    config_at(precision, LR)
}

/// [`config`] at learning rate `lr`.
fn config_at(precision: Precision, lr: f64) -> TrainerConfig {
    TrainerConfig {
        lr,
        aux_loss_coeff: 0.0,
        z_loss_coeff: 0.0,
        update_expert_bias: false,
        mtp_loss_scaling_factor: 0.0,
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
    let ids = golden_ids();
    let ids = &ids;
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
                .map(|m| micro_batch(ids, step, replica * per + m))
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
            assert_eq!(
                *g,
                bf16::from_f32(*m).to_f32(),
                "element {i}: {g} vs master {m}"
            );
        }
    }
}

fn no_check<M: ParallelCausalLm>(_: &Trainer<M>) {}

/// `max |a − b| / |b|` over the steps.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0f64, f64::max)
}

fn golden_losses(name: &str, precision: &str) -> Vec<f64> {
    let (shape, v) = golden().f32(&format!("{name}.loss.{precision}"));
    assert_eq!(shape, [STEPS]);
    v.into_iter().map(f64::from).collect()
}

/// Tolerance of the f32 run against PyTorch's f32 run (the same arithmetic in another order;
/// measured: 1.2e-6 Qwen3-MoE, 1.0e-6 Qwen3, 5.5e-3 DeepSeek-V3, whose routing amplifies it).
const F32_RTOL: f64 = 0.01;

/// The stated BF16 tolerance against PyTorch's BF16 run of the same recipe: every step's loss
/// within 3% (measured worst 2.1% Qwen3-MoE, 2.0% DeepSeek-V3, 0.27% Qwen3; means 0.24%, 0.50%,
/// 0.04%; the two BF16 runs differ in rounding order only,
/// but every BF16 rounding difference is amplified by training like the BF16-vs-f32 difference,
/// which PyTorch's own recipe shows at up to 4.3% for DeepSeek-V3 and 1.5% for Qwen3-MoE), and
/// the mean over the steps within 1%.
const BF16_RTOL: f64 = 0.03;
const BF16_MEAN_RTOL: f64 = 0.01;

/// The BF16 and f32 runs of `start` against each other and against PyTorch's (the goldens).
/// BF16 against f32: every step within `bf16_vs_f32` (2%, the acceptance bound, where the
/// PyTorch recipe itself stays within it).
fn check_model<M: ParallelCausalLm + Sync>(start: &M, name: &str, bf16_vs_f32: f64) {
    check_model_at(start, name, LR, bf16_vs_f32);
}

/// [`check_model`] at learning rate `lr` against the goldens `{name}.loss.*` (`name` names the
/// pair of PyTorch runs at `lr`).
fn check_model_at<M: ParallelCausalLm + Sync>(start: &M, name: &str, lr: f64, bf16_vs_f32: f64) {
    let f32_losses = train(
        start,
        (1, ""),
        config_at(Precision::F32, lr),
        STEPS,
        &no_check,
    );
    let bf16_losses = train(
        start,
        (1, ""),
        config_at(Precision::Bf16, lr),
        STEPS,
        &params_are_rounded_masters,
    );
    let (torch_f32, torch_bf16) = (golden_losses(name, "fp32"), golden_losses(name, "bf16"));
    let mean = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| ((x - y) / y).abs())
            .sum::<f64>()
            / a.len() as f64
    };
    eprintln!(
        "{name}: f32 {:.4} → {:.4}, bf16 {:.4} → {:.4}; worst relative difference: bf16 vs f32 \
         {:.2e} (PyTorch's {:.2e}), f32 vs PyTorch {:.2e}, bf16 vs PyTorch {:.2e} (mean {:.2e})",
        f32_losses[0],
        f32_losses[STEPS - 1],
        bf16_losses[0],
        bf16_losses[STEPS - 1],
        worst(&bf16_losses, &f32_losses),
        worst(&torch_bf16, &torch_f32),
        worst(&f32_losses, &torch_f32),
        worst(&bf16_losses, &torch_bf16),
        mean(&bf16_losses, &torch_bf16),
    );
    assert!(
        f32_losses[STEPS - 1] < 0.5 * f32_losses[0],
        "{name}: the run learns ({f32_losses:?})"
    );
    assert!(
        worst(&f32_losses, &torch_f32) <= F32_RTOL,
        "{name}: f32 {f32_losses:?} vs PyTorch {torch_f32:?}"
    );
    assert!(
        worst(&bf16_losses, &torch_bf16) <= BF16_RTOL
            && mean(&bf16_losses, &torch_bf16) <= BF16_MEAN_RTOL,
        "{name}: bf16 {bf16_losses:?} vs PyTorch {torch_bf16:?}"
    );
    assert!(
        worst(&bf16_losses, &f32_losses) <= bf16_vs_f32,
        "{name}: bf16 {bf16_losses:?} vs f32 {f32_losses:?}"
    );
}

#[test]
fn qwen3_moe_bf16_tracks_f32_and_pytorch_over_50_steps() {
    check_model(&qwen3_moe(&ad()), "qwen3_moe", 0.02);
}

/// DeepSeek-V3's group-limited sigmoid routing turns rounding differences into routing flips
/// whose effect on the loss grows with the step size: at the golden runs' lr 3e-3 PyTorch's own
/// BF16 run leaves its f32 run by up to 4.3% within these 50 steps (ours: 3.4%), so there
/// BF16 against f32 is held to that reference's divergence (5%); at lr 1e-3
/// ([`deepseek_v3_bf16_tracks_f32_within_2_percent_at_lr_1e_3`]) it is held to the 2%.
#[test]
fn deepseek_v3_bf16_tracks_f32_and_pytorch_over_50_steps() {
    check_model(&deepseek(&ad()), "deepseek_v3", 0.05);
}

/// DeepSeek-V3 at lr 1e-3 (a PyTorch pair of runs of its own): BF16 within 2% of f32 at every
/// one of the 50 steps, and both runs match PyTorch's.
#[test]
fn deepseek_v3_bf16_tracks_f32_within_2_percent_at_lr_1e_3() {
    check_model_at(&deepseek(&ad()), "deepseek_v3.lr0.001", LOW_LR, 0.02);
}

#[test]
fn qwen3_bf16_tracks_f32_and_pytorch_over_50_steps() {
    check_model(&qwen3(&ad()), "qwen3", 0.02);
}

/// Steps of the layout runs.
const LAYOUT_STEPS: usize = 10;

/// The BF16 run under `layouts` (data-parallel replicas share the global batch's micro-batches,
/// so every layout trains on the same global batches) equals the `world=1` BF16 run within
/// [`BF16_RTOL`] at every step, and the parameters are their rounded main weights on every
/// rank after every step.
fn bf16_layouts_match_one_rank<M: ParallelCausalLm + Sync>(
    start: &M,
    name: &str,
    layouts: &[(usize, &str)],
) {
    let one = train(
        start,
        (1, ""),
        config(Precision::Bf16),
        LAYOUT_STEPS,
        &no_check,
    );
    for &(world, spec) in layouts {
        let got = train(
            start,
            (world, spec),
            config(Precision::Bf16),
            LAYOUT_STEPS,
            &params_are_rounded_masters,
        );
        let w = worst(&got, &one);
        eprintln!("{name} {spec}: worst relative difference to world=1 {w:.2e}");
        assert!(w <= BF16_RTOL, "{name} {spec}: {got:?} vs world=1 {one:?}");
    }
}

#[test]
fn qwen3_moe_bf16_layouts_match_one_rank() {
    bf16_layouts_match_one_rank(
        &qwen3_moe(&ad()),
        "qwen3_moe",
        &[(2, "ep=2"), (4, "tp=2,ep=2,etp=2"), (4, "tp=2,ep=4")],
    );
}

#[test]
fn qwen3_bf16_layouts_match_one_rank() {
    bf16_layouts_match_one_rank(&qwen3(&ad()), "qwen3", &[(2, "pp=2"), (2, "cp=2")]);
}

#[test]
fn deepseek_v3_bf16_layouts_match_one_rank() {
    bf16_layouts_match_one_rank(&deepseek(&ad()), "deepseek_v3", &[(4, "tp=2,ep=4")]);
}

/// Bytes of the shard's trainable parameters as they are held (numel × dtype size) and their
/// element count.
fn param_bytes<M: ParallelCausalLm>(trainer: &Trainer<M>) -> (usize, usize) {
    struct Bytes(usize, usize);
    impl ModuleVisitor for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            if t.is_require_grad() {
                let n = t.shape().num_elements();
                self.0 += n * t.dtype().size();
                self.1 += n;
            }
        }
    }
    let mut b = Bytes(0, 0);
    trainer.model().model().visit(&mut b);
    (b.0, b.1)
}

/// The planner's bytes per parameter follow the precision: measured on a trained `world=1`
/// Qwen3-MoE shard, the parameters take 2 bytes each under BF16 and 4 under f32, the main
/// weights 4 under both, as `plan::memory::state_bytes` says for one rank.
#[test]
fn measured_bytes_per_parameter_equal_the_planners() {
    use moe_backend::parallel::ParallelLayout;
    use moe_models::plan::RankParams;
    use moe_models::plan::memory::{MemoryOptions, state_bytes};
    let start = qwen3_moe(&ad());
    for precision in [Precision::Bf16, Precision::F32] {
        let measured = World::run(1, |ctx| {
            let pg = ctx.process_groups(&ParallelLayout::parse(1, "").expect("layout"))?;
            let mut trainer =
                Trainer::new(&start, &pg, ctx.world()?, config(precision), &ad()).map_err(be)?;
            let ids = golden_ids();
            let micro: Vec<TrainBatch> = (0..MICRO).map(|m| micro_batch(&ids, 0, m)).collect();
            trainer.step_micro_batches(&micro).map_err(be)?;
            let (bytes, n) = param_bytes(&trainer);
            let (dense, expert) = trainer.optimizer().master_values()?;
            let master_bytes = (dense.len() + expert.len()) * std::mem::size_of::<f32>();
            Ok((bytes, n, master_bytes))
        })
        .remove(0)
        .expect("world 1");
        let (bytes, n, master_bytes) = measured;
        let planned = state_bytes(
            &RankParams {
                dense_sharded: n as u64,
                dense_replicated: 0,
                expert: 0,
                buffers: 0,
            },
            &ParallelLayout::parse(1, "").expect("layout"),
            &MemoryOptions {
                precision,
                ..MemoryOptions::default()
            },
        );
        assert_eq!(bytes as f64, planned.weights, "{precision}: parameters");
        assert_eq!(
            master_bytes as f64, planned.master,
            "{precision}: main weights"
        );
        assert_eq!(bytes / n, precision.param_bytes(), "{precision}");
    }
}
