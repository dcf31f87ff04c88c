//! Pipeline-parallel schedules as plain data (docs/parallelism.md §Pipeline parallelism).
//!
//! A [`PipelineSchedule`] lists, for every pipeline rank, the order in which that rank runs the
//! forward and backward passes of its model chunks, exactly as Megatron-LM orders them:
//!
//! * [`PipelineSchedule::one_f_one_b`]: non-interleaved 1F1B. Rank `r` of `pp` runs
//!   `min(pp − r − 1, m)` warm-up forwards, then steady pairs "forward, backward", then the
//!   cool-down backwards.
//! * [`PipelineSchedule::interleaved`]: interleaved 1F1B over `vpp` model chunks per rank
//!   (virtual pipeline). Micro-batches run in groups of `pp`: the `k`-th forward of a rank is
//!   micro-batch `(k / (pp·vpp))·pp + k % pp` of chunk `(k / pp) % vpp`, and the `k`-th backward
//!   is the same micro-batch of chunk `vpp − 1 − (k / pp) % vpp`. Rank `r` runs
//!   `2·(pp − r − 1) + (vpp − 1)·pp` warm-up forwards (capped at `m·vpp`).
//!
//! Chunk `c` of rank `s` is virtual stage `c·pp + s` of `pp·vpp`: its forward needs the
//! activation of virtual stage `c·pp + s − 1` and its backward the gradient of virtual stage
//! `c·pp + s + 1`. [`PipelineSchedule::steps`] derives the point-to-point transfers a rank posts
//! between computations, batched as Megatron batches them ([`Fusion`]), and
//! [`PipelineSchedule::simulate`] runs all ranks in a discrete-event model with blocking
//! batches to prove the order cannot deadlock and to measure the makespan and pipeline bubble.
//! The batching matters: the interleaved schedule batched per computation
//! ([`Fusion::Adjacent`]) deadlocks in this model, and 1F1B batched per iteration
//! ([`Fusion::Pairs`]) runs but loses its overlap (makespan 24 instead of 15 for `pp = 2`,
//! `m = 4`); the interleaved schedule's extra `pp − r − 1` warm-up forwards are what let its
//! per-iteration batches keep the pipeline full.

use std::collections::HashMap;
use std::fmt;

use crate::error::{BackendError, Result};

#[cfg(test)]
mod tests;

/// One computation of a pipeline rank on one micro-batch of one of its model chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward pass of `microbatch` through the rank's model chunk `chunk`.
    Forward {
        /// Micro-batch index in `0..microbatches`.
        microbatch: usize,
        /// Local model chunk in `0..vpp`.
        chunk: usize,
    },
    /// Backward pass of `microbatch` through the rank's model chunk `chunk`.
    Backward {
        /// Micro-batch index in `0..microbatches`.
        microbatch: usize,
        /// Local model chunk in `0..vpp`.
        chunk: usize,
    },
}

impl Action {
    /// Shorthand for [`Action::Forward`].
    pub fn forward(microbatch: usize, chunk: usize) -> Self {
        Action::Forward { microbatch, chunk }
    }

    /// Shorthand for [`Action::Backward`].
    pub fn backward(microbatch: usize, chunk: usize) -> Self {
        Action::Backward { microbatch, chunk }
    }

    /// Whether this is a forward pass.
    pub fn is_forward(&self) -> bool {
        matches!(self, Action::Forward { .. })
    }

    /// The micro-batch.
    pub fn microbatch(&self) -> usize {
        match *self {
            Action::Forward { microbatch, .. } | Action::Backward { microbatch, .. } => microbatch,
        }
    }

    /// The local model chunk.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. } | Action::Backward { chunk, .. } => chunk,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Forward { microbatch, chunk } => write!(f, "F(mb {microbatch}, chunk {chunk})"),
            Action::Backward { microbatch, chunk } => {
                write!(f, "B(mb {microbatch}, chunk {chunk})")
            }
        }
    }
}

/// What a point-to-point transfer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payload {
    /// Output activation of a forward pass, sent to the next virtual stage.
    Activation,
    /// Gradient w.r.t. the input of a backward pass, sent to the previous virtual stage.
    Grad,
}

