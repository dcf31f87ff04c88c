//! Canonical tensors from HF tensors and back (docs/checkpoints.md §Canonical names and sharding,
//! §Streaming conversion): per-expert HF tensors are stacked into `[E, 2, Im, H]` / `[E, H, Im]`,
//! fused HF tensors reshaped, and canonical tensors split into per-expert HF tensors for export.
//!
//! Stacked expert pieces are contiguous in the canonical layout (experts outer, parts inner), so
//! stacking and splitting are byte concatenation and byte slicing.

use std::collections::BTreeMap;
use std::ops::Range;

use super::registry::{ExpertLayout, Registry};
use super::rule::{HfTarget, ResolvedCanon};
use crate::BridgeError;
use crate::fp8::OutDtype;
use crate::hf::HfCheckpoint;
use crate::safetensors::{Dtype, OwnedTensor};

/// The canonical tensors HF tensors `names` produce, with the number of experts seen for
/// stacked ones (`Some(max expert index + 1)`, `None` for direct and fused tensors). Ignored and
/// unknown names are skipped.
pub fn canonical_tensors<'a>(
    registry: &Registry,
    names: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<String, Option<usize>> {
    let mut out: BTreeMap<String, Option<usize>> = BTreeMap::new();
    for name in names {
        let Some(resolved) = registry.hf_to_canon(name) else {
            continue;
        };
        match resolved.target {
            HfTarget::ExpertSlice { canon, expert, .. } => {
                let seen = out.entry(canon).or_insert(Some(0));
                *seen = Some(seen.unwrap_or(0).max(expert + 1));
            }
            HfTarget::Direct { canon, .. } | HfTarget::Fused { canon, .. } => {
                out.entry(canon).or_insert(None);
            }
            HfTarget::Ignored { .. } => {}
        }
    }
    out
}

fn resolve(
    ckpt: &HfCheckpoint,
    registry: &Registry,
    canon: &str,
    num_experts: usize,
    layout: ExpertLayout,
) -> Result<ResolvedCanon, BridgeError> {
    registry
        .canon_to_hf(canon, num_experts, layout)
        .ok_or_else(|| BridgeError::TensorNotFound {
            path: ckpt.dir().to_path_buf(),
            tensor: canon.to_owned(),
        })
}

/// Reads canonical tensor `canon` from `ckpt` (a checkpoint with `num_experts` routed experts
/// stored in `layout`), each HF tensor through the FP8 load hook
/// ([`HfCheckpoint::read_dequantized`] with `out`).
pub fn read_canonical(
    ckpt: &HfCheckpoint,
    registry: &Registry,
    canon: &str,
    num_experts: usize,
    layout: ExpertLayout,
    out: OutDtype,
) -> Result<OwnedTensor, BridgeError> {
    let resolved = resolve(ckpt, registry, canon, num_experts, layout)?;
    if resolved.pieces.iter().all(|p| p.expert.is_none()) {
        return read_whole(ckpt, canon, &resolved, out);
    }
    stack(ckpt, canon, &resolved, 0..num_experts, out)
}

/// Reads experts `experts` of a stacked canonical expert tensor: shape `[len, …]` (what one EP
/// rank owns), reading only those experts' HF tensors in the per-expert layout.
pub fn read_canonical_experts(
    ckpt: &HfCheckpoint,
    registry: &Registry,
    canon: &str,
    num_experts: usize,
    layout: ExpertLayout,
    experts: Range<usize>,
    out: OutDtype,
) -> Result<OwnedTensor, BridgeError> {
    let invalid = |reason: String| BridgeError::InvalidWrite {
        path: ckpt.dir().to_path_buf(),
        tensor: canon.to_owned(),
        reason,
    };
    if experts.start > experts.end || experts.end > num_experts {
        return Err(invalid(format!(
            "experts {experts:?} outside 0..{num_experts}"
        )));
    }
    let resolved = resolve(ckpt, registry, canon, num_experts, layout)?;
    if resolved.pieces.iter().any(|p| p.expert.is_some()) {
        return stack(ckpt, canon, &resolved, experts, out);
    }
    let whole = read_whole(ckpt, canon, &resolved, out)?;
    let Some((&total, inner)) = whole.shape.split_first() else {
        return Err(invalid("not an expert tensor".to_owned()));
    };
    if total != num_experts {
        return Err(BridgeError::ShapeMismatch {
            path: ckpt.dir().to_path_buf(),
            tensor: canon.to_owned(),
            expected: [&[num_experts][..], inner].concat(),
            actual: whole.shape.clone(),
        });
    }
    let per_expert = whole.bytes.len() / total.max(1);
    let bytes = whole.bytes[experts.start * per_expert..experts.end * per_expert].to_vec();
    let shape = [&[experts.len()][..], inner].concat();
    OwnedTensor::new(canon, whole.dtype, shape, bytes)
}

