//! Ranks as processes over plain TCP (always built, no MPI runtime needed): one process per
//! rank, launched by `torchrun --nproc-per-node 4 --no-python <binary> …` or anything else that
//! sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`. Every collective of
//! [`Communicator`](super::Communicator) is built by the crate's point-to-point layer (as for
//! MPI, with the same checks and bit-identical results) on a full mesh of TCP connections, one
//! per pair of ranks.
//!
//! ```no_run
//! # fn main() -> moe_backend::Result<()> {
//! use moe_backend::comm::launch::Launch;
//! use moe_backend::comm::tcp::{TcpConfig, TcpWorld};
//! use moe_backend::parallel::ParallelLayout;
//!
//! let launch = Launch::from_env()?.expect("started by torchrun");
//! let world = TcpWorld::init(&launch, TcpConfig::default())?;
//! let layout = ParallelLayout::parse(world.size(), "tp=2,ep=4")?;
//! world.run(|ctx| {
//!     let groups = ctx.process_groups(&layout)?; // the same code as on World::run's threads
//!     Ok(groups.groups.tp_rank())
//! })?;
//! # Ok(()) }
//! ```
//!
//! # Rendezvous
//! Rank 0 listens at `MASTER_ADDR:MASTER_PORT` (at `MASTER_PORT + 1` when torchrun's agent
//! keeps its own store on `MASTER_PORT`, i.e. `TORCHELASTIC_USE_AGENT_STORE=True`; every rank
//! applies the same rule). Every other rank connects there (retrying until
//! [`TcpConfig::connect_timeout`]), opens its own listener on an ephemeral port of the address
//! it reached the master from, and registers `(rank, world size, listener address)`. Rank 0
//! checks the registrations (same world size, every rank once), draws a random job token and
//! sends everyone the table of listener addresses with the token; a disagreement is sent to
//! every registered rank as an error, so the whole job fails with the same message. Then every
//! rank connects to every lower rank and accepts the higher ones: the connecting side sends a
//! hello (protocol magic and version, job token, world size, its rank, the rank it meant to
//! reach) and the accepting side answers with its rank. Connections that do not speak the
//! protocol or carry another job's token are dropped; a peer with the right token but a wrong
//! world size or rank is an error. Every socket has `TCP_NODELAY`.
//!
//! # Frames
//! All groups share the per-pair sockets. A frame is a 24-byte header (kind, channel, six
//! reserved bytes, group id, payload length; little-endian) and its payload. The group id is a
//! hash of the group key (`name[ranks]`), the same on every member; the channel separates
//! collective traffic from `send`/`recv`. Kinds: data, abort (payload: the sender's error) and
//! bye (orderly close). One reader thread per peer sorts data frames into mailboxes per (group,
//! channel, sender), where the links wait for them (until the collective's deadline); one writer
//! thread per peer drains a queue of frames, so a send never blocks the caller, even when both
//! ends of a socket write at once.
//!
//! # Failures
//! Nothing waits longer than [`TcpConfig::timeout`], and every failure names the rank:
//! - a peer whose socket ends without a bye (process killed, `kill -9`, crashed node that the
//!   kernel reports) fails every pending and later operation of every group of this rank with
//!   "rank R closed its connection (process gone?)", as soon as the kernel reports the end;
//! - a rank whose [`TcpWorld::run`] closure returns an error or panics sends an abort frame with
//!   its message to every peer (and waits up to two seconds for them to leave the socket), so
//!   the survivors fail with `rank R failed: <message>`; `run` then returns the error;
//! - a deadline that passes is a [`BackendError::Timeout`] naming the ranks not heard from.
//!
//! The first failure is kept for the whole world, as in the in-process [`World`](super::World):
//! a job with a failed rank cannot complete. A normal end is not a failure: [`TcpWorld::run`]
//! ends with a world barrier, and dropping the [`TcpWorld`] sends a bye to every peer, closes
//! the sending side and waits (at most five seconds) for the peers to do the same, reading all
//! the while, so no rank loses data or sees a reset. Operations of a group that need a peer that
//! has said bye fail with "rank R has left the job".

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Comm;
use super::ctx::{Connector, RankCtx, Transport, catch_rank};
use super::launch::Launch;
use super::p2p::{LinkError, Links, P2pComm};
use crate::error::{BackendError, Result};

#[cfg(test)]
mod tests;

/// Settings of a TCP world.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// How long a collective or receive waits for the other members.
    pub timeout: Duration,
    /// How long the rendezvous waits: for the master to be reachable, for every rank to
    /// register, and for the mesh connections.
    pub connect_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(60),
        }
    }
}

/// Protocol magic (rendezvous messages and hellos).
const MAGIC: u64 = u64::from_le_bytes(*b"moe-tcp\0");
/// Protocol version (rendezvous messages and hellos).
const VERSION: u32 = 1;
/// Bytes of a frame header.
const FRAME_HEADER: usize = 24;
/// Frame kinds.
const KIND_DATA: u8 = 0;
const KIND_ABORT: u8 = 1;
const KIND_BYE: u8 = 2;
/// Frame channels.
const CHANNEL_COLL: u8 = 0;
const CHANNEL_P2P: u8 = 1;
/// Longest rendezvous message.
const MAX_RENDEZVOUS_MESSAGE: usize = 16 << 20;
/// How long dropping a world waits for the peers to close their side.
const LINGER: Duration = Duration::from_secs(5);
/// How long a failing rank waits for its abort frames to leave.
const ABORT_FLUSH: Duration = Duration::from_secs(2);
/// Poll interval of the non-blocking accept loops and of connect retries.
const POLL: Duration = Duration::from_millis(5);
const RETRY: Duration = Duration::from_millis(100);
/// Longest wait for a connection's first message (a silent stray connection is dropped).
const FIRST_MESSAGE: Duration = Duration::from_secs(5);
/// Socket buffer sizes of the reader and writer threads.
const IO_BUFFER: usize = 1 << 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn rendezvous_error(size: usize, detail: String) -> BackendError {
    BackendError::Collective {
        op: "tcp_rendezvous",
        group: format!("world of {size}"),
        detail,
    }
}

