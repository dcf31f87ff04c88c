//! The trainer with Muon (weight matrices) + AdamW (embedding, LM head, norms): the same run
//! under other layouts equals `world=1`, it learns, and it is not AdamW.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use moe_backend::comm::World;
use moe_backend::optim::{DistributedAdamWConfig, MuonConfig};
use moe_backend::parallel::{GroupFamily, ParallelLayout, replicate};
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use moe_models::qwen3_moe::Qwen3MoeForCausalLM;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig};

const STEPS: usize = 3;

fn ad() -> Device {
    Device::flex().autodiff()
}

fn config(muon: bool) -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        // As the other cross-layout comparisons: a moderate ε for the AdamW side.
        optimizer: DistributedAdamWConfig {
            epsilon: 1e-3,
            weight_decay: 0.1,
            ..TrainerConfig::default().optimizer
        },
        muon: muon.then(|| MuonConfig {
            weight_decay: 0.1,
            ..MuonConfig::default()
        }),
        ..TrainerConfig::default()
    }
}

/// Every float parameter of a module, in visiting order.
#[derive(Default)]
struct Values(Vec<Vec<f32>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(
            param
                .val()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32"),
        );
    }
}

fn values<M: Module>(m: &M) -> Vec<Vec<f32>> {
    let mut v = Values::default();
    m.visit(&mut v);
    v.0
}

/// Ids of replica `r` (the global batch is every replica's rows; the same every step).
fn ids(r: usize) -> Vec<i64> {
    (0..2 * 12)
        .map(|i| ((i * 7 + r * 29) % 256) as i64)
        .collect()
}

fn be(e: moe_models::ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// Trains `STEPS` steps under `(world, spec)` (at world 1 on the `replicas_of_reference`
/// replicas' rows as micro-batches); returns each rank's losses and shard.
fn train<M: ParallelCausalLm + Sync>(
    start: &M,
    (world, spec): (usize, &str),
    muon: bool,
    replicas_of_reference: usize,
) -> (Vec<Vec<f32>>, Vec<M>) {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let layout = &layout;
    let out = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, config(muon), &ad()).map_err(be)?;
        let replica = pg.groups.get(GroupFamily::DpCp).index;
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            // World 1 takes every replica's rows as micro-batches (the same global batch).
            let micro: Vec<TrainBatch> = if world == 1 {
                (0..replicas_of_reference)
                    .map(|r| TrainBatch::causal(ids(r), 2).expect("batch"))
                    .collect()
            } else {
                vec![TrainBatch::causal(ids(replica), 2).expect("batch")]
            };
            losses.push(trainer.step_micro_batches(&micro).map_err(be)?.loss);
        }
        Ok((losses, trainer.model().model().clone()))
    });
    out.into_iter().map(|r| r.expect("rank")).unzip()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * scale + 1e-6,
            "{what}: index {i}: {x} vs {y} (scale {scale})"
        );
    }
}

fn layouts_match_one_rank<M: ParallelCausalLm + Sync>(start: &M) {
    for (world, spec) in [
        (4, "tp=2,ep=4"),
        (4, "ep=2,etp=2"),
        (2, "ep=2"),
        (3, "pp=3"),
    ] {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let replicas = layout.dp;
        let (_, reference) = train(start, (1, ""), true, replicas);
        let reference = &reference[0];
        let (_, shards) = train(start, (world, spec), true, replicas);
        // Cut the world-1 result the way each rank holds it and compare every parameter.
        let layout = &layout;
        let wants = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout)?;
            let shard = reference.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
            Ok(values(shard.model()))
        });
        for (rank, (want, got)) in wants.into_iter().zip(&shards).enumerate() {
            let want = want.expect("rank");
            let got = values(got);
            assert_eq!(got.len(), want.len());
            for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                close(g, w, &format!("{spec} rank {rank} parameter {p}"));
            }
        }
    }
}

fn qwen3_moe() -> Qwen3MoeForCausalLM {
    let dir = common::fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&Qwen3MoeForCausalLM::from_weights(&config, &source, &ad()).expect("weights"))
}

fn deepseek_v3() -> DeepseekV3ForCausalLM {
    let dir = common::fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&DeepseekV3ForCausalLM::from_weights(&config, &source, &ad()).expect("weights"))
}

#[test]
fn muon_training_under_layouts_matches_one_rank() {
    layouts_match_one_rank(&qwen3_moe());
    layouts_match_one_rank(&deepseek_v3());
}

#[test]
fn muon_learns_and_differs_from_adamw() {
    let start = qwen3_moe();
    let (muon_losses, muon) = train(&start, (1, ""), true, 1);
    let (_, adamw) = train(&start, (1, ""), false, 1);
    let (muon, adamw, start) = (values(&muon[0]), values(&adamw[0]), values(&start));
    // The same batch every step: the loss falls.
    assert!(
        muon_losses[0][STEPS - 1] < muon_losses[0][0],
        "{:?}",
        muon_losses[0]
    );
    // Matrices moved, and not as AdamW moved them; 1-D norms are AdamW's on both.
    let moved = |a: &[Vec<f32>]| a.iter().zip(&start).filter(|(x, s)| x != s).count();
    assert!(moved(&muon) > 0);
    let differ = muon.iter().zip(&adamw).filter(|(m, a)| m != a).count();
    assert!(differ > 0, "Muon and AdamW gave the same parameters");
}
