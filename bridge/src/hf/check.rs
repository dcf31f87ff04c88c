//! Validation of an HF checkpoint before any command uses its weights.
//!
//! [`HfCheckpoint::check`] is what `moe convert`, `moe export --model`, `moe logits` /
//! `moe generate` (model loading) and `moe inspect` run first:
//!
//! 1. `config.json` parsed with the model's typed config `C` and validated
//!    ([`ModelSchema::from_config`]: JSON types, ranges, cross-field rules, plausible sizes).
//!    The model knowledge (config type, name mapping, expected tensors) is the caller's
//!    [`ModelSchema`] (moe-models' `ModelConfig` for the built-in models).
//! 2. The shard set is unambiguous ([`HfCheckpoint::verify_shards`]): every shard header is
//!    valid, no tensor is stored in two shards, every shard tensor is listed in the index, and
//!    every index entry's shard holds it.
//! 3. Every tensor the config implies ([`ModelSchema::expected_hf_tensors`]) is present when
//!    required, has exactly the implied shape, and a usable dtype: a float weight, or a
//!    one-byte (FP8) weight with its `_scale_inv`; scales are floats of the block-grid shape.
//!    Integer and bool tensors where a weight belongs are [`BridgeError::DtypeMismatch`].
//!
//! What transformers tolerates is a warning, as HF loads it: tensors the model does not use
//! (e.g. `rotary_emb.inv_freq`, layers beyond `num_hidden_layers`) are listed in
//! [`CheckReport::unused`] and skipped by conversion and export; an FP8 weight without a scale
//! is value-cast; a scale next to a float weight is ignored.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use super::{CONFIG_FILE, HfCheckpoint, read_json};
use crate::BridgeError;
use crate::fp8::scale_inv_name;
use crate::mapping::{ExpectedTable, ExpertLayout, HfRole};
use crate::safetensors::Dtype;
use crate::schema::ModelSchema;

/// How many names a warning lists before "… N more".
const LISTED: usize = 5;

/// The outcome of a successful [`HfCheckpoint::check`]; `C` is the model's config type (a
/// [`ModelSchema`]).
#[derive(Debug, Clone)]
pub struct CheckReport<C> {
    /// The parsed, validated `config.json`.
    pub config: C,
    /// How the checkpoint stores routed experts (`None`: no routed experts).
    pub expert_layout: Option<ExpertLayout>,
    /// The HF tensors the config implies (what was checked).
    pub expected: ExpectedTable,
    /// Tensors in the checkpoint that the model does not use (ignored, as transformers does).
    pub unused: BTreeSet<String>,
    /// Non-fatal findings, one line each, for the user (the CLI prints them as
    /// `warning: …`).
    pub warnings: Vec<String>,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// One-byte dtypes the FP8 load hook dequantises when a `_scale_inv` exists.
fn is_quantized(d: Dtype) -> bool {
    matches!(d, Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::I8 | Dtype::U8)
}

/// `a, b, c, … N more`.
fn list(names: &[&str]) -> String {
    let mut text = names
        .iter()
        .take(LISTED)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED {
        text.push_str(&format!(", … {} more", names.len() - LISTED));
    }
    text
}

impl HfCheckpoint {
    /// Opens every shard (validating its header) and checks that the shard set is
    /// unambiguous: an index listing at least one tensor ([`BridgeError::InvalidIndex`]), no
    /// tensor stored in two shards ([`BridgeError::TensorInTwoShards`]), no
    /// shard tensor missing from the index ([`BridgeError::UnindexedTensor`]), no index entry
    /// whose shard lacks the tensor ([`BridgeError::IndexedTensorMissing`]). Errors name the
    /// tensor and the files.
    pub fn verify_shards(&self) -> Result<(), BridgeError> {
        let index = &self.source;
        if self.is_sharded() && self.weight_map.is_empty() {
            return Err(BridgeError::InvalidIndex {
                path: index.clone(),
                reason: "`weight_map` lists no tensors".to_owned(),
            });
        }
        // Where each tensor physically is, in shard order.
        let mut stored: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, path) in self.shard_paths.iter().enumerate() {
            let file = self.shard_at(i, "")?;
            for t in file.names() {
                if !self.weight_map.contains_key(t) {
                    return Err(BridgeError::UnindexedTensor {
                        index: index.clone(),
                        shard: path.clone(),
                        tensor: t.to_owned(),
                    });
                }
                stored.entry(t).or_default().push(i);
            }
        }
        for (tensor, &listed) in &self.weight_map {
            let shards = stored.get(tensor.as_str()).map_or(&[][..], Vec::as_slice);
            if !shards.contains(&listed) {
                return Err(BridgeError::IndexedTensorMissing {
                    index: index.clone(),
                    shard: self.shard_paths[listed].clone(),
                    tensor: tensor.clone(),
                });
            }
            if let Some(&other) = shards.iter().find(|&&s| s != listed) {
                return Err(BridgeError::TensorInTwoShards {
                    index: index.clone(),
                    tensor: tensor.clone(),
                    first: self.shard_paths[listed].clone(),
                    second: self.shard_paths[other].clone(),
                });
            }
        }
        Ok(())
    }

