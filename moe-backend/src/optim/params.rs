//! Parameters as flat per-class buffers: classification (dense / sequence-parallel / TP-sharded
//! / expert), flattening gradients and values in a deterministic order, and writing updated
//! values back into a module.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};

use crate::error::{BackendError, Result};

/// How a parameter is distributed and how its gradient is reduced (parallelism.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamClass {
    /// Replicated on every TP rank with identical gradients; reduced over `dp_cp`.
    Dense,
    /// Replicated on every TP rank but fed by sequence-parallel activations (norms, router,
    /// QK-norm): gradients are summed over `tp`, then reduced over `dp_cp`.
    DenseSequenceParallel,
    /// Sharded over TP (column/row-parallel weights); reduced over `dp_cp`.
    DenseTpSharded,
    /// Routed-expert weights (sharded over EP/ETP); reduced over `expt_dp`.
    Expert,
}

impl ParamClass {
    /// Whether the parameter belongs to the expert buffer.
    pub fn is_expert(self) -> bool {
        self == ParamClass::Expert
    }

    /// Whether every TP rank holds an identical copy (so only TP rank 0 counts it in norms).
    pub fn tp_replicated(self) -> bool {
        matches!(self, ParamClass::Dense | ParamClass::DenseSequenceParallel)
    }
}

/// The default classification: parameters inside a `GroupedExperts` module are experts, those
/// whose path ends in a router weight or norm are sequence-parallel replicated, everything else
/// is dense.
pub fn default_classify(path: &str, in_experts: bool) -> ParamClass {
    if in_experts {
        ParamClass::Expert
    } else if path.contains("norm") || path.starts_with("router.") || path.contains(".router.") {
        ParamClass::DenseSequenceParallel
    } else {
        ParamClass::Dense
    }
}

/// One float parameter of a module.
#[derive(Debug, Clone)]
pub struct ParamInfo {
    /// Burn parameter id.
    pub id: ParamId,
    /// Dotted path of the parameter in the module (`experts.fc1`).
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Class.
    pub class: ParamClass,
    /// Offset of its first element in the class's flat buffer.
    pub offset: usize,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every trainable float parameter of a module (tensors that require grad) in visiting order,
/// with per-class flat offsets.
#[derive(Debug, Clone, Default)]
pub struct ParamTable {
    /// Parameters in visiting order.
    pub params: Vec<ParamInfo>,
    /// Total elements of the dense buffer (all non-expert classes).
    pub dense_len: usize,
    /// Total elements of the expert buffer.
    pub expert_len: usize,
}

struct TableBuilder<'a, F: Fn(&str, bool) -> ParamClass> {
    path: Vec<String>,
    expert_depth: usize,
    classify: &'a F,
    table: ParamTable,
}

impl<F: Fn(&str, bool) -> ParamClass> ModuleVisitor for TableBuilder<'_, F> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        if container_type == "Struct:GroupedExperts" || self.expert_depth > 0 {
            self.expert_depth += 1;
        }
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
        self.expert_depth = self.expert_depth.saturating_sub(1);
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.val().is_require_grad() {
            return; // buffers such as the expert bias are not optimised
        }
        let path = self.path.join(".");
        let class = (self.classify)(&path, self.expert_depth > 0);
        let shape = param.shape().to_vec();
        let numel: usize = shape.iter().product();
        let offset = if class.is_expert() {
            self.table.expert_len += numel;
            self.table.expert_len - numel
        } else {
            self.table.dense_len += numel;
            self.table.dense_len - numel
        };
        self.table.params.push(ParamInfo {
            id: param.id,
            path,
            shape,
            class,
            offset,
        });
    }
}

impl ParamTable {
    /// Builds the table of `module`, classifying each parameter with `classify(path,
    /// inside_grouped_experts)`.
    pub fn new<M: Module, F: Fn(&str, bool) -> ParamClass>(module: &M, classify: &F) -> Self {
        let mut builder = TableBuilder {
            path: Vec::new(),
            expert_depth: 0,
            classify,
            table: ParamTable::default(),
        };
        module.visit(&mut builder);
        builder.table
    }

