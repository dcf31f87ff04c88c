//! FP8 primary weights end to end (issue 8): a Qwen3-MoE trained with FP8 expert GEMMs and
//! FP8 primary weights saves its FP8 weights — the bytes and scales the model computes with —
//! in the distributed checkpoint; the HF export is the FP8 release format carrying exactly those
//! bytes and scales; another layout restores the same FP8 weights bit for bit; and a recipe
//! with other blocks re-casts them from the restored master weights.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::Device;
use burn_moe::backend::comm::World;
use burn_moe::backend::fp8::{Fp8Recipe, PackedFp8, dequantize_param};
use burn_moe::backend::parallel::{ParallelLayout, replicate};
use burn_moe::bridge::dist::convert::export_dist_to_hf;
use burn_moe::bridge::dist::fp8::scale_box;
use burn_moe::bridge::dist::{
    DistCheckpoint, SaveMeta, ShardingPlan, TensorBox, TensorKind, TrainState,
};
use burn_moe::bridge::export::ExportOptions;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::Dtype;
use burn_moe::models::checkpoint::{PlacedModel, restore_trainer, save_trainer};
use burn_moe::models::export::ExportHf;
use burn_moe::models::families::shard_rule;
use burn_moe::models::hf::ModelConfig;
use burn_moe::models::param_plan::hf_names::stage_place;
use burn_moe::models::train::{TrainBatch, Trainer, TrainerConfig};
use burn_moe::models::{Qwen3MoeConfig, Qwen3MoeForCausalLM};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");

fn model(device: &Device) -> Qwen3MoeForCausalLM {
    let config = Qwen3MoeConfig::from_file(format!("{FIXTURE}/config.json")).expect("config");
    replicate(&config.init(device).expect("init"))
}

fn config(block: usize) -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        fp8: Some(Fp8Recipe::new().with_block_size(block)),
        fp8_primary_weights: true,
        aux_loss_coeff: 0.0,
        ..TrainerConfig::default()
    }
}

fn batch(step: usize, replica: usize, replicas: usize) -> TrainBatch {
    let ids: Vec<i64> = (0..4 * 8)
        .map(|i| ((i * 31 + step * 17 + 5) % 256) as i64)
        .collect();
    let rows = 4 / replicas;
    TrainBatch::causal(
        ids[replica * rows * 8..(replica + 1) * rows * 8].to_vec(),
        rows,
    )
    .expect("batch")
}

/// `(fqn, box offsets) -> (box shape, canonical FP8 codes, scale_inv)` of every FP8 primary
/// weight of a trainer's shard.
type Fp8Boxes = BTreeMap<(String, Vec<usize>), (Vec<usize>, Vec<u8>, Vec<f32>)>;

fn fp8_boxes(trainer: &Trainer<burn_moe::models::Qwen3MoeForCausalLM>) -> Fp8Boxes {
    let model = &trainer.model().model;
    let groups = trainer.process_groups();
    let plan = ShardingPlan::new(
        &groups.layout,
        Some(model.config().num_hidden_layers),
        shard_rule,
        stage_place,
    )
    .expect("plan");
    let placed = model
        .placements(&plan, groups.rank, false)
        .expect("placements");
    placed
        .iter()
        .filter_map(|p| {
            let w = trainer.optimizer().fp8_weight(p.id)?;
            let key = (p.placement.fqn.clone(), p.placement.offsets.clone());
            let shape = p.placement.shape.clone();
            Some((key, (shape, w.canonical_data(), w.scale_inv.clone())))
        })
        .collect()
}

