//! Resume equivalence (issue 6; Qwen3-MoE and DeepSeek-V3 with its MTP module and expert
//! bias): 3 training steps under layout A, a distributed checkpoint with
//! the optimizer state, a restore under layout B and 3 more steps give the parameters and
//! losses of 6 uninterrupted steps under B (f32, the tolerance of
//! `models/tests/parallel_equivalence.rs`).
//!
//! Every step trains on the same global batch whatever the layout: replica `r` of `R` takes
//! rows `[r·G/R, (r+1)·G/R)` of it (equal-length rows, so the mean of the replicas' mean losses
//! is the global mean). The router aux loss is off: it is computed over each rank's tokens,
//! so it depends on the layout.

use std::path::Path;

use burn::tensor::Device;
use burn_moe::backend::comm::World;
use burn_moe::backend::optim::DistributedAdamWConfig;
use burn_moe::backend::parallel::GroupFamily;
use burn_moe::backend::parallel::{ParallelLayout, replicate};
use burn_moe::bridge::dist::region::TensorBox;
use burn_moe::bridge::dist::{DistCheckpoint, SaveMeta, TrainState, read_train_state};
use burn_moe::models::checkpoint::{PlacedModel, restore_trainer, save_trainer};
use burn_moe::models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use burn_moe::models::hf::ModelConfig;
use burn_moe::models::train::{TrainBatch, Trainer, TrainerConfig};
use burn_moe::models::{DeepseekV3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM};
use moe_backend::testing::XorShift64;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");
const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/deepseek_v3");
/// Global batch rows per step and their length.
const G: usize = 4;
const S: usize = 8;
const LR: f64 = 1e-2;
/// Adam's ε, as in the parallel-equivalence test (keeps near-zero gradients well conditioned).
const EPS: f32 = 1e-3;

fn trainer_config() -> TrainerConfig {
    TrainerConfig {
        lr: LR,
        optimizer: DistributedAdamWConfig {
            weight_decay: 0.1,
            epsilon: EPS,
            ..DistributedAdamWConfig::default()
        },
        dispatcher: DispatcherKind::AllToAll,
        aux_loss_coeff: 0.0,
        ..TrainerConfig::default()
    }
}

/// Replica `replica` of `replicas`'s rows of the global batch of `step`.
fn batch(step: usize, replica: usize, replicas: usize, vocab: usize) -> TrainBatch {
    let ids = XorShift64::new(0x9e37_79b9_u64.wrapping_mul(step as u64 + 7)).ids(G * S, vocab);
    let rows = G / replicas;
    let mine = ids[replica * rows * S..(replica + 1) * rows * S].to_vec();
    TrainBatch::causal(mine, rows).expect("batch")
}

fn model(device: &Device) -> Qwen3MoeForCausalLM {
    let config = Qwen3MoeConfig::from_file(format!("{FIXTURE}/config.json")).expect("config");
    replicate(&config.init(device).expect("init"))
}

/// What one rank ends with: its flat `(dense, expert)` parameters and the losses it saw.
type RankEnd = ((Vec<f32>, Vec<f32>), Vec<f32>);

