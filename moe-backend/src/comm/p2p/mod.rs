//! Collectives of a process transport, built from point-to-point byte exchanges.
//!
//! A process transport (MPI today) only has to provide [`Links`]: send byte buffers to, and
//! receive them from, the other members of a group, with a deadline. [`P2pComm`] builds every
//! collective of [`Communicator`] on top, with the promises of the in-process world:
//!
//! - **Argument checks across ranks.** Every collective starts with an exchange of a small
//!   header (operation, sequence number, dtype, shape, splits, reduce op or root, call site,
//!   and any error the member found in its own arguments). Every member checks all headers the
//!   same way, so all members report the same disagreement, naming the ranks and call sites,
//!   instead of exchanging mismatched buffers.
//! - **Identical results everywhere, equal to the in-process world.** Reductions are computed
//!   by [`reduce_blocks`] in group-member order: `reduce_scatter_v` reduces each block on the
//!   member that owns it; `all_reduce` is that reduce-scatter over equal element ranges
//!   followed by an all-gather of the reduced ranges (small tensors are all-gathered whole and
//!   reduced everywhere). Floats accumulate in f32 and round once, as in [`super::World`], so a
//!   run over processes is bit-identical to the same run over threads.
//! - **No hang.** Every wait has the transport's deadline; a member that does not join in time
//!   is named in [`BackendError::Timeout`].
//!
//! Traffic counts payload bytes addressed to other members, as the in-process world does
//! (headers excluded). `all_reduce` moves `2·(n−1)/n` of the tensor per member instead of the
//! in-process world's `n−1` whole copies.

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::DType;

use super::buffer::{HostBuffer, HostCollectives};
use super::data::reduce_blocks;
use super::{CallSite, ReduceOp, Traffic};
use crate::error::{BackendError, Result};

mod header;
#[cfg(test)]
pub(super) mod tests;

use header::{Header, Op};

/// Why a link operation did not complete.
#[derive(Debug)]
pub(crate) enum LinkError {
    /// The deadline passed; these members (indices in the group) had not completed.
    Timeout(Vec<usize>),
    /// The transport reported an error.
    Failed(String),
}

/// Point-to-point byte transport between the members of one group.
///
/// Messages between two members on one channel arrive in the order they were sent (MPI's
/// non-overtaking rule). Collectives and point-to-point traffic use separate channels.
pub(crate) trait Links: Send + Sync + fmt::Debug {
    /// Global ranks of the group, in member order.
    fn ranks(&self) -> &[usize];
    /// This member's index.
    fn index(&self) -> usize;
    /// Sends `sends[j]` to member `j` and receives `recv_lens[j]` bytes from member `j`
    /// (`None`: no message), all concurrently, and waits for all of them until `deadline`.
    /// The entry for this member itself is never used (callers copy locally).
    fn exchange(
        &self,
        sends: &[Option<&[u8]>],
        recv_lens: &[Option<usize>],
        deadline: Instant,
    ) -> std::result::Result<Vec<Option<Vec<u8>>>, LinkError>;
    /// Starts sending `bytes` to member `dst` on the point-to-point channel and returns
    /// without waiting for the receiver.
    fn post(&self, dst: usize, bytes: Vec<u8>) -> std::result::Result<(), LinkError>;
    /// Receives the next message member `src` posted on the point-to-point channel, whatever
    /// its length.
    fn take(&self, src: usize, deadline: Instant) -> std::result::Result<Vec<u8>, LinkError>;
}

/// A [`Communicator`] over [`Links`].
pub(crate) struct P2pComm<L> {
    links: L,
    timeout: Duration,
    /// Serialises this group's collectives (they must run in the same order on every member).
    order: Mutex<()>,
    seq: AtomicU64,
    calls: AtomicU64,
    bytes_sent: AtomicU64,
}

impl<L: Links> fmt::Debug for P2pComm<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("P2pComm")
            .field("links", &self.links)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// All-reduces of at most this many bytes are all-gathered whole and reduced on every member
