//! Ranks as processes over NCCL (feature `nccl`, cudarc with dynamic loading): every collective
//! of [`Communicator`](super::Communicator) is built by `super::p2p` from NCCL point-to-point
//! transfers, **staged through host memory**.
//!
//! ```no_run
//! # fn main() -> moe_backend::Result<()> {
//! use moe_backend::comm::launch::Launch;
//! use moe_backend::comm::nccl::{NcclConfig, nccl_ctx};
//! use moe_backend::comm::tcp::{TcpConfig, TcpWorld};
//! use moe_backend::parallel::ParallelLayout;
//!
//! let launch = Launch::from_env()?.expect("started by torchrun");
//! let world = TcpWorld::init(&launch, TcpConfig::default())?; // or MpiWorld (feature `mpi`)
//! let layout = ParallelLayout::parse(world.size(), "tp=2,ep=4")?;
//! world.run(|bootstrap| {
//!     let ctx = nccl_ctx(bootstrap, NcclConfig::default())?; // one GPU per process
//!     let groups = ctx.process_groups(&layout)?; // the same code as on every other transport
//!     Ok(groups.groups.tp_rank())
//! })?;
//! # Ok(()) }
//! ```
//!
//! # What is host-staged
//! This is the first step of the NCCL transport: the [`Communicator`](super::Communicator)
//! interface moves host [`TensorData`], so every transfer is copied host → device into a
//! staging buffer, moved by `ncclSend`/`ncclRecv` inside one NCCL group call, and copied
//! device → host again (`HostStagedNccl`). Reductions run on the host in `super::p2p`
//! (deterministic, bit-identical to the in-process world), not in NCCL. This path serves host
//! (Flex) tensors and the headers of every collective.
//!
//! With feature `cuda` as well, collectives on CUDA tensors run on their device buffers
//! (submodule `device`: `ncclAllReduce`, `ncclReduceScatter` / grouped `ncclReduce`,
//! `ncclAllGather` / grouped `ncclBroadcast`, grouped `ncclSend`/`ncclRecv` for
//! all-to-all-v, `ncclBroadcast`) on the same communicator, after the host header round, and
//! so does the pipeline's batched `send_recv` (grouped `ncclSend`/`ncclRecv` of header and
//! payload per message); only a lone `send`/`recv` is still staged through the host. Staging memory is bounded:
//! messages travel in pieces of 256 MiB / group size (at least 4 MiB) per peer and round, and
//! every member cuts them the same way, so sends and receives match.
//!
//! # Bootstrap and devices
//! [`nccl_ctx`] turns the rank context of a host transport (MPI, TCP, ...) into an NCCL one.
//! Each NCCL group is created on first use, as on every transport: its lowest global rank calls
//! `ncclGetUniqueId` and sends the 128-byte id (with a hash of the group key, so members that
//! create groups in different orders get an error instead of a wrong communicator) to the
//! other members over the bootstrap's world communicator; then every member calls
//! `ncclCommInitRank` on its own stream. The GPU is the local rank, from
//! [`NcclConfig::local_rank`] or the launcher ([`Launch`]); a node with more processes than GPUs
//! is refused before any NCCL call, naming both counts ([`crate::devices`]). One process per
//! GPU: NCCL refuses two ranks on one device.
//!
//! # Point-to-point: rendezvous, not buffered
//! NCCL has no buffered send: an `ncclSend` completes only when the receiver posts the matching
//! `ncclRecv`, and the messages of a communicator between two members are matched in issue
//! order, collectives and point-to-point alike (one channel per pair, where MPI and TCP have
//! two). So a `send` only queues the message; it is delivered (an 8-byte length, then the
//! payload, each in an NCCL group) when this rank next uses any NCCL group: every link call —
//! on any group of this rank — first flushes the queued posts, and a `recv` sends the
//! queued post of its own group in the same NCCL groups as its own receive, so rings and
//! pairwise exchanges (everyone sends, then everyone receives) complete. Queued posts are also
//! flushed when the group is dropped. Consequences, and the rules for code that uses
//! `send`/`recv` over NCCL:
//! - a `send` completes only when the receiver calls `recv`; the sender's next call on any
//!   NCCL group waits for that;
//! - the receiver must `recv` a message before its own next collective on that group (the
//!   message would otherwise meet the collective's traffic, which NCCL does not detect: expect
//!   a timeout or unreadable headers);
//! - a reply that depends on the message does not work on its own: if rank A sends to B and
//!   then receives B's answer, while B receives first and answers after, A's receive holds the
//!   rest of its message back and both time out. Exchange in pairs instead (both send, then
//!   both receive), as pipeline schedules do.
//!
//! Messages a member sends to itself never touch NCCL.
//!
//! # Timeouts
//! NCCL calls on a blocking communicator do not return until the peers take part. Every wait
//! that this module controls has the deadline of [`NcclConfig::timeout`]: the completion of an
//! NCCL group is polled with a CUDA event, and the deadline is checked between the pieces of a
//! message. When it passes, the group's communicator is aborted (`ncclCommAbort`, which ends
//! the kernels still waiting), the call returns [`BackendError::Timeout`] naming the peers, and
//! every later call of that group fails. Two waits are NCCL's own and end only by NCCL's
//! settings or the launcher: `ncclCommInitRank` (every member reaches it right after the id
//! exchange, which has the bootstrap transport's timeout) and the connection set-up NCCL may
//! perform inside `ncclGroupEnd` on the first transfer between two members.
//!
//! # Run time requirements and what is tested
//! The crate builds without CUDA or NCCL (cudarc loads `libcuda` and `libnccl` when first
//! used). At run time [`nccl_ctx`] checks for both libraries ([`probe_libraries`]) and returns
//! a [`BackendError::Config`] instead of letting cudarc panic. NCCL comes e.g. from the PyPI
//! wheels `nvidia-nccl-cu12` / `nvidia-nccl-cu13` (`nvidia/nccl/lib/libnccl.so.2`); cudarc
//! looks for `libnccl.so`, so a `libnccl.so -> libnccl.so.2` symlink in a directory on
//! `LD_LIBRARY_PATH` is needed.
//!
//! Tested without a GPU: the library checks, device choice, id exchange (over the in-process
//! world), piece planning, and the whole link protocol (queued posts, flushes, merged
//! receives, pieces, timeouts) over an in-memory imitation of NCCL's matching rules running
//! every collective of `super::p2p`. Not tested here: the cudarc calls themselves
//! (`HostStagedNccl`); the `#[ignore]`d test `gpu_world_of_one` runs them on one GPU.

use std::collections::VecDeque;
use std::ffi::c_char;
use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys::ncclComm_t;

#[cfg(feature = "cuda")]
mod device;

use super::Comm;
use super::ctx::{Connector, RankCtx, Transport};
use super::launch::Launch;
use super::p2p::{LinkError, Links, P2pComm};
use crate::devices::{self, GpuRuntime, LocalRanks};
use crate::error::{BackendError, Result};