/// Runs `steps` steps under `layout` with FP8 primary weights in `block`-sized blocks (after
/// restoring `resume`), saves to `save`; checks that the model computes with the decoded FP8
/// weights and returns each rank's FP8 boxes.
fn run(
    layout: &ParallelLayout,
    block: usize,
    steps: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Fp8Boxes> {
    let device = Device::flex().autodiff();
    let start = model(&device);
    let ckpt = resume.map(|p| DistCheckpoint::open::<ModelConfig>(p).expect("open"));
    let config_json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{FIXTURE}/config.json")).expect("config"),
    )
    .expect("json");
    let out = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let mut trainer =
            Trainer::new(&start, &groups, world.clone(), config(block), &device).expect("trainer");
        if let Some(ckpt) = &ckpt {
            restore_trainer(ckpt, &mut trainer).expect("restore");
        }
        let (replica, replicas) = (trainer.model().replica, trainer.model().replicas);
        for step in 0..steps {
            let stats = trainer.step(&batch(step, replica, replicas)).expect("step");
            assert!(stats.loss.is_finite());
        }
        if let Some(root) = save {
            let mut meta = SaveMeta::new(steps as u64, layout);
            meta.model_family = Some("qwen3_moe".into());
            meta.config = Some(config_json.clone());
            let state = TrainState {
                step: steps as u64,
                ..TrainState::default()
            };
            save_trainer(&world, root, meta, &trainer, &state).expect("save");
        }
        // The model computes with the FP8 weights: its parameter holds their codes and scales.
        let model = &trainer.model().model;
        // The live HF export (weight sync, `moe export` of a running model) reads the decoded
        // values of the packed parameters.
        let exported: Vec<(String, Vec<f32>)> = model
            .hf_tensors()
            .expect("export")
            .map(|(name, data)| {
                let v = data.convert::<f32>().try_into_vec::<f32>().expect("f32");
                (name, v)
            })
            .collect();
        for (name, v) in &exported {
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{name} exports non-finite values"
            );
        }
        // Layers by their global index (a pipeline stage holds some).
        let ids = model.model.layers.ids();
        for (&l, layer) in ids.iter().zip(model.model.layers.iter()) {
            if let burn_moe::models::qwen3_moe::Qwen3MoeFeedForward::Sparse(b) = &layer.mlp {
                let fc1 = &b.moe.experts.fc1;
                let w = trainer.optimizer().fp8_weight(fc1.id).expect("fc1 is FP8");
                let held = PackedFp8::from_tensor(&fc1.val()).expect("fc1 holds packed FP8");
                assert_eq!(
                    (held.codes(), held.scale_inv()),
                    (&w.data[..], w.scale_inv.clone())
                );
                let values = dequantize_param(fc1.val())
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>();
                let values = values.expect("fc1");
                assert_eq!(values, w.dequantize());
                // This rank's first expert's `gate_proj` is the first `F` rows of its `fc1`.
                let [_, rows, cols] = fc1.val().dims();
                let prefix = format!("model.layers.{l}.mlp.experts.");
                let (_, gate) = exported
                    .iter()
                    .find(|(n, _)| n.starts_with(&prefix) && n.ends_with(".gate_proj.weight"))
                    .expect("an exported gate_proj");
                assert_eq!(gate[..], values[..rows / 2 * cols]);
            }
        }
        Ok(fp8_boxes(&trainer))
    });
    out.into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{layout} rank {r}: {e}")))
        .collect()
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-moe-fp8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Every box of `boxes` holds the checkpoint's FP8 codes and the scales of its blocks.
fn assert_boxes_are_stored(ckpt: &DistCheckpoint, boxes: &Fp8Boxes, block: [usize; 2], what: &str) {
    for ((fqn, offsets), (shape, codes, scales)) in boxes {
        let b = TensorBox::new(offsets.clone(), shape.clone());
        assert_eq!(
            &ckpt.read_box(fqn, &b).expect("read").bytes,
            codes,
            "{what}: {fqn} codes"
        );
        let sb = scale_box(&b, block).expect("scale box");
        let stored = ckpt
            .read_box(&format!("{fqn}_scale_inv"), &sb)
            .expect("scales")
            .to_f32_vec()
            .expect("f32");
        assert_eq!(&stored, scales, "{what}: {fqn} scales");
    }
}

