//! The training job behind `moe train`: one rank's part of a Qwen3-MoE, dense Qwen3 or DeepSeek-V3 (with
//! its MTP modules and aux-loss-free expert-bias updates) fine-tuning run, the same code
//! whether the ranks are threads of one process ([`World`](moe_backend::comm::World)) or processes (MPI,
//! launched by `mpirun` / `srun`).
//!
//! - **Model**: an HF directory or a distributed checkpoint; each rank reads only its own
//!   boxes, under any layout, and never builds the full model (an HF directory is validated
//!   against its config before any rank allocates its shard; a distributed checkpoint restores
//!   into a zero skeleton of the rank's shard).
//! - **Data**: a global batch of `gbs` sequences per step, independent of the layout: sequence
//!   `i` of step `s` is row `(s·gbs + i) mod N` of `input_ids [N, S]` from `--data` (a
//!   safetensors file, or text tokenized into such rows: [`TrainJob::data`]), or the
//!   built-in arithmetic corpus ([`corpus_batch`] of `(s, i)`); data-parallel replica `r` of
//!   `dp` takes the `gbs/dp` consecutive sequences starting at `r·gbs/dp`. The same run under
//!   any layout therefore sees the same data, and `world=1` is its reference.
//! - **Checkpoints**: with `save`, every `save_every` steps and at the end, the trainer
//!   (parameters, ZeRO-1 optimizer state, [`TrainState`]) is saved as the next `iter_*` of the
//!   root (atomic: a crash mid-save leaves the previous checkpoint the latest). `resume`
//!   continues from the root's latest checkpoint, under any layout.
//! - **Ranks**: threads or processes, as [`crate::launch::Placement`] decides ([`run_job`]).
//! - **Metrics**: one JSON object per step (`step`, `loss`, `aux_loss`, `mtp_loss` for models
//!   with MTP modules, `grad_norm`, `lr`, `tokens_per_s`) from rank 0.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use moe_backend::comm::{Comm, RankCtx, ReduceOp};
use moe_backend::devices::LocalRanks;
use moe_backend::optim::GradScalerState;
use moe_backend::parallel::{GroupFamily, ParallelLayout};
use moe_backend::router::AuxLossType;
use moe_bridge::dist::commit::{StalePolicy, remove_stale_temp_dirs};
use moe_bridge::dist::index::{INDEX_FILE, LATEST_FILE};
use moe_bridge::dist::{DistCheckpoint, SaveMeta, TrainState};
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::safetensors::{Dtype, SafetensorsFile};
use moe_bridge::{BridgeError, Tokenizer};
use moe_models::checkpoint::{restore_trainer, save_trainer};
use moe_models::distributed::{CausalLmShard, LoadShard};
use moe_models::export::ExportHf;
use moe_models::family::{Family, FamilyConfig, FamilyVisitor, MODEL_TYPES, visit_family};
use moe_models::hf::{ModelConfig, load_shard_checked};
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::weight_sync::{
    SyncDtype, SyncOptions, WeightReceiver, WeightSyncError, WireSender, read_ack, sync_weights,
};
use serde_json::{Value, json};

use crate::finetune::corpus_batch;
use crate::launch::{Placement, run_spmd};

/// Name of the token-id tensor read from `--data`.
pub const INPUT_IDS: &str = "input_ids";

