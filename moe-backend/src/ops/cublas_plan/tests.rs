//! The cuBLAS plans run through a host interpreter of cuBLAS's documented column-major
//! semantics (`X(i, j) = X[offset + i + j·ld]`, `op(X)` per `trans`, `beta = 0` so `C` is
//! written and never read), against row-major references written from the ops' definitions.
//! Values are small integers, so every sum is exact in f64 and results compare with `==`.

use super::*;

/// SplitMix64: reproducible inputs without an RNG dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Integers in `-4..=4`.
    fn values(&mut self, len: usize) -> Vec<f64> {
        (0..len).map(|_| self.below(9) as f64 - 4.0).collect()
    }
}

fn read(buf: &[f64], at: usize, what: &str) -> std::result::Result<f64, String> {
    buf.get(at)
        .copied()
        .ok_or_else(|| format!("{what} read at {at} past a buffer of {}", buf.len()))
}

/// One cuBLAS GEMM as cuBLAS defines it, with its `CUBLAS_STATUS_INVALID_VALUE` checks on
/// the leading dimensions; an access outside a buffer is an error (on a GPU: a fault or
/// silent corruption).
fn gemm(c: &GemmCall, a: &[f64], b: &[f64], out: &mut [f64]) -> std::result::Result<(), String> {
    let rows_a = if c.transa == Trans::N { c.m } else { c.k };
    let rows_b = if c.transb == Trans::N { c.k } else { c.n };
    if c.lda < rows_a.max(1) || c.ldb < rows_b.max(1) || c.ldc < c.m.max(1) {
        return Err(format!("CUBLAS_STATUS_INVALID_VALUE: {c:?}"));
    }
    for j in 0..c.n {
        for i in 0..c.m {
            let mut sum = 0.0;
            for l in 0..c.k {
                let av = match c.transa {
                    Trans::N => read(a, c.a + i + l * c.lda, "A")?,
                    Trans::T => read(a, c.a + l + i * c.lda, "A")?,
                };
                let bv = match c.transb {
                    Trans::N => read(b, c.b + l + j * c.ldb, "B")?,
                    Trans::T => read(b, c.b + j + l * c.ldb, "B")?,
                };
                sum += av * bv;
            }
            let at = c.c + i + j * c.ldc;
            let len = out.len();
            *out.get_mut(at)
                .ok_or_else(|| format!("C write at {at} past an output of {len}"))? = sum;
        }
    }
    Ok(())
}

/// The output of `plan` on a NaN-poisoned buffer: zeroed ranges, then every call.
fn run_plan(plan: &Plan, a: &[f64], b: &[f64]) -> std::result::Result<Vec<f64>, String> {
    let mut out = vec![f64::NAN; plan.c_len];
    for z in &plan.zero {
        out[z.clone()].fill(0.0);
    }
    for c in &plan.calls {
        gemm(c, a, b, &mut out)?;
    }
    Ok(out)
}

/// The same through the packed `cublasGemmGroupedBatchedEx` arguments: each problem takes its
/// shape from its cuBLAS group and only its pointers (offsets) from the plan.
fn run_grouped(plan: &Plan, a: &[f64], b: &[f64]) -> std::result::Result<Vec<f64>, String> {
    let args = GroupedArgs::of(plan);
    assert_eq!(args.groups.len(), args.group_size.len());
    assert_eq!(args.group_size.iter().sum::<usize>(), plan.calls.len());
    let mut out = vec![f64::NAN; plan.c_len];
    for z in &plan.zero {
        out[z.clone()].fill(0.0);
    }
    let mut next = args.problems.iter();
    for (key, &size) in args.groups.iter().zip(&args.group_size) {
        for _ in 0..size {
            let p = &plan.calls[*next.next().ok_or("too few problems")?];
            let call = GemmCall {
                group: p.group,
                transa: key.transa,
                transb: key.transb,
                m: key.m,
                n: key.n,
                k: key.k,
                a: p.a,
                lda: key.lda,
                b: p.b,
                ldb: key.ldb,
                c: p.c,
                ldc: key.ldc,
            };
            gemm(&call, a, b, &mut out)?;
        }
    }
    assert!(next.next().is_none(), "problems left over");
    Ok(out)
}

