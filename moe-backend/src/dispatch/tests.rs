//! Parallel equivalence: an MoE layer with experts spread over EP/ETP ranks (threads) gives the
//! single-rank outputs and, after the data-parallel reductions, the single-rank gradients.

use std::ops::Range;

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor};

use super::*;
use crate::comm::World;
use crate::experts::ExpertActivation;
use crate::layer::{MoeLayer, MoeLayerConfig};
use crate::parallel::{GroupFamily, GroupTable, ParallelLayout, replicate};
use crate::router::{RouteOptions, TopKRouterConfig};
use crate::testing::{SplitMix, assert_close, tensor, values};

const H: usize = 8;
const E: usize = 8;
const K: usize = 2;
const F: usize = 8;

fn ad() -> Device {
    Device::flex().autodiff()
}

fn tokens_of(rank: usize) -> usize {
    3 + rank % 3
}

fn data(tag: u64, rank: usize, len: usize) -> Vec<f64> {
    let mut rng = SplitMix::new(tag * 7919 + rank as u64);
    (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// The layer under test: Megatron's plain one, or gpt-oss's block (router bias, expert biases,
/// clamped SwiGLU with a limit these small pre-activations reach).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Plain,
    GptOss,
}

fn reference_layer(capacity_factor: Option<f64>, variant: Variant) -> MoeLayer {
    let gpt_oss = variant == Variant::GptOss;
    let router = TopKRouterConfig::new(H, E, K)
        .with_init_std(0.5)
        .with_bias(gpt_oss)
        .with_capacity_factor(capacity_factor)
        .with_pad_to_capacity(capacity_factor.is_some());
    let mut cfg = MoeLayerConfig::new(router, F)
        .with_init_std(0.3)
        .with_shared_ffn_hidden_size(Some(4));
    if gpt_oss {
        cfg = cfg
            .with_experts_bias(true)
            .with_activation(ExpertActivation::ClampedSwiGlu {
                alpha: 1.702,
                limit: 0.3,
            });
    }
    let mut layer = cfg.init(&ad()).unwrap();
    if gpt_oss {
        // Non-zero biases (they initialise to zero).
        let param2 = |t: Tensor<2>, tag| {
            let [a, b] = t.dims();
            Param::from_tensor(
                tensor(data(tag, 0, a * b), [a, b], &ad(), DType::F32).require_grad(),
            )
        };
        layer.router.bias = Some(Param::from_tensor(
            tensor(data(3, 0, E), [E], &ad(), DType::F32).require_grad(),
        ));
        layer.experts.fc1_bias = layer.experts.fc1_bias.map(|b| param2(b.val(), 4));
        layer.experts.fc2_bias = layer.experts.fc2_bias.map(|b| param2(b.val(), 5));
    }
    replicate(&layer)
}

#[derive(Debug)]
struct Grads {
    out: Vec<f64>,
    x: Vec<f64>,
    router: Vec<f64>,
    fc1: Vec<f64>,
    fc2: Vec<f64>,
    shared_down: Vec<f64>,
    router_bias: Option<Vec<f64>>,
    fc1_bias: Option<Vec<f64>>,
    fc2_bias: Option<Vec<f64>>,
}

fn run_layer(layer: &MoeLayer, x: Tensor<2>, w: Tensor<2>, d: &dyn TokenDispatcher) -> Grads {
    run_batches(layer, vec![x], vec![w], d)
}

/// Runs every batch separately (capacity is per batch), one backward of the summed losses.
fn run_batches(
    layer: &MoeLayer,
    xs: Vec<Tensor<2>>,
    ws: Vec<Tensor<2>>,
    d: &dyn TokenDispatcher,
) -> Grads {
    let state = layer.router.init_state();
    let outs: Vec<Tensor<2>> = xs
        .iter()
        .map(|x| {
            layer
                .forward_with(x.clone(), &state, &RouteOptions::default(), d)
                .unwrap()
                .output
        })
        .collect();
    let loss = outs
        .iter()
        .zip(ws)
        .map(|(o, w)| (o.clone() * w).sum())
        .reduce(|a, b| a + b)
        .expect("batches");
    let grads = loss.backward();
    let out = Tensor::cat(outs, 0);
    let x = Tensor::cat(
        xs.iter().map(|x| x.grad(&grads).expect("x grad")).collect(),
        0,
    );
    let g = |t: Option<Tensor<3>>| values(t.expect("grad").reshape([-1]));
    let g2 = |p: &Option<Param<Tensor<2>>>| {
        p.as_ref()
            .map(|p| values(p.val().grad(&grads).expect("bias grad")))
    };
    let shared = layer.shared_experts.as_ref().expect("shared experts");
    Grads {
        out: values(out),
        x: values(x),
        router: values(layer.router.weight.val().grad(&grads).expect("router grad")),
        fc1: g(layer.experts.fc1.val().grad(&grads)),
        fc2: g(layer.experts.fc2.val().grad(&grads)),
        shared_down: values(
            shared
                .down_proj
                .weight
                .val()
                .grad(&grads)
                .expect("shared grad"),
        ),
        router_bias: layer
            .router
            .bias
            .as_ref()
            .map(|b| values(b.val().grad(&grads).expect("router bias grad"))),
        fc1_bias: g2(&layer.experts.fc1_bias),
        fc2_bias: g2(&layer.experts.fc2_bias),
    }
}

/// Rows `[start, start+rows)` of a row-major `[_, cols]` buffer.
fn rows(v: &[f64], start: usize, count: usize, cols: usize) -> Vec<f64> {
    v[start * cols..(start + count) * cols].to_vec()
}

/// Reference expert-grad shard for `experts` and ETP block `t` of `etp` (independent of
/// `GroupedExperts::shard`): fc1 `[E,2F,H]` gate/up rows, fc2 `[E,H,F]` columns.
fn shard_ref(
    fc1: &[f64],
    fc2: &[f64],
    experts: Range<usize>,
    t: usize,
    etp: usize,
) -> (Vec<f64>, Vec<f64>) {
    let b = F / etp;
    let mut a = Vec::new();
    let mut c = Vec::new();
    for e in experts {
        for half in 0..2 {
            for r in half * F + t * b..half * F + (t + 1) * b {
                a.extend_from_slice(&fc1[(e * 2 * F + r) * H..(e * 2 * F + r + 1) * H]);
            }
        }
        for h in 0..H {
            c.extend_from_slice(&fc2[(e * H + h) * F + t * b..(e * H + h) * F + (t + 1) * b]);
        }
    }
    (a, c)
}

fn sum_into(acc: &mut Vec<f64>, v: &[f64]) {
    if acc.is_empty() {
        acc.resize(v.len(), 0.0);
    }
    for (a, b) in acc.iter_mut().zip(v) {
        *a += b;
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    AllGather,
    AllToAll,
    Flex,
}

fn check_equivalence(world: usize, spec: &str, kind: Kind) {
    check_with_capacity(world, spec, kind, None, Variant::Plain);
}

/// Reference bias-grad shard for `experts` and ETP block `t` of `etp`: fc1's bias `[E, 2F]`
/// gate/up columns of the block, fc2's bias `[E, H]` whole (replicated over ETP).
fn bias_shard_ref(
    b1: &[f64],
    b2: &[f64],
    experts: Range<usize>,
    t: usize,
    etp: usize,
) -> (Vec<f64>, Vec<f64>) {
    let b = F / etp;
    let mut a = Vec::new();
    for e in experts.clone() {
        for half in 0..2 {
            let start = e * 2 * F + half * F + t * b;
            a.extend_from_slice(&b1[start..start + b]);
        }
    }
    (a, b2[experts.start * H..experts.end * H].to_vec())
}

/// With `capacity_factor`, experts drop and pad to a capacity computed from each rank's own
/// tokens (as in Megatron), so the reference runs every rank's batch separately.
fn check_with_capacity(
    world: usize,
    spec: &str,
    kind: Kind,
    capacity_factor: Option<f64>,
    variant: Variant,
) {
    let layout = ParallelLayout::parse(world, spec).unwrap();
    let table = GroupTable::new(&layout).unwrap();
    let reference = reference_layer(capacity_factor, variant);
    let counts: Vec<usize> = (0..world).map(tokens_of).collect();
    let total: usize = counts.iter().sum();
    let xs: Vec<Vec<f64>> = (0..world).map(|r| data(1, r, counts[r] * H)).collect();
    let ws: Vec<Vec<f64>> = (0..world).map(|r| data(2, r, counts[r] * H)).collect();
    let expected = if capacity_factor.is_some() {
        let leaf =
            |r: usize, v: &[Vec<f64>]| tensor(v[r].clone(), [counts[r], H], &ad(), DType::F32);
        run_batches(
            &reference,
            (0..world).map(|r| leaf(r, &xs).require_grad()).collect(),
            (0..world).map(|r| leaf(r, &ws)).collect(),
            &LocalDispatcher::new(E),
        )
    } else {
        let x_all = tensor(xs.concat(), [total, H], &ad(), DType::F32).require_grad();
        let w_all = tensor(ws.concat(), [total, H], &ad(), DType::F32);
        run_layer(&reference, x_all, w_all, &LocalDispatcher::new(E))
    };

    let (layout_ref, reference_ref, xs_ref, ws_ref) = (&layout, &reference, &xs, &ws);
    let got = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let comm = |f| pg.comm(f).clone();
        let dispatcher: Box<dyn TokenDispatcher> = match kind {
            Kind::AllGather => Box::new(AllGatherDispatcher::new(
                comm(GroupFamily::TpEp),
                E,
                layout_ref.ep,
                layout_ref.etp,
            )?),
            Kind::Flex => Box::new(FlexDispatcher::new(
                comm(GroupFamily::TpEp),
                E,
                layout_ref.ep,
                layout_ref.etp,
            )?),
            Kind::AllToAll => Box::new(AllToAllDispatcher::new(
                comm(GroupFamily::Ep),
                comm(GroupFamily::ExptTp),
                comm(GroupFamily::TpEp),
                E,
            )?),
        };
        let local = dispatcher.local_experts();
        assert_eq!(local, pg.groups.local_expert_ids(E)?);
        let layer = MoeLayer {
            router: replicate(&reference_ref.router),
            experts: reference_ref.experts.shard(
                local.clone(),
                pg.groups.get(GroupFamily::ExptTp).index,
                layout_ref.etp,
            )?,
            shared_experts: reference_ref.shared_experts.as_ref().map(replicate),
        };
        let r = ctx.rank();
        let x = tensor(xs_ref[r].clone(), [tokens_of(r), H], &ad(), DType::F32).require_grad();
        let w = tensor(ws_ref[r].clone(), [tokens_of(r), H], &ad(), DType::F32);
        Ok(run_layer(&layer, x, w, dispatcher.as_ref()))
    });
    let got: Vec<Grads> = got
        .into_iter()
        .enumerate()
        .map(|(r, g)| g.unwrap_or_else(|e| panic!("{spec} rank {r}: {e}")))
        .collect();

    let what = |s: &str| format!("{spec} {kind:?} {variant:?}: {s}");
    let mut start = 0;
    let (mut router, mut shared, mut router_bias) = (Vec::new(), Vec::new(), Vec::new());
    for (r, g) in got.iter().enumerate() {
        let n = counts[r];
        assert_close(
            &g.out,
            &rows(&expected.out, start, n, H),
            1e-4,
            1e-6,
            &what(&format!("output rank {r}")),
        );
        assert_close(
            &g.x,
            &rows(&expected.x, start, n, H),
            1e-4,
            1e-6,
            &what(&format!("dx rank {r}")),
        );
        sum_into(&mut router, &g.router);
        sum_into(&mut shared, &g.shared_down);
        if let Some(b) = &g.router_bias {
            sum_into(&mut router_bias, b);
        }
        start += n;
    }
    if let Some(b) = &expected.router_bias {
        assert_close(&router_bias, b, 1e-4, 1e-6, &what("router bias grad"));
    }
    // Replicated params: the sum over every rank (the DP reduction) is the one-rank grad.
    assert_close(&router, &expected.router, 1e-4, 1e-6, &what("router grad"));
    assert_close(
        &shared,
        &expected.shared_down,
        1e-4,
        1e-6,
        &what("shared-expert grad"),
    );
    // Experts: summed over expt_dp equals the reference shard of (ep rank, etp rank).
    for group in table.groups(GroupFamily::ExptDp) {
        let (mut fc1, mut fc2) = (Vec::new(), Vec::new());
        for &r in group {
            sum_into(&mut fc1, &got[r].fc1);
            sum_into(&mut fc2, &got[r].fc2);
        }
        let pg = table.for_rank(group[0]).unwrap();
        let local = pg.local_expert_ids(E).unwrap();
        let t = pg.get(GroupFamily::ExptTp).index;
        if let (Some(b1), Some(b2)) = (&expected.fc1_bias, &expected.fc2_bias) {
            let (mut g1, mut g2) = (Vec::new(), Vec::new());
            for &r in group {
                sum_into(&mut g1, got[r].fc1_bias.as_ref().expect("fc1 bias grad"));
                sum_into(&mut g2, got[r].fc2_bias.as_ref().expect("fc2 bias grad"));
            }
            let (a, c) = bias_shard_ref(b1, b2, local.clone(), t, layout.etp);
            let name = |b: &str| what(&format!("{b} grad of expt_dp {group:?}"));
            assert_close(&g1, &a, 1e-4, 1e-6, &name("fc1 bias"));
            // Every ETP rank holds the full gradient of its replicated fc2 bias.
            assert_close(&g2, &c, 1e-4, 1e-6, &name("fc2 bias"));
        }
        let (a, c) = shard_ref(&expected.fc1, &expected.fc2, local, t, layout.etp);
        assert_close(
            &fc1,
            &a,
            1e-4,
            1e-6,
            &what(&format!("fc1 grad of expt_dp {group:?}")),
        );
        assert_close(
            &fc2,
            &c,
            1e-4,
            1e-6,
            &what(&format!("fc2 grad of expt_dp {group:?}")),
        );
    }
}

