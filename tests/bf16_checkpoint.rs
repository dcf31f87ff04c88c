//! Training checkpoints of BF16 mixed-precision runs (issue 34 item 1; docs/checkpoints.md
//! §Training checkpoints, docs/training-and-rl.md §Mixed precision (BF16)), for Qwen3-MoE and
//! DeepSeek-V3 (MTP module, f32 expert bias):
//!
//! - the checkpoint keeps the f32 main weights (`optim.master`, not rounded) and f32 moments;
//!   the trainable parameters are stored in BF16, each exactly its main weight rounded to
//!   nearest even; buffers stay f32;
//! - resumed under the same layout, a run continues bit for bit like the uninterrupted one
//!   (parameters, main weights, losses); restored under another layout and saved at once, every
//!   stored tensor is the same bit for bit; resumed under that layout, its losses stay within
//!   [`BF16_RESUME_RTOL`] of the uninterrupted run under it, and after every run each BF16
//!   parameter is its main weight rounded;
//! - an f32 run resuming a BF16 checkpoint computes with the main weights themselves;
//! - `export_dist_to_hf` writes BF16 by default (the main weights rounded once, the config's
//!   `dtype` `bfloat16`) and, asked for F32, the main weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor, bf16};
use burn_moe::backend::comm::World;
use burn_moe::backend::optim::{DistributedAdamWConfig, Precision};
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout, replicate};
use burn_moe::bridge::dist::convert::export_dist_to_hf;
use burn_moe::bridge::dist::index::TensorKind;
use burn_moe::bridge::dist::region::TensorBox;
use burn_moe::bridge::dist::{DistCheckpoint, SaveMeta, TrainState};
use burn_moe::bridge::export::ExportOptions;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::Dtype;
use burn_moe::models::checkpoint::{PlacedModel, restore_trainer, save_trainer};
use burn_moe::models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use burn_moe::models::hf::ModelConfig;
use burn_moe::models::train::{TrainBatch, Trainer, TrainerConfig};
use burn_moe::models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
};
use moe_backend::testing::XorShift64;

const QWEN3_MOE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");
const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/deepseek_v3");
/// Global batch rows per step and their length.
const G: usize = 4;
const S: usize = 8;

/// The stated tolerance of a BF16 run resumed under another layout against the uninterrupted
/// run under that layout: every step's loss within 1% (relative). The two differ only in the
/// order of the f32 sums of the first steps, which BF16 rounding of the parameters turns into
/// differences of one BF16 ulp (2⁻⁸ relative) in some parameters. Measured: 2.5e-4 for both
/// models over 3 resumed steps.
const BF16_RESUME_RTOL: f64 = 0.01;

fn trainer_config(precision: Precision) -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        optimizer: DistributedAdamWConfig {
            weight_decay: 0.1,
            epsilon: 1e-3,
            ..DistributedAdamWConfig::default()
        },
        dispatcher: DispatcherKind::AllToAll,
        aux_loss_coeff: 0.0,
        precision,
        ..TrainerConfig::default()
    }
}

/// Replica `replica` of `replicas`'s rows of the global batch of `step`.
fn batch(step: usize, replica: usize, replicas: usize, vocab: usize) -> TrainBatch {
    let ids = XorShift64::new(0x5bd1_e995_u64.wrapping_mul(step as u64 + 3)).ids(G * S, vocab);
    let rows = G / replicas;
    TrainBatch::causal(
        ids[replica * rows * S..(replica + 1) * rows * S].to_vec(),
        rows,
    )
    .expect("batch")
}

