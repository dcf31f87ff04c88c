//! Training checkpoints across layouts: a real Qwen3-MoE shard and its real ZeRO-1 optimizer
//! on an in-process world are saved under one random layout and restored under another; every
//! parameter, master weight and moment must come back bit-exactly.
//!
//! The optimizer state is cheap to make but travels the real code paths: each rank fills its
//! own [`StatePiece`]s with values that are a function of (state, fqn, global element index),
//! so the restoring rank can check its pieces without a reference run.

use crate::Qwen3MoeConfig;
use crate::Qwen3MoeForCausalLM;
use crate::distributed::{DispatcherKind, Sharded};
use crate::param_plan::Planned;
use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::optim::{DistributedAdamW, DistributedAdamWConfig, MomentDtype, OptimState};
use moe_backend::parallel::{ParallelLayout, replicate};

use super::*;
use crate::checkpoint::placement::PlacedModel;
use crate::hf::ModelConfig;
use moe_backend::testing::SplitMix;
use moe_backend::testing::TempDir;

/// A Qwen3-MoE whose every split dimension divides by 8 (heads, KV heads, vocabulary, FFN
/// widths, experts): layer 0 dense, layer 1 MoE.
fn tiny_config() -> Qwen3MoeConfig {
    let text = r#"{
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 16, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 4,
        "intermediate_size": 16, "moe_intermediate_size": 8, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "mlp_only_layers": [0],
        "decoder_sparse_step": 1, "norm_topk_prob": true, "vocab_size": 64,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": false, "attention_bias": false
    }"#;
    Qwen3MoeConfig::from_json_str(text).expect("tiny config")
}

fn pow2_divisors(n: usize) -> Vec<usize> {
    [1, 2, 4, 8]
        .into_iter()
        .filter(|d| n.is_multiple_of(*d))
        .collect()
}

/// A random layout the parallel model runs (pp = cp = 1) over world 1..=8: tp, ep, etp and the
/// derived dp / edp.
fn random_training_layout(rng: &mut SplitMix) -> ParallelLayout {
    loop {
        let world = 1 + rng.below(8);
        let tp = rng.pick(&pow2_divisors(world));
        let ep = rng.pick(&pow2_divisors(world));
        let etp = rng.pick(&pow2_divisors(world / ep));
        if let Ok(layout) = ParallelLayout::parse(world, &format!("tp={tp},ep={ep},etp={etp}")) {
            return layout;
        }
    }
}

/// The fake value of `state` at global element `index` of `fqn`: small integers times powers
/// of two, exact in bf16 (so bf16 moments round-trip bit-exactly too).
fn fake(state: OptimState, fqn: &str, index: usize) -> f32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ (state as u64 + 1);
    for b in fqn.bytes().chain(index.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let mantissa = (h % 255) as f32 - 127.0;
    mantissa * (2f32).powi(-(((h >> 8) % 12) as i32))
}

/// Global row-major indices of the elements of `piece`'s box, in box order.
fn global_indices(piece: &StatePiece) -> Vec<usize> {
    let n = piece.shape.len();
    let strides = moe_bridge::dist::region::strides(&piece.global_shape);
    let mut out = Vec::with_capacity(piece.numel());
    let mut idx = vec![0usize; n];
    for _ in 0..piece.numel() {
        out.push(
            (0..n)
                .map(|d| (piece.offsets[d] + idx[d]) * strides[d])
                .sum(),
        );
        for d in (0..n).rev() {
            idx[d] += 1;
            if idx[d] < piece.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

fn optimizer_config(moments: MomentDtype) -> DistributedAdamWConfig {
    DistributedAdamWConfig {
        moment_dtype: moments,
        weight_decay: 0.1,
        ..DistributedAdamWConfig::default()
    }
}

fn backend(e: impl std::fmt::Display) -> BackendError {
    BackendError::Config {
        field: "test",
        detail: e.to_string(),
    }
}

/// Every rank of `layout` shards `full`, fills its optimizer pieces with [`fake`] values and
/// saves; returns the checkpoint directory.
fn save_fake_training(
    root: &Path,
    full: &Qwen3MoeForCausalLM,
    layout: &ParallelLayout,
    moments: MomentDtype,
    state: &TrainState,
) -> PathBuf {
    let results = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(full, &groups, DispatcherKind::AllToAll)
            .map_err(backend)?;
        let classes = shard.model.param_classes().map_err(backend)?;
        let mut optim = DistributedAdamW::with_classes(
            &shard.model,
            &groups,
            world.clone(),
            optimizer_config(moments),
            &classes.classifier(),
        )?;
        let plan = ShardingPlan::new(layout, Some(2), shard_rule, stage_place).map_err(backend)?;
        let placed = shard
            .model
            .placements(&plan, ctx.rank(), false)
            .map_err(backend)?;
        let ids = by_id(&placed);
        for piece in optim.state_pieces(&placer(&ids))? {
            for s in OptimState::ALL {
                let values: Vec<f32> = global_indices(&piece)
                    .into_iter()
                    .map(|i| fake(s, &piece.fqn, i))
                    .collect();
                optim.set_piece_values(&piece, s, &values)?;
            }
        }
        optim.set_step_count(state.step)?;
        let meta = SaveMeta::new(state.step, layout);
        save_training_state(&world, root, meta, &shard.model, Some(&optim), state).map_err(backend)
    });
    let dirs: Vec<PathBuf> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("save under {layout}: {e}")))
        .collect();
    dirs[0].clone()
}

