//! Muon (MomentUm Orthogonalized by Newton–Schulz) as a second optimizer beside AdamW,
//! distributed the way Megatron-Core does it.
//!
//! # Update rule
//!
//! For every weight matrix `W` (a 2-D parameter, or each `[m, n]` matrix of a stacked `[L, m, n]`
//! expert weight) with reduced gradient `G`, Muon keeps one momentum buffer `B` (f32) and does
//!
//! ```text
//! B ← β·B + (1−β)·G                          (EMA momentum, β = `momentum`)
//! U ← (1−β)·G + β·B   (Nesterov)   or   U ← B
//! O ← NewtonSchulz₅(U)                       (≈ the orthogonal polar factor of U)
//! W ← W·(1 − lr·wd) − lr·s(m, n)·O           (decoupled weight decay, shape scale s)
//! ```
//!
//! This is Keller Jordan's and Megatron/Emerging-Optimizers' EMA form; Moonshot ("Muon is
//! Scalable", arXiv:2502.16982) writes `B ← β·B + G`, `U ← G + β·B`, which is the same `U` up to
//! the factor `1−β` and therefore the same `O` (Newton–Schulz normalises its input first). The
//! scale `s` is selectable ([`MuonScale`]): Moonshot's `0.2·√max(m, n)`, which gives updates of
//! the RMS of AdamW's (≈0.2) so AdamW's learning rate and weight decay carry over, or Keller's
//! `√max(1, fan_out/fan_in)`.
//!
//! [`newton_schulz`] runs the quintic iteration `X ← a·X + (b·A + c·A²)·X`, `A = X·Xᵀ`,
//! `(a, b, c) = (3.4445, −4.7750, 2.0315)`, on `X = U/(‖U‖_F + 1e-7)`, transposed so that `A` is
//! the Gram matrix of the shorter side. Megatron (Emerging-Optimizers, `fp32_matmul_prec =
//! "medium"`) and Keller run it in bf16 on tensor cores; here it runs in **f32** on the
//! parameters' device (Burn matmuls; state, reductions and updates stay there too): the CPU has
//! no bf16 speed advantage, and f32 keeps the result reproducible against an f64 reference (within 1e-6 absolute in the tests). The
//! quintic deliberately over-shoots: the singular values of the result are not 1 but spread
//! over roughly `[0.7, 1.2]`, which Keller found not to hurt.
//!
//! # Which parameters
//!
//! [`default_muon_select`] follows Megatron (`get_megatron_muon_optimizer`) and Keller: every
//! 2-D weight and every stacked 3-D expert weight (one matrix per expert), except the embedding
//! and the LM head (`embed`, `lm_head`, `output_layer` in the path) and biases; all 1-D
//! parameters, biases, the embedding and the LM head stay with AdamW. [`MuonAdamW`] pairs a
//! [`DistributedMuon`] with the crate's ZeRO-1 [`DistributedAdamW`], built unchanged on a *view*
//! of the module in which the Muon parameters do not require grad, so its flat buffers hold the
//! AdamW parameters only; its `step` skips parameters outside its table, so it updates the full
//! module in place of the AdamW parameters only.
//!
//! # Distribution
//!
//! Per parameter class (as [`DistributedAdamW`],
//! docs/parallelism.md §Gradient reduction and scaling):
//!
//! 1. `DenseSequenceParallel` gradients are summed over `tp` first.
//! 2. Gradients are reduced over the data-parallel group of the class, `dp_cp` for dense and
//!    `expt_dp` for expert parameters, summed with the pre-factor `1/|dp_cp|` for both classes
//!    (the AdamW convention): an all-reduce under [`MuonSharding::Replicated`], a
//!    reduce-scatter to the owner under [`MuonSharding::LayerWise`].
//! 3. The clipping norm counts every unique element once (TP-replicated parameters on TP rank
//!    0, DP replicas on DP rank 0 / the owner) and is all-reduced over the world.
//! 4. Momentum (f32) and the f32 master copy of the parameter live with the local shard: the
//!    same `[m, n/tp]` block as the parameter. Newton–Schulz needs the whole matrix: the
//!    Nesterov directions of TP-sharded matrices ([`MuonMatrix::split`]) are all-gathered over
//!    `tp` (ETP-sharded expert matrices over `expt_tp`) in one packed collective per group,
//!    every member orthogonalises the identical full matrix (deterministic: same input, same
//!    kernels), scales it by the *full* shape and keeps its own block. Gathering in shard order
//!    is exact even where the shard order is not the logical row order (a gated `fc1` sharded
//!    as `[gate_r; up_r]`): Newton–Schulz commutes with row and column permutations,
//!    `NS(P·X·Q) = P·NS(X)·Q`.
//! 5. Under `Replicated` every DP member holds the full local shard state and updates it;
//!    under `LayerWise` each parameter is owned by one DP member (greedy largest-first
//!    balancing), only the owner (and its TP peers, which share its DP index) keeps the
//!    momentum and master, computes the update and the new values are all-gathered over the DP
//!    group.
//!
//! Compared with Megatron: `Replicated` is `TensorParallelMuon` in its default `duplicated`
//! mode under plain DDP (Megatron rejects Muon with the ZeRO distributed optimizer): every rank
//! of a TP group all-gathers the matrix and runs the same Newton–Schulz, every DP replica
//! repeats it. `LayerWise` is `LayerWiseDistributedOptimizer`: whole parameters are assigned to
//! DP ranks, each DP rank runs Newton–Schulz only for the parameters it owns (still duplicated
//! over its TP group), then the parameters are all-gathered. Megatron's `distributed` TP mode
//! (each TP rank multiplies its shard, the Gram matrices all-reduced) and `blockwise` mode
//! (each shard orthogonalised alone, which changes the update) are not implemented, nor is
//! splitting fused QKV weights into separate matrices or MuonClip.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};

use super::distributed_adam::{has_f64, host_f32, scale_f64, sum_of_squares};
use super::params::{cat_flat, param_device};
use super::{
    DistributedAdamW, DistributedAdamWConfig, ParamClass, ParamInfo, ParamTable, StepReport,
};
use crate::comm::{Comm, GroupComms, ReduceOp};
use crate::error::{BackendError, Result};
use crate::parallel::GroupFamily;

