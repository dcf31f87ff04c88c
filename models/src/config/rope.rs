//! RoPE parameters, normalised from either spelling (docs/models.md §Config parsing,
//! §RoPE and YaRN).
//!
//! HF 5.23 writes `rope_parameters {rope_type, rope_theta, ...}`; older configs write a top-level
//! `rope_theta` plus `rope_scaling {type | rope_type, ...}` (`null` meaning plain RoPE). Both
//! become one [`RopeParameters`]. [`RopeJson`] is either object as written; [`RopeParameters`]
//! serializes back as a 5.23 `rope_parameters` object.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::de;
use crate::ModelError;

/// HF's default RoPE base when a config gives none.
pub const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// RoPE settings shared by every model family.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParameters {
    /// Base `θ` of the inverse frequencies `θ^(−2j/dim)`.
    pub rope_theta: f64,
    /// Frequency scaling applied on top of the default frequencies.
    pub scaling: RopeScaling,
}

impl Default for RopeParameters {
    fn default() -> Self {
        Self {
            rope_theta: DEFAULT_ROPE_THETA,
            scaling: RopeScaling::Default,
        }
    }
}

impl RopeParameters {
    /// The HF `rope_type` string: `"default"` or `"yarn"`.
    pub fn rope_type(&self) -> &'static str {
        match self.scaling {
            RopeScaling::Default => "default",
            RopeScaling::Yarn(_) => "yarn",
        }
    }
}

/// Which RoPE frequency scheme is used; the only two this project supports.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type = "default"`).
    Default,
    /// YaRN interpolation (`rope_type = "yarn"`).
    Yarn(YarnParameters),
}

/// YaRN parameters with HF's defaults already applied (docs/models.md §RoPE and YaRN).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnParameters {
    /// Context extension factor; a `null`/absent `factor` is derived as
    /// `max_position_embeddings / original_max_position_embeddings`.
    pub factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Fast boundary of the correction range (`null` or 0 ⇒ 32).
    pub beta_fast: f64,
    /// Slow boundary of the correction range (`null` or 0 ⇒ 1).
    pub beta_slow: f64,
    /// `mscale` of `get_mscale` (DeepSeek), if given.
    pub mscale: Option<f64>,
    /// `mscale_all_dim` of `get_mscale` (DeepSeek), if given.
    pub mscale_all_dim: Option<f64>,
    /// Explicit attention factor; when `None` it is derived from `factor` and the mscales.
    pub attention_factor: Option<f64>,
    /// Whether the correction range is rounded with floor/ceil (HF default `true`).
    pub truncate: bool,
}

