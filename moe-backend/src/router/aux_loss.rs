//! Load-balancing losses and z-loss
//! (docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
//!
//! The losses are computed from inputs kept apart from the routing decision: `P [T, E]`
//! ([`aux_loss_scores`](super::scoring::aux_loss_scores)) and its plain top-`k` mask `M`
//! (no expert bias, no group limit, no dropping). Counts are host `f64` vectors so that
//! distributed code can sum them over a process group through a [`CountReducer`].

use burn::tensor::{Bool, DType, Device, Tensor, TensorData, bf16, f16};

use super::config::AuxLossType;
use super::scoring::logsumexp_rows;
use crate::error::{BackendError, Result};
use crate::ops::int_tensor_to_usize;

/// Host f64 `values` as a tensor of the float dtype `dtype` on `device`, each value rounded
/// once on the host exactly as Flex casts f64 (`as f32`, `f16::from_f64`, `bf16::from_f64`), so
/// the device never needs f64 support (WGSL has none).
fn host_f64_as<const D: usize>(
    values: Vec<f64>,
    shape: [usize; D],
    device: &Device,
    dtype: DType,
) -> Tensor<D> {
    let data = match dtype {
        DType::F64 => TensorData::new(values, shape),
        DType::F16 => TensorData::new(
            values.into_iter().map(f16::from_f64).collect::<Vec<_>>(),
            shape,
        ),
        DType::BF16 => TensorData::new(
            values.into_iter().map(bf16::from_f64).collect::<Vec<_>>(),
            shape,
        ),
        _ => TensorData::new(
            values.into_iter().map(|v| v as f32).collect::<Vec<_>>(),
            shape,
        ),
    };
    Tensor::from_data(data, (device, dtype))
}

/// Process group over which per-expert counts are summed (the table of
/// docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountGroup {
    /// `tp_cp`: counts of `aux_loss` and `seq_aux_loss`.
    TpCp,
    /// `tp_dp_cp`: counts of `global_aux_loss`.
    TpDpCp,
}

/// Sums per-expert counts over a process group (an all-reduce in distributed code). Needed
/// whenever the matching group size of the router configuration is larger than 1.
pub trait CountReducer {
    /// Replaces `counts` by their element-wise sum over all ranks of `group`.
    fn all_reduce_sum(&self, group: CountGroup, counts: &mut [f64]) -> Result<()>;
}

/// Names of the losses a router reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterLossKind {
    /// `aux_loss`.
    Aux,
    /// `seq_aux_loss`.
    SeqAux,
    /// `global_aux_loss`.
    GlobalAux,
    /// z-loss.
    Z,
}

impl RouterLossKind {
    /// Megatron's logging name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Aux => "load_balancing_loss",
            Self::SeqAux => "seq_load_balancing_loss",
            Self::GlobalAux => "global_load_balancing_loss",
            Self::Z => "z_loss",
        }
    }
}

impl From<AuxLossType> for RouterLossKind {
    fn from(kind: AuxLossType) -> Self {
        match kind {
            AuxLossType::Aux => Self::Aux,
            AuxLossType::SeqAux => Self::SeqAux,
            AuxLossType::GlobalAux => Self::GlobalAux,
        }
    }
}

/// One loss computed by a router forward, for logging.
#[derive(Clone, Debug)]
pub struct RouterLoss {
    /// Which loss.
    pub kind: RouterLossKind,
    /// Its coefficient.
    pub coeff: f64,
    /// `[1]` this rank's value, coefficient included, detached (before the per-token-loss
    /// pre-multiplication). The logical loss is the sum over the loss's reduction group.
    pub loss: Tensor<1>,
}

impl RouterLoss {
    /// The loss value on the host.
    pub fn value(&self) -> Result<f64> {
        scalar_f64(self.loss.clone())
    }
}

/// Reads a one-element float tensor as `f64`.
pub(crate) fn scalar_f64(t: Tensor<1>) -> Result<f64> {
    t.into_data()
        .try_into_vec_as::<f64>()
        .ok()
        .and_then(|v| v.first().copied())
        .ok_or_else(|| BackendError::Shape {
            op: "router loss",
            detail: "cannot read the loss value".into(),
        })
}

