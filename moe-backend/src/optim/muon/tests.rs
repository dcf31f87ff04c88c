//! Muon: Newton–Schulz against an f64 reference and its singular-value property; the hybrid
//! Muon + AdamW on one rank against a reference written from the update rule; the distributed
//! optimizer (DP, TP, EP, ETP; replicated and layer-wise state) against the one-rank run on the
//! whole batch.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor};

use super::*;
use crate::comm::World;
use crate::comm::autograd::reduce_from_tensor_parallel_region;
use crate::dispatch::{LocalDispatcher, TokenDispatcher};
use crate::optim::default_classify;
use crate::optim::tests::{E, H as MOE_H, STEPS, ad, batch, loss, rank_layer, reference_layer};
use crate::parallel::tensor_parallel::{column_parallel_linear, row_parallel_linear};
use crate::parallel::{ParallelLayout, replicate};
use crate::testing::{SplitMix, assert_close, tensor, values};

const LR: f64 = 0.05;
const WD: f32 = 0.1;

// ---------------------------------------------------------------------------------------------
// (a) Newton–Schulz

/// Row-major `[r, c]` f64 matrix product `a [r, k] · b [k, c]`.
fn matmul(a: &[f64], b: &[f64], r: usize, k: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..c {
                out[i * c + j] += x * b[p * c + j];
            }
        }
    }
    out
}

fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = a[i * c + j];
        }
    }
    out
}

/// The iteration written from its formula in f64: X = G/(‖G‖_F + 1e-7) (transposed when
/// m > n), X ← aX + (bA + cA²)X with A = XXᵀ.
fn ns_reference(g: &[f64], m: usize, n: usize, steps: usize) -> Vec<f64> {
    let (a, b, c) = (3.4445, -4.7750, 2.0315);
    let tr = m > n;
    let (r, k) = if tr { (n, m) } else { (m, n) };
    let mut x = if tr { transpose(g, m, n) } else { g.to_vec() };
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
    x.iter_mut().for_each(|v| *v /= norm);
    for _ in 0..steps {
        let gram = matmul(&x, &transpose(&x, r, k), r, k, r);
        let gram2 = matmul(&gram, &gram, r, r, r);
        let poly: Vec<f64> = gram
            .iter()
            .zip(&gram2)
            .map(|(p, q)| b * p + c * q)
            .collect();
        let px = matmul(&poly, &x, r, r, k);
        x = x.iter().zip(&px).map(|(v, w)| a * v + w).collect();
    }
    if tr { transpose(&x, r, k) } else { x }
}

/// Eigenvalues of a symmetric `[k, k]` matrix (cyclic Jacobi).
fn symmetric_eigenvalues(mut a: Vec<f64>, k: usize) -> Vec<f64> {
    for _ in 0..100 {
        let off: f64 = (0..k)
            .flat_map(|i| (0..k).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * k + j].powi(2))
            .sum();
        if off < 1e-24 {
            break;
        }
        for p in 0..k {
            for q in p + 1..k {
                let apq = a[p * k + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * k + q] - a[p * k + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for i in 0..k {
                    let (aip, aiq) = (a[i * k + p], a[i * k + q]);
                    a[i * k + p] = c * aip - s * aiq;
                    a[i * k + q] = s * aip + c * aiq;
                }
                for j in 0..k {
                    let (apj, aqj) = (a[p * k + j], a[q * k + j]);
                    a[p * k + j] = c * apj - s * aqj;
                    a[q * k + j] = s * apj + c * aqj;
                }
            }
        }
    }
    (0..k).map(|i| a[i * k + i]).collect()
}

/// Singular values of a row-major `[m, n]` matrix.
fn singular_values(o: &[f64], m: usize, n: usize) -> Vec<f64> {
    let (x, r, k) = if m > n {
        (transpose(o, m, n), n, m)
    } else {
        (o.to_vec(), m, n)
    };
    let gram = matmul(&x, &transpose(&x, r, k), r, k, r);
    symmetric_eigenvalues(gram, r)
        .into_iter()
        .map(|l| l.max(0.0).sqrt())
        .collect()
}

/// Full-rank test inputs: wide, tall, a well-conditioned square one and a row.
fn ns_inputs() -> Vec<(Vec<f64>, usize, usize)> {
    let mut rng = SplitMix::new(11);
    let square: Vec<f64> = (0..16 * 16)
        .map(|i| if i % 17 == 0 { 1.0 } else { 0.0 } + 0.3 * rng.uniform(-1.0, 1.0))
        .collect();
    vec![
        (rng.values(6 * 24), 6, 24),
        (rng.values(24 * 6), 24, 6),
        (square, 16, 16),
        (rng.values(7), 1, 7),
    ]
}

