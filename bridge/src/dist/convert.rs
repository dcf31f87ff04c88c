//! Streaming conversion between HF checkpoints and distributed checkpoints
//! (docs/checkpoints.md §Streaming conversion).
//!
//! HF → distributed ([`convert_hf_to_dist`]): canonical tensors are processed one at a time in
//! sorted order. Each HF tensor feeding one (a whole tensor, or one expert's `gate_proj` /
//! `up_proj` / `down_proj`) is read on its own — with `pread` rather than through a mapping, so
//! resident memory stays bounded by that tensor — and its overlap with every main-replica chunk
//! of the target layout is written at the chunk's offsets in the virtual ranks' files. Blockwise
//! FP8 weights keep their bytes and gain a `<fqn>_scale_inv` companion ([`super::fp8`]), or,
//! with [`ConvertOptions::keep_fp8`] off, pass through the FP8 load hook (BF16). A stacked
//! expert tensor is never materialised: peak memory is about one HF tensor plus one chunk-sized
//! overlap.
//!
//! Distributed → HF ([`export_dist_to_hf`]): every HF tensor (per expert for stacked experts)
//! is read as the global sub-box it maps to from the overlapping chunks, cast (FP8 weights:
//! dequantised, or kept with their scales) to the export dtype, and handed to the HF shard writer, which writes each shard as soon as it is full.
//!
//! Distributed → distributed ([`reshard`]): each chunk of the new layout is read from the
//! overlapping stored chunks and written, one chunk at a time.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use moe_backend::parallel::ParallelLayout;
use serde_json::Value;

use super::files::TensorMeta;
use super::fp8::{scale_fqn, weight_of_scale};
use super::index::{Fp8Record, TensorEntry, TensorKind};
use super::load::DistCheckpoint;
use super::region::TensorBox;
use super::save::{OfflineWriter, SaveMeta};
use super::sharding::ShardingPlan;
use crate::BridgeError;
use crate::export::{
    ExportOptions, ExportSummary, Mxfp4Export, Mxfp4Part, default_generation_config, export_config,
    mxfp4_outputs,
};
use crate::fp8::{OutDtype, scale_inv_name, scale_shape, should_dequantize};
use crate::hf::{CONFIG_FILE, GENERATION_CONFIG_FILE, HfCheckpoint, read_json};
use crate::mapping::{ExpertLayout, Registry, canonical_tensors};
use crate::safetensors::{Dtype, HfDirWriter, OwnedTensor, ShardPlan, TensorView};
use crate::schema::ModelSchema;

/// Progress of a conversion, reported after each canonical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertProgress {
    /// The tensor just written.
    pub tensor: String,
    /// Canonical tensors done so far.
    pub done: usize,
    /// Canonical tensors in total.
    pub total: usize,
    /// Bytes written so far.
    pub bytes: u64,
    /// Bytes to write in total.
    pub total_bytes: u64,
}

/// One HF tensor feeding a canonical tensor: its name and the canonical box it fills.
#[derive(Debug, Clone)]
struct Piece {
    hf: String,
    region: TensorBox,
}

/// A canonical tensor the release stores whole under another layout or as an MXFP4 pair: read
/// whole (decoded), converted by [`ModelSchema::release_to_canonical`], written as one box.
#[derive(Debug, Clone)]
struct ReleaseSource {
    /// The HF tensor (the MXFP4 pair's base name).
    hf: String,
    /// Its shape as the release stores it (an MXFP4 pair: the decoded parameter's).
    stored: Vec<usize>,
    /// Stored as an MXFP4 pair (`<hf>_blocks`, `<hf>_scales`).
    mxfp4: bool,
}

/// A canonical tensor and the HF tensors it is made of.
#[derive(Debug, Clone)]
struct CanonSource {
    meta: TensorMeta,
    pieces: Vec<Piece>,
    /// Read whole and converted rather than copied piece by piece.
    release: Option<ReleaseSource>,
}

/// Options of [`convert_hf_to_dist_opts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertOptions {
    /// Step recorded in the checkpoint.
    pub step: u64,
    /// Keep blockwise FP8 weights as their FP8 bytes plus `<fqn>_scale_inv` tensors
    /// ([`super::fp8`]; the default), or dequantise them to BF16 (`false`).
    pub keep_fp8: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self {
            step: 0,
            keep_fp8: true,
        }
    }
}

/// The dtype an HF tensor is stored with: scaled FP8 weights stay FP8 with `keep_fp8`, else the
/// FP8 load hook dequantises them (and value-casts unscaled FP8 tensors) to BF16.
fn hooked_dtype(ckpt: &HfCheckpoint, name: &str, stored: Dtype, keep_fp8: bool) -> Dtype {
    let scaled = should_dequantize(stored, ckpt.contains(&scale_inv_name(name)));
    if scaled && keep_fp8 {
        stored
    } else if scaled || matches!(stored, Dtype::F8E4M3 | Dtype::F8E5M2) {
        Dtype::BF16
    } else {
        stored
    }
}

