//! The AdamW step on the CPU backend (Flex), in place.
//!
//! Flex tensors live in host memory, so the step needs no transfers; what it must avoid is
//! copies. A step of a 230 M-parameter model moves the gradients, the master weights and both
//! moments (0.92 GB each in f32): reading them into host vectors and building tensors from the
//! results again copied each of them into freshly faulted pages (`TensorData::into_vec` of an
//! aligned buffer copies; BENCHMARKS.md: 1.1 s of optimizer against PyTorch's fused AdamW at
//! 0.3–0.4 s). Here:
//!
//! - the gradient shard is read where it lies: the parameters' own gradient tensors end to end
//!   when the class needs no collective ([`HostGrad::from_pieces`]), else the reduce-scatter's
//!   output, with no concatenation;
//! - the master weights and moments are updated in their own storage
//!   ([`FlexTensor::storage_mut`]); storage shared with another tensor (a parameter still
//!   viewing the master) is copied first (copy-on-write), so the result never depends on it,
//!   only the speed (see [`DistributedAdamW::step_in_place`](super::DistributedAdamW::step_in_place)).
//!
//! Both passes (the norm's sum of squares and the update) go over fixed chunks of
//! [`CHUNK`] elements of the shard in parallel, so the results do not depend on the thread
//! count or on where the pieces begin: the sum of squares accumulates each chunk in f64 in
//! element order and adds the chunks in order, the update is element-wise.

use std::ops::Range;

use burn::tensor::{DType, Tensor};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::distributed_adam::AdamwConstants;
use crate::error::{BackendError, Result};

/// Elements per parallel chunk of the norm and the update.
pub(super) const CHUNK: usize = 1 << 15;

/// One class's gradient shard on the CPU backend, read in place: contiguous f32 pieces laid
/// end to end (`(offset in the shard, tensor)`, sorted, gap-free).
pub(super) struct HostGrad {
    parts: Vec<(usize, FlexTensor)>,
    len: usize,
}

/// `t` as a Flex tensor (an error naming `what` on another backend).
fn flex(t: Tensor<1>, what: &str) -> Result<FlexTensor> {
    t.try_into_primitive::<Flex>()
        .map_err(|_| BackendError::Shape {
            op: "DistributedAdamW",
            detail: format!("{what} is not a CPU-backend (Flex) tensor"),
        })
}

/// The f32 values of a Flex tensor, contiguous (a copy only when they are not).
fn contiguous_f32(t: FlexTensor) -> FlexTensor {
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        let data = t.into_data().convert::<f32>();
        FlexTensor::from_data(data)
    };
    if t.layout().contiguous_offsets().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The values of a contiguous f32 Flex tensor (see [`contiguous_f32`]).
fn values(t: &FlexTensor) -> &[f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("made contiguous by `contiguous_f32`");
    &t.storage::<f32>()[start..end]
}

impl HostGrad {
    /// The shard as the 1-D f32 tensors `pieces`, in order.
    pub(super) fn from_pieces(pieces: Vec<Tensor<1>>) -> Result<Self> {
        let mut parts = Vec::with_capacity(pieces.len());
        let mut len = 0;
        for piece in pieces {
            let t = contiguous_f32(flex(piece, "a gradient")?);
            let n = values(&t).len();
            if n > 0 {
                parts.push((len, t));
                len += n;
            }
        }
        Ok(Self { parts, len })
    }

    /// Number of elements.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Calls `f` on the contiguous segments covering `range`, in order.
    fn segments(&self, range: Range<usize>, mut f: impl FnMut(&[f32])) {
        let first = self
            .parts
            .partition_point(|(o, t)| o + values(t).len() <= range.start);
        for (offset, t) in &self.parts[first..] {
            if *offset >= range.end {
                break;
            }
            let v = values(t);
            let a = range.start.saturating_sub(*offset);
            let b = (range.end - offset).min(v.len());
            f(&v[a..b]);
        }
    }

