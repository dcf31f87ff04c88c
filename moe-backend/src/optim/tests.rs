//! ZeRO-1 AdamW under several layouts equals Burn's own AdamW on one rank with the whole
//! batch (loss = mean of the ranks' losses), step by step, with global-norm clipping.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor};

use super::*;
use crate::comm::World;
use crate::dispatch::{AllToAllDispatcher, LocalDispatcher, TokenDispatcher};
use crate::layer::{MoeLayer, MoeLayerConfig};
use crate::parallel::{GroupFamily, ParallelLayout, replicate};
use crate::router::{RouteOptions, TopKRouterConfig};
use crate::testing::{SplitMix, assert_close, redraw, tensor, values};

pub(super) const H: usize = 8;
pub(super) const E: usize = 4;
pub(super) const T: usize = 4;
pub(super) const STEPS: usize = 3;
pub(super) const LR: f64 = 0.05;

pub(super) fn ad() -> Device {
    Device::flex().autodiff()
}

pub(super) fn batch(step: usize, rank: usize, tag: u64) -> Vec<f64> {
    let mut rng = SplitMix::new(tag * 100_003 + (step * 64 + rank) as u64);
    (0..T * H).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// The layer every test here starts from, with reproducible weights (`redraw`): with weights
/// from Burn's unseeded initialiser about one draw in a thousand gives a dense gradient element
/// near 1e-8 after clipping, where AdamW's update `g / (|g| + ε)` turns the f32 rounding of the
/// ranks' different summation orders into 1e-4 differences in the parameters (measured over
/// 1800 draws; the same weights fail on every rerun, so it is the draw, not the step).
pub(super) fn reference_layer() -> MoeLayer {
    let router = TopKRouterConfig::new(H, E, 2).with_init_std(0.5);
    let layer = MoeLayerConfig::new(router, 8)
        .with_init_std(0.3)
        .with_shared_ffn_hidden_size(Some(4))
        .init(&ad())
        .unwrap();
    let layer = MoeLayer {
        router: redraw(layer.router, 1, 0.5),
        experts: redraw(layer.experts, 2, 0.3),
        shared_experts: layer.shared_experts.map(|s| redraw(s, 3, 0.3)),
    };
    replicate(&layer)
}

pub(super) fn loss(
    layer: &MoeLayer,
    x: Tensor<2>,
    w: Tensor<2>,
    d: &dyn TokenDispatcher,
) -> Tensor<1> {
    let state = layer.router.init_state();
    let out = layer
        .forward_with(x, &state, &RouteOptions::default(), d)
        .unwrap()
        .output;
    (out * w).sum()
}

pub(super) fn config(
    max_grad_norm: Option<f64>,
    moment_dtype: MomentDtype,
) -> DistributedAdamWConfig {
    DistributedAdamWConfig {
        weight_decay: 0.1,
        max_grad_norm,
        moment_dtype,
        ..DistributedAdamWConfig::default()
    }
}

/// Flat `(dense, expert)` parameters after one step.
type Snapshot = (Vec<f32>, Vec<f32>);

/// One-rank reference with Burn's AdamW; returns the flat parameters after every step and the
/// grad norms.
fn reference_run(
    start: &MoeLayer,
    world: usize,
    max_grad_norm: Option<f64>,
) -> (Vec<Snapshot>, Vec<f64>) {
    let mut layer = replicate(start);
    let table = ParamTable::new(&layer, &default_classify);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.1)
        .with_epsilon(1e-8)
        .init();
    let mut snapshots = Vec::new();
    let mut norms = Vec::new();
    for step in 0..STEPS {
        let x: Vec<f64> = (0..world).flat_map(|r| batch(step, r, 1)).collect();
        let w: Vec<f64> = (0..world).flat_map(|r| batch(step, r, 2)).collect();
        let x = tensor(x, [world * T, H], &ad(), DType::F32);
        let w = tensor(w, [world * T, H], &ad(), DType::F32);
        let l = loss(&layer, x, w, &LocalDispatcher::new(E)) / world as f64;
        let mut grads = GradientsParams::from_grads(l.backward(), &layer);
        // Global norm over every parameter, then clipping by hand.
        let (d, e) = table.flatten_grads(&layer, &mut grads).unwrap();
        let norm = d
            .iter()
            .chain(&e)
            .map(|&g| (g as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        norms.push(norm);
        let coeff = match max_grad_norm {
            Some(m) if norm > m => m / (norm + 1e-6),
            _ => 1.0,
        };
        let mut grads = GradientsParams::new();
        for p in &table.params {
            let buf = if p.class.is_expert() { &e } else { &d };
            let v: Vec<f32> = buf[p.offset..p.offset + p.numel()]
                .iter()
                .map(|&g| (g as f64 * coeff) as f32)
                .collect();
            let v64: Vec<f64> = v.iter().map(|&g| g as f64).collect();
            match p.shape.len() {
                1 => grads.register(p.id, tensor(v64, [p.shape[0]], &Device::flex(), DType::F32)),
                2 => grads.register(
                    p.id,
                    tensor(v64, [p.shape[0], p.shape[1]], &Device::flex(), DType::F32),
                ),
                _ => grads.register(
                    p.id,
                    tensor(
                        v64,
                        [p.shape[0], p.shape[1], p.shape[2]],
                        &Device::flex(),
                        DType::F32,
                    ),
                ),
            }
        }
        layer = optim.step(LR, layer, grads);
        snapshots.push(table.flatten_values(&layer).unwrap());
    }
    (snapshots, norms)
}

/// This rank's AlltoAll dispatcher and its shard of `reference` (router and shared experts
/// replicated, routed experts cut over EP/ETP) under `layout`.
pub(super) fn rank_layer(
    pg: &crate::comm::GroupComms,
    layout: &ParallelLayout,
    reference: &MoeLayer,
) -> crate::Result<(AllToAllDispatcher, MoeLayer)> {
    let dispatcher = AllToAllDispatcher::new(
        pg.comm(GroupFamily::Ep).clone(),
        pg.comm(GroupFamily::ExptTp).clone(),
        pg.comm(GroupFamily::TpEp).clone(),
        E,
    )?;
    let layer = MoeLayer {
        router: replicate(&reference.router),
        experts: reference.experts.shard(
            dispatcher.local_experts(),
            pg.groups.get(GroupFamily::ExptTp).index,
            layout.etp,
        )?,
        shared_experts: reference.shared_experts.as_ref().map(replicate),
    };
    Ok((dispatcher, layer))
}

fn check(world: usize, spec: &str, max_grad_norm: Option<f64>) {
    let layout = ParallelLayout::parse(world, spec).unwrap();
    let reference = reference_layer();
    let (expected, norms) = reference_run(&reference, world, max_grad_norm);
    let (layout_ref, reference_ref) = (&layout, &reference);
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let (dispatcher, mut layer) = rank_layer(&pg, layout_ref, reference_ref)?;
        let mut optim = DistributedAdamW::new(
            &layer,
            &pg,
            ctx.world()?,
            config(max_grad_norm, MomentDtype::F32),
        )?;
        // The state lives on the parameters' device (without autodiff).
        assert_eq!(optim.device(), &ad().without_autodiff());
        let mut out = Vec::new();
        for step in 0..STEPS {
            let r = ctx.rank();
            let x = tensor(batch(step, r, 1), [T, H], &ad(), DType::F32);
            let w = tensor(batch(step, r, 2), [T, H], &ad(), DType::F32);
            let grads =
                GradientsParams::from_grads(loss(&layer, x, w, &dispatcher).backward(), &layer);
            let (next, report) = optim.step(LR, layer, grads)?;
            layer = next;
            let (dense, _) = optim.table().flatten_values(&layer)?;
            let fc1 = values(layer.experts.fc1.val().reshape([-1]));
            out.push((dense, fc1, report.grad_norm));
        }
        Ok((out, dispatcher.local_experts()))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (steps, local) = res.unwrap_or_else(|e| panic!("{spec} rank {r}: {e}"));
        for (s, (dense, fc1, norm)) in steps.iter().enumerate() {
            let what = format!("{spec} rank {r} step {s}");
            assert!(
                (norm - norms[s]).abs() <= 1e-4 * norms[s],
                "{what}: norm {norm} vs {}",
                norms[s]
            );
            let d: Vec<f64> = dense.iter().map(|&v| v as f64).collect();
            let ed: Vec<f64> = expected[s].0.iter().map(|&v| v as f64).collect();
            assert_close(&d, &ed, 1e-4, 1e-5, &format!("{what}: dense params"));
            if layout.etp == 1 {
                // fc1 [E, 2F, H]: this rank's experts are a contiguous block.
                let per = fc1.len() / local.len();
                let ex: Vec<f64> = expected[s].1[local.start * per..local.end * per]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                assert_close(fc1, &ex, 1e-4, 1e-5, &format!("{what}: expert fc1"));
            }
        }
    }
}

#[test]
fn zero1_adamw_matches_one_rank_adamw() {
    for (world, spec) in [
        (1, ""),
        (2, "ep=2"),
        (4, "ep=2"),
        (4, "ep=4"),
        (4, "ep=2,etp=2"),
    ] {
        check(world, spec, None);
    }
}

#[test]
fn global_norm_clipping_matches_one_rank() {
    for (world, spec) in [(2, "ep=2"), (4, "ep=2,etp=2")] {
        check(world, spec, Some(0.05));
    }
}

#[test]
fn bf16_moments_stay_close_to_f32() {
    let layout = ParallelLayout::parse(2, "ep=2").unwrap();
    let reference = reference_layer();
    let (layout_ref, reference_ref) = (&layout, &reference);
    let run = |dtype: MomentDtype| {
        World::run(2, move |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let d = AllToAllDispatcher::new(
                pg.comm(GroupFamily::Ep).clone(),
                pg.comm(GroupFamily::ExptTp).clone(),
                pg.comm(GroupFamily::TpEp).clone(),
                E,
            )?;
            let mut layer = MoeLayer {
                router: replicate(&reference_ref.router),
                experts: reference_ref.experts.shard(d.local_experts(), 0, 1)?,
                shared_experts: reference_ref.shared_experts.as_ref().map(replicate),
            };
            let mut optim = DistributedAdamW::new(&layer, &pg, ctx.world()?, config(None, dtype))?;
            for step in 0..STEPS {
                let x = tensor(batch(step, ctx.rank(), 1), [T, H], &ad(), DType::F32);
                let w = tensor(batch(step, ctx.rank(), 2), [T, H], &ad(), DType::F32);
                let grads = GradientsParams::from_grads(loss(&layer, x, w, &d).backward(), &layer);
                layer = optim.step(LR, layer, grads)?.0;
            }
            Ok(values(layer.router.weight.val()))
        })
    };
    let a = run(MomentDtype::F32);
    let b = run(MomentDtype::Bf16);
    for (x, y) in a.into_iter().zip(b) {
        let (x, y) = (x.unwrap(), y.unwrap());
        // Updates are ~lr per step; bf16 moments perturb them by well under 1%.
        assert_close(&y, &x, 0.0, 0.01 * LR, "bf16 vs f32 moments");
        assert_ne!(x, y, "bf16 moments must actually be rounded");
    }
    let _ = Module::num_params(&reference);
}