/// The release source of canonical tensor `canon` resolved to the single whole HF tensor `hf`,
/// when the release stores it in another layout ([`ModelSchema::release_canonical_shape`]) or as
/// an MXFP4 pair; `None` when the HF tensor is the canonical one. Decoded MXFP4 values are
/// BF16-exact (an E2M1 code times a power of two) and stored as BF16; a release-layout tensor
/// keeps its float dtype (an FP8 one is dequantised to BF16).
fn plan_release<C: ModelSchema>(
    ckpt: &HfCheckpoint,
    schema: &C,
    canon: &str,
    hf: &str,
) -> Result<Option<CanonSource>, BridgeError> {
    let mxfp4 = !ckpt.contains(hf) && ckpt.is_mxfp4(hf);
    let (stored, dtype) = if mxfp4 {
        (ckpt.mxfp4_param_shape(hf)?, Dtype::BF16)
    } else {
        let info = ckpt.info(hf)?;
        (
            info.shape.clone(),
            hooked_dtype(ckpt, hf, info.dtype, false),
        )
    };
    let canonical = schema.release_canonical_shape(hf, &stored)?;
    if canonical.is_none() && !mxfp4 {
        return Ok(None);
    }
    let shape = canonical.unwrap_or_else(|| stored.clone());
    let meta = TensorMeta {
        fqn: canon.to_owned(),
        kind: TensorKind::Param,
        dtype,
        global_shape: shape.clone(),
        hf: vec![hf.to_owned()],
    };
    let pieces = vec![Piece {
        hf: hf.to_owned(),
        region: TensorBox::full(&shape),
    }];
    let release = Some(ReleaseSource {
        hf: hf.to_owned(),
        stored,
        mxfp4,
    });
    Ok(Some(CanonSource {
        meta,
        pieces,
        release,
    }))
}

/// Reads release source `r` of canonical tensor `meta` and returns the canonical tensor's
/// bytes in its stored dtype.
fn read_release<C: ModelSchema>(
    ckpt: &HfCheckpoint,
    schema: &C,
    meta: &TensorMeta,
    r: &ReleaseSource,
) -> Result<Vec<u8>, BridgeError> {
    let (shape, values) = if r.mxfp4 {
        ckpt.read_mxfp4_param(&r.hf)?
    } else {
        ckpt.read_f32(&r.hf)?
    };
    if shape != r.stored {
        return Err(BridgeError::Conversion {
            path: ckpt.dir().to_path_buf(),
            tensor: r.hf.clone(),
            dtype: meta.dtype.to_string(),
            reason: format!("read shape {shape:?}, planned {:?}", r.stored),
        });
    }
    let values = schema
        .release_to_canonical(&r.hf, &shape, &values)?
        .unwrap_or(values);
    let t = OwnedTensor::from_f32(meta.fqn.clone(), meta.global_shape.clone(), &values)?;
    Ok(t.cast(meta.dtype)?.bytes)
}

/// Resolves canonical tensor `canon` to its HF pieces, global shape and dtype.
fn plan_source<C: ModelSchema>(
    ckpt: &HfCheckpoint,
    schema: &C,
    registry: &Registry,
    canon: &str,
    num_experts: Option<usize>,
    layout: ExpertLayout,
    keep_fp8: bool,
) -> Result<CanonSource, BridgeError> {
    let resolved = registry
        .canon_to_hf(canon, num_experts.unwrap_or(0), layout)
        .ok_or_else(|| BridgeError::TensorNotFound {
            path: ckpt.dir().to_path_buf(),
            tensor: canon.to_owned(),
        })?;
    let mismatch = |hf: &str, reason: String| BridgeError::Conversion {
        path: ckpt.dir().to_path_buf(),
        tensor: hf.to_owned(),
        dtype: String::new(),
        reason,
    };
    let Some(first) = resolved.pieces.first() else {
        return Err(mismatch(canon, "no HF tensors map to it".to_owned()));
    };
    if let [only] = resolved.pieces.as_slice()
        && only.expert.is_none()
        && resolved.split_parts.is_none()
        && let Some(source) = plan_release(ckpt, schema, canon, &only.hf)?
    {
        return Ok(source);
    }
    let info = ckpt.info(&first.hf)?;
    let dtype = hooked_dtype(ckpt, &first.hf, info.dtype, keep_fp8);
    let piece_shape = info.shape.clone();
    if first.expert.is_none() {
        let mut shape = piece_shape.clone();
        if let Some(parts) = resolved.split_parts {
            shape = match piece_shape.as_slice() {
                [e, fused, tail @ ..] if parts > 0 && fused % parts == 0 => {
                    [&[*e, parts, fused / parts][..], tail].concat()
                }
                _ => {
                    return Err(mismatch(
                        &first.hf,
                        format!("shape {piece_shape:?} cannot split dim 1 into {parts}"),
                    ));
                }
            };
        }
        let meta = TensorMeta {
            fqn: canon.to_owned(),
            kind: TensorKind::Param,
            dtype,
            global_shape: shape.clone(),
            hf: vec![first.hf.clone()],
        };
        let pieces = vec![Piece {
            hf: first.hf.clone(),
            region: TensorBox::full(&shape),
        }];
        return Ok(CanonSource {
            meta,
            pieces,
            release: None,
        });
    }
    let multi = resolved.pieces.iter().any(|p| p.part.is_some());
    let parts = resolved
        .pieces
        .iter()
        .filter(|p| p.expert == Some(0))
        .count();
    let experts = num_experts.unwrap_or(0);
    let mut global = vec![experts];
    if multi {
        global.push(parts);
    }
    global.extend_from_slice(&piece_shape);
    let mut pieces = Vec::with_capacity(resolved.pieces.len());
    for p in &resolved.pieces {
        let info = ckpt.info(&p.hf)?;
        let d = hooked_dtype(ckpt, &p.hf, info.dtype, keep_fp8);
        if info.shape != piece_shape || d != dtype {
            return Err(mismatch(
                &p.hf,
                format!(
                    "{d} {:?} differs from expert 0's {dtype} {piece_shape:?}",
                    info.shape
                ),
            ));
        }
        let mut offsets = vec![p.expert.unwrap_or(0)];
        let mut shape = vec![1];
        if multi {
            offsets.push(p.part.unwrap_or(0));
            shape.push(1);
        }
        offsets.extend(std::iter::repeat_n(0, piece_shape.len()));
        shape.extend_from_slice(&piece_shape);
        pieces.push(Piece {
            hf: p.hf.clone(),
            region: TensorBox::new(offsets, shape),
        });
    }
    let hf = resolved
        .pieces
        .iter()
        .filter(|p| p.expert == Some(0))
        .map(|p| p.hf.replacen(".experts.0.", ".experts.*.", 1))
        .collect();
    let meta = TensorMeta {
        fqn: canon.to_owned(),
        kind: TensorKind::Param,
        dtype,
        global_shape: global,
        hf,
    };
    Ok(CanonSource {
        meta,
        pieces,
        release: None,
    })
}

