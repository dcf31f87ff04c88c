//! The plan of a sync: which HF tensors travel, in which order, and where each one's pieces
//! lie (which pipeline stage holds it, how it is split over that stage's `tp` / expert `tp_ep`
//! ranks, and which box of the full tensor each piece fills).
//!
//! Every rank builds the same plan from the local HF entries of every pipeline stage (their
//! names, shapes and dtypes, exchanged over the `pp` group before any data moves). Under
//! pipeline parallelism each stage exports its own tensors under their global names (layers by
//! their global index, as [`crate::layers::LayerStack`] names them; the last stage's copy of an
//! embedding it shares with the first is a duplicate and is left out), and the stages' lists
//! are merged back into the order of [`crate::export::export_hf_tensors`] on the whole model:
//! what precedes the decoder layers (the embedding), the layers by global index, the final norm
//! and output layer, then what follows them (DeepSeek-V3's MTP layers `model.layers.{N+j}`).
//! The split of each tensor is the sharding table's ([`crate::families::shard_rule`]), as
//! Megatron-Core's distributed checkpoints and slime's / verl's Megatron weight exporters
//! read it.

use std::collections::HashMap;

use burn::tensor::DType;
use moe_bridge::dist::StagePlace;

use super::bucket::SyncedTensor;
use super::host::PieceBox;
use super::{ExpertNames, SyncOptions, WeightSyncError};
use crate::distributed::ShardRule;
use crate::export::{HfTensorSpec, keeps_f32};
use crate::families::shard_rule;
use crate::param_plan::hf_names::{self, ExpertProjections};
use crate::param_plan::{ParallelPlan, ReleaseLayout};

/// Which part of a layer's local expert tensors a synced tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertPart {
    /// The fused `gate_up_proj [E, 2·Im, H]`.
    FusedGateUp,
    /// The fused `down_proj [E, H, Im]`.
    FusedDown,
    /// Expert `e`'s `gate_proj [Im, H]`.
    Gate(usize),
    /// Expert `e`'s `up_proj [Im, H]`.
    Up(usize),
    /// Expert `e`'s `down_proj [H, Im]`.
    Down(usize),
    /// The fused gate/up bias `[E, 2·Im]` (rows `[gate; up]`, each split over ETP).
    FusedGateUpBias,
    /// A stacked `[E, …]` tensor replicated over ETP (e.g. an `fc2` bias): ETP rank 0 of each
    /// EP rank sends its local experts.
    EtpReplicated,
    /// A stacked expert tensor in its family's release layout (the receiver's HF export):
    /// each holder converts its local experts to the layout before sending.
    Release(ReleaseLayout),
}

/// How a synced tensor is split over the ranks of the stage holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Split {
    /// Every rank of the stage holds all of it; its `tp` rank 0 sends it.
    Replicated,
    /// One piece per `tp` rank, concatenated along `dim`.
    Tp { dim: usize },
    /// Routed experts, from the stage's expert `tp_ep` ranks.
    Experts { part: ExpertPart },
}

/// Where a synced tensor's pieces are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Source {
    /// The pipeline rank holding it.
    pub stage: usize,
    /// Its entry in that stage's local (fused) HF export.
    pub entry: usize,
    /// The shape of that entry (the same on every rank of the stage).
    pub local: Vec<usize>,
    /// How it is split.
    pub split: Split,
}

/// A group member's coordinates: its pipeline rank, and its `tp` rank (dense group) or
/// `(ep rank, etp rank)` (expert group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Coords {
    /// Pipeline rank.
    pub stage: usize,
    /// `tp` rank, or EP rank.
    pub a: usize,
    /// ETP rank (0 in the dense group).
    pub b: usize,
}

/// One piece of a tensor: how its holder cuts it from its local entry, and where it lands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Piece {
    /// `(dim, start, len)` narrowings of the local entry.
    pub narrow: Vec<(usize, usize, usize)>,
    /// Shape of the cut (what travels).
    pub shape: Vec<usize>,
    /// Its box in the synced tensor.
    pub bx: PieceBox,
    /// The release layout the holder converts its cut (of the local entry's shape) to before
    /// sending ([`ReleaseLayout::to_stored`]); `shape` is then the converted shape.
    pub release: Option<ReleaseLayout>,
}