/// Coefficients `(a, b, c)` of the quintic Newton–Schulz step `X ← a·X + (b·A + c·A²)·X`,
/// `A = X·Xᵀ` (Keller Jordan's, used by Moonshot and Megatron's `simple` set).
pub const NS_COEFFICIENTS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

/// ε added to the Frobenius norm before the iteration.
pub const NS_EPSILON: f32 = 1e-7;

/// Newton–Schulz orthogonalisation of one matrix, in f32: `g` is normalised by its Frobenius
/// norm (+[`NS_EPSILON`]), transposed when it has more rows than columns, iterated `steps` times
/// with [`NS_COEFFICIENTS`] and transposed back. The result has the shape of `g` and singular
/// values near 1 (roughly `[0.7, 1.2]` after 5 steps for full-rank inputs). Runs on `g`'s
/// device, detached.
pub fn newton_schulz(g: Tensor<2>, steps: usize) -> Tensor<2> {
    newton_schulz_batched(g.unsqueeze::<3>(), steps).squeeze_dim::<2>(0)
}

/// [`newton_schulz`] of every matrix of a `[L, m, n]` stack (each normalised by its own norm).
pub fn newton_schulz_batched(g: Tensor<3>, steps: usize) -> Tensor<3> {
    let [_, m, n] = g.dims();
    let x = g.detach().cast(DType::F32);
    let transpose = m > n;
    let x = if transpose { x.swap_dims(1, 2) } else { x };
    let norm = x
        .clone()
        .powi_scalar(2)
        .sum_dim(2)
        .sum_dim(1)
        .sqrt()
        .add_scalar(NS_EPSILON);
    let mut x = x / norm;
    let (a, b, c) = NS_COEFFICIENTS;
    for _ in 0..steps {
        let gram = x.clone().matmul(x.clone().swap_dims(1, 2));
        let poly = gram.clone().mul_scalar(b) + gram.clone().matmul(gram).mul_scalar(c);
        x = x.clone().mul_scalar(a) + poly.matmul(x);
    }
    if transpose { x.swap_dims(1, 2) } else { x }
}

/// How the orthogonalised update is scaled (the learning rate is applied on top).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MuonScale {
    /// Moonshot's `0.2·√max(m, n)` (Megatron `scale_mode = "spectral"` with
    /// `extra_scale_factor = 0.2`): the update RMS matches AdamW's typical 0.2, so AdamW's
    /// learning rate and weight decay can be used unchanged.
    #[default]
    MatchAdamW,
    /// Keller Jordan's `√max(1, fan_out/fan_in)` (Megatron `"shape_scaling"`); needs a
    /// Muon-sized learning rate (≈0.02).
    Keller,
}

impl MuonScale {
    /// The factor for a full (unsharded) matrix with `fan_out` outputs and `fan_in` inputs.
    pub fn factor(self, fan_out: usize, fan_in: usize) -> f32 {
        match self {
            MuonScale::MatchAdamW => 0.2 * (fan_out.max(fan_in) as f32).sqrt(),
            MuonScale::Keller => (fan_out as f32 / fan_in.max(1) as f32).max(1.0).sqrt(),
        }
    }
}

/// Where the Muon state lives across the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MuonSharding {
    /// Every DP member reduces (all-reduce), orthogonalises and updates every Muon parameter of
    /// its shard (Megatron's `TensorParallelMuon` under DDP).
    #[default]
    Replicated,
    /// Each parameter is owned by one DP member (greedy, largest first): gradients are
    /// reduce-scattered to the owner, which alone keeps its momentum and master copy and runs
    /// Newton–Schulz; the new values are all-gathered (Megatron's
    /// `LayerWiseDistributedOptimizer`).
    LayerWise,
}

/// Hyper-parameters of [`DistributedMuon`] (the learning rate is given per step).
#[derive(Debug, Clone, PartialEq)]
pub struct MuonConfig {
    /// Momentum β.
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Newton–Schulz steps.
    pub ns_steps: usize,
    /// Decoupled weight decay (`W ← W·(1 − lr·wd)`).
    pub weight_decay: f32,
    /// Update scale.
    pub scale: MuonScale,
    /// Where the state lives across the DP group.
    pub sharding: MuonSharding,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            weight_decay: 0.0,
            scale: MuonScale::MatchAdamW,
            sharding: MuonSharding::Replicated,
        }
    }
}

/// An axis of one matrix (the last two dimensions of a parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixAxis {
    /// The first matrix dimension (dim 0 of a 2-D, dim 1 of a stacked 3-D parameter).
    Rows,
    /// The second matrix dimension (the last dimension).
    Cols,
}

/// How a parameter is seen by Muon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MuonMatrix {
    /// Rows are output features (`[out, in]`: PyTorch, the router, stacked experts) rather
    /// than input features (`[in, out]`: Burn `Linear`). Only [`MuonScale::Keller`] uses it.
    pub rows_are_outputs: bool,
    /// The axis along which the tensor-parallel group (`tp` for dense, `expt_tp` for expert
    /// parameters) splits every matrix of this parameter into equal contiguous blocks in member
    /// order, or `None` when every member holds whole matrices.
    pub split: Option<MatrixAxis>,
}

/// Whether `path` names an embedding or an output (LM head) parameter.
fn is_embedding_or_output(path: &str) -> bool {
    path.contains("embed") || path.contains("lm_head") || path.contains("output_layer")
}

/// Whether a TP-sharded Burn `Linear` (`[in, out]`) at `path` is row-parallel (input rows
/// split) by the Megatron / Hugging Face naming; otherwise it is column-parallel.
fn is_row_parallel(path: &str) -> bool {
    [
        "o_proj",
        "down_proj",
        "out_proj",
        "linear_proj",
        "linear_fc2",
    ]
    .iter()
    .any(|n| path.contains(n))
}

