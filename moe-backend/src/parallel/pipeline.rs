//! The pipeline-parallel executor: runs one rank's part of a [`PipelineSchedule`] (1F1B or
//! interleaved 1F1B over virtual stages) with real point-to-point transfers of activations
//! and their gradients, as Megatron-LM's `forward_backward_pipelining_*` functions do.
//!
//! A rank's model chunks are a [`PipelineStage`]: the executor calls its forward for each
//! forward action (with the previous virtual stage's activation, received from its rank, as a
//! tracked leaf), keeps the chunk's output graph until the matching backward, and then
//! back-propagates either the loss (last virtual stage) or the output gradient received from
//! the next virtual stage's rank; the input leaf's gradient goes back to the previous virtual
//! stage. Each backward's parameter gradients are handed to the stage
//! ([`PipelineStage::backward_done`]), which accumulates them over the micro-batches (a
//! [`burn::optim::GradientsAccumulator`] per chunk, say), so an optimizer step after the
//! schedule sees the same sums a one-rank run over the same micro-batches would.
//!
//! # Transfers
//!
//! Activations travel on one communicator and gradients on another, both over the ranks of
//! the pipeline group in pipeline order ([`PipelineChannels`]; a [`crate::comm::RankCtx`]
//! gives independent channels over the same members by name). The transports' `send` is
//! buffered, so a rank never waits on its own sends, and each channel delivers in order per
//! sender: the executor checks up front ([`check_transfer_order`]) that on every channel each
//! receiver asks for messages in the order its sender posts them — true of Megatron's
//! schedules (every rank runs its forwards, and its backwards, in the same micro-batch/chunk
//! order), and refused with an error naming both ranks for a custom order that is not. No
//! header travels with a payload: the traffic counters of the pipeline channels are exactly
//! the activation and gradient bytes.

use std::collections::HashMap;

use burn::tensor::{DType, Device, Gradients, Tensor};

use super::schedule::{Action, PipelineSchedule};
use crate::comm::Comm;
use crate::error::{BackendError, Result};

mod split;
#[cfg(test)]
mod tests;

pub use split::{PipelineSplit, StageParts};

/// What a forward of a model chunk produced.
#[derive(Debug, Clone)]
pub enum StageOutput<const D: usize> {
    /// The activation passed to the next virtual stage (not the last one).
    Activation(Tensor<D>),
    /// The scalar objective of this micro-batch (the last virtual stage): back-propagated as
    /// it is, so it carries the caller's micro-batch weighting.
    Loss(Tensor<1>),
}

/// A pipeline rank's model chunks, as the executor drives them.
pub trait PipelineStage<const D: usize> {
    /// Error of the stage's own computations.
    type Error: From<BackendError>;

    /// Shape of the activation passed between virtual stages for `microbatch` (its gradient
    /// has the same shape): what a receiver expects.
    fn activation_shape(&self, microbatch: usize) -> [usize; D];

    /// Dtype of the activations passed between virtual stages.
    fn activation_dtype(&self) -> DType {
        DType::F32
    }

    /// Device the received activations and gradients are put on (the chunks' autodiff device).
    fn device(&self) -> Device;

    /// Forward of local chunk `chunk` on `microbatch`. `input` is the previous virtual stage's
    /// activation as a tracked leaf, `None` on virtual stage 0 (which reads its micro-batch
    /// itself). The last virtual stage returns [`StageOutput::Loss`], the others
    /// [`StageOutput::Activation`].
    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<Tensor<D>>,
    ) -> std::result::Result<StageOutput<D>, Self::Error>;

    /// The gradients of one backward of `chunk` on `microbatch` (parameters of the chunk; the
    /// input leaf's gradient has been taken out): accumulate them. Not called when the
    /// chunk's output depends on nothing tracked (no parameter, no input).
    fn backward_done(
        &mut self,
        chunk: usize,
        microbatch: usize,
        grads: Gradients,
    ) -> std::result::Result<(), Self::Error>;
}

/// The two communicators of a pipeline group, members in pipeline order (member `r` is
/// pipeline rank `r`): one carries activations, the other their gradients.
#[derive(Debug, Clone)]
pub struct PipelineChannels {
    /// Forward activations, virtual stage `v` to `v + 1`.
    pub activations: Comm,
    /// Gradients of those activations, virtual stage `v + 1` to `v`.
    pub gradients: Comm,
}

/// What one rank's run of a schedule did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PipelineRun {
    /// Forward computations run.
    pub forwards: usize,
    /// Backward computations run.
    pub backwards: usize,
    /// Largest number of (micro-batch, chunk) outputs held at once, waiting for their backward.
    pub peak_in_flight: usize,
}