/// Trains steps `steps` under `layout` from `start` (or from the checkpoint at `resume`),
/// optionally saving to `save` at the end.
fn run<M: ParallelCausalLm + PlacedModel + Sync>(
    layout: &ParallelLayout,
    start: &M,
    (fixture, family, vocab): (&str, &str, usize),
    steps: std::ops::Range<usize>,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Vec<RankEnd> {
    let device = Device::flex().autodiff();
    let ckpt = resume.map(|p| DistCheckpoint::open::<ModelConfig>(p).expect("open checkpoint"));
    let config_json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{fixture}/config.json")).expect("config"),
    )
    .expect("config json");
    let results = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let mut trainer = Trainer::new(start, &groups, world.clone(), trainer_config(), &device)
            .expect("trainer");
        if let Some(ckpt) = &ckpt {
            let state = restore_trainer(ckpt, &mut trainer).expect("restore");
            assert_eq!(state.step as usize, steps.start);
            assert_eq!(state.data_position as usize, steps.start);
            assert_eq!(trainer.optimizer().step_count() as usize, steps.start);
        }
        let dp = groups.groups.get(GroupFamily::Dp);
        let (replica, replicas) = (dp.index, dp.size());
        let mut losses = Vec::new();
        for step in steps.clone() {
            let whole = batch(step, replica, replicas, vocab);
            // An interleaved pipeline needs micro-batches: one per sequence (the loss is
            // normalised over the step's tokens, so the step is the same).
            let micro: Vec<TrainBatch> = if layout.vpp > 1 {
                (whole.input_ids.chunks(S))
                    .map(|row| TrainBatch::causal(row.to_vec(), 1).expect("row"))
                    .collect()
            } else {
                vec![whole]
            };
            let stats = trainer.step_micro_batches(&micro).expect("step");
            losses.push(stats.loss);
        }
        if let Some(root) = save {
            let mut meta = SaveMeta::new(steps.end as u64, layout);
            meta.model_family = Some(family.into());
            meta.config = Some(config_json.clone());
            let state = TrainState {
                step: steps.end as u64,
                data_position: steps.end as u64,
                rng_seed: 7,
                ..TrainState::default()
            };
            save_trainer(&world, root, meta, &trainer, &state).expect("save");
        }
        let flat = trainer
            .optimizer()
            .table()
            .flatten_values(trainer.model().model())?;
        Ok((flat, losses))
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{layout} rank {r}: {e}")))
        .collect()
}

/// `|a − b| ≤ 1e-5·max|b| + 1e-6` elementwise (parallel_equivalence.rs).
fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * scale + 1e-6,
            "{what}: index {i}: {x} vs {y} (scale {scale})"
        );
    }
}

/// Both models from `a` to `b`; `{m}` in a pipeline layout stands for DeepSeek-V3's MTP
/// module (`m`; nothing for Qwen3-MoE).
fn resume_matches_uninterrupted(a: &str, b: &str) {
    let device = Device::flex().autodiff();
    let (start, other) = (model(&device), model(&device));
    let vocab = start.config().vocab_size;
    let (qa, qb) = (a.replace("{m}", ""), b.replace("{m}", ""));
    resume_model_matches_uninterrupted(&qa, &qb, (start, other), (FIXTURE, "qwen3_moe", vocab));
    let fixture = DEEPSEEK;
    let config = DeepseekV3Config::from_file(format!("{fixture}/config.json")).expect("config");
    let init = || replicate(&config.init(&device).expect("init"));
    let vocab = config.vocab_size;
    let (da, db) = (a.replace("{m}", "m"), b.replace("{m}", "m"));
    let model = (fixture, "deepseek_v3", vocab);
    resume_model_matches_uninterrupted(&da, &db, (init(), init()), model);
}