/// FNV-1a of a group key: the group id in frames, the same on every member.
fn group_id(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn random_token() -> u64 {
    let mut h = RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

// ---------------------------------------------------------------------------------------------
// Rendezvous messages: a u32 length, then the body.

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(self, s: &str) -> Self {
        let mut e = self.u32(s.len() as u32);
        e.0.extend_from_slice(s.as_bytes());
        e
    }
}

struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
    fn str(&mut self) -> Option<String> {
        let len = self.u32()? as usize;
        self.take(len)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

fn send_message(stream: &mut TcpStream, body: &[u8]) -> io::Result<()> {
    let mut bytes = Vec::with_capacity(4 + body.len());
    bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
    bytes.extend_from_slice(body);
    stream.write_all(&bytes)?;
    stream.flush()
}

fn recv_message(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_RENDEZVOUS_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message of {len} bytes is not part of the protocol"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(body)
}

/// A rank's registration with the master.
struct Registration {
    world: u64,
    rank: u64,
    addr: String,
}

impl Registration {
    fn encode(&self) -> Vec<u8> {
        Enc::default()
            .u64(MAGIC)
            .u32(VERSION)
            .u64(self.world)
            .u64(self.rank)
            .str(&self.addr)
            .0
    }

    /// `None` when the bytes are not a registration of this protocol version.
    fn decode(body: &[u8]) -> Option<Self> {
        let mut d = Dec(body);
        if d.u64()? != MAGIC || d.u32()? != VERSION {
            return None;
        }
        Some(Self {
            world: d.u64()?,
            rank: d.u64()?,
            addr: d.str()?,
        })
    }
}

fn encode_refusal(message: &str) -> Vec<u8> {
    Enc::default().u64(MAGIC).u8(1).str(message).0
}

fn encode_table(token: u64, table: &[SocketAddr]) -> Vec<u8> {
    let mut e = Enc::default()
        .u64(MAGIC)
        .u8(0)
        .u64(token)
        .u64(table.len() as u64);
    for addr in table {
        e = e.str(&addr.to_string());
    }
    e.0
}

/// The master's answer: `Ok((token, table))` or its refusal.
fn decode_answer(body: &[u8]) -> Option<std::result::Result<(u64, Vec<String>), String>> {
    let mut d = Dec(body);
    if d.u64()? != MAGIC {
        return None;
    }
    match d.u8()? {
        0 => {
            let token = d.u64()?;
            let n = usize::try_from(d.u64()?).ok()?;
            let table = (0..n).map(|_| d.str()).collect::<Option<Vec<_>>>()?;
            Some(Ok((token, table)))
        }
        _ => Some(Err(d.str()?)),
    }
}

/// The first message on a mesh connection.
struct Hello {
    token: u64,
    world: u64,
    from: u64,
    to: u64,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        Enc::default()
            .u64(MAGIC)
            .u32(VERSION)
            .u64(self.token)
            .u64(self.world)
            .u64(self.from)
            .u64(self.to)
            .0
    }

    fn decode(body: &[u8]) -> Option<Self> {
        let mut d = Dec(body);
        if d.u64()? != MAGIC || d.u32()? != VERSION {
            return None;
        }
        Some(Self {
            token: d.u64()?,
            world: d.u64()?,
            from: d.u64()?,
            to: d.u64()?,
        })
    }
}

fn encode_ack(token: u64, rank: usize, refusal: Option<&str>) -> Vec<u8> {
    let e = Enc::default().u64(MAGIC).u64(token).u64(rank as u64);
    match refusal {
        None => e.u8(0).0,
        Some(message) => e.u8(1).str(message).0,
    }
}

/// `(token, rank, refusal)` of an acknowledgement.
fn decode_ack(body: &[u8]) -> Option<(u64, u64, Option<String>)> {
    let mut d = Dec(body);
    if d.u64()? != MAGIC {
        return None;
    }
    let token = d.u64()?;
    let rank = d.u64()?;
    let refusal = match d.u8()? {
        0 => None,
        _ => Some(d.str()?),
    };
    Some((token, rank, refusal))
}

// ---------------------------------------------------------------------------------------------
// Rendezvous.

/// The port rank 0 listens on: `MASTER_PORT`, or the next one when torchrun's agent keeps its
/// own store on `MASTER_PORT`.
fn rendezvous_port(port: u16, agent_store: bool) -> Result<u16> {
    if !agent_store {
        return Ok(port);
    }
    port.checked_add(1).ok_or_else(|| BackendError::Config {
        field: "MASTER_PORT",
        detail: format!(
            "torchrun's agent holds MASTER_PORT={port}; the rendezvous uses the next port, \
             which does not exist"
        ),
    })
}

/// Whether torchrun's agent hosts its store on `MASTER_PORT` for this process.
fn torchrun_agent_store() -> bool {
    std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v == "True")
}

