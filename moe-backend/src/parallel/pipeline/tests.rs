//! The executor against the one-rank run of the same micro-batches (bit for bit), with
//! buffered and with rendezvous (NCCL's) sends; the old unbatched order deadlocking under
//! rendezvous; a stage that fails mid-schedule; the transfer-order checks, and the stage
//! splits against their definitions.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};

use super::*;
use crate::comm::{PointToPoint, World, WorldConfig};
use crate::testing::SplitMix;

const WIDTH: usize = 8;
const ROWS: usize = 3;

fn device() -> Device {
    Device::flex().autodiff()
}

/// `layers` linear layers with seeded weights (the same on every rank).
fn chain(layers: usize, device: &Device) -> Vec<Linear> {
    let mut rng = SplitMix::new(7);
    (0..layers)
        .map(|_| {
            let mut layer = LinearConfig::new(WIDTH, WIDTH).init(device);
            let w: Vec<f32> = (0..WIDTH * WIDTH)
                .map(|_| rng.uniform(-0.5, 0.5) as f32)
                .collect();
            let b: Vec<f32> = (0..WIDTH).map(|_| rng.uniform(-0.1, 0.1) as f32).collect();
            layer.weight = layer.weight.map(|_| {
                Tensor::from_data(TensorData::new(w.clone(), [WIDTH, WIDTH]), device).require_grad()
            });
            layer.bias = layer.bias.map(|p| {
                p.map(|_| {
                    Tensor::from_data(TensorData::new(b.clone(), [WIDTH]), device).require_grad()
                })
            });
            layer
        })
        .collect()
}

/// Micro-batch `m`'s input and target.
fn data(m: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let mut rng = SplitMix::new(100 + m as u64);
    let x: Vec<f32> = (0..ROWS * WIDTH)
        .map(|_| rng.uniform(-1.0, 1.0) as f32)
        .collect();
    let y: Vec<f32> = (0..ROWS * WIDTH)
        .map(|_| rng.uniform(-1.0, 1.0) as f32)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [ROWS, WIDTH]), device),
        Tensor::from_data(TensorData::new(y, [ROWS, WIDTH]), device),
    )
}

fn block(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
    layer.forward(x).tanh()
}

/// The objective of one micro-batch out of `m`.
fn loss(out: Tensor<2>, target: Tensor<2>, m: usize) -> Tensor<1> {
    (out - target).powi_scalar(2).mean().div_scalar(m as f64)
}

/// Per layer, the weight and bias gradients summed over the micro-batches, as bits.
type Grads = BTreeMap<usize, (Vec<u32>, Vec<u32>)>;

fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Adds `layer`'s gradients in `grads` to `sums[l]`.
fn accumulate(
    sums: &mut BTreeMap<usize, (Tensor<2>, Tensor<1>)>,
    l: usize,
    layer: &Linear,
    grads: &Gradients,
) {
    let w = layer.weight.val().grad(grads).expect("weight gradient");
    let b = layer
        .bias
        .as_ref()
        .and_then(|b| b.val().grad(grads))
        .expect("bias gradient");
    let entry = match sums.remove(&l) {
        Some((sw, sb)) => (sw + w, sb + b),
        None => (w, b),
    };
    sums.insert(l, entry);
}

fn finish(sums: BTreeMap<usize, (Tensor<2>, Tensor<1>)>) -> Grads {
    sums.into_iter()
        .map(|(l, (w, b))| (l, (bits(w), bits(b))))
        .collect()
}

/// One rank, every layer, micro-batches one after the other.
fn reference(layers: usize, microbatches: usize) -> Grads {
    let device = device();
    let chain = chain(layers, &device);
    let mut sums = BTreeMap::new();
    for m in 0..microbatches {
        let (x, target) = data(m, &device);
        let out = chain.iter().fold(x, |h, layer| block(layer, h));
        let grads = loss(out, target, microbatches).backward();
        for (l, layer) in chain.iter().enumerate() {
            accumulate(&mut sums, l, layer, &grads);
        }
    }
    finish(sums)
}

/// A pipeline rank's chunks of the chain.
struct ChainStage {
    split: PipelineSplit,
    rank: usize,
    chain: Vec<Linear>,
    microbatches: usize,
    sums: BTreeMap<usize, (Tensor<2>, Tensor<1>)>,
    device: Device,
}

impl PipelineStage<2> for ChainStage {
    type Error = BackendError;

