//! [`P2pComm`] over in-memory links between threads: every collective gives exactly the bytes
//! of the in-process world's, argument mismatches are reported by every member, and a member
//! that never joins is named by a timeout.

use std::collections::{HashMap, VecDeque};
use std::panic::Location;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};

use super::{LinkError, Links, P2pComm};
use crate::comm::{Communicator, ReduceOp, World};
use crate::error::BackendError;

/// Messages waiting per `(channel, from, to)`.
type Mailboxes = HashMap<(u8, usize, usize), VecDeque<Vec<u8>>>;

/// Mailboxes shared by the threads of a test.
#[derive(Default)]
struct Net {
    boxes: Mutex<Mailboxes>,
    wake: Condvar,
}

#[derive(Clone)]
struct MemLinks {
    net: Arc<Net>,
    ranks: Vec<usize>,
    index: usize,
}

impl std::fmt::Debug for MemLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemLinks({})", self.index)
    }
}

const COLL: u8 = 0;
const P2P: u8 = 1;

impl MemLinks {
    fn push(&self, channel: u8, to: usize, bytes: Vec<u8>) {
        let mut boxes = self.net.boxes.lock().unwrap();
        boxes
            .entry((channel, self.index, to))
            .or_default()
            .push_back(bytes);
        self.net.wake.notify_all();
    }

    fn pop(&self, channel: u8, from: usize, deadline: Instant) -> Option<Vec<u8>> {
        let mut boxes = self.net.boxes.lock().unwrap();
        loop {
            if let Some(m) = boxes
                .get_mut(&(channel, from, self.index))
                .and_then(VecDeque::pop_front)
            {
                return Some(m);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            boxes = self.net.wake.wait_timeout(boxes, deadline - now).unwrap().0;
        }
    }
}

impl Links for MemLinks {
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
    ) -> Result<Vec<Option<Vec<u8>>>, LinkError> {
        for (j, s) in sends.iter().enumerate() {
            if let Some(s) = s {
                self.push(COLL, j, s.to_vec());
            }
        }
        let mut out = vec![None; sends.len()];
        let mut waiting = Vec::new();
        for (j, len) in recv_lens.iter().enumerate() {
            if len.is_some() {
                match self.pop(COLL, j, deadline) {
                    Some(m) => out[j] = Some(m),
                    None => waiting.push(j),
                }
            }
        }
        if waiting.is_empty() {
            Ok(out)
        } else {
            Err(LinkError::Timeout(waiting))
        }
    }
    fn post(&self, dst: usize, bytes: Vec<u8>) -> Result<(), LinkError> {
        self.push(P2P, dst, bytes);
        Ok(())
    }
    fn take(&self, src: usize, deadline: Instant) -> Result<Vec<u8>, LinkError> {
        self.pop(P2P, src, deadline)
            .ok_or(LinkError::Timeout(vec![src]))
    }
}

