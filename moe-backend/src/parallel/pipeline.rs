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
//! The rank runs its program of [`PipelineSchedule::steps`] (forward-only:
//! [`PipelineSchedule::forward_steps`]): computations, and between them
//! [`Step::Exchange`] batches of sends and receives, each issued as ONE
//! [`Comm::send_recv`] on the pipeline group's communicator ([`PipelineChannels`]) — Megatron's
//! `send_forward_recv_backward` / `send_backward_recv_forward` (1F1B) and
//! `send_forward_backward_recv_forward_backward` (interleaved) through `_batched_p2p_ops`.
//! Within a batch the transfers are posted in [`PipelineSchedule::posting_order`].
//!
//! So the schedule does not rely on buffered sends: on NCCL, whose sends complete only when
//! the receiver posts the matching receive, a rank that sent its activation and then waited
//! to receive its gradient (while the next rank sent that gradient and waited to receive the
//! next activation) would deadlock; batched, both exchanges complete together. The executor
//! checks up front that the programs complete under these rendezvous semantics
//! ([`PipelineSchedule::simulate`]) and that on the one channel every receiver asks for
//! messages in the order its sender posts them ([`PipelineSchedule::check_matching`]); the
//! tests run every schedule on the threads transport in rendezvous mode
//! ([`crate::comm::PointToPoint::Rendezvous`]). Hand-offs between chunks of the same rank
//! (`pp = 1`) stay on the rank. No header travels with a payload on the host transports: the
//! traffic counter of the pipeline channel is exactly the activation and gradient bytes.

use std::collections::HashMap;

use burn::tensor::{DType, Device, Gradients, Tensor};

use super::schedule::{Action, Direction, Payload, PipelineSchedule, Step, Transfer};
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

/// The point-to-point communicator of a pipeline group, members in pipeline order (member
/// `r` is pipeline rank `r`), as Megatron's pipeline-parallel group: it carries the
/// activations (virtual stage `v` to `v + 1`) and their gradients (`v + 1` to `v`), batched
/// per exchange.
#[derive(Debug, Clone)]
pub struct PipelineChannels {
    /// The pipeline group's communicator.
    pub p2p: Comm,
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

/// Checks that, per kind of message (activations, gradients), each receiver of `schedule`
/// asks for its sender's messages in the order the sender's actions produce them; an error
/// names the two ranks. (The executor checks the stronger
/// [`PipelineSchedule::check_matching`]: one channel for both kinds, batched.)
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

/// Checks that `channels` are pipeline rank `rank`'s of a pipeline of `pp` ranks.
fn check_channels(pp: usize, rank: usize, channels: &PipelineChannels) -> Result<()> {
    if rank >= pp {
        return Err(BackendError::Layout {
            field: "pp",
            detail: format!("pipeline rank {rank} of a schedule over pp = {pp}"),
        });
    }
    let comm = &channels.p2p;
    if comm.size() != pp || comm.rank() != rank {
        return Err(BackendError::Layout {
            field: "pp",
            detail: format!(
                "the pipeline channel is member {} of {}, the schedule wants pipeline rank {rank} of {pp}",
                comm.rank(),
                comm.size()
            ),
        });
    }
    Ok(())
}

/// Tensors in transit on one rank: outputs waiting for the next exchange to send them,
/// inputs received (or handed over by a chunk of the same rank) waiting for their
/// computation. Keys: payload, micro-batch, and the chunk on this rank that produced
/// (outbox) or consumes (inbox) the tensor.
struct Mailboxes<const D: usize> {
    outbox: HashMap<(Payload, usize, usize), Tensor<D>>,
    inbox: HashMap<(Payload, usize, usize), Tensor<D>>,
}

impl<const D: usize> Mailboxes<D> {
    fn new() -> Self {
        Self {
            outbox: HashMap::new(),
            inbox: HashMap::new(),
        }
    }

    /// The input of `action` on `rank` (received or handed over), `None` on virtual stage 0
    /// of a forward / the last of a backward.
    fn input(
        &mut self,
        schedule: &PipelineSchedule,
        rank: usize,
        action: Action,
    ) -> Result<Option<Tensor<D>>> {
        if schedule.input_of(rank, action).is_none() {
            return Ok(None);
        }
        let payload = payload_of(action);
        let key = (payload, action.microbatch(), action.chunk());
        self.inbox.remove(&key).map(Some).ok_or_else(|| {
            schedule_error(format!(
                "pipeline rank {rank}: {action} runs before its input arrived"
            ))
        })
    }

