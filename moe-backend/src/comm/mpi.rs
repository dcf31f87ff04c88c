//! Ranks as processes over MPI (feature `mpi`): one process per rank, launched by `mpirun`,
//! `srun` or any MPI launcher, with every collective of [`Communicator`](super::Communicator) built by
//! the `p2p` module from non-blocking MPI point-to-point messages.
//!
//! ```no_run
//! # fn main() -> moe_backend::Result<()> {
//! use moe_backend::comm::mpi::{MpiConfig, MpiWorld};
//! use moe_backend::parallel::ParallelLayout;
//!
//! let world = MpiWorld::init(MpiConfig::default())?;
//! let layout = ParallelLayout::parse(world.size(), "tp=2,ep=4")?;
//! world.run(|ctx| {
//!     let groups = ctx.process_groups(&layout)?; // the same code as on World::run's threads
//!     Ok(groups.groups.tp_rank())
//! })?;
//! # Ok(()) }
//! ```
//!
//! # Groups
//! Each group is its own MPI communicator, made with `MPI_Comm_create_group` from the world
//! (collective over the group's members only), so [`RankCtx::group`] and
//! [`RankCtx::process_groups`] behave as on the in-process world. Collectives use one tag
//! and point-to-point messages another, so buffered sends never meet a collective's messages.
//!
//! # Faults
//! MPI (without the fault-tolerance extension) cannot tell the survivors of a failed process
//! to carry on, so every fault ends the whole job promptly and names the rank:
//! - a rank whose closure returns an error prints it and calls `MPI_Abort` ([`MpiWorld::run`]);
//! - a panicking rank does the same from a panic hook (without it, unwinding into
//!   `MPI_Finalize` would hang the job);
//! - a collective that waits longer than [`MpiConfig::timeout`] prints the ranks it is waiting
//!   for and aborts (a pending MPI send cannot be withdrawn safely, so the collective does not
//!   return);
//! - a process killed outright (`kill -9`) is noticed by the launcher, which ends the job
//!   (`mpirun noticed that process rank R … exited on signal 9`).
//!
//! A checkpoint being saved when the job ends is never committed (see `moe_bridge::dist`): the
//! previous one stays the latest.
//!
//! # Sizes
//! Messages are cut into pieces of at most 1 GiB, so tensors beyond MPI's `int` counts travel
//! whole.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::Comm;
use super::ctx::{Connector, RankCtx, Transport};
use super::launch::Launch;
use super::p2p::{LinkError, Links, P2pComm};
use crate::error::{BackendError, Result};

/// Settings of an MPI world.
#[derive(Debug, Clone)]
pub struct MpiConfig {
    /// How long a collective or receive waits for the other members before the job is aborted.
    pub timeout: Duration,
}

impl Default for MpiConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
        }
    }
}

/// Largest piece of one message (MPI counts are `int`).
const PIECE: usize = 1 << 30;
/// Tag of collective messages.
const COLL_TAG: c_int = 1;
/// Tag of point-to-point messages (`send` / `recv`).
const P2P_TAG: c_int = 2;

/// The process's MPI world: initialised once per process; dropping it finalises MPI.
pub struct MpiWorld {
    _universe: mpi::environment::Universe,
    rank: usize,
    size: usize,
    config: MpiConfig,
}

impl fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiWorld")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn abort(code: c_int) -> ! {
    // SAFETY: MPI is initialised (an MpiWorld exists or existed); MPI_Abort may be called from
    // any thread under MPI_THREAD_MULTIPLE and does not return.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code)
}

