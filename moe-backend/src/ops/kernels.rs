//! Plain-Rust CPU kernels on contiguous row-major buffers.
//!
//! These are the compute bodies of the Flex implementation of [`MoeOps`](super::MoeOps). They work on
//! slices (no Burn calls inside), use the `gemm` crate for matrix products and rayon for
//! parallelism, and are generic over the two native float types `f32` and `f64`. Half-precision
//! inputs are widened to `f32` by the caller, which gives the f32 accumulation of
//! docs/routing-and-dispatch.md §Notation and conventions.

use rayon::prelude::*;

/// A float element the kernels compute in (`f32` or `f64`).
pub trait KernelFloat:
    Copy
    + Send
    + Sync
    + Default
    + PartialEq
    + core::ops::Add<Output = Self>
    + core::ops::Mul<Output = Self>
    + core::ops::AddAssign
    + 'static
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
}

impl KernelFloat for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl KernelFloat for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// Raw pointer that may cross rayon task boundaries. Every use writes a region no other task
/// touches (the disjointness argument is given at each use).
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: only used for disjoint writes from parallel tasks, see the call sites.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// Returns the wrapped pointer (a method, so closures capture the whole wrapper).
    fn get(self) -> *mut T {
        self.0
    }
}

/// A zero-filled buffer of `len` elements for a kernel output.
///
/// Large outputs (MoE activations and expert weight gradients reach gigabytes) are asked to be
/// backed by transparent huge pages before their first touch, which cuts page-fault cost on
/// Linux systems where THP is in `madvise` mode. The advice is best-effort and never changes
/// results.
pub fn zeroed<T: Copy + Default>(len: usize) -> Vec<T> {
    let v = vec![T::default(); len];
    advise_huge_pages(v.as_ptr(), core::mem::size_of_val(v.as_slice()));
    v
}

/// An uninitialised buffer of `len` elements for a kernel output that is written in full
/// before use (no zero fill: with a caching global allocator such as
/// [`crate::alloc::LargeBlockCache`] a reused block then costs neither page faults nor a
/// `memset`). Write every element of `spare_capacity_mut()[..len]`, then `set_len(len)`.
pub fn uninit_output<T>(len: usize) -> Vec<T> {
    let v = Vec::with_capacity(len);
    advise_huge_pages(v.as_ptr(), len * core::mem::size_of::<T>());
    v
}

#[cfg(target_os = "linux")]
fn advise_huge_pages<T>(ptr: *const T, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 4 * HUGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside the allocation; MADV_HUGEPAGE only changes
        // how the kernel backs those pages, not their contents, and failure is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_ptr: *const T, _bytes: usize) {}

/// Rows per parallel task for row-copy kernels: at least ~32 KiB of payload per task.
fn rows_per_task(width: usize, elem_bytes: usize) -> usize {
    let row_bytes = (width * elem_bytes).max(1);
    (32 * 1024 / row_bytes).max(1)
}

/// Exclusive prefix sum: `offsets[i] = Σ_{j<i} sizes[j]`, with a final total entry.
pub fn offsets_of(sizes: &[usize]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(sizes.len() + 1);
    let mut acc = 0usize;
    offsets.push(0);
    for &s in sizes {
        acc += s;
        offsets.push(acc);
    }
    offsets
}

/// Gathers rows: `out[r] = x[idx[r]]` for `x [rows, width]`.
///
/// Callers guarantee `idx[r] < rows(x)`.
pub fn gather_rows<T: Copy + Send + Sync + Default>(
    x: &[T],
    width: usize,
    idx: &[usize],
) -> Vec<T> {
    let len = idx.len() * width;
    let mut out = uninit_output::<T>(len);
    if width == 0 {
        return out;
    }
    let chunk = rows_per_task(width, core::mem::size_of::<T>());
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk * width)
        .zip(idx.par_chunks(chunk))
        .for_each(|(dst, rows)| {
            for (d, &src) in dst.chunks_exact_mut(width).zip(rows) {
                for (d, &v) in d.iter_mut().zip(&x[src * width..(src + 1) * width]) {
                    d.write(v);
                }
            }
        });
    // SAFETY: the chunks cover all `len` elements and every one was written above.
    unsafe { out.set_len(len) };
    out
}