    /// Queues `tensor`, the output of `action` on `rank`, for its consumer: handed over
    /// directly when that is a chunk of this rank, else sent by the next exchange.
    fn output(
        &mut self,
        schedule: &PipelineSchedule,
        rank: usize,
        action: Action,
        tensor: Tensor<D>,
    ) {
        let Some((dst, dst_chunk)) = schedule.output_of(rank, action) else {
            return;
        };
        let payload = payload_of(action);
        if dst == rank {
            self.inbox
                .insert((payload, action.microbatch(), dst_chunk), tensor);
        } else {
            self.outbox
                .insert((payload, action.microbatch(), action.chunk()), tensor);
        }
    }

    /// One [`Step::Exchange`]: the batch's sends and receives in one [`Comm::send_recv`].
    /// `shape_of` gives the shape of a received tensor.
    fn exchange(
        &mut self,
        schedule: &PipelineSchedule,
        rank: usize,
        mut ops: Vec<Transfer>,
        channels: &PipelineChannels,
        (dtype, device): (DType, &Device),
        shape_of: impl Fn(&Transfer) -> [usize; D],
    ) -> Result<()> {
        schedule.posting_order(rank, &mut ops);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut keys = Vec::new();
        for t in &ops {
            let key = (t.payload, t.microbatch, t.chunk);
            match t.direction {
                Direction::Send => {
                    let tensor = self.outbox.remove(&key).ok_or_else(|| {
                        schedule_error(format!("pipeline rank {rank} must {t} before computing it"))
                    })?;
                    sends.push((tensor, t.peer));
                }
                Direction::Recv => {
                    recvs.push((shape_of(t), dtype, t.peer));
                    keys.push(key);
                }
            }
        }
        let got = channels.p2p.send_recv(sends, &recvs, device)?;
        self.inbox.extend(keys.into_iter().zip(got));
        Ok(())
    }

