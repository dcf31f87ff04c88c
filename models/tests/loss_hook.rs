//! The trainer's loss hook: a step with the cross-entropy supplied through
//! `Trainer::step_with` is the built-in SFT step, bit for bit.

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::Qwen3MoeConfig;
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

fn fixture() -> Qwen3MoeConfig {
    Qwen3MoeConfig::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/qwen3_moe/config.json"
    ))
    .expect("config")
}

fn backend(e: moe_models::ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

#[test]
fn cross_entropy_through_the_hook_equals_the_sft_step() {
    let device = Device::flex().autodiff();
    let full = fixture().init(&device).expect("init");
    let layout = ParallelLayout::parse(2, "ep=2").expect("layout");
    let config = TrainerConfig {
        aux_loss_coeff: 0.0,
        ..TrainerConfig::default()
    };
    let (full, layout, config, dev) = (&full, &layout, &config, &device);
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut sft =
            Trainer::new(full, &pg, ctx.world()?, config.clone(), dev).map_err(backend)?;
        let mut hook =
            Trainer::new(full, &pg, ctx.world()?, config.clone(), dev).map_err(backend)?;
        for step in 0..3 {
            let ids: Vec<i64> = (0..16)
                .map(|i| ((i * 7 + step * 13 + ctx.rank() * 29) % 250) as i64)
                .collect();
            let batch = TrainBatch::causal(ids, 2).map_err(backend)?;
            let a = sft.step(&batch).map_err(backend)?;
            let b = hook
                .step_with(
                    std::slice::from_ref(&batch),
                    |shard, b: &TrainBatch, scale| {
                        let out = shard.forward_loss_scaled(
                            &b.input_ids,
                            &b.labels,
                            b.batch,
                            dev,
                            scale,
                        )?;
                        Ok((out.loss, b.target_tokens()))
                    },
                )
                .map_err(backend)?;
            assert_eq!(a.loss, b.loss, "step {step} loss");
            assert_eq!(a.grad_norm, b.grad_norm, "step {step} grad norm");
        }
        let flat = |t: &Trainer<moe_models::Qwen3MoeForCausalLM>| {
            t.optimizer()
                .table()
                .flatten_values(&t.model().model)
                .expect("flatten")
        };
        Ok((flat(&sft), flat(&hook)))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (a, b) = r.expect("rank");
        assert_eq!(a, b, "rank {rank}: parameters after 3 steps");
    }
}

/// Under pipeline parallelism the hook (a whole-model forward) is refused naming `pp`, and
/// the whole-model forward itself refuses too; the SFT step runs the pipeline.
#[test]
fn the_hook_is_refused_under_pipeline_stages() {
    let device = Device::flex().autodiff();
    let full = fixture().init(&device).expect("init");
    let layout = ParallelLayout::parse(3, "pp=3").expect("layout");
    let (full, layout, dev) = (&full, &layout, &device);
    let results = World::run(3, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let config = TrainerConfig::default();
        let mut trainer = Trainer::new(full, &pg, ctx.world()?, config, dev).map_err(backend)?;
        let batch =
            TrainBatch::causal((0..16).map(|i| i as i64 * 3).collect(), 2).map_err(backend)?;
        let forward = trainer
            .model()
            .forward_loss(&batch.input_ids, &batch.labels, 2, dev)
            .err()
            .map(|e| e.to_string());
        let hook = trainer
            .step_with(
                std::slice::from_ref(&batch),
                |shard, b: &TrainBatch, scale| {
                    let out =
                        shard.forward_loss_scaled(&b.input_ids, &b.labels, b.batch, dev, scale)?;
                    Ok((out.loss, b.target_tokens()))
                },
            )
            .err()
            .map(|e| e.to_string());
        let sft = trainer.step(&batch).map_err(backend)?;
        Ok((forward, hook, sft.loss))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (forward, hook, loss) = r.expect("rank");
        for e in [forward, hook] {
            let e = e.unwrap_or_else(|| panic!("rank {rank}: not refused"));
            assert!(
                e.contains("pp") && (e.contains("every layer") || e.contains("whole-model")),
                "{e}"
            );
        }
        assert!(loss.is_finite() && loss > 0.0, "rank {rank}: {loss}");
    }
}