    fn activation_shape(&self, _microbatch: usize) -> [usize; 2] {
        [ROWS, WIDTH]
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<Tensor<2>>,
    ) -> Result<StageOutput<2>> {
        let parts = self.split.parts(self.rank, chunk).expect("chunk").clone();
        let (x, target) = data(microbatch, &self.device);
        let mut h = match (input, parts.embedding) {
            (None, true) => x,
            (Some(h), false) => h,
            _ => panic!("virtual stage 0 (and only it) reads the micro-batch"),
        };
        for l in parts.layers {
            h = block(&self.chain[l], h);
        }
        Ok(if parts.loss {
            StageOutput::Loss(loss(h, target, self.microbatches))
        } else {
            StageOutput::Activation(h)
        })
    }

    fn backward_done(&mut self, chunk: usize, _microbatch: usize, grads: Gradients) -> Result<()> {
        let parts = self.split.parts(self.rank, chunk).expect("chunk").clone();
        for l in parts.layers {
            accumulate(&mut self.sums, l, &self.chain[l], &grads);
        }
        Ok(())
    }
}

/// Every pipeline rank's run and gradients (the union over ranks covers every layer once).
fn pipelined(
    layers: usize,
    split: &PipelineSplit,
    schedule: &PipelineSchedule,
    p2p: PointToPoint,
) -> (Grads, Vec<PipelineRun>, Vec<u64>) {
    let pp = schedule.pp();
    let out = World::run_with(pp, world_config(p2p), |ctx| {
        let ranks: Vec<usize> = (0..pp).collect();
        let channels = PipelineChannels {
            p2p: ctx.group("pp_p2p", &ranks)?,
        };
        let device = device();
        let mut stage = ChainStage {
            split: split.clone(),
            rank: ctx.rank(),
            chain: chain(layers, &device),
            microbatches: schedule.microbatches(),
            sums: BTreeMap::new(),
            device,
        };
        let run = run_pipeline(schedule, ctx.rank(), &channels, &mut stage)?;
        let bytes = channels.p2p.traffic().bytes_sent;
        Ok((finish(stage.sums), run, bytes))
    });
    let mut grads = Grads::new();
    let mut runs = Vec::new();
    let mut bytes = Vec::new();
    for (rank, result) in out.into_iter().enumerate() {
        let (g, run, b) = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        for (l, v) in g {
            assert!(grads.insert(l, v).is_none(), "layer {l} on two ranks");
        }
        runs.push(run);
        bytes.push(b);
    }
    (grads, runs, bytes)
}

/// A world whose point-to-point sends are `p2p`, with a timeout short enough for a test
/// that waits for one.
fn world_config(p2p: PointToPoint) -> WorldConfig {
    WorldConfig {
        timeout: std::time::Duration::from_secs(20),
        p2p,
        ..WorldConfig::default()
    }
}

/// The pipelined gradients equal one rank's bit for bit with buffered sends and with
/// rendezvous sends (NCCL's semantics: the batched exchanges never wait on their own sends).
fn check(layers: usize, split: PipelineSplit, schedule: PipelineSchedule) {
    for p2p in [PointToPoint::Buffered, PointToPoint::Rendezvous] {
        check_with(layers, &split, &schedule, p2p);
    }
}

fn check_with(
    layers: usize,
    split: &PipelineSplit,
    schedule: &PipelineSchedule,
    p2p: PointToPoint,
) {
    let m = schedule.microbatches();
    let want = reference(layers, m);
    let (got, runs, bytes) = pipelined(layers, split, schedule, p2p);
    assert_eq!(got.len(), layers);
    for (l, g) in &want {
        assert_eq!(
            got.get(l),
            Some(g),
            "layer {l}: gradients differ from one rank ({p2p:?})"
        );
    }
    let stages = schedule.pp() * schedule.vpp();
    let per_message = (ROWS * WIDTH * 4) as u64;
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(run.forwards, m * schedule.vpp());
        assert_eq!(run.backwards, m * schedule.vpp());
        assert_eq!(
            run.peak_in_flight,
            schedule.max_in_flight(rank),
            "rank {rank}"
        );
        // Every virtual stage but the last sends each micro-batch's activation forward, and
        // every one but the first its input gradient back.
        let sends: u64 = (0..schedule.vpp())
            .map(|c| {
                let v = schedule.virtual_stage(rank, c);
                u64::from(v + 1 < stages) + u64::from(v > 0)
            })
            .sum();
        assert_eq!(
            bytes[rank],
            sends * m as u64 * per_message,
            "rank {rank} bytes"
        );
    }
}

