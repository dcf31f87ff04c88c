//! Attention masks and sequence packing (tracker issue 19, item 4): three documents of
//! different lengths packed into one row (with trailing padding) give, per document, the
//! logits, per-token log-probs and loss of the document run alone — single-rank and sharded at
//! `world=1` and under `world=4, tp=2, ep=4` — a left-padded batch equals the unpadded
//! sequences, a training step on the packed batch equals the step on the padded documents
//! (same token-mean loss, router losses over the same tokens, same gradients and parameters),
//! and bad packing inputs are errors naming the field.
//!
//! "Equal" is the f32 equivalence tolerance of docs/architecture.md §Equality and tolerances:
//! `|a − b| ≤ 1e-5·max|b| + 1e-6` element-wise (scalars: `1e-5` relative).

mod common;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm, Sharded};
use moe_models::packing::SequenceLayout;
use moe_models::qwen3::Qwen3ForCausalLM;
use moe_models::rl::logprobs::{TokenLogProbs, logprobs_from_logits, model_logprobs_batch};
use moe_models::train::{PaddingSide, StepStats, TrainBatch, Trainer, TrainerConfig};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3Config, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
};

/// Document lengths: packed back to back into one row of [`S`] tokens (two padding tokens at
/// the end).
const LENGTHS: [usize; 3] = [5, 3, 6];
/// Row length of the packed batch.
const S: usize = 16;
/// Row length of the padded batches (the longest document).
const PADDED: usize = 6;
const PAD: i64 = 0;

fn ad() -> Device {
    Device::flex().autodiff()
}

fn be(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// The three documents (deterministic ids in `1..vocab`).
fn documents(vocab: usize) -> Vec<Vec<i64>> {
    let mut rng = XorShift64::new(0x2545_f491_4f6c_dd1d);
    LENGTHS
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| 1 + rng.below(vocab as u64 - 1) as i64)
                .collect()
        })
        .collect()
}

/// First column of every document in the packed row.
fn starts() -> Vec<usize> {
    LENGTHS
        .iter()
        .scan(0, |at, &len| {
            let start = *at;
            *at += len;
            Some(start)
        })
        .collect()
}

/// The documents packed into one row with Megatron-style `cu_seqlens` (labels = ids; the
/// layout masks the boundaries and the padding).
fn packed(docs: &[Vec<i64>]) -> TrainBatch {
    let mut ids: Vec<i64> = docs.concat();
    ids.resize(S, PAD);
    let mut cu = vec![0];
    cu.extend(LENGTHS.iter().scan(0, |at, &len| {
        *at += len;
        Some(*at)
    }));
    let batch = TrainBatch::causal(ids, 1)
        .and_then(|b| b.with_cu_seqlens(vec![cu]))
        .expect("packed batch");
    // `TrainBatch::packed` builds the same batch from the documents (its column-0 label, never
    // a target, is −100).
    let built = TrainBatch::packed(docs, 1, S, PAD).expect("packed()");
    assert_eq!(built.input_ids, batch.input_ids);
    assert_eq!(built.labels[1..], batch.labels[1..]);
    assert_eq!(built.layout(), batch.layout());
    batch
}

fn padded(docs: &[Vec<i64>], side: PaddingSide) -> TrainBatch {
    TrainBatch::padded(docs, PADDED, PAD, side).expect("padded batch")
}

fn ids_tensor(ids: &[i64], [b, s]: [usize; 2], device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Tensor::from_data(TensorData::new(ids, [b, s]), device)
}

fn f32s<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values")
}

/// `a` equals `b` within `1e-5·max|b| + 1e-6` element-wise.
fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let tol = 1e-5 * scale + 1e-6;
    if let Some(i) = (0..a.len()).find(|&i| (a[i] - b[i]).abs() > tol || !a[i].is_finite()) {
        panic!(
            "{what}: index {i}: {} vs {} (tolerance {tol:e}, max |diff| {:e})",
            a[i],
            b[i],
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        );
    }
}

/// `a` equals `b` within `1e-5` relative (+1e-7 absolute).
fn close_scalar(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-7, "{what}: {a} vs {b}");
}