/// Row-major reference of `moe_grouped_matmul`: `y [rows, m]`, `y[r, j] = Σ_l x[r, l] ·
/// W_g(j, l)` with `W_g(j, l) = w[g, j, l]` (`[G, M, K]`, transposed) or `w[g, l, j]`.
fn matmul_ref(x: &[f64], w: &[f64], sizes: &[usize], k: usize, m: usize, trans: bool) -> Vec<f64> {
    let rows: usize = sizes.iter().sum();
    let mut y = vec![0.0; rows * m];
    let mut r = 0;
    for (g, &n_g) in sizes.iter().enumerate() {
        for _ in 0..n_g {
            for j in 0..m {
                let mut s = 0.0;
                for l in 0..k {
                    let wv = if trans {
                        w[g * m * k + j * k + l]
                    } else {
                        w[g * k * m + l * m + j]
                    };
                    s += x[r * k + l] * wv;
                }
                y[r * m + j] = s;
            }
            r += 1;
        }
    }
    y
}

/// Row-major reference of `moe_grouped_matmul_wgrad`: `out[g, i, j] = Σ_{r in g} lhs[r, i] ·
/// rhs[r, j]`, zero for empty groups.
fn wgrad_ref(lhs: &[f64], rhs: &[f64], sizes: &[usize], p: usize, q: usize) -> Vec<f64> {
    let mut out = vec![0.0; sizes.len() * p * q];
    let mut start = 0;
    for (g, &n_g) in sizes.iter().enumerate() {
        for i in 0..p {
            for j in 0..q {
                let mut s = 0.0;
                for r in start..start + n_g {
                    s += lhs[r * p + i] * rhs[r * q + j];
                }
                out[g * p * q + i * q + j] = s;
            }
        }
        start += n_g;
    }
    out
}

/// One planned op with its inputs and reference.
struct Case {
    plan: Plan,
    a: Vec<f64>,
    b: Vec<f64>,
    want: Vec<f64>,
}

impl Case {
    /// Whether the plan passes its check and both interpreters reproduce the reference.
    fn holds(&self) -> std::result::Result<(), String> {
        self.plan.check()?;
        for (route, got) in [
            ("per-group", run_plan(&self.plan, &self.a, &self.b)?),
            ("grouped", run_grouped(&self.plan, &self.a, &self.b)?),
        ] {
            if got != self.want {
                let at = got
                    .iter()
                    .zip(&self.want)
                    .position(|(g, w)| g != w && !(g.is_nan() && w.is_nan()))
                    .unwrap_or(0);
                return Err(format!(
                    "{route}: element {at} is {} but the reference has {}",
                    got[at], self.want[at]
                ));
            }
        }
        Ok(())
    }
}

fn fprop_case(rng: &mut Rng, sizes: &[usize], k: usize, m: usize, trans: bool) -> Case {
    let rows: usize = sizes.iter().sum();
    let x = rng.values(rows * k);
    let w = rng.values(sizes.len() * m * k);
    let shape = GroupedShape::Matmul {
        rows,
        k,
        m,
        transpose_weights: trans,
    };
    let plan = plan("test", shape, sizes).expect("plan");
    let want = matmul_ref(&x, &w, sizes, k, m, trans);
    // A is the weights, B is x.
    Case {
        plan,
        a: w,
        b: x,
        want,
    }
}

fn wgrad_case(rng: &mut Rng, sizes: &[usize], p: usize, q: usize) -> Case {
    let rows: usize = sizes.iter().sum();
    let lhs = rng.values(rows * p);
    let rhs = rng.values(rows * q);
    let plan = plan("test", GroupedShape::Wgrad { rows, p, q }, sizes).expect("plan");
    let want = wgrad_ref(&lhs, &rhs, sizes, p, q);
    // A is rhs, B is lhs.
    Case {
        plan,
        a: rhs,
        b: lhs,
        want,
    }
}

/// Ragged groups with empty ones first, in the middle and last; K and N not multiples of 8.
const RAGGED: [usize; 7] = [0, 3, 5, 0, 1, 9, 0];

#[test]
fn fprop_both_weight_layouts_match_the_row_major_reference() {
    let mut rng = Rng(1);
    for trans in [true, false] {
        for (k, m) in [(13, 11), (8, 16), (1, 7), (24, 1)] {
            let case = fprop_case(&mut rng, &RAGGED, k, m, trans);
            assert_eq!(case.plan.calls.len(), 4, "one call per non-empty group");
            assert!(case.plan.zero.is_empty());
            case.holds()
                .unwrap_or_else(|e| panic!("trans {trans}, K {k}, M {m}: {e}"));
        }
    }
}

