//! RL under every layout (issue 36), pipeline and context parallelism included:
//! - per-token log-probs and entropies ([`shard_logprobs`]: the forward-only pipeline schedule,
//!   results broadcast from the last stage) under `pp=2`, `pp=2,vpp=2`, `pp=2,cp=2,ep=2`, …
//!   equal the `world=1` run and `log_softmax` of the transformers goldens, for Qwen3-MoE and
//!   DeepSeek-V3;
//! - a policy-gradient step through the log-prob loss hook
//!   ([`Trainer::step_with_logprobs`]: PPO's clipped objective and an entropy bonus) under
//!   `pp=2,ep=2`, `pp=2,vpp=2`, `cp=2`, `pp=2,cp=2` equals the `world=1` step, parameters and
//!   expert biases after three steps;
//! - the same step under BF16 mixed precision (`precision: Bf16`, docs/training-and-rl.md
//!   §Mixed precision (BF16)) under `pp=2,ep=2` equals the `world=1` BF16 step within
//!   [`BF16_PARAM_RTOL`], every trainable parameter BF16 and its f32 main weight rounded.

mod common;

use burn::tensor::{DType, Device, Tensor, TensorData};
use common::{FixtureSource, Golden, fixtures};
use moe_backend::comm::World;
use moe_backend::optim::{DistributedAdamWConfig, Precision};
use moe_backend::parallel::{GroupFamily, ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::distributed::logprob_pipeline::shard_logprobs;
use moe_models::distributed::replay::RoutedExperts;
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use moe_models::rl::logprobs::TokenLogProbs;
use moe_models::rl::{LossAgg, PpoConfig, ResponseMask, aggregate, ppo_loss};
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3MoeConfig, Qwen3MoeForCausalLM,
};

fn be(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

fn qwen3_moe(device: &Device) -> Qwen3MoeForCausalLM {
    let dir = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    replicate(
        &Qwen3MoeForCausalLM::from_weights(&config, &FixtureSource::open(&dir), device)
            .expect("weights"),
    )
}

fn deepseek_v3(device: &Device) -> DeepseekV3ForCausalLM {
    let dir = fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    replicate(
        &DeepseekV3ForCausalLM::from_weights(&config, &FixtureSource::open(&dir), device)
            .expect("weights"),
    )
}

/// `max |a − b| / max |b|`.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    err / b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12)
}

/// `log_softmax` of the golden logits `[B, S, V]` at the next ids, and the entropies, in f64:
/// `[B, S − 1]` each.
fn golden_logprobs(golden: &Golden, ids: &[i64]) -> (Vec<f32>, Vec<f32>) {
    let (shape, logits) = golden.f32("logits");
    let (b, s, v) = (shape[0], shape[1], shape[2]);
    let (mut lp, mut h) = (Vec::new(), Vec::new());
    for row in 0..b {
        for t in 0..s - 1 {
            let l = &logits[(row * s + t) * v..(row * s + t + 1) * v];
            let max = l.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
            let lse = max
                + l.iter()
                    .map(|&x| (f64::from(x) - max).exp())
                    .sum::<f64>()
                    .ln();
            lp.push((f64::from(l[ids[row * s + t + 1] as usize]) - lse) as f32);
            h.push(
                -l.iter()
                    .map(|&x| (f64::from(x) - lse).exp() * (f64::from(x) - lse))
                    .sum::<f64>() as f32,
            );
        }
    }
    (lp, h)
}

/// The golden batch's log-probs under `spec`, as two micro-batches of one row each per
/// replica: `(logprobs, entropy)` of the whole batch `[B, S − 1]` row-major, assembled from
/// every rank's replica rows after checking that the ranks of a replica agree bit for bit.
fn scored<M: ParallelCausalLm + Sync>(
    full: &M,
    (world, spec): (usize, &str),
    ids: &[i64],
    [b, s]: [usize; 2],
) -> (Vec<f32>, Vec<f32>) {
    scored_routed(full, (world, spec), ids, [b, s], None)
}

