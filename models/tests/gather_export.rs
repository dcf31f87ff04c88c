//! Export during training from any layout: shards gathered back into the full model give the
//! same HF tensors (names, shapes, bits) as the model they were cut from.

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{DispatcherKind, Sharded, gather_full};
use moe_models::export::export_hf_tensors;
use moe_models::{DeepseekV3Config, Qwen3MoeConfig};
use moe_models::{DeepseekV3ForCausalLM, Qwen3MoeForCausalLM};

const LAYOUTS: [(usize, &str); 6] = [
    (2, "ep=2"),
    (4, "tp=2,ep=2"),
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

fn tensors<M: moe_models::export::ExportHf>(m: &M) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    export_hf_tensors(m)
        .expect("export")
        .map(|(name, data)| (name, data.shape().to_vec(), data.as_bytes().to_vec()))
        .collect()
}

#[test]
fn gathered_qwen3_moe_exports_the_original_tensors() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let full = config.init(&Device::flex()).unwrap();
    let expected = tensors(&full);
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let (full_ref, layout_ref) = (&full, &layout);
        for (rank, got) in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard =
                Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let gathered = gather_full(&shard, &pg)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(tensors(&gathered))
        })
        .into_iter()
        .enumerate()
        {
            assert!(
                got.unwrap() == expected,
                "{spec} rank {rank}: exported tensors differ"
            );
        }
    }
}

#[test]
fn gathered_deepseek_v3_exports_the_original_tensors() {
    let mut config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    config.num_nextn_predict_layers = 0;
    let full = config.init(&Device::flex()).unwrap();
    let expected = tensors(&full);
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let (full_ref, layout_ref) = (&full, &layout);
        for (rank, got) in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard =
                Sharded::<DeepseekV3ForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let gathered = gather_full(&shard, &pg)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(tensors(&gathered))
        })
        .into_iter()
        .enumerate()
        {
            assert!(
                got.unwrap() == expected,
                "{spec} rank {rank}: exported tensors differ"
            );
        }
    }
}
