//! Parallel equivalence of Qwen3-MoE training (issue: distributed training step): the same
//! 3 AdamW steps on N in-process ranks under a folded layout give the single-rank logits,
//! losses, gradient norms and parameters (f32). The single-rank side uses the plain model and
//! Burn's own AdamW on the concatenated batch.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use moe_backend::comm::GroupComms;
use moe_backend::comm::World;
use moe_backend::optim::{DistributedAdamW, DistributedAdamWConfig, ParamTable, default_classify};
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::causal_lm::causal_lm_loss;
use moe_models::distributed::{DispatcherKind, ParallelOutput, Sharded};
use moe_models::param_plan::Planned;
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3MoeConfig};
use moe_models::{Qwen3MoeForCausalLM, causal_lm::CausalLm};

/// What the test needs from a model family.
trait Arch {
    /// The single-rank model (also the type of one rank's shard).
    type Model: Module + Clone + Send + Sync + CausalLm + Planned + 'static;
    /// One rank's sharded model.
    type Par: Send;
    fn init(device: &Device) -> Self::Model;
    fn logits(model: &Self::Model, ids: Tensor<2, Int>) -> Tensor<3>;
    fn shard(
        full: &Self::Model,
        pg: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self::Par, ModelError>;
    fn forward_loss(par: &Self::Par, ids: &[i64]) -> Result<ParallelOutput, ModelError>;
    fn module(par: &mut Self::Par) -> &mut Self::Model;
    fn replica(par: &Self::Par) -> usize;
}

struct Qwen;
impl Arch for Qwen {
    type Model = Qwen3MoeForCausalLM;
    type Par = Sharded<Qwen3MoeForCausalLM>;
    fn init(device: &Device) -> Self::Model {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/qwen3_moe/config.json"
        );
        Qwen3MoeConfig::from_file(path)
            .expect("config")
            .init(device)
            .expect("init")
    }
    fn logits(model: &Self::Model, ids: Tensor<2, Int>) -> Tensor<3> {
        model.forward(ids).expect("forward").logits
    }
    fn shard(
        full: &Self::Model,
        pg: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self::Par, ModelError> {
        Sharded::<Qwen3MoeForCausalLM>::shard(full, pg, kind)
    }
    fn forward_loss(par: &Self::Par, ids: &[i64]) -> Result<ParallelOutput, ModelError> {
        par.forward_loss(ids, ids, B, &ad())
    }
    fn module(par: &mut Self::Par) -> &mut Self::Model {
        &mut par.model
    }
    fn replica(par: &Self::Par) -> usize {
        par.replica
    }
}

struct DeepSeek;
impl Arch for DeepSeek {
    type Model = DeepseekV3ForCausalLM;
    type Par = Sharded<DeepseekV3ForCausalLM>;
    fn init(device: &Device) -> Self::Model {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/deepseek_v3/config.json"
        );
        let mut config = DeepseekV3Config::from_file(path).expect("config");
        // MTP modules are not trained by the parallel forward.
        config.num_nextn_predict_layers = 0;
        config.init(device).expect("init")
    }
    fn logits(model: &Self::Model, ids: Tensor<2, Int>) -> Tensor<3> {
        model.forward(ids).expect("forward").logits
    }
    fn shard(
        full: &Self::Model,
        pg: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self::Par, ModelError> {
        Sharded::<DeepseekV3ForCausalLM>::shard(full, pg, kind)
    }
    fn forward_loss(par: &Self::Par, ids: &[i64]) -> Result<ParallelOutput, ModelError> {
        par.forward_loss(ids, ids, B, &ad())
    }
    fn module(par: &mut Self::Par) -> &mut Self::Model {
        &mut par.model
    }
    fn replica(par: &Self::Par) -> usize {
        par.replica
    }
}

const B: usize = 2;
const S: usize = 8;
const STEPS: usize = 3;
const LR: f64 = 1e-2;
/// Adam's ε. Elements whose gradient is ~0 (experts that saw almost no tokens) get updates
/// `g/(|g|+ε)` that amplify f32 rounding of `g` without bound as ε → 0; a moderate ε keeps
/// the comparison about the gradients, not about that conditioning.
const EPS: f32 = 1e-3;

fn ad() -> Device {
    Device::flex().autodiff()
}

/// Deterministic token ids of replica `r` at `step`.
fn batch(step: usize, r: usize, vocab: usize) -> Vec<i64> {
    XorShift64::new(0x9e37_79b9_u64.wrapping_mul((step * 131 + r + 1) as u64)).ids(B * S, vocab)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * scale + 1e-6,
            "{what}: index {i}: {x} vs {y} (scale {scale})"
        );
    }
}

