//! Routing replay inside the trainer's micro-batch step (issue 36, item 2): a routing recorded
//! under one layout (`world = 1`) and replayed under pipeline (`pp=2`, `pp=2,vpp=2`), context
//! (`cp=2`), tensor / sequence parallel layouts, on packed batches and with activation
//! recompute gives the same losses and gradient norms as the replayed step at `world = 1`
//! (≤ 1e-5 relative); a natural routing recorded and replayed reproduces the natural step; a
//! forced routing moves the loss, so a layout that dropped or misplaced it would fail.
//! DeepSeek-V3's MTP routers are recorded and replayed after the main MoE layers.

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::experts::GroupedExperts;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_models::deepseek_v3::DeepseekV3FeedForward;
use moe_models::distributed::replay::RoutedExperts;
use moe_models::distributed::{DispatcherKind, ParallelCausalLm, Sharded};
use moe_models::plan::activations::Recompute;
use moe_models::qwen3_moe::Qwen3MoeFeedForward;
use moe_models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3MoeConfig, Qwen3MoeForCausalLM,
};

/// Relative tolerance of the layout equivalence.
const RTOL: f64 = 1e-5;
const B: usize = 2;
const S: usize = 8;
const E: usize = 8;

fn ad() -> Device {
    Device::flex().autodiff()
}

fn to_backend(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../tests/fixtures/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A random model's routed experts (initialised with std 0.02) barely touch the residual
/// stream and its near-uniform logits hide them: the experts are scaled by 25 and the output
/// layer by 5, so the loss and its gradient depend visibly on the routing and a routing change
/// moves them well beyond the tolerance.
fn sharpen(head: &mut Option<burn::nn::Linear>, experts: Vec<&mut GroupedExperts>) {
    let head = head.as_mut().expect("an untied output layer");
    head.weight = head.weight.clone().map(|w| w.mul_scalar(5.0));
    for e in experts {
        e.fc1 = e.fc1.clone().map(|w| w.mul_scalar(25.0));
        e.fc2 = e.fc2.clone().map(|w| w.mul_scalar(25.0));
    }
}

/// Random initialisation seeded and serialised over this binary's tests (they run in parallel
/// and share the device's generator): the same weights on every run, so the margins the tests
/// assert (a routing change must move the losses) hold run after run.
fn seeded<T>(seed: u64, init: impl FnOnce() -> T) -> T {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    ad().seed(seed);
    init()
}

/// The qwen3_moe fixture config with 4 decoder layers (layer 0 dense, 1–3 MoE: 3 routers, so
/// the pipeline stages own different ones), random weights, sharpened.
fn qwen3_moe() -> Qwen3MoeForCausalLM {
    let mut config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).expect("config");
    config.num_hidden_layers = 4;
    // Parameters initialise lazily: built, sharpened and materialised under the lock.
    seeded(0x5eed_0001, || {
        let mut model = config.init(&ad()).expect("init");
        let experts = (model.model.layers.iter_mut())
            .filter_map(|l| match &mut l.mlp {
                Qwen3MoeFeedForward::Sparse(block) => Some(&mut block.moe.experts),
                Qwen3MoeFeedForward::Dense(_) => None,
            })
            .collect();
        sharpen(&mut model.lm_head, experts);
        replicate(&model)
    })
}

/// The deepseek_v3 fixture config (layer 0 dense, 1–2 MoE, one MTP module), random weights,
/// sharpened.
fn deepseek() -> DeepseekV3ForCausalLM {
    let config = DeepseekV3Config::from_file(fixture("deepseek_v3")).expect("config");
    // Parameters initialise lazily: built, sharpened and materialised under the lock.
    seeded(0x5eed_0002, || {
        let mut model = config.init(&ad()).expect("init");
        let main = model.model.layers.iter_mut();
        let experts = (main.chain(model.mtp.iter_mut().map(|m| &mut m.block)))
            .filter_map(|l| match &mut l.mlp {
                DeepseekV3FeedForward::Moe(block) => Some(&mut block.moe.experts),
                DeepseekV3FeedForward::Dense(_) => None,
            })
            .collect();
        sharpen(&mut model.lm_head, experts);
        replicate(&model)
    })
}

/// Two micro-batches of `[B, S]` ids.
fn micro_batches() -> Vec<TrainBatch> {
    (0..2)
        .map(|m| {
            let ids = (0..B * S).map(|t| ((t * 37 + m * 101 + 11) % 256) as i64);
            TrainBatch::causal(ids.collect(), B).expect("batch")
        })
        .collect()
}

