//! A user's own MoE model (the parallel-block model of `examples/custom_moe.rs`, none of the
//! built-in families) trained by the [`Trainer`] under `world = 4`, `tp=2,ep=4` (and
//! `tp=2,ep=2,etp=2`, and `tp=2,cp=2,ep=2` on 8 ranks) equals the `world = 1` run: per-step losses and gradient norms, and
//! every rank's parameters against the same rank's shard of the `world = 1` result, within
//! `1e-5·max|x| + 1e-6` (f32).

#[allow(dead_code)]
#[path = "../examples/custom_moe.rs"]
mod example;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use burn_moe::backend::comm::World;
use burn_moe::backend::optim::DistributedAdamWConfig;
use burn_moe::backend::parallel::{ParallelLayout, replicate};
use burn_moe::models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm, Sharded};
use burn_moe::models::param_plan::Planned;
use burn_moe::models::train::{StepStats, TrainerConfig};
use example::{ParallelBlockMoe, ParallelBlockMoeConfig, be, train};

const STEPS: usize = 4;

/// `(path, values)` of every float tensor.
#[derive(Default)]
struct Values {
    path: Vec<String>,
    found: Vec<(String, Vec<f32>)>,
}

impl ModuleVisitor for Values {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let values = param
            .val()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32");
        self.found.push((self.path.join("."), values));
    }
}

fn values<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    let mut v = Values::default();
    m.visit(&mut v);
    v.found
}

/// How far `a` is from `b`, tensor by tensor against `tol = 1e-5·max|b| + 1e-6` (`max|b|`
/// of each tensor).
struct Diff {
    /// Largest `|a − b| / tol` (≤ 1: every element within the tolerance).
    ratio: f64,
    /// Largest `|a − b|`.
    max_abs: f64,
    /// Elements beyond `tol`, and all elements.
    over: usize,
    total: usize,
    /// `‖a − b‖₂ / ‖b‖₂` over everything.
    rel_l2: f64,
}

fn diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)], what: &str) -> Diff {
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    let mut d = Diff {
        ratio: 0.0,
        max_abs: 0.0,
        over: 0,
        total: 0,
        rel_l2: 0.0,
    };
    let (mut num, mut den) = (0f64, 0f64);
    for ((pa, va), (pb, vb)) in a.iter().zip(b) {
        assert_eq!(pa, pb, "{what}: paths");
        assert_eq!(va.len(), vb.len(), "{what}: {pa} sizes");
        let scale = vb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tol = f64::from(1e-5 * scale + 1e-6);
        for (x, y) in va.iter().zip(vb) {
            let e = f64::from((x - y).abs());
            d.max_abs = d.max_abs.max(e);
            d.ratio = d.ratio.max(e / tol);
            d.over += usize::from(e > tol);
            d.total += 1;
            num += e * e;
            den += f64::from(*y) * f64::from(*y);
        }
    }
    d.rel_l2 = (num / den).sqrt();
    d
}

fn config(eps: f32) -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        optimizer: DistributedAdamWConfig {
            epsilon: eps,
            ..TrainerConfig::default().optimizer
        },
        ..TrainerConfig::default()
    }
}

/// Trains under `spec` and compares with `world = 1`: parameters every element within the
/// tolerance, or with `loose` (the real Adam ε = 1e-8, see
/// models/tests/training_equivalence.rs `REAL_DEFAULTS_LOOSE`: Adam's `m/√v` with a tiny ε
/// passes f32 reduction-order differences of tiny gradients on at the scale of the step) at
/// least 99% of the elements within it and `‖Δ‖₂ ≤ 1e-3·‖x‖₂`.
fn check(start: &ParallelBlockMoe, world: usize, spec: &str, eps: f32, loose: bool) {
    let config = config(eps);
    let reference = train(start, 1, "", STEPS, &config).expect("world 1");
    let (_, want_stats, want_model) = &reference[0];
    let runs = train(start, world, spec, STEPS, &config).expect(spec);
    // The same rank's shard of the world=1 result, as the plan cuts it.
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let want_shards = World::run(world, |rank| {
        let pg = rank.process_groups(&layout)?;
        let shard = want_model
            .shard(&pg, DispatcherKind::AllToAll)
            .map_err(be)?;
        Ok(values(shard.model()))
    });
    for (rank, ((_, _, got), want)) in runs.iter().zip(want_shards).enumerate() {
        let want = want.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
        let d = diff(&values(got), &want, &format!("{spec} rank {rank}"));
        let summary = format!(
            "{spec} eps {eps:e} rank {rank}: parameters after {STEPS} steps: max |Δ| {:e} \
             ({:.3} × tol), {} of {} elements beyond tol, ‖Δ‖/‖x‖ = {:e}",
            d.max_abs, d.ratio, d.over, d.total, d.rel_l2
        );
        println!("{summary}");
        if loose {
            assert!(d.over * 100 <= d.total && d.rel_l2 <= 1e-3, "{summary}");
        } else {
            assert!(d.ratio <= 1.0, "{summary}");
        }
    }
    for step in 0..STEPS {
        let want: StepStats = want_stats[step];
        let (mut sum, mut tokens, mut seen) = (0f64, 0usize, Vec::new());
        for (replica, stats, _) in &runs {
            let s = stats[step];
            let rel = (s.grad_norm - want.grad_norm).abs() / want.grad_norm;
            assert!(
                rel <= 1e-5,
                "{spec} step {step}: grad norm rel diff {rel:e}"
            );
            if !seen.contains(replica) {
                seen.push(*replica);
                sum += f64::from(s.loss) * s.tokens as f64;
                tokens += s.tokens;
            }
        }
        assert_eq!(tokens, want.tokens, "{spec} step {step}: tokens");
        let loss = sum / tokens as f64;
        let d = (loss - f64::from(want.loss)).abs();
        println!(
            "{spec} eps {eps:e} step {step}: loss {loss:.7} vs {:.7} (|Δ| {d:e})",
            want.loss
        );
        assert!(
            d <= 1e-5 * f64::from(want.loss).abs() + 1e-6,
            "{spec} step {step}: loss {loss} vs {}",
            want.loss
        );
    }
}