/// What the tests need from an MoE model family.
trait Family: ParallelCausalLm + Clone + Send + Sync + 'static {
    fn load(device: &Device) -> Self;
    fn vocab(&self) -> usize;
    /// Single-rank logits of a plain batch.
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3>;
    /// Single-rank logits of a packed or padded batch.
    fn logits_packed(
        &self,
        ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Tensor<3>, ModelError>;
    /// Sharded log-probs and loss of a batch.
    fn sharded(
        shard: &Self::Shard,
        batch: &TrainBatch,
        device: &Device,
    ) -> Result<(TokenLogProbs, Tensor<1>), ModelError>;
}

impl Family for Qwen3MoeForCausalLM {
    fn load(device: &Device) -> Self {
        let dir = common::fixtures().join("qwen3_moe");
        let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
        let source = common::FixtureSource::open(&dir);
        replicate(&Self::from_weights(&config, &source, device).expect("weights"))
    }
    fn vocab(&self) -> usize {
        self.config().vocab_size
    }
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids).expect("forward").logits
    }
    fn logits_packed(
        &self,
        ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Tensor<3>, ModelError> {
        Ok(self.forward_packed(ids, layout)?.logits)
    }
    fn sharded(
        shard: &Sharded<Qwen3MoeForCausalLM>,
        batch: &TrainBatch,
        device: &Device,
    ) -> Result<(TokenLogProbs, Tensor<1>), ModelError> {
        let lp = shard.forward_logprobs_batch(batch, device, 1.0)?;
        let loss = shard.forward_loss_batch(batch, device, 1.0)?.loss;
        Ok((lp, loss))
    }
}

impl Family for DeepseekV3ForCausalLM {
    fn load(device: &Device) -> Self {
        let dir = common::fixtures().join("deepseek_v3");
        let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
        let source = common::FixtureSource::open(&dir);
        replicate(&Self::from_weights(&config, &source, device).expect("weights"))
    }
    fn vocab(&self) -> usize {
        self.config().vocab_size
    }
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids).expect("forward").logits
    }
    fn logits_packed(
        &self,
        ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Tensor<3>, ModelError> {
        Ok(self.forward_packed(ids, layout)?.logits)
    }
    fn sharded(
        shard: &Sharded<DeepseekV3ForCausalLM>,
        batch: &TrainBatch,
        device: &Device,
    ) -> Result<(TokenLogProbs, Tensor<1>), ModelError> {
        let lp = shard.forward_logprobs_batch(batch, device, 1.0)?;
        let loss = shard.forward_loss_batch(batch, device, 1.0)?.loss;
        Ok((lp, loss))
    }
}

/// Per document alone (single rank): logits `[L, V]` flattened, log-probs and entropies
/// `[L − 1]`, and the summed cross-entropy of its `L − 1` targets.
struct Alone {
    logits: Vec<Vec<f32>>,
    logprobs: Vec<Vec<f32>>,
    entropy: Vec<Vec<f32>>,
    ce_sum: f64,
    targets: usize,
}

fn alone<M: Family>(model: &M, docs: &[Vec<i64>], device: &Device) -> Alone {
    let mut out = Alone {
        logits: Vec::new(),
        logprobs: Vec::new(),
        entropy: Vec::new(),
        ce_sum: 0.0,
        targets: 0,
    };
    for doc in docs {
        let logits = model.logits(ids_tensor(doc, [1, doc.len()], device));
        let lp = logprobs_from_logits(logits.clone(), doc).expect("log-probs");
        let values = f32s(lp.logprobs);
        out.ce_sum -= values.iter().map(|&v| f64::from(v)).sum::<f64>();
        out.targets += values.len();
        out.logprobs.push(values);
        out.entropy.push(f32s(lp.entropy));
        out.logits.push(f32s(logits));
    }
    out
}

/// The `[rows, len − 1]` per-position values of a batch whose row `r` holds document `d` at
/// column `start` (`(r, d, start)` per document), 0 elsewhere.
fn place(per_doc: &[Vec<f32>], at: &[(usize, usize, usize)], [rows, len]: [usize; 2]) -> Vec<f32> {
    let mut out = vec![0.0; rows * (len - 1)];
    for &(r, d, start) in at {
        for (i, &v) in per_doc[d].iter().enumerate() {
            out[r * (len - 1) + start + i] = v;
        }
    }
    out
}

