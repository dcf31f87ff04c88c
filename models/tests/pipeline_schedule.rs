//! The activation planner's in-flight micro-batch counts agree with the pipeline schedules
//! `moe_backend::parallel::schedule` actually produces.

use moe_backend::parallel::schedule::PipelineSchedule;
use moe_models::plan::activations::in_flight_per_chunk;

#[test]
fn planner_in_flight_matches_the_schedule_peak() {
    for pp in [1, 2, 4, 8] {
        for vpp in [1, 2, 3, 4] {
            for m in [pp, 2 * pp, 4 * pp, 8 * pp, 16 * pp] {
                let s = PipelineSchedule::interleaved(pp, vpp, m).unwrap();
                for stage in 0..pp {
                    let planner = in_flight_per_chunk(pp, vpp, stage, m);
                    assert_eq!(
                        s.in_flight_at_peak(stage),
                        planner,
                        "pp {pp} vpp {vpp} m {m} stage {stage}"
                    );
                    assert_eq!(s.max_in_flight(stage), planner.iter().sum::<usize>());
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_planner_matches_for_any_microbatch_count() {
    for pp in [2, 3, 4] {
        for m in 1..=10 {
            let s = PipelineSchedule::one_f_one_b(pp, m).unwrap();
            for stage in 0..pp {
                assert_eq!(
                    vec![s.max_in_flight(stage)],
                    in_flight_per_chunk(pp, 1, stage, m),
                    "pp {pp} m {m} stage {stage}"
                );
            }
        }
    }
}

/// A pipeline stage whose chunks pass on a `[S·B/(cp·tp), h]` activation (one rank's
/// sequence-parallel block of a micro-batch, the tensor Megatron sends between stages)
/// through one tracked weight: the executor sends exactly what a model's stages would.
struct Passing {
    rows: usize,
    hidden: usize,
    last_chunk_on_rank: Option<usize>,
    weight: burn::tensor::Tensor<2>,
}

impl moe_backend::parallel::pipeline::PipelineStage<2> for Passing {
    type Error = moe_backend::BackendError;

    fn activation_shape(&self, _microbatch: usize) -> [usize; 2] {
        [self.rows, self.hidden]
    }

    fn device(&self) -> burn::tensor::Device {
        self.weight.device()
    }

    fn forward(
        &mut self,
        chunk: usize,
        _microbatch: usize,
        input: Option<burn::tensor::Tensor<2>>,
    ) -> Result<moe_backend::parallel::pipeline::StageOutput<2>, Self::Error> {
        use moe_backend::parallel::pipeline::StageOutput;
        let x = input.unwrap_or_else(|| {
            burn::tensor::Tensor::ones([self.rows, self.hidden], &self.weight.device())
        });
        let y = x * self.weight.clone();
        Ok(if self.last_chunk_on_rank == Some(chunk) {
            StageOutput::Loss(y.sum())
        } else {
            StageOutput::Activation(y)
        })
    }

    fn backward_done(
        &mut self,
        _chunk: usize,
        _microbatch: usize,
        _grads: burn::tensor::Gradients,
    ) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// `moe plan`'s pipeline traffic per rank (activations forward, their gradients back, per
/// micro-batch and virtual stage) equals what the pipeline executor sends for the same
/// schedule and activation: Qwen3-MoE's fixture shape under `pp=2`, `pp=4`, `pp=2` with 2
/// virtual stages, and `tp=2,pp=2` (sequence-parallel blocks).
#[test]
fn planner_pipeline_traffic_matches_the_executor() {
    use burn::tensor::Device;
    use moe_backend::comm::World;
    use moe_backend::parallel::ParallelLayout;
    use moe_backend::parallel::pipeline::{PipelineChannels, run_pipeline};
    use moe_models::Qwen3MoeConfig;

    let path = format!(
        "{}/../tests/fixtures/qwen3_moe/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let config = Qwen3MoeConfig::from_file(path).unwrap();
    let hidden = config.hidden_size;
    let (seq, micro_batch) = (8, 2);
    for (world, spec, vpp, m) in [
        (2, "pp=2", 1, 3),
        (4, "pp=4", 1, 5),
        (2, "pp=2", 2, 4),
        (4, "tp=2,pp=2", 1, 2),
    ] {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let schedule = PipelineSchedule::interleaved(layout.pp, vpp, m).unwrap();
        let rows = seq * micro_batch / layout.tp;
        let (layout_ref, schedule_ref) = (&layout, &schedule);
        let sent = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let pp = pg.groups.get(moe_backend::parallel::GroupFamily::Pp);
            let channels = PipelineChannels {
                p2p: ctx.group("pp_p2p", &pp.ranks)?,
            };
            let device = Device::flex().autodiff();
            let stages = layout_ref.pp * vpp;
            let mut stage = Passing {
                rows,
                hidden,
                last_chunk_on_rank: (0..vpp)
                    .find(|&c| schedule_ref.virtual_stage(pp.index, c) + 1 == stages),
                weight: burn::tensor::Tensor::ones([rows, hidden], &device).require_grad(),
            };
            run_pipeline(schedule_ref, pp.index, &channels, &mut stage)?;
            let bytes = channels.p2p.traffic().bytes_sent;
            Ok((pp.index, bytes))
        });
        for (rank, result) in sent.into_iter().enumerate() {
            let (stage, measured) = result.unwrap();
            let planned = planned_pp_bytes(&config, &layout, stage, (seq, micro_batch, m, vpp));
            assert_eq!(planned, measured, "{spec} vpp {vpp} rank {rank}");
        }
    }
}

/// The same planner figure against a real training step: the [`moe_models::train::Trainer`]
/// of a 4-layer Qwen3-MoE (the fixture's config) runs one step of `m` micro-batches under
/// pipeline layouts, and each rank's pipeline channels carried exactly the planner's
/// per-rank pipeline traffic (f32 activations and gradients).
#[test]
fn planner_pipeline_traffic_matches_a_training_step() {
    use burn::tensor::Device;
    use moe_backend::comm::World;
    use moe_backend::parallel::{GroupFamily, ParallelLayout, replicate};
    use moe_models::Qwen3MoeConfig;
    use moe_models::distributed::DispatcherKind;
    use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

    let path = format!(
        "{}/../tests/fixtures/qwen3_moe/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut config = Qwen3MoeConfig::from_file(path).unwrap();
    config.num_hidden_layers = 4;
    let device = Device::flex().autodiff();
    let start = replicate(&config.init(&device).unwrap());
    let (seq, micro_batch) = (8, 2);
    for (world, spec, m) in [
        (2, "pp=2", 3),
        (4, "pp=4", 2),
        (2, "pp=2,vpp=2", 4),
        (4, "tp=2,pp=2", 2),
    ] {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let (layout_ref, start_ref, device_ref) = (&layout, &start, &device);
        let sent = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let config = TrainerConfig {
                dispatcher: DispatcherKind::AllToAll,
                ..TrainerConfig::default()
            };
            let mut trainer = Trainer::new(start_ref, &pg, ctx.world()?, config, device_ref)
                .map_err(|e| moe_backend::BackendError::Config {
                    field: "trainer",
                    detail: e.to_string(),
                })?;
            let micro: Vec<TrainBatch> = (0..m)
                .map(|i| {
                    let ids = (0..seq * micro_batch).map(|t| ((t * 7 + i * 13) % 200) as i64);
                    TrainBatch::causal(ids.collect(), micro_batch).unwrap()
                })
                .collect();
            trainer
                .step_micro_batches(&micro)
                .map_err(|e| moe_backend::BackendError::Config {
                    field: "step",
                    detail: e.to_string(),
                })?;
            let channels = pg.pipeline_channels();
            let bytes = channels.p2p.traffic().bytes_sent;
            Ok((pg.groups.get(GroupFamily::Pp).index, bytes))
        });
        for (rank, result) in sent.into_iter().enumerate() {
            let (stage, measured) = result.unwrap();
            let shape = (seq, micro_batch, m, layout.vpp);
            let planned = planned_pp_bytes(&config, &layout, stage, shape);
            assert!(measured > 0, "{spec} rank {rank}: nothing sent");
            assert_eq!(planned, measured, "{spec} rank {rank}");
        }
    }
}

/// `moe plan`'s pipeline bytes per step sent by pipeline rank `stage` of a Qwen3-MoE under
/// `layout`, for `(seq, micro_batch, micro-batches, vpp)` with the planner's f32 precision
/// (`moe plan --fp32`, what these f32 runs train in).
fn planned_pp_bytes(
    config: &moe_models::Qwen3MoeConfig,
    layout: &moe_backend::parallel::ParallelLayout,
    stage: usize,
    (seq, micro_batch, microbatches, vpp): (usize, usize, usize, usize),
) -> u64 {
    use moe_models::Qwen3MoeForCausalLM;
    use moe_models::families::Family;
    use moe_models::plan::PlanOptions;
    use moe_models::plan::comm::{Routing, step_traffic};
    use moe_models::plan::rank_params_of;
    let shape = moe_models::qwen3_moe::Qwen3Moe::model_shape(config).expect("shape");

    let params = rank_params_of::<Qwen3MoeForCausalLM>(config, layout, stage).unwrap();
    let opts = PlanOptions {
        seq,
        micro_batch,
        vpp,
        precision: moe_backend::optim::Precision::F32,
        ..PlanOptions::default()
    }
    .comm(microbatches);
    let traffic = step_traffic(&shape, &params, layout, &opts, stage, 0, &Routing::Uniform);
    traffic.expect("planned traffic").total.pp as u64
}

/// The pipeline drivers never rely on buffered sends: the [`moe_models::train::Trainer`] of
/// a 4-layer Qwen3-MoE (the fixture's config) under `pp=2` (1F1B) and `pp=2,vpp=2`
/// (interleaved), run on the threads transport with rendezvous sends (NCCL's semantics: a
/// send completes only when the receiver has posted the matching receive), completes three
/// training steps and an evaluation (forward-only pipeline) and equals the run with buffered
/// sends bit for bit: losses, aux losses, gradient norms, evaluation loss.
#[test]
fn training_under_rendezvous_sends_equals_buffered_bit_for_bit() {
    use burn::tensor::Device;
    use moe_backend::comm::{PointToPoint, World, WorldConfig};
    use moe_backend::parallel::{ParallelLayout, replicate};
    use moe_models::Qwen3MoeConfig;
    use moe_models::distributed::DispatcherKind;
    use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

    let path = format!(
        "{}/../tests/fixtures/qwen3_moe/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut config = Qwen3MoeConfig::from_file(path).unwrap();
    config.num_hidden_layers = 4;
    let device = Device::flex().autodiff();
    let start = replicate(&config.init(&device).unwrap());
    let (seq, micro_batch) = (8, 2);
    let be = |e: moe_models::ModelError| moe_backend::BackendError::Config {
        field: "trainer",
        detail: e.to_string(),
    };
    for (world, spec, m) in [(2, "pp=2", 3), (2, "pp=2,vpp=2", 4)] {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let run = |p2p: PointToPoint| {
            let config = WorldConfig {
                timeout: std::time::Duration::from_secs(120),
                p2p,
                ..WorldConfig::default()
            };
            World::run_with(world, config, |ctx| {
                let pg = ctx.process_groups(&layout)?;
                let config = TrainerConfig {
                    dispatcher: DispatcherKind::AllToAll,
                    ..TrainerConfig::default()
                };
                let mut trainer =
                    Trainer::new(&start, &pg, ctx.world()?, config, &device).map_err(be)?;
                let mut seen = Vec::new();
                for step in 0..3 {
                    let micro: Vec<TrainBatch> = (0..m)
                        .map(|i| {
                            let ids = (0..seq * micro_batch)
                                .map(|t| ((t * 7 + i * 13 + step * 5) % 200) as i64);
                            TrainBatch::causal(ids.collect(), micro_batch).unwrap()
                        })
                        .collect();
                    let stats = trainer.step_micro_batches(&micro).map_err(be)?;
                    seen.push(u64::from(stats.loss.to_bits()));
                    seen.push(u64::from(stats.aux_loss.to_bits()));
                    seen.push(stats.grad_norm.to_bits());
                    if step == 2 {
                        let (loss, tokens) = trainer.evaluate(&micro).map_err(be)?;
                        seen.extend([loss.to_bits(), tokens as u64]);
                    }
                }
                Ok(seen)
            })
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{spec} {p2p:?}: {e}")))
            .collect::<Vec<_>>()
        };
        let buffered = run(PointToPoint::Buffered);
        let rendezvous = run(PointToPoint::Rendezvous);
        assert!(buffered[0].iter().all(|&b| b != 0), "{spec}: {buffered:?}");
        assert_eq!(rendezvous, buffered, "{spec}");
    }
}
