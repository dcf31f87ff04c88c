//! Collectives on 1..8 threads against sequential results; gradients through every
//! differentiable collective against one-rank computations; failure handling.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Int, Tensor, TensorData, bf16};

use super::autograd::*;
use super::*;
use crate::error::BackendError;
use crate::testing::{SplitMix, assert_close, tensor, values};

fn dev() -> Device {
    Device::flex()
}

/// Deterministic per-rank input: `rows x cols` values from seed `(tag, rank)`.
fn input(tag: u64, rank: usize, rows: usize, cols: usize) -> Vec<f64> {
    let mut rng = SplitMix::new(tag * 1000 + rank as u64);
    (0..rows * cols).map(|_| rng.uniform(-2.0, 2.0)).collect()
}

fn quick() -> WorldConfig {
    WorldConfig {
        timeout: Duration::from_secs(5),
        ..WorldConfig::default()
    }
}

fn ok<T: std::fmt::Debug>(results: Vec<Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn all_reduce_sum_mean_max_match_sequential() {
    for n in 1..=8 {
        let cols = 5;
        let out = ok(World::run(n, |ctx| {
            let world = ctx.world()?;
            let x = tensor(input(1, ctx.rank(), 3, cols), [3, cols], &dev(), DType::F32);
            let sum = values(world.all_reduce(x.clone(), ReduceOp::Sum)?);
            let mean = values(world.all_reduce(x.clone(), ReduceOp::Mean)?);
            let max = values(world.all_reduce(x, ReduceOp::Max)?);
            Ok((sum, mean, max))
        }));
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| input(1, r, 3, cols).iter().map(|&v| v as f32).collect())
            .collect();
        let mut sum = vec![0f32; 3 * cols];
        let mut max = vec![f32::NEG_INFINITY; 3 * cols];
        for x in &inputs {
            for i in 0..sum.len() {
                sum[i] += x[i];
                max[i] = max[i].max(x[i]);
            }
        }
        for (r, (s, m, x)) in out.iter().enumerate() {
            let exact: Vec<f64> = sum.iter().map(|&v| v as f64).collect();
            assert_eq!(
                s, &exact,
                "n={n} rank {r}: sum is bit-identical to the ordered sum"
            );
            let mean: Vec<f64> = sum.iter().map(|&v| (v / n as f32) as f64).collect();
            assert_eq!(m, &mean, "n={n} rank {r}: mean");
            let mx: Vec<f64> = max.iter().map(|&v| v as f64).collect();
            assert_eq!(x, &mx, "n={n} rank {r}: max");
        }
    }
}

#[test]
fn all_reduce_int_and_bf16() {
    let out = ok(World::run(4, |ctx| {
        let world = ctx.world()?;
        let r = ctx.rank() as i32;
        let ints = Tensor::<1, Int>::from_data(TensorData::new(vec![r, 10 * r, -r], [3]), &dev());
        let ints = world.all_reduce(ints, ReduceOp::Sum)?.into_data();
        let b = Tensor::<1>::from_data(
            TensorData::new(vec![bf16::from_f32(256.0), bf16::from_f32(1.0)], [2]),
            (&dev(), DType::BF16),
        );
        let b = world.all_reduce(b, ReduceOp::Sum)?;
        assert_eq!(b.dtype(), DType::BF16);
        Ok((
            ints.convert::<i64>()
                .try_into_vec::<i64>()
                .unwrap_or_default(),
            values(b),
        ))
    }));
    for (ints, b) in out {
        assert_eq!(ints, vec![6, 60, -6]);
        // 4·256 = 1024 exactly; 4·1 = 4.
        assert_eq!(b, vec![1024.0, 4.0]);
    }
}

