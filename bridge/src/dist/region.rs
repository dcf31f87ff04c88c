//! Hyper-rectangles of global tensors ([`TensorBox`]) and strided copies between row-major buffers
//! (docs/checkpoints.md §Resharding: copy the overlap of a stored chunk and a requested box in
//! contiguous runs along the trailing dimensions).

/// A box `[offsets, offsets + shape)` of a global tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorBox {
    /// Global offsets of the first element.
    pub offsets: Vec<usize>,
    /// Extent along each dimension.
    pub shape: Vec<usize>,
}

impl TensorBox {
    /// A box; `offsets` and `shape` must have the same length.
    pub fn new(offsets: Vec<usize>, shape: Vec<usize>) -> Self {
        Self { offsets, shape }
    }

    /// The whole tensor of `shape`.
    pub fn full(shape: &[usize]) -> Self {
        Self {
            offsets: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The overlap of two boxes of the same rank, `None` when they do not intersect (a box
    /// with an empty dimension intersects nothing).
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut shape = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if lo >= hi {
                return None;
            }
            offsets.push(lo);
            shape.push(hi - lo);
        }
        Some(TensorBox { offsets, shape })
    }

    /// Whether the box lies inside a tensor of `global` shape (same rank).
    pub fn within(&self, global: &[usize]) -> bool {
        self.offsets.len() == global.len()
            && self.shape.len() == global.len()
            && (0..global.len()).all(|d| {
                self.offsets[d]
                    .checked_add(self.shape[d])
                    .is_some_and(|end| end <= global[d])
            })
    }

    /// This box's offsets relative to `origin` (which must not exceed them).
    pub fn relative_to(&self, origin: &[usize]) -> Vec<usize> {
        self.offsets
            .iter()
            .zip(origin)
            .map(|(o, base)| o - base)
            .collect()
    }
}

/// Row-major strides (in elements) of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut out = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1] * shape[d + 1];
    }
    out
}

/// If the sub-box at `offsets` of extent `sub` is one contiguous run of a row-major tensor of
/// `shape`, its first element's linear index.
pub fn contiguous_start(offsets: &[usize], sub: &[usize], shape: &[usize]) -> Option<usize> {
    let n = shape.len();
    // Leading dims of extent 1, then one partial dim, then full trailing dims.
    let mut d = 0;
    while d < n && sub[d] == 1 {
        d += 1;
    }
    // `d` is the first dim of extent > 1; everything after it must be whole.
    if (d + 1..n).any(|i| sub[i] != shape[i]) {
        return None;
    }
    let st = strides(shape);
    Some((0..n).map(|i| offsets[i] * st[i]).sum())
}

