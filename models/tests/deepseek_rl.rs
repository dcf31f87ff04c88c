//! DeepSeek-V3 in the RL entry points (issue 19, items 1 and 3): per-token log-probs and
//! entropy of the sharded model computed vocab-parallel equal the single-rank ones (and those
//! equal `log_softmax` of the transformers goldens); routing recorded under one layout replays
//! identically under others through the group-limited, bias-shifted router; a forced routing
//! equals the single-rank replay of it (router gradients included); bad routings are rejected
//! by field.

mod common;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{FixtureSource, Golden, fixtures};
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::causal_lm::causal_lm_loss;
use moe_models::deepseek_v3::DeepseekV3FeedForward;
use moe_models::distributed::replay::RoutedExperts;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::replay::{RouterReplayModel, replay_routing};
use moe_models::rl::logprobs::{model_logprobs, model_logprobs_detached};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, ModelError};

const B: usize = 4;
const S: usize = 12;
/// Relative tolerance of the parallel-equivalence checks.
const RTOL: f32 = 1e-5;

fn ad() -> Device {
    Device::flex().autodiff()
}

/// The committed deepseek_v3 fixture (transformers weights: 3 layers, layers 1 and 2 MoE with
/// 8 experts in 2 groups, top-2 of 1 group, non-zero `e_score_correction_bias`, one MTP module).
fn fixture_model(device: &Device) -> DeepseekV3ForCausalLM {
    let path = fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(path.join("config.json")).expect("config");
    DeepseekV3ForCausalLM::from_weights(&config, &FixtureSource::open(&path), device)
        .expect("load")
        .set_require_grad(true)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

/// Asserts `max|a − b| ≤ rtol · max|b|`; returns the ratio.
fn close(a: &[f32], b: &[f32], rtol: f32, what: &str) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= rtol * scale,
        "{what}: max error {err:.3e} > {rtol:.0e} · {scale:.4e}"
    );
    err / scale
}

fn to_backend(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// `B × S` ids: the golden's two rows, then two pseudo-random rows.
fn batch_ids(vocab: usize) -> Vec<i64> {
    let (shape, mut ids) = Golden::open("deepseek_v3").i64("input_ids");
    assert_eq!(shape, vec![2, S]);
    ids.extend(XorShift64::new(0x2545_f491_4f6c_dd1d).ids((B - 2) * S, vocab));
    ids
}

/// `log p(ids[t+1])` and the entropy of `log_softmax(logits [b, s, v])` (f64), `[b·(s−1)]`.
fn golden_logprobs(logits: &[f32], ids: &[i64], [b, s, v]: [usize; 3]) -> (Vec<f32>, Vec<f32>) {
    let (mut lp, mut h) = (Vec::new(), Vec::new());
    for row in 0..b {
        for t in 0..s - 1 {
            let l = &logits[(row * s + t) * v..(row * s + t + 1) * v];
            let max = l.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            lp.push((l[ids[row * s + t + 1] as usize] as f64 - lse) as f32);
            h.push(
                -l.iter()
                    .map(|&x| (x as f64 - lse).exp() * (x as f64 - lse))
                    .sum::<f64>() as f32,
            );
        }
    }
    (lp, h)
}

/// One rank's log-probs, entropies, ∂Σlogprobs/∂lm_head shard and detached log-probs.
struct LogprobRank {
    replica: usize,
    vocab: std::ops::Range<usize>,
    logprobs: Vec<f32>,
    entropy: Vec<f32>,
    head: Vec<f32>,
    detached: Vec<f32>,
}

fn sharded_logprobs(
    spec: &str,
    full: &DeepseekV3ForCausalLM,
    ids: &[i64],
    labels: &[i64],
    batch: usize,
) -> (usize, Vec<LogprobRank>) {
    let layout = ParallelLayout::parse_spec(spec).expect("layout");
    let replicas = layout.dp * layout.cp;
    let rows = batch / replicas;
    let layout_ref = &layout;
    let outs = World::run(layout.world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let par = Sharded::<DeepseekV3ForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        let r = par.replica;
        let span = r * rows * S..(r + 1) * rows * S;
        let (my_ids, my_labels) = (&ids[span.clone()], &labels[span]);
        let out = par
            .forward_logprobs(my_ids, my_labels, rows, &ad())
            .map_err(to_backend)?;
        let (logprobs, entropy) = (values(out.logprobs.clone()), values(out.entropy));
        let g = out.logprobs.sum().backward();
        let head_w = par.model.lm_head.as_ref().expect("head").weight.val();
        let head = values(head_w.grad(&g).expect("head grad"));
        let det = par
            .forward_logprobs_detached(my_ids, my_labels, rows)
            .map_err(to_backend)?;
        assert!(
            !det.logprobs.is_autodiff(),
            "detached must not use autodiff"
        );
        let vl = par
            .model
            .model
            .embed_tokens
            .as_ref()
            .unwrap()
            .weight
            .val()
            .dims()[0];
        let tp_rank = pg.groups.tp_rank();
        Ok(LogprobRank {
            replica: r,
            vocab: vl * tp_rank..vl * (tp_rank + 1),
            logprobs,
            entropy,
            head,
            detached: values(det.logprobs),
        })
    });
    let outs = outs
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}")))
        .collect();
    (rows, outs)
}