#[test]
fn all_gather_and_reduce_scatter_with_random_sizes() {
    let mut rng = SplitMix::new(7);
    for n in 1..=8 {
        let rows: Vec<usize> = (0..n).map(|_| rng.below(4)).collect(); // zeros included
        let cols = 3;
        let rows_ref = &rows;
        let out = ok(World::run(n, |ctx| {
            let world = ctx.world()?;
            let r = ctx.rank();
            let x = tensor(
                input(2, r, rows_ref[r], cols),
                [rows_ref[r], cols],
                &dev(),
                DType::F32,
            );
            let (gathered, sizes) = world.all_gather_v(x)?;
            // Reduce-scatter of a full tensor with the same splits.
            let total: usize = rows_ref.iter().sum();
            let y = tensor(input(3, r, total, cols), [total, cols], &dev(), DType::F32);
            let scattered = world.reduce_scatter_v(y, rows_ref, ReduceOp::Sum)?;
            Ok((values(gathered), sizes, values(scattered)))
        }));
        let expected_gather: Vec<f64> = (0..n)
            .flat_map(|r| input(2, r, rows[r], cols))
            .map(|v| v as f32 as f64)
            .collect();
        let total: usize = rows.iter().sum();
        for (r, (g, sizes, s)) in out.iter().enumerate() {
            assert_eq!(g, &expected_gather, "n={n} rank {r} gather");
            assert_eq!(sizes, &rows);
            let start: usize = rows[..r].iter().sum::<usize>() * cols;
            let len = rows[r] * cols;
            let expected: Vec<f64> = (0..len)
                .map(|i| {
                    (0..n)
                        .map(|q| input(3, q, total, cols)[start + i] as f32)
                        .sum::<f32>() as f64
                })
                .collect();
            assert_eq!(s, &expected, "n={n} rank {r} reduce_scatter");
        }
    }
}

#[test]
fn equal_all_gather_and_reduce_scatter_check_sizes() {
    let out = World::run_with(3, quick(), |ctx| {
        let world = ctx.world()?;
        let x = tensor(
            vec![0.0; 2 * (ctx.rank() + 1)],
            [ctx.rank() + 1, 2],
            &dev(),
            DType::F32,
        );
        world.all_gather(x).map(|_| ())
    });
    for res in out {
        let err = res.unwrap_err().to_string();
        assert!(err.contains("different row counts [1, 2, 3]"), "{err}");
    }
    let out = World::run_with(2, quick(), |ctx| {
        let x = tensor(vec![0.0; 3], [3, 1], &dev(), DType::F32);
        ctx.world()?.reduce_scatter(x, ReduceOp::Sum).map(|_| ())
    });
    assert!(out.iter().all(|r| {
        r.as_ref()
            .unwrap_err()
            .to_string()
            .contains("do not divide")
    }));
}

/// Random `n x n` split matrix with zeros; `send[i][j]` rows go from i to j.
fn split_matrix(rng: &mut SplitMix, n: usize) -> Vec<Vec<usize>> {
    (0..n)
        .map(|_| {
            (0..n)
                .map(|_| if rng.below(3) == 0 { 0 } else { rng.below(4) })
                .collect()
        })
        .collect()
}

#[test]
fn all_to_all_v_with_random_splits() {
    let mut rng = SplitMix::new(11);
    for n in 1..=8 {
        let send = split_matrix(&mut rng, n);
        let cols = 2;
        let send_ref = &send;
        let out = ok(World::run(n, |ctx| {
            let r = ctx.rank();
            let rows: usize = send_ref[r].iter().sum();
            let recv: Vec<usize> = (0..n).map(|i| send_ref[i][r]).collect();
            let x = tensor(input(4, r, rows, cols), [rows, cols], &dev(), DType::F32);
            Ok(values(ctx.world()?.all_to_all_v(x, &send_ref[r], &recv)?))
        }));
        for (j, got) in out.iter().enumerate() {
            let mut expected = Vec::new();
            for (i, row) in send.iter().enumerate() {
                let rows: usize = row.iter().sum();
                let start: usize = row[..j].iter().sum();
                let x = input(4, i, rows, cols);
                expected.extend(
                    x[start * cols..(start + row[j]) * cols]
                        .iter()
                        .map(|&v| v as f32 as f64),
                );
            }
            assert_eq!(got, &expected, "n={n} rank {j}");
        }
    }
}

#[test]
fn broadcast_send_recv_barrier() {
    let out = ok(World::run(4, |ctx| {
        let world = ctx.world()?;
        let r = ctx.rank();
        let x = tensor(vec![r as f64; 3], [3], &dev(), DType::F32);
        let b = values(world.broadcast(x, 2)?);
        // Ring: send to the next rank, receive from the previous one.
        let msg = tensor(vec![10.0 * r as f64, 1.0], [2], &dev(), DType::F32);
        world.send(msg, (r + 1) % 4)?;
        let got: Tensor<1> = world.recv([2], DType::F32, (r + 3) % 4, &dev())?;
        world.barrier()?;
        Ok((b, values(got)))
    }));
    for (r, (b, got)) in out.into_iter().enumerate() {
        assert_eq!(b, vec![2.0; 3]);
        assert_eq!(got, vec![10.0 * ((r + 3) % 4) as f64, 1.0]);
    }
}

