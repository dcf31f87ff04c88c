//! The data sources of a training job beyond token-id files and pretraining text: Megatron's
//! indexed datasets (`--data-path`, blended) and SFT conversations / prompt–completion pairs
//! (`--data chat.jsonl`), each turned into rows of a [`TrainBatch`].

use std::path::Path;

use moe_bridge::Tokenizer;
use moe_bridge::data::{TrainDataset, parse_data_path};
use moe_bridge::text::sft::{self, SftOptions, Truncation};
use moe_models::train::TrainBatch;
use serde_json::Value;

use crate::train_job::TrainJobError;

/// How SFT examples become rows (`--sft-packing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SftPacking {
    /// Several examples per row, packed best-fit-decreasing as TRL packs them; attention and
    /// positions restart at every example.
    #[default]
    Packed,
    /// One example per row, right-padded.
    Padded,
}

/// SFT settings of a job (`--sft-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SftSettings {
    /// Packed or padded rows.
    pub packing: SftPacking,
    /// An example longer than `--seq-len`: truncated as TRL truncates, or refused.
    pub truncation: Truncation,
    /// Conversations train on the assistant turns only (TRL's `assistant_only_loss`); off,
    /// on every token of the conversation.
    pub assistant_only_loss: bool,
}

impl Default for SftSettings {
    fn default() -> Self {
        Self {
            packing: SftPacking::Packed,
            truncation: Truncation::Truncate,
            assistant_only_loss: true,
        }
    }
}

fn invalid(field: impl Into<String>, detail: impl Into<String>) -> TrainJobError {
    TrainJobError::Invalid {
        field: field.into(),
        detail: detail.into(),
    }
}

/// Megatron's train split of the `--data-path` datasets (`args`, Megatron's list) for
/// `num_samples` sequences of `seq_len + 1` tokens with `seed`, every token id checked against
/// `vocab` before any step.
pub fn megatron_dataset(
    args: &[String],
    seq_len: usize,
    seed: u64,
    num_samples: usize,
    vocab: usize,
) -> Result<TrainDataset, TrainJobError> {
    let blend = parse_data_path(args)?;
    let seed = u32::try_from(seed).map_err(|_| {
        invalid(
            "seed",
            format!("{seed}: Megatron's random seed is a 32-bit unsigned integer"),
        )
    })?;
    let dataset = TrainDataset::build(&blend, seq_len, seed, num_samples as u64)?;
    dataset.check_vocab(vocab as u64)?;
    Ok(dataset)
}

/// One SFT row: ids padded to the row length, HF labels (-100 where not trained and on
/// padding), and either its examples' boundaries (packed) or its attention mask (padded).
#[derive(Debug, Clone)]
pub struct SftRow {
    ids: Vec<i64>,
    labels: Vec<i64>,
    /// Example boundaries `[0, l₀, l₀+l₁, …]` of a packed row.
    cu_seqlens: Option<Vec<usize>>,
    /// Tokens before the padding.
    len: usize,
}

/// SFT data as rows of `row_len` tokens.
#[derive(Debug)]
pub struct SftRows {
    rows: Vec<SftRow>,
    row_len: usize,
    packing: SftPacking,
}

/// The first non-blank line of the JSONL file `path`, parsed.
fn first_row(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| !l.trim().is_empty())?;
    serde_json::from_str(line).ok()
}

/// Whether the JSONL file `path` holds SFT rows (`messages`, or `prompt` and `completion`)
/// rather than pretraining text (`text`): decided by its first non-blank line.
pub fn is_sft_jsonl(path: &Path) -> bool {
    first_row(path).is_some_and(|v| {
        ["messages", "prompt", "completion"]
            .iter()
            .any(|k| v.get(k).is_some())
    })
}

/// Whether the first row of the JSONL file `path` is conversational: `messages`, or a
/// `prompt` given as a list of messages.
fn is_conversational(path: &Path) -> bool {
    first_row(path).is_some_and(|v| {
        v.get("messages").is_some() || v.get("prompt").is_some_and(Value::is_array)
    })
}