    /// Validates the checkpoint against its `config.json`, read as the model config `C`
    /// (see the module docs); nothing is read beyond the headers. Errors are typed
    /// [`BridgeError`]s naming the file, the tensor or the config field; never a panic.
    pub fn check<C: ModelSchema>(&self) -> Result<CheckReport<C>, BridgeError> {
        let config_path = self.dir.join(CONFIG_FILE);
        let json = read_json(&config_path)?;
        let config = C::from_config(&json, &config_path)?;
        let mut warnings: Vec<String> = config
            .warnings()
            .into_iter()
            .map(|w| format!("{}: {w}", config_path.display()))
            .collect();
        self.verify_shards()?;
        let registry = C::registry_of(&json, &config_path)?;
        let expert_layout = registry.detect_layout(self.tensor_names(), &self.source)?;
        let block = self.fp8_block_size()?;
        let expected = config.expected_hf_tensors(
            expert_layout.unwrap_or(ExpertLayout::PerExpert),
            &config_path,
            block,
        )?;
        let mut value_cast = Vec::new();
        let mut ignored_scales = Vec::new();
        for (name, want) in &expected {
            if !self.contains(name)
                && let Some(stored) = &want.mxfp4
                && self.is_mxfp4(name)
            {
                self.check_mxfp4(name, stored)?;
                continue;
            }
            if !self.contains(name) {
                if want.required {
                    return Err(BridgeError::MissingWeight {
                        path: self.source.clone(),
                        config: config_path,
                        tensor: name.clone(),
                        expected: want.shape.clone(),
                    });
                }
                continue;
            }
            let info = self.info(name)?;
            let file = || -> Result<PathBuf, BridgeError> { Ok(self.file_of(name)?.to_owned()) };
            if info.shape != want.shape {
                return Err(BridgeError::ConfigMismatch {
                    path: file()?,
                    config: config_path,
                    tensor: name.clone(),
                    expected: want.shape.clone(),
                    found: info.shape.clone(),
                });
            }
            let dtype = info.dtype;
            let bad_dtype = |expected: &str| -> Result<BridgeError, BridgeError> {
                Ok(BridgeError::DtypeMismatch {
                    path: file()?,
                    tensor: name.clone(),
                    expected: expected.to_owned(),
                    actual: dtype.to_string(),
                })
            };
            match want.role {
                HfRole::Weight => {
                    let scaled = self.contains(&scale_inv_name(name));
                    if is_float(dtype) {
                        if scaled {
                            ignored_scales.push(name.as_str());
                        }
                    } else if scaled && is_quantized(dtype) {
                        // Dequantised by the FP8 load hook.
                    } else if matches!(dtype, Dtype::F8E4M3 | Dtype::F8E5M2) {
                        value_cast.push(name.as_str());
                    } else {
                        return Err(bad_dtype(
                            "a float weight (F32, BF16, F16, F64; or F8_E4M3/F8_E5M2/I8/U8 \
                             with a `_scale_inv`)",
                        )?);
                    }
                }
                HfRole::ScaleInv => {
                    if !(is_float(dtype) || dtype == Dtype::F8E8M0) {
                        return Err(bad_dtype(
                            "a float FP8 inverse scale (F32, BF16, F16, F64 or F8_E8M0)",
                        )?);
                    }
                }
            }
        }
        // Not expected, or the scale of a weight that is absent (an optional one); the MXFP4
        // pair of an expected weight is used.
        let used = |n: &str| {
            let pair = crate::mxfp4::mxfp4_base(n)
                .and_then(|base| expected.get(base))
                .is_some_and(|want| want.mxfp4.is_some());
            pair || expected.get(n).is_some_and(|want| {
                want.scale_of
                    .as_deref()
                    .is_none_or(|weight| self.contains(weight))
            })
        };
        let unused: BTreeSet<String> = self
            .tensor_names()
            .filter(|n| !used(n))
            .map(str::to_owned)
            .collect();
        if !value_cast.is_empty() {
            warnings.push(format!(
                "{}: {} FP8 weight(s) without a `_scale_inv` are value-cast to BF16 (as \
                 transformers does): {}",
                self.source.display(),
                value_cast.len(),
                list(&value_cast)
            ));
        }
        if !ignored_scales.is_empty() {
            warnings.push(format!(
                "{}: {} float weight(s) have a `_scale_inv`, which is ignored (only one-byte \
                 weights are dequantised): {}",
                self.source.display(),
                ignored_scales.len(),
                list(&ignored_scales)
            ));
        }
        if !unused.is_empty() {
            let names: Vec<&str> = unused.iter().map(String::as_str).collect();
            warnings.push(format!(
                "{}: {} tensor(s) the `{}` model does not use are ignored (as transformers \
                 ignores them): {}",
                self.source.display(),
                names.len(),
                config.model_type(),
                list(&names)
            ));
        }
        Ok(CheckReport {
            config,
            expert_layout,
            expected,
            unused,
            warnings,
        })
    }
}

