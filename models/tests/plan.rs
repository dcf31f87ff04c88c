//! The planner's per-rank parameter counts equal what the sharded models really hold on each
//! in-process rank.

use burn::module::Module;
use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{DispatcherKind, ParallelDeepseekV3, ParallelQwen3Moe};
use moe_models::plan::{deepseek_v3_rank_params, qwen3_moe_rank_params};
use moe_models::{DeepseekV3Config, Qwen3MoeConfig};

const LAYOUTS: [(usize, &str); 6] = [
    (1, ""),
    (2, "ep=2"),
    (4, "tp=2,ep=4"),
    (4, "tp=2,ep=2,etp=2"),
    (4, "ep=2,etp=2"),
    (8, "tp=2,ep=4,etp=2"),
];

fn fixture(name: &str) -> String {
    format!(
        "{}/../tests/fixtures/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn qwen3_moe_rank_params_match_the_sharded_model() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let full = config.init(&Device::flex()).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = qwen3_moe_rank_params(&config, &layout, 0).total() as usize;
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard = ParallelQwen3Moe::shard(full_ref, &pg, DispatcherKind::AllToAll)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(shard.model.num_params())
        }) {
            assert_eq!(held.unwrap(), planned, "{spec}");
        }
    }
    let single = ParallelLayout::single();
    assert_eq!(
        qwen3_moe_rank_params(&config, &single, 0).total(),
        config.param_count().total
    );
}

#[test]
fn deepseek_v3_rank_params_match_the_sharded_model() {
    let mut config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    config.num_nextn_predict_layers = 0;
    let full = config.init(&Device::flex()).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = deepseek_v3_rank_params(&config, &layout, 0).total() as usize;
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard = ParallelDeepseekV3::shard(full_ref, &pg, DispatcherKind::AllToAll)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(shard.model.num_params())
        }) {
            assert_eq!(held.unwrap(), planned, "{spec}");
        }
    }
    let single = ParallelLayout::single();
    assert_eq!(
        deepseek_v3_rank_params(&config, &single, 0).total(),
        config.param_count().total
    );
}

/// The planner's optimizer traffic per step equals what the in-process ZeRO-1 step sends.
#[test]
fn zero1_step_traffic_matches_the_planner() {
    use burn::optim::GradientsParams;
    use moe_backend::optim::{DistributedAdamW, DistributedAdamWConfig};
    use moe_backend::parallel::GroupFamily;
    use moe_models::distributed::param_class;
    use moe_models::plan::zero1_step_bytes;

    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let device = Device::flex().autodiff();
    let full = config.init(&device).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = zero1_step_bytes(&qwen3_moe_rank_params(&config, &layout, 0), &layout);
        let (full_ref, layout_ref, dev) = (&full, &layout, &device);
        for (rank, sent) in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let world_comm = ctx.world()?;
            let shard = ParallelQwen3Moe::shard(full_ref, &pg, DispatcherKind::AllToAll)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let mut optim = DistributedAdamW::with_classes(
                &shard.model,
                &pg,
                world_comm.clone(),
                DistributedAdamWConfig::default(),
                &param_class,
            )?;
            let ids: Vec<i64> = (0..32).map(|i| (i * 7 % 256) as i64).collect();
            let out = shard
                .forward_loss(&ids, &ids, 2, dev)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let grads = GradientsParams::from_grads(out.loss.backward(), &shard.model);
            let comms = [
                pg.comm(GroupFamily::DpCp).clone(),
                pg.comm(GroupFamily::ExptDp).clone(),
                pg.comm(GroupFamily::Tp).clone(),
                world_comm,
            ];
            let sent = || comms.iter().map(|c| c.traffic().bytes_sent).sum::<u64>();
            let before = sent();
            optim.step(1e-3, shard.model.clone(), grads)?;
            Ok(sent() - before)
        })
        .into_iter()
        .enumerate()
        {
            assert_eq!(sent.unwrap(), planned, "{spec} rank {rank}");
        }
    }
}