/// The non-finite guard through the loss hook: an objective that is NaN on rank 1 alone is
/// refused on both ranks (agreed over the world, naming rank 1); with a skip budget the step
/// is skipped and changes nothing (the next step equals the same step of a run that never
/// saw it, bit for bit); past the budget the step fails, again changing nothing.
#[test]
fn a_non_finite_objective_on_one_rank_is_skipped_then_refused_on_every_rank() {
    let device = Device::flex().autodiff();
    let full = fixture().init(&device).expect("init");
    let layout = ParallelLayout::parse(2, "ep=2").expect("layout");
    let config = TrainerConfig {
        skip_nonfinite_steps: 1,
        ..TrainerConfig::default()
    };
    let (full, layout, config, dev) = (&full, &layout, &config, &device);
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut skipping =
            Trainer::new(full, &pg, ctx.world()?, config.clone(), dev).map_err(backend)?;
        let mut plain =
            Trainer::new(full, &pg, ctx.world()?, config.clone(), dev).map_err(backend)?;
        let rank = ctx.rank();
        let batch = |step: usize| {
            let ids: Vec<i64> = (0..16)
                .map(|i| ((i * 7 + step * 13 + rank * 29) % 250) as i64)
                .collect();
            TrainBatch::causal(ids, 2).map_err(backend)
        };
        // The objective, NaN on rank 1 when `poison`.
        let hook = |poison: bool| {
            move |shard: &moe_models::distributed::Sharded<moe_models::Qwen3MoeForCausalLM>,
                  b: &TrainBatch,
                  scale: f64| {
                let out =
                    shard.forward_loss_scaled(&b.input_ids, &b.labels, b.batch, dev, scale)?;
                let loss = if poison && rank == 1 {
                    out.loss.mul_scalar(f64::NAN)
                } else {
                    out.loss
                };
                Ok((loss, b.target_tokens()))
            }
        };
        let flat = |t: &Trainer<moe_models::Qwen3MoeForCausalLM>| {
            t.optimizer()
                .table()
                .flatten_values(&t.model().model)
                .expect("flatten")
        };
        let b0 = batch(0)?;
        skipping
            .step_with(std::slice::from_ref(&b0), hook(false))
            .map_err(backend)?;
        plain
            .step_with(std::slice::from_ref(&b0), hook(false))
            .map_err(backend)?;
        let before = flat(&skipping);
        let stats = skipping
            .step_with(std::slice::from_ref(&b0), hook(true))
            .map_err(backend)?;
        assert!(stats.skipped, "rank {rank}: skipped on every rank");
        assert_eq!(skipping.skipped_steps(), 1);
        assert_eq!(flat(&skipping), before, "a skipped step changes nothing");
        let b1 = batch(1)?;
        let a = skipping
            .step_with(std::slice::from_ref(&b1), hook(false))
            .map_err(backend)?;
        let b = plain
            .step_with(std::slice::from_ref(&b1), hook(false))
            .map_err(backend)?;
        assert_eq!((a.loss, a.grad_norm), (b.loss, b.grad_norm));
        assert_eq!(
            flat(&skipping),
            flat(&plain),
            "as if the step never happened"
        );
        // The budget is spent: refused, naming rank 1, nothing changed.
        let before = flat(&skipping);
        let e = skipping
            .step_with(std::slice::from_ref(&b1), hook(true))
            .expect_err("refused past the budget");
        assert!(e.is_non_finite(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("rank 1") && text.contains("objective"),
            "{text}"
        );
        assert_eq!(flat(&skipping), before, "a refused step changes nothing");
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
