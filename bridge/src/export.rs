//! HF → HF export (docs/checkpoints.md §Minimal loadable export, §Streaming conversion): e.g. an
//! FP8 release checkpoint to BF16, a stacked-expert checkpoint to per-expert names, or a
//! re-sharding.
//!
//! - Weights under per-expert HF names, in the requested dtype (FP8 weights are dequantised,
//!   computing in f32 and rounding once); `e_score_correction_bias` stays F32 (mapping rule);
//!   every `*_scale_inv` and `rotary_emb.inv_freq` is dropped; `lm_head.weight` is omitted when
//!   `tie_word_embeddings` is true; MTP copies of `embed_tokens` / `shared_head.head` are copied
//!   through, and optionally emitted when absent.
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
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            overwrite: false,
            emit_mtp_copies: false,
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
            tensors.push(produce(src, key, planned, &mut cache)?);
        }
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        writer.write_shard(i, &views)?;
    }

    let config_dtype = opts.dtype.or(dequantized.then_some(Dtype::BF16));
    writer.write_json(
        CONFIG_FILE,
        &export_config(&config, config_dtype, dequantized),
    )?;
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