/// [`scored`] with every row replaying its part of `routing` (`[B, S, layers, k]`).
fn scored_routed<M: ParallelCausalLm + Sync>(
    full: &M,
    (world, spec): (usize, &str),
    ids: &[i64],
    [b, s]: [usize; 2],
    routing: Option<&RoutedExperts>,
) -> (Vec<f32>, Vec<f32>) {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let replicas = layout.dp;
    let rows = b / replicas;
    let layout_ref = &layout;
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let shard = full.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
        let replica = pg.groups.get(GroupFamily::Dp).index;
        let micro: Vec<TrainBatch> = (0..rows)
            .map(|r| {
                let at = replica * rows + r;
                let batch = TrainBatch::causal(ids[at * s..(at + 1) * s].to_vec(), 1)?;
                match routing {
                    Some(routing) => batch.with_routed_experts(routing.slice_batch(at..at + 1)?),
                    None => Ok(batch),
                }
            })
            .collect::<Result<_, _>>()
            .map_err(be)?;
        let out = shard_logprobs(&shard, &micro, &pg, &Device::flex()).map_err(be)?;
        let flat = |f: fn(&TokenLogProbs) -> &Tensor<2>| -> Vec<f32> {
            out.iter().flat_map(|o| values(f(o).clone())).collect()
        };
        Ok((replica, flat(|o| &o.logprobs), flat(|o| &o.entropy)))
    });
    let n = rows * (s - 1);
    let mut lp: Vec<Option<Vec<f32>>> = vec![None; replicas];
    let mut h: Vec<Option<Vec<f32>>> = vec![None; replicas];
    for (rank, r) in results.into_iter().enumerate() {
        let (replica, l, e) = r.unwrap_or_else(|err| panic!("{spec} rank {rank}: {err}"));
        assert_eq!(
            l.len(),
            n,
            "{spec} rank {rank}: log-probs of its replica's rows"
        );
        match &lp[replica] {
            // Every rank of a replica (TP, CP, every pipeline stage) returns the same values.
            Some(first) => {
                assert_eq!(
                    first, &l,
                    "{spec} rank {rank}: log-probs differ in a replica"
                );
                assert_eq!(h[replica].as_ref(), Some(&e), "{spec} rank {rank}: entropy");
            }
            None => {
                lp[replica] = Some(l);
                h[replica] = Some(e);
            }
        }
    }
    let all = |v: Vec<Option<Vec<f32>>>| v.into_iter().flat_map(|x| x.expect("replica")).collect();
    (all(lp), all(h))
}

fn logprobs_match<M: ParallelCausalLm + Sync>(full: &M, name: &str, layouts: &[(usize, &str)]) {
    let golden = Golden::open(name);
    let (shape, ids) = golden.i64("input_ids");
    let [b, s] = [shape[0], shape[1]];
    let (want_lp, want_h) = golden_logprobs(&golden, &ids);
    let (one_lp, one_h) = scored(full, (1, ""), &ids, [b, s]);
    let (g_lp, g_h) = (rel(&one_lp, &want_lp), rel(&one_h, &want_h));
    println!("{name} world=1 vs transformers: logprobs {g_lp:.2e}, entropy {g_h:.2e}");
    assert!(
        g_lp <= 1e-5 && g_h <= 1e-5,
        "world=1 vs goldens: {g_lp:e}, {g_h:e}"
    );
    for &(world, spec) in layouts {
        let (lp, h) = scored(full, (world, spec), &ids, [b, s]);
        let (e_lp, e_h) = (rel(&lp, &one_lp), rel(&h, &one_h));
        let (t_lp, t_h) = (rel(&lp, &want_lp), rel(&h, &want_h));
        println!(
            "{name} {spec}: vs world=1 logprobs {e_lp:.2e} entropy {e_h:.2e}; vs transformers \
             {t_lp:.2e} {t_h:.2e}"
        );
        assert!(
            e_lp <= 1e-5 && e_h <= 1e-5,
            "{spec} vs world=1: {e_lp:e}, {e_h:e}"
        );
        assert!(
            t_lp <= 1e-5 && t_h <= 1e-5,
            "{spec} vs goldens: {t_lp:e}, {t_h:e}"
        );
    }
}