/// Compressed token -> rows map: rows of token `t` are `rows[start[t]..start[t+1]]`, ascending.
pub struct TokenRows {
    start: Vec<usize>,
    rows: Vec<usize>,
}

impl TokenRows {
    /// Builds the inverse of `sorted_indices` (row `r` belongs to token `sorted_indices[r]`) by a
    /// counting sort, so each token's rows are listed in ascending row order (deterministic
    /// accumulation order).
    pub fn new(sorted_indices: &[usize], num_tokens: usize) -> Self {
        let mut counts = vec![0usize; num_tokens];
        for &t in sorted_indices {
            counts[t] += 1;
        }
        let start = offsets_of(&counts);
        let mut fill = start[..num_tokens].to_vec();
        let mut rows = vec![0usize; sorted_indices.len()];
        for (r, &t) in sorted_indices.iter().enumerate() {
            rows[fill[t]] = r;
            fill[t] += 1;
        }
        Self { start, rows }
    }

    /// The rows holding copies of token `t`, ascending.
    pub fn rows_of(&self, t: usize) -> &[usize] {
        &self.rows[self.start[t]..self.start[t + 1]]
    }
}

/// Scatter-add of permuted rows back to tokens: `out[t] = Σ_{r: idx[r] = t} rows[r] · p_r`.
///
/// `weights` (one per row) is optional. Accumulates in `T` (callers pass f32 or f64) in ascending
/// row order for every token, so the result is deterministic and independent of thread count.
pub fn scatter_add_rows<T: KernelFloat>(
    rows: &[T],
    width: usize,
    sorted_indices: &[usize],
    weights: Option<&[T]>,
    num_tokens: usize,
) -> Vec<T> {
    let mut out = zeroed::<T>(num_tokens * width);
    if width == 0 || num_tokens == 0 {
        return out;
    }
    let inverse = TokenRows::new(sorted_indices, num_tokens);
    let chunk = rows_per_task(width, core::mem::size_of::<T>());
    out.par_chunks_mut(chunk * width)
        .enumerate()
        .for_each(|(c, dst)| {
            for (i, acc) in dst.chunks_exact_mut(width).enumerate() {
                let t = c * chunk + i;
                for &r in inverse.rows_of(t) {
                    let src = &rows[r * width..(r + 1) * width];
                    match weights {
                        Some(w) => {
                            let p = w[r];
                            for (a, &v) in acc.iter_mut().zip(src) {
                                *a += v * p;
                            }
                        }
                        None => {
                            for (a, &v) in acc.iter_mut().zip(src) {
                                *a += v;
                            }
                        }
                    }
                }
            }
        });
    out
}

/// Row index list realising `sort_chunks_by_idxs` (docs/routing-and-dispatch.md §Chunk sorting):
/// output row `j` is input row `index[j]`, chunks taken in `sorted_idxs` order.
pub fn sort_chunks_row_index(split_sizes: &[usize], sorted_idxs: &[usize]) -> Vec<usize> {
    let offsets = offsets_of(split_sizes);
    let mut index = Vec::with_capacity(offsets[split_sizes.len()]);
    for &c in sorted_idxs {
        index.extend(offsets[c]..offsets[c + 1]);
    }
    index
}

/// Work item of a grouped GEMM: a block of output rows (or, for wgrad, output columns) of one
/// group.
#[derive(Clone, Copy, Debug)]
struct Tile {
    group: usize,
    start: usize,
    len: usize,
}

/// Splits each group's `extent` into tiles so that the total work can be balanced over the rayon
/// pool without splitting a group finer than `min_tile`.
fn tiles(extents: &[usize], min_tile: usize) -> Vec<Tile> {
    let total: usize = extents.iter().sum();
    let threads = rayon::current_num_threads().max(1);
    // Aim for ~4 tiles per thread overall, never below `min_tile`.
    let target = (total / (threads * 4)).max(min_tile).max(1);
    let mut out = Vec::new();
    for (group, &extent) in extents.iter().enumerate() {
        let mut start = 0;
        while start < extent {
            let pieces = extent.div_ceil(target);
            let len = extent.div_ceil(pieces).min(extent - start);
            out.push(Tile { group, start, len });
            start += len;
        }
    }
    out
}

