use super::*;

fn f(microbatch: usize, chunk: usize) -> Action {
    Action::forward(microbatch, chunk)
}

fn b(microbatch: usize, chunk: usize) -> Action {
    Action::backward(microbatch, chunk)
}

fn field_of(err: BackendError) -> &'static str {
    match err {
        BackendError::Config { field, .. } => field,
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn one_f_one_b_phase_counts_pp4_m8() {
    let s = PipelineSchedule::one_f_one_b(4, 8).unwrap();
    for r in 0..4 {
        let warmup = 4 - r - 1;
        assert_eq!(s.warmup(r), warmup, "rank {r}");
        assert_eq!(s.steady(r), 8 - warmup, "rank {r}");
        assert_eq!(s.cooldown(r), warmup, "rank {r}");
        assert_eq!(s.actions(r).len(), 16);
    }
}

#[test]
fn one_f_one_b_pp3_m4_matches_the_published_picture() {
    // Narayanan et al. 2021, Fig. 4 (top) / Megatron's non-interleaved 1F1B: stage s runs
    // pp − s − 1 forwards, then alternates one forward and one backward, then drains.
    let s = PipelineSchedule::one_f_one_b(3, 4).unwrap();
    assert_eq!(
        s.actions(0),
        [
            f(0, 0),
            f(1, 0),
            f(2, 0),
            b(0, 0),
            f(3, 0),
            b(1, 0),
            b(2, 0),
            b(3, 0)
        ]
    );
    assert_eq!(
        s.actions(1),
        [
            f(0, 0),
            f(1, 0),
            b(0, 0),
            f(2, 0),
            b(1, 0),
            f(3, 0),
            b(2, 0),
            b(3, 0)
        ]
    );
    assert_eq!(
        s.actions(2),
        [
            f(0, 0),
            b(0, 0),
            f(1, 0),
            b(1, 0),
            f(2, 0),
            b(2, 0),
            f(3, 0),
            b(3, 0)
        ]
    );
}

#[test]
fn one_f_one_b_fewer_microbatches_than_stages_is_all_warmup() {
    let s = PipelineSchedule::one_f_one_b(4, 2).unwrap();
    assert_eq!(s.actions(0), [f(0, 0), f(1, 0), b(0, 0), b(1, 0)]);
    assert_eq!((s.warmup(0), s.steady(0), s.cooldown(0)), (2, 0, 2));
    assert_eq!((s.warmup(3), s.steady(3), s.cooldown(3)), (0, 2, 0));
    s.simulate().unwrap();
}

#[test]
fn interleaved_pp2_vpp2_m4_by_hand() {
    // Megatron's rules: forward k is micro-batch (k / (pp·vpp))·pp + k % pp of chunk
    // (k / pp) % vpp; backward k is the same micro-batch of chunk vpp − 1 − (k / pp) % vpp.
    // Table for pp = 2, vpp = 2, m = 4 (k = 0..8):
    //   (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)
    // Warm-up: rank 0: 2·(2 − 0 − 1) + (2 − 1)·2 = 4; rank 1: 0 + 2 = 2.
    let s = PipelineSchedule::interleaved(2, 2, 4).unwrap();
    assert_eq!(
        s.actions(0),
        [
            // warm-up
            f(0, 0),
            f(1, 0),
            f(0, 1),
            f(1, 1),
            // steady
            f(2, 0),
            b(0, 1),
            f(3, 0),
            b(1, 1),
            f(2, 1),
            b(0, 0),
            f(3, 1),
            b(1, 0),
            // cool-down
            b(2, 1),
            b(3, 1),
            b(2, 0),
            b(3, 0),
        ]
    );
    assert_eq!(
        s.actions(1),
        [
            // warm-up
            f(0, 0),
            f(1, 0),
            // steady
            f(0, 1),
            b(0, 1),
            f(1, 1),
            b(1, 1),
            f(2, 0),
            b(0, 0),
            f(3, 0),
            b(1, 0),
            f(2, 1),
            b(2, 1),
            f(3, 1),
            b(3, 1),
            // cool-down
            b(2, 0),
            b(3, 0),
        ]
    );
    assert_eq!((s.warmup(0), s.steady(0), s.cooldown(0)), (4, 4, 4));
    assert_eq!((s.warmup(1), s.steady(1), s.cooldown(1)), (2, 6, 2));
    assert_eq!(s.virtual_stage(1, 1), 3);
    s.simulate().unwrap();
}

#[test]
fn interleaved_warmup_follows_megatron_and_is_capped() {
    let s = PipelineSchedule::interleaved(4, 3, 8).unwrap();
    for r in 0..4 {
        assert_eq!(s.warmup(r), 2 * (4 - r - 1) + 2 * 4, "rank {r}");
        assert_eq!(s.steady(r) + s.warmup(r), 24);
        assert_eq!(s.cooldown(r), s.warmup(r));
    }
    // pp = 4, vpp = 2, m = 4: rank 0 would warm up 2·3 + 4 = 10 > 8 = m·vpp.
    let s = PipelineSchedule::interleaved(4, 2, 4).unwrap();
    assert_eq!((s.warmup(0), s.steady(0), s.cooldown(0)), (8, 0, 8));
    assert_eq!(s.warmup(1), 8);
    assert_eq!(s.warmup(3), 4);
    s.simulate().unwrap();
}

#[test]
fn interleaved_vpp1_is_one_f_one_b() {
    assert_eq!(
        PipelineSchedule::interleaved(4, 1, 6).unwrap(),
        PipelineSchedule::one_f_one_b(4, 6).unwrap()
    );
}

#[test]
fn max_in_flight_of_one_f_one_b_is_min_pp_minus_rank_and_m() {
    for pp in [1, 2, 3, 4, 8] {
        for m in 1..=12 {
            let s = PipelineSchedule::one_f_one_b(pp, m).unwrap();
            for r in 0..pp {
                assert_eq!(
                    s.max_in_flight(r),
                    (pp - r).min(m),
                    "pp {pp} m {m} rank {r}"
                );
            }
        }
    }
}

/// Interleaved: the peak is reached by the first steady forward, so a rank holds
/// `min(2·(pp − r − 1) + (vpp − 1)·pp + 1, m·vpp)` micro-batch-chunks. On the first stage this
/// is `pp·vpp + pp − 1` chunks, i.e. `pp·(1 + (pp − 1)/(pp·vpp))` micro-batches' worth of the
/// stage's layers: the activation factor of Korthikanti et al. 2022 ("Reducing Activation
/// Recomputation in Large Transformer Models", §4.2, interleaved schedule) that the Megatron
/// Core MoE report cites for PP with VPP ("activations > 1 with VPP", Table 12).
#[test]
fn max_in_flight_of_interleaved_matches_megatrons_memory_analysis() {
    for pp in [1, 2, 4, 8] {
        for vpp in 2..=4 {
            for m in (pp..=32).step_by(pp) {
                let s = PipelineSchedule::interleaved(pp, vpp, m).unwrap();
                for r in 0..pp {
                    let want = (2 * (pp - r - 1) + (vpp - 1) * pp + 1).min(m * vpp);
                    assert_eq!(s.max_in_flight(r), want, "pp {pp} vpp {vpp} m {m} rank {r}");
                }
                if m * vpp >= pp * vpp + pp - 1 {
                    let stage_mbs = s.max_in_flight(0) as f64 / vpp as f64;
                    let megatron = pp as f64 * (1.0 + (pp - 1) as f64 / (pp * vpp) as f64);
                    assert!(
                        (stage_mbs - megatron).abs() < 1e-12,
                        "pp {pp} vpp {vpp} m {m}"
                    );
                }
            }
        }
    }
    // pp 2, vpp 2, m 4, rank 0: warm-up 4 + 1 = 5 in flight, chunk 0 holds mb 0, 1, 2.
    let s = PipelineSchedule::interleaved(2, 2, 4).unwrap();
    assert_eq!(s.in_flight_at_peak(0), vec![3, 2]);
    assert_eq!(s.in_flight_at_peak(1), vec![2, 1]);
}

#[test]
fn every_small_schedule_runs_and_covers_each_pass_once() {
    for pp in [1, 2, 4] {
        for vpp in [1, 2, 3] {
            for m in (pp..=16).step_by(pp) {
                let s = PipelineSchedule::interleaved(pp, vpp, m).unwrap();
                let sim = s
                    .simulate()
                    .unwrap_or_else(|e| panic!("pp {pp} vpp {vpp} m {m}: {e}"));
                for r in 0..pp {
                    let mut seen = std::collections::HashSet::new();
                    for a in s.actions(r) {
                        assert!(
                            seen.insert(*a),
                            "pp {pp} vpp {vpp} m {m} rank {r}: {a} twice"
                        );
                    }
                    assert_eq!(seen.len(), 2 * m * vpp);
                    assert_eq!(sim.busy[r], 3 * (m * vpp) as u64);
                }
                if vpp > 1 && s.warmup(0) < m * vpp {
                    assert_eq!(
                        sim.makespan,
                        3 * (m * vpp + pp - 1) as u64,
                        "pp {pp} vpp {vpp} m {m}"
                    );
                }
                // Never worse than running the virtual stages one after another per micro-batch.
                assert!(sim.makespan <= 3 * (m * pp * vpp) as u64);
            }
        }
    }
}

#[test]
fn one_f_one_b_bubble_is_pp_minus_one_over_m_plus_pp_minus_one() {
    for pp in [1, 2, 3, 4, 8] {
        for m in 1..=16 {
            let sim = PipelineSchedule::one_f_one_b(pp, m)
                .unwrap()
                .simulate()
                .unwrap();
            // f = 1, b = 2: makespan (m + pp − 1)·3, bubble (pp − 1)·3 / (m·3 + (pp − 1)·3).
            assert_eq!(sim.makespan, 3 * (m + pp - 1) as u64, "pp {pp} m {m}");
            let want = (pp - 1) as f64 / (m + pp - 1) as f64;
            assert!(
                (sim.bubble_fraction() - want).abs() < 1e-12,
                "pp {pp} m {m}"
            );
        }
    }
}

#[test]
fn interleaving_shrinks_the_bubble() {
    // Megatron: the interleaved bubble is 1/vpp of the 1F1B bubble; in chunk units with
    // f = 1, b = 2 per chunk that is a makespan of (m·vpp + pp − 1)·3 when m·vpp is large enough.
    let mut lines = Vec::new();
    for (pp, vpp, m) in [(2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 3, 12), (8, 4, 32)] {
        let sim = PipelineSchedule::interleaved(pp, vpp, m)
            .unwrap()
            .simulate()
            .unwrap();
        let base = PipelineSchedule::one_f_one_b(pp, m)
            .unwrap()
            .simulate()
            .unwrap();
        lines.push(format!(
            "pp {pp} vpp {vpp} m {m}: makespan {} (ideal {}), bubble {:.4} vs 1F1B {:.4}",
            sim.makespan,
            3 * (m * vpp + pp - 1),
            sim.bubble_fraction(),
            base.bubble_fraction()
        ));
        assert!(
            sim.bubble_fraction() < base.bubble_fraction(),
            "{}",
            lines.join("\n")
        );
    }
    println!("{}", lines.join("\n"));
}

#[test]
fn steps_fuse_sends_with_the_next_receives() {
    let s = PipelineSchedule::one_f_one_b(2, 2).unwrap();
    let send_act = |mb| Transfer {
        direction: Direction::Send,
        payload: Payload::Activation,
        microbatch: mb,
        chunk: 0,
        peer: 1,
        peer_chunk: 0,
    };
    let recv_grad = |mb| Transfer {
        direction: Direction::Recv,
        payload: Payload::Grad,
        microbatch: mb,
        chunk: 0,
        peer: 1,
        peer_chunk: 0,
    };
    assert_eq!(
        s.steps(0),
        vec![
            Step::Compute(f(0, 0)),
            Step::Exchange(vec![send_act(0)]),
            Step::Compute(f(1, 0)),
            Step::Exchange(vec![send_act(1), recv_grad(0)]),
            Step::Compute(b(0, 0)),
            Step::Exchange(vec![recv_grad(1)]),
            Step::Compute(b(1, 0)),
        ]
    );
    assert_eq!(send_act(0).counterpart(0).direction, Direction::Recv);
    // pp = 1: chunk-to-chunk hand-offs stay on the rank.
    let s = PipelineSchedule::interleaved(1, 3, 2).unwrap();
    assert!(s.steps(0).iter().all(|st| matches!(st, Step::Compute(_))));
}

#[test]
fn simulate_reports_deadlocks_and_bad_orders() {
    // Rank 0 waits for the gradient of mb 0 before sending mb 1; rank 1 needs mb 1 first.
    let s = PipelineSchedule::from_actions(
        2,
        1,
        2,
        vec![
            vec![f(0, 0), b(0, 0), f(1, 0), b(1, 0)],
            vec![f(0, 0), f(1, 0), b(0, 0), b(1, 0)],
        ],
    )
    .unwrap();
    let err = s.simulate().unwrap_err().to_string();
    assert!(err.contains("deadlock"), "{err}");
    assert!(err.contains("rank 0 (before B(mb 0, chunk 0))"), "{err}");
    assert!(err.contains("rank 1 (before F(mb 1, chunk 0))"), "{err}");

    let s = PipelineSchedule::from_actions(1, 1, 1, vec![vec![b(0, 0), f(0, 0)]]).unwrap();
    let err = s.simulate().unwrap_err().to_string();
    assert!(
        err.contains("rank 0: B(mb 0, chunk 0) before its forward"),
        "{err}"
    );

    let s = PipelineSchedule::from_actions(1, 2, 1, vec![vec![f(0, 1), f(0, 0), b(0, 1), b(0, 0)]])
        .unwrap();
    let err = s.simulate().unwrap_err().to_string();
    assert!(
        err.contains("F(mb 0, chunk 1) needs F(mb 0, chunk 0)"),
        "{err}"
    );

    let s = PipelineSchedule::from_actions(1, 1, 2, vec![vec![f(0, 0), b(0, 0)]]).unwrap();
    let err = s.simulate().unwrap_err().to_string();
    assert!(err.contains("expected 2 each"), "{err}");

    let s = PipelineSchedule::from_actions(1, 1, 1, vec![vec![f(0, 0), f(0, 0), b(0, 0)]]).unwrap();
    assert!(s.simulate().unwrap_err().to_string().contains("twice"));
}

#[test]
fn bad_inputs_are_config_errors() {
    assert_eq!(
        field_of(PipelineSchedule::one_f_one_b(0, 4).unwrap_err()),
        "pp"
    );
    assert_eq!(
        field_of(PipelineSchedule::one_f_one_b(2, 0).unwrap_err()),
        "microbatches"
    );
    assert_eq!(
        field_of(PipelineSchedule::interleaved(2, 0, 4).unwrap_err()),
        "vpp"
    );
    assert_eq!(
        field_of(PipelineSchedule::interleaved(0, 2, 4).unwrap_err()),
        "pp"
    );
    // Fewer micro-batches than the interleaved schedule needs, and not a multiple of pp.
    assert_eq!(
        field_of(PipelineSchedule::interleaved(4, 2, 2).unwrap_err()),
        "microbatches"
    );
    assert_eq!(
        field_of(PipelineSchedule::interleaved(4, 2, 6).unwrap_err()),
        "microbatches"
    );
    assert_eq!(
        field_of(PipelineSchedule::interleaved(2, 3, 5).unwrap_err()),
        "microbatches"
    );
    // 1F1B has no multiple-of-pp requirement.
    PipelineSchedule::one_f_one_b(4, 6)
        .unwrap()
        .simulate()
        .unwrap();
    assert_eq!(
        field_of(PipelineSchedule::from_actions(2, 1, 1, vec![vec![]]).unwrap_err()),
        "pp"
    );
    assert_eq!(
        field_of(PipelineSchedule::from_actions(1, 1, 1, vec![vec![f(1, 0)]]).unwrap_err()),
        "schedule"
    );
}

#[test]
fn batching_must_match_the_schedule() {
    // 1F1B batched per iteration still runs, but serialises: 24 steps instead of (4 + 1)·3.
    let sim = PipelineSchedule::one_f_one_b(2, 4)
        .unwrap()
        .with_fusion(Fusion::Pairs)
        .simulate()
        .unwrap();
    assert_eq!(sim.makespan, 24);
    let s = PipelineSchedule::interleaved(2, 2, 4).unwrap();
    assert_eq!(s.fusion(), Fusion::Pairs);
    let err = s
        .with_fusion(Fusion::Adjacent)
        .simulate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("deadlock: rank 0"), "{err}");
    // 1F1B also runs with the generic batching.
    PipelineSchedule::one_f_one_b(4, 8)
        .unwrap()
        .with_fusion(Fusion::Adjacent)
        .simulate()
        .unwrap();
}

