//! The training checks every family's test file runs the same way (`mixtral.rs`,
//! `gpt_oss.rs`, `glm4_moe.rs`), on a family's `<name>.train` golden (`train_ids
//! [steps, 2, 12]`, per-step `losses` and `grad_norms`, the parameters after the last step
//! under the release names; `tests/fixtures/make_family_fixtures.py`):
//!
//! - [`training_matches_pytorch`]: the [`Trainer`] against the PyTorch reference (the
//!   transformers model + `torch.optim.AdamW` at [`reference_settings`]);
//! - [`layouts_match_one_rank`]: the same run under parallel layouts against `world = 1`.

use std::collections::BTreeMap;

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::optim::DistributedAdamWConfig;
use moe_backend::parallel::{GroupFamily, ParallelLayout};
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use moe_models::export::export_hf_tensors;
use moe_models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};

use super::{Golden, fixtures, max_errors};

/// Sequences of a golden step (micro-batches of one sequence under a layout).
const MICRO: usize = 2;
/// Tokens per golden sequence.
const SEQ: usize = 12;

/// A model error as the backend error `World::run` closures return.
pub fn be(e: moe_models::ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

/// `|ours − want| / |want| ≤ tol`, printed.
pub fn assert_rel(what: &str, ours: f64, want: f64, tol: f64) {
    let rel = (ours - want).abs() / want.abs();
    println!("{what}: ours {ours:.7}, golden {want:.7}, rel err {rel:.3e}");
    assert!(
        rel <= tol,
        "{what}: {ours} vs {want} (rel {rel:e} > {tol:e})"
    );
}

/// `a` equals `b` within `1e-5·max|b| + 1e-6` element-wise.
pub fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    let (err, _) = max_errors(a, b);
    assert!(
        err <= 1e-5 * scale + 1e-6,
        "{what}: max error {err:e} (scale {scale})"
    );
}

/// The PyTorch reference's settings (`tests/fixtures/README.md`, training goldens): AdamW
/// lr 1e-3, β (0.9, 0.95), ε 1e-8, weight decay 0.1 except norms and biases, clipping at 1.0;
/// cross-entropy only (no aux loss, z-loss, expert-bias update or MTP loss).
pub fn reference_settings() -> TrainerConfig {
    let defaults = TrainerConfig::default();
    TrainerConfig {
        lr: 1e-3,
        aux_loss_coeff: 0.0,
        z_loss_coeff: 0.0,
        update_expert_bias: false,
        mtp_loss_scaling_factor: 0.0,
        optimizer: DistributedAdamWConfig {
            beta_1: 0.9,
            beta_2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.1,
            exempt_norms_and_biases: true,
            max_grad_norm: Some(1.0),
            ..defaults.optimizer
        },
        ..defaults
    }
}

/// The real defaults (router aux loss and z-loss on) with lr 1e-2 and Adam ε 1e-3 (so that
/// f32 reduction-order differences of near-zero gradients are not amplified, as in
/// `training_equivalence.rs`).
pub fn layout_settings() -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        optimizer: DistributedAdamWConfig {
            epsilon: 1e-3,
            ..TrainerConfig::default().optimizer
        },
        ..TrainerConfig::default()
    }
}

/// The tensor names of the HF directory `dir` (one `model.safetensors`), sorted.
pub fn checkpoint_names(dir: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("fixture");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    names
}

/// Every HF tensor of `model` as f32 values, by release name.
fn exported<M: ParallelCausalLm>(model: &M) -> BTreeMap<String, Vec<f32>> {
    export_hf_tensors(model)
        .expect("export")
        .map(|(n, d)| (n, d.convert::<f32>().try_to_vec::<f32>().expect("f32")))
        .collect()
}