/// Column sums of a bool map as `f64` counts (`[R, C] -> C` values).
pub fn column_counts(map: Tensor<2, Bool>) -> Vec<f64> {
    let [_, c] = map.dims();
    int_tensor_to_usize(map.int().sum_dim(0).reshape([c]))
        .into_iter()
        .map(|v| v as f64)
        .collect()
}

/// Core switch loss (docs/routing-and-dispatch.md §Load-balancing losses and z-loss):
/// `coeff · E/(k·T²) · Σ_c (Σ_r P_rc) · counts_c`.
///
/// `probs [R, C]` are this rank's aux-loss scores (`C = E`, or `B·E` for the per-sequence
/// form), `counts [C]` the (possibly reduced) counts and `total_tokens` the `T` of the formula.
/// Returns `[1]` in the dtype of `probs`, differentiable through `probs`; zero when
/// `total_tokens ≤ 0` (every row padded).
pub fn switch_loss(
    probs: Tensor<2>,
    counts: &[f64],
    total_tokens: f64,
    num_experts: usize,
    topk: usize,
    coeff: f64,
) -> Result<Tensor<1>> {
    let [_, c] = probs.dims();
    if counts.len() != c {
        return Err(BackendError::Shape {
            op: "switch_loss",
            detail: format!("{} counts for {c} probability columns", counts.len()),
        });
    }
    let counts = host_f64_as(counts.to_vec(), [c], &probs.device(), probs.dtype());
    let per_expert = probs.sum_dim(0).reshape([c]);
    let dot = (per_expert * counts).sum();
    if total_tokens <= 0.0 {
        return Ok(dot.mul_scalar(0.0));
    }
    let scale = num_experts as f64 * coeff / (topk as f64 * total_tokens * total_tokens);
    Ok(dot.mul_scalar(scale))
}

/// z-loss (docs/routing-and-dispatch.md §Load-balancing losses and z-loss):
/// `coeff · Σ_valid logsumexp(logits_t)² / max(n_valid, 1)` — the mean of the squares over the
/// valid rows. `valid_rows [T, 1]` marks the non-padded rows (all rows when `None`). The caller
/// divides `coeff` by `|tp_cp|`. Returns `[1]`.
pub fn z_loss(
    logits: Tensor<2>,
    valid_rows: Option<Tensor<2, Bool>>,
    num_valid: usize,
    coeff: f64,
) -> Tensor<1> {
    let squares = logsumexp_rows(logits).square();
    let squares = match valid_rows {
        Some(valid) => squares.mask_fill(valid.bool_not(), 0.0),
        None => squares,
    };
    squares
        .sum()
        .div_scalar(num_valid.max(1) as f64)
        .mul_scalar(coeff)
}

/// Aux-loss inputs of one forward.
#[derive(Clone, Debug)]
pub struct AuxInputs {
    /// `[T, E]` aux-loss scores `P`, zero on padded rows.
    pub scores: Tensor<2>,
    /// `[T, E]` plain top-`k` mask `M` of `P`, false on padded rows.
    pub topk_map: Tensor<2, Bool>,
    /// Number of valid (non-padded) rows.
    pub num_valid: usize,
}

/// Everything [`load_balancing_loss`] needs besides the inputs.
#[derive(Clone, Copy)]
pub struct LossContext<'a> {
    /// `E`.
    pub num_experts: usize,
    /// `k`.
    pub topk: usize,
    /// `|tp_cp|`.
    pub tp_cp_size: usize,
    /// `|tp_dp_cp|`.
    pub tp_dp_cp_size: usize,
    /// Sequences `B` of the micro-batch (rows are `t = s·B + b` unless
    /// [`row_sequences`](Self::row_sequences) says otherwise).
    pub batch_size: usize,
    /// The sequence (`0..B`) of each row, for row orders other than Megatron's `[S, B]`
    /// (e.g. a sequence-parallel slice of batch-major rows).
    pub row_sequences: Option<&'a [usize]>,
    /// Count reducer (required when a group size is > 1).
    pub reducer: Option<&'a dyn CountReducer>,
    /// A padding mask was given (on every rank of the loss's group): the ranks may hold
    /// different numbers of valid rows, so the token total `T` is taken from the reduced
    /// counts (`Σ counts / k`: every valid row selects `k` experts in `M`) instead of
    /// `num_valid × group size`. Equal to it when every rank holds `num_valid` valid rows.
    pub padded: bool,
}