struct Reference<M> {
    losses: Vec<f32>,
    norms: Vec<f64>,
    logits: Vec<f32>,
    final_model: M,
}

fn reference<A: Arch>(start: &A::Model, replicas: usize) -> Reference<A::Model> {
    let v = start.vocab_size();
    let mut model = replicate(start);
    let table = ParamTable::new(&model, &default_classify);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.1)
        .with_epsilon(EPS)
        .init();
    let (mut losses, mut norms, mut logits0) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..STEPS {
        let ids: Vec<i64> = (0..replicas).flat_map(|r| batch(step, r, v)).collect();
        let t = Tensor::<2, Int>::from_data(
            TensorData::new(
                ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
                [replicas * B, S],
            ),
            &ad(),
        );
        let logits = A::logits(&model, t);
        if step == 0 {
            logits0 = values(logits.clone());
        }
        let loss = causal_lm_loss(logits, &ids).expect("loss");
        losses.push(values(loss.clone())[0]);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let (d, e) = table.flatten_grads(&model, &mut grads).expect("grads");
        norms.push(
            d.iter()
                .chain(&e)
                .map(|&g| (g as f64).powi(2))
                .sum::<f64>()
                .sqrt(),
        );
        // `flatten_grads` consumed the gradients: recompute them for the optimizer.
        let ids_t = Tensor::<2, Int>::from_data(
            TensorData::new(
                ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
                [replicas * B, S],
            ),
            &ad(),
        );
        let loss = causal_lm_loss(A::logits(&model, ids_t), &ids).expect("loss");
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    Reference {
        losses,
        norms,
        logits: logits0,
        final_model: model,
    }
}

/// A copy of `start` whose parameter values are its gradients of the step-0 loss on the
/// concatenated batch (so the sharding code can cut the expected gradient of every rank).
fn reference_gradients<A: Arch>(start: &A::Model, replicas: usize) -> A::Model {
    let v = start.vocab_size();
    let model = replicate(start);
    let table = ParamTable::new(&model, &default_classify);
    let ids: Vec<i64> = (0..replicas).flat_map(|r| batch(0, r, v)).collect();
    let t = Tensor::<2, Int>::from_data(
        TensorData::new(
            ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
            [replicas * B, S],
        ),
        &ad(),
    );
    let loss = causal_lm_loss(A::logits(&model, t), &ids).expect("loss");
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    let (d, e) = table.flatten_grads(&model, &mut grads).expect("grads");
    table
        .write_values(replicate(start), &d, &e)
        .expect("grad model")
}