/// Runs `f` on `n` threads, each with a [`P2pComm`] of the whole group.
fn run_p2p<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(&dyn Communicator) -> T + Sync,
) -> Vec<T> {
    let net = Arc::new(Net::default());
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|index| {
                let links = MemLinks {
                    net: Arc::clone(&net),
                    ranks: (0..n).collect(),
                    index,
                };
                s.spawn(move || f(&P2pComm::new(links, timeout)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn data_f32(values: Vec<f32>, shape: Vec<usize>) -> TensorData {
    TensorData::new(values, shape)
}

/// A fixed sequence of collectives with rank-dependent data; returns every output's bytes.
pub(in crate::comm) fn script(c: &dyn Communicator) -> Vec<Vec<u8>> {
    let site = Location::caller();
    let (r, n) = (c.rank(), c.size());
    let vals = |len: usize, salt: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + r * 13 + salt) % 29) as f32 * 0.37 - 3.1 + 1e-7 * i as f32)
            .collect()
    };
    let mut out = Vec::new();
    // Small and large all-reduces (the large one takes the reduce-scatter + all-gather path).
    for len in [5usize, 40_000] {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            let d = data_f32(vals(len, len), vec![len]);
            out.push(c.all_reduce(d, op, site).unwrap().as_bytes().to_vec());
        }
    }
    let bf = TensorData::new(vals(33_000, 3), vec![33_000]).convert_dtype(DType::BF16);
    out.push(
        c.all_reduce(bf, ReduceOp::Sum, site)
            .unwrap()
            .as_bytes()
            .to_vec(),
    );
    let ints = TensorData::new(
        (0..6).map(|i| i * (r as i64 + 1)).collect::<Vec<i64>>(),
        [2, 3],
    );
    out.push(
        c.all_reduce(ints, ReduceOp::Max, site)
            .unwrap()
            .as_bytes()
            .to_vec(),
    );
    // Variable all-gather.
    let rows = r + 1;
    let (g, sizes) = c
        .all_gather_v(data_f32(vals(rows * 3, 1), vec![rows, 3]), site)
        .unwrap();
    assert_eq!(sizes, (1..=n).collect::<Vec<_>>());
    out.push(g.as_bytes().to_vec());
    // Reduce-scatter with uneven splits.
    let splits: Vec<usize> = (0..n).map(|j| j % 3).collect();
    let total: usize = splits.iter().sum();
    let rs = c
        .reduce_scatter_v(
            data_f32(vals(total * 2, 2), vec![total, 2]),
            &splits,
            ReduceOp::Sum,
            site,
        )
        .unwrap();
    out.push(rs.as_bytes().to_vec());
    // All-to-all: rank i sends (i + j) % 3 rows to rank j.
    let send: Vec<usize> = (0..n).map(|j| (r + j) % 3).collect();
    let recv: Vec<usize> = (0..n).map(|i| (i + r) % 3).collect();
    let rows: usize = send.iter().sum();
    let a2a = c
        .all_to_all_v(
            data_f32(vals(rows * 4, 5), vec![rows, 4]),
            &send,
            &recv,
            site,
        )
        .unwrap();
    out.push(a2a.as_bytes().to_vec());
    // Broadcast from the last member.
    let b = c
        .broadcast(data_f32(vals(6, 9), vec![2, 3]), n - 1, site)
        .unwrap();
    out.push(b.as_bytes().to_vec());
    // A ring of sends.
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    c.send(data_f32(vals(4, 11), vec![2, 2]), next, site)
        .unwrap();
    let got = c.recv(&[2, 2], DType::F32, prev, site).unwrap();
    out.push(got.as_bytes().to_vec());
    c.barrier(site).unwrap();
    out
}

