//! Tensor- and sequence-parallel building blocks (Megatron `tensor_parallel/layers.py`,
//! `cross_entropy.py`): column/row shards of Burn `Linear`s, vocab-parallel embedding and
//! vocab-parallel cross-entropy. The region ops that connect them live in
//! [`crate::comm::autograd`].
//!
//! Burn's `Linear` stores `weight [in, out]`: a column-parallel shard keeps output columns
//! `[r·out/tp, (r+1)·out/tp)`, a row-parallel shard keeps input rows `[r·in/tp, (r+1)·in/tp)`.
//! Shards are fresh parameters (same ids), so in-process ranks never share autodiff nodes.

use std::ops::Range;

use burn::module::{Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::{Int, Tensor, TensorData};

use crate::comm::autograd::{
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};

fn fresh<const D: usize>(id: ParamId, t: Tensor<D>, requires_grad: bool) -> Param<Tensor<D>> {
    let (dtype, device) = (t.dtype(), t.device());
    let leaf = Tensor::from_data(t.into_data(), (&device, dtype));
    Param::initialized(
        id,
        if requires_grad {
            leaf.require_grad()
        } else {
            leaf
        },
    )
}

/// `[r·n/tp, (r+1)·n/tp)`, or an error naming `what` when `tp ∤ n`.
pub fn shard_range(what: &'static str, n: usize, rank: usize, tp: usize) -> Result<Range<usize>> {
    if tp == 0 || !n.is_multiple_of(tp) || rank >= tp {
        return Err(BackendError::Layout {
            field: "tp",
            detail: format!("{what} of size {n} cannot be split into part {rank} of {tp}"),
        });
    }
    let part = n / tp;
    Ok(rank * part..(rank + 1) * part)
}

/// Column-parallel shard of `linear` (output features split; bias split alike).
pub fn column_parallel_linear(linear: &Linear, rank: usize, tp: usize) -> Result<Linear> {
    let w = linear.weight.val();
    let grad = w.is_require_grad();
    let [inp, out] = w.dims();
    let cols = shard_range("column-parallel output", out, rank, tp)?;
    Ok(Linear {
        weight: fresh(linear.weight.id, w.slice([0..inp, cols.clone()]), grad),
        bias: linear
            .bias
            .as_ref()
            .map(|b| fresh(b.id, b.val().slice([cols.clone()]), grad)),
    })
}

/// Row-parallel shard of `linear` (input features split). A bias would be added once per rank
/// before the reduction, so biased row-parallel linears are rejected.
pub fn row_parallel_linear(linear: &Linear, rank: usize, tp: usize) -> Result<Linear> {
    if linear.bias.is_some() && tp > 1 {
        return Err(BackendError::Config {
            field: "bias",
            detail: "row-parallel linears with a bias are not supported".into(),
        });
    }
    let w = linear.weight.val();
    let grad = w.is_require_grad();
    let [inp, out] = w.dims();
    let rows = shard_range("row-parallel input", inp, rank, tp)?;
    Ok(Linear {
        weight: fresh(linear.weight.id, w.slice([rows, 0..out]), grad),
        bias: linear.bias.as_ref().map(|b| fresh(b.id, b.val(), grad)),
    })
}

/// Vocab-parallel shard of `embedding` (rows `vocab`); returns the shard and its vocab range.
pub fn vocab_parallel_embedding(
    embedding: &Embedding,
    rank: usize,
    tp: usize,
) -> Result<(Embedding, Range<usize>)> {
    let w = embedding.weight.val();
    let grad = w.is_require_grad();
    let [v, h] = w.dims();
    let rows = shard_range("vocabulary", v, rank, tp)?;
    Ok((
        Embedding {
            weight: fresh(embedding.weight.id, w.slice([rows.clone(), 0..h]), grad),
        },
        rows,
    ))
}

/// Vocab-parallel lookup of `ids [B, S]` (the same ids on every TP rank) in this rank's
/// `shard` (rows `vocab`): ids outside the range contribute zeros, partial rows are summed
/// over `tp`. Returns `[B·S, H]`, or with `sequence_parallel` this rank's `[B·S/tp, H]` block
/// (reduce-scatter instead of all-reduce).
pub fn embed_vocab_parallel(
    shard: &Embedding,
    ids: &[i64],
    batch: usize,
    vocab: Range<usize>,
    tp: &Comm,
    sequence_parallel: bool,
) -> Result<Tensor<2>> {
    let device = shard.weight.val().device();
    let h = shard.weight.val().dims()[1];
    let n = ids.len();
    let (mut local, mut keep) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for &id in ids {
        let inside = id >= vocab.start as i64 && id < vocab.end as i64;
        local.push(if inside { id - vocab.start as i64 } else { 0 } as i32);
        keep.push(if inside { 1.0f32 } else { 0.0 });
    }
    if batch == 0 || !n.is_multiple_of(batch) {
        return Err(BackendError::Shape {
            op: "embed_vocab_parallel",
            detail: format!("{n} ids do not form {batch} sequences"),
        });
    }
    let ids = Tensor::<2, Int>::from_data(TensorData::new(local, [batch, n / batch]), &device);
    // In the table's dtype (0 and 1 are exact in BF16).
    let dtype = shard.weight.val().dtype();
    let keep = Tensor::<2>::from_data(TensorData::new(keep, [n, 1]), (&device, dtype));
    let partial = shard.forward(ids).reshape([n, h]) * keep;
    if sequence_parallel {
        reduce_scatter_to_sequence_parallel_region(tp, partial)
    } else {
        reduce_from_tensor_parallel_region(tp, partial)
    }
}

/// Mean cross-entropy of `logits [N, V/tp]` (this rank's vocab columns `vocab`) against
/// `targets [N]` (global ids; `ignore_index` rows skipped), computed in f32 across the TP group
/// without gathering the vocabulary: global max (all-reduce max, detached), Σ exp and the
/// target logit summed over `tp` with identity backward. Every TP rank returns the same loss;
/// each rank's logits receive `softmax − onehot` for its columns.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<2>,
    targets: &[i64],
    ignore_index: i64,
    vocab: Range<usize>,
    tp: &Comm,
) -> Result<Tensor<1>> {
    let [n, vl] = logits.dims();
    if targets.len() != n || vocab.len() != vl {
        return Err(BackendError::Shape {
            op: "vocab_parallel_cross_entropy",
            detail: format!(
                "logits [{n}, {vl}] need {n} targets (got {}) and a vocab range of {vl} (got {vocab:?})",
                targets.len()
            ),
        });
    }
    let device = logits.device();
    let logits = logits.cast(burn::tensor::DType::F32);
    let local_max = logits.clone().detach().max_dim(1);
    let max = tp.all_reduce(local_max, ReduceOp::Max)?;
    let shifted = logits - max;
    let sum_exp = reduce_from_tensor_parallel_region(tp, shifted.clone().exp().sum_dim(1))?;
    let mut onehot = vec![0.0f32; n * vl];
    let mut valid = vec![0.0f32; n];
    for (row, &t) in targets.iter().enumerate() {
        if t == ignore_index {
            continue;
        }
        valid[row] = 1.0;
        if t >= vocab.start as i64 && t < vocab.end as i64 {
            onehot[row * vl + (t as usize - vocab.start)] = 1.0;
        }
    }
    let count = valid.iter().sum::<f32>();
    let onehot = Tensor::<2>::from_data(TensorData::new(onehot, [n, vl]), &device);
    let valid = Tensor::<2>::from_data(TensorData::new(valid, [n, 1]), &device);
    let target = reduce_from_tensor_parallel_region(tp, (shifted * onehot).sum_dim(1))?;
    let per_row = (sum_exp.log() - target) * valid;
    Ok(per_row.sum().div_scalar(count.max(1.0)).reshape([1]))
}

