//! [`LayerStack`]: a model's decoder layers, or the layers one pipeline rank holds, named by
//! their global index.
//!
//! Under pipeline parallelism a rank holds only some decoder layers (its virtual stages'), but
//! every path-based reader (the parallel plan, loading by HF name, checkpoint placement,
//! gathering and export) must see each layer under its place in the whole model:
//! `model.layers.5.self_attn…` is layer 5 wherever it lives. A `LayerStack` is a `Vec` of
//! layers that Burn visits with their global indices as path segments; indexing, iteration and
//! `len` are local (the rank's layers in model order).

use std::ops::{Deref, DerefMut};

use burn::module::{
    Content, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::Device;

use crate::ModelError;

/// Decoder layers with their global indices (see the module docs).
#[derive(Debug, Clone)]
pub struct LayerStack<L> {
    layers: Vec<L>,
    /// Global index of each layer, strictly increasing.
    ids: Vec<usize>,
}

impl<L> LayerStack<L> {
    /// The whole model's layers: layer `i` is global layer `i`.
    pub fn new(layers: Vec<L>) -> Self {
        let ids = (0..layers.len()).collect();
        Self { layers, ids }
    }

    /// Global index of each held layer, in order.
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    /// Whether the stack holds every layer of a model of `total` layers.
    pub fn is_whole(&self, total: usize) -> bool {
        self.ids.len() == total && self.ids.iter().enumerate().all(|(i, &id)| i == id)
    }

    /// Local index of global layer `id`, if held.
    pub fn local(&self, id: usize) -> Option<usize> {
        self.ids.binary_search(&id).ok()
    }

    /// Keeps only the global layers `keep` (strictly increasing, all held): a pipeline rank's
    /// layers out of the whole model's (lazy) template. Errors name the missing layer.
    pub fn select(self, keep: &[usize]) -> Result<Self, ModelError> {
        if keep.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::layout(
                "pipeline_layout",
                format!("layers {keep:?} are not in increasing order"),
            ));
        }
        let mut slots: Vec<Option<L>> = self.layers.into_iter().map(Some).collect();
        let mut layers = Vec::with_capacity(keep.len());
        for &id in keep {
            let at = self.ids.binary_search(&id).ok();
            let layer = at.and_then(|i| slots[i].take()).ok_or_else(|| {
                ModelError::layout(
                    "pipeline_layout",
                    format!(
                        "layer {id} is not among the model's {} layers",
                        self.ids.len()
                    ),
                )
            })?;
            layers.push(layer);
        }
        Ok(Self {
            layers,
            ids: keep.to_vec(),
        })
    }

    /// Applies the fallible `f` to every layer, keeping the global indices.
    pub fn try_map<E>(self, f: impl FnMut(L) -> Result<L, E>) -> Result<Self, E> {
        Ok(Self {
            layers: self.layers.into_iter().map(f).collect::<Result<_, E>>()?,
            ids: self.ids,
        })
    }

    /// This stack's layers, each with the layer of the same global index in `whole` (a stack
    /// of every layer of the model).
    pub fn select_from_mut<'a, 'b>(
        &'a mut self,
        whole: &'b LayerStack<L>,
    ) -> impl Iterator<Item = (&'a mut L, &'b L)> {
        (self.layers.iter_mut().zip(&self.ids))
            .filter_map(move |(layer, &id)| whole.local(id).map(|i| (layer, &whole.layers[i])))
    }

    /// The layers and their global indices.
    pub fn into_parts(self) -> (Vec<L>, Vec<usize>) {
        (self.layers, self.ids)
    }
}

impl<L> FromIterator<L> for LayerStack<L> {
    fn from_iter<I: IntoIterator<Item = L>>(iter: I) -> Self {
        Self::new(iter.into_iter().collect())
    }
}

impl<L> Deref for LayerStack<L> {
    type Target = [L];

    fn deref(&self) -> &[L] {
        &self.layers
    }
}

impl<L> DerefMut for LayerStack<L> {
    fn deref_mut(&mut self) -> &mut [L] {
        &mut self.layers
    }
}