/// Where each document sits in the packed row and in the left-padded rows.
fn packed_at() -> Vec<(usize, usize, usize)> {
    starts()
        .into_iter()
        .enumerate()
        .map(|(d, s)| (0, d, s))
        .collect()
}

fn left_at() -> Vec<(usize, usize, usize)> {
    LENGTHS
        .iter()
        .enumerate()
        .map(|(d, &len)| (d, d, PADDED - len))
        .collect()
}

/// Single-rank forward: each document's logits in the packed row and in the left-padded
/// batch equal the document run alone.
fn single_rank_logits_match<M: Family>() {
    let device = Device::flex();
    let model = M::load(&device);
    let docs = documents(model.vocab());
    let want = alone(&model, &docs, &device);
    let v = model.vocab();
    for (what, batch, at, [rows, len]) in [
        ("packed", packed(&docs), packed_at(), [1, S]),
        (
            "left-padded",
            padded(&docs, PaddingSide::Left),
            left_at(),
            [3, PADDED],
        ),
    ] {
        let layout = batch.layout().expect("layout");
        let logits = model
            .logits_packed(ids_tensor(&batch.input_ids, [rows, len], &device), layout)
            .expect("packed forward");
        assert_eq!(logits.dims(), [rows, len, v]);
        for &(r, d, start) in &at {
            let got = logits.clone().narrow(0, r, 1).narrow(1, start, LENGTHS[d]);
            close(
                &f32s(got),
                &want.logits[d],
                &format!("{what}: logits of document {d}"),
            );
        }
    }
}

#[test]
fn qwen3_moe_packed_and_left_padded_logits_equal_each_document_alone() {
    single_rank_logits_match::<Qwen3MoeForCausalLM>();
}

#[test]
fn deepseek_v3_packed_and_left_padded_logits_equal_each_document_alone() {
    single_rank_logits_match::<DeepseekV3ForCausalLM>();
}

#[test]
fn dense_qwen3_packed_logits_equal_each_document_alone() {
    let device = Device::flex();
    let dir = common::fixtures().join("qwen3");
    let config = Qwen3Config::from_file(dir.join("config.json")).expect("config");
    let source = common::FixtureSource::open(&dir);
    let model = Qwen3ForCausalLM::from_weights(&config, &source, &device).expect("weights");
    let docs = documents(config.vocab_size);
    let batch = packed(&docs);
    let logits = model
        .forward_packed(
            ids_tensor(&batch.input_ids, [1, S], &device),
            batch.layout().expect("layout"),
        )
        .expect("packed forward");
    for (d, start) in starts().into_iter().enumerate() {
        let doc = &docs[d];
        let want = model
            .forward(ids_tensor(doc, [1, doc.len()], &device))
            .expect("forward");
        close(
            &f32s(logits.clone().narrow(1, start, doc.len())),
            &f32s(want),
            &format!("dense Qwen3: logits of document {d}"),
        );
    }
}

/// The single-rank Qwen3-MoE log-prob entry point on a packed batch.
#[test]
fn qwen3_moe_single_rank_packed_logprobs_equal_each_document_alone() {
    let device = Device::flex();
    let model = Qwen3MoeForCausalLM::load(&device);
    let docs = documents(model.vocab());
    let want = alone(&model, &docs, &device);
    let got = model_logprobs_batch(&model, &packed(&docs), &device).expect("log-probs");
    close(
        &f32s(got.logprobs),
        &place(&want.logprobs, &packed_at(), [1, S]),
        "log-probs",
    );
    close(
        &f32s(got.entropy),
        &place(&want.entropy, &packed_at(), [1, S]),
        "entropies",
    );
}

