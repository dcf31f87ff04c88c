//! Row movement kernels: permute (row gather), unpermute (deterministic per-token sum of the
//! k copies, f32 accumulation) and the device-side inverse map unpermute needs.
//!
//! Unpermute builds a CSR inverse of `sorted_indices` on the device: per-token counts (integer
//! atomics, order-independent), an exclusive scan, slot filling (atomics pick the slot), then a
//! per-token insertion sort of the slots so that every token sums its rows in ascending row
//! order. The float sum itself is done by one unit per output element, so the result does not
//! depend on scheduling.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::launch::{
    self, LaunchShape, elem_count, empty_like_dtype, float_storage, int_storage, zeros_u32,
};

/// `out[r, c] = src[idx[r], c]` for `src [T, H]`, `idx [N]`, `out [N, H]`.
#[cube(launch)]
fn gather_rows_kernel<E: Numeric, I: Int>(
    src: &Tensor<E>,
    idx: &Tensor<I>,
    out: &mut Tensor<E>,
    width: u32,
    #[define(E, I)] _dtypes: [ElemType; 2],
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let w = width as usize;
    let r = pos / w;
    let c = pos % w;
    let tok = usize::cast_from(idx[r]);
    out[pos] = src[tok * w + c];
}

/// `counts[idx[r]] += 1` for every row `r`.
#[cube(launch)]
fn count_rows_kernel<I: Int>(
    idx: &Tensor<I>,
    counts: &mut Tensor<Atomic<u32>>,
    #[define(I)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r >= idx.len() {
        terminate!();
    }
    let tok = usize::cast_from(idx[r]);
    counts[tok].fetch_add(1u32);
}

/// Exclusive scan of `counts [T]` into `offsets [T + 1]` (one unit; T is the token count).
#[cube(launch)]
fn exclusive_scan_kernel(counts: &Tensor<u32>, offsets: &mut Tensor<u32>) {
    if ABSOLUTE_POS == 0 {
        let mut acc = 0u32;
        offsets[0] = 0u32;
        for t in 0..counts.len() {
            acc += counts[t];
            offsets[t + 1] = acc;
        }
    }
}

/// Places every row `r` in a slot of its token's segment: `slots[offsets[t] + j] = r`.
#[cube(launch)]
fn fill_slots_kernel<I: Int>(
    idx: &Tensor<I>,
    offsets: &Tensor<u32>,
    cursor: &mut Tensor<Atomic<u32>>,
    slots: &mut Tensor<u32>,
    #[define(I)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r >= idx.len() {
        terminate!();
    }
    let tok = usize::cast_from(idx[r]);
    let j = cursor[tok].fetch_add(1u32);
    slots[(offsets[tok] + j) as usize] = r as u32;
}

/// Sorts each token's slots ascending (insertion sort; segments hold the k copies of a token).
#[cube(launch)]
fn sort_slots_kernel(offsets: &Tensor<u32>, slots: &mut Tensor<u32>, tokens: u32) {
    let t = ABSOLUTE_POS;
    if t >= tokens as usize {
        terminate!();
    }
    let start = offsets[t] as usize;
    let end = offsets[t + 1] as usize;
    for i in start + 1..end {
        let v = slots[i];
        let mut j = i;
        loop {
            if j <= start {
                break;
            }
            let prev = slots[j - 1];
            if prev <= v {
                break;
            }
            slots[j] = prev;
            j -= 1;
        }
        slots[j] = v;
    }
}

/// `out[t, c] = Σ_{r in slots of t} rows[r, c] (· probs[r])`, summed in f32 in slot order.
#[cube(launch)]
fn unpermute_kernel<E: Float>(
    rows: &Tensor<E>,
    probs: &Tensor<E>,
    offsets: &Tensor<u32>,
    slots: &Tensor<u32>,
    out: &mut Tensor<E>,
    width: u32,
    #[comptime] weighted: bool,
    #[define(E)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let w = width as usize;
    let t = pos / w;
    let c = pos % w;
    let start = offsets[t] as usize;
    let end = offsets[t + 1] as usize;
    let mut acc = 0.0f32;
    for s in start..end {
        let r = slots[s] as usize;
        let v = f32::cast_from(rows[r * w + c]);
        if comptime![weighted] {
            acc += v * f32::cast_from(probs[r]);
        } else {
            acc += v;
        }
    }
    out[pos] = E::cast_from(acc);
}

