//! Activation recompute (Burn's gradient checkpointing of memory-bound operations) changes
//! memory, never results: training on a checkpointing device gives bit-identical parameters.

mod common;

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_models::distributed::CausalLmShard;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM};

fn run(device: Device, spec: (usize, &str)) -> Vec<Vec<f32>> {
    let dir = common::fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    let start = replicate(
        &DeepseekV3ForCausalLM::from_weights(&config, &source, &device).expect("weights"),
    );
    let layout = ParallelLayout::parse(spec.0, spec.1).expect("layout");
    let (start, layout, device) = (&start, &layout, &device);
    let out = World::run(spec.0, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer = Trainer::new(start, &pg, ctx.world()?, TrainerConfig::default(), device)
            .map_err(|e| moe_backend::BackendError::Config {
                field: "m",
                detail: e.to_string(),
            })?;
        let r = pg
            .groups
            .get(moe_backend::parallel::GroupFamily::DpCp)
            .index as i64;
        for step in 0..3i64 {
            let ids: Vec<i64> = (0..32).map(|i| (i * 7 + step * 13 + r * 5) % 256).collect();
            trainer
                .step(&TrainBatch::causal(ids, 2).expect("batch"))
                .map_err(|e| moe_backend::BackendError::Config {
                    field: "m",
                    detail: e.to_string(),
                })?;
        }
        trainer
            .optimizer()
            .table()
            .flatten_values(trainer.model().model())
    });
    out.into_iter()
        .map(|r| {
            let (a, b) = r.expect("rank");
            [a, b].concat()
        })
        .collect()
}

#[test]
fn checkpointing_gives_bit_identical_training() {
    for spec in [(1, ""), (4, "tp=2,ep=4")] {
        let plain = run(Device::flex().autodiff(), spec);
        let ckpt = run(Device::flex().autodiff().gradient_checkpointing(), spec);
        assert_eq!(plain, ckpt, "{spec:?}");
    }
}
