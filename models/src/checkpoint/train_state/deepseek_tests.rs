//! DeepSeek-V3 training checkpoints across layouts: a real `Trainer::<DeepseekV3ForCausalLM>`
//! (MTP loss on, aux-loss-free expert-bias updates on) trains 2 steps under layout A and saves;
//! a trainer built from another random model under layout B (another world size or split)
//! restores it. Checked:
//!
//! - the full model gathered from the restored shards (main layers, MTP module, expert biases;
//!   compared on its exported HF tensors) is bit-identical to the one gathered before the save;
//! - a checkpoint saved by the restored trainer right away holds bit-identical tensors
//!   (parameters, expert-bias buffers, master weights and moments) to the first one;
//! - 2 more steps under B give the model and the global losses of 4 uninterrupted steps under
//!   A, within the tolerance of `tests/resume.rs` and `models/tests/parallel_equivalence.rs`:
//!   `|a − b| ≤ 1e-5·max|b| + 1e-6` (per tensor here, `max|b|` at least 1e-3).
//!
//! Every step trains on the same global batch whatever the layout (replica `r` of `R` takes
//! rows `[r·G/R, (r+1)·G/R)`). The router aux loss is off, as in `tests/resume.rs`: its
//! per-micro-batch statistics depend on how the batch is split over replicas.

use std::ops::Range;

use crate::DeepseekV3ForCausalLM;
use crate::deepseek_v3::DeepseekV3FeedForward;
use crate::distributed::gather_full;
use crate::export::export_hf_tensors;
use crate::train::{TrainBatch, Trainer, TrainerConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};
use moe_backend::comm::World;
use moe_backend::optim::DistributedAdamWConfig;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;

use super::*;
use crate::checkpoint::placement::tests::tiny_deepseek_config;
use crate::hf::ModelConfig;
use moe_backend::testing::TempDir;
use moe_bridge::dist::region::TensorBox;

/// Global batch rows per step and their length.
const G: usize = 4;
const S: usize = 8;

fn trainer_config() -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        optimizer: DistributedAdamWConfig {
            weight_decay: 0.1,
            // As in the resume and parallel-equivalence tests.
            epsilon: 1e-3,
            ..DistributedAdamWConfig::default()
        },
        aux_loss_coeff: 0.0,
        // A visible bias drift within a few steps (Megatron's default is 1e-3).
        expert_bias_update_rate: Some(1e-2),
        ..TrainerConfig::default()
    }
}

/// Replica `replica` of `replicas`'s rows of the global batch of `step`.
fn batch(step: usize, replica: usize, replicas: usize, vocab: usize) -> TrainBatch {
    let ids = XorShift64::new(0x9e37_79b9_u64.wrapping_mul(step as u64 + 11)).ids(G * S, vocab);
    let rows = G / replicas;
    let mine = ids[replica * rows * S..(replica + 1) * rows * S].to_vec();
    TrainBatch::causal(mine, rows).expect("batch")
}

