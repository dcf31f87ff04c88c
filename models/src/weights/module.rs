//! A live model as a [`WeightSource`]: its tensors under their HF names (the export's view,
//! [`crate::export`], with routed experts stacked), read box by box on the device so that only
//! the requested box is copied to the host.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use super::{WeightSource, check_box};
use crate::ModelError;
use crate::export::{ExpertNames, ExportHf, LazyTensor, export_hf_tensors_as};

/// The tensors of a model held on this process, addressed by HF name (see the module docs).
///
/// Sharding a full model ([`crate::distributed::Sharded::<Qwen3MoeForCausalLM>::shard`] and its siblings)
/// loads the rank's shard from this source with the same code that loads it from a checkpoint.
pub struct ModuleWeights {
    tensors: HashMap<String, (Vec<usize>, Box<dyn LazyTensor>)>,
}

impl std::fmt::Debug for ModuleWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleWeights")
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl ModuleWeights {
    /// The tensors of `model` (cheap handles: nothing is copied until a box is read); an
    /// error names a parameter the model's plan does not place.
    pub fn new<M: ExportHf + ?Sized>(model: &M) -> Result<Self, ModelError> {
        let tensors = export_hf_tensors_as(model, ExpertNames::Fused)?
            .into_lazy()
            .into_iter()
            .map(|(spec, lazy)| (spec.name, (spec.shape, lazy)))
            .collect();
        Ok(Self { tensors })
    }

    fn values(name: &str, data: TensorData) -> Result<Vec<f32>, ModelError> {
        data.convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| ModelError::TensorRead {
                name: name.to_owned(),
                reason: format!("{e:?}"),
            })
    }

    fn entry(&self, name: &str) -> Result<&(Vec<usize>, Box<dyn LazyTensor>), ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })
    }
}

impl WeightSource for ModuleWeights {
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let (shape, lazy) = self.entry(hf_name)?;
        Ok((shape.clone(), Self::values(hf_name, lazy.fetch())?))
    }

    fn contains(&self, hf_name: &str) -> bool {
        self.tensors.contains_key(hf_name)
    }

    /// Narrows the tensor on its device to the box and copies only the box to the host.
    fn tensor_box_f32(
        &self,
        hf_name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        check_box(hf_name, global, offsets, shape)?;
        let (found, lazy) = self.entry(hf_name)?;
        if found.as_slice() != global {
            return Err(ModelError::TensorShape {
                name: hf_name.to_owned(),
                expected: global.to_vec(),
                found: found.clone(),
            });
        }
        let mut part: Option<Box<dyn LazyTensor>> = None;
        for (d, (&at, &len)) in offsets.iter().zip(shape).enumerate() {
            if at == 0 && len == global[d] {
                continue;
            }
            part = Some(match &part {
                Some(p) => p.narrow(d, at, len),
                None => lazy.narrow(d, at, len),
            });
        }
        let data = match &part {
            Some(p) => p.fetch(),
            None => lazy.fetch(),
        };
        Self::values(hf_name, data)
    }
}

/// Float parameters of a module in visiting order: module path and id.
struct Ids {
    path: Vec<String>,
    ids: Vec<(String, ParamId)>,
}

impl ModuleVisitor for Ids {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.ids.push((self.path.join("."), param.id));
    }
}

/// Gives every float parameter the id of the parameter at the same module path in the
/// source (which may hold more: a pipeline stage holds some of the model's layers).
struct Adopt {
    path: Vec<String>,
    ids: std::collections::HashMap<String, ParamId>,
    error: Option<String>,
}

impl ModuleMapper for Adopt {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, mut param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        match self.ids.get(&path) {
            Some(&id) => param.id = id,
            None => {
                self.error
                    .get_or_insert_with(|| format!("parameter `{path}` has no counterpart"));
            }
        }
        param
    }
}

/// `shard` with the parameter ids of `full` (a model of the same type whose parameters sit at
/// the same module paths, e.g. the model it was sharded from): the ids identify a parameter
/// across the full model and its shards (optimizer tables, checkpoint placement).
pub(crate) fn adopt_param_ids<M: Module>(shard: M, full: &M) -> Result<M, ModelError> {
    let mut ids = Ids {
        path: Vec::new(),
        ids: Vec::new(),
    };
    full.visit(&mut ids);
    let mut adopt = Adopt {
        path: Vec::new(),
        ids: ids.ids.into_iter().collect(),
        error: None,
    };
    let shard = shard.map(&mut adopt);
    match adopt.error {
        Some(reason) => Err(ModelError::invalid("model", reason)),
        None => Ok(shard),
    }
}
