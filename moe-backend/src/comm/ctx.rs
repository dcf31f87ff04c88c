//! One rank's view of its world, whatever the transport: its rank, the world size and the
//! communicators of its process groups.
//!
//! The same [`RankCtx`] is handed to the rank closure of the in-process [`World`](super::World)
//! (ranks are threads) and of a process world ([`super::mpi::MpiWorld`], feature `mpi`), so
//! training code written against it runs unchanged on either.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use super::Comm;
use super::local::{self, Shared};
use crate::error::{BackendError, Result};
use crate::parallel::pipeline::PipelineChannels;
use crate::parallel::{GroupFamily, GroupTable, ParallelLayout, ProcessGroups};

/// Creates the communicator of one group on a process transport.
pub(crate) trait Connector: Send + Sync {
    /// Transport name for messages (`mpi`).
    fn name(&self) -> &'static str;
    /// The communicator of `ranks` (global ranks in member order; this rank is member
    /// `index`). Called by every member of the group, in the same order of groups.
    fn connect(&self, key: &str, ranks: &[usize], index: usize) -> Result<Comm>;
}

/// Where a rank's communicators come from.
pub(crate) enum Transport {
    /// The shared-memory rendezvous of an in-process world.
    Local(Arc<Shared>),
    /// A process transport (TCP, MPI, NCCL).
    Process(Arc<dyn Connector>),
}

/// One rank's view of the world: its rank and the communicators of its groups.
pub struct RankCtx {
    rank: usize,
    size: usize,
    transport: Transport,
    groups: Mutex<HashMap<String, Comm>>,
}

impl fmt::Debug for RankCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let transport = match &self.transport {
            Transport::Local(_) => "threads",
            Transport::Process(c) => c.name(),
        };
        f.debug_struct("RankCtx")
            .field("rank", &self.rank)
            .field("world", &self.size)
            .field("transport", &transport)
            .finish()
    }
}

impl RankCtx {
    pub(crate) fn new(rank: usize, size: usize, transport: Transport) -> Self {
        Self {
            rank,
            size,
            transport,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// Whether the ranks are processes (`false` for the threads of an in-process world).
    pub fn is_multiprocess(&self) -> bool {
        matches!(self.transport, Transport::Process(_))
    }

    /// The communicator of all ranks.
    pub fn world(&self) -> Result<Comm> {
        let all: Vec<usize> = (0..self.size).collect();
        self.group("world", &all)
    }

    /// The communicator of the group `ranks` (global ranks in member order), which must
    /// contain this rank. `name` separates independent groups with the same members (e.g.
    /// `ep` and `tp_ep`); asking twice for the same name and ranks returns the same channel.
    /// Every member must ask for its groups in the same order (on a process transport,
    /// creating a group is a collective of its members).
    pub fn group(&self, name: &str, ranks: &[usize]) -> Result<Comm> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() {
            return Err(BackendError::Layout {
                field: "group",
                detail: format!("group `{name}` {ranks:?} repeats a rank"),
            });
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.size) {
            return Err(BackendError::Layout {
                field: "group",
                detail: format!(
                    "group `{name}` names rank {bad} in a world of {}",
                    self.size
                ),
            });
        }
        let index =
            ranks
                .iter()
                .position(|&r| r == self.rank)
                .ok_or_else(|| BackendError::Layout {
                    field: "group",
                    detail: format!(
                        "rank {} is not a member of group `{name}` {ranks:?}",
                        self.rank
                    ),
                })?;
        let key = format!("{name}{ranks:?}");
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(comm) = groups.get(&key) {
            return Ok(comm.clone());
        }
        let comm = match &self.transport {
            Transport::Local(shared) => local::connect(shared, &key, ranks, index),
            Transport::Process(connector) => connector.connect(&key, ranks, index)?,
        };
        groups.insert(key, comm.clone());
        Ok(comm)
    }

    /// Communicators for every group family of `layout` this rank belongs to, created in the
    /// deterministic order of [`GroupFamily::ALL`].
    pub fn process_groups(&self, layout: &ParallelLayout) -> Result<GroupComms> {
        if layout.world != self.size {
            return Err(BackendError::Layout {
                field: "world",
                detail: format!(
                    "layout is for {} ranks but the world has {}",
                    layout.world, self.size
                ),
            });
        }
        let groups = GroupTable::new(layout)?.for_rank(self.rank)?;
        let comms = groups
            .iter()
            .map(|m| self.group(m.family.name(), &m.ranks))
            .collect::<Result<Vec<_>>>()?;
        // The pipeline's point-to-point channel and Megatron's embedding
        // group (first and last pipeline stage: the tied or MTP copy of the embedding),
        // created after the families in the same order on every rank; without a pipeline,
        // the one-member `pp` communicator stands for the channels (never used).
        let pp = groups.get(GroupFamily::Pp).clone();
        let (pp_p2p, embedding) = if pp.size() == 1 {
            let at = GroupFamily::ALL.iter().position(|f| *f == GroupFamily::Pp);
            (comms[at.unwrap_or_default()].clone(), None)
        } else {
            let p2p = self.group("pp_p2p", &pp.ranks)?;
            let ends = [pp.ranks[0], pp.ranks[pp.size() - 1]];
            let embedding = if ends.contains(&self.rank) {
                Some(self.group("pp_embedding", &ends)?)
            } else {
                None
            };
            (p2p, embedding)
        };
        Ok(GroupComms {
            groups,
            comms,
            pp_p2p,
            embedding,
        })
    }
}

/// A rank's [`ProcessGroups`] with a communicator for each.
#[derive(Debug, Clone)]
pub struct GroupComms {
    /// Memberships.
    pub groups: ProcessGroups,
    comms: Vec<Comm>,
    /// The pipeline's point-to-point channel over the `pp` group's members (activations and
    /// their gradients, batched per exchange), apart from the `pp` communicator so its traffic
    /// counter holds only the pipeline's transfers.
    pp_p2p: Comm,
    /// The first and last stage of this rank's pipeline (`None` on the stages between).
    embedding: Option<Comm>,
}

impl GroupComms {
    /// The groups of a world of one rank (`ParallelLayout::single()`), on the calling thread:
    /// every group has this rank alone and every collective is the identity. What a model's
    /// single-rank forward runs on (the parallel forward at `world = 1`).
    pub fn single() -> Result<Self> {
        local::single_ctx().process_groups(&ParallelLayout::single())
    }

    /// The point-to-point channel of this rank's pipeline group (activations and their
    /// gradients on one communicator over the `pp` group's members, as Megatron's).
    pub fn pipeline_channels(&self) -> PipelineChannels {
        PipelineChannels {
            p2p: self.pp_p2p.clone(),
        }
    }

    /// Megatron's embedding group: the first and the last stage of this rank's pipeline, over
    /// which the gradients of an embedding held on both (tied output layer, MTP) are summed;
    /// `None` on the stages between and without pipeline parallelism.
    pub fn embedding_group(&self) -> Option<&Comm> {
        self.embedding.as_ref()
    }

    /// The communicator of `family`.
    pub fn comm(&self, family: GroupFamily) -> &Comm {
        let at = GroupFamily::ALL
            .iter()
            .position(|f| *f == family)
            .unwrap_or_default();
        &self.comms[at]
    }
}

/// Runs a rank's closure, turning a panic into [`BackendError::RankPanicked`] with its message.
pub(crate) fn catch_rank<T>(rank: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "non-string panic payload".into());
        Err(BackendError::RankPanicked { rank, message })
    })
}