/// Copies the box of extent `extent` at `src_at` in the row-major `src` (shape `src_shape`) to
/// `dst_at` in `dst` (shape `dst_shape`); elements are `elem` bytes. Runs along the trailing
/// dimensions that are whole in both buffers are copied with one `memcpy` each. Callers
/// guarantee the boxes lie inside both buffers.
#[allow(clippy::too_many_arguments)]
pub fn copy_box(
    src: &[u8],
    src_shape: &[usize],
    src_at: &[usize],
    dst: &mut [u8],
    dst_shape: &[usize],
    dst_at: &[usize],
    extent: &[usize],
    elem: usize,
) {
    let n = extent.len();
    if n == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    if extent.contains(&0) {
        return;
    }
    // Merge trailing dims that are whole in both buffers into one run.
    let mut k = 1; // number of trailing dims in the run
    let mut run = extent[n - 1];
    while k < n && extent[n - k] == src_shape[n - k] && extent[n - k] == dst_shape[n - k] {
        run *= extent[n - k - 1];
        k += 1;
    }
    let outer = n - k;
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    let run_bytes = run * elem;
    let mut idx = vec![0usize; outer];
    loop {
        let mut s = 0;
        let mut t = 0;
        for d in 0..n {
            let i = if d < outer { idx[d] } else { 0 };
            s += (src_at[d] + i) * ss[d];
            t += (dst_at[d] + i) * ds[d];
        }
        let (s, t) = (s * elem, t * elem);
        dst[t..t + run_bytes].copy_from_slice(&src[s..s + run_bytes]);
        // Odometer over the outer dims.
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Calls `f(start_in_shape, start_in_extent, run)` for each contiguous run (in elements) of
/// the box of extent `extent` at `at` inside a row-major tensor of `shape`, in row-major order;
/// `start_in_extent` is the run's position in a dense buffer of shape `extent`.
pub fn for_each_run(
    at: &[usize],
    extent: &[usize],
    shape: &[usize],
    mut f: impl FnMut(usize, usize, usize),
) {
    let n = extent.len();
    if n == 0 {
        f(0, 0, 1);
        return;
    }
    if extent.contains(&0) {
        return;
    }
    let mut k = 1;
    let mut run = extent[n - 1];
    while k < n && extent[n - k] == shape[n - k] {
        run *= extent[n - k - 1];
        k += 1;
    }
    let outer = n - k;
    let st = strides(shape);
    let mut idx = vec![0usize; outer];
    let mut dense = 0;
    loop {
        let start: usize = (0..n)
            .map(|d| (at[d] + if d < outer { idx[d] } else { 0 }) * st[d])
            .sum();
        f(start, dense, run);
        dense += run;
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The boxes (at most `2·ndim − 1`) that make up the flat element range `[start, end)` of a
/// row-major tensor of `shape` (docs/checkpoints.md §Distributed checkpoint format: how a DistOpt
/// flat range is stored): partial leading rows, a full middle block, partial trailing rows,
/// recursively. The decomposition is [`moe_backend::optim::flat_range_boxes`], which the optimizer
/// uses for its state pieces.
pub fn flat_range_boxes(shape: &[usize], start: usize, end: usize) -> Vec<TensorBox> {
    moe_backend::optim::flat_range_boxes(shape, start, end)
        .into_iter()
        .map(|b| TensorBox::new(b.offsets, b.shape))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn intersect_and_within() {
        let a = TensorBox::new(vec![0, 2], vec![4, 4]);
        let b = TensorBox::new(vec![2, 0], vec![4, 3]);
        assert_eq!(
            a.intersect(&b),
            Some(TensorBox::new(vec![2, 2], vec![2, 1]))
        );
        assert_eq!(a.intersect(&TensorBox::new(vec![4, 0], vec![1, 9])), None);
        assert!(a.within(&[4, 6]) && !a.within(&[4, 5]) && !a.within(&[4]));
    }

    #[test]
    fn copy_box_matches_a_naive_copy() {
        let src_shape = [3, 4, 5];
        let src = iota(60);
        let mut dst = vec![0u8; 2 * 3 * 5];
        copy_box(
            &src,
            &src_shape,
            &[1, 1, 0],
            &mut dst,
            &[2, 3, 5],
            &[0, 0, 0],
            &[2, 3, 5],
            1,
        );
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..5 {
                    assert_eq!(
                        dst[(i * 3 + j) * 5 + k] as usize,
                        ((1 + i) * 4 + 1 + j) * 5 + k
                    );
                }
            }
        }
        // Two-byte elements, partial last dim, into the middle of a destination.
        let src = iota(2 * 3 * 4 * 2);
        let mut dst = vec![0u8; 3 * 4 * 2];
        copy_box(
            &src,
            &[2, 3, 4],
            &[1, 0, 1],
            &mut dst,
            &[1, 3, 4],
            &[0, 0, 2],
            &[1, 3, 2],
            2,
        );
        for j in 0..3 {
            for k in 0..2 {
                for b in 0..2 {
                    let s = ((3 + j) * 4 + 1 + k) * 2 + b;
                    assert_eq!(dst[(j * 4 + 2 + k) * 2 + b] as usize, s);
                }
            }
        }
    }

    #[test]
    fn runs_cover_the_box_in_order() {
        let mut runs = Vec::new();
        for_each_run(&[1, 0, 2], &[2, 4, 3], &[3, 4, 5], |s, d, r| {
            runs.push((s, d, r))
        });
        assert_eq!(runs.len(), 8);
        assert_eq!(runs[0], (22, 0, 3));
        assert_eq!(runs[7], (57, 21, 3));
        let mut runs = Vec::new();
        for_each_run(&[1, 0, 0], &[2, 4, 5], &[3, 4, 5], |s, d, r| {
            runs.push((s, d, r))
        });
        assert_eq!(runs, [(20, 0, 40)]);
    }

    #[test]
    fn contiguity() {
        assert_eq!(
            contiguous_start(&[1, 0, 0], &[1, 4, 5], &[3, 4, 5]),
            Some(20)
        );
        assert_eq!(
            contiguous_start(&[1, 2, 0], &[1, 2, 5], &[3, 4, 5]),
            Some(30)
        );
        assert_eq!(contiguous_start(&[0, 0, 1], &[3, 4, 2], &[3, 4, 5]), None);
        assert_eq!(contiguous_start(&[1, 0], &[2, 5], &[3, 5]), Some(5));
        assert_eq!(contiguous_start(&[], &[], &[]), Some(0));
        assert_eq!(
            contiguous_start(&[0, 1, 0], &[1, 2, 5], &[1, 4, 5]),
            Some(5)
        );
    }

    #[test]
    fn flat_ranges_tile_exactly() {
        let shape = [3, 4, 5];
        for start in 0..60 {
            for end in start..=60 {
                let boxes = flat_range_boxes(&shape, start, end);
                assert!(boxes.len() <= 5, "{start}..{end}: {boxes:?}");
                let mut covered = [0u8; 60];
                for b in &boxes {
                    assert!(b.within(&shape));
                    let st = strides(&shape);
                    for i in 0..b.shape[0] {
                        for j in 0..b.shape[1] {
                            for k in 0..b.shape[2] {
                                let o = &b.offsets;
                                covered[(o[0] + i) * st[0] + (o[1] + j) * st[1] + o[2] + k] += 1;
                            }
                        }
                    }
                }
                for (i, c) in covered.iter().enumerate() {
                    assert_eq!(*c, u8::from(i >= start && i < end), "{start}..{end} at {i}");
                }
            }
        }
        assert_eq!(flat_range_boxes(&[], 0, 1), vec![TensorBox::full(&[])]);
    }
}