/// The EP2 worked example of moe-ops §15: tokens per expert exchanged with `all_to_all_v`
/// (ints), then the token rows; splits and received rows as the spec states.
#[test]
fn ep2_worked_example_through_all_to_all_v() {
    use crate::ops::{PermuteMode, int_tensor_to_usize, permute_with_indices};
    let routing = [[[0i32, 2], [1, 3]], [[1, 2], [2, 3]]];
    let out = ok(World::run(2, |ctx| {
        let r = ctx.rank();
        let ep = ctx.group("ep", &[0, 1])?;
        // Token rows: rank 0 holds a=10, b=20; rank 1 holds c=30, d=40 (one column).
        let x = tensor(
            vec![10.0 + 20.0 * r as f64, 20.0 + 20.0 * r as f64],
            [2, 1],
            &dev(),
            DType::F32,
        );
        let idx = Tensor::<2, Int>::from_data(TensorData::new(routing[r].concat(), [2, 2]), &dev());
        let permuted = permute_with_indices(x, idx, None, 4, PermuteMode::Dropless)?;
        let n = permuted.row_id_map.tokens_per_expert_host();
        let input_splits = vec![n[0] + n[1], n[2] + n[3]];
        // Count exchange: every rank sends its 2 local-expert counts to each owner.
        let counts = Tensor::<1, Int>::from_data(
            TensorData::new(n.iter().map(|&c| c as i32).collect::<Vec<_>>(), [4]),
            &dev(),
        );
        let gl = int_tensor_to_usize(ep.all_to_all_v(counts, &[2, 2], &[2, 2])?);
        let output_splits = vec![gl[0] + gl[1], gl[2] + gl[3]];
        let received = ep.all_to_all_v(permuted.rows, &input_splits, &output_splits)?;
        Ok((input_splits, output_splits, gl, values(received)))
    }));
    let (a, b, c, d) = (10.0, 20.0, 30.0, 40.0);
    assert_eq!(out[0].0, vec![2, 2]);
    assert_eq!(out[1].0, vec![1, 3]);
    assert_eq!(out[0].1, vec![2, 1]);
    assert_eq!(out[1].1, vec![2, 3]);
    assert_eq!(out[0].2, vec![1, 1, 0, 1]); // gl = [[1,1],[0,1]]
    assert_eq!(out[1].2, vec![1, 1, 2, 1]); // gl = [[1,1],[2,1]]
    assert_eq!(out[0].3, vec![a, b, c]); // [a_e0, b_e1 | c_e1]
    assert_eq!(out[1].3, vec![a, b, c, d, d]); // [a_e2, b_e3 | c_e2, d_e2, d_e3]
}

// ---------------------------------------------------------------------------------------
// Gradients: every rank r holds x_r and a fixed cotangent w_r; the total loss is
// Σ_r ⟨collective(x)_r, w_r⟩. The gradient of x_r computed through the collective on n
// threads must equal the gradient of the same total loss computed on one rank with plain
// tensor ops.

fn grad_of<const D: usize>(x: &Tensor<D>, loss: Tensor<1>) -> Vec<f64> {
    let grads = loss.backward();
    values(x.grad(&grads).expect("gradient"))
}

fn leaf<const D: usize>(v: Vec<f64>, shape: [usize; D]) -> Tensor<D> {
    tensor(v, shape, &dev().autodiff(), DType::F32).require_grad()
}

const N: usize = 4;