#[test]
fn one_f_one_b_equals_one_rank_bit_for_bit() {
    check(
        4,
        PipelineSplit::even(4, 0, 2, 1).unwrap(),
        PipelineSchedule::one_f_one_b(2, 4).unwrap(),
    );
    // More stages than micro-batches leaves ranks idle in the warm-up.
    check(
        6,
        PipelineSplit::even(6, 0, 3, 1).unwrap(),
        PipelineSchedule::one_f_one_b(3, 2).unwrap(),
    );
}

#[test]
fn uneven_stages_equal_one_rank_bit_for_bit() {
    check(
        7,
        PipelineSplit::parse("Et|t*3|t*2|tL", 7, 0, 4, 1).unwrap(),
        PipelineSchedule::one_f_one_b(4, 5).unwrap(),
    );
}

#[test]
fn interleaved_stages_equal_one_rank_bit_for_bit() {
    check(
        8,
        PipelineSplit::even(8, 0, 2, 2).unwrap(),
        PipelineSchedule::interleaved(2, 2, 4).unwrap(),
    );
    // The embedding on a stage of its own, uneven chunks, 4 ranks × 2 chunks.
    check(
        9,
        PipelineSplit::parse("E|t*2|t|t|(t|)*3t*2L", 9, 0, 4, 2).unwrap(),
        PipelineSchedule::interleaved(4, 2, 8).unwrap(),
    );
}

/// The losses of a forward-only run, per micro-batch, from the stage holding the last
/// virtual stage: `(micro-batch, loss bits)` in the order the stage saw them.
struct ForwardOnly {
    inner: ChainStage,
    losses: Vec<(usize, u32)>,
}

impl PipelineStage<2> for ForwardOnly {
    type Error = BackendError;

    fn activation_shape(&self, microbatch: usize) -> [usize; 2] {
        self.inner.activation_shape(microbatch)
    }

    fn device(&self) -> Device {
        self.inner.device()
    }

    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<Tensor<2>>,
    ) -> Result<StageOutput<2>> {
        assert!(input.as_ref().is_none_or(|x| !x.is_require_grad()));
        let out = self.inner.forward(chunk, microbatch, input)?;
        if let StageOutput::Loss(l) = &out {
            self.losses.push((microbatch, bits(l.clone())[0]));
        }
        Ok(out)
    }

    fn backward_done(
        &mut self,
        _chunk: usize,
        _microbatch: usize,
        _grads: Gradients,
    ) -> Result<()> {
        panic!("a forward-only run has no backward")
    }
}

/// [`chain`] without autodiff (what a forward-only run holds).
fn frozen_chain(layers: usize) -> Vec<Linear> {
    chain(layers, &device())
        .into_iter()
        .map(|l| l.valid())
        .collect()
}

/// Megatron's `forward_only`: the forwards of a schedule alone give every micro-batch's loss
/// bit for bit as one rank's forward, in micro-batch order, with no gradient traffic.
#[test]
fn forward_only_runs_give_one_rank_losses() {
    let cases = [
        (
            4,
            PipelineSplit::even(4, 0, 2, 1),
            PipelineSchedule::one_f_one_b(2, 3),
        ),
        (
            8,
            PipelineSplit::even(8, 0, 2, 2),
            PipelineSchedule::interleaved(2, 2, 4),
        ),
    ];
    for (layers, split, schedule) in cases {
        let (split, schedule) = (split.unwrap(), schedule.unwrap());
        let m = schedule.microbatches();
        let device = Device::flex();
        let chain1 = frozen_chain(layers);
        let want: Vec<(usize, u32)> = (0..m)
            .map(|mb| {
                let (x, target) = data(mb, &device);
                let out = chain1.iter().fold(x, |h, layer| block(layer, h));
                (mb, bits(loss(out, target, m))[0])
            })
            .collect();
        let pp = schedule.pp();
        for p2p in [PointToPoint::Buffered, PointToPoint::Rendezvous] {
            let out = World::run_with(pp, world_config(p2p), |ctx| {
                let ranks: Vec<usize> = (0..pp).collect();
                let channels = PipelineChannels {
                    p2p: ctx.group("pp_p2p", &ranks)?,
                };
                let device = Device::flex();
                let mut stage = ForwardOnly {
                    inner: ChainStage {
                        split: split.clone(),
                        rank: ctx.rank(),
                        chain: frozen_chain(layers),
                        microbatches: m,
                        sums: BTreeMap::new(),
                        device,
                    },
                    losses: Vec::new(),
                };
                let run = run_pipeline_forward(&schedule, ctx.rank(), &channels, &mut stage)?;
                let bytes = channels.p2p.traffic().bytes_sent;
                Ok((stage.losses, run, bytes))
            });
            let mut seen = Vec::new();
            for (rank, result) in out.into_iter().enumerate() {
                let (losses, run, bytes) = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(run.forwards, m * schedule.vpp(), "rank {rank}");
                assert_eq!(run.backwards, 0);
                // Activations only: every virtual stage but the last sends each micro-batch on.
                let stages = schedule.pp() * schedule.vpp();
                let senders = (0..schedule.vpp())
                    .filter(|&c| schedule.virtual_stage(rank, c) + 1 < stages)
                    .count();
                assert_eq!(bytes, (senders * m * ROWS * WIDTH * 4) as u64, "{p2p:?}");
                seen.extend(losses);
            }
            assert_eq!(seen, want, "{p2p:?}");
        }
    }
}

