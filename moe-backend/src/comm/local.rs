//! The in-process world: SPMD ranks as threads exchanging tensor data through shared memory.
//!
//! Every collective is a rendezvous: each member posts a signature (op, dtype, shape, splits,
//! call site) and one payload per destination into the slot `(group, sequence number)`, waits
//! until all members have posted, takes the payloads addressed to it, and checks that the
//! signatures agree. Failures (a rank returning an error, panicking, exiting early, or a
//! timeout) are recorded once for the whole world and wake every waiting rank.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};

use super::data::{
    concat_rows, reduce_blocks, rows_and_row_bytes, rows_to_data, split_rows, trailing,
};
use super::{CallSite, Comm, Communicator, ReduceOp, Traffic};
use crate::error::{BackendError, Result};
use crate::parallel::{GroupFamily, GroupTable, ParallelLayout, ProcessGroups};

/// Settings of an in-process world.
#[derive(Debug, Clone)]
pub struct WorldConfig {
    /// How long a collective waits for the other members before failing the world.
    pub timeout: Duration,
    /// Stack size of each rank thread.
    pub stack_bytes: usize,
}

impl Default for WorldConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stack_bytes: 16 << 20,
        }
    }
}

type Payload = Arc<TensorData>;

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
    data: TensorData,
}

#[derive(Default)]
struct State {
    slots: HashMap<(Arc<str>, u64), Slot>,
    mail: HashMap<(Arc<str>, usize, usize), VecDeque<Mail>>,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
}

struct Shared {
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

fn run_rank<T, F>(shared: Arc<Shared>, rank: usize, f: &F) -> Result<T>
where
    F: Fn(&RankCtx) -> Result<T> + Sync,
{
    let ctx = RankCtx {
        shared: Arc::clone(&shared),
        rank,
        groups: Mutex::new(HashMap::new()),
    };
    let result = match catch_unwind(AssertUnwindSafe(|| f(&ctx))) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(BackendError::RankPanicked { rank, message })
        }
    };
    if let Err(e) = &result {
        shared.fail(rank, e.to_string());
    }
    shared.exit(rank);
    result
}

/// One rank's view of the world: its rank and the communicators of its groups.
pub struct RankCtx {
    shared: Arc<Shared>,
    rank: usize,
    groups: Mutex<HashMap<String, Comm>>,
}

impl fmt::Debug for RankCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RankCtx")
            .field("rank", &self.rank)
            .field("world", &self.shared.size)
            .finish()
    }
}