#[test]
fn all_to_all_v_gradient_is_swapped_all_to_all() {
    let send = split_matrix(&mut SplitMix::new(3), N);
    let send_ref = &send;
    let cols = 2;
    let got = ok(World::run(N, |ctx| {
        let r = ctx.rank();
        let rows: usize = send_ref[r].iter().sum();
        let recv: Vec<usize> = (0..N).map(|i| send_ref[i][r]).collect();
        let x = leaf(input(5, r, rows, cols), [rows, cols]);
        let y = ctx.world()?.all_to_all_v(x.clone(), &send_ref[r], &recv)?;
        let out_rows: usize = recv.iter().sum();
        let w = tensor(
            input(6, r, out_rows, cols),
            [out_rows, cols],
            &dev().autodiff(),
            DType::F32,
        );
        Ok(grad_of(&x, (y * w).sum()))
    }));
    // Reference: dx_i rows sent to j are w_j's rows received from i.
    for (i, g) in got.iter().enumerate() {
        let mut expected = Vec::new();
        for j in 0..N {
            let out_rows: usize = (0..N).map(|q| send[q][j]).sum();
            let start: usize = (0..i).map(|q| send[q][j]).sum();
            let w = input(6, j, out_rows, cols);
            expected.extend(
                w[start * cols..(start + send[i][j]) * cols]
                    .iter()
                    .map(|&v| v as f32 as f64),
            );
        }
        assert_close(g, &expected, 1e-6, 1e-6, &format!("rank {i}"));
    }
}

/// One-rank reference: x = cat(x_0..x_{n-1}) with grads, loss = Σ_r f_r(x), gradient slices.
fn reference_grads<F>(xs: Vec<(Vec<f64>, usize)>, cols: usize, f: F) -> Vec<Vec<f64>>
where
    F: Fn(Tensor<2>) -> Tensor<1>,
{
    let rows: Vec<usize> = xs.iter().map(|(_, r)| *r).collect();
    let all: Vec<f64> = xs.into_iter().flat_map(|(v, _)| v).collect();
    let total: usize = rows.iter().sum();
    let x = leaf(all, [total, cols]);
    let g = grad_of(&x, f(x.clone()));
    let mut out = Vec::new();
    let mut start = 0;
    for r in rows {
        out.push(g[start * cols..(start + r) * cols].to_vec());
        start += r;
    }
    out
}

#[test]
fn all_gather_gradient_is_reduce_scatter() {
    let rows = [2usize, 0, 3, 1];
    let cols = 3;
    let total: usize = rows.iter().sum();
    let got = ok(World::run(N, |ctx| {
        let r = ctx.rank();
        let x = leaf(input(7, r, rows[r], cols), [rows[r], cols]);
        let (y, _) = ctx.world()?.all_gather_v(x.clone())?;
        let w = tensor(
            input(8, r, total, cols),
            [total, cols],
            &dev().autodiff(),
            DType::F32,
        );
        Ok(grad_of(&x, (y * w).sum()))
    }));
    let expected = reference_grads(
        (0..N)
            .map(|r| (input(7, r, rows[r], cols), rows[r]))
            .collect(),
        cols,
        |x| {
            (0..N)
                .map(|r| {
                    let w = tensor(
                        input(8, r, total, cols),
                        [total, cols],
                        &dev().autodiff(),
                        DType::F32,
                    );
                    (x.clone() * w).sum()
                })
                .reduce(|a, b| a + b)
                .expect("ranks")
        },
    );
    for r in 0..N {
        assert_close(&got[r], &expected[r], 1e-5, 1e-5, &format!("rank {r}"));
    }
}

#[test]
fn reduce_scatter_gradient_is_all_gather() {
    let cols = 2;
    let rows = 2 * N;
    let got = ok(World::run(N, |ctx| {
        let r = ctx.rank();
        let x = leaf(input(9, r, rows, cols), [rows, cols]);
        let y = ctx.world()?.reduce_scatter(x.clone(), ReduceOp::Sum)?;
        let w = tensor(
            input(10, r, 2, cols),
            [2, cols],
            &dev().autodiff(),
            DType::F32,
        );
        Ok(grad_of(&x, (y * w).sum()))
    }));
    // d/dx_r Σ_q ⟨(Σ_p x_p)[block q], w_q⟩ = cat_q(w_q) for every r.
    let expected: Vec<f64> = (0..N)
        .flat_map(|q| input(10, q, 2, cols))
        .map(|v| v as f32 as f64)
        .collect();
    for g in got {
        assert_close(&g, &expected, 1e-6, 1e-6, "reduce_scatter grad");
    }
}