/// Settings of an NCCL rank context.
#[derive(Debug, Clone)]
pub struct NcclConfig {
    /// How long a collective or receive waits for the other members before it fails with
    /// [`BackendError::Timeout`] (and the group's communicator is aborted).
    pub timeout: Duration,
    /// Rank of this process among the processes of its node, which is the GPU's ordinal (a
    /// rank without a GPU of its own is refused). `None`: the launcher's local rank
    /// ([`Launch::local_rank`]), checked against its local world size, or 0 for a process
    /// started by hand.
    pub local_rank: Option<usize>,
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            local_rank: None,
        }
    }
}

/// Bytes of an NCCL unique id (`ncclUniqueId::internal`).
const ID_BYTES: usize = 128;
/// Bytes of the id message: status, group-key hash, id.
const ID_MESSAGE: usize = 1 + 8 + ID_BYTES;
/// Staging budget of one round of an exchange, split over the peers.
const STAGE_BUDGET: usize = 256 << 20;
/// Smallest piece, however many peers.
const MIN_PIECE: usize = 4 << 20;
/// Largest point-to-point message believed (a larger length means the order was broken).
const MAX_MESSAGE: u64 = 1 << 40;

fn config_error(detail: String) -> BackendError {
    BackendError::Config {
        field: "nccl",
        detail,
    }
}

/// Why the libraries are unusable, from whether each was found.
fn check_libraries(cuda: bool, nccl: bool) -> Result<()> {
    let mut missing = Vec::new();
    if !cuda {
        missing.push(
            "the CUDA driver library (libcuda.so / libcuda.so.1) was not found: the NCCL \
             transport needs an NVIDIA GPU and its driver"
                .to_string(),
        );
    }
    if !nccl {
        missing.push(
            "libnccl.so was not found on the library search path: install NCCL (e.g. `pip \
             install nvidia-nccl-cu12` or `nvidia-nccl-cu13`, which ship \
             nvidia/nccl/lib/libnccl.so.2), add a symlink libnccl.so -> libnccl.so.2 next to it \
             (cudarc loads libnccl.so, not libnccl.so.2) and put that directory on \
             LD_LIBRARY_PATH"
                .to_string(),
        );
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(config_error(missing.join("; ")))
    }
}

/// Checks that the CUDA driver library and NCCL can be loaded, with an error that says how to
/// get them. Without this check, cudarc panics on the first call into a missing library.
pub fn probe_libraries() -> Result<()> {
    // SAFETY: both functions only try to open the candidate library names and close them again.
    let (cuda, nccl) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    check_libraries(cuda, nccl)
}

fn driver_error(what: &str, e: DriverError) -> String {
    format!("CUDA {what} failed: {e}")
}

fn cuda(what: &'static str) -> impl Fn(DriverError) -> LinkError {
    move |e| LinkError::Failed(driver_error(what, e))
}

fn nccl(what: &'static str) -> impl Fn(NcclError) -> LinkError {
    move |e| LinkError::Failed(nccl_error(what, &e))
}

fn nccl_error(what: &str, e: &NcclError) -> String {
    // SAFETY: an NcclError comes from a call into the loaded library; ncclGetErrorString returns
    // a static C string for every result code.
    let text = unsafe {
        let ptr = cudarc::nccl::sys::ncclGetErrorString(e.0);
        if ptr.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned()
        }
    };
    format!("NCCL {what} failed: {:?} ({text})", e.0)
}

/// A fresh NCCL unique id, as bytes (needs libnccl; no GPU).
fn new_id() -> Result<[u8; ID_BYTES]> {
    // SAFETY: only tries to open the candidate library names. Without the check, cudarc
    // panics when libnccl is missing.
    let present = unsafe { cudarc::nccl::sys::is_culib_present() };
    check_libraries(true, present)?;
    let id =
        cudarc::nccl::Id::new().map_err(|e| config_error(nccl_error("ncclGetUniqueId", &e)))?;
    Ok(id_bytes(&id))
}

fn id_bytes(id: &cudarc::nccl::Id) -> [u8; ID_BYTES] {
    (*id.internal()).map(|c| c as u8)
}

#[cfg(test)]
fn id_from_bytes(bytes: &[u8; ID_BYTES]) -> cudarc::nccl::Id {
    cudarc::nccl::Id::uninit(bytes.map(|b| b as c_char))
}