#[cfg(test)]
mod tests {
    use burn::nn::{EmbeddingConfig, LinearConfig};
    use burn::tensor::{DType, Device, activation::log_softmax};

    use super::*;
    use crate::comm::World;
    use crate::comm::autograd::copy_to_tensor_parallel_region;
    use crate::parallel::replicate;
    use crate::testing::{SplitMix, assert_close, tensor, values};

    fn ad() -> Device {
        Device::flex().autodiff()
    }

    fn rows(v: &[f64], cols: usize, keep: Range<usize>) -> Vec<f64> {
        v.chunks(cols)
            .flat_map(|r| r[keep.clone()].to_vec())
            .collect()
    }

    #[test]
    fn column_then_row_parallel_linears_equal_the_full_mlp() {
        let full_a = replicate(&LinearConfig::new(6, 8).init(&ad()));
        let full_b = replicate(&LinearConfig::new(8, 6).with_bias(false).init(&ad()));
        let mut rng = SplitMix::new(3);
        let xv: Vec<f64> = (0..12).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let x = tensor(xv.clone(), [2, 6], &ad(), DType::F32).require_grad();
        let y = full_b.forward(full_a.forward(x.clone()).tanh());
        let g = (y.clone() * y.clone()).sum().backward();
        let (ey, ex) = (values(y), values(x.grad(&g).unwrap()));
        let ea = values(full_a.weight.val().grad(&g).unwrap());
        let (fa, fb) = (&full_a, &full_b);
        let xr = &xv;
        for tp in [1, 2, 4] {
            let out = World::run(tp, |ctx| {
                let comm = ctx.world()?;
                let a = column_parallel_linear(fa, ctx.rank(), tp)?;
                let b = row_parallel_linear(fb, ctx.rank(), tp)?;
                let x = tensor(xr.clone(), [2, 6], &ad(), DType::F32).require_grad();
                let h = a
                    .forward(copy_to_tensor_parallel_region(&comm, x.clone()))
                    .tanh();
                let y = reduce_from_tensor_parallel_region(&comm, b.forward(h))?;
                let g = (y.clone() * y.clone()).sum().backward();
                Ok((
                    values(y),
                    values(x.grad(&g).unwrap()),
                    values(a.weight.val().grad(&g).unwrap()),
                ))
            });
            for (r, res) in out.into_iter().enumerate() {
                let (y, dx, da) = res.unwrap();
                assert_close(&y, &ey, 1e-5, 1e-6, "output");
                assert_close(&dx, &ex, 1e-5, 1e-6, "dx");
                let part = 8 / tp;
                assert_close(
                    &da,
                    &rows(&ea, 8, r * part..(r + 1) * part),
                    1e-5,
                    1e-6,
                    "dA shard",
                );
            }
        }
    }

