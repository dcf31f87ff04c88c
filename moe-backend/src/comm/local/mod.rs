//! The in-process world: SPMD ranks as threads exchanging tensor data through shared memory.
//!
//! Every collective is a rendezvous: each member posts a signature (op, dtype, shape, splits,
//! call site) and one payload per destination into the slot `(group, sequence number)`, waits
//! until all members have posted, takes the payloads addressed to it, and checks that the
//! signatures agree. Failures (a rank returning an error, panicking, exiting early, or a
//! timeout) are recorded once for the whole world and wake every waiting rank.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use std::ops::Range;

use burn::tensor::DType;

use super::buffer::HostBuffer;
use super::ctx::{RankCtx, Transport, catch_rank};
use super::{CallSite, Comm, PointToPoint};
use crate::error::{BackendError, Result};

mod collectives;
mod rendezvous;

use rendezvous::LocalComm;

/// Settings of an in-process world.
#[derive(Debug, Clone)]
pub struct WorldConfig {
    /// How long a collective waits for the other members before failing the world.
    pub timeout: Duration,
    /// Stack size of each rank thread.
    pub stack_bytes: usize,
    /// Whether point-to-point sends are buffered (the default) or rendezvous (NCCL's
    /// semantics, for tests that prove a program does not rely on buffering).
    pub p2p: PointToPoint,
}

impl Default for WorldConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stack_bytes: 16 << 20,
            p2p: PointToPoint::Buffered,
        }
    }
}

/// Bytes one member addresses to another: a range of a buffer shared between the threads
/// (a block of the sender's tensor is not copied until the receiver assembles its result).
#[derive(Clone)]
struct Payload {
    buf: Arc<HostBuffer>,
    range: Range<usize>,
}

impl Payload {
    fn whole(buf: &Arc<HostBuffer>) -> Self {
        Self {
            buf: Arc::clone(buf),
            range: 0..buf.bytes().len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf.bytes()[self.range.clone()]
    }
}

#[derive(Debug, Clone)]
struct Signature {
    op: &'static str,
    dtype: DType,
    shape: Vec<usize>,
    /// Op-specific sizes: splits, send splits.
    splits: Vec<usize>,
    /// Op-specific: receive splits.
    recv_splits: Vec<usize>,
    /// Op-specific scalar: reduce op or root.
    param: String,
    site: CallSite,
}

struct Post {
    sig: Signature,
    outgoing: Vec<Option<Payload>>,
}

struct Slot {
    posts: Vec<Option<Post>>,
    readers: usize,
}

struct Mail {
    sig: Signature,
    data: HostBuffer,
}

#[derive(Default)]
struct State {
    slots: HashMap<(Arc<str>, u64), Slot>,
    mail: HashMap<(Arc<str>, usize, usize), VecDeque<Mail>>,
    /// Per channel `(group, from, to)`: messages posted and messages received so far (a
    /// rendezvous send waits until the receiver has taken its message).
    posted: HashMap<(Arc<str>, usize, usize), u64>,
    taken: HashMap<(Arc<str>, usize, usize), u64>,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
}

pub(crate) struct Shared {
    size: usize,
    config: WorldConfig,
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records the first failure of the world and wakes every waiter.
    fn fail(&self, rank: usize, reason: String) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some((rank, reason));
        }
        drop(st);
        self.wake.notify_all();
    }

    fn exit(&self, rank: usize) {
        let mut st = self.lock();
        if let Some(flag) = st.exited.get_mut(rank) {
            *flag = true;
        }
        drop(st);
        self.wake.notify_all();
    }
}

/// An in-process world of SPMD ranks.
pub struct World;

impl World {
    /// Runs `f` on `size` ranks (one thread each) with the default [`WorldConfig`]; returns
    /// each rank's result in rank order.
    pub fn run<T, F>(size: usize, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(&RankCtx) -> Result<T> + Sync,
    {
        Self::run_with(size, WorldConfig::default(), f)
    }

    /// [`World::run`] with explicit settings.
    pub fn run_with<T, F>(size: usize, config: WorldConfig, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(&RankCtx) -> Result<T> + Sync,
    {
        let stack = config.stack_bytes;
        let shared = Arc::new(Shared {
            size,
            config,
            state: Mutex::new(State {
                exited: vec![false; size],
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..size)
                .map(|rank| {
                    let shared = Arc::clone(&shared);
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .stack_size(stack)
                        .spawn_scoped(scope, move || run_rank(shared, rank, f))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, handle)| match handle {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(BackendError::RankPanicked {
                            rank,
                            message: "thread could not be joined".into(),
                        })
                    }),
                    Err(e) => Err(BackendError::RankPanicked {
                        rank,
                        message: format!("thread could not be spawned: {e}"),
                    }),
                })
                .collect()
        })
    }
}

/// The context of a world of one rank on the calling thread: every group has one member, so
/// every collective is the identity and nothing ever waits on the rendezvous.
pub(crate) fn single_ctx() -> RankCtx {
    let shared = Arc::new(Shared {
        size: 1,
        config: WorldConfig::default(),
        state: Mutex::new(State {
            exited: vec![false],
            ..State::default()
        }),
        wake: Condvar::new(),
    });
    RankCtx::new(0, 1, Transport::Local(shared))
}

fn run_rank<T, F>(shared: Arc<Shared>, rank: usize, f: &F) -> Result<T>
where
    F: Fn(&RankCtx) -> Result<T> + Sync,
{
    let ctx = RankCtx::new(rank, shared.size, Transport::Local(Arc::clone(&shared)));
    let result = catch_rank(rank, || f(&ctx));
    if let Err(e) = &result {
        shared.fail(rank, e.to_string());
    }
    shared.exit(rank);
    result
}

/// The communicator of the group `ranks` (`index` is this rank's member index) on the shared
/// rendezvous of an in-process world.
pub(crate) fn connect(shared: &Arc<Shared>, key: &str, ranks: &[usize], index: usize) -> Comm {
    Comm::new(Arc::new(LocalComm {
        shared: Arc::clone(shared),
        key: Arc::from(key),
        ranks: ranks.to_vec(),
        index,
        seq: AtomicU64::new(0),
        calls: AtomicU64::new(0),
        bytes_sent: AtomicU64::new(0),
    }))
}
