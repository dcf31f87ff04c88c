//! Activation recompute changes memory, never results: training on a device with Burn's
//! gradient checkpointing of memory-bound operations, and training with Megatron's
//! module-level selective recompute (`core_attn`, `moe_act`, `shared_experts`, `mlp`), give
//! bit-identical losses and parameters.

mod common;

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_models::distributed::CausalLmShard;
use moe_models::distributed::ParallelCausalLm;
use moe_models::plan::activations::Recompute;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM};

fn deepseek(device: &Device) -> DeepseekV3ForCausalLM {
    let dir = common::fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&DeepseekV3ForCausalLM::from_weights(&config, &source, device).expect("weights"))
}

fn qwen3_moe(device: &Device) -> Qwen3MoeForCausalLM {
    let dir = common::fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    replicate(&Qwen3MoeForCausalLM::from_weights(&config, &source, device).expect("weights"))
}

fn run(device: Device, spec: (usize, &str)) -> Vec<Vec<f32>> {
    let start = deepseek(&device);
    train(&start, device, spec, TrainerConfig::default())
}

/// Parameters after 3 steps (then the losses' bits), per rank.
fn train<M: ParallelCausalLm + Sync>(
    start: &M,
    device: Device,
    spec: (usize, &str),
    config: TrainerConfig,
) -> Vec<Vec<f32>> {
    let layout = ParallelLayout::parse(spec.0, spec.1).expect("layout");
    let (layout, device, config) = (&layout, &device, &config);
    let out =
        World::run(spec.0, |ctx| {
            let pg = ctx.process_groups(layout)?;
            let mut trainer = Trainer::new(start, &pg, ctx.world()?, config.clone(), device)
                .map_err(|e| moe_backend::BackendError::Config {
                    field: "m",
                    detail: e.to_string(),
                })?;
            let mut losses = Vec::new();
            let r = pg
                .groups
                .get(moe_backend::parallel::GroupFamily::DpCp)
                .index as i64;
            for step in 0..3i64 {
                let ids: Vec<i64> = (0..32).map(|i| (i * 7 + step * 13 + r * 5) % 256).collect();
                let stats = trainer
                    .step(&TrainBatch::causal(ids, 2).expect("batch"))
                    .map_err(|e| moe_backend::BackendError::Config {
                        field: "m",
                        detail: e.to_string(),
                    })?;
                losses.extend([stats.loss, stats.aux_loss, stats.grad_norm as f32]);
            }
            let (a, b) = trainer
                .optimizer()
                .table()
                .flatten_values(trainer.model().model())?;
            Ok::<_, moe_backend::BackendError>([a, b, losses].concat())
        });
    out.into_iter().map(|r| r.expect("rank")).collect()
}

#[test]
fn checkpointing_gives_bit_identical_training() {
    for spec in [(1, ""), (4, "tp=2,ep=4")] {
        let plain = run(Device::flex().autodiff(), spec);
        let ckpt = run(Device::flex().autodiff().gradient_checkpointing(), spec);
        assert_eq!(plain, ckpt, "{spec:?}");
    }
}

fn recomputing(modules: &str) -> TrainerConfig {
    TrainerConfig {
        recompute: modules.parse::<Recompute>().expect("modules"),
        ..TrainerConfig::default()
    }
}

/// Every supported module, alone and together, on DeepSeek-V3 (MLA core attention, routed
/// experts with shared experts, a dense first layer) under one rank, `tp=2,ep=4` and `pp=3`.
#[test]
fn selective_recompute_gives_bit_identical_deepseek_training() {
    let device = Device::flex().autodiff();
    let start = deepseek(&device);
    for spec in [(1, ""), (4, "tp=2,ep=4"), (3, "pp=3")] {
        let plain = train(&start, device.clone(), spec, TrainerConfig::default());
        for modules in [
            "core_attn",
            "moe_act",
            "shared_experts",
            "mlp",
            "core_attn,moe_act,shared_experts,mlp",
            "full",
        ] {
            let got = train(&start, device.clone(), spec, recomputing(modules));
            assert!(
                got == plain,
                "{modules} under {spec:?} changed the training"
            );
        }
    }
}