/// The synced tensors (name, dtype, full shape) and where each comes from.
pub(super) type Plan = (Vec<(String, DType, Vec<usize>)>, Vec<Source>);

/// One stage's synced tensors: name, dtype, full shape, split and local entry.
type StagePlan = Vec<(String, DType, Vec<usize>, Split, usize)>;

/// The plan of the whole model from every pipeline stage's local entries (`stages[s]`: pipeline
/// rank `s`'s local fused export, the same on every rank of that stage), in the order of the
/// whole model's export (see the module docs). `family`: the synced model's own plan (its
/// per-expert projection names and release layouts); `release`: whether it streams its experts
/// in the family's release layout ([`streams_release`]).
pub(super) fn plan(
    stages: &[Vec<HfTensorSpec>],
    tp: usize,
    ep: usize,
    etp: usize,
    options: &SyncOptions,
    family: Option<&ParallelPlan>,
    release: bool,
) -> Result<Plan, WeightSyncError> {
    // (order key, name, dtype, shape, source)
    type Keyed = ((u8, usize, usize, usize), String, DType, Vec<usize>, Source);
    let mut all: Vec<Keyed> = Vec::new();
    let mut seen: HashMap<String, (DType, Vec<usize>)> = HashMap::new();
    for (stage, specs) in stages.iter().enumerate() {
        let keys = order_keys(specs);
        for (at, (name, dtype, shape, split, entry)) in
            stage_plan(specs, tp, ep, etp, options, family, release)?
                .into_iter()
                .enumerate()
        {
            if let Some((d, s)) = seen.get(&name) {
                // A copy another stage holds too (the last stage's embedding): the first
                // stage's is the one synced.
                if (*d, s) != (dtype, &shape) {
                    return Err(WeightSyncError::Layout {
                        name,
                        reason: format!(
                            "pipeline stage {stage} holds a {dtype:?} {shape:?} copy of a {d:?} \
                             {s:?} tensor of an earlier stage"
                        ),
                    });
                }
                continue;
            }
            seen.insert(name.clone(), (dtype, shape.clone()));
            let (group, layer) = keys[entry];
            let source = Source {
                stage,
                entry,
                local: specs[entry].shape.clone(),
                split,
            };
            all.push(((group, layer, stage, at), name, dtype, shape, source));
        }
    }
    // One stage: its own export order, whatever the model. Several: merged by the keys (a
    // layer lies on one stage, so ties keep a stage's own order).
    if stages.len() > 1 {
        all.sort_by_key(|k| k.0);
    }
    Ok(all
        .into_iter()
        .map(|(_, name, dtype, shape, source)| ((name, dtype, shape), source))
        .unzip())
}

/// The place of each local entry in the whole model's export order: `(0, 0)` before the
/// decoder layers, `(1, l)` decoder layer `l`, `(2, 0)` the final norm and output layer, `(3, l)`
/// layers named after them (MTP layers `N + j`, which a stage's export lists after its head).
fn order_keys(specs: &[HfTensorSpec]) -> Vec<(u8, usize)> {
    let mut after_head = false;
    specs
        .iter()
        .map(|s| match hf_names::stage_place(&s.name) {
            StagePlace::First => (0, 0),
            StagePlace::Layer(l) => (if after_head { 3 } else { 1 }, l),
            StagePlace::Last => {
                after_head = true;
                (2, 0)
            }
        })
        .collect()
}

/// The release layout of stacked expert tensor `name` in the synced model's own plan `plan`
/// ([`crate::export::ExportHf::export_plan`]), when its release does not store the canonical
/// tensor (what the HF export with per-expert names writes).
pub(super) fn release_layout(plan: Option<&ParallelPlan>, name: &str) -> Option<ReleaseLayout> {
    plan.filter(|p| p.has_release_layouts())
        .and_then(|p| p.release_layout(name))
}

