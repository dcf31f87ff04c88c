//! The layer against a per-expert reference composed with plain Burn ops.

use burn::module::{Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::{DType, Device, IndexingUpdateOp, Tensor};

use super::*;
use crate::router::{AuxLossSpec, AuxLossType};
use crate::testing::{SplitMix, assert_close, int_tensor, tensor, values};

fn ad() -> Device {
    Device::flex().autodiff()
}

/// `Σ_e p_te · expert_e(x_t)` with one `select` / `matmul` chain / `select_assign` per expert.
fn reference_routed(layer: &MoeLayer, x: Tensor<2>, routing: &RouterOutput) -> Tensor<2> {
    let [t, h] = x.dims();
    let e = layer.experts.num_experts();
    let f = layer.experts.ffn_hidden_size();
    let map = routing
        .routing_map
        .clone()
        .into_data()
        .convert::<u8>()
        .try_to_vec::<u8>()
        .expect("map");
    let mut out = Tensor::<2>::zeros([t, h], (&x.device(), x.dtype()));
    for ex in 0..e {
        let toks: Vec<i64> = (0..t)
            .filter(|&tok| map[tok * e + ex] != 0)
            .map(|v| v as i64)
            .collect();
        if toks.is_empty() {
            continue;
        }
        let idx = int_tensor(toks.clone(), [toks.len()], &x.device());
        let xe = x.clone().select(0, idx.clone());
        let pe = routing
            .probs
            .clone()
            .slice([0..t, ex..ex + 1])
            .select(0, idx.clone());
        let w1 = layer
            .experts
            .fc1
            .val()
            .slice(ex..ex + 1)
            .reshape([2 * f, h]);
        let w2 = layer.experts.fc2.val().slice(ex..ex + 1).reshape([h, f]);
        let hid = xe.matmul(w1.transpose());
        let n = toks.len();
        let z = silu(hid.clone().slice([0..n, 0..f])) * hid.slice([0..n, f..2 * f]);
        let ye = z.matmul(w2.transpose()) * pe;
        out = out.select_assign(0, idx, ye, IndexingUpdateOp::Add);
    }
    out
}

fn f64_layer(cfg: &MoeLayerConfig, rng: &mut SplitMix) -> MoeLayer {
    let layer = cfg.init(&ad()).expect("init");
    let rand3 = |t: Tensor<3>, rng: &mut SplitMix| {
        Param::from_tensor(
            tensor(
                rng.values(t.dims().iter().product()),
                t.dims(),
                &ad(),
                DType::F64,
            )
            .require_grad(),
        )
    };
    let rw = layer.router.weight.val();
    let router_weight = Param::from_tensor(
        tensor(
            rng.values(rw.dims().iter().product()),
            rw.dims(),
            &ad(),
            DType::F64,
        )
        .require_grad(),
    );
    let mut router = layer.router;
    router.weight = router_weight;
    MoeLayer {
        router,
        experts: GroupedExperts {
            fc1: rand3(layer.experts.fc1.val(), rng),
            fc2: rand3(layer.experts.fc2.val(), rng),
            ..layer.experts
        },
        shared_experts: layer.shared_experts.map(|s| {
            let to_f64 = |l: burn::nn::Linear| burn::nn::Linear {
                weight: Param::from_tensor(
                    l.weight
                        .val()
                        .cast(burn::tensor::FloatDType::F64)
                        .detach()
                        .require_grad(),
                ),
                bias: None,
            };
            SharedExperts {
                gate_proj: to_f64(s.gate_proj),
                up_proj: to_f64(s.up_proj),
                down_proj: to_f64(s.down_proj),
                gate: s.gate.map(to_f64),
            }
        }),
    }
}

#[test]
fn layer_matches_per_expert_reference_forward_and_backward() {
    let mut rng = SplitMix::new(21);
    let (t, h, e, k, f) = (13, 12, 6, 2, 10);
    let router = TopKRouterConfig::new(h, e, k).with_router_dtype(burn::tensor::FloatDType::F64);
    for shared in [None, Some(7)] {
        let cfg = MoeLayerConfig::new(router.clone(), f).with_shared_ffn_hidden_size(shared);
        let layer = f64_layer(&cfg, &mut rng);
        let xv = rng.values(t * h);
        let rv = rng.values(t * h);
        let state = layer.router.init_state();
        let run = |reference: bool| {
            let x = tensor(xv.clone(), [t, h], &ad(), DType::F64).require_grad();
            let y = if reference {
                let routing = layer
                    .router
                    .forward(x.clone(), &state, &RouteOptions::default())
                    .expect("route");
                let mut y = reference_routed(&layer, x.clone(), &routing);
                if let Some(s) = &layer.shared_experts {
                    y = y + s.forward(x.clone());
                }
                y
            } else {
                layer
                    .forward(x.clone(), &state, &RouteOptions::default())
                    .expect("forward")
                    .output
            };
            let grads = (y.clone() * tensor(rv.clone(), [t, h], &ad(), DType::F64))
                .sum()
                .backward();
            vec![
                values(y),
                values(x.grad(&grads).expect("dx")),
                values(layer.router.weight.grad(&grads).expect("d router")),
                values(layer.experts.fc1.grad(&grads).expect("d fc1")),
                values(layer.experts.fc2.grad(&grads).expect("d fc2")),
            ]
        };
        let (ours, reference) = (run(false), run(true));
        for ((a, b), name) in ours
            .iter()
            .zip(&reference)
            .zip(["output", "dx", "d router", "d fc1", "d fc2"])
        {
            assert_close(a, b, 1e-10, 1e-12, name);
        }
    }
}

#[test]
fn layer_parameter_count_matches_spec() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 20: H = 12, E = 2, GLU, F = 48 ->
    // router 24 + experts 3456 = 3480.
    let cfg = MoeLayerConfig::new(TopKRouterConfig::new(12, 2, 1).with_pre_softmax(true), 48);
    assert_eq!(cfg.init(&Device::flex()).expect("init").num_params(), 3480);
}