#[test]
fn newton_schulz_matches_an_f64_reference() {
    for (g, m, n) in ns_inputs() {
        let expected = ns_reference(&g, m, n, 5);
        let got = values(newton_schulz(
            tensor(g.clone(), [m, n], &Device::flex(), DType::F32),
            5,
        ));
        // f32 against f64: a few ulps per step, amplified by the quintic's slope (≤ 3.4);
        // measured ≤ 9e-7 absolute on entries of ~0.1–0.5.
        assert_close(&got, &expected, 1e-5, 5e-6, &format!("NS [{m}, {n}]"));
    }
    // The batched form orthogonalises each matrix with its own norm; bf16 input is cast.
    let inputs: Vec<_> = (0..3)
        .map(|s| SplitMix::new(s + 50).values(4 * 10))
        .collect();
    let stacked: Vec<f64> = inputs.iter().flatten().copied().collect();
    let got = values(newton_schulz_batched(
        tensor(stacked.clone(), [3, 4, 10], &Device::flex(), DType::F32),
        5,
    ));
    for (s, g) in inputs.iter().enumerate() {
        let expected = ns_reference(g, 4, 10, 5);
        assert_close(
            &got[s * 40..(s + 1) * 40],
            &expected,
            1e-5,
            5e-6,
            "batched NS",
        );
    }
    let bf16 = values(newton_schulz_batched(
        tensor(stacked, [3, 4, 10], &Device::flex(), DType::BF16),
        5,
    ));
    // The bf16 rounding of the input (2⁻⁸ relative) moves the result by ~1e-3.
    assert_close(&bf16, &got, 0.0, 0.01, "bf16 input");
}

#[test]
fn newton_schulz_output_has_singular_values_near_one() {
    for (g, m, n) in ns_inputs() {
        let o = values(newton_schulz(
            tensor(g, [m, n], &Device::flex(), DType::F32),
            5,
        ));
        let sv = singular_values(&o, m, n);
        // The quintic's attracting interval is ≈ [0.68, 1.20] (its extrema on (0, 1.2]).
        for s in &sv {
            assert!(
                (0.67..=1.21).contains(s),
                "[{m}, {n}]: singular values {sv:?}"
            );
        }
        // More steps stay inside it.
        let o = values(newton_schulz(
            tensor(o, [m, n], &Device::flex(), DType::F32),
            10,
        ));
        for s in singular_values(&o, m, n) {
            assert!((0.67..=1.21).contains(&s), "[{m}, {n}] after 15 steps: {s}");
        }
    }
    // Scale invariance: NS(c·G) = NS(G).
    let (g, m, n) = ns_inputs().remove(0);
    let a = values(newton_schulz(
        tensor(g.clone(), [m, n], &Device::flex(), DType::F32),
        5,
    ));
    let scaled: Vec<f64> = g.iter().map(|v| v * 37.0).collect();
    let b = values(newton_schulz(
        tensor(scaled, [m, n], &Device::flex(), DType::F32),
        5,
    ));
    assert_close(&b, &a, 1e-4, 1e-5, "scale invariance");
}

#[test]
fn scale_factors_follow_moonshot_and_keller() {
    assert!((MuonScale::MatchAdamW.factor(64, 16) - 1.6).abs() < 1e-6);
    assert!((MuonScale::MatchAdamW.factor(16, 64) - 1.6).abs() < 1e-6);
    assert!((MuonScale::Keller.factor(64, 16) - 2.0).abs() < 1e-6);
    assert_eq!(MuonScale::Keller.factor(16, 64), 1.0);
}

#[test]
fn default_selection_is_megatrons() {
    let info = |path: &str, shape: Vec<usize>, class| ParamInfo {
        id: burn::module::ParamId::new(),
        path: path.into(),
        shape,
        class,
        offset: 0,
    };
    let d = ParamClass::Dense;
    let tp = ParamClass::DenseTpSharded;
    let ex = ParamClass::Expert;
    let sel = |p: &str, s: Vec<usize>, c| default_muon_select(&info(p, s, c));
    assert_eq!(sel("model.embed_tokens.weight", vec![10, 4], tp), None);
    assert_eq!(sel("lm_head.weight", vec![4, 10], tp), None);
    assert_eq!(sel("norm.weight", vec![4], d), None);
    assert_eq!(sel("q_proj.bias", vec![4], tp), None);
    assert_eq!(sel("experts.fc1_bias", vec![2, 4], ex), None);
    let m = |rows_are_outputs, split| {
        Some(MuonMatrix {
            rows_are_outputs,
            split,
        })
    };
    assert_eq!(sel("mlp.up_proj.weight", vec![4, 8], d), m(false, None));
    assert_eq!(
        sel(
            "router.weight",
            vec![8, 4],
            ParamClass::DenseSequenceParallel
        ),
        m(true, None)
    );
    assert_eq!(
        sel("attn.q_proj.weight", vec![4, 8], tp),
        m(false, Some(MatrixAxis::Cols))
    );
    assert_eq!(
        sel("attn.o_proj.weight", vec![8, 4], tp),
        m(false, Some(MatrixAxis::Rows))
    );
    assert_eq!(
        sel("experts.fc1", vec![2, 8, 4], ex),
        m(true, Some(MatrixAxis::Rows))
    );
    assert_eq!(
        sel("experts.fc2", vec![2, 4, 8], ex),
        m(true, Some(MatrixAxis::Cols))
    );
}

