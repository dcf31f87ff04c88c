//! HF → HF export (docs/checkpoints.md §Minimal loadable export, §Streaming conversion): e.g. an
//! FP8 release checkpoint to BF16, a stacked-expert checkpoint to per-expert names, or a
//! re-sharding.
//!
//! - Weights under per-expert HF names, in the requested dtype (FP8 weights are dequantised,
//!   computing in f32 and rounding once); `e_score_correction_bias` stays F32 (mapping rule);
//!   every `*_scale_inv` and `rotary_emb.inv_freq` is dropped; `lm_head.weight` is omitted when
//!   `tie_word_embeddings` is true; MTP copies of `embed_tokens` / `shared_head.head` are copied
//!   through, and optionally emitted when absent. With [`ExportOptions::mxfp4`] the tensors the
//!   model's release stores as MXFP4 are packed into `*_blocks` / `*_scales` ([`Mxfp4Export`];
//!   a source already in MXFP4 keeps its pairs).
//! - `config.json` starts from the source (unknown keys kept), with `dtype` (and a legacy
//!   `torch_dtype`) updated and `quantization_config` removed when the source was quantised;
//!   `generation_config.json` is copied, or the default of
//!   docs/checkpoints.md §Minimal loadable export written; other files (tokenizer) are copied
//!   through untouched.
//! - Shards are planned greedily over sorted names up to `max_shard_size` and each is written
//!   as soon as its tensors are produced; the directory appears atomically
//!   ([`HfDirWriter`]). Reading an HF checkpoint this writes gives bit-identical tensors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::BridgeError;
use crate::fp8::{OutDtype, is_scale_inv};
use crate::hf::{CONFIG_FILE, GENERATION_CONFIG_FILE, HfCheckpoint, INDEX_FILE};
use crate::mapping::{HfTarget, Registry};
use crate::safetensors::{Dtype, HfDirWriter, OwnedTensor, ShardPlan, TensorView};
use crate::schema::ModelSchema;

/// The default shard limit of `save_pretrained`: 5 GB (10⁹ bytes per GB).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 5_000_000_000;

/// How to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOptions {
    /// Float dtype of the exported weights (BF16, F16, F32); `None` keeps each tensor's dtype
    /// (FP8 weights become BF16). Rule overrides (router bias → F32) always win.
    pub dtype: Option<Dtype>,
    /// Largest shard in bytes (a bigger tensor gets its own shard).
    pub max_shard_size: u64,
    /// Replace an existing target directory.
    pub overwrite: bool,
    /// Add DeepSeek-V3 MTP copies of `embed_tokens` and `shared_head.head` when absent.
    pub emit_mtp_copies: bool,
    /// Pack the tensors the model's release stores as MXFP4 ([`ModelSchema::release_mxfp4`])
    /// into `<name>_blocks` / `<name>_scales` ([`crate::mxfp4`]) and write the release's
    /// `quantization_config`; the other tensors follow `dtype`. Refused for a model whose
    /// release has no MXFP4 tensors. See [`Mxfp4Export`]. With `dtype` `None` the other
    /// tensors are BF16 (the release's dtype).
    pub mxfp4: bool,
    /// With `mxfp4`: an HF directory (the MXFP4 release the weights came from) whose block
    /// scales are kept wherever a block's values are still exactly representable at them, so
    /// weights that did not change re-pack to the release's bytes (the values alone do not
    /// determine a block's scale: a block whose largest code is 3 holds the same values at
    /// half the scale with doubled codes).
    pub mxfp4_reference: Option<PathBuf>,
}