/// `model` with a distinct non-zero expert bias in every router (main layers and MTP blocks),
/// multiples of 1e-3 beside the updates' steps of 1e-2: a restored bias can only come from
/// the checkpoint, whatever the updates do in 2 steps.
fn with_expert_bias(mut model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM {
    let mtp_blocks = model.mtp.iter_mut().map(|m| &mut m.block);
    let layers = model.model.layers.iter_mut().chain(mtp_blocks);
    for (l, layer) in layers.enumerate() {
        if let DeepseekV3FeedForward::Moe(block) = &mut layer.mlp {
            let router = &mut block.moe.router;
            router.expert_bias = router.expert_bias.take().map(|bias| {
                bias.map(|t| {
                    let e = t.dims()[0];
                    let values: Vec<f32> = (0..e)
                        .map(|i| ((i * 5 + l * 3) % 7) as f32 * 1e-3 - 3e-3)
                        .collect();
                    Tensor::from_data(TensorData::new(values, [e]), (&t.device(), DType::F32))
                })
            });
        }
    }
    model
}

/// The HF tensors of a full model: name, shape, f32 values.
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn tensors(model: &DeepseekV3ForCausalLM) -> Tensors {
    export_hf_tensors(model)
        .expect("export")
        .map(|(name, data)| {
            let shape = data.shape().to_vec();
            let values = data
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32 values");
            (name, shape, values)
        })
        .collect()
}

fn bits(t: &Tensors) -> Vec<(&str, &[usize], Vec<u32>)> {
    t.iter()
        .map(|(n, s, v)| {
            (
                n.as_str(),
                s.as_slice(),
                v.iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

fn backend(e: impl std::fmt::Display) -> BackendError {
    BackendError::Config {
        field: "test",
        detail: e.to_string(),
    }
}

/// What a run ends with.
struct RunEnd {
    /// The full model gathered right after the restore (when resuming).
    restored: Option<Tensors>,
    /// The full model gathered after the last step.
    last: Tensors,
    /// Per step: the global mean cross-entropy and MTP loss (mean over the replicas).
    losses: Vec<(f64, f64)>,
}

/// Trains steps `steps` under `layout` from `start`, or from `resume` (then, with `resave`,
/// saves the restored state there before training on), and with `save` saves at the end.
fn run(
    layout: &ParallelLayout,
    start: &DeepseekV3ForCausalLM,
    steps: Range<usize>,
    resume: Option<(&DistCheckpoint, Option<&Path>)>,
    save: Option<&Path>,
) -> RunEnd {
    let device = Device::flex().autodiff();
    let vocab = start.config().vocab_size;
    let results = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let mut trainer = Trainer::<DeepseekV3ForCausalLM>::new(
            start,
            &groups,
            world.clone(),
            trainer_config(),
            &device,
        )
        .map_err(backend)?;
        let gather = |t: &Trainer<DeepseekV3ForCausalLM>| {
            gather_full(t.model(), &groups)
                .map(|full| tensors(&full))
                .map_err(backend)
        };
        let mut restored = None;
        if let Some((ckpt, resave)) = resume {
            let state = restore_trainer(ckpt, &mut trainer).map_err(backend)?;
            assert_eq!(state.step as usize, steps.start);
            assert_eq!(state.data_position as usize, steps.start);
            assert_eq!(trainer.optimizer().step_count() as usize, steps.start);
            restored = Some(gather(&trainer)?);
            if let Some(root) = resave {
                let meta = SaveMeta::new(state.step, layout);
                save_trainer(&world, root, meta, &trainer, &state).map_err(backend)?;
            }
        }
        let (replica, replicas) = (trainer.model().replica, trainer.model().replicas);
        let mut losses = Vec::new();
        for step in steps.clone() {
            let stats = trainer
                .step(&batch(step, replica, replicas, vocab))
                .map_err(backend)?;
            losses.push((
                f64::from(stats.loss),
                f64::from(stats.mtp_loss.expect("mtp")),
            ));
        }
        if let Some(root) = save {
            let mut meta = SaveMeta::new(steps.end as u64, layout);
            meta.model_family = Some("deepseek_v3".into());
            let state = TrainState {
                step: steps.end as u64,
                data_position: steps.end as u64,
                rng_seed: 7,
                ..TrainState::default()
            };
            save_trainer(&world, root, meta, &trainer, &state).map_err(backend)?;
        }
        let last = gather(&trainer)?;
        Ok((restored, last, replica, losses))
    });
    let mut ends = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        ends.push(res.unwrap_or_else(|e| panic!("{layout} rank {r}: {e}")));
    }
    // Every rank gathers the same model.
    for (r, end) in ends.iter().enumerate().skip(1) {
        assert!(
            bits(&end.1) == bits(&ends[0].1),
            "{layout}: rank {r} gathers another model"
        );
    }
    let replicas = layout.dp;
    let mut losses = vec![(0.0, 0.0); steps.len()];
    let mut seen = vec![false; replicas];
    for (_, _, replica, rank_losses) in &ends {
        if !std::mem::replace(&mut seen[*replica], true) {
            for (sum, l) in losses.iter_mut().zip(rank_losses) {
                sum.0 += l.0 / replicas as f64;
                sum.1 += l.1 / replicas as f64;
            }
        }
    }
    let (restored, last, ..) = ends.swap_remove(0);
    RunEnd {
        restored,
        last,
        losses,
    }
}

/// `|a − b| ≤ 1e-5·max|b| + 1e-6` elementwise, per tensor.
fn close(got: &Tensors, want: &Tensors, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for ((name, shape, a), (want_name, want_shape, b)) in got.iter().zip(want) {
        assert_eq!((name, shape), (want_name, want_shape), "{what}");
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * scale + 1e-6,
                "{what}: {name} index {i}: {x} vs {y} (scale {scale})"
            );
        }
    }
}