/// Every Megatron schedule's programs (with backwards and forward-only) complete under
/// rendezvous sends in the model, and run over one channel per pair that matches messages in
/// issue order; a custom order whose messages cross on that channel is refused, naming the
/// ranks.
#[test]
fn megatron_programs_complete_under_rendezvous_on_one_channel() {
    for pp in 1..=5 {
        for vpp in 1..=4 {
            for m in (pp..=3 * pp).step_by(pp) {
                let s = PipelineSchedule::interleaved(pp, vpp, m).unwrap();
                let what = format!("pp {pp} vpp {vpp} m {m}");
                s.simulate().unwrap_or_else(|e| panic!("{what}: {e}"));
                s.simulate_forward()
                    .unwrap_or_else(|e| panic!("{what} forward-only: {e}"));
                s.check_matching(false)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                s.check_matching(true)
                    .unwrap_or_else(|e| panic!("{what} forward-only: {e}"));
                for r in 0..pp {
                    let forwards = s
                        .forward_steps(r)
                        .iter()
                        .filter(|st| matches!(st, Step::Compute(_)))
                        .count();
                    assert_eq!(forwards, m * vpp, "{what}");
                }
            }
        }
    }
    // 1F1B without its steady-state fusion: per-computation exchanges deadlock in the model.
    let s = PipelineSchedule::one_f_one_b(2, 3).unwrap();
    let programs: Vec<Vec<Step>> = (0..2)
        .map(|r| {
            s.actions(r)
                .iter()
                .flat_map(|&a| {
                    let recv = s.recv_of(r, a).map(|t| Step::Exchange(vec![t]));
                    let send = s.send_of(r, a).map(|t| Step::Exchange(vec![t]));
                    recv.into_iter().chain([Step::Compute(a)]).chain(send)
                })
                .collect()
        })
        .collect();
    let err = s
        .run_model(&programs, Costs::default(), true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("deadlock"), "{err}");
    // Rank 1 asks for the gradients in the other order: refused on the one channel.
    let s = PipelineSchedule::from_actions(
        2,
        1,
        2,
        vec![
            vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0)],
            vec![f(0, 0), b(0, 0), f(1, 0), b(1, 0)],
        ],
    )
    .unwrap();
    let err = s.check_matching(false).unwrap_err().to_string();
    assert!(
        err.contains("pipeline rank 1 posts the gradient of micro-batch 0")
            && err.contains("rank 0, which asks for the gradient of micro-batch 1"),
        "{err}"
    );
}

#[test]
fn posting_order_puts_activations_first_then_micro_batch_then_stage() {
    let s = PipelineSchedule::interleaved(2, 2, 4).unwrap();
    let t = |direction, payload, microbatch, chunk, peer_chunk| Transfer {
        direction,
        payload,
        microbatch,
        chunk,
        peer: 1,
        peer_chunk,
    };
    let mut ops = vec![
        t(Direction::Recv, Payload::Grad, 0, 0, 1),
        t(Direction::Send, Payload::Activation, 2, 1, 1),
        t(Direction::Recv, Payload::Activation, 1, 1, 0),
        t(Direction::Send, Payload::Activation, 1, 0, 0),
    ];
    s.posting_order(0, &mut ops);
    let keys: Vec<(Payload, usize, usize)> = ops
        .iter()
        .map(|t| (t.payload, t.microbatch, t.chunk))
        .collect();
    // Produced by virtual stages: send a(1) from vs 0, recv a(1) from vs 1, send a(2) from
    // vs 2, recv g(0) from vs 3.
    assert_eq!(
        keys,
        vec![
            (Payload::Activation, 1, 0),
            (Payload::Activation, 1, 1),
            (Payload::Activation, 2, 1),
            (Payload::Grad, 0, 0),
        ]
    );
}