/// One HF tensor is the canonical tensor (direct, or fused and reshaped).
fn read_whole(
    ckpt: &HfCheckpoint,
    canon: &str,
    resolved: &ResolvedCanon,
    out: OutDtype,
) -> Result<OwnedTensor, BridgeError> {
    let [piece] = resolved.pieces.as_slice() else {
        return Err(BridgeError::TensorNotFound {
            path: ckpt.dir().to_path_buf(),
            tensor: canon.to_owned(),
        });
    };
    let mut t = ckpt.read_dequantized(&piece.hf, out)?;
    t.name = canon.to_owned();
    if let Some(parts) = resolved.split_parts {
        match t.shape.as_slice() {
            [e, fused, tail @ ..] if parts > 0 && fused % parts == 0 => {
                t.shape = [&[*e, parts, fused / parts][..], tail].concat();
            }
            _ => {
                return Err(BridgeError::Conversion {
                    path: ckpt.file_of(&piece.hf)?.to_path_buf(),
                    tensor: piece.hf.clone(),
                    dtype: t.dtype.to_string(),
                    reason: format!("shape {:?} cannot split dim 1 into {parts} parts", t.shape),
                });
            }
        }
    }
    Ok(t)
}

/// Stacks the per-expert pieces of experts `experts`.
fn stack(
    ckpt: &HfCheckpoint,
    canon: &str,
    resolved: &ResolvedCanon,
    experts: Range<usize>,
    out: OutDtype,
) -> Result<OwnedTensor, BridgeError> {
    let parts = resolved
        .pieces
        .iter()
        .filter(|p| p.expert == Some(0))
        .count()
        .max(1);
    let multi = resolved.pieces.iter().any(|p| p.part.is_some());
    let mut first: Option<(Dtype, Vec<usize>)> = None;
    let mut bytes = Vec::new();
    for piece in resolved
        .pieces
        .iter()
        .filter(|p| p.expert.is_some_and(|e| experts.contains(&e)))
    {
        let t = ckpt.read_dequantized(&piece.hf, out)?;
        match &first {
            None => first = Some((t.dtype, t.shape.clone())),
            Some((dtype, shape)) => {
                let view = ckpt.tensor(&piece.hf)?;
                if t.dtype != *dtype {
                    return Err(BridgeError::DtypeMismatch {
                        path: view.path.to_path_buf(),
                        tensor: piece.hf.clone(),
                        expected: dtype.to_string(),
                        actual: t.dtype.to_string(),
                    });
                }
                view.expect_shape(shape)?;
            }
        }
        bytes.extend_from_slice(&t.bytes);
    }
    let Some((dtype, piece_shape)) = first else {
        return Err(BridgeError::TensorNotFound {
            path: ckpt.dir().to_path_buf(),
            tensor: format!("{canon} (experts {experts:?})"),
        });
    };
    let mut shape = vec![experts.len()];
    if multi {
        shape.push(parts);
    }
    shape.extend_from_slice(&piece_shape);
    OwnedTensor::new(canon, dtype, shape, bytes)
}

/// Splits canonical tensor `tensor` into the HF tensors that make it up, in the per-expert
/// layout exporters write. Float tensors are cast to the rule's export dtype if it has one
/// (e.g. `e_score_correction_bias` → F32), else to `dtype` when given.
pub fn canonical_to_hf(
    registry: &Registry,
    tensor: &OwnedTensor,
    dtype: Option<Dtype>,
) -> Result<Vec<OwnedTensor>, BridgeError> {
    let num_experts = tensor.shape.first().copied().unwrap_or(0);
    let resolved = registry
        .canon_to_hf(&tensor.name, num_experts, ExpertLayout::PerExpert)
        .ok_or_else(|| BridgeError::TensorNotFound {
            path: crate::safetensors::MEMORY.into(),
            tensor: tensor.name.clone(),
        })?;
    let target = resolved.export_dtype.or(dtype);
    let is_float = matches!(
        tensor.dtype,
        Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64
    );
    let cast = |t: OwnedTensor| match target {
        Some(d) if is_float => t.cast(d),
        _ => Ok(t),
    };
    if let [piece] = resolved.pieces.as_slice()
        && piece.expert.is_none()
    {
        let mut t = tensor.clone();
        t.name = piece.hf.clone();
        return Ok(vec![cast(t)?]);
    }
    let parts = resolved
        .pieces
        .iter()
        .filter(|p| p.expert == Some(0))
        .count()
        .max(1);
    let multi = resolved.pieces.iter().any(|p| p.part.is_some());
    let inner = if multi { 2 } else { 1 };
    let shape_ok = tensor.shape.len() > inner && (!multi || tensor.shape[1] == parts);
    if !shape_ok || resolved.pieces.is_empty() {
        return Err(BridgeError::ShapeMismatch {
            path: crate::safetensors::MEMORY.into(),
            tensor: tensor.name.clone(),
            expected: [vec![num_experts], if multi { vec![parts] } else { vec![] }].concat(),
            actual: tensor.shape.clone(),
        });
    }
    let piece_shape = tensor.shape[inner..].to_vec();
    tensor.view().validate()?;
    let chunk = tensor.bytes.len() / resolved.pieces.len();
    resolved
        .pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let bytes = tensor.bytes[i * chunk..(i + 1) * chunk].to_vec();
            cast(OwnedTensor::new(
                piece.hf.clone(),
                tensor.dtype,
                piece_shape.clone(),
                bytes,
            )?)
        })
        .collect()
}