/// Two packed micro-batches: documents of 5, 3, 6 and 2 tokens in 2 rows of 8 (one document
/// split over the rows, the tail padded).
fn packed_batches() -> Vec<TrainBatch> {
    (0..2)
        .map(|m| {
            let docs: Vec<Vec<i64>> = [5usize, 3, 6, 2]
                .iter()
                .enumerate()
                .map(|(d, &n)| {
                    (0..n)
                        .map(|i| ((i * 29 + d * 53 + m * 7 + 3) % 255) as i64 + 1)
                        .collect()
                })
                .collect();
            let batch = TrainBatch::packed(&docs, B, S, 0).expect("packed");
            assert!(batch.layout().is_some());
            batch
        })
        .collect()
}

/// Every token of every layer to `[a, a + 1 + layer]` (mod E) with `a` varying by token,
/// micro-batch and layer: distinct per token, far from the natural routing.
fn forced(layers: usize, micro: usize) -> RoutedExperts {
    let mut indices = Vec::new();
    for t in 0..B * S {
        for l in 0..layers {
            let a = (t * 3 + l * 5 + micro * 7) % E;
            indices.extend([a as i64, ((a + 1 + l % (E - 1)) % E) as i64]);
        }
    }
    RoutedExperts::new(B, S, layers, 2, indices).expect("routing")
}

fn with_routing(micro: &[TrainBatch], routings: &[RoutedExperts]) -> Vec<TrainBatch> {
    micro
        .iter()
        .zip(routings)
        .map(|(b, r)| b.clone().with_routed_experts(r.clone()).expect("routed"))
        .collect()
}

/// Rank 0's stats of two training steps on `micro` under `spec` (every layout here has one
/// data-parallel replica, so every rank trains the same micro-batches).
fn train<M: ParallelCausalLm + Sync>(
    start: &M,
    world: usize,
    spec: &str,
    config: &TrainerConfig,
    micro: &[TrainBatch],
) -> Vec<StepStats> {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    assert_eq!(layout.dp, 1, "{spec}: one replica");
    let device = ad();
    let out = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, config.clone(), &device).map_err(to_backend)?;
        (0..2)
            .map(|_| trainer.step_micro_batches(micro).map_err(to_backend))
            .collect::<Result<Vec<_>, _>>()
    });
    out.into_iter()
        .next()
        .expect("rank 0")
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// Losses (and MTP losses) and gradient norms of every step equal `want`'s.
fn assert_same(got: &[StepStats], want: &[StepStats], what: &str) {
    let mut worst = 0f64;
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let pairs = [
            ("loss", f64::from(g.loss), f64::from(w.loss)),
            ("grad norm", g.grad_norm, w.grad_norm),
            (
                "mtp loss",
                f64::from(g.mtp_loss.unwrap_or(0.0)),
                f64::from(w.mtp_loss.unwrap_or(0.0)),
            ),
        ];
        for (name, a, b) in pairs {
            worst = worst.max(rel(a, b));
            assert!(
                rel(a, b) <= RTOL,
                "{what}: step {step} {name} {a} vs {b} (rel {:.2e})",
                rel(a, b)
            );
        }
    }
    eprintln!("{what}: max relative difference {worst:.2e}");
}

/// The first step's loss and gradient norm moved well beyond the tolerance.
fn assert_moved(got: &[StepStats], from: &[StepStats], what: &str) {
    let (a, b) = (f64::from(got[0].loss), f64::from(from[0].loss));
    let (ga, gb) = (got[0].grad_norm, from[0].grad_norm);
    eprintln!(
        "{what}: loss {a} vs {b} (rel {:.2e}), grad norm {ga} vs {gb} (rel {:.2e})",
        rel(a, b),
        rel(ga, gb)
    );
    assert!(
        rel(a, b) > 1e3 * RTOL,
        "{what}: loss {a} vs {b} did not move"
    );
}

/// Rank 0's recording of `micro`'s natural routing by the Qwen3-MoE training forward under
/// `spec` (one replica).
fn record_qwen(
    full: &Qwen3MoeForCausalLM,
    world: usize,
    spec: &str,
    micro: &[TrainBatch],
) -> Vec<RoutedExperts> {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let out = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<Qwen3MoeForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        micro
            .iter()
            .map(|b| {
                let (_, routed) = par
                    .forward_train_recorded(b, &ad(), 1.0, false)
                    .map_err(to_backend)?;
                Ok(routed)
            })
            .collect::<Result<Vec<_>, moe_backend::BackendError>>()
    });
    let mut ranks = out.into_iter().map(|r| r.expect("record"));
    let first = ranks.next().expect("rank 0");
    for other in ranks {
        assert_eq!(
            other, first,
            "{spec}: every rank returns the replica's routing"
        );
    }
    first
}