#[test]
fn qwen3_moe_logprobs_under_pipeline_and_context_layouts_equal_one_rank_and_goldens() {
    let full = qwen3_moe(&Device::flex());
    logprobs_match(
        &full,
        "qwen3_moe",
        &[
            (2, "pp=2,pp_layout=Et|t*2L"),
            (2, "pp=2,vpp=2,pp_layout=E|t|t|tL"),
            (4, "pp=2,cp=2,ep=2,pp_layout=Et*2|tL"),
            (2, "cp=2"),
            (4, "tp=2,pp=2,ep=2,pp_layout=Et|t*2L"),
            (4, "pp=2,ep=2,pp_layout=Et*2|tL"),
        ],
    );
}

#[test]
fn deepseek_v3_logprobs_under_pipeline_and_context_layouts_equal_one_rank_and_goldens() {
    let full = deepseek_v3(&Device::flex());
    logprobs_match(
        &full,
        "deepseek_v3",
        &[
            (2, "pp=2,pp_layout=Et|t*2mL"),
            (2, "pp=2,vpp=2,pp_layout=E|t|t|tmL"),
            (4, "pp=2,cp=2,ep=2,pp_layout=Et*2|tmL"),
            (4, "tp=2,pp=2,ep=2,pp_layout=Et*2|tmL"),
        ],
    );
}

/// RL routing replay with log-probs: a batch carrying an inference engine's routing replays it
/// in the log-prob forward under every layout (each stage its layers' entries, each CP rank its
/// chunks' rows), equal to the `world=1` replay and unlike the natural routing.
#[test]
fn routed_logprobs_replay_under_pipeline_and_context_layouts() {
    let full = qwen3_moe(&Device::flex());
    let golden = Golden::open("qwen3_moe");
    let (shape, ids) = golden.i64("input_ids");
    let [b, s] = [shape[0], shape[1]];
    // Two MoE layers (layer 0 is dense), top-2 of 8 experts, far from the natural choice.
    let (layers, k, e) = (2, 2, 8);
    let indices: Vec<i64> = (0..b * s)
        .flat_map(|t| {
            (0..layers).flat_map(move |l| {
                let a = (t * 3 + l * 5) % e;
                [a as i64, ((a + 1 + l) % e) as i64]
            })
        })
        .collect();
    let routing = RoutedExperts::new(b, s, layers, k, indices).expect("routing");
    let (natural, _) = scored(&full, (1, ""), &ids, [b, s]);
    let (one, one_h) = scored_routed(&full, (1, ""), &ids, [b, s], Some(&routing));
    let moved = rel(&one, &natural);
    assert!(
        moved > 1e-2,
        "the forced routing must move the log-probs ({moved:e})"
    );
    for (world, spec) in [
        (2, "pp=2,pp_layout=Et|t*2L"),
        (2, "cp=2"),
        (4, "pp=2,cp=2,ep=2,pp_layout=Et*2|tL"),
        (2, "pp=2,vpp=2,pp_layout=E|t|t|tL"),
    ] {
        let (lp, h) = scored_routed(&full, (world, spec), &ids, [b, s], Some(&routing));
        let (e_lp, e_h) = (rel(&lp, &one), rel(&h, &one_h));
        println!("replayed {spec}: vs world=1 {e_lp:.2e} {e_h:.2e} (routing moved {moved:.2e})");
        assert!(e_lp <= 1e-5 && e_h <= 1e-5, "{spec}: {e_lp:e}, {e_h:e}");
    }
}

