//! The main-job pipeline of `examples/quickstart.rs`, from an HF checkpoint to a trained HF
//! checkpoint through distributed checkpoints (docs/checkpoints.md §Streaming conversion,
//! §Training checkpoints, §Resharding):
//!
//! 1. **convert** the HF Qwen3-MoE directory to a distributed checkpoint under the training
//!    layout (default attention TP2 × DP2, experts EP4 on 4 ranks), streaming;
//! 2. **fine-tune** on in-process ranks: every rank restores its own shard from the
//!    checkpoint (reading only its boxes) and trains with [`Trainer`] on the built-in corpus
//!    ([`crate::finetune`]);
//! 3. **save** parameters, ZeRO-1 optimizer state and [`TrainState`] as the next `iter_*` of
//!    the same checkpoint root (atomic, every rank writes its own file);
//! 4. **reshard** to the export layout (default EP2 × ETP2);
//! 5. **export** the resharded checkpoint to an HF directory (F32);
//! 6. **check** that the export loads with [`moe_models::hf::load_causal_lm`] and gives the trained
//!    model's logits (gathered from the ranks at the end of training) within a tolerance.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_bridge::dist::convert::{
    ConvertProgress, checkpoint_meta, convert_hf_to_dist_with, export_dist_to_hf, reshard,
};
use moe_bridge::dist::{DistCheckpoint, TrainState};
use moe_bridge::export::{ExportOptions, ExportSummary};
use moe_bridge::safetensors::Dtype;
use moe_models::checkpoint::{restore_trainer, save_trainer};
use moe_models::distributed::{ShardModel, gather_full};
use moe_models::families::{Family, FamilyConfig, local_logits};
use moe_models::hf::{ConfigVisitor, ModelConfig};
use moe_models::train::Trainer;

use crate::finetune::{FinetuneOptions, FinetuneReport, corpus_batch, to_backend, train_steps};

