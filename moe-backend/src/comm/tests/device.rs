//! The device-buffer path against the host-staged path on the same transport: every
//! collective bit for bit (worlds 2–4, ragged all-to-all-v and all-gather-v, every dtype the
//! step uses), autograd through it, a dead peer, and no host transfer on the device path.
//! The TCP transport runs [`compare_paths`] from its own tests (`tcp/tests.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

use super::*;
use crate::error::BackendError;
use crate::testing::tensor;

/// A transport seen without its device-buffer path: [`Comm`] stages every collective
/// through host [`TensorData`].
#[derive(Debug)]
struct HostOnly(Arc<dyn Communicator>);

impl Communicator for HostOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn ranks(&self) -> &[usize] {
        self.0.ranks()
    }
    fn all_reduce(&self, data: TensorData, op: ReduceOp, site: CallSite) -> Result<TensorData> {
        self.0.all_reduce(data, op, site)
    }
    fn all_gather_v(&self, data: TensorData, site: CallSite) -> Result<(TensorData, Vec<usize>)> {
        self.0.all_gather_v(data, site)
    }
    fn reduce_scatter_v(
        &self,
        data: TensorData,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<TensorData> {
        self.0.reduce_scatter_v(data, splits, op, site)
    }
    fn all_to_all_v(
        &self,
        data: TensorData,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<TensorData> {
        self.0.all_to_all_v(data, send_splits, recv_splits, site)
    }
    fn broadcast(&self, data: TensorData, root: usize, site: CallSite) -> Result<TensorData> {
        self.0.broadcast(data, root, site)
    }
    fn send(&self, data: TensorData, dst: usize, site: CallSite) -> Result<()> {
        self.0.send(data, dst, site)
    }
    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<TensorData> {
        self.0.recv(shape, dtype, src, site)
    }
    fn send_recv(
        &self,
        sends: Vec<(TensorData, usize)>,
        recvs: &[RecvSpec],
        site: CallSite,
    ) -> Result<Vec<TensorData>> {
        self.0.send_recv(sends, recvs, site)
    }
    fn barrier(&self, site: CallSite) -> Result<()> {
        self.0.barrier(site)
    }
}

pub(crate) fn host_only(comm: &Comm) -> Comm {
    Comm::new(Arc::new(HostOnly(comm.communicator().clone())))
}

/// Bytes, shape and dtype of a result.
fn bits<const D: usize, K: burn::tensor::kind::Basic>(
    t: Tensor<D, K>,
) -> (Vec<u8>, Vec<usize>, DType) {
    let data = t.into_data();
    (
        data.as_bytes().to_vec(),
        data.shape().to_vec(),
        data.dtype(),
    )
}

fn same<const D: usize, K: burn::tensor::kind::Basic>(
    what: &str,
    device: Tensor<D, K>,
    host: Tensor<D, K>,
) {
    let (a, b) = (bits(device), bits(host));
    assert!(
        a == b,
        "{what}: the device path differs from the host path ({:?} {:?} vs {:?} {:?})",
        a.2,
        a.1,
        b.2,
        b.1
    );
}

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// Every collective through the device path and the host path of `ctx`'s world, compared
/// bit for bit; returns how many results were compared. Also checks that the device path
/// made no host transfer and the host path did.
pub(crate) fn compare_paths(ctx: &RankCtx, tag: u64) -> Result<usize> {
    let on = ctx.world()?;
    let off = host_only(&on);
    let (n, r) = (on.size(), on.rank());
    let d = dev();
    let mut rng = SplitMix::new(tag);
    let m = split_matrix(&mut rng, n);
    let send = m[r].clone();
    let recv: Vec<usize> = (0..n).map(|i| m[i][r]).collect();
    // The reduce-scatter's splits are the same on every member (row 0 of the matrix).
    let rs_splits = m[0].clone();
    let mut checks = 0;
    let mut check = |what: String, a: Tensor<2>, b: Tensor<2>| {
        same(&what, a, b);
        checks += 1;
    };
    for dtype in FLOATS {
        let y = tensor(input(tag, r, 5, 3), [5, 3], &d, dtype);
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            check(
                format!("all_reduce {op:?} {dtype:?}"),
                on.all_reduce(y.clone(), op)?,
                off.all_reduce(y.clone(), op)?,
            );
        }
        let rows: usize = send.iter().sum();
        let x = tensor(input(tag + 1, r, rows, 3), [rows, 3], &d, dtype);
        check(
            format!("all_to_all_v {dtype:?} {m:?}"),
            on.all_to_all_v(x.clone(), &send, &recv)?,
            off.all_to_all_v(x.clone(), &send, &recv)?,
        );
        let (a, sa) = on.all_gather_v(x.clone())?;
        let (b, sb) = off.all_gather_v(x)?;
        assert_eq!(sa, sb);
        check(format!("all_gather_v {dtype:?}"), a, b);
        let rows: usize = rs_splits.iter().sum();
        let z = tensor(input(tag + 2, r, rows, 3), [rows, 3], &d, dtype);
        check(
            format!("reduce_scatter_v {dtype:?} {rs_splits:?}"),
            on.reduce_scatter_v(z.clone(), &rs_splits, ReduceOp::Sum)?,
            off.reduce_scatter_v(z, &rs_splits, ReduceOp::Sum)?,
        );
        let even = tensor(input(tag + 3, r, 2 * n, 3), [2 * n, 3], &d, dtype);
        check(
            format!("reduce_scatter {dtype:?}"),
            on.reduce_scatter(even.clone(), ReduceOp::Sum)?,
            off.reduce_scatter(even.clone(), ReduceOp::Sum)?,
        );
        check(
            format!("all_gather {dtype:?}"),
            on.all_gather(even.clone())?,
            off.all_gather(even)?,
        );
        check(
            format!("broadcast {dtype:?}"),
            on.broadcast(y.clone(), n - 1)?,
            off.broadcast(y.clone(), n - 1)?,
        );
        // A ring: everyone sends, then everyone receives (buffered sends).
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        on.send(y.clone(), next)?;
        let a: Tensor<2> = on.recv([5, 3], dtype, prev, &d)?;
        off.send(y, next)?;
        let b: Tensor<2> = off.recv([5, 3], dtype, prev, &d)?;
        check(format!("send/recv {dtype:?}"), a, b);
    }
    for dtype in [DType::I64, DType::I32] {
        let v: Vec<i64> = (0..15).map(|i| (i * 7 + r as i64 * 13) % 23 - 11).collect();
        let y = Tensor::<2, Int>::from_data(TensorData::new(v, [5, 3]), (&d, dtype));
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            same(
                &format!("all_reduce {op:?} {dtype:?}"),
                on.all_reduce(y.clone(), op)?,
                off.all_reduce(y.clone(), op)?,
            );
        }
        let rows: usize = send.iter().sum();
        let v: Vec<i64> = (0..rows as i64 * 2).map(|i| i + 100 * r as i64).collect();
        let x = Tensor::<2, Int>::from_data(TensorData::new(v, [rows, 2]), (&d, dtype));
        same(
            &format!("all_to_all_v {dtype:?}"),
            on.all_to_all_v(x.clone(), &send, &recv)?,
            off.all_to_all_v(x, &send, &recv)?,
        );
        checks += 3;
    }
    let rows: usize = send.iter().sum();
    let v: Vec<bool> = (0..rows * 2).map(|i| (i + r) % 3 == 0).collect();
    let x = Tensor::<2, Bool>::from_data(TensorData::new(v, [rows, 2]), &d);
    same(
        "all_to_all_v bool",
        on.all_to_all_v(x.clone(), &send, &recv)?,
        off.all_to_all_v(x.clone(), &send, &recv)?,
    );
    let (a, _) = on.all_gather_v(x.clone())?;
    let (b, _) = off.all_gather_v(x)?;
    same("all_gather_v bool", a, b);
    checks += 2;
    assert_eq!(
        on.host_transfers(),
        0,
        "the device path staged through the host"
    );
    assert!(
        off.host_transfers() > 0,
        "the host path made no host transfer"
    );
    Ok(checks)
}