/// FNV-1a of a group key (the same on every member).
fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Shares the NCCL id of group `ranks` (global ranks in member order; this rank is member
/// `index`) over the bootstrap `world`: its lowest rank calls `make` and sends the result to
/// the other members, which check the group key. A failure of `make` reaches every member.
fn share_id(
    world: &Comm,
    key: &str,
    ranks: &[usize],
    index: usize,
    make: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    let site = Location::caller();
    let leader = ranks.iter().copied().min().unwrap_or_default();
    let me = ranks[index];
    let hash = key_hash(key).to_le_bytes();
    let comm = world.communicator();
    if me == leader {
        let made = make();
        let mut message = vec![0u8; ID_MESSAGE];
        message[1..9].copy_from_slice(&hash);
        match &made {
            Ok(id) => message[9..].copy_from_slice(id),
            Err(_) => message[0] = 1,
        }
        for &peer in ranks.iter().filter(|&&r| r != me) {
            comm.send(TensorData::new(message.clone(), [ID_MESSAGE]), peer, site)?;
        }
        return made;
    }
    let message = comm.recv(&[ID_MESSAGE], DType::U8, leader, site)?;
    let bytes = message.as_bytes();
    let group = || format!("{ranks:?}");
    if bytes[1..9] != hash {
        return Err(BackendError::Collective {
            op: "connect",
            group: group(),
            detail: format!(
                "rank {leader} sent the NCCL id of another group than `{key}`: the members \
                 create their groups in different orders"
            ),
        });
    }
    if bytes[0] != 0 {
        return Err(BackendError::Collective {
            op: "connect",
            group: group(),
            detail: format!("rank {leader} could not create the NCCL id of `{key}`"),
        });
    }
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(&bytes[9..]);
    Ok(id)
}

/// The rank context of this process over NCCL, bootstrapped by `bootstrap` (the context of a
/// host transport with the same ranks, e.g. a [`TcpWorld`](super::tcp::TcpWorld)'s; its
/// world communicator carries the NCCL ids, so do not use its `send`/`recv` while NCCL
/// groups are being created). Every rank calls this once, at the same point.
///
/// Checks that libcuda and libnccl can be loaded and opens the GPU `local_rank`;
/// the NCCL groups themselves are created on first use, like every transport's.
pub fn nccl_ctx(bootstrap: &RankCtx, config: NcclConfig) -> Result<RankCtx> {
    probe_libraries()?;
    // One GPU per process (see `crate::devices`): the local rank is the device ordinal, and a
    // node with more processes than GPUs is refused, naming both counts.
    let local_rank = match config.local_rank {
        Some(l) => l,
        None => match Launch::from_env()? {
            Some(launch) => {
                let devices = devices::probe_cuda()?;
                devices::check_local_ranks(
                    GpuRuntime::Cuda,
                    &LocalRanks::from_launch(&launch),
                    devices,
                )?;
                launch.local_rank
            }
            None => 0,
        },
    };
    let ordinal = devices::cuda_device_index(local_rank)?;
    let device = CudaContext::new(ordinal)
        .map_err(|e| config_error(driver_error(&format!("opening GPU {ordinal}"), e)))?;
    let world = bootstrap.world()?;
    let connector = NcclConnector {
        world,
        device,
        timeout: config.timeout,
        registry: Arc::new(Registry::default()),
    };
    Ok(RankCtx::new(
        bootstrap.rank(),
        bootstrap.world_size(),
        Transport::Process(Arc::new(connector)),
    ))
}

/// Creates the NCCL communicator of each group (see the module docs).
struct NcclConnector {
    /// The bootstrap transport's world: carries the NCCL ids.
    world: Comm,
    device: Arc<CudaContext>,
    timeout: Duration,
    /// This rank's groups, for flushing queued posts.
    registry: Arc<Registry>,
}

impl Connector for NcclConnector {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn connect(&self, key: &str, ranks: &[usize], index: usize) -> Result<Comm> {
        let id = share_id(&self.world, key, ranks, index, new_id)?;
        let failed = |detail: String| BackendError::Collective {
            op: "connect",
            group: format!("{ranks:?}"),
            detail: format!("{detail} (group `{key}`)"),
        };
        self.device
            .bind_to_thread()
            .map_err(|e| failed(driver_error("binding the GPU", e)))?;
        let stream = self
            .device
            .new_stream()
            .map_err(|e| failed(driver_error("creating a stream", e)))?;
        let comm = RawComm::init(stream, index, ranks.len(), &id)
            .map_err(|e| failed(nccl_error("ncclCommInitRank", &e)))?;
        let links = NcclLinks::new(
            HostStagedNccl::new(comm),
            ranks.to_vec(),
            index,
            self.timeout,
            piece_len(ranks.len()),
            &self.registry,
        );
        let p2p = P2pComm::new(links, self.timeout);
        // With Burn's CUDA runtime, collectives on CUDA tensors run on their device buffers.
        #[cfg(feature = "cuda")]
        return Ok(Comm::new(Arc::new(device::NcclComm::new(p2p))));
        #[cfg(not(feature = "cuda"))]
        Ok(Comm::new(Arc::new(p2p)))
    }
}

/// Bytes per piece of a message in a group of `members`: every member computes the same, so
/// the pieces of a message match on both ends.
pub(crate) fn piece_len(members: usize) -> usize {
    (STAGE_BUDGET / members.max(1)).max(MIN_PIECE)
}

/// Range of piece `round` of a `len`-byte message cut in `piece`-byte pieces (an empty message
/// has no pieces).
fn piece_range(len: usize, piece: usize, round: usize) -> Option<std::ops::Range<usize>> {
    let start = round.checked_mul(piece)?;
    (start < len).then(|| start..(start + piece).min(len))
}

/// Number of pieces of a `len`-byte message.
fn piece_count(len: usize, piece: usize) -> usize {
    len.div_ceil(piece)
}

/// One NCCL group call of point-to-point transfers on a group's communicator, issued and
/// awaited. Implemented by [`HostStagedNccl`] (and an in-memory imitation in the tests).
pub(crate) trait Wire: Send + 'static {
    /// Sends `sends[k].1` to member `sends[k].0` and receives `recvs[k].1` bytes from member
    /// `recvs[k].0`, all in one group, and waits for all of them until `deadline`. Transfers
    /// between two members are matched in issue order. After a timeout the wire is unusable.
    fn group(
        &mut self,
        sends: &[(usize, &[u8])],
        recvs: &[(usize, usize)],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, LinkError>;
    /// Gives the communicator up after a failure (ends the transfers still in flight).
    fn abort(&mut self);
}

/// An NCCL communicator (`ncclComm_t`) and the stream its operations run on; aborted
/// (`ncclCommAbort`) when dropped. Raw rather than cudarc's `Comm`, whose typed calls take
/// cudarc buffers only: the device path hands NCCL the pointers of CubeCL's buffers.
pub(crate) struct RawComm {
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use it at
// once. A `RawComm` lives only in a `HostStagedNccl`, which lives only inside the `Mutex` of
// its `LinkState`; every use happens while that lock is held, so calls are serialised. The
// group calls (`ncclGroupStart`/`End`, thread-local in NCCL) start and end within one lock.
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommInitRank` of member `rank` of `members` with the shared `id`.
    fn init(
        stream: Arc<CudaStream>,
        rank: usize,
        members: usize,
        id: &[u8; ID_BYTES],
    ) -> std::result::Result<Self, NcclError> {
        let unique = cudarc::nccl::sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful `ncclCommInitRank` before it is read; the
        // rank and size fit an i32 (a group is at most the world, which the launcher sized).
        let comm = unsafe {
            cudarc::nccl::result::comm_init_rank(
                comm.as_mut_ptr(),
                members as i32,
                unique,
                rank as i32,
            )?;
            comm.assume_init()
        };
        Ok(Self { comm, stream })
    }

    /// The raw communicator.
    pub(crate) fn raw(&self) -> ncclComm_t {
        self.comm
    }

    /// The stream NCCL runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: `comm` came from `ncclCommInitRank` and is aborted once. An error is
        // reported, not raised: this runs on failure paths.
        if let Err(e) = unsafe { cudarc::nccl::result::comm_abort(self.comm) } {
            eprintln!("[moe] {}", nccl_error("ncclCommAbort", &e));
        }
    }
}

/// Host-staged NCCL transfers: each send is copied into a device buffer on the communicator's
/// stream, all sends and receives go in one NCCL group (`ncclSend`/`ncclRecv` per peer), the
/// stream's completion is polled until the deadline, and the receives are copied back to host.
/// The device path (`device`) runs its collectives on the same communicator.
pub(crate) struct HostStagedNccl {
    /// `None` once aborted.
    comm: Option<RawComm>,
}

/// Closes an NCCL group on every path.
struct GroupGuard {
    open: bool,
}

impl GroupGuard {
    fn start() -> std::result::Result<Self, NcclError> {
        cudarc::nccl::group_start()?;
        Ok(Self { open: true })
    }

    fn end(mut self) -> std::result::Result<(), NcclError> {
        self.open = false;
        cudarc::nccl::group_end().map(|_| ())
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.open {
            let _ = cudarc::nccl::group_end();
        }
    }
}

/// Polls `event` until it completes (`Ok(true)`) or `deadline` passes (`Ok(false)`); backs off
/// from spinning to short sleeps.
fn wait_event(event: &CudaEvent, deadline: Instant) -> std::result::Result<bool, DriverError> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if event.try_is_complete()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else if start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl HostStagedNccl {
    fn new(comm: RawComm) -> Self {
        Self { comm: Some(comm) }
    }

    /// The communicator, or the error of an aborted one.
    pub(crate) fn comm(&self) -> std::result::Result<&RawComm, LinkError> {
        self.comm
            .as_ref()
            .ok_or_else(|| LinkError::Failed("the NCCL communicator was aborted".into()))
    }

    /// Waits for the work issued on the communicator's stream until `deadline`; on a timeout
    /// aborts the communicator (ending the kernels still waiting for `peers`) and returns
    /// [`LinkError::Timeout`].
    pub(crate) fn wait(
        &mut self,
        mut peers: Vec<usize>,
        deadline: Instant,
    ) -> std::result::Result<(), LinkError> {
        let done = self
            .comm()?
            .stream
            .record_event(None)
            .map_err(cuda("recording an event"))?;
        if wait_event(&done, deadline).map_err(cuda("waiting for NCCL"))? {
            return Ok(());
        }
        peers.sort_unstable();
        peers.dedup();
        self.abort();
        Err(LinkError::Timeout(peers))
    }
}

impl Wire for HostStagedNccl {
    /// Drops the communicator: cudarc's `Drop` calls `ncclCommAbort`, which also ends the
    /// kernels still waiting for peers.
    fn abort(&mut self) {
        self.comm = None;
    }

    fn group(
        &mut self,
        sends: &[(usize, &[u8])],
        recvs: &[(usize, usize)],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, LinkError> {
        let comm = self.comm()?;
        let stream = Arc::clone(comm.stream());
        let raw = comm.raw();
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda("binding the GPU"))?;
        let staged = sends
            .iter()
            .map(|(_, bytes)| stream.clone_htod(*bytes))
            .collect::<std::result::Result<Vec<CudaSlice<u8>>, _>>()
            .map_err(cuda("staging a send"))?;
        let mut landing = recvs
            .iter()
            // SAFETY: the buffers are written by the receives before they are read.
            .map(|&(_, len)| unsafe { stream.alloc::<u8>(len) })
            .collect::<std::result::Result<Vec<CudaSlice<u8>>, _>>()
            .map_err(cuda("allocating a receive buffer"))?;
        let u8_type = cudarc::nccl::sys::ncclDataType_t::ncclUint8;
        let cu_stream = stream.cu_stream() as cudarc::nccl::sys::cudaStream_t;
        {
            let group = GroupGuard::start().map_err(nccl("ncclGroupStart"))?;
            for (&(peer, _), buf) in sends.iter().zip(&staged) {
                let (ptr, _sync) = buf.device_ptr(&stream);
                // SAFETY: `buf` is a live device buffer of `buf.len()` bytes on the
                // communicator's stream; it outlives the transfer (awaited below, or the
                // communicator is aborted before the buffer is freed).
                unsafe {
                    cudarc::nccl::result::send(
                        ptr as *const _,
                        buf.len(),
                        u8_type,
                        peer as i32,
                        raw,
                        cu_stream,
                    )
                }
                .map_err(nccl("ncclSend"))?;
            }
            for (&(peer, _), buf) in recvs.iter().zip(landing.iter_mut()) {
                let (ptr, _sync) = buf.device_ptr(&stream);
                // SAFETY: as for the sends; NCCL writes `buf.len()` bytes into `buf`.
                unsafe {
                    cudarc::nccl::result::recv(
                        ptr as *mut _,
                        buf.len(),
                        u8_type,
                        peer as i32,
                        raw,
                        cu_stream,
                    )
                }
                .map_err(nccl("ncclRecv"))?;
            }
            group.end().map_err(nccl("ncclGroupEnd"))?;
        }
        let peers: Vec<usize> = sends
            .iter()
            .map(|s| s.0)
            .chain(recvs.iter().map(|r| r.0))
            .collect();
        // On a timeout the kernels still reference `staged` and `landing`: `wait` aborts
        // them first; the buffers are freed after, in stream order.
        self.wait(peers, deadline)?;
        landing
            .iter()
            .map(|buf| stream.clone_dtoh(buf))
            .collect::<std::result::Result<Vec<Vec<u8>>, _>>()
            .map_err(cuda("copying a receive to the host"))
    }
}

/// A group that may hold a queued post (for flushes from the rank's other groups).
trait Flush: Send + Sync {
    /// Whether a post is queued.
    fn has_post(&self) -> bool;
    /// Delivers the queued post, if any.
    fn flush(&self, deadline: Instant) -> std::result::Result<(), LinkError>;
    /// Global ranks of the group.
    fn ranks(&self) -> &[usize];
}

/// The NCCL groups of one rank.
#[derive(Default)]
struct Registry {
    groups: Mutex<Vec<Weak<dyn Flush>>>,
}

impl Registry {
    fn add(&self, group: Weak<dyn Flush>) {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|g| g.strong_count() > 0);
        groups.push(group);
    }

    /// Delivers the queued posts of every group but `except`.
    fn flush_except(
        &self,
        except: *const (),
        deadline: Instant,
    ) -> std::result::Result<(), LinkError> {
        let pending: Vec<Arc<dyn Flush>> = {
            let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
            groups
                .iter()
                .filter(|g| !std::ptr::addr_eq(g.as_ptr(), except))
                .filter_map(Weak::upgrade)
                .filter(|g| g.has_post())
                .collect()
        };
        for group in pending {
            group.flush(deadline).map_err(|e| {
                LinkError::Failed(format!(
                    "a message queued on NCCL group {:?} could not be delivered: {}",
                    group.ranks(),
                    describe(&e)
                ))
            })?;
        }
        Ok(())
    }
}

fn describe(e: &LinkError) -> String {
    match e {
        LinkError::Timeout(members) => format!("timed out waiting for members {members:?}"),
        LinkError::Failed(detail) => detail.clone(),
    }
}

/// The mutable part of a group's links.
struct Inner<W> {
    wire: W,
    /// A post to another member, not delivered yet (at most one: each call flushes first).
    queued: Option<(usize, Vec<u8>)>,
    /// Posts to this member itself, oldest first.
    to_self: VecDeque<Vec<u8>>,
    /// Why the group is unusable.
    broken: Option<String>,
}

struct LinkState<W> {
    ranks: Vec<usize>,
    index: usize,
    piece: usize,
    has_post: AtomicBool,
    inner: Mutex<Inner<W>>,
}

impl<W: Wire> LinkState<W> {
    fn lock(&self) -> std::result::Result<std::sync::MutexGuard<'_, Inner<W>>, LinkError> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match &inner.broken {
            Some(why) => Err(LinkError::Failed(why.clone())),
            None => Ok(inner),
        }
    }

    /// Messages in pieces: round `r` carries piece `r` of every message, so the rounds of two
    /// members match whatever else each of them moves. Checks the deadline between rounds.
    fn rounds(
        &self,
        inner: &mut Inner<W>,
        sends: &[(usize, &[u8])],
        recvs: &[(usize, usize)],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, LinkError> {
        let piece = self.piece;
        let rounds = sends
            .iter()
            .map(|s| piece_count(s.1.len(), piece))
            .chain(recvs.iter().map(|r| piece_count(r.1, piece)))
            .max()
            .unwrap_or(0);
        let mut out: Vec<Vec<u8>> = recvs.iter().map(|r| Vec::with_capacity(r.1)).collect();
        for round in 0..rounds {
            if round > 0 && Instant::now() >= deadline {
                let mut peers: Vec<usize> = sends
                    .iter()
                    .map(|s| s.0)
                    .chain(recvs.iter().map(|r| r.0))
                    .collect();
                peers.sort_unstable();
                peers.dedup();
                return Err(self.fail(inner, LinkError::Timeout(peers)));
            }
            let round_sends: Vec<(usize, &[u8])> = sends
                .iter()
                .filter_map(|&(p, b)| piece_range(b.len(), piece, round).map(|r| (p, &b[r])))
                .collect();
            let (slots, round_recvs): (Vec<usize>, Vec<(usize, usize)>) = recvs
                .iter()
                .enumerate()
                .filter_map(|(k, &(p, len))| {
                    piece_range(len, piece, round).map(|r| (k, (p, r.len())))
                })
                .unzip();
            let got = inner
                .wire
                .group(&round_sends, &round_recvs, deadline)
                .map_err(|e| self.fail(inner, e))?;
            for (k, bytes) in slots.into_iter().zip(got) {
                out[k].extend_from_slice(&bytes);
            }
        }
        Ok(out)
    }

    /// Gives the group up after `e`: the members may have moved different parts of a message,
    /// so nothing that follows could be matched.
    fn fail(&self, inner: &mut Inner<W>, e: LinkError) -> LinkError {
        inner.wire.abort();
        let after = match e {
            LinkError::Timeout(_) => "a timeout",
            LinkError::Failed(_) => "an error",
        };
        inner.broken = Some(format!(
            "NCCL group {:?} was aborted after {after} ({})",
            self.ranks,
            describe(&e)
        ));
        e
    }

    /// Delivers the queued post: its length, then its payload.
    fn flush_locked(
        &self,
        inner: &mut Inner<W>,
        deadline: Instant,
    ) -> std::result::Result<(), LinkError> {
        let Some((dst, bytes)) = inner.queued.take() else {
            return Ok(());
        };
        self.has_post.store(false, Ordering::SeqCst);
        let len = (bytes.len() as u64).to_le_bytes();
        self.rounds(inner, &[(dst, &len)], &[], deadline)?;
        self.rounds(inner, &[(dst, &bytes)], &[], deadline)?;
        Ok(())
    }
}

impl<W: Wire> Flush for LinkState<W> {
    fn has_post(&self) -> bool {
        self.has_post.load(Ordering::SeqCst)
    }

    fn flush(&self, deadline: Instant) -> std::result::Result<(), LinkError> {
        let mut inner = self.lock()?;
        self.flush_locked(&mut inner, deadline)
    }

    fn ranks(&self) -> &[usize] {
        &self.ranks
    }
}

/// [`Links`] of one group over NCCL, host-staged by default ([`HostStagedNccl`]); see the
/// module docs for the point-to-point rules.
pub(crate) struct NcclLinks<W: Wire = HostStagedNccl> {
    state: Arc<LinkState<W>>,
    registry: Arc<Registry>,
    timeout: Duration,
}

impl<W: Wire> fmt::Debug for NcclLinks<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclLinks")
            .field("ranks", &self.state.ranks)
            .field("index", &self.state.index)
            .field("piece", &self.state.piece)
            .finish()
    }
}

impl<W: Wire> NcclLinks<W> {
    /// Links of member `index` of `ranks` over `wire`, registered with the rank's other groups.
    fn new(
        wire: W,
        ranks: Vec<usize>,
        index: usize,
        timeout: Duration,
        piece: usize,
        registry: &Arc<Registry>,
    ) -> Self {
        let state = Arc::new(LinkState {
            ranks,
            index,
            piece: piece.max(1),
            has_post: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                wire,
                queued: None,
                to_self: VecDeque::new(),
                broken: None,
            }),
        });
        let weak: Weak<dyn Flush> = Arc::downgrade(&(Arc::clone(&state) as Arc<dyn Flush>));
        registry.add(weak);
        Self {
            state,
            registry: Arc::clone(registry),
            timeout,
        }
    }

    /// Runs `f` on the wire once every queued post of this rank is delivered, holding the
    /// group's lock (NCCL matches a pair's operations in issue order, so the device path's
    /// calls must follow the posts queued before them). An error of `f` gives the group up,
    /// as a failed transfer does.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn with_wire<T>(
        &self,
        deadline: Instant,
        f: impl FnOnce(&mut W) -> std::result::Result<T, LinkError>,
    ) -> std::result::Result<T, LinkError> {
        self.flush_others(deadline)?;
        let state = &self.state;
        let mut inner = state.lock()?;
        state.flush_locked(&mut inner, deadline)?;
        f(&mut inner.wire).map_err(|e| state.fail(&mut inner, e))
    }

    /// Delivers the posts queued on the rank's other groups.
    fn flush_others(&self, deadline: Instant) -> std::result::Result<(), LinkError> {
        self.registry
            .flush_except(Arc::as_ptr(&self.state) as *const (), deadline)
    }
}

impl<W: Wire> Links for NcclLinks<W> {
    fn ranks(&self) -> &[usize] {
        &self.state.ranks
    }

    fn index(&self) -> usize {
        self.state.index
    }

    fn exchange(
        &self,
        sends: &[Option<&[u8]>],
        recv_lens: &[Option<usize>],
        deadline: Instant,
    ) -> std::result::Result<Vec<Option<Vec<u8>>>, LinkError> {
        self.flush_others(deadline)?;
        let state = &self.state;
        let mut inner = state.lock()?;
        state.flush_locked(&mut inner, deadline)?;
        let sends: Vec<(usize, &[u8])> = sends
            .iter()
            .enumerate()
            .filter_map(|(j, s)| s.map(|s| (j, s)))
            .collect();
        let recvs: Vec<(usize, usize)> = recv_lens
            .iter()
            .enumerate()
            .filter_map(|(j, l)| l.map(|l| (j, l)))
            .collect();
        let got = state.rounds(&mut inner, &sends, &recvs, deadline)?;
        let mut out = vec![None; recv_lens.len()];
        for ((j, _), bytes) in recvs.into_iter().zip(got) {
            out[j] = Some(bytes);
        }
        Ok(out)
    }

    fn post(&self, dst: usize, bytes: Vec<u8>) -> std::result::Result<(), LinkError> {
        let state = &self.state;
        if dst == state.index {
            state.lock()?.to_self.push_back(bytes);
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        self.flush_others(deadline)?;
        let mut inner = state.lock()?;
        state.flush_locked(&mut inner, deadline)?;
        inner.queued = Some((dst, bytes));
        state.has_post.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn take(&self, src: usize, deadline: Instant) -> std::result::Result<Vec<u8>, LinkError> {
        let state = &self.state;
        if src == state.index {
            // Only this rank posts to itself (possibly from another thread).
            loop {
                if let Some(bytes) = state.lock()?.to_self.pop_front() {
                    return Ok(bytes);
                }
                if Instant::now() >= deadline {
                    return Err(LinkError::Timeout(vec![src]));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.flush_others(deadline)?;
        let mut inner = state.lock()?;
        // The queued post travels in the same NCCL groups as this receive, so a ring of
        // send-then-receive completes.
        let queued = inner.queued.take();
        state.has_post.store(false, Ordering::SeqCst);
        let len_out = queued.as_ref().map(|(_, b)| (b.len() as u64).to_le_bytes());
        let mut sends: Vec<(usize, &[u8])> = Vec::new();
        if let (Some((dst, _)), Some(len)) = (&queued, &len_out) {
            sends.push((*dst, len));
        }
        let got = state.rounds(&mut inner, &sends, &[(src, 8)], deadline)?;
        let len = u64::from_le_bytes(got[0].as_slice().try_into().unwrap_or([0xff; 8]));
        if len > MAX_MESSAGE {
            let detail = format!(
                "member {src} announced a message of {len} bytes: the order of sends, receives \
                 and collectives differs between the two members"
            );
            return Err(state.fail(&mut inner, LinkError::Failed(detail)));
        }
        let len = len as usize;
        let sends: Vec<(usize, &[u8])> = queued
            .as_ref()
            .map(|(dst, b)| (*dst, b.as_slice()))
            .into_iter()
            .collect();
        let mut got = state.rounds(&mut inner, &sends, &[(src, len)], deadline)?;
        Ok(got.pop().unwrap_or_default())
    }
}

impl<W: Wire> Drop for NcclLinks<W> {
    fn drop(&mut self) {
        if !self.state.has_post() {
            return;
        }
        let deadline = Instant::now() + self.timeout;
        if let Err(e) = self.state.flush(deadline) {
            eprintln!(
                "[moe] rank {}: a message queued on NCCL group {:?} was never received: {}",
                self.state.ranks[self.state.index],
                self.state.ranks,
                describe(&e)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Condvar;

    use super::*;
    use crate::comm::p2p::tests::script;
    use crate::comm::{Communicator, World};

    #[test]
    fn missing_libraries_are_config_errors_that_say_how_to_get_them() {
        assert!(check_libraries(true, true).is_ok());
        let err = check_libraries(true, false).unwrap_err();
        assert!(matches!(err, BackendError::Config { field: "nccl", .. }));
        let text = err.to_string();
        for hint in [
            "nvidia-nccl-cu12",
            "libnccl.so -> libnccl.so.2",
            "LD_LIBRARY_PATH",
        ] {
            assert!(text.contains(hint), "{text}");
        }
        assert!(!text.contains("libcuda"), "{text}");
        let text = check_libraries(false, true).unwrap_err().to_string();
        assert!(
            text.contains("libcuda") && !text.contains("libnccl"),
            "{text}"
        );
        let text = check_libraries(false, false).unwrap_err().to_string();
        assert!(
            text.contains("libcuda") && text.contains("libnccl"),
            "{text}"
        );
        // The probe agrees with the loader (this build machine has neither library).
        let present = unsafe {
            cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present()
        };
        assert_eq!(probe_libraries().is_ok(), present);
    }

    #[test]
    fn nccl_ctx_without_the_libraries_is_an_error_not_a_panic() {
        if probe_libraries().is_ok() {
            return; // a GPU machine: covered by `gpu_world_of_one`
        }
        let results = World::run(2, |boot| {
            let err = nccl_ctx(boot, NcclConfig::default()).unwrap_err();
            assert!(
                matches!(err, BackendError::Config { field: "nccl", .. }),
                "{err}"
            );
            Ok(())
        });
        assert!(results.into_iter().all(|r| r.is_ok()));
    }

    #[test]
    fn the_device_is_the_local_rank_and_never_shared() {
        use crate::devices::{DeviceError, device_index};
        assert_eq!(device_index(GpuRuntime::Cuda, 0, 8), Ok(0));
        assert_eq!(device_index(GpuRuntime::Cuda, 5, 8), Ok(5));
        assert!(matches!(
            device_index(GpuRuntime::Cuda, 9, 8),
            Err(DeviceError::TooFewDevices {
                local_ranks: 10,
                devices: 8,
                ..
            })
        ));
        assert!(device_index(GpuRuntime::Cuda, 0, 0).is_err());
    }

    #[test]
    fn ids_round_trip_through_bytes() {
        let bytes: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 37 + 200) as u8);
        assert_eq!(id_bytes(&id_from_bytes(&bytes)), bytes);
        match new_id() {
            Ok(id) => assert_eq!(id_bytes(&id_from_bytes(&id)), id),
            Err(e) => {
                // No libnccl here: the typed error, not cudarc's panic.
                assert!(
                    matches!(e, BackendError::Config { field: "nccl", .. }),
                    "{e}"
                );
                assert!(e.to_string().contains("libnccl.so"), "{e}");
            }
        }
    }

    #[test]
    fn ids_are_made_by_the_lowest_member_and_reach_every_member() {
        let results = World::run(4, |ctx| {
            let world = ctx.world()?;
            let r = ctx.rank();
            let mut got = Vec::new();
            // Groups in the same order on every member; members not in lowest-first order.
            for (key, ranks) in [
                ("a", vec![2usize, 0, 3]),
                ("b", vec![3, 1]),
                ("c", vec![0, 1, 2, 3]),
            ] {
                if let Some(index) = ranks.iter().position(|&m| m == r) {
                    let made =
                        [ranks.iter().min().copied().unwrap() as u8 + key.len() as u8; ID_BYTES];
                    let id = share_id(&world, key, &ranks, index, || {
                        assert_eq!(
                            r,
                            *ranks.iter().min().unwrap(),
                            "only the lowest member makes the id"
                        );
                        Ok(made)
                    })?;
                    got.push((key, id[0]));
                }
            }
            // A failing leader fails every member.
            if let Some(index) = [1usize, 2].iter().position(|&m| m == r) {
                let err = share_id(&world, "d", &[1, 2], index, || {
                    Err(config_error("no libnccl".into()))
                });
                assert!(err.is_err());
            }
            Ok(got)
        });
        let got: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(got[0], vec![("a", 1), ("c", 1)]);
        assert_eq!(got[1], vec![("b", 2), ("c", 1)]);
        assert_eq!(got[2], vec![("a", 1), ("c", 1)]);
        assert_eq!(got[3], vec![("a", 1), ("b", 2), ("c", 1)]);
    }

    #[test]
    fn groups_created_in_different_orders_are_reported() {
        let results = World::run(2, |ctx| {
            let world = ctx.world()?;
            let key = if ctx.rank() == 0 { "tp" } else { "ep" };
            share_id(&world, key, &[0, 1], ctx.rank(), || Ok([7; ID_BYTES]))
        });
        assert!(results[0].is_ok());
        let err = results[1].as_ref().unwrap_err().to_string();
        assert!(err.contains("different orders"), "{err}");
    }

    #[test]
    fn pieces_cover_each_message_once() {
        assert_eq!(piece_count(0, 4), 0);
        assert_eq!(piece_range(0, 4, 0), None);
        assert_eq!(piece_count(9, 4), 3);
        let ranges: Vec<_> = (0..4).map(|r| piece_range(9, 4, r)).collect();
        assert_eq!(ranges, vec![Some(0..4), Some(4..8), Some(8..9), None]);
        assert_eq!(piece_range(8, 4, 2), None);
        assert_eq!(piece_range(usize::MAX, usize::MAX, 2), None);
        // Staging of one round stays within the budget, with a floor for large groups.
        assert_eq!(piece_len(1), STAGE_BUDGET);
        assert_eq!(piece_len(8) * 8, STAGE_BUDGET);
        assert_eq!(piece_len(1024), MIN_PIECE);
        assert_eq!(piece_len(0), STAGE_BUDGET);
    }

    /// Transfers from one member to another in issue order, each with its completion flag.
    type Fifo = VecDeque<(Vec<u8>, Arc<AtomicBool>)>;

    /// An in-memory imitation of NCCL point-to-point matching: a send is visible to its
    /// receiver as soon as its group is issued but completes only when received; transfers
    /// between two members match in issue order and must agree on the size; a group returns
    /// when all its transfers are done.
    #[derive(Default)]
    struct FakeNet {
        fifos: Mutex<HashMap<(usize, usize), Fifo>>,
        wake: Condvar,
    }

    struct FakeWire {
        net: Arc<FakeNet>,
        me: usize,
        broken: bool,
    }

    impl Wire for FakeWire {
        fn group(
            &mut self,
            sends: &[(usize, &[u8])],
            recvs: &[(usize, usize)],
            deadline: Instant,
        ) -> std::result::Result<Vec<Vec<u8>>, LinkError> {
            assert!(!self.broken, "a wire is not used after a timeout");
            let mut fifos = self.net.fifos.lock().unwrap();
            let sent: Vec<Arc<AtomicBool>> = sends
                .iter()
                .map(|&(p, b)| {
                    let done = Arc::new(AtomicBool::new(false));
                    fifos
                        .entry((self.me, p))
                        .or_default()
                        .push_back((b.to_vec(), Arc::clone(&done)));
                    done
                })
                .collect();
            self.net.wake.notify_all();
            let mut got: Vec<Option<Vec<u8>>> = vec![None; recvs.len()];
            loop {
                for k in 0..recvs.len() {
                    let (p, len) = recvs[k];
                    let earlier_pending = (0..k).any(|i| recvs[i].0 == p && got[i].is_none());
                    if got[k].is_some() || earlier_pending {
                        continue;
                    }
                    if let Some((bytes, done)) =
                        fifos.get_mut(&(p, self.me)).and_then(VecDeque::pop_front)
                    {
                        done.store(true, Ordering::SeqCst);
                        self.net.wake.notify_all();
                        if bytes.len() != len {
                            return Err(LinkError::Failed(format!(
                                "size mismatch: member {p} sent {} bytes, member {} expected {len}",
                                bytes.len(),
                                self.me
                            )));
                        }
                        got[k] = Some(bytes);
                    }
                }
                if got.iter().all(Option::is_some) && sent.iter().all(|d| d.load(Ordering::SeqCst))
                {
                    return Ok(got.into_iter().flatten().collect());
                }
                let now = Instant::now();
                if now >= deadline {
                    self.broken = true;
                    let mut peers: Vec<usize> = sends
                        .iter()
                        .map(|s| s.0)
                        .chain(recvs.iter().map(|r| r.0))
                        .collect();
                    peers.sort_unstable();
                    peers.dedup();
                    return Err(LinkError::Timeout(peers));
                }
                fifos = self
                    .net
                    .wake
                    .wait_timeout(fifos, (deadline - now).min(Duration::from_millis(20)))
                    .unwrap()
                    .0;
            }
        }

        fn abort(&mut self) {
            self.broken = true;
        }
    }

    /// Runs `f` on `n` threads; each rank gets a communicator for each of `groups` groups of
    /// all ranks (sharing the rank's registry), over fake NCCL with `piece`-byte pieces.
    fn run_fake<T: Send>(
        n: usize,
        groups: usize,
        timeout: Duration,
        piece: usize,
        f: impl Fn(usize, &[P2pComm<NcclLinks<FakeWire>>]) -> T + Sync,
    ) -> Vec<T> {
        let nets: Vec<Arc<FakeNet>> = (0..groups).map(|_| Arc::default()).collect();
        let (f, nets) = (&f, &nets);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|me| {
                    s.spawn(move || {
                        let registry = Arc::new(Registry::default());
                        let comms: Vec<_> = nets
                            .iter()
                            .map(|net| {
                                let wire = FakeWire {
                                    net: Arc::clone(net),
                                    me,
                                    broken: false,
                                };
                                let links = NcclLinks::new(
                                    wire,
                                    (0..n).collect(),
                                    me,
                                    timeout,
                                    piece,
                                    &registry,
                                );
                                P2pComm::new(links, timeout)
                            })
                            .collect();
                        f(me, &comms)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn msg(rank: usize, k: usize, len: usize) -> TensorData {
        TensorData::new(
            (0..len)
                .map(|i| (rank * 1000 + k * 100 + i) as f32)
                .collect::<Vec<f32>>(),
            [len],
        )
    }

    fn recv(c: &dyn Communicator, src: usize, len: usize) -> Vec<f32> {
        c.recv(&[len], DType::F32, src, Location::caller())
            .unwrap()
            .try_to_vec::<f32>()
            .unwrap()
    }

    fn send(c: &dyn Communicator, data: TensorData, dst: usize) {
        c.send(data, dst, Location::caller()).unwrap();
    }

    #[test]
    fn collectives_over_imitated_nccl_equal_the_in_process_world_bit_for_bit() {
        for n in [1usize, 2, 3, 4] {
            // 1000-byte pieces: the large all-reduce and all-to-all travel in many rounds.
            let fake = run_fake(n, 1, Duration::from_secs(60), 1000, |_, c| script(&c[0]));
            let local: Vec<Vec<Vec<u8>>> =
                World::run(n, |ctx| Ok(script(ctx.world()?.communicator().as_ref())))
                    .into_iter()
                    .map(|r| r.unwrap())
                    .collect();
            assert_eq!(fake, local, "world of {n}");
        }
    }

    #[test]
    fn pairwise_exchanges_rings_and_self_sends_complete() {
        let out = run_fake(4, 1, Duration::from_secs(30), 64, |r, c| {
            let c = &c[0];
            let mut got = Vec::new();
            // Pairwise exchange 0<->1, 2<->3, long enough for several pieces.
            let peer = r ^ 1;
            send(c, msg(r, 0, 50), peer);
            got.push(recv(c, peer, 50)[49]);
            // A ring, then a collective right after.
            send(c, msg(r, 1, 3), (r + 1) % 4);
            got.push(recv(c, (r + 3) % 4, 3)[0]);
            c.barrier(Location::caller()).unwrap();
            // To itself.
            send(c, msg(r, 2, 2), r);
            got.push(recv(c, r, 2)[1]);
            got
        });
        for (r, got) in out.iter().enumerate() {
            let (peer, prev) = (r ^ 1, (r + 3) % 4);
            let expect = [
                (peer * 1000 + 49) as f32,
                (prev * 1000 + 100) as f32,
                (r * 1000 + 201) as f32,
            ];
            assert_eq!(got, &expect, "rank {r}");
        }
    }

    #[test]
    fn a_one_f_one_b_pipeline_completes_and_its_last_sends_are_delivered() {
        // Two stages, three micro-batches, Megatron's 1F1B order with send-then-receive pairs;
        // group 0 is the pipeline, group 1 another group of the same ranks (data parallel).
        let out = run_fake(2, 2, Duration::from_secs(30), 16, |r, c| {
            let (pipe, other) = (&c[0], &c[1]);
            let mut got = Vec::new();
            if r == 0 {
                send(pipe, msg(0, 0, 10), 1); // warm-up forward
                for k in 1..3 {
                    send(pipe, msg(0, k, 10), 1); // send_forward_recv_backward
                    got.push(recv(pipe, 1, 4)[3]);
                }
                got.push(recv(pipe, 1, 4)[3]); // cool-down recv_backward
                other.barrier(Location::caller()).unwrap();
                got.push(recv(pipe, 1, 2)[1]);
            } else {
                got.push(recv(pipe, 0, 10)[9]);
                for k in 0..2 {
                    send(pipe, msg(1, k, 4), 0); // send_backward_recv_forward
                    got.push(recv(pipe, 0, 10)[9]);
                }
                // The last send on the pipeline is delivered by the next call on another group.
                send(pipe, msg(1, 2, 4), 0);
                other.barrier(Location::caller()).unwrap();
                // The very last call: delivered when the group is dropped.
                send(pipe, msg(1, 3, 2), 0);
            }
            got
        });
        assert_eq!(out[0], vec![1003.0, 1103.0, 1203.0, 1301.0]);
        assert_eq!(out[1], vec![9.0, 109.0, 209.0]);
    }

    #[test]
    fn a_reply_to_an_unreceived_message_times_out_instead_of_hanging() {
        // The documented limitation: A sends then waits for B's reply, B receives then replies.
        let start = Instant::now();
        let out = run_fake(2, 1, Duration::from_millis(300), 1 << 10, |r, c| {
            let c = &c[0];
            let site = Location::caller();
            if r == 0 {
                c.send(msg(0, 0, 4), 1, site)?;
                c.recv(&[4], DType::F32, 1, site).map(|_| ())
            } else {
                c.recv(&[4], DType::F32, 0, site)?;
                c.send(msg(1, 0, 4), 0, site)
            }
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        for (r, result) in out.iter().enumerate() {
            let err = result.as_ref().unwrap_err();
            assert!(
                matches!(err, BackendError::Timeout { .. }),
                "rank {r}: {err}"
            );
        }
    }

    #[test]
    fn a_member_that_never_joins_is_named_and_the_group_stays_failed() {
        let out = run_fake(3, 1, Duration::from_millis(300), 1 << 10, |r, c| {
            let c = &c[0];
            if r == 2 {
                return (String::new(), String::new());
            }
            let data = TensorData::new(vec![1.0f32; 4], [4]);
            let first = c
                .all_reduce(data.clone(), crate::comm::ReduceOp::Sum, Location::caller())
                .unwrap_err();
            let second = c
                .all_reduce(data, crate::comm::ReduceOp::Sum, Location::caller())
                .unwrap_err();
            (first.to_string(), second.to_string())
        });
        for (first, second) in &out[..2] {
            assert!(
                first.contains("timed out") && first.contains('2'),
                "{first}"
            );
            assert!(second.contains("aborted after a timeout"), "{second}");
        }
    }

    /// One GPU, one process: NCCL bootstrap, the host-staged transfers (through NCCL to this
    /// rank itself, in several pieces) and every collective of the script.
    ///
    /// Needs an NVIDIA GPU, libcuda and `libnccl.so` on the library path (see the module
    /// docs); run with `cargo test -p moe-backend --features nccl --lib gpu_world_of_one --
    /// --ignored`.
    #[test]
    #[ignore = "needs an NVIDIA GPU, libcuda and libnccl.so"]
    fn gpu_world_of_one() {
        probe_libraries().unwrap();
        let results = World::run(1, |boot| {
            let config = NcclConfig {
                timeout: Duration::from_secs(60),
                local_rank: Some(0),
            };
            let ctx = nccl_ctx(boot, config)?;
            let world = ctx.world()?;
            let local = World::run(1, |c| Ok(script(c.world()?.communicator().as_ref())));
            assert_eq!(
                script(world.communicator().as_ref()),
                *local[0].as_ref().unwrap()
            );
            // The staging path itself: NCCL send/recv to this rank in 3 pieces.
            let device = CudaContext::new(0).unwrap();
            let comm = RawComm::init(device.new_stream().unwrap(), 0, 1, &new_id()?).unwrap();
            let registry = Arc::new(Registry::default());
            let links = NcclLinks::new(
                HostStagedNccl::new(comm),
                vec![0],
                0,
                Duration::from_secs(60),
                1000,
                &registry,
            );
            let bytes: Vec<u8> = (0..2500).map(|i| (i % 251) as u8).collect();
            let deadline = Instant::now() + Duration::from_secs(60);
            let got = links
                .exchange(&[Some(bytes.as_slice())], &[Some(bytes.len())], deadline)
                .unwrap();
            assert_eq!(got[0].as_deref(), Some(bytes.as_slice()));
            Ok(())
        });
        results.into_iter().for_each(|r| r.unwrap());
    }
}