/// [`resume_matches_uninterrupted`] of one model: `start` trained, `other` (another random
/// model) restored.
fn resume_model_matches_uninterrupted<M: ParallelCausalLm + PlacedModel + Sync>(
    a: &str,
    b: &str,
    (start, other): (M, M),
    model: (&str, &str, usize),
) {
    let layout_a = ParallelLayout::parse_spec(a).expect("layout A");
    let layout_b = ParallelLayout::parse_spec(b).expect("layout B");
    // Unique per call: tests run at once and may resume from the same layout.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "burn-moe-resume-{}-{n}-{}",
        std::process::id(),
        model.1
    ));
    let _ = std::fs::remove_dir_all(&dir);
    run(&layout_a, &start, model, 0..3, None, Some(&dir));
    let ckpt = DistCheckpoint::open::<ModelConfig>(&dir).expect("checkpoint");
    ckpt.validate::<ModelConfig>().expect("valid checkpoint");
    assert_eq!(ckpt.index().step, 3);
    assert_eq!(ckpt.index().optimizer.as_ref().map(|o| o.step), Some(3));
    assert_eq!(
        read_train_state(&ckpt).expect("state").map(|s| s.rng_seed),
        Some(7)
    );
    assert!(
        ckpt.index()
            .tensors
            .contains_key("optim.exp_avg_sq.model.layers.1.mlp.experts.gate_up_proj")
    );
    // Restored under B and saved again at once: every tensor (parameters, buffers, optimizer
    // state) bit for bit the same.
    let again = dir.with_extension("again");
    let _ = std::fs::remove_dir_all(&again);
    run(&layout_b, &other, model, 3..3, Some(&dir), Some(&again));
    same_tensors(
        &ckpt,
        &DistCheckpoint::open::<ModelConfig>(&again).expect("re-saved checkpoint"),
        &format!("{a} -> {b}"),
    );
    let _ = std::fs::remove_dir_all(&again);
    // The restored run starts from another random model: everything must come from the
    // checkpoint.
    let resumed = run(&layout_b, &other, model, 3..6, Some(&dir), None);
    let straight = run(&layout_b, &start, model, 0..6, None, None);
    for (r, ((got, got_losses), (want, want_losses))) in resumed.iter().zip(&straight).enumerate() {
        let what = |s: &str| format!("{a} -> {b} rank {r}: {s}");
        close(&got.0, &want.0, &what("dense params after 6 steps"));
        close(&got.1, &want.1, &what("expert params after 6 steps"));
        close(got_losses, &want_losses[3..], &what("losses of steps 4-6"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every tensor of two checkpoints, compared bit for bit (dtype, shape, bytes).
fn same_tensors(a: &DistCheckpoint, b: &DistCheckpoint, what: &str) {
    let names: Vec<&String> = a.index().tensors.keys().collect();
    let other: Vec<&String> = b.index().tensors.keys().collect();
    assert_eq!(names, other, "{what}: tensor names");
    for (fqn, entry) in &a.index().tensors {
        let whole = TensorBox::full(&entry.global_shape);
        let x = a.read_box(fqn, &whole).expect("read");
        let y = b.read_box(fqn, &whole).expect("read");
        assert_eq!(x.dtype, y.dtype, "{what}: {fqn}: dtype");
        assert!(x.bytes == y.bytes, "{what}: {fqn}: stored values differ");
    }
}

#[test]
fn tp2_ep4_resumes_as_ep2_etp2() {
    resume_matches_uninterrupted("world=4,tp=2,ep=4", "world=4,ep=2,etp=2");
}

#[test]
fn four_ranks_resume_on_two() {
    resume_matches_uninterrupted("world=4,tp=2,ep=2", "world=2,ep=2");
}

/// Pipeline stages save and restore like any other dimension: a checkpoint written by three
/// pipeline stages (one decoder layer each) resumes on one rank, and one written on one rank
/// resumes on three stages.
#[test]
fn pipeline_stages_resume_on_one_rank_and_back() {
    resume_matches_uninterrupted("world=3,pp=3", "world=1");
    resume_matches_uninterrupted("world=1", "world=3,pp=3");
    resume_matches_uninterrupted("world=6,pp=3,ep=2", "world=4,tp=2,ep=2");
}

/// Uneven and interleaved pipeline splits place their layers in the checkpoint as any other:
/// 1 + 2 layers on two stages resumes on one rank; one rank resumes as four virtual stages
/// on two ranks (interleaved), which resume as 2 + 1 layers.
#[test]
fn uneven_and_virtual_pipeline_stages_resume() {
    resume_matches_uninterrupted("world=2,pp=2,pp_layout=Et|tt{m}L", "world=1");
    resume_matches_uninterrupted("world=1", "world=2,pp=2,vpp=2,pp_layout=Et|t|t|{m}L");
    resume_matches_uninterrupted(
        "world=4,pp=2,vpp=2,ep=2,pp_layout=Et|t|t|{m}L",
        "world=2,pp=2,pp_layout=Ett|t{m}L",
    );
}

/// Context-parallel ranks save and restore like any other: a checkpoint of `cp=2` (with EP)
/// reloads bit for bit on one rank and resumes there, and the reverse.
#[test]
fn context_parallel_checkpoints_resume_across_cp() {
    resume_matches_uninterrupted("world=4,cp=2,ep=2", "world=1");
    resume_matches_uninterrupted("world=1", "world=4,tp=2,cp=2,ep=2");
}