/// A forward whose backward has not run yet.
struct InFlight<const D: usize> {
    input: Option<Tensor<D>>,
    output: StageOutput<D>,
}

/// An error of the schedule being run (a stage or an order that cannot be executed).
fn schedule_error(detail: impl Into<String>) -> BackendError {
    BackendError::Config {
        field: "schedule",
        detail: detail.into(),
    }
}

/// The gradients of `objective`, or `None` when it depends on nothing tracked (a chunk that
/// only passes its micro-batch on, such as an embedding stage without trainable weights).
fn tracked_backward(objective: Tensor<1>) -> Option<Gradients> {
    objective.is_tracked().then(|| objective.backward())
}

/// Checks that on every channel each receiver of `schedule` asks for messages in the order
/// its sender posts them (see the module docs); an error names the two ranks.
pub fn check_transfer_order(schedule: &PipelineSchedule) -> Result<()> {
    let pp = schedule.pp();
    // (kind, src, dst) → keys in post order / in request order; kind 0 activations, 1 grads.
    let mut sent: HashMap<(u8, usize, usize), Vec<(usize, usize)>> = HashMap::new();
    let mut asked: HashMap<(u8, usize, usize), Vec<(usize, usize)>> = HashMap::new();
    for rank in 0..pp {
        for &action in schedule.actions(rank) {
            let kind = u8::from(!action.is_forward());
            // A message is keyed by the micro-batch and the virtual stage that produced it.
            let vs = schedule.virtual_stage(rank, action.chunk());
            if let Some((dst, _)) = schedule.output_of(rank, action) {
                sent.entry((kind, rank, dst))
                    .or_default()
                    .push((action.microbatch(), vs));
            }
            if let Some((src, chunk)) = schedule.input_of(rank, action) {
                let from = schedule.virtual_stage(src, chunk);
                asked
                    .entry((kind, src, rank))
                    .or_default()
                    .push((action.microbatch(), from));
            }
        }
    }
    for (key, posted) in &sent {
        let wanted = asked.get(key).map(Vec::as_slice).unwrap_or_default();
        if posted.as_slice() != wanted {
            let (kind, src, dst) = *key;
            let what = if kind == 0 {
                "activations"
            } else {
                "gradients"
            };
            return Err(schedule_error(format!(
                "pipeline rank {dst} receives the {what} of rank {src} in another order than \
                 rank {src} sends them ({wanted:?} vs {posted:?})"
            )));
        }
    }
    if let Some(key) = asked.keys().find(|k| !sent.contains_key(k)) {
        return Err(schedule_error(format!(
            "pipeline rank {} waits for messages rank {} never sends",
            key.2, key.1
        )));
    }
    Ok(())
}

/// One forward action of `rank`: receives the input activation (a tracked leaf when
/// `track`), runs the stage's chunk and sends an activation on; checks that only the last
/// virtual stage returns a loss.
#[allow(clippy::type_complexity)]
fn run_forward<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    action: Action,
    channels: &PipelineChannels,
    stage: &mut S,
    track: bool,
) -> std::result::Result<(Option<Tensor<D>>, StageOutput<D>), S::Error> {
    let (microbatch, chunk) = (action.microbatch(), action.chunk());
    let vs = schedule.virtual_stage(rank, chunk);
    let last = schedule.pp() * schedule.vpp() - 1;
    let input = match schedule.input_of(rank, action) {
        Some((src, _)) => {
            let shape = stage.activation_shape(microbatch);
            let (dtype, device) = (stage.activation_dtype(), stage.device());
            let x: Tensor<D> = channels.activations.recv(shape, dtype, src, &device)?;
            Some(if track { x.require_grad() } else { x })
        }
        None => None,
    };
    let output = stage.forward(chunk, microbatch, input.clone())?;
    match (&output, schedule.output_of(rank, action)) {
        (StageOutput::Activation(y), Some((dst, _))) => {
            channels.activations.send(y.clone().detach(), dst)?;
        }
        (StageOutput::Loss(_), None) => {}
        (StageOutput::Activation(_), None) => {
            return Err(schedule_error(format!(
                "virtual stage {vs} (the last of {}) returned an activation instead of a loss",
                last + 1
            ))
            .into());
        }
        (StageOutput::Loss(_), Some(_)) => {
            return Err(schedule_error(format!(
                "virtual stage {vs} returned a loss; only the last ({last}) may"
            ))
            .into());
        }
    }
    Ok((input, output))
}