#[test]
fn every_collective_on_device_buffers_equals_the_host_path_bit_for_bit() {
    for n in [2usize, 3, 4] {
        for tag in [1u64, 7] {
            let checks = ok(World::run_with(n, quick(), |ctx| {
                compare_paths(ctx, tag * 10 + n as u64)
            }));
            assert!(
                checks.iter().all(|&c| c == checks[0] && c > 40),
                "{checks:?}"
            );
        }
    }
}

/// Gradients of `x` (ragged all-to-all-v, all-gather-v, reduce-scatter-v, the sequence
/// parallel gather) and `y` (all-reduce, broadcast) through `comm`, as bytes.
fn grads(comm: &Comm, tag: u64, dtype: DType) -> Result<Vec<Vec<u8>>> {
    let d = dev().autodiff();
    let (n, r) = (comm.size(), comm.rank());
    let mut rng = SplitMix::new(tag);
    let m = split_matrix(&mut rng, n);
    let send = m[r].clone();
    let recv: Vec<usize> = (0..n).map(|i| m[i][r]).collect();
    let rows: usize = send.iter().sum();
    let x = tensor(input(tag, r, rows, 3), [rows, 3], &d, dtype).require_grad();
    let y = tensor(input(tag + 1, r, 4, 3), [4, 3], &d, dtype).require_grad();
    let a = comm.all_to_all_v(x.clone(), &send, &recv)?;
    let (g, sizes) = comm.all_gather_v(a.clone() * 1.5)?;
    let s = comm.reduce_scatter_v(g.clone(), &sizes, ReduceOp::Sum)?;
    let sp = autograd::gather_from_sequence_parallel_region(comm, a, true)?;
    let ar = comm.all_reduce(y.clone(), ReduceOp::Sum)?;
    let bc = comm.broadcast(y.clone(), 0)?;
    let mean = comm.all_reduce(y.clone(), ReduceOp::Mean)?;
    let w = |rows: usize, seed: u64| tensor(input(seed, r, rows, 3), [rows, 3], &d, dtype);
    let total: usize = sizes.iter().sum();
    let loss = (s.clone() * w(s.dims()[0], tag + 2)).sum()
        + (g * w(total, tag + 3)).sum()
        + (sp * w(total, tag + 4)).sum()
        + (ar * w(4, tag + 5)).sum()
        + (bc * w(4, tag + 6)).sum()
        + (mean * w(4, tag + 7)).sum();
    let gr = loss.backward();
    let gx = x.grad(&gr).map(|t| t.into_data().as_bytes().to_vec());
    let gy = y.grad(&gr).map(|t| t.into_data().as_bytes().to_vec());
    Ok(vec![gx.unwrap_or_default(), gy.unwrap_or_default()])
}