impl ExportOptions {
    /// These options with the dtype an MXFP4 export gives the other tensors when `dtype` is
    /// `None` (BF16, the release's); unchanged otherwise.
    pub fn resolved(&self) -> std::borrow::Cow<'_, Self> {
        match self.dtype {
            None if self.mxfp4 => std::borrow::Cow::Owned(Self {
                dtype: Some(Dtype::BF16),
                ..self.clone()
            }),
            _ => std::borrow::Cow::Borrowed(self),
        }
    }
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            overwrite: false,
            emit_mtp_copies: false,
            mxfp4: false,
            mxfp4_reference: None,
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The written directory.
    pub target: PathBuf,
    /// Number of tensors written.
    pub tensors: usize,
    /// Σ tensor bytes (the index's `total_size`).
    pub total_size: u64,
    /// Number of safetensors files.
    pub shards: usize,
    /// Source tensors not exported (scales, RoPE buffers, a tied `lm_head`, tensors the model
    /// does not use).
    pub dropped: Vec<String>,
    /// Validation warnings about the source, for the user (empty for a distributed source).
    pub warnings: Vec<String>,
}

/// Parses a shard size such as `5GB` (10⁹), `500MB`, `2GiB` (2³⁰), `1024KB` or a plain byte
/// count.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}`: expected a number with an optional unit"))?;
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        other => return Err(format!("`{text}`: unknown unit `{other}`")),
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}`: too large"))
}

/// The HF spelling of a float dtype in `config.json` (`None` for non-float dtypes).
pub fn config_dtype_name(dtype: Dtype) -> Option<&'static str> {
    match dtype {
        Dtype::BF16 => Some("bfloat16"),
        Dtype::F16 => Some("float16"),
        Dtype::F32 => Some("float32"),
        Dtype::F64 => Some("float64"),
        _ => None,
    }
}

/// The exported `config.json`: `source` with `dtype` (and a legacy `torch_dtype`) set to
/// `dtype` when given, and `quantization_config` removed when `dequantized`.
pub fn export_config(source: &Value, dtype: Option<Dtype>, dequantized: bool) -> Value {
    let mut config = source.clone();
    if let Value::Object(map) = &mut config {
        if dequantized {
            map.remove("quantization_config");
        }
        if let Some(name) = dtype.and_then(config_dtype_name) {
            map.insert("dtype".to_owned(), json!(name));
            if map.contains_key("torch_dtype") {
                map.insert("torch_dtype".to_owned(), json!(name));
            }
        }
    }
    config
}

/// The `generation_config.json` written when the source has none
/// (docs/checkpoints.md §Minimal loadable export).
pub fn default_generation_config(config: &Value) -> Value {
    json!({
        "_from_model_config": true,
        "bos_token_id": config.get("bos_token_id").cloned().unwrap_or(Value::Null),
        "eos_token_id": config.get("eos_token_id").cloned().unwrap_or(Value::Null),
        "output_attentions": false,
        "output_hidden_states": false,
        "use_cache": true,
    })
}

/// Which tensor of an MXFP4 pair an exported name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mxfp4Part {
    /// `<name>_blocks`.
    Blocks,
    /// `<name>_scales`.
    Scales,
}

/// The MXFP4 side of an export ([`ExportOptions::mxfp4`]), following transformers 5.23's
/// gpt-oss release format (`integrations/mxfp4.py`): each tensor the model's release stores as
/// MXFP4 ([`ModelSchema::release_mxfp4`]) leaves as `<name>_blocks` `U8 [..., out, in/32, 16]`
/// and `<name>_scales` `U8 [..., out, in/32]` of its transposed parameter
/// ([`crate::mxfp4::encode_mxfp4_param`]: the OCP MX rule, or the reference scale where the
/// values still fit it exactly); `config.json` gets the release's `quantization_config` (the
/// source's when it is an MXFP4 one, else the model's). The two tensors of a pair are packed
/// once (the half not yet written is kept until it is).
pub struct Mxfp4Export {
    reference: Option<HfCheckpoint>,
    quantization: Value,
    /// Packed pairs with a half not yet written: `(blocks, scales)`.
    pending: BTreeMap<String, (Option<PairHalf>, Option<PairHalf>)>,
}

/// One half of a packed MXFP4 pair: its shape and bytes.
type PairHalf = (Vec<usize>, Vec<u8>);

impl std::fmt::Debug for Mxfp4Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mxfp4Export")
            .field("reference", &self.reference.as_ref().map(HfCheckpoint::dir))
            .field("quantization", &self.quantization)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl Mxfp4Export {
    /// The MXFP4 side of an export with `opts` of a model `schema` whose `config.json`
    /// (`config`, at `config_path`) the export starts from; `None` when `opts.mxfp4` is off.
    ///
    /// Errors: [`BridgeError::InvalidConfig`] (field `dtype`) for a model whose release has no
    /// MXFP4 tensors, naming its `model_type`, or a reference without `mxfp4`; a reference
    /// directory that does not open.
    pub fn new<C: ModelSchema>(
        schema: &C,
        opts: &ExportOptions,
        config: &Value,
        config_path: &Path,
    ) -> Result<Option<Self>, BridgeError> {
        if !opts.mxfp4 {
            if let Some(r) = &opts.mxfp4_reference {
                return Err(BridgeError::InvalidConfig {
                    path: r.clone(),
                    field: "mxfp4_reference".to_owned(),
                    reason: "reference scales are for an MXFP4 export only".to_owned(),
                });
            }
            return Ok(None);
        }
        let Some(default) = schema.mxfp4_quantization_config() else {
            return Err(BridgeError::InvalidConfig {
                path: config_path.to_path_buf(),
                field: "dtype".to_owned(),
                reason: format!(
                    "`{}` has no MXFP4 tensors: only a model whose release stores some \
                     exports MXFP4",
                    schema.model_type()
                ),
            });
        };
        let source = config
            .get("quantization_config")
            .filter(|q| q.get("quant_method").and_then(Value::as_str) == Some("mxfp4"));
        let reference = match &opts.mxfp4_reference {
            Some(dir) => Some(HfCheckpoint::open(dir)?),
            None => None,
        };
        Ok(Some(Self {
            reference,
            quantization: source.cloned().unwrap_or(default),
            pending: BTreeMap::new(),
        }))
    }

    /// The exported `config.json` `config` with the release's `quantization_config`.
    pub fn write_config(&self, config: &mut Value) {
        if let Value::Object(map) = config {
            map.insert("quantization_config".to_owned(), self.quantization.clone());
        }
    }

    /// The reference scales of `name` (shape `scales_shape`), when a reference is given.
    /// Errors: a reference that lacks the pair or holds scales of another shape, naming it.
    fn reference_scales(
        &self,
        name: &str,
        scales_shape: &[usize],
    ) -> Result<Option<Vec<u8>>, BridgeError> {
        let Some(reference) = &self.reference else {
            return Ok(None);
        };
        if !reference.is_mxfp4(name) {
            return Err(BridgeError::Mxfp4 {
                tensor: name.to_owned(),
                reason: format!(
                    "the reference {} does not store it as an MXFP4 pair",
                    reference.dir().display()
                ),
            });
        }
        let (shape, scales) = reference.read_mxfp4_scales(name)?;
        if shape != scales_shape {
            return Err(BridgeError::Mxfp4 {
                tensor: name.to_owned(),
                reason: format!(
                    "the reference {} holds scales {shape:?}, the export {scales_shape:?}",
                    reference.dir().display()
                ),
            });
        }
        Ok(Some(scales))
    }

    /// The `part` of the MXFP4 pair of parameter `name`: `(shape, bytes)`, packed by `values`
    /// (the parameter's `(shape [..., in, out], values)`) the first time either half is asked
    /// for, the other half kept until it is.
    pub(crate) fn take(
        &mut self,
        name: &str,
        part: Mxfp4Part,
        values: impl FnOnce() -> Result<(Vec<usize>, Vec<f32>), BridgeError>,
    ) -> Result<(Vec<usize>, Vec<u8>), BridgeError> {
        if !self.pending.contains_key(name) {
            let (shape, values) = values()?;
            let (_, scales_shape) = crate::mxfp4::mxfp4_pair_shapes(name, &shape)?;
            let reference = self.reference_scales(name, &scales_shape)?;
            let packed =
                crate::mxfp4::encode_mxfp4_param(name, &values, &shape, reference.as_deref())?;
            self.pending.insert(
                name.to_owned(),
                (
                    Some((packed.blocks_shape, packed.blocks)),
                    Some((packed.scales_shape, packed.scales)),
                ),
            );
        }
        let missing = || BridgeError::Mxfp4 {
            tensor: name.to_owned(),
            reason: format!("{part:?} asked for twice"),
        };
        let entry = self.pending.get_mut(name).ok_or_else(missing)?;
        let got = match part {
            Mxfp4Part::Blocks => entry.0.take(),
            Mxfp4Part::Scales => entry.1.take(),
        };
        if entry.0.is_none() && entry.1.is_none() {
            self.pending.remove(name);
        }
        got.ok_or_else(missing)
    }
}

/// The names and shapes of the MXFP4 pair of parameter `name` of shape `shape`
/// (`[..., in, out]`): `(<name>_blocks, shape, Blocks)`, `(<name>_scales, shape, Scales)`.
pub(crate) fn mxfp4_outputs(
    name: &str,
    shape: &[usize],
) -> Result<[(String, Vec<usize>, Mxfp4Part); 2], BridgeError> {
    use crate::mxfp4::{BLOCKS_SUFFIX, SCALES_SUFFIX};
    let (blocks, scales) = crate::mxfp4::mxfp4_pair_shapes(name, shape)?;
    Ok([
        (format!("{name}{BLOCKS_SUFFIX}"), blocks, Mxfp4Part::Blocks),
        (format!("{name}{SCALES_SUFFIX}"), scales, Mxfp4Part::Scales),
    ])
}

/// Where one exported tensor comes from.
#[derive(Debug, Clone)]
struct Planned {
    /// Source HF tensor.
    source: String,
    /// `Some((index, count))`: the `index`-th of `count` equal dim-0/1 chunks of a fused
    /// expert tensor.
    chunk: Option<(usize, usize)>,
    /// Output shape.
    shape: Vec<usize>,
    /// Output dtype.
    dtype: Dtype,
    /// A half of the MXFP4 pair the dense `source` is packed into.
    mxfp4: Option<Mxfp4Part>,
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// Exports `src`, a model whose config is `C`, to `target` (see the module docs).
///
/// The source is validated against its `config.json` first ([`HfCheckpoint::check`]); on
/// failure nothing is written. Tensors the model does not use are dropped with a warning
/// ([`ExportSummary::warnings`]).
pub fn export_hf<C: ModelSchema>(
    src: &HfCheckpoint,
    target: &Path,
    opts: &ExportOptions,
) -> Result<ExportSummary, BridgeError> {
    let opts = &*opts.resolved();
    if let Some(d) = opts.dtype.filter(|d| !is_float(*d)) {
        return Err(BridgeError::InvalidConfig {
            path: target.to_path_buf(),
            field: "dtype".to_owned(),
            reason: format!("{d} is not a float dtype"),
        });
    }
    let report = src.check::<C>()?;
    let config_path = src.dir().join(CONFIG_FILE);
    let config = src.config_json()?;
    let registry = C::registry_of(&config, &config_path)?;
    let mut mxfp4 = Mxfp4Export::new(&report.config, opts, &config, &config_path)?;
    let tied = C::tied_head(&config);
    let mut plan: BTreeMap<String, Planned> = BTreeMap::new();
    let mut dropped = Vec::new();
    let mut dequantized = false;
    for name in src.tensor_names() {
        let resolved = registry.hf_to_canon(name);
        if is_scale_inv(name)
            || name.ends_with("rotary_emb.inv_freq")
            || tied.as_deref() == Some(name)
            || report.unused.contains(name)
        {
            dequantized |= is_scale_inv(name);
            dropped.push(name.to_owned());
            continue;
        }
        let info = src.info(name)?;
        dequantized |= matches!(info.dtype, Dtype::F8E4M3 | Dtype::F8E5M2);
        let export_dtype = match resolved.as_ref().map(|r| &r.target) {
            Some(HfTarget::Direct { export_dtype, .. }) => *export_dtype,
            _ => None,
        };
        let dtype = out_dtype(info.dtype, export_dtype.or(opts.dtype));
        if mxfp4.is_some() && is_float(info.dtype) && report.config.release_mxfp4(name) {
            // A dense tensor the release packs (a source already in MXFP4 keeps its pairs).
            for (out, shape, part) in mxfp4_outputs(name, &info.shape)? {
                let planned = Planned {
                    source: name.to_owned(),
                    chunk: None,
                    shape,
                    dtype: Dtype::U8,
                    mxfp4: Some(part),
                };
                plan.insert(out, planned);
            }
            continue;
        }
        match resolved.map(|r| r.target) {
            Some(HfTarget::Fused { split_parts, .. }) => {
                plan_fused(&registry, name, &info.shape, split_parts, dtype, &mut plan).map_err(
                    |reason| BridgeError::Conversion {
                        path: src.dir().to_path_buf(),
                        tensor: name.to_owned(),
                        dtype: info.dtype.to_string(),
                        reason,
                    },
                )?;
            }
            _ => {
                let planned = Planned {
                    source: name.to_owned(),
                    chunk: None,
                    shape: info.shape.clone(),
                    dtype,
                    mxfp4: None,
                };
                plan.insert(name.to_owned(), planned);
            }
        }
    }
    if opts.emit_mtp_copies {
        let copies = report.config.export_copies(&|name| src.contains(name));
        add_copies(src, copies, opts.dtype, &mut plan)?;
    }

    let sizes: BTreeMap<String, u64> = plan
        .iter()
        .map(|(n, p)| {
            let numel: usize = p.shape.iter().product();
            (n.clone(), (numel * p.dtype.size()) as u64)
        })
        .collect();
    let shard_plan = ShardPlan::greedy(&sizes, opts.max_shard_size);
    let mut writer = HfDirWriter::create(target, shard_plan, opts.overwrite)?;
    let mut cache: Option<(String, OwnedTensor)> = None;
    for i in 0..writer.plan().num_shards() {
        let keys = writer.plan().keys(i).to_vec();
        let mut tensors = Vec::with_capacity(keys.len());
        for key in &keys {
            let planned = plan.get(key).ok_or_else(|| BridgeError::TensorNotFound {
                path: src.dir().to_path_buf(),
                tensor: key.clone(),
            })?;
            let t = match (planned.mxfp4, mxfp4.as_mut()) {
                (Some(part), Some(mx)) => {
                    let (shape, bytes) =
                        mx.take(&planned.source, part, || src.read_f32(&planned.source))?;
                    OwnedTensor::new(key.clone(), Dtype::U8, shape, bytes)?
                }
                _ => produce(src, key, planned, &mut cache)?,
            };
            tensors.push(t);
        }
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        writer.write_shard(i, &views)?;
    }

    let config_dtype = opts.dtype.or(dequantized.then_some(Dtype::BF16));
    let mut out_config = export_config(&config, config_dtype, dequantized);
    if let Some(mx) = &mxfp4 {
        mx.write_config(&mut out_config);
    }
    writer.write_json(CONFIG_FILE, &out_config)?;
    let generation = match src.generation_config_json()? {
        Some(g) => g,
        None => default_generation_config(&config),
    };
    writer.write_json(GENERATION_CONFIG_FILE, &generation)?;
    copy_other_files(src.dir(), &mut writer)?;
    let shards = writer.plan().num_shards();
    let total_size = sizes.values().sum();
    let target = writer.finish()?;
    Ok(ExportSummary {
        target,
        tensors: plan.len(),
        total_size,
        shards,
        dropped,
        warnings: report.warnings,
    })
}

/// The output dtype of a stored `dtype` given the requested float dtype.
fn out_dtype(stored: Dtype, requested: Option<Dtype>) -> Dtype {
    let fp8 = matches!(stored, Dtype::F8E4M3 | Dtype::F8E5M2);
    match requested {
        Some(d) if is_float(stored) || fp8 => d,
        _ if fp8 => Dtype::BF16,
        _ => stored,
    }
}

/// Plans the per-expert tensors of a fused HF expert tensor.
fn plan_fused(
    registry: &Registry,
    name: &str,
    shape: &[usize],
    split_parts: Option<usize>,
    dtype: Dtype,
    plan: &mut BTreeMap<String, Planned>,
) -> Result<(), String> {
    let parts = split_parts.unwrap_or(1);
    let (num_experts, piece_shape) = match (shape, split_parts) {
        ([e, fused, tail @ ..], Some(p)) if p > 0 && fused % p == 0 => {
            (*e, [&[fused / p][..], tail].concat())
        }
        ([e, tail @ ..], None) => (*e, tail.to_vec()),
        _ => return Err(format!("shape {shape:?} is not a stacked expert tensor")),
    };
    let resolved = registry
        .hf_to_canon(name)
        .and_then(|r| r.target.canon().map(str::to_owned))
        .and_then(|canon| {
            registry.canon_to_hf(&canon, num_experts, crate::mapping::ExpertLayout::PerExpert)
        })
        .ok_or_else(|| "no per-expert names for it".to_owned())?;
    let count = num_experts * parts;
    if resolved.pieces.len() != count {
        return Err(format!(
            "{} per-expert names for {count} pieces",
            resolved.pieces.len()
        ));
    }
    for (index, piece) in resolved.pieces.into_iter().enumerate() {
        let planned = Planned {
            source: name.to_owned(),
            chunk: Some((index, count)),
            shape: piece_shape.clone(),
            dtype,
            mxfp4: None,
        };
        plan.insert(piece.hf, planned);
    }
    Ok(())
}

/// Plans the model's export copies (`(name, source)`, [`ModelSchema::export_copies`]): a name
/// already planned, or whose source the checkpoint lacks, is skipped.
fn add_copies(
    src: &HfCheckpoint,
    copies: Vec<(String, String)>,
    dtype: Option<Dtype>,
    plan: &mut BTreeMap<String, Planned>,
) -> Result<(), BridgeError> {
    for (name, source) in copies {
        if plan.contains_key(&name) || !src.contains(&source) {
            continue;
        }
        let info = src.info(&source)?;
        let planned = Planned {
            source,
            chunk: None,
            shape: info.shape.clone(),
            dtype: out_dtype(info.dtype, dtype),
            mxfp4: None,
        };
        plan.insert(name, planned);
    }
    Ok(())
}

/// Reads, slices and casts one planned tensor. `cache` keeps the last fused source.
fn produce(
    src: &HfCheckpoint,
    name: &str,
    planned: &Planned,
    cache: &mut Option<(String, OwnedTensor)>,
) -> Result<OwnedTensor, BridgeError> {
    let out = if planned.dtype == Dtype::F32 {
        OutDtype::F32
    } else {
        OutDtype::BF16
    };
    let (dtype, bytes) = match planned.chunk {
        Some((index, count)) => {
            let whole = match cache.take() {
                Some((cached, t)) if cached == planned.source => t,
                _ => src.read_dequantized(&planned.source, out)?,
            };
            let len = whole.bytes.len() / count.max(1);
            let bytes = whole.bytes[index * len..(index + 1) * len].to_vec();
            let dtype = whole.dtype;
            *cache = Some((planned.source.clone(), whole));
            (dtype, bytes)
        }
        None => {
            let whole = src.read_dequantized(&planned.source, out)?;
            (whole.dtype, whole.bytes)
        }
    };
    let t = OwnedTensor::new(name, dtype, planned.shape.clone(), bytes)?;
    if is_float(t.dtype) {
        t.cast(planned.dtype)
    } else {
        Ok(t)
    }
}

/// Copies the plain files of checkpoint directory `dir` other than weights, index and configs
/// (tokenizer files, …) into `writer`'s directory (symlinks followed, hidden files skipped,
/// in name order).
pub fn copy_other_files(dir: &Path, writer: &mut HfDirWriter) -> Result<(), BridgeError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BridgeError::Io { path, source }
    };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    entries.sort();
    for path in entries {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let skip = name.starts_with('.')
            || name.ends_with(".safetensors")
            || [INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE].contains(&name);
        // `metadata` follows symlinks (hub cache snapshots link to blobs).
        if skip || !std::fs::metadata(&path).map_err(io(&path))?.is_file() {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        writer.write_file(name, &bytes)?;
    }
    Ok(())
}