    /// Errors unless every tensor was sent and consumed.
    fn check_empty(&self, rank: usize) -> Result<()> {
        if let Some((payload, mb, chunk)) = self.outbox.keys().next() {
            return Err(schedule_error(format!(
                "pipeline rank {rank} never sent the {payload:?} of micro-batch {mb}, chunk {chunk}"
            )));
        }
        if let Some((payload, mb, chunk)) = self.inbox.keys().next() {
            return Err(schedule_error(format!(
                "pipeline rank {rank} never used the {payload:?} of micro-batch {mb}, chunk {chunk}"
            )));
        }
        Ok(())
    }
}

fn payload_of(action: Action) -> Payload {
    if action.is_forward() {
        Payload::Activation
    } else {
        Payload::Grad
    }
}

/// One forward action of `rank`: takes the input activation (a tracked leaf when `track`),
/// runs the stage's chunk and queues the activation for the next virtual stage; checks that
/// only the last virtual stage returns a loss.
#[allow(clippy::type_complexity)]
fn run_forward<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    action: Action,
    mail: &mut Mailboxes<D>,
    stage: &mut S,
    track: bool,
) -> std::result::Result<(Option<Tensor<D>>, StageOutput<D>), S::Error> {
    let (microbatch, chunk) = (action.microbatch(), action.chunk());
    let vs = schedule.virtual_stage(rank, chunk);
    let last = schedule.pp() * schedule.vpp() - 1;
    let input = mail
        .input(schedule, rank, action)?
        .map(|x| if track { x.require_grad() } else { x });
    let output = stage.forward(chunk, microbatch, input.clone())?;
    match (&output, schedule.output_of(rank, action)) {
        (StageOutput::Activation(y), Some(_)) => {
            mail.output(schedule, rank, action, y.clone().detach());
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

/// The forwards of pipeline rank `rank`'s part of `schedule` only, in the schedule's order
/// (Megatron's `forward_only`): activations travel as in [`run_pipeline`], batched per
/// [`PipelineSchedule::forward_steps`], nothing is kept for a backward and no gradient is
/// exchanged; the last virtual stage's outputs are the stage's to keep
/// ([`PipelineStage::forward`] sees every micro-batch). A collective of the pipeline group.
/// Checked up front to complete under rendezvous sends
/// ([`PipelineSchedule::simulate_forward`], [`PipelineSchedule::check_matching`]).
pub fn run_pipeline_forward<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    channels: &PipelineChannels,
    stage: &mut S,
) -> std::result::Result<PipelineRun, S::Error> {
    check_channels(schedule.pp(), rank, channels)?;
    schedule.simulate_forward()?;
    schedule.check_matching(true)?;
    let device = stage.device();
    let dtype = stage.activation_dtype();
    let mut mail = Mailboxes::new();
    let mut run = PipelineRun::default();
    for step in schedule.forward_steps(rank) {
        match step {
            Step::Exchange(ops) => {
                let shape = |t: &Transfer| stage.activation_shape(t.microbatch);
                mail.exchange(schedule, rank, ops, channels, (dtype, &device), shape)?;
            }
            Step::Compute(action) => {
                run_forward(schedule, rank, action, &mut mail, stage, false)?;
                run.forwards += 1;
                run.peak_in_flight = run.peak_in_flight.max(1);
            }
        }
    }
    mail.check_empty(rank)?;
    Ok(run)
}

/// Runs pipeline rank `rank`'s program of `schedule` ([`PipelineSchedule::steps`]) on
/// `stage`, exchanging activations and gradients with the other pipeline ranks over
/// `channels`, each exchange one batched [`Comm::send_recv`] (a collective of the pipeline
/// group: every rank calls it with the same schedule). Checked up front to complete under
/// rendezvous sends ([`PipelineSchedule::simulate`], [`PipelineSchedule::check_matching`]).
pub fn run_pipeline<const D: usize, S: PipelineStage<D>>(
    schedule: &PipelineSchedule,
    rank: usize,
    channels: &PipelineChannels,
    stage: &mut S,
) -> std::result::Result<PipelineRun, S::Error> {
    let pp = schedule.pp();
    check_channels(pp, rank, channels)?;
    schedule.simulate()?;
    schedule.check_matching(false)?;
    let device = stage.device();
    let dtype = stage.activation_dtype();
    let mut held: HashMap<(usize, usize), InFlight<D>> = HashMap::new();
    let mut mail = Mailboxes::new();
    let mut run = PipelineRun::default();
    for step in schedule.steps(rank) {
        let action = match step {
            Step::Exchange(ops) => {
                // A gradient has the shape of the activation it belongs to.
                let shape = |t: &Transfer| match (t.payload, held.get(&(t.microbatch, t.chunk))) {
                    (
                        Payload::Grad,
                        Some(InFlight {
                            output: StageOutput::Activation(y),
                            ..
                        }),
                    ) => y.dims(),
                    _ => stage.activation_shape(t.microbatch),
                };
                mail.exchange(schedule, rank, ops, channels, (dtype, &device), shape)?;
                continue;
            }
            Step::Compute(action) => action,
        };
        let (microbatch, chunk) = (action.microbatch(), action.chunk());
        let vs = schedule.virtual_stage(rank, chunk);
        match action {
            Action::Forward { .. } => {
                let (input, output) = run_forward(schedule, rank, action, &mut mail, stage, true)?;
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
                        let Some(dy) = mail.input(schedule, rank, action)? else {
                            return Err(schedule_error(format!(
                                "virtual stage {vs} has no next stage to send it a gradient"
                            ))
                            .into());
                        };
                        // d(Σ y·dy)/dy = dy: the received gradient seeds the chunk's backward.
                        tracked_backward((y * dy).sum())
                    }
                };
                if let Some(x) = input
                    && schedule.output_of(rank, action).is_some()
                {
                    let dx = match grads.as_mut().and_then(|g| x.grad_remove(g)) {
                        Some(g) => g,
                        None => Tensor::zeros(x.dims(), &x.device().without_autodiff()),
                    };
                    mail.output(schedule, rank, action, dx);
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
    mail.check_empty(rank)?;
    Ok(run)
}