/// How the weights of a grouped GEMM are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmWeightLayout {
    /// `w [G, M, K]` (PyTorch `[out, in]`): `Y_g = X_g · W_gᵀ`.
    OutIn,
    /// `w [G, K, M]` (`[in, out]`): `Y_g = X_g · W_g`.
    InOut,
}

/// `dst [m, n] = lhs [m, k] · rhs [k, n]` with explicit strides, single-threaded.
///
/// # Safety
/// All pointers must be valid for the given extents and strides, and `dst` must not alias the
/// inputs or any region written concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_single<T: KernelFloat>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    lhs: *const T,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const T,
    rhs_cs: isize,
    rhs_rs: isize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm_strided(
            m, n, k, dst, 1, dst_rs, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs,
        );
    }
}

/// [`gemm_single`] with an explicit output column stride.
///
/// # Safety
/// As [`gemm_single`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_strided<T: KernelFloat>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_cs: isize,
    dst_rs: isize,
    lhs: *const T,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const T,
    rhs_cs: isize,
    rhs_rs: isize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            false,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `dst [rows, cols]` (row stride `cols`) = the transpose of `src [cols, rows]` (row-major),
/// in cache-sized blocks.
///
/// # Safety
/// `dst` must be valid for writes of `rows · cols` elements that nothing else accesses.
unsafe fn transpose_into<T: Copy>(src: &[T], rows: usize, cols: usize, dst: *mut T) {
    const B: usize = 32;
    for c0 in (0..cols).step_by(B) {
        for r0 in (0..rows).step_by(B) {
            for c in c0..(c0 + B).min(cols) {
                let r1 = (r0 + B).min(rows);
                for (r, &v) in (r0..r1).zip(&src[c * rows + r0..c * rows + r1]) {
                    // SAFETY: r·cols + c < rows·cols (caller's contract).
                    unsafe { dst.add(r * cols + c).write(v) };
                }
            }
        }
    }
}

/// Largest row tile an `OutIn` grouped GEMM computes through a column-major scratch output.
/// Below it, keeping the weight on the packed right-hand side wins (balanced 128-row experts at
/// K = 2048, M = 768: 0.87–1.03 of a dense GEMM instead of 0.49); above it, the scratch's long
/// column stride costs more than `gemm`'s own strided packing of the weight, which a tall tile
/// amortises (2048-row experts: 1.07 instead of 0.53). Measured on 2 AVX-512 cores.
const SCRATCH_MAX_ROWS: usize = 768;