const S: usize = 8;
const MBS: usize = 2;
const MICRO: usize = 2;
const STEPS: usize = 3;

/// Micro-batch `m` of replica `r` at `step`.
fn micro_batch(step: usize, r: usize, m: usize, vocab: usize) -> TrainBatch {
    let first = (r * MICRO + m) * MBS;
    let ids: Vec<i64> = (first..first + MBS)
        .flat_map(|i| {
            XorShift64::new(0x51f1_5eed_u64.wrapping_mul((step * 131 + i + 1) as u64)).ids(S, vocab)
        })
        .collect();
    TrainBatch::causal(ids, MBS).expect("batch")
}

/// A fixed value in `[-1, 1)` per (step, replica, micro-batch, position).
fn noise(step: usize, r: usize, m: usize, n: usize) -> Vec<f32> {
    let mut rng = XorShift64::new(0xadd5_0001 + (step * 97 + r * 13 + m) as u64);
    (0..n)
        .map(|_| (rng.ids(1, 1 << 16)[0] as f32) / 32768.0 - 1.0)
        .collect()
}

/// PPO's clipped objective of one micro-batch (old log-probs the current ones shifted by a
/// fixed amount per token, so the ratios reach the clip range; advantages fixed per token),
/// minus an entropy bonus; the mean over its tokens times `weight` (the caller's share: the
/// optimizer's mean over the replicas of their sums over micro-batches must be the mean over
/// the global batch's micro-batches).
fn ppo_objective(
    lp: TokenLogProbs,
    (step, r, m): (usize, usize, usize),
    weight: f64,
) -> Result<(Tensor<1>, usize), ModelError> {
    let dev = lp.logprobs.device();
    let [rows, t] = lp.logprobs.dims();
    let shift = noise(step, r, m, rows * t);
    let adv = noise(step + 100, r, m, rows * t);
    let shift = Tensor::<2>::from_data(TensorData::new(shift, [rows, t]), &dev).mul_scalar(0.3);
    let old = lp.logprobs.clone().detach() + shift;
    let adv = Tensor::<2>::from_data(TensorData::new(adv, [rows, t]), &dev);
    let mask = ResponseMask::from_float(Tensor::ones([rows, t], (&dev, DType::F32)))?;
    let out = ppo_loss(lp.logprobs, old, adv, &mask, &PpoConfig::default())?;
    let entropy = aggregate(lp.entropy, &mask, LossAgg::TokenMean)?;
    let objective = (out.loss - entropy.mul_scalar(0.01)).mul_scalar(weight);
    Ok((objective, rows * t))
}

fn config() -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        expert_bias_update_rate: Some(1e-2),
        optimizer: DistributedAdamWConfig {
            epsilon: 1e-3,
            ..TrainerConfig::default().optimizer
        },
        ..TrainerConfig::default()
    }
}

/// `a` equals `b` within `1e-5·max|b| + 1e-6` element-wise.
fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    let tight = 1e-5 * scale + 1e-6;
    if let Some(i) = (0..a.len()).find(|&i| (a[i] - b[i]).abs() > tight) {
        panic!(
            "{what}: index {i}: {} vs {} (tolerance {tight:e})",
            a[i], b[i]
        );
    }
}

/// [`config`] under BF16 mixed precision (f32 main gradients, f32 reduction).
fn bf16_config() -> TrainerConfig {
    TrainerConfig {
        precision: Precision::Bf16,
        ..config()
    }
}

/// The stated tolerance of the BF16 policy step under a layout against `world=1` BF16:
/// `max |a − b| ≤ 1e-2 · max |b|` over the parameters after three steps. The two runs sum
/// the same f32 main gradients in another order; a BF16 parameter whose main weight lies near
/// a rounding boundary then rounds the other way (one BF16 ulp, 2⁻⁸ relative), and that
/// difference feeds the next steps' gradients. Measured under `pp=2,ep=2`: 6.2e-3 (Qwen3-MoE)
/// and 6.0e-3 (DeepSeek-V3), about 1.5 BF16 ulps of the largest parameter, with 5–15% of the
/// elements differing; the expert biases (f32) are equal.
const BF16_PARAM_RTOL: f32 = 1e-2;

