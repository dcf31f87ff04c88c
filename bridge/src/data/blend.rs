//! Megatron-Core's `BlendedDataset` and the per-dataset sample counts its builder asks of each
//! component.
//!
//! Follows megatron-core 0.19.2:
//! - `megatron/core/datasets/utils.py` `normalize`: `w / numpy.sum(w)` in float64 (numpy's
//!   pairwise summation, reproduced by [`normalize`]);
//! - `megatron/core/datasets/blended_megatron_dataset_builder.py`
//!   (`BlendedMegatronDatasetBuilder._build_blended_dataset_splits` for a weighted blend, and
//!   `_get_size_per_split_per_dataset`): the weights are normalised, component `i` is asked for
//!   `⌈⌈size·wᵢ⌉·(1 + surplus)⌉` samples with `mid_level_dataset_surplus = 0.005`, and the blend
//!   is built with `Σᵢ ⌈size·wᵢ⌉` samples (marginally more than `size`);
//! - `megatron/core/datasets/blended_dataset.py` (`BlendedDataset.__init__`, `_build_indices`):
//!   the weights are normalised again, the indices built, and a component drawn more often than
//!   it has samples is refused;
//! - `megatron/core/datasets/helpers.cpp` `build_blending_indices`: for each blended sample `n`,
//!   the component with the largest `wᵢ·max(n, 1) − drawnᵢ` (the first on ties) supplies its next
//!   sample.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::gpt::GptDataset;
use super::indexed::IndexedDataset;
use crate::BridgeError;

/// Megatron's default `mid_level_dataset_surplus`: the fraction of extra samples each component
/// of a weighted blend builds.
pub const MID_LEVEL_DATASET_SURPLUS: f64 = 0.005;

/// The most components a blend may have (Megatron's int16 dataset index, `< 32767`).
pub const MAX_BLEND_COMPONENTS: usize = 32766;

/// numpy's `add.reduce` of a contiguous float64 array: pairwise summation (8 accumulators in
/// blocks of up to 128, halves split at multiples of 8 above that).
fn numpy_sum(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 8 {
        return values.iter().fold(0.0, |sum, v| sum + v);
    }
    if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&values[..8]);
        let blocks = n - n % 8;
        for block in values[8..blocks].chunks_exact(8) {
            for (acc, v) in r.iter_mut().zip(block) {
                *acc += v;
            }
        }
        let mut sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for v in &values[blocks..] {
            sum += v;
        }
        return sum;
    }
    let half = n / 2;
    let half = half - half % 8;
    numpy_sum(&values[..half]) + numpy_sum(&values[half..])
}

/// Megatron's `normalize`: each weight divided by their float64 sum as numpy computes it.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let sum = numpy_sum(weights);
    weights.iter().map(|w| w / sum).collect()
}

/// `_get_size_per_split_per_dataset` for one split: `⌈⌈size·wᵢ⌉·(1 + surplus)⌉` per
/// component, from normalised weights.
pub fn size_per_dataset(normalized_weights: &[f64], size: u64, surplus: f64) -> Vec<u64> {
    normalized_weights
        .iter()
        .map(|w| {
            let target = (size as f64 * w).ceil();
            (target * (1.0 + surplus)).ceil() as u64
        })
        .collect()
}

/// `build_blending_indices` (helpers.cpp): for each of `size` blended samples, the component
/// (index into `weights`) and that component's sample drawn. Meant for at most
/// [`MAX_BLEND_COMPONENTS`] weights (Megatron's int16 dataset index), as [`BlendedDataset`]
/// checks.
pub fn build_blending_indices(weights: &[f64], size: usize) -> (Vec<u16>, Vec<u64>) {
    let mut drawn = vec![0u64; weights.len()];
    let mut dataset_index = Vec::with_capacity(size);
    let mut dataset_sample_index = Vec::with_capacity(size);
    for n in 0..size {
        let at = (n as f64).max(1.0);
        let mut best = 0usize;
        let mut best_error = f64::NEG_INFINITY;
        for (i, (w, d)) in weights.iter().zip(&drawn).enumerate() {
            let error = w * at - *d as f64;
            if i == 0 || error > best_error {
                best = i;
                best_error = error;
            }
        }
        dataset_index.push(best as u16);
        if let Some(d) = drawn.get_mut(best) {
            dataset_sample_index.push(*d);
            *d += 1;
        }
    }
    (dataset_index, dataset_sample_index)
}