/// The companion `<canon>_scale_inv` of a canonical tensor kept in FP8: one HF scale per HF
/// piece, at the piece's leading offsets, checked against the block grid of the piece.
fn plan_scale(
    ckpt: &HfCheckpoint,
    source: &CanonSource,
    block: [usize; 2],
) -> Result<Option<CanonSource>, BridgeError> {
    let Some(first) = source.pieces.first() else {
        return Ok(None);
    };
    if source.meta.dtype.size() != 1 || !ckpt.contains(&scale_inv_name(&first.hf)) {
        return Ok(None);
    }
    let fail = |hf: &str, dtype: String, reason: String| BridgeError::Conversion {
        path: ckpt.dir().to_path_buf(),
        tensor: hf.to_owned(),
        dtype,
        reason,
    };
    let fqn = &source.meta.fqn;
    let global = scale_shape(&source.meta.global_shape, block).ok_or_else(|| {
        fail(
            fqn,
            String::new(),
            "an FP8 weight needs rank ≥ 2".to_owned(),
        )
    })?;
    let mut pieces = Vec::with_capacity(source.pieces.len());
    let mut dtype = None;
    for p in &source.pieces {
        let name = scale_inv_name(&p.hf);
        let weight = ckpt.info(&p.hf)?;
        let info = ckpt.info(&name)?;
        let expected = scale_shape(&weight.shape, block).unwrap_or_default();
        if info.shape != expected {
            return Err(fail(
                &name,
                info.dtype.to_string(),
                format!(
                    "shape {:?}, expected {expected:?} for {:?} in {block:?} blocks",
                    info.shape, weight.shape
                ),
            ));
        }
        if *dtype.get_or_insert(info.dtype) != info.dtype {
            return Err(fail(
                &name,
                info.dtype.to_string(),
                "differs from the dtype of the other scales of the tensor".to_owned(),
            ));
        }
        // The piece fills the weight box at `offsets`; its trailing dims are the whole HF
        // matrix, so the scale piece sits at the same leading offsets.
        let lead = p.region.offsets.len().saturating_sub(expected.len());
        if p.region.shape[lead..] != weight.shape[..] {
            return Err(fail(
                &p.hf,
                weight.dtype.to_string(),
                "a fused FP8 tensor split into parts cannot be kept in FP8 (convert with \
                 dequantisation)"
                    .to_owned(),
            ));
        }
        let mut offsets = p.region.offsets[..lead].to_vec();
        offsets.extend(std::iter::repeat_n(0, expected.len()));
        let mut shape = p.region.shape[..lead].to_vec();
        shape.extend_from_slice(&expected);
        pieces.push(Piece {
            hf: name,
            region: TensorBox::new(offsets, shape),
        });
    }
    let meta = TensorMeta {
        fqn: scale_fqn(fqn),
        kind: TensorKind::Scale,
        dtype: dtype.unwrap_or(Dtype::F32),
        global_shape: global,
        hf: source.meta.hf.iter().map(|h| scale_inv_name(h)).collect(),
    };
    Ok(Some(CanonSource {
        meta,
        pieces,
        release: None,
    }))
}

/// Reads HF tensors with positioned reads (no mapping stays resident), keeping files open.
struct PieceReader<'a> {
    ckpt: &'a HfCheckpoint,
    files: BTreeMap<PathBuf, File>,
    keep_fp8: bool,
}