#[test]
fn dgrad_of_the_fprop_weights_matches_its_definition() {
    // fprop: y = x · W_gᵀ with W [G, M, K]; dgrad: dx [rows, K] = dy [rows, M] · W_g, which
    // is moe_grouped_matmul(dy, W, transpose = false) reading W as [G, K' = M, M' = K].
    let mut rng = Rng(2);
    let (k, m) = (13, 11);
    let sizes = RAGGED;
    let rows: usize = sizes.iter().sum();
    let dy = rng.values(rows * m);
    let w = rng.values(sizes.len() * m * k);
    let shape = GroupedShape::Matmul {
        rows,
        k: m,
        m: k,
        transpose_weights: false,
    };
    let plan = plan("test", shape, &sizes).expect("plan");
    let mut want = vec![0.0; rows * k];
    let mut r = 0;
    for (g, &n_g) in sizes.iter().enumerate() {
        for _ in 0..n_g {
            for c in 0..k {
                want[r * k + c] = (0..m)
                    .map(|j| dy[r * m + j] * w[g * m * k + j * k + c])
                    .sum();
            }
            r += 1;
        }
    }
    let case = Case {
        plan,
        a: w,
        b: dy,
        want,
    };
    case.holds().unwrap();
}

#[test]
fn wgrad_matches_the_reference_and_zeroes_empty_groups() {
    let mut rng = Rng(3);
    for (p, q) in [(11, 13), (16, 8), (1, 5), (7, 1)] {
        let case = wgrad_case(&mut rng, &RAGGED, p, q);
        assert_eq!(case.plan.calls.len(), 4);
        // Groups 0, 3 and 6 are empty: their [P, Q] blocks are zeroed, not computed.
        let pq = p * q;
        assert_eq!(
            case.plan.zero,
            vec![0..pq, 3 * pq..4 * pq, 6 * pq..7 * pq],
            "P {p}, Q {q}"
        );
        case.holds().unwrap_or_else(|e| panic!("P {p}, Q {q}: {e}"));
    }
}

#[test]
fn degenerate_groupings_plan_nothing_or_zeros() {
    let mut rng = Rng(4);
    // No rows at all: no calls; wgrad of all-empty groups is all zero.
    let case = fprop_case(&mut rng, &[0, 0, 0], 5, 3, true);
    assert!(case.plan.calls.is_empty() && case.plan.c_len == 0);
    case.holds().unwrap();
    let case = wgrad_case(&mut rng, &[0, 0], 4, 3);
    assert!(case.plan.calls.is_empty());
    assert_eq!(case.plan.zero, vec![0..12, 12..24]);
    case.holds().unwrap();
    // One group holding every row.
    fprop_case(&mut rng, &[9], 6, 5, false).holds().unwrap();
    wgrad_case(&mut rng, &[9], 6, 5).holds().unwrap();
    // K = 0: the output is an empty sum everywhere, zeroed without a call.
    let case = fprop_case(&mut rng, &[2, 0, 3], 0, 4, true);
    assert!(case.plan.calls.is_empty());
    assert_eq!(case.plan.zero, vec![0..20]);
    case.holds().unwrap();
    // No groups.
    assert!(
        plan(
            "test",
            GroupedShape::Wgrad {
                rows: 0,
                p: 3,
                q: 3
            },
            &[]
        )
        .unwrap()
        .calls
        .is_empty()
    );
}

#[test]
fn random_shapes_hold_for_every_op() {
    let mut rng = Rng(5);
    for round in 0..300 {
        let groups = 1 + rng.below(7);
        let sizes: Vec<usize> = (0..groups)
            .map(|_| if rng.below(4) == 0 { 0 } else { rng.below(12) })
            .collect();
        let (d1, d2) = (1 + rng.below(19), 1 + rng.below(19));
        let case = match round % 3 {
            0 => fprop_case(&mut rng, &sizes, d1, d2, true),
            1 => fprop_case(&mut rng, &sizes, d1, d2, false),
            _ => wgrad_case(&mut rng, &sizes, d1, d2),
        };
        case.holds()
            .unwrap_or_else(|e| panic!("round {round}, sizes {sizes:?}, dims {d1} {d2}: {e}"));
    }
}

#[test]
fn identical_problems_share_a_cublas_group_in_pointer_order() {
    let mut rng = Rng(6);
    // Groups 0, 1, 4 have 3 rows, group 3 has 5, group 2 none: two cuBLAS groups.
    let case = fprop_case(&mut rng, &[3, 3, 0, 5, 3], 10, 6, true);
    let args = GroupedArgs::of(&case.plan);
    assert_eq!(args.group_size, vec![3, 1]);
    assert_eq!(
        args.groups.iter().map(|k| k.n).collect::<Vec<_>>(),
        vec![3, 5]
    );
    // Problems are plan indices: calls 0, 1, 3 (groups 0, 1, 4), then call 2 (group 3).
    assert_eq!(args.problems, vec![0, 1, 3, 2]);
    let experts: Vec<usize> = args
        .problems
        .iter()
        .map(|&p| case.plan.calls[p].group)
        .collect();
    assert_eq!(experts, vec![0, 1, 4, 3]);
    case.holds().unwrap();
    // wgrad: equal group sizes give equal k.
    let case = wgrad_case(&mut rng, &[4, 4, 4], 3, 5);
    assert_eq!(GroupedArgs::of(&case.plan).group_size, vec![3]);
    case.holds().unwrap();
}