/// Grouped GEMM forward (docs/routing-and-dispatch.md §Grouped GEMM): rows of `x [N, K]` form
/// consecutive segments of `sizes`; `out[seg_g] = x[seg_g] · W_gᵀ` (`OutIn`) or `x[seg_g] · W_g`
/// (`InOut`).
///
/// `w` holds `G` matrices of `m·k` elements each. Empty groups produce no rows.
/// Callers guarantee `Σ sizes = N` and buffer lengths.
pub fn grouped_gemm<T: KernelFloat>(
    x: &[T],
    k: usize,
    w: &[T],
    m: usize,
    sizes: &[usize],
    layout: GemmWeightLayout,
) -> Vec<T> {
    let n_rows: usize = sizes.iter().sum();
    if m == 0 || n_rows == 0 || k == 0 {
        return zeroed::<T>(n_rows * m);
    }
    // Every output row belongs to exactly one tile and `gemm` overwrites its tile (it does
    // not read the destination), so the output needs no zero fill.
    let mut out = uninit_output::<T>(n_rows * m);
    let offsets = offsets_of(sizes);
    let out_ptr = SendPtr(out.as_mut_ptr());
    // Row tiles of >= 64 rows keep the packed weight panel reused across enough rows.
    tiles(sizes, 64)
        .into_par_iter()
        .for_each_init(Vec::<T>::new, |scratch, tile| {
            let row0 = offsets[tile.group] + tile.start;
            let w_g = &w[tile.group * m * k..(tile.group + 1) * m * k];
            match layout {
                GemmWeightLayout::OutIn if tile.len <= SCRATCH_MAX_ROWS => {
                    // W_g [M, K]; rhs = W_gᵀ [K, M]: element (kk, j) at j·K + kk. With a
                    // row-major output `gemm` would transpose the problem and pack W_g as a
                    // row-major left operand (a strided gather, half the speed); a column-major
                    // scratch output keeps W_g on the right, packed in contiguous K runs. The
                    // scratch [M, len] is then transposed into the tile's rows.
                    scratch.clear();
                    scratch.resize(tile.len * m, T::ZERO);
                    // SAFETY: `scratch` holds len·M elements, written column-major (element
                    // (i, j) at j·len + i); inputs are only read, indices stay inside `x` and
                    // `w_g` by construction of `offsets`.
                    unsafe {
                        gemm_strided(
                            tile.len,
                            m,
                            k,
                            scratch.as_mut_ptr(),
                            tile.len as isize,
                            1,
                            x.as_ptr().add(row0 * k),
                            1,
                            k as isize,
                            w_g.as_ptr(),
                            k as isize,
                            1,
                        );
                    }
                    // SAFETY: tiles cover disjoint output rows [row0, row0 + len), inside the
                    // buffer's capacity.
                    unsafe { transpose_into(scratch, tile.len, m, out_ptr.get().add(row0 * m)) };
                }
                GemmWeightLayout::OutIn | GemmWeightLayout::InOut => {
                    let (rhs_cs, rhs_rs) = match layout {
                        GemmWeightLayout::OutIn => (k as isize, 1),
                        GemmWeightLayout::InOut => (1, m as isize),
                    };
                    // W_g [K, M]: element (kk, j) at kk·M + j.
                    // SAFETY: tiles cover disjoint output rows [row0, row0 + len); inputs are
                    // only read and every index stays inside `x`, `w_g` and `out`.
                    unsafe {
                        gemm_single(
                            tile.len,
                            m,
                            k,
                            out_ptr.get().add(row0 * m),
                            m as isize,
                            x.as_ptr().add(row0 * k),
                            1,
                            k as isize,
                            w_g.as_ptr(),
                            rhs_cs,
                            rhs_rs,
                        );
                    }
                }
            }
        });
    // SAFETY: the tiles cover every row of every group, and each call wrote its rows in full.
    unsafe { out.set_len(n_rows * m) };
    out
}

/// Grouped weight gradient: `out_g [P, Q] = a[seg_g]ᵀ · b[seg_g]` for `a [N, P]`, `b [N, Q]`.
///
/// With `OutIn` weights `dW = wgrad(dY, X)`; with `InOut` weights `dW = wgrad(X, dY)`.
/// Groups with no rows get an all-zero gradient.
pub fn grouped_gemm_wgrad<T: KernelFloat>(
    a: &[T],
    p: usize,
    b: &[T],
    q: usize,
    sizes: &[usize],
) -> Vec<T> {
    let groups = sizes.len();
    let len = groups * p * q;
    if p == 0 || q == 0 {
        return zeroed::<T>(len);
    }
    // Non-empty groups are overwritten in full by their tiles (`gemm` does not read the
    // destination); only empty groups are zero-filled, so reused memory is never cleared twice.
    let mut out = uninit_output::<T>(len);
    for (g, _) in sizes.iter().enumerate().filter(|&(_, &s)| s == 0) {
        out.spare_capacity_mut()[g * p * q..(g + 1) * p * q]
            .iter_mut()
            .for_each(|v| {
                v.write(T::ZERO);
            });
    }
    let offsets = offsets_of(sizes);
    // Parallelise over (group, column block of Q): each tile owns disjoint output columns.
    let extents: Vec<usize> = sizes.iter().map(|&s| if s == 0 { 0 } else { q }).collect();
    let out_ptr = SendPtr(out.as_mut_ptr());
    tiles(&extents, 64).into_par_iter().for_each(|tile| {
        let rows = sizes[tile.group];
        let row0 = offsets[tile.group];
        // SAFETY: each tile writes the block [0, P) x [start, start + len) of group `group`'s
        // output, disjoint from every other tile; reads stay inside `a` and `b`.
        unsafe {
            gemm_single(
                p,
                tile.len,
                rows,
                out_ptr.get().add(tile.group * p * q + tile.start),
                q as isize,
                // lhs = a_gᵀ [P, rows]: element (i, r) at r·P + i.
                a.as_ptr().add(row0 * p),
                p as isize,
                1,
                // rhs = b_g[:, start..start+len] [rows, len]: element (r, j) at r·Q + j.
                b.as_ptr().add(row0 * q + tile.start),
                1,
                q as isize,
            );
        }
    });
    // SAFETY: empty groups were zero-filled; the tiles of every other group cover its
    // [P, Q] block and `gemm` wrote each tile in full.
    unsafe { out.set_len(len) };
    out
}