#[test]
fn collectives_equal_the_in_process_world_bit_for_bit() {
    for n in [1usize, 2, 3, 4] {
        let p2p = run_p2p(n, Duration::from_secs(30), script);
        let local: Vec<Vec<Vec<u8>>> = World::run(n, |ctx| {
            let world = ctx.world()?;
            Ok(script(world.communicator().as_ref()))
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
        for (rank, (a, b)) in p2p.iter().zip(&local).enumerate() {
            assert_eq!(a.len(), b.len());
            for (k, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(x == y, "world {n} rank {rank} output {k} differs");
            }
        }
        // Every member got identical all-reduce results.
        for rank in 1..n {
            assert_eq!(p2p[rank][..8], p2p[0][..8]);
        }
    }
}

#[test]
fn argument_mismatches_are_reported_by_every_member() {
    let out = run_p2p(3, Duration::from_secs(30), |c| {
        let site = Location::caller();
        let r = c.rank();
        // Rank 1 expects one row too many from rank 0.
        let send = vec![1usize, 1, 1];
        let mut recv = vec![1usize, 1, 1];
        if r == 1 {
            recv[0] = 2;
        }
        let d = data_f32(vec![0.0; 6], vec![3, 2]);
        c.all_to_all_v(d, &send, &recv, site)
    });
    for res in out {
        match res {
            Err(BackendError::Collective { detail, .. }) => {
                assert!(detail.contains("rank 0 sends 1 rows to rank 1"), "{detail}")
            }
            other => panic!("expected a split mismatch, got {other:?}"),
        }
    }
    let out = run_p2p(2, Duration::from_secs(30), |c| {
        let site = Location::caller();
        let shape = if c.rank() == 0 { vec![4] } else { vec![5] };
        let len = shape[0];
        c.all_reduce(data_f32(vec![1.0; len], shape), ReduceOp::Sum, site)
    });
    for res in out {
        let err = res.unwrap_err().to_string();
        assert!(err.contains("shape mismatch"), "{err}");
    }
    // A member's own bad arguments fail the collective on every member, naming it.
    let out = run_p2p(2, Duration::from_secs(30), |c| {
        let site = Location::caller();
        let splits = if c.rank() == 1 {
            vec![3, 3]
        } else {
            vec![1, 1]
        };
        c.reduce_scatter_v(
            data_f32(vec![1.0; 2], vec![2]),
            &splits,
            ReduceOp::Sum,
            site,
        )
    });
    for res in out {
        let err = res.unwrap_err().to_string();
        assert!(err.contains("rank 1 rejected its arguments"), "{err}");
    }
}

#[test]
fn a_member_that_never_joins_is_named_by_the_timeout() {
    let out = run_p2p(3, Duration::from_millis(200), |c| {
        let site = Location::caller();
        if c.rank() == 2 {
            return Ok(TensorData::new(vec![0f32], [1]));
        }
        c.all_reduce(data_f32(vec![1.0], vec![1]), ReduceOp::Sum, site)
    });
    for res in out.into_iter().take(2) {
        match res {
            Err(BackendError::Timeout { waiting, .. }) => assert_eq!(waiting, vec![2]),
            other => panic!("expected a timeout naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn recv_of_a_different_shape_names_both_sides() {
    let out = run_p2p(2, Duration::from_secs(5), |c| {
        let site = Location::caller();
        if c.rank() == 0 {
            c.send(data_f32(vec![1.0; 6], vec![2, 3]), 1, site)
                .map(|_| None)
        } else {
            c.recv(&[3, 2], DType::F32, 0, site).map(Some)
        }
    });
    let err = out[1].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("rank 0 sent F32 [2, 3]") && err.contains("expected F32 [3, 2]"),
        "{err}"
    );
}

/// The header round of the device path ([`P2pComm::agree`]) checks exactly as the host path:
/// the same verdicts on bad splits, and every member's rows for the ragged all-gather.
#[test]
fn agree_checks_device_collectives_like_the_host_path() {
    let net = Arc::new(Net::default());
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|index| {
                let links = MemLinks {
                    net: Arc::clone(&net),
                    ranks: (0..3).collect(),
                    index,
                };
                s.spawn(move || {
                    let c = P2pComm::new(links, Duration::from_secs(30));
                    let site = Location::caller();
                    let rows = [2usize, 0, 5][index];
                    let (order, sizes) = c
                        .agree(super::Args::AllGather, &[rows, 4], DType::BF16, site)
                        .unwrap();
                    drop(order);
                    // Rank 1 expects one row too many from rank 0.
                    let mut recv = vec![1usize, 1, 1];
                    if index == 1 {
                        recv[0] = 2;
                    }
                    let args = super::Args::AllToAll {
                        send: &[1, 1, 1],
                        recv: &recv,
                    };
                    let err = c.agree(args, &[3, 2], DType::F32, site).map(|_| ());
                    // A bad root is this member's own error, reported by every member.
                    let root = if index == 2 { 7 } else { 0 };
                    let bad_root = c
                        .agree(super::Args::Broadcast { root }, &[1], DType::F32, site)
                        .map(|_| ());
                    (sizes, err, bad_root)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (sizes, err, bad_root) in out {
        assert_eq!(sizes, vec![2, 0, 5]);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("rank 0 sends 1 rows to rank 1"), "{err}");
        let err = bad_root.unwrap_err().to_string();
        assert!(
            err.contains("rank 2 rejected its arguments") && err.contains("root 7 out of range"),
            "{err}"
        );
    }
}
