//! Op tests: every kernel against the plain-Burn references of [`crate::testing`], forward and
//! backward, plus central finite differences in f64.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use super::*;
use crate::testing::{
    SplitMix, assert_close, finite_difference, int_tensor, reference_grouped_matmul,
    reference_permute, reference_unpermute, tensor, values,
};

fn dev() -> Device {
    Device::flex()
}

fn ad() -> Device {
    Device::flex().autodiff()
}

/// Random routing: every token picks `k` distinct experts among the first `used` experts.
fn random_routing(rng: &mut SplitMix, t: usize, e: usize, k: usize, used: usize) -> Vec<bool> {
    let mut map = vec![false; t * e];
    for tok in 0..t {
        for ex in rng.distinct(used, k) {
            map[tok * e + ex] = true;
        }
    }
    map
}

fn bool_tensor(map: &[bool], t: usize, e: usize, device: &Device) -> Tensor<2, Bool> {
    Tensor::from_data(TensorData::new(map.to_vec(), [t, e]), device)
}

fn ints(t: Tensor<1, Int>) -> Vec<usize> {
    int_tensor_to_usize(t)
}

/// (T, H, E, k, experts actually used): T = 1, k = E, zero-token experts, odd sizes.
const CASES: [(usize, usize, usize, usize, usize); 5] = [
    (1, 3, 4, 2, 4),
    (13, 5, 7, 3, 7),
    (5, 4, 4, 4, 4),
    (9, 6, 8, 2, 3),
    (33, 17, 12, 5, 11),
];

#[test]
fn permute_matches_per_expert_reference_and_orders_expert_major() {
    let mut rng = SplitMix::new(1);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        let x = tensor(rng.values(t * h), [t, h], &dev(), DType::F32);
        let p = tensor(rng.values(t * e), [t, e], &dev(), DType::F32);
        let out = permute(
            x.clone(),
            bool_tensor(&map, t, e, &dev()),
            Some(p.clone()),
            PermuteMode::Dropless,
        )
        .expect("permute");
        let (expect_rows, expect_idx) = reference_permute(x, &map, e);
        assert_eq!(out.rows.dims(), [t * k, h]);
        assert_eq!(
            values(out.rows),
            values(expect_rows),
            "rows for case {t},{e},{k}"
        );
        assert_eq!(ints(out.row_id_map.sorted_indices.clone()), expect_idx);
        let counts: Vec<usize> = (0..e)
            .map(|ex| (0..t).filter(|&tok| map[tok * e + ex]).count())
            .collect();
        assert_eq!(out.row_id_map.tokens_per_expert_host(), counts);
        // Permuted probs are probs[token, expert] in the same order.
        let pv = values(p);
        let mut expect_p = Vec::new();
        for ex in 0..e {
            for tok in 0..t {
                if map[tok * e + ex] {
                    expect_p.push(pv[tok * e + ex]);
                }
            }
        }
        assert_eq!(values(out.probs.expect("probs")), expect_p);
    }
}

#[test]
fn spec_ep2_vector_permute_order() {
    // docs/routing-and-dispatch.md §EP2 worked example: rank 0 tokens a -> {0,2}, b -> {1,3}; rank
    // 1 c -> {1,2}, d -> {2,3}.
    for (pairs, expect) in [
        ([[0, 2], [1, 3]], vec![0, 1, 0, 1]),
        ([[1, 2], [2, 3]], vec![0, 0, 1, 1]),
    ] {
        let idx = int_tensor(
            pairs.iter().flatten().map(|&v| v as i64).collect(),
            [2, 2],
            &dev(),
        );
        let x = tensor(vec![1.0, 2.0], [2, 1], &dev(), DType::F32);
        let out = permute_with_indices(x, idx, None, 4, PermuteMode::Dropless).expect("permute");
        assert_eq!(ints(out.row_id_map.sorted_indices), expect);
    }
}