/// GQA core attention and routed experts (Qwen3-MoE), with a packed batch's mask too.
#[test]
fn selective_recompute_gives_bit_identical_qwen3_moe_training() {
    let device = Device::flex().autodiff();
    let start = qwen3_moe(&device);
    for spec in [(1, ""), (2, "ep=2"), (4, "tp=2,ep=2"), (3, "pp=3")] {
        let plain = train(&start, device.clone(), spec, TrainerConfig::default());
        for modules in ["core_attn,moe_act,mlp", "full"] {
            let got = train(&start, device.clone(), spec, recomputing(modules));
            if got != plain {
                for (r, (g, p)) in got.iter().zip(&plain).enumerate() {
                    let n = g.len();
                    let d: Vec<(usize, f32, f32)> = g
                        .iter()
                        .zip(p)
                        .enumerate()
                        .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
                        .map(|(i, (a, b))| (i, *a, *b))
                        .collect();
                    let maxd = d.iter().map(|(_, a, b)| (a - b).abs()).fold(0f32, f32::max);
                    eprintln!(
                        "DIFF {modules} {spec:?} rank {r}: {} of {n} differ, max {maxd:e}, first {:?} last {:?}",
                        d.len(),
                        d.first(),
                        d.last()
                    );
                }
                panic!("differs");
            }
        }
    }
}

/// Full recompute under context parallelism (the recomputed attention gathers the keys
/// again) and with `global_aux_loss` (the second pass reads the counts the first read).
#[test]
fn full_recompute_gives_bit_identical_training_under_cp_and_global_aux() {
    let device = Device::flex().autodiff();
    let start = deepseek(&device);
    for (spec, global) in [((4, "cp=2,ep=2"), false), ((4, "tp=2,ep=4"), true)] {
        let base = TrainerConfig {
            aux_loss_type: if global {
                moe_backend::router::AuxLossType::GlobalAux
            } else {
                TrainerConfig::default().aux_loss_type
            },
            ..TrainerConfig::default()
        };
        let plain = train(&start, device.clone(), spec, base.clone());
        let full = TrainerConfig {
            recompute: Recompute::Full,
            ..base
        };
        let got = train(&start, device.clone(), spec, full);
        assert!(got == plain, "full under {spec:?} (global aux {global})");
    }
}

#[test]
fn recompute_modules_that_would_save_nothing_are_refused() {
    let device = Device::flex().autodiff();
    let start = qwen3_moe(&device);
    for (modules, named) in [
        ("layernorm", "layernorm"),
        ("core_attn,mla_up_proj", "mla_up_proj"),
        ("moe", "moe"),
    ] {
        let layout = ParallelLayout::parse(1, "").expect("layout");
        let (start, layout, device) = (&start, &layout, &device);
        let config = recomputing(modules);
        let out = World::run(1, |ctx| {
            let pg = ctx.process_groups(layout)?;
            Ok::<_, moe_backend::BackendError>(
                Trainer::new(start, &pg, ctx.world()?, config.clone(), device).err(),
            )
        });
        let err = out[0].as_ref().expect("rank").as_ref().expect("refused");
        let msg = err.to_string();
        assert!(
            msg.contains("recompute") && msg.contains(named),
            "{modules}: {msg}"
        );
    }
}

/// Megatron's `moe_shared_expert_overlap` (DeepSeek-V3's shared experts computed while the
/// tokens are dispatched, on its own and with `shared_experts` recompute) trains bit for bit
/// as the sequential layer, under one rank and `tp=2,ep=4`.
#[test]
fn shared_expert_overlap_gives_bit_identical_training() {
    let device = Device::flex().autodiff();
    let start = deepseek(&device);
    for spec in [(1, ""), (4, "tp=2,ep=4"), (3, "pp=3")] {
        let plain = train(&start, device.clone(), spec, TrainerConfig::default());
        for recompute in ["none", "shared_experts"] {
            let config = TrainerConfig {
                moe_shared_expert_overlap: true,
                ..recomputing(recompute)
            };
            let got = train(&start, device.clone(), spec, config);
            assert!(got == plain, "{spec:?} overlap with recompute {recompute}");
        }
    }
}