/// The default Muon selection (Megatron / Keller convention): 2-D weights and stacked 3-D
/// weights (one `[out, in]` matrix per slice), except biases, 2-D expert parameters (stacked
/// biases), the embedding and the LM head. Burn 2-D weights are `[in, out]` (the router's is
/// `[E, H]`); `DenseTpSharded` 2-D weights are column-parallel (columns split) unless named like
/// a row-parallel projection (`o_proj`, `down_proj`, `out_proj`, `linear_proj`, `linear_fc2`:
/// rows split); expert `fc1` `[L, 2F/etp, H]` is split along rows, `fc2` `[L, H, F/etp]` along
/// columns over `expt_tp`.
pub fn default_muon_select(info: &ParamInfo) -> Option<MuonMatrix> {
    let last = info.path.rsplit('.').next().unwrap_or("");
    if !(2..=3).contains(&info.shape.len())
        || last.contains("bias")
        || is_embedding_or_output(&info.path)
    {
        return None;
    }
    if info.shape.len() == 3 {
        let split = if !info.class.is_expert() {
            None
        } else if last == "fc1" {
            Some(MatrixAxis::Rows)
        } else if last == "fc2" {
            Some(MatrixAxis::Cols)
        } else {
            None
        };
        return Some(MuonMatrix {
            rows_are_outputs: true,
            split,
        });
    }
    if info.class.is_expert() {
        return None;
    }
    let split = (info.class == ParamClass::DenseTpSharded).then(|| {
        if is_row_parallel(&info.path) {
            MatrixAxis::Rows
        } else {
            MatrixAxis::Cols
        }
    });
    Some(MuonMatrix {
        rows_are_outputs: info.path.contains("router"),
        split,
    })
}

/// One Muon parameter and its state on this rank.
#[derive(Debug, Clone)]
struct Slot {
    info: ParamInfo,
    matrix: MuonMatrix,
    /// Local `[L, m, n]` (`L = 1` for a 2-D parameter).
    dims: [usize; 3],
    /// Member of the class's DP group that updates it (`LayerWise`; 0 otherwise).
    owner: usize,
    /// f32 master values of the local shard, flat on the parameters' device (`None` when
    /// another DP member owns it).
    master: Option<Tensor<1>>,
    /// f32 momentum of the local shard, flat on the device (`None` when not owned).
    momentum: Option<Tensor<1>>,
}

/// The per-parameter f32 state a checkpoint restores.
#[derive(Clone, Copy)]
enum SlotState {
    Master,
    Momentum,
}

impl SlotState {
    /// Whether this rank keeps this state of `slot`.
    fn held(self, slot: &Slot) -> bool {
        match self {
            SlotState::Master => slot.master.is_some(),
            SlotState::Momentum => slot.momentum.is_some(),
        }
    }

    /// This state of `slot`.
    fn of(self, slot: &mut Slot) -> &mut Option<Tensor<1>> {
        match self {
            SlotState::Master => &mut slot.master,
            SlotState::Momentum => &mut slot.momentum,
        }
    }
}

impl Slot {
    fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    fn expert(&self) -> bool {
        self.info.class.is_expert()
    }
}

fn read_f32(data: TensorData, what: &str) -> Result<Vec<f32>> {
    data.convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| BackendError::Shape {
            op: "DistributedMuon",
            detail: format!("cannot read {what} as f32: {e:?}"),
        })
}

/// Reads the values (or removes the gradients) of the selected parameters as flat f32
/// tensors on the device.
struct Reader<'a> {
    ids: &'a HashMap<ParamId, usize>,
    out: Vec<Option<Tensor<1>>>,
    grads: Option<&'a mut GradientsParams>,
}

impl ModuleVisitor for Reader<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(&i) = self.ids.get(&param.id) else {
            return;
        };
        let value = match self.grads.as_deref_mut() {
            Some(grads) => grads.remove::<D>(param.id),
            None => Some(param.val().without_autodiff()),
        };
        if let Some(v) = value {
            let n = v.shape().num_elements();
            self.out[i] = Some(v.reshape([n]).cast(DType::F32));
        }
    }
}

/// Replaces the selected parameters with new values from flat device tensors (dtype, ids,
/// autodiff and `require_grad` kept).
struct Writer<'a> {
    ids: &'a HashMap<ParamId, usize>,
    values: Vec<Option<Tensor<1>>>,
    shapes: Vec<Vec<usize>>,
}

impl ModuleMapper for Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(&i) = self.ids.get(&param.id) else {
            return param;
        };
        let Some(values) = self.values[i].take() else {
            return param;
        };
        let shape = Shape::from(self.shapes[i].clone());
        param.map(move |t| super::params::like_param(values.reshape::<D, _>(shape), &t))
    }
}

/// Turns off `require_grad` of the selected parameters (the AdamW view).
struct Freezer<'a> {
    ids: &'a HashMap<ParamId, usize>,
}

impl ModuleMapper for Freezer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.ids.contains_key(&param.id) {
            param.map(|t| t.set_require_grad(false))
        } else {
            param
        }
    }
}

/// Copies (`factor = None`) or scales in place (`Some(c)`) every gradient of a module.
struct GradWalker<'a> {
    grads: &'a mut GradientsParams,
    copy: Option<GradientsParams>,
    factor: Option<f64>,
}

impl ModuleVisitor for GradWalker<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        match (self.factor, self.copy.as_mut()) {
            (Some(c), _) => {
                if let Some(g) = self.grads.remove::<D>(param.id) {
                    self.grads.register(param.id, g.mul_scalar(c));
                }
            }
            (None, Some(copy)) => {
                if let Some(g) = self.grads.get::<D>(param.id) {
                    copy.register(param.id, g);
                }
            }
            (None, None) => {}
        }
    }
}

/// Muon over the selected weight matrices of a module, distributed over the dense (`dp_cp`,
/// `tp`) and expert (`expt_dp`, `expt_tp`) groups (see the [module docs](self)). The other
/// parameters are left alone: pair it with a [`DistributedAdamW`] built on
/// [`DistributedMuon::adamw_view`], or use [`MuonAdamW`].
#[derive(Debug, Clone)]
pub struct DistributedMuon {
    config: MuonConfig,
    slots: Vec<Slot>,
    ids: HashMap<ParamId, usize>,
    tp: Comm,
    expt_tp: Comm,
    dp_cp: Comm,
    expt_dp: Comm,
    world: Comm,
    step: u64,
    /// The parameters' device (without autodiff), where the state lives.
    device: Device,
}