#[test]
fn deepseek_sharded_logprobs_and_entropy_equal_one_rank() {
    let full = fixture_model(&ad());
    let v = full.config().vocab_size;
    let ids = batch_ids(v);
    let mut labels = ids.clone();
    for at in [0, 1, 2, 3, 2 * S + 7, 4 * S - 1] {
        labels[at] = -100;
    }
    for spec in ["", "world=4,tp=2,ep=4"] {
        let (rows, outs) = sharded_logprobs(spec, &full, &ids, &labels, B);
        let (mut lp, mut h) = (vec![0f32; B * (S - 1)], vec![0f32; B * (S - 1)]);
        let mut worst_head = 0f32;
        for out in &outs {
            let span = out.replica * rows * S..(out.replica + 1) * rows * S;
            let model = replicate(&full);
            let want = model_logprobs(&model, &ids[span.clone()], &labels[span], rows, &ad())
                .expect("single-rank logprobs");
            let g = want.logprobs.clone().sum().backward();
            let head = values(
                model
                    .lm_head
                    .as_ref()
                    .expect("head")
                    .weight
                    .val()
                    .grad(&g)
                    .expect("grad"),
            );
            let cols: Vec<f32> = head
                .chunks(v)
                .flat_map(|r| r[out.vocab.clone()].to_vec())
                .collect();
            worst_head = worst_head.max(close(
                &out.head,
                &cols,
                RTOL,
                &format!("{spec}: dΣlp/dhead"),
            ));
            close(
                &out.detached,
                &out.logprobs,
                1e-6,
                &format!("{spec}: detached"),
            );
            let o = out.replica * rows * (S - 1);
            lp[o..o + rows * (S - 1)].copy_from_slice(&out.logprobs);
            h[o..o + rows * (S - 1)].copy_from_slice(&out.entropy);
        }
        let model = replicate(&full);
        let want = model_logprobs(&model, &ids, &labels, B, &ad()).expect("reference");
        let e_lp = close(
            &lp,
            &values(want.logprobs),
            RTOL,
            &format!("{spec}: logprobs"),
        );
        let e_h = close(&h, &values(want.entropy), RTOL, &format!("{spec}: entropy"));
        for t in 0..3 {
            assert_eq!((lp[t], h[t]), (0.0, 0.0), "{spec}: masked position {t}");
        }
        println!(
            "layout {spec:?}: max err / max|value|: logprobs {e_lp:.2e}, entropy {e_h:.2e}, \
             dΣlp/dhead {worst_head:.2e}"
        );
    }
}