fn start() -> ParallelBlockMoe {
    let device = Device::flex().autodiff();
    replicate(&ParallelBlockMoeConfig::tiny().init(&device).expect("init"))
}

/// The plan classifies every parameter of the user's model (no fallback).
#[test]
fn the_user_plan_covers_every_parameter() {
    let model = start();
    let plan = ParallelBlockMoe::parallel_plan();
    let walked = plan.walk(&model, model.main_layers()).expect("plan");
    assert_eq!(walked.len(), values(&model).len());
    assert!(
        walked
            .iter()
            .any(|t| t.hf_name == "model.layers.1.mlp.experts.gate_up_proj")
    );
    model.param_classes().expect("classes");
}

/// Adam ε = 1e-3 (as models/tests/parallel_equivalence.rs): TP + EP and TP + EP × ETP.
#[test]
fn custom_moe_under_tp_and_ep_matches_one_rank() {
    let start = start();
    check(&start, 4, "tp=2,ep=4", 1e-3, false);
    check(&start, 4, "tp=2,ep=2,etp=2", 1e-3, false);
    // Context parallelism: the user's attention takes the context's inputs and exchanges
    // keys over `cp` with no change to the model.
    check(&start, 8, "tp=2,cp=2,ep=2", 1e-3, false);
}

/// The real Adam default ε = 1e-8 (losses and gradient norms as tight; parameters with the
/// loose criterion of models/tests/training_equivalence.rs).
#[test]
fn custom_moe_with_real_adam_eps_matches_one_rank() {
    check(&start(), 4, "tp=2,ep=4", 1e-8, true);
}

/// HF export reads the user's plan: HF names and canonical shapes (experts per expert).
#[test]
fn the_user_model_exports_hf_tensors_through_its_plan() {
    let model = start();
    let c = &model.config;
    let tensors = burn_moe::models::export::export_hf_tensors(&model).expect("export");
    let specs = tensors.specs();
    let shape = |name: &str| {
        specs
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.shape.clone())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert_eq!(
        shape("model.layers.1.self_attn.q_proj.weight"),
        vec![c.num_heads * c.head_dim, c.hidden_size]
    );
    assert_eq!(
        shape("model.layers.0.mlp.experts.7.gate_proj.weight"),
        vec![c.moe_ffn, c.hidden_size]
    );
    assert_eq!(shape("lm_head.weight"), vec![c.vocab_size, c.hidden_size]);
}