/// Everything that can stop the quickstart pipeline.
#[derive(Debug, thiserror::Error)]
pub enum QuickstartError {
    /// Checkpoint conversion, I/O or loading failed.
    #[error(transparent)]
    Bridge(#[from] moe_bridge::BridgeError),
    /// The model rejected its configuration or input.
    #[error(transparent)]
    Model(#[from] moe_models::ModelError),
    /// Layout, communication or training failure.
    #[error(transparent)]
    Backend(#[from] moe_backend::BackendError),
    /// A directory of the output could not be prepared.
    #[error("{path}: {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A tensor could not be read back to the host.
    #[error("{0}")]
    Readback(String),
    /// The exported model does not reproduce the trained model.
    #[error(
        "{path}: the exported model's logits differ from the trained model's by \
         {max_abs_diff:e} (tolerance {tolerance:e})"
    )]
    LogitsMismatch {
        /// The exported HF directory.
        path: PathBuf,
        /// Largest absolute logit difference.
        max_abs_diff: f32,
        /// Allowed difference.
        tolerance: f32,
    },
}

/// Settings of [`quickstart`].
#[derive(Debug, Clone)]
pub struct QuickstartOptions {
    /// The fine-tuning part: HF model directory (default: the tiny fixture), the training
    /// layout, steps, batch, sequence length and trainer settings.
    pub train: FinetuneOptions,
    /// Directory receiving `dist/` (training checkpoints), `dist_resharded/` and `hf/`; those
    /// three are replaced if they exist.
    pub out_dir: PathBuf,
    /// Layout of the resharded checkpoint (default EP2 × ETP2 on 4 ranks).
    pub export_layout: String,
    /// Largest accepted absolute logit difference between the export and the trained model.
    pub tolerance: f32,
}

impl QuickstartOptions {
    /// The default pipeline writing into `out_dir`: 40 steps under `world=4,tp=2,ep=4`,
    /// exported through `world=4,ep=2,etp=2`.
    pub fn new(out_dir: impl Into<PathBuf>) -> Self {
        Self {
            train: FinetuneOptions {
                layout: "world=4,tp=2,ep=4".into(),
                steps: 40,
                ..FinetuneOptions::default()
            },
            out_dir: out_dir.into(),
            export_layout: "world=4,ep=2,etp=2".into(),
            tolerance: 1e-4,
        }
    }
}

/// A stage of the pipeline, reported as it completes.
#[derive(Debug)]
pub enum QuickstartEvent<'a> {
    /// One canonical tensor was converted.
    Converting(&'a ConvertProgress),
    /// The HF checkpoint was converted to this `iter_*` directory.
    Converted(&'a Path),
    /// A training step finished (the report so far, losses averaged over ranks).
    Step(usize, &'a FinetuneReport),
    /// The trained model and optimizer state were saved to this `iter_*` directory.
    Saved(&'a Path),
    /// The checkpoint was resharded to this `iter_*` directory.
    Resharded(&'a Path),
    /// The HF export was written.
    Exported(&'a ExportSummary),
}

/// What [`quickstart`] did.
#[derive(Debug, Clone)]
pub struct QuickstartReport {
    /// The converted checkpoint (`…/dist/iter_0000000`).
    pub converted: PathBuf,
    /// The trained checkpoint (`…/dist/iter_{steps}`).
    pub trained: PathBuf,
    /// The resharded checkpoint.
    pub resharded: PathBuf,
    /// The exported HF directory.
    pub exported: PathBuf,
    /// Training losses and throughput.
    pub train: FinetuneReport,
    /// Largest absolute difference between the export's and the trained model's logits.
    pub max_abs_diff: f32,
    /// Wall-clock seconds of convert, train (with save), reshard, export, check.
    pub seconds: [f64; 5],
}

/// Removes `dir` if it exists, so a rerun starts clean.
fn clear(dir: &Path) -> Result<(), QuickstartError> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|source| QuickstartError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

/// Steps 2–3 of [`quickstart`] for the family of the checkpoint's `config.json`: every rank
/// restores its shard, trains and saves with its optimizer state; rank 0 also returns the
/// trained model's logits of the probe sequences.
struct TrainStage<'a> {
    probe: &'a [i64],
    ckpt: &'a DistCheckpoint,
    layout: &'a ParallelLayout,
    dist_root: &'a Path,
    options: &'a QuickstartOptions,
    on_event: &'a (dyn Fn(QuickstartEvent<'_>) + Sync),
}

/// What every rank returns from [`TrainStage`]: its report, the saved checkpoint and (rank 0)
/// the trained logits.
type RankResults =
    Vec<Result<(FinetuneReport, PathBuf, Option<Vec<f32>>), moe_backend::BackendError>>;

impl ConfigVisitor for TrainStage<'_> {
    type Output = Result<RankResults, QuickstartError>;

    fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
        let (ckpt, options, on_event) = (self.ckpt, self.options, self.on_event);
        let (train_layout, dist_root) = (self.layout, self.dist_root);
        let vocab = config.vocab_size();
        let device = Device::flex().autodiff();
        // The module structure every rank shards; its values are replaced by the checkpoint's.
        let template = <F::Model as ShardModel>::template(config, &device)?;
        let probe = self.probe;
        let steps = options.train.steps;
        let results = World::run(train_layout.world, |ctx| {
            let groups = ctx.process_groups(train_layout)?;
            let world = ctx.world()?;
            let mut trainer = Trainer::new(
                &template,
                &groups,
                world.clone(),
                options.train.trainer.clone(),
                &device,
            )
            .map_err(to_backend)?;
            let resumed = restore_trainer(ckpt, &mut trainer).map_err(carry)?;
            let first = usize::try_from(resumed.step).unwrap_or(0);
            let report = train_steps(
                &mut trainer,
                &world,
                &options.train,
                first,
                vocab,
                &|step, r| on_event(QuickstartEvent::Step(step, r)),
            )?;
            let state = TrainState {
                step: (first + steps) as u64,
                data_position: (first + steps) as u64,
                rng_seed: resumed.rng_seed,
                extra: resumed.extra,
            };
            let meta = checkpoint_meta(ckpt, train_layout).map_err(carry)?;
            let saved = save_trainer(&world, dist_root, meta, &trainer, &state).map_err(carry)?;
            let full = gather_full(trainer.model(), &groups).map_err(to_backend)?;
            let logits = if ctx.rank() == 0 {
                let out = local_logits(&full, ids_tensor(probe, 2, &device)).map_err(to_backend)?;
                Some(logits_values(out).map_err(carry)?)
            } else {
                None
            };
            Ok((report, saved, logits))
        });
        Ok(results)
    }
}

/// Token ids `[rows, S]` as a Burn tensor.
fn ids_tensor(ids: &[i64], rows: usize, device: &Device) -> Tensor<2, Int> {
    let cols = ids.len() / rows.max(1);
    let data: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    Tensor::from_data(TensorData::new(data, [rows, cols]), device)
}

fn logits_values(t: Tensor<3>) -> Result<Vec<f32>, QuickstartError> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| QuickstartError::Readback(format!("logits unreadable as f32: {e:?}")))
}