/// Rank 0's side: collects every registration on `listener` and answers with the table.
/// Returns the job token and the table of listener addresses (rank 0's own entry is `own`).
fn master_rendezvous(
    listener: &TcpListener,
    size: usize,
    own_port: u16,
    own: SocketAddr,
    connect_timeout: Duration,
) -> Result<(u64, Vec<SocketAddr>)> {
    let listen_addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let io_error = |what: &str, e: io::Error| {
        rendezvous_error(size, format!("rank 0 {what} at {listen_addr}: {e}"))
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| io_error("could not poll its listener", e))?;
    let deadline = Instant::now() + connect_timeout;
    let mut table: Vec<Option<SocketAddr>> = vec![None; size];
    table[0] = Some(own);
    // Registered ranks, their connection and the address they reached rank 0 at.
    let mut members: Vec<(usize, TcpStream, IpAddr)> = Vec::new();
    let refuse_all = |members: &mut Vec<(usize, TcpStream, IpAddr)>, message: &str| {
        for (_, stream, _) in members.iter_mut() {
            let _ = send_message(stream, &encode_refusal(message));
        }
    };
    while table.iter().any(Option::is_none) {
        let (mut stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (0..size).filter(|&r| table[r].is_none()).collect();
                    refuse_all(
                        &mut members,
                        &format!(
                            "rank 0 gave up after {:.1} s waiting for ranks {waiting:?} to \
                             register at {listen_addr}",
                            connect_timeout.as_secs_f64()
                        ),
                    );
                    return Err(BackendError::Timeout {
                        op: "tcp_rendezvous",
                        group: format!("world of {size}"),
                        waiting,
                        seconds: connect_timeout.as_secs_f64(),
                        site: format!("TcpWorld::init, rank 0 listening at {listen_addr}"),
                    });
                }
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                refuse_all(&mut members, &format!("rank 0 failed to accept: {e}"));
                return Err(io_error("failed to accept", e));
            }
        };
        let registration = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(FIRST_MESSAGE.min(remaining(deadline)))))
            .and_then(|()| recv_message(&mut stream))
            .ok()
            .and_then(|body| Registration::decode(&body));
        // Not this protocol (a port scanner, another program): dropped.
        let Some(reg) = registration else { continue };
        let problem = if reg.world != size as u64 {
            Some(format!(
                "rank {} (from {peer}) was started for a world of {}, rank 0 for a world of {size}",
                reg.rank, reg.world
            ))
        } else if reg.rank == 0 || reg.rank >= size as u64 {
            Some(format!(
                "a process at {peer} registered as rank {} of a world of {size}, where only \
                 ranks 1..{size} register with rank 0",
                reg.rank
            ))
        } else if table[reg.rank as usize].is_some() {
            Some(format!(
                "rank {} registered twice (again from {peer})",
                reg.rank
            ))
        } else {
            None
        };
        let addr = reg.addr.parse::<SocketAddr>();
        let problem = problem.or_else(|| {
            addr.as_ref().err().map(|e| {
                format!(
                    "rank {} (from {peer}) registered the unreadable address {:?}: {e}",
                    reg.rank, reg.addr
                )
            })
        });
        if let Some(problem) = problem {
            let _ = send_message(&mut stream, &encode_refusal(&problem));
            refuse_all(&mut members, &problem);
            return Err(rendezvous_error(size, problem));
        }
        let reached = stream.local_addr().map(|a| a.ip()).unwrap_or(own.ip());
        if let Ok(addr) = addr {
            table[reg.rank as usize] = Some(addr);
        }
        members.push((reg.rank as usize, stream, reached));
    }
    let table: Vec<SocketAddr> = table.into_iter().map(|a| a.unwrap_or(own)).collect();
    let token = random_token();
    for (rank, stream, reached) in &mut members {
        // Each rank reaches rank 0's mesh listener at the address it reached the master at.
        let mut theirs = table.clone();
        theirs[0] = SocketAddr::new(*reached, own_port);
        send_message(stream, &encode_table(token, &theirs)).map_err(|e| {
            rendezvous_error(
                size,
                format!("rank {rank} left during the rendezvous (sending it the table: {e})"),
            )
        })?;
    }
    Ok((token, table))
}

/// A non-zero rank's side: connects to the master, opens this rank's listener on the address
/// the master was reached from, registers it and receives the token and the table.
fn join_rendezvous(
    master: &[SocketAddr],
    master_name: &str,
    rank: usize,
    size: usize,
    connect_timeout: Duration,
) -> Result<(TcpListener, u64, Vec<SocketAddr>)> {
    let deadline = Instant::now() + connect_timeout;
    let mut last_error = None;
    let mut stream = 'connect: loop {
        for addr in master {
            let wait = remaining(deadline).max(Duration::from_millis(1));
            match TcpStream::connect_timeout(addr, wait) {
                Ok(stream) => break 'connect stream,
                Err(e) => last_error = Some(format!("{addr}: {e}")),
            }
        }
        if Instant::now() >= deadline {
            return Err(rendezvous_error(
                size,
                format!(
                    "rank {rank} could not reach the master (rank 0) at {master_name} within \
                     {:.1} s ({})",
                    connect_timeout.as_secs_f64(),
                    last_error.unwrap_or_else(|| "no address".into())
                ),
            ));
        }
        std::thread::sleep(RETRY.min(remaining(deadline)));
    };
    let master_addr = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| master_name.to_string());
    let io_error = |what: &str, e: io::Error| {
        rendezvous_error(
            size,
            format!("rank {rank} {what} (master at {master_addr}): {e}"),
        )
    };
    let local = stream
        .local_addr()
        .map_err(|e| io_error("has no local address", e))?;
    let listener = TcpListener::bind(SocketAddr::new(local.ip(), 0))
        .map_err(|e| io_error(&format!("could not open its listener on {}", local.ip()), e))?;
    let own = listener
        .local_addr()
        .map_err(|e| io_error("has no listener address", e))?;
    let registration = Registration {
        world: size as u64,
        rank: rank as u64,
        addr: own.to_string(),
    };
    send_message(&mut stream, &registration.encode())
        .map_err(|e| io_error("could not register", e))?;
    // Rank 0 answers once every rank has registered, or refuses within its own deadline.
    stream
        .set_read_timeout(Some(connect_timeout + Duration::from_secs(10)))
        .map_err(|e| io_error("could not set a timeout", e))?;
    let body = recv_message(&mut stream).map_err(|e| {
        io_error(
            "got no answer to its registration (did rank 0 fail? is MASTER_PORT used by \
             another program?)",
            e,
        )
    })?;
    let answer = decode_answer(&body).ok_or_else(|| {
        rendezvous_error(
            size,
            format!(
                "rank {rank}: the process at {master_addr} does not speak this rendezvous \
                 protocol (is MASTER_PORT used by another program?)"
            ),
        )
    })?;
    let (token, table) = answer.map_err(|message| {
        rendezvous_error(size, format!("rank 0 refused the rendezvous: {message}"))
    })?;
    if table.len() != size {
        return Err(rendezvous_error(
            size,
            format!(
                "rank 0 sent a table of {} ranks to rank {rank} of a world of {size}",
                table.len()
            ),
        ));
    }
    let table = table
        .iter()
        .map(|a| a.parse::<SocketAddr>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| rendezvous_error(size, format!("rank 0 sent an unreadable table: {e}")))?;
    Ok((listener, token, table))
}

