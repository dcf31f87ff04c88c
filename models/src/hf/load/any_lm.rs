//! [`AnyCausalLm`]: any family's model behind one type, for tools (the `moe` CLI) that pick the
//! model from `config.json` at run time.

use std::any::Any;

use burn::tensor::{Device, Int, Tensor};

#[cfg(test)]
use super::ConfigVisitor;
use super::ModelConfig;
use crate::causal_lm::LmLosses;
use crate::distributed::ShardModel;
use crate::family::{Family, FamilyVisitor, local_logits, visit_family};
use crate::layers::KvCache;
use crate::{CausalLm, GenerationConfig, ModelError, ParamCount, generate};

/// A loaded causal LM of any family in the list ([`crate::family`]); get the typed model back
/// with [`get`](Self::get) or run code generic over the family with [`visit`](Self::visit).
#[derive(Debug)]
pub struct AnyCausalLm {
    inner: Box<dyn DynModel>,
}

/// What [`AnyCausalLm`] asks of a family's model, object-safe.
trait DynModel: std::fmt::Debug + Send + Sync {
    fn config(&self) -> ModelConfig;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    fn losses(
        &self,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError>;
    fn logits(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError>;
    fn causal_lm(&self) -> &dyn CausalLm;
}

/// A model of family `F`.
struct Typed<F: Family>(F::Model);

impl<F: Family> std::fmt::Debug for Typed<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<F: Family> DynModel for Typed<F> {
    fn config(&self) -> ModelConfig {
        ModelConfig::new::<F>(self.0.model_config().clone())
    }

    fn as_any(&self) -> &dyn Any {
        &self.0
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        &mut self.0
    }

    fn losses(
        &self,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError> {
        F::hf_losses(&self.0, input_ids, labels)
    }

    fn logits(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        local_logits(&self.0, input_ids)
    }

    fn causal_lm(&self) -> &dyn CausalLm {
        &self.0
    }
}

/// Code generic over a family given its model ([`AnyCausalLm::visit`]).
pub trait ModelVisitor {
    /// What the visit returns.
    type Output;
    /// Runs for family `F` and its model.
    fn visit<F: Family>(self, model: &F::Model) -> Self::Output;
}

/// Code generic over a family given its model, mutably ([`AnyCausalLm::visit_mut`]).
pub trait ModelVisitorMut {
    /// What the visit returns.
    type Output;
    /// Runs for family `F` and its model.
    fn visit<F: Family>(self, model: &mut F::Model) -> Self::Output;
}

impl AnyCausalLm {
    /// A model of family `F`.
    pub fn new<F: Family>(model: F::Model) -> Self {
        Self {
            inner: Box::new(Typed::<F>(model)),
        }
    }

    /// The typed model when it is family `F`'s.
    pub fn get<F: Family>(&self) -> Option<&F::Model> {
        self.inner.as_any().downcast_ref::<F::Model>()
    }

    /// Runs `visitor` for this model's family (an error for a family not in the list).
    pub fn visit<V: ModelVisitor>(&self, visitor: V) -> Result<V::Output, ModelError> {
        struct With<'a, V>(&'a AnyCausalLm, V);
        impl<V: ModelVisitor> FamilyVisitor for With<'_, V> {
            type Output = Option<V::Output>;
            fn visit<F: Family>(self) -> Option<V::Output> {
                let model = self.0.get::<F>()?;
                Some(self.1.visit::<F>(model))
            }
        }
        let model_type = self.model_type();
        visit_family(model_type, With(self, visitor))
            .flatten()
            .ok_or_else(|| {
                ModelError::unsupported(
                    "model_type",
                    format!("family `{model_type}` is not in the family list"),
                )
            })
    }

    /// The typed model, mutably, when it is family `F`'s.
    pub fn get_mut<F: Family>(&mut self) -> Option<&mut F::Model> {
        self.inner.as_any_mut().downcast_mut::<F::Model>()
    }

    /// [`visit`](Self::visit) with the model mutable (e.g. to update its weights).
    pub fn visit_mut<V: ModelVisitorMut>(&mut self, visitor: V) -> Result<V::Output, ModelError> {
        struct With<'a, V>(&'a mut AnyCausalLm, V);
        impl<V: ModelVisitorMut> FamilyVisitor for With<'_, V> {
            type Output = Option<V::Output>;
            fn visit<F: Family>(self) -> Option<V::Output> {
                let model = self.0.get_mut::<F>()?;
                Some(self.1.visit::<F>(model))
            }
        }
        let model_type = self.model_type();
        visit_family(model_type, With(self, visitor))
            .flatten()
            .ok_or_else(|| {
                ModelError::unsupported(
                    "model_type",
                    format!("family `{model_type}` is not in the family list"),
                )
            })
    }

    /// HF `model_type`.
    pub fn model_type(&self) -> &'static str {
        self.config().model_type()
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> ModelConfig {
        self.inner.config()
    }

    /// Shape-only parameter counts of the model's configuration.
    pub fn param_count(&self) -> Result<ParamCount, ModelError> {
        self.config().param_count()
    }

    /// Logits `[B, S, V]` of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn logits(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        self.inner.logits(input_ids)
    }

    /// Logits of `input_ids [B, S]` and the losses HF reports for `labels` (`[B, S]` host
    /// values, −100 ignored; HF shifts them internally, so `labels = input_ids` is the usual
    /// choice): cross-entropy, plus the load-balancing term of families whose HF loss has one
    /// ([`Family::hf_losses`]).
    pub fn losses(
        &self,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError> {
        self.inner.losses(input_ids, labels)
    }

    /// Continues `prompt` (one sequence) with up to `config.max_new_tokens` tokens using a KV
    /// cache; returns the new tokens only.
    pub fn generate(
        &self,
        prompt: &[usize],
        config: &GenerationConfig,
        device: &Device,
    ) -> Result<Vec<usize>, ModelError> {
        generate(self, prompt, config, device)
    }
}

impl CausalLm for AnyCausalLm {
    fn vocab_size(&self) -> usize {
        self.inner.causal_lm().vocab_size()
    }

    fn new_cache(&self) -> KvCache {
        self.inner.causal_lm().new_cache()
    }

    fn forward_cached(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, ModelError> {
        self.inner.causal_lm().forward_cached(input_ids, cache)
    }
}

/// [`ModelConfig::visit`] building nothing: kept private to the module's tests.
#[cfg(test)]
struct ModelType;

#[cfg(test)]
impl ConfigVisitor for ModelType {
    type Output = &'static str;
    fn visit<F: Family>(self, _config: &F::Config) -> &'static str {
        F::MODEL_TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_visits_its_own_family() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        for name in ["qwen3", "qwen3_moe", "deepseek_v3"] {
            let config = ModelConfig::from_dir(dir.join(name)).expect("config");
            assert_eq!(config.visit(ModelType).expect("visit"), name);
        }
    }
}
