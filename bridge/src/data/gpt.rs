//! Megatron-Core's `GPTDataset` over one indexed dataset: the document index shuffled over
//! epochs, the sample index of `seq_len + 1`-token windows across documents, and the shuffle
//! index, all seeded by `random_seed` through `numpy.random.RandomState`.
//!
//! Follows megatron-core 0.19.2: `megatron/core/datasets/gpt_dataset.py`
//! (`GPTDataset._build_document_sample_shuffle_indices`, `_get_num_tokens_per_epoch`,
//! `_get_num_epochs`, `_build_document_index`, `_build_shuffle_index`,
//! `_query_document_sample_shuffle_indices`) and `megatron/core/datasets/helpers.cpp`
//! (`build_sample_idx`), with `add_extra_token_to_sequence = True` and the train split's
//! `drop_last_partial_sequence = True` (so no sample is ever padded).
//!
//! This is the **train split of the whole file** (`--split 100,0,0`): the dataset's
//! "documents" are, as in Megatron's GPTDataset, all its *sequences* in file order
//! (`numel_low_level_dataset` is the sequence count; with `tools/preprocess_data.py` without
//! `--split-sentences` every document is one sequence). A `--split` into train / valid / test
//! ranges is not supported.
//!
//! The steps, with `D` sequences of `T` tokens in all, `seq_len` and `num_samples` asked for:
//! 1. epochs `E`: the fewest with `E·T ≥ num_samples·seq_len + 1`;
//! 2. `separate_final_epoch` when `E > 1` and the samples drawn from the last epoch,
//!    `num_samples − ⌊((E−1)·T − 1)/seq_len⌋`, are fewer than `int(0.8 · ⌊(T − 1)/seq_len⌋)`;
//! 3. document index: `0..D` repeated `E` times and shuffled once (or the first `E − 1`
//!    epochs shuffled together, then the last epoch shuffled alone, when separate);
//! 4. sample index: `⌊(E·T − 1)/seq_len⌋ + 1` (document-index position, token offset) marks,
//!    each window `seq_len + 1` tokens long and overlapping the next by one token;
//! 5. shuffle index: a shuffled `0..samples` (or `0..k` and `k..samples` shuffled separately
//!    when separate, `k` = the samples before the last epoch).
//!
//! `len()` is Megatron's `len(GPTDataset)`: every sample of the `E` epochs, at least
//! `num_samples`.

use std::sync::Arc;

use super::indexed::IndexedDataset;
use super::numpy_random::RandomState;
use crate::BridgeError;

/// Megatron's threshold below which a final epoch is shuffled separately.
const SEPARATE_FINAL_EPOCH_THRESHOLD: f64 = 0.80;

/// Megatron-Core's `GPTDataset` (train split, the whole file) for one indexed dataset.
#[derive(Debug)]
pub struct GptDataset {
    dataset: Arc<IndexedDataset>,
    seq_len: usize,
    seed: u32,
    num_samples: u64,
    tokens_per_epoch: u64,
    num_epochs: u64,
    separate_final_epoch: bool,
    document_index: Vec<u32>,
    sample_index: Vec<[u32; 2]>,
    shuffle_index: Vec<u32>,
}