fn check<A: Arch>(world: usize, spec: &str, kind: DispatcherKind) {
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let device = ad();
    let start = replicate(&A::init(&device));
    let v = start.vocab_size();
    let replicas = layout.dp * layout.cp;
    let expected = reference::<A>(&start, replicas);
    let grad_model = reference_gradients::<A>(&start, replicas);
    let (layout_ref, start_ref, final_ref) = (&layout, &start, &expected.final_model);
    let grad_ref = &grad_model;
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let mut par = A::shard(start_ref, &pg, kind).map_err(to_backend)?;
        let config = DistributedAdamWConfig {
            weight_decay: 0.1,
            epsilon: EPS,
            ..DistributedAdamWConfig::default()
        };
        let classes = A::module(&mut par).param_classes().map_err(to_backend)?;
        let mut optim = DistributedAdamW::with_classes(
            A::module(&mut par),
            &pg,
            ctx.world()?,
            config,
            &classes.classifier(),
        )?;
        let (mut losses, mut norms, mut logits0) = (Vec::new(), Vec::new(), Vec::new());
        // Every gradient at step 0, after the TP / DP reductions, against the single-rank
        // gradient cut the same way as the parameters.
        let ids0 = batch(0, A::replica(&par), v);
        let out0 = A::forward_loss(&par, &ids0).map_err(to_backend)?;
        let module = A::module(&mut par);
        let grads0 = GradientsParams::from_grads(out0.loss.backward(), module);
        let reduced = optim.reduced_gradients(module, grads0)?;
        let mut want_grads = A::shard(grad_ref, &pg, kind).map_err(to_backend)?;
        let want_grads = optim.table().flatten_values(A::module(&mut want_grads))?;
        for step in 0..STEPS {
            let ids = batch(step, A::replica(&par), v);
            let out = A::forward_loss(&par, &ids).map_err(to_backend)?;
            if step == 0 {
                logits0 = values(out.logits.clone());
            }
            losses.push(values(out.loss.clone())[0]);
            let module = A::module(&mut par);
            let grads = GradientsParams::from_grads(out.loss.backward(), module);
            let (next, report) = optim.step(LR, module.clone(), grads)?;
            *module = next;
            norms.push(report.grad_norm);
        }
        let mine = optim.table().flatten_values(A::module(&mut par))?;
        let mut want = A::shard(final_ref, &pg, kind).map_err(to_backend)?;
        let want = optim.table().flatten_values(A::module(&mut want))?;
        close(&reduced.0, &want_grads.0, "step-0 dense gradients");
        close(&reduced.1, &want_grads.1, "step-0 expert gradients");
        Ok((
            A::replica(&par),
            v / pg.groups.layout.tp,
            pg.groups.tp_rank(),
            losses,
            norms,
            logits0,
            mine,
            want,
        ))
    });
    let mut mean_loss = [0f32; STEPS];
    for (r, res) in results.into_iter().enumerate() {
        let (replica, vl, tp_rank, losses, norms, logits, mine, want) =
            res.unwrap_or_else(|e| panic!("{spec} {kind:?} rank {r}: {e}"));
        let what = |s: &str| format!("{spec} {kind:?} rank {r}: {s}");
        for (m, l) in mean_loss.iter_mut().zip(&losses) {
            *m += l / world as f32;
        }
        for (s, n) in norms.iter().enumerate() {
            let e = expected.norms[s];
            assert!(
                (n - e).abs() <= 1e-4 * e,
                "{}",
                what(&format!("grad norm step {s}: {n} vs {e}"))
            );
        }
        // Step-0 logits: this replica's rows, this rank's vocabulary columns.
        let rows = B * S;
        let exp: Vec<f32> = (0..rows)
            .flat_map(|i| {
                let row = (replica * rows + i) * v;
                expected.logits[row + tp_rank * vl..row + (tp_rank + 1) * vl].to_vec()
            })
            .collect();
        close(&logits, &exp, &what("step-0 logits"));
        close(&mine.0, &want.0, &what("dense params after 3 steps"));
        close(&mine.1, &want.1, &what("expert params after 3 steps"));
    }
    for (s, (m, e)) in mean_loss.iter().zip(&expected.losses).enumerate() {
        assert!(
            (m - e).abs() <= 1e-5 * e.abs(),
            "{spec} {kind:?} step {s}: loss {m} vs {e}"
        );
    }
}

fn to_backend(e: moe_models::ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

#[test]
fn expert_parallel_layouts_match_one_rank() {
    for (world, spec) in [
        (1, ""),
        (2, "ep=2"),
        (4, "ep=4"),
        (4, "ep=2"),
        (4, "ep=2,etp=2"),
    ] {
        check::<Qwen>(world, spec, DispatcherKind::AllToAll);
    }
}

#[test]
fn deepseek_v3_mla_under_folded_layouts_matches_one_rank() {
    for (world, spec) in [(2, "ep=2"), (4, "tp=2,ep=4"), (4, "tp=2,ep=2,etp=2")] {
        check::<DeepSeek>(world, spec, DispatcherKind::AllToAll);
    }
}

#[test]
fn tensor_parallel_with_folded_experts_matches_one_rank() {
    // TP2 with EP4 folded (world 4); TP2 × DP2 with EP2 × EDP2.
    for (world, spec) in [(4, "tp=2,ep=4"), (4, "tp=2,ep=2")] {
        check::<Qwen>(world, spec, DispatcherKind::AllToAll);
    }
}

#[test]
fn every_dispatcher_gives_the_same_training_run() {
    for kind in [DispatcherKind::AllGather, DispatcherKind::Flex] {
        check::<Qwen>(4, "tp=2,ep=2,etp=2", kind);
    }
}
