//! Validation of an HF checkpoint before any command uses its weights.
//!
//! [`HfCheckpoint::check`] is what `moe convert`, `moe export --model`, `moe logits` /
//! `moe generate` (model loading) and `moe inspect` run first:
//!
//! 1. `config.json` parsed with the model's typed config and validated
//!    ([`ModelConfig::from_dir`]: JSON types, ranges, cross-field rules, plausible sizes).
//! 2. The shard set is unambiguous ([`HfCheckpoint::verify_shards`]): every shard header is
//!    valid, no tensor is stored in two shards, every shard tensor is listed in the index, and
//!    every index entry's shard holds it.
//! 3. Every tensor the config implies ([`expected_hf_tensors`]) is present when required, has
//!    exactly the implied shape, and a usable dtype: a float weight, or a one-byte (FP8) weight
//!    with its `_scale_inv`; scales are floats of the block-grid shape. Integer and bool
//!    tensors where a weight belongs are [`BridgeError::DtypeMismatch`].
//!
//! What transformers tolerates is a warning, as HF loads it: tensors the model does not use
//! (e.g. `rotary_emb.inv_freq`, layers beyond `num_hidden_layers`) are listed in
//! [`CheckReport::unused`] and skipped by conversion and export; an FP8 weight without a scale
//! is value-cast; a scale next to a float weight is ignored.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use super::{CONFIG_FILE, HfCheckpoint};
use crate::BridgeError;
use crate::fp8::scale_inv_name;
use crate::mapping::{ExpectedTable, ExpertLayout, HfRole, expected_hf_tensors, for_model_type};
use crate::safetensors::Dtype;
use crate::weights::ModelConfig;

/// How many names a warning lists before "… N more".
const LISTED: usize = 5;

