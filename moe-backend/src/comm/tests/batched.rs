//! The batched point-to-point exchange ([`Comm::send_recv`]) on the threads transport, with
//! buffered and with rendezvous (NCCL's) sends: results equal to what each sender sent, the
//! device-buffer path equal to the host path with no host transfer, a ring that only a batch
//! completes under rendezvous, argument errors, and a dead or silent peer.

use std::time::{Duration, Instant};

use burn::tensor::DType;

use super::device::host_only;
use super::*;
use crate::error::BackendError;
use crate::testing::tensor;

const MODES: [PointToPoint; 2] = [PointToPoint::Buffered, PointToPoint::Rendezvous];

fn config(p2p: PointToPoint, timeout: Duration) -> WorldConfig {
    WorldConfig {
        timeout,
        p2p,
        ..WorldConfig::default()
    }
}

/// The tensor member `src` sends to member `dst` as its `k`-th message of a test: values
/// from the triple, so a receiver can check what it got without the sender's help.
fn message(src: usize, dst: usize, k: usize, rows: usize, dtype: DType) -> Tensor<2> {
    tensor(
        input(src as u64 * 100 + dst as u64 * 10 + k as u64, 0, rows, 3),
        [rows, 3],
        &dev(),
        dtype,
    )
}

/// Every member sends two messages to each of the next two members (ring distance 1 and 2)
/// and receives theirs from the previous two, all in one batch: what arrives is exactly what
/// was sent, on the device path and the host path alike, and the device path makes no host
/// transfer — for worlds of 2–4 members, every float dtype, both send modes.
#[test]
fn a_batch_delivers_every_message_on_both_paths_and_both_modes() {
    for p2p in MODES {
        for n in 2..=4 {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let out = World::run_with(n, config(p2p, Duration::from_secs(10)), |ctx| {
                    let on = ctx.world()?;
                    let off = host_only(&on);
                    let me = ctx.rank();
                    let peers = [(me + 1) % n, (me + 2) % n];
                    let from = [(me + n - 1) % n, (me + n - 2) % n];
                    for comm in [&on, &off] {
                        let mut sends = Vec::new();
                        let mut recvs = Vec::new();
                        for (d, (&dst, &src)) in peers.iter().zip(&from).enumerate() {
                            for k in 0..2 {
                                sends.push((message(me, dst, 2 * d + k, 1 + k, dtype), dst));
                                recvs.push(([1 + k, 3], dtype, src));
                            }
                        }
                        let got = comm.send_recv(sends, &recvs, &dev())?;
                        for (i, t) in got.into_iter().enumerate() {
                            let (d, k) = (i / 2, i % 2);
                            let want = message(from[d], me, 2 * d + k, 1 + k, dtype);
                            assert_eq!(t.into_data(), want.into_data(), "{p2p:?} n={n} {dtype:?}");
                        }
                    }
                    Ok((on.host_transfers(), off.host_transfers()))
                });
                for r in ok(out) {
                    assert_eq!(r.0, 0, "the device path stays on the tensors' storage");
                    assert_eq!(
                        r.1,
                        2 * 4,
                        "the host path reads each send and uploads each receive"
                    );
                }
            }
        }
    }
}

/// A ring where every member sends to the next and then receives from the previous: with
/// buffered sends it completes as two calls, with rendezvous sends only as one batch; the
/// unbatched ring under rendezvous is a deadlock, reported as a timeout, not a hang.
#[test]
fn a_ring_completes_under_rendezvous_only_as_a_batch() {
    let ring = |p2p: PointToPoint, batched: bool| {
        World::run_with(3, config(p2p, Duration::from_millis(800)), move |ctx| {
            let comm = ctx.world()?;
            let me = ctx.rank();
            let x = message(me, (me + 1) % 3, 0, 2, DType::F32);
            let recv = [([2, 3], DType::F32, (me + 2) % 3)];
            let got = if batched {
                comm.send_recv(vec![(x, (me + 1) % 3)], &recv, &dev())?
            } else {
                comm.send(x, (me + 1) % 3)?;
                comm.send_recv(Vec::new(), &recv, &dev())?
            };
            let want = message((me + 2) % 3, me, 0, 2, DType::F32);
            assert_eq!(got[0].clone().into_data(), want.into_data());
            Ok(())
        })
    };
    ok(ring(PointToPoint::Buffered, false));
    ok(ring(PointToPoint::Buffered, true));
    ok(ring(PointToPoint::Rendezvous, true));
    let start = Instant::now();
    let out = ring(PointToPoint::Rendezvous, false);
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(out.iter().all(Result::is_err));
    assert!(
        out.iter()
            .any(|r| matches!(r, Err(BackendError::Timeout { op: "send", .. }))),
        "{out:?}"
    );
}