#[test]
fn tensor_parallel_regions_compose_like_megatron() {
    // Column-parallel then row-parallel linear on TP=N ranks vs one rank:
    // y = (x·A)·B with A split by columns and B by rows.
    let (h, f) = (3, 2 * N);
    let a = input(11, 0, h, f);
    let b = input(12, 0, f, h);
    let x0 = input(13, 0, 2, h);
    let cols = |m: &[f64], rows: usize, c: usize, r0: usize, take: usize| -> Vec<f64> {
        (0..rows)
            .flat_map(|i| m[i * c + r0..i * c + r0 + take].to_vec())
            .collect()
    };
    let got = ok(World::run(N, |ctx| {
        let tp = ctx.world()?;
        let r = ctx.rank();
        let chunk = f / N;
        let x = leaf(x0.clone(), [2, h]);
        let a_r = leaf(cols(&a, h, f, r * chunk, chunk), [h, chunk]);
        let b_r = leaf(b[r * chunk * h..(r + 1) * chunk * h].to_vec(), [chunk, h]);
        let xin = copy_to_tensor_parallel_region(&tp, x.clone());
        let hidden = xin.matmul(a_r.clone());
        let y = reduce_from_tensor_parallel_region(&tp, hidden.matmul(b_r.clone()))?;
        let grads = (y.clone() * y).sum().backward();
        Ok((
            values(x.grad(&grads).expect("x")),
            values(a_r.grad(&grads).expect("a")),
            values(b_r.grad(&grads).expect("b")),
        ))
    }));
    let x = leaf(x0.clone(), [2, h]);
    let aa = leaf(a.clone(), [h, f]);
    let bb = leaf(b.clone(), [f, h]);
    let y = x.clone().matmul(aa.clone()).matmul(bb.clone());
    let grads = (y.clone() * y).sum().backward();
    let gx = values(x.grad(&grads).expect("x"));
    let ga = values(aa.grad(&grads).expect("a"));
    let gb = values(bb.grad(&grads).expect("b"));
    let chunk = f / N;
    for (r, (dx, da, db)) in got.iter().enumerate() {
        // Each rank's loss is the (replicated) full loss; dx is all-reduced: equals one rank's.
        assert_close(dx, &gx, 1e-4, 1e-5, &format!("dx rank {r}"));
        assert_close(
            da,
            &cols(&ga, h, f, r * chunk, chunk),
            1e-4,
            1e-5,
            &format!("dA rank {r}"),
        );
        assert_close(
            db,
            &gb[r * chunk * h..(r + 1) * chunk * h],
            1e-4,
            1e-5,
            &format!("dB rank {r}"),
        );
    }
}

#[test]
fn sequence_parallel_and_last_dim_regions() {
    let (s, h) = (2 * N, 2 * N);
    let x0 = input(14, 0, s, h);
    let w = input(15, 0, s, h);
    let got = ok(World::run(N, |ctx| {
        let tp = ctx.world()?;
        let r = ctx.rank();
        let x = leaf(x0.clone(), [s, h]);
        let wt = tensor(w.clone(), [s, h], &dev().autodiff(), DType::F32);
        // scatter(seq) -> gather(seq, split grad) is the identity on the replicated input.
        let part = scatter_to_sequence_parallel_region(&tp, x.clone())?;
        let full = gather_from_sequence_parallel_region(&tp, part, false)?;
        // scatter(last) -> gather(last) likewise.
        let cols = scatter_to_tensor_parallel_region(&tp, full)?;
        let back = gather_from_tensor_parallel_region(&tp, cols)?;
        let loss = (back.clone() * wt).sum();
        let g = grad_of(&x, loss);
        // Reduce-scatter to SP then gather with RS backward: partial sums of rank-scaled x.
        let y = leaf(x0.clone(), [s, h]);
        let scaled = y.clone() * (r as f64 + 1.0);
        let rs = reduce_scatter_to_sequence_parallel_region(&tp, scaled)?;
        let ag = gather_from_sequence_parallel_region(&tp, rs, true)?;
        let w2 = tensor(input(16, r, s, h), [s, h], &dev().autodiff(), DType::F32);
        let g2 = grad_of(&y, (ag * w2).sum());
        Ok((values(back), g, g2))
    }));
    let expected_x: Vec<f64> = x0.iter().map(|&v| v as f32 as f64).collect();
    let wf: Vec<f64> = w.iter().map(|&v| v as f32 as f64).collect();
    // Loss on rank r: Σ_q (r+1)·x·w_q summed over... reference: grad of rank r's y is
    // (r+1)·Σ_q w2_q (the AG output on every rank is Σ_p (p+1)·x, read by every rank's loss).
    let sum_w2: Vec<f64> = (0..s * h)
        .map(|i| (0..N).map(|q| input(16, q, s, h)[i] as f32 as f64).sum())
        .collect();
    for (r, (back, g, g2)) in got.iter().enumerate() {
        assert_eq!(back, &expected_x, "rank {r}: round trip values");
        assert_close(g, &wf, 1e-6, 1e-6, &format!("rank {r}: identity grad"));
        let expected: Vec<f64> = sum_w2.iter().map(|v| v * (r as f64 + 1.0)).collect();
        assert_close(g2, &expected, 1e-5, 1e-5, &format!("rank {r}: rs/ag grad"));
    }
}