/// Megatron-Core's `BlendedDataset` of GPT datasets: blended sample `i` is sample
/// `dataset_sample_index()[i]` of component `dataset_index()[i]`.
#[derive(Debug)]
pub struct BlendedDataset {
    datasets: Vec<GptDataset>,
    weights: Vec<f64>,
    dataset_index: Vec<u16>,
    dataset_sample_index: Vec<u64>,
}

impl BlendedDataset {
    /// `BlendedDataset(datasets, weights, size)`: normalises `weights`, builds the blending
    /// indices for `size` samples and refuses a component drawn more often than it has samples.
    pub fn new(
        datasets: Vec<GptDataset>,
        weights: &[f64],
        size: usize,
    ) -> Result<Self, BridgeError> {
        let path = datasets
            .first()
            .map(|d| d.dataset().prefix().to_path_buf())
            .unwrap_or_default();
        check_weights(&path, datasets.len(), weights)?;
        let weights = normalize(weights);
        let (dataset_index, dataset_sample_index) = build_blending_indices(&weights, size);
        let mut counts = vec![0usize; datasets.len()];
        for &d in &dataset_index {
            if let Some(count) = counts.get_mut(usize::from(d)) {
                *count += 1;
            }
        }
        for (dataset, count) in datasets.iter().zip(counts) {
            if count > dataset.len() {
                return Err(BridgeError::DataSampling {
                    path: dataset.dataset().prefix().to_path_buf(),
                    reason: format!(
                        "the blend draws {count} samples from it, more than the {} built \
                         (Megatron's oversampling error; mid_level_dataset_surplus is too small)",
                        dataset.len()
                    ),
                });
            }
        }
        Ok(Self {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
        })
    }