/// Float types with the transcendental functions the activation kernels need.
pub trait ActivationFloat:
    KernelFloat + core::ops::Sub<Output = Self> + core::ops::Neg<Output = Self>
{
    /// `1 / (1 + e^{-x})`.
    fn sigmoid(self) -> Self;
}

impl ActivationFloat for f32 {
    fn sigmoid(self) -> Self {
        1.0 / (1.0 + (-self).exp())
    }
}

impl ActivationFloat for f64 {
    fn sigmoid(self) -> Self {
        1.0 / (1.0 + (-self).exp())
    }
}

/// Fused SwiGLU with routing weights (docs/routing-and-dispatch.md §Experts, steps 3–4): for
/// `hidden [N, 2F]` with rows `[gate; up]`, `z[r] = silu(gate[r]) ⊙ up[r] · p_r`. Output `[N, F]`.
pub fn swiglu_probs<T: ActivationFloat>(hidden: &[T], f: usize, probs: &[T]) -> Vec<T> {
    let n = probs.len();
    let mut out = uninit_output::<T>(n * f);
    if f == 0 {
        return out;
    }
    let chunk = rows_per_task(2 * f, core::mem::size_of::<T>());
    out.spare_capacity_mut()[..n * f]
        .par_chunks_mut(chunk * f)
        .enumerate()
        .for_each(|(c, dst)| {
            for (i, z) in dst.chunks_exact_mut(f).enumerate() {
                let r = c * chunk + i;
                let (gate, up) = hidden[r * 2 * f..(r + 1) * 2 * f].split_at(f);
                let p = probs[r];
                for ((z, &g), &u) in z.iter_mut().zip(gate).zip(up) {
                    z.write(g * g.sigmoid() * u * p);
                }
            }
        });
    // SAFETY: the chunks cover all n·F elements and every one was written above.
    unsafe { out.set_len(n * f) };
    out
}