/// Everything that can stop a training job.
#[derive(Debug, thiserror::Error)]
pub enum TrainJobError {
    /// Reading or writing a checkpoint failed.
    #[error(transparent)]
    Bridge(#[from] moe_bridge::BridgeError),
    /// The model rejected its configuration or input.
    #[error(transparent)]
    Model(#[from] moe_models::ModelError),
    /// Layout, communication or training failure.
    #[error(transparent)]
    Backend(#[from] moe_backend::BackendError),
    /// The compute device cannot be used: not built, no driver, no device, or fewer GPUs than
    /// ranks on this node.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// The job's settings or data do not fit the model or layout.
    #[error("{field}: {detail}")]
    Invalid {
        /// The setting or file.
        field: String,
        /// What is wrong.
        detail: String,
    },
    /// A step's loss or gradients were NaN or infinite (the non-finite guard): nothing of the
    /// step was applied or saved.
    #[error(
        "step {step}: {detail}. Nothing of this step was applied or saved; {latest}. Lower the \
         learning rate or clip gradients (--clip-grad), or let --skip-nonfinite-steps N skip \
         such steps"
    )]
    NonFinite {
        /// The step that failed (1-based, as the metrics count).
        step: usize,
        /// What was non-finite, and on which rank.
        detail: String,
        /// Where the last finite state is (`the latest checkpoint is …`).
        latest: String,
    },
    /// The weight sync to a rollout process (`sync_weights_to`) failed.
    #[error("weight sync to {addr}: {source}")]
    WeightSync {
        /// The `HOST:PORT` of the rollout process.
        addr: String,
        /// What failed.
        source: Box<WeightSyncError>,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn invalid(field: impl Into<String>, detail: impl Into<String>) -> TrainJobError {
    TrainJobError::Invalid {
        field: field.into(),
        detail: detail.into(),
    }
}

/// Settings of a training job.
#[derive(Debug, Clone)]
pub struct TrainJob {
    /// HF Qwen3-MoE, DeepSeek-V3 or dense Qwen3 directory (FP8 releases load dequantised), or a
    /// distributed checkpoint (root or `iter_*` directory).
    pub model: PathBuf,
    /// Layout, e.g. `tp=2,ep=4` (the world is derived unless `world=` is given).
    pub layout: String,
    /// Train until this many optimizer steps have been taken (a resumed run continues to it).
    pub steps: usize,
    /// Sequences per step over all data-parallel replicas (the global batch).
    pub gbs: usize,
    /// Sequences per micro-batch of a replica (`None`: one micro-batch of `gbs / dp`). The
    /// global batch is `dp × micro-batches × mbs` sequences; gradients accumulate over the
    /// micro-batches and the loss is normalised per token over the whole global batch.
    pub mbs: Option<usize>,
    /// Tokens per sequence of the built-in corpus and of text data (a safetensors `data` file's
    /// rows set their own).
    pub seq_len: usize,
    /// The training tokens; `None`: the built-in corpus. Either `input_ids [N, S]` (I64 or
    /// I32) in a safetensors file, or text: a `.jsonl` file (one JSON object per line with a
    /// `text` string) or a `.txt` file (one document per line), tokenized with the
    /// `tokenizer` directory's tokenizer.json: each document encoded with the tokenizer's
    /// special tokens (e.g. a BOS, as transformers' `encode` adds them) and followed by its
    /// `eos_token`, all documents concatenated in file order and cut into rows of `seq_len`
    /// tokens, the last partial row dropped (HF `run_clm`'s grouping with Megatron's
    /// end-of-document token). Blank lines are skipped.
    pub data: Option<PathBuf>,
    /// Directory holding the tokenizer for text `data` (default: `model`, which must then be
    /// an HF directory with tokenizer.json).
    pub tokenizer: Option<PathBuf>,
    /// Megatron's `--data-path`: indexed datasets (`prefix.bin` + `prefix.idx`), one prefix or
    /// `weight prefix` pairs to blend; sampled as Megatron's `GPTDataset` into sequences of
    /// `seq_len + 1` tokens (sample `s·gbs + i` is row `i` of step `s`), shuffled by `seed`.
    /// Empty: not used (it replaces `data`).
    pub data_path: Vec<String>,
    /// Seed of the data order (Megatron's `--seed`, 1234 by default).
    pub seed: u64,
    /// How SFT data (`data` a JSONL file of conversations or prompt–completion pairs) becomes
    /// rows.
    pub sft: crate::job_data::SftSettings,
    /// Trainer settings (learning rate, optimizer, dispatcher, aux-loss coefficient, FP8).
    pub trainer: TrainerConfig,
    /// Checkpoint root to save into.
    pub save: Option<PathBuf>,
    /// Save every this many steps (0: only at the end).
    pub save_every: usize,
    /// Continue from the latest checkpoint under `save`.
    pub resume: bool,
    /// JSON-lines metrics file (rank 0 writes it; appended to when resuming).
    pub metrics_out: Option<PathBuf>,
    /// Activation recompute: train on a device with Burn's gradient checkpointing, which keeps
    /// the inputs of memory-bound operations (element-wise ops, activations, norms) instead of
    /// their outputs and recomputes them in the backward pass. Results are bit-identical.
    pub recompute: bool,
    /// Compute device of every rank (`cpu`: Flex; `vulkan` / `cuda` need the binary's Cargo
    /// feature).
    pub device: crate::device::DeviceChoice,
    /// Load-balancing loss coefficient; `None`: the model's `config.json` (Qwen3-MoE
    /// `router_aux_loss_coef`, DeepSeek's `aux_loss_alpha`), else `trainer.aux_loss_coeff`.
    pub aux_loss_coeff: Option<f64>,
    /// Load-balancing loss type; `None`: `seq_aux_loss` when `config.json` says `seq_aux:
    /// true` (DeepSeek-V3's release config), else `trainer.aux_loss_type`.
    pub aux_loss_type: Option<AuxLossType>,
    /// After each successful save, keep only this many newest `iter_*` checkpoints (and the
    /// one `latest` names), removed crash-safely
    /// ([`keep_last`](moe_bridge::dist::retention::keep_last)); `None` keeps all.
    pub keep_last: Option<usize>,
    /// When to stop before `steps`, saving first: a signal, a wall-clock budget, a step
    /// interval.
    pub exit: ExitPolicy,
    /// Validation loss on held-out data during training.
    pub eval: Option<EvalJob>,
    /// After the last step, stream the trained weights to a rollout process listening at this
    /// `HOST:PORT` (e.g. `moe receive-weights`) in the weight-sync wire format
    /// ([`moe_models::weight_sync::wire`]): global rank 0 connects, every rank takes part in
    /// the collective sync. Not done when the job stops early (exit signal, budget, interval).
    pub sync_weights_to: Option<String>,
    /// The dtype the weights travel in with `sync_weights_to`.
    pub sync_dtype: SyncDtype,
    /// Largest bucket in bytes with `sync_weights_to` (`≥ 1`).
    pub sync_bucket_bytes: usize,
}

/// When a job stops early, every rank after the same step, with a checkpoint saved (when the
/// job saves) and success: Megatron's `--exit-signal-handler`, `--exit-duration-in-mins`,
/// `--exit-interval`.
#[derive(Debug, Clone, Default)]
pub struct ExitPolicy {
    /// Set by a signal handler ([`crate::preempt::ExitSignals`]): read after every step.
    pub signal: Option<Arc<AtomicBool>>,
    /// Stop once the job has run this long (measured by each rank from its start).
    pub duration: Option<Duration>,
    /// Stop after a step that is a multiple of this.
    pub interval: Option<usize>,
}

/// Evaluation settings (Megatron's `--eval-interval`, `--eval-iters`).
#[derive(Debug, Clone)]
pub struct EvalJob {
    /// Held-out data, in any format `data` takes.
    pub data: PathBuf,
    /// Evaluate after every this many steps (and after the last step).
    pub interval: usize,
    /// Global batches (of `gbs` sequences, in the same micro-batches as training) per
    /// evaluation: batch `k` holds rows `k·gbs … k·gbs + gbs − 1` of the data (wrapping), the
    /// same rows at every evaluation.
    pub iters: usize,
}

impl Default for TrainJob {
    fn default() -> Self {
        Self {
            model: PathBuf::from(crate::finetune::DEFAULT_MODEL_DIR),
            layout: "tp=2,ep=4".into(),
            steps: 20,
            gbs: 8,
            mbs: None,
            seq_len: 16,
            data: None,
            tokenizer: None,
            data_path: Vec::new(),
            seed: 1234,
            sft: crate::job_data::SftSettings::default(),
            trainer: TrainerConfig {
                lr: 3e-3,
                ..TrainerConfig::default()
            },
            save: None,
            save_every: 0,
            resume: false,
            metrics_out: None,
            recompute: false,
            device: crate::device::DeviceChoice::Cpu,
            aux_loss_coeff: None,
            aux_loss_type: None,
            keep_last: None,
            exit: ExitPolicy::default(),
            eval: None,
            sync_weights_to: None,
            sync_dtype: SyncDtype::default(),
            sync_bucket_bytes: moe_models::weight_sync::DEFAULT_BUCKET_BYTES,
        }
    }
}

/// The trainer settings of `job` with the router-loss settings it leaves open taken from the
/// model's `config.json` (`config`), as Megatron's HF bridges do: the coefficient from
/// `router_aux_loss_coef` (Qwen3-MoE) or `aux_loss_alpha` (DeepSeek), the sequence-level loss
/// when `seq_aux` is true (DeepSeek-V3); explicit job settings win.
pub fn router_loss_settings(job: &TrainJob, config: &Value) -> TrainerConfig {
    let mut trainer = job.trainer.clone();
    let from_config = ["router_aux_loss_coef", "aux_loss_alpha"]
        .iter()
        .find_map(|key| config.get(key).and_then(Value::as_f64));
    if let Some(coeff) = job.aux_loss_coeff.or(from_config) {
        trainer.aux_loss_coeff = coeff;
    }
    let seq_aux = config.get("seq_aux").and_then(Value::as_bool) == Some(true);
    trainer.aux_loss_type = match job.aux_loss_type {
        Some(kind) => kind,
        None if seq_aux => AuxLossType::SeqAux,
        None => trainer.aux_loss_type,
    };
    trainer
}

/// One step's metrics (rank 0's view of the whole job).
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    /// Steps taken after this one (1-based).
    pub step: usize,
    /// Cross-entropy of the global batch: the mean over its target tokens (every replica's,
    /// weighted by their token counts, as one rank computes it).
    pub loss: f32,
    /// Load-balancing loss (mean over MoE layers, without its coefficient) averaged over the
    /// data-parallel replicas.
    pub aux_loss: f32,
    /// Multi-token-prediction cross-entropy (mean over depths, without its scaling factor)
    /// averaged over the data-parallel replicas, for models with MTP modules.
    pub mtp_loss: Option<f32>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Target tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Non-finite steps skipped so far in the run (`--skip-nonfinite-steps`), this one
    /// included when it was skipped.
    pub skipped_steps: u64,
    /// Whether this step was skipped (nothing updated): non-finite, or an FP16 overflow.
    pub skipped: bool,
    /// The FP16 loss scale this step's backward pass used (`None` without loss scaling).
    pub loss_scale: Option<f64>,
    /// Validation loss (token-weighted mean cross-entropy over the evaluation batches) when
    /// the step evaluated.
    pub eval_loss: Option<f32>,
}

impl StepMetrics {
    /// The JSON-lines record (`eval_loss` and `eval_ppl` only on evaluation steps; a
    /// non-finite value is written as `null`).
    pub fn to_json(&self) -> Value {
        let mut record = json!({
            "step": self.step,
            "loss": self.loss,
            "aux_loss": self.aux_loss,
            "mtp_loss": self.mtp_loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "tokens_per_s": self.tokens_per_s,
            "skipped_steps": self.skipped_steps,
        });
        if let (Some(scale), Some(map)) = (self.loss_scale, record.as_object_mut()) {
            map.insert("loss_scale".into(), json!(scale));
        }
        if let (Some(eval), Some(map)) = (self.eval_loss, record.as_object_mut()) {
            map.insert("eval_loss".into(), json!(eval));
            map.insert("eval_ppl".into(), json!(f64::from(eval).exp()));
        }
        record
    }

    /// The scalars a TensorBoard writer records for this step, by tag (Megatron's names where
    /// it has them): `lm loss`, `load_balancing_loss`, `mtp loss`, `grad-norm`,
    /// `learning-rate`, `tokens-per-sec`, `skipped-iterations`, `loss-scale` (FP16),
    /// `lm loss validation`, `lm loss validation ppl`; non-finite values are left out.
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut out = vec![
            ("lm loss", f64::from(self.loss)),
            ("load_balancing_loss", f64::from(self.aux_loss)),
            ("grad-norm", self.grad_norm),
            ("learning-rate", self.lr),
            ("tokens-per-sec", self.tokens_per_s),
            ("skipped-iterations", self.skipped_steps as f64),
        ];
        if let Some(mtp) = self.mtp_loss {
            out.push(("mtp loss", f64::from(mtp)));
        }
        if let Some(scale) = self.loss_scale {
            out.push(("loss-scale", scale));
        }
        if let Some(eval) = self.eval_loss {
            out.push(("lm loss validation", f64::from(eval)));
            out.push(("lm loss validation ppl", f64::from(eval).exp()));
        }
        out.retain(|(_, v)| v.is_finite());
        out
    }
}

/// What a rank's part of the job ended with.
#[derive(Debug, Clone, Default)]
pub struct TrainJobReport {
    /// The step the run started from (0, or the resumed checkpoint's).
    pub first_step: usize,
    /// Metrics of the steps this run took.
    pub metrics: Vec<StepMetrics>,
    /// Checkpoints committed by this run.
    pub saved: Vec<PathBuf>,
    /// The layout that ran.
    pub layout: String,
    /// Why the run stopped before `steps` (a signal, the time budget, the exit interval),
    /// after saving.
    pub stopped: Option<String>,
}

/// The token source of a job.
#[derive(Debug, Clone)]
enum Data {
    Corpus {
        seq_len: usize,
    },
    Ids {
        ids: Vec<i64>,
        rows: usize,
        seq_len: usize,
    },
    /// Megatron's indexed datasets: sample `s·gbs + i`, `seq_len + 1` tokens.
    Megatron {
        samples: Arc<moe_bridge::data::TrainDataset>,
        row_len: usize,
    },
    /// SFT rows (packed or padded) with their labels and layouts.
    Sft(Arc<crate::job_data::SftRows>),
}

impl Data {
    /// The data of `path` (`job.data` for training; `None`: the built-in corpus).
    fn open(job: &TrainJob, path: Option<&Path>, vocab: usize) -> Result<Self, TrainJobError> {
        if let Some(path) = path
            && moe_bridge::data::idx_path(path).is_file()
        {
            // A Megatron indexed dataset given by its prefix (`prefix.idx` exists).
            return Self::megatron(job, &[path.display().to_string()], vocab);
        }
        let Some(path) = path else {
            if job.seq_len < 2 {
                return Err(invalid("seq_len", "sequences need at least 2 tokens"));
            }
            return Ok(Data::Corpus {
                seq_len: job.seq_len,
            });
        };
        if TextFormat::of(path) == Some(TextFormat::Jsonl) && crate::job_data::is_sft_jsonl(path) {
            let tokenizer = job_tokenizer(job, &path.display().to_string())?;
            return Ok(Data::Sft(Arc::new(crate::job_data::SftRows::open(
                path,
                &tokenizer,
                job.seq_len,
                job.sft,
                vocab,
            )?)));
        }
        if let Some(format) = TextFormat::of(path) {
            return Self::from_text(job, path, format, vocab);
        }
        let file = SafetensorsFile::open(path)?;
        let view = file.tensor(INPUT_IDS).map_err(|_| {
            invalid(
                path.display().to_string(),
                format!("no `{INPUT_IDS}` tensor (expected integer token ids [N, S])"),
            )
        })?;
        let &[rows, seq_len] = view.shape else {
            return Err(invalid(
                path.display().to_string(),
                format!("`{INPUT_IDS}` has shape {:?}, expected [N, S]", view.shape),
            ));
        };
        let ids: Vec<i64> = match view.dtype {
            Dtype::I64 | Dtype::I32 => view
                .to_tensor_data()?
                .convert::<i64>()
                .try_into_vec::<i64>()
                .map_err(|e| invalid(path.display().to_string(), format!("{e:?}")))?,
            other => {
                return Err(invalid(
                    path.display().to_string(),
                    format!("`{INPUT_IDS}` is {other:?}; token ids must be I64 or I32"),
                ));
            }
        };
        if rows == 0 || seq_len < 2 {
            return Err(invalid(
                path.display().to_string(),
                format!("`{INPUT_IDS}` [{rows}, {seq_len}] needs rows and at least 2 tokens"),
            ));
        }
        if let Some((at, bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id < 0 || **id as usize >= vocab)
        {
            return Err(invalid(
                path.display().to_string(),
                format!(
                    "`{INPUT_IDS}` row {} column {} holds {bad}, outside the vocabulary 0..{vocab}",
                    at / seq_len,
                    at % seq_len
                ),
            ));
        }
        Ok(Data::Ids { ids, rows, seq_len })
    }

    /// Text `path` tokenized into rows of `job.seq_len` tokens (see [`TrainJob::data`]).
    fn from_text(
        job: &TrainJob,
        path: &Path,
        format: TextFormat,
        vocab: usize,
    ) -> Result<Self, TrainJobError> {
        let file = path.display().to_string();
        let seq_len = job.seq_len;
        if seq_len < 2 {
            return Err(invalid("seq_len", "sequences need at least 2 tokens"));
        }
        let text = std::fs::read_to_string(path).map_err(|source| TrainJobError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let documents = format.documents(&text, &file)?;
        if documents.is_empty() {
            return Err(invalid(&file, "holds no documents"));
        }
        let tokenizer = job_tokenizer(job, &file)?;
        let tokenizer_file = tokenizer.path().display().to_string();
        let eos = tokenizer
            .eos_token_id()
            .or_else(|| tokenizer.generation_stop_ids().first().copied())
            .ok_or_else(|| {
                invalid(
                    &tokenizer_file,
                    "no `eos_token` (tokenizer_config.json) or `eos_token_id` \
                     (generation_config.json, config.json) to separate the documents",
                )
            })?;
        let texts: Vec<&str> = documents.iter().map(String::as_str).collect();
        let encoded = tokenizer.encode_batch(&texts, true)?;
        let mut ids: Vec<i64> = Vec::new();
        for doc in &encoded {
            ids.extend(doc.iter().map(|&t| i64::from(t)));
            if doc.last() != Some(&eos) {
                ids.push(i64::from(eos));
            }
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                &tokenizer_file,
                format!(
                    "{file} encodes to token id {bad} ({:?}), outside the model's vocabulary \
                     0..{vocab} (is this the model's own tokenizer?)",
                    tokenizer.id_to_token(bad as u32).unwrap_or_default()
                ),
            ));
        }
        let rows = ids.len() / seq_len;
        if rows == 0 {
            return Err(invalid(
                &file,
                format!(
                    "{} documents make {} tokens, fewer than one sequence of --seq-len {seq_len}",
                    documents.len(),
                    ids.len()
                ),
            ));
        }
        tracing::info!(
            data = %file,
            documents = documents.len(),
            tokens = ids.len(),
            rows,
            seq_len,
            dropped = ids.len() - rows * seq_len,
            "tokenized the text data"
        );
        ids.truncate(rows * seq_len);
        Ok(Data::Ids { ids, rows, seq_len })
    }

