//! `MoeOps` for the Flex CPU backend: converts tensors to contiguous host slices and runs the
//! kernels of [`super::kernels`].
//!
//! `f32` and `f64` are computed natively; `f16`/`bf16` are widened to `f32`, computed, and narrowed
//! once at the end (f32 accumulation, docs/routing-and-dispatch.md §Notation and conventions).

use burn::backend::{
    Flex,
    tensor::{BoolTensor, FloatTensor, IntTensor},
};
use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use std::borrow::Cow;

use super::MoeOps;
use super::kernels::{self, GemmWeightLayout, KernelFloat};

/// Host view of a float tensor in a computation type: borrowed when the tensor is already a
/// contiguous f32/f64 buffer, converted otherwise.
enum HostFloat<'a> {
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
}

/// The float dtype a kernel result must be returned in.
#[derive(Clone, Copy)]
struct OutDType(DType);

fn host_float<'a>(t: &'a FlexTensor, op: &str) -> (HostFloat<'a>, OutDType) {
    let dtype = t.dtype();
    let host = match dtype {
        DType::F64 => HostFloat::F64(match t.as_slice::<f64>() {
            Some(s) => Cow::Borrowed(s),
            None => Cow::Owned(expect_vec(t.clone().into_data().try_into_vec::<f64>(), op)),
        }),
        DType::F32 => HostFloat::F32(match t.as_slice::<f32>() {
            Some(s) => Cow::Borrowed(s),
            None => Cow::Owned(expect_vec(t.clone().into_data().try_into_vec::<f32>(), op)),
        }),
        DType::F16 | DType::BF16 => HostFloat::F32(Cow::Owned(expect_vec(
            t.clone().into_data().convert::<f32>().try_into_vec::<f32>(),
            op,
        ))),
        other => panic!("{op}: unsupported float dtype {other:?} on Flex"),
    };
    (host, OutDType(dtype))
}

fn expect_vec<T>(v: Result<Vec<T>, burn::tensor::DataError>, op: &str) -> Vec<T> {
    v.unwrap_or_else(|e| panic!("{op}: cannot read tensor data: {e:?}"))
}

/// A kernel compute type that host buffers convert into and results convert out of.
trait Compute: KernelFloat {
    /// Views a host buffer in this compute type (no copy when it already matches).
    fn from_host(h: HostFloat<'_>) -> Cow<'_, [Self]>;
    /// Wraps a result as a tensor of dtype `out`.
    fn into_tensor(v: Vec<Self>, shape: Shape, out: OutDType) -> FlexTensor;
}

impl Compute for f32 {
    fn from_host(h: HostFloat<'_>) -> Cow<'_, [Self]> {
        match h {
            HostFloat::F32(v) => v,
            HostFloat::F64(v) => Cow::Owned(v.iter().map(|&x| x as f32).collect()),
        }
    }
    fn into_tensor(v: Vec<Self>, shape: Shape, out: OutDType) -> FlexTensor {
        cast_to(TensorData::new(v, shape), out)
    }
}

impl Compute for f64 {
    fn from_host(h: HostFloat<'_>) -> Cow<'_, [Self]> {
        match h {
            HostFloat::F64(v) => v,
            HostFloat::F32(v) => Cow::Owned(v.iter().map(|&x| f64::from(x)).collect()),
        }
    }
    fn into_tensor(v: Vec<Self>, shape: Shape, out: OutDType) -> FlexTensor {
        cast_to(TensorData::new(v, shape), out)
    }
}

fn cast_to(data: TensorData, out: OutDType) -> FlexTensor {
    let data = if data.dtype() == out.0 {
        data
    } else {
        match out.0 {
            DType::F64 => data.convert::<f64>(),
            DType::F16 => data.convert::<burn::tensor::f16>(),
            DType::BF16 => data.convert::<burn::tensor::bf16>(),
            _ => data.convert::<f32>(),
        }
    };
    FlexTensor::from_data(data)
}

/// Runs `body` in the compute type of `out` (f64 for f64 tensors, f32 otherwise) and returns
/// the result as a tensor of `out`'s dtype.
macro_rules! with_compute_type {
    ($out:expr, $shape:expr, |$t:ident| $body:expr) => {{
        let out: OutDType = $out;
        if matches!(out.0, DType::F64) {
            type $t = f64;
            <f64 as Compute>::into_tensor($body, $shape, out)
        } else {
            type $t = f32;
            <f32 as Compute>::into_tensor($body, $shape, out)
        }
    }};
}

/// Reads an int tensor as `usize` indices, panicking (with the op name) on negative values.
fn host_indices(t: &FlexTensor, op: &str) -> Vec<usize> {
    let data = t.clone().into_data().convert::<i64>();
    expect_vec(data.try_into_vec::<i64>(), op)
        .into_iter()
        .map(|v| usize::try_from(v).unwrap_or_else(|_| panic!("{op}: negative index {v}")))
        .collect()
}

fn check_bounds(op: &str, idx: &[usize], limit: usize) {
    if let Some(&bad) = idx.iter().find(|&&i| i >= limit) {
        panic!("{op}: index {bad} out of range for {limit} rows");
    }
}

fn int_tensor(values: Vec<i32>) -> FlexTensor {
    let n = values.len();
    FlexTensor::from_data(TensorData::new(values, [n]))
}

fn dims2(t: &FlexTensor, op: &str) -> [usize; 2] {
    let s = t.layout().shape();
    assert!(
        s.num_dims() == 2,
        "{op}: expected a 2-D tensor, got shape {s:?}"
    );
    [s[0], s[1]]
}

fn to_i32(v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("moe ops: index {v} does not fit in i32"))
}

fn unpermute_impl(
    rows: FlexTensor,
    sorted_indices: FlexTensor,
    probs: Option<FlexTensor>,
    num_tokens: usize,
) -> FlexTensor {
    let op = "moe_unpermute";
    let [n, h] = dims2(&rows, op);
    let idx = host_indices(&sorted_indices, op);
    assert_eq!(idx.len(), n, "{op}: {n} rows but {} indices", idx.len());
    check_bounds(op, &idx, num_tokens);
    let (host, out) = host_float(&rows, op);
    let probs = probs.as_ref().map(|p| host_float(p, op).0);
    with_compute_type!(out, Shape::new([num_tokens, h]), |T| {
        let rows = T::from_host(host);
        let probs = probs.map(T::from_host);
        if let Some(p) = &probs {
            assert_eq!(p.len(), n, "{op}: {} probs for {n} rows", p.len());
        }
        kernels::scatter_add_rows(&rows, h, &idx, probs.as_deref(), num_tokens)
    })
}

impl MoeOps for Flex {
    fn moe_routing_index(
        routing_map: BoolTensor<Self>,
        capacity: Option<usize>,
    ) -> (IntTensor<Self>, IntTensor<Self>, IntTensor<Self>) {
        let op = "moe_routing_index";
        let [t, e] = dims2(&routing_map, op);
        let data = routing_map.into_data();
        let map: Vec<bool> = expect_vec(data.try_into_vec::<bool>(), op);
        let mut sorted = Vec::new();
        let mut probs_index = Vec::new();
        let mut per_expert = Vec::with_capacity(e);
        for expert in 0..e {
            let before = sorted.len();
            let routed = (0..t).filter(|&tok| map[tok * e + expert]);
            match capacity {
                None => sorted.extend(routed),
                Some(cap) => {
                    let unrouted = (0..t).filter(|&tok| !map[tok * e + expert]);
                    sorted.extend(routed.chain(unrouted).take(cap));
                }
            }
            for &tok in &sorted[before..] {
                probs_index.push(to_i32(tok * e + expert));
            }
            per_expert.push(to_i32(sorted.len() - before));
        }
        let sorted: Vec<i32> = sorted.into_iter().map(to_i32).collect();
        (
            int_tensor(sorted),
            int_tensor(probs_index),
            int_tensor(per_expert),
        )
    }

