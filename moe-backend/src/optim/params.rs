//! Parameters as flat per-class buffers: classification (dense / sequence-parallel / TP-sharded
//! / expert), flattening gradients and values in a deterministic order, and writing updated
//! values back into a module.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};

use crate::error::{BackendError, Result};

/// How a parameter is distributed and how its gradient is reduced
/// (docs/parallelism.md §Gradient reduction and scaling).
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
    /// A routed-expert parameter sharded over EP but held whole on every expert-TP rank with
    /// the full gradient on each (the row-parallel `fc2` bias, added after the ETP reduction):
    /// reduced over `expt_dp` like [`ParamClass::Expert`], counted in the global gradient norm
    /// (and written to checkpoints) by expert-TP rank 0 only, as Megatron-Core's
    /// `param_is_not_tensor_parallel_duplicate` counts a row-parallel bias once
    /// (`megatron/core/tensor_parallel/layers.py`).
    ExpertTpReplicated,
}

impl ParamClass {
    /// Whether the parameter belongs to the expert buffer.
    pub fn is_expert(self) -> bool {
        matches!(self, ParamClass::Expert | ParamClass::ExpertTpReplicated)
    }

    /// Whether every expert-TP rank holds an identical copy (so only expert-TP rank 0 counts
    /// it in norms).
    pub fn expt_tp_replicated(self) -> bool {
        self == ParamClass::ExpertTpReplicated
    }

    /// Whether this rank's copy is a duplicate another rank counts: a TP-replicated dense
    /// parameter off TP rank 0, an ETP-replicated expert parameter off expert-TP rank 0.
    pub fn is_duplicate_on(self, tp_rank: usize, expt_tp_rank: usize) -> bool {
        (self.tp_replicated() && tp_rank != 0) || (self.expt_tp_replicated() && expt_tp_rank != 0)
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

    /// Flat `(dense, expert)` buffers of the module's parameter values (f32) on the host
    /// ([`flatten_values_on`](Self::flatten_values_on) read back; checkpoints and checks).
    pub fn flatten_values<M: Module>(&self, module: &M) -> Result<(Vec<f32>, Vec<f32>)> {
        let (dense, expert) = self.flatten_values_on(module, &param_device(module))?;
        Ok((host_vec(dense, "values")?, host_vec(expert, "values")?))
    }

    /// Flat `(dense, expert)` gradient buffers (f32) on the host; parameters without a
    /// gradient count as zeros, so every rank contributes buffers of the same layout
    /// ([`flatten_grads_on`](Self::flatten_grads_on) read back).
    pub fn flatten_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (dense, expert) = self.flatten_grads_on(module, grads, &param_device(module))?;
        Ok((
            host_vec(dense, "gradients")?,
            host_vec(expert, "gradients")?,
        ))
    }

    /// `module` with every float parameter replaced by its slice of the host flat buffers
    /// (cast to the parameter's dtype; ids, autodiff and `require_grad` kept):
    /// [`write_tensors`](Self::write_tensors) of the buffers on the parameters' device.
    pub fn write_values<M: Module>(&self, module: M, dense: &[f32], expert: &[f32]) -> Result<M> {
        let device = param_device(&module);
        let tensor =
            |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device);
        self.write_tensors(module, &tensor(dense), &tensor(expert))
    }
}

/// The device a module's float parameters live on, without autodiff (the first parameter's;
/// the optimizer keeps its state there), or the default device for a module without any.
pub fn param_device<M: Module>(module: &M) -> Device {
    struct Probe(Option<Device>);
    impl ModuleVisitor for Probe {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().device().without_autodiff());
            }
        }
    }
    let mut probe = Probe(None);
    module.visit(&mut probe);
    probe.0.unwrap_or_default()
}