/// Direction of a point-to-point transfer, seen from the rank that posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// This rank sends.
    Send,
    /// This rank receives.
    Recv,
}

/// One send or receive a rank posts between two computations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Send or receive.
    pub direction: Direction,
    /// Activation or gradient.
    pub payload: Payload,
    /// Micro-batch of the tensor.
    pub microbatch: usize,
    /// This rank's model chunk that produced (send) or consumes (receive) the tensor.
    pub chunk: usize,
    /// The other pipeline rank.
    pub peer: usize,
    /// The other rank's model chunk.
    pub peer_chunk: usize,
}

impl Transfer {
    /// The transfer the peer must post for this one to complete.
    pub fn counterpart(&self, rank: usize) -> Transfer {
        Transfer {
            direction: match self.direction {
                Direction::Send => Direction::Recv,
                Direction::Recv => Direction::Send,
            },
            payload: self.payload,
            microbatch: self.microbatch,
            chunk: self.peer_chunk,
            peer: rank,
            peer_chunk: self.chunk,
        }
    }
}

impl fmt::Display for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.payload {
            Payload::Activation => "activation",
            Payload::Grad => "grad",
        };
        let (verb, dir) = match self.direction {
            Direction::Send => ("send", "to"),
            Direction::Recv => ("recv", "from"),
        };
        write!(
            f,
            "{verb} {what} of mb {} (chunk {}) {dir} rank {} chunk {}",
            self.microbatch, self.chunk, self.peer, self.peer_chunk
        )
    }
}

/// One step of a rank's program: a batch of transfers posted together and waited on together,
/// or a computation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Sends of the previous computation's outputs and receives of the next one's inputs.
    Exchange(Vec<Transfer>),
    /// A forward or backward pass.
    Compute(Action),
}

/// How a rank batches its sends and receives into [`Step::Exchange`]s (each batch is posted
/// at once and waited on as a whole, like `torch.distributed.batch_isend_irecv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fusion {
    /// Megatron's non-interleaved 1F1B: warm-up and cool-down receive, compute and send one
    /// at a time; the steady phase fuses "send forward output, receive backward input"
    /// (`send_forward_recv_backward`) and "send backward output, receive next forward input"
    /// (`send_backward_recv_forward`).
    OneFOneB,
    /// Megatron's interleaved 1F1B: one batch per schedule iteration (a warm-up forward, a
    /// steady "forward, backward" pair or a cool-down backward) sending the iteration's outputs
    /// and receiving all inputs of the next iteration
    /// (`send_forward_backward_recv_forward_backward`).
    Pairs,
    /// One batch between consecutive computations: the previous one's output and the next
    /// one's input (the default for [`PipelineSchedule::from_actions`]).
    Adjacent,
}

/// Unit costs of the discrete-event model (time steps per pass of one model chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Costs {
    /// Time of one forward pass of one chunk.
    pub forward: u64,
    /// Time of one backward pass of one chunk.
    pub backward: u64,
}

impl Default for Costs {
    /// Forward 1, backward 2 (the usual `t_b ≈ 2·t_f`).
    fn default() -> Self {
        Costs {
            forward: 1,
            backward: 2,
        }
    }
}

/// Outcome of [`PipelineSchedule::simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Time at which the last rank finishes.
    pub makespan: u64,
    /// Compute time of each rank.
    pub busy: Vec<u64>,
    /// Time at which each rank finishes its last step.
    pub finish: Vec<u64>,
}

impl Simulation {
    /// Idle share of the pipeline's device time: `1 − Σ busy / (pp · makespan)`.
    pub fn bubble_fraction(&self) -> f64 {
        if self.makespan == 0 {
            return 0.0;
        }
        let busy: u64 = self.busy.iter().sum();
        1.0 - busy as f64 / (self.busy.len() as u64 * self.makespan) as f64
    }
}

/// Per-rank forward/backward order of a pipeline-parallel training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSchedule {
    pp: usize,
    vpp: usize,
    microbatches: usize,
    ranks: Vec<Vec<Action>>,
    warmup: Vec<usize>,
    fusion: Fusion,
}

fn payload_of(action: Action) -> Payload {
    if action.is_forward() {
        Payload::Activation
    } else {
        Payload::Grad
    }
}