    /// Megatron's datasets of `--data-path` `args`, sampled for the job's steps.
    fn megatron(job: &TrainJob, args: &[String], vocab: usize) -> Result<Self, TrainJobError> {
        let samples = job.steps.saturating_mul(job.gbs).max(1);
        let samples =
            crate::job_data::megatron_dataset(args, job.seq_len, job.seed, samples, vocab)?;
        if samples.is_empty() {
            return Err(invalid("data_path", "no sample could be built"));
        }
        Ok(Data::Megatron {
            samples: Arc::new(samples),
            row_len: job.seq_len + 1,
        })
    }

    /// The training data of `job`.
    fn training(job: &TrainJob, vocab: usize) -> Result<Self, TrainJobError> {
        if !job.data_path.is_empty() {
            if job.data.is_some() {
                return Err(invalid(
                    "data_path",
                    "--data-path and --data are two training sets: give one",
                ));
            }
            return Self::megatron(job, &job.data_path, vocab);
        }
        Self::open(job, job.data.as_deref(), vocab)
    }

    /// Tokens per row of the batches this data makes.
    fn row_len(&self) -> usize {
        match self {
            Data::Corpus { seq_len } | Data::Ids { seq_len, .. } => *seq_len,
            Data::Megatron { row_len, .. } => *row_len,
            Data::Sft(rows) => rows.row_len(),
        }
    }