    #[test]
    fn vocab_parallel_embedding_and_cross_entropy_equal_the_full_ones() {
        let (v, h, b, s) = (12, 4, 2, 4);
        let emb = replicate(&EmbeddingConfig::new(v, h).init(&ad()));
        let mut rng = SplitMix::new(5);
        let ids: Vec<i64> = (0..b * s).map(|_| rng.below(v) as i64).collect();
        let mut targets: Vec<i64> = (0..b * s).map(|_| rng.below(v) as i64).collect();
        targets[3] = -100;
        let proj: Vec<f64> = (0..h * v).map(|_| rng.uniform(-1.0, 1.0)).collect();
        // Reference: full embedding, logits = x·P, mean CE over valid rows.
        let id_t = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&i| i as i32).collect::<Vec<_>>(), [b, s]),
            &ad(),
        );
        let p = tensor(proj.clone(), [h, v], &ad(), DType::F32).require_grad();
        let logits = emb.forward(id_t).reshape([b * s, h]).matmul(p.clone());
        let lsm = log_softmax(logits, 1);
        let mut picks = Vec::new();
        for (row, &t) in targets.iter().enumerate() {
            if t >= 0 {
                picks.push(
                    lsm.clone()
                        .slice([row..row + 1, t as usize..t as usize + 1])
                        .reshape([1]),
                );
            }
        }
        let loss = -Tensor::cat(picks, 0).mean();
        let g = loss.clone().backward();
        let (eloss, ep, ee) = (
            values(loss)[0],
            values(p.grad(&g).unwrap()),
            values(emb.weight.val().grad(&g).unwrap()),
        );
        let (embr, idr, tr, pr) = (&emb, &ids, &targets, &proj);
        for tp in [1, 2, 4] {
            for sp in [false, true] {
                let out = World::run(tp, |ctx| {
                    let comm = ctx.world()?;
                    let (shard, vocab) = vocab_parallel_embedding(embr, ctx.rank(), tp)?;
                    let x = embed_vocab_parallel(&shard, idr, b, vocab.clone(), &comm, sp)?;
                    let x = if sp {
                        crate::comm::autograd::gather_from_sequence_parallel_region(&comm, x, true)?
                    } else {
                        copy_to_tensor_parallel_region(&comm, x)
                    };
                    let pl = tensor(
                        rows(pr, v, vocab.clone()),
                        [h, vocab.len()],
                        &ad(),
                        DType::F32,
                    )
                    .require_grad();
                    let loss =
                        vocab_parallel_cross_entropy(x.matmul(pl.clone()), tr, -100, vocab, &comm)?;
                    let g = loss.clone().backward();
                    Ok((
                        values(loss)[0],
                        values(pl.grad(&g).unwrap()),
                        values(shard.weight.val().grad(&g).unwrap()),
                    ))
                });
                for (r, res) in out.into_iter().enumerate() {
                    let (l, dp, de) = res.unwrap_or_else(|e| panic!("tp {tp} sp {sp}: {e}"));
                    let part = v / tp;
                    let what = format!("tp {tp} sp {sp} rank {r}");
                    assert!(
                        (l - eloss).abs() < 1e-5 * eloss.abs(),
                        "{what}: loss {l} vs {eloss}"
                    );
                    assert_close(
                        &dp,
                        &rows(&ep, v, r * part..(r + 1) * part),
                        1e-4,
                        1e-6,
                        &what,
                    );
                    assert_close(
                        &de,
                        &ee[r * part * h..(r + 1) * part * h],
                        1e-4,
                        1e-6,
                        &what,
                    );
                }
            }
        }
    }
}