#[test]
fn unpermute_matches_reference_with_and_without_probs() {
    let mut rng = SplitMix::new(2);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        let x = tensor(rng.values(t * h), [t, h], &dev(), DType::F32);
        let perm = permute(
            x,
            bool_tensor(&map, t, e, &dev()),
            None,
            PermuteMode::Dropless,
        )
        .expect("permute");
        let n = perm.rows.dims()[0];
        let rows = tensor(rng.values(n * h), [n, h], &dev(), DType::F32);
        let w = tensor(rng.values(n), [n], &dev(), DType::F32);
        let idx = ints(perm.row_id_map.sorted_indices.clone());
        for probs in [None, Some(w)] {
            let got = unpermute(rows.clone(), &perm.row_id_map, probs.clone()).expect("unpermute");
            let expect = reference_unpermute(rows.clone(), &idx, probs, t);
            assert_close(&values(got), &values(expect), 1e-6, 1e-6, "unpermute");
        }
    }
}

#[test]
fn round_trip_with_probs_one_over_k_returns_input_and_upstream_grad() {
    let mut rng = SplitMix::new(3);
    let (t, h, e, k) = (11, 6, 6, 3);
    let map = random_routing(&mut rng, t, e, k, e);
    let xv = rng.values(t * h);
    let x = tensor(xv.clone(), [t, h], &ad(), DType::F32).require_grad();
    let probs: Vec<f64> = map
        .iter()
        .map(|&m| if m { 1.0 / k as f64 } else { 0.0 })
        .collect();
    let p = tensor(probs, [t, e], &ad(), DType::F32);
    let perm = permute(
        x.clone(),
        bool_tensor(&map, t, e, &ad()),
        Some(p),
        PermuteMode::Dropless,
    )
    .expect("permute");
    let y = unpermute(perm.rows, &perm.row_id_map, perm.probs).expect("unpermute");
    assert_close(&values(y.clone()), &xv, 1e-6, 1e-6, "round trip");
    let upstream = rng.values(t * h);
    let grads = (y * tensor(upstream.clone(), [t, h], &ad(), DType::F32))
        .sum()
        .backward();
    let gx = x.grad(&grads).expect("grad");
    assert_close(&values(gx), &upstream, 1e-6, 1e-6, "round-trip grad");
}

#[test]
fn permute_unpermute_backward_matches_reference_autodiff() {
    let mut rng = SplitMix::new(4);
    for (t, h, e, k, used) in CASES {
        let map = random_routing(&mut rng, t, e, k, used);
        let xv = rng.values(t * h);
        let pv = rng.values(t * e);
        let rv = rng.values(t * h);
        // Ours: permute (with probs) -> tanh -> unpermute weighted.
        let x = tensor(xv.clone(), [t, h], &ad(), DType::F64).require_grad();
        let p = tensor(pv.clone(), [t, e], &ad(), DType::F64).require_grad();
        let perm = permute(
            x.clone(),
            bool_tensor(&map, t, e, &ad()),
            Some(p.clone()),
            PermuteMode::Dropless,
        )
        .expect("permute");
        let y = unpermute(perm.rows.tanh(), &perm.row_id_map, perm.probs).expect("unpermute");
        let r = tensor(rv.clone(), [t, h], &ad(), DType::F64);
        let grads = (y * r).sum().backward();
        let (gx, gp) = (
            values(x.grad(&grads).expect("gx")),
            values(p.grad(&grads).expect("gp")),
        );
        // Reference with plain Burn ops.
        let x2 = tensor(xv, [t, h], &ad(), DType::F64).require_grad();
        let p2 = tensor(pv, [t, e], &ad(), DType::F64).require_grad();
        let (rows, idx) = reference_permute(x2.clone(), &map, e);
        let flat: Vec<i64> = {
            let mut f = Vec::new();
            for ex in 0..e {
                for tok in 0..t {
                    if map[tok * e + ex] {
                        f.push((tok * e + ex) as i64);
                    }
                }
            }
            f
        };
        let pr = p2
            .clone()
            .reshape([t * e])
            .select(0, int_tensor(flat.clone(), [flat.len()], &ad()));
        let y2 = reference_unpermute(rows.tanh(), &idx, Some(pr), t);
        let grads2 = (y2 * tensor(rv, [t, h], &ad(), DType::F64))
            .sum()
            .backward();
        assert_close(
            &gx,
            &values(x2.grad(&grads2).expect("gx2")),
            1e-12,
            1e-12,
            "d tokens",
        );
        assert_close(
            &gp,
            &values(p2.grad(&grads2).expect("gp2")),
            1e-12,
            1e-12,
            "d probs",
        );
    }
}