impl LossContext<'_> {
    /// The token total `T` of the switch loss: `num_valid × group_size`, or with
    /// [`padded`](Self::padded) the reduced `counts` over `k`.
    fn total_tokens(&self, counts: &[f64], num_valid: usize, group_size: usize) -> f64 {
        if self.padded {
            counts.iter().sum::<f64>() / self.topk as f64
        } else {
            num_valid as f64 * group_size as f64
        }
    }

    fn reduce(&self, group: CountGroup, counts: &mut [f64]) -> Result<()> {
        let (size, field) = match group {
            CountGroup::TpCp => (self.tp_cp_size, "tp_cp_size"),
            CountGroup::TpDpCp => (self.tp_dp_cp_size, "tp_dp_cp_size"),
        };
        match self.reducer {
            Some(r) => r.all_reduce_sum(group, counts),
            None if size == 1 => Ok(()),
            None => Err(BackendError::Config {
                field,
                detail: format!("group size {size} > 1 needs RouteOptions::count_reducer"),
            }),
        }
    }
}

/// Running counts of `global_aux_loss` over the micro-batches of a global batch.
#[derive(Clone, Copy, Debug)]
pub struct GlobalCounts<'a> {
    /// `G`, the sum of the reduced counts of the previous micro-batches.
    pub tokens_per_expert: &'a [f64],
    /// `n`, the number of previous micro-batches.
    pub steps: usize,
}

/// Computes one load-balancing loss (the table of
/// docs/routing-and-dispatch.md §Load-balancing losses and z-loss), coefficient included.
///
/// Returns the loss and, for [`AuxLossType::GlobalAux`], this micro-batch's reduced counts
/// `c_mb` (to be added to the running counts once the forward is committed).
pub fn load_balancing_loss(
    kind: AuxLossType,
    coeff: f64,
    inputs: &AuxInputs,
    ctx: &LossContext<'_>,
    global: GlobalCounts<'_>,
) -> Result<(Tensor<1>, Option<Vec<f64>>)> {
    let (e, k) = (ctx.num_experts, ctx.topk);
    match kind {
        AuxLossType::Aux => {
            let mut counts = column_counts(inputs.topk_map.clone());
            ctx.reduce(CountGroup::TpCp, &mut counts)?;
            let total = ctx.total_tokens(&counts, inputs.num_valid, ctx.tp_cp_size);
            Ok((
                switch_loss(inputs.scores.clone(), &counts, total, e, k, coeff)?,
                None,
            ))
        }
        AuxLossType::SeqAux => {
            let b = ctx.batch_size;
            let [t, _] = inputs.scores.dims();
            if let Some(rows) = ctx.row_sequences {
                return seq_aux_by_rows(inputs, ctx, rows, coeff).map(|loss| (loss, None));
            }
            if b == 0 || !t.is_multiple_of(b) {
                return Err(BackendError::Shape {
                    op: "seq_aux_loss",
                    detail: format!("{t} rows do not split into batch_size = {b} sequences"),
                });
            }
            let s = t / b;
            // Row t = s·B + b ⇒ column b·E + e of the [S, B·E] view is sequence b, expert e.
            let scores = inputs.scores.clone().reshape([s, b * e]);
            let mut counts = column_counts(inputs.topk_map.clone().reshape([s, b * e]));
            ctx.reduce(CountGroup::TpCp, &mut counts)?;
            // Megatron: valid tokens per sequence = Σ counts / (k·B) (= S without padding).
            let total = ctx.total_tokens(&counts, inputs.num_valid, ctx.tp_cp_size) / b as f64;
            let loss = switch_loss(scores, &counts, total, e, k, coeff)?;
            Ok((loss.div_scalar(b as f64), None))
        }
        AuxLossType::GlobalAux => {
            let mut counts = column_counts(inputs.topk_map.clone());
            ctx.reduce(CountGroup::TpDpCp, &mut counts)?;
            if global.tokens_per_expert.len() != counts.len() {
                return Err(BackendError::Shape {
                    op: "global_aux_loss",
                    detail: format!(
                        "running counts have {} experts, expected {}",
                        global.tokens_per_expert.len(),
                        counts.len()
                    ),
                });
            }
            let steps = (global.steps + 1) as f64;
            let averaged: Vec<f64> = global
                .tokens_per_expert
                .iter()
                .zip(&counts)
                .map(|(g, c)| (g + c) / steps)
                .collect();
            let total = ctx.total_tokens(&counts, inputs.num_valid, ctx.tp_dp_cp_size);
            let loss = switch_loss(inputs.scores.clone(), &averaged, total, e, k, coeff)?;
            Ok((loss, Some(counts)))
        }
    }
}

