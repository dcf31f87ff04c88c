//! Training checkpoints: model parameters, optimizer state and the small training state (step,
//! data-loader position, RNG seed) in one distributed checkpoint, saved atomically by every rank
//! and restored under any layout (docs/checkpoints.md §Training checkpoints, §Resharding).
//!
//! - Parameters and buffers (e.g. the expert bias) are saved as canonical tensors from each
//!   rank's model shard ([`super::placement::PlacedModel`]: Qwen3-MoE, DeepSeek-V3 with its MTP
//!   modules), by their main replicas, in the dtype the shard holds them: F32, or BF16 for the
//!   trainable parameters of a BF16 mixed-precision run (each its f32 main weight rounded to
//!   nearest even; the main weights themselves are `optim.master`, as Megatron's distributed
//!   optimizer saves its FP32 main parameters beside the BF16 model).
//! - The ZeRO-1 optimizer state is saved as `optim.{master|exp_avg|exp_avg_sq}.<fqn>` with the
//!   parameter's global shape: every rank writes the boxes of its own flat range
//!   ([`DistributedAdamW::state_pieces`]; TP-replicated parameters by TP rank 0 only), the
//!   master in F32 and the moments in their storage dtype. The index's `optimizer` record
//!   carries the step count, the hyper-parameters and the state dtypes.
//! - moe-bridge's [`TrainState`] is stored in the index's `objects` under
//!   [`TRAIN_STATE_OBJECT`].
//!
//! Restoring reads, on every rank, only the boxes of its own shard and of its own optimizer
//! flat range under the new layout, then writes every trained parameter from its restored
//! main weight (cast to the parameter's dtype, as a step does), so that a run resumed in BF16
//! or in f32 computes with exactly the parameters its next step would (docs/checkpoints.md
//! §Training checkpoints). A model-only checkpoint (e.g. right after HF import) restores the
//! parameters and initialises the master weights from them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::distributed::{CausalLmShard, ParallelCausalLm};
use crate::train::Trainer;
use burn::module::{ModuleMapper, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorData};
use moe_backend::BackendError;
use moe_backend::comm::Comm;
use moe_backend::optim::{
    DistributedAdamW, DistributedMuon, MomentDtype, MuonAdamW, OptimState, ParamInfo,
    ParamPlacement, StatePiece, transpose_2d,
};
use serde_json::json;

use super::placement::{PlacedModel, PlacedTensor, by_id};
use moe_bridge::dist::TensorMeta;
use moe_bridge::dist::fp8::{every_box_aligned, fp8_chunks, read_fp8_weight, scale_fqn};
use moe_bridge::dist::index::{Fp8Record, OptimizerRecord, TensorKind};
use moe_bridge::dist::load::DistCheckpoint;
use moe_bridge::dist::region::TensorBox;
use moe_bridge::dist::save::{LocalChunk, SaveMeta, save_spmd};
use moe_bridge::dist::sharding::ShardingPlan;
use moe_bridge::dist::{TRAIN_STATE_OBJECT, TrainState, read_train_state};

use crate::families::shard_rule;
use crate::param_plan::hf_names::stage_place;
use moe_bridge::BridgeError;
use moe_bridge::fp8::{OutDtype, scale_shape};
use moe_bridge::safetensors::{Dtype, OwnedTensor};

/// `optim.<state>.<fqn>`.
pub fn optim_fqn(state: OptimState, fqn: &str) -> String {
    format!("optim.{}.{fqn}", state.name())
}

fn backend_error(path: &Path, field: &str) -> impl FnOnce(BackendError) -> BridgeError {
    let path = path.to_path_buf();
    let field = field.to_owned();
    move |e| BridgeError::TrainState {
        path,
        field,
        reason: e.to_string(),
    }
}

/// The placement of every optimizer parameter, looked up by id in `placed`.
fn placer<'a>(
    placed: &'a HashMap<ParamId, &'a PlacedTensor>,
) -> impl Fn(&ParamInfo) -> Result<ParamPlacement, BackendError> + 'a {
    move |info| {
        placed
            .get(&info.id)
            .map(|p| p.placement.clone())
            .ok_or_else(|| BackendError::Config {
                field: "placement",
                detail: format!(
                    "optimizer parameter `{}` is not a parameter of the model",
                    info.path
                ),
            })
    }
}