    /// Rows `first..first + count` of global batch `index` (of `gbs` rows) as one micro-batch.
    fn batch(
        &self,
        index: usize,
        gbs: usize,
        first: usize,
        count: usize,
        vocab: usize,
    ) -> Result<TrainBatch, TrainJobError> {
        match self {
            Data::Sft(rows) => rows.batch(index, gbs, first, count),
            Data::Megatron { samples, .. } => {
                let mut ids = Vec::new();
                for i in first..first + count {
                    let n = samples.len().max(1);
                    ids.extend(samples.sample((index * gbs + i) % n)?);
                }
                Ok(TrainBatch::causal(ids, count)?)
            }
            _ => Ok(TrainBatch::causal(
                self.sequences(index, gbs, first, count, vocab),
                count,
            )?),
        }
    }

    /// Sequences `first..first + count` of step `step` (global batch `gbs`), flattened.
    fn sequences(
        &self,
        step: usize,
        gbs: usize,
        first: usize,
        count: usize,
        vocab: usize,
    ) -> Vec<i64> {
        let mut out = Vec::new();
        for i in first..first + count {
            match self {
                Data::Corpus { seq_len } => {
                    out.extend(corpus_batch(step, i, 1, *seq_len, vocab));
                }
                Data::Ids { ids, rows, seq_len } => {
                    let row = (step * gbs + i) % rows;
                    out.extend_from_slice(&ids[row * seq_len..(row + 1) * seq_len]);
                }
                Data::Megatron { .. } | Data::Sft(_) => {}
            }
        }
        out
    }
}

/// Text formats of `--data`, by file extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextFormat {
    /// `.jsonl`: one JSON object per line with a `text` string.
    Jsonl,
    /// `.txt`: one document per line.
    Lines,
}

impl TextFormat {
    fn of(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()? {
            "jsonl" => Some(Self::Jsonl),
            "txt" => Some(Self::Lines),
            _ => None,
        }
    }

    /// The documents of `text` (blank lines skipped).
    fn documents(self, text: &str, file: &str) -> Result<Vec<String>, TrainJobError> {
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match self {
                Self::Lines => docs.push(line.to_string()),
                Self::Jsonl => {
                    let at = |detail: String| invalid(file, format!("line {}: {detail}", i + 1));
                    let value: Value = serde_json::from_str(line)
                        .map_err(|e| at(format!("not valid JSON: {e}")))?;
                    match value.get("text") {
                        Some(Value::String(text)) => docs.push(text.clone()),
                        _ => return Err(at("expected an object with a `text` string".into())),
                    }
                }
            }
        }
        Ok(docs)
    }
}

/// The tokenizer text data `file` needs: `job.tokenizer`, else the model directory's.
fn job_tokenizer(job: &TrainJob, file: &str) -> Result<Tokenizer, TrainJobError> {
    let dir = job.tokenizer.as_ref().unwrap_or(&job.model);
    Tokenizer::from_dir(dir).map_err(|e| match e {
        BridgeError::MissingTokenizer { .. } => invalid(
            file,
            format!(
                "text data needs a tokenizer: {e}{}",
                if job.tokenizer.is_none() {
                    " (pass --tokenizer DIR, e.g. for a distributed checkpoint)"
                } else {
                    ""
                }
            ),
        ),
        other => other.into(),
    })
}

fn is_dist_checkpoint(path: &Path) -> bool {
    path.join(LATEST_FILE).is_file() || path.join(INDEX_FILE).is_file()
}

fn read_json(path: &Path) -> Result<Value, TrainJobError> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainJobError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| invalid(path.display().to_string(), e.to_string()))
}

/// The `config.json` of a model path: an HF directory, or a distributed checkpoint's.
fn config_path(path: &Path) -> Result<PathBuf, TrainJobError> {
    if is_dist_checkpoint(path) {
        Ok(DistCheckpoint::open::<ModelConfig>(path)?
            .dir()
            .join(moe_bridge::hf::CONFIG_FILE))
    } else {
        Ok(path.join(moe_bridge::hf::CONFIG_FILE))
    }
}

/// Architecture fields that must agree between the model a job names and the checkpoint it
/// resumes (HF `config.json` names).
const ARCHITECTURE_FIELDS: [&str; 25] = [
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
    "tie_word_embeddings",
    "mlp_only_layers",
    "decoder_sparse_step",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "num_nextn_predict_layers",
];