impl DistributedMuon {
    /// Builds Muon for the parameters of `module` that `select` picks (see
    /// [`default_muon_select`]), classified by `classify(path, inside_grouped_experts)` as for
    /// [`DistributedAdamW::with_classes`]. A collective under [`MuonSharding::LayerWise`] with
    /// TP (checks that TP peers share their DP index); every rank of the world calls it.
    pub fn new<M: Module, F: Fn(&str, bool) -> ParamClass>(
        module: &M,
        groups: &GroupComms,
        world: Comm,
        config: MuonConfig,
        classify: &F,
        select: &dyn Fn(&ParamInfo) -> Option<MuonMatrix>,
    ) -> Result<Self> {
        if !(0.0..1.0).contains(&config.momentum) {
            return Err(BackendError::Config {
                field: "momentum",
                detail: format!("Muon momentum {} is outside [0, 1)", config.momentum),
            });
        }
        if config.ns_steps == 0 {
            return Err(BackendError::Config {
                field: "ns_steps",
                detail: "Newton–Schulz needs at least one step".into(),
            });
        }
        let table = ParamTable::new(module, classify);
        let mut slots = Vec::new();
        for info in table.params {
            let Some(matrix) = select(&info) else {
                continue;
            };
            let dims = match info.shape[..] {
                [m, n] => [1, m, n],
                [l, m, n] => [l, m, n],
                _ => {
                    return Err(BackendError::Shape {
                        op: "DistributedMuon",
                        detail: format!(
                            "`{}` of shape {:?} is not a matrix or a stack of matrices",
                            info.path, info.shape
                        ),
                    });
                }
            };
            slots.push(Slot {
                info,
                matrix,
                dims,
                owner: 0,
                master: None,
                momentum: None,
            });
        }
        let ids = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.info.id, i))
            .collect();
        let mut muon = Self {
            config,
            slots,
            ids,
            tp: groups.comm(GroupFamily::Tp).clone(),
            expt_tp: groups.comm(GroupFamily::ExptTp).clone(),
            dp_cp: groups.comm(GroupFamily::DpCp).clone(),
            expt_dp: groups.comm(GroupFamily::ExptDp).clone(),
            world,
            step: 0,
            device: param_device(module),
        };
        if muon.config.sharding == MuonSharding::LayerWise {
            muon.assign_owners();
            muon.check_owner_groups()?;
        }
        let values = muon.read(module, None)?;
        for (i, v) in values.into_iter().enumerate() {
            if muon.owned(i) {
                let slot = &mut muon.slots[i];
                slot.momentum = Some(v.zeros_like());
                slot.master = Some(v);
            }
        }
        Ok(muon)
    }

    /// Greedy largest-first assignment of each class's parameters to its DP members
    /// (deterministic: ties by size go to the earlier parameter, then the lower member).
    fn assign_owners(&mut self) {
        for expert in [false, true] {
            let members = self.dp(expert).size();
            let mut order: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].expert() == expert)
                .collect();
            order.sort_by_key(|&i| (std::cmp::Reverse(self.slots[i].numel()), i));
            let mut load = vec![0usize; members];
            for i in order {
                let (member, _) = load
                    .iter()
                    .enumerate()
                    .min_by_key(|&(j, l)| (*l, j))
                    .unwrap_or((0, &0));
                self.slots[i].owner = member;
                load[member] += self.slots[i].numel();
            }
        }
    }

    /// Layer-wise ownership needs the TP peers that gather a matrix together to own it
    /// together, i.e. to share their index in the DP group.
    fn check_owner_groups(&self) -> Result<()> {
        for (mp, dp) in [(&self.tp, &self.dp_cp), (&self.expt_tp, &self.expt_dp)] {
            if mp.size() == 1 {
                continue;
            }
            // Construction-time check: one value per member, read back.
            let me = Tensor::<1>::from_data(
                TensorData::new(vec![dp.rank() as f32], [1]),
                (&self.device, DType::F32),
            );
            let got = read_f32(mp.all_gather(me)?.into_data(), "DP indices")?;
            if got.iter().any(|&r| r != dp.rank() as f32) {
                return Err(BackendError::Layout {
                    field: "sharding",
                    detail: format!(
                        "layer-wise Muon needs TP peers with equal DP indices, got {got:?}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The data-parallel group of a class.
    fn dp(&self, expert: bool) -> &Comm {
        if expert { &self.expt_dp } else { &self.dp_cp }
    }

    /// The tensor-parallel group that splits a class's matrices.
    fn mp(&self, expert: bool) -> &Comm {
        if expert { &self.expt_tp } else { &self.tp }
    }

    /// Whether this rank updates slot `i`.
    fn owned(&self, i: usize) -> bool {
        let s = &self.slots[i];
        self.config.sharding == MuonSharding::Replicated || s.owner == self.dp(s.expert()).rank()
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &MuonConfig {
        &self.config
    }

    /// The Muon parameters (path, local shape, class), in module order.
    pub fn params(&self) -> impl Iterator<Item = &ParamInfo> {
        self.slots.iter().map(|s| &s.info)
    }

    /// Whether parameter `id` is optimised by Muon.
    pub fn contains(&self, id: ParamId) -> bool {
        self.ids.contains_key(&id)
    }

    /// Steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Sets the step count (when resuming from a checkpoint; Muon itself does not use it).
    pub fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    /// Sets the decoupled weight decay of the following steps (a weight-decay schedule).
    pub fn set_weight_decay(&mut self, weight_decay: f32) {
        self.config.weight_decay = weight_decay;
    }

    /// The momentum of parameter `id`'s local shard (flat, row-major), read back to the host,
    /// when this rank keeps it (for checkpoints).
    pub fn momentum(&self, id: ParamId) -> Option<Vec<f32>> {
        let s = &self.slots[*self.ids.get(&id)?];
        let m = s.momentum.clone()?;
        host_f32(m, "Muon momentum").ok()
    }

    /// Restores the momentum of parameter `id`'s local shard (e.g. from a checkpoint written
    /// with the same layout). Errors when `id` is not a Muon parameter this rank keeps, or the
    /// length differs.
    pub fn set_momentum(&mut self, id: ParamId, values: &[f32]) -> Result<()> {
        self.set_state(id, values, SlotState::Momentum)
    }

    /// The f32 master copy of parameter `id`'s local shard (flat, row-major), read back to the
    /// host, when this rank keeps it (for checkpoints: under BF16 mixed precision the
    /// parameter is only its rounding).
    pub fn master(&self, id: ParamId) -> Option<Vec<f32>> {
        let s = &self.slots[*self.ids.get(&id)?];
        let m = s.master.clone()?;
        host_f32(m, "Muon master").ok()
    }

    /// Restores the f32 master copy of parameter `id`'s local shard (from a checkpoint, under
    /// any layout). Errors when `id` is not a Muon parameter this rank keeps a master of, or
    /// the length differs.
    pub fn set_master(&mut self, id: ParamId, values: &[f32]) -> Result<()> {
        self.set_state(id, values, SlotState::Master)
    }

    /// Overwrites `state` of parameter `id`'s local shard with `values` (f32, flat).
    fn set_state(&mut self, id: ParamId, values: &[f32], state: SlotState) -> Result<()> {
        let device = self.device.clone();
        let (field, what, op) = match state {
            SlotState::Master => ("master", "master copy", "DistributedMuon::set_master"),
            SlotState::Momentum => ("momentum", "momentum", "DistributedMuon::set_momentum"),
        };
        let slot = self
            .ids
            .get(&id)
            .map(|&i| &mut self.slots[i])
            .filter(|s| state.held(s))
            .ok_or_else(|| BackendError::Config {
                field,
                detail: format!("parameter {id} has no Muon {what} on this rank"),
            })?;
        if values.len() != slot.numel() {
            return Err(BackendError::Shape {
                op,
                detail: format!(
                    "`{}`: {} values for a shard of {}",
                    slot.info.path,
                    values.len(),
                    slot.numel()
                ),
            });
        }
        let n = values.len();
        *state.of(slot) = Some(Tensor::from_data(
            TensorData::new(values.to_vec(), [n]),
            (&device, DType::F32),
        ));
        Ok(())
    }

    /// `module` with the Muon parameters set from the master copies, cast to each parameter's
    /// dtype, as a step writes them (after restoring the masters from a checkpoint). A
    /// collective over the data-parallel groups under `LayerWise` sharding.
    pub fn write_master_into<M: Module>(&self, module: M) -> Result<M> {
        self.write(module)
    }

    /// Sets the master copies this rank keeps from `module`'s parameter values (e.g. after
    /// loading parameters from a model-only checkpoint); the momentum is kept.
    pub fn reset_master_from<M: Module>(&mut self, module: &M) -> Result<()> {
        let values = self.read(module, None)?;
        for (slot, v) in self.slots.iter_mut().zip(values) {
            if slot.master.is_some() {
                slot.master = Some(v);
            }
        }
        Ok(())
    }

    /// `module` with the Muon parameters no longer requiring grad: build the paired
    /// [`DistributedAdamW`] on it so its table holds the other parameters only (its `step`
    /// then runs on the full module and leaves the Muon parameters alone).
    pub fn adamw_view<M: Module>(&self, module: &M) -> M {
        module.clone().map(&mut Freezer { ids: &self.ids })
    }

    /// Values (`grads = None`) or removed gradients (zeros when missing) of every slot, as
    /// flat f32 tensors on the device.
    fn read<M: Module>(
        &self,
        module: &M,
        grads: Option<&mut GradientsParams>,
    ) -> Result<Vec<Tensor<1>>> {
        let is_grad = grads.is_some();
        let mut reader = Reader {
            ids: &self.ids,
            out: vec![None; self.slots.len()],
            grads,
        };
        module.visit(&mut reader);
        let mut out = Vec::with_capacity(self.slots.len());
        for (slot, v) in self.slots.iter().zip(reader.out) {
            let v = match v {
                Some(v) => v,
                None if is_grad => Tensor::zeros([slot.numel()], (&self.device, DType::F32)),
                None => {
                    return Err(BackendError::Shape {
                        op: "DistributedMuon",
                        detail: format!(
                            "parameter `{}` was not found in the module (different model?)",
                            slot.info.path
                        ),
                    });
                }
            };
            let n = v.dims()[0];
            if n != slot.numel() {
                return Err(BackendError::Shape {
                    op: "DistributedMuon",
                    detail: format!(
                        "`{}` has {n} elements, expected {}",
                        slot.info.path,
                        slot.numel()
                    ),
                });
            }
            out.push(v);
        }
        Ok(out)
    }

    /// Removes the Muon gradients from `grads` and reduces them on the device:
    /// sequence-parallel ones summed over `tp`, then each class over its DP group (pre-factor
    /// `1/|dp_cp|`). Returns the reduced gradient of every owned slot (`None` for the others).
    fn reduce<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<Vec<Option<Tensor<1>>>> {
        let mut local: Vec<Option<Tensor<1>>> = self
            .read(module, Some(grads))?
            .into_iter()
            .map(Some)
            .collect();
        let sp: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].info.class == ParamClass::DenseSequenceParallel)
            .collect();
        if self.tp.size() > 1 && !sp.is_empty() {
            let packed = cat_flat(
                sp.iter().filter_map(|&i| local[i].clone()).collect(),
                &self.device,
            );
            let summed = self.tp.all_reduce(packed, ReduceOp::Sum)?;
            let mut at = 0;
            for &i in &sp {
                let n = self.slots[i].numel();
                local[i] = Some(summed.clone().slice(at..at + n));
                at += n;
            }
        }
        let scale = 1.0 / self.dp_cp.size() as f32;
        let mut reduced = vec![None; self.slots.len()];
        for expert in [false, true] {
            let comm = self.dp(expert);
            let class: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].expert() == expert)
                .collect();
            if class.is_empty() {
                continue;
            }
            // Slots in packing order, and this rank's slice of the reduced buffer.
            let (order, mine): (Vec<usize>, Vec<usize>) = match self.config.sharding {
                MuonSharding::Replicated => (class.clone(), class.clone()),
                MuonSharding::LayerWise => {
                    let mut order = class.clone();
                    order.sort_by_key(|&i| self.slots[i].owner);
                    let mine = class.iter().copied().filter(|&i| self.owned(i)).collect();
                    (order, mine)
                }
            };
            let packed = cat_flat(
                order.iter().filter_map(|&i| local[i].take()).collect(),
                &self.device,
            );
            let out = if comm.size() == 1 {
                packed
            } else {
                match self.config.sharding {
                    MuonSharding::Replicated => comm.all_reduce(packed, ReduceOp::Sum)?,
                    MuonSharding::LayerWise => {
                        let mut splits = vec![0; comm.size()];
                        for &i in &order {
                            splits[self.slots[i].owner] += self.slots[i].numel();
                        }
                        comm.reduce_scatter_v(packed, &splits, ReduceOp::Sum)?
                    }
                }
            };
            let mut at = 0;
            for i in mine {
                let n = self.slots[i].numel();
                let g = out.clone().slice(at..at + n);
                reduced[i] = Some(if scale != 1.0 { g.mul_scalar(scale) } else { g });
                at += n;
            }
        }
        Ok(reduced)
    }

    /// Σ g² (a one-element device tensor, f64 where the device has it) of the reduced
    /// gradients this rank counts for the global norm: each unique element once (DP replicas
    /// on DP member 0 or the owner, TP-replicated parameters on TP rank 0).
    fn local_sq_norm(&self, reduced: &[Option<Tensor<1>>]) -> Tensor<1> {
        let f64 = has_f64(&self.device);
        let dtype = if f64 { DType::F64 } else { DType::F32 };
        let mut sq = Tensor::<1>::zeros([1], (&self.device, dtype));
        for (slot, g) in self.slots.iter().zip(reduced) {
            let Some(g) = g else {
                continue;
            };
            if (self.config.sharding == MuonSharding::Replicated
                && self.dp(slot.expert()).rank() != 0)
                || (slot.info.class).is_duplicate_on(self.tp.rank(), self.expt_tp.rank())
                || slot.numel() == 0
            {
                continue;
            }
            sq = sq + sum_of_squares(g.clone(), f64);
        }
        sq
    }

    /// Momentum, Newton–Schulz on the full matrices, scale, decay and update of the owned
    /// master shards, with the gradients multiplied by `clip_coeff`; all on the device.
    fn apply(&mut self, lr: f64, reduced: Vec<Option<Tensor<1>>>, clip_coeff: f64) -> Result<()> {
        self.step += 1;
        let beta = self.config.momentum;
        let nesterov = self.config.nesterov;
        let mut dirs = Vec::with_capacity(self.slots.len());
        for (slot, g) in self.slots.iter_mut().zip(reduced) {
            let (Some(g), Some(b)) = (g, slot.momentum.take()) else {
                dirs.push(None);
                continue;
            };
            let g = if clip_coeff != 1.0 {
                scale_f64(g, clip_coeff, &self.device)
            } else {
                g
            };
            // B ← β·B + (1−β)·G;  U ← (1−β)·G + β·B (Nesterov) or B
            let b = b.mul_scalar(beta) + g.clone().mul_scalar(1.0 - beta);
            let dir = if nesterov {
                g.mul_scalar(1.0 - beta) + b.clone().mul_scalar(beta)
            } else {
                b.clone()
            };
            slot.momentum = Some(b);
            dirs.push(Some(dir));
        }
        let full = self.gather_full(&dirs)?;
        let lr = lr as f32;
        let decay = 1.0 - lr * self.config.weight_decay;
        for (i, (dir, full)) in dirs.into_iter().zip(full).enumerate() {
            let Some(dir) = dir else {
                continue;
            };
            let slot = &self.slots[i];
            let full = full.unwrap_or_else(|| dir.reshape(slot.dims));
            let [_, m, n] = full.dims();
            let o = newton_schulz_batched(full, self.config.ns_steps);
            let o = self.local_block(i, o);
            let (fan_out, fan_in) = if slot.matrix.rows_are_outputs {
                (m, n)
            } else {
                (n, m)
            };
            let step = lr * self.config.scale.factor(fan_out, fan_in);
            let slot = &mut self.slots[i];
            if let Some(p) = slot.master.take() {
                // W ← W·(1 − lr·wd) − lr·s·O
                let p = if decay != 1.0 { p.mul_scalar(decay) } else { p };
                slot.master = Some(p - o.mul_scalar(step));
            }
        }
        Ok(())
    }

    /// The full matrices `[L, M, N]` of the owned split slots (`None` for the others): the
    /// local directions of each group are packed, all-gathered once over `tp` / `expt_tp` and
    /// reassembled along the split axis in member order (device slices and `cat`).
    fn gather_full(&self, dirs: &[Option<Tensor<1>>]) -> Result<Vec<Option<Tensor<3>>>> {
        let mut full = vec![None; self.slots.len()];
        for expert in [false, true] {
            let comm = self.mp(expert);
            let parts = comm.size();
            let split: Vec<usize> = (0..self.slots.len())
                .filter(|&i| {
                    let s = &self.slots[i];
                    s.expert() == expert && s.matrix.split.is_some() && dirs[i].is_some()
                })
                .collect();
            if parts == 1 || split.is_empty() {
                continue;
            }
            let packed = cat_flat(
                split.iter().filter_map(|&i| dirs[i].clone()).collect(),
                &self.device,
            );
            let len = packed.dims()[0];
            let all = comm.all_gather(packed)?;
            let mut at = 0;
            for &i in &split {
                let s = &self.slots[i];
                let [l, m, n] = s.dims;
                let pieces: Vec<Tensor<3>> = (0..parts)
                    .map(|r| {
                        all.clone()
                            .slice(r * len + at..r * len + at + l * m * n)
                            .reshape([l, m, n])
                    })
                    .collect();
                let axis = match s.matrix.split {
                    Some(MatrixAxis::Rows) => 1,
                    _ => 2,
                };
                full[i] = Some(Tensor::cat(pieces, axis));
                at += l * m * n;
            }
        }
        Ok(full)
    }

    /// This rank's block (flat) of a full `[L, M, N]` update of slot `i` (the whole of it when
    /// the slot is not split or its group has one member).
    fn local_block(&self, i: usize, o: Tensor<3>) -> Tensor<1> {
        let s = &self.slots[i];
        let [l, lm, ln] = s.dims;
        let [_, m, n] = o.dims();
        if (m, n) == (lm, ln) {
            return o.reshape([l * lm * ln]);
        }
        let r = self.mp(s.expert()).rank();
        let block = match s.matrix.split {
            Some(MatrixAxis::Rows) => o.slice([0..l, r * lm..(r + 1) * lm, 0..ln]),
            _ => o.slice([0..l, 0..lm, r * ln..(r + 1) * ln]),
        };
        block.reshape([l * lm * ln])
    }

    /// `module` with the Muon parameters replaced by the master shards (under `LayerWise`,
    /// all-gathered from their owners over the DP group first).
    fn write<M: Module>(&self, module: M) -> Result<M> {
        let mut values: Vec<Option<Tensor<1>>> =
            self.slots.iter().map(|s| s.master.clone()).collect();
        if self.config.sharding == MuonSharding::LayerWise {
            for expert in [false, true] {
                let comm = self.dp(expert);
                let class: Vec<usize> = (0..self.slots.len())
                    .filter(|&i| self.slots[i].expert() == expert)
                    .collect();
                if comm.size() == 1 || class.is_empty() {
                    continue;
                }
                let packed = cat_flat(
                    class
                        .iter()
                        .filter(|&&i| self.owned(i))
                        .filter_map(|&i| self.slots[i].master.clone())
                        .collect(),
                    &self.device,
                );
                let (all, _) = comm.all_gather_v(packed)?;
                let mut at = 0;
                for member in 0..comm.size() {
                    for &i in class.iter().filter(|&&i| self.slots[i].owner == member) {
                        let n = self.slots[i].numel();
                        values[i] = Some(all.clone().slice(at..at + n));
                        at += n;
                    }
                }
            }
        }
        let mut writer = Writer {
            ids: &self.ids,
            values,
            shapes: self.slots.iter().map(|s| s.info.shape.clone()).collect(),
        };
        Ok(module.map(&mut writer))
    }

    /// One Muon step: removes the Muon gradients from `grads` (the rest is left for the paired
    /// AdamW), reduces them, clips by the global norm of the Muon gradients when
    /// `max_grad_norm` is set, updates and returns `module` with the new Muon parameters. A
    /// collective. (Clip by the norm over *all* parameters with [`MuonAdamW`].)
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: &mut GradientsParams,
        max_grad_norm: Option<f64>,
    ) -> Result<(M, StepReport)> {
        let reduced = self.reduce(&module, grads)?;
        let grad_norm = world_sum(&self.world, self.local_sq_norm(&reduced))?.sqrt();
        let clip_coeff = clip_coeff(grad_norm, max_grad_norm);
        self.apply(lr, reduced, clip_coeff)?;
        Ok((
            self.write(module)?,
            StepReport {
                grad_norm,
                clip_coeff,
            },
        ))
    }
}

/// Σ over the world of a one-element device tensor per rank, read back: the one scalar the
/// clipping decision and the report need on the host.
fn world_sum(world: &Comm, x: Tensor<1>) -> Result<f64> {
    world
        .all_reduce(x, ReduceOp::Sum)?
        .into_data()
        .iter::<f64>()
        .next()
        .ok_or_else(|| BackendError::Shape {
            op: "DistributedMuon",
            detail: "norm unreadable".into(),
        })
}

/// `max/(norm + 1e-6)` when `norm > max`, else 1 (Megatron's clipping).
fn clip_coeff(norm: f64, max_grad_norm: Option<f64>) -> f64 {
    match max_grad_norm {
        Some(max) if norm > max => max / (norm + 1e-6),
        _ => 1.0,
    }
}

/// Muon for the weight matrices and ZeRO-1 AdamW for everything else (embedding, LM head,
/// norms, biases), with one global gradient norm over both (Megatron's chained Muon + Adam).
#[derive(Debug, Clone)]
pub struct MuonAdamW {
    muon: DistributedMuon,
    adamw: DistributedAdamW,
    max_grad_norm: Option<f64>,
}

impl MuonAdamW {
    /// Splits the parameters of `module` with `select` (see [`default_muon_select`]): Muon
    /// ([`DistributedMuon`], `muon`) for the selected ones, [`DistributedAdamW`] (`adamw`,
    /// unchanged and built on [`DistributedMuon::adamw_view`]) for the rest. `adamw.max_grad_norm`
    /// becomes the threshold of the joint clipping over all parameters. A collective.
    pub fn new<M: Module, F: Fn(&str, bool) -> ParamClass>(
        module: &M,
        groups: &GroupComms,
        world: Comm,
        muon: MuonConfig,
        adamw: DistributedAdamWConfig,
        classify: &F,
        select: &dyn Fn(&ParamInfo) -> Option<MuonMatrix>,
    ) -> Result<Self> {
        let muon = DistributedMuon::new(module, groups, world.clone(), muon, classify, select)?;
        let max_grad_norm = adamw.max_grad_norm;
        let config = DistributedAdamWConfig {
            max_grad_norm: None,
            ..adamw
        };
        let view = muon.adamw_view(module);
        let adamw = DistributedAdamW::with_classes(&view, groups, world, config, classify)?;
        Ok(Self {
            muon,
            adamw,
            max_grad_norm,
        })
    }

    /// The Muon side.
    pub fn muon(&self) -> &DistributedMuon {
        &self.muon
    }

    /// The AdamW side (its table holds the non-Muon parameters).
    pub fn adamw(&self) -> &DistributedAdamW {
        &self.adamw
    }

    /// The AdamW side, mutably (e.g. to enable FP8 primary weights for its parameters).
    pub fn adamw_mut(&mut self) -> &mut DistributedAdamW {
        &mut self.adamw
    }

    /// The Muon side, mutably (e.g. to restore its momentum).
    pub fn muon_mut(&mut self) -> &mut DistributedMuon {
        &mut self.muon
    }

    /// Optimizer steps taken (AdamW's bias-correction count).
    pub fn step_count(&self) -> u64 {
        self.adamw.step_count()
    }

    /// Whether a step with a non-finite global gradient norm is refused before any update
    /// (the default), as [`DistributedAdamW::set_check_non_finite`], for both sides.
    pub fn set_check_non_finite(&mut self, check: bool) {
        self.adamw.set_check_non_finite(check);
    }

    /// Sets the decoupled weight decay of both sides for the following steps (a weight-decay
    /// schedule; Moonshot uses one value for both with [`MuonScale::MatchAdamW`]).
    pub fn set_weight_decay(&mut self, weight_decay: f32) {
        self.adamw.set_weight_decay(weight_decay);
        self.muon.set_weight_decay(weight_decay);
    }

    /// Sets the master weights of both sides from `module`'s parameter values; moments and
    /// momentum are kept.
    pub fn reset_master_from<M: Module>(&mut self, module: &M) -> Result<()> {
        self.adamw.reset_master_from(module)?;
        self.muon.reset_master_from(module)
    }

    /// [`MuonAdamW::step_with_lrs`] with one learning rate for both (the
    /// [`MuonScale::MatchAdamW`] setting).
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
    ) -> Result<(M, StepReport)> {
        self.step_with_lrs(lr, lr, module, grads)
    }

    /// One step of both optimizers on this rank's local gradients; returns the updated module
    /// and the global gradient norm over all parameters (before clipping). With clipping the
    /// AdamW gradients are reduced once more to measure their norm before the step
    /// (`DistributedAdamW` has no hook for an external clip coefficient), and every local
    /// gradient is multiplied by the coefficient before its reduction.
    pub fn step_with_lrs<M: Module>(
        &mut self,
        muon_lr: f64,
        adamw_lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport)> {
        let reduced = self.muon.reduce(&module, &mut grads)?;
        let muon_sq = self.muon.local_sq_norm(&reduced);
        let (module, grad_norm, clip_coeff) = match self.max_grad_norm {
            Some(max) => {
                let mut walker = GradWalker {
                    grads: &mut grads,
                    copy: Some(GradientsParams::new()),
                    factor: None,
                };
                module.visit(&mut walker);
                let copy = walker.copy.take().unwrap_or_default();
                let (dense, expert) = self.adamw.reduced_gradient_tensors(&module, copy)?;
                let sq = muon_sq + self.adamw_sq_norm(&dense, &expert);
                let norm = world_sum(&self.muon.world, sq)?.sqrt();
                if self.adamw.check_non_finite() && !norm.is_finite() {
                    return Err(BackendError::NonFiniteGradients {
                        op: "MuonAdamW",
                        norm,
                        rank: None,
                        groups: "the Muon matrices or the AdamW parameters".into(),
                    });
                }
                let coeff = clip_coeff(norm, Some(max));
                if coeff != 1.0 {
                    module.visit(&mut GradWalker {
                        grads: &mut grads,
                        copy: None,
                        factor: Some(coeff),
                    });
                }
                let (module, _) = self.adamw.step(adamw_lr, module, grads)?;
                (module, norm, coeff)
            }
            None => {
                // A second scalar read (the first is AdamW's own norm inside its step): the
                // reported norm covers both sides.
                let muon_sq = world_sum(&self.muon.world, muon_sq)?;
                if self.adamw.check_non_finite() && !muon_sq.is_finite() {
                    return Err(BackendError::NonFiniteGradients {
                        op: "MuonAdamW",
                        norm: muon_sq.sqrt(),
                        rank: None,
                        groups: "Muon matrices".into(),
                    });
                }
                let (module, report) = self.adamw.step(adamw_lr, module, grads)?;
                (module, (report.grad_norm.powi(2) + muon_sq).sqrt(), 1.0)
            }
        };
        self.muon.apply(muon_lr, reduced, clip_coeff)?;
        Ok((
            self.muon.write(module)?,
            StepReport {
                grad_norm,
                clip_coeff,
            },
        ))
    }

    /// Σ g² (a one-element device tensor, f64 where the device has it) of AdamW's reduced
    /// full buffers this rank counts: dense on `dp_cp` member 0 (TP-replicated ones on TP
    /// rank 0 only), experts on `expt_dp` member 0. Contiguous counted ranges are merged.
    fn adamw_sq_norm(&self, dense: &Tensor<1>, expert: &Tensor<1>) -> Tensor<1> {
        let m = &self.muon;
        let mut ranges: [Vec<std::ops::Range<usize>>; 2] = [Vec::new(), Vec::new()];
        for p in &self.adamw.table().params {
            let counted = if p.class.is_expert() {
                m.expt_dp.rank() == 0 && !(p.class.expt_tp_replicated() && m.expt_tp.rank() != 0)
            } else {
                m.dp_cp.rank() == 0
                    && !(p.class.tp_replicated() && m.tp.rank() != 0)
                    && !self.adamw.norm_excluded().contains(&p.id)
            };
            if !counted || p.numel() == 0 {
                continue;
            }
            let list = &mut ranges[usize::from(p.class.is_expert())];
            let r = p.offset..p.offset + p.numel();
            match list.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => list.push(r),
            }
        }
        let f64 = has_f64(&m.device);
        let dtype = if f64 { DType::F64 } else { DType::F32 };
        let mut sq = Tensor::<1>::zeros([1], (&m.device, dtype));
        for (buf, list) in [(dense, &ranges[0]), (expert, &ranges[1])] {
            for r in list {
                sq = sq + sum_of_squares(buf.clone().slice(r.clone()), f64);
            }
        }
        sq
    }
}

#[cfg(test)]
mod tests;
