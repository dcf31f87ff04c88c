//! Router replay in the sharded Qwen3-MoE forward (issue 19, item 3): a routing recorded
//! under one layout and replayed under another reproduces the logits and losses exactly up to
//! the parallel-equivalence tolerance; a forced routing equals the single-rank replay of the
//! same routing; router gradients flow under replay; bad routings are rejected by field.

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::causal_lm::causal_lm_loss;
use moe_models::distributed::replay::RoutedExperts;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::qwen3_moe::Qwen3MoeFeedForward;
use moe_models::replay::{RouterReplayModel, replay_routing};
use moe_models::{ModelError, Qwen3MoeConfig, Qwen3MoeForCausalLM};

const B: usize = 4;
const S: usize = 8;
/// Relative tolerance of the parallel-equivalence tests.
const RTOL: f32 = 1e-5;

fn ad() -> Device {
    Device::flex().autodiff()
}

/// The qwen3_moe fixture config (8 experts, top-2, layers 1 and 2 MoE), random weights.
fn model() -> Qwen3MoeForCausalLM {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/qwen3_moe/config.json"
    );
    Qwen3MoeConfig::from_file(path)
        .expect("config")
        .init(&ad())
        .expect("init")
        .set_require_grad(true)
}

fn ids(vocab: usize) -> Vec<i64> {
    XorShift64::new(0x9e37_79b9_7f4a_7c15).ids(B * S, vocab)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

/// Asserts `max|a − b| ≤ rtol · max|b|`.
fn close(a: &[f32], b: &[f32], rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= rtol * scale,
        "{what}: max error {err:.3e} > {rtol:.0e} · {scale:.4e}"
    );
}

fn to_backend(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// What one layout's run gives for the whole batch.
struct Run {
    /// `[B·S, V]` logits gathered over vocabulary shards and replicas.
    logits: Vec<f32>,
    /// Mean of the replicas' losses (= the batch's: every replica has as many targets).
    loss: f32,
    /// The routing used, recorded on every rank and merged over replicas.
    routed: RoutedExperts,
    /// Router gate gradients `[E, H]` of every MoE layer, summed over the ranks and divided
    /// by the replicas (the gradient of the batch loss).
    gate_grads: Vec<Vec<f32>>,
}

struct RankOut {
    replica: usize,
    vocab: std::ops::Range<usize>,
    logits: Vec<f32>,
    loss: f32,
    routed: RoutedExperts,
    gate_grads: Vec<Vec<f32>>,
}

fn gate_weights(model: &Qwen3MoeForCausalLM) -> Vec<Tensor<2>> {
    model
        .model
        .layers
        .iter()
        .filter_map(|l| match &l.mlp {
            Qwen3MoeFeedForward::Sparse(block) => Some(block.moe.router.weight.val()),
            Qwen3MoeFeedForward::Dense(_) => None,
        })
        .collect()
}

/// Runs the sharded forward (and backward) under `spec` on `world` ranks, replaying
/// `replay` (the whole batch's routing, split over replicas) when given.
fn run(
    world: usize,
    spec: &str,
    full: &Qwen3MoeForCausalLM,
    ids: &[i64],
    replay: Option<&RoutedExperts>,
) -> Run {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let replicas = layout.dp * layout.cp;
    let rows = B / replicas;
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<Qwen3MoeForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
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
            // The replay-only entry point gives the same loss.
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
        // Every TP rank of a replica returns the replica's whole routing.
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

/// Single-rank replay of `routed` through the file path of `moe_models::replay`: logits,
/// loss and router gate gradients.
fn single_rank(full: &Qwen3MoeForCausalLM, ids: &[i64], routed: &RoutedExperts) -> Run {
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

/// Every token to experts `pick(token, layer)`.
fn forced(layers: usize, pick: impl Fn(usize, usize) -> [i64; 2]) -> RoutedExperts {
    let mut indices = Vec::new();
    for t in 0..B * S {
        for l in 0..layers {
            indices.extend(pick(t, l));
        }
    }
    RoutedExperts::new(B, S, layers, 2, indices).expect("routing")
}

#[test]
fn routing_recorded_under_one_layout_replays_identically_under_others() {
    let full = model();
    let ids = ids(full.config().vocab_size);
    let natural = run(1, "", &full, &ids, None);
    assert_eq!(natural.routed.layers, 2);
    let folded = run(4, "tp=2,ep=4", &full, &ids, None);
    assert_same(&folded, &natural, "record world=4,tp=2,ep=4 vs world=1");
    for recording in [&natural, &folded] {
        for (world, spec) in [(1, ""), (2, "ep=2"), (4, "tp=2,ep=2,etp=2")] {
            let replayed = run(world, spec, &full, &ids, Some(&recording.routed));
            assert_same(&replayed, &natural, &format!("replay world={world} {spec}"));
        }
    }
}

#[test]
fn forced_routing_changes_the_loss_and_equals_single_rank_replay() {
    let full = model();
    let ids = ids(full.config().vocab_size);
    let natural = run(1, "", &full, &ids, None);
    let routings = [
        forced(2, |_, _| [0, 1]),
        forced(2, |t, l| {
            let a = ((t * 3 + l) % 8) as i64;
            [a, (a + 5) % 8]
        }),
    ];
    for (i, routing) in routings.iter().enumerate() {
        let want = single_rank(&full, &ids, routing);
        assert_eq!(&want.routed, routing, "single-rank routing {i}");
        // A different routing changes the logits well beyond the tolerance, and the loss
        // (a random-init model's loss stays near ln V, so only the logits have a margin).
        let scale = natural.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        let moved = want
            .logits
            .iter()
            .zip(&natural.logits)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            moved > 1e-3 * scale && want.loss != natural.loss,
            "routing {i} should change the logits ({moved:.3e} vs scale {scale:.3e}) and the \
             loss ({} vs {})",
            want.loss,
            natural.loss
        );
        for (world, spec) in [
            (1, ""),
            (2, "ep=2"),
            (4, "tp=2,ep=4"),
            (4, "tp=2,ep=2,etp=2"),
        ] {
            let what = format!("routing {i} world={world} {spec}");
            let got = run(world, spec, &full, &ids, Some(routing));
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
}

#[test]
fn bad_routed_experts_are_rejected_by_field() {
    let full = model();
    let ids = ids(full.config().vocab_size);
    let good = forced(2, |t, _| [(t % 8) as i64, ((t + 1) % 8) as i64]);
    let mut out_of_range = good.clone();
    out_of_range.indices[5] = 8;
    let mut negative = good.clone();
    negative.indices[0] = -1;
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
    let wrong_batch = RoutedExperts::new(2, 2 * S, 2, 2, good.indices.clone()).expect("2 × 16");
    let mut short = good.clone();
    short.indices.pop();
    let cases = [
        (out_of_range, "routed_experts.indices", "out of range"),
        (negative, "routed_experts.indices", "out of range"),
        (duplicate, "routed_experts.indices", "selected twice"),
        (wrong_topk, "routed_experts.topk", "num_experts_per_tok = 2"),
        (wrong_layers, "routed_experts.layers", "2 MoE layers"),
        (wrong_batch, "routed_experts.batch", "forward has 4"),
        (short, "routed_experts.indices", "expected"),
    ];
    assert!(RoutedExperts::new(B, S, 2, 2, vec![0; 3]).is_err());
    let layout = ParallelLayout::parse(2, "tp=2,ep=2").expect("layout");
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let par = Sharded::<Qwen3MoeForCausalLM>::shard(&full, &pg, DispatcherKind::AllToAll)
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