/// Refuses to resume from a checkpoint of another model than `--model`'s (another
/// architecture or shape), naming the first field that differs.
fn check_same_model(model: &Path, root: &Path) -> Result<(), TrainJobError> {
    let (want_path, have_path) = (config_path(model)?, config_path(root)?);
    let (want, have) = (read_json(&want_path)?, read_json(&have_path)?);
    for field in ARCHITECTURE_FIELDS {
        if want.get(field) != have.get(field) {
            return Err(invalid(
                "resume",
                format!(
                    "the checkpoint under {} is of another model: `{field}` is {} there but {} in {}",
                    root.display(),
                    have.get(field).map_or("absent".into(), Value::to_string),
                    want.get(field).map_or("absent".into(), Value::to_string),
                    want_path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Parses the layout of `job` for a world of `world` ranks.
pub fn job_layout(job: &TrainJob, world: Option<usize>) -> Result<ParallelLayout, TrainJobError> {
    let layout = ParallelLayout::parse_spec(&job.layout)?;
    if let Some(world) = world
        && layout.world != world
    {
        // A spec without `world=` derives the smallest world; processes fix it.
        let fixed = ParallelLayout::parse(world, &job.layout).map_err(|e| {
            invalid(
                "layout",
                format!(
                    "`{}` does not fit the {world} launched ranks: {e}",
                    job.layout
                ),
            )
        })?;
        return Ok(fixed);
    }
    Ok(layout)
}

/// Checks the settings that do not need the model, before any rank starts.
pub fn check_job(job: &TrainJob, layout: &ParallelLayout) -> Result<(), TrainJobError> {
    // Refused before training rather than after it.
    if job.sync_weights_to.is_some() && job.sync_bucket_bytes == 0 {
        return Err(invalid(
            "sync_bucket_bytes",
            "a bucket must hold at least 1 byte",
        ));
    }
    // The context-parallel ranks of a replica share its sequences.
    let replicas = layout.dp;
    if job.gbs == 0 || !job.gbs.is_multiple_of(replicas) {
        return Err(invalid(
            "gbs",
            format!(
                "the global batch of {} sequences does not split over {replicas} data-parallel \
                 replicas of layout {layout}",
                job.gbs
            ),
        ));
    }
    if let Some(mbs) = job.mbs
        && (mbs == 0 || !(job.gbs / replicas).is_multiple_of(mbs))
    {
        return Err(invalid(
            "mbs",
            format!(
                "the global batch of {} sequences does not split into {replicas} replicas × \
                 micro-batches of {mbs} sequences",
                job.gbs
            ),
        ));
    }
    if layout.pp > 1 {
        // The pipeline schedule of every step: an interleaved one needs enough micro-batches.
        let per_replica = job.gbs / replicas;
        let micro = per_replica / job.mbs.unwrap_or(per_replica).max(1);
        moe_backend::parallel::schedule::PipelineSchedule::interleaved(
            layout.pp, layout.vpp, micro,
        )
        .map_err(|e| {
            invalid(
                "mbs",
                format!(
                    "{micro} micro-batches per step (gbs {} / {replicas} replicas / mbs): {e}",
                    job.gbs
                ),
            )
        })?;
    }
    if job.steps == 0 {
        return Err(invalid("steps", "train at least one step"));
    }
    if job.resume && job.save.is_none() {
        return Err(invalid(
            "resume",
            "--resume needs --save (the checkpoint root)",
        ));
    }
    match (job.keep_last, &job.save) {
        (Some(0), _) => return Err(invalid("keep_last", "keep at least one checkpoint")),
        (Some(_), None) => {
            return Err(invalid(
                "keep_last",
                "--keep-last needs --save (the checkpoint root)",
            ));
        }
        _ => {}
    }
    if let Some(eval) = &job.eval {
        if eval.interval == 0 {
            return Err(invalid("eval_interval", "evaluate every 1 step or more"));
        }
        if eval.iters == 0 {
            return Err(invalid("eval_iters", "evaluate at least one batch"));
        }
        if !eval.data.is_file() {
            return Err(invalid(
                "eval_data",
                format!("{}: no such file", eval.data.display()),
            ));
        }
    }
    if job.exit.interval == Some(0) {
        return Err(invalid("exit_interval", "exit after every 1 step or more"));
    }
    Ok(())
}

/// The `model_type` of the model `moe train` starts from (the resumed checkpoint's when
/// resuming).
fn model_type(path: &Path) -> Result<String, TrainJobError> {
    let path = config_path(path)?;
    let config = read_json(&path)?;
    config
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| invalid(path.display().to_string(), "no `model_type` string"))
}

/// Runs this rank's part of `job` (every rank of the world calls it). `on_step` runs on rank 0
/// after every step.
pub fn run_rank(
    ctx: &RankCtx,
    job: &TrainJob,
    on_step: &(dyn Fn(&StepMetrics) + Sync),
) -> Result<TrainJobReport, TrainJobError> {
    struct Run<'a>(&'a RankCtx, &'a TrainJob, &'a (dyn Fn(&StepMetrics) + Sync));
    impl FamilyVisitor for Run<'_> {
        type Output = Result<TrainJobReport, TrainJobError>;
        fn visit<F: Family>(self) -> Self::Output {
            run_model::<F>(self.0, self.1, self.2)
        }
    }
    let model_type = model_type(&job.model)?;
    visit_family(&model_type, Run(ctx, job, on_step)).unwrap_or_else(|| {
        Err(invalid(
            "model",
            format!(
                "{}: `model_type` \"{model_type}\" cannot be trained by `moe train` ({})",
                job.model.display(),
                MODEL_TYPES.join(", ")
            ),
        ))
    })
}

/// The configuration of family `F` at `config` and its vocabulary size.
fn read_config<F: Family>(config: &Path) -> Result<(F::Config, usize), TrainJobError> {
    let text = std::fs::read_to_string(config)
        .map_err(|e| invalid(config.display().to_string(), e.to_string()))?;
    let config = F::Config::from_json_str(&text)?;
    let vocab = config.vocab_size();
    Ok((config, vocab))
}

/// [`run_rank`] for the model family `F`.
fn run_model<F: Family>(
    ctx: &RankCtx,
    job: &TrainJob,
    on_step: &(dyn Fn(&StepMetrics) + Sync),
) -> Result<TrainJobReport, TrainJobError> {
    let layout = job_layout(job, Some(ctx.world_size()))?;
    check_job(job, &layout)?;
    // One GPU per rank: the rank's index on its node picks it (`crate::device`).
    let base = job.device.rank_device(crate::device::local_index(ctx)?)?;
    let device = if job.recompute {
        base.autodiff().gradient_checkpointing()
    } else {
        base.autodiff()
    };
    let groups = ctx.process_groups(&layout)?;
    let world = ctx.world()?;

    // Where the parameters come from: the latest checkpoint of the save root when resuming,
    // else the model path (distributed checkpoint or HF directory).
    let resume_from = match (&job.save, job.resume) {
        (Some(root), true) if root.join(LATEST_FILE).is_file() => Some(root.clone()),
        (Some(root), true) => {
            return Err(invalid(
                "resume",
                format!("{} holds no checkpoint to resume from", root.display()),
            ));
        }
        _ => None,
    };
    if let Some(root) = &resume_from {
        check_same_model(&job.model, root)?;
    }
    let (mut trainer, state, config_value, family, vocab) = match resume_from
        .as_deref()
        .or_else(|| is_dist_checkpoint(&job.model).then_some(job.model.as_path()))
    {
        Some(path) => {
            let ckpt = DistCheckpoint::open::<ModelConfig>(path)?;
            let config_path = ckpt.dir().join(moe_bridge::hf::CONFIG_FILE);
            // This rank's shard at local shapes, filled by the restore (no full template).
            let (config, vocab) = read_config::<F>(&config_path)?;
            let settings = router_loss_settings(job, &read_json(&config_path)?);
            let skeleton =
                F::Model::shard_skeleton(&config, &groups, job.trainer.dispatcher, &device)?;
            let mut trainer = Trainer::<F::Model>::from_shard(
                skeleton,
                &groups,
                world.clone(),
                settings,
                &device,
            )?;
            let state = restore_trainer(&ckpt, &mut trainer)?;
            let family = ckpt.index().model_family.clone();
            (trainer, state, read_json(&config_path)?, family, vocab)
        }
        None => {
            let checkpoint = HfCheckpoint::open(&job.model)?;
            let config_path = job.model.join(moe_bridge::hf::CONFIG_FILE);
            // Config, shard set, presence, shapes and dtypes before any weight is read; then
            // only this rank's boxes.
            let (shard, report) = load_shard_checked::<F::Model>(
                &checkpoint,
                &groups,
                job.trainer.dispatcher,
                &device,
            )?;
            let vocab = report.config.vocab_size();
            let settings = router_loss_settings(job, &read_json(&config_path)?);
            let trainer =
                Trainer::<F::Model>::from_shard(shard, &groups, world.clone(), settings, &device)?;
            let state = TrainState {
                step: 0,
                data_position: 0,
                rng_seed: 0,
                extra: Default::default(),
            };
            let mut config = read_json(&config_path)?;
            // An FP8 release trains (and saves) dequantised weights.
            if let Some(map) = config.as_object_mut() {
                map.remove("quantization_config");
            }
            (trainer, state, config, Some(F::MODEL_TYPE.into()), vocab)
        }
    };
    let data = Data::training(job, vocab)?;
    let seq_len = data.row_len();
    if layout.cp > 1 && !seq_len.is_multiple_of(2 * layout.cp) {
        return Err(invalid(
            "seq_len",
            format!(
                "context parallelism cuts every sequence into 2·cp = {} chunks; sequences of \
                 {seq_len} tokens do not split (layout {layout})",
                2 * layout.cp
            ),
        ));
    }
    let eval_data = match &job.eval {
        Some(eval) => {
            let eval_data = Data::open(job, Some(&eval.data), vocab)?;
            let len = eval_data.row_len();
            if layout.cp > 1 && !len.is_multiple_of(2 * layout.cp) {
                return Err(invalid(
                    "eval_data",
                    format!(
                        "{}: sequences of {len} tokens do not split into 2·cp = {} chunks \
                         (layout {layout})",
                        eval.data.display(),
                        2 * layout.cp
                    ),
                ));
            }
            Some(eval_data)
        }
        None => None,
    };
    let first_step = usize::try_from(state.step).unwrap_or(usize::MAX);
    if first_step > job.steps {
        return Err(invalid(
            "steps",
            format!(
                "the checkpoint is already at step {first_step}, past the requested {}",
                job.steps
            ),
        ));
    }
    let replicas = layout.dp;
    let per_replica = job.gbs / replicas;
    let mbs = job.mbs.unwrap_or(per_replica);
    let replica = groups.groups.get(GroupFamily::Dp).index;
    if let (Some(root), 0) = (&job.save, ctx.rank()) {
        clean_stale_saves(root);
    }
    let mut skipped = state
        .extra
        .get(SKIPPED_STEPS)
        .and_then(Value::as_u64)
        .unwrap_or(0);
    trainer.set_skipped_steps(skipped);
    if let Some(saved) = state.extra.get(GRAD_SCALER) {
        trainer.set_grad_scaler_state(&grad_scaler_from_json(saved)?)?;
    }
    let mut report = TrainJobReport {
        first_step,
        layout: layout.to_string(),
        ..TrainJobReport::default()
    };
    let started = Instant::now();
    // This replica's micro-batches of global batch `index` of `data`.
    let micro_batches = |data: &Data, index: usize| {
        (0..per_replica / mbs)
            .map(|m| data.batch(index, job.gbs, replica * per_replica + m * mbs, mbs, vocab))
            .collect::<Result<Vec<_>, _>>()
    };
    for step in first_step..job.steps {
        let done = step + 1;
        let micro = micro_batches(&data, step)?;
        let stats = match trainer.step_micro_batches(&micro) {
            Ok(stats) => stats,
            Err(e) if e.is_non_finite() => {
                let detail = match e {
                    moe_models::ModelError::Backend(b) => b.to_string(),
                    other => other.to_string(),
                };
                return Err(TrainJobError::NonFinite {
                    step: done,
                    detail,
                    latest: latest_description(job.save.as_deref()),
                });
            }
            Err(e) => return Err(e.into()),
        };
        if stats.overflow {
            if ctx.rank() == 0 {
                tracing::info!(
                    step = done,
                    loss_scale = stats.loss_scale.unwrap_or(f64::NAN),
                    "skipped a step: FP16 gradients overflowed (the loss scaler backs off)"
                );
            }
        } else if stats.skipped {
            skipped += 1;
            if ctx.rank() == 0 {
                tracing::warn!(
                    step = done,
                    skipped,
                    "skipped a non-finite step (--skip-nonfinite-steps)"
                );
            }
        }
        let eval = match (&job.eval, &eval_data) {
            (Some(settings), Some(eval_data))
                if done.is_multiple_of(settings.interval.max(1)) || done == job.steps =>
            {
                let (mut loss_sum, mut tokens) = (0.0f64, 0usize);
                for k in 0..settings.iters {
                    let (l, n) = trainer.evaluate(&micro_batches(eval_data, k)?)?;
                    loss_sum += l;
                    tokens += n;
                }
                Some((loss_sum, tokens))
            }
            _ => None,
        };
        let votes = ExitVotes {
            signal: job
                .exit
                .signal
                .as_ref()
                .is_some_and(|f| f.load(Ordering::SeqCst)),
            duration: job.exit.duration.is_some_and(|d| started.elapsed() >= d),
            interval: job
                .exit
                .interval
                .is_some_and(|k| k > 0 && done.is_multiple_of(k) && done < job.steps),
        };
        let (mut metrics, stop) = reduce_metrics(&world, &layout, done, &stats, eval, votes)?;
        metrics.skipped_steps = skipped;
        if ctx.rank() == 0 {
            on_step(&metrics);
        }
        report.metrics.push(metrics);
        let due = job.save_every > 0 && done.is_multiple_of(job.save_every);
        if let Some(root) = &job.save
            && (due || done == job.steps || stop.is_some())
        {
            let mut meta = SaveMeta::new(done as u64, &layout);
            meta.model_family = family.clone();
            meta.config = Some(config_value.clone());
            let mut extra = state.extra.clone();
            extra.insert(SKIPPED_STEPS.into(), json!(skipped));
            if let Some(scaler) = trainer.grad_scaler() {
                let st = scaler.state();
                extra.insert(
                    GRAD_SCALER.into(),
                    json!({
                        "scale": st.scale,
                        "growth_tracker": st.growth_tracker,
                        "hysteresis_tracker": st.hysteresis_tracker,
                    }),
                );
            }
            let saved_state = TrainState {
                step: done as u64,
                data_position: done as u64,
                rng_seed: state.rng_seed,
                extra,
            };
            let dir = save_trainer(&world, root, meta, &trainer, &saved_state)?;
            report.saved.push(dir);
            if let (Some(keep), 0) = (job.keep_last, ctx.rank()) {
                apply_retention(root, keep);
            }
        }
        if let Some(reason) = stop {
            if ctx.rank() == 0 {
                tracing::warn!(step = done, "stopping: {reason}");
            }
            report.stopped = Some(reason);
            break;
        }
    }
    if let Some(addr) = &job.sync_weights_to
        && report.stopped.is_none()
    {
        let options = SyncOptions {
            bucket_bytes: job.sync_bucket_bytes,
            dtype: job.sync_dtype,
            ..SyncOptions::default()
        };
        sync_to_rollout(ctx, &groups, trainer.model().model(), addr, options)?;
    }
    Ok(report)
}

/// Streams `model` (this rank's shard) to the rollout process at `addr` in the weight-sync
/// wire format: global rank 0 connects, writes, then waits for the receiver's acknowledgement;
/// every rank takes part in the collective. A failed connection still lets the collective run
/// to its end (so no rank waits forever), then fails the job; a refusal fails it with the
/// receiver's reason.
fn sync_to_rollout<M: ExportHf>(
    ctx: &RankCtx,
    groups: &moe_backend::comm::GroupComms,
    model: &M,
    addr: &str,
    options: SyncOptions,
) -> Result<(), TrainJobError> {
    let failed = |source| TrainJobError::WeightSync {
        addr: addr.to_owned(),
        source: Box::new(source),
    };
    let stream = (ctx.rank() == 0).then(|| std::net::TcpStream::connect(addr));
    let mut sender = match &stream {
        Some(Ok(s)) => Some(WireSender::new(std::io::BufWriter::new(s))),
        _ => None,
    };
    let result = sync_weights(
        model,
        groups,
        options,
        sender.as_mut().map(|s| s as &mut dyn WeightReceiver),
    );
    let wire = sender.as_ref().map(WireSender::stats);
    drop(sender);
    let stream = match stream {
        None => return result.map(drop).map_err(failed),
        Some(Err(e)) => {
            return Err(failed(WeightSyncError::Unsupported(format!(
                "cannot connect: {e}"
            ))));
        }
        Some(Ok(stream)) => stream,
    };
    if result.is_err() {
        // The receiver sees the stream end early and answers with its refusal (if it still
        // can); do not wait long for it.
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    }
    let ack = read_ack(&stream);
    let stats = match (result, ack) {
        (Ok(stats), Ok(())) => stats,
        // A write failed because the receiver refused: its reason is the one to report.
        (
            Err(WeightSyncError::WireIo { .. }),
            Err(refused @ WeightSyncError::WireRejected { .. }),
        ) => {
            return Err(failed(refused));
        }
        (Err(e), _) | (Ok(_), Err(e)) => return Err(failed(e)),
    };
    if let Some(wire) = wire {
        tracing::info!(
            addr,
            tensors = wire.tensors,
            buckets = wire.buckets,
            bytes = wire.stream_bytes,
            seconds = stats.seconds,
            "synced the trained weights"
        );
    }
    Ok(())
}

/// `TrainState::extra` key of the count of skipped non-finite steps.
const SKIPPED_STEPS: &str = "skipped_steps";

/// `TrainState::extra` key of the FP16 loss scaler's state (Megatron's `grad_scaler`
/// `state_dict`: `scale`, `growth_tracker`, `hysteresis_tracker`).
const GRAD_SCALER: &str = "grad_scaler";

/// The loss scaler's state as a checkpoint's `extra` holds it.
fn grad_scaler_from_json(v: &Value) -> Result<GradScalerState, TrainJobError> {
    let field = |name: &str| {
        v.get(name).ok_or_else(|| {
            invalid(
                "resume",
                format!("the checkpoint's `{GRAD_SCALER}` state lacks `{name}`: {v}"),
            )
        })
    };
    let bad = |name: &str| {
        invalid(
            "resume",
            format!("`{GRAD_SCALER}.{name}` is malformed: {v}"),
        )
    };
    Ok(GradScalerState {
        scale: field("scale")?.as_f64().ok_or_else(|| bad("scale"))?,
        growth_tracker: field("growth_tracker")?
            .as_u64()
            .ok_or_else(|| bad("growth_tracker"))?,
        hysteresis_tracker: field("hysteresis_tracker")?
            .as_i64()
            .ok_or_else(|| bad("hysteresis_tracker"))?,
    })
}

/// `the latest checkpoint is …` of a job's save root, for the non-finite error.
fn latest_description(save: Option<&Path>) -> String {
    match save {
        Some(root) => match std::fs::read_to_string(root.join(LATEST_FILE)) {
            Ok(name) => format!(
                "the latest checkpoint, {}, holds the last finite state (resume with --resume)",
                root.join(name.trim()).display()
            ),
            Err(_) => format!("no checkpoint was saved under {}", root.display()),
        },
        None => "the job saves no checkpoints (--save)".into(),
    }
}

/// Keeps the newest `keep` checkpoints of `root` (rank 0, after a save), logging what goes.
/// `MOE_TEST_KILL_IN_RETENTION=1` kills the process (SIGKILL) in the middle of the first
/// removal: the crash test of `tests/long_runs.rs`.
fn apply_retention(root: &Path, keep: usize) {
    let kill = std::env::var("MOE_TEST_KILL_IN_RETENTION").is_ok_and(|v| v == "1");
    let mut at = |point: moe_bridge::dist::retention::RemovalPoint<'_>| {
        let moe_bridge::dist::retention::RemovalPoint::Renamed(hidden) = point;
        if kill {
            // Half of the directory deleted, then killed.
            if let Ok(entries) = std::fs::read_dir(hidden) {
                for entry in entries.flatten().step_by(2) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
            let _ = signal_hook::low_level::raise(signal_hook::consts::signal::SIGKILL);
        }
    };
    match moe_bridge::dist::retention::keep_last_with(root, keep, &mut at) {
        Ok(report) => {
            for dir in &report.removed {
                tracing::info!(path = %dir.display(), "removed an old checkpoint (--keep-last {keep})");
            }
        }
        Err(e) => tracing::warn!("checkpoint retention under {}: {e}", root.display()),
    }
}

/// Removes the temporary directories that killed saves left under `root` (their owner process
/// is gone), logging each; the next save would remove them too, silently.
fn clean_stale_saves(root: &Path) {
    match remove_stale_temp_dirs(root, &StalePolicy::default()) {
        Ok(report) => {
            for dir in &report.removed {
                tracing::warn!(path = %dir.path.display(), reason = %dir.reason, "removed a killed save's temporary directory");
            }
            for e in &report.failed {
                tracing::warn!("{e}");
            }
        }
        Err(e) => tracing::warn!("cannot check {} for stale saves: {e}", root.display()),
    }
}

/// Each rank's reasons to stop after a step, agreed in the step's metrics collective.
#[derive(Debug, Clone, Copy, Default)]
struct ExitVotes {
    /// An exit signal reached this process.
    signal: bool,
    /// This rank's time budget is spent.
    duration: bool,
    /// The step is a multiple of the exit interval.
    interval: bool,
}

/// The job-wide view of one step: losses averaged over ranks, tokens summed over replicas, the
/// validation loss over every replica (`eval`: this replica's token-summed cross-entropy and
/// target tokens), and whether any rank votes to stop (with the reason). One collective.
fn reduce_metrics(
    world: &Comm,
    layout: &ParallelLayout,
    step: usize,
    stats: &moe_models::train::StepStats,
    eval: Option<(f64, usize)>,
    votes: ExitVotes,
) -> Result<(StepMetrics, Option<String>), TrainJobError> {
    // Every TP / CP / EP rank of a replica reports its replica's values: dividing by the world
    // size averages over replicas; tokens per second count once per replica.
    let ranks_per_replica = (layout.world / layout.dp) as f32;
    let (eval_sum, eval_tokens) = eval.unwrap_or((0.0, 0));
    let flag = |b: bool| if b { 1.0f32 } else { 0.0 };
    let local = Tensor::<1>::from_data(
        [
            stats.loss * stats.tokens as f32,
            stats.aux_loss,
            stats.tokens_per_second as f32 / ranks_per_replica,
            stats.mtp_loss.unwrap_or(0.0),
            eval_sum as f32,
            eval_tokens as f32,
            flag(votes.signal),
            flag(votes.duration),
            flag(votes.interval),
            stats.tokens as f32,
        ],
        &Device::flex(),
    );
    let sums = world
        .all_reduce(local, ReduceOp::Sum)?
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| invalid("metrics", format!("{e:?}")))?;
    let n = layout.world as f32;
    // The router loss of a replica is the sum of its ranks' parts (each pipeline stage
    // reports the parts of every stage).
    let replicas = layout.dp as f32;
    let sum = |i: usize| sums.get(i).copied().unwrap_or(0.0);
    let stop = if sum(6) > 0.0 {
        Some(format!(
            "an exit signal reached {} of {} rank(s)",
            sum(6),
            layout.world
        ))
    } else if sum(7) > 0.0 {
        Some("the --exit-duration-in-mins budget is spent".to_string())
    } else if sum(8) > 0.0 {
        Some(format!("step {step} is a multiple of --exit-interval"))
    } else {
        None
    };
    let metrics = StepMetrics {
        step,
        // Token-weighted over the replicas (each replica's ranks report it alike): the mean
        // cross-entropy of the global batch, as one rank computes it.
        loss: sum(0) / sum(9).max(1.0),
        aux_loss: sum(1) / (replicas * layout.pp as f32),
        mtp_loss: stats.mtp_loss.map(|_| sum(3) / n),
        grad_norm: stats.grad_norm,
        lr: stats.lr,
        tokens_per_s: f64::from(sum(2)),
        skipped_steps: 0,
        skipped: stats.skipped,
        loss_scale: stats.loss_scale,
        // Each replica's sums are reported by all its ranks alike: the ratio is the mean.
        eval_loss: eval.and_then(|_| (sum(5) > 0.0).then(|| sum(4) / sum(5))),
    };
    Ok((metrics, stop))
}

/// Appends metrics to a JSON-lines file.
///
/// The file is opened (truncated, or appended to) by the first record, so a job refused
/// before its first step leaves an existing metrics file as it was and creates none.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    append: bool,
    file: std::sync::Mutex<Option<std::fs::File>>,
}

impl MetricsWriter {
    /// A writer of `path` (truncated, or appended to when `append`, at the first record); its
    /// directory must exist.
    pub fn open(path: &Path, append: bool) -> Result<Self, TrainJobError> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() || path.is_dir() {
            return Err(TrainJobError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a file in an existing directory",
                ),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            append,
            file: std::sync::Mutex::new(None),
        })
    }

    /// Writes one record (a line) and flushes it.
    pub fn write(&self, metrics: &StepMetrics) -> Result<(), TrainJobError> {
        let io = |source| TrainJobError::Io {
            path: self.path.clone(),
            source,
        };
        let mut slot = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let file = match slot.take() {
            Some(file) => file,
            None => std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(self.append)
                .truncate(!self.append)
                .open(&self.path)
                .map_err(io)?,
        };
        let file = slot.insert(file);
        writeln!(file, "{}", metrics.to_json())
            .and_then(|()| file.flush())
            .map_err(io)
    }
}