fn moment_dtype(optimizer: &DistributedAdamW) -> Dtype {
    match optimizer.config().moment_dtype {
        MomentDtype::F32 => Dtype::F32,
        MomentDtype::Bf16 => Dtype::BF16,
    }
}

/// The index's optimizer record of `optimizer`.
pub fn optimizer_record(optimizer: &DistributedAdamW) -> OptimizerRecord {
    let c = optimizer.config();
    let moments = moment_dtype(optimizer).as_str().to_owned();
    OptimizerRecord {
        kind: "adamw".to_owned(),
        step: optimizer.step_count(),
        hparams: BTreeMap::from([
            ("beta_1".to_owned(), json!(c.beta_1)),
            ("beta_2".to_owned(), json!(c.beta_2)),
            ("epsilon".to_owned(), json!(c.epsilon)),
            ("weight_decay".to_owned(), json!(c.weight_decay)),
            ("max_grad_norm".to_owned(), json!(c.max_grad_norm)),
        ]),
        state_dtypes: BTreeMap::from([
            ("master".to_owned(), Dtype::F32.as_str().to_owned()),
            ("exp_avg".to_owned(), moments.clone()),
            ("exp_avg_sq".to_owned(), moments),
        ]),
    }
}

/// One chunk this rank saves, owning its bytes.
struct OwnedChunk {
    meta: TensorMeta,
    offsets: Vec<usize>,
    tensor: OwnedTensor,
}

/// The optimizer-state chunks of this rank (its main-replica pieces, three states each).
fn optimizer_chunks(
    optimizer: &DistributedAdamW,
    pieces: &[StatePiece],
    root: &Path,
) -> Result<Vec<OwnedChunk>, BridgeError> {
    let moments = moment_dtype(optimizer);
    let mut out = Vec::new();
    for piece in pieces.iter().filter(|p| p.main_replica) {
        for state in OptimState::ALL {
            let fqn = optim_fqn(state, &piece.fqn);
            let values = optimizer
                .piece_values(piece, state)
                .map_err(backend_error(root, &fqn))?;
            let mut tensor = OwnedTensor::from_f32(fqn.clone(), piece.shape.clone(), &values)?;
            let dtype = match state {
                OptimState::Master => Dtype::F32,
                _ => moments,
            };
            if dtype != Dtype::F32 {
                tensor = tensor.cast(dtype)?;
            }
            out.push(OwnedChunk {
                meta: TensorMeta {
                    fqn,
                    kind: TensorKind::Optim,
                    dtype,
                    global_shape: piece.global_shape.clone(),
                    hf: Vec::new(),
                },
                offsets: piece.offsets.clone(),
                tensor,
            });
        }
    }
    Ok(out)
}

/// Saves a training checkpoint of step `state.step` into `root`; every rank of `comm` (the
/// world) calls it with its shard `model` (any [`PlacedModel`]: Qwen3-MoE, DeepSeek-V3 with its
/// MTP modules) and optimizer. `meta` supplies the
/// layout (which must be the one `model` was sharded under), `config.json`, model family and
/// extra JSON files (e.g. from
/// [`checkpoint_meta`](moe_bridge::dist::convert::checkpoint_meta)); its step, optimizer
/// record and [`TRAIN_STATE_OBJECT`] are set here. Without an optimizer the checkpoint is model-only.
/// Atomic like [`save_spmd`]; returns the committed `iter_*` directory on every rank.
pub fn save_training_state<M: PlacedModel>(
    comm: &Comm,
    root: &Path,
    meta: SaveMeta,
    model: &M,
    optimizer: Option<&DistributedAdamW>,
    state: &TrainState,
) -> Result<PathBuf, BridgeError> {
    save_state(comm, root, meta, model, optimizer, None, state, None)
}