// ---------------------------------------------------------------------------------------------
// (b) one rank against the update rule

const H: usize = 8;
const F: usize = 12;
const O: usize = 4;
const T: usize = 3;

/// Every kind of parameter: a 1-D norm weight and an `embed` matrix (AdamW), a linear with a
/// bias (weight: Muon, no transpose; bias: AdamW), a linear without (Muon, transposed: 12 > 8),
/// and a stack of two `[out, in]` matrices (Muon per slice).
#[derive(Module, Debug)]
struct Net {
    norm: Param<Tensor<1>>,
    embed: Param<Tensor<2>>,
    fc1: Linear,
    fc2: Linear,
    stack: Param<Tensor<3>>,
}

fn param<const D: usize>(seed: u64, shape: [usize; D], scale: f64) -> Param<Tensor<D>> {
    let n = shape.iter().product();
    let v = SplitMix::new(seed)
        .values(n)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    Param::from_tensor(tensor(v, shape, &ad(), DType::F32))
}

fn net() -> Net {
    let mut fc1 = LinearConfig::new(H, F).init(&ad());
    fc1.weight = param(2, [H, F], 0.5);
    fc1.bias = Some(param(3, [F], 0.2));
    let mut fc2 = LinearConfig::new(F, H).with_bias(false).init(&ad());
    fc2.weight = param(4, [F, H], 0.5);
    replicate(&Net {
        norm: Param::from_tensor(tensor(vec![1.0; H], [H], &ad(), DType::F32)),
        embed: param(1, [H, H], 0.5),
        fc1,
        fc2,
        stack: param(5, [2, O, H], 0.5),
    })
}

impl Net {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = (x * self.norm.val().unsqueeze::<2>()).matmul(self.embed.val());
        let h = self.fc2.forward(self.fc1.forward(h).tanh());
        let s = self.stack.val();
        (0..2)
            .map(|k| {
                let w = s.clone().slice([k..k + 1, 0..O, 0..H]).reshape([O, H]);
                h.clone().matmul(w.transpose())
            })
            .reduce(|a, b| a + b)
            .expect("two slices")
    }

    fn loss(&self, step: usize, replicas: std::ops::Range<usize>) -> Tensor<1> {
        let n = replicas.len();
        let x: Vec<f64> = replicas.clone().flat_map(|r| data(step, r, 1, H)).collect();
        let w: Vec<f64> = replicas.flat_map(|r| data(step, r, 2, O)).collect();
        let x = tensor(x, [n * T, H], &ad(), DType::F32);
        let w = tensor(w, [n * T, O], &ad(), DType::F32);
        (self.forward(x) * w).sum()
    }

    fn flat(&self) -> Vec<f64> {
        [
            values(self.norm.val()),
            values(self.embed.val().reshape([-1])),
            values(self.fc1.weight.val().reshape([-1])),
            values(self.fc1.bias.as_ref().expect("bias").val()),
            values(self.fc2.weight.val().reshape([-1])),
            values(self.stack.val().reshape([-1])),
        ]
        .concat()
    }
}

/// `T` rows of `width` values of replica `replica` at `step`.
fn data(step: usize, replica: usize, tag: u64, width: usize) -> Vec<f64> {
    SplitMix::new(tag * 7_919 + (step * 64 + replica) as u64).values(T * width)
}

fn muon_config(scale: MuonScale, sharding: MuonSharding) -> MuonConfig {
    MuonConfig {
        weight_decay: WD,
        scale,
        sharding,
        ..MuonConfig::default()
    }
}

fn adamw_config(max_grad_norm: Option<f64>) -> DistributedAdamWConfig {
    DistributedAdamWConfig {
        weight_decay: WD,
        max_grad_norm,
        ..DistributedAdamWConfig::default()
    }
}

/// Muon written from the update rule in f64 for one `[L, m, n]` parameter.
struct ReferenceMuon {
    momentum: Vec<f64>,
    dims: [usize; 3],
    rows_are_outputs: bool,
}