    /// `Σ g²` over `range` in f64: fixed chunks of [`CHUNK`] from `range.start` in
    /// parallel, each summed in [`LANES`] interleaved f64 accumulators (element `t` of the
    /// chunk into lane `t mod LANES`, in element order; the lanes then added in order), the
    /// chunks added in order. The order depends on neither the thread count nor the pieces.
    pub(super) fn sum_of_squares(&self, range: Range<usize>) -> f64 {
        let n = range.end.saturating_sub(range.start);
        let partial: Vec<f64> = (0..n.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let a = range.start + c * CHUNK;
                let b = (a + CHUNK).min(range.end);
                let mut lanes = [0f64; LANES];
                let mut at = 0;
                self.segments(a..b, |s| {
                    squares_into(&mut lanes, at, s);
                    at += s.len();
                });
                lanes.iter().sum::<f64>()
            })
            .collect();
        partial.iter().sum()
    }
}

/// Interleaved accumulators of [`HostGrad::sum_of_squares`] (one AVX-512 register of f64).
pub(super) const LANES: usize = 8;

/// Adds `x²` of `values` (chunk positions `at..`) into `lanes[position mod LANES]`.
fn squares_into(lanes: &mut [f64; LANES], at: usize, values: &[f32]) {
    let head = ((LANES - at % LANES) % LANES).min(values.len());
    for (t, &x) in values[..head].iter().enumerate() {
        lanes[(at + t) % LANES] += f64::from(x) * f64::from(x);
    }
    let rest = &values[head..];
    let body = rest.len() / LANES * LANES;
    simd::squares(lanes, &rest[..body]);
    for (t, &x) in rest[body..].iter().enumerate() {
        lanes[t] += f64::from(x) * f64::from(x);
    }
}

/// A 1-D tensor's storage taken out for an in-place update, given back by [`Self::finish`].
pub(super) struct InPlace {
    tensor: FlexTensor,
    store: DType,
}

impl InPlace {
    /// Takes `t` (left empty until [`Self::finish`]): f32 storage is updated where it lies
    /// (copied first only when shared or not contiguous); other storage (bf16 moments) is
    /// widened to a fresh f32 buffer and narrowed back at the end.
    pub(super) fn take(t: &mut Tensor<1>, what: &str) -> Result<Self> {
        let device = t.device();
        let taken = std::mem::replace(t, Tensor::zeros([0], (&device, DType::F32)));
        let store = taken.dtype();
        let tensor = contiguous_f32(flex(taken, what)?);
        Ok(Self { tensor, store })
    }

    /// The values, mutable (copy-on-write when shared).
    pub(super) fn values_mut(&mut self) -> &mut [f32] {
        let (start, end) = self
            .tensor
            .layout()
            .contiguous_offsets()
            .expect("made contiguous by `contiguous_f32`");
        &mut self.tensor.storage_mut::<f32>()[start..end]
    }

    /// The updated tensor, in its storage dtype.
    pub(super) fn finish(self) -> Tensor<1> {
        let t = Tensor::<1>::from_primitive::<Flex>(self.tensor);
        if self.store == DType::F32 {
            t
        } else {
            t.cast(self.store)
        }
    }
}