#[test]
fn a_custom_order_whose_messages_cross_is_refused() {
    let order = vec![
        vec![
            Action::forward(0, 0),
            Action::forward(1, 0),
            Action::backward(1, 0),
            Action::backward(0, 0),
        ],
        vec![
            Action::forward(0, 0),
            Action::backward(0, 0),
            Action::forward(1, 0),
            Action::backward(1, 0),
        ],
    ];
    let schedule = PipelineSchedule::from_actions(2, 1, 2, order).unwrap();
    let err = check_transfer_order(&schedule).unwrap_err().to_string();
    assert!(
        err.contains("pipeline rank 0 receives the gradients of rank 1 in another order"),
        "{err}"
    );
    // Megatron's schedules pass.
    for (pp, vpp, m) in [(2, 1, 3), (4, 1, 8), (2, 2, 4), (4, 3, 8), (3, 2, 6)] {
        check_transfer_order(&PipelineSchedule::interleaved(pp, vpp, m).unwrap()).unwrap();
    }
}

#[test]
fn even_split_holds_each_part_once() {
    let split = PipelineSplit::even(8, 1, 2, 2).unwrap();
    let stages = split.stages();
    assert_eq!(stages.len(), 4);
    assert!(stages[0].embedding && !stages[1].embedding);
    assert!(stages[3].loss && !stages[2].loss);
    assert_eq!(stages[3].mtp, 0..1);
    assert_eq!(stages[2].mtp.len(), 0);
    assert_eq!(
        stages.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(),
        vec![0..2, 2..4, 4..6, 6..8]
    );
    // Rank 1 holds virtual stages 1 and 3.
    assert_eq!(split.rank_layers(1), vec![2, 3, 6, 7]);
    assert_eq!(split.parts(0, 1), Some(&stages[2]));
    assert_eq!(split.parts(2, 0), None);
}

#[test]
fn megatron_layouts_parse() {
    // DeepSeek-V3's style: embedding with 3 layers, then pairs, MTP with the loss.
    let split = PipelineSplit::parse("Et*3|(tt|)*3t m L", 10, 1, 5, 1).unwrap();
    let layers: Vec<_> = split.stages().iter().map(|s| s.layers.clone()).collect();
    assert_eq!(layers, vec![0..3, 3..5, 5..7, 7..9, 9..10]);
    assert_eq!(split.stages()[4].mtp, 0..1);
    assert!(split.stages()[4].loss);
    // Empty stages are allowed (a rank's chunk with nothing but the pass-through).
    let split = PipelineSplit::parse("E|t*4|t*4|L", 8, 0, 2, 2).unwrap();
    assert_eq!(split.stages()[3].layers.len(), 0);
    assert_eq!(split.stages()[0].layers.len(), 0);
}

