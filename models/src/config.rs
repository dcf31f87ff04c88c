//! HF `config.json` parsing and validation (docs/models.md §Config parsing, §Qwen3-MoE config).
//!
//! Each config struct mirrors its HF twin field by field, with HF's class defaults for absent
//! keys, both accepted spellings of renamed keys, and the keys we do not interpret kept verbatim
//! in `extra` so that an export can write them back.

//!
//! Parsing is two steps: serde deserializes `config.json` into a private struct per family
//! that mirrors HF's field names and class defaults (types are serde's job, and its errors are
//! reported with the field's path), then a conversion merges the accepted spellings, normalises
//! RoPE and checks ranges and cross-field rules (`validate`). The public configs serialize back
//! to `config.json` (transformers 5.23 spelling) through the same structs.

pub(crate) mod check;
pub(crate) mod de;
pub(crate) mod layer_types;
pub(crate) mod rope;

pub use self::layer_types::LayerType;
pub use self::rope::{DEFAULT_ROPE_THETA, RopeParameters, RopeScaling, YarnParameters};
use crate::ModelError;

/// The largest size field a config may have (2²⁴ = 16 777 216, 64 × the largest vocabulary of
/// a released model): above it the config is taken to be corrupt, before anything of its size
/// is built (so that no product of two sizes overflows and no per-layer list is huge).
pub const MAX_DIM: usize = 1 << 24;

/// Refuses a layer count above [`MAX_DIM`] (naming `field`) before a per-layer list of it is
/// built.
pub(crate) fn check_layer_count(field: &'static str, layers: usize) -> Result<(), ModelError> {
    if layers > MAX_DIM {
        return Err(ModelError::invalid(
            field,
            format!("{layers} is above {MAX_DIM}; the config is not plausible"),
        ));
    }
    Ok(())
}

/// A family's parsed HF `config.json`: what tools read of any family.
pub trait FamilyConfig: Clone + std::fmt::Debug + serde::Serialize + Send + Sync + 'static {
    /// Parses and validates a `config.json` text (HF class defaults for absent keys; errors
    /// name the field).
    fn from_json_str(text: &str) -> Result<Self, ModelError>;
    /// Checks the configuration's internal consistency (naming the field at fault).
    fn validate(&self) -> Result<(), ModelError>;
    /// Vocabulary size `V`.
    fn vocab_size(&self) -> usize;
    /// Number of decoder layers (MTP layers not included).
    fn num_layers(&self) -> usize;
    /// Hidden size `H`.
    fn hidden_size(&self) -> usize;
    /// `(routed experts, experts per token)` of an MoE model, `None` for a dense one.
    fn experts(&self) -> Option<(usize, usize)>;
    /// Whether decoder layer `layer` has an MoE block (the default: every layer of an MoE
    /// model, none of a dense one).
    fn is_moe_layer(&self, layer: usize) -> bool {
        let _ = layer;
        self.experts().is_some()
    }
    /// Multi-token-prediction modules (stored as layers `N + j`; none by default).
    fn mtp_layers(&self) -> usize {
        0
    }
    /// Whether the output layer shares the token embedding's weight.
    fn tie_word_embeddings(&self) -> bool;
    /// Configuration warnings worth showing a user (none by default).
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }
    /// The sizes a model of this config is built from, bounded before any model of it is
    /// built (`families::check_sizes`: an absurd config is refused naming the field, never a
    /// hang or a huge allocation). The default: the layers, the routed experts, the hidden and
    /// vocabulary widths; a family lists every other size field its layers multiply (head
    /// counts, head and MLP widths, ranks) and its MTP layers.
    fn sizes(&self) -> ConfigSizes {
        ConfigSizes {
            layers: ("num_hidden_layers", self.num_layers()),
            experts: self.experts().map(|(e, _)| ("num_experts", e)),
            dims: vec![
                ("vocab_size", self.vocab_size()),
                ("hidden_size", self.hidden_size()),
            ],
        }
    }
}

/// The sizes a model of a config is built from, by their HF field names
/// ([`FamilyConfig::sizes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSizes {
    /// The decoder layers the model builds (MTP layers included) and the field(s) naming
    /// them (`num_hidden_layers/num_nextn_predict_layers`).
    pub layers: (&'static str, usize),
    /// The routed experts of an MoE layer and their field; `None` for a dense model.
    pub experts: Option<(&'static str, usize)>,
    /// Every other size field a tensor dimension is built from, with its value.
    pub dims: Vec<(&'static str, usize)>,
}
