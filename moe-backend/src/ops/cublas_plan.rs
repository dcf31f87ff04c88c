//! Host planning of the cuBLAS grouped-GEMM candidate (docs/gpu.md §Cube kernels): the
//! row-major grouped ops of [`MoeOps`](super::MoeOps) as a list of column-major cuBLAS GEMMs.
//!
//! cuBLAS is column-major: `C[m×n] = op(A)[m×k] · op(B)[k×n]` with `A`, `B`, `C` addressed as
//! `X(i, j) = X[i + j·ld]`. A row-major `R [r, c]` with row stride `ld` is the same memory as
//! the column-major `Rᵀ [c, r]` with the same `ld`, so a row-major `C = A·B` is issued as the
//! column-major `Cᵀ = Bᵀ·Aᵀ` — the operands swap places and no data moves. Per group `g` with
//! rows `s_g .. s_g + n_g` (empty groups are skipped):
//!
//! | op (row-major) | cuBLAS `A` | `transa`, `lda` | cuBLAS `B` | `transb`, `ldb` | `m, n, k` | `C`, `ldc` |
//! |---|---|---|---|---|---|---|
//! | `Y_g = X_g · W_gᵀ`, `W [G, M, K]` | `W + g·M·K` | `T`, `K` | `X + s_g·K` | `N`, `K` | `M, n_g, K` | `Y + s_g·M`, `M` |
//! | `Y_g = X_g · W_g`, `W [G, K, M]` | `W + g·K·M` | `N`, `M` | `X + s_g·K` | `N`, `K` | `M, n_g, K` | `Y + s_g·M`, `M` |
//! | `D_g = L_gᵀ · R_g`, `L [N, P]`, `R [N, Q]` | `R + s_g·Q` | `N`, `Q` | `L + s_g·P` | `T`, `P` | `Q, P, n_g` | `D + g·P·Q`, `Q` |
//!
//! Fprop is the first row, dgrad the second (`dX_g = dY_g · W_g` with the fprop weights read as
//! `[G, K', M']`), wgrad the third. In every plan `A` is the op's second operand (the weights,
//! `rhs`) and `B` its first (`x`, `lhs`). The weight gradient of an empty group is zero, as
//! the Cube kernels write it: the plan lists those output ranges ([`Plan::zero`]).
//!
//! [`Plan::check`] proves every call legal for cuBLAS (its documented `ld` minimums, `int`
//! ranges) and every call's footprint inside its buffer, with disjoint outputs; the tests run the
//! calls through a host interpreter of cuBLAS's semantics against row-major references.
//! [`GroupedArgs`] packs a plan into the arrays of `cublasGemmGroupedBatchedEx` (problems with
//! identical shapes share one cuBLAS group). The CUDA calls themselves are in
//! `ops/cube/gemm_cublas.rs`.

use std::ops::Range;

use crate::error::{BackendError, Result};

/// `op(X)` of a cuBLAS call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Trans {
    /// `op(X) = X` (`CUBLAS_OP_N`).
    N,
    /// `op(X) = Xᵀ` (`CUBLAS_OP_T`).
    T,
}

/// One column-major cuBLAS GEMM, `C = op(A) · op(B)` (`alpha = 1`, `beta = 0`), with element
/// offsets into the three buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GemmCall {
    /// The group (expert) this call computes.
    pub(crate) group: usize,
    /// `op(A)`.
    pub(crate) transa: Trans,
    /// `op(B)`.
    pub(crate) transb: Trans,
    /// Rows of `op(A)` and `C`.
    pub(crate) m: usize,
    /// Columns of `op(B)` and `C`.
    pub(crate) n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub(crate) k: usize,
    /// Element offset of `A` in the `A` buffer.
    pub(crate) a: usize,
    /// Leading dimension of `A`.
    pub(crate) lda: usize,
    /// Element offset of `B` in the `B` buffer.
    pub(crate) b: usize,
    /// Leading dimension of `B`.
    pub(crate) ldb: usize,
    /// Element offset of `C` in the output.
    pub(crate) c: usize,
    /// Leading dimension of `C`.
    pub(crate) ldc: usize,
}

/// Column-major footprint: `(rows, cols)` of a stored operand and the span of elements it
/// touches from its offset (`(cols − 1)·ld + rows`).
fn footprint(rows: usize, cols: usize, ld: usize) -> usize {
    (cols - 1) * ld + rows
}

impl GemmCall {
    /// `(rows, cols)` of `A` as stored (column-major).
    fn a_stored(&self) -> (usize, usize) {
        match self.transa {
            Trans::N => (self.m, self.k),
            Trans::T => (self.k, self.m),
        }
    }

    /// `(rows, cols)` of `B` as stored (column-major).
    fn b_stored(&self) -> (usize, usize) {
        match self.transb {
            Trans::N => (self.k, self.n),
            Trans::T => (self.n, self.k),
        }
    }

    /// The output elements this call may write: `c .. c + (n − 1)·ldc + m`.
    fn c_span(&self) -> Range<usize> {
        self.c..self.c + footprint(self.m, self.n, self.ldc)
    }
}

