//! RoPE parameters, normalised from either spelling (models.md §2, §3.3).
//!
//! HF 5.23 writes `rope_parameters {rope_type, rope_theta, ...}`; older configs write a top-level
//! `rope_theta` plus `rope_scaling {type | rope_type, ...}` (`null` meaning plain RoPE). Both
//! become one [`RopeParameters`].

use super::json::JsonObject;
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

/// YaRN parameters with HF's defaults already applied (models.md §3.3).
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

/// Takes the RoPE keys out of `cfg` and normalises them.
///
/// `rope_parameters` wins over the legacy keys when both are present (a legacy `rope_scaling` is
/// then ignored; a top-level `rope_theta` is only used if `rope_parameters` lacks one).
pub(crate) fn parse_rope(
    cfg: &mut JsonObject,
    max_position_embeddings: usize,
) -> Result<RopeParameters, ModelError> {
    let top_theta = cfg.nullable_f64("rope_theta")?;
    let top_orig = cfg.contains("original_max_position_embeddings");
    let params = cfg.object("rope_parameters", "rope_parameters.")?;
    let legacy = cfg.object("rope_scaling", "rope_scaling.")?;
    let (mut obj, theta) = match (params, legacy) {
        (Some(mut p), _) => {
            let theta = p.nullable_f64("rope_theta")?.or(top_theta);
            (Some(p), theta)
        }
        (None, legacy) => (legacy, top_theta),
    };
    let rope_theta = theta.unwrap_or(DEFAULT_ROPE_THETA);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(ModelError::invalid(
            "rope_theta",
            format!("must be a positive number, got {rope_theta}"),
        ));
    }
    let Some(obj) = obj.as_mut() else {
        return Ok(RopeParameters {
            rope_theta,
            scaling: RopeScaling::Default,
        });
    };
    let type_key_is_legacy = !obj.contains("rope_type") && obj.contains("type");
    let rope_type = obj
        .either_string("rope_type", "type")?
        .unwrap_or_else(|| "default".to_owned());
    let scaling = match rope_type.as_str() {
        "default" => RopeScaling::Default,
        "yarn" => {
            let orig_top = if top_orig {
                cfg.opt_usize("original_max_position_embeddings")?
            } else {
                None
            };
            RopeScaling::Yarn(parse_yarn(obj, orig_top, max_position_embeddings)?)
        }
        other => {
            let key = if type_key_is_legacy {
                "type"
            } else {
                "rope_type"
            };
            return Err(ModelError::invalid(
                obj.field(key),
                format!("\"{other}\" is not supported (expected \"default\" or \"yarn\")"),
            ));
        }
    };
    Ok(RopeParameters {
        rope_theta,
        scaling,
    })
}

fn parse_yarn(
    obj: &mut JsonObject,
    orig_top: Option<usize>,
    max_position_embeddings: usize,
) -> Result<YarnParameters, ModelError> {
    let orig = obj
        .nullable_usize("original_max_position_embeddings")?
        .or(orig_top)
        .unwrap_or(max_position_embeddings);
    if orig == 0 {
        return Err(ModelError::invalid(
            obj.field("original_max_position_embeddings"),
            "must be positive",
        ));
    }
    let factor = obj
        .nullable_f64("factor")?
        .unwrap_or(max_position_embeddings as f64 / orig as f64);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::invalid(
            obj.field("factor"),
            format!("must be a positive number, got {factor}"),
        ));
    }
    let nonzero_or = |v: Option<f64>, d: f64| v.filter(|&x| x != 0.0).unwrap_or(d);
    Ok(YarnParameters {
        factor,
        original_max_position_embeddings: orig,
        beta_fast: nonzero_or(obj.nullable_f64("beta_fast")?, 32.0),
        beta_slow: nonzero_or(obj.nullable_f64("beta_slow")?, 1.0),
        mscale: obj.nullable_f64("mscale")?,
        mscale_all_dim: obj.nullable_f64("mscale_all_dim")?,
        attention_factor: obj.nullable_f64("attention_factor")?,
        truncate: obj.bool_or("truncate", true)?,
    })
}