/// Gathers rows of a contiguous `[T, H]` tensor by `idx [N]` into `[N, H]`.
pub(crate) fn gather_rows(src: CubeTensor, idx: CubeTensor) -> CubeTensor {
    let src = launch::contiguous(src);
    let idx = launch::contiguous(idx);
    let h = src.meta.shape()[1];
    let n = idx.meta.shape()[0];
    let out = empty_like_dtype(&src, [n, h], src.dtype);
    let total = n * h;
    if total == 0 {
        return out;
    }
    let shape = LaunchShape::elementwise(&src.client, total);
    let dtypes = [float_storage(src.dtype), int_storage(idx.dtype)];
    let client = src.client.clone();
    gather_rows_kernel::launch(
        &client,
        shape.count,
        shape.dim,
        src.into_tensor_arg(),
        idx.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        launch::u32_arg(h, "moe_permute"),
        dtypes,
    );
    out
}

/// Device CSR inverse of `idx [N]` over `tokens` targets: `(offsets [T + 1], slots [N])`,
/// every segment sorted ascending.
fn inverse_map(idx: &CubeTensor, tokens: usize) -> (CubeTensor, CubeTensor) {
    let n = idx.meta.shape()[0];
    let client = &idx.client;
    let counts = zeros_u32(idx, tokens);
    let offsets = empty_like_dtype(idx, [tokens + 1], burn::tensor::DType::U32);
    let slots = empty_like_dtype(idx, [n.max(1)], burn::tensor::DType::U32);
    let idx_dtype = int_storage(idx.dtype);
    if n > 0 {
        let shape = LaunchShape::elementwise(client, n);
        count_rows_kernel::launch(
            client,
            shape.count,
            shape.dim,
            idx.clone().into_tensor_arg(),
            counts.clone().into_tensor_arg(),
            idx_dtype,
        );
    }
    exclusive_scan_kernel::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        counts.into_tensor_arg(),
        offsets.clone().into_tensor_arg(),
    );
    if n > 0 {
        let cursor = zeros_u32(idx, tokens);
        let shape = LaunchShape::elementwise(client, n);
        fill_slots_kernel::launch(
            client,
            shape.count,
            shape.dim,
            idx.clone().into_tensor_arg(),
            offsets.clone().into_tensor_arg(),
            cursor.into_tensor_arg(),
            slots.clone().into_tensor_arg(),
            idx_dtype,
        );
        let shape = LaunchShape::elementwise(client, tokens);
        sort_slots_kernel::launch(
            client,
            shape.count,
            shape.dim,
            offsets.clone().into_tensor_arg(),
            slots.clone().into_tensor_arg(),
            launch::u32_arg(tokens, "moe_unpermute"),
        );
    }
    (offsets, slots)
}

/// Sums the rows `[N, H]` of every token (optionally weighted by `probs [N]`) into
/// `[tokens, H]`; rows are summed in ascending row order with f32 accumulation.
pub(crate) fn unpermute(
    rows: CubeTensor,
    idx: CubeTensor,
    probs: Option<CubeTensor>,
    tokens: usize,
) -> CubeTensor {
    let rows = launch::contiguous(rows);
    let idx = launch::contiguous(idx);
    let h = rows.meta.shape()[1];
    let out = empty_like_dtype(&rows, [tokens, h], rows.dtype);
    let total = tokens * h;
    if total == 0 {
        return out;
    }
    let (offsets, slots) = inverse_map(&idx, tokens);
    let weighted = probs.is_some();
    // Unweighted: `probs` is never read; pass `rows` as a placeholder binding.
    let probs = match probs {
        Some(p) => launch::cast_float(launch::contiguous(p), rows.dtype),
        None => rows.clone(),
    };
    let shape = LaunchShape::elementwise(&rows.client, elem_count(&out));
    let dtype = float_storage(rows.dtype);
    let client = rows.client.clone();
    unpermute_kernel::launch(
        &client,
        shape.count,
        shape.dim,
        rows.into_tensor_arg(),
        probs.into_tensor_arg(),
        offsets.into_tensor_arg(),
        slots.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        launch::u32_arg(h, "moe_unpermute"),
        weighted,
        dtype,
    );
    out
}