impl RankCtx {
    /// Global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.size
    }

    /// The communicator of all ranks.
    pub fn world(&self) -> Result<Comm> {
        let all: Vec<usize> = (0..self.shared.size).collect();
        self.group("world", &all)
    }

    /// The communicator of the group `ranks` (global ranks in member order), which must
    /// contain this rank. `name` separates independent groups with the same members (e.g.
    /// `ep` and `tp_ep`); asking twice for the same name and ranks returns the same channel.
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
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.shared.size) {
            return Err(BackendError::Layout {
                field: "group",
                detail: format!(
                    "group `{name}` names rank {bad} in a world of {}",
                    self.shared.size
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
        let comm = groups.entry(key.clone()).or_insert_with(|| {
            Comm::new(Arc::new(LocalComm {
                shared: Arc::clone(&self.shared),
                key: Arc::from(key.as_str()),
                ranks: ranks.to_vec(),
                index,
                seq: AtomicU64::new(0),
                calls: AtomicU64::new(0),
                bytes_sent: AtomicU64::new(0),
            }))
        });
        Ok(comm.clone())
    }

    /// Communicators for every group family of `layout` this rank belongs to, created in the
    /// deterministic order of [`GroupFamily::ALL`].
    pub fn process_groups(&self, layout: &ParallelLayout) -> Result<GroupComms> {
        if layout.world != self.shared.size {
            return Err(BackendError::Layout {
                field: "world",
                detail: format!(
                    "layout is for {} ranks but the world has {}",
                    layout.world, self.shared.size
                ),
            });
        }
        let groups = GroupTable::new(layout)?.for_rank(self.rank)?;
        let comms = groups
            .iter()
            .map(|m| self.group(m.family.name(), &m.ranks))
            .collect::<Result<Vec<_>>>()?;
        Ok(GroupComms { groups, comms })
    }
}

/// A rank's [`ProcessGroups`] with a communicator for each.
#[derive(Debug, Clone)]
pub struct GroupComms {
    /// Memberships.
    pub groups: ProcessGroups,
    comms: Vec<Comm>,
}

impl GroupComms {
    /// The communicator of `family`.
    pub fn comm(&self, family: GroupFamily) -> &Comm {
        let at = GroupFamily::ALL
            .iter()
            .position(|f| *f == family)
            .unwrap_or_default();
        &self.comms[at]
    }
}

/// Transport of one group inside a [`World`].
struct LocalComm {
    shared: Arc<Shared>,
    key: Arc<str>,
    ranks: Vec<usize>,
    index: usize,
    seq: AtomicU64,
    calls: AtomicU64,
    bytes_sent: AtomicU64,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("group", &self.key)
            .field("rank", &self.index)
            .finish()
    }
}

fn describe(sig: &Signature) -> String {
    format!("{} at {}", sig.op, sig.site)
}

impl LocalComm {
    fn count(&self, bytes: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn group(&self) -> String {
        format!("{:?}", self.ranks)
    }

    fn me(&self) -> usize {
        self.ranks[self.index]
    }

    fn error(&self, op: &'static str, detail: String) -> BackendError {
        BackendError::Collective {
            op,
            group: self.group(),
            detail,
        }
    }

    fn aborted(&self, op: &'static str, failure: &(usize, String)) -> BackendError {
        BackendError::Aborted {
            op,
            group: self.group(),
            rank: failure.0,
            reason: failure.1.clone(),
        }
    }

    /// Posts this member's signature and payloads (one per destination member), waits for
    /// every member, and returns every member's signature with the payload sent to this member.
    fn exchange(
        &self,
        sig: Signature,
        outgoing: Vec<Option<Payload>>,
    ) -> Result<Vec<(Signature, Option<Payload>)>> {
        let n = self.ranks.len();
        let op = sig.op;
        let site = sig.site;
        let bytes: usize = outgoing
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.index)
            .filter_map(|(_, p)| p.as_ref().map(|d| d.as_bytes().len()))
            .sum();
        self.count(bytes);
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let key = (Arc::clone(&self.key), seq);
        let deadline = Instant::now() + self.shared.config.timeout;
        let mut st = self.shared.lock();
        if let Some(failure) = &st.failure {
            return Err(self.aborted(op, failure));
        }
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            posts: (0..n).map(|_| None).collect(),
            readers: 0,
        });
        slot.posts[self.index] = Some(Post { sig, outgoing });
        self.shared.wake.notify_all();
        loop {
            if let Some(failure) = &st.failure {
                return Err(self.aborted(op, failure));
            }
            let missing: Vec<usize> = match st.slots.get(&key) {
                Some(slot) => (0..n).filter(|&i| slot.posts[i].is_none()).collect(),
                None => Vec::new(),
            };
            if missing.is_empty() {
                break;
            }
            let missing_ranks: Vec<usize> = missing.iter().map(|&i| self.ranks[i]).collect();
            if let Some(&gone) = missing_ranks.iter().find(|&&r| st.exited[r]) {
                let reason = format!(
                    "rank {gone} finished without joining {op} (called by rank {} at {site})",
                    self.me()
                );
                drop(st);
                self.shared.fail(self.me(), reason.clone());
                return Err(self.error(op, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                let err = BackendError::Timeout {
                    op,
                    group: self.group(),
                    waiting: missing_ranks,
                    seconds: self.shared.config.timeout.as_secs_f64(),
                    site: site.to_string(),
                };
                self.shared.fail(self.me(), err.to_string());
                return Err(err);
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let mut received = Vec::with_capacity(n);
        let mut done = false;
        if let Some(slot) = st.slots.get_mut(&key) {
            for post in slot.posts.iter_mut().flatten() {
                let payload = post.outgoing.get_mut(self.index).and_then(Option::take);
                received.push((post.sig.clone(), payload));
            }
            slot.readers += 1;
            done = slot.readers == n;
        }
        if done {
            st.slots.remove(&key);
        }
        drop(st);
        // Every member checks the same signatures, so all report the same disagreement.
        let first = &received[0].0;
        for (i, (other, _)) in received.iter().enumerate().skip(1) {
            if other.op != first.op {
                return Err(self.error(
                    op,
                    format!(
                        "collective order mismatch: rank {} called {}, rank {} called {}",
                        self.ranks[0],
                        describe(first),
                        self.ranks[i],
                        describe(other)
                    ),
                ));
            }
            if other.dtype != first.dtype {
                return Err(self.error(
                    op,
                    format!(
                        "dtype mismatch: rank {} passed {:?} ({}), rank {} passed {:?} ({})",
                        self.ranks[0],
                        first.dtype,
                        first.site,
                        self.ranks[i],
                        other.dtype,
                        other.site
                    ),
                ));
            }
        }
        Ok(received)
    }

    fn sig(&self, op: &'static str, data: &TensorData, site: CallSite) -> Signature {
        Signature {
            op,
            dtype: data.dtype(),
            shape: data.shape().to_vec(),
            splits: Vec::new(),
            recv_splits: Vec::new(),
            param: String::new(),
            site,
        }
    }

    /// Error unless every member's signature satisfies `same` relative to member 0.
    fn agree(
        &self,
        op: &'static str,
        sigs: &[(Signature, Option<Payload>)],
        what: &str,
        same: impl Fn(&Signature, &Signature) -> bool,
        show: impl Fn(&Signature) -> String,
    ) -> Result<()> {
        let first = &sigs[0].0;
        for (i, (other, _)) in sigs.iter().enumerate().skip(1) {
            if !same(first, other) {
                return Err(self.error(
                    op,
                    format!(
                        "{what} mismatch: rank {} passed {} ({}), rank {} passed {} ({})",
                        self.ranks[0],
                        show(first),
                        first.site,
                        self.ranks[i],
                        show(other),
                        other.site
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_splits(
        &self,
        op: &'static str,
        data: &TensorData,
        splits: &[usize],
        what: &str,
        site: CallSite,
    ) -> Result<()> {
        let n = self.ranks.len();
        if splits.len() != n {
            return Err(self.error(
                op,
                format!(
                    "{what} has {} entries for {n} members (at {site})",
                    splits.len()
                ),
            ));
        }
        let (rows, _) = rows_and_row_bytes(data);
        let sum: usize = splits.iter().sum();
        if sum != rows || data.shape().as_slice().is_empty() {
            return Err(self.error(
                op,
                format!(
                    "{what} {splits:?} sum to {sum} but the tensor has {rows} rows (at {site})"
                ),
            ));
        }
        Ok(())
    }
}

fn payloads(data: &TensorData, splits: &[usize]) -> Vec<Option<Payload>> {
    let tail = trailing(data);
    split_rows(data, splits)
        .into_iter()
        .zip(splits)
        .map(|(block, &rows)| Some(Arc::new(rows_to_data(block, rows, &tail, data.dtype()))))
        .collect()
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.index
    }

    fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp, site: CallSite) -> Result<TensorData> {
        const OP: &str = "all_reduce";
        let mut sig = self.sig(OP, &data, site);
        sig.param = format!("{op:?}");
        let shared = Arc::new(data);
        let outgoing = vec![Some(Arc::clone(&shared)); self.ranks.len()];
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "reduce op",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        let parts: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(|d| d.as_bytes()))
            .collect();
        let bytes = reduce_blocks(OP, &self.group(), &parts, shared.dtype(), op)?;
        Ok(TensorData::from_bytes_vec(
            bytes,
            shared.shape().to_vec(),
            shared.dtype(),
        ))
    }

    fn all_gather_v(&self, data: TensorData, site: CallSite) -> Result<(TensorData, Vec<usize>)> {
        const OP: &str = "all_gather";
        if data.shape().as_slice().is_empty() {
            return Err(self.error(OP, format!("a 0-d tensor has no dim 0 (at {site})")));
        }
        let sig = self.sig(OP, &data, site);
        let shared = Arc::new(data);
        let got = self.exchange(sig, vec![Some(Arc::clone(&shared)); self.ranks.len()])?;
        self.agree(
            OP,
            &got,
            "trailing shape",
            |a, b| a.shape.len() == b.shape.len() && a.shape[1..] == b.shape[1..],
            |s| format!("{:?}", s.shape),
        )?;
        let sizes: Vec<usize> = got.iter().map(|(s, _)| s.shape[0]).collect();
        let blocks: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(|d| d.as_bytes()))
            .collect();
        let out = concat_rows(
            blocks,
            sizes.iter().sum(),
            &trailing(&shared),
            shared.dtype(),
        );
        Ok((out, sizes))
    }

    fn reduce_scatter_v(
        &self,
        data: TensorData,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<TensorData> {
        const OP: &str = "reduce_scatter";
        self.check_splits(OP, &data, splits, "splits", site)?;
        let mut sig = self.sig(OP, &data, site);
        sig.splits = splits.to_vec();
        sig.param = format!("{op:?}");
        let outgoing = payloads(&data, splits);
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "splits",
            |a, b| a.splits == b.splits,
            |s| format!("{:?}", s.splits),
        )?;
        self.agree(
            OP,
            &got,
            "reduce op",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        let parts: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(|d| d.as_bytes()))
            .collect();
        let bytes = reduce_blocks(OP, &self.group(), &parts, data.dtype(), op)?;
        let mut shape = data.shape().to_vec();
        shape[0] = splits[self.index];
        Ok(TensorData::from_bytes_vec(bytes, shape, data.dtype()))
    }

    fn all_to_all_v(
        &self,
        data: TensorData,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<TensorData> {
        const OP: &str = "all_to_all_v";
        self.check_splits(OP, &data, send_splits, "send_splits", site)?;
        if recv_splits.len() != self.ranks.len() {
            return Err(self.error(
                OP,
                format!(
                    "recv_splits has {} entries for {} members (at {site})",
                    recv_splits.len(),
                    self.ranks.len()
                ),
            ));
        }
        let mut sig = self.sig(OP, &data, site);
        sig.splits = send_splits.to_vec();
        sig.recv_splits = recv_splits.to_vec();
        let outgoing = payloads(&data, send_splits);
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "trailing shape",
            |a, b| a.shape.len() == b.shape.len() && a.shape[1..] == b.shape[1..],
            |s| format!("{:?}", s.shape),
        )?;
        // Every member checks the whole split matrix: recv[j][i] == send[i][j].
        for (i, (si, _)) in got.iter().enumerate() {
            for (j, (sj, _)) in got.iter().enumerate() {
                if sj.recv_splits[i] != si.splits[j] {
                    return Err(self.error(
                        OP,
                        format!(
                            "split mismatch: rank {} sends {} rows to rank {} (send_splits {:?} at {}), \
                             but rank {} expects {} (recv_splits {:?} at {})",
                            self.ranks[i],
                            si.splits[j],
                            self.ranks[j],
                            si.splits,
                            si.site,
                            self.ranks[j],
                            sj.recv_splits[i],
                            sj.recv_splits,
                            sj.site
                        ),
                    ));
                }
            }
        }
        let blocks: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(|d| d.as_bytes()))
            .collect();
        Ok(concat_rows(
            blocks,
            recv_splits.iter().sum(),
            &trailing(&data),
            data.dtype(),
        ))
    }

    fn broadcast(&self, data: TensorData, root: usize, site: CallSite) -> Result<TensorData> {
        const OP: &str = "broadcast";
        if root >= self.ranks.len() {
            return Err(self.error(
                OP,
                format!(
                    "root {root} out of range for {} members (at {site})",
                    self.ranks.len()
                ),
            ));
        }
        let mut sig = self.sig(OP, &data, site);
        sig.param = root.to_string();
        let outgoing = if self.index == root {
            vec![Some(Arc::new(data)); self.ranks.len()]
        } else {
            vec![None; self.ranks.len()]
        };
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "root",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        got.into_iter()
            .nth(root)
            .and_then(|(_, p)| p)
            .map(|p| Arc::try_unwrap(p).unwrap_or_else(|shared| (*shared).clone()))
            .ok_or_else(|| self.error(OP, format!("no data from root {root} (at {site})")))
    }

    fn send(&self, data: TensorData, dst: usize, site: CallSite) -> Result<()> {
        const OP: &str = "send";
        let Some(&to) = self.ranks.get(dst) else {
            return Err(self.error(OP, format!("destination {dst} out of range (at {site})")));
        };
        let sig = self.sig(OP, &data, site);
        if to != self.me() {
            self.count(data.as_bytes().len());
        }
        let mut st = self.shared.lock();
        if let Some(failure) = &st.failure {
            return Err(self.aborted(OP, failure));
        }
        st.mail
            .entry((Arc::clone(&self.key), self.me(), to))
            .or_default()
            .push_back(Mail { sig, data });
        drop(st);
        self.shared.wake.notify_all();
        Ok(())
    }

    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<TensorData> {
        const OP: &str = "recv";
        let Some(&from) = self.ranks.get(src) else {
            return Err(self.error(OP, format!("source {src} out of range (at {site})")));
        };
        let key = (Arc::clone(&self.key), from, self.me());
        let deadline = Instant::now() + self.shared.config.timeout;
        let mut st = self.shared.lock();
        let mail = loop {
            if let Some(failure) = &st.failure {
                return Err(self.aborted(OP, failure));
            }
            if let Some(mail) = st.mail.get_mut(&key).and_then(VecDeque::pop_front) {
                break mail;
            }
            if st.exited[from] {
                let reason = format!(
                    "rank {from} finished without sending to rank {} (recv at {site})",
                    self.me()
                );
                drop(st);
                self.shared.fail(self.me(), reason.clone());
                return Err(self.error(OP, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                let err = BackendError::Timeout {
                    op: OP,
                    group: self.group(),
                    waiting: vec![from],
                    seconds: self.shared.config.timeout.as_secs_f64(),
                    site: site.to_string(),
                };
                self.shared.fail(self.me(), err.to_string());
                return Err(err);
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        drop(st);
        if mail.sig.shape != shape || mail.sig.dtype != dtype {
            return Err(self.error(
                OP,
                format!(
                    "rank {from} sent {:?} {:?} (at {}), rank {} expected {:?} {:?} (at {site})",
                    mail.sig.dtype,
                    mail.sig.shape,
                    mail.sig.site,
                    self.me(),
                    dtype,
                    shape
                ),
            ));
        }
        Ok(mail.data)
    }

    fn traffic(&self) -> Traffic {
        Traffic {
            calls: self.calls.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
        }
    }

    fn barrier(&self, site: CallSite) -> Result<()> {
        let empty = TensorData::new(Vec::<f32>::new(), [0]);
        let sig = self.sig("barrier", &empty, site);
        self.exchange(sig, vec![None; self.ranks.len()]).map(|_| ())
    }
}