/// A dense layer with a bias and a norm-like 1-D weight.
#[derive(Module, Debug)]
struct Tiny {
    linear: burn::nn::Linear,
    norm: burn::module::Param<Tensor<1>>,
}

#[test]
fn weight_decay_exempts_norms_and_biases_as_megatron_does() {
    let layout = ParallelLayout::parse(2, "").unwrap();
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        // The same values on every rank (the optimizer's replicas must agree).
        let param = |v: Vec<f64>, shape: [usize; 2]| {
            burn::module::Param::from_tensor(tensor(v, shape, &ad(), DType::F32))
        };
        let mut linear = burn::nn::LinearConfig::new(3, 2).init(&ad());
        linear.weight = param(vec![0.3, -0.7, 1.1, 0.25, -1.9, 0.6], [3, 2]);
        linear.bias = Some(burn::module::Param::from_tensor(tensor(
            vec![-0.4, 0.8],
            [2],
            &ad(),
            DType::F32,
        )));
        let tiny = Tiny {
            linear,
            norm: burn::module::Param::from_tensor(tensor(
                vec![1.5, -2.0, 0.5],
                [3],
                &ad(),
                DType::F32,
            )),
        };
        let tiny = replicate(&tiny);
        let mut out = Vec::new();
        for exempt in [false, true] {
            let config = DistributedAdamWConfig {
                weight_decay: 0.1,
                exempt_norms_and_biases: exempt,
                ..DistributedAdamWConfig::default()
            };
            let mut optim = DistributedAdamW::new(&tiny, &pg, ctx.world()?, config)?;
            // Zero gradients: the step is the decay alone.
            let x = tensor(vec![1.0, 2.0, 3.0], [1, 3], &ad(), DType::F32);
            let zero = tiny.linear.forward(x).sum().mul_scalar(0.0)
                + tiny.norm.val().sum().mul_scalar(0.0);
            let grads = GradientsParams::from_grads(zero.backward(), &tiny);
            let next = optim.step(LR, tiny.clone(), grads)?.0;
            out.push((
                values(next.linear.weight.val().reshape([-1])),
                values(next.linear.bias.as_ref().map(|b| b.val()).expect("bias")),
                values(next.norm.val()),
            ));
        }
        Ok((
            values(tiny.linear.weight.val().reshape([-1])),
            values(tiny.linear.bias.as_ref().map(|b| b.val()).expect("bias")),
            values(tiny.norm.val()),
            out,
        ))
    });
    let decay = 1.0 - (LR as f32) * 0.1;
    for res in results {
        let (w, b, n, out) = res.unwrap();
        let decayed =
            |v: &[f64]| -> Vec<f64> { v.iter().map(|&x| ((x as f32) * decay) as f64).collect() };
        // Every parameter decays without exemptions.
        assert_eq!(out[0].0, decayed(&w));
        assert_eq!(out[0].1, decayed(&b));
        assert_eq!(out[0].2, decayed(&n));
        // With them: the 2-D weight decays, the bias and the 1-D norm weight do not.
        assert_eq!(out[1].0, decayed(&w));
        assert_eq!(out[1].1, b);
        assert_eq!(out[1].2, n);
    }
}