fn bf(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// One model under test: its fixture directory, family name and vocabulary.
#[derive(Clone, Copy)]
struct Fixture {
    dir: &'static str,
    family: &'static str,
    vocab: usize,
}

/// What one rank ends with: its flat `(dense, expert)` parameters, the all-gathered main
/// weights in the same layout, and the losses it saw.
struct RankEnd {
    params: (Vec<f32>, Vec<f32>),
    masters: (Vec<f32>, Vec<f32>),
    losses: Vec<f32>,
}

/// Every trainable float parameter of `model` has `dtype`; the others (buffers) are f32.
fn check_dtypes<M: burn::module::Module>(model: &M, dtype: DType) {
    struct Dtypes(Vec<(bool, DType)>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0.push((t.is_require_grad(), t.dtype()));
        }
    }
    let mut seen = Dtypes(Vec::new());
    model.visit(&mut seen);
    for (trainable, got) in seen.0 {
        let want = if trainable { dtype } else { DType::F32 };
        assert_eq!(got, want, "a parameter (trainable: {trainable})");
    }
}

/// Trains `steps` under `layout` in `precision` from `start` (or from the checkpoint at
/// `resume`), optionally saving to `save` at the end. After the last step every trainable
/// parameter is checked to be its main weight in the parameters' dtype.
fn run<M: ParallelCausalLm + PlacedModel + Sync>(
    layout: &ParallelLayout,
    start: &M,
    fixture: Fixture,
    precision: Precision,
    steps: std::ops::Range<usize>,
    (resume, save): (Option<&Path>, Option<&Path>),
) -> Vec<RankEnd> {
    let device = Device::flex().autodiff();
    let ckpt = resume.map(|p| DistCheckpoint::open::<ModelConfig>(p).expect("open checkpoint"));
    let config_json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}/config.json", fixture.dir)).expect("config"),
    )
    .expect("config json");
    let results = World::run(layout.world, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let config = trainer_config(precision);
        let mut trainer =
            Trainer::new(start, &groups, world.clone(), config, &device).expect("trainer");
        if let Some(ckpt) = &ckpt {
            let state = restore_trainer(ckpt, &mut trainer).expect("restore");
            assert_eq!(state.step as usize, steps.start);
            assert_eq!(trainer.optimizer().step_count() as usize, steps.start);
        }
        let dp = groups.groups.get(GroupFamily::Dp);
        let mut losses = Vec::new();
        for step in steps.clone() {
            let micro = [batch(step, dp.index, dp.size(), fixture.vocab)];
            losses.push(trainer.step_micro_batches(&micro).expect("step").loss);
        }
        if let Some(root) = save {
            let mut meta = SaveMeta::new(steps.end as u64, layout);
            meta.model_family = Some(fixture.family.into());
            meta.config = Some(config_json.clone());
            let state = TrainState {
                step: steps.end as u64,
                data_position: steps.end as u64,
                ..TrainState::default()
            };
            save_trainer(&world, root, meta, &trainer, &state).expect("save");
        }
        let model = trainer.model().model();
        check_dtypes(model, precision.param_dtype());
        let params = trainer.optimizer().table().flatten_values(model)?;
        let masters = trainer.optimizer().master_values()?;
        for (got, master) in [(&params.0, &masters.0), (&params.1, &masters.1)] {
            assert_eq!(got.len(), master.len());
            for (i, (g, m)) in got.iter().zip(master).enumerate() {
                let want = match precision {
                    Precision::Bf16 => bf(*m),
                    Precision::F16 => burn::tensor::f16::from_f32(*m).to_f32(),
                    Precision::F32 => *m,
                };
                assert!(
                    g.to_bits() == want.to_bits(),
                    "{layout} {precision}: element {i} is {g}, its main weight {m}"
                );
            }
        }
        Ok(RankEnd {
            params,
            masters,
            losses,
        })
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{layout} rank {r}: {e}")))
        .collect()
}

fn qwen3_moe() -> (Qwen3MoeForCausalLM, Fixture) {
    let device = Device::flex().autodiff();
    let config = Qwen3MoeConfig::from_file(format!("{QWEN3_MOE}/config.json")).expect("config");
    let fixture = Fixture {
        dir: QWEN3_MOE,
        family: "qwen3_moe",
        vocab: config.vocab_size,
    };
    (replicate(&config.init(&device).expect("init")), fixture)
}