/// The sharded forward (vocab-parallel log-probs and loss) of the packed and the left-padded
/// batch at `world=1` and under `world=4, tp=2, ep=4` (both replicas given the same batch):
/// per-token log-probs and entropies equal the documents alone (0 at positions whose target
/// crosses a boundary or is padding), the loss is the token mean over the documents.
fn sharded_logprobs_match<M: Family>() {
    let device = Device::flex();
    let full = M::load(&device);
    let docs = documents(full.vocab());
    let want = alone(&full, &docs, &device);
    let want_loss = want.ce_sum / want.targets as f64;
    let cases = [
        (packed(&docs), packed_at(), [1, S]),
        (padded(&docs, PaddingSide::Left), left_at(), [3, PADDED]),
    ];
    for (world, spec) in [(1, ""), (4, "tp=2,ep=4")] {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let (full_ref, cases_ref, layout_ref) = (&full, &cases, &layout);
        let results = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard = full_ref.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
            cases_ref
                .iter()
                .map(|(batch, _, _)| {
                    let (lp, loss) = M::sharded(&shard, batch, &Device::flex()).map_err(be)?;
                    Ok((f32s(lp.logprobs), f32s(lp.entropy), f32s(loss)[0]))
                })
                .collect::<Result<Vec<_>, _>>()
        });
        for (rank, res) in results.into_iter().enumerate() {
            let res = res.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            for ((lp, ent, loss), (batch, at, shape)) in res.iter().zip(&cases) {
                let what = |s: &str| {
                    format!(
                        "world {world} {spec} rank {rank}, {} rows: {s}",
                        batch.batch
                    )
                };
                close(lp, &place(&want.logprobs, at, *shape), &what("log-probs"));
                close(ent, &place(&want.entropy, at, *shape), &what("entropies"));
                close_scalar(f64::from(*loss), want_loss, &what("loss"));
            }
        }
    }
}

#[test]
fn qwen3_moe_sharded_packed_logprobs_and_loss_equal_each_document_alone() {
    sharded_logprobs_match::<Qwen3MoeForCausalLM>();
}

#[test]
fn deepseek_v3_sharded_packed_logprobs_and_loss_equal_each_document_alone() {
    sharded_logprobs_match::<DeepseekV3ForCausalLM>();
}

/// Real training settings (router aux loss and z-loss on, expert bias updating with a visible
/// rate, MTP on for DeepSeek-V3) with Adam ε = 1e-3, so parameters after the steps can be held
/// to the tight tolerance (ε = 1e-8 passes f32 reduction-order noise of near-zero gradients on
/// at the scale of the learning rate; see `training_equivalence.rs`).
fn train_config() -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        expert_bias_update_rate: Some(1e-2),
        optimizer: moe_backend::optim::DistributedAdamWConfig {
            epsilon: 1e-3,
            ..TrainerConfig::default().optimizer
        },
        ..TrainerConfig::default()
    }
}

const STEPS: usize = 2;

/// One run's per-rank results: step statistics, the first step's reduced gradients and the
/// final parameters (in the rank's table layout), the expert biases.
struct RankRun {
    stats: Vec<StepStats>,
    grads: (Vec<f32>, Vec<f32>),
    params: (Vec<f32>, Vec<f32>),
    biases: Vec<Vec<f32>>,
}

/// Trains `STEPS` steps on `batch` (every replica the same batch) under `(world, spec)`;
/// before the first step, records the reduced gradients of the training objective (main loss
/// plus the scaled MTP losses, router losses attached: the trainer's objective of a single
/// micro-batch). Returns each rank's results and final shard.
fn train<M: Family>(
    start: &M,
    batch: &TrainBatch,
    (world, spec): (usize, &str),
) -> Vec<(RankRun, M)> {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let layout_ref = &layout;
    World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let config = train_config();
        let scale = config.mtp_loss_scaling_factor;
        let mut trainer = Trainer::new(start, &pg, ctx.world()?, config, &ad()).map_err(be)?;
        let grads = {
            let (shard, optimizer) = trainer.parts_mut();
            let mtp = shard.mtp_depths() > 0;
            let out = shard
                .forward_train_batch(batch, &ad(), 1.0, mtp)
                .map_err(be)?;
            let depths = out.mtp_losses.len().max(1) as f64;
            let objective = out
                .mtp_losses
                .into_iter()
                .fold(out.loss, |acc, l| acc + l.mul_scalar(scale / depths));
            let grads = GradientsParams::from_grads(objective.backward(), shard.model());
            optimizer.reduced_gradients(shard.model(), grads)?
        };
        let mut stats = Vec::new();
        for _ in 0..STEPS {
            stats.push(trainer.step(batch).map_err(be)?);
        }
        let params = trainer
            .optimizer()
            .table()
            .flatten_values(trainer.model().model())?;
        let biases = {
            let (shard, _) = trainer.parts_mut();
            shard
                .routers_mut()
                .into_iter()
                .filter_map(|r| r.expert_bias_values().expect("bias"))
                .collect()
        };
        Ok((
            RankRun {
                stats,
                grads,
                params,
                biases,
            },
            trainer.model().model().clone(),
        ))
    })
    .into_iter()
    .enumerate()
    .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}")))
    .collect()
}