/// `fresh` (new values of parameter tensor `t`, without autodiff) as `t` is: its dtype, on
/// autodiff with `t`'s own gradient-checkpointing strategy when `t` is (a plain `autodiff()`
/// would give the default strategy, and tensors of different strategies cannot meet in one
/// operation), requiring gradients when `t` does.
pub(super) fn like_param<const D: usize>(fresh: Tensor<D>, t: &Tensor<D>) -> Tensor<D> {
    like_param_as(fresh, t, t.dtype())
}

/// [`like_param`] with the values cast to `dtype` instead of `t`'s.
pub(super) fn like_param_as<const D: usize>(
    fresh: Tensor<D>,
    t: &Tensor<D>,
    dtype: DType,
) -> Tensor<D> {
    let fresh = fresh.cast(dtype);
    let fresh = match t.gradient_checkpointing_strategy() {
        Some(strategy) => fresh
            .autodiff()
            .with_gradient_checkpointing_strategy(strategy),
        None => fresh,
    };
    if t.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

/// The concatenation of 1-D f32 `pieces` (zeros of length 0 when there are none).
pub(super) fn cat_flat(pieces: Vec<Tensor<1>>, device: &Device) -> Tensor<1> {
    if pieces.is_empty() {
        Tensor::zeros([0], (device, DType::F32))
    } else if pieces.len() == 1 {
        pieces.into_iter().next().expect("one piece")
    } else {
        Tensor::cat(pieces, 0)
    }
}

impl ParamTable {
    /// The trainable parameters' values (`grads = None`) or gradients, removed from `grads`
    /// (zeros where a parameter has none), as flat f32 tensors on `device` in table order:
    /// `(dense pieces, expert pieces)`. Everything stays on the device (reshape and cast).
    pub(super) fn pieces<M: Module>(
        &self,
        module: &M,
        grads: Option<&mut GradientsParams>,
        device: &Device,
    ) -> Result<(Vec<Tensor<1>>, Vec<Tensor<1>>)> {
        let mut reader = PieceReader {
            cursor: TableCursor::new(self),
            device,
            dense: Vec::new(),
            expert: Vec::new(),
            grads,
            error: None,
        };
        module.visit(&mut reader);
        if let Some(e) = reader.error {
            return Err(e);
        }
        if let Some(missing) = self.params.get(reader.cursor.index) {
            return Err(BackendError::Shape {
                op: "ParamTable",
                detail: format!(
                    "parameter `{}` of the table was not found in the module (different model?)",
                    missing.path
                ),
            });
        }
        Ok((reader.dense, reader.expert))
    }

    /// [`ParamTable::flatten_grads`] on the device: flat `(dense, expert)` f32 gradient
    /// tensors on `device` (`Tensor::cat` of the reshaped gradients; zeros for parameters
    /// without a gradient).
    pub fn flatten_grads_on<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
        device: &Device,
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let (dense, expert) = self.pieces(module, Some(grads), device)?;
        Ok((cat_flat(dense, device), cat_flat(expert, device)))
    }

    /// [`ParamTable::flatten_values`] on the device: flat `(dense, expert)` f32 value tensors
    /// on `device`.
    pub fn flatten_values_on<M: Module>(
        &self,
        module: &M,
        device: &Device,
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let (dense, expert) = self.pieces(module, None, device)?;
        Ok((cat_flat(dense, device), cat_flat(expert, device)))
    }

    /// [`ParamTable::write_values`] from flat device tensors: every parameter becomes its
    /// slice of `dense` / `expert`, reshaped and cast to the parameter's dtype (ids,
    /// autodiff and `require_grad` kept). No host round trip.
    pub fn write_tensors<M: Module>(
        &self,
        module: M,
        dense: &Tensor<1>,
        expert: &Tensor<1>,
    ) -> Result<M> {
        let (d, e) = (dense.dims()[0], expert.dims()[0]);
        if d < self.dense_len || e < self.expert_len {
            return Err(BackendError::Shape {
                op: "ParamTable::write_tensors",
                detail: format!(
                    "buffers of {d} / {e} elements for {} dense / {} expert parameters",
                    self.dense_len, self.expert_len
                ),
            });
        }
        let mut writer = TensorWriter {
            cursor: TableCursor::new(self),
            dense,
            expert,
        };
        Ok(module.map(&mut writer))
    }
}