fn config(field: &'static str, detail: impl Into<String>) -> BackendError {
    BackendError::Config {
        field,
        detail: detail.into(),
    }
}

impl PipelineSchedule {
    /// Megatron's non-interleaved 1F1B schedule (`forward_backward_pipelining_without_interleaving`)
    /// of `microbatches` micro-batches over `pp` stages. `pp = 1` gives "F0 B0 F1 B1 …", the
    /// order of Megatron's no-pipelining path.
    pub fn one_f_one_b(pp: usize, microbatches: usize) -> Result<Self> {
        check_common(pp, 1, microbatches)?;
        let warmup: Vec<usize> = (0..pp)
            .map(|rank| (pp - rank - 1).min(microbatches))
            .collect();
        let ranks = warmup
            .iter()
            .map(|&w| build(pp, 1, microbatches, w))
            .collect();
        Ok(Self {
            pp,
            vpp: 1,
            microbatches,
            ranks,
            warmup,
            fusion: Fusion::OneFOneB,
        })
    }

    /// Megatron's interleaved 1F1B schedule (`forward_backward_pipelining_with_interleaving`,
    /// default `microbatch_group_size_per_vp_stage = pp`) with `vpp` model chunks per rank.
    ///
    /// `vpp = 1` is [`Self::one_f_one_b`]. With `vpp > 1`, `microbatches` must be at least `pp`
    /// and a multiple of `pp`. Megatron sends `pp = 1` to its no-pipelining path; here `pp = 1`
    /// uses the same warm-up formula, `vpp − 1` forwards, which is a valid order for one rank.
    pub fn interleaved(pp: usize, vpp: usize, microbatches: usize) -> Result<Self> {
        check_common(pp, vpp, microbatches)?;
        if vpp == 1 {
            return Self::one_f_one_b(pp, microbatches);
        }
        if microbatches < pp {
            return Err(config(
                "microbatches",
                format!(
                    "the interleaved schedule (vpp = {vpp}) needs at least pp = {pp} micro-batches, got {microbatches}"
                ),
            ));
        }
        if !microbatches.is_multiple_of(pp) {
            return Err(config(
                "microbatches",
                format!(
                    "the interleaved schedule (vpp = {vpp}) needs a multiple of pp = {pp} micro-batches, got {microbatches}"
                ),
            ));
        }
        let total = microbatches * vpp;
        let warmup: Vec<usize> = (0..pp)
            .map(|rank| (2 * (pp - rank - 1) + (vpp - 1) * pp).min(total))
            .collect();
        let ranks = warmup
            .iter()
            .map(|&w| build(pp, vpp, microbatches, w))
            .collect();
        Ok(Self {
            pp,
            vpp,
            microbatches,
            ranks,
            warmup,
            fusion: Fusion::Pairs,
        })
    }

    /// A schedule from explicit per-rank action lists (for custom orders; checked only for
    /// shape, use [`Self::simulate`] to check that it runs).
    pub fn from_actions(
        pp: usize,
        vpp: usize,
        microbatches: usize,
        ranks: Vec<Vec<Action>>,
    ) -> Result<Self> {
        check_common(pp, vpp, microbatches)?;
        if ranks.len() != pp {
            return Err(config(
                "pp",
                format!("{} action lists for pp = {pp} ranks", ranks.len()),
            ));
        }
        for (rank, actions) in ranks.iter().enumerate() {
            if let Some(a) = actions
                .iter()
                .find(|a| a.microbatch() >= microbatches || a.chunk() >= vpp)
            {
                return Err(config(
                    "schedule",
                    format!(
                        "rank {rank}: {a} is outside {microbatches} micro-batches × {vpp} chunks"
                    ),
                ));
            }
        }
        let warmup = ranks
            .iter()
            .map(|actions| {
                let lead = actions.iter().take_while(|a| a.is_forward()).count();
                let forwards = actions.iter().filter(|a| a.is_forward()).count();
                if lead == forwards {
                    lead
                } else {
                    lead.saturating_sub(1)
                }
            })
            .collect();
        Ok(Self {
            pp,
            vpp,
            microbatches,
            ranks,
            warmup,
            fusion: Fusion::Adjacent,
        })
    }

