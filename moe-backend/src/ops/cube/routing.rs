//! Routing kernels: expert-major row order of a routing map
//! (docs/routing-and-dispatch.md §Permute and unpermute) and top-k expert indices with the
//! lower-index tie rule (docs/routing-and-dispatch.md §Notation and conventions).
//!
//! Both run one unit per expert (routing index) or per token (top-k) and loop sequentially over
//! the other axis, so every order is fixed by construction. Dropless routing reads the `[E]`
//! per-expert counts back to the host once: the number of permuted rows sizes the output.

use burn::backend::ops::BoolTensorOps;
use burn::tensor::{DType, IntDType, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::launch::{self, LaunchShape, empty_like_dtype, float_storage, int_storage};

/// `counts[e] = Σ_t map[t, e]` for `map [T, E]` (nonzero = routed).
#[cube(launch)]
fn expert_counts_kernel<I: Int>(
    map: &Tensor<I>,
    counts: &mut Tensor<u32>,
    tokens: u32,
    experts: u32,
    #[define(I)] _dtype: ElemType,
) {
    let ex = ABSOLUTE_POS;
    if ex >= experts as usize {
        terminate!();
    }
    let e = experts as usize;
    let mut c = 0u32;
    for tok in 0..tokens as usize {
        if map[tok * e + ex] != I::new(0) {
            c += 1u32;
        }
    }
    counts[ex] = c;
}

/// Writes expert `e`'s rows starting at `offsets[e]` (dropless) or `e · capacity` (padded):
/// routed tokens ascending, then (padded only) unrouted tokens ascending, at most `capacity`.
#[cube(launch)]
fn routing_fill_kernel<I: Int>(
    map: &Tensor<I>,
    offsets: &Tensor<u32>,
    sorted: &mut Tensor<i32>,
    probs_index: &mut Tensor<i32>,
    tokens: u32,
    experts: u32,
    capacity: u32,
    #[comptime] pad: bool,
    #[define(I)] _dtype: ElemType,
) {
    let ex = ABSOLUTE_POS;
    if ex >= experts as usize {
        terminate!();
    }
    let e = experts as usize;
    let base = if comptime![pad] {
        ex * capacity as usize
    } else {
        offsets[ex] as usize
    };
    let mut w = 0u32;
    for tok in 0..tokens as usize {
        if map[tok * e + ex] != I::new(0) && w < capacity {
            sorted[base + w as usize] = i32::cast_from(tok);
            probs_index[base + w as usize] = i32::cast_from(tok * e + ex);
            w += 1u32;
        }
    }
    if comptime![pad] {
        for tok in 0..tokens as usize {
            if map[tok * e + ex] == I::new(0) && w < capacity {
                sorted[base + w as usize] = i32::cast_from(tok);
                probs_index[base + w as usize] = i32::cast_from(tok * e + ex);
                w += 1u32;
            }
        }
    }
}

/// `out[t, j]`: index of the `j`-th largest score of row `t` (descending value, lower index
/// first among ties, NaN last). Scores are compared as f32.
#[cube(launch)]
fn topk_kernel<E: Float>(
    scores: &Tensor<E>,
    out: &mut Tensor<i32>,
    rows: u32,
    experts: u32,
    k: u32,
    #[define(E)] _dtype: ElemType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let e = experts as usize;
    let base = row * e;
    let mut prev_i = 0usize;
    let mut prev_v = f32::cast_from(scores[base]);
    let mut prev_nan = prev_v.is_nan();
    for j in 0..k as usize {
        let mut found = false;
        let mut best_i = 0usize;
        let mut best_v = f32::cast_from(scores[base]);
        let mut best_nan = false;
        for i in 0..e {
            let v = f32::cast_from(scores[base + i]);
            let nan = v.is_nan();
            // Strictly after the previous pick in the order (value desc, index asc, NaN last).
            let after_prev = j == 0
                || (!prev_nan && nan)
                || (!prev_nan && !nan && (v < prev_v || (v == prev_v && i > prev_i)))
                || (prev_nan && nan && i > prev_i);
            // Strictly before the current best.
            let before_best = !found
                || (!nan && best_nan)
                || (!nan && !best_nan && (v > best_v || (v == best_v && i < best_i)))
                || (nan && best_nan && i < best_i);
            if after_prev && before_best {
                found = true;
                best_i = i;
                best_v = v;
                best_nan = nan;
            }
        }
        out[row * k as usize + j] = i32::cast_from(best_i);
        prev_i = best_i;
        prev_v = best_v;
        prev_nan = best_nan;
    }
}

fn i32_tensor(values: Vec<i32>, like: &CubeTensor) -> CubeTensor {
    let n = values.len();
    <CubeBackend as burn::backend::ops::IntTensorOps<CubeBackend>>::int_from_data(
        TensorData::new(values, [n]),
        &like.device,
    )
}

/// Expert-major routing index; see
/// [`MoeOps::moe_routing_index`](crate::ops::MoeOps::moe_routing_index).
pub(crate) fn routing_index(
    routing_map: CubeTensor,
    capacity: Option<usize>,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let op = "moe_routing_index";
    let s = routing_map.meta.shape().clone();
    assert!(
        s.num_dims() == 2,
        "{op}: routing_map must be 2-D, got {s:?}"
    );
    let (t, e) = (s[0], s[1]);
    let map = launch::contiguous(CubeBackend::bool_into_int(routing_map, IntDType::I32));
    let client = map.client.clone();
    let dtype = int_storage(map.dtype);
    let experts = launch::u32_arg(e, op);
    let tokens = launch::u32_arg(t, op);
    let shape = LaunchShape::elementwise(&client, e.max(1));
    match capacity {
        Some(cap) => {
            let n = e * cap;
            let sorted = empty_like_dtype(&map, [n], DType::I32);
            let probs_index = empty_like_dtype(&map, [n], DType::I32);
            if n > 0 {
                routing_fill_kernel::launch(
                    &client,
                    shape.count,
                    shape.dim,
                    map.clone().into_tensor_arg(),
                    launch::zeros_u32(&map, 1).into_tensor_arg(),
                    sorted.clone().into_tensor_arg(),
                    probs_index.clone().into_tensor_arg(),
                    tokens,
                    experts,
                    launch::u32_arg(cap, op),
                    true,
                    dtype,
                );
            }
            let cap = i32::try_from(cap)
                .unwrap_or_else(|_| panic!("{op}: capacity {cap} does not fit in i32"));
            let per_expert = i32_tensor(vec![cap; e], &map);
            (sorted, probs_index, per_expert)
        }
        None => {
            if e == 0 || t == 0 {
                let empty = empty_like_dtype(&map, [0], DType::I32);
                return (empty.clone(), empty, i32_tensor(vec![0; e], &map));
            }
            let counts = empty_like_dtype(&map, [e], DType::U32);
            expert_counts_kernel::launch(
                &client,
                shape.count,
                shape.dim,
                map.clone().into_tensor_arg(),
                counts.clone().into_tensor_arg(),
                tokens,
                experts,
                dtype,
            );
            let shape = LaunchShape::elementwise(&client, e);
            // The row count sizes the outputs: one read of the [E] counts.
            let counts: Vec<u32> = burn_cubecl::ops::into_data_sync(counts)
                .convert::<u32>()
                .try_into_vec::<u32>()
                .unwrap_or_else(|e| panic!("{op}: cannot read expert counts: {e:?}"));
            let mut offsets = Vec::with_capacity(e);
            let mut n = 0u32;
            for &c in &counts {
                offsets.push(n);
                n += c;
            }
            let n = n as usize;
            let sorted = empty_like_dtype(&map, [n], DType::I32);
            let probs_index = empty_like_dtype(&map, [n], DType::I32);
            let offsets =
                <CubeBackend as burn::backend::ops::IntTensorOps<CubeBackend>>::int_from_data(
                    TensorData::new(offsets, [e]),
                    &map.device,
                );
            if n > 0 {
                routing_fill_kernel::launch(
                    &client,
                    shape.count,
                    shape.dim,
                    map.clone().into_tensor_arg(),
                    offsets.into_tensor_arg(),
                    sorted.clone().into_tensor_arg(),
                    probs_index.clone().into_tensor_arg(),
                    tokens,
                    experts,
                    u32::MAX,
                    false,
                    dtype,
                );
            }
            let per_expert = i32_tensor(counts.iter().map(|&c| c as i32).collect(), &map);
            (sorted, probs_index, per_expert)
        }
    }
}

/// Top-k expert indices; see [`MoeOps::moe_topk_indices`](crate::ops::MoeOps::moe_topk_indices).
pub(crate) fn topk_indices(scores: CubeTensor, k: usize) -> CubeTensor {
    let op = "moe_topk_indices";
    let scores = launch::contiguous(scores);
    let s = scores.meta.shape().clone();
    assert!(s.num_dims() == 2, "{op}: scores must be 2-D, got {s:?}");
    let (t, e) = (s[0], s[1]);
    assert!(k <= e, "{op}: k = {k} exceeds {e} columns");
    let out = empty_like_dtype(&scores, [t, k], DType::I32);
    if t == 0 || k == 0 {
        return out;
    }
    let shape = LaunchShape::elementwise(&scores.client, t);
    let dtype = float_storage(scores.dtype);
    topk_kernel::launch(
        &scores.client,
        shape.count,
        shape.dim,
        scores.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        launch::u32_arg(t, op),
        launch::u32_arg(e, op),
        launch::u32_arg(k, op),
        dtype,
    );
    out
}