    /// What `BlendedMegatronDatasetBuilder` builds for a weighted `--data-path` and a train
    /// split of `size` samples: each component a [`GptDataset`] of its share plus Megatron's
    /// surplus ([`MID_LEVEL_DATASET_SURPLUS`]), the blend `Σ ⌈size·wᵢ⌉` samples long.
    /// `weights` need not sum to 1 but must be positive and finite.
    pub fn build(
        components: &[(f64, Arc<IndexedDataset>)],
        seq_len: usize,
        seed: u32,
        size: u64,
    ) -> Result<Self, BridgeError> {
        let path = components
            .first()
            .map(|(_, d)| d.prefix().to_path_buf())
            .unwrap_or_default();
        let weights: Vec<f64> = components.iter().map(|(w, _)| *w).collect();
        check_weights(&path, components.len(), &weights)?;
        let weights = normalize(&weights);
        let targets = size_per_dataset(&weights, size, 0.0);
        let buffers = size_per_dataset(&weights, size, MID_LEVEL_DATASET_SURPLUS);
        let datasets = components
            .iter()
            .zip(&buffers)
            .map(|((_, dataset), &samples)| {
                GptDataset::new(Arc::clone(dataset), seq_len, seed, samples)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let blend_size = targets
            .iter()
            .try_fold(0usize, |sum, &t| sum.checked_add(usize::try_from(t).ok()?))
            .ok_or_else(|| BridgeError::DataSampling {
                path: path.clone(),
                reason: format!("a blend of {size} samples overflows"),
            })?;
        Self::new(datasets, &weights, blend_size)
    }

    /// Blended samples (Megatron's `len(BlendedDataset)`).
    pub fn len(&self) -> usize {
        self.dataset_index.len()
    }

    /// Whether the blend has no sample.
    pub fn is_empty(&self) -> bool {
        self.dataset_index.is_empty()
    }

    /// Which component supplies blended sample `i`, and which of its samples.
    pub fn source(&self, i: usize) -> Result<(usize, usize), BridgeError> {
        match (self.dataset_index.get(i), self.dataset_sample_index.get(i)) {
            (Some(&d), Some(&s)) => Ok((usize::from(d), s as usize)),
            _ => Err(BridgeError::DataIndexOutOfRange {
                path: self.first_prefix(),
                reason: format!("sample {i} asked for, the blend has {}", self.len()),
            }),
        }
    }

    /// Blended sample `i`: `seq_len + 1` token ids.
    pub fn sample(&self, i: usize) -> Result<Vec<i64>, BridgeError> {
        let mut out = Vec::new();
        self.sample_into(i, &mut out)?;
        Ok(out)
    }

    /// [`sample`](Self::sample), appending to `out`.
    pub fn sample_into(&self, i: usize, out: &mut Vec<i64>) -> Result<(), BridgeError> {
        let (d, s) = self.source(i)?;
        match self.datasets.get(d) {
            Some(dataset) => dataset.sample_into(s, out),
            None => Err(BridgeError::DataIndexOutOfRange {
                path: self.first_prefix(),
                reason: format!(
                    "component {d} asked for, the blend has {}",
                    self.datasets.len()
                ),
            }),
        }
    }

    /// The components, in `--data-path` order.
    pub fn datasets(&self) -> &[GptDataset] {
        &self.datasets
    }

    /// The normalised weights the blending indices were built with.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The component of each blended sample.
    pub fn dataset_index(&self) -> &[u16] {
        &self.dataset_index
    }

    /// The component's sample of each blended sample.
    pub fn dataset_sample_index(&self) -> &[u64] {
        &self.dataset_sample_index
    }

    fn first_prefix(&self) -> PathBuf {
        self.datasets
            .first()
            .map(|d| d.dataset().prefix().to_path_buf())
            .unwrap_or_default()
    }
}

/// One weight per component, 1 to [`MAX_BLEND_COMPONENTS`] components, each positive and
/// finite with a finite sum (Megatron's `BlendedDataset` asserts every weight is positive).
fn check_weights(
    path: &std::path::Path,
    components: usize,
    weights: &[f64],
) -> Result<(), BridgeError> {
    let fail = |reason: String| BridgeError::DataSampling {
        path: path.to_path_buf(),
        reason,
    };
    if components == 0 || components > MAX_BLEND_COMPONENTS {
        return Err(fail(format!(
            "a blend needs 1 to {MAX_BLEND_COMPONENTS} components, got {components}"
        )));
    }
    if weights.len() != components {
        return Err(fail(format!(
            "{} weights for {components} datasets",
            weights.len()
        )));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w > 0.0))
    {
        return Err(fail(format!(
            "weight {i} is {w}, not a positive finite number"
        )));
    }
    let sum = numpy_sum(weights);
    if !sum.is_finite() {
        return Err(fail(format!("the weights sum to {sum}")));
    }
    Ok(())
}

/// Opens each distinct prefix once (a prefix listed twice is one shared mapping).
pub(crate) fn open_shared(prefixes: &[PathBuf]) -> Result<Vec<Arc<IndexedDataset>>, BridgeError> {
    let mut opened: HashMap<&PathBuf, Arc<IndexedDataset>> = HashMap::new();
    prefixes
        .iter()
        .map(|prefix| {
            if let Some(dataset) = opened.get(prefix) {
                return Ok(Arc::clone(dataset));
            }
            let dataset = Arc::new(IndexedDataset::open(prefix)?);
            opened.insert(prefix, Arc::clone(&dataset));
            Ok(dataset)
        })
        .collect()
}