/// [`save_training_state`], with `muon` the Muon side of a Muon + AdamW optimizer whose AdamW
/// side is `optimizer` ([`muon`]) and the model's layers on `layer_stages` when given.
#[allow(clippy::too_many_arguments)]
fn save_state<M: PlacedModel>(
    comm: &Comm,
    root: &Path,
    mut meta: SaveMeta,
    model: &M,
    optimizer: Option<&DistributedAdamW>,
    muon: Option<&DistributedMuon>,
    state: &TrainState,
    layer_stages: Option<Vec<usize>>,
) -> Result<PathBuf, BridgeError> {
    let rank = comm
        .ranks()
        .get(comm.rank())
        .copied()
        .unwrap_or(comm.rank());
    let plan = model_plan(&meta.layout, model, layer_stages)?;
    let placed = model.placements(&plan, rank, true)?;
    let mut owned = Vec::new();
    // FP8 primary weights are saved as their FP8 bytes with `<fqn>_scale_inv` (the checkpoint
    // keeps exactly the weights the model computes with); the f32 master is in `optim.master`.
    let fp8_config = optimizer.and_then(|o| o.fp8_config().copied());
    for p in placed.iter().filter(|p| p.main_replica) {
        let pl = &p.placement;
        if let Some(w) = optimizer.and_then(|o| o.fp8_weight(p.id)) {
            let (bytes, sbox, scales) = fp8_chunks(pl, &w)?;
            let block = [w.grid.b0, w.grid.b1];
            let scale_name = scale_fqn(&pl.fqn);
            owned.push(OwnedChunk {
                meta: TensorMeta {
                    fqn: pl.fqn.clone(),
                    kind: p.kind,
                    dtype: Dtype::F8E4M3,
                    global_shape: pl.global_shape.clone(),
                    hf: Vec::new(),
                },
                offsets: pl.offsets.clone(),
                tensor: OwnedTensor::new(pl.fqn.clone(), Dtype::F8E4M3, pl.shape.clone(), bytes)?,
            });
            owned.push(OwnedChunk {
                meta: TensorMeta {
                    fqn: scale_name.clone(),
                    kind: TensorKind::Scale,
                    dtype: Dtype::F32,
                    global_shape: scale_shape(&pl.global_shape, block).unwrap_or_default(),
                    hf: Vec::new(),
                },
                offsets: sbox.offsets,
                tensor: OwnedTensor::from_f32(scale_name, sbox.shape, &scales)?,
            });
            continue;
        }
        let values = p.values.as_deref().unwrap_or_default();
        // Stored in the dtype the shard holds it in: the cast of a BF16 parameter's f32 values
        // back to BF16 is exact.
        let dtype = stored_dtype(p.dtype);
        let mut tensor = OwnedTensor::from_f32(pl.fqn.clone(), pl.shape.clone(), values)?;
        if dtype != Dtype::F32 {
            tensor = tensor.cast(dtype)?;
        }
        owned.push(OwnedChunk {
            meta: TensorMeta {
                fqn: pl.fqn.clone(),
                kind: p.kind,
                dtype,
                global_shape: pl.global_shape.clone(),
                hf: Vec::new(),
            },
            offsets: pl.offsets.clone(),
            tensor,
        });
    }
    meta.step = state.step;
    meta.optimizer = None;
    if let Some(c) = fp8_config {
        meta.fp8 = Some(Fp8Record {
            format: "e4m3".to_owned(),
            weight_block_size: c.block,
            pow2_scales: c.pow2_scales,
        });
    }
    if let Some(optimizer) = optimizer {
        let ids = by_id(&placed);
        let pieces = optimizer
            .state_pieces(&placer(&ids))
            .map_err(backend_error(root, "optimizer"))?;
        // A pipeline stage's copy of another stage's tensor saves no optimizer state (the
        // owner's is the same).
        let copies: Vec<ParamId> = placed.iter().filter(|p| p.copy).map(|p| p.id).collect();
        let table = &optimizer.table().params;
        let pieces: Vec<StatePiece> = (pieces.into_iter())
            .filter(|piece| {
                table
                    .get(piece.param)
                    .is_none_or(|p| !copies.contains(&p.id))
            })
            .collect();
        owned.extend(optimizer_chunks(optimizer, &pieces, root)?);
        meta.optimizer = Some(match muon {
            Some(m) => {
                owned.extend(muon::momentum_chunks(m, &placed, root)?);
                muon::record(optimizer_record(optimizer), m)
            }
            None => optimizer_record(optimizer),
        });
    }
    let value = serde_json::to_value(state).map_err(|e| BridgeError::TrainState {
        path: root.to_path_buf(),
        field: TRAIN_STATE_OBJECT.to_owned(),
        reason: e.to_string(),
    })?;
    meta.objects.insert(TRAIN_STATE_OBJECT.to_owned(), value);
    let chunks: Vec<LocalChunk<'_>> = owned
        .iter()
        .map(|c| LocalChunk {
            meta: c.meta.clone(),
            offsets: c.offsets.clone(),
            data: c.tensor.view(),
        })
        .collect();
    save_spmd(comm, root, &meta, &chunks)
}

