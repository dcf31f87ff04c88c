//! Save / load / reshard tests: random layout pairs, SPMD saves on an in-process world, crash
//! safety and corrupt files.

use std::path::Path;

use moe_backend::comm::World;
use moe_backend::error::BackendError;
use moe_backend::parallel::ParallelLayout;

use super::index::{INDEX_FILE, LATEST_FILE};
use super::testing::{
    SplitMix, TINY_LAYERS, TinyModel, random_layout, synthetic_bytes, tiny_moe_tensors,
    tiny_moe_with_optimizer, tiny_rule, tiny_stage,
};
use super::*;
use crate::BridgeError;
use crate::safetensors::{OwnedTensor, TensorView};
use crate::test_util::TempDir;

fn full_tensors(metas: &[TensorMeta]) -> Vec<(TensorMeta, Vec<u8>)> {
    metas
        .iter()
        .map(|m| (m.clone(), synthetic_bytes(m)))
        .collect()
}

/// The box of a whole row-major tensor `bytes` at `b`.
fn slice(meta: &TensorMeta, bytes: &[u8], b: &TensorBox) -> OwnedTensor {
    let elem = meta.dtype.size();
    let mut out = vec![0u8; b.numel() * elem];
    region::copy_box(
        bytes,
        &meta.global_shape,
        &b.offsets,
        &mut out,
        &b.shape,
        &vec![0; b.shape.len()],
        &b.shape,
        elem,
    );
    OwnedTensor::new(meta.fqn.clone(), meta.dtype, b.shape.clone(), out).unwrap()
}

