//! Writing a live model's weights as an HF checkpoint directory with bounded memory
//! (docs/checkpoints.md §Minimal loadable export, §FP8 release format; issue 7 "weight export
//! during training").
//!
//! The input is moe-models' streaming iterator ([`HfTensors`], from
//! [`crate::export::export_hf_tensors`]), whose specs give every name, shape and dtype
//! before any data moves. From them the shards are planned **in yield order** (greedy up to
//! `max_shard_size`), and each shard file is streamed: its safetensors header is written
//! first, then every tensor's bytes as the tensor arrives, so at most one tensor (plus its
//! converted copy) is in memory. Shards go into a hidden temporary directory that is renamed
//! into place after the index and configs are written (atomic like
//! [`moe_bridge::safetensors::HfDirWriter`];
//! the temporary directory is removed on error).
//!
//! Output dtypes ([`LiveDtype`]): F32, BF16 (RNE from f32), or FP8 blockwise: every 2-D
//! projection (attention, dense/shared MLP, experts, MTP `eh_proj`) becomes `F8_E4M3` plus an
//! F32 `<name>_scale_inv` with the release recipe ([`moe_bridge::fp8::quantize_blockwise`]) and
//! `quantization_config` is written; embeddings, `lm_head`, norms and routers stay BF16.
//! `e_score_correction_bias` is always F32.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use moe_backend::fs::{sibling_temp_path, write_atomic_bytes};
use moe_bridge::BridgeError;
use moe_bridge::export::{DEFAULT_MAX_SHARD_SIZE, default_generation_config, export_config};
use moe_bridge::fp8::{quantize_blockwise, scale_inv_name};
use moe_bridge::hf::{CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use moe_bridge::safetensors::{
    Dtype, MEMORY, OwnedTensor, commit_dir, planned_header, pt_metadata,
};
use serde_json::{Value, json};

use crate::ModelError;
use crate::export::{ExportHf, HfTensorSpec, HfTensors};
use crate::param_plan::hf_names;

/// dtype of the exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LiveDtype {
    /// float32 (bit-identical to f32 parameters).
    F32,
    /// bfloat16, rounded to nearest even.
    #[default]
    BF16,
    /// FP8 E4M3 blockwise with `*_scale_inv` (block `[b0, b1]`, the release uses 128×128).
    Fp8 {
        /// Block size.
        block: [usize; 2],
    },
}

/// How to write a live export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveExportOptions {
    /// Weight dtype.
    pub dtype: LiveDtype,
    /// Largest shard in bytes (a larger tensor gets its own shard).
    pub max_shard_size: u64,
    /// Replace an existing target directory.
    pub overwrite: bool,
}

impl Default for LiveExportOptions {
    fn default() -> Self {
        Self {
            dtype: LiveDtype::BF16,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            overwrite: false,
        }
    }
}

/// What a live export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveExportSummary {
    /// The written directory.
    pub target: PathBuf,
    /// Tensors written (scales included).
    pub tensors: usize,
    /// Σ tensor bytes (the index's `total_size`).
    pub total_size: u64,
    /// Safetensors files.
    pub shards: usize,
}

/// One tensor of the output, planned from a spec.
#[derive(Debug, Clone)]
struct Planned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl Planned {
    fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * self.dtype.size()) as u64
    }
}

/// Whether `name` (rank 2) is quantised in FP8 mode: every projection, not embeddings,
/// heads or routers (the release list of docs/checkpoints.md §FP8 release format).
fn fp8_quantized(spec: &HfTensorSpec) -> bool {
    let n = &spec.name;
    spec.shape.len() == 2
        && !hf_names::mentions_embedding_or_head(n)
        && !hf_names::is_mtp_head_copy(n)
        && !hf_names::is_router_weight(n)
}

/// The output tensors of one spec (one, or the FP8 pair `(q, scale_inv)`).
fn plan_spec(spec: &HfTensorSpec, dtype: LiveDtype) -> Vec<Planned> {
    let one = |dtype| {
        vec![Planned {
            name: spec.name.clone(),
            dtype,
            shape: spec.shape.clone(),
        }]
    };
    if hf_names::is_expert_bias(&spec.name) {
        return one(Dtype::F32);
    }
    match dtype {
        LiveDtype::F32 => one(Dtype::F32),
        LiveDtype::BF16 => one(Dtype::BF16),
        LiveDtype::Fp8 { block } if fp8_quantized(spec) => vec![
            Planned {
                name: spec.name.clone(),
                dtype: Dtype::F8E4M3,
                shape: spec.shape.clone(),
            },
            Planned {
                name: scale_inv_name(&spec.name),
                dtype: Dtype::F32,
                shape: vec![
                    spec.shape[0].div_ceil(block[0]),
                    spec.shape[1].div_ceil(block[1]),
                ],
            },
        ],
        LiveDtype::Fp8 { .. } => one(Dtype::BF16),
    }
}