#[test]
fn deepseek_logprobs_equal_log_softmax_of_the_transformers_goldens() {
    let device = Device::flex();
    let model = fixture_model(&device);
    let golden = Golden::open("deepseek_v3");
    let (_, ids) = golden.i64("input_ids");
    let (shape, logits) = golden.f32("logits");
    let dims = [shape[0], shape[1], shape[2]];
    let (want_lp, want_h) = golden_logprobs(&logits, &ids, dims);
    let scale = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    let check = |lp: &[f32], h: &[f32], what: &str| {
        let e_lp = lp
            .iter()
            .zip(&want_lp)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let e_h = h
            .iter()
            .zip(&want_h)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "{what}: max|logprob err| {e_lp:.3e}, max|entropy err| {e_h:.3e}, max|logit| {scale:.4}"
        );
        assert!(
            e_lp <= 1e-4 * scale,
            "{what}: logprobs {e_lp} > 1e-4 · {scale}"
        );
        assert!(
            e_h <= 1e-4 * scale,
            "{what}: entropy {e_h} > 1e-4 · {scale}"
        );
    };
    let out = model_logprobs(&model, &ids, &ids, dims[0], &device).expect("logprobs");
    assert_eq!(out.logprobs.dims(), [dims[0], dims[1] - 1]);
    let (lp, h) = (values(out.logprobs), values(out.entropy));
    check(&lp, &h, "world=1");
    let det = model_logprobs_detached(&model, &ids, &ids, dims[0]).expect("detached");
    assert!(!det.logprobs.is_autodiff());
    assert_eq!(values(det.logprobs), lp);
    // The vocab-parallel run of the golden rows (2 replicas of 1 row, tp = 2, ep = 4).
    let full = fixture_model(&ad());
    let (rows, outs) = sharded_logprobs("world=4,tp=2,ep=4", &full, &ids, &ids, dims[0]);
    let (mut slp, mut sh) = (vec![0f32; lp.len()], vec![0f32; h.len()]);
    for out in &outs {
        let o = out.replica * rows * (S - 1);
        slp[o..o + rows * (S - 1)].copy_from_slice(&out.logprobs);
        sh[o..o + rows * (S - 1)].copy_from_slice(&out.entropy);
    }
    check(&slp, &sh, "world=4,tp=2,ep=4");
    // Clear errors.
    let mut labels = ids.clone();
    labels[5] = dims[2] as i64;
    let err = model_logprobs(&model, &ids, &labels, dims[0], &device).unwrap_err();
    assert!(err.to_string().contains("labels"), "{err}");
    let err = model_logprobs(&model, &ids[..2], &ids[..2], 2, &device).unwrap_err();
    assert!(err.to_string().contains("at least 2 tokens"), "{err}");
}

/// What one layout's run gives for the whole batch.
struct Run {
    /// `[B·S, V]` logits gathered over vocabulary shards and replicas.
    logits: Vec<f32>,
    /// Mean of the replicas' losses.
    loss: f32,
    /// The routing used, merged over replicas.
    routed: RoutedExperts,
    /// Router gate gradients of every MoE layer, summed over the ranks / replicas.
    gate_grads: Vec<Vec<f32>>,
}

fn gate_weights(model: &DeepseekV3ForCausalLM) -> Vec<Tensor<2>> {
    model
        .model
        .layers
        .iter()
        .filter_map(|l| match &l.mlp {
            DeepseekV3FeedForward::Moe(block) => Some(block.moe.router.weight.val()),
            DeepseekV3FeedForward::Dense(_) => None,
        })
        .collect()
}

struct RankOut {
    replica: usize,
    vocab: std::ops::Range<usize>,
    logits: Vec<f32>,
    loss: f32,
    routed: RoutedExperts,
    gate_grads: Vec<Vec<f32>>,
}

