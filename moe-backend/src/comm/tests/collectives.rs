//! Collectives against the obvious sequential results.

use burn::tensor::{DType, Int, Tensor, TensorData, bf16};

use super::*;
use crate::testing::{SplitMix, tensor, values};

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

/// docs/routing-and-dispatch.md §EP2 worked example: tokens per expert exchanged with
/// `all_to_all_v` (ints), then the token rows; splits and received rows as that section states.
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