impl PieceReader<'_> {
    /// The bytes of HF tensor `name` after the FP8 hook.
    fn read(&mut self, name: &str) -> Result<Vec<u8>, BridgeError> {
        let info = self.ckpt.info(name)?;
        if hooked_dtype(self.ckpt, name, info.dtype, self.keep_fp8) != info.dtype {
            return Ok(self.ckpt.read_dequantized(name, OutDtype::BF16)?.bytes);
        }
        let shard = self.ckpt.shard_for(name)?;
        let range = shard
            .header()
            .byte_range(name)
            .ok_or_else(|| BridgeError::TensorNotFound {
                path: shard.path().to_path_buf(),
                tensor: name.to_owned(),
            })?;
        let path = shard.path().to_path_buf();
        let io = |source| BridgeError::Io {
            path: path.clone(),
            source,
        };
        let file = match self.files.entry(path.clone()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(File::open(&path).map_err(io)?)
            }
        };
        let mut bytes = vec![0u8; range.len()];
        file.seek(SeekFrom::Start(range.start as u64)).map_err(io)?;
        file.read_exact(&mut bytes).map_err(io)?;
        Ok(bytes)
    }
}

/// Converts the HF checkpoint in `hf_dir` (a model whose config is `C`) to a distributed
/// checkpoint of step 0 under `layout` in `out_root` (see the module docs); returns the
/// `iter_*` directory.
pub fn convert_hf_to_dist<C: ModelSchema>(
    hf_dir: &Path,
    out_root: &Path,
    layout: &ParallelLayout,
) -> Result<PathBuf, BridgeError> {
    convert_hf_to_dist_with::<C>(hf_dir, out_root, layout, 0, &mut |_| {})
}