/// The same for DeepSeek-V3 with its MTP module.
fn record_deepseek(
    full: &DeepseekV3ForCausalLM,
    world: usize,
    spec: &str,
    micro: &[TrainBatch],
) -> Vec<RoutedExperts> {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let out = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<DeepseekV3ForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        micro
            .iter()
            .map(|b| {
                let (_, routed) = par
                    .forward_train_recorded(b, &ad(), 1.0, true)
                    .map_err(to_backend)?;
                Ok(routed)
            })
            .collect::<Result<Vec<_>, moe_backend::BackendError>>()
    });
    let mut ranks = out.into_iter().map(|r| r.expect("record"));
    let first = ranks.next().expect("rank 0");
    for other in ranks {
        assert_eq!(
            other, first,
            "{spec}: every rank returns the replica's routing"
        );
    }
    first
}

fn full_recompute() -> TrainerConfig {
    TrainerConfig {
        recompute: Recompute::Full,
        ..TrainerConfig::default()
    }
}

#[test]
fn qwen3_moe_replayed_steps_match_world_1_under_pp_cp_tp_and_recompute() {
    let full = qwen3_moe();
    let micro = micro_batches();
    let plain = TrainerConfig::default();
    let natural = train(&full, 1, "", &plain, &micro);
    let recorded = record_qwen(&full, 1, "", &micro);
    assert_eq!(recorded[0].layers, 3);
    // Recorded under other layouts: the same routing (gathered over TP and CP).
    for (world, spec) in [(2, "cp=2"), (2, "tp=2")] {
        assert_eq!(
            record_qwen(&full, world, spec, &micro),
            recorded,
            "record {spec}"
        );
    }
    let forced: Vec<RoutedExperts> = (0..2).map(|m| forced(3, m)).collect();
    let replay_natural = with_routing(&micro, &recorded);
    let replay_forced = with_routing(&micro, &forced);
    // The routing used is the one replayed, recorded under any layout.
    for (world, spec) in [(1, ""), (2, "cp=2"), (2, "tp=2")] {
        assert_eq!(
            record_qwen(&full, world, spec, &replay_forced),
            forced,
            "forced routing used under {spec}"
        );
    }
    let reference = train(&full, 1, "", &plain, &replay_forced);
    assert_same(
        &train(&full, 1, "", &plain, &replay_natural)[..1],
        &natural[..1],
        "world=1 natural replay",
    );
    assert_moved(&reference, &natural, "forced routing");
    for (world, spec, config) in [
        (2, "pp=2", &plain),
        (2, "pp=2,vpp=2", &plain),
        (2, "cp=2", &plain),
        (2, "tp=2", &plain),
        (1, "", &full_recompute()),
        (2, "pp=2", &full_recompute()),
        (4, "cp=2,pp=2", &plain),
    ] {
        let what = format!("{spec} recompute {:?}", config.recompute);
        let got = train(&full, world, spec, config, &replay_forced);
        assert_same(&got, &reference, &format!("forced replay {what}"));
        // The recorded routing is the first step's natural one (the weights move after it).
        let got = train(&full, world, spec, config, &replay_natural);
        assert_same(&got[..1], &natural[..1], &format!("natural replay {what}"));
    }
    // Natural routing under recompute (no replay): the rerun routes as the first pass did.
    let got = train(&full, 2, "pp=2,vpp=2", &full_recompute(), &micro);
    assert_same(&got, &natural, "natural pp=2,vpp=2 with recompute");
}

#[test]
fn packed_batches_replay_their_flattened_tokens_under_every_layout() {
    let full = qwen3_moe();
    let micro = packed_batches();
    let plain = TrainerConfig::default();
    let natural = train(&full, 1, "", &plain, &micro);
    let recorded = record_qwen(&full, 1, "", &micro);
    assert_eq!(
        record_qwen(&full, 2, "cp=2", &micro),
        recorded,
        "packed record cp=2"
    );
    let forced: Vec<RoutedExperts> = (0..2).map(|m| forced(3, m)).collect();
    let replay_natural = with_routing(&micro, &recorded);
    let replay_forced = with_routing(&micro, &forced);
    let reference = train(&full, 1, "", &plain, &replay_forced);
    assert_moved(&reference, &natural, "forced packed routing");
    assert_same(
        &train(&full, 1, "", &plain, &replay_natural)[..1],
        &natural[..1],
        "packed natural replay",
    );
    for (world, spec, config) in [
        (2, "pp=2", &plain),
        (2, "cp=2", &plain),
        (2, "tp=2", &full_recompute()),
    ] {
        let what = format!("packed {spec} recompute {:?}", config.recompute);
        let got = train(&full, world, spec, config, &replay_forced);
        assert_same(&got, &reference, &format!("forced replay {what}"));
        // The recorded routing is the first step's natural one (the weights move after it).
        let got = train(&full, world, spec, config, &replay_natural);
        assert_same(&got[..1], &natural[..1], &format!("natural replay {what}"));
    }
}

