//! Gradients through every differentiable collective against one-rank computations.

use burn::tensor::{DType, Tensor};

use super::*;
use crate::comm::autograd::*;
use crate::testing::{SplitMix, assert_close, tensor, values};

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