/// The address of a Flex tensor's storage.
fn storage_address(t: &Tensor<1>) -> usize {
    t.clone()
        .try_into_primitive::<burn_flex::Flex>()
        .expect("a Flex tensor")
        .bytes()
        .as_ptr() as usize
}

/// `step_in_place` updates the master weights in their own storage on the CPU backend (the
/// module's views of them let go first) and gives the same parameters, bit for bit, as
/// `step` while the caller keeps a clone of the module, which forces a copy of the master.
#[test]
fn step_in_place_updates_the_master_where_it_lies() {
    let reference = reference_layer();
    let reference = &reference;
    World::run(1, |ctx| {
        let layout = ParallelLayout::parse(1, "").unwrap();
        let pg = ctx.process_groups(&layout)?;
        let start = replicate(reference);
        let cfg = config(Some(0.5), MomentDtype::F32);
        let mut a = DistributedAdamW::new(&start, &pg, ctx.world()?, cfg.clone())?;
        let mut b = DistributedAdamW::new(&start, &pg, ctx.world()?, cfg)?;
        let (mut in_place, mut held) = (replicate(&start), replicate(&start));
        for step in 0..STEPS {
            let x = || tensor(batch(step, 0, 1), [T, H], &ad(), DType::F32);
            let w = || tensor(batch(step, 0, 2), [T, H], &ad(), DType::F32);
            let d = LocalDispatcher::new(E);
            let ga =
                GradientsParams::from_grads(loss(&in_place, x(), w(), &d).backward(), &in_place);
            let gb = GradientsParams::from_grads(loss(&held, x(), w(), &d).backward(), &held);
            let before = (
                storage_address(&a.dense.master),
                storage_address(&b.dense.master),
            );
            let ra = a.step_in_place(LR, &mut in_place, ga)?;
            let kept = held.clone();
            let (next, rb) = b.step(LR, held, gb)?;
            held = next;
            assert_eq!(ra, rb, "step {step}");
            assert_eq!(
                a.table().flatten_values(&in_place)?,
                b.table().flatten_values(&held)?
            );
            if step > 0 {
                // From the second step on, the module views the master.
                assert_eq!(
                    storage_address(&a.dense.master),
                    before.0,
                    "step {step}: copied"
                );
                assert_ne!(
                    storage_address(&b.dense.master),
                    before.1,
                    "step {step}: shared"
                );
            }
            drop(kept);
        }
        Ok(())
    })
    .remove(0)
    .unwrap();
}