/// The checkpoint dtype of a tensor a shard holds in `dtype`: BF16 and F16 as they are
/// (mixed-precision parameters), everything else (f32 parameters, buffers) in F32.
fn stored_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// Replaces parameter values by id (cast to each parameter's dtype; ids and `require_grad`
/// kept).
struct SetValues {
    values: HashMap<ParamId, Vec<f32>>,
}

impl ModuleMapper for SetValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(values) = self.values.remove(&param.id) else {
            return param;
        };
        let shape = param.shape().to_vec();
        param.map(move |t| {
            let grad = t.is_require_grad();
            let (dtype, device) = (t.dtype(), t.device());
            let fresh = Tensor::from_data(TensorData::new(values, shape), (&device, dtype));
            if grad { fresh.require_grad() } else { fresh }
        })
    }
}

/// `model` (rank `rank`'s shard under `plan`'s layout) with every parameter and
/// buffer read from `ckpt`: each rank reads only its own boxes (cast to f32 when stored in
/// BF16, dequantised exactly to f32 when stored in FP8 with scales). Errors name the missing
/// or mismatching tensor.
pub fn load_model_state<M: PlacedModel>(
    ckpt: &DistCheckpoint,
    model: M,
    plan: &ShardingPlan,
    rank: usize,
) -> Result<M, BridgeError> {
    let placed = model.placements(plan, rank, false)?;
    let mut values = HashMap::with_capacity(placed.len());
    for p in &placed {
        let pl = &p.placement;
        let request = TensorBox::new(pl.offsets.clone(), pl.shape.clone());
        let t = if ckpt.is_fp8(&pl.fqn) {
            let entry = ckpt.entry(&pl.fqn)?;
            if entry.global_shape != pl.global_shape {
                return Err(BridgeError::ShapeMismatch {
                    path: ckpt.dir().to_path_buf(),
                    tensor: pl.fqn.clone(),
                    expected: pl.global_shape.clone(),
                    actual: entry.global_shape.clone(),
                });
            }
            // Exact f32 values of the FP8 weights (what FP8 primary weights hold).
            ckpt.read_box_dequantized(&pl.fqn, &request, OutDtype::F32)?
        } else {
            ckpt.read_box_checked(&pl.fqn, &pl.global_shape, Some(Dtype::F32), &request, true)?
        };
        let v = t.to_f32_vec()?;
        let v = match pl.shape.as_slice() {
            [rows, cols] if pl.transposed => transpose_2d(&v, *rows, *cols),
            _ => v,
        };
        values.insert(p.id, v);
    }
    let mut mapper = SetValues { values };
    Ok(model.map(&mut mapper))
}

/// Restores `optimizer` (rank `rank`'s, for its shard `model` under `plan`'s layout) from
/// `ckpt`: the master weights and moments of its own flat ranges, read as boxes of the
/// `optim.*` tensors, and the step count. A model-only checkpoint sets the master weights
/// from `model` instead (moments stay as they are). Returns whether optimizer state was read.
pub fn load_optimizer_state<M: PlacedModel>(
    ckpt: &DistCheckpoint,
    optimizer: &mut DistributedAdamW,
    model: &M,
    plan: &ShardingPlan,
    rank: usize,
) -> Result<bool, BridgeError> {
    load_adamw_state(ckpt, optimizer, model, plan, rank, "adamw")
}

