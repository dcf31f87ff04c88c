//! Megatron pretraining data: indexed datasets (`<prefix>.bin` + `<prefix>.idx`, made by
//! Megatron's `tools/preprocess_data.py`), the samples Megatron-Core's `GPTDataset` draws from
//! one, and the blend of several that `--data-path 0.3 a 0.7 b` asks for — each sample equal,
//! token for token and index for index, to Megatron's.
//!
//! Follows megatron-core 0.19.2 (`megatron/core/datasets/`) and numpy 2.x's legacy
//! `RandomState`:
//! - [`indexed`]: `indexed_dataset.py` — [`IndexedDataset`], memory-mapped, every dtype code,
//!   validated when opened;
//! - [`gpt`]: `gpt_dataset.py` and `helpers.cpp` `build_sample_idx` — [`GptDataset`], the
//!   train split of the whole file;
//! - [`blend`]: `blended_dataset.py`, `blended_megatron_dataset_builder.py`, `utils.py`
//!   `normalize` and `helpers.cpp` `build_blending_indices` — [`BlendedDataset`];
//! - [`data_path`]: `utils.py` `get_blend_from_list` — [`parse_data_path`];
//! - [`numpy_random`]: numpy's MT19937 and legacy `shuffle` — [`RandomState`].
//!
//! [`TrainDataset::build`] is what `BlendedMegatronDatasetBuilder` builds for the train split
//! (`--split 100,0,0`): a lone prefix gives a [`GptDataset`] of exactly the samples asked for;
//! a weighted list gives a [`BlendedDataset`] whose components carry Megatron's surplus.
//! Every type here is `Send + Sync` and every accessor takes `&self`: sample `i` is the same on
//! every call and every thread, so a run resumed under another layout sees the samples of the
//! uninterrupted run (the sample of step `s`, row `r` is sample `s·global_batch + r`).

pub mod blend;
pub mod data_path;
pub mod gpt;
pub mod indexed;
pub mod numpy_random;
#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use blend::BlendedDataset;
pub use data_path::{DataBlend, parse_data_path};
pub use gpt::GptDataset;
pub use indexed::{IndexedDataset, TokenDtype, bin_path, idx_path};
pub use numpy_random::RandomState;

use crate::BridgeError;

/// The train split Megatron builds for a `--data-path`: one GPT dataset, or a blend.
#[derive(Debug)]
pub enum TrainDataset {
    /// A lone prefix: `GPTDataset` with `num_samples` = the samples asked for.
    Gpt(GptDataset),
    /// A weighted list: `BlendedDataset` of `GPTDataset`s.
    Blended(BlendedDataset),
}

impl TrainDataset {
    /// Opens the datasets of `blend` (each distinct prefix once; all are validated before any
    /// sample is built) and builds Megatron's train split of `num_samples` samples of
    /// `seq_len + 1` tokens with `random_seed = seed`.
    pub fn build(
        blend: &DataBlend,
        seq_len: usize,
        seed: u32,
        num_samples: u64,
    ) -> Result<Self, BridgeError> {
        let datasets = blend::open_shared(&blend.prefixes)?;
        match (&blend.weights, datasets.as_slice()) {
            (None, [dataset]) => Ok(Self::Gpt(GptDataset::new(
                Arc::clone(dataset),
                seq_len,
                seed,
                num_samples,
            )?)),
            (Some(weights), _) => {
                let components: Vec<(f64, Arc<IndexedDataset>)> =
                    weights.iter().copied().zip(datasets).collect();
                Ok(Self::Blended(BlendedDataset::build(
                    &components,
                    seq_len,
                    seed,
                    num_samples,
                )?))
            }
            (None, _) => Err(BridgeError::InvalidDataPath {
                position: 1,
                item: blend
                    .prefixes
                    .first()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                reason: format!(
                    "{} prefixes without weights (give `weight prefix` pairs)",
                    blend.prefixes.len()
                ),
            }),
        }
    }

    /// Samples available (at least the `num_samples` asked for).
    pub fn len(&self) -> usize {
        match self {
            Self::Gpt(d) => d.len(),
            Self::Blended(d) => d.len(),
        }
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i`: `seq_len + 1` token ids.
    pub fn sample(&self, i: usize) -> Result<Vec<i64>, BridgeError> {
        match self {
            Self::Gpt(d) => d.sample(i),
            Self::Blended(d) => d.sample(i),
        }
    }

    /// [`sample`](Self::sample), appending to `out`.
    pub fn sample_into(&self, i: usize, out: &mut Vec<i64>) -> Result<(), BridgeError> {
        match self {
            Self::Gpt(d) => d.sample_into(i, out),
            Self::Blended(d) => d.sample_into(i, out),
        }
    }

    /// Which dataset (position in `--data-path`) and which of its samples sample `i` is.
    pub fn source(&self, i: usize) -> Result<(usize, usize), BridgeError> {
        match self {
            Self::Gpt(d) if i < d.len() => Ok((0, i)),
            Self::Gpt(d) => Err(BridgeError::DataIndexOutOfRange {
                path: d.dataset().prefix().to_path_buf(),
                reason: format!("sample {i} asked for, the GPT dataset has {}", d.len()),
            }),
            Self::Blended(d) => d.source(i),
        }
    }

    /// The GPT datasets, in `--data-path` order.
    pub fn datasets(&self) -> &[GptDataset] {
        match self {
            Self::Gpt(d) => std::slice::from_ref(d),
            Self::Blended(d) => d.datasets(),
        }
    }

    /// Refuses a token id outside `0..vocab` in any dataset (see
    /// [`IndexedDataset::check_vocab`]); each distinct file is scanned once.
    pub fn check_vocab(&self, vocab: u64) -> Result<(), BridgeError> {
        let mut seen: Vec<&Arc<IndexedDataset>> = Vec::new();
        for dataset in self.datasets() {
            let file = dataset.dataset();
            if seen.iter().any(|s| Arc::ptr_eq(s, file)) {
                continue;
            }
            file.check_vocab(vocab)?;
            seen.push(file);
        }
        Ok(())
    }
}