impl GptDataset {
    /// Builds the document, sample and shuffle indices for `num_samples` samples of
    /// `seq_len + 1` tokens with `random_seed = seed`.
    ///
    /// Refuses `seq_len < 2` (Megatron's `build_sample_idx` asserts `seq_length > 1`), a dataset
    /// of fewer than 2 tokens, and sizes past Megatron's index types (more than `i32::MAX`
    /// sequences or epochs) or the u32 indices kept here (more than `u32::MAX` document-index
    /// entries or samples).
    pub fn new(
        dataset: Arc<IndexedDataset>,
        seq_len: usize,
        seed: u32,
        num_samples: u64,
    ) -> Result<Self, BridgeError> {
        let fail = |reason: String| BridgeError::DataSampling {
            path: dataset.prefix().to_path_buf(),
            reason,
        };
        if seq_len < 2 || seq_len >= i32::MAX as usize {
            return Err(fail(format!(
                "sequence length {seq_len} outside Megatron's 2..{}",
                i32::MAX
            )));
        }
        let documents = dataset.num_sequences();
        if documents > i32::MAX as usize {
            return Err(fail(format!(
                "{documents} sequences exceed Megatron's int32 document ids"
            )));
        }
        let tokens_per_epoch = dataset.num_tokens();
        if tokens_per_epoch < 2 {
            return Err(fail(format!(
                "{tokens_per_epoch} tokens: a sample needs at least 2 (Megatron asserts \
                 tokens_per_epoch > 1)"
            )));
        }
        let seq = seq_len as u128;
        let tokens = u128::from(tokens_per_epoch);
        // The fewest epochs with E·T ≥ num_samples·seq_len + 1 (`_get_num_epochs`).
        let requested = u128::from(num_samples) * seq + 1;
        let num_epochs = requested.div_ceil(tokens).max(1);
        if num_epochs > i32::MAX as u128 {
            return Err(fail(format!(
                "{num_samples} samples need {num_epochs} epochs, past Megatron's int32 epochs"
            )));
        }
        let index_len = num_epochs * documents as u128;
        let total_samples = (num_epochs * tokens - 1) / seq;
        if index_len > u32::MAX as u128 || total_samples >= u32::MAX as u128 - 1 {
            return Err(fail(format!(
                "{num_epochs} epochs of {documents} sequences ({total_samples} samples) are \
                 too many to index"
            )));
        }
        let (separate_final_epoch, samples_before_final_epoch) = if num_epochs == 1 {
            (false, 0)
        } else {
            let before = ((num_epochs - 1) * tokens - 1) / seq;
            let from_final = i128::from(num_samples) - before as i128;
            let per_epoch = (tokens - 1) / seq;
            if from_final < 0 || from_final > per_epoch as i128 + 1 {
                return Err(fail(format!(
                    "{from_final} samples from the final epoch outside 0..={} (Megatron's \
                     assertion)",
                    per_epoch + 1
                )));
            }
            let threshold = (SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch as f64) as i128;
            (from_final < threshold, before)
        };
        let num_epochs = num_epochs as u64;

        let mut rng = RandomState::new(seed);
        let document_index =
            build_document_index(documents as u32, num_epochs, &mut rng, separate_final_epoch);
        let sample_index =
            build_sample_index(&dataset, &document_index, seq_len, total_samples as u32)
                .map_err(fail)?;
        let total = total_samples as u32;
        let shuffle_index = if separate_final_epoch {
            build_shuffle_index(samples_before_final_epoch as u32, total, &mut rng)
        } else {
            build_shuffle_index(total, total, &mut rng)
        };
        Ok(Self {
            dataset,
            seq_len,
            seed,
            num_samples,
            tokens_per_epoch,
            num_epochs,
            separate_final_epoch,
            document_index,
            sample_index,
            shuffle_index,
        })
    }

    /// The samples built (Megatron's `len(GPTDataset)`, at least the `num_samples` asked for).
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// Whether no sample was built.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// Sample `i`: `seq_len + 1` token ids (inputs are the first `seq_len`, labels the last).
    pub fn sample(&self, i: usize) -> Result<Vec<i64>, BridgeError> {
        let mut out = Vec::with_capacity(self.seq_len + 1);
        self.sample_into(i, &mut out)?;
        Ok(out)
    }

    /// [`sample`](Self::sample), appending to `out`.
    pub fn sample_into(&self, i: usize, out: &mut Vec<i64>) -> Result<(), BridgeError> {
        let start_len = out.len();
        let Some(&shuffled) = self.shuffle_index.get(i) else {
            return Err(BridgeError::DataIndexOutOfRange {
                path: self.dataset.prefix().to_path_buf(),
                reason: format!("sample {i} asked for, the GPT dataset has {}", self.len()),
            });
        };
        let fail = |reason: String| BridgeError::DataSampling {
            path: self.dataset.prefix().to_path_buf(),
            reason,
        };
        let (Some(&[begin, begin_offset]), Some(&[end, end_offset])) = (
            self.sample_index.get(shuffled as usize),
            self.sample_index.get(shuffled as usize + 1),
        ) else {
            return Err(fail(format!("sample index has no entry {shuffled}")));
        };
        let document = |position: u32| {
            self.document_index
                .get(position as usize)
                .map(|&d| d as usize)
                .ok_or_else(|| fail(format!("document index has no position {position}")))
        };
        if begin == end {
            let Some(span) = end_offset.checked_sub(begin_offset) else {
                return Err(fail(format!(
                    "sample window {shuffled} ends before it begins"
                )));
            };
            let length = span as usize + 1;
            self.dataset
                .extend_from(document(begin)?, begin_offset as usize, Some(length), out)?;
        } else {
            for position in begin..=end {
                let offset = if position == begin { begin_offset } else { 0 };
                let length = (position == end).then_some(end_offset as usize + 1);
                self.dataset
                    .extend_from(document(position)?, offset as usize, length, out)?;
            }
        }
        let got = out.len() - start_len;
        if got != self.seq_len + 1 {
            return Err(fail(format!(
                "sample {i} holds {got} tokens instead of {}",
                self.seq_len + 1
            )));
        }
        Ok(())
    }