/// Every trainable parameter of `trainer`'s shard is BF16 and equals its f32 main weight
/// rounded to nearest even.
fn params_are_rounded_masters<M: ParallelCausalLm>(
    trainer: &Trainer<M>,
) -> Result<(), moe_backend::BackendError> {
    let optimizer = trainer.optimizer();
    let (dense, expert) = optimizer.table().flatten_values(trainer.model().model())?;
    let (m_dense, m_expert) = optimizer.master_values()?;
    for (got, master) in [(dense, m_dense), (expert, m_expert)] {
        assert_eq!(got.len(), master.len());
        for (i, (g, m)) in got.iter().zip(&master).enumerate() {
            let want = burn::tensor::bf16::from_f32(*m).to_f32();
            assert!(
                g.to_bits() == want.to_bits(),
                "element {i}: {g}, main weight {m}"
            );
        }
    }
    Ok(())
}

/// `STEPS` policy steps through the log-prob hook on one rank over every replica's
/// micro-batches: the final model and per-step objectives.
fn one_rank<M: ParallelCausalLm + Sync>(
    start: &M,
    vocab: usize,
    replicas: usize,
    config: fn() -> TrainerConfig,
) -> M {
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let ad = Device::flex().autodiff();
    let mut out = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut trainer = Trainer::new(start, &pg, ctx.world()?, config(), &ad).map_err(be)?;
        for step in 0..STEPS {
            let micro: Vec<TrainBatch> = (0..replicas)
                .flat_map(|r| (0..MICRO).map(move |m| micro_batch(step, r, m, vocab)))
                .collect();
            trainer
                .step_with_logprobs(&micro, |i, _, lp| {
                    // One replica holding the whole global batch.
                    ppo_objective(lp, (step, i / MICRO, i % MICRO), 1.0 / micro.len() as f64)
                })
                .map_err(be)?;
        }
        Ok(trainer.model().model().clone())
    });
    out.remove(0).expect("world 1")
}

fn steps_match<M: ParallelCausalLm + Sync>(start: &M, vocab: usize, layouts: &[(usize, &str)]) {
    steps_match_in(start, vocab, layouts, config, None);
}