/// The bits of every tensor block a rank holds, with its fqn and offsets.
fn canonical(
    model: &Qwen3MoeForCausalLM,
    plan: &ShardingPlan,
    rank: usize,
) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    model
        .placements(plan, rank, true)
        .unwrap()
        .into_iter()
        .map(|p| {
            let bits = p.values.unwrap().iter().map(|v| v.to_bits()).collect();
            (p.placement.fqn, p.placement.offsets, bits)
        })
        .collect()
}

/// Every rank of `layout` restores a differently initialised shard and a fresh optimizer from
/// `ckpt` and checks parameters (against `full`), master, moments, step and train state.
fn check_restore(
    ckpt: &DistCheckpoint,
    full: &Qwen3MoeForCausalLM,
    layout: &ParallelLayout,
    moments: MomentDtype,
    state: &TrainState,
) {
    let device = Device::flex().autodiff();
    let other = replicate(&tiny_config().init(&device).unwrap());
    let results = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let kind = DispatcherKind::AllToAll;
        let want = Sharded::<Qwen3MoeForCausalLM>::shard(full, &groups, kind).map_err(backend)?;
        let mut shard =
            Sharded::<Qwen3MoeForCausalLM>::shard(&other, &groups, kind).map_err(backend)?;
        let plan = ShardingPlan::new(layout, Some(2), shard_rule, stage_place).map_err(backend)?;
        let rank = ctx.rank();
        assert_ne!(
            canonical(&shard.model, &plan, rank),
            canonical(&want.model, &plan, rank)
        );
        shard.model = load_model_state(ckpt, shard.model, &plan, rank).map_err(backend)?;
        assert_eq!(
            canonical(&shard.model, &plan, rank),
            canonical(&want.model, &plan, rank),
            "{layout} rank {rank}: parameters"
        );
        let classes = shard.model.param_classes().map_err(backend)?;
        let mut optim = DistributedAdamW::with_classes(
            &shard.model,
            &groups,
            ctx.world()?,
            optimizer_config(moments),
            &classes.classifier(),
        )?;
        let read =
            load_optimizer_state(ckpt, &mut optim, &shard.model, &plan, rank).map_err(backend)?;
        assert!(read);
        assert_eq!(optim.step_count(), state.step);
        let placed = shard
            .model
            .placements(&plan, rank, false)
            .map_err(backend)?;
        let ids = by_id(&placed);
        let pieces = optim.state_pieces(&placer(&ids))?;
        assert!(!pieces.is_empty() || layout.world > 1);
        for piece in &pieces {
            let indices = global_indices(piece);
            for s in OptimState::ALL {
                let got = optim.piece_values(piece, s)?;
                for (v, &i) in got.iter().zip(&indices) {
                    assert_eq!(
                        v.to_bits(),
                        fake(s, &piece.fqn, i).to_bits(),
                        "{layout} rank {rank}: {} {} element {i}",
                        s.name(),
                        piece.fqn
                    );
                }
            }
        }
        Ok(pieces.iter().map(StatePiece::numel).sum::<usize>())
    });
    for r in results {
        r.unwrap_or_else(|e| panic!("restore under {layout}: {e}"));
    }
    assert_eq!(read_train_state(ckpt).unwrap().as_ref(), Some(state));
}