/// 6 steps of the [`Trainer`] from `start` at `world = 1` on the golden `{family}.train`
/// equal the PyTorch reference: per-step losses and gradient norms within 1e-4 relative, and
/// the parameters after the last step, exported under the release names (exactly the names
/// of `tests/fixtures/{family}`), within `param_tol` of the reference's `save_pretrained`
/// tensors — each of which moved during the run (the comparison is not of the start).
pub fn training_matches_pytorch<M: ParallelCausalLm + Sync>(
    start: &M,
    family: &str,
    param_tol: f32,
) {
    let golden = Golden::open(&format!("{family}.train"));
    let (shape, ids) = golden.i64("train_ids");
    assert_eq!(shape, [6, MICRO, SEQ]);
    let (_, want_losses) = golden.f32("losses");
    let (_, want_norms) = golden.f32("grad_norms");
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let ad = Device::flex().autodiff();
    let (ids, layout, ad) = (&ids, &layout, &ad);
    let mut runs = World::run(1, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, reference_settings(), ad).map_err(be)?;
        let mut stats = Vec::new();
        for step in ids.chunks(MICRO * SEQ) {
            let batch = TrainBatch::causal(step.to_vec(), MICRO).map_err(be)?;
            stats.push(trainer.step_micro_batches(&[batch]).map_err(be)?);
        }
        Ok((stats, exported(trainer.model().model())))
    });
    let (stats, exported_after) = runs.remove(0).expect("world 1");
    for (t, s) in stats.iter().enumerate() {
        let (loss, norm) = (f64::from(want_losses[t]), f64::from(want_norms[t]));
        assert_rel(&format!("step {t} loss"), f64::from(s.loss), loss, 1e-4);
        assert_rel(&format!("step {t} grad norm"), s.grad_norm, norm, 1e-4);
    }
    let skip = ["train_ids", "losses", "grad_norms"];
    let want: BTreeMap<String, Vec<f32>> = (golden.names().into_iter())
        .filter(|n| !skip.contains(&n.as_str()))
        .map(|n| {
            let values = golden.f32(&n).1;
            (n, values)
        })
        .collect();
    assert_eq!(
        exported_after.keys().cloned().collect::<Vec<_>>(),
        checkpoint_names(&fixtures().join(family)),
        "export names = the release checkpoint's"
    );
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        exported_after.keys().collect::<Vec<_>>()
    );
    let before = exported(start);
    let mut worst = (0f32, String::new());
    for (name, w) in &want {
        let (err, _) = max_errors(&exported_after[name], w);
        let (moved, _) = max_errors(&before[name], w);
        assert!(moved > 1e-4, "{name} did not train ({moved})");
        if err > worst.0 {
            worst = (err, name.clone());
        }
        assert!(err <= param_tol, "{name}: max |ours − PyTorch| = {err:e}");
    }
    println!(
        "final parameters: worst max error {:.3e} ({})",
        worst.0, worst.1
    );
}

/// A rank's flattened parameters (dense, experts) in the optimizer's table order.
type Flat = (Vec<f32>, Vec<f32>);

/// Trains `start` under `(world, spec)` at [`layout_settings`] on the golden `{family}.train`
/// batches (each step's two sequences spread over the data-parallel replicas); per rank: its
/// replica, its step stats, its parameters and `reference`'s shard of this rank, flattened
/// the same way.
fn train_under<M: ParallelCausalLm + Sync>(
    start: &M,
    family: &str,
    (world, spec): (usize, &str),
    reference: &M,
) -> Vec<(usize, Vec<StepStats>, Flat, Flat)> {
    let golden = Golden::open(&format!("{family}.train"));
    let (_, ids) = golden.i64("train_ids");
    let layout = ParallelLayout::parse(world, spec).expect("layout");
    let replicas = layout.dp;
    let ad = Device::flex().autodiff();
    let (ids, layout, ad) = (&ids, &layout, &ad);
    World::run(world, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, layout_settings(), ad).map_err(be)?;
        let replica = pg.groups.get(GroupFamily::Dp).index;
        let per = MICRO / replicas;
        let mut stats = Vec::new();
        for step in ids.chunks(MICRO * SEQ) {
            let micro: Vec<TrainBatch> = (0..per)
                .map(|m| {
                    let row = replica * per + m;
                    TrainBatch::causal(step[row * SEQ..(row + 1) * SEQ].to_vec(), 1)
                })
                .collect::<Result<_, _>>()
                .map_err(be)?;
            stats.push(trainer.step_micro_batches(&micro).map_err(be)?);
        }
        let table = trainer.optimizer().table();
        let mine = table.flatten_values(trainer.model().model())?;
        let shard = reference.shard(&pg, DispatcherKind::AllToAll).map_err(be)?;
        let want = table.flatten_values(shard.model())?;
        Ok((replica, stats, mine, want))
    })
    .into_iter()
    .enumerate()
    .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}")))
    .collect()
}