/// A grouped op as planned cuBLAS calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The calls, in group order (empty groups have none).
    pub(crate) calls: Vec<GemmCall>,
    /// Output ranges no call writes that must read zero (the weight gradients of empty groups).
    pub(crate) zero: Vec<Range<usize>>,
    /// Elements of the `A` buffer (the op's second operand).
    pub(crate) a_len: usize,
    /// Elements of the `B` buffer (the op's first operand).
    pub(crate) b_len: usize,
    /// Elements of the output.
    pub(crate) c_len: usize,
}

/// The row-major shapes of a grouped op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GroupedShape {
    /// `moe_grouped_matmul`: `x [rows, k]`; `weights [G, m, k]` when `transpose_weights`
    /// (`Y_g = X_g · W_gᵀ`), else `[G, k, m]` (`Y_g = X_g · W_g`); output `[rows, m]`.
    Matmul {
        /// Rows of `x`.
        rows: usize,
        /// Columns of `x`.
        k: usize,
        /// Columns of the output.
        m: usize,
        /// Weights stored `[G, m, k]`.
        transpose_weights: bool,
    },
    /// `moe_grouped_matmul_wgrad`: `lhs [rows, p]`, `rhs [rows, q]`, output `[G, p, q]`.
    Wgrad {
        /// Rows of both operands.
        rows: usize,
        /// Columns of `lhs`.
        p: usize,
        /// Columns of `rhs`.
        q: usize,
    },
}

/// The largest `m`, `n`, `k` or leading dimension a cuBLAS `int` argument holds.
const INT_MAX: usize = i32::MAX as usize;

fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| BackendError::Shape {
        op,
        detail: format!("{a} × {b} elements overflow usize"),
    })
}

/// Plans `shape` with the row counts `sizes` (one per group): one call per non-empty group.
/// Errors: sizes that do not sum to the rows, sizes or dimensions past cuBLAS's `int` range.
pub(crate) fn plan(op: &'static str, shape: GroupedShape, sizes: &[usize]) -> Result<Plan> {
    let rows = match shape {
        GroupedShape::Matmul { rows, .. } | GroupedShape::Wgrad { rows, .. } => rows,
    };
    let mut sum = 0usize;
    for &s in sizes {
        sum = sum.checked_add(s).ok_or_else(|| BackendError::Shape {
            op,
            detail: "group sizes overflow usize".into(),
        })?;
    }
    if sum != rows {
        return Err(BackendError::SizeSum { op, sum, rows });
    }
    let g = sizes.len();
    let too_big = |what: &str, v: usize| BackendError::Shape {
        op,
        detail: format!("{what} {v} exceeds cuBLAS's int range ({INT_MAX})"),
    };
    let mut calls = Vec::with_capacity(g);
    let mut zero = Vec::new();
    let mut start = 0usize;
    let plan = match shape {
        GroupedShape::Matmul {
            rows,
            k,
            m,
            transpose_weights,
        } => {
            for (name, v) in [("K", k), ("M", m)] {
                if v > INT_MAX {
                    return Err(too_big(name, v));
                }
            }
            let per_group = mul(op, m, k)?;
            for (group, &n_g) in sizes.iter().enumerate() {
                if n_g > INT_MAX {
                    return Err(too_big("group size", n_g));
                }
                if n_g > 0 && m > 0 && k > 0 {
                    let (transa, lda) = if transpose_weights {
                        (Trans::T, k)
                    } else {
                        (Trans::N, m)
                    };
                    calls.push(GemmCall {
                        group,
                        transa,
                        transb: Trans::N,
                        m,
                        n: n_g,
                        k,
                        a: mul(op, group, per_group)?,
                        lda,
                        b: mul(op, start, k)?,
                        ldb: k,
                        c: mul(op, start, m)?,
                        ldc: m,
                    });
                }
                start += n_g;
            }
            // K = 0: every output element is an empty sum.
            if k == 0 && rows > 0 && m > 0 {
                zero.push(0..mul(op, rows, m)?);
            }
            Plan {
                calls,
                zero,
                a_len: mul(op, g, per_group)?,
                b_len: mul(op, rows, k)?,
                c_len: mul(op, rows, m)?,
            }
        }
        GroupedShape::Wgrad { rows, p, q } => {
            for (name, v) in [("P", p), ("Q", q)] {
                if v > INT_MAX {
                    return Err(too_big(name, v));
                }
            }
            let per_group = mul(op, p, q)?;
            for (group, &n_g) in sizes.iter().enumerate() {
                if n_g > INT_MAX {
                    return Err(too_big("group size", n_g));
                }
                let c = mul(op, group, per_group)?;
                if n_g == 0 {
                    if per_group > 0 {
                        zero.push(c..c + per_group);
                    }
                } else if per_group > 0 {
                    calls.push(GemmCall {
                        group,
                        transa: Trans::N,
                        transb: Trans::T,
                        m: q,
                        n: p,
                        k: n_g,
                        a: mul(op, start, q)?,
                        lda: q,
                        b: mul(op, start, p)?,
                        ldb: p,
                        c,
                        ldc: q,
                    });
                }
                start += n_g;
            }
            Plan {
                calls,
                zero,
                a_len: mul(op, rows, q)?,
                b_len: mul(op, rows, p)?,
                c_len: mul(op, g, per_group)?,
            }
        }
    };
    plan.check()
        .map_err(|detail| BackendError::Shape { op, detail })?;
    Ok(plan)
}