#[test]
fn router_grad_is_zero_without_losses_when_output_is_zeroed_and_non_zero_with_aux() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 2.
    let (t, h, e, k) = (8, 12, 4, 2);
    let mut rng = SplitMix::new(22);
    let xv = rng.values(t * h);
    for coeff in [0.0, 1.0] {
        let router = TopKRouterConfig::new(h, e, k).with_aux_losses(vec![AuxLossSpec {
            kind: AuxLossType::Aux,
            coeff,
        }]);
        let layer = MoeLayerConfig::new(router, 16).init(&ad()).expect("init");
        let x = tensor(xv.clone(), [t, h], &ad(), DType::F32).require_grad();
        let out = layer
            .forward(x, &layer.router.init_state(), &RouteOptions::default())
            .expect("forward");
        let grads = (out.output * 0.0).sum().backward();
        let g = layer
            .router
            .weight
            .grad(&grads)
            .map(values)
            .unwrap_or_else(|| vec![0.0; e * h]);
        let norm: f64 = g.iter().map(|v| v.abs()).sum();
        if coeff == 0.0 {
            assert_eq!(norm, 0.0);
        } else {
            assert!(norm > 0.0);
        }
    }
}

#[test]
fn invalid_layer_config_is_an_error() {
    let cfg = MoeLayerConfig::new(TopKRouterConfig::new(12, 4, 2), 8).with_shared_gate(true);
    assert!(matches!(
        cfg.init(&Device::flex()),
        Err(BackendError::Config {
            field: "shared_gate",
            ..
        })
    ));
    let cfg = MoeLayerConfig::new(TopKRouterConfig::new(12, 4, 5), 8);
    assert!(matches!(
        cfg.init(&Device::flex()),
        Err(BackendError::Config { .. })
    ));
}

/// The events of one forward, with a condition variable the gated dispatcher waits on. With
/// `hold_shared`, the shared experts start only once the dispatch has started.
#[derive(Default)]
struct EventLog {
    events: std::sync::Mutex<Vec<OverlapEvent>>,
    changed: std::sync::Condvar,
    hold_shared: bool,
}

impl OverlapObserver for EventLog {
    fn event(&self, event: OverlapEvent) {
        let mut events = self.events.lock().unwrap();
        if event == OverlapEvent::SharedStart && self.hold_shared {
            events = self
                .changed
                .wait_timeout_while(events, std::time::Duration::from_secs(20), |e| {
                    !e.contains(&OverlapEvent::DispatchStart)
                })
                .unwrap()
                .0;
        }
        events.push(event);
        self.changed.notify_all();
    }
}

/// A dispatcher that starts moving tokens only once the shared experts are done. With an
/// [`EventLog`] holding the shared experts until the dispatch has started, a forward can only
/// finish when the two run at the same time (run one after the other, it times out).
#[derive(Debug)]
struct AfterShared<'a, D> {
    inner: D,
    log: &'a EventLog,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventLog")
    }
}