#[test]
fn impossible_splits_are_refused_naming_the_field() {
    let cases = [
        (
            PipelineSplit::even(3, 0, 4, 1),
            "pp",
            "every stage needs a layer",
        ),
        (PipelineSplit::even(6, 0, 4, 1), "pp", "do not split evenly"),
        (PipelineSplit::even(4, 0, 2, 0), "vpp", "at least 1"),
        (
            PipelineSplit::parse("Et*2|t*2L", 5, 0, 2, 1),
            "pipeline_layout",
            "places 4 decoder layers, the model has 5",
        ),
        (
            PipelineSplit::parse("Et*2|t*2|tL", 5, 0, 2, 1),
            "pipeline_layout",
            "has 3 stages, pp = 2 × vpp = 1 needs 2",
        ),
        (
            PipelineSplit::parse("Et*2L|t*2", 4, 0, 2, 1),
            "pipeline_layout",
            "`L` must be on the last virtual stage",
        ),
        (
            PipelineSplit::parse("t*2|Et*2L", 4, 0, 2, 1),
            "pipeline_layout",
            "`E` must open virtual stage 0",
        ),
        (
            PipelineSplit::parse("Et*2m|t*2L", 4, 1, 2, 1),
            "pipeline_layout",
            "MTP modules must be on the last virtual stage",
        ),
        (
            PipelineSplit::parse("Et*2|t*2L", 4, 1, 2, 1),
            "pipeline_layout",
            "places 0 MTP modules, the model has 1",
        ),
        (
            PipelineSplit::parse("Et*2|(t*2L", 4, 0, 2, 1),
            "pipeline_layout",
            "never closed",
        ),
        (
            PipelineSplit::parse("Et*2|t*xL", 4, 0, 2, 1),
            "pipeline_layout",
            "followed by a count",
        ),
        (
            PipelineSplit::parse("Et*2|t*2Lq", 4, 0, 2, 1),
            "pipeline_layout",
            "unknown symbol `q`",
        ),
    ];
    for (result, field, detail) in cases {
        match result {
            Err(BackendError::Config {
                field: f,
                detail: d,
            }) => {
                assert_eq!(f, field, "{d}");
                assert!(d.contains(detail), "{d}");
            }
            other => panic!("expected a `{field}` error with `{detail}`, got {other:?}"),
        }
    }
}

/// The executor's order before batching: per action, receive its input, compute, send its
/// output, each transfer a blocking call of its own.
fn run_unbatched(
    schedule: &PipelineSchedule,
    rank: usize,
    comm: &Comm,
    stage: &mut ChainStage,
) -> Result<()> {
    let device = stage.device();
    let mut held: HashMap<(usize, usize), (Option<Tensor<2>>, StageOutput<2>)> = HashMap::new();
    for &action in schedule.actions(rank) {
        let (mb, chunk) = (action.microbatch(), action.chunk());
        let input = match schedule.input_of(rank, action) {
            Some((src, _)) => Some(comm.recv::<2, burn::tensor::Float>(
                [ROWS, WIDTH],
                DType::F32,
                src,
                &device,
            )?),
            None => None,
        };
        if action.is_forward() {
            let x = input.map(Tensor::require_grad);
            let out = stage.forward(chunk, mb, x.clone())?;
            if let (StageOutput::Activation(y), Some((dst, _))) =
                (&out, schedule.output_of(rank, action))
            {
                comm.send(y.clone().detach(), dst)?;
            }
            held.insert((mb, chunk), (x, out));
        } else {
            let (x, out) = held.remove(&(mb, chunk)).expect("forward ran");
            let mut grads = match (out, input) {
                (StageOutput::Loss(l), _) => l.backward(),
                (StageOutput::Activation(y), Some(dy)) => (y * dy).sum().backward(),
                (StageOutput::Activation(_), None) => panic!("no gradient received"),
            };
            if let (Some(x), Some((dst, _))) = (x, schedule.output_of(rank, action)) {
                comm.send(x.grad_remove(&mut grads).expect("input gradient"), dst)?;
            }
            stage.backward_done(chunk, mb, grads)?;
        }
    }
    Ok(())
}

fn chain_stage(split: &PipelineSplit, rank: usize, layers: usize, m: usize) -> ChainStage {
    let device = device();
    ChainStage {
        split: split.clone(),
        rank,
        chain: chain(layers, &device),
        microbatches: m,
        sums: BTreeMap::new(),
        device,
    }
}