/// Runs the pipeline (see the module docs); `on_event` is called as stages complete (from the
/// calling thread, or rank 0's thread for training steps).
pub fn quickstart(
    options: &QuickstartOptions,
    on_event: &(dyn Fn(QuickstartEvent<'_>) + Sync),
) -> Result<QuickstartReport, QuickstartError> {
    let train_layout = ParallelLayout::parse_spec(&options.train.layout)?;
    let export_layout = ParallelLayout::parse_spec(&options.export_layout)?;
    let (dist_root, resharded_root, hf_dir) = (
        options.out_dir.join("dist"),
        options.out_dir.join("dist_resharded"),
        options.out_dir.join("hf"),
    );
    for dir in [&dist_root, &resharded_root, &hf_dir] {
        clear(dir)?;
    }
    let mut seconds = [0.0; 5];

    // 1. HF -> distributed (training layout).
    let clock = Instant::now();
    let converted = convert_hf_to_dist_with::<ModelConfig>(
        &options.train.model_dir,
        &dist_root,
        &train_layout,
        0,
        &mut |p| on_event(QuickstartEvent::Converting(p)),
    )?;
    on_event(QuickstartEvent::Converted(&converted));
    seconds[0] = clock.elapsed().as_secs_f64();

    // 2-3. Restore every rank's shard, train, save with optimizer state.
    let clock = Instant::now();
    let ckpt = DistCheckpoint::open::<ModelConfig>(&converted)?;
    let config = ModelConfig::from_dir(ckpt.dir())?;
    // Held-out probe sequences (a step the run never trains on).
    let probe = corpus_batch(1_000_000, 0, 2, options.train.seq_len, config.vocab_size());
    let train = TrainStage {
        probe: &probe,
        ckpt: &ckpt,
        layout: &train_layout,
        dist_root: &dist_root,
        options,
        on_event,
    };
    let results = config.visit(train)??;
    let mut results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let (train, trained, trained_logits) = results.swap_remove(0);
    let trained_logits = trained_logits.unwrap_or_default();
    on_event(QuickstartEvent::Saved(&trained));
    seconds[1] = clock.elapsed().as_secs_f64();

    // 4. Reshard to the export layout.
    let clock = Instant::now();
    let resharded = reshard::<ModelConfig>(
        &DistCheckpoint::open::<ModelConfig>(&trained)?,
        &resharded_root,
        &export_layout,
    )?;
    on_event(QuickstartEvent::Resharded(&resharded));
    seconds[2] = clock.elapsed().as_secs_f64();

    // 5. Export to HF.
    let clock = Instant::now();
    let export = ExportOptions {
        dtype: Some(Dtype::F32),
        ..ExportOptions::default()
    };
    let summary = export_dist_to_hf::<ModelConfig>(
        &DistCheckpoint::open::<ModelConfig>(&resharded)?,
        &hf_dir,
        &export,
    )?;
    on_event(QuickstartEvent::Exported(&summary));
    seconds[3] = clock.elapsed().as_secs_f64();

    // 6. Reload the export and compare logits with the trained model's.
    let clock = Instant::now();
    let host = Device::flex();
    let model = moe_models::hf::load_causal_lm(&summary.target, &host)?;
    let logits = logits_values(model.logits(ids_tensor(&probe, 2, &host))?)?;
    let max_abs_diff = if logits.len() == trained_logits.len() {
        logits
            .iter()
            .zip(&trained_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    } else {
        f32::INFINITY
    };
    seconds[4] = clock.elapsed().as_secs_f64();
    if max_abs_diff.is_nan() || max_abs_diff > options.tolerance {
        return Err(QuickstartError::LogitsMismatch {
            path: summary.target,
            max_abs_diff,
            tolerance: options.tolerance,
        });
    }
    Ok(QuickstartReport {
        converted,
        trained,
        resharded,
        exported: summary.target,
        train,
        max_abs_diff,
        seconds,
    })
}

/// Carries an error out of a rank's closure (whose error type is the backend's).
fn carry(e: impl std::fmt::Display) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "checkpoint",
        detail: e.to_string(),
    }
}