/// The outcome of a successful [`HfCheckpoint::check`].
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The parsed, validated `config.json`.
    pub config: ModelConfig,
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

    /// Validates the checkpoint against its `config.json` (see the module docs); nothing is
    /// read beyond the headers. Errors are typed [`BridgeError`]s naming the file, the tensor
    /// or the config field; never a panic.
    pub fn check(&self) -> Result<CheckReport, BridgeError> {
        let config_path = self.dir.join(CONFIG_FILE);
        let config = ModelConfig::from_dir(&self.dir)?;
        let mut warnings: Vec<String> = config
            .warnings()
            .into_iter()
            .map(|w| format!("{}: {w}", config_path.display()))
            .collect();
        self.verify_shards()?;
        let registry = for_model_type(config.model_type(), &config_path)?;
        let expert_layout = registry.detect_layout(self.tensor_names(), &self.source)?;
        let block = self.fp8_block_size()?;
        let expected = expected_hf_tensors(
            &config,
            expert_layout.unwrap_or(ExpertLayout::PerExpert),
            &config_path,
            block,
        )?;
        let mut value_cast = Vec::new();
        let mut ignored_scales = Vec::new();
        for (name, want) in &expected {
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
        // Not expected, or the scale of a weight that is absent (an optional one).
        let used = |n: &str| {
            expected.get(n).is_some_and(|want| {
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

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::hf::{INDEX_FILE, SINGLE_FILE};
    use crate::safetensors::{OwnedTensor, TensorView, write_safetensors};
    use crate::test_util::TempDir;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
    }

    /// The tensors of fixture `name`, owned.
    fn tensors(name: &str) -> Vec<OwnedTensor> {
        let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
        ckpt.tensor_names()
            .map(|n| ckpt.tensor(n).unwrap().to_owned_tensor())
            .collect()
    }

    /// A single-file checkpoint of `tensors` with fixture `config_of`'s config.
    fn write_single(dir: &Path, config_of: &str, tensors: &[OwnedTensor]) {
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        write_safetensors(&dir.join(SINGLE_FILE), &views).unwrap();
        std::fs::copy(fixture(config_of).join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
    }

    #[test]
    fn every_fixture_passes_without_warnings() {
        for name in [
            "qwen3",
            "qwen3_moe",
            "qwen3_moe_bf16",
            "deepseek_v3",
            "deepseek_v3_sharded",
            "deepseek_v3_fp8",
            "deepseek_v3_fp8_dequant",
        ] {
            let report = HfCheckpoint::open(fixture(name)).unwrap().check().unwrap();
            assert!(report.unused.is_empty(), "{name}: {:?}", report.unused);
            assert!(report.warnings.is_empty(), "{name}: {:?}", report.warnings);
            assert_eq!(
                report.expert_layout.is_some(),
                report.config.experts().is_some(),
                "{name}"
            );
        }
    }

    #[test]
    fn integer_weights_are_dtype_errors_and_unused_tensors_warnings() {
        let tmp = TempDir::new("check-dtype");
        let mut ts = tensors("qwen3");
        let norm = ts
            .iter_mut()
            .find(|t| t.name == "model.norm.weight")
            .unwrap();
        norm.dtype = Dtype::I32;
        write_single(tmp.path(), "qwen3", &ts);
        let err = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap_err();
        assert!(matches!(err, BridgeError::DtypeMismatch { .. }), "{err}");
        assert!(err.to_string().contains("model.norm.weight"), "{err}");
        // Nor is it widened value by value when read directly.
        let err = HfCheckpoint::open(tmp.path())
            .unwrap()
            .read_f32("model.norm.weight")
            .unwrap_err();
        assert!(matches!(err, BridgeError::DtypeMismatch { .. }), "{err}");

        let mut ts = tensors("qwen3");
        ts.push(
            OwnedTensor::from_f32(
                "model.layers.0.self_attn.rotary_emb.inv_freq",
                vec![2],
                &[1.0, 2.0],
            )
            .unwrap(),
        );
        ts.push(
            OwnedTensor::from_f32("model.layers.9.input_layernorm.weight", vec![1], &[1.0])
                .unwrap(),
        );
        write_single(tmp.path(), "qwen3", &ts);
        let report = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap();
        assert_eq!(report.unused.len(), 2);
        assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
        assert!(report.warnings[0].contains("rotary_emb.inv_freq"));
    }

    #[test]
    fn missing_and_mis_shaped_weights_name_the_tensor() {
        let tmp = TempDir::new("check-shape");
        let mut ts = tensors("qwen3_moe");
        ts.retain(|t| t.name != "model.layers.0.mlp.up_proj.weight");
        write_single(tmp.path(), "qwen3_moe", &ts);
        let err = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap_err();
        assert!(matches!(err, BridgeError::MissingWeight { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("model.layers.0.mlp.up_proj.weight")
        );

        let mut ts = tensors("qwen3_moe");
        let gate = ts
            .iter_mut()
            .find(|t| t.name == "model.layers.2.mlp.gate.weight")
            .unwrap();
        gate.shape = vec![64, 8];
        write_single(tmp.path(), "qwen3_moe", &ts);
        let err = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap_err();
        assert!(matches!(err, BridgeError::ConfigMismatch { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("mlp.gate.weight") && text.contains("config.json"),
            "{text}"
        );
    }

    #[test]
    fn fp8_without_scale_warns_and_wrong_scale_shape_fails() {
        let tmp = TempDir::new("check-fp8");
        let mut ts = tensors("deepseek_v3_fp8");
        ts.retain(|t| t.name != "model.layers.0.mlp.up_proj.weight_scale_inv");
        write_single(tmp.path(), "deepseek_v3_fp8", &ts);
        let report = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap();
        assert!(
            report.warnings.iter().any(
                |w| w.contains("value-cast") && w.contains("model.layers.0.mlp.up_proj.weight")
            ),
            "{:?}",
            report.warnings
        );

        let mut ts = tensors("deepseek_v3_fp8");
        let scale = ts
            .iter_mut()
            .find(|t| t.name == "model.layers.0.mlp.up_proj.weight_scale_inv")
            .unwrap();
        scale.shape = vec![4, 8];
        write_single(tmp.path(), "deepseek_v3_fp8", &ts);
        let err = HfCheckpoint::open(tmp.path()).unwrap().check().unwrap_err();
        assert!(
            err.to_string().contains("up_proj.weight_scale_inv"),
            "{err}"
        );
    }

    #[test]
    fn ambiguous_shard_sets_name_the_tensor_and_files() {
        let tmp = TempDir::new("check-shards");
        let dir = tmp.path();
        let ts = tensors("qwen3");
        let (a, b) = ts.split_at(ts.len() / 2);
        let write = |file: &str, part: &[OwnedTensor]| {
            let views: Vec<TensorView<'_>> = part.iter().map(OwnedTensor::view).collect();
            write_safetensors(&dir.join(file), &views).unwrap();
        };
        std::fs::copy(fixture("qwen3").join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
        let index = |map: &[(&str, &str)]| {
            let weight_map: serde_json::Map<String, serde_json::Value> = map
                .iter()
                .map(|(t, f)| ((*t).to_owned(), (*f).into()))
                .collect();
            let text = serde_json::json!({ "weight_map": weight_map }).to_string();
            std::fs::write(dir.join(INDEX_FILE), text).unwrap();
        };
        let mut map: Vec<(&str, &str)> = a
            .iter()
            .map(|t| (t.name.as_str(), "s1.safetensors"))
            .collect();
        map.extend(b.iter().map(|t| (t.name.as_str(), "s2.safetensors")));
        write("s1.safetensors", a);
        write("s2.safetensors", b);
        index(&map);
        HfCheckpoint::open(dir).unwrap().check().unwrap();

        // A tensor of s1 copied into s2 as well.
        let mut b2 = b.to_vec();
        b2.push(a[0].clone());
        write("s2.safetensors", &b2);
        let err = HfCheckpoint::open(dir).unwrap().check().unwrap_err();
        assert!(
            matches!(err, BridgeError::TensorInTwoShards { .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&a[0].name)
                && text.contains("s1.safetensors")
                && text.contains("s2.safetensors"),
            "{text}"
        );
        write("s2.safetensors", b);

        // An index entry dropped.
        index(&map[1..]);
        let err = HfCheckpoint::open(dir).unwrap().check().unwrap_err();
        assert!(matches!(err, BridgeError::UnindexedTensor { .. }), "{err}");
        assert!(err.to_string().contains(&a[0].name));

        // An index entry naming the wrong shard.
        let mut wrong = map.clone();
        wrong[0].1 = "s2.safetensors";
        index(&wrong);
        let err = HfCheckpoint::open(dir).unwrap().check().unwrap_err();
        assert!(
            matches!(err, BridgeError::IndexedTensorMissing { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("s2.safetensors"));
    }
}