#[test]
fn broadcast_gradient_sums_onto_root_and_mean_scales() {
    let got = ok(World::run(3, |ctx| {
        let world = ctx.world()?;
        let r = ctx.rank();
        let x = leaf(vec![1.0 + r as f64, 2.0], [2]);
        let y = world.broadcast(x.clone(), 1)?;
        let w = tensor(
            vec![r as f64 + 1.0, 1.0],
            [2],
            &dev().autodiff(),
            DType::F32,
        );
        let gb = grad_of(&x, (y * w).sum());
        let z = leaf(vec![3.0], [1]);
        let m = world.all_reduce(z.clone(), ReduceOp::Mean)?;
        let gm = grad_of(&z, m.sum());
        let max = world.all_reduce(leaf(vec![1.0], [1]), ReduceOp::Max);
        Ok((gb, gm, max.is_err()))
    }));
    assert_eq!(got[1].0, vec![6.0, 3.0]); // Σ_r w_r on the root
    assert_eq!(got[0].0, vec![0.0, 0.0]);
    assert_eq!(got[2].0, vec![0.0, 0.0]);
    for (_, gm, max_err) in &got {
        assert_close(gm, &[1.0 / 3.0], 1e-7, 0.0, "mean grad");
        assert!(max_err, "max of a tracked tensor must be rejected");
    }
}

// ---------------------------------------------------------------------------------------
// Failures.