/// AdamW over a shard in place: `p`, `m`, `v` the master weights and moments, `g` the
/// gradient shard (same length), scaled by `clip` as `(g as f64 · clip) as f32`; `no_decay`
/// sorted shard ranges exempt from weight decay. Element by element the scalar rule of
/// `DistributedAdamW` (each operation rounded to f32), over chunks of [`CHUNK`] in parallel.
pub(super) fn adamw(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &HostGrad,
    clip: f64,
    k: &AdamwConstants,
    no_decay: &[Range<usize>],
) -> Result<()> {
    let n = p.len();
    if [m.len(), v.len(), g.len()] != [n; 3] {
        return Err(BackendError::Shape {
            op: "DistributedAdamW",
            detail: format!(
                "shard of {n}: gradient {}, moments {} / {}",
                g.len(),
                m.len(),
                v.len()
            ),
        });
    }
    (p.par_chunks_mut(CHUNK), m.par_chunks_mut(CHUNK))
        .into_par_iter()
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, ((p, m), v))| {
            let start = chunk * CHUNK;
            let end = start + p.len();
            // The first exempt range that may cover this chunk (ranges are sorted).
            let mut r = no_decay.partition_point(|range| range.end <= start);
            let mut i = start;
            g.segments(start..end, |gs| {
                let (seg_start, seg_end) = (i, i + gs.len());
                // Runs of one decay factor: up to the next exempt boundary.
                while i < seg_end {
                    while r < no_decay.len() && no_decay[r].end <= i {
                        r += 1;
                    }
                    let (exempt, run_end) = match no_decay.get(r) {
                        Some(e) if e.start <= i => (true, e.end.min(seg_end)),
                        Some(e) => (false, e.start.min(seg_end)),
                        None => (false, seg_end),
                    };
                    let decay = if exempt { 1.0 } else { k.decay };
                    let (a, b) = (i - start, run_end - start);
                    let gi = &gs[i - seg_start..run_end - seg_start];
                    simd::adamw(&mut p[a..b], &mut m[a..b], &mut v[a..b], gi, clip, k, decay);
                    i = run_end;
                }
            });
        });
    Ok(())
}

/// The element-wise kernels, compiled for AVX-512 or AVX2 when the CPU has them (runtime
/// detection; the crate is built for baseline x86-64). Plain loops without reassociation or
/// fused multiply-adds, so every build gives the same bits: IEEE `+ − × ÷ √` and the
/// f32 ↔ f64 conversions are exact or correctly rounded in every instruction set.
mod simd {
    use super::{AdamwConstants, LANES};