/// Every rank of `layout` loads its box of every tensor and compares with the source.
fn check_reload(ckpt: &DistCheckpoint, layout: &ParallelLayout, tensors: &[(TensorMeta, Vec<u8>)]) {
    let plan = ShardingPlan::new(layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    for (meta, bytes) in tensors {
        for rank in 0..layout.world {
            let Some(shard) = plan
                .rank_shard(&meta.fqn, &meta.global_shape, rank)
                .unwrap()
            else {
                continue;
            };
            let got = ckpt
                .read_box_checked(
                    &meta.fqn,
                    &meta.global_shape,
                    Some(meta.dtype),
                    &shard.tensor_box,
                    false,
                )
                .unwrap();
            let want = slice(meta, bytes, &shard.tensor_box);
            assert_eq!(got.bytes, want.bytes, "{layout}: {} rank {rank}", meta.fqn);
        }
    }
}

#[test]
fn random_layout_pairs_reload_bit_exactly() {
    let tensors = full_tensors(&tiny_moe_with_optimizer());
    let views: Vec<(TensorMeta, &[u8])> = tensors
        .iter()
        .map(|(m, b)| (m.clone(), b.as_slice()))
        .collect();
    let mut rng = SplitMix::new(2024);
    let dir = TempDir::new("dist-pairs");
    for pair in 0..104 {
        let save_layout = random_layout(&mut rng, 8);
        let load_layout = random_layout(&mut rng, 8);
        let plan =
            ShardingPlan::new(&save_layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
        let root = dir.join(&format!("pair{pair}"));
        let meta = SaveMeta::new(pair, &save_layout);
        let saved = save_offline(&root, meta, &plan, &views).unwrap();
        let ckpt = DistCheckpoint::open::<TinyModel>(&root).unwrap();
        assert_eq!(ckpt.dir(), saved);
        if pair % 16 == 0 {
            ckpt.validate::<TinyModel>().unwrap();
        }
        check_reload(&ckpt, &load_layout, &tensors);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn optimizer_flat_ranges_save_as_several_files_and_reshard() {
    // A DistOpt-like save: every rank of a world of 3 writes its flat third of each state as
    // ≤ 2·ndim−1 boxes (j-th box of a key in file j); reload under EP2 × ETP2.
    let metas: Vec<TensorMeta> = tiny_moe_with_optimizer()
        .into_iter()
        .filter(|m| m.kind == TensorKind::Optim)
        .collect();
    let tensors = full_tensors(&metas);
    let mut chunks = Vec::new();
    for (m, _) in &tensors {
        let n: usize = m.global_shape.iter().product();
        for rank in 0..3 {
            let (a, b) = (rank * n / 3, (rank + 1) * n / 3);
            for bx in region::flat_range_boxes(&m.global_shape, a, b) {
                chunks.push((rank, m.clone(), bx));
            }
        }
    }
    let dir = TempDir::new("dist-flat");
    let layout = ParallelLayout::parse(3, "").unwrap();
    let mut writer =
        OfflineWriter::with_chunks(dir.path(), SaveMeta::new(5, &layout), chunks).unwrap();
    for (m, bytes) in &tensors {
        writer
            .write_region(&m.fqn, &TensorBox::full(&m.global_shape), bytes)
            .unwrap();
    }
    let saved = writer.finish().unwrap();
    let names: Vec<String> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("shard-00001-model-00002-of-")),
        "{names:?}"
    );
    let ckpt = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap();
    ckpt.validate::<TinyModel>().unwrap();
    check_reload(
        &ckpt,
        &ParallelLayout::parse(4, "tp=2,ep=2,etp=2").unwrap(),
        &tensors,
    );
}

/// Each rank's main-replica chunks of `tensors` under `layout`.
fn local_chunks(
    plan: &ShardingPlan,
    rank: usize,
    tensors: &[(TensorMeta, Vec<u8>)],
) -> Vec<(TensorMeta, TensorBox, OwnedTensor)> {
    let mut out = Vec::new();
    for (meta, bytes) in tensors {
        if let Some(s) = plan
            .rank_shard(&meta.fqn, &meta.global_shape, rank)
            .unwrap()
            && s.main_replica
        {
            let t = slice(meta, bytes, &s.tensor_box);
            out.push((meta.clone(), s.tensor_box, t));
        }
    }
    out
}

fn spmd_save(
    root: &Path,
    layout: &ParallelLayout,
    step: u64,
    tensors: &[(TensorMeta, Vec<u8>)],
    fail_rank: Option<usize>,
) -> Vec<Result<std::path::PathBuf, BackendError>> {
    let plan = ShardingPlan::new(layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    World::run(layout.world, |ctx| {
        let comm = ctx.world()?;
        let owned = local_chunks(&plan, ctx.rank(), tensors);
        let mut chunks: Vec<LocalChunk<'_>> = owned
            .iter()
            .map(|(m, b, t)| LocalChunk {
                meta: m.clone(),
                offsets: b.offsets.clone(),
                data: t.view(),
            })
            .collect();
        if fail_rank == Some(ctx.rank()) {
            if ctx.rank() % 2 == 0 {
                // Take part in the save up to writing this rank's files, then die before
                // reporting them (like a process killed mid-save).
                let tmp = save::share_from_rank0(&comm, None).unwrap();
                save::write_rank(&root.join(tmp), ctx.rank(), &chunks).unwrap();
                panic!("injected crash of rank {} during the save", ctx.rank());
            }
            // A chunk whose bytes do not match its shape: this rank's write fails while the
            // others write theirs.
            let first = chunks.first_mut().unwrap();
            first.data = TensorView {
                bytes: &first.data.bytes[1..],
                ..first.data
            };
        }
        let mut meta = SaveMeta::new(step, layout);
        meta.objects
            .insert("data_position".into(), serde_json::json!(step * 10));
        save_spmd(&comm, root, &meta, &chunks).map_err(|e| BackendError::Layout {
            field: "save",
            detail: e.to_string(),
        })
    })
}

#[test]
fn spmd_save_on_four_ranks_reloads_under_other_layouts() {
    let tensors = full_tensors(&tiny_moe_with_optimizer());
    let dir = TempDir::new("dist-spmd");
    let layout = ParallelLayout::parse(4, "tp=2,ep=4").unwrap();
    let results = spmd_save(dir.path(), &layout, 3, &tensors, None);
    let dirs: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    assert!(dirs.iter().all(|d| d == &dir.join("iter_0000003")));
    let ckpt = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap();
    ckpt.validate::<TinyModel>().unwrap();
    assert_eq!(ckpt.index().objects["data_position"], 30);
    assert_eq!(ckpt.index().layout.ep, 4);
    // Load on an in-process world of 4 ranks under EP2 × ETP2, each rank its own boxes.
    let load_layout = ParallelLayout::parse(4, "tp=4,ep=2,etp=2").unwrap();
    let plan = ShardingPlan::new(&load_layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    let results = World::run(4, |ctx| {
        for (meta, bytes) in &tensors {
            let shard = plan
                .rank_shard(&meta.fqn, &meta.global_shape, ctx.rank())
                .unwrap()
                .unwrap();
            let got = ckpt.read_box(&meta.fqn, &shard.tensor_box).unwrap();
            assert_eq!(got.bytes, slice(meta, bytes, &shard.tensor_box).bytes);
        }
        Ok(())
    });
    assert!(results.iter().all(Result::is_ok));
    check_reload(
        &ckpt,
        &ParallelLayout::parse(8, "tp=8,ep=1,etp=8").unwrap(),
        &tensors,
    );
}

#[test]
fn aborted_saves_leave_the_previous_checkpoint_loadable() {
    let tensors = full_tensors(&tiny_moe_tensors());
    let dir = TempDir::new("dist-crash");
    let layout = ParallelLayout::parse(4, "tp=2,ep=2").unwrap();
    for r in spmd_save(dir.path(), &layout, 1, &tensors, None) {
        r.unwrap();
    }
    // Rank 3 fails writing after the others wrote; rank 2 panics mid-save.
    for (step, fail) in [(2, 3), (3, 2)] {
        let results = spmd_save(dir.path(), &layout, step, &tensors, Some(fail));
        assert!(
            results.iter().all(Result::is_err),
            "step {step}: {results:?}"
        );
        let ckpt = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap();
        assert_eq!(ckpt.index().step, 1);
        assert!(!dir.join(&format!("iter_{step:07}")).exists());
    }
    let latest = std::fs::read_to_string(dir.join(LATEST_FILE)).unwrap();
    assert_eq!(latest.trim(), "iter_0000001");
    // A save killed before its commit leaves a .tmp-* directory, refused by name.
    let plan = ShardingPlan::new(&layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    let metas: Vec<TensorMeta> = tensors.iter().map(|(m, _)| m.clone()).collect();
    let mut writer =
        OfflineWriter::create(dir.path(), SaveMeta::new(9, &layout), &plan, &metas).unwrap();
    let (m, bytes) = &tensors[0];
    writer
        .write_region(&m.fqn, &TensorBox::full(&m.global_shape), bytes)
        .unwrap();
    let tmp = writer.tmp_dir().to_path_buf();
    std::mem::forget(writer); // like a killed process: no cleanup
    let err = DistCheckpoint::open::<TinyModel>(&tmp).unwrap_err();
    assert!(matches!(err, BridgeError::NotACheckpoint { .. }));
    assert!(err.to_string().contains(".tmp-"), "{err}");
    assert_eq!(
        DistCheckpoint::open::<TinyModel>(dir.path())
            .unwrap()
            .index()
            .step,
        1
    );
    // A directory with files and index but no .complete is refused too.
    let fake = dir.join("iter_0000009");
    std::fs::create_dir(&fake).unwrap();
    std::fs::copy(
        dir.join("iter_0000001").join(INDEX_FILE),
        fake.join(INDEX_FILE),
    )
    .unwrap();
    let err = DistCheckpoint::open::<TinyModel>(&fake).unwrap_err();
    assert!(err.to_string().contains(".complete"), "{err}");
    let err = DistCheckpoint::open::<TinyModel>(dir.join("nothing")).unwrap_err();
    assert!(matches!(err, BridgeError::NotACheckpoint { .. }));
}

#[test]
fn corrupt_or_truncated_chunk_files_are_named() {
    let tensors = full_tensors(&tiny_moe_tensors());
    let views: Vec<(TensorMeta, &[u8])> = tensors
        .iter()
        .map(|(m, b)| (m.clone(), b.as_slice()))
        .collect();
    let dir = TempDir::new("dist-corrupt");
    let layout = ParallelLayout::parse(2, "tp=2").unwrap();
    let plan = ShardingPlan::new(&layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    let saved = save_offline(dir.path(), SaveMeta::new(1, &layout), &plan, &views).unwrap();
    let file = saved.join("shard-00001-model-00001-of-00001.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 10]).unwrap();
    let ckpt = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap();
    let err = ckpt.read_tensor("lm_head.weight").unwrap_err();
    assert!(
        err.to_string().contains("shard-00001-model-00001-of-00001"),
        "{err}"
    );
    let err = ckpt.validate::<TinyModel>().unwrap_err();
    assert!(err.to_string().contains("shard-00001"), "{err}");
    // Header garbage.
    std::fs::write(&file, b"\xff\xff\xff\xff\x00\x00\x00\x00garbage").unwrap();
    let ckpt = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap();
    let err = ckpt.read_tensor("lm_head.weight").unwrap_err();
    assert!(err.to_string().contains("shard-00001-model-00001"), "{err}");
    // Missing keys and mismatched models.
    let err = ckpt
        .read_tensor("model.layers.9.mlp.gate.weight")
        .unwrap_err();
    assert!(matches!(err, BridgeError::TensorNotFound { .. }), "{err}");
    let full = TensorBox::full(&[32, 16]);
    let err = ckpt
        .read_box_checked("model.embed_tokens.weight", &[64, 16], None, &full, false)
        .unwrap_err();
    assert!(matches!(err, BridgeError::ShapeMismatch { .. }), "{err}");
    let err = ckpt
        .read_box_checked(
            "model.embed_tokens.weight",
            &[32, 16],
            Some(crate::safetensors::Dtype::BF16),
            &full,
            false,
        )
        .unwrap_err();
    assert!(matches!(err, BridgeError::DtypeMismatch { .. }), "{err}");
    let cast = ckpt
        .read_box_checked(
            "model.embed_tokens.weight",
            &[32, 16],
            Some(crate::safetensors::Dtype::BF16),
            &TensorBox::new(vec![0, 0], vec![16, 16]),
            true,
        )
        .unwrap();
    // Only rank 0's (intact) file overlaps that box: the corrupt file is never opened.
    assert_eq!(cast.dtype, crate::safetensors::Dtype::BF16);
    // An index whose chunks leave a hole is refused at open.
    let index_path = saved.join(INDEX_FILE);
    let mut index = DcpIndex::read(&index_path).unwrap();
    index
        .tensors
        .get_mut("lm_head.weight")
        .unwrap()
        .chunks
        .pop();
    std::fs::write(&index_path, index.to_json(&index_path).unwrap()).unwrap();
    let err = DistCheckpoint::open::<TinyModel>(dir.path()).unwrap_err();
    assert!(matches!(err, BridgeError::Coverage { .. }), "{err}");
}
