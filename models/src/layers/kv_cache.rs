//! Key/value cache for incremental decoding.
//!
//! One [`LayerCache`] per decoder layer holds two tensors `[B, heads, S, ·]` that grow along
//! the sequence dimension. GQA attention stores post-RoPE keys and values; MLA stores its
//! compressed latents (`kv_c` normed, `k_rot` rotated), as HF 5.23 does. A sliding-window
//! layer keeps only the last `w − 1` positions, all a later query can see (HF 5.23
//! `cache_utils.DynamicSlidingWindowLayer`), and counts the ones it dropped.

use burn::tensor::Tensor;

/// Cached tensors of one attention layer.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    entries: Option<(Tensor<4>, Tensor<4>)>,
    /// Positions seen but no longer held (the oldest ones, dropped by a sliding window).
    dropped: usize,
}

impl LayerCache {
    /// Positions seen so far, held or dropped (0 when empty): the position of the next one.
    pub fn seq_len(&self) -> usize {
        self.dropped + self.held()
    }

    /// Positions held (`seq_len` minus those a sliding window dropped).
    pub fn held(&self) -> usize {
        self.entries.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// [`append`](Self::append) for a layer that needs at most the last `keep` positions
    /// later (`None`: all): returns the position of the first returned key and every held
    /// key/value followed by the new ones, then drops all but the last `keep` positions.
    pub fn append_within(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
        keep: Option<usize>,
    ) -> (usize, Tensor<4>, Tensor<4>) {
        let start = self.dropped;
        let (k, v) = self.append(keys, values);
        if let Some(keep) = keep {
            let held = k.dims()[2];
            if held > keep {
                let drop = held - keep;
                self.entries = Some((
                    k.clone().narrow(2, drop, keep),
                    v.clone().narrow(2, drop, keep),
                ));
                self.dropped += drop;
            }
        }
        (start, k, v)
    }

    /// Appends `keys` and `values` (`[B, heads, S_new, ·]`) and returns everything cached so
    /// far (`[B, heads, S_old + S_new, ·]`).
    pub fn append(&mut self, keys: Tensor<4>, values: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let (k, v) = match self.entries.take() {
            None => (keys, values),
            Some((k, v)) => (
                Tensor::cat(vec![k, keys], 2),
                Tensor::cat(vec![v, values], 2),
            ),
        };
        self.entries = Some((k.clone(), v.clone()));
        (k, v)
    }
}

/// The caches of every layer of a model.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// One cache per decoder layer.
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); num_layers],
        }
    }

    /// Positions already cached (those of the first layer).
    pub fn seq_len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::seq_len)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;

    #[test]
    fn append_grows_along_the_sequence() {
        let device = Device::flex();
        let mut cache = KvCache::new(2);
        assert_eq!(cache.seq_len(), 0);
        let (k, v) = cache.layers[0].append(
            Tensor::zeros([1, 2, 3, 4], &device),
            Tensor::zeros([1, 2, 3, 5], &device),
        );
        assert_eq!((k.dims(), v.dims()), ([1, 2, 3, 4], [1, 2, 3, 5]));
        let (k, _) = cache.layers[0].append(
            Tensor::ones([1, 2, 1, 4], &device),
            Tensor::ones([1, 2, 1, 5], &device),
        );
        assert_eq!(k.dims(), [1, 2, 4, 4]);
        assert_eq!(cache.seq_len(), 4);
        assert_eq!(cache.layers[1].seq_len(), 0);
    }

    #[test]
    fn a_window_keeps_the_last_positions_and_counts_the_rest() {
        let device = Device::flex();
        let mut cache = LayerCache::default();
        let at = |p: usize, n: usize| {
            let v: Vec<f32> = (p..p + n).map(|x| x as f32).collect();
            Tensor::<1>::from_floats(v.as_slice(), &device).reshape([1, 1, n, 1])
        };
        let first = |t: &Tensor<4>| t.clone().narrow(2, 0, 1).into_scalar::<f32>();
        // Keep 2: the first call returns all 4 from position 0 and keeps positions 2, 3.
        let (start, k, _) = cache.append_within(at(0, 4), at(0, 4), Some(2));
        assert_eq!((start, k.dims()[2]), (0, 4));
        assert_eq!((cache.seq_len(), cache.held()), (4, 2));
        let (start, k, v) = cache.append_within(at(4, 1), at(4, 1), Some(2));
        assert_eq!((start, k.dims()[2], first(&k), first(&v)), (2, 3, 2.0, 2.0));
        assert_eq!((cache.seq_len(), cache.held()), (5, 2));
        let (start, k, _) = cache.append_within(at(5, 1), at(5, 1), Some(2));
        assert_eq!((start, first(&k)), (3, 3.0));
        // Without a window nothing is dropped.
        let mut full = LayerCache::default();
        full.append_within(at(0, 4), at(0, 4), None);
        assert_eq!((full.seq_len(), full.held()), (4, 4));
    }
}