impl MpiWorld {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE`, installs the panic hook that aborts the job,
    /// and checks the MPI world against the launcher's environment (a process started by
    /// torchrun without an MPI runtime sees an MPI world of 1 and is refused).
    pub fn init(config: MpiConfig) -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| BackendError::Config {
                field: "mpi",
                detail: "MPI is already initialised in this process (one MpiWorld per \
                             process)"
                    .into(),
            })?;
        if threading < mpi::Threading::Multiple {
            return Err(BackendError::Config {
                field: "mpi",
                detail: format!(
                    "the MPI library provides thread level {threading:?}; MPI_THREAD_MULTIPLE \
                     is required"
                ),
            });
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialised; the out-pointers are valid.
        unsafe {
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
        }
        let (rank, size) = (rank as usize, size as usize);
        if let Some(launch) = Launch::from_env()?
            && (launch.world_size != size || launch.rank != rank)
        {
            return Err(BackendError::Config {
                field: "launcher",
                detail: format!(
                    "{} started this process as rank {} of {}, but MPI sees rank {rank} of \
                     {size}: start MPI jobs with mpirun or srun (torchrun does not start an \
                     MPI runtime)",
                    launch.launcher, launch.rank, launch.world_size
                ),
            });
        }
        install_panic_hook(rank);
        Ok(Self {
            _universe: universe,
            rank,
            size,
            config,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank context of this process (groups are created on first use).
    pub fn ctx(&self) -> RankCtx {
        RankCtx::new(
            self.rank,
            self.size,
            Transport::Process(Arc::new(MpiConnector {
                timeout: self.config.timeout,
            })),
        )
    }

    /// Runs this rank's part of an SPMD job, as [`super::World::run`] runs a thread's. An
    /// error ends the whole job (printed with the rank, then `MPI_Abort`), so the other ranks
    /// never wait for this one; on success every rank meets at a barrier before returning.
    pub fn run<T>(&self, f: impl FnOnce(&RankCtx) -> Result<T>) -> Result<T> {
        let ctx = self.ctx();
        let result = f(&ctx).and_then(|value| {
            ctx.world()?.barrier()?;
            Ok(value)
        });
        match result {
            Ok(value) => Ok(value),
            Err(e) => {
                eprintln!("[moe] rank {} of {} failed: {e}", self.rank, self.size);
                eprintln!("[moe] aborting the MPI job");
                abort(1)
            }
        }
    }

    /// Ends the whole job with `code` (every process).
    pub fn abort(&self, code: i32) -> ! {
        abort(code)
    }
}

fn install_panic_hook(rank: usize) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("[moe] rank {rank} panicked; aborting the MPI job");
            abort(101);
        }));
    });
}

struct MpiConnector {
    timeout: Duration,
}

impl Connector for MpiConnector {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn connect(&self, key: &str, ranks: &[usize], index: usize) -> Result<Comm> {
        let members: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        // Same tag on every member: a hash of the group key (names + ranks).
        let tag = (key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }) % 30_000) as c_int;
        let mut comm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI is initialised; every handle is created and freed here, the pointers are
        // valid for the calls; MPI_Comm_create_group is collective over `members`, which every
        // member enters in the same order of groups (RankCtx::group's contract).
        let code = unsafe {
            let mut world_group: ffi::MPI_Group = ffi::RSMPI_GROUP_NULL;
            ffi::MPI_Comm_group(ffi::RSMPI_COMM_WORLD, &mut world_group);
            let mut group: ffi::MPI_Group = ffi::RSMPI_GROUP_NULL;
            ffi::MPI_Group_incl(
                world_group,
                members.len() as c_int,
                members.as_ptr(),
                &mut group,
            );
            let code = ffi::MPI_Comm_create_group(ffi::RSMPI_COMM_WORLD, group, tag, &mut comm);
            ffi::MPI_Group_free(&mut group);
            ffi::MPI_Group_free(&mut world_group);
            code
        };
        if code != 0 {
            return Err(BackendError::Collective {
                op: "create_group",
                group: format!("{ranks:?}"),
                detail: format!("MPI_Comm_create_group failed with code {code} for `{key}`"),
            });
        }
        let links = MpiLinks {
            comm: RawComm(comm),
            ranks: ranks.to_vec(),
            index,
            pending: Mutex::new(Vec::new()),
        };
        Ok(Comm::new(Arc::new(P2pComm::new(links, self.timeout))))
    }
}

/// An MPI communicator handle.
struct RawComm(ffi::MPI_Comm);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE, under which a communicator handle may
// be used from any thread; the handle itself is never mutated after creation, and P2pComm
// serialises the collectives of one group.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// A buffered send in flight: its requests and the buffers they read.
struct InFlight {
    requests: Vec<ffi::MPI_Request>,
    _buffers: Vec<Vec<u8>>,
}

// SAFETY: requests are plain MPI handles, usable from any thread under MPI_THREAD_MULTIPLE;
// the buffers are owned and outlive the requests.
unsafe impl Send for InFlight {}

struct MpiLinks {
    comm: RawComm,
    ranks: Vec<usize>,
    index: usize,
    pending: Mutex<Vec<InFlight>>,
}

impl fmt::Debug for MpiLinks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiLinks")
            .field("ranks", &self.ranks)
            .field("index", &self.index)
            .finish()
    }
}

/// Byte ranges of the pieces of a `len`-byte message (one empty piece for an empty one).
fn pieces(len: usize) -> Vec<std::ops::Range<usize>> {
    if len == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..len)
        .step_by(PIECE)
        .map(|s| s..(s + PIECE).min(len))
        .collect()
}

/// Whether every request has completed (completed ones become `MPI_REQUEST_NULL`).
fn test_all(requests: &mut [ffi::MPI_Request]) -> bool {
    let mut done = true;
    for req in requests.iter_mut() {
        // SAFETY: `req` is a valid request or MPI_REQUEST_NULL (for which MPI_Test sets the
        // flag); the status is ignored.
        unsafe {
            if *req == ffi::RSMPI_REQUEST_NULL {
                continue;
            }
            let mut flag: c_int = 0;
            ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
            if flag == 0 {
                done = false;
            }
        }
    }
    done
}

/// Polls until `requests` complete; backs off from spinning to yielding to short sleeps so
/// oversubscribed ranks leave the cores to the ones computing.
fn wait(requests: &mut [ffi::MPI_Request], deadline: Instant) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if test_all(requests) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
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

impl MpiLinks {
    fn isend(&self, bytes: &[u8], peer: usize, tag: c_int, out: &mut Vec<ffi::MPI_Request>) {
        for piece in pieces(bytes.len()) {
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the buffer outlives the request (callers wait for it, or keep the buffer
            // in `pending`); counts fit in c_int (pieces of at most 1 GiB).
            unsafe {
                ffi::MPI_Isend(
                    bytes[piece.clone()].as_ptr() as *const c_void,
                    piece.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    tag,
                    self.comm.0,
                    &mut req,
                );
            }
            out.push(req);
        }
    }

    fn irecv(&self, buf: &mut [u8], peer: usize, tag: c_int, out: &mut Vec<ffi::MPI_Request>) {
        for piece in pieces(buf.len()) {
            let len = piece.len();
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: as in `isend`; the receive buffer is not touched until the request
            // completes.
            unsafe {
                ffi::MPI_Irecv(
                    buf[piece].as_mut_ptr() as *mut c_void,
                    len as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    tag,
                    self.comm.0,
                    &mut req,
                );
            }
            out.push(req);
        }
    }

    /// Drops the buffered sends that have completed.
    fn reap(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain_mut(|f| !test_all(&mut f.requests));
    }

    /// A wait that ran out of time: the pending requests still reference buffers, so the job
    /// is ended here with the ranks that did not answer.
    fn timed_out(&self, what: &str, waiting: &[usize]) -> ! {
        let ranks: Vec<usize> = waiting.iter().map(|&m| self.ranks[m]).collect();
        eprintln!(
            "[moe] rank {}: {what} in group {:?} timed out waiting for rank(s) {ranks:?}; \
             aborting the MPI job",
            self.ranks[self.index], self.ranks
        );
        abort(3)
    }
}

impl Links for MpiLinks {
    fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn index(&self) -> usize {
        self.index
    }

    fn exchange(
        &self,
        sends: &[Option<&[u8]>],
        recv_lens: &[Option<usize>],
        deadline: Instant,
    ) -> std::result::Result<Vec<Option<Vec<u8>>>, LinkError> {
        self.reap();
        let mut out: Vec<Option<Vec<u8>>> = recv_lens
            .iter()
            .map(|l| l.map(|len| vec![0u8; len]))
            .collect();
        let mut requests = Vec::new();
        let mut owners = Vec::new();
        for (j, buf) in out.iter_mut().enumerate() {
            if let Some(buf) = buf {
                let before = requests.len();
                self.irecv(buf, j, COLL_TAG, &mut requests);
                owners.extend(std::iter::repeat_n(j, requests.len() - before));
            }
        }
        for (j, bytes) in sends.iter().enumerate() {
            if let Some(bytes) = bytes {
                let before = requests.len();
                self.isend(bytes, j, COLL_TAG, &mut requests);
                owners.extend(std::iter::repeat_n(j, requests.len() - before));
            }
        }
        if !wait(&mut requests, deadline) {
            let mut waiting: Vec<usize> = requests
                .iter()
                .zip(&owners)
                .filter(|(r, _)| **r != unsafe { ffi::RSMPI_REQUEST_NULL })
                .map(|(_, &j)| j)
                .collect();
            waiting.dedup();
            self.timed_out("collective", &waiting);
        }
        Ok(out)
    }

    fn post(&self, dst: usize, bytes: Vec<u8>) -> std::result::Result<(), LinkError> {
        self.reap();
        let len = (bytes.len() as u64).to_le_bytes().to_vec();
        let mut requests = Vec::new();
        self.isend(&len, dst, P2P_TAG, &mut requests);
        self.isend(&bytes, dst, P2P_TAG, &mut requests);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(InFlight {
                requests,
                _buffers: vec![len, bytes],
            });
        Ok(())
    }

    fn take(&self, src: usize, deadline: Instant) -> std::result::Result<Vec<u8>, LinkError> {
        self.reap();
        let mut len = [0u8; 8];
        let mut requests = Vec::new();
        self.irecv(&mut len, src, P2P_TAG, &mut requests);
        if !wait(&mut requests, deadline) {
            self.timed_out("recv", &[src]);
        }
        let len = usize::try_from(u64::from_le_bytes(len))
            .map_err(|_| LinkError::Failed("message length does not fit in memory".into()))?;
        let mut buf = vec![0u8; len];
        let mut requests = Vec::new();
        self.irecv(&mut buf, src, P2P_TAG, &mut requests);
        if !wait(&mut requests, deadline) {
            self.timed_out("recv", &[src]);
        }
        Ok(buf)
    }
}

impl Drop for MpiLinks {
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            return;
        }
        // Buffered sends must complete before their buffers go.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for f in pending.iter_mut() {
            if !wait(&mut f.requests, deadline) {
                eprintln!(
                    "[moe] rank {}: a buffered send in group {:?} was never received",
                    self.ranks[self.index], self.ranks
                );
                abort(3);
            }
        }
        pending.clear();
        // SAFETY: no request of this communicator is pending any more.
        unsafe {
            ffi::MPI_Comm_free(&mut self.comm.0);
        }
    }
}
