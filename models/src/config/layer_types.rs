//! Per-layer attention kinds, HF `layer_types` (transformers 5.23
//! `configuration_utils.PreTrainedConfig.validate_layer_type`; Qwen3's derivation from
//! `use_sliding_window` / `max_window_layers` in `configuration_qwen3.Qwen3Config.__post_init__`).

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// The attention of one decoder layer (an entry of HF `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Causal attention over every earlier position (`"full_attention"`).
    FullAttention,
    /// Causal attention over the last `sliding_window` positions (`"sliding_attention"`).
    SlidingAttention,
}

impl LayerType {
    /// The HF spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::SlidingAttention => "sliding_attention",
        }
    }
}

/// Parses a `layer_types` list as written: one known entry per decoder layer; an error naming
/// `layer_types` for another length or an entry this project does not run.
pub(crate) fn parse_layer_types(
    written: &[String],
    num_hidden_layers: usize,
) -> Result<Vec<LayerType>, ModelError> {
    if written.len() != num_hidden_layers {
        return Err(ModelError::invalid(
            "layer_types",
            format!(
                "{} entries for num_hidden_layers = {num_hidden_layers}",
                written.len()
            ),
        ));
    }
    written
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(LayerType::FullAttention),
            "sliding_attention" => Ok(LayerType::SlidingAttention),
            other => Err(ModelError::invalid(
                "layer_types",
                format!("entry {i} is `{other}` (supported: full_attention, sliding_attention)"),
            )),
        })
        .collect()
}

/// The sliding window of each layer: `window` on the sliding layers; an error naming
/// `layer_types` when a layer slides without a window (HF's
/// `create_sliding_window_causal_mask` raises then).
pub(crate) fn layer_windows(
    types: &[LayerType],
    window: Option<usize>,
) -> Result<Vec<Option<usize>>, ModelError> {
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match (t, window) {
            (LayerType::FullAttention, _) => Ok(None),
            (LayerType::SlidingAttention, Some(w)) => Ok(Some(w)),
            (LayerType::SlidingAttention, None) => Err(ModelError::invalid(
                "layer_types",
                format!(
                    "layer {i} is sliding_attention but no sliding window is set \
                     (use_sliding_window false or sliding_window null)"
                ),
            )),
        })
        .collect()
}