/// (one round instead of two).
const SMALL_ALL_REDUCE: usize = 64 << 10;

/// Element range of member `j` when `elems` elements are split over `n` members.
fn elem_range(elems: usize, n: usize, j: usize) -> std::ops::Range<usize> {
    (elems * j / n)..(elems * (j + 1) / n)
}

impl<L: Links> P2pComm<L> {
    /// A communicator over `links` whose waits end after `timeout`.
    pub(crate) fn new(links: L, timeout: Duration) -> Self {
        Self {
            links,
            timeout,
            order: Mutex::new(()),
            seq: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
        }
    }

    fn n(&self) -> usize {
        self.links.ranks().len()
    }

    fn me(&self) -> usize {
        self.links.index()
    }

    fn group(&self) -> String {
        format!("{:?}", self.links.ranks())
    }

    fn error(&self, op: &'static str, detail: String) -> BackendError {
        BackendError::Collective {
            op,
            group: self.group(),
            detail,
        }
    }

    fn link_error(&self, op: &'static str, e: LinkError, site: CallSite) -> BackendError {
        match e {
            LinkError::Timeout(members) => BackendError::Timeout {
                op,
                group: self.group(),
                waiting: members.iter().map(|&m| self.links.ranks()[m]).collect(),
                seconds: self.timeout.as_secs_f64(),
                site: site.to_string(),
            },
            LinkError::Failed(detail) => self.error(op, format!("{detail} (at {site})")),
        }
    }