/// The full canonical shape of a stacked expert tensor from its local entry `local` (local
/// experts times `ep`, the ETP-split dim `etp_dim` of the local entry times `etp`).
fn expert_full_shape(local: &[usize], ep: usize, etp: usize, etp_dim: Option<usize>) -> Vec<usize> {
    let mut shape = local.to_vec();
    if let Some(first) = shape.first_mut() {
        *first *= ep;
    }
    if let Some(d) = etp_dim.and_then(|d| shape.get_mut(d)) {
        *d *= etp;
    }
    shape
}

/// The dim of a local fused expert entry that ETP splits under `layout` (`None`: none):
/// the gate/up rows (dim 1) of `[L, 2·Im, H]` and `[L, 2·Im]`, the FFN columns (dim 2) of
/// `down_proj [L, H, Im]`.
fn release_etp_dim(layout: ReleaseLayout, rule: ShardRule) -> Option<usize> {
    match (layout, rule) {
        (_, ShardRule::ExpertReplicated) => None,
        (ReleaseLayout::InterleavedGateUp | ReleaseLayout::InterleavedGateUpBias, _) => Some(1),
        (_, ShardRule::Expert { .. }) => Some(2),
        _ => None,
    }
}

/// Whether a model whose local per-expert HF export lists `names` streams experts in its
/// family's release layout: it names a stacked expert tensor that its plan's (`plan`) release
/// layout covers (families without one list per-expert tensors there instead).
pub(super) fn streams_release<'a>(
    plan: Option<&ParallelPlan>,
    names: impl IntoIterator<Item = &'a str>,
) -> bool {
    names.into_iter().any(|n| release_layout(plan, n).is_some())
}