/// A NaN in one rank's expert gradients: every rank refuses the step (the global norm is the
/// same everywhere), naming the expert group and that rank; master weights, moments, the step
/// count and the module are untouched.
#[test]
fn a_non_finite_gradient_on_one_rank_is_refused_on_every_rank_changing_nothing() {
    let reference = reference_layer();
    let reference = &reference;
    let results = World::run(2, |ctx| {
        let layout = ParallelLayout::parse(2, "ep=2").unwrap();
        let pg = ctx.process_groups(&layout)?;
        let (d, mut layer) = rank_layer(&pg, &layout, reference)?;
        let cfg = config(Some(0.5), MomentDtype::F32);
        let mut optim = DistributedAdamW::new(&layer, &pg, ctx.world()?, cfg)?;
        let x = tensor(batch(0, ctx.rank(), 1), [T, H], &ad(), DType::F32);
        let w = tensor(batch(0, ctx.rank(), 2), [T, H], &ad(), DType::F32);
        let grads = GradientsParams::from_grads(loss(&layer, x, w, &d).backward(), &layer);
        // Poison one expert gradient element on rank 1.
        let mut grads = grads;
        if ctx.rank() == 1 {
            let id = layer.experts.fc1.id;
            let g: Tensor<3> = grads.remove(id).expect("expert gradient");
            let poisoned = g.clone().slice_fill([0..1, 0..1, 0..1], f32::NAN);
            grads.register(id, poisoned);
        }
        let before = (
            optim.table().flatten_values(&layer)?,
            values(optim.dense.master.clone()),
            values(optim.expert.master.clone()),
            optim.step_count(),
        );
        let e = optim
            .step_in_place(LR, &mut layer, grads)
            .expect_err("refused");
        let after = (
            optim.table().flatten_values(&layer)?,
            values(optim.dense.master.clone()),
            values(optim.expert.master.clone()),
            optim.step_count(),
        );
        Ok((e, before == after))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (e, unchanged) = r.unwrap();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                crate::BackendError::NonFiniteGradients { rank: Some(1), .. }
            ),
            "rank {rank}: {text}"
        );
        assert!(
            text.contains("expert parameters") && !text.contains("dense"),
            "{text}"
        );
        assert!(unchanged, "rank {rank}: the refused step changed the state");
    }
}