/// A training step on the packed row equals the step on the same documents right-padded to
/// one row each: same token-mean cross-entropy, the router aux loss and the expert-bias counts
/// over the same (unpadded) tokens, the same gradients, parameters and expert biases — at
/// `world=1` and under `world=4, tp=2, ep=4` (whose sequence-parallel halves of the packed row
/// hold different numbers of padded rows), and under `cp=2` (context parallelism of a packed
/// row: document masks across the gathered keys).
fn training_step_matches<M: Family>() {
    let start = M::load(&ad());
    let docs = documents(start.vocab());
    let unpacked = padded(&docs, PaddingSide::Right);
    let packed = packed(&docs);
    assert_eq!(unpacked.target_tokens(), packed.target_tokens());
    assert_eq!(
        packed.target_tokens(),
        LENGTHS.iter().map(|l| l - 1).sum::<usize>()
    );
    let reference = train(&start, &unpacked, (1, ""));
    let (ref_run, ref_model) = &reference[0];
    // `cp=2`: the packed rows cut into four chunks of 4, two per rank (the padded twin's rows
    // of 6 do not split; its parameters are laid out as at world 1, so the world-1 run is
    // the reference).
    for (world, spec) in [(1, ""), (4, "tp=2,ep=4"), (2, "cp=2")] {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let runs = train(&start, &packed, (world, spec));
        let twins = (world > 1 && layout.cp == 1).then(|| train(&start, &unpacked, (world, spec)));
        let layout_ref = &layout;
        // The reference's final parameters in each rank's shard layout.
        let want_params = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let trainer =
                Trainer::new(ref_model, &pg, ctx.world()?, train_config(), &ad()).map_err(be)?;
            trainer
                .optimizer()
                .table()
                .flatten_values(trainer.model().model())
        });
        for (rank, ((run, _), want)) in runs.iter().zip(want_params).enumerate() {
            let want = want.expect("reference shard");
            let what = |s: &str| format!("{spec} rank {rank}: {s}");
            // Gradients first: they say most about a mismatch. (Under context parallelism
            // the recorded objective is each rank's own token mean, not the trainer's
            // token-weighted one; the steps below compare what the trainer does.)
            if layout.cp == 1 {
                let grads_want = match &twins {
                    Some(t) => &t[rank].0.grads,
                    None => &ref_run.grads,
                };
                close(&run.grads.0, &grads_want.0, &what("dense gradients"));
                close(&run.grads.1, &grads_want.1, &what("expert gradients"));
            }
            for (step, (s, w)) in run.stats.iter().zip(&ref_run.stats).enumerate() {
                let at = |s: &str| what(&format!("step {step} {s}"));
                assert_eq!(s.tokens, w.tokens, "{}", at("tokens"));
                close_scalar(f64::from(s.loss), f64::from(w.loss), &at("loss"));
                close_scalar(s.grad_norm, w.grad_norm, &at("gradient norm"));
                if world == 1 {
                    // Per-rank aux-loss parts sum to the replica's over tp.
                    close_scalar(f64::from(s.aux_loss), f64::from(w.aux_loss), &at("aux"));
                }
                match (s.mtp_loss, w.mtp_loss) {
                    (Some(a), Some(b)) => close_scalar(f64::from(a), f64::from(b), &at("mtp")),
                    (a, b) => assert_eq!(a.is_some(), b.is_some(), "{}", at("mtp")),
                }
            }
            close(&run.params.0, &want.0, &what("dense parameters"));
            close(&run.params.1, &want.1, &what("expert parameters"));
            assert_eq!(run.biases.len(), ref_run.biases.len());
            for (l, (b, w)) in run.biases.iter().zip(&ref_run.biases).enumerate() {
                close(b, w, &what(&format!("expert bias of router {l}")));
            }
        }
        if let Some(twins) = &twins {
            // A replica's aux loss is its TP ranks' parts summed (the parts depend on how the
            // sequence-parallel split falls); both replicas hold the same batch.
            let replicas = layout.dp as f64;
            for step in 0..STEPS {
                let sum = |r: &[(RankRun, M)]| {
                    r.iter()
                        .map(|(x, _)| f64::from(x.stats[step].aux_loss))
                        .sum::<f64>()
                        / replicas
                };
                let want = f64::from(ref_run.stats[step].aux_loss);
                let at = |s: &str| format!("{spec} step {step}: {s}");
                close_scalar(sum(&runs), want, &at("packed aux loss vs world 1"));
                close_scalar(sum(twins), want, &at("padded aux loss vs world 1"));
            }
        }
    }
}