/// [`load_optimizer_state`] from a checkpoint whose optimizer type must be `kind` (`adamw`,
/// or [`muon::MUON_KIND`] for the AdamW side of Muon + AdamW).
fn load_adamw_state<M: PlacedModel>(
    ckpt: &DistCheckpoint,
    optimizer: &mut DistributedAdamW,
    model: &M,
    plan: &ShardingPlan,
    rank: usize,
    kind: &str,
) -> Result<bool, BridgeError> {
    let dir = ckpt.dir().to_path_buf();
    let Some(record) = ckpt.index().optimizer.clone() else {
        optimizer
            .reset_master_from(model)
            .map_err(backend_error(&dir, "master"))?;
        return Ok(false);
    };
    if record.kind != kind {
        let want = if kind == "adamw" {
            "an AdamW"
        } else {
            "a Muon + AdamW"
        };
        return Err(BridgeError::TrainState {
            path: dir,
            field: "optimizer.type".to_owned(),
            reason: format!("\"{}\" cannot restore {want} optimizer", record.kind),
        });
    }
    let placed = model.placements(plan, rank, false)?;
    let ids = by_id(&placed);
    let pieces = optimizer
        .state_pieces(&placer(&ids))
        .map_err(backend_error(&dir, "optimizer"))?;
    for piece in &pieces {
        for state in OptimState::ALL {
            let fqn = optim_fqn(state, &piece.fqn);
            let request = TensorBox::new(piece.offsets.clone(), piece.shape.clone());
            let t = ckpt.read_box_checked(&fqn, &piece.global_shape, None, &request, false)?;
            let values = t.to_f32_vec()?;
            optimizer
                .set_piece_values(piece, state, &values)
                .map_err(backend_error(&dir, &fqn))?;
        }
    }
    optimizer
        .set_step_count(record.step)
        .map_err(backend_error(&dir, "optimizer.step"))?;
    Ok(true)
}

/// [`save_training_state`] of a [`Trainer`] of any placed model (its shard and optimizer).
pub fn save_trainer<M: ParallelCausalLm + PlacedModel>(
    comm: &Comm,
    root: &Path,
    meta: SaveMeta,
    trainer: &Trainer<M>,
    state: &TrainState,
) -> Result<PathBuf, BridgeError> {
    let layout = &trainer.process_groups().layout;
    if &meta.layout != layout {
        return Err(BridgeError::TrainState {
            path: root.to_path_buf(),
            field: "layout".to_owned(),
            reason: format!(
                "the trainer runs under {layout}, the save metadata says {}",
                meta.layout
            ),
        });
    }
    save_state(
        comm,
        root,
        meta,
        trainer.model().model(),
        Some(trainer.optimizer()),
        trainer.muon().map(MuonAdamW::muon),
        state,
        layer_stages(trainer.model()),
    )
}

/// The pipeline stage of every main decoder layer of `shard`'s model when it runs a pipeline
/// (`None`: no pipeline, or the even split [`ShardingPlan`] assumes).
fn layer_stages<S: crate::distributed::CausalLmShard>(shard: &S) -> Option<Vec<usize>> {
    shard.pipeline().map(|p| p.split.layer_ranks())
}

/// The sharding plan of `model` under `layout`, with its layers on `stages` when given.
fn model_plan<M: PlacedModel>(
    layout: &moe_backend::parallel::ParallelLayout,
    model: &M,
    stages: Option<Vec<usize>>,
) -> Result<ShardingPlan, BridgeError> {
    let plan = ShardingPlan::new(
        layout,
        Some(model.num_main_layers()),
        shard_rule,
        stage_place,
    )?;
    match stages {
        Some(stages) => plan.with_layer_stages(stages),
        None => Ok(plan),
    }
}