/// The golden `{family}.train` run at [`layout_settings`] (router aux loss on) under each of
/// `layouts` equals the `world = 1` run: every rank's parameters after the last step equal
/// its shard of the `world = 1` model ([`close`]), every rank's gradient norm and the
/// token-weighted loss of the replicas equal the `world = 1` step's within 1e-5 relative.
pub fn layouts_match_one_rank<M: ParallelCausalLm + Sync>(
    start: &M,
    family: &str,
    layouts: &[(usize, &str)],
) {
    let golden = Golden::open(&format!("{family}.train"));
    let (_, ids) = golden.i64("train_ids");
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let ad = Device::flex().autodiff();
    let (ids, layout, ad) = (&ids, &layout, &ad);
    let (want_stats, final_model) = World::run(1, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer =
            Trainer::new(start, &pg, ctx.world()?, layout_settings(), ad).map_err(be)?;
        let mut stats = Vec::new();
        for step in ids.chunks(MICRO * SEQ) {
            let micro: Vec<TrainBatch> = (step.chunks(SEQ))
                .map(|row| TrainBatch::causal(row.to_vec(), 1))
                .collect::<Result<_, _>>()
                .map_err(be)?;
            stats.push(trainer.step_micro_batches(&micro).map_err(be)?);
        }
        Ok((stats, trainer.model().model().clone()))
    })
    .remove(0)
    .expect("world 1");
    assert!(
        want_stats.iter().all(|s| s.aux_loss > 0.0),
        "the aux loss is on"
    );
    for &(world, spec) in layouts {
        let ranks = train_under(start, family, (world, spec), &final_model);
        let replicas = ParallelLayout::parse(world, spec).expect("layout").dp;
        for (rank, (_, _, mine, want)) in ranks.iter().enumerate() {
            let what = format!("{spec} rank {rank}");
            close(&mine.0, &want.0, &format!("{what}: dense parameters"));
            close(&mine.1, &want.1, &format!("{what}: expert parameters"));
        }
        for (step, want) in want_stats.iter().enumerate() {
            let mut seen = vec![false; replicas];
            let (mut loss, mut tokens) = (0f64, 0usize);
            for (replica, stats, _, _) in &ranks {
                let s = &stats[step];
                let rel = (s.grad_norm - want.grad_norm).abs() / want.grad_norm;
                assert!(rel <= 1e-5, "{spec} step {step}: grad norm rel {rel:e}");
                if !std::mem::replace(&mut seen[*replica], true) {
                    loss += f64::from(s.loss) * s.tokens as f64;
                    tokens += s.tokens;
                }
            }
            assert_eq!(tokens, want.tokens, "{spec} step {step}: tokens");
            let loss = loss / tokens as f64;
            let rel = (loss - f64::from(want.loss)).abs() / f64::from(want.loss);
            assert!(
                rel <= 1e-5,
                "{spec} step {step}: loss {loss} vs {} ({rel:e})",
                want.loss
            );
        }
        println!("{spec}: losses, gradient norms and parameters equal world = 1");
    }
}