/// `seq_aux_loss` on rows in any order: `rows[r]` is the sequence (`0..B`) of row `r`. Each
/// sequence's `[E]` counts are summed over `tp_cp` (whose ranks hold other rows of the same
/// sequences), and `Σ_q Σ_e (Σ_{r∈q} P_re)·c_qe / (E·…)` is formed as `Σ_r Σ_e P_re·c_{q(r)e}`.
fn seq_aux_by_rows(
    inputs: &AuxInputs,
    ctx: &LossContext<'_>,
    rows: &[usize],
    coeff: f64,
) -> Result<Tensor<1>> {
    let (b, e, k) = (ctx.batch_size, ctx.num_experts, ctx.topk);
    let [t, _] = inputs.scores.dims();
    if rows.len() != t || rows.iter().any(|&q| q >= b) {
        return Err(BackendError::Shape {
            op: "seq_aux_loss",
            detail: format!(
                "{} row sequences for {t} rows (each must be < batch_size = {b})",
                rows.len()
            ),
        });
    }
    let map = inputs
        .topk_map
        .clone()
        .into_data()
        .try_into_vec::<bool>()
        .map_err(|err| BackendError::Shape {
            op: "seq_aux_loss",
            detail: format!("top-k map: {err:?}"),
        })?;
    let mut counts = vec![0.0f64; b * e];
    for (row, &q) in map.chunks_exact(e).zip(rows) {
        for (c, &hit) in counts[q * e..(q + 1) * e].iter_mut().zip(row) {
            *c += f64::from(u8::from(hit));
        }
    }
    ctx.reduce(CountGroup::TpCp, &mut counts)?;
    let per_row: Vec<f64> = rows
        .iter()
        .flat_map(|&q| counts[q * e..(q + 1) * e].iter().copied())
        .collect();
    let per_row = host_f64_as(
        per_row,
        [t, e],
        &inputs.scores.device(),
        inputs.scores.dtype(),
    );
    let dot = (inputs.scores.clone() * per_row).sum();
    // Megatron: valid tokens per sequence = Σ counts / (k·B) (= S without padding).
    let total = ctx.total_tokens(&counts, inputs.num_valid, ctx.tp_cp_size) / b as f64;
    if total <= 0.0 {
        return Ok(dot.mul_scalar(0.0));
    }
    Ok(dot.mul_scalar(e as f64 * coeff / (k as f64 * total * total * b as f64)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::testing::{f64_tensor, host_f64, lcg_values};
    use burn::tensor::Device;

    /// Naive switch loss over host rows.
    fn ref_switch(p: &[f64], cols: usize, counts: &[f64], t: f64, e: usize, k: usize) -> f64 {
        let dot: f64 = (0..cols)
            .map(|c| p.iter().skip(c).step_by(cols).sum::<f64>() * counts[c])
            .sum();
        dot * e as f64 / (k as f64 * t * t)
    }

    #[test]
    fn router_switch_loss_matches_hand_computed_value() {
        let device = Device::flex();
        // P = [[0.5, 0.5], [0.25, 0.75]], c = [1, 3], T = 2, E = 2, k = 2:
        // Σ_e P_e c_e = 0.75·1 + 1.25·3 = 4.5; · E/(k·T²) = 2/8 ⇒ 1.125.
        let p = f64_tensor(&[0.5, 0.5, 0.25, 0.75], [2, 2], &device);
        let loss = switch_loss(p, &[1.0, 3.0], 2.0, 2, 2, 1.0).unwrap();
        assert_eq!(host_f64(loss.reshape([1]))[0], 1.125);
        let p = f64_tensor(&[0.5, 0.5], [1, 2], &device);
        assert!(switch_loss(p.clone(), &[1.0], 1.0, 2, 1, 1.0).is_err());
        assert_eq!(
            host_f64(switch_loss(p, &[1.0, 1.0], 0.0, 2, 1, 1.0).unwrap())[0],
            0.0
        );
    }

    #[test]
    fn router_seq_aux_is_mean_of_per_sequence_aux() {
        let device = Device::flex();
        let (s, b, e, k) = (5, 3, 4, 2);
        let t = s * b;
        let p_host = lcg_values(t * e, 3);
        let map_host: Vec<bool> = (0..t * e)
            .map(|i| (i * 7 + i / e).is_multiple_of(3))
            .collect();
        let inputs = AuxInputs {
            scores: f64_tensor(&p_host, [t, e], &device),
            topk_map: Tensor::<2, Bool>::from_data(
                TensorData::new(map_host.clone(), [t, e]),
                &device,
            ),
            num_valid: t,
        };
        let ctx = LossContext {
            num_experts: e,
            topk: k,
            tp_cp_size: 1,
            tp_dp_cp_size: 1,
            batch_size: b,
            row_sequences: None,
            reducer: None,
            padded: false,
        };
        let global = GlobalCounts {
            tokens_per_expert: &[0.0; 4],
            steps: 0,
        };
        let (loss, _) =
            load_balancing_loss(AuxLossType::SeqAux, 0.5, &inputs, &ctx, global).unwrap();
        let mut want = 0.0;
        for seq in 0..b {
            let rows: Vec<usize> = (0..s).map(|si| si * b + seq).collect();
            let p: Vec<f64> = rows
                .iter()
                .flat_map(|&r| p_host[r * e..(r + 1) * e].to_vec())
                .collect();
            let counts: Vec<f64> = (0..e)
                .map(|c| rows.iter().filter(|&&r| map_host[r * e + c]).count() as f64)
                .collect();
            want += 0.5 * ref_switch(&p, e, &counts, s as f64, e, k);
        }
        want /= b as f64;
        let got = host_f64(loss)[0];
        assert!((got - want).abs() < 1e-14, "{got} vs {want}");
    }

    /// Adds fixed counts (another rank's) to the reduced ones.
    struct AddCounts(Vec<f64>);
    impl CountReducer for AddCounts {
        fn all_reduce_sum(&self, _: CountGroup, counts: &mut [f64]) -> Result<()> {
            counts.iter_mut().zip(&self.0).for_each(|(c, o)| *c += o);
            Ok(())
        }
    }

    /// Batch-major rows (`t = b·S + s`) cut into two sequence-parallel halves: each half's
    /// loss with `row_sequences` and counts summed over both halves adds up to the loss of all
    /// rows in Megatron's `[S, B]` order.
    #[test]
    fn router_seq_aux_with_row_sequences_splits_over_ranks() {
        let device = Device::flex();
        let (s, b, e, k) = (6, 3, 4, 2);
        let t = s * b;
        // Host data in batch-major order.
        let p_bm = lcg_values(t * e, 11);
        let map_bm: Vec<bool> = (0..t * e)
            .map(|i| (i * 5 + i / e).is_multiple_of(3))
            .collect();
        let seq_bm: Vec<usize> = (0..t).map(|r| r / s).collect();
        // The same rows in [S, B] order for the reference.
        let to_sb = |v: &[f64]| -> Vec<f64> {
            (0..t)
                .flat_map(|r| {
                    let (si, q) = (r / b, r % b);
                    v[(q * s + si) * e..(q * s + si + 1) * e].to_vec()
                })
                .collect()
        };
        let map_sb: Vec<bool> = (0..t)
            .flat_map(|r| {
                let (si, q) = (r / b, r % b);
                map_bm[(q * s + si) * e..(q * s + si + 1) * e].to_vec()
            })
            .collect();
        let inputs = |p: Vec<f64>, m: Vec<bool>| {
            let rows = p.len() / e;
            AuxInputs {
                scores: f64_tensor(&p, [rows, e], &device),
                topk_map: Tensor::<2, Bool>::from_data(TensorData::new(m, [rows, e]), &device),
                num_valid: rows,
            }
        };
        let global = GlobalCounts {
            tokens_per_expert: &[0.0; 4],
            steps: 0,
        };
        let ctx = |tp: usize, rows: Option<&'static [usize]>, r: Option<&'static AddCounts>| {
            LossContext {
                num_experts: e,
                topk: k,
                tp_cp_size: tp,
                tp_dp_cp_size: tp,
                batch_size: b,
                row_sequences: rows,
                reducer: r.map(|r| r as &dyn CountReducer),
                padded: false,
            }
        };
        let full = inputs(to_sb(&p_bm), map_sb);
        let (want, _) =
            load_balancing_loss(AuxLossType::SeqAux, 0.3, &full, &ctx(1, None, None), global)
                .unwrap();
        let half = t / 2;
        let counts_of = |rows: std::ops::Range<usize>| {
            let mut c = vec![0.0; b * e];
            for r in rows {
                for x in 0..e {
                    if map_bm[r * e + x] {
                        c[seq_bm[r] * e + x] += 1.0;
                    }
                }
            }
            c
        };
        let mut got = 0.0;
        for (mine, other) in [(0..half, half..t), (half..t, 0..half)] {
            let rows: &'static [usize] = seq_bm[mine.clone()].to_vec().leak();
            let add: &'static AddCounts = Box::leak(Box::new(AddCounts(counts_of(other))));
            let part = inputs(
                p_bm[mine.start * e..mine.end * e].to_vec(),
                map_bm[mine.start * e..mine.end * e].to_vec(),
            );
            let (loss, _) = load_balancing_loss(
                AuxLossType::SeqAux,
                0.3,
                &part,
                &ctx(2, Some(rows), Some(add)),
                global,
            )
            .unwrap();
            got += host_f64(loss)[0];
        }
        let want = host_f64(want)[0];
        assert!((got - want).abs() < 1e-13 * want.abs(), "{got} vs {want}");
        // A row sequence out of range is a shape error, not a panic.
        let bad: &'static [usize] = vec![b; t].leak();
        let err = load_balancing_loss(
            AuxLossType::SeqAux,
            0.3,
            &full,
            &ctx(1, Some(bad), None),
            global,
        );
        assert!(matches!(
            err,
            Err(BackendError::Shape {
                op: "seq_aux_loss",
                ..
            })
        ));
    }

    struct Doubling;
    impl CountReducer for Doubling {
        fn all_reduce_sum(&self, _: CountGroup, counts: &mut [f64]) -> Result<()> {
            counts.iter_mut().for_each(|c| *c *= 2.0);
            Ok(())
        }
    }

    #[test]
    fn router_group_sizes_need_a_reducer_and_scale_the_token_count() {
        let device = Device::flex();
        let inputs = AuxInputs {
            scores: f64_tensor(&[0.25; 8], [2, 4], &device),
            topk_map: Tensor::<2, Bool>::from_data(
                TensorData::new(
                    vec![true, false, false, false, false, true, false, false],
                    [2, 4],
                ),
                &device,
            ),
            num_valid: 2,
        };
        let mut ctx = LossContext {
            num_experts: 4,
            topk: 1,
            tp_cp_size: 2,
            tp_dp_cp_size: 2,
            batch_size: 1,
            row_sequences: None,
            reducer: None,
            padded: false,
        };
        let global = GlobalCounts {
            tokens_per_expert: &[0.0; 4],
            steps: 0,
        };
        let err = load_balancing_loss(AuxLossType::Aux, 1.0, &inputs, &ctx, global).unwrap_err();
        assert!(matches!(
            err,
            BackendError::Config {
                field: "tp_cp_size",
                ..
            }
        ));
        // Two ranks with identical uniform rows: this rank's partial is half the logical loss 1.
        ctx.reducer = Some(&Doubling);
        let (loss, _) = load_balancing_loss(AuxLossType::Aux, 1.0, &inputs, &ctx, global).unwrap();
        assert_eq!(host_f64(loss)[0], 0.5);
    }
}