/// The FP8 copies of an optimizer with FP8 primary weights after a restore: the stored FP8
/// bytes and scales when the checkpoint holds every FP8 parameter in FP8 with the optimizer's
/// blocks on block-aligned boxes of every rank, else a fresh cast of the restored master
/// weights (a collective; the choice depends only on the checkpoint and the layout, so every
/// rank makes the same one). Returns `model` with the decoded values.
fn restore_fp8_weights<M: PlacedModel>(
    ckpt: &DistCheckpoint,
    optimizer: &mut DistributedAdamW,
    model: M,
    plan: &ShardingPlan,
    rank: usize,
) -> Result<M, BridgeError> {
    let dir = ckpt.dir().to_path_buf();
    let placed = model.placements(plan, rank, false)?;
    let mut loaded = HashMap::new();
    let mut adopt = true;
    for p in &placed {
        let Some(grid) = optimizer.fp8_weight(p.id).map(|w| w.grid) else {
            continue;
        };
        let pl = &p.placement;
        if !every_box_aligned(plan, &pl.fqn, &pl.global_shape, &grid)? {
            adopt = false;
            break;
        }
        match read_fp8_weight(ckpt, pl, grid)? {
            Some(w) => {
                loaded.insert(p.id, w);
            }
            None => {
                adopt = false;
                break;
            }
        }
    }
    if adopt {
        optimizer
            .set_fp8_weights(loaded)
            .map_err(backend_error(&dir, "fp8"))?;
        // The module's FP8 parameters hold the restored codes and scales.
        optimizer
            .apply_fp8_weights(model)
            .map_err(backend_error(&dir, "fp8"))
    } else {
        optimizer
            .recast_fp8_primary_weights(model)
            .map_err(backend_error(&dir, "fp8"))
    }
}

/// Restores a [`Trainer`] of any placed model (built for any layout) from `ckpt`: this rank's
/// parameters and buffers (e.g. the expert bias), its
/// optimizer shards (or master weights from the parameters for a model-only checkpoint), the
/// step count and, with FP8 primary weights, their FP8 copies (the stored FP8
/// bytes when they fit the optimizer's blocks, else a cast of the restored master weights).
/// Returns the stored [`TrainState`], or one at the index's step when the checkpoint has none.
pub fn restore_trainer<M: ParallelCausalLm + PlacedModel>(
    ckpt: &DistCheckpoint,
    trainer: &mut Trainer<M>,
) -> Result<TrainState, BridgeError> {
    let groups = trainer.process_groups().clone();
    let stages = layer_stages(trainer.model());
    if let Some((shard, optimizer)) = trainer.muon_parts_mut() {
        let model = shard.model_mut();
        let plan = model_plan(&groups.layout, &*model, stages)?;
        *model = load_model_state(ckpt, model.clone(), &plan, groups.rank)?;
        let dir = ckpt.dir().to_path_buf();
        let kind = muon::MUON_KIND;
        let mut masters = false;
        if load_adamw_state(
            ckpt,
            optimizer.adamw_mut(),
            &*model,
            &plan,
            groups.rank,
            kind,
        )? {
            let placed = model.placements(&plan, groups.rank, false)?;
            masters = muon::load_momentum(ckpt, optimizer.muon_mut(), &placed)?;
            // Both sides' parameters from their restored main weights (see restore_trainer).
            *model = optimizer
                .adamw_mut()
                .write_master_into(model.clone())
                .map_err(backend_error(&dir, "master"))?;
        }
        if masters {
            *model = optimizer
                .muon()
                .write_master_into(model.clone())
                .map_err(backend_error(&dir, "muon master"))?;
        } else {
            optimizer
                .muon_mut()
                .reset_master_from(&*model)
                .map_err(backend_error(&dir, "muon master"))?;
        }
        let step = optimizer.step_count();
        optimizer.muon_mut().set_step_count(step);
        return Ok(read_train_state(ckpt)?.unwrap_or(TrainState {
            step: ckpt.index().step,
            ..TrainState::default()
        }));
    }
    let (shard, optimizer) = trainer.parts_mut();
    let model = shard.model_mut();
    let plan = model_plan(&groups.layout, &*model, stages)?;
    *model = load_model_state(ckpt, model.clone(), &plan, groups.rank)?;
    let restored = load_optimizer_state(ckpt, optimizer, &*model, &plan, groups.rank)?;
    if optimizer.fp8_config().is_some() {
        *model = restore_fp8_weights(ckpt, optimizer, model.clone(), &plan, groups.rank)?;
    } else if restored {
        // The parameters the next step computes with: the restored main weights in the
        // parameters' dtype (a BF16 checkpoint's stored parameters are these already).
        *model = optimizer
            .write_master_into(model.clone())
            .map_err(backend_error(ckpt.dir(), "master"))?;
    }
    Ok(read_train_state(ckpt)?.unwrap_or(TrainState {
        step: ckpt.index().step,
        ..TrainState::default()
    }))
}

mod muon;

#[cfg(test)]
mod deepseek_tests;
#[cfg(test)]
mod tests;