/// A distributed checkpoint of the user's model: 2 steps under `tp=2,ep=4`, saved (parameters
/// and ZeRO-1 optimizer state, placed by the plan), restored under `tp=2,ep=2,etp=2` and
/// trained 2 more steps, equals 4 uninterrupted `world = 1` steps.
#[test]
fn the_user_model_resumes_under_another_layout() {
    use burn_moe::bridge::dist::{DistCheckpoint, SaveMeta, TrainState};
    use burn_moe::models::checkpoint::{restore_trainer, save_trainer};
    use burn_moe::models::hf::ModelConfig;
    use burn_moe::models::train::Trainer;
    use example::replica_batches;

    let start = start();
    let config = config(1e-3);
    let vocab = start.config.vocab_size;
    let dir = std::env::temp_dir().join(format!("burn-moe-custom-moe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let device = Device::flex().autodiff();
    // steps 0..2 under A, saved; steps 2..4 under B, restored.
    let run = |spec: &str, steps: std::ops::Range<usize>, resume: bool| {
        let layout = ParallelLayout::parse(4, spec).expect("layout");
        let replicas = layout.dp * layout.cp;
        let ckpt = resume.then(|| DistCheckpoint::open::<ModelConfig>(&dir).expect("open"));
        World::run(4, |rank| {
            let pg = rank.process_groups(&layout)?;
            let world = rank.world()?;
            let mut trainer =
                Trainer::new(&start, &pg, world.clone(), config.clone(), &device).map_err(be)?;
            if let Some(ckpt) = &ckpt {
                let state = restore_trainer(ckpt, &mut trainer).expect("restore");
                assert_eq!(state.step as usize, steps.start);
            }
            let replica = pg
                .groups
                .get(burn_moe::backend::parallel::GroupFamily::DpCp)
                .index;
            for step in steps.clone() {
                let micro = replica_batches(step, replica, replicas, vocab).map_err(be)?;
                trainer.step_micro_batches(&micro).map_err(be)?;
            }
            if !resume {
                let meta = SaveMeta::new(steps.end as u64, &layout);
                let state = TrainState {
                    step: steps.end as u64,
                    ..TrainState::default()
                };
                save_trainer(&world, &dir, meta, &trainer, &state).expect("save");
            }
            Ok(values(trainer.model().model()))
        })
    };
    run("tp=2,ep=4", 0..2, false)
        .into_iter()
        .for_each(|r| drop(r.expect("first half")));
    let resumed = run("tp=2,ep=2,etp=2", 2..4, true);
    let reference = train(&start, 1, "", 4, &config).expect("world 1");
    let want_model = &reference[0].2;
    let layout = ParallelLayout::parse(4, "tp=2,ep=2,etp=2").expect("layout");
    let want = World::run(4, |rank| {
        let pg = rank.process_groups(&layout)?;
        let shard = want_model
            .shard(&pg, DispatcherKind::AllToAll)
            .map_err(be)?;
        Ok(values(shard.model()))
    });
    for (rank, (got, want)) in resumed.into_iter().zip(want).enumerate() {
        let (got, want) = (got.expect("resumed"), want.expect("reference"));
        let d = diff(&got, &want, &format!("rank {rank}"));
        println!(
            "resumed rank {rank}: max |Δ| {:e} ({:.3} × tol) vs world=1",
            d.max_abs, d.ratio
        );
        assert!(d.ratio <= 1.0, "resumed rank {rank}: {:e}", d.max_abs);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sharded loading of the user's model: each rank reads its boxes from a weight source (here
/// the HF tensors of a live model) by the plan and gets exactly the shard the plan cuts out of
/// the full model.
#[test]
fn the_user_model_loads_its_shard_from_a_weight_source() {
    use burn_moe::models::distributed::LoadShard;
    use burn_moe::models::weights::ModuleWeights;

    let start = start();
    let device = Device::flex().autodiff();
    for (world, spec) in [(4, "tp=2,ep=4"), (4, "tp=2,ep=2,etp=2")] {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let results = World::run(world, |rank| {
            let pg = rank.process_groups(&layout)?;
            let kind = DispatcherKind::AllToAll;
            let source = ModuleWeights::new(&start).map_err(be)?;
            let loaded = ParallelBlockMoe::load_shard(&start.config, &source, &pg, kind, &device)
                .map_err(be)?;
            let cut = start.shard(&pg, kind).map_err(be)?;
            let heads = |s: &Sharded<ParallelBlockMoe>| -> Vec<(usize, usize)> {
                s.model
                    .layers
                    .iter()
                    .map(|b| (b.self_attn.num_heads, b.self_attn.num_kv_heads))
                    .collect()
            };
            assert_eq!(heads(&loaded), heads(&cut));
            Ok((values(loaded.model()), values(cut.model())))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (got, want) = r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            assert!(got == want, "{spec} rank {rank}: loaded shard differs");
        }
    }
}

/// The user's shards gather back to the full model by the plan (every tensor bit for bit),
/// under TP, EP and ETP.
#[test]
fn the_user_model_gathers_back_by_its_plan() {
    use burn_moe::models::distributed::gather_planned;

    let start = start();
    let want = values(&start);
    for (world, spec) in [(4, "tp=2,ep=4"), (4, "tp=2,ep=2,etp=2")] {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let results = World::run(world, |rank| {
            let pg = rank.process_groups(&layout)?;
            let shard = start.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
            let full = gather_planned(shard.model(), &pg).map_err(be)?;
            Ok(values(&full))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            assert!(got == want, "{spec} rank {rank}: gathered model differs");
        }
    }
}