impl ReferenceMuon {
    fn update(&mut self, w: &mut [f64], g: &[f64], scale: MuonScale) {
        let beta = 0.95;
        let [l, m, n] = self.dims;
        let mut u = vec![0.0; g.len()];
        for i in 0..g.len() {
            self.momentum[i] = beta * self.momentum[i] + (1.0 - beta) * g[i];
            u[i] = (1.0 - beta) * g[i] + beta * self.momentum[i]; // Nesterov
        }
        let (fan_out, fan_in) = if self.rows_are_outputs {
            (m, n)
        } else {
            (n, m)
        };
        let s = match scale {
            MuonScale::MatchAdamW => 0.2 * (fan_out.max(fan_in) as f64).sqrt(),
            MuonScale::Keller => (fan_out as f64 / fan_in as f64).max(1.0).sqrt(),
        };
        for b in 0..l {
            let o = ns_reference(&u[b * m * n..(b + 1) * m * n], m, n, 5);
            for (k, ok) in o.iter().enumerate() {
                let p = &mut w[b * m * n + k];
                *p = *p * (1.0 - LR * WD as f64) - LR * s * ok;
            }
        }
    }
}

/// Reference run: the gradients clipped by their global norm over all parameters when
/// `max_grad_norm` is set, then Burn's AdamW for the AdamW parameters and [`ReferenceMuon`] for
/// the others. Returns the flat parameters and the grad norm after every step.
fn reference_run(scale: MuonScale, max_grad_norm: Option<f64>) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut net = net();
    let mut adamw = AdamWConfig::new()
        .with_weight_decay(WD)
        .with_epsilon(1e-8)
        .init();
    let muon = |dims: [usize; 3], rows_are_outputs| ReferenceMuon {
        momentum: vec![0.0; dims.iter().product()],
        dims,
        rows_are_outputs,
    };
    let (mut m1, mut m2, mut m3) = (
        muon([1, H, F], false),
        muon([1, F, H], false),
        muon([2, O, H], true),
    );
    let (mut out, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let mut grads = GradientsParams::from_grads(net.loss(step, 0..1).backward(), &net);
        let g1 = values(grads.remove::<2>(net.fc1.weight.id).unwrap().reshape([-1]));
        let g2 = values(grads.remove::<2>(net.fc2.weight.id).unwrap().reshape([-1]));
        let g3 = values(grads.remove::<3>(net.stack.id).unwrap().reshape([-1]));
        let gn = grads.remove::<1>(net.norm.id).unwrap();
        let ge = grads.remove::<2>(net.embed.id).unwrap();
        let bias_id = net.fc1.bias.as_ref().expect("bias").id;
        let gb = grads.remove::<1>(bias_id).unwrap();
        let sq = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        let norm = (sq(&g1) + sq(&g2) + sq(&g3))
            + sq(&values(gn.clone()))
            + sq(&values(ge.clone().reshape([-1])))
            + sq(&values(gb.clone()));
        let norm = norm.sqrt();
        norms.push(norm);
        let c = match max_grad_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        let clip = |g: Vec<f64>| -> Vec<f64> { g.into_iter().map(|x| x * c).collect() };
        grads.register(net.norm.id, gn.mul_scalar(c));
        grads.register(net.embed.id, ge.mul_scalar(c));
        grads.register(bias_id, gb.mul_scalar(c));
        let mut w1 = values(net.fc1.weight.val().reshape([-1]));
        let mut w2 = values(net.fc2.weight.val().reshape([-1]));
        let mut w3 = values(net.stack.val().reshape([-1]));
        m1.update(&mut w1, &clip(g1), scale);
        m2.update(&mut w2, &clip(g2), scale);
        m3.update(&mut w3, &clip(g3), scale);
        net = adamw.step(LR, net, grads);
        let leaf = |v, s| tensor(v, s, &ad(), DType::F32).require_grad();
        net.fc1.weight = Param::initialized(net.fc1.weight.id, leaf(w1, [H, F]));
        net.fc2.weight = Param::initialized(net.fc2.weight.id, leaf(w2, [F, H]));
        let stack = tensor(w3, [2, O, H], &ad(), DType::F32).require_grad();
        net.stack = Param::initialized(net.stack.id, stack);
        out.push(net.flat());
    }
    (out, norms)
}