#[test]
fn weighted_unpermute_gradients_match_finite_differences() {
    let mut rng = SplitMix::new(5);
    let (t, h, n) = (4, 3, 7);
    let idx = [2usize, 0, 2, 3, 1, 0, 2];
    let rows_v = rng.values(n * h);
    let p_v = rng.values(n);
    let r_v = rng.values(t * h);
    let map = RowIdMap {
        sorted_indices: int_tensor(idx.iter().map(|&v| v as i64).collect(), [n], &dev()),
        probs_index: int_tensor(vec![0; n], [n], &dev()),
        tokens_per_expert: int_tensor(vec![n as i64], [1], &dev()),
        num_tokens: t,
        num_experts: 1,
    };
    let loss = |rows: &[f64], p: &[f64]| -> f64 {
        let y = unpermute(
            tensor(rows.to_vec(), [n, h], &dev(), DType::F64),
            &map,
            Some(tensor(p.to_vec(), [n], &dev(), DType::F64)),
        )
        .expect("unpermute");
        values(y).iter().zip(&r_v).map(|(a, b)| (a * b).sin()).sum()
    };
    let rows = tensor(rows_v.clone(), [n, h], &ad(), DType::F64).require_grad();
    let p = tensor(p_v.clone(), [n], &ad(), DType::F64).require_grad();
    let y = unpermute(rows.clone(), &map, Some(p.clone())).expect("unpermute");
    let grads = (y * tensor(r_v.clone(), [t, h], &ad(), DType::F64))
        .sin()
        .sum()
        .backward();
    let fd_rows = finite_difference(|v| loss(v, &p_v), &rows_v, 1e-6);
    let fd_p = finite_difference(|v| loss(&rows_v, v), &p_v, 1e-6);
    // Central differences in f64 with eps 1e-6: truncation + rounding error well below 1e-7.
    assert_close(
        &values(rows.grad(&grads).expect("g")),
        &fd_rows,
        1e-6,
        1e-7,
        "d rows (fd)",
    );
    assert_close(
        &values(p.grad(&grads).expect("g")),
        &fd_p,
        1e-6,
        1e-7,
        "d probs (fd)",
    );
}

#[test]
fn drop_and_pad_gives_exactly_capacity_rows_routed_first() {
    // Expert 0: tokens 1,2,4 routed (cap 2 drops 4); expert 1: token 3 routed, pads 0; expert 2: none.
    let (t, e, cap) = (5, 3, 2);
    let mut map = vec![false; t * e];
    for (tok, ex) in [(1, 0), (2, 0), (4, 0), (3, 1)] {
        map[tok * e + ex] = true;
    }
    let x = tensor(
        (0..t).map(|v| v as f64).collect(),
        [t, 1],
        &dev(),
        DType::F32,
    );
    let out = permute(
        x,
        bool_tensor(&map, t, e, &dev()),
        None,
        PermuteMode::DropAndPad { capacity: cap },
    )
    .expect("permute");
    assert_eq!(
        ints(out.row_id_map.sorted_indices.clone()),
        vec![1, 2, 3, 0, 0, 1]
    );
    assert_eq!(out.row_id_map.tokens_per_expert_host(), vec![cap; e]);
    assert_eq!(values(out.rows), vec![1.0, 2.0, 3.0, 0.0, 0.0, 1.0]);
}