/// Connects to every lower rank (in rank order) and checks its answer.
fn connect_lower(
    rank: usize,
    size: usize,
    token: u64,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut out = Vec::with_capacity(rank);
    for (peer, addr) in table.iter().enumerate().take(rank) {
        let error = |detail: String| {
            rendezvous_error(
                size,
                format!("rank {rank} connecting to rank {peer} at {addr}: {detail}"),
            )
        };
        let mut stream = loop {
            match TcpStream::connect_timeout(addr, remaining(deadline).max(POLL)) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => return Err(error(e.to_string())),
                Err(_) => std::thread::sleep(RETRY.min(remaining(deadline))),
            }
        };
        let hello = Hello {
            token,
            world: size as u64,
            from: rank as u64,
            to: peer as u64,
        };
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(remaining(deadline).max(POLL))))
            .and_then(|()| send_message(&mut stream, &hello.encode()))
            .map_err(|e| error(e.to_string()))?;
        let body =
            recv_message(&mut stream).map_err(|e| error(format!("no acknowledgement: {e}")))?;
        match decode_ack(&body) {
            Some((t, r, None)) if t == token && r == peer as u64 => out.push((peer, stream)),
            Some((_, _, Some(refusal))) => return Err(error(format!("refused: {refusal}"))),
            Some((t, r, None)) if t == token => {
                return Err(error(format!("the process there answered as rank {r}")));
            }
            _ => {
                return Err(error(
                    "the process there is not part of this job (wrong protocol or token)".into(),
                ));
            }
        }
    }
    Ok(out)
}

/// Accepts a connection from every higher rank on `listener`, checking their hellos.
fn accept_higher(
    listener: &TcpListener,
    rank: usize,
    size: usize,
    token: u64,
    (deadline, seconds): (Instant, f64),
    cancel: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>> {
    let listen_addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    listener.set_nonblocking(true).map_err(|e| {
        rendezvous_error(
            size,
            format!("rank {rank} could not poll its listener at {listen_addr}: {e}"),
        )
    })?;
    let mut got: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let missing = |got: &[Option<TcpStream>]| -> Vec<usize> {
        (rank + 1..size).filter(|&r| got[r].is_none()).collect()
    };
    while !missing(&got).is_empty() {
        if cancel.load(Ordering::Relaxed) {
            return Ok(Vec::new());
        }
        let (mut stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                if Instant::now() >= deadline {
                    return Err(BackendError::Timeout {
                        op: "tcp_rendezvous",
                        group: format!("world of {size}"),
                        waiting: missing(&got),
                        seconds,
                        site: format!("TcpWorld::init, rank {rank} listening at {listen_addr}"),
                    });
                }
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) => {
                return Err(rendezvous_error(
                    size,
                    format!("rank {rank} failed to accept at {listen_addr}: {e}"),
                ));
            }
        };
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(FIRST_MESSAGE.min(remaining(deadline)))))
            .and_then(|()| recv_message(&mut stream))
            .ok()
            .and_then(|body| Hello::decode(&body));
        let Some(hello) = hello else { continue };
        if hello.token != token {
            // Another job's process: refused, not an error of this job.
            let _ = send_message(
                &mut stream,
                &encode_ack(token, rank, Some("wrong job token")),
            );
            continue;
        }
        let problem = if hello.world != size as u64 {
            Some(format!(
                "a process at {peer} claims rank {} of a world of {}, but this world has {size}",
                hello.from, hello.world
            ))
        } else if hello.to != rank as u64 {
            Some(format!(
                "a process at {peer} meant to reach rank {} but reached rank {rank} at \
                 {listen_addr}",
                hello.to
            ))
        } else if hello.from <= rank as u64 || hello.from >= size as u64 {
            Some(format!(
                "a process at {peer} claims rank {}, but only ranks {}..{size} connect to rank \
                 {rank}",
                hello.from,
                rank + 1
            ))
        } else if got[hello.from as usize].is_some() {
            Some(format!(
                "rank {} connected to rank {rank} twice (again from {peer})",
                hello.from
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            let _ = send_message(&mut stream, &encode_ack(token, rank, Some(&problem)));
            return Err(rendezvous_error(size, problem));
        }
        stream
            .set_nodelay(true)
            .and_then(|()| send_message(&mut stream, &encode_ack(token, rank, None)))
            .map_err(|e| {
                rendezvous_error(
                    size,
                    format!(
                        "rank {rank} could not acknowledge rank {} at {peer}: {e}",
                        hello.from
                    ),
                )
            })?;
        got[hello.from as usize] = Some(stream);
    }
    Ok(got
        .into_iter()
        .enumerate()
        .filter_map(|(r, s)| s.map(|s| (r, s)))
        .collect())
}

/// The full mesh: a connection to every other rank, indexed by rank (`None` for this one).
fn build_mesh(
    rank: usize,
    size: usize,
    listener: &TcpListener,
    token: u64,
    table: &[SocketAddr],
    connect_timeout: Duration,
) -> Result<Vec<Option<TcpStream>>> {
    let deadline = Instant::now() + connect_timeout;
    let limits = (deadline, connect_timeout.as_secs_f64());
    let cancel = AtomicBool::new(false);
    let (lower, higher) = std::thread::scope(|s| {
        let acceptor = std::thread::Builder::new()
            .name(format!("tcp-accept-{rank}"))
            .spawn_scoped(s, || {
                accept_higher(listener, rank, size, token, limits, &cancel)
            });
        let lower = connect_lower(rank, size, token, table, deadline);
        if lower.is_err() {
            cancel.store(true, Ordering::Relaxed);
        }
        let higher = match acceptor {
            Ok(handle) => handle.join().unwrap_or_else(|_| {
                Err(rendezvous_error(
                    size,
                    format!("rank {rank}: the accepting thread panicked"),
                ))
            }),
            // No thread: accept on this one.
            Err(_) => accept_higher(listener, rank, size, token, limits, &cancel),
        };
        (lower, higher)
    });
    let mut mesh: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    for (peer, stream) in lower?.into_iter().chain(higher?) {
        mesh[peer] = Some(stream);
    }
    Ok(mesh)
}

// ---------------------------------------------------------------------------------------------
// Data plane.

/// A frame waiting for its writer thread.
struct OutFrame {
    header: [u8; FRAME_HEADER],
    payload: Vec<u8>,
}