impl<'a, L> IntoIterator for &'a LayerStack<L> {
    type Item = &'a L;
    type IntoIter = std::slice::Iter<'a, L>;

    fn into_iter(self) -> Self::IntoIter {
        self.layers.iter()
    }
}

impl<'a, L> IntoIterator for &'a mut LayerStack<L> {
    type Item = &'a mut L;
    type IntoIter = std::slice::IterMut<'a, L>;

    fn into_iter(self) -> Self::IntoIter {
        self.layers.iter_mut()
    }
}

impl<L> LayerStack<L> {
    /// Applies `f` to every layer, keeping the global indices.
    fn map_layers(self, f: impl FnMut(L) -> L) -> Self {
        Self {
            layers: self.layers.into_iter().map(f).collect(),
            ids: self.ids,
        }
    }
}

impl<L: Module> Module for LayerStack<L> {
    fn collect_devices(&self, mut devices: Vec<Device>) -> Vec<Device> {
        for layer in &self.layers {
            devices = layer.collect_devices(devices);
        }
        devices
    }

    fn fork(self, device: &Device) -> Self {
        self.map_layers(|l| l.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.map_layers(|l| l.to_device(device))
    }

    fn train(self) -> Self {
        self.map_layers(Module::train)
    }

    fn valid(&self) -> Self {
        Self {
            layers: self.layers.iter().map(Module::valid).collect(),
            ids: self.ids.clone(),
        }
    }

    fn materialize(self) -> Self {
        self.map_layers(Module::materialize)
    }

    fn num_params(&self) -> usize {
        self.layers.iter().map(Module::num_params).sum()
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        for (layer, id) in self.layers.iter().zip(&self.ids) {
            let name = id.to_string();
            visitor.enter_module(&name, "Vec");
            layer.visit(visitor);
            visitor.exit_module(&name, "Vec");
        }
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        let layers = (self.layers.into_iter().zip(&self.ids))
            .map(|(layer, id)| {
                let name = id.to_string();
                mapper.enter_module(&name, "Vec");
                let mapped = layer.map(mapper);
                mapper.exit_module(&name, "Vec");
                mapped
            })
            .collect();
        Self {
            layers,
            ids: self.ids,
        }
    }
}

impl<L: ModuleDisplay> ModuleDisplayDefault for LayerStack<L> {
    fn content(&self, content: Content) -> Option<Content> {
        (self.layers.iter().zip(&self.ids))
            .fold(content, |acc, (layer, id)| acc.add(&id.to_string(), layer))
            .set_top_level_type(&format!("LayerStack<{:?}>", self.ids))
            .optional()
    }
}

impl<L: ModuleDisplay> ModuleDisplay for LayerStack<L> {}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    struct Paths(Vec<String>, Vec<String>);

    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.1.push(name.to_owned());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &burn::module::Param<burn::Tensor<D>>) {
            self.0.push(self.1.join("."));
        }
    }

    #[test]
    fn a_selected_stack_is_visited_under_global_indices() {
        let device = Device::flex();
        let stack: LayerStack<Linear> = (0..4)
            .map(|_| LinearConfig::new(2, 3).init(&device))
            .collect();
        assert!(stack.is_whole(4));
        let held = stack.select(&[1, 3]).unwrap();
        assert_eq!(held.len(), 2);
        assert_eq!(held.ids(), &[1, 3]);
        assert_eq!(held.local(3), Some(1));
        assert_eq!(held.local(2), None);
        assert!(!held.is_whole(4));
        let mut paths = Paths(Vec::new(), Vec::new());
        held.visit(&mut paths);
        assert_eq!(paths.0, ["1.weight", "1.bias", "3.weight", "3.bias"]);
        let e = held.clone().select(&[2]).unwrap_err().to_string();
        assert!(
            e.contains("pipeline_layout") && e.contains("layer 2"),
            "{e}"
        );
        assert!(held.select(&[3, 1]).is_err());
    }
}