/// [`steps_match`] with the trainer configuration `config`; with `bf16_rtol`, the parameters
/// (BF16, each its main weight rounded) and expert biases are compared within
/// `bf16_rtol · max |b|` instead of the f32 tolerance.
fn steps_match_in<M: ParallelCausalLm + Sync>(
    start: &M,
    vocab: usize,
    layouts: &[(usize, &str)],
    config: fn() -> TrainerConfig,
    bf16_rtol: Option<f32>,
) {
    for &(world, spec) in layouts {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let replicas = layout.dp;
        let reference = one_rank(start, vocab, replicas, config);
        let (layout_ref, reference) = (&layout, &reference);
        let ad = Device::flex().autodiff();
        let results = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let mut trainer = Trainer::new(start, &pg, ctx.world()?, config(), &ad).map_err(be)?;
            let replica = pg.groups.get(GroupFamily::Dp).index;
            for step in 0..STEPS {
                let micro: Vec<TrainBatch> = (0..MICRO)
                    .map(|m| micro_batch(step, replica, m, vocab))
                    .collect();
                let stats = trainer
                    .step_with_logprobs(&micro, |i, _, lp| {
                        // The optimizer averages over the replicas.
                        let weight = replicas as f64 / (replicas * MICRO) as f64;
                        ppo_objective(lp, (step, replica, i), weight)
                    })
                    .map_err(be)?;
                assert!(stats.loss.is_finite() && stats.tokens == MICRO * MBS * (S - 1));
            }
            if bf16_rtol.is_some() {
                params_are_rounded_masters(&trainer)?;
            }
            let table = trainer.optimizer().table();
            let mine = table.flatten_values(trainer.model().model())?;
            let mut want_shard = reference.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
            let want = table.flatten_values(want_shard.model())?;
            let bias = |routers: Vec<&mut moe_backend::router::TopKRouter>| -> Vec<Vec<f32>> {
                routers
                    .into_iter()
                    .filter_map(|r| r.expert_bias_values().expect("bias"))
                    .collect()
            };
            let want_bias = bias(want_shard.routers_mut());
            let (shard, _) = trainer.parts_mut();
            Ok((mine, want, bias(shard.routers_mut()), want_bias))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (mine, want, bias, want_bias) =
                r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            let what = |s: &str| format!("{spec} rank {rank}: {s} after {STEPS} steps");
            let mut pairs = vec![
                (mine.0, want.0, what("dense parameters")),
                (mine.1, want.1, what("expert parameters")),
            ];
            assert_eq!(bias.len(), want_bias.len());
            for (l, (b, w)) in bias.into_iter().zip(want_bias).enumerate() {
                pairs.push((b, w, what(&format!("expert bias of router {l}"))));
            }
            for (a, b, name) in pairs {
                match bf16_rtol {
                    None => close(&a, &b, &name),
                    Some(tol) if !b.is_empty() => {
                        let r = rel(&a, &b);
                        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
                        println!(
                            "{name}: max |a − b| / max |b| = {r:.2e} ({differ} of {} differ)",
                            b.len()
                        );
                        assert!(r <= tol, "{name}: {r:e} > {tol:e}");
                    }
                    Some(_) => {}
                }
            }
        }
        println!("{spec}: {STEPS} PPO steps through the log-prob hook equal world=1");
    }
}

#[test]
fn qwen3_moe_policy_steps_under_pipeline_and_context_layouts_equal_one_rank() {
    let start = qwen3_moe(&Device::flex().autodiff());
    steps_match(
        &start,
        256,
        &[
            (4, "pp=2,ep=2,pp_layout=Et|t*2L"),
            (2, "pp=2,vpp=2,pp_layout=E|t|t|tL"),
            (2, "cp=2"),
            (4, "pp=2,cp=2,ep=2,pp_layout=Et*2|tL"),
        ],
    );
}

#[test]
fn deepseek_v3_policy_steps_under_pipeline_layouts_equal_one_rank() {
    let start = deepseek_v3(&Device::flex().autodiff());
    steps_match(
        &start,
        256,
        &[
            (4, "pp=2,ep=2,pp_layout=Et|t*2mL"),
            (4, "tp=2,pp=2,pp_layout=Et*2|tmL"),
        ],
    );
}

/// The policy step under BF16 mixed precision (`Et|t*2L` on the 3-layer fixture, `pp=2,ep=2`)
/// equals the `world=1` BF16 step within [`BF16_PARAM_RTOL`].
#[test]
fn qwen3_moe_bf16_policy_steps_under_pp2_ep2_equal_one_rank_bf16() {
    let start = qwen3_moe(&Device::flex().autodiff());
    steps_match_in(
        &start,
        256,
        &[(4, "pp=2,ep=2,pp_layout=Et|t*2L")],
        bf16_config,
        Some(BF16_PARAM_RTOL),
    );
}

/// [`qwen3_moe_bf16_policy_steps_under_pp2_ep2_equal_one_rank_bf16`] for DeepSeek-V3 (MTP on
/// the last stage, f32 expert bias).
#[test]
fn deepseek_v3_bf16_policy_steps_under_pp2_ep2_equal_one_rank_bf16() {
    let start = deepseek_v3(&Device::flex().autodiff());
    steps_match_in(
        &start,
        256,
        &[(4, "pp=2,ep=2,pp_layout=Et|t*2mL")],
        bf16_config,
        Some(BF16_PARAM_RTOL),
    );
}