/// Checks that `channels` are pipeline rank `rank`'s of a pipeline of `pp` ranks.
fn check_channels(pp: usize, rank: usize, channels: &PipelineChannels) -> Result<()> {
    if rank >= pp {
        return Err(BackendError::Layout {
            field: "pp",
            detail: format!("pipeline rank {rank} of a schedule over pp = {pp}"),
        });
    }
    for (name, comm) in [
        ("activations", &channels.activations),
        ("gradients", &channels.gradients),
    ] {
        if comm.size() != pp || comm.rank() != rank {
            return Err(BackendError::Layout {
                field: "pp",
                detail: format!(
                    "the {name} channel is member {} of {}, the schedule wants pipeline rank {rank} of {pp}",
                    comm.rank(),
                    comm.size()
                ),
            });
        }
    }
    Ok(())
}

/// The forwards of pipeline rank `rank`'s part of `schedule` only, in the schedule's order
/// (Megatron's `forward_only`): activations travel as in [`run_pipeline`], nothing is kept
/// for a backward and no gradient is exchanged; the last virtual stage's outputs are the
/// stage's to keep ([`PipelineStage::forward`] sees every micro-batch). A collective of the
/// pipeline group. Deadlock-free for any schedule [`run_pipeline`] runs: a forward waits only
/// on earlier virtual stages' forwards, and sends are buffered.
pub fn run_pipeline_forward<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    channels: &PipelineChannels,
    stage: &mut S,
) -> std::result::Result<PipelineRun, S::Error> {
    check_channels(schedule.pp(), rank, channels)?;
    check_transfer_order(schedule)?;
    let mut run = PipelineRun::default();
    for &action in schedule.actions(rank).iter().filter(|a| a.is_forward()) {
        run_forward(schedule, rank, action, channels, stage, false)?;
        run.forwards += 1;
        run.peak_in_flight = run.peak_in_flight.max(1);
    }
    Ok(run)
}

/// Runs pipeline rank `rank`'s actions of `schedule` on `stage`, exchanging activations and
/// gradients with the other pipeline ranks over `channels` (a collective of the pipeline
/// group: every rank calls it with the same schedule).
pub fn run_pipeline<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    channels: &PipelineChannels,
    stage: &mut S,
) -> std::result::Result<PipelineRun, S::Error> {
    let pp = schedule.pp();
    check_channels(pp, rank, channels)?;
    check_transfer_order(schedule)?;
    let device = stage.device();
    let dtype = stage.activation_dtype();
    let mut held: HashMap<(usize, usize), InFlight<D>> = HashMap::new();
    let mut run = PipelineRun::default();
    for &action in schedule.actions(rank) {
        let (microbatch, chunk) = (action.microbatch(), action.chunk());
        let vs = schedule.virtual_stage(rank, chunk);
        match action {
            Action::Forward { .. } => {
                let (input, output) = run_forward(schedule, rank, action, channels, stage, true)?;
                held.insert((microbatch, chunk), InFlight { input, output });
                run.forwards += 1;
                run.peak_in_flight = run.peak_in_flight.max(held.len());
            }
            Action::Backward { .. } => {
                let InFlight { input, output } =
                    held.remove(&(microbatch, chunk)).ok_or_else(|| {
                        schedule_error(format!(
                            "backward of micro-batch {microbatch}, chunk {chunk} on pipeline rank {rank} before its forward"
                        ))
                    })?;
                let mut grads = match output {
                    StageOutput::Loss(loss) => tracked_backward(loss),
                    StageOutput::Activation(y) => {
                        let Some((src, _)) = schedule.input_of(rank, action) else {
                            return Err(schedule_error(format!(
                                "virtual stage {vs} has no next stage to send it a gradient"
                            ))
                            .into());
                        };
                        let dy: Tensor<D> =
                            channels.gradients.recv(y.dims(), dtype, src, &device)?;
                        // d(Σ y·dy)/dy = dy: the received gradient seeds the chunk's backward.
                        tracked_backward((y * dy).sum())
                    }
                };
                if let (Some(x), Some((dst, _))) = (input, schedule.output_of(rank, action)) {
                    let dx = match grads.as_mut().and_then(|g| x.grad_remove(g)) {
                        Some(g) => g,
                        None => Tensor::zeros(x.dims(), &x.device().without_autodiff()),
                    };
                    channels.gradients.send(dx, dst)?;
                }
                if let Some(grads) = grads {
                    stage.backward_done(chunk, microbatch, grads)?;
                }
                run.backwards += 1;
            }
        }
    }
    if let Some((microbatch, chunk)) = held.keys().next() {
        return Err(schedule_error(format!(
            "micro-batch {microbatch}, chunk {chunk} on pipeline rank {rank} ran forward but never backward"
        ))
        .into());
    }
    Ok(run)
}