impl Plan {
    /// Checks every call against cuBLAS's argument rules (`m, n, k ≥ 1` here since empty
    /// problems are never issued; `lda ≥ rows of A as stored`, likewise `ldb`, `ldc ≥ m`; every
    /// value in `int` range) and its footprint inside the buffers; the outputs of the calls
    /// and the zeroed ranges must be disjoint.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(self.calls.len() + self.zero.len());
        for (i, c) in self.calls.iter().enumerate() {
            let (ar, ac) = c.a_stored();
            let (br, bc) = c.b_stored();
            let checks = [
                (
                    c.m >= 1 && c.n >= 1 && c.k >= 1,
                    "m, n, k must be at least 1",
                ),
                (c.lda >= ar.max(1), "lda is below the rows of A as stored"),
                (c.ldb >= br.max(1), "ldb is below the rows of B as stored"),
                (c.ldc >= c.m.max(1), "ldc is below m"),
                (
                    [c.m, c.n, c.k, c.lda, c.ldb, c.ldc]
                        .iter()
                        .all(|&v| v <= INT_MAX),
                    "a size or leading dimension exceeds cuBLAS's int range",
                ),
            ];
            if let Some((_, why)) = checks.iter().find(|(ok, _)| !ok) {
                return Err(format!("cuBLAS call {i} ({c:?}): {why}"));
            }
            for (what, offset, span, len) in [
                ("A", c.a, footprint(ar, ac, c.lda), self.a_len),
                ("B", c.b, footprint(br, bc, c.ldb), self.b_len),
                ("C", c.c, footprint(c.m, c.n, c.ldc), self.c_len),
            ] {
                if offset.checked_add(span).is_none_or(|end| end > len) {
                    return Err(format!(
                        "cuBLAS call {i} ({c:?}): {what} spans elements {offset}..{} of a \
                         buffer of {len}",
                        offset.saturating_add(span)
                    ));
                }
            }
            spans.push(c.c_span());
        }
        for z in &self.zero {
            if z.end > self.c_len || z.start > z.end {
                return Err(format!(
                    "zeroed range {z:?} outside an output of {}",
                    self.c_len
                ));
            }
            spans.push(z.clone());
        }
        spans.sort_by_key(|r| (r.start, r.end));
        if let Some(w) = spans.windows(2).find(|w| w[0].end > w[1].start) {
            return Err(format!("output ranges {:?} and {:?} overlap", w[0], w[1]));
        }
        Ok(())
    }
}

/// The shape parameters cuBLAS takes once per group of `cublasGemmGroupedBatchedEx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GroupKey {
    /// `op(A)`.
    pub(crate) transa: Trans,
    /// `op(B)`.
    pub(crate) transb: Trans,
    /// `m`.
    pub(crate) m: usize,
    /// `n`.
    pub(crate) n: usize,
    /// `k`.
    pub(crate) k: usize,
    /// `lda`.
    pub(crate) lda: usize,
    /// `ldb`.
    pub(crate) ldb: usize,
    /// `ldc`.
    pub(crate) ldc: usize,
}

impl GroupKey {
    fn of(c: &GemmCall) -> Self {
        Self {
            transa: c.transa,
            transb: c.transb,
            m: c.m,
            n: c.n,
            k: c.k,
            lda: c.lda,
            ldb: c.ldb,
            ldc: c.ldc,
        }
    }
}

/// A plan as the arguments of one `cublasGemmGroupedBatchedEx`: `groups[i]` holds
/// `group_size[i]` problems, which are the next `group_size[i]` entries of `problems` (indices
/// into [`Plan::calls`], the order of the device pointer arrays).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GroupedArgs {
    /// The per-group shapes (cuBLAS's host arrays), in order of first appearance.
    pub(crate) groups: Vec<GroupKey>,
    /// Problems per group.
    pub(crate) group_size: Vec<usize>,
    /// The calls in pointer-array order: group by group, each in plan order.
    pub(crate) problems: Vec<usize>,
}

impl GroupedArgs {
    /// Packs `plan`: calls with identical shapes and leading dimensions share a cuBLAS group.
    pub(crate) fn of(plan: &Plan) -> Self {
        let mut groups: Vec<GroupKey> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for (i, c) in plan.calls.iter().enumerate() {
            let key = GroupKey::of(c);
            let at = *index.entry(key).or_insert_with(|| {
                groups.push(key);
                members.push(Vec::new());
                groups.len() - 1
            });
            members[at].push(i);
        }
        Self {
            groups,
            group_size: members.iter().map(Vec::len).collect(),
            problems: members.into_iter().flatten().collect(),
        }
    }
}

#[cfg(test)]
mod tests;