    fn count(&self, sends: &[Option<&[u8]>]) {
        let me = self.me();
        let bytes: usize = sends
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .filter_map(|(_, s)| s.map(<[u8]>::len))
            .sum();
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// One round: sends `sends[j]` to every member, receives `recv_lens[j]` from every member,
    /// copying this member's own entry locally.
    fn round(
        &self,
        op: &'static str,
        sends: &[Option<&[u8]>],
        recv_lens: &[Option<usize>],
        site: CallSite,
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let me = self.me();
        let mut remote_sends = sends.to_vec();
        let mut remote_lens = recv_lens.to_vec();
        remote_sends[me] = None;
        remote_lens[me] = None;
        let deadline = Instant::now() + self.timeout;
        let mut got = self
            .links
            .exchange(&remote_sends, &remote_lens, deadline)
            .map_err(|e| self.link_error(op, e, site))?;
        got[me] = recv_lens[me].map(|_| sends[me].map(<[u8]>::to_vec).unwrap_or_default());
        for (j, (want, have)) in recv_lens.iter().zip(&got).enumerate() {
            let len = have.as_ref().map(Vec::len);
            if *want != len {
                return Err(self.error(
                    op,
                    format!(
                        "received {len:?} bytes from rank {} where {want:?} were expected (at {site})",
                        self.links.ranks()[j]
                    ),
                ));
            }
        }
        Ok(got)
    }

    /// Starts a collective: checks local arguments (`local` is their verdict), exchanges the
    /// headers and checks them against each other. Returns every member's header.
    fn begin(
        &self,
        op: Op,
        (shape, dtype): (&[usize], DType),
        mut header: Header,
        local: std::result::Result<(), String>,
        site: CallSite,
    ) -> Result<Vec<Header>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        header.seq = self.seq.fetch_add(1, Ordering::SeqCst);
        header.set_shape(shape, dtype);
        header.set_site(site);
        let local = local.and_then(|()| header.tensor_problem().map_or(Ok(()), Err));
        if let Err(message) = &local {
            header.set_error(message);
        }
        let n = self.n();
        let bytes = header.encode(n);
        let sends = vec![Some(bytes.as_slice()); n];
        let lens = vec![Some(bytes.len()); n];
        let got = self.round(op.name(), &sends, &lens, site)?;
        let headers = got
            .iter()
            .enumerate()
            .map(|(j, b)| {
                Header::decode(b.as_deref().unwrap_or_default(), n).map_err(|e| {
                    self.error(
                        op.name(),
                        format!("unreadable header from rank {}: {e}", self.links.ranks()[j]),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // A member's own argument error travels in its header, so every member (this one
        // included) reports it the same way.
        header::agree(&headers, self.links.ranks())
            .map_err(|detail| self.error(op.name(), detail))?;
        Ok(headers)
    }

    fn splits_check(&self, shape: &[usize], splits: &[usize], what: &str) -> Option<String> {
        let n = self.n();
        if splits.len() != n {
            return Some(format!(
                "{what} has {} entries for {n} members",
                splits.len()
            ));
        }
        let rows = shape.first().copied().unwrap_or(1);
        let sum: usize = splits.iter().sum();
        if sum != rows || shape.is_empty() {
            return Some(format!(
                "{what} {splits:?} sum to {sum} but the tensor has {rows} rows"
            ));
        }
        None
    }
}

impl<L: Links> P2pComm<L> {
    /// The header of a collective with `args` on a tensor of `shape`, and this member's verdict
    /// on its own arguments (the same checks for host and device buffers).
    fn header_for(
        &self,
        args: &Args<'_>,
        shape: &[usize],
    ) -> (Op, Header, std::result::Result<(), String>) {
        let n = self.n();
        match *args {
            Args::AllReduce(op) => {
                let mut header = Header::new(Op::AllReduce);
                header.param = header::reduce_code(op);
                (Op::AllReduce, header, Ok(()))
            }
            Args::AllGather => {
                let local = verdict(
                    shape
                        .is_empty()
                        .then(|| "a 0-d tensor has no dim 0".to_string()),
                );
                (Op::AllGather, Header::new(Op::AllGather), local)
            }
            Args::ReduceScatter { splits, op } => {
                let problem = self.splits_check(shape, splits, "splits");
                let mut header = Header::new(Op::ReduceScatter);
                header.param = header::reduce_code(op);
                if problem.is_none() {
                    header.splits = splits.iter().map(|&s| s as u64).collect();
                }
                (Op::ReduceScatter, header, verdict(problem))
            }
            Args::AllToAll { send, recv } => {
                let problem = self.splits_check(shape, send, "send_splits").or_else(|| {
                    (recv.len() != n)
                        .then(|| format!("recv_splits has {} entries for {n} members", recv.len()))
                });
                let mut header = Header::new(Op::AllToAll);
                if problem.is_none() {
                    header.splits = send.iter().map(|&s| s as u64).collect();
                    header.recv_splits = recv.iter().map(|&s| s as u64).collect();
                }
                (Op::AllToAll, header, verdict(problem))
            }
            Args::Broadcast { root } => {
                let local = verdict(
                    (root >= n).then(|| format!("root {root} out of range for {n} members")),
                );
                let mut header = Header::new(Op::Broadcast);
                header.param = root as u64;
                (Op::Broadcast, header, local)
            }
        }
    }
}

/// The device path's access to the header round and the links (the NCCL transport with
/// features `cuda` and `nccl`).
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
impl<L: Links> P2pComm<L> {
    /// The header round of a collective with `args` on a tensor of `shape` and `dtype`, for a
    /// transport that moves the payload itself (the NCCL device path): every member's
    /// arguments checked against the others' exactly as on the host path. Returns the
    /// group's order lock (hold it until the payload has moved, so collectives stay in the
    /// same order on every member) and every member's row count.
    pub(crate) fn agree(
        &self,
        args: Args<'_>,
        shape: &[usize],
        dtype: DType,
        site: CallSite,
    ) -> Result<(std::sync::MutexGuard<'_, ()>, Vec<usize>)> {
        let order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let (op, header, local) = self.header_for(&args, shape);
        let headers = self.begin(op, (shape, dtype), header, local, site)?;
        Ok((order, headers.iter().map(Header::rows).collect()))
    }

    /// The links.
    pub(crate) fn links(&self) -> &L {
        &self.links
    }

    /// How long a wait lasts.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Counts a collective's payload addressed to other members (`bytes` per member `j`).
    pub(crate) fn count_payload(&self, bytes: &[usize]) {
        let me = self.me();
        let total: usize = bytes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .map(|(_, b)| b)
            .sum();
        self.bytes_sent.fetch_add(total as u64, Ordering::Relaxed);
    }

    /// A typed error of this group.
    pub(crate) fn group_error(&self, op: &'static str, detail: String) -> BackendError {
        self.error(op, detail)
    }

    /// The typed error of a failed link operation (timeouts name the members waited for).
    pub(crate) fn link_failure(
        &self,
        op: &'static str,
        e: LinkError,
        site: CallSite,
    ) -> BackendError {
        self.link_error(op, e, site)
    }
}

/// The header of a point-to-point message of `shape` and `dtype` sent at `site` (what the
/// host path puts before a payload; the NCCL device path sends it just before the payload).
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
pub(crate) fn message_header(shape: &[usize], dtype: DType, site: CallSite) -> Vec<u8> {
    let mut header = Header::new(Op::Send);
    header.set_shape(shape, dtype);
    header.set_site(site);
    header.encode(0)
}

/// Bytes of a [`message_header`].
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
pub(crate) fn message_header_len() -> usize {
    Header::new(Op::Send).encode(0).len()
}

/// Checks a received message header against the receive's `shape` and `dtype`: the error
/// names both ranks (global) and both call sites, as the host path's.
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
pub(crate) fn check_message_header(
    bytes: &[u8],
    (shape, dtype): (&[usize], DType),
    (src, me): (usize, usize),
    site: CallSite,
) -> std::result::Result<(), String> {
    let header = Header::decode(bytes, 0)
        .map_err(|e| format!("unreadable message header: {e} (at {site})"))?;
    let mut expected = Header::new(Op::Send);
    expected.set_shape(shape, dtype);
    if header.op != Op::Send || !header.same_tensor(&expected) {
        return Err(format!(
            "rank {src} sent {} (at {}), rank {me} expected {dtype:?} {shape:?} (at {site})",
            header.describe_tensor(),
            header.site(),
        ));
    }
    Ok(())
}

/// A collective's arguments, for [`P2pComm::agree`].
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Args<'a> {
    /// `all_reduce` with this reduction.
    AllReduce(ReduceOp),
    /// `all_gather_v`.
    AllGather,
    /// `reduce_scatter_v`.
    ReduceScatter {
        /// Rows per member.
        splits: &'a [usize],
        /// The reduction.
        op: ReduceOp,
    },
    /// `all_to_all_v`.
    AllToAll {
        /// Rows sent to each member.
        send: &'a [usize],
        /// Rows received from each member.
        recv: &'a [usize],
    },
    /// `broadcast` from this member.
    Broadcast {
        /// The sending member.
        root: usize,
    },
}

fn verdict(problem: Option<String>) -> std::result::Result<(), String> {
    problem.map_or(Ok(()), Err)
}

impl<L: Links> HostCollectives for P2pComm<L> {
    fn member(&self) -> usize {
        self.me()
    }

    fn members(&self) -> &[usize] {
        self.links.ranks()
    }

    fn host_all_reduce(
        &self,
        data: HostBuffer,
        op: ReduceOp,
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "all_reduce";
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let (code, header, local) = self.header_for(&Args::AllReduce(op), data.shape());
        self.begin(code, (data.shape(), data.dtype()), header, local, site)?;
        let (n, me) = (self.n(), self.me());
        let dtype = data.dtype();
        let elem = dtype.size();
        let bytes = data.bytes();
        let shape = data.shape().to_vec();
        let group = self.group();
        if bytes.len() <= SMALL_ALL_REDUCE || n == 1 {
            let sends = vec![Some(bytes); n];
            self.count(&sends);
            let got = self.round(OP, &sends, &vec![Some(bytes.len()); n], site)?;
            let parts: Vec<&[u8]> = got
                .iter()
                .map(|b| b.as_deref().unwrap_or_default())
                .collect();
            let out = reduce_blocks(OP, &group, &parts, dtype, op)?;
            return Ok(HostBuffer::from_bytes(out, shape, dtype));
        }
        let elems = bytes.len() / elem;
        let range = |j: usize| {
            let r = elem_range(elems, n, j);
            r.start * elem..r.end * elem
        };
        // Reduce-scatter: member j reduces element range j in member order.
        let sends: Vec<Option<&[u8]>> = (0..n).map(|j| Some(&bytes[range(j)])).collect();
        self.count(&sends);
        let mine = range(me).len();
        let got = self.round(OP, &sends, &vec![Some(mine); n], site)?;
        let parts: Vec<&[u8]> = got
            .iter()
            .map(|b| b.as_deref().unwrap_or_default())
            .collect();
        let reduced = reduce_blocks(OP, &group, &parts, dtype, op)?;
        // All-gather of the reduced ranges.
        let sends = vec![Some(reduced.as_slice()); n];
        self.count(&sends);
        let lens: Vec<Option<usize>> = (0..n).map(|j| Some(range(j).len())).collect();
        let got = self.round(OP, &sends, &lens, site)?;
        let mut out = Vec::with_capacity(bytes.len());
        for part in got.iter().flatten() {
            out.extend_from_slice(part);
        }
        Ok(HostBuffer::from_bytes(out, shape, dtype))
    }

    fn host_all_gather_v(
        &self,
        data: HostBuffer,
        site: CallSite,
    ) -> Result<(HostBuffer, Vec<usize>)> {
        const OP: &str = "all_gather";
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let (code, header, local) = self.header_for(&Args::AllGather, data.shape());
        let headers = self.begin(code, (data.shape(), data.dtype()), header, local, site)?;
        let n = self.n();
        let (_, row_bytes) = data.rows_and_row_bytes();
        let sizes: Vec<usize> = headers.iter().map(|h| h.rows()).collect();
        let sends = vec![Some(data.bytes()); n];
        self.count(&sends);
        let lens: Vec<Option<usize>> = sizes.iter().map(|&r| Some(r * row_bytes)).collect();
        let got = self.round(OP, &sends, &lens, site)?;
        let out = HostBuffer::concat(
            got.iter().map(|b| b.as_deref().unwrap_or_default()),
            sizes.iter().sum(),
            data.trailing(),
            data.dtype(),
        );
        Ok((out, sizes))
    }

    fn host_reduce_scatter_v(
        &self,
        data: HostBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "reduce_scatter";
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let args = Args::ReduceScatter { splits, op };
        let (code, header, local) = self.header_for(&args, data.shape());
        self.begin(code, (data.shape(), data.dtype()), header, local, site)?;
        let me = self.me();
        let (_, row_bytes) = data.rows_and_row_bytes();
        let all = data.bytes();
        let sends: Vec<Option<&[u8]>> = data
            .row_ranges(splits)
            .into_iter()
            .map(|r| Some(&all[r]))
            .collect();
        self.count(&sends);
        let mine = splits[me] * row_bytes;
        let got = self.round(OP, &sends, &vec![Some(mine); self.n()], site)?;
        let parts: Vec<&[u8]> = got
            .iter()
            .map(|b| b.as_deref().unwrap_or_default())
            .collect();
        let bytes = reduce_blocks(OP, &self.group(), &parts, data.dtype(), op)?;
        let mut shape = data.shape().to_vec();
        shape[0] = splits[me];
        Ok(HostBuffer::from_bytes(bytes, shape, data.dtype()))
    }

    fn host_all_to_all_v(
        &self,
        data: HostBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "all_to_all_v";
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let args = Args::AllToAll {
            send: send_splits,
            recv: recv_splits,
        };
        let (code, header, local) = self.header_for(&args, data.shape());
        self.begin(code, (data.shape(), data.dtype()), header, local, site)?;
        let (_, row_bytes) = data.rows_and_row_bytes();
        let all = data.bytes();
        let sends: Vec<Option<&[u8]>> = data
            .row_ranges(send_splits)
            .into_iter()
            .map(|r| Some(&all[r]))
            .collect();
        self.count(&sends);
        let lens: Vec<Option<usize>> = recv_splits.iter().map(|&r| Some(r * row_bytes)).collect();
        let got = self.round(OP, &sends, &lens, site)?;
        Ok(HostBuffer::concat(
            got.iter().map(|b| b.as_deref().unwrap_or_default()),
            recv_splits.iter().sum(),
            data.trailing(),
            data.dtype(),
        ))
    }

    fn host_broadcast(&self, data: HostBuffer, root: usize, site: CallSite) -> Result<HostBuffer> {
        const OP: &str = "broadcast";
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.n();
        let (code, header, local) = self.header_for(&Args::Broadcast { root }, data.shape());
        self.begin(code, (data.shape(), data.dtype()), header, local, site)?;
        if self.me() == root {
            let sends = vec![Some(data.bytes()); n];
            self.count(&sends);
            self.round(OP, &sends, &vec![None; n], site)?;
            return Ok(data);
        }
        let mut lens = vec![None; n];
        lens[root] = Some(data.bytes().len());
        let mut got = self.round(OP, &vec![None; n], &lens, site)?;
        let bytes = got[root].take().unwrap_or_default();
        Ok(HostBuffer::from_bytes(
            bytes,
            data.shape().to_vec(),
            data.dtype(),
        ))
    }

    fn host_send(&self, data: HostBuffer, dst: usize, site: CallSite) -> Result<()> {
        const OP: &str = "send";
        let n = self.n();
        if dst >= n {
            return Err(self.error(OP, format!("destination {dst} out of range (at {site})")));
        }
        let mut header = Header::new(Op::Send);
        header.set_shape(data.shape(), data.dtype());
        header.set_site(site);
        let mut bytes = header.encode(0);
        bytes.extend_from_slice(data.bytes());
        self.calls.fetch_add(1, Ordering::Relaxed);
        if dst != self.me() {
            self.bytes_sent
                .fetch_add(data.bytes().len() as u64, Ordering::Relaxed);
        }
        self.links
            .post(dst, bytes)
            .map_err(|e| self.link_error(OP, e, site))
    }

    fn host_recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "recv";
        if src >= self.n() {
            return Err(self.error(OP, format!("source {src} out of range (at {site})")));
        }
        let mut expected = Header::new(Op::Send);
        expected.set_shape(shape, dtype);
        let len = shape.iter().product::<usize>() * dtype.size();
        let header_len = Header::new(Op::Send).encode(0).len();
        let deadline = Instant::now() + self.timeout;
        let message = self
            .links
            .take(src, deadline)
            .map_err(|e| self.link_error(OP, e, site))?;
        let header = Header::decode(&message[..header_len.min(message.len())], 0)
            .map_err(|e| self.error(OP, format!("unreadable message header: {e} (at {site})")))?;
        if message.len() != header_len + len || !header.same_tensor(&expected) {
            return Err(self.error(
                OP,
                format!(
                    "rank {} sent {} (at {}), rank {} expected {:?} {shape:?} (at {site})",
                    self.links.ranks()[src],
                    header.describe_tensor(),
                    header.site(),
                    self.links.ranks()[self.me()],
                    dtype,
                ),
            ));
        }
        Ok(HostBuffer::from_bytes(
            message[header_len..].to_vec(),
            shape.to_vec(),
            dtype,
        ))
    }

    fn host_barrier(&self, site: CallSite) -> Result<()> {
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let empty = HostBuffer::from_bytes(Vec::new(), vec![0], DType::F32);
        let tensor = (empty.shape(), empty.dtype());
        self.begin(Op::Barrier, tensor, Header::new(Op::Barrier), Ok(()), site)
            .map(|_| ())
    }

    fn host_traffic(&self) -> Traffic {
        Traffic {
            calls: self.calls.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
        }
    }
}