/// [`MuonAdamW`] on `world` ranks (`layout`), each with its own replica's batch; returns the
/// flat parameters after every step and the reported grad norms of every rank.
fn hybrid_run(
    world: usize,
    muon: MuonConfig,
    max_grad_norm: Option<f64>,
) -> Vec<(Vec<Vec<f64>>, Vec<f64>)> {
    let layout = ParallelLayout::parse(world, "").unwrap();
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut net = net();
        let mut optim = MuonAdamW::new(
            &net,
            &pg,
            ctx.world()?,
            muon.clone(),
            adamw_config(max_grad_norm),
            &default_classify,
            &default_muon_select,
        )?;
        let paths: Vec<_> = optim.muon().params().map(|p| p.path.clone()).collect();
        assert_eq!(paths, ["fc1.weight", "fc2.weight", "stack"]);
        let (mut out, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let r = ctx.rank();
            let l = net.loss(step, r..r + 1);
            let grads = GradientsParams::from_grads(l.backward(), &net);
            let (next, report) = optim.step(LR, net, grads)?;
            net = next;
            out.push(net.flat());
            norms.push(report.grad_norm);
        }
        Ok((out, norms))
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn one_rank_muon_adamw_matches_the_update_rule() {
    for scale in [MuonScale::MatchAdamW, MuonScale::Keller] {
        for clip in [None, Some(0.5)] {
            let (expected, norms) = reference_run(scale, clip);
            let config = muon_config(scale, MuonSharding::Replicated);
            let (got, got_norms) = hybrid_run(1, config, clip).remove(0);
            for s in 0..STEPS {
                let what = format!("{scale:?} clip {clip:?} step {s}");
                assert_close(&got[s], &expected[s], 1e-6, 1e-6, &what);
                assert!(
                    (got_norms[s] - norms[s]).abs() <= 1e-5 * norms[s],
                    "{what}: norm"
                );
            }
            if clip.is_some() {
                assert!(norms.iter().all(|&n| n > 0.5), "clipping must be exercised");
            }
        }
    }
}

/// The reference concatenates the replicas' batches and divides the loss by their number.
fn one_rank_whole_batch(
    replicas: usize,
    muon: MuonConfig,
    max_grad_norm: Option<f64>,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let layout = ParallelLayout::single();
    let mut r = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut net = net();
        let mut optim = MuonAdamW::new(
            &net,
            &pg,
            ctx.world()?,
            muon.clone(),
            adamw_config(max_grad_norm),
            &default_classify,
            &default_muon_select,
        )?;
        let (mut out, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let l = net.loss(step, 0..replicas) / replicas as f64;
            let grads = GradientsParams::from_grads(l.backward(), &net);
            let (next, report) = optim.step(LR, net, grads)?;
            net = next;
            out.push(net.flat());
            norms.push(report.grad_norm);
        }
        Ok((out, norms))
    });
    r.remove(0).unwrap()
}

#[test]
fn data_parallel_muon_adamw_matches_one_rank() {
    // Four ranks: under `LayerWise` one member owns none of the three Muon matrices.
    for world in [2, 4] {
        for sharding in [MuonSharding::Replicated, MuonSharding::LayerWise] {
            for clip in [None, Some(0.5)] {
                let config = muon_config(MuonScale::MatchAdamW, sharding);
                let (expected, norms) = one_rank_whole_batch(world, config.clone(), clip);
                let ranks = hybrid_run(world, config, clip);
                for (r, (got, got_norms)) in ranks.iter().enumerate() {
                    // The replicas stay bit-identical (deterministic reductions and NS).
                    assert_eq!(
                        got, &ranks[0].0,
                        "world {world} {sharding:?}: rank {r} drifted"
                    );
                    for s in 0..STEPS {
                        let what =
                            format!("world {world} {sharding:?} clip {clip:?} rank {r} step {s}");
                        assert_close(&got[s], &expected[s], 1e-5, 1e-6, &what);
                        assert!((got_norms[s] - norms[s]).abs() <= 1e-5 * norms[s], "{what}");
                    }
                }
                if clip.is_some() {
                    assert!(norms.iter().any(|&n| n > 0.5), "clipping must be exercised");
                }
            }
        }
    }
}