/// gpt-oss's MoE layer (biased router, experts with biases, clamped SwiGLU) with reproducible
/// weights and biases.
fn biased_clamped_layer() -> MoeLayer {
    let router = TopKRouterConfig::new(H, E, 2)
        .with_init_std(0.5)
        .with_bias(true);
    let layer = MoeLayerConfig::new(router, 8)
        .with_init_std(0.3)
        .with_activation(crate::experts::ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 0.7,
        })
        .with_experts_bias(true)
        .init(&ad())
        .unwrap();
    replicate(&MoeLayer {
        router: redraw(layer.router, 4, 0.5),
        experts: redraw(layer.experts, 5, 0.3),
        shared_experts: None,
    })
}

/// [`default_classify`] with the routed experts' `fc2` bias ETP-replicated (the plan's class
/// for a bias held whole on every expert-TP rank).
fn etp_replicated_fc2_bias(path: &str, in_experts: bool) -> ParamClass {
    if in_experts && path.ends_with("fc2_bias") {
        ParamClass::ExpertTpReplicated
    } else {
        default_classify(path, in_experts)
    }
}

/// Per step: the global norm, the dense parameters and this rank's `fc2` bias; with the
/// rank's local experts.
type BiasRun = (Vec<(f64, Vec<f32>, Vec<f32>)>, std::ops::Range<usize>);