    /// Flat `(dense, expert)` buffers of the module's parameter values (f32).
    pub fn flatten_values<M: Module>(&self, module: &M) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut reader = Flattener {
            table: self,
            index: 0,
            dense: vec![0.0; self.dense_len],
            expert: vec![0.0; self.expert_len],
            grads: None,
            error: None,
        };
        module.visit(&mut reader);
        reader.finish()
    }

    /// Flat `(dense, expert)` gradient buffers (f32); parameters without a gradient count as
    /// zeros, so every rank contributes buffers of the same layout.
    pub fn flatten_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut reader = Flattener {
            table: self,
            index: 0,
            dense: vec![0.0; self.dense_len],
            expert: vec![0.0; self.expert_len],
            grads: Some(grads),
            error: None,
        };
        module.visit(&mut reader);
        reader.finish()
    }

    /// `module` with every float parameter replaced by its slice of the flat buffers (cast to
    /// the parameter's dtype; ids and `require_grad` kept).
    pub fn write_values<M: Module>(&self, module: M, dense: &[f32], expert: &[f32]) -> Result<M> {
        if dense.len() < self.dense_len || expert.len() < self.expert_len {
            return Err(BackendError::Shape {
                op: "ParamTable::write_values",
                detail: format!(
                    "buffers of {} / {} elements for {} dense / {} expert parameters",
                    dense.len(),
                    expert.len(),
                    self.dense_len,
                    self.expert_len
                ),
            });
        }
        let mut writer = Writer {
            table: self,
            index: 0,
            dense,
            expert,
        };
        Ok(module.map(&mut writer))
    }
}

struct Flattener<'a> {
    table: &'a ParamTable,
    index: usize,
    dense: Vec<f32>,
    expert: Vec<f32>,
    grads: Option<&'a mut GradientsParams>,
    error: Option<BackendError>,
}

impl Flattener<'_> {
    fn finish(self) -> Result<(Vec<f32>, Vec<f32>)> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if let Some(missing) = self.table.params.get(self.index) {
            return Err(BackendError::Shape {
                op: "ParamTable",
                detail: format!(
                    "parameter `{}` of the table was not found in the module (different model?)",
                    missing.path
                ),
            });
        }
        Ok((self.dense, self.expert))
    }
}

fn to_f32(data: TensorData, path: &str) -> Result<Vec<f32>> {
    data.convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| BackendError::Shape {
            op: "ParamTable",
            detail: format!("cannot read parameter `{path}` as f32: {e:?}"),
        })
}

impl ModuleVisitor for Flattener<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(info) = self.table.params.get(self.index) else {
            return; // a trailing non-trainable parameter
        };
        if info.id != param.id {
            return; // not in the table (non-trainable)
        }
        self.index += 1;
        let value = match self.grads.as_deref_mut() {
            Some(grads) => grads.remove::<D>(param.id),
            None => Some(param.val()),
        };
        let Some(value) = value else {
            return; // no gradient: zeros
        };
        let data = value.into_data();
        let buf = if info.class.is_expert() {
            &mut self.expert
        } else {
            &mut self.dense
        };
        // f32 gradients are copied straight from the tensor's bytes (no intermediate Vec).
        if let Ok(v) = data.as_slice::<f32>()
            && v.len() == info.numel()
        {
            buf[info.offset..info.offset + v.len()].copy_from_slice(v);
            return;
        }
        match to_f32(data, &info.path) {
            Ok(v) if v.len() == info.numel() => {
                buf[info.offset..info.offset + v.len()].copy_from_slice(&v);
            }
            Ok(v) => {
                self.error = Some(BackendError::Shape {
                    op: "ParamTable",
                    detail: format!(
                        "`{}` has {} elements, expected {}",
                        info.path,
                        v.len(),
                        info.numel()
                    ),
                });
            }
            Err(e) => self.error = Some(e),
        }
    }
}

struct Writer<'a> {
    table: &'a ParamTable,
    index: usize,
    dense: &'a [f32],
    expert: &'a [f32],
}

impl ModuleMapper for Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(info) = self.table.params.get(self.index) else {
            return param;
        };
        if info.id != param.id {
            return param; // non-trainable, not in the table
        }
        self.index += 1;
        let buf = if info.class.is_expert() {
            self.expert
        } else {
            self.dense
        };
        let values = buf[info.offset..info.offset + info.numel()].to_vec();
        let shape = info.shape.clone();
        param.map(move |t| {
            let grad = t.is_require_grad();
            let dtype: DType = t.dtype();
            let device = t.device();
            let fresh = Tensor::from_data(TensorData::new(values, shape), (&device, dtype));
            if grad { fresh.require_grad() } else { fresh }
        })
    }
}