    /// The indexed dataset sampled.
    pub fn dataset(&self) -> &Arc<IndexedDataset> {
        &self.dataset
    }

    /// Tokens per sample minus one (Megatron's `sequence_length`).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The `random_seed` of the shuffles.
    pub fn seed(&self) -> u32 {
        self.seed
    }

    /// The samples asked for (Megatron's `num_samples`).
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Tokens in one epoch (all sequences).
    pub fn tokens_per_epoch(&self) -> u64 {
        self.tokens_per_epoch
    }

    /// Epochs of the document index.
    pub fn num_epochs(&self) -> u64 {
        self.num_epochs
    }

    /// Whether the last epoch was shuffled apart from the others.
    pub fn separate_final_epoch(&self) -> bool {
        self.separate_final_epoch
    }

    /// The document index: sequence ids, `num_epochs` times shuffled.
    pub fn document_index(&self) -> &[u32] {
        &self.document_index
    }

    /// The sample index: `len() + 1` (document-index position, token offset) pairs.
    pub fn sample_index(&self) -> &[[u32; 2]] {
        &self.sample_index
    }

    /// The shuffle index: sample `i` is window `shuffle_index()[i]`.
    pub fn shuffle_index(&self) -> &[u32] {
        &self.shuffle_index
    }
}

/// `_build_document_index`: `0..documents` tiled `epochs` times and shuffled, or the first
/// `epochs − 1` tiles shuffled and the last tile shuffled after them when `separate`.
fn build_document_index(
    documents: u32,
    epochs: u64,
    rng: &mut RandomState,
    separate: bool,
) -> Vec<u32> {
    let tile = |epochs: u64, rng: &mut RandomState| {
        let mut index: Vec<u32> = (0..epochs).flat_map(|_| 0..documents).collect();
        rng.shuffle(&mut index);
        index
    };
    if !separate || epochs == 1 {
        return tile(epochs, rng);
    }
    let mut index = tile(epochs - 1, rng);
    index.extend(tile(1, rng));
    index
}

/// `build_sample_idx` (helpers.cpp) with `add_extra_token_to_sequence = 1` and
/// `drop_last_partial_sequence = true`: `samples + 1` marks (document-index position, offset).
fn build_sample_index(
    dataset: &IndexedDataset,
    document_index: &[u32],
    seq_len: usize,
    samples: u32,
) -> Result<Vec<[u32; 2]>, String> {
    let length_at = |position: usize| -> Result<i64, String> {
        let document = document_index
            .get(position)
            .ok_or_else(|| format!("ran past the document index at position {position}"))?;
        Ok(dataset.length_unchecked(*document as usize) as i64)
    };
    let mut index = Vec::with_capacity(samples as usize + 1);
    let mut position = 0usize;
    let mut offset = 0i64;
    index.push([0, 0]);
    for _ in 0..samples {
        let mut remaining = seq_len as i64 + 1;
        while remaining != 0 {
            let document_length = length_at(position)? - offset;
            remaining -= document_length;
            if remaining <= 0 {
                offset += remaining + document_length - 1;
                remaining = 0;
            } else {
                if position + 1 == document_index.len() {
                    // Only a partial last sample reaches this (never with drop_last).
                    return Err(format!(
                        "the documents ran out {remaining} tokens short of a full sample"
                    ));
                }
                position += 1;
                offset = 0;
            }
        }
        // position < document_index.len() ≤ u32::MAX and 0 ≤ offset < a sequence length.
        index.push([position as u32, offset as u32]);
    }
    Ok(index)
}

/// `_build_shuffle_index`: `0..first` shuffled, then `first..total` shuffled after it.
fn build_shuffle_index(first: u32, total: u32, rng: &mut RandomState) -> Vec<u32> {
    let mut index: Vec<u32> = (0..first).collect();
    rng.shuffle(&mut index);
    if first == total {
        return index;
    }
    let mut last: Vec<u32> = (first..total).collect();
    rng.shuffle(&mut last);
    index.extend(last);
    index
}