fn frame(kind: u8, channel: u8, group: u64, payload: Vec<u8>) -> OutFrame {
    let mut header = [0u8; FRAME_HEADER];
    header[0] = kind;
    header[1] = channel;
    header[8..16].copy_from_slice(&group.to_le_bytes());
    header[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    OutFrame { header, payload }
}

#[derive(Default)]
struct OutState {
    queue: VecDeque<OutFrame>,
    /// Frames queued or being written.
    unsent: usize,
    /// No more frames will be queued: the writer sends what it has, then closes its side.
    closed: bool,
    /// The writer thread has ended.
    done: bool,
}

/// The send queue of one peer, drained by its writer thread.
#[derive(Default)]
struct Outbox {
    state: Mutex<OutState>,
    wake: Condvar,
}

impl Outbox {
    /// Queues a frame; `false` when the writer no longer takes frames.
    fn push(&self, frame: OutFrame) -> bool {
        let mut st = lock(&self.state);
        if st.closed || st.done {
            return false;
        }
        st.queue.push_back(frame);
        st.unsent += 1;
        drop(st);
        self.wake.notify_all();
        true
    }

    /// Stops taking frames (after `last`, if given); the writer closes its side when done.
    fn close(&self, last: Option<OutFrame>) {
        let mut st = lock(&self.state);
        if !st.closed
            && !st.done
            && let Some(f) = last
        {
            st.queue.push_back(f);
            st.unsent += 1;
        }
        st.closed = true;
        drop(st);
        self.wake.notify_all();
    }

    /// Waits until everything queued has been written (or the writer ended), until `deadline`.
    fn wait_sent(&self, deadline: Instant, finished: bool) {
        let mut st = lock(&self.state);
        loop {
            let ok = if finished {
                st.done
            } else {
                st.unsent == 0 || st.done
            };
            let left = remaining(deadline);
            if ok || left.is_zero() {
                return;
            }
            st = self
                .wake
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// One peer's connection.
struct Peer {
    /// Kept to shut the socket down (the threads own clones).
    stream: TcpStream,
    out: Arc<Outbox>,
}

#[derive(Default)]
struct NetState {
    /// Messages by (group, channel, sender rank).
    boxes: HashMap<(u64, u8, usize), VecDeque<Vec<u8>>>,
    /// The peer said bye (it closed its world normally).
    left: Vec<bool>,
    /// The peer sent an abort frame.
    aborted: Vec<bool>,
    /// The peer's reader thread has ended.
    ended: Vec<bool>,
    /// The first failure of the world; every later operation fails with it.
    failure: Option<String>,
    /// This rank is closing its world.
    closing: bool,
}

/// A rank's connections to all other ranks and the mailboxes they fill.
struct Net {
    rank: usize,
    size: usize,
    state: Mutex<NetState>,
    wake: Condvar,
    /// Indexed by rank; `None` for this rank.
    peers: Vec<Option<Peer>>,
    /// Group ids in use and their keys (two keys with one id would mix their messages).
    groups: Mutex<HashMap<u64, String>>,
}

enum ReadEnd {
    Eof,
    Error(io::Error),
    Garbage(String),
}

impl Net {
    fn state(&self) -> MutexGuard<'_, NetState> {
        lock(&self.state)
    }

    /// Records the world's first failure and wakes every waiting operation.
    fn fail(&self, st: &mut NetState, message: String) {
        if st.failure.is_none() {
            st.failure = Some(message);
        }
        self.wake.notify_all();
    }

    fn deliver(&self, group: u64, channel: u8, src: usize, payload: Vec<u8>) {
        let mut st = self.state();
        st.boxes
            .entry((group, channel, src))
            .or_default()
            .push_back(payload);
        drop(st);
        self.wake.notify_all();
    }

    /// The reader of `peer` stopped: a failure unless the peer said bye or aborted, or this
    /// rank is closing.
    fn reader_ended(&self, peer: usize, end: ReadEnd) {
        let mut st = self.state();
        st.ended[peer] = true;
        let expected = st.left[peer] || st.aborted[peer] || st.closing;
        if !expected {
            let message = match end {
                ReadEnd::Eof => format!("rank {peer} closed its connection (process gone?)"),
                ReadEnd::Error(e) => {
                    format!("rank {peer} closed its connection (process gone?): {e}")
                }
                ReadEnd::Garbage(what) => format!("rank {peer} sent {what}"),
            };
            self.fail(&mut st, message);
        }
        self.wake.notify_all();
    }

    fn writer_failed(&self, peer: usize, e: io::Error) {
        let mut st = self.state();
        if !(st.left[peer] || st.aborted[peer] || st.closing) {
            self.fail(
                &mut st,
                format!("rank {peer} closed its connection (process gone?): sending failed: {e}"),
            );
        }
    }

    /// Queues a frame for `peer` (this rank's own point-to-point messages go straight to its
    /// mailbox).
    fn send(
        &self,
        peer: usize,
        channel: u8,
        group: u64,
        payload: Vec<u8>,
    ) -> std::result::Result<(), LinkError> {
        {
            let st = self.state();
            if let Some(failure) = &st.failure {
                return Err(LinkError::Failed(failure.clone()));
            }
            if st.closing {
                return Err(LinkError::Failed(format!(
                    "the TcpWorld of rank {} is closed",
                    self.rank
                )));
            }
            if st.left.get(peer).copied().unwrap_or(false) {
                return Err(LinkError::Failed(format!(
                    "rank {peer} has left the job (its TcpWorld was closed)"
                )));
            }
        }
        if peer == self.rank {
            self.deliver(group, channel, peer, payload);
            return Ok(());
        }
        let Some(Some(p)) = self.peers.get(peer) else {
            return Err(LinkError::Failed(format!(
                "rank {peer} is not in a world of {}",
                self.size
            )));
        };
        if p.out.push(frame(KIND_DATA, channel, group, payload)) {
            Ok(())
        } else {
            let st = self.state();
            Err(LinkError::Failed(st.failure.clone().unwrap_or_else(|| {
                format!("the connection to rank {peer} is closed")
            })))
        }
    }

    /// Waits for the next message from each of `want` (`(member index, rank)`) on a group's
    /// channel.
    fn recv_all(
        &self,
        group: u64,
        channel: u8,
        want: &[(usize, usize)],
        deadline: Instant,
    ) -> std::result::Result<Vec<Vec<u8>>, LinkError> {
        let mut got: Vec<Option<Vec<u8>>> = vec![None; want.len()];
        let mut st = self.state();
        loop {
            for (slot, &(_, src)) in got.iter_mut().zip(want) {
                if slot.is_none() {
                    *slot = st
                        .boxes
                        .get_mut(&(group, channel, src))
                        .and_then(VecDeque::pop_front);
                }
            }
            if got.iter().all(Option::is_some) {
                return Ok(got.into_iter().flatten().collect());
            }
            if let Some(failure) = &st.failure {
                return Err(LinkError::Failed(failure.clone()));
            }
            if st.closing {
                return Err(LinkError::Failed(format!(
                    "the TcpWorld of rank {} is closed",
                    self.rank
                )));
            }
            let missing: Vec<(usize, usize)> = got
                .iter()
                .zip(want)
                .filter(|(g, _)| g.is_none())
                .map(|(_, &w)| w)
                .collect();
            if let Some(&(_, src)) = missing
                .iter()
                .find(|(_, src)| st.left.get(*src).copied().unwrap_or(false))
            {
                return Err(LinkError::Failed(format!(
                    "rank {src} has left the job (its TcpWorld was closed) without sending \
                     what this rank waits for"
                )));
            }
            let left = remaining(deadline);
            if left.is_zero() {
                return Err(LinkError::Timeout(
                    missing.iter().map(|&(m, _)| m).collect(),
                ));
            }
            st = self
                .wake
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Tells every peer that this rank failed with `message`, and waits (briefly) for the
    /// frames to leave.
    fn abort(&self, message: &str) {
        {
            let mut st = self.state();
            let own = format!("rank {} failed: {message}", self.rank);
            self.fail(&mut st, own);
        }
        for p in self.peers.iter().flatten() {
            p.out
                .push(frame(KIND_ABORT, 0, 0, message.as_bytes().to_vec()));
        }
        let deadline = Instant::now() + ABORT_FLUSH;
        for p in self.peers.iter().flatten() {
            p.out.wait_sent(deadline, false);
        }
    }
}

/// Reads the frames of `peer` until its connection ends.
fn read_loop(net: &Net, peer: usize, stream: TcpStream) -> ReadEnd {
    let mut r = BufReader::with_capacity(IO_BUFFER, stream);
    loop {
        let mut header = [0u8; FRAME_HEADER];
        // A clean end is an end between frames.
        match r.read(&mut header[..1]) {
            Ok(0) => return ReadEnd::Eof,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return ReadEnd::Error(e),
        }
        if let Err(e) = r.read_exact(&mut header[1..]) {
            return ReadEnd::Error(e);
        }
        let kind = header[0];
        let channel = header[1];
        let group = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(header[16..24].try_into().unwrap_or_default());
        let Ok(len) = usize::try_from(len) else {
            return ReadEnd::Garbage(format!("a frame of {len} bytes"));
        };
        let mut payload = Vec::new();
        if payload.try_reserve_exact(len).is_err() {
            return ReadEnd::Garbage(format!("a frame of {len} bytes, more than fits in memory"));
        }
        match (&mut r).take(len as u64).read_to_end(&mut payload) {
            Ok(n) if n == len => {}
            Ok(_) => return ReadEnd::Error(io::ErrorKind::UnexpectedEof.into()),
            Err(e) => return ReadEnd::Error(e),
        }
        match kind {
            KIND_DATA if channel == CHANNEL_COLL || channel == CHANNEL_P2P => {
                net.deliver(group, channel, peer, payload)
            }
            KIND_ABORT => {
                let message = String::from_utf8_lossy(&payload).into_owned();
                let mut st = net.state();
                st.aborted[peer] = true;
                net.fail(&mut st, format!("rank {peer} failed: {message}"));
            }
            KIND_BYE => {
                let mut st = net.state();
                st.left[peer] = true;
                drop(st);
                net.wake.notify_all();
            }
            _ => return ReadEnd::Garbage(format!("a frame of unknown kind {kind}/{channel}")),
        }
    }
}

/// Writes the frames queued for one peer; closes the sending side when the queue is closed.
fn write_loop(out: &Outbox, stream: TcpStream) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(IO_BUFFER, stream);
    loop {
        let next = {
            let mut st = lock(&out.state);
            loop {
                if let Some(f) = st.queue.pop_front() {
                    break Some(f);
                }
                if st.closed {
                    break None;
                }
                st = out.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(f) = next else {
            w.flush()?;
            return w.get_ref().shutdown(Shutdown::Write);
        };
        w.write_all(&f.header)?;
        w.write_all(&f.payload)?;
        if lock(&out.state).queue.is_empty() {
            w.flush()?;
        }
        let mut st = lock(&out.state);
        st.unsent = st.unsent.saturating_sub(1);
        drop(st);
        out.wake.notify_all();
    }
}

/// Starts the reader and writer threads of every connection.
fn start_net(
    rank: usize,
    size: usize,
    mesh: Vec<Option<TcpStream>>,
    timeout: Duration,
) -> Result<(Arc<Net>, Vec<JoinHandle<()>>)> {
    let io_error = |peer: usize, e: io::Error| {
        rendezvous_error(
            size,
            format!("rank {rank} could not set up its connection to rank {peer}: {e}"),
        )
    };
    let mut peers = Vec::with_capacity(size);
    let mut streams = Vec::new();
    for (peer, stream) in mesh.into_iter().enumerate() {
        let Some(stream) = stream else {
            peers.push(None);
            continue;
        };
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| io_error(peer, e))?;
        let reader = stream.try_clone().map_err(|e| io_error(peer, e))?;
        let writer = stream.try_clone().map_err(|e| io_error(peer, e))?;
        let out = Arc::new(Outbox::default());
        streams.push((peer, reader, writer, Arc::clone(&out)));
        peers.push(Some(Peer { stream, out }));
    }
    let net = Arc::new(Net {
        rank,
        size,
        state: Mutex::new(NetState {
            left: vec![false; size],
            aborted: vec![false; size],
            ended: vec![false; size],
            ..NetState::default()
        }),
        wake: Condvar::new(),
        peers,
        groups: Mutex::new(HashMap::new()),
    });
    let mut threads = Vec::new();
    let mut spawn_error = None;
    for (peer, reader, writer, out) in streams {
        let n = Arc::clone(&net);
        let spawned = std::thread::Builder::new()
            .name(format!("tcp-read-{rank}-{peer}"))
            .spawn(move || {
                let end = read_loop(&n, peer, reader);
                n.reader_ended(peer, end);
            });
        match spawned {
            Ok(h) => threads.push(h),
            Err(e) => {
                spawn_error = Some((peer, e));
                break;
            }
        }
        let n = Arc::clone(&net);
        let spawned = std::thread::Builder::new()
            .name(format!("tcp-write-{rank}-{peer}"))
            .spawn(move || {
                let result = write_loop(&out, writer);
                {
                    let mut st = lock(&out.state);
                    st.done = true;
                    st.queue.clear();
                }
                out.wake.notify_all();
                if let Err(e) = result {
                    n.writer_failed(peer, e);
                }
            });
        match spawned {
            Ok(h) => threads.push(h),
            Err(e) => {
                spawn_error = Some((peer, e));
                break;
            }
        }
    }
    if let Some((peer, e)) = spawn_error {
        shutdown_net(&net, threads, false, Duration::ZERO);
        return Err(io_error(peer, e));
    }
    Ok((net, threads))
}

/// Closes every connection: orderly (bye, then wait up to `linger` for the peers' end) or
/// abruptly; then ends the threads.
fn shutdown_net(net: &Net, threads: Vec<JoinHandle<()>>, orderly: bool, linger: Duration) {
    net.state().closing = true;
    net.wake.notify_all();
    let peers = || net.peers.iter().flatten();
    if orderly {
        for p in peers() {
            p.out.close(Some(frame(KIND_BYE, 0, 0, Vec::new())));
        }
        let deadline = Instant::now() + linger;
        for p in peers() {
            p.out.wait_sent(deadline, true);
        }
        // Keep reading until every peer has closed its side, so none of its data is left
        // unread on a closed socket (which would reset the connection).
        let mut st = net.state();
        while (0..net.size).any(|r| r != net.rank && !st.ended[r]) && !remaining(deadline).is_zero()
        {
            st = net
                .wake
                .wait_timeout(st, remaining(deadline))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
    for p in peers() {
        p.out.close(None);
        let _ = p.stream.shutdown(Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
}

/// The links of one group over the world's connections.
struct TcpLinks {
    net: Arc<Net>,
    group: u64,
    ranks: Vec<usize>,
    index: usize,
}

impl fmt::Debug for TcpLinks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpLinks")
            .field("ranks", &self.ranks)
            .field("index", &self.index)
            .field("group", &format_args!("{:#018x}", self.group))
            .finish()
    }
}

impl Links for TcpLinks {
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
        for (j, bytes) in sends.iter().enumerate() {
            if let Some(bytes) = bytes
                && j != self.index
            {
                self.net
                    .send(self.ranks[j], CHANNEL_COLL, self.group, bytes.to_vec())?;
            }
        }
        let want: Vec<(usize, usize)> = recv_lens
            .iter()
            .enumerate()
            .filter(|(j, len)| len.is_some() && *j != self.index)
            .map(|(j, _)| (j, self.ranks[j]))
            .collect();
        let got = self
            .net
            .recv_all(self.group, CHANNEL_COLL, &want, deadline)?;
        let mut out = vec![None; recv_lens.len()];
        for ((j, _), bytes) in want.into_iter().zip(got) {
            out[j] = Some(bytes);
        }
        Ok(out)
    }

    fn post(&self, dst: usize, bytes: Vec<u8>) -> std::result::Result<(), LinkError> {
        let rank = *self
            .ranks
            .get(dst)
            .ok_or_else(|| LinkError::Failed(format!("no member {dst} in {:?}", self.ranks)))?;
        self.net.send(rank, CHANNEL_P2P, self.group, bytes)
    }

    fn take(&self, src: usize, deadline: Instant) -> std::result::Result<Vec<u8>, LinkError> {
        let rank = *self
            .ranks
            .get(src)
            .ok_or_else(|| LinkError::Failed(format!("no member {src} in {:?}", self.ranks)))?;
        let mut got = self
            .net
            .recv_all(self.group, CHANNEL_P2P, &[(src, rank)], deadline)?;
        got.pop()
            .ok_or_else(|| LinkError::Failed("no message".into()))
    }
}

struct TcpConnector {
    net: Arc<Net>,
    timeout: Duration,
}

impl Connector for TcpConnector {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn connect(&self, key: &str, ranks: &[usize], index: usize) -> Result<Comm> {
        let group = group_id(key);
        {
            let mut groups = lock(&self.net.groups);
            let known = groups.entry(group).or_insert_with(|| key.to_string());
            if known != key {
                return Err(BackendError::Collective {
                    op: "create_group",
                    group: format!("{ranks:?}"),
                    detail: format!(
                        "groups `{known}` and `{key}` have the same id {group:#018x} on the \
                         TCP transport; rename one"
                    ),
                });
            }
        }
        let links = TcpLinks {
            net: Arc::clone(&self.net),
            group,
            ranks: ranks.to_vec(),
            index,
        };
        Ok(Comm::new(Arc::new(P2pComm::new(links, self.timeout))))
    }
}

/// This process's TCP world: the rendezvous is done and every pair of ranks is connected.
/// Dropping it closes the connections in order (see the module docs).
pub struct TcpWorld {
    rank: usize,
    size: usize,
    config: TcpConfig,
    net: Arc<Net>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for TcpWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpWorld")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl TcpWorld {
    /// Joins the job described by `launch` (rank, world size, `MASTER_ADDR`, `MASTER_PORT`):
    /// rendezvous at the master, then a connection to every other rank. A world of one needs
    /// no master. Errors name the addresses and ranks involved: `MASTER_ADDR`/`MASTER_PORT`
    /// missing or unresolvable, rank 0 unable to listen, the master unreachable within
    /// [`TcpConfig::connect_timeout`], ranks that never registered, a rank started for another
    /// world size or registering twice. Under torchrun with `TORCHELASTIC_USE_AGENT_STORE=True`
    /// (its agent then holds `MASTER_PORT`), the rendezvous uses `MASTER_PORT + 1`.
    pub fn init(launch: &Launch, config: TcpConfig) -> Result<Self> {
        Self::init_with(launch, config, None)
    }

    /// [`TcpWorld::init`]; rank 0 uses `master` (already listening) instead of binding
    /// `MASTER_ADDR:MASTER_PORT`.
    fn init_with(launch: &Launch, config: TcpConfig, master: Option<TcpListener>) -> Result<Self> {
        let (rank, size) = (launch.rank, launch.world_size);
        if size == 0 || rank >= size {
            return Err(BackendError::Config {
                field: "launcher",
                detail: format!("rank {rank} of a world of {size}"),
            });
        }
        let mesh = if size == 1 {
            vec![None]
        } else {
            Self::rendezvous(launch, &config, master)?
        };
        let (net, threads) = start_net(rank, size, mesh, config.timeout)?;
        Ok(Self {
            rank,
            size,
            config,
            net,
            threads,
        })
    }

    fn rendezvous(
        launch: &Launch,
        config: &TcpConfig,
        master: Option<TcpListener>,
    ) -> Result<Vec<Option<TcpStream>>> {
        let (rank, size) = (launch.rank, launch.world_size);
        let (listener, token, table) = if rank == 0 {
            let master = match master {
                Some(listener) => listener,
                None => Self::listen_master(launch)?,
            };
            let ip = master
                .local_addr()
                .map_err(|e| rendezvous_error(size, format!("rank 0's listener: {e}")))?
                .ip();
            let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
                rendezvous_error(
                    size,
                    format!("rank 0 could not open its listener on {ip}: {e}"),
                )
            })?;
            let own = listener
                .local_addr()
                .map_err(|e| rendezvous_error(size, format!("rank 0's listener: {e}")))?;
            let (token, table) =
                master_rendezvous(&master, size, own.port(), own, config.connect_timeout)?;
            (listener, token, table)
        } else {
            let (host, port) = Self::master_address(launch)?;
            let name = format!("{host}:{port}");
            let addrs = Self::resolve(&host, port)?;
            join_rendezvous(&addrs, &name, rank, size, config.connect_timeout)?
        };
        build_mesh(rank, size, &listener, token, &table, config.connect_timeout)
    }

    /// `MASTER_ADDR` and the rendezvous port.
    fn master_address(launch: &Launch) -> Result<(String, u16)> {
        let host = launch
            .master_addr
            .clone()
            .ok_or_else(|| BackendError::Config {
                field: "MASTER_ADDR",
                detail: format!(
                    "rank {} of {} has no MASTER_ADDR: the TCP transport needs the rendezvous \
                     host (torchrun sets it; export it under Slurm or mpirun)",
                    launch.rank, launch.world_size
                ),
            })?;
        let port = launch.master_port.ok_or_else(|| BackendError::Config {
            field: "MASTER_PORT",
            detail: format!(
                "rank {} of {} has no MASTER_PORT: the TCP transport needs the rendezvous port",
                launch.rank, launch.world_size
            ),
        })?;
        Ok((host, rendezvous_port(port, torchrun_agent_store())?))
    }

    fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| BackendError::Config {
                field: "MASTER_ADDR",
                detail: format!("cannot resolve MASTER_ADDR={host}: {e}"),
            })?
            .collect();
        if addrs.is_empty() {
            return Err(BackendError::Config {
                field: "MASTER_ADDR",
                detail: format!("MASTER_ADDR={host} resolves to no address"),
            });
        }
        Ok(addrs)
    }

    /// Rank 0's rendezvous listener at `MASTER_ADDR:port`.
    fn listen_master(launch: &Launch) -> Result<TcpListener> {
        let (host, port) = Self::master_address(launch)?;
        let mut errors = Vec::new();
        for addr in Self::resolve(&host, port)? {
            match TcpListener::bind(addr) {
                Ok(listener) => return Ok(listener),
                Err(e) => {
                    let hint = if e.kind() == io::ErrorKind::AddrInUse {
                        " (another process listens there; choose another MASTER_PORT)"
                    } else {
                        ""
                    };
                    errors.push(format!("{addr}: {e}{hint}"));
                }
            }
        }
        Err(rendezvous_error(
            launch.world_size,
            format!(
                "rank 0 could not listen at MASTER_ADDR={host} port {port}: {}",
                errors.join("; ")
            ),
        ))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank context of this process (groups are created on first use; on this transport
    /// creating a group needs no messages).
    pub fn ctx(&self) -> RankCtx {
        RankCtx::new(
            self.rank,
            self.size,
            Transport::Process(Arc::new(TcpConnector {
                net: Arc::clone(&self.net),
                timeout: self.config.timeout,
            })),
        )
    }

    /// Runs this rank's part of an SPMD job, as [`super::World::run`] runs a thread's. On
    /// success every rank meets at a world barrier before returning. An error or a panic of
    /// `f` (or of the barrier) is sent to every other rank, whose pending and later operations
    /// fail with `rank R failed: <message>`, and returned; the world stays failed.
    pub fn run<T>(&self, f: impl FnOnce(&RankCtx) -> Result<T>) -> Result<T> {
        let ctx = self.ctx();
        let result = catch_rank(self.rank, || f(&ctx));
        let result = result.and_then(|value| {
            ctx.world()?.barrier()?;
            Ok(value)
        });
        if let Err(e) = &result {
            self.net.abort(&e.to_string());
        }
        result
    }

    /// Drops the connections without a bye, as a killed process would (tests).
    #[cfg(test)]
    fn sever(mut self) {
        let threads = std::mem::take(&mut self.threads);
        shutdown_net(&self.net, threads, false, Duration::ZERO);
    }
}

impl Drop for TcpWorld {
    fn drop(&mut self) {
        let threads = std::mem::take(&mut self.threads);
        if self.net.state().closing {
            return;
        }
        shutdown_net(&self.net, threads, true, LINGER.min(self.config.timeout));
    }
}