#[test]
fn a_failing_rank_aborts_pending_collectives_within_the_timeout() {
    let start = Instant::now();
    let out = World::run_with(4, quick(), |ctx| {
        let world = ctx.world()?;
        let x = tensor(vec![1.0], [1], &dev(), DType::F32);
        world.all_reduce(x.clone(), ReduceOp::Sum)?;
        if ctx.rank() == 2 {
            return Err(BackendError::Config {
                field: "test",
                detail: "rank 2 gives up".into(),
            });
        }
        world.all_reduce(x, ReduceOp::Sum).map(|_| ())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "no rank waited for the timeout"
    );
    for (r, res) in out.iter().enumerate() {
        let err = res.as_ref().expect_err("every rank fails").to_string();
        if r == 2 {
            assert!(err.contains("rank 2 gives up"), "{err}");
        } else {
            assert!(
                err.contains("rank 2") && err.contains("gives up"),
                "rank {r}: {err}"
            );
        }
    }
}

#[test]
fn a_panicking_rank_aborts_the_others() {
    let out = World::run_with(3, quick(), |ctx| {
        if ctx.rank() == 0 {
            panic!("boom on rank 0");
        }
        ctx.world()?.barrier()
    });
    assert!(
        matches!(&out[0], Err(BackendError::RankPanicked { rank: 0, message }) if message.contains("boom"))
    );
    for res in &out[1..] {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 0"), "{err}");
    }
}

#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    let config = WorldConfig {
        timeout: Duration::from_millis(300),
        ..WorldConfig::default()
    };
    let start = Instant::now();
    let out = World::run_with(2, config, |ctx| {
        if ctx.rank() == 1 {
            // Rank 1 is stuck in local work and never joins.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        ctx.world()?.barrier()
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    match &out[0] {
        Err(BackendError::Timeout { waiting, .. }) => assert_eq!(waiting, &vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn mismatched_sizes_and_order_name_the_ranks() {
    let out = World::run_with(2, quick(), |ctx| {
        let rows = 2 + ctx.rank();
        let x = tensor(vec![0.0; rows], [rows], &dev(), DType::F32);
        ctx.world()?.all_reduce(x, ReduceOp::Sum).map(|_| ())
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("shape mismatch: rank 0 passed [2]") && err.contains("rank 1 passed [3]"),
            "{err}"
        );
        assert!(err.contains("tests.rs"), "call site missing: {err}");
    }
    let out = World::run_with(2, quick(), |ctx| {
        let world = ctx.world()?;
        let x = tensor(vec![0.0; 2], [2], &dev(), DType::F32);
        if ctx.rank() == 0 {
            world.all_reduce(x, ReduceOp::Sum).map(|_| ())
        } else {
            world.all_gather(x).map(|_| ())
        }
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("order mismatch: rank 0 called all_reduce")
                && err.contains("rank 1 called all_gather"),
            "{err}"
        );
    }
    // all_to_all_v whose receive splits disagree with the senders.
    let out = World::run_with(2, quick(), |ctx| {
        let x = tensor(vec![0.0; 2], [2, 1], &dev(), DType::F32);
        let recv = if ctx.rank() == 1 { [1, 2] } else { [1, 1] };
        ctx.world()?.all_to_all_v(x, &[1, 1], &recv).map(|_| ())
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("rank 1 sends 1 rows to rank 1") && err.contains("expects 2"),
            "{err}"
        );
    }
}

#[test]
fn bad_groups_are_rejected() {
    let out = World::run(2, |ctx| {
        assert!(ctx.group("g", &[0, 0]).is_err());
        assert!(ctx.group("g", &[0, 5]).is_err());
        assert!(ctx.group("g", &[1 - ctx.rank()]).is_err());
        Ok(())
    });
    ok(out);
}

#[test]
fn process_group_communicators_follow_the_layout() {
    // World 8, TP2 / EP4: all-reduce over dp, expt_dp and tp of the global rank.
    let layout = ParallelLayout::parse(8, "tp=2,etp=1,ep=4").unwrap();
    let layout_ref = &layout;
    let out = ok(World::run(8, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let rank =
            Tensor::<1, Int>::from_data(TensorData::new(vec![ctx.rank() as i32], [1]), &dev());
        let mut sums = Vec::new();
        for family in [
            GroupFamily::Tp,
            GroupFamily::Dp,
            GroupFamily::Ep,
            GroupFamily::ExptDp,
        ] {
            let s = pg.comm(family).all_reduce(rank.clone(), ReduceOp::Sum)?;
            sums.push(crate::ops::int_tensor_to_usize(s)[0]);
        }
        Ok((sums, pg.groups.local_expert_ids(8)?))
    }));
    for (r, (sums, experts)) in out.iter().enumerate() {
        let tp = (r / 2) * 2;
        assert_eq!(sums[0], tp + tp + 1, "tp sum rank {r}");
        assert_eq!(sums[1], if r % 2 == 0 { 12 } else { 16 }, "dp sum rank {r}");
        assert_eq!(sums[2], if r < 4 { 6 } else { 22 }, "ep sum rank {r}");
        assert_eq!(sums[3], (r % 4) * 2 + 4, "expt_dp sum rank {r}");
        assert_eq!(experts, &((r % 4) * 2..(r % 4) * 2 + 2));
    }
}

use crate::parallel::{GroupFamily, ParallelLayout};

#[test]
fn traffic_counts_bytes_addressed_to_other_members() {
    let out = ok(World::run(3, |ctx| {
        let world = ctx.world()?;
        let r = ctx.rank();
        // Rank r sends r+1 rows of 2 f32 to each member (its own block is not traffic).
        let rows = 3 * (r + 1);
        let x = tensor(vec![0.0; rows * 2], [rows, 2], &dev(), DType::F32);
        world.all_to_all_v(x, &[r + 1; 3], &[1, 2, 3])?;
        world.all_reduce(tensor(vec![0.0; 4], [4], &dev(), DType::F32), ReduceOp::Sum)?;
        Ok(world.traffic())
    }));
    for (r, t) in out.iter().enumerate() {
        assert_eq!(t.calls, 2);
        assert_eq!(
            t.bytes_sent,
            (2 * (r as u64 + 1) * 2 * 4) + 2 * 16,
            "rank {r}"
        );
    }
}