/// Backward of [`swiglu_probs`]: given `dz [N, F]`, returns `d_hidden [N, 2F]` and `d_probs [N]`:
/// `d_gate = dz·p·up·σ(g)(1 + g(1 − σ(g)))`, `d_up = dz·p·silu(g)`, `d_p = Σ dz·silu(g)·up`.
pub fn swiglu_probs_backward<T: ActivationFloat>(
    hidden: &[T],
    f: usize,
    probs: &[T],
    dz: &[T],
) -> (Vec<T>, Vec<T>) {
    let n = probs.len();
    let mut dh = uninit_output::<T>(n * 2 * f);
    let mut dp = vec![T::ZERO; n];
    if f == 0 {
        return (dh, dp);
    }
    let chunk = rows_per_task(2 * f, core::mem::size_of::<T>());
    dh.spare_capacity_mut()[..n * 2 * f]
        .par_chunks_mut(chunk * 2 * f)
        .zip(dp.par_chunks_mut(chunk))
        .enumerate()
        .for_each(|(c, (dh_rows, dp_rows))| {
            for (i, (dhr, dpr)) in dh_rows.chunks_exact_mut(2 * f).zip(dp_rows).enumerate() {
                let r = c * chunk + i;
                let (gate, up) = hidden[r * 2 * f..(r + 1) * 2 * f].split_at(f);
                let dzr = &dz[r * f..(r + 1) * f];
                let p = probs[r];
                let (dg, du) = dhr.split_at_mut(f);
                let mut acc = T::ZERO;
                for j in 0..f {
                    let (g, u, d) = (gate[j], up[j], dzr[j]);
                    let s = g.sigmoid();
                    let silu = g * s;
                    acc += d * silu * u;
                    du[j].write(d * p * silu);
                    dg[j].write(d * p * u * s * (T::ONE + g * (T::ONE - s)));
                }
                *dpr = acc;
            }
        });
    // SAFETY: the chunks cover all n·2F elements and every row's gate and up halves were
    // written above.
    unsafe { dh.set_len(n * 2 * f) };
    (dh, dp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_gemm(x: &[f64], rows: usize, k: usize, w: &[f64], m: usize, out_in: bool) -> Vec<f64> {
        let mut y = vec![0.0; rows * m];
        for r in 0..rows {
            for j in 0..m {
                let mut acc = 0.0;
                for kk in 0..k {
                    let wv = if out_in { w[j * k + kk] } else { w[kk * m + j] };
                    acc += x[r * k + kk] * wv;
                }
                y[r * m + j] = acc;
            }
        }
        y
    }

    fn pseudo(n: usize, seed: u64) -> Vec<f64> {
        crate::testing::SplitMix::new(seed).values(n)
    }

    #[test]
    fn grouped_gemm_matches_per_group_naive_product() {
        let (k, m) = (7, 5);
        let sizes = [3, 0, 130, 1];
        let n: usize = sizes.iter().sum();
        let x = pseudo(n * k, 1);
        let w = pseudo(sizes.len() * m * k, 2);
        for layout in [GemmWeightLayout::OutIn, GemmWeightLayout::InOut] {
            let y = grouped_gemm(&x, k, &w, m, &sizes, layout);
            let mut row = 0;
            for (g, &s) in sizes.iter().enumerate() {
                let expect = naive_gemm(
                    &x[row * k..(row + s) * k],
                    s,
                    k,
                    &w[g * m * k..(g + 1) * m * k],
                    m,
                    layout == GemmWeightLayout::OutIn,
                );
                for (a, b) in y[row * m..(row + s) * m].iter().zip(&expect) {
                    assert!((a - b).abs() < 1e-12, "{layout:?} group {g}: {a} vs {b}");
                }
                row += s;
            }
        }
    }

    #[test]
    fn wgrad_is_segment_outer_product_sum_and_zero_for_empty_groups() {
        let (p, q) = (4, 130);
        let sizes = [2, 0, 5];
        let n: usize = sizes.iter().sum();
        let a = pseudo(n * p, 3);
        let b = pseudo(n * q, 4);
        let out = grouped_gemm_wgrad(&a, p, &b, q, &sizes);
        let mut row = 0;
        for (g, &s) in sizes.iter().enumerate() {
            for i in 0..p {
                for j in 0..q {
                    let expect: f64 = (row..row + s).map(|r| a[r * p + i] * b[r * q + j]).sum();
                    let got = out[g * p * q + i * q + j];
                    assert!((got - expect).abs() < 1e-12);
                }
            }
            row += s;
        }
    }

    #[test]
    fn scatter_add_sums_copies_in_row_order() {
        let rows = [1.0f64, 2.0, 10.0, 20.0, 100.0, 200.0];
        let idx = [1, 0, 1];
        let w = [0.5, 2.0, 3.0];
        let out = scatter_add_rows(&rows, 2, &idx, Some(&w), 3);
        assert_eq!(out, vec![20.0, 40.0, 300.5, 601.0, 0.0, 0.0]);
    }

    #[test]
    fn sort_chunks_index_reorders_chunks_and_allows_empty_ones() {
        let index = sort_chunks_row_index(&[1, 0, 2, 1], &[2, 1, 0, 3]);
        assert_eq!(index, vec![1, 2, 0, 3]);
    }
}