    /// Defines `pub(super) fn $name` with `$body` compiled three times: for AVX-512F, for AVX2
    /// and for the baseline, picked at run time by the CPU's features (the body is an
    /// `#[inline(always)]` function, so each feature-enabled wrapper holds its own copy).
    macro_rules! dispatched {
        ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            pub(super) fn $name($($arg: $ty),*) {
                #[inline(always)]
                #[allow(clippy::too_many_arguments)]
                fn plain($($arg: $ty),*) $body
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "avx512f")]
                    #[allow(clippy::too_many_arguments)]
                    fn avx512($($arg: $ty),*) {
                        plain($($arg),*)
                    }
                    #[target_feature(enable = "avx2")]
                    #[allow(clippy::too_many_arguments)]
                    fn avx2($($arg: $ty),*) {
                        plain($($arg),*)
                    }
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        // SAFETY: the CPU has AVX-512F (checked above).
                        return unsafe { avx512($($arg),*) };
                    }
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU has AVX2 (checked above).
                        return unsafe { avx2($($arg),*) };
                    }
                }
                plain($($arg),*)
            }
        };
    }

    dispatched!(
        /// `lanes[t mod LANES] += values[t]²` (in f64; `values.len()` a multiple of `LANES`).
        fn squares(lanes: &mut [f64; LANES], values: &[f32]) {
            for block in values.chunks_exact(LANES) {
                for (l, &x) in lanes.iter_mut().zip(block) {
                    *l += f64::from(x) * f64::from(x);
                }
            }
        }
    );

    dispatched!(
        /// The AdamW rule over equal-length slices with one weight-decay factor.
        fn adamw(
            p: &mut [f32],
            m: &mut [f32],
            v: &mut [f32],
            g: &[f32],
            clip: f64,
            k: &AdamwConstants,
            decay: f32,
        ) {
            let n = p.len();
            let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
            let scaled = clip != 1.0;
            for i in 0..n {
                let gi = if scaled {
                    (f64::from(g[i]) * clip) as f32
                } else {
                    g[i]
                };
                let mi = m[i] * k.beta_1 + gi * (1.0 - k.beta_1);
                let vi = v[i] * k.beta_2 + gi * gi * (1.0 - k.beta_2);
                m[i] = mi;
                v[i] = vi;
                let m_hat = mi / k.bc1;
                let v_hat = vi / k.bc2;
                p[i] = p[i] * decay - (m_hat / (v_hat.sqrt() + k.epsilon)) * k.lr;
            }
        }
    );
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::testing::SplitMix;

    fn tensor(v: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Device::flex())
    }

    /// Pieces of any sizes (empty, smaller and larger than a chunk, a strided one) give the
    /// sum of squares of the concatenated buffer, bit for bit (the same fixed chunks, each
    /// summed in element order), over the whole shard and over sub-ranges.
    #[test]
    fn pieces_sum_like_the_flat_buffer() {
        let mut rng = SplitMix::new(3);
        let sizes = [5, 0, CHUNK + 7, 3, 2 * CHUNK - 1, 1, 40];
        let values: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&n| (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect())
            .collect();
        let flat: Vec<f32> = values.concat();
        let mut pieces: Vec<Tensor<1>> = values.iter().map(|v| tensor(v)).collect();
        // One piece as a non-contiguous view (every second element of a doubled buffer).
        let doubled: Vec<f32> = values[6].iter().flat_map(|&x| [x, 99.0]).collect();
        pieces[6] = Tensor::<2>::from_data(
            TensorData::new(doubled, [values[6].len(), 2]),
            &Device::flex(),
        )
        .narrow(1, 0, 1)
        .reshape([values[6].len()]);
        let grad = HostGrad::from_pieces(pieces).unwrap();
        assert_eq!(grad.len(), flat.len());
        let whole = HostGrad::from_pieces(vec![tensor(&flat)]).unwrap();
        for range in [0..flat.len(), 3..CHUNK + 20, CHUNK..flat.len() - 2, 7..7] {
            // Written from the documented order: per chunk, element t into lane t mod LANES.
            let reference: f64 = flat[range.clone()]
                .chunks(CHUNK)
                .map(|c| {
                    let mut lanes = [0f64; LANES];
                    for (t, &x) in c.iter().enumerate() {
                        lanes[t % LANES] += f64::from(x) * f64::from(x);
                    }
                    lanes.iter().sum::<f64>()
                })
                .sum();
            assert_eq!(grad.sum_of_squares(range.clone()), reference, "{range:?}");
            assert_eq!(whole.sum_of_squares(range.clone()), reference, "{range:?}");
        }
    }

    /// The update writes the taken tensor's own storage: no copy when it is not shared, a
    /// copy (leaving the sharer untouched) when it is.
    #[test]
    fn in_place_updates_storage_unless_shared() {
        let mut master = tensor(&[1.0; 8]);
        let ptr = |t: &Tensor<1>| {
            t.clone()
                .try_into_primitive::<Flex>()
                .unwrap()
                .bytes()
                .as_ptr() as usize
        };
        let before = ptr(&master);
        let mut taken = InPlace::take(&mut master, "master").unwrap();
        taken.values_mut()[0] = 2.0;
        let master = taken.finish();
        assert_eq!(ptr(&master), before, "unshared storage was copied");

        let mut shared = master.clone();
        let view = master.clone().slice(0..4);
        let mut taken = InPlace::take(&mut shared, "master").unwrap();
        taken.values_mut()[1] = 5.0;
        let shared = taken.finish();
        assert_ne!(ptr(&shared), ptr(&view));
        assert_eq!(
            view.to_data().try_to_vec::<f32>().unwrap(),
            vec![2.0, 1.0, 1.0, 1.0]
        );
        assert_eq!(
            shared.to_data().try_to_vec::<f32>().unwrap()[..2],
            [2.0, 5.0]
        );
    }
}