    fn moe_topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        let op = "moe_topk_indices";
        let [t, e] = dims2(&scores, op);
        assert!(k <= e, "{op}: k = {k} exceeds {e} columns");
        let (host, _) = host_float(&scores, op);
        let values = <f64 as Compute>::from_host(host);
        let mut out = vec![0i32; t * k];
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for (row, dst) in values
            .chunks_exact(e.max(1))
            .zip(out.chunks_exact_mut(k.max(1)))
        {
            order.clear();
            order.extend(0..e);
            // Descending value, ascending index among ties; NaN sorts last.
            let key = |i: &usize| row[*i];
            order.sort_by(|a, b| {
                key(b)
                    .partial_cmp(&key(a))
                    .unwrap_or_else(|| key(a).is_nan().cmp(&key(b).is_nan()))
                    .then(a.cmp(b))
            });
            for (d, &i) in dst.iter_mut().zip(&order[..k]) {
                *d = to_i32(i);
            }
        }
        FlexTensor::from_data(TensorData::new(out, [t, k]))
    }

    fn moe_permute(
        tokens: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let op = "moe_permute";
        let [t, h] = dims2(&tokens, op);
        let idx = host_indices(&sorted_indices, op);
        check_bounds(op, &idx, t);
        let n = idx.len();
        let tokens = tokens.to_contiguous();
        macro_rules! gather {
            ($ty:ty) => {{
                let src = tokens.as_slice::<$ty>().expect("contiguous");
                let out = kernels::gather_rows(src, h, &idx);
                FlexTensor::from_data(TensorData::new(out, [n, h]))
            }};
        }
        match tokens.dtype() {
            DType::F32 => gather!(f32),
            DType::F64 => gather!(f64),
            DType::F16 => gather!(burn::tensor::f16),
            DType::BF16 => gather!(burn::tensor::bf16),
            other => panic!("{op}: unsupported dtype {other:?}"),
        }
    }

    fn moe_unpermute(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        unpermute_impl(rows, sorted_indices, None, num_tokens)
    }

    fn moe_unpermute_weighted(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        probs: FloatTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        unpermute_impl(rows, sorted_indices, Some(probs), num_tokens)
    }