impl HfCheckpoint {
    /// Checks the MXFP4 pair of weight `name` against the matrix shape `stored` it must
    /// decode to (`[..., K]`, `K` the blocked input width): both `U8`, blocks
    /// `[..., K/32, 16]` (32 values a block) and scales `[..., K/32]`. A block width other than
    /// 32 values, or blocks that do not tile `K`, is [`BridgeError::Mxfp4`] naming the blocks
    /// tensor; other shapes are [`BridgeError::ConfigMismatch`].
    fn check_mxfp4(&self, name: &str, stored: &[usize]) -> Result<(), BridgeError> {
        use crate::mxfp4::{BLOCK, BLOCKS_SUFFIX, SCALES_SUFFIX};
        let config = self.dir.join(CONFIG_FILE);
        let blocks_name = format!("{name}{BLOCKS_SUFFIX}");
        let scales_name = format!("{name}{SCALES_SUFFIX}");
        let mxfp4 = |tensor: &str, reason: String| BridgeError::Mxfp4 {
            tensor: tensor.to_owned(),
            reason,
        };
        let Some((&width, lead)) = stored.split_last() else {
            return Err(mxfp4(&blocks_name, "a scalar has no MXFP4 blocks".into()));
        };
        for tensor in [&blocks_name, &scales_name] {
            let info = self.info(tensor)?;
            if info.dtype != Dtype::U8 {
                return Err(BridgeError::DtypeMismatch {
                    path: self.file_of(tensor)?.to_owned(),
                    tensor: tensor.clone(),
                    expected: "U8 (MXFP4 codes / E8M0 scales)".to_owned(),
                    actual: info.dtype.to_string(),
                });
            }
        }
        let blocks = self.info(&blocks_name)?.shape.clone();
        let bytes = blocks.last().copied().unwrap_or(0);
        if bytes != BLOCK / 2 {
            return Err(mxfp4(
                &blocks_name,
                format!(
                    "blocks {blocks:?} hold {} values each; MXFP4 blocks hold {BLOCK} ({} bytes) and tile the input width {width}",
                    2 * bytes,
                    BLOCK / 2
                ),
            ));
        }
        if !width.is_multiple_of(BLOCK) {
            return Err(mxfp4(
                &blocks_name,
                format!("the input width {width} is not a multiple of the block size {BLOCK}"),
            ));
        }
        let mut want_scales = lead.to_vec();
        want_scales.push(width / BLOCK);
        let mut want_blocks = want_scales.clone();
        want_blocks.push(BLOCK / 2);
        for (tensor, want) in [(&blocks_name, want_blocks), (&scales_name, want_scales)] {
            let found = self.info(tensor)?.shape.clone();
            if found != want {
                return Err(BridgeError::ConfigMismatch {
                    path: self.file_of(tensor)?.to_owned(),
                    config,
                    tensor: tensor.clone(),
                    expected: want,
                    found,
                });
            }
        }
        Ok(())
    }
}