impl ParamTable {
    /// `module` with every table parameter replaced by a placeholder of its shape (one zero
    /// broadcast, no storage of its own; ids, dtype, autodiff and `require_grad` kept), so
    /// that nothing in it refers to the previous values' storage. For
    /// [`DistributedAdamW::step_in_place`](super::DistributedAdamW::step_in_place), which
    /// writes the new values right after.
    pub(super) fn release<M: Module>(&self, module: M) -> M {
        module.map(&mut Releaser {
            cursor: TableCursor::new(self),
        })
    }
}

/// Walks a table's entries in module order beside a module walk.
struct TableCursor<'a> {
    table: &'a ParamTable,
    /// Entries passed so far (the next one's index).
    index: usize,
}

impl<'a> TableCursor<'a> {
    fn new(table: &'a ParamTable) -> Self {
        Self { table, index: 0 }
    }

    /// The entry of the parameter `id` when it is the table's next one (and steps past it);
    /// `None` for a parameter not in the table (non-trainable).
    fn next(&mut self, id: ParamId) -> Option<&'a ParamInfo> {
        let info = self
            .table
            .params
            .get(self.index)
            .filter(|info| info.id == id)?;
        self.index += 1;
        Some(info)
    }
}

struct Releaser<'a> {
    cursor: TableCursor<'a>,
}

impl ModuleMapper for Releaser<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.cursor.next(param.id).is_none() {
            return param; // non-trainable, not in the table
        }
        param.map(|t| {
            let zero = Tensor::<1>::zeros([1], (&t.device(), DType::F32)).reshape([1; D]);
            like_param(zero.expand(t.shape()), &t)
        })
    }
}

struct PieceReader<'a> {
    cursor: TableCursor<'a>,
    device: &'a Device,
    dense: Vec<Tensor<1>>,
    expert: Vec<Tensor<1>>,
    grads: Option<&'a mut GradientsParams>,
    error: Option<BackendError>,
}

impl ModuleVisitor for PieceReader<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(info) = self.cursor.next(param.id) else {
            return; // not in the table (non-trainable)
        };
        let value = match self.grads.as_deref_mut() {
            Some(grads) => grads.remove::<D>(param.id),
            // A packed FP8 parameter reads as its decoded values.
            None => Some(crate::fp8::dequantize_param(param.val().without_autodiff())),
        };
        let n = info.numel();
        let piece = match value {
            None => Tensor::zeros([n], (self.device, DType::F32)),
            Some(v) if v.shape().num_elements() == n => v.reshape([n]).cast(DType::F32),
            Some(v) => {
                self.error = Some(BackendError::Shape {
                    op: "ParamTable",
                    detail: format!(
                        "`{}` has {} elements, expected {n}",
                        info.path,
                        v.shape().num_elements()
                    ),
                });
                return;
            }
        };
        if info.class.is_expert() {
            self.expert.push(piece);
        } else {
            self.dense.push(piece);
        }
    }
}

struct TensorWriter<'a> {
    cursor: TableCursor<'a>,
    dense: &'a Tensor<1>,
    expert: &'a Tensor<1>,
}

impl ModuleMapper for TensorWriter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(info) = self.cursor.next(param.id) else {
            return param; // non-trainable, not in the table
        };
        if info.numel() == 0 {
            return param;
        }
        let buf = if info.class.is_expert() {
            self.expert
        } else {
            self.dense
        };
        let values = buf.clone().slice(info.offset..info.offset + info.numel());
        let shape = Shape::from(info.shape.clone());
        param.map(move |t| like_param(values.reshape::<D, _>(shape), &t))
    }
}

/// A flat f32 tensor's values on the host.
fn host_vec(t: Tensor<1>, what: &str) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| BackendError::Shape {
            op: "ParamTable",
            detail: format!("cannot read the flat {what} as f32: {e:?}"),
        })
}