    fn moe_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
        transpose_weights: bool,
    ) -> FloatTensor<Self> {
        let op = "moe_grouped_matmul";
        let [n, k] = dims2(&x, op);
        let ws = weights.layout().shape().clone();
        assert!(ws.num_dims() == 3, "{op}: weights must be 3-D, got {ws:?}");
        let (g, a, b) = (ws[0], ws[1], ws[2]);
        let (layout, m) = if transpose_weights {
            (GemmWeightLayout::OutIn, a)
        } else {
            (GemmWeightLayout::InOut, b)
        };
        let in_dim = if transpose_weights { b } else { a };
        assert_eq!(
            in_dim, k,
            "{op}: x has {k} columns, weights expect {in_dim}"
        );
        let sizes = host_indices(&group_sizes, op);
        assert_eq!(
            sizes.len(),
            g,
            "{op}: {} group sizes for {g} groups",
            sizes.len()
        );
        let sum: usize = sizes.iter().sum();
        assert_eq!(sum, n, "{op}: group sizes sum to {sum} but x has {n} rows");
        let (xh, out) = host_float(&x, op);
        let (wh, _) = host_float(&weights, op);
        with_compute_type!(out, Shape::new([n, m]), |T| {
            let xv = T::from_host(xh);
            let wv = T::from_host(wh);
            kernels::grouped_gemm(&xv, k, &wv, m, &sizes, layout)
        })
    }

    fn moe_grouped_matmul_wgrad(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let op = "moe_grouped_matmul_wgrad";
        let [n, p] = dims2(&lhs, op);
        let [n2, q] = dims2(&rhs, op);
        assert_eq!(n, n2, "{op}: lhs has {n} rows, rhs {n2}");
        let sizes = host_indices(&group_sizes, op);
        let sum: usize = sizes.iter().sum();
        assert_eq!(
            sum, n,
            "{op}: group sizes sum to {sum} but inputs have {n} rows"
        );
        let (ah, out) = host_float(&lhs, op);
        let (bh, _) = host_float(&rhs, op);
        with_compute_type!(out, Shape::new([sizes.len(), p, q]), |T| {
            let av = T::from_host(ah);
            let bv = T::from_host(bh);
            kernels::grouped_gemm_wgrad(&av, p, &bv, q, &sizes)
        })
    }

    fn moe_sort_chunks(
        x: FloatTensor<Self>,
        split_sizes: Vec<usize>,
        sorted_idxs: Vec<usize>,
    ) -> FloatTensor<Self> {
        let op = "moe_sort_chunks";
        let [n, _] = dims2(&x, op);
        let sum: usize = split_sizes.iter().sum();
        assert_eq!(sum, n, "{op}: split sizes sum to {sum} but x has {n} rows");
        if let Err(e) = super::check_permutation(op, &sorted_idxs, split_sizes.len()) {
            panic!("{e}");
        }
        let index: Vec<i32> = kernels::sort_chunks_row_index(&split_sizes, &sorted_idxs)
            .into_iter()
            .map(to_i32)
            .collect();
        Self::moe_permute(x, int_tensor(index))
    }

    fn moe_swiglu(hidden: FloatTensor<Self>, probs: FloatTensor<Self>) -> FloatTensor<Self> {
        let op = "moe_swiglu";
        let [n, two_f] = dims2(&hidden, op);
        let f = two_f / 2;
        assert_eq!(
            probs.layout().shape().num_elements(),
            n,
            "{op}: probs must have {n} rows"
        );
        let (hh, out) = host_float(&hidden, op);
        let (ph, _) = host_float(&probs, op);
        with_compute_type!(out, Shape::new([n, f]), |T| {
            kernels::swiglu_probs(&T::from_host(hh), f, &T::from_host(ph))
        })
    }

    fn moe_swiglu_backward(
        hidden: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let op = "moe_swiglu_backward";
        let [n, two_f] = dims2(&hidden, op);
        let f = two_f / 2;
        assert_eq!(dims2(&grad, op), [n, f], "{op}: grad must be [{n}, {f}]");
        let (hh, out) = host_float(&hidden, op);
        // The probs' gradient in the probs' dtype (f32 router probs with BF16 activations):
        // computed in f32 and rounded once, if at all.
        let (ph, probs_out) = host_float(&probs, op);
        let (gh, _) = host_float(&grad, op);
        macro_rules! run {
            ($t:ty) => {{
                let (dh, dp) = kernels::swiglu_probs_backward(
                    &<$t as Compute>::from_host(hh),
                    f,
                    &<$t as Compute>::from_host(ph),
                    &<$t as Compute>::from_host(gh),
                );
                (
                    <$t as Compute>::into_tensor(dh, Shape::new([n, two_f]), out),
                    <$t as Compute>::into_tensor(dp, Shape::new([n]), probs_out),
                )
            }};
        }
        if matches!(out.0, DType::F64) {
            run!(f64)
        } else {
            run!(f32)
        }
    }

    fn moe_attach_loss(
        x: FloatTensor<Self>,
        _loss: FloatTensor<Self>,
        _grad_scale: f64,
    ) -> FloatTensor<Self> {
        x
    }
}