/// The unbatched order relies on buffered sends: it completes (and equals one rank) with
/// buffered sends, and under rendezvous sends (NCCL's) rank 0 waits to send the activation
/// of micro-batch 1 while rank 1 waits to send the gradient of micro-batch 0 — a deadlock,
/// which the threads transport reports as a timeout instead of hanging. The batched executor
/// runs the same schedule under rendezvous (`one_f_one_b_equals_one_rank_bit_for_bit`).
#[test]
fn the_unbatched_order_deadlocks_under_rendezvous_sends() {
    let (layers, m) = (4, 3);
    let split = PipelineSplit::even(layers, 0, 2, 1).unwrap();
    let schedule = PipelineSchedule::one_f_one_b(2, m).unwrap();
    let run = |p2p: PointToPoint| {
        let config = WorldConfig {
            timeout: std::time::Duration::from_millis(1500),
            p2p,
            ..WorldConfig::default()
        };
        World::run_with(2, config, |ctx| {
            let comm = ctx.group("pp_p2p", &[0, 1])?;
            let mut stage = chain_stage(&split, ctx.rank(), layers, m);
            run_unbatched(&schedule, ctx.rank(), &comm, &mut stage)?;
            Ok(finish(stage.sums))
        })
    };
    let mut got = Grads::new();
    for result in run(PointToPoint::Buffered) {
        got.extend(result.unwrap());
    }
    assert_eq!(
        got,
        reference(layers, m),
        "the unbatched order itself is right"
    );
    let start = std::time::Instant::now();
    let out = run(PointToPoint::Rendezvous);
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    let errors: Vec<String> = out
        .into_iter()
        .map(|r| r.expect_err("a deadlock").to_string())
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("timed out") || e.contains("timeout")),
        "{errors:?}"
    );
}

/// A stage that fails in the middle of the schedule makes every other rank's exchange fail
/// with the transport's typed error within the timeout, never hang — with buffered and with
/// rendezvous sends, for 1F1B over 4 ranks and the interleaved schedule.
#[test]
fn a_stage_that_fails_mid_schedule_fails_the_others_promptly() {
    struct Failing {
        inner: ChainStage,
        fail_at: Option<(usize, usize)>,
    }
    impl PipelineStage<2> for Failing {
        type Error = BackendError;
        fn activation_shape(&self, mb: usize) -> [usize; 2] {
            self.inner.activation_shape(mb)
        }
        fn device(&self) -> Device {
            self.inner.device()
        }
        fn forward(
            &mut self,
            chunk: usize,
            mb: usize,
            input: Option<Tensor<2>>,
        ) -> Result<StageOutput<2>> {
            if self.fail_at == Some((mb, chunk)) {
                return Err(BackendError::Config {
                    field: "test",
                    detail: format!("stage fails at micro-batch {mb}"),
                });
            }
            self.inner.forward(chunk, mb, input)
        }
        fn backward_done(&mut self, chunk: usize, mb: usize, grads: Gradients) -> Result<()> {
            self.inner.backward_done(chunk, mb, grads)
        }
    }
    for (layers, split, schedule, dying) in [
        (
            4,
            PipelineSplit::even(4, 0, 4, 1).unwrap(),
            PipelineSchedule::one_f_one_b(4, 6).unwrap(),
            2,
        ),
        (
            8,
            PipelineSplit::even(8, 0, 2, 2).unwrap(),
            PipelineSchedule::interleaved(2, 2, 4).unwrap(),
            1,
        ),
    ] {
        for p2p in [PointToPoint::Buffered, PointToPoint::Rendezvous] {
            let pp = schedule.pp();
            let timeout = std::time::Duration::from_secs(3);
            let config = WorldConfig {
                timeout,
                p2p,
                ..WorldConfig::default()
            };
            let start = std::time::Instant::now();
            let out = World::run_with(pp, config, |ctx| {
                let ranks: Vec<usize> = (0..pp).collect();
                let channels = PipelineChannels {
                    p2p: ctx.group("pp_p2p", &ranks)?,
                };
                let m = schedule.microbatches();
                let mut stage = Failing {
                    inner: chain_stage(&split, ctx.rank(), layers, m),
                    fail_at: (ctx.rank() == dying).then_some((2, 0)),
                };
                run_pipeline(&schedule, ctx.rank(), &channels, &mut stage)
            });
            let elapsed = start.elapsed();
            assert!(elapsed < timeout * 2, "{p2p:?}: {elapsed:?}");
            for (rank, result) in out.into_iter().enumerate() {
                let err = result.expect_err("every rank fails");
                if rank == dying {
                    assert!(err.to_string().contains("stage fails"), "{err}");
                } else {
                    assert!(
                        matches!(
                            err,
                            BackendError::Aborted { .. }
                                | BackendError::Collective { .. }
                                | BackendError::Timeout { .. }
                        ),
                        "{p2p:?} rank {rank}: {err:?}"
                    );
                }
            }
        }
    }
}