#[test]
fn gradients_through_device_buffers_equal_the_host_path() {
    for n in [2usize, 3, 4] {
        for dtype in [DType::F32, DType::BF16] {
            let out = ok(World::run_with(n, quick(), |ctx| {
                let on = ctx.world()?;
                let off = host_only(&on);
                let a = grads(&on, 40 + n as u64, dtype)?;
                let b = grads(&off, 40 + n as u64, dtype)?;
                Ok((a, b, on.host_transfers(), off.host_transfers()))
            }));
            for (r, (a, b, on, off)) in out.into_iter().enumerate() {
                // `x` may have no rows on a rank (ragged splits); `y` always has.
                assert!(!a[1].is_empty(), "rank {r}: no gradient");
                assert!(a == b, "world {n} {dtype:?} rank {r}: gradients differ");
                assert_eq!(on, 0, "rank {r}: the device path staged through the host");
                assert!(off > 0);
            }
        }
    }
}

/// The others' device-path collectives after `dead` left: typed errors naming it, before the
/// world's timeout.
fn others_fail(out: &[Result<()>], dead: usize, within: Duration, elapsed: Duration) {
    assert!(elapsed < within, "waited {elapsed:?}");
    for (r, res) in out.iter().enumerate() {
        if r == dead {
            continue;
        }
        let err = res.as_ref().expect_err("the collective fails");
        assert!(
            matches!(
                err,
                BackendError::Aborted { .. } | BackendError::Collective { .. }
            ),
            "rank {r}: {err:?}"
        );
        assert!(
            err.to_string().contains(&format!("rank {dead}")),
            "rank {r}: {err}"
        );
    }
}

#[test]
fn a_dead_peer_fails_device_buffer_collectives_within_the_timeout() {
    // The peer returns an error, panics, or returns early without joining.
    for how in ["error", "panic", "exit"] {
        let start = Instant::now();
        let out = World::run_with(4, quick(), |ctx| {
            let world = ctx.world()?;
            let x = tensor(vec![1.0; 8], [4, 2], &dev(), DType::BF16);
            world.all_to_all_v(x.clone(), &[1, 1, 1, 1], &[1, 1, 1, 1])?;
            if ctx.rank() == 2 {
                match how {
                    "error" => {
                        return Err(BackendError::Config {
                            field: "test",
                            detail: "rank 2 gives up".into(),
                        });
                    }
                    "panic" => panic!("rank 2 dies"),
                    _ => return Ok(()),
                }
            }
            let y = world.all_reduce(x.clone(), ReduceOp::Sum)?;
            let (g, _) = world.all_gather_v(y)?;
            assert_eq!(world.host_transfers(), 0);
            world.reduce_scatter(g, ReduceOp::Sum).map(|_| ())
        });
        let out: Vec<Result<()>> = out;
        others_fail(&out, 2, Duration::from_secs(4), start.elapsed());
    }
}

#[test]
fn a_silent_peer_times_out_on_device_buffers() {
    let config = WorldConfig {
        timeout: Duration::from_millis(300),
        ..WorldConfig::default()
    };
    let start = Instant::now();
    let out = World::run_with(3, config, |ctx| {
        let world = ctx.world()?;
        if ctx.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        let x = tensor(vec![1.0; 4], [2, 2], &dev(), DType::F32);
        world.all_reduce(x, ReduceOp::Sum).map(|_| ())
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    for r in [0, 2] {
        let err = out[r].as_ref().expect_err("times out");
        assert!(
            matches!(
                err,
                BackendError::Timeout { .. } | BackendError::Aborted { .. }
            ),
            "rank {r}: {err:?}"
        );
        assert!(err.to_string().contains("1"), "rank {r}: {err}");
    }
}