/// Trains `start` under `(world, spec)` for [`STEPS`] clipped steps (each rank its own batch,
/// the `world = 1` run all of them with the loss divided by their count, so the gradients are
/// the same), classes by `classify`.
fn biased_run(
    start: &MoeLayer,
    (world, spec): (usize, &str),
    batches: usize,
    classify: fn(&str, bool) -> ParamClass,
) -> Vec<BiasRun> {
    let layout = ParallelLayout::parse(world, spec).unwrap();
    let layout = &layout;
    World::run(world, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let (dispatcher, mut layer) = rank_layer(&pg, layout, start)?;
        let mut optim = DistributedAdamW::with_classes(
            &layer,
            &pg,
            ctx.world()?,
            config(Some(0.05), MomentDtype::F32),
            &classify,
        )?;
        let per = batches / world;
        let mut out = Vec::new();
        for step in 0..STEPS {
            let rows = |tag| -> Vec<f64> {
                (0..per)
                    .flat_map(|b| batch(step, ctx.rank() * per + b, tag))
                    .collect()
            };
            let x = tensor(rows(1), [per * T, H], &ad(), DType::F32);
            let w = tensor(rows(2), [per * T, H], &ad(), DType::F32);
            let l = loss(&layer, x, w, &dispatcher) / per as f64;
            let grads = GradientsParams::from_grads(l.backward(), &layer);
            let (next, report) = optim.step(LR, layer, grads)?;
            layer = next;
            let (dense, _) = optim.table().flatten_values(&layer)?;
            let bias = layer.experts.fc2_bias.as_ref().map(|b| b.val());
            let bias = bias.map(|b| values(b.reshape([-1]))).unwrap_or_default();
            let bias = bias.iter().map(|&v| v as f32).collect();
            out.push((report.grad_norm, dense, bias));
        }
        Ok((out, dispatcher.local_experts()))
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{spec}: {e}")))
    .collect()
}

/// The gpt-oss expert-TP bug's minimal case: the `fc2` bias is held whole on every expert-TP
/// rank with the full gradient on each, so the global norm must count it once. Classed as a
/// plain expert parameter it is counted `etp` times, the norm is too large and clipping
/// scales every update differently from `world = 1`; classed `ExpertTpReplicated`, the norm,
/// the dense parameters and the bias equal the `world = 1` run under `ep = 2, etp = 2` (and
/// `etp = 2` alone).
#[test]
fn an_etp_replicated_expert_bias_counts_once_in_the_norm_and_trains_as_on_one_rank() {
    let start = biased_clamped_layer();
    let one = biased_run(&start, (1, ""), 4, etp_replicated_fc2_bias)
        .remove(0)
        .0;
    for (world, spec) in [(4, "ep=2,etp=2"), (2, "etp=2")] {
        for (rank, (steps, local)) in biased_run(&start, (world, spec), 4, etp_replicated_fc2_bias)
            .into_iter()
            .enumerate()
        {
            for (s, ((norm, dense, bias), (want_norm, want_dense, want_bias))) in
                steps.iter().zip(&one).enumerate()
            {
                let what = format!("{spec} rank {rank} step {s}");
                assert!(
                    (norm - want_norm).abs() <= 1e-6 * want_norm,
                    "{what}: norm {norm} vs {want_norm}"
                );
                let f = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
                assert_close(
                    &f(dense),
                    &f(want_dense),
                    1e-5,
                    1e-6,
                    &format!("{what}: dense"),
                );
                let want_bias = &want_bias[local.start * H..local.end * H];
                assert_close(
                    &f(bias),
                    &f(want_bias),
                    1e-5,
                    1e-6,
                    &format!("{what}: fc2 bias"),
                );
            }
        }
    }
    // The same bias classed as a sharded expert parameter is counted twice under etp = 2.
    let (steps, _) = biased_run(&start, (2, "etp=2"), 4, default_classify).remove(0);
    let (norm, want) = (steps[0].0, one[0].0);
    assert!(
        norm > want * (1.0 + 1e-6),
        "double-counted norm {norm} vs {want}"
    );
}