/// The safetensors header (with the 8-byte length prefix) of one shard, data in `entries`
/// order.
fn shard_header(entries: &[Planned], path: &Path) -> Result<Vec<u8>, BridgeError> {
    let entries = entries.iter().map(|p| {
        (
            p.name.as_str(),
            p.dtype,
            p.shape.clone(),
            p.bytes() as usize,
        )
    });
    Ok(planned_header(&pt_metadata(), entries, path)?.0)
}

/// A hidden temporary directory beside the target, removed unless committed.
struct TempDirGuard {
    tmp: PathBuf,
    committed: bool,
}

impl Drop for TempDirGuard {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BridgeError + '_ {
    move |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Converts one yielded tensor to its planned outputs' bytes.
fn encode(
    spec: &HfTensorSpec,
    data: &burn::tensor::TensorData,
    planned: &[Planned],
    dtype: LiveDtype,
) -> Result<Vec<Vec<u8>>, BridgeError> {
    let tensor = OwnedTensor::from_tensor_data(spec.name.clone(), data)?;
    if tensor.shape != spec.shape {
        return Err(BridgeError::ShapeMismatch {
            path: MEMORY.into(),
            tensor: spec.name.clone(),
            expected: spec.shape.clone(),
            actual: tensor.shape,
        });
    }
    match (planned, dtype) {
        ([q, _], LiveDtype::Fp8 { block }) if q.dtype == Dtype::F8E4M3 => {
            let values = tensor.to_f32_vec()?;
            let (bytes, scales) =
                quantize_blockwise(&values, [spec.shape[0], spec.shape[1]], block).ok_or_else(
                    || BridgeError::InvalidWrite {
                        path: MEMORY.into(),
                        tensor: spec.name.clone(),
                        reason: format!("cannot quantise in {block:?} blocks"),
                    },
                )?;
            Ok(vec![
                bytes,
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ])
        }
        ([p], _) if p.dtype == tensor.dtype => Ok(vec![tensor.bytes]),
        ([p], _) => Ok(vec![tensor.cast(p.dtype)?.bytes]),
        _ => Err(BridgeError::InvalidWrite {
            path: MEMORY.into(),
            tensor: spec.name.clone(),
            reason: "inconsistent export plan".into(),
        }),
    }
}

/// Writes `tensors` as an HF checkpoint directory at `target` (see the module docs), with
/// `config` (the model's `config.json`, e.g. the source checkpoint's; `dtype` updated,
/// `quantization_config` set for FP8 and removed otherwise) and `generation_config` (or the
/// default of docs/checkpoints.md §Minimal loadable export).
pub fn write_hf_tensors(
    tensors: HfTensors,
    config: &Value,
    generation_config: Option<&Value>,
    target: &Path,
    opts: &LiveExportOptions,
) -> Result<LiveExportSummary, BridgeError> {
    if let LiveDtype::Fp8 { block } = opts.dtype
        && block.contains(&0)
    {
        return Err(BridgeError::InvalidConfig {
            path: target.to_path_buf(),
            field: "weight_block_size".into(),
            reason: format!("{block:?} has a zero"),
        });
    }
    if target.exists() && !opts.overwrite {
        return Err(BridgeError::TargetExists {
            path: target.to_path_buf(),
        });
    }
    // Plan: per spec its outputs; shards greedy in yield order.
    let per_spec: Vec<Vec<Planned>> = tensors
        .specs()
        .iter()
        .map(|s| plan_spec(s, opts.dtype))
        .collect();
    let mut shard_of_spec = Vec::with_capacity(per_spec.len());
    let mut shards: Vec<Vec<Planned>> = Vec::new();
    let mut current = 0u64;
    for outs in &per_spec {
        let size: u64 = outs.iter().map(Planned::bytes).sum();
        match shards.last_mut() {
            Some(shard) if current.saturating_add(size) <= opts.max_shard_size => {
                shard.extend(outs.iter().cloned());
                current += size;
            }
            _ => {
                shards.push(outs.clone());
                current = size;
            }
        }
        shard_of_spec.push(shards.len() - 1);
    }
    let n = shards.len().max(1);
    let file_name = |i: usize| match n {
        1 => SINGLE_FILE.to_owned(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
    };

    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    let tmp = sibling_temp_path(target, "live-tmp");
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    let mut guard = TempDirGuard {
        tmp: tmp.clone(),
        committed: false,
    };

    let specs = tensors.specs().to_vec();
    let mut open: Option<(usize, PathBuf, BufWriter<File>)> = None;
    let close = |open: Option<(usize, PathBuf, BufWriter<File>)>| -> Result<(), BridgeError> {
        if let Some((_, path, out)) = open {
            let file = out.into_inner().map_err(|e| io(&path)(e.into_error()))?;
            file.sync_all().map_err(io(&path))?;
        }
        Ok(())
    };
    for (i, (name, data)) in tensors.enumerate() {
        let (spec, planned, shard) = (&specs[i], &per_spec[i], shard_of_spec[i]);
        debug_assert_eq!(spec.name, name);
        if open.as_ref().map(|o| o.0) != Some(shard) {
            close(open.take())?;
            let path = tmp.join(file_name(shard));
            let mut out = BufWriter::new(File::create(&path).map_err(io(&path))?);
            out.write_all(&shard_header(&shards[shard], &path)?)
                .map_err(io(&path))?;
            open = Some((shard, path, out));
        }
        let Some((_, path, out)) = open.as_mut() else {
            continue;
        };
        for (p, bytes) in planned
            .iter()
            .zip(encode(spec, &data, planned, opts.dtype)?)
        {
            if bytes.len() as u64 != p.bytes() {
                return Err(BridgeError::InvalidWrite {
                    path: path.clone(),
                    tensor: p.name.clone(),
                    reason: format!("{} bytes, planned {}", bytes.len(), p.bytes()),
                });
            }
            out.write_all(&bytes).map_err(io(path))?;
        }
    }
    close(open.take())?;
    if shards.is_empty() {
        let path = tmp.join(SINGLE_FILE);
        write_atomic_bytes(&path, &shard_header(&[], &path)?)?;
    }

    let all: Vec<&Planned> = shards.iter().flatten().collect();
    let total_size: u64 = all.iter().map(|p| p.bytes()).sum();
    if n > 1 {
        let weight_map: BTreeMap<&str, String> = shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.iter().map(move |p| (p.name.as_str(), file_name(i))))
            .collect();
        let params: u64 = all
            .iter()
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        let index = json!({
            "metadata": {"total_parameters": params, "total_size": total_size},
            "weight_map": weight_map,
        });
        write_json(&tmp.join(INDEX_FILE), &index)?;
    }
    let config_dtype = match opts.dtype {
        LiveDtype::F32 => Dtype::F32,
        _ => Dtype::BF16,
    };
    let mut out_config = export_config(config, Some(config_dtype), true);
    if let (LiveDtype::Fp8 { block }, Value::Object(map)) = (opts.dtype, &mut out_config) {
        map.insert(
            "quantization_config".into(),
            json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": block}),
        );
    }
    write_json(&tmp.join(CONFIG_FILE), &out_config)?;
    let generation = generation_config
        .cloned()
        .unwrap_or_else(|| default_generation_config(config));
    write_json(&tmp.join(GENERATION_CONFIG_FILE), &generation)?;

    commit_dir(&tmp, target, opts.overwrite)?;
    guard.committed = true;
    Ok(LiveExportSummary {
        target: target.to_path_buf(),
        tensors: all.len(),
        total_size,
        shards: n,
    })
}

/// [`write_hf_tensors`] of `model`'s streaming iterator. Errors: the model's own (e.g. a
/// shard that cannot be gathered), or the writer's [`BridgeError`] as [`ModelError::Bridge`].
pub fn export_live_model<M: ExportHf + ?Sized>(
    model: &M,
    config: &Value,
    generation_config: Option<&Value>,
    target: &Path,
    opts: &LiveExportOptions,
) -> Result<LiveExportSummary, ModelError> {
    Ok(write_hf_tensors(
        model.hf_tensors()?,
        config,
        generation_config,
        target,
        opts,
    )?)
}

fn write_json(path: &Path, value: &Value) -> Result<(), BridgeError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| BridgeError::InvalidJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    text.push('\n');
    Ok(write_atomic_bytes(path, text.as_bytes())?)
}

#[cfg(test)]
mod tests;