#[test]
fn deepseek_mtp_routers_are_recorded_and_replayed_after_the_main_layers() {
    let full = deepseek();
    let micro = micro_batches();
    let plain = TrainerConfig::default();
    assert!(plain.mtp_loss_scaling_factor > 0.0, "the MTP modules train");
    let natural = train(&full, 1, "", &plain, &micro);
    let recorded = record_deepseek(&full, 1, "", &micro);
    // 2 main MoE layers, then the MTP module's.
    assert_eq!(recorded[0].layers, 3);
    assert_eq!(
        record_deepseek(&full, 2, "cp=2", &micro),
        recorded,
        "record cp=2"
    );
    let forced_all: Vec<RoutedExperts> = (0..2).map(|m| forced(3, m)).collect();
    // The main layers' forced routing only: the MTP router routes naturally.
    let forced_main: Vec<RoutedExperts> = (0..2).map(|m| forced(2, m)).collect();
    let replay_natural = with_routing(&micro, &recorded);
    let replay_all = with_routing(&micro, &forced_all);
    let replay_main = with_routing(&micro, &forced_main);
    assert_same(
        &train(&full, 1, "", &plain, &replay_natural)[..1],
        &natural[..1],
        "natural replay with MTP",
    );
    let reference = train(&full, 1, "", &plain, &replay_all);
    let main_only = train(&full, 1, "", &plain, &replay_main);
    assert_moved(&reference, &natural, "forced routing");
    // The main losses agree (same main routing); the MTP loss moves with the MTP routing.
    assert!(rel(f64::from(main_only[0].loss), f64::from(reference[0].loss)) <= RTOL);
    let (a, b) = (main_only[0].mtp_loss, reference[0].mtp_loss);
    let (a, b) = (f64::from(a.expect("mtp")), f64::from(b.expect("mtp")));
    println!(
        "MTP loss, natural vs replayed MTP routing: {a} vs {b} (rel {:.2e})",
        rel(a, b)
    );
    assert!(rel(a, b) > 1e3 * RTOL, "MTP routing replayed: {a} vs {b}");
    let pp = "pp=2,pp_layout=Ett|tmL";
    for (world, spec, config) in [
        (2, pp, &plain),
        (2, "cp=2", &plain),
        (2, "tp=2", &plain),
        (2, pp, &full_recompute()),
    ] {
        let what = format!("{spec} recompute {:?}", config.recompute);
        let got = train(&full, world, spec, config, &replay_all);
        assert_same(&got, &reference, &format!("forced replay {what}"));
        let got = train(&full, world, spec, config, &replay_main);
        assert_same(&got, &main_only, &format!("forced main-only replay {what}"));
        // The recorded routing is the first step's natural one (the weights move after it).
        let got = train(&full, world, spec, config, &replay_natural);
        assert_same(&got[..1], &natural[..1], &format!("natural replay {what}"));
    }
}

#[test]
fn bad_routings_are_refused_before_any_forward() {
    let full = qwen3_moe();
    let micro = micro_batches();
    // The batch's shape is checked when the routing is attached.
    let wrong_shape = RoutedExperts::new(B, S / 2, 3, 2, vec![0; B * S / 2 * 3 * 2]).unwrap();
    let e = micro[0]
        .clone()
        .with_routed_experts(wrong_shape)
        .unwrap_err();
    assert!(e.to_string().contains("routed_experts"), "{e}");
    // The layers, k and ids against the model, on every rank of a pipeline before it runs.
    let mut bad_id = forced(3, 0);
    bad_id.indices[7] = E as i64;
    let cases = [
        (forced(2, 0), "routed_experts.layers"),
        (bad_id, "routed_experts.indices"),
    ];
    for (routing, field) in cases {
        let batch = micro[0].clone().with_routed_experts(routing).unwrap();
        let layout = ParallelLayout::parse(2, "pp=2").expect("layout");
        let device = ad();
        let out = World::run(2, |ctx| {
            let pg = ctx.process_groups(&layout)?;
            let mut trainer =
                Trainer::new(&full, &pg, ctx.world()?, TrainerConfig::default(), &device)
                    .map_err(to_backend)?;
            let e = trainer
                .step_micro_batches(std::slice::from_ref(&batch))
                .expect_err(field);
            Ok(matches!(e, ModelError::InvalidInput { what, .. } if what == field))
        });
        for r in out {
            assert!(r.expect("rank"), "{field}");
        }
    }
}