#[test]
fn standalone_muon_leaves_other_parameters_and_gradients() {
    let layout = ParallelLayout::single();
    let res = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let net = net();
        let mut muon = DistributedMuon::new(
            &net,
            &pg,
            ctx.world()?,
            MuonConfig::default(),
            &default_classify,
            &default_muon_select,
        )?;
        let view = muon.adamw_view(&net);
        let adamw_table = ParamTable::new(&view, &default_classify);
        let adamw_paths: Vec<_> = adamw_table.params.iter().map(|p| p.path.clone()).collect();
        let mut grads = GradientsParams::from_grads(net.loss(0, 0..1).backward(), &net);
        let before = net.flat();
        let (next, report) = muon.step(LR, net.clone(), &mut grads, None)?;
        assert!(report.grad_norm > 0.0 && report.clip_coeff == 1.0);
        assert_eq!(muon.step_count(), 1);
        let m = muon.momentum(net.fc2.weight.id).expect("momentum");
        assert!(m.iter().any(|&x| x != 0.0));
        assert!(muon.momentum(net.norm.id).is_none());
        assert!(muon.set_momentum(net.norm.id, &[0.0; H]).is_err());
        assert!(muon.set_momentum(net.fc2.weight.id, &m[1..]).is_err());
        let doubled: Vec<f32> = m.iter().map(|x| 2.0 * x).collect();
        muon.set_momentum(net.fc2.weight.id, &doubled)?;
        assert_eq!(muon.momentum(net.fc2.weight.id), Some(doubled.clone()));
        // The Muon gradients were taken, the others left.
        assert!(grads.get::<2>(net.fc1.weight.id).is_none());
        assert!(grads.get::<1>(net.norm.id).is_some());
        assert!(grads.get::<2>(net.embed.id).is_some());
        Ok((adamw_paths, before, next.flat()))
    });
    let (paths, before, after) = res.into_iter().next().unwrap().unwrap();
    assert_eq!(paths, ["norm", "embed", "fc1.bias"]);
    // norm, embed and fc1.bias unchanged; the Muon weights moved.
    let adam_len = H + H * H;
    assert_eq!(before[..adam_len], after[..adam_len]);
    let bias = adam_len + H * F;
    assert_eq!(before[bias..bias + F], after[bias..bias + F]);
    assert_ne!(before[adam_len..bias], after[adam_len..bias]);
}

// ---------------------------------------------------------------------------------------------
// (c) tensor parallelism: a column-parallel then row-parallel MLP behind a replicated input
// projection (sequence-parallel class: partial gradients on each TP rank).

#[derive(Module, Debug)]
struct TpNet {
    norm: Param<Tensor<1>>,
    pre: Param<Tensor<2>>,
    up_proj: Linear,
    down_proj: Linear,
}

fn tp_net() -> TpNet {
    let mut up = LinearConfig::new(H, F).init(&ad());
    up.weight = param(12, [H, F], 0.5);
    up.bias = Some(param(13, [F], 0.2));
    let mut down = LinearConfig::new(F, H).with_bias(false).init(&ad());
    down.weight = param(14, [F, H], 0.5);
    replicate(&TpNet {
        norm: param(10, [H], 1.0),
        pre: param(11, [H, H], 0.5),
        up_proj: up,
        down_proj: down,
    })
}

fn tp_classify(path: &str, _: bool) -> ParamClass {
    if path.starts_with("norm") || path.starts_with("pre") {
        ParamClass::DenseSequenceParallel
    } else {
        ParamClass::DenseTpSharded
    }
}

impl TpNet {
    fn loss(&self, step: usize, replicas: std::ops::Range<usize>, tp: Option<&Comm>) -> Tensor<1> {
        let n = replicas.len();
        let x: Vec<f64> = replicas.clone().flat_map(|r| data(step, r, 3, H)).collect();
        let w: Vec<f64> = replicas.flat_map(|r| data(step, r, 4, H)).collect();
        let x = tensor(x, [n * T, H], &ad(), DType::F32);
        let w = tensor(w, [n * T, H], &ad(), DType::F32);
        let h = (x * self.norm.val().unsqueeze::<2>()).matmul(self.pre.val());
        let y = self.down_proj.forward(self.up_proj.forward(h).tanh());
        let y = match tp {
            Some(tp) => reduce_from_tensor_parallel_region(tp, y).unwrap(),
            None => y,
        };
        (y * w).sum()
    }
}

/// `(norm, pre, up weight, up bias, down weight)` values.
type TpValues = [Vec<f64>; 5];

fn tp_values(net: &TpNet) -> TpValues {
    [
        values(net.norm.val()),
        values(net.pre.val().reshape([-1])),
        values(net.up_proj.weight.val().reshape([-1])),
        values(net.up_proj.bias.as_ref().expect("bias").val()),
        values(net.down_proj.weight.val().reshape([-1])),
    ]
}

fn tp_reference(replicas: usize, muon: MuonConfig) -> Vec<(TpValues, f64)> {
    let layout = ParallelLayout::single();
    let mut r = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut net = tp_net();
        let mut optim = MuonAdamW::new(
            &net,
            &pg,
            ctx.world()?,
            muon.clone(),
            adamw_config(None),
            &tp_classify,
            &default_muon_select,
        )?;
        let mut out = Vec::new();
        for step in 0..STEPS {
            let l = net.loss(step, 0..replicas, None) / replicas as f64;
            let grads = GradientsParams::from_grads(l.backward(), &net);
            let (next, report) = optim.step(LR, net, grads)?;
            net = next;
            out.push((tp_values(&net), report.grad_norm));
        }
        Ok(out)
    });
    r.remove(0).unwrap()
}