/// A receive that expects another shape or dtype than was sent is a typed error naming both
/// call sites; a peer index out of range too.
#[test]
fn mismatched_messages_and_bad_peers_are_typed_errors() {
    for p2p in MODES {
        let out = World::run_with(2, config(p2p, Duration::from_secs(5)), |ctx| {
            let comm = ctx.world()?;
            let other = 1 - ctx.rank();
            let x = message(ctx.rank(), other, 0, 2, DType::F32);
            comm.send_recv(vec![(x, other)], &[([3, 3], DType::F32, other)], &dev())
                .map(|_| ())
        });
        for r in out {
            let err = r.expect_err("shape mismatch").to_string();
            assert!(
                err.contains("sent F32 [2, 3]") && err.contains("expected F32 [3, 3]"),
                "{err}"
            );
            assert!(err.contains("batched.rs"), "{err}");
        }
    }
    let out = World::run_with(2, quick(), |ctx| {
        let comm = ctx.world()?;
        let x = message(0, 0, 0, 1, DType::F32);
        comm.send_recv(vec![(x, 2)], &[], &dev()).map(|_| ())
    });
    for r in out {
        let err = r.expect_err("bad peer").to_string();
        assert!(err.contains("destination 2 out of range"), "{err}");
    }
}

/// A member that leaves mid-exchange (returns, as a failed stage does) makes the others'
/// batches fail with typed errors naming it, well before the timeout; one that stays silent
/// is named by the timeout. Both send modes.
#[test]
fn a_dead_or_silent_peer_fails_the_batch_promptly() {
    for p2p in MODES {
        let start = Instant::now();
        let out = World::run_with(3, config(p2p, Duration::from_secs(30)), |ctx| {
            let comm = ctx.world()?;
            let me = ctx.rank();
            for step in 0..4 {
                if me == 2 && step == 2 {
                    return Ok(());
                }
                let x = message(me, (me + 1) % 3, step, 1, DType::F32);
                let recv = [([1, 3], DType::F32, (me + 2) % 3)];
                comm.send_recv(vec![(x, (me + 1) % 3)], &recv, &dev())?;
            }
            Ok(())
        });
        assert!(start.elapsed() < Duration::from_secs(5), "{p2p:?}");
        for r in [0, 1] {
            let err = out[r].as_ref().expect_err("the batch fails");
            assert!(
                matches!(
                    err,
                    BackendError::Collective { .. } | BackendError::Aborted { .. }
                ),
                "{p2p:?} rank {r}: {err:?}"
            );
            assert!(
                err.to_string().contains("rank 2"),
                "{p2p:?} rank {r}: {err}"
            );
        }

        let start = Instant::now();
        let out = World::run_with(2, config(p2p, Duration::from_millis(300)), |ctx| {
            let comm = ctx.world()?;
            if ctx.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            let x = message(0, 1, 0, 1, DType::F32);
            comm.send_recv(vec![(x, 1)], &[([1, 3], DType::F32, 1)], &dev())
                .map(|_| ())
        });
        assert!(start.elapsed() < Duration::from_secs(3));
        let err = out[0].as_ref().expect_err("times out");
        assert!(
            matches!(err, BackendError::Timeout { waiting, .. } if waiting == &vec![1]),
            "{p2p:?}: {err:?}"
        );
    }
}