/// A `rope_parameters` (HF 5.23) or legacy `rope_scaling` object, field by field as HF writes
/// it. Every field is optional; HF applies the YaRN defaults where it reads them
/// (`_compute_yarn_parameters`), and so does [`resolve`].
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
// Must stay `de::OBJECT_OR_NULL`, which turns it into a `WrongType` error.
#[serde(expecting = "an object or null")]
pub(crate) struct RopeJson {
    /// `"default"` | `"yarn"` (5.23 spelling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    /// Legacy spelling of `rope_type`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
    /// RoPE base (5.23 keeps it here rather than at the top level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// YaRN context extension factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// YaRN pre-training context length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN fast correction boundary (`null` or 0 ⇒ 32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    /// YaRN slow correction boundary (`null` or 0 ⇒ 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    /// DeepSeek `mscale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<f64>,
    /// DeepSeek `mscale_all_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale_all_dim: Option<f64>,
    /// Explicit YaRN attention factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    /// Floor/ceil the YaRN correction range (`null` ⇒ `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    /// Keys of other RoPE types (e.g. `low_freq_factor`); not interpreted.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The RoPE keys of a config: top-level `rope_theta`, `rope_parameters`, legacy `rope_scaling`.
#[derive(Debug)]
pub(crate) struct RopeKeys {
    /// Top-level `rope_theta` (legacy spelling).
    pub rope_theta: Option<f64>,
    /// `rope_parameters` (5.23 spelling).
    pub rope_parameters: Option<RopeJson>,
    /// `rope_scaling` (legacy spelling).
    pub rope_scaling: Option<RopeJson>,
}

/// Normalises the RoPE keys of a config into [`RopeParameters`].
///
/// `rope_parameters` wins over the legacy keys when both are present (a legacy `rope_scaling` is
/// then ignored; a top-level `rope_theta` is only used if `rope_parameters` lacks one). For YaRN
/// a top-level `original_max_position_embeddings` is taken out of `extra` (it stays there
/// otherwise).
pub(crate) fn resolve(
    keys: RopeKeys,
    extra: &mut Map<String, Value>,
    max_position_embeddings: usize,
) -> Result<RopeParameters, ModelError> {
    let (obj, prefix, theta) = match (keys.rope_parameters, keys.rope_scaling) {
        (Some(p), _) => {
            let theta = p.rope_theta.or(keys.rope_theta);
            (Some(p), "rope_parameters.", theta)
        }
        (None, legacy) => (legacy, "rope_scaling.", keys.rope_theta),
    };
    let rope_theta = theta.unwrap_or(DEFAULT_ROPE_THETA);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(ModelError::invalid(
            "rope_theta",
            format!("must be a positive number, got {rope_theta}"),
        ));
    }
    let Some(mut obj) = obj else {
        return Ok(RopeParameters {
            rope_theta,
            scaling: RopeScaling::Default,
        });
    };
    let type_key_is_legacy = obj.rope_type.is_none() && obj.legacy_type.is_some();
    let rope_type = de::either(
        ("rope_type", obj.rope_type.take()),
        ("type", obj.legacy_type.take()),
    )?;
    let scaling = match rope_type.as_deref().unwrap_or("default") {
        "default" => RopeScaling::Default,
        "yarn" => {
            const TOP_ORIG: &str = "original_max_position_embeddings";
            let orig_top = match extra.remove(TOP_ORIG) {
                Some(v) => Some(de::deserialize::<usize>(TOP_ORIG, &v)?),
                None => None,
            };
            RopeScaling::Yarn(yarn(&obj, prefix, orig_top, max_position_embeddings)?)
        }
        other => {
            let key = if type_key_is_legacy {
                "type"
            } else {
                "rope_type"
            };
            return Err(ModelError::invalid(
                format!("{prefix}{key}"),
                format!("\"{other}\" is not supported (expected \"default\" or \"yarn\")"),
            ));
        }
    };
    Ok(RopeParameters {
        rope_theta,
        scaling,
    })
}

/// YaRN parameters with HF's defaults applied; `prefix` names the object in errors.
fn yarn(
    obj: &RopeJson,
    prefix: &str,
    orig_top: Option<usize>,
    max_position_embeddings: usize,
) -> Result<YarnParameters, ModelError> {
    let orig = obj
        .original_max_position_embeddings
        .or(orig_top)
        .unwrap_or(max_position_embeddings);
    if orig == 0 {
        return Err(ModelError::invalid(
            format!("{prefix}original_max_position_embeddings"),
            "must be positive",
        ));
    }
    let factor = obj
        .factor
        .unwrap_or(max_position_embeddings as f64 / orig as f64);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::invalid(
            format!("{prefix}factor"),
            format!("must be a positive number, got {factor}"),
        ));
    }
    let nonzero_or = |v: Option<f64>, d: f64| v.filter(|&x| x != 0.0).unwrap_or(d);
    Ok(YarnParameters {
        factor,
        original_max_position_embeddings: orig,
        beta_fast: nonzero_or(obj.beta_fast, 32.0),
        beta_slow: nonzero_or(obj.beta_slow, 1.0),
        mscale: obj.mscale,
        mscale_all_dim: obj.mscale_all_dim,
        attention_factor: obj.attention_factor,
        truncate: obj.truncate.unwrap_or(true),
    })
}

impl From<&RopeParameters> for RopeJson {
    /// The 5.23 `rope_parameters` object, every YaRN default written out.
    fn from(p: &RopeParameters) -> Self {
        let mut json = RopeJson {
            rope_type: Some(p.rope_type().to_owned()),
            rope_theta: Some(p.rope_theta),
            ..RopeJson::default()
        };
        if let RopeScaling::Yarn(y) = &p.scaling {
            json.factor = Some(y.factor);
            json.original_max_position_embeddings = Some(y.original_max_position_embeddings);
            json.beta_fast = Some(y.beta_fast);
            json.beta_slow = Some(y.beta_slow);
            json.mscale = y.mscale;
            json.mscale_all_dim = y.mscale_all_dim;
            json.attention_factor = y.attention_factor;
            json.truncate = Some(y.truncate);
        }
        json
    }
}