fn cols(v: &[f64], width: usize, keep: std::ops::Range<usize>) -> Vec<f64> {
    v.chunks(width)
        .flat_map(|r| r[keep.clone()].to_vec())
        .collect()
}

#[test]
fn tensor_parallel_muon_matches_one_rank() {
    for (world, spec) in [(2, "tp=2"), (4, "tp=2")] {
        for sharding in [MuonSharding::Replicated, MuonSharding::LayerWise] {
            let layout = ParallelLayout::parse(world, spec).unwrap();
            let (tp, dp) = (layout.tp, world / layout.tp);
            let config = muon_config(MuonScale::MatchAdamW, sharding);
            let expected = tp_reference(dp, config.clone());
            let results = World::run(world, |ctx| {
                let pg = ctx.process_groups(&layout)?;
                let tpc = pg.comm(GroupFamily::Tp).clone();
                let full = tp_net();
                let mut net = TpNet {
                    norm: full.norm.clone(),
                    pre: full.pre.clone(),
                    up_proj: column_parallel_linear(&full.up_proj, tpc.rank(), tp)?,
                    down_proj: row_parallel_linear(&full.down_proj, tpc.rank(), tp)?,
                };
                let mut optim = MuonAdamW::new(
                    &net,
                    &pg,
                    ctx.world()?,
                    config.clone(),
                    adamw_config(None),
                    &tp_classify,
                    &default_muon_select,
                )?;
                let replica = pg.comm(GroupFamily::DpCp).rank();
                let mut out = Vec::new();
                for step in 0..STEPS {
                    let l = net.loss(step, replica..replica + 1, Some(&tpc));
                    let grads = GradientsParams::from_grads(l.backward(), &net);
                    let (next, report) = optim.step(LR, net, grads)?;
                    net = next;
                    out.push((tp_values(&net), report.grad_norm));
                }
                Ok((out, tpc.rank()))
            });
            let results: Vec<_> = results
                .into_iter()
                .enumerate()
                .map(|(r, res)| res.unwrap_or_else(|e| panic!("{spec} rank {r}: {e}")))
                .collect();
            for (r, (steps, t)) in results.iter().enumerate() {
                let t = *t;
                // TP-replicated parameters stay bit-identical on every rank.
                for (s, (got, _)) in steps.iter().enumerate() {
                    let first = &results[0].0[s].0;
                    assert_eq!(
                        got[..2],
                        first[..2],
                        "{spec} {sharding:?} rank {r} step {s}"
                    );
                }
                let fc = F / tp;
                for (s, ((got, norm), (exp, exp_norm))) in steps.iter().zip(&expected).enumerate() {
                    let what = |p: &str| format!("{spec} {sharding:?} rank {r} step {s}: {p}");
                    assert!(
                        (norm - exp_norm).abs() <= 1e-5 * exp_norm,
                        "{}",
                        what("norm")
                    );
                    assert_close(&got[0], &exp[0], 1e-5, 1e-6, &what("norm"));
                    assert_close(&got[1], &exp[1], 1e-5, 1e-6, &what("pre"));
                    let up = cols(&exp[2], F, t * fc..(t + 1) * fc);
                    assert_close(&got[2], &up, 1e-5, 1e-6, &what("up_proj (column block)"));
                    let bias = exp[3][t * fc..(t + 1) * fc].to_vec();
                    assert_close(&got[3], &bias, 1e-5, 1e-6, &what("up bias"));
                    let down = exp[4][t * fc * H..(t + 1) * fc * H].to_vec();
                    assert_close(&got[4], &down, 1e-5, 1e-6, &what("down_proj (row block)"));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (c) expert parallelism: the MoE layer of the AdamW tests under EP and EP × ETP.

/// `(router, shared experts, fc1, fc2)` values of a layer.
type MoeValues = [Vec<f64>; 4];

fn moe_values(layer: &crate::layer::MoeLayer) -> MoeValues {
    let shared = layer.shared_experts.as_ref().expect("shared experts");
    [
        values(layer.router.weight.val().reshape([-1])),
        [
            values(shared.gate_proj.weight.val().reshape([-1])),
            values(shared.up_proj.weight.val().reshape([-1])),
            values(shared.down_proj.weight.val().reshape([-1])),
        ]
        .concat(),
        values(layer.experts.fc1.val().reshape([-1])),
        values(layer.experts.fc2.val().reshape([-1])),
    ]
}

#[test]
fn expert_parallel_muon_matches_one_rank() {
    let reference = reference_layer();
    let ffn = reference.experts.ffn_hidden_size();
    for (world, spec) in [(2, "ep=2"), (4, "ep=2,etp=2")] {
        for sharding in [MuonSharding::Replicated, MuonSharding::LayerWise] {
            let config = muon_config(MuonScale::MatchAdamW, sharding);
            let single = ParallelLayout::single();
            let expected = World::run(1, |ctx| {
                let pg = ctx.process_groups(&single)?;
                let mut layer = replicate(&reference);
                let mut optim = MuonAdamW::new(
                    &layer,
                    &pg,
                    ctx.world()?,
                    config.clone(),
                    adamw_config(None),
                    &default_classify,
                    &default_muon_select,
                )?;
                let mut out = Vec::new();
                for step in 0..STEPS {
                    let x: Vec<f64> = (0..world).flat_map(|r| batch(step, r, 1)).collect();
                    let w: Vec<f64> = (0..world).flat_map(|r| batch(step, r, 2)).collect();
                    let rows = x.len() / MOE_H;
                    let x = tensor(x, [rows, MOE_H], &ad(), DType::F32);
                    let w = tensor(w, [rows, MOE_H], &ad(), DType::F32);
                    let l = loss(&layer, x, w, &LocalDispatcher::new(E)) / world as f64;
                    let grads = GradientsParams::from_grads(l.backward(), &layer);
                    let (next, report) = optim.step(LR, layer, grads)?;
                    layer = next;
                    out.push((moe_values(&layer), report.grad_norm));
                }
                Ok(out)
            })
            .remove(0)
            .unwrap();
            let layout = ParallelLayout::parse(world, spec).unwrap();
            let results = World::run(world, |ctx| {
                let pg = ctx.process_groups(&layout)?;
                let (dispatcher, mut layer) = rank_layer(&pg, &layout, &reference)?;
                let mut optim = MuonAdamW::new(
                    &layer,
                    &pg,
                    ctx.world()?,
                    config.clone(),
                    adamw_config(None),
                    &default_classify,
                    &default_muon_select,
                )?;
                let mut out = Vec::new();
                for step in 0..STEPS {
                    let r = ctx.rank();
                    let x = tensor(batch(step, r, 1), [4, MOE_H], &ad(), DType::F32);
                    let w = tensor(batch(step, r, 2), [4, MOE_H], &ad(), DType::F32);
                    let l = loss(&layer, x, w, &dispatcher);
                    let grads = GradientsParams::from_grads(l.backward(), &layer);
                    let (next, report) = optim.step(LR, layer, grads)?;
                    layer = next;
                    out.push((moe_values(&layer), report.grad_norm));
                }
                let etp_index = pg.groups.get(GroupFamily::ExptTp).index;
                Ok((out, dispatcher.local_experts(), etp_index))
            });
            let etp = layout.etp;
            let block = ffn / etp;
            for (r, res) in results.into_iter().enumerate() {
                let (steps, local, t) = res.unwrap_or_else(|e| panic!("{spec} rank {r}: {e}"));
                for (s, ((got, norm), (exp, exp_norm))) in steps.iter().zip(&expected).enumerate() {
                    let what = |p: &str| format!("{spec} {sharding:?} rank {r} step {s}: {p}");
                    assert!(
                        (norm - exp_norm).abs() <= 1e-5 * exp_norm,
                        "{}",
                        what("norm")
                    );
                    assert_close(&got[0], &exp[0], 1e-5, 1e-6, &what("router"));
                    assert_close(&got[1], &exp[1], 1e-5, 1e-6, &what("shared experts"));
                    // fc1 [E, 2F, H] → this rank's experts, gate and up rows of its block.
                    let mut fc1 = Vec::new();
                    let mut fc2 = Vec::new();
                    for e in local.clone() {
                        let m = &exp[2][e * 2 * ffn * MOE_H..(e + 1) * 2 * ffn * MOE_H];
                        for half in [0, ffn] {
                            let rows = half + t * block..half + (t + 1) * block;
                            fc1.extend_from_slice(&m[rows.start * MOE_H..rows.end * MOE_H]);
                        }
                        // fc2 [E, H, F] → columns of its block.
                        let m = &exp[3][e * MOE_H * ffn..(e + 1) * MOE_H * ffn];
                        fc2.extend(cols(m, ffn, t * block..(t + 1) * block));
                    }
                    assert_close(&got[2], &fc1, 1e-5, 1e-6, &what("experts fc1"));
                    assert_close(&got[3], &fc2, 1e-5, 1e-6, &what("experts fc2"));
                }
            }
        }
    }
}