/// Every tensor of two checkpoints, compared bit by bit (dtype, shape, bytes).
fn same_tensors(a: &DistCheckpoint, b: &DistCheckpoint) {
    let names: Vec<&String> = a.index().tensors.keys().collect();
    let other: Vec<&String> = b.index().tensors.keys().collect();
    assert_eq!(names, other, "tensor names");
    for (fqn, entry) in &a.index().tensors {
        let whole = TensorBox::full(&entry.global_shape);
        let x = a.read_box(fqn, &whole).unwrap();
        let y = b.read_box(fqn, &whole).unwrap();
        assert_eq!(x.dtype, y.dtype, "{fqn}: dtype");
        assert!(x.bytes == y.bytes, "{fqn}: stored values differ");
    }
}

fn resume_across_layouts(q_lora_rank: Option<usize>, a: (usize, &str), b: (usize, &str)) {
    let layout_a = ParallelLayout::parse(a.0, a.1).unwrap();
    let layout_b = ParallelLayout::parse(b.0, b.1).unwrap();
    let device = Device::flex().autodiff();
    let config = tiny_deepseek_config(q_lora_rank);
    let start = with_expert_bias(replicate(&config.init(&device).unwrap()));
    let dir = TempDir::new("train-state-deepseek");
    let (first, second) = (dir.join("a"), dir.join("b"));

    let saved = run(&layout_a, &start, 0..2, None, Some(&first));
    let ckpt = DistCheckpoint::open::<ModelConfig>(&first).unwrap();
    ckpt.validate::<ModelConfig>().unwrap();
    let index = ckpt.index();
    assert_eq!(index.optimizer.as_ref().map(|o| o.step), Some(2));
    // The MTP module (layer 2), its expert bias (a buffer, without optimizer state) and the
    // shared experts are in the checkpoint.
    for fqn in [
        "model.layers.2.eh_proj.weight",
        "optim.exp_avg.model.layers.2.eh_proj.weight",
        "optim.master.model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.shared_head.norm.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    ] {
        assert!(index.tensors.contains_key(fqn), "{fqn}");
    }
    for l in [1, 2] {
        let bias = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
        assert_eq!(index.tensors[&bias].kind, TensorKind::Buffer, "{bias}");
        assert!(!index.tensors.contains_key(&format!("optim.master.{bias}")));
        // Non-zero values the (zero-bias) model restored below does not have.
        let (_, _, values) = saved.last.iter().find(|t| t.0 == bias).unwrap();
        assert!(values.iter().any(|&v| v != 0.0), "{bias}");
    }

    // Restore under B into a trainer built from another random model.
    let other = replicate(&config.init(&device).unwrap());
    let resumed = run(&layout_b, &other, 2..4, Some((&ckpt, Some(&second))), None);
    let restored = resumed.restored.as_ref().unwrap();
    assert!(
        bits(restored) == bits(&saved.last),
        "{layout_a} -> {layout_b}: the restored model differs from the saved one"
    );
    same_tensors(
        &ckpt,
        &DistCheckpoint::open::<ModelConfig>(&second).unwrap(),
    );

    // Resumed under B = uninterrupted under A.
    let straight = run(&layout_a, &start, 0..4, None, None);
    let what = format!("{layout_a} -> {layout_b} (q_lora_rank {q_lora_rank:?})");
    close(
        &resumed.last,
        &straight.last,
        &format!("{what}: model after 4 steps"),
    );
    for (step, (got, want)) in resumed.losses.iter().zip(&straight.losses[2..]).enumerate() {
        for (g, w, name) in [(got.0, want.0, "loss"), (got.1, want.1, "mtp loss")] {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{what}: step {}: {name} {g} vs {w}",
                step + 3
            );
        }
    }
}

#[test]
fn deepseek_v3_low_rank_query_resumes_on_fewer_ranks() {
    resume_across_layouts(Some(8), (4, "tp=2,ep=2"), (2, "ep=2"));
}

#[test]
fn deepseek_v3_plain_query_resumes_under_another_split() {
    resume_across_layouts(None, (4, "ep=4"), (4, "tp=2,ep=2,etp=2"));
}

#[test]
fn deepseek_v3_resumes_from_one_rank_on_four() {
    resume_across_layouts(Some(8), (1, ""), (4, "tp=2,ep=4"));
}