/// The sharded forward (and backward) under `spec` on `world` ranks, recording the routing
/// and replaying `replay` (the whole batch's, split over replicas) when given.
fn run(
    world: usize,
    spec: &str,
    full: &DeepseekV3ForCausalLM,
    ids: &[i64],
    replay: Option<&RoutedExperts>,
) -> Run {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let replicas = layout.dp * layout.cp;
    let rows = B / replicas;
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<DeepseekV3ForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        let r = par.replica;
        let my_ids = &ids[r * rows * S..(r + 1) * rows * S];
        let my_replay = replay
            .map(|routed| routed.slice_batch(r * rows..(r + 1) * rows))
            .transpose()
            .map_err(to_backend)?;
        let (out, routed) = par
            .forward_loss_recorded(my_ids, my_ids, rows, &ad(), 1.0, my_replay.as_ref())
            .map_err(to_backend)?;
        if let Some(want) = &my_replay {
            let only = par
                .forward_loss_replayed(my_ids, my_ids, rows, &ad(), 1.0, want)
                .map_err(to_backend)?;
            assert_eq!(values(only.loss), values(out.loss.clone()));
        }
        let loss = values(out.loss.clone())[0];
        let logits = values(out.logits.clone());
        let g = out.loss.backward();
        let gate_grads = gate_weights(&par.model)
            .into_iter()
            .map(|w| values(w.grad(&g).expect("router gate gradient")))
            .collect();
        Ok(RankOut {
            replica: r,
            vocab: out.vocab,
            logits,
            loss,
            routed,
            gate_grads,
        })
    });
    let outs: Vec<RankOut> = results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}")))
        .collect();
    let v = full.config().vocab_size;
    let mut logits = vec![0f32; B * S * v];
    let mut losses = vec![0f32; replicas];
    let mut routed: Vec<Option<RoutedExperts>> = vec![None; replicas];
    let mut gate_grads: Vec<Vec<f32>> = Vec::new();
    for out in &outs {
        let width = out.vocab.len();
        for (i, row) in out.logits.chunks(width).enumerate() {
            let at = (out.replica * rows * S + i) * v + out.vocab.start;
            logits[at..at + width].copy_from_slice(row);
        }
        losses[out.replica] = out.loss;
        match &routed[out.replica] {
            Some(seen) => assert_eq!(seen, &out.routed, "{spec}: TP ranks disagree on routing"),
            None => routed[out.replica] = Some(out.routed.clone()),
        }
        if gate_grads.is_empty() {
            gate_grads = vec![vec![0f32; out.gate_grads[0].len()]; out.gate_grads.len()];
        }
        for (acc, g) in gate_grads.iter_mut().zip(&out.gate_grads) {
            acc.iter_mut()
                .zip(g)
                .for_each(|(a, x)| *a += x / replicas as f32);
        }
    }
    let first = routed[0].clone().expect("replica 0");
    let indices = routed
        .into_iter()
        .flat_map(|r| r.expect("every replica").indices)
        .collect();
    Run {
        logits,
        loss: losses.iter().sum::<f32>() / replicas as f32,
        routed: RoutedExperts::new(B, S, first.layers, first.topk, indices).expect("merged"),
        gate_grads,
    }
}

/// Single-rank replay of `routed` through the replay-file path of `moe_models::replay`.
fn single_rank(full: &DeepseekV3ForCausalLM, ids: &[i64], routed: &RoutedExperts) -> Run {
    let model = replicate(full);
    let file = routed.to_replay_file(&model.replay_spec()).expect("file");
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [B, S]), &ad());
    let (logits, selected) = replay_routing(&model, input, &file).expect("replay");
    let layers: Vec<Vec<i64>> = selected
        .into_iter()
        .map(|t| t.into_data().try_into_vec_as::<i64>().expect("ids"))
        .collect();
    let used = RoutedExperts::from_layers(B, S, routed.topk, &layers).expect("routing");
    let loss = causal_lm_loss(logits.clone(), ids).expect("loss");
    let value = values(loss.clone())[0];
    let g = loss.backward();
    let gate_grads = gate_weights(&model)
        .into_iter()
        .map(|w| values(w.grad(&g).expect("gate gradient")))
        .collect();
    Run {
        logits: values(logits),
        loss: value,
        routed: used,
        gate_grads,
    }
}

fn assert_same(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.routed, b.routed, "{what}: routing");
    close(&a.logits, &b.logits, RTOL, &format!("{what}: logits"));
    close(&[a.loss], &[b.loss], RTOL, &format!("{what}: loss"));
}

/// Every token to experts `pick(token, layer)` (2 MoE layers, top-2).
fn forced(pick: impl Fn(usize, usize) -> [i64; 2]) -> RoutedExperts {
    let mut indices = Vec::new();
    for t in 0..B * S {
        for l in 0..2 {
            indices.extend(pick(t, l));
        }
    }
    RoutedExperts::new(B, S, 2, 2, indices).expect("routing")
}