/// Every way of getting a leading dimension wrong is caught: by the plan's check (below
/// cuBLAS's minimum, outside a buffer, overlapping outputs) or by a wrong result.
#[test]
fn a_wrong_leading_dimension_fails() {
    let mut rng = Rng(7);
    // Every dimension at least 2, so every leading dimension matters.
    let sizes = [2, 0, 4, 3];
    let cases = [
        fprop_case(&mut rng, &sizes, 5, 3, true),
        fprop_case(&mut rng, &sizes, 5, 3, false),
        wgrad_case(&mut rng, &sizes, 3, 4),
    ];
    for (c, case) in cases.iter().enumerate() {
        case.holds().unwrap();
        for call in 0..case.plan.calls.len() {
            for field in ["lda", "ldb", "ldc"] {
                for delta in [-1i64, 1, 7] {
                    let mut plan = case.plan.clone();
                    let ld = match field {
                        "lda" => &mut plan.calls[call].lda,
                        "ldb" => &mut plan.calls[call].ldb,
                        _ => &mut plan.calls[call].ldc,
                    };
                    *ld = (*ld as i64 + delta) as usize;
                    let wrong = Case {
                        plan,
                        a: case.a.clone(),
                        b: case.b.clone(),
                        want: case.want.clone(),
                    };
                    assert!(
                        wrong.holds().is_err(),
                        "case {c}, call {call}: {field} {delta:+} went unnoticed"
                    );
                    if delta < 0 {
                        let err = wrong.plan.check().unwrap_err();
                        assert!(err.contains("is below"), "{err}");
                    }
                }
            }
        }
        // The transposes swapped: caught too.
        let mut plan = case.plan.clone();
        for call in &mut plan.calls {
            call.transa = if call.transa == Trans::N {
                Trans::T
            } else {
                Trans::N
            };
        }
        let wrong = Case {
            plan,
            a: case.a.clone(),
            b: case.b.clone(),
            want: case.want.clone(),
        };
        assert!(
            wrong.holds().is_err(),
            "case {c}: transa flipped went unnoticed"
        );
    }
}

#[test]
fn footprints_past_a_buffer_or_overlapping_outputs_are_rejected() {
    let mut rng = Rng(8);
    let case = fprop_case(&mut rng, &[2, 3], 4, 5, true);
    // B of the last call one row further: its last element is past x.
    let mut plan = case.plan.clone();
    plan.calls[1].b += 4;
    let err = plan.check().unwrap_err();
    assert!(err.contains("B spans"), "{err}");
    // A past the weights.
    let mut plan = case.plan.clone();
    plan.calls[1].a += 1;
    assert!(plan.check().unwrap_err().contains("A spans"));
    // Two calls writing the same rows.
    let mut plan = case.plan.clone();
    plan.calls[1].c = plan.calls[0].c;
    assert!(plan.check().unwrap_err().contains("overlap"));
    // A zeroed range over a computed block.
    let mut plan = case.plan.clone();
    plan.zero.push(0..1);
    assert!(plan.check().unwrap_err().contains("overlap"));
}

#[test]
fn bad_sizes_are_typed_errors() {
    let shape = GroupedShape::Matmul {
        rows: 10,
        k: 4,
        m: 4,
        transpose_weights: true,
    };
    match plan("op", shape, &[3, 4]) {
        Err(BackendError::SizeSum { op, sum, rows }) => {
            assert_eq!((op, sum, rows), ("op", 7, 10));
        }
        other => panic!("{other:?}"),
    }
    // A group past cuBLAS's int range (nothing is allocated: planning is arithmetic only).
    let big = i32::MAX as usize + 1;
    let shape = GroupedShape::Wgrad {
        rows: big,
        p: 2,
        q: 2,
    };
    match plan("op", shape, &[big]) {
        Err(BackendError::Shape { detail, .. }) => assert!(detail.contains("int range")),
        other => panic!("{other:?}"),
    }
    let shape = GroupedShape::Matmul {
        rows: 1,
        k: big,
        m: 1,
        transpose_weights: false,
    };
    assert!(matches!(
        plan("op", shape, &[1]),
        Err(BackendError::Shape { .. })
    ));
}