const LAYOUTS: [(usize, &str); 7] = [
    (1, ""),
    (2, "ep=2"),
    (4, "ep=4"),
    (4, "ep=2"),
    (4, "ep=2,etp=2"),
    (8, "ep=2,etp=2"),
    (8, "ep=4,etp=2,tp=2"),
];

#[test]
fn alltoall_dispatcher_matches_one_rank() {
    for (world, spec) in LAYOUTS {
        check_equivalence(world, spec, Kind::AllToAll);
    }
}

#[test]
fn allgather_dispatcher_matches_one_rank() {
    for (world, spec) in LAYOUTS {
        check_equivalence(world, spec, Kind::AllGather);
    }
}

#[test]
fn flex_dispatcher_matches_one_rank() {
    for (world, spec) in LAYOUTS {
        check_equivalence(world, spec, Kind::Flex);
    }
}

#[test]
fn gpt_oss_biased_clamped_layer_matches_one_rank_under_ep_and_etp() {
    for kind in [Kind::AllToAll, Kind::AllGather, Kind::Flex] {
        for (world, spec) in [
            (1, ""),
            (2, "ep=2"),
            (2, "etp=2"),
            (4, "ep=2,etp=2"),
            (8, "ep=2,etp=2"),
        ] {
            check_with_capacity(world, spec, kind, None, Variant::GptOss);
        }
    }
}