#[test]
fn deepseek_routing_recorded_under_one_layout_replays_identically_under_others() {
    let full = fixture_model(&ad());
    let ids = batch_ids(full.config().vocab_size);
    let natural = run(1, "", &full, &ids, None);
    assert_eq!((natural.routed.layers, natural.routed.topk), (2, 2));
    // Group-limited routing (topk_group = 1 of 2 groups of 4): both experts in one group.
    for chunk in natural.routed.indices.chunks(2) {
        assert_eq!(
            chunk[0] / 4,
            chunk[1] / 4,
            "group-limited routing {chunk:?}"
        );
    }
    let folded = run(4, "tp=2,ep=4", &full, &ids, None);
    assert_same(&folded, &natural, "record world=4,tp=2,ep=4 vs world=1");
    for recording in [&natural, &folded] {
        for (world, spec) in [(1, ""), (2, "ep=2"), (4, "tp=2,ep=2,etp=2")] {
            let replayed = run(world, spec, &full, &ids, Some(&recording.routed));
            assert_same(&replayed, &natural, &format!("replay world={world} {spec}"));
            for (l, (g, w)) in replayed
                .gate_grads
                .iter()
                .zip(&natural.gate_grads)
                .enumerate()
            {
                close(
                    g,
                    w,
                    1e-4,
                    &format!("replay world={world} {spec}: layer {l} gate grad"),
                );
            }
        }
    }
}

#[test]
fn deepseek_forced_routing_equals_single_rank_replay() {
    let full = fixture_model(&ad());
    let ids = batch_ids(full.config().vocab_size);
    let natural = run(1, "", &full, &ids, None);
    // Across the two expert groups: a routing the group-limited selection never makes.
    let routing = forced(|t, l| {
        let a = ((t * 3 + l) % 4) as i64;
        [a, 4 + (a + t as i64) % 4]
    });
    let want = single_rank(&full, &ids, &routing);
    assert_eq!(want.routed, routing, "single-rank routing");
    let moved = want
        .logits
        .iter()
        .zip(&natural.logits)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        moved > 1e-4,
        "a forced routing should change the logits ({moved:.3e})"
    );
    for (world, spec) in [(1, ""), (4, "tp=2,ep=4"), (4, "tp=2,ep=2,etp=2")] {
        let what = format!("forced world={world} {spec}");
        let got = run(world, spec, &full, &ids, Some(&routing));
        assert_same(&got, &want, &what);
        for (l, (g, w)) in got.gate_grads.iter().zip(&want.gate_grads).enumerate() {
            assert!(
                g.iter().any(|v| *v != 0.0),
                "{what}: layer {l} router gradient is zero"
            );
            close(g, w, 1e-4, &format!("{what}: layer {l} router gradient"));
        }
    }
}

#[test]
fn deepseek_bad_routed_experts_are_rejected_by_field() {
    let full = fixture_model(&ad());
    let ids = batch_ids(full.config().vocab_size);
    let good = forced(|t, _| [(t % 8) as i64, ((t + 1) % 8) as i64]);
    let mut out_of_range = good.clone();
    out_of_range.indices[5] = 8;
    let mut duplicate = good.clone();
    duplicate.indices[3] = duplicate.indices[2];
    let wrong_topk = RoutedExperts::new(
        B,
        S,
        2,
        1,
        good.indices.iter().step_by(2).copied().collect(),
    )
    .expect("topk 1");
    let wrong_layers = RoutedExperts::new(
        B,
        S,
        1,
        2,
        good.indices
            .chunks(4)
            .flat_map(|c| c[..2].to_vec())
            .collect(),
    )
    .expect("1 layer");
    let cases = [
        (out_of_range, "routed_experts.indices", "out of range 0..8"),
        (duplicate, "routed_experts.indices", "selected twice"),
        (wrong_topk, "routed_experts.topk", "num_experts_per_tok = 2"),
        (wrong_layers, "routed_experts.layers", "2 MoE layers"),
    ];
    let layout = ParallelLayout::parse(2, "tp=2,ep=2").expect("layout");
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<DeepseekV3ForCausalLM>::shard(&full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        par.forward_loss_replayed(&ids, &ids, B, &ad(), 1.0, &good)
            .map_err(to_backend)?;
        for (routed, field, detail) in &cases {
            let e = par
                .forward_loss_replayed(&ids, &ids, B, &ad(), 1.0, routed)
                .expect_err(field);
            let msg = e.to_string();
            assert!(
                matches!(e, ModelError::InvalidInput { what, .. } if what == *field),
                "{field}: {msg}"
            );
            assert!(msg.contains(detail), "{field}: {msg}");
        }
        Ok(())
    });
    for r in results {
        r.expect("rank");
    }
}
