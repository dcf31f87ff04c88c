//! Key/value cache for incremental decoding.
//!
//! One [`LayerCache`] per decoder layer holds two tensors `[B, heads, S, ·]` that grow along
//! the sequence dimension. GQA attention stores post-RoPE keys and values; MLA stores its
//! compressed latents (`kv_c` normed, `k_rot` rotated), as HF 5.23 does.

use burn::tensor::Tensor;

/// Cached tensors of one attention layer.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    entries: Option<(Tensor<4>, Tensor<4>)>,
}

impl LayerCache {
    /// Cached positions (0 when empty).
    pub fn seq_len(&self) -> usize {
        self.entries.as_ref().map_or(0, |(k, _)| k.dims()[2])
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
}