#[test]
fn fp8_primary_weights_save_export_and_reshard_bit_exactly() {
    let dir = temp("ckpt");
    let a = ParallelLayout::parse_spec("world=4,tp=2,ep=2").expect("layout");
    let saved = run(&a, 8, 2, None, Some(&dir));
    let ckpt = DistCheckpoint::open::<ModelConfig>(&dir).expect("checkpoint");
    ckpt.validate::<ModelConfig>().expect("valid");
    let fqn = "model.layers.1.mlp.experts.gate_up_proj";
    assert_eq!(ckpt.entry(fqn).expect("experts").dtype, Dtype::F8E4M3);
    let scale = ckpt.entry(&format!("{fqn}_scale_inv")).expect("scale");
    assert_eq!(scale.kind, TensorKind::Scale);
    assert_eq!(scale.global_shape, vec![8, 2, 2, 8]); // [E, 2, F/8, H/8]
    assert_eq!(ckpt.fp8_block(), Some([8, 8]));
    // The checkpoint holds every rank's FP8 codes and scales as they were.
    for boxes in &saved {
        assert!(boxes.keys().any(|(f, _)| f == fqn));
        assert_boxes_are_stored(&ckpt, boxes, [8, 8], "saved under A");
    }
    // HF export keeps FP8: per-expert codes and `weight_scale_inv` are the trained ones.
    let hf_dir = temp("hf");
    export_dist_to_hf::<ModelConfig>(&ckpt, &hf_dir, &ExportOptions::default()).expect("export");
    let hf = HfCheckpoint::open(&hf_dir).expect("hf");
    let config = hf.config_json().expect("config");
    assert_eq!(
        config["quantization_config"]["weight_block_size"],
        serde_json::json!([8, 8])
    );
    let (_, codes, scales) = saved
        .iter()
        .find_map(|b| b.get(&(fqn.to_owned(), vec![0, 0, 0, 0])))
        .expect("expert 0 on some rank");
    let gate = hf
        .tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
        .expect("gate");
    assert_eq!(gate.dtype, Dtype::F8E4M3);
    assert_eq!(gate.bytes, &codes[..16 * 64]);
    let gate_scale = hf
        .tensor("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv")
        .expect("gate scale")
        .to_f32_vec()
        .expect("f32");
    assert_eq!(gate_scale, scales[..2 * 8]);
    // Another layout (experts split over ETP as well) adopts the stored FP8 weights: its boxes
    // hold the stored codes and scales, and its model computes with their decoded values.
    let b = ParallelLayout::parse_spec("world=4,ep=2,etp=2").expect("layout");
    let restored = run(&b, 8, 0, Some(&dir), None);
    assert!(
        restored
            .iter()
            .any(|boxes| boxes.keys().any(|(f, o)| f == fqn && o[2] == 8)),
        "some rank holds the second ETP half of the experts"
    );
    for boxes in &restored {
        assert_boxes_are_stored(&ckpt, boxes, [8, 8], "restored under B");
    }
    // Pipeline stages (one layer each, experts over EP2) adopt them too.
    let c = ParallelLayout::parse_spec("world=6,pp=3,ep=2").expect("layout");
    let staged = run(&c, 8, 0, Some(&dir), None);
    assert!(
        staged
            .iter()
            .any(|boxes| boxes.keys().any(|(f, _)| f == fqn)),
        "the stage of layer 1 holds its experts"
    );
    for boxes in &staged {
        assert_boxes_are_stored(&ckpt, boxes, [8, 8], "restored under pp=3,ep=2");
    }
    // A recipe with other blocks cannot adopt 8x8 codes: it re-casts the restored master
    // weights into 16x16 blocks (and then trains on).
    let recast = run(
        &ParallelLayout::parse_spec("world=2,ep=2").expect("layout"),
        16,
        1,
        Some(&dir),
        None,
    );
    assert!(
        recast
            .iter()
            .all(|b| b.values().all(|(_, _, s)| !s.is_empty()))
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&hf_dir);
}