#[test]
fn qwen3_moe_training_step_on_packed_batch_equals_unpacked_documents() {
    training_step_matches::<Qwen3MoeForCausalLM>();
}

#[test]
fn deepseek_v3_training_step_on_packed_batch_equals_unpacked_documents() {
    training_step_matches::<DeepseekV3ForCausalLM>();
}

#[test]
fn bad_packing_inputs_are_errors_naming_the_field() {
    let ids: Vec<i64> = (1..=S as i64).collect();
    let batch = || TrainBatch::causal(ids.clone(), 1).expect("batch");
    let err = |r: Result<TrainBatch, ModelError>| r.expect_err("must fail").to_string();
    let e = err(batch().with_cu_seqlens(vec![vec![0, 5, 3, 14]]));
    assert!(
        e.contains("`cu_seqlens` of row 0") && e.contains("strictly increasing"),
        "{e}"
    );
    let e = err(batch().with_cu_seqlens(vec![vec![0, 5, 17]]));
    assert!(e.contains("`cu_seqlens`") && e.contains("beyond"), "{e}");
    let e = err(batch().with_cu_seqlens(vec![vec![2, 5]]));
    assert!(
        e.contains("`cu_seqlens`") && e.contains("start with 0"),
        "{e}"
    );
    let e = err(batch().with_cu_seqlens(vec![vec![0, 5], vec![0, 4]]));
    assert!(e.contains("`cu_seqlens` has 2 rows"), "{e}");
    let e = err(batch().with_attention_mask(vec![1; S - 1]));
    assert!(
        e.contains("`attention_mask` has 15 values") && e.contains("`input_ids`"),
        "{e}"
    );
    let mut mask = vec![1; S];
    mask[3] = 2;
    let e = err(batch().with_attention_mask(mask));
    assert!(
        e.contains("`attention_mask` at row 0, column 3 is 2"),
        "{e}"
    );
    let layout = SequenceLayout::from_cu_seqlens(2, 8, vec![vec![0, 8], vec![0, 8]]).expect("ok");
    let e = err(batch().with_layout(layout.clone()));
    assert!(e.contains("`input_ids` is [1, 16]"), "{e}");
    let e = err(TrainBatch::padded(
        &[vec![1; 7]],
        PADDED,
        PAD,
        PaddingSide::Left,
    ));
    assert!(e.contains("documents"), "{e}");
    // A forward given a layout of another shape.
    let device = Device::flex();
    let dir = common::fixtures().join("qwen3");
    let config = Qwen3Config::from_file(dir.join("config.json")).expect("config");
    let model =
        Qwen3ForCausalLM::from_weights(&config, &common::FixtureSource::open(&dir), &device)
            .expect("weights");
    let e = model
        .forward_packed(ids_tensor(&ids, [1, S], &device), &layout)
        .expect_err("shape mismatch")
        .to_string();
    assert!(
        e.contains("packing layout") && e.contains("`input_ids`"),
        "{e}"
    );
}