#[test]
fn training_state_reloads_bit_exactly_across_random_layout_pairs() {
    let device = Device::flex().autodiff();
    let full = replicate(&tiny_config().init(&device).unwrap());
    let mut rng = SplitMix::new(606);
    let dir = TempDir::new("train-state-pairs");
    for pair in 0..100u64 {
        let save = random_training_layout(&mut rng);
        let load = random_training_layout(&mut rng);
        let pick = |rng: &mut SplitMix| rng.pick(&[MomentDtype::F32, MomentDtype::Bf16]);
        let (save_moments, load_moments) = (pick(&mut rng), pick(&mut rng));
        let state = TrainState {
            step: pair + 1,
            data_position: 10 * pair,
            rng_seed: 42,
            extra: BTreeMap::from([("lr".to_owned(), json!(1e-3))]),
        };
        let root = dir.join(&format!("pair{pair}"));
        let saved = save_fake_training(&root, &full, &save, save_moments, &state);
        let ckpt = DistCheckpoint::open::<ModelConfig>(&root).unwrap();
        assert_eq!(ckpt.dir(), saved);
        if pair % 10 == 0 {
            ckpt.validate::<ModelConfig>().unwrap();
            let record = ckpt.index().optimizer.clone().unwrap();
            let moments = if save_moments == MomentDtype::Bf16 {
                "BF16"
            } else {
                "F32"
            };
            assert_eq!(record.state_dtypes["exp_avg"], moments);
            assert_eq!(record.step, state.step);
        }
        check_restore(&ckpt, &full, &load, load_moments, &state);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn model_only_checkpoints_initialise_the_master_from_the_parameters() {
    let device = Device::flex().autodiff();
    let full = replicate(&tiny_config().init(&device).unwrap());
    let dir = TempDir::new("train-state-model-only");
    let save = ParallelLayout::parse(4, "tp=2,ep=4").unwrap();
    let state = TrainState::default();
    World::run(save.world, |ctx| {
        let groups = ctx.process_groups(&save)?;
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(&full, &groups, DispatcherKind::AllToAll)
            .map_err(backend)?;
        let meta = SaveMeta::new(0, &save);
        save_training_state(&ctx.world()?, dir.path(), meta, &shard.model, None, &state)
            .map_err(backend)
    })
    .into_iter()
    .for_each(|r| {
        r.unwrap();
    });
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.path()).unwrap();
    assert!(ckpt.index().optimizer.is_none());
    assert!(
        ckpt.index()
            .tensors
            .keys()
            .all(|k| !k.starts_with("optim."))
    );
    let load = ParallelLayout::parse(4, "ep=2,etp=2").unwrap();
    let other = replicate(&tiny_config().init(&device).unwrap());
    World::run(load.world, |ctx| {
        let groups = ctx.process_groups(&load)?;
        let mut shard =
            Sharded::<Qwen3MoeForCausalLM>::shard(&other, &groups, DispatcherKind::AllToAll)
                .map_err(backend)?;
        let plan = ShardingPlan::new(&load, Some(2), shard_rule, stage_place).map_err(backend)?;
        shard.model = load_model_state(&ckpt, shard.model, &plan, ctx.rank()).map_err(backend)?;
        let classes = shard.model.param_classes().map_err(backend)?;
        let mut optim = DistributedAdamW::with_classes(
            &shard.model,
            &groups,
            ctx.world()?,
            optimizer_config(MomentDtype::F32),
            &classes.classifier(),
        )?;
        let read = load_optimizer_state(&ckpt, &mut optim, &shard.model, &plan, ctx.rank())
            .map_err(backend)?;
        assert!(!read);
        let placed = shard
            .model
            .placements(&plan, ctx.rank(), true)
            .map_err(backend)?;
        let ids = by_id(&placed);
        for piece in optim.state_pieces(&placer(&ids))? {
            let master = optim.piece_values(&piece, OptimState::Master)?;
            let entry = ckpt.entry(&piece.fqn).map_err(backend)?;
            assert_eq!(entry.global_shape, piece.global_shape);
            let stored = ckpt
                .read_box(
                    &piece.fqn,
                    &TensorBox::new(piece.offsets.clone(), piece.shape.clone()),
                )
                .map_err(backend)?
                .to_f32_vec()
                .map_err(backend)?;
            assert_eq!(master, stored, "{}", piece.fqn);
        }
        Ok(())
    })
    .into_iter()
    .for_each(|r| r.unwrap());
}

#[test]
fn a_trainer_checkpoint_names_what_does_not_match() {
    let device = Device::flex().autodiff();
    let full = replicate(&tiny_config().init(&device).unwrap());
    let dir = TempDir::new("train-state-mismatch");
    let layout = ParallelLayout::parse(2, "tp=2").unwrap();
    let state = TrainState::default();
    World::run(2, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(&full, &groups, DispatcherKind::AllToAll)
            .map_err(backend)?;
        let meta = SaveMeta::new(0, &layout);
        save_training_state(&ctx.world()?, dir.path(), meta, &shard.model, None, &state)
            .map_err(backend)
    })
    .into_iter()
    .for_each(|r| {
        r.unwrap();
    });
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.path()).unwrap();
    // A model with another vocabulary: the embedding's global shape differs.
    let mut config = tiny_config();
    config.vocab_size = 32;
    let small = replicate(&config.init(&device).unwrap());
    let plan = ShardingPlan::new(
        &ParallelLayout::parse(1, "").unwrap(),
        Some(2),
        shard_rule,
        stage_place,
    )
    .unwrap();
    let err = load_model_state(&ckpt, small, &plan, 0).unwrap_err();
    assert!(matches!(err, BridgeError::ShapeMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("model.embed_tokens.weight"),
        "{err}"
    );
    // A corrupt train_state object is named.
    let index_path = ckpt.dir().join(moe_bridge::dist::index::INDEX_FILE);
    let mut index = moe_bridge::dist::index::DcpIndex::read(&index_path).unwrap();
    index
        .objects
        .insert(TRAIN_STATE_OBJECT.to_owned(), json!({"step": "three"}));
    std::fs::write(&index_path, index.to_json(&index_path).unwrap()).unwrap();
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.path()).unwrap();
    let err = read_train_state(&ckpt).unwrap_err();
    assert!(err.to_string().contains("objects.train_state"), "{err}");
}