/// One stage's synced tensors from its local fused export (`family`: the model's own plan;
/// `release`: the family streams its release layout under per-expert names, [`streams_release`]; full shapes: TP splits times `tp`,
/// local experts times `ep`, expert FFN widths times `etp`).
fn stage_plan(
    local: &[HfTensorSpec],
    tp: usize,
    ep: usize,
    etp: usize,
    options: &SyncOptions,
    family: Option<&ParallelPlan>,
    release: bool,
) -> Result<StagePlan, WeightSyncError> {
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, split: Split, entry: usize| {
        let dtype = if keeps_f32(&name) {
            DType::F32
        } else {
            options.dtype.dtype()
        };
        out.push((name, dtype, shape, split, entry));
    };
    let bad = |name: &str, reason: String| WeightSyncError::Layout {
        name: name.to_owned(),
        reason,
    };
    let mut k = 0;
    while k < local.len() {
        let spec = &local[k];
        match shard_rule(&spec.name) {
            ShardRule::Replicated => {
                push(spec.name.clone(), spec.shape.clone(), Split::Replicated, k)
            }
            ShardRule::Tp { dim } => {
                let mut shape = spec.shape.clone();
                let extent = shape.get_mut(dim).ok_or_else(|| {
                    bad(
                        &spec.name,
                        format!("TP splits dim {dim} of {:?}", spec.shape),
                    )
                })?;
                *extent *= tp;
                push(spec.name.clone(), shape, Split::Tp { dim }, k);
            }
            rule @ (ShardRule::ExpertReplicated | ShardRule::Expert { .. })
                if release
                    && options.experts == ExpertNames::PerExpert
                    && let Some(layout) = release_layout(family, &spec.name) =>
            {
                // The release's stacked layout (the receiver's HF export): one tensor.
                let etp_dim = release_etp_dim(layout, rule);
                let canonical = expert_full_shape(&spec.shape, ep, etp, etp_dim);
                let shape = (layout.stored_shape(&spec.name, &canonical))
                    .map_err(|e| bad(&spec.name, e.to_string()))?;
                let part = match rule {
                    ShardRule::ExpertReplicated if layout == ReleaseLayout::Stacked => {
                        ExpertPart::EtpReplicated
                    }
                    _ => ExpertPart::Release(layout),
                };
                push(spec.name.clone(), shape, Split::Experts { part }, k);
            }
            ShardRule::ExpertReplicated => {
                let shape = expert_full_shape(&spec.shape, ep, etp, None);
                let part = ExpertPart::EtpReplicated;
                push(spec.name.clone(), shape, Split::Experts { part }, k);
            }
            ShardRule::Expert { etp_dim: 2 } if spec.shape.len() == 2 => {
                // A gated bias `[L, 2·Im]` (checkpoint `[E, 2, Im]`), stacked as HF's fused
                // names hold it (per-expert names of a family without a release layout for
                // it have no HF tensor to stream it as).
                if options.experts == ExpertNames::PerExpert {
                    return Err(bad(
                        &spec.name,
                        "a gated expert bias has no per-expert HF name in this family's plan"
                            .to_owned(),
                    ));
                }
                let shape = expert_full_shape(&spec.shape, ep, etp, Some(1));
                let part = ExpertPart::FusedGateUpBias;
                push(spec.name.clone(), shape, Split::Experts { part }, k);
            }
            ShardRule::Expert { etp_dim } => {
                let prefix = match hf_names::split_stacked(&spec.name) {
                    Some((prefix, true)) => prefix,
                    _ => {
                        return Err(bad(
                            &spec.name,
                            "expected the layer's stacked gate/up projection first".to_owned(),
                        ));
                    }
                };
                let down_name = hf_names::stacked_down(prefix);
                let down = local
                    .get(k + 1)
                    .filter(|s| s.name == down_name)
                    .ok_or_else(|| bad(&spec.name, format!("`{down_name}` does not follow")))?;
                let (&[l, two_iml, h], &[l2, h2, iml]) =
                    (spec.shape.as_slice(), down.shape.as_slice())
                else {
                    return Err(bad(
                        &spec.name,
                        format!("expert shapes {:?} / {:?}", spec.shape, down.shape),
                    ));
                };
                // The pieces below split the FFN width (canonical dim 2 of [E, 2, Im, H]).
                if etp_dim != 2 || l != l2 || h != h2 || two_iml != 2 * iml {
                    return Err(bad(
                        &spec.name,
                        format!(
                            "expert shapes {:?} / {:?} (ETP dim {etp_dim})",
                            spec.shape, down.shape
                        ),
                    ));
                }
                let (e, im) = (l * ep, iml * etp);
                let (gu, dn) = (k, k + 1);
                match options.experts {
                    ExpertNames::Fused => {
                        let part = ExpertPart::FusedGateUp;
                        push(
                            spec.name.clone(),
                            vec![e, 2 * im, h],
                            Split::Experts { part },
                            gu,
                        );
                        let part = ExpertPart::FusedDown;
                        push(down_name, vec![e, h, im], Split::Experts { part }, dn);
                    }
                    ExpertNames::PerExpert => {
                        // The family plan's names (Llama's for a model without a plan).
                        let projs =
                            family.map_or(ExpertProjections::LLAMA, |p| p.expert_projections());
                        for x in 0..e {
                            for (proj, entry, part, shape) in [
                                (projs.gate, gu, ExpertPart::Gate(x), vec![im, h]),
                                (projs.up, gu, ExpertPart::Up(x), vec![im, h]),
                                (projs.down, dn, ExpertPart::Down(x), vec![h, im]),
                            ] {
                                push(
                                    hf_names::expert_proj_weight(prefix, x, proj),
                                    shape,
                                    Split::Experts { part },
                                    entry,
                                );
                            }
                        }
                    }
                }
                k += 2;
                continue;
            }
        }
        k += 1;
    }
    Ok(out)
}