fn gmm_case(rng: &mut SplitMix, sizes: &[usize], k: usize, m: usize, out_in: bool, dtype: DType) {
    let n: usize = sizes.iter().sum();
    let g = sizes.len();
    let wshape = if out_in { [g, m, k] } else { [g, k, m] };
    let (xv, wv, rv) = (rng.values(n * k), rng.values(g * m * k), rng.values(n * m));
    let layout = if out_in {
        WeightLayout::OutIn
    } else {
        WeightLayout::InOut
    };
    let x = tensor(xv.clone(), [n, k], &ad(), dtype).require_grad();
    let w = tensor(wv.clone(), wshape, &ad(), dtype).require_grad();
    let y = grouped_matmul(
        x.clone(),
        w.clone(),
        &GroupSizes::Host(sizes.to_vec()),
        layout,
    )
    .expect("gmm");
    let x2 = tensor(xv, [n, k], &ad(), dtype).require_grad();
    let w2 = tensor(wv, wshape, &ad(), dtype).require_grad();
    let y2 = reference_grouped_matmul(x2.clone(), w2.clone(), sizes, out_in);
    let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
    assert_close(
        &values(y.clone()),
        &values(y2.clone()),
        tol,
        tol,
        "gmm forward",
    );
    let grads = (y * tensor(rv.clone(), [n, m], &ad(), dtype))
        .sum()
        .backward();
    let grads2 = (y2 * tensor(rv, [n, m], &ad(), dtype)).sum().backward();
    assert_close(
        &values(x.grad(&grads).expect("dx")),
        &values(x2.grad(&grads2).expect("dx2")),
        tol,
        tol,
        "dgrad",
    );
    let dw = values(w.grad(&grads).expect("dw"));
    let dw2 = w2
        .grad(&grads2)
        .map(values)
        .unwrap_or_else(|| vec![0.0; dw.len()]);
    assert_close(&dw, &dw2, tol, tol, "wgrad");
    // Empty groups get exactly zero weight gradient.
    for (gi, &s) in sizes.iter().enumerate() {
        if s == 0 {
            assert!(dw[gi * m * k..(gi + 1) * m * k].iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn grouped_matmul_forward_and_backward_match_per_group_reference() {
    let mut rng = SplitMix::new(6);
    for sizes in [
        vec![3, 0, 5, 1],
        vec![0, 0, 7],
        vec![1],
        vec![70, 0, 129, 2, 0],
    ] {
        for out_in in [true, false] {
            gmm_case(&mut rng, &sizes, 9, 5, out_in, DType::F32);
            gmm_case(&mut rng, &sizes, 4, 11, out_in, DType::F64);
        }
    }
}

#[test]
fn grouped_matmul_gradients_match_finite_differences() {
    let mut rng = SplitMix::new(7);
    let (sizes, k, m) = (vec![2, 0, 3], 3, 2);
    let n = 5;
    let (xv, wv, rv) = (rng.values(n * k), rng.values(3 * m * k), rng.values(n * m));
    let f = |x: &[f64], w: &[f64]| -> f64 {
        let y = grouped_matmul(
            tensor(x.to_vec(), [n, k], &dev(), DType::F64),
            tensor(w.to_vec(), [3, m, k], &dev(), DType::F64),
            &GroupSizes::Host(sizes.clone()),
            WeightLayout::OutIn,
        )
        .expect("gmm");
        values(y).iter().zip(&rv).map(|(a, b)| (a * b).cos()).sum()
    };
    let x = tensor(xv.clone(), [n, k], &ad(), DType::F64).require_grad();
    let w = tensor(wv.clone(), [3, m, k], &ad(), DType::F64).require_grad();
    let y = grouped_matmul(
        x.clone(),
        w.clone(),
        &GroupSizes::Host(sizes.clone()),
        WeightLayout::OutIn,
    )
    .expect("gmm");
    let grads = (y * tensor(rv.clone(), [n, m], &ad(), DType::F64))
        .cos()
        .sum()
        .backward();
    assert_close(
        &values(x.grad(&grads).expect("dx")),
        &finite_difference(|v| f(v, &wv), &xv, 1e-6),
        1e-6,
        1e-7,
        "dx fd",
    );
    assert_close(
        &values(w.grad(&grads).expect("dw")),
        &finite_difference(|v| f(&xv, v), &wv, 1e-6),
        1e-6,
        1e-7,
        "dw fd",
    );
}

#[test]
fn wgrad_op_is_differentiable() {
    let mut rng = SplitMix::new(8);
    let (sizes, p, q) = (vec![3, 0, 2], 4, 3);
    let n = 5;
    let (av, bv, rv) = (rng.values(n * p), rng.values(n * q), rng.values(3 * p * q));
    let a = tensor(av.clone(), [n, p], &ad(), DType::F64).require_grad();
    let b = tensor(bv.clone(), [n, q], &ad(), DType::F64).require_grad();
    let out = grouped_matmul_wgrad(a.clone(), b.clone(), &GroupSizes::Host(sizes.clone()))
        .expect("wgrad");
    let grads = (out * tensor(rv.clone(), [3, p, q], &ad(), DType::F64))
        .sum()
        .backward();
    // Reference: per group a_gᵀ b_g with plain matmuls.
    let a2 = tensor(av, [n, p], &ad(), DType::F64).require_grad();
    let b2 = tensor(bv, [n, q], &ad(), DType::F64).require_grad();
    let mut loss = Tensor::<1>::zeros([1], (&ad(), DType::F64));
    let mut row = 0;
    for (g, &s) in sizes.iter().enumerate() {
        if s > 0 {
            let og = a2
                .clone()
                .slice(row..row + s)
                .transpose()
                .matmul(b2.clone().slice(row..row + s));
            let rg = tensor(
                rv[g * p * q..(g + 1) * p * q].to_vec(),
                [p, q],
                &ad(),
                DType::F64,
            );
            loss = loss + (og * rg).sum();
        }
        row += s;
    }
    let grads2 = loss.backward();
    assert_close(
        &values(a.grad(&grads).expect("da")),
        &values(a2.grad(&grads2).expect("da2")),
        1e-12,
        1e-12,
        "da",
    );
    assert_close(
        &values(b.grad(&grads).expect("db")),
        &values(b2.grad(&grads2).expect("db2")),
        1e-12,
        1e-12,
        "db",
    );
}

#[test]
fn sort_chunks_reproduces_spec_ep2_vector_and_inverts_in_backward() {
    // docs/routing-and-dispatch.md §EP2 worked example, rank 1: rows [a_e2, b_e3 | c_e2, d_e2,
    // d_e3], gl = [[1,1],[2,1]], idx [0,2,1,3].
    let x = tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0], [5, 1], &ad(), DType::F32).require_grad();
    let y = sort_chunks_by_idxs(x.clone(), &[1, 1, 2, 1], &[0, 2, 1, 3]).expect("sort");
    assert_eq!(values(y.clone()), vec![1.0, 3.0, 4.0, 2.0, 5.0]);
    let grads = (y * tensor(
        vec![10.0, 20.0, 30.0, 40.0, 50.0],
        [5, 1],
        &ad(),
        DType::F32,
    ))
    .sum()
    .backward();
    assert_eq!(
        values(x.grad(&grads).expect("grad")),
        vec![10.0, 40.0, 20.0, 30.0, 50.0]
    );
    // Rank 0 with an empty chunk: gl = [[1,1],[0,1]].
    let x0 = tensor(vec![1.0, 2.0, 3.0], [3, 1], &dev(), DType::F32);
    let y0 = sort_chunks_by_idxs(x0, &[1, 1, 0, 1], &[0, 2, 1, 3]).expect("sort");
    assert_eq!(values(y0), vec![1.0, 2.0, 3.0]);
}

#[test]
fn topk_indices_breaks_ties_to_lower_index() {
    let s = tensor(
        vec![0.5, 0.5, 0.5, 0.5, 1.0, 3.0, 1.0, 3.0],
        [2, 4],
        &dev(),
        DType::F32,
    );
    let idx = topk_indices(s, 3).expect("topk");
    assert_eq!(int_tensor_to_usize(idx), vec![0, 1, 2, 1, 3, 0]);
}

#[test]
fn attach_loss_is_identity_forward_and_sends_constant_grad_to_loss() {
    let x = tensor(vec![1.0, 2.0], [2], &ad(), DType::F32).require_grad();
    let l_in = tensor(vec![3.0], [1], &ad(), DType::F32).require_grad();
    let loss = l_in.clone() * l_in.clone();
    let y = attach_loss(x.clone(), loss, 0.5);
    assert_eq!(values(y.clone()), vec![1.0, 2.0]);
    let grads = (y * 4.0).sum().backward();
    assert_eq!(values(x.grad(&grads).expect("dx")), vec![4.0, 4.0]);
    // d(l²)/dl · 0.5 = 2·3·0.5.
    assert_eq!(values(l_in.grad(&grads).expect("dl")), vec![3.0]);
}

#[test]
fn half_precision_unpermute_accumulates_in_f32() {
    // 1.0 followed by 128 copies of 2^-8: in bf16 every partial sum 1 + 2^-8 rounds back to 1.0
    // (ties to even), so only f32 accumulation gives 1.5 (exactly representable in bf16).
    let (t, n, h) = (1, 129, 1);
    let rows: Vec<f64> = (0..n)
        .map(|i| if i == 0 { 1.0 } else { 1.0 / 256.0 })
        .collect();
    let map = RowIdMap {
        sorted_indices: int_tensor(vec![0; n], [n], &dev()),
        probs_index: int_tensor(vec![0; n], [n], &dev()),
        tokens_per_expert: int_tensor(vec![n as i64], [1], &dev()),
        num_tokens: t,
        num_experts: 1,
    };
    let y = unpermute(tensor(rows, [n, h], &dev(), DType::BF16), &map, None).expect("unpermute");
    assert_eq!(values(y), vec![1.5]);
}

#[test]
fn bad_inputs_return_typed_errors() {
    let x = tensor(vec![0.0; 6], [3, 2], &dev(), DType::F32);
    let w = tensor(vec![0.0; 8], [2, 2, 2], &dev(), DType::F32);
    let err = grouped_matmul(
        x.clone(),
        w.clone(),
        &GroupSizes::Host(vec![1, 1]),
        WeightLayout::OutIn,
    );
    assert!(matches!(
        err,
        Err(BackendError::SizeSum {
            sum: 2,
            rows: 3,
            ..
        })
    ));
    let err = grouped_matmul(
        x.clone(),
        w,
        &GroupSizes::Host(vec![3]),
        WeightLayout::OutIn,
    );
    assert!(matches!(err, Err(BackendError::Shape { .. })));
    let err = sort_chunks_by_idxs(x.clone(), &[1, 2], &[1, 1]);
    assert!(matches!(err, Err(BackendError::Index { .. })));
    let err = sort_chunks_by_idxs(x.clone(), &[1, 1], &[1, 0]);
    assert!(matches!(err, Err(BackendError::SizeSum { .. })));
    let map = bool_tensor(&[true; 4], 2, 2, &dev());
    assert!(matches!(
        permute(x.clone(), map.clone(), None, PermuteMode::Dropless),
        Err(BackendError::Shape { .. })
    ));
    let idx = int_tensor(vec![0, 5, 1, 2, 0, 1], [3, 2], &dev());
    let err = permute_with_indices(x.clone(), idx, None, 4, PermuteMode::Dropless);
    assert!(matches!(err, Err(BackendError::Index { .. })));
    assert!(matches!(
        topk_indices(x, 3),
        Err(BackendError::Config { .. })
    ));
}

#[test]
fn fused_swiglu_matches_burn_ops_and_finite_differences() {
    let mut rng = SplitMix::new(9);
    let (n, f) = (5, 3);
    let (hv, pv, rv) = (rng.values(n * 2 * f), rng.values(n), rng.values(n * f));
    let run = |fused: bool| {
        let h = tensor(hv.clone(), [n, 2 * f], &ad(), DType::F64).require_grad();
        let p = tensor(pv.clone(), [n], &ad(), DType::F64).require_grad();
        let z = if fused {
            swiglu_with_probs(h.clone(), p.clone()).expect("swiglu")
        } else {
            let gate = h.clone().slice([0..n, 0..f]);
            burn::tensor::activation::silu(gate)
                * h.clone().slice([0..n, f..2 * f])
                * p.clone().reshape([n, 1])
        };
        let r = tensor(rv.clone(), [n, f], &ad(), DType::F64);
        let grads = (z.clone() * r).sum().backward();
        let gh = values(h.grad(&grads).expect("dh"));
        let gp = values(p.grad(&grads).expect("dp"));
        (values(z), gh, gp)
    };
    let (ours, reference) = (run(true), run(false));
    assert_close(&ours.0, &reference.0, 1e-14, 1e-14, "swiglu forward");
    assert_close(&ours.1, &reference.1, 1e-12, 1e-14, "swiglu d hidden");
    assert_close(&ours.2, &reference.2, 1e-12, 1e-14, "swiglu d probs");
    let loss = |h: &[f64], p: &[f64]| -> f64 {
        let z = swiglu_with_probs(
            tensor(h.to_vec(), [n, 2 * f], &dev(), DType::F64),
            tensor(p.to_vec(), [n], &dev(), DType::F64),
        )
        .expect("swiglu");
        values(z).iter().zip(&rv).map(|(a, b)| a * b).sum()
    };
    let fd_h = finite_difference(|v| loss(v, &pv), &hv, 1e-6);
    let fd_p = finite_difference(|v| loss(&hv, v), &pv, 1e-6);
    assert_close(&ours.1, &fd_h, 1e-6, 1e-8, "swiglu d hidden (fd)");
    assert_close(&ours.2, &fd_p, 1e-6, 1e-8, "swiglu d probs (fd)");
    let bad = swiglu_with_probs(
        tensor(vec![0.0; 6], [2, 3], &dev(), DType::F32),
        tensor(vec![1.0; 2], [2], &dev(), DType::F32),
    );
    assert!(matches!(bad, Err(BackendError::Shape { .. })));
}

#[test]
fn clamped_swiglu_matches_closed_form_forward_and_gradient() {
    // gpt-oss (transformers `GptOssExperts._apply_gate`): g = min(gate, L), u = clamp(up, ±L),
    // z = (u + 1)·g·σ(α·g)·p; written out per element on the host, with its derivative.
    let (alpha, limit) = (1.702, 7.0);
    let mut rng = SplitMix::new(31);
    let (n, f) = (6, 5);
    // Values in ±12 so every branch occurs; none lies within 1e-3 of ±limit.
    let hv: Vec<f64> = (0..n * 2 * f)
        .map(|_| {
            loop {
                let v = rng.uniform(-12.0, 12.0);
                if (v.abs() - limit).abs() > 1e-3 {
                    break v;
                }
            }
        })
        .collect();
    let (pv, rv) = (rng.values(n), rng.values(n * f));
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let (mut z, mut dh, mut dp) = (vec![0.0; n * f], vec![0.0; n * 2 * f], vec![0.0; n]);
    let mut clamped = [0usize; 3];
    for i in 0..n {
        for j in 0..f {
            let (gate, up) = (hv[i * 2 * f + j], hv[i * 2 * f + f + j]);
            clamped[0] += usize::from(gate > limit);
            clamped[1] += usize::from(up > limit);
            clamped[2] += usize::from(up < -limit);
            let g = gate.min(limit);
            let u = up.clamp(-limit, limit);
            let s = sig(alpha * g);
            let glu = g * s;
            let r = rv[i * f + j];
            z[i * f + j] = (u + 1.0) * glu * pv[i];
            dp[i] += r * (u + 1.0) * glu;
            let dglu = r * pv[i] * (u + 1.0);
            dh[i * 2 * f + j] = if gate < limit {
                dglu * (s + alpha * g * s * (1.0 - s))
            } else {
                0.0
            };
            dh[i * 2 * f + f + j] = if up.abs() < limit {
                r * pv[i] * glu
            } else {
                0.0
            };
        }
    }
    assert!(
        clamped.iter().all(|&c| c > 0),
        "every clamp occurs: {clamped:?}"
    );
    let h = tensor(hv.clone(), [n, 2 * f], &ad(), DType::F64).require_grad();
    let p = tensor(pv.clone(), [n], &ad(), DType::F64).require_grad();
    let out = clamped_swiglu_with_probs(h.clone(), p.clone(), alpha, limit).expect("swiglu");
    let grads = (out.clone() * tensor(rv.clone(), [n, f], &ad(), DType::F64))
        .sum()
        .backward();
    assert_close(&values(out), &z, 1e-14, 1e-14, "clamped swiglu forward");
    let gh = values(h.grad(&grads).expect("dh"));
    assert_close(&gh, &dh, 1e-12, 1e-14, "clamped swiglu d hidden");
    assert_close(
        &values(p.grad(&grads).expect("dp")),
        &dp,
        1e-12,
        1e-14,
        "clamped swiglu d probs",
    );
    // Exactly zero where clamped.
    let zeros = dh.iter().filter(|v| **v == 0.0).count();
    assert!(zeros > 0 && gh.iter().filter(|v| **v == 0.0).count() == zeros);
    for (hidden, probs, alpha, limit) in [
        (vec![0.0; 6], vec![1.0; 2], 1.0, 7.0),
        (vec![0.0; 4], vec![1.0; 2], 1.0, 0.0),
        (vec![0.0; 4], vec![1.0; 2], f64::NAN, 7.0),
    ] {
        let cols = hidden.len() / 2;
        let bad = clamped_swiglu_with_probs(
            tensor(hidden, [2, cols], &dev(), DType::F32),
            tensor(probs, [2], &dev(), DType::F32),
            alpha,
            limit,
        );
        assert!(bad.is_err(), "{cols} {alpha} {limit}");
    }
}