#[test]
fn muon_and_adamw_checkpoints_do_not_restore_into_each_other() {
    let device = Device::flex().autodiff();
    let full = replicate(&tiny_config().init(&device).unwrap());
    let (muon_dir, adamw_dir) = (TempDir::new("ts-muon"), TempDir::new("ts-adamw"));
    let layout = ParallelLayout::parse(1, "").unwrap();
    let errors = World::run(1, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let trainer = |muon: bool| {
            let config = crate::train::TrainerConfig {
                muon: muon.then(moe_backend::optim::MuonConfig::default),
                ..Default::default()
            };
            crate::train::Trainer::new(&full, &groups, ctx.world().unwrap(), config, &device)
                .map_err(backend)
        };
        let (mut muon, mut adamw) = (trainer(true)?, trainer(false)?);
        let state = TrainState::default();
        for (dir, t) in [(&muon_dir, &muon), (&adamw_dir, &adamw)] {
            let meta = SaveMeta::new(0, &layout);
            save_trainer(&ctx.world()?, dir.path(), meta, t, &state).map_err(backend)?;
        }
        let open = |d: &TempDir| DistCheckpoint::open::<ModelConfig>(d.path()).map_err(backend);
        let into_adamw = restore_trainer(&open(&muon_dir)?, &mut adamw).err();
        let into_muon = restore_trainer(&open(&adamw_dir)?, &mut muon).err();
        // Each restores into its own kind.
        restore_trainer(&open(&muon_dir)?, &mut muon).map_err(backend)?;
        restore_trainer(&open(&adamw_dir)?, &mut adamw).map_err(backend)?;
        Ok([into_adamw, into_muon].map(|e| e.map(|e| e.to_string())))
    });
    let [into_adamw, into_muon] = errors.into_iter().next().unwrap().unwrap();
    let into_adamw = into_adamw.expect("refused");
    assert!(into_adamw.contains("muon_adamw") && into_adamw.contains("an AdamW"));
    let into_muon = into_muon.expect("refused");
    assert!(into_muon.contains("\"adamw\"") && into_muon.contains("Muon + AdamW"));
}