/// The piece of synced tensor `t` that the group member at `coords` holds (`None`: none),
/// given the holder's local entry shape (`source.local`).
pub(super) fn piece(
    t: &SyncedTensor,
    source: &Source,
    coords: Coords,
) -> Result<Option<Piece>, WeightSyncError> {
    let local = source.local.as_slice();
    let whole = || Piece {
        narrow: Vec::new(),
        shape: local.to_vec(),
        bx: PieceBox::whole(local),
        release: None,
    };
    let bad = || WeightSyncError::Layout {
        name: t.name.clone(),
        reason: format!("local shape {local:?} for a {:?} tensor", t.shape),
    };
    Ok(Some(match source.split {
        Split::Replicated => whole(),
        Split::Tp { dim } => {
            // `a` is the member's TP rank.
            let extent = *local.get(dim).ok_or_else(bad)?;
            let mut offsets = vec![0; local.len()];
            offsets[dim] = coords.a * extent;
            Piece {
                narrow: Vec::new(),
                shape: local.to_vec(),
                bx: PieceBox {
                    full: t.shape.clone(),
                    offsets,
                    shape: local.to_vec(),
                },
                release: None,
            }
        }
        Split::Experts {
            part:
                part
                @ (ExpertPart::FusedGateUpBias | ExpertPart::EtpReplicated | ExpertPart::Release(_)),
        } => {
            let (ep_rank, etp_rank) = (coords.a, coords.b);
            let l = *local.first().ok_or_else(bad)?;
            let mut offsets = vec![0; local.len()];
            offsets[0] = ep_rank * l;
            let (full, shape, release) = match part {
                ExpertPart::FusedGateUpBias => {
                    // `[E, 2·Im]` viewed as `[E, 2, Im]`: this rank's `Iml` rows of each half.
                    let &[_, two_iml] = local else {
                        return Err(bad());
                    };
                    let (e, im, iml) = (t.shape[0], t.shape[1] / 2, two_iml / 2);
                    return Ok(Some(Piece {
                        narrow: Vec::new(),
                        shape: local.to_vec(),
                        bx: PieceBox {
                            full: vec![e, 2, im],
                            offsets: vec![ep_rank * l, 0, etp_rank * iml],
                            shape: vec![l, 2, iml],
                        },
                        release: None,
                    }));
                }
                ExpertPart::EtpReplicated => {
                    if etp_rank != 0 {
                        return Ok(None);
                    }
                    (t.shape.clone(), local.to_vec(), None)
                }
                ExpertPart::Release(layout) => {
                    let stored = (layout.stored_shape(&t.name, local)).map_err(|e| {
                        WeightSyncError::Layout {
                            name: t.name.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                    // Interleaving is per FFN row, so an ETP rank's rows stay one contiguous
                    // range of the stored last dim (gate/up) or of dim 1 (`down_proj`).
                    match layout {
                        ReleaseLayout::InterleavedGateUp | ReleaseLayout::InterleavedGateUpBias => {
                            let last = stored.len() - 1;
                            offsets[last] = etp_rank * stored[last];
                        }
                        ReleaseLayout::InputMajorExperts => offsets[1] = etp_rank * stored[1],
                        ReleaseLayout::Stacked => {
                            // Any dim the full tensor has more of than the holder is ETP's.
                            for d in 1..local.len() {
                                if t.shape.get(d).is_some_and(|&f| f > local[d]) {
                                    offsets[d] = etp_rank * local[d];
                                }
                            }
                        }
                    }
                    (t.shape.clone(), stored, Some(layout))
                }
                _ => return Err(bad()),
            };
            Piece {
                narrow: Vec::new(),
                shape: shape.clone(),
                bx: PieceBox {
                    full,
                    offsets,
                    shape,
                },
                release,
            }
        }
        Split::Experts { part } => {
            // `(a, b)` = the member's (EP rank, ETP rank); `L` local experts of `iml` rows.
            let (ep_rank, etp_rank) = (coords.a, coords.b);
            let &[l, d1, d2] = local else {
                return Err(bad());
            };
            match part {
                ExpertPart::FusedGateUp => {
                    let (iml, h) = (d1 / 2, d2);
                    let (e, im) = (t.shape[0], t.shape[1] / 2);
                    Piece {
                        narrow: Vec::new(),
                        shape: local.to_vec(),
                        bx: PieceBox {
                            full: vec![e, 2, im, h],
                            offsets: vec![ep_rank * l, 0, etp_rank * iml, 0],
                            shape: vec![l, 2, iml, h],
                        },
                        release: None,
                    }
                }
                ExpertPart::FusedDown => Piece {
                    narrow: Vec::new(),
                    shape: local.to_vec(),
                    bx: PieceBox {
                        full: t.shape.clone(),
                        offsets: vec![ep_rank * l, 0, etp_rank * d2],
                        shape: local.to_vec(),
                    },
                    release: None,
                },
                ExpertPart::Gate(x) | ExpertPart::Up(x) => {
                    if x / l != ep_rank {
                        return Ok(None);
                    }
                    let (iml, h) = (d1 / 2, d2);
                    let rows = if matches!(part, ExpertPart::Gate(_)) {
                        0
                    } else {
                        iml
                    };
                    Piece {
                        narrow: vec![(0, x % l, 1), (1, rows, iml)],
                        shape: vec![1, iml, h],
                        bx: PieceBox {
                            full: t.shape.clone(),
                            offsets: vec![etp_rank * iml, 0],
                            shape: vec![iml, h],
                        },
                        release: None,
                    }
                }
                ExpertPart::FusedGateUpBias
                | ExpertPart::EtpReplicated
                | ExpertPart::Release(_) => return Err(bad()),
                ExpertPart::Down(x) => {
                    if x / l != ep_rank {
                        return Ok(None);
                    }
                    let (h, iml) = (d1, d2);
                    Piece {
                        narrow: vec![(0, x % l, 1)],
                        shape: vec![1, h, iml],
                        bx: PieceBox {
                            full: t.shape.clone(),
                            offsets: vec![0, etp_rank * iml],
                            shape: vec![h, iml],
                        },
                        release: None,
                    }
                }
            }
        }
    }))
}

/// The dtypes a local entry can have, by their code in [`encode_specs`].
const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// `specs` as bytes (JSON `[[name, shape, dtype code], …]`), to exchange with the other
/// pipeline stages.
pub(super) fn encode_specs(specs: &[HfTensorSpec]) -> Result<Vec<u8>, WeightSyncError> {
    let rows = specs
        .iter()
        .map(|s| {
            let code = DTYPES.iter().position(|&d| d == s.dtype).ok_or_else(|| {
                WeightSyncError::UnsupportedDtype {
                    name: s.name.clone(),
                    dtype: s.dtype,
                }
            })?;
            Ok((s.name.as_str(), s.shape.as_slice(), code))
        })
        .collect::<Result<Vec<_>, WeightSyncError>>()?;
    serde_json::to_vec(&rows).map_err(|e| {
        WeightSyncError::Unsupported(format!("the local tensor list cannot be encoded: {e}"))
    })
}

/// The specs [`encode_specs`] encoded (`stage` names the sender in errors).
pub(super) fn decode_specs(
    bytes: &[u8],
    stage: usize,
) -> Result<Vec<HfTensorSpec>, WeightSyncError> {
    let bad = |reason: String| {
        WeightSyncError::Unsupported(format!(
            "the tensor list of pipeline stage {stage} is unreadable: {reason}"
        ))
    };
    let rows: Vec<(String, Vec<usize>, usize)> =
        serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    rows.into_iter()
        .map(|(name, shape, code)| {
            let dtype = *DTYPES
                .get(code)
                .ok_or_else(|| bad(format!("dtype code {code} of `{name}`")))?;
            Ok(HfTensorSpec { name, shape, dtype })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize]) -> HfTensorSpec {
        HfTensorSpec {
            name: name.to_owned(),
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }

    fn layer(l: usize) -> [HfTensorSpec; 2] {
        [
            spec(&format!("model.layers.{l}.input_layernorm.weight"), &[4]),
            spec(
                &format!("model.layers.{l}.self_attn.q_proj.weight"),
                &[6, 4],
            ),
        ]
    }

    /// Two pipeline ranks of an interleaved split (rank 0: layers 0 and 2, rank 1: layers 1
    /// and 3 with the head, a copy of the embedding and an MTP layer 4), under `tp = 2`.
    fn stages() -> Vec<Vec<HfTensorSpec>> {
        let embed = spec("model.embed_tokens.weight", &[8, 4]);
        let mut first = vec![embed.clone()];
        first.extend(layer(0));
        first.extend(layer(2));
        let mut last = vec![embed];
        last.extend(layer(1));
        last.extend(layer(3));
        last.push(spec("model.norm.weight", &[4]));
        last.push(spec("lm_head.weight", &[8, 4]));
        last.extend(layer(4));
        vec![first, last]
    }

    #[test]
    fn stages_merge_into_the_export_order() {
        let options = SyncOptions {
            dtype: super::super::SyncDtype::F32,
            ..SyncOptions::default()
        };
        let (tensors, sources) = plan(&stages(), 2, 1, 1, &options, None, false).unwrap();
        let mut want: Vec<(String, Vec<usize>, usize, usize)> =
            vec![("model.embed_tokens.weight".into(), vec![16, 4], 0, 0)];
        // Layer l's entries: rank l % 2, local layer l / 2 after the embedding.
        for l in 0..4 {
            let entry = 1 + 2 * (l / 2);
            for (k, s) in layer(l).iter().enumerate() {
                let full = if k == 0 { vec![4] } else { vec![12, 4] };
                want.push((s.name.clone(), full, l % 2, entry + k));
            }
        }
        want.push(("model.norm.weight".into(), vec![4], 1, 5));
        want.push(("lm_head.weight".into(), vec![16, 4], 1, 6));
        want.push((
            "model.layers.4.input_layernorm.weight".into(),
            vec![4],
            1,
            7,
        ));
        want.push((
            "model.layers.4.self_attn.q_proj.weight".into(),
            vec![12, 4],
            1,
            8,
        ));
        let got: Vec<(String, Vec<usize>, usize, usize)> = tensors
            .iter()
            .zip(&sources)
            .map(|((n, _, s), src)| (n.clone(), s.clone(), src.stage, src.entry))
            .collect();
        assert_eq!(got, want);
        // Local shapes and splits are the holder's.
        let q3 = &sources[got
            .iter()
            .position(|g| g.0.contains("3.self_attn"))
            .unwrap()];
        assert_eq!(q3.local, [6, 4]);
        assert_eq!(q3.split, Split::Tp { dim: 0 });
    }

    #[test]
    fn a_copy_of_another_shape_is_refused_naming_it() {
        let mut stages = stages();
        stages[1][0].shape = vec![9, 4];
        let err = plan(&stages, 1, 1, 1, &SyncOptions::default(), None, false).unwrap_err();
        assert!(
            matches!(&err, WeightSyncError::Layout { name, .. } if name == "model.embed_tokens.weight"),
            "{err}"
        );
        assert!(err.to_string().contains("pipeline stage 1"), "{err}");
    }

    #[test]
    fn specs_round_trip_and_bad_lists_are_refused() {
        let mut specs = stages().remove(1);
        specs[2].dtype = DType::BF16;
        let bytes = encode_specs(&specs).unwrap();
        assert_eq!(decode_specs(&bytes, 1).unwrap(), specs);
        let err = decode_specs(&bytes[..bytes.len() - 1], 3).unwrap_err();
        assert!(err.to_string().contains("pipeline stage 3"), "{err}");
        let err = decode_specs(br#"[["x", [2], 9]]"#, 1).unwrap_err();
        assert!(err.to_string().contains("dtype code 9 of `x`"), "{err}");
        specs[0].dtype = DType::I64;
        assert!(matches!(
            encode_specs(&specs),
            Err(WeightSyncError::UnsupportedDtype { .. })
        ));
    }
}
