//! Muon's part of a training checkpoint ([`Trainer`](crate::train::Trainer) with
//! `TrainerConfig::muon`): the AdamW side is saved as any AdamW (`optim.master`,
//! `optim.exp_avg`, `optim.exp_avg_sq` of the non-Muon parameters) under the optimizer type
//! [`MUON_KIND`]; each Muon matrix adds its momentum as `optim.muon_momentum.<fqn>`, a tensor
//! of the parameter's global shape whose chunks are the parameters' own boxes, so it reshards
//! like the parameters, and its f32 master copy as `optim.muon_master.<fqn>` the same way (under
//! BF16 mixed precision the parameter is only the master rounded). A checkpoint without
//! `optim.muon_master` (written before they were saved, by f32 runs whose masters equal the
//! parameters) restores the masters from the parameters. Only [`MuonSharding::Replicated`] is
//! checkpointed (under `LayerWise` a parameter's momentum lives on its owner only).

use std::path::Path;

use moe_backend::optim::{DistributedMuon, MuonSharding, transpose_2d};
use serde_json::json;

use super::{OwnedChunk, backend_error};
use crate::checkpoint::placement::PlacedTensor;
use moe_bridge::BridgeError;
use moe_bridge::dist::TensorMeta;
use moe_bridge::dist::index::{OptimizerRecord, TensorKind};
use moe_bridge::dist::load::DistCheckpoint;
use moe_bridge::dist::region::TensorBox;
use moe_bridge::safetensors::{Dtype, OwnedTensor};

/// Optimizer type of a Muon + AdamW checkpoint.
pub const MUON_KIND: &str = "muon_adamw";

/// Checkpoint name of a Muon matrix's momentum.
pub fn momentum_fqn(fqn: &str) -> String {
    format!("optim.muon_momentum.{fqn}")
}

/// Checkpoint name of a Muon matrix's f32 master copy.
pub fn master_fqn(fqn: &str) -> String {
    format!("optim.muon_master.{fqn}")
}

fn check_sharding(muon: &DistributedMuon, path: &Path) -> Result<(), BridgeError> {
    if muon.config().sharding != MuonSharding::Replicated {
        return Err(BridgeError::TrainState {
            path: path.to_path_buf(),
            field: "optimizer".to_owned(),
            reason: "only Muon with replicated state (MuonSharding::Replicated) is stored in \
                     training checkpoints"
                .to_owned(),
        });
    }
    Ok(())
}

/// `values` of a parameter stored as `placed` in Burn's orientation, in the checkpoint's.
fn canonical(placed: &PlacedTensor, values: &[f32]) -> Vec<f32> {
    match placed.placement.shape.as_slice() {
        // Burn stores `[in, out]` = `[cols, rows]` of the canonical block.
        [rows, cols] if placed.placement.transposed => transpose_2d(values, *cols, *rows),
        _ => values.to_vec(),
    }
}

/// The momentum chunks of this rank's main-replica Muon parameters.
pub(super) fn momentum_chunks(
    muon: &DistributedMuon,
    placed: &[PlacedTensor],
    root: &Path,
) -> Result<Vec<OwnedChunk>, BridgeError> {
    check_sharding(muon, root)?;
    let mut out = Vec::new();
    for p in placed
        .iter()
        .filter(|p| p.main_replica && muon.contains(p.id))
    {
        let pl = &p.placement;
        let states = [
            (momentum_fqn(&pl.fqn), muon.momentum(p.id), "momentum"),
            (master_fqn(&pl.fqn), muon.master(p.id), "master copy"),
        ];
        for (fqn, values, what) in states {
            let values = values.ok_or_else(|| BridgeError::TrainState {
                path: root.to_path_buf(),
                field: fqn.clone(),
                reason: format!("this rank keeps no Muon {what} for it"),
            })?;
            out.push(OwnedChunk {
                meta: TensorMeta {
                    fqn: fqn.clone(),
                    kind: TensorKind::Optim,
                    dtype: Dtype::F32,
                    global_shape: pl.global_shape.clone(),
                    hf: Vec::new(),
                },
                offsets: pl.offsets.clone(),
                tensor: OwnedTensor::from_f32(fqn, pl.shape.clone(), &canonical(p, &values))?,
            });
        }
    }
    Ok(out)
}

/// `record` (the AdamW side's) as the record of the Muon + AdamW pair.
pub(super) fn record(mut record: OptimizerRecord, muon: &DistributedMuon) -> OptimizerRecord {
    let c = muon.config();
    record.kind = MUON_KIND.to_owned();
    record.hparams.insert(
        "muon".to_owned(),
        json!({
            "momentum": c.momentum,
            "nesterov": c.nesterov,
            "ns_steps": c.ns_steps,
            "weight_decay": c.weight_decay,
            "scale": format!("{:?}", c.scale),
        }),
    );
    for state in ["muon_momentum", "muon_master"] {
        record
            .state_dtypes
            .insert(state.to_owned(), Dtype::F32.as_str().to_owned());
    }
    record
}

/// Restores this rank's Muon momentum and master copies from `ckpt` (each Muon parameter's
/// own box of `optim.muon_momentum.<fqn>` and `optim.muon_master.<fqn>`, under any layout;
/// without the latter the masters are left as they are, the caller sets them from the
/// parameters). Returns whether the master copies were read.
pub(super) fn load_momentum(
    ckpt: &DistCheckpoint,
    muon: &mut DistributedMuon,
    placed: &[PlacedTensor],
) -> Result<bool, BridgeError> {
    let dir = ckpt.dir().to_path_buf();
    check_sharding(muon, &dir)?;
    let mine: Vec<&PlacedTensor> = placed.iter().filter(|p| muon.contains(p.id)).collect();
    let masters = mine.iter().all(|p| {
        ckpt.index()
            .tensors
            .contains_key(&master_fqn(&p.placement.fqn))
    });
    for p in mine {
        let pl = &p.placement;
        let read = |fqn: &str| -> Result<Vec<f32>, BridgeError> {
            let request = TensorBox::new(pl.offsets.clone(), pl.shape.clone());
            let t = ckpt.read_box_checked(fqn, &pl.global_shape, None, &request, false)?;
            let v = t.to_f32_vec()?;
            Ok(match pl.shape.as_slice() {
                [rows, cols] if pl.transposed => transpose_2d(&v, *rows, *cols),
                _ => v,
            })
        };
        let fqn = momentum_fqn(&pl.fqn);
        muon.set_momentum(p.id, &read(&fqn)?)
            .map_err(backend_error(&dir, &fqn))?;
        if masters {
            let fqn = master_fqn(&pl.fqn);
            muon.set_master(p.id, &read(&fqn)?)
                .map_err(backend_error(&dir, &fqn))?;
        }
    }
    Ok(masters)
}