/// Runs `job` on every rank of `placement` (threads, or this process as one rank of a
/// multi-process job); returns this process's report (rank 0's for threads). `on_step` runs
/// on rank 0 after every step.
pub fn run_job(
    job: &TrainJob,
    placement: &Placement,
    timeout: Duration,
    on_step: &(dyn Fn(&StepMetrics) + Sync),
) -> Result<TrainJobReport, TrainJobError> {
    // The device before any work: no driver, no device or more ranks on this node than GPUs
    // end the job here, naming the counts, instead of in the runtime's own threads. Processes
    // know their node's ranks from the launcher; threads once the layout gives their number.
    match placement {
        Placement::Process {
            launch: Some(launch),
            ..
        } => job
            .device
            .check_local_ranks(&LocalRanks::from_launch(launch))?,
        Placement::Process { launch: None, .. } => {
            job.device.check_local_ranks(&LocalRanks::threads(1))?
        }
        Placement::Threads { .. } => {}
    }
    let launched = match placement {
        Placement::Threads { .. } => None,
        // A process without a launcher (NCCL on one GPU) is a world of one.
        Placement::Process { .. } => Some(placement.world().unwrap_or(1)),
    };
    let layout = job_layout(job, launched)?;
    let placement = match placement {
        Placement::Threads { .. } => {
            job.device
                .check_local_ranks(&LocalRanks::threads(layout.world))?;
            Placement::Threads {
                world: layout.world,
            }
        }
        other => other.clone(),
    };
    check_job(job, &layout)?;
    // A rank's own job error (a bad file, a refused checkpoint) is kept as it is: the ranks
    // speak `BackendError`, so it travels beside them and replaces the stand-in afterwards.
    let job_error: std::sync::Mutex<Option<TrainJobError>> = std::sync::Mutex::new(None);
    let result = run_spmd(&placement, timeout, |ctx| {
        run_rank(ctx, job, on_step).map_err(|e| match e {
            TrainJobError::Backend(b) => b,
            other => {
                let detail = other.to_string();
                let mut slot = job_error.lock().unwrap_or_else(|p| p.into_inner());
                slot.get_or_insert(other);
                moe_backend::BackendError::Config {
                    field: "train",
                    detail,
                }
            }
        })
    });
    result.map_err(|e| {
        let own = job_error.into_inner().unwrap_or_else(|p| p.into_inner());
        own.unwrap_or(TrainJobError::Backend(e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An FP16 step's loss scale is logged (`loss_scale` in the JSON record, Megatron's
    /// `loss-scale` in TensorBoard); without loss scaling neither appears.
    #[test]
    fn loss_scale_is_logged_when_set() {
        let mut m = StepMetrics {
            step: 3,
            loss: 2.5,
            aux_loss: 1.0,
            mtp_loss: None,
            grad_norm: f64::NAN,
            lr: 1e-3,
            tokens_per_s: 10.0,
            skipped_steps: 0,
            skipped: true,
            loss_scale: Some(65536.0),
            eval_loss: None,
        };
        assert_eq!(m.to_json()["loss_scale"], json!(65536.0));
        assert!(m.to_json()["grad_norm"].is_null());
        let scalars = m.scalars();
        assert!(scalars.contains(&("loss-scale", 65536.0)), "{scalars:?}");
        assert!(!scalars.iter().any(|(tag, _)| *tag == "grad-norm"));
        m.loss_scale = None;
        assert!(m.to_json().get("loss_scale").is_none());
        assert!(!m.scalars().iter().any(|(tag, _)| *tag == "loss-scale"));
    }

    #[test]
    fn router_losses_default_to_the_model_config_and_explicit_settings_win() {
        let job = TrainJob::default();
        // DeepSeek-V3's release config.
        let deepseek =
            json!({"model_type": "deepseek_v3", "aux_loss_alpha": 0.002, "seq_aux": true});
        let t = router_loss_settings(&job, &deepseek);
        assert_eq!(
            (t.aux_loss_coeff, t.aux_loss_type),
            (0.002, AuxLossType::SeqAux)
        );
        // Qwen3-MoE's HF config.
        let qwen = json!({"model_type": "qwen3_moe", "router_aux_loss_coef": 0.01});
        let t = router_loss_settings(&job, &qwen);
        assert_eq!(
            (t.aux_loss_coeff, t.aux_loss_type),
            (0.01, AuxLossType::Aux)
        );
        // Nothing in the config: the trainer's defaults (Megatron's 1e-3, `aux_loss`).
        let t = router_loss_settings(&job, &json!({"model_type": "qwen3"}));
        assert_eq!(
            (t.aux_loss_coeff, t.aux_loss_type),
            (1e-3, AuxLossType::Aux)
        );
        // Explicit settings win over the config.
        let explicit = TrainJob {
            aux_loss_coeff: Some(0.0),
            aux_loss_type: Some(AuxLossType::GlobalAux),
            ..TrainJob::default()
        };
        let t = router_loss_settings(&explicit, &deepseek);
        assert_eq!(
            (t.aux_loss_coeff, t.aux_loss_type),
            (0.0, AuxLossType::GlobalAux)
        );
    }
}