    /// Pipeline-parallel size.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Model chunks per rank (1 for non-interleaved).
    pub fn vpp(&self) -> usize {
        self.vpp
    }

    /// Micro-batches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The ordered computations of pipeline rank `rank`.
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.ranks[rank]
    }

    /// Virtual stage of chunk `chunk` of rank `rank`: `chunk·pp + rank`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.pp + rank
    }

    /// Warm-up forwards of `rank` before the first steady "forward, backward" pair: Megatron's
    /// `min(pp − rank − 1, m)` for 1F1B and `min(2·(pp − rank − 1) + (vpp − 1)·pp, m·vpp)` for
    /// the interleaved schedule. For [`Self::from_actions`]: the forwards before the first
    /// backward, less the one that opens the steady phase (all of them when none follows).
    pub fn warmup(&self, rank: usize) -> usize {
        self.warmup[rank]
    }

    /// Steady-state "forward, backward" pairs of `rank`: its forwards less the warm-up.
    pub fn steady(&self, rank: usize) -> usize {
        self.forwards(rank).saturating_sub(self.warmup(rank))
    }

    /// Cool-down backwards of `rank`: its backwards less the steady ones (the warm-up count for
    /// Megatron's schedules).
    pub fn cooldown(&self, rank: usize) -> usize {
        let backwards = self.ranks[rank].len() - self.forwards(rank);
        backwards.saturating_sub(self.steady(rank))
    }

    fn forwards(&self, rank: usize) -> usize {
        self.ranks[rank].iter().filter(|a| a.is_forward()).count()
    }

    /// Largest number of (micro-batch, chunk) pairs of `rank` whose forward has run and whose
    /// backward has not: the activations the rank holds at its peak.
    pub fn max_in_flight(&self, rank: usize) -> usize {
        self.in_flight_at_peak(rank).iter().sum()
    }

    /// Per chunk, the (micro-batch, chunk) pairs in flight on `rank` at the first moment the
    /// total reaches [`Self::max_in_flight`].
    pub fn in_flight_at_peak(&self, rank: usize) -> Vec<usize> {
        let mut now = vec![0usize; self.vpp];
        let mut best = now.clone();
        let mut best_total = 0;
        let mut total = 0usize;
        for a in &self.ranks[rank] {
            if a.is_forward() {
                now[a.chunk()] += 1;
                total += 1;
                if total > best_total {
                    best_total = total;
                    best.clone_from(&now);
                }
            } else {
                now[a.chunk()] = now[a.chunk()].saturating_sub(1);
                total = total.saturating_sub(1);
            }
        }
        best
    }

    /// Where the input of `action` on `rank` comes from: `(rank, chunk)` of the previous virtual
    /// stage for a forward, of the next one for a backward; `None` at the ends of the pipeline.
    pub fn input_of(&self, rank: usize, action: Action) -> Option<(usize, usize)> {
        let vs = self.virtual_stage(rank, action.chunk());
        let last = self.pp * self.vpp - 1;
        let other = if action.is_forward() {
            vs.checked_sub(1)?
        } else if vs < last {
            vs + 1
        } else {
            return None;
        };
        Some((other % self.pp, other / self.pp))
    }

    /// Where the output of `action` on `rank` goes: `(rank, chunk)` of the next virtual stage for
    /// a forward, of the previous one for a backward; `None` at the ends of the pipeline.
    pub fn output_of(&self, rank: usize, action: Action) -> Option<(usize, usize)> {
        let flipped = match action {
            Action::Forward { microbatch, chunk } => Action::backward(microbatch, chunk),
            Action::Backward { microbatch, chunk } => Action::forward(microbatch, chunk),
        };
        self.input_of(rank, flipped)
    }

    /// How transfers are batched in [`Self::steps`].
    pub fn fusion(&self) -> Fusion {
        self.fusion
    }

    /// The same schedule with transfers batched as `fusion` says.
    pub fn with_fusion(mut self, fusion: Fusion) -> Self {
        self.fusion = fusion;
        self
    }

    /// The receive `action` on `rank` posts for its input, unless it has none or it comes from
    /// the same rank.
    pub fn recv_of(&self, rank: usize, action: Action) -> Option<Transfer> {
        let (peer, peer_chunk) = self.input_of(rank, action)?;
        (peer != rank).then(|| Transfer {
            direction: Direction::Recv,
            payload: payload_of(action),
            microbatch: action.microbatch(),
            chunk: action.chunk(),
            peer,
            peer_chunk,
        })
    }

    /// The send `action` on `rank` posts for its output, unless it has none or it goes to the
    /// same rank.
    pub fn send_of(&self, rank: usize, action: Action) -> Option<Transfer> {
        let (peer, peer_chunk) = self.output_of(rank, action)?;
        (peer != rank).then(|| Transfer {
            direction: Direction::Send,
            payload: payload_of(action),
            microbatch: action.microbatch(),
            chunk: action.chunk(),
            peer,
            peer_chunk,
        })
    }

    /// The program of `rank`: its computations with the [`Step::Exchange`] batches between
    /// them, as [`Self::fusion`] groups them (empty batches omitted). Transfers between chunks of
    /// the same rank (`pp = 1`) are local and not listed.
    pub fn steps(&self, rank: usize) -> Vec<Step> {
        let actions = &self.ranks[rank];
        let mut steps = Vec::new();
        let exchange = |steps: &mut Vec<Step>, ops: Vec<Option<Transfer>>| {
            let ops: Vec<Transfer> = ops.into_iter().flatten().collect();
            if !ops.is_empty() {
                steps.push(Step::Exchange(ops));
            }
        };
        let units: Vec<&[Action]> = match self.fusion {
            Fusion::Adjacent => actions.chunks(1).collect(),
            Fusion::Pairs => {
                let w = self.warmup(rank).min(actions.len());
                let pairs = 2 * self.steady(rank);
                let mut units: Vec<&[Action]> = actions[..w].chunks(1).collect();
                units.extend(actions[w..(w + pairs).min(actions.len())].chunks(2));
                units.extend(actions[(w + pairs).min(actions.len())..].chunks(1));
                units
            }
            Fusion::OneFOneB => {
                let w = self.warmup(rank).min(actions.len());
                let pairs = (2 * self.steady(rank)).min(actions.len() - w);
                for &a in &actions[..w] {
                    exchange(&mut steps, vec![self.recv_of(rank, a)]);
                    steps.push(Step::Compute(a));
                    exchange(&mut steps, vec![self.send_of(rank, a)]);
                }
                let steady = &actions[w..w + pairs];
                if let Some(&first) = steady.first() {
                    exchange(&mut steps, vec![self.recv_of(rank, first)]);
                }
                for (i, &a) in steady.iter().enumerate() {
                    steps.push(Step::Compute(a));
                    let next = steady.get(i + 1).and_then(|&n| self.recv_of(rank, n));
                    exchange(&mut steps, vec![self.send_of(rank, a), next]);
                }
                for &a in &actions[w + pairs..] {
                    exchange(&mut steps, vec![self.recv_of(rank, a)]);
                    steps.push(Step::Compute(a));
                    exchange(&mut steps, vec![self.send_of(rank, a)]);
                }
                return steps;
            }
        };
        let mut previous: &[Action] = &[];
        for unit in units {
            let mut ops: Vec<Option<Transfer>> =
                previous.iter().map(|&a| self.send_of(rank, a)).collect();
            ops.extend(unit.iter().map(|&a| self.recv_of(rank, a)));
            exchange(&mut steps, ops);
            steps.extend(unit.iter().map(|&a| Step::Compute(a)));
            previous = unit;
        }
        let last: Vec<Option<Transfer>> = previous.iter().map(|&a| self.send_of(rank, a)).collect();
        exchange(&mut steps, last);
        steps
    }

    /// [`Self::simulate_with`] with forward = 1, backward = 2.
    pub fn simulate(&self) -> Result<Simulation> {
        self.simulate_with(Costs::default())
    }

    /// Runs every rank's [`Self::steps`] in a discrete-event model: computations take their
    /// [`Costs`], transfers take no time, and an exchange completes when every transfer in it
    /// has met its counterpart in the peer's currently posted exchange (blocking, rendezvous
    /// semantics). Also checks that every (micro-batch, chunk) runs forward and backward exactly
    /// once per rank, each backward after its forward, and that same-rank inputs (`pp = 1`)
    /// exist when needed.
    ///
    /// Errors (`BackendError::Config { field: "schedule" }`) name the rank and action of the
    /// first violation, or every blocked rank and what it waits for on a deadlock.
    pub fn simulate_with(&self, costs: Costs) -> Result<Simulation> {
        let programs: Vec<Vec<Step>> = (0..self.pp).map(|r| self.steps(r)).collect();
        self.run_model(&programs, costs, true)
    }

    /// [`Self::simulate`] of the forward-only programs ([`Self::forward_steps`]): proves that
    /// a forward-only pass (Megatron's `forward_only`) completes under rendezvous semantics.
    pub fn simulate_forward(&self) -> Result<Simulation> {
        let programs: Vec<Vec<Step>> = (0..self.pp).map(|r| self.forward_steps(r)).collect();
        self.run_model(&programs, Costs::default(), false)
    }

    /// The program of `rank` for a forward-only pass: its forwards in the schedule's order,
    /// with one [`Step::Exchange`] between consecutive forwards (the previous one's output
    /// sent, the next one's input received), as Megatron's forward-only pass batches
    /// `send_forward_recv_forward`. Same-rank hand-offs (`pp = 1`) are not listed.
    pub fn forward_steps(&self, rank: usize) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut previous: Option<Action> = None;
        for &a in self.ranks[rank].iter().filter(|a| a.is_forward()) {
            let ops: Vec<Transfer> = [
                previous.and_then(|p| self.send_of(rank, p)),
                self.recv_of(rank, a),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !ops.is_empty() {
                steps.push(Step::Exchange(ops));
            }
            steps.push(Step::Compute(a));
            previous = Some(a);
        }
        if let Some(t) = previous.and_then(|p| self.send_of(rank, p)) {
            steps.push(Step::Exchange(vec![t]));
        }
        steps
    }

    /// Sorts the transfers of one exchange of `rank` into the order they are posted: by
    /// payload (activations first), micro-batch, then the virtual stage that produced the
    /// tensor. Both ends compute the same key for a message, so when the batches of two ranks
    /// meet, the messages between them are posted in the same order on both ends — what a
    /// transport that matches a pair's messages in issue order (NCCL, TCP, MPI) needs.
    pub fn posting_order(&self, rank: usize, ops: &mut [Transfer]) {
        ops.sort_by_key(|t| self.message_key(rank, t));
    }

    /// `(payload, micro-batch, producing virtual stage)` of a transfer posted by `rank`.
    fn message_key(&self, rank: usize, t: &Transfer) -> (u8, usize, usize) {
        let producer = match t.direction {
            Direction::Send => self.virtual_stage(rank, t.chunk),
            Direction::Recv => self.virtual_stage(t.peer, t.peer_chunk),
        };
        (u8::from(t.payload == Payload::Grad), t.microbatch, producer)
    }

    /// Checks that the programs ([`Self::steps`], or [`Self::forward_steps`] when
    /// `forward_only`) can run over ONE channel per pair of ranks that matches messages in
    /// issue order: for every ordered pair `(src, dst)`, the messages `src` posts to `dst`
    /// (exchanges in program order, each in [`Self::posting_order`]) are the messages `dst`
    /// asks `src` for, in the same order. An error names the two ranks and the first
    /// difference.
    pub fn check_matching(&self, forward_only: bool) -> Result<()> {
        type Key = (u8, usize, usize);
        let mut sent: HashMap<(usize, usize), Vec<Key>> = HashMap::new();
        let mut asked: HashMap<(usize, usize), Vec<Key>> = HashMap::new();
        for rank in 0..self.pp {
            let program = if forward_only {
                self.forward_steps(rank)
            } else {
                self.steps(rank)
            };
            for step in program {
                let Step::Exchange(mut ops) = step else {
                    continue;
                };
                self.posting_order(rank, &mut ops);
                for t in &ops {
                    let key = self.message_key(rank, t);
                    match t.direction {
                        Direction::Send => sent.entry((rank, t.peer)).or_default().push(key),
                        Direction::Recv => asked.entry((t.peer, rank)).or_default().push(key),
                    }
                }
            }
        }
        let mut pairs: Vec<(usize, usize)> = sent.keys().chain(asked.keys()).copied().collect();
        pairs.sort_unstable();
        pairs.dedup();
        for (src, dst) in pairs {
            let posted = sent.get(&(src, dst)).map(Vec::as_slice).unwrap_or_default();
            let wanted = asked
                .get(&(src, dst))
                .map(Vec::as_slice)
                .unwrap_or_default();
            if posted != wanted {
                let at = posted
                    .iter()
                    .zip(wanted)
                    .position(|(a, b)| a != b)
                    .unwrap_or(posted.len().min(wanted.len()));
                let show = |k: Option<&Key>| match k {
                    Some(&(kind, mb, vs)) => format!(
                        "the {} of micro-batch {mb} from virtual stage {vs}",
                        if kind == 0 { "activation" } else { "gradient" }
                    ),
                    None => "nothing".into(),
                };
                return Err(config(
                    "schedule",
                    format!(
                        "pipeline rank {src} posts {} as its message {at} to rank {dst}, which \
                         asks for {} ({} messages posted, {} asked for)",
                        show(posted.get(at)),
                        show(wanted.get(at)),
                        posted.len(),
                        wanted.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The discrete-event model of [`Self::simulate_with`] on `programs`; `with_backwards`:
    /// every (micro-batch, chunk) must also run backward.
    fn run_model(
        &self,
        programs: &[Vec<Step>],
        costs: Costs,
        with_backwards: bool,
    ) -> Result<Simulation> {
        let pp = self.pp;
        let mut pc = vec![0usize; pp];
        let mut clock = vec![0u64; pp];
        let mut busy = vec![0u64; pp];
        // Per rank: (is_forward, microbatch, chunk) -> completion time.
        let mut done: Vec<HashMap<(bool, usize, usize), u64>> = vec![HashMap::new(); pp];

        let reset = |programs: &[Vec<Step>], pc: &[usize], r: usize| -> Vec<Option<u64>> {
            match programs[r].get(pc[r]) {
                Some(Step::Exchange(ops)) => vec![None; ops.len()],
                _ => Vec::new(),
            }
        };
        // Per rank and op of the current exchange: time the op was matched.
        let mut matched: Vec<Vec<Option<u64>>> = (0..pp).map(|r| reset(programs, &pc, r)).collect();

        loop {
            let mut progress = false;
            for r in 0..pp {
                while let Some(step) = programs[r].get(pc[r]) {
                    match step {
                        Step::Compute(action) => {
                            self.check_compute(r, *action, &done[r])?;
                            let cost = if action.is_forward() {
                                costs.forward
                            } else {
                                costs.backward
                            };
                            clock[r] += cost;
                            busy[r] += cost;
                            done[r].insert(
                                (action.is_forward(), action.microbatch(), action.chunk()),
                                clock[r],
                            );
                        }
                        Step::Exchange(ops) => {
                            for i in 0..ops.len() {
                                if matched[r][i].is_some() {
                                    continue;
                                }
                                let want = ops[i].counterpart(r);
                                let p = ops[i].peer;
                                if let Some(Step::Exchange(peer_ops)) = programs[p].get(pc[p])
                                    && let Some(j) = peer_ops
                                        .iter()
                                        .enumerate()
                                        .position(|(j, t)| *t == want && matched[p][j].is_none())
                                {
                                    let at = clock[r].max(clock[p]);
                                    matched[r][i] = Some(at);
                                    matched[p][j] = Some(at);
                                }
                            }
                            if matched[r].iter().any(Option::is_none) {
                                break;
                            }
                            let at = matched[r].iter().flatten().copied().max().unwrap_or(0);
                            clock[r] = clock[r].max(at);
                        }
                    }
                    pc[r] += 1;
                    matched[r] = reset(programs, &pc, r);
                    progress = true;
                }
            }
            if (0..pp).all(|r| pc[r] == programs[r].len()) {
                break;
            }
            if !progress {
                return Err(config(
                    "schedule",
                    self.deadlock_report(programs, &pc, &matched),
                ));
            }
        }

        let expected = self.microbatches * self.vpp;
        for (r, d) in done.iter().enumerate() {
            let forwards = d.keys().filter(|k| k.0).count();
            let backwards = d.len() - forwards;
            let expected_backwards = if with_backwards { expected } else { 0 };
            if forwards != expected || backwards != expected_backwards {
                return Err(config(
                    "schedule",
                    format!(
                        "rank {r} runs {forwards} forwards and {backwards} backwards, expected {}",
                        if with_backwards {
                            format!("{expected} each")
                        } else {
                            format!("{expected} forwards and no backward")
                        }
                    ),
                ));
            }
        }
        Ok(Simulation {
            makespan: clock.iter().copied().max().unwrap_or(0),
            busy,
            finish: clock,
        })
    }

    fn check_compute(
        &self,
        rank: usize,
        action: Action,
        done: &HashMap<(bool, usize, usize), u64>,
    ) -> Result<()> {
        let (mb, c) = (action.microbatch(), action.chunk());
        if done.contains_key(&(action.is_forward(), mb, c)) {
            return Err(config(
                "schedule",
                format!("rank {rank}: {action} runs twice"),
            ));
        }
        if !action.is_forward() && !done.contains_key(&(true, mb, c)) {
            return Err(config(
                "schedule",
                format!("rank {rank}: {action} before its forward"),
            ));
        }
        if let Some((peer, peer_chunk)) = self.input_of(rank, action)
            && peer == rank
            && !done.contains_key(&(action.is_forward(), mb, peer_chunk))
        {
            let needed = if action.is_forward() {
                Action::forward(mb, peer_chunk)
            } else {
                Action::backward(mb, peer_chunk)
            };
            return Err(config(
                "schedule",
                format!(
                    "deadlock: rank {rank}: {action} needs {needed} of the same rank, which has not run"
                ),
            ));
        }
        Ok(())
    }

    fn deadlock_report(
        &self,
        programs: &[Vec<Step>],
        pc: &[usize],
        matched: &[Vec<Option<u64>>],
    ) -> String {
        let mut parts = Vec::new();
        for (r, program) in programs.iter().enumerate() {
            let Some(Step::Exchange(ops)) = program.get(pc[r]) else {
                continue;
            };
            let next = program[pc[r]..]
                .iter()
                .find_map(|s| match s {
                    Step::Compute(a) => Some(a.to_string()),
                    Step::Exchange(_) => None,
                })
                .unwrap_or_else(|| "the end".into());
            let waiting: Vec<String> = ops
                .iter()
                .zip(&matched[r])
                .filter(|(_, m)| m.is_none())
                .map(|(t, _)| t.to_string())
                .collect();
            parts.push(format!(
                "rank {r} (before {next}) waits to {}",
                waiting.join(", ")
            ));
        }
        format!("deadlock: {}", parts.join("; "))
    }
}

fn check_common(pp: usize, vpp: usize, microbatches: usize) -> Result<()> {
    if pp == 0 {
        return Err(config("pp", "pipeline-parallel size must be at least 1"));
    }
    if vpp == 0 {
        return Err(config("vpp", "virtual pipeline size must be at least 1"));
    }
    if microbatches == 0 {
        return Err(config("microbatches", "need at least one micro-batch"));
    }
    Ok(())
}

/// Forward `k` of a rank: micro-batch and chunk of Megatron's schedule table with groups of `pp`
/// micro-batches per chunk (`microbatches` a multiple of `pp`, or `vpp = 1`).
fn table(pp: usize, vpp: usize, k: usize) -> (usize, usize) {
    if vpp == 1 {
        return (k, 0);
    }
    let round = k / (pp * vpp);
    ((round * pp) + k % pp, (k / pp) % vpp)
}

/// Warm-up forwards, steady "forward, backward" pairs, cool-down backwards.
fn build(pp: usize, vpp: usize, microbatches: usize, warmup: usize) -> Vec<Action> {
    let total = microbatches * vpp;
    let fwd = |k: usize| {
        let (mb, c) = table(pp, vpp, k);
        Action::forward(mb, c)
    };
    let bwd = |k: usize| {
        let (mb, c) = table(pp, vpp, k);
        Action::backward(mb, vpp - 1 - c)
    };
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(fwd));
    for i in 0..total - warmup {
        out.push(fwd(warmup + i));
        out.push(bwd(i));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}