#[test]
fn drop_and_pad_capacity_matches_per_batch_reference() {
    for kind in [Kind::AllToAll, Kind::AllGather, Kind::Flex] {
        for (world, spec) in [(2, "ep=2"), (4, "ep=2,etp=2"), (4, "ep=4")] {
            check_with_capacity(world, spec, kind, Some(1.0), Variant::Plain);
        }
    }
}

#[test]
fn dispatchers_reject_inconsistent_groups() {
    let out = World::run(2, |ctx| {
        let world = ctx.world()?;
        // 8 experts over a 2-rank tp_ep group claimed to be ep = 4.
        assert!(AllGatherDispatcher::new(world.clone(), E, 4, 1).is_err());
        // 3 experts cannot be split over 2 EP ranks.
        let solo = ctx.group("solo", &[ctx.rank()])?;
        assert!(AllToAllDispatcher::new(world.clone(), solo.clone(), world, 3).is_err());
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

/// Bytes each rank addresses to other ranks during one dispatch (all groups together).
fn dispatch_traffic(kind: Kind, world: usize, t: usize, h: usize, e: usize, k: usize) -> Vec<u64> {
    let layout = ParallelLayout::parse(world, &format!("ep={world}")).unwrap();
    let layout_ref = &layout;
    let out = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let families = [GroupFamily::Ep, GroupFamily::ExptTp, GroupFamily::TpEp];
        let d: Box<dyn TokenDispatcher> = match kind {
            Kind::AllGather => Box::new(AllGatherDispatcher::new(
                pg.comm(GroupFamily::TpEp).clone(),
                e,
                world,
                1,
            )?),
            Kind::AllToAll => Box::new(AllToAllDispatcher::new(
                pg.comm(GroupFamily::Ep).clone(),
                pg.comm(GroupFamily::ExptTp).clone(),
                pg.comm(GroupFamily::TpEp).clone(),
                e,
            )?),
            Kind::Flex => Box::new(FlexDispatcher::new(
                pg.comm(GroupFamily::TpEp).clone(),
                e,
                world,
                1,
            )?),
        };
        // Uniform routing: k distinct experts per token, equal probs.
        let mut rng = SplitMix::new(99 + ctx.rank() as u64);
        let mut probs = vec![0.0; t * e];
        for row in probs.chunks_mut(e) {
            for j in rng.distinct(e, k) {
                row[j] = 1.0 / k as f64;
            }
        }
        let dev = Device::flex();
        let p = tensor(probs, [t, e], &dev, DType::F32);
        let map = p.clone().greater_elem(0.0);
        let x = tensor(data(5, ctx.rank(), t * h), [t, h], &dev, DType::F32);
        let before: u64 = families
            .iter()
            .map(|f| pg.comm(*f).traffic().bytes_sent)
            .sum();
        let dispatched = d.dispatch(x, p, map)?;
        let after: u64 = families
            .iter()
            .map(|f| pg.comm(*f).traffic().bytes_sent)
            .sum();
        d.combine(dispatched.rows, dispatched.state)?;
        Ok(after - before)
    });
    out.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn dispatch_traffic_matches_the_all_to_all_formula_and_flex_sends_less() {
    let (world, t, h, e, k) = (4, 256, 256, 16, 4);
    let formula = (t * k * h * 4) as f64 * (world - 1) as f64 / world as f64;
    let a2a = dispatch_traffic(Kind::AllToAll, world, t, h, e, k);
    let flex = dispatch_traffic(Kind::Flex, world, t, h, e, k);
    let ag = dispatch_traffic(Kind::AllGather, world, t, h, e, k);
    for r in 0..world {
        let rel = (a2a[r] as f64 - formula).abs() / formula;
        assert!(
            rel < 0.05,
            "rank {r}: AlltoAll sent {} bytes, formula {formula} ({rel:.3})",
            a2a[r]
        );
        assert!(
            flex[r] < a2a[r],
            "rank {r}: Flex {} vs AlltoAll {}",
            flex[r],
            a2a[r]
        );
        // AllGather sends every token (plus probs and map) to every other member.
        assert!(
            ag[r] as f64 >= (t * h * 4 * (world - 1)) as f64,
            "rank {r}: AllGather {}",
            ag[r]
        );
    }
}