impl<D: TokenDispatcher> TokenDispatcher for AfterShared<'_, D> {
    fn local_experts(&self) -> std::ops::Range<usize> {
        self.inner.local_experts()
    }

    fn dispatch(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<2>,
        routing_map: Tensor<2, burn::tensor::Bool>,
    ) -> crate::Result<crate::dispatch::Dispatched> {
        let events = self.log.events.lock().unwrap();
        let (events, timeout) = self
            .log
            .changed
            .wait_timeout_while(events, std::time::Duration::from_secs(20), |e| {
                !e.contains(&OverlapEvent::SharedEnd)
            })
            .unwrap();
        drop(events);
        if timeout.timed_out() {
            return Err(BackendError::Config {
                field: "test",
                detail: "the shared experts did not run while the dispatch waited".into(),
            });
        }
        self.inner.dispatch(hidden, probs, routing_map)
    }

    fn combine(
        &self,
        expert_out: Tensor<2>,
        state: crate::dispatch::CombineState,
    ) -> crate::Result<Tensor<2>> {
        self.inner.combine(expert_out, state)
    }
}

#[test]
fn shared_experts_overlap_the_dispatch_with_the_same_result() {
    use crate::comm::World;
    use crate::dispatch::AllToAllDispatcher;
    use crate::parallel::{GroupFamily, ParallelLayout, replicate};

    let (t, h, e, k, f) = (12, 8, 4, 2, 6);
    let reference = MoeLayerConfig::new(TopKRouterConfig::new(h, e, k), f)
        .with_shared_ffn_hidden_size(Some(5))
        .init(&ad())
        .expect("layer");
    let layout = ParallelLayout::parse(2, "ep=2").unwrap();
    let (layout, reference) = (&layout, &reference);
    let out = World::run(2, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let dispatcher = AllToAllDispatcher::new(
            pg.comm(GroupFamily::Ep).clone(),
            pg.comm(GroupFamily::ExptTp).clone(),
            pg.comm(GroupFamily::TpEp).clone(),
            e,
        )?;
        let layer = MoeLayer {
            router: replicate(&reference.router),
            experts: reference.experts.shard(dispatcher.local_experts(), 0, 1)?,
            shared_experts: reference.shared_experts.as_ref().map(replicate),
        };
        let mut rng = SplitMix::new(5 + ctx.rank() as u64);
        let xv = rng.values(t * h);
        let dy = rng.values(t * h);
        let state = layer.router.init_state();
        // Output, input gradient and the shared experts' weight gradient, as bits.
        let run = |overlap: bool, gated: bool| -> crate::Result<(Vec<u64>, Vec<OverlapEvent>)> {
            let log = EventLog {
                hold_shared: gated,
                ..EventLog::default()
            };
            let x = tensor(xv.clone(), [t, h], &ad(), DType::F32).require_grad();
            let execution = MoeExecution {
                overlap_shared_experts: overlap,
                observer: Some(&log),
                ..MoeExecution::default()
            };
            let gate = AfterShared {
                inner: dispatcher.clone(),
                log: &log,
            };
            let d: &dyn TokenDispatcher = if gated { &gate } else { &dispatcher };
            let y = layer
                .forward_executing(x.clone(), &state, &RouteOptions::default(), d, &execution)?
                .output;
            let grads = (y.clone() * tensor(dy.clone(), [t, h], &ad(), DType::F32))
                .sum()
                .backward();
            let shared = layer.shared_experts.as_ref().expect("shared");
            let mut bits: Vec<u64> = Vec::new();
            for v in [
                y.into_data(),
                x.grad(&grads).expect("dx").into_data(),
                shared
                    .down_proj
                    .weight
                    .grad(&grads)
                    .expect("dW")
                    .into_data(),
            ] {
                bits.extend(v.iter::<f32>().map(|x| u64::from(x.to_bits())));
            }
            let events = log.events.lock().unwrap().clone();
            Ok((bits, events))
        };
        let (plain, plain_events) = run(false, false)?;
        let (overlapped, events) = run(true, true)?;
        Ok((plain == overlapped, plain_events, events))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (same, plain, overlapped) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(same, "rank {rank}: the overlapped layer differs");
        use OverlapEvent::*;
        assert_eq!(
            plain,
            vec![DispatchStart, DispatchEnd, SharedStart, SharedEnd]
        );
        // The dispatch started before the shared experts and ended after them.
        assert_eq!(
            overlapped,
            vec![DispatchStart, SharedStart, SharedEnd, DispatchEnd]
        );
    }
}