impl SftRows {
    /// The SFT file `path` prepared as TRL prepares it (the version of
    /// [`sft::TRL_VERSION`]) with `tokenizer` and its chat template, examples of at most
    /// `row_len` tokens, then packed or padded into rows of `row_len` tokens.
    pub fn open(
        path: &Path,
        tokenizer: &Tokenizer,
        row_len: usize,
        settings: SftSettings,
        vocab: usize,
    ) -> Result<Self, TrainJobError> {
        // Assistant-only loss is TRL's option for conversations (messages, or prompts and
        // completions given as messages); plain prompt–completion text trains on the
        // completions (`completion_only_loss`).
        let options = SftOptions {
            max_length: Some(row_len),
            truncation: settings.truncation,
            assistant_only_loss: settings.assistant_only_loss && is_conversational(path),
            ..SftOptions::default()
        };
        let dataset = sft::read_sft_jsonl(path, tokenizer, &options)?;
        let file = path.display().to_string();
        if dataset.examples.is_empty() {
            return Err(invalid(&file, "holds no SFT example"));
        }
        for line in &dataset.dropped_lines {
            tracing::warn!(
                data = %file,
                line,
                "truncated to --seq-len, the example has no trained token left: dropped (as TRL)"
            );
        }
        if let Some((e, bad)) = dataset.examples.iter().find_map(|e| {
            e.input_ids
                .iter()
                .find(|&&t| t as usize >= vocab)
                .map(|t| (e, *t))
        }) {
            return Err(invalid(
                &file,
                format!(
                    "line {}: token id {bad} is outside the model's vocabulary 0..{vocab} (is \
                     this the model's own tokenizer?)",
                    e.line
                ),
            ));
        }
        let pad = sft::trl_pad_token_id(tokenizer).map_or(0, i64::from);
        let rows: Vec<SftRow> = match settings.packing {
            SftPacking::Packed => dataset
                .pack_bfd(row_len)?
                .into_iter()
                .map(|row| {
                    let cu = row.cu_seqlens();
                    pad_row(
                        row.input_ids.iter().map(|&t| i64::from(t)).collect(),
                        row.labels,
                        Some(cu),
                        row_len,
                        pad,
                    )
                })
                .collect(),
            SftPacking::Padded => dataset
                .examples
                .iter()
                .map(|e| {
                    pad_row(
                        e.input_ids.iter().map(|&t| i64::from(t)).collect(),
                        e.labels(),
                        None,
                        row_len,
                        pad,
                    )
                })
                .collect(),
        };
        tracing::info!(
            data = %file,
            examples = dataset.examples.len(),
            rows = rows.len(),
            row_len,
            packing = ?settings.packing,
            trl = sft::TRL_VERSION,
            "prepared the SFT data"
        );
        Ok(Self {
            rows,
            row_len,
            packing: settings.packing,
        })
    }

    /// Tokens per row.
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Rows (packed: fewer than the examples).
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Rows `first..first + count` of global batch `index` (of `gbs` rows; row `index·gbs + i`
    /// wrapping over the rows) as one micro-batch.
    pub fn batch(
        &self,
        index: usize,
        gbs: usize,
        first: usize,
        count: usize,
    ) -> Result<TrainBatch, TrainJobError> {
        let n = self.rows.len().max(1);
        let picked: Vec<&SftRow> = (first..first + count)
            .filter_map(|i| self.rows.get((index * gbs + i) % n))
            .collect();
        let ids: Vec<i64> = picked.iter().flat_map(|r| r.ids.iter().copied()).collect();
        let labels: Vec<i64> = picked
            .iter()
            .flat_map(|r| r.labels.iter().copied())
            .collect();
        let batch = TrainBatch::new(ids, labels, count)?;
        Ok(match self.packing {
            SftPacking::Packed => batch.with_cu_seqlens(
                picked
                    .iter()
                    .map(|r| {
                        r.cu_seqlens
                            .clone()
                            .unwrap_or_else(|| vec![0, self.row_len])
                    })
                    .collect(),
            )?,
            SftPacking::Padded => batch.with_attention_mask(
                picked
                    .iter()
                    .flat_map(|r| (0..self.row_len).map(move |t| i64::from(t < r.len)))
                    .collect(),
            )?,
        })
    }
}

/// A row padded to `row_len` with `pad` (labels -100).
fn pad_row(
    mut ids: Vec<i64>,
    mut labels: Vec<i64>,
    cu_seqlens: Option<Vec<usize>>,
    row_len: usize,
    pad: i64,
) -> SftRow {
    let len = ids.len();
    ids.resize(row_len, pad);
    labels.resize(row_len, sft::IGNORE_INDEX);
    SftRow {
        ids,
        labels,
        cu_seqlens,
        len,
    }
}