fn deepseek() -> (DeepseekV3ForCausalLM, Fixture) {
    let device = Device::flex().autodiff();
    let config = DeepseekV3Config::from_file(format!("{DEEPSEEK}/config.json")).expect("config");
    let fixture = Fixture {
        dir: DEEPSEEK,
        family: "deepseek_v3",
        vocab: config.vocab_size,
    };
    (replicate(&config.init(&device).expect("init")), fixture)
}

/// A fresh scratch directory.
fn scratch(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("burn-moe-bf16-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn read_all(ckpt: &DistCheckpoint, fqn: &str) -> (Dtype, Vec<f32>) {
    let entry = ckpt.entry(fqn).expect("entry");
    let t = ckpt
        .read_box(fqn, &TensorBox::full(&entry.global_shape))
        .expect("read");
    (t.dtype, t.to_f32_vec().expect("f32"))
}

/// The checkpoint of a BF16 run: BF16 parameters that are their f32 main weights rounded,
/// main weights that are not all BF16 values, f32 moments and buffers.
fn check_bf16_checkpoint(ckpt: &DistCheckpoint) {
    let mut params = 0;
    let mut unrounded = 0usize;
    for (fqn, entry) in &ckpt.index().tensors {
        match entry.kind {
            TensorKind::Param => {
                params += 1;
                assert_eq!(entry.dtype, Dtype::BF16, "{fqn}");
                let (dtype, values) = read_all(ckpt, fqn);
                assert_eq!(dtype, Dtype::BF16, "{fqn}");
                let (mdtype, master) = read_all(ckpt, &format!("optim.master.{fqn}"));
                assert_eq!(mdtype, Dtype::F32, "{fqn}: main weight");
                assert_eq!(values.len(), master.len());
                for (i, (v, m)) in values.iter().zip(&master).enumerate() {
                    assert!(
                        v.to_bits() == bf(*m).to_bits(),
                        "{fqn}[{i}]: stored {v}, main weight {m}"
                    );
                }
                unrounded += master.iter().filter(|m| bf(**m) != **m).count();
            }
            TensorKind::Buffer => assert_eq!(entry.dtype, Dtype::F32, "{fqn}"),
            TensorKind::Optim => assert_eq!(entry.dtype, Dtype::F32, "{fqn}"),
            _ => {}
        }
    }
    assert!(params > 0);
    assert!(
        unrounded > 0,
        "the main weights are kept in f32, not rounded"
    );
}

/// Every tensor of two checkpoints, compared bit for bit (dtype, shape, bytes).
fn same_tensors(a: &DistCheckpoint, b: &DistCheckpoint, what: &str) {
    let names: Vec<&String> = a.index().tensors.keys().collect();
    let other: Vec<&String> = b.index().tensors.keys().collect();
    assert_eq!(names, other, "{what}: tensor names");
    for (fqn, entry) in &a.index().tensors {
        let whole = TensorBox::full(&entry.global_shape);
        let x = a.read_box(fqn, &whole).expect("read");
        let y = b.read_box(fqn, &whole).expect("read");
        assert_eq!(x.dtype, y.dtype, "{what}: {fqn}: dtype");
        assert!(x.bytes == y.bytes, "{what}: {fqn}: stored values differ");
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `max |a − b| / |b|`.
fn worst(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((f64::from(*x) - f64::from(*y)) / f64::from(*y)).abs())
        .fold(0f64, f64::max)
}

/// 3 BF16 steps under `a`, saved; resumed under `a` for 3 more: bit for bit the uninterrupted
/// 6 steps; an f32 trainer restoring the checkpoint holds the main weights. Then under `b`:
/// restored and saved at once, the same tensors; resumed, the losses of the uninterrupted run
/// under `b` within [`BF16_RESUME_RTOL`].
fn bf16_resume<M: ParallelCausalLm + PlacedModel + Sync>(
    (start, other): (M, M),
    fixture: Fixture,
    a: &str,
    b: &str,
) {
    let layout_a = ParallelLayout::parse_spec(a).expect("layout A");
    let layout_b = ParallelLayout::parse_spec(b).expect("layout B");
    let bf16 = Precision::Bf16;
    let dir = scratch(fixture.family);
    run(&layout_a, &start, fixture, bf16, 0..3, (None, Some(&dir)));
    let ckpt = DistCheckpoint::open::<ModelConfig>(&dir).expect("checkpoint");
    ckpt.validate::<ModelConfig>().expect("valid checkpoint");
    check_bf16_checkpoint(&ckpt);

    // Same layout: bit for bit, from another random model (everything from the checkpoint).
    let resumed = run(&layout_a, &other, fixture, bf16, 3..6, (Some(&dir), None));
    let straight = run(&layout_a, &start, fixture, bf16, 0..6, (None, None));
    for (r, (got, want)) in resumed.iter().zip(&straight).enumerate() {
        let what = format!("{a} rank {r}");
        assert_eq!(bits(&got.params.0), bits(&want.params.0), "{what}: dense");
        assert_eq!(bits(&got.params.1), bits(&want.params.1), "{what}: experts");
        assert_eq!(
            bits(&got.masters.0),
            bits(&want.masters.0),
            "{what}: masters"
        );
        assert_eq!(
            bits(&got.masters.1),
            bits(&want.masters.1),
            "{what}: masters"
        );
        assert_eq!(bits(&got.losses), bits(&want.losses[3..]), "{what}: losses");
    }
    // An f32 run restoring it computes with the main weights (`run` checks the parameters
    // against them bit for bit).
    let f32_start = run(
        &layout_b,
        &other,
        fixture,
        Precision::F32,
        3..3,
        (Some(&dir), None),
    );
    assert!(f32_start.iter().any(|e| {
        let (p, m) = (&e.params.0, &e.masters.0);
        p == m && p.iter().any(|v| bf(*v) != *v)
    }));

    // Another layout: restored and saved at once, the same checkpoint bit for bit.
    let again = dir.with_extension("again");
    let _ = std::fs::remove_dir_all(&again);
    run(
        &layout_b,
        &other,
        fixture,
        bf16,
        3..3,
        (Some(&dir), Some(&again)),
    );
    let resaved = DistCheckpoint::open::<ModelConfig>(&again).expect("re-saved");
    same_tensors(&ckpt, &resaved, &format!("{a} -> {b}"));
    let _ = std::fs::remove_dir_all(&again);
    // Resumed there: the uninterrupted run under B within the BF16 tolerance.
    let resumed = run(&layout_b, &other, fixture, bf16, 3..6, (Some(&dir), None));
    let straight = run(&layout_b, &start, fixture, bf16, 0..6, (None, None));
    for (r, (got, want)) in resumed.iter().zip(&straight).enumerate() {
        let w = worst(&got.losses, &want.losses[3..]);
        eprintln!(
            "{} {a} -> {b} rank {r}: worst relative loss difference {w:.2e}",
            fixture.family
        );
        assert!(
            w <= BF16_RESUME_RTOL,
            "{a} -> {b} rank {r}: losses {:?} vs uninterrupted {:?}",
            got.losses,
            &want.losses[3..]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qwen3_moe_bf16_checkpoint_keeps_main_weights_and_resumes() {
    let ((start, fixture), (other, _)) = (qwen3_moe(), qwen3_moe());
    bf16_resume((start, other), fixture, "world=4,tp=2,ep=2", "world=2,ep=2");
}

#[test]
fn deepseek_v3_bf16_checkpoint_keeps_main_weights_and_resumes() {
    let ((start, fixture), (other, _)) = (deepseek(), deepseek());
    bf16_resume(
        (start, other),
        fixture,
        "world=2,pp=2,pp_layout=Et|ttmL",
        "world=4,tp=2,ep=4",
    );
}

/// Every tensor of an HF export, as f32 values with their stored dtype.
fn hf_tensors(dir: &Path) -> BTreeMap<String, (Dtype, Vec<f32>)> {
    let hf = HfCheckpoint::open(dir).expect("export opens");
    let names: Vec<String> = hf.tensor_names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let t = hf.tensor(&n).expect("tensor");
            (n, (t.dtype, t.to_f32_vec().expect("f32")))
        })
        .collect()
}

fn export(ckpt: &DistCheckpoint, out: &Path, dtype: Option<Dtype>) -> serde_json::Value {
    let opts = ExportOptions {
        dtype,
        ..ExportOptions::default()
    };
    export_dist_to_hf::<ModelConfig>(ckpt, out, &opts).expect("export");
    serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
        .expect("config json")
}

/// `moe export`'s default for a BF16 run's checkpoint is BF16: every weight its f32 main
/// weight rounded once (the router's expert bias stays f32); `--dtype f32` exports the main
/// weights themselves.
fn bf16_export<M: ParallelCausalLm + PlacedModel + Sync>(
    start: M,
    fixture: Fixture,
    f32_names: &[&str],
) {
    let layout = ParallelLayout::parse_spec("world=4,tp=2,ep=4").expect("layout");
    let dir = scratch(&format!("export-{}", fixture.family));
    run(
        &layout,
        &start,
        fixture,
        Precision::Bf16,
        0..2,
        (None, Some(&dir)),
    );
    let ckpt = DistCheckpoint::open::<ModelConfig>(&dir).expect("checkpoint");
    let (bf_dir, f_dir) = (dir.join("hf-bf16"), dir.join("hf-f32"));
    let bf_config = export(&ckpt, &bf_dir, None);
    let f_config = export(&ckpt, &f_dir, Some(Dtype::F32));
    assert_eq!(bf_config["dtype"], "bfloat16");
    assert_eq!(f_config["dtype"], "float32");
    let (bf_t, f_t) = (hf_tensors(&bf_dir), hf_tensors(&f_dir));
    assert_eq!(
        bf_t.keys().collect::<Vec<_>>(),
        f_t.keys().collect::<Vec<_>>()
    );
    let mut unrounded = 0;
    for (name, (dtype, values)) in &bf_t {
        let (fdtype, main) = &f_t[name];
        assert_eq!(*fdtype, Dtype::F32, "{name}");
        if f32_names.iter().any(|n| name.ends_with(n)) {
            assert_eq!(*dtype, Dtype::F32, "{name}");
            assert_eq!(bits(values), bits(main), "{name}");
            continue;
        }
        assert_eq!(*dtype, Dtype::BF16, "{name}");
        for (i, (v, m)) in values.iter().zip(main).enumerate() {
            assert!(
                v.to_bits() == bf(*m).to_bits(),
                "{name}[{i}]: exported {v}, main weight {m}"
            );
        }
        unrounded += main.iter().filter(|m| bf(**m) != **m).count();
        // A tensor whose HF name is its canonical one: the F32 export is the stored main weight.
        if let Ok(entry) = ckpt.entry(&format!("optim.master.{name}")) {
            let (_, master) = read_all(&ckpt, &format!("optim.master.{name}"));
            assert_eq!(entry.dtype, Dtype::F32);
            assert_eq!(
                bits(main),
                bits(&master),
                "{name}: F32 export vs main weight"
            );
        }
    }
    assert!(
        unrounded > 0,
        "the F32 export holds the unrounded main weights"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qwen3_moe_bf16_checkpoint_exports_bf16_and_main_weights() {
    let (start, fixture) = qwen3_moe();
    bf16_export(start, fixture, &[]);
}

#[test]
fn deepseek_v3_bf16_checkpoint_exports_bf16_and_main_weights() {
    let (start, fixture) = deepseek();
    bf16_export(start, fixture, &["e_score_correction_bias"]);
}