/// [`convert_hf_to_dist`] with the step to record and a progress callback (FP8 weights kept
/// in FP8).
pub fn convert_hf_to_dist_with<C: ModelSchema>(
    hf_dir: &Path,
    out_root: &Path,
    layout: &ParallelLayout,
    step: u64,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<PathBuf, BridgeError> {
    let opts = ConvertOptions {
        step,
        ..ConvertOptions::default()
    };
    convert_hf_to_dist_opts::<C>(hf_dir, out_root, layout, &opts, progress)
}

/// [`convert_hf_to_dist`] with [`ConvertOptions`] and a progress callback.
pub fn convert_hf_to_dist_opts<C: ModelSchema>(
    hf_dir: &Path,
    out_root: &Path,
    layout: &ParallelLayout,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<PathBuf, BridgeError> {
    convert_hf_to_dist_report::<C>(hf_dir, out_root, layout, opts, progress).map(|r| r.dir)
}

/// What [`convert_hf_to_dist_report`] wrote, and what it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertReport {
    /// The new `iter_*` directory.
    pub dir: PathBuf,
    /// Source tensors the model does not use, not converted (as transformers ignores them).
    pub unused: Vec<String>,
    /// Validation warnings for the user ([`HfCheckpoint::check`]).
    pub warnings: Vec<String>,
}

/// [`convert_hf_to_dist_opts`] returning the validation warnings too.
///
/// The source is validated against its `config.json` before anything is written
/// ([`HfCheckpoint::check`]: typed config, unambiguous shards, every implied tensor present
/// with its shape and a float or scaled-FP8 dtype); on failure `out_root` is left untouched.
/// Tensors the model does not use are skipped with a warning.
pub fn convert_hf_to_dist_report<C: ModelSchema>(
    hf_dir: &Path,
    out_root: &Path,
    layout: &ParallelLayout,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<ConvertReport, BridgeError> {
    let step = opts.step;
    let ckpt = HfCheckpoint::open(hf_dir)?;
    let report = ckpt.check::<C>()?;
    let config_path = ckpt.dir().join(CONFIG_FILE);
    let config = ckpt.config_json()?;
    let registry = C::registry_of(&config, &config_path)?;
    let expert_layout = report.expert_layout.unwrap_or(ExpertLayout::PerExpert);
    let used = ckpt.tensor_names().filter(|n| !report.unused.contains(*n));
    let mut canon = canonical_tensors(&registry, used);
    // MXFP4 pairs (their `_blocks` / `_scales` names ignored by the rules) feed the canonical
    // tensor their base name maps to.
    let packed: Vec<&str> = (ckpt.tensor_names())
        .filter_map(|n| n.strip_suffix(crate::mxfp4::BLOCKS_SUFFIX))
        .filter(|base| !ckpt.contains(base) && ckpt.is_mxfp4(base))
        .collect();
    for base in packed {
        if let Some(crate::mapping::ResolvedHf {
            target: crate::mapping::HfTarget::Direct { canon: name, .. },
            ..
        }) = registry.hf_to_canon(base)
        {
            canon.entry(name).or_insert(None);
        }
    }
    let mut sources = canon
        .iter()
        .map(|(name, experts)| {
            plan_source(
                &ckpt,
                &report.config,
                &registry,
                name,
                *experts,
                expert_layout,
                opts.keep_fp8,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let block = ckpt.fp8_block_size()?;
    let mut scales = Vec::new();
    if opts.keep_fp8 {
        for source in &sources {
            scales.extend(plan_scale(&ckpt, source, block)?);
        }
    }
    let kept_fp8 = !scales.is_empty();
    sources.extend(scales);
    let plan = ShardingPlan::new(
        layout,
        Some(report.config.num_layers()),
        C::shard_rule,
        C::stage_place,
    )?;
    let dequantized = !kept_fp8
        && (ckpt.tensor_names().any(crate::fp8::is_scale_inv)
            || config.get("quantization_config").is_some());
    let mut meta = SaveMeta::new(step, layout);
    if kept_fp8 {
        let format = config
            .get("quantization_config")
            .and_then(|q| q.get("fmt"))
            .and_then(Value::as_str)
            .unwrap_or("e4m3");
        meta.fp8 = Some(Fp8Record {
            format: format.to_owned(),
            weight_block_size: block,
            pow2_scales: false,
        });
    }
    meta.model_family = config
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_owned);
    meta.config = Some(export_config(
        &config,
        dequantized.then_some(Dtype::BF16),
        dequantized,
    ));
    if let Some(generation) = ckpt.generation_config_json()? {
        meta.extra_json
            .insert(GENERATION_CONFIG_FILE.to_owned(), generation);
    }
    let metas: Vec<TensorMeta> = sources.iter().map(|s| s.meta.clone()).collect();
    let total_bytes: u64 = metas
        .iter()
        .map(|m| (m.global_shape.iter().product::<usize>() * m.dtype.size()) as u64)
        .sum();
    let mut writer = OfflineWriter::create(out_root, meta, &plan, &metas)?;
    let mut reader = PieceReader {
        ckpt: &ckpt,
        files: BTreeMap::new(),
        keep_fp8: opts.keep_fp8,
    };
    let mut bytes_done = 0u64;
    for (i, source) in sources.iter().enumerate() {
        if let Some(release) = &source.release {
            let bytes = read_release(&ckpt, &report.config, &source.meta, release)?;
            let region = TensorBox::full(&source.meta.global_shape);
            writer.write_region(&source.meta.fqn, &region, &bytes)?;
            bytes_done += bytes.len() as u64;
            progress(&ConvertProgress {
                tensor: source.meta.fqn.clone(),
                done: i + 1,
                total: sources.len(),
                bytes: bytes_done,
                total_bytes,
            });
            continue;
        }
        for piece in &source.pieces {
            let bytes = reader.read(&piece.hf)?;
            writer.write_region(&source.meta.fqn, &piece.region, &bytes)?;
            bytes_done += bytes.len() as u64;
        }
        progress(&ConvertProgress {
            tensor: source.meta.fqn.clone(),
            done: i + 1,
            total: sources.len(),
            bytes: bytes_done,
            total_bytes,
        });
    }
    Ok(ConvertReport {
        dir: writer.finish()?,
        unused: report.unused.into_iter().collect(),
        warnings: report.warnings,
    })
}

/// The metadata of checkpoint `ckpt` re-targeted to `layout`: step, model family, optimizer
/// record, FP8 record and objects from the index, `config.json` and `generation_config.json`
/// from the directory (when present). What [`reshard`] writes, and the starting point of a
/// training save that continues from `ckpt`.
pub fn checkpoint_meta(
    ckpt: &DistCheckpoint,
    layout: &ParallelLayout,
) -> Result<SaveMeta, BridgeError> {
    let index = ckpt.index();
    let config_path = ckpt.dir().join(CONFIG_FILE);
    let config = if config_path.is_file() {
        Some(read_json(&config_path)?)
    } else {
        None
    };
    let mut meta = SaveMeta::new(index.step, layout);
    meta.model_family = index.model_family.clone();
    meta.config = config;
    meta.optimizer = index.optimizer.clone();
    meta.fp8 = index.fp8.clone();
    meta.objects = index.objects.clone();
    let generation_path = ckpt.dir().join(GENERATION_CONFIG_FILE);
    if generation_path.is_file() {
        meta.extra_json.insert(
            GENERATION_CONFIG_FILE.to_owned(),
            read_json(&generation_path)?,
        );
    }
    Ok(meta)
}

/// `num_hidden_layers` of the config in `meta` (needed to place layers on pipeline stages).
pub(crate) fn meta_num_layers(meta: &SaveMeta) -> Option<usize> {
    meta.config
        .as_ref()
        .and_then(|c| c.get("num_hidden_layers"))
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
}

/// Rewrites the checkpoint `ckpt` (of a model whose config is `C`, which gives the split of
/// every tensor) under `layout` into `out_root` (`moe reshard`): every
/// tensor, optimizer state included, is read one target chunk at a time from the overlapping
/// stored chunks. Index metadata (step, optimizer, objects, FP8) and the JSON files next to
/// the index are kept. Returns the new `iter_*` directory.
pub fn reshard<C: ModelSchema>(
    ckpt: &DistCheckpoint,
    out_root: &Path,
    layout: &ParallelLayout,
) -> Result<PathBuf, BridgeError> {
    let index = ckpt.index();
    let meta = checkpoint_meta(ckpt, layout)?;
    let plan = ShardingPlan::new(
        layout,
        meta_num_layers(&meta),
        C::shard_rule,
        C::stage_place,
    )?;
    let metas: Vec<TensorMeta> = index
        .tensors
        .iter()
        .map(|(fqn, e)| TensorMeta {
            fqn: fqn.clone(),
            kind: e.kind,
            dtype: e.dtype,
            global_shape: e.global_shape.clone(),
            hf: e.hf.clone(),
        })
        .collect();
    let mut writer = OfflineWriter::create(out_root, meta, &plan, &metas)?;
    for m in &metas {
        for chunk in writer.chunks_of(&m.fqn) {
            let t = ckpt.read_box(&m.fqn, &chunk)?;
            writer.write_region(&m.fqn, &chunk, &t.bytes)?;
        }
    }
    writer.finish()
}

/// Where one exported HF tensor comes from.
#[derive(Debug, Clone)]
struct ExportItem {
    fqn: String,
    region: TensorBox,
    shape: Vec<usize>,
    dtype: Dtype,
    /// An FP8 weight exported as dequantised floats.
    dequantize: bool,
    /// Stored in the release's layout, not the canonical one ([`ModelSchema::to_release`]):
    /// the canonical shape of the region read.
    release: Option<Vec<usize>>,
    /// A half of the MXFP4 pair the parameter (`base`, of release shape `param`) is packed
    /// into ([`Mxfp4Export`]).
    mxfp4: Option<(Mxfp4Part, String, Vec<usize>)>,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// One HF tensor a stored tensor exports to: its name, the box of the stored tensor it is,
/// and its HF shape.
pub(crate) struct HfPart {
    pub(crate) name: String,
    pub(crate) region: TensorBox,
    pub(crate) shape: Vec<usize>,
}

/// The HF tensors stored tensor `fqn` exports to under `registry` (per-expert names; a scale
/// gets its weight's names with the `_scale_inv` suffix) and the rule's export dtype.
/// [`BridgeError::TensorNotFound`] naming `config_path` when the table has no HF name for it.
pub(crate) fn hf_parts(
    registry: &Registry,
    fqn: &str,
    entry: &TensorEntry,
    config_path: &Path,
) -> Result<(Option<Dtype>, Vec<HfPart>), BridgeError> {
    let scale = entry.kind == TensorKind::Scale;
    let canon = if scale {
        weight_of_scale(fqn).unwrap_or(fqn)
    } else {
        fqn
    };
    let experts = entry.global_shape.first().copied().unwrap_or(0);
    let resolved = registry
        .canon_to_hf(canon, experts, ExpertLayout::PerExpert)
        .ok_or_else(|| BridgeError::TensorNotFound {
            path: config_path.to_path_buf(),
            tensor: format!("{fqn} (no HF name in the `{}` table)", registry.name()),
        })?;
    let multi = resolved.pieces.iter().any(|p| p.part.is_some());
    let parts = resolved
        .pieces
        .into_iter()
        .map(|p| {
            let (region, shape) = match p.expert {
                None => (
                    TensorBox::full(&entry.global_shape),
                    entry.global_shape.clone(),
                ),
                Some(e) => {
                    let lead = if multi { 2 } else { 1 };
                    let rest = entry.global_shape.get(lead..).unwrap_or_default().to_vec();
                    let mut offsets = vec![e];
                    let mut ext = vec![1];
                    if multi {
                        offsets.push(p.part.unwrap_or(0));
                        ext.push(1);
                    }
                    offsets.extend(std::iter::repeat_n(0, rest.len()));
                    ext.extend_from_slice(&rest);
                    (TensorBox::new(offsets, ext), rest)
                }
            };
            let name = if scale { scale_inv_name(&p.hf) } else { p.hf };
            HfPart {
                name,
                region,
                shape,
            }
        })
        .collect();
    Ok((resolved.export_dtype, parts))
}

/// Prefixes of the optimizer tensors holding a parameter's f32 main weight in a training
/// checkpoint: the distributed AdamW's `optim.master.<fqn>` and Muon's
/// `optim.muon_master.<fqn>` (docs/checkpoints.md §Training checkpoints).
pub const MAIN_WEIGHT_PREFIXES: [&str; 2] = ["optim.master.", "optim.muon_master."];

/// The stored f32 main weight of parameter `fqn` (`entry`): an `F32` tensor of the same
/// global shape named by one of [`MAIN_WEIGHT_PREFIXES`], when the checkpoint has one.
pub fn main_weight_fqn(
    index: &super::index::DcpIndex,
    fqn: &str,
    entry: &TensorEntry,
) -> Option<String> {
    MAIN_WEIGHT_PREFIXES
        .iter()
        .map(|prefix| format!("{prefix}{fqn}"))
        .find(|name| {
            index.tensors.get(name).is_some_and(|m| {
                m.kind == TensorKind::Optim
                    && m.dtype == Dtype::F32
                    && m.global_shape == entry.global_shape
            })
        })
}

/// The f32 values of export item `item` (HF tensor `name`) in the release layout: its region
/// read (FP8 dequantised to f32), permuted by [`ModelSchema::to_release`] when the release
/// stores it in another layout.
fn release_values<C: ModelSchema>(
    ckpt: &DistCheckpoint,
    schema: &C,
    item: &ExportItem,
    name: &str,
) -> Result<Vec<f32>, BridgeError> {
    let t = if item.dequantize {
        ckpt.read_box_dequantized(&item.fqn, &item.region, OutDtype::F32)?
    } else {
        ckpt.read_box(&item.fqn, &item.region)?
    };
    let values = t.to_f32_vec()?;
    match &item.release {
        Some(canonical) => {
            schema
                .to_release(name, canonical, &values)?
                .ok_or_else(|| BridgeError::Conversion {
                    path: ckpt.dir().to_path_buf(),
                    tensor: name.to_owned(),
                    dtype: t.dtype.to_string(),
                    reason: "a release shape without a release layout".to_owned(),
                })
        }
        None => Ok(values),
    }
}

/// Exports the model tensors of a distributed checkpoint (of a model whose config is `C`) as
/// an HF checkpoint in `target`
/// (per-expert names; `generation_config.json` copied or defaulted; optimizer state is not
/// exported). `opts.dtype` casts float tensors (rule overrides such as the F32 router bias win)
/// and dequantises FP8 weights, dropping their scales and `quantization_config`; `None` keeps
/// the stored dtypes, so FP8 weights leave as their stored bytes with `<name>_scale_inv` and the
/// config keeps `quantization_config` (the release format, bit for bit).
///
/// A checkpoint of a BF16 mixed-precision run stores its trainable parameters in BF16, each
/// its f32 main weight rounded once to nearest even (docs/training-and-rl.md §Mixed precision
/// (BF16)): `None` exports exactly those (the config's `dtype` says `bfloat16` when every
/// parameter is BF16 or every one F16), and a wider `opts.dtype` (F32) exports the f32 main
/// weights themselves ([`main_weight_fqn`]) rather than widened BF16 values.
///
/// With `opts.mxfp4` the tensors the model's release stores as MXFP4 leave packed from their
/// f32 values (main weights where kept) as `<name>_blocks` / `<name>_scales` with the release's
/// `quantization_config` ([`Mxfp4Export`]); `opts.mxfp4_reference` keeps the release's scales
/// where the values still fit them, so an untrained checkpoint converted from the release
/// exports its bytes.
pub fn export_dist_to_hf<C: ModelSchema>(
    ckpt: &DistCheckpoint,
    target: &Path,
    opts: &ExportOptions,
) -> Result<ExportSummary, BridgeError> {
    let opts = &*opts.resolved();
    let config_path = ckpt.dir().join(CONFIG_FILE);
    let config = read_json(&config_path)?;
    let registry = C::registry_of(&config, &config_path)?;
    let schema = C::from_config(&config, &config_path)?;
    let mut mxfp4 = Mxfp4Export::new(&schema, opts, &config, &config_path)?;
    let tied = C::tied_head(&config);
    let index = ckpt.index();
    let dequantize_fp8 = opts.dtype.is_some();
    let mut items: BTreeMap<String, ExportItem> = BTreeMap::new();
    let mut dropped = Vec::new();
    let mut kept_fp8 = false;
    // The one dtype of every stored trainable parameter, if they share one.
    let mut param_dtypes = std::collections::BTreeSet::new();
    for (fqn, entry) in &index.tensors {
        let scale = entry.kind == TensorKind::Scale;
        if entry.kind == TensorKind::Optim
            || tied.as_deref() == Some(fqn.as_str())
            || (scale && dequantize_fp8)
        {
            dropped.push(fqn.clone());
            continue;
        }
        let fp8 = !scale && super::fp8::is_fp8_weight(index, fqn, entry);
        kept_fp8 |= fp8 && !dequantize_fp8;
        let (export_dtype, parts) = hf_parts(&registry, fqn, entry, &config_path)?;
        let dtype = match export_dtype.or(opts.dtype) {
            _ if scale => entry.dtype,
            Some(d) if fp8 || is_float(entry.dtype) => d,
            _ => entry.dtype,
        };
        if entry.kind == TensorKind::Param && !fp8 {
            param_dtypes.insert(entry.dtype);
        }
        // A parameter stored narrower than it is exported (BF16 of a mixed-precision run,
        // exported as F32) leaves as its f32 main weight when the checkpoint keeps one.
        let source = match opts.dtype {
            Some(d)
                if entry.kind == TensorKind::Param
                    && !fp8
                    && is_float(entry.dtype)
                    && dtype == d
                    && d.size() > entry.dtype.size() =>
            {
                main_weight_fqn(index, fqn, entry).unwrap_or_else(|| fqn.clone())
            }
            _ => fqn.clone(),
        };
        for part in parts {
            let release = schema.release_shape(&part.name, &part.shape)?;
            let (shape, release) = match release {
                Some(stored) => (stored, Some(part.shape)),
                None => (part.shape, None),
            };
            if mxfp4.is_some() && !scale && schema.release_mxfp4(&part.name) {
                // Packed from the f32 values: a narrower parameter's f32 main weight when
                // the checkpoint keeps one.
                let source = match entry.dtype {
                    d if entry.kind == TensorKind::Param && !fp8 && d.size() < 4 => {
                        main_weight_fqn(index, fqn, entry).unwrap_or_else(|| fqn.clone())
                    }
                    _ => fqn.clone(),
                };
                for (out, pair_shape, half) in mxfp4_outputs(&part.name, &shape)? {
                    let item = ExportItem {
                        fqn: source.clone(),
                        region: part.region.clone(),
                        shape: pair_shape,
                        dtype: Dtype::U8,
                        dequantize: fp8,
                        release: release.clone(),
                        mxfp4: Some((half, part.name.clone(), shape.clone())),
                    };
                    items.insert(out, item);
                }
                continue;
            }
            let item = ExportItem {
                fqn: source.clone(),
                region: part.region,
                shape,
                dtype,
                dequantize: fp8 && dequantize_fp8,
                release,
                mxfp4: None,
            };
            items.insert(part.name, item);
        }
    }
    let sizes: BTreeMap<String, u64> = items
        .iter()
        .map(|(n, it)| {
            let numel: usize = it.shape.iter().product();
            (n.clone(), (numel * it.dtype.size()) as u64)
        })
        .collect();
    let mut writer = HfDirWriter::create(
        target,
        ShardPlan::greedy(&sizes, opts.max_shard_size),
        opts.overwrite,
    )?;
    for i in 0..writer.plan().num_shards() {
        let keys = writer.plan().keys(i).to_vec();
        let mut tensors = Vec::with_capacity(keys.len());
        for key in &keys {
            let Some(item) = items.get(key) else {
                continue;
            };
            if let (Some((half, base, param)), Some(mx)) = (&item.mxfp4, mxfp4.as_mut()) {
                let (shape, bytes) = mx.take(base, *half, || {
                    let values = release_values(ckpt, &schema, item, base)?;
                    Ok((param.clone(), values))
                })?;
                tensors.push(OwnedTensor::new(key.clone(), Dtype::U8, shape, bytes)?);
                continue;
            }
            let mut t = if item.dequantize {
                let out = match item.dtype {
                    Dtype::BF16 => OutDtype::BF16,
                    _ => OutDtype::F32,
                };
                ckpt.read_box_dequantized(&item.fqn, &item.region, out)?
            } else {
                ckpt.read_box(&item.fqn, &item.region)?
            };
            t.name = key.clone();
            if let Some(canonical) = &item.release {
                // The release's permutation of the canonical values (exact in f32).
                let values = t.to_f32_vec()?;
                let stored = schema.to_release(key, canonical, &values)?.ok_or_else(|| {
                    BridgeError::Conversion {
                        path: ckpt.dir().to_path_buf(),
                        tensor: key.clone(),
                        dtype: t.dtype.to_string(),
                        reason: "a release shape without a release layout".to_owned(),
                    }
                })?;
                t = OwnedTensor::from_f32(key.clone(), item.shape.clone(), &stored)?;
            }
            t.shape = item.shape.clone();
            tensors.push(if is_float(t.dtype) {
                t.cast(item.dtype)?
            } else {
                t
            });
        }
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        writer.write_shard(i, &views)?;
    }
    // Kept dtypes: a BF16 (or F16) mixed-precision run's parameters name their dtype.
    let half = match param_dtypes.iter().collect::<Vec<_>>().as_slice() {
        [d @ (Dtype::BF16 | Dtype::F16)] => Some(**d),
        _ => None,
    };
    let mut out_config = export_config(&config, opts.dtype.or(half), !kept_fp8);
    if kept_fp8 && let (Some(record), Value::Object(map)) = (&index.fp8, &mut out_config) {
        // The block size of the stored scales (a training save may use other blocks than the
        // source release); the other fields follow the DeepSeek-V3 release.
        let q = map
            .entry("quantization_config")
            .or_insert_with(|| serde_json::json!({}));
        if let Value::Object(q) = q {
            q.entry("activation_scheme").or_insert("dynamic".into());
            q.entry("fmt").or_insert(record.format.clone().into());
            q.entry("quant_method").or_insert("fp8".into());
            q.insert(
                "weight_block_size".to_owned(),
                serde_json::json!(record.weight_block_size),
            );
        }
    }
    if let Some(mx) = &mxfp4 {
        mx.write_config(&mut out_config);
    }
    writer.write_json(CONFIG_FILE, &out_config)?;
    let generation_path = ckpt.dir().join(GENERATION_CONFIG_FILE);
    let generation = if generation_path.is_file() {
        read_json(&generation_path)?
    } else {
        default_generation_config(&config)
    };
    writer.write_json(GENERATION_CONFIG_FILE, &generation)?;
    let shards = writer.plan().num_shards();
    let target = writer.finish()?;
    Ok(ExportSummary {
        target,
        tensors: items.len(),
        total_size: sizes.values().sum(),
        shards,
        dropped,
        warnings: Vec::new(),
    })
}
