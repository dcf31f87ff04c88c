//! What the formats need to know about the model a checkpoint holds, supplied by the crate
//! that defines the models (moe-models implements [`ModelSchema`] for its `ModelConfig`).
//!
//! The bridge knows no model: checkpoint validation ([`HfCheckpoint::check`]), HF ↔
//! distributed conversion, export and resharding, and the distributed checkpoint's config
//! check are generic over a [`ModelSchema`], which parses a `config.json`, names the
//! name-mapping [`Registry`] of its model, lists the HF tensors it implies
//! ([`ExpectedTable`]) and gives the split of every canonical tensor ([`ShardRule`]).
//!
//! [`HfCheckpoint::check`]: crate::hf::HfCheckpoint::check

use std::path::Path;

use serde_json::Value;

use crate::BridgeError;
use crate::dist::{ShardRule, StagePlace};
use crate::mapping::{ExpectedTable, ExpertLayout, Registry};

/// A parsed, validated `config.json` of a model the formats can check, convert, export and
/// reshard: the model knowledge the bridge is handed (see the module docs).
pub trait ModelSchema: Sized {
    /// Parses and validates a `config.json` read as JSON (typed fields, ranges, cross-field
    /// rules, plausible sizes); `path` names it in errors.
    ///
    /// Errors: [`BridgeError::InvalidConfig`] naming the field, or
    /// [`BridgeError::UnknownModelType`].
    fn from_config(config: &Value, path: &Path) -> Result<Self, BridgeError>;

    /// The name-mapping rules of the model `config` describes, read from its `model_type`
    /// alone (the rest of the config is not validated); `path` names it in errors.
    fn registry_of(config: &Value, path: &Path) -> Result<Registry, BridgeError>;

    /// The split of canonical parameter (or buffer) `name` over the ranks of one pipeline
    /// stage; a name the models do not know is [`ShardRule::Replicated`].
    fn shard_rule(name: &str) -> ShardRule;

    /// The pipeline placement of canonical parameter (or buffer) `name`: on the first stage,
    /// in decoder layer `i`, or on the last stage.
    fn stage_place(name: &str) -> StagePlace;

    /// The canonical (= HF) name of the tensor the parsed `config.json` `config` ties to the
    /// embedding (the LM head under `tie_word_embeddings`), which conversions and exports do not
    /// write; `None` when the config ties nothing.
    fn tied_head(config: &Value) -> Option<String>;

    /// HF `model_type`.
    fn model_type(&self) -> &str;

    /// `num_hidden_layers` of the main model (what pipeline stages split).
    fn num_layers(&self) -> usize;

    /// The HF tensors this config implies, routed experts in `layout`, FP8 scale companions
    /// for `block`; `path` names the config in errors.
    fn expected_hf_tensors(
        &self,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError>;

    /// Tensors an HF export writes as copies of others, `(name, source)`, given which names
    /// the checkpoint holds (`has`): e.g. DeepSeek-V3's MTP layers repeating the embedding
    /// and the LM head as the release checkpoints do. None by default.
    fn export_copies(&self, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        let _ = has;
        Vec::new()
    }

    /// Configuration findings worth showing a user (none by default).
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// The shape the HF release stores canonical tensor `name` of (checkpoint) shape `shape`
    /// in, when its release layout is not the canonical one (e.g. input-major,
    /// gate/up-interleaved experts); `None` (the default) when the release stores the
    /// canonical tensor. Errors name the tensor.
    fn release_shape(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<usize>>, BridgeError> {
        let _ = (name, shape);
        Ok(None)
    }

    /// The release's values of canonical tensor `name` of shape `shape` (row-major f32
    /// `values`), permuted to [`release_shape`](Self::release_shape); `None` (the default)
    /// when the release stores the canonical tensor.
    fn to_release(
        &self,
        name: &str,
        shape: &[usize],
        values: &[f32],
    ) -> Result<Option<Vec<f32>>, BridgeError> {
        let _ = (name, shape, values);
        Ok(None)
    }

    /// The (checkpoint) shape of canonical tensor `name` that the HF release stores in shape
    /// `stored` (the inverse of [`release_shape`](Self::release_shape)); `None` (the default)
    /// when the release stores the canonical tensor. HF → distributed conversion uses it to
    /// lay out the canonical tensors before reading any value. Errors name the tensor.
    fn release_canonical_shape(
        &self,
        name: &str,
        stored: &[usize],
    ) -> Result<Option<Vec<usize>>, BridgeError> {
        let _ = (name, stored);
        Ok(None)
    }

    /// The canonical values of tensor `name` from the release's `values` (row-major f32) of
    /// shape `stored`, in the shape [`release_canonical_shape`](Self::release_canonical_shape) gives
    /// (the inverse of [`to_release`](Self::to_release), exact: pure data movement); `None`
    /// (the default) when the release stores the canonical tensor.
    fn release_to_canonical(
        &self,
        name: &str,
        stored: &[usize],
        values: &[f32],
    ) -> Result<Option<Vec<f32>>, BridgeError> {
        let _ = (name, stored, values);
        Ok(None)
    }

    /// Whether the HF release stores tensor `name` (its release parameter, `[..., in, out]`) as
    /// an MXFP4 pair (`<name>_blocks`, `<name>_scales`, [`crate::mxfp4`]): what an MXFP4 export
    /// packs. `false` (the default) for every tensor of a model whose release has none.
    fn release_mxfp4(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// The `quantization_config` an HF release storing some tensors as MXFP4
    /// ([`release_mxfp4`](Self::release_mxfp4)) writes in its `config.json`; `None` (the
    /// default) when the release has no MXFP4 tensors, which an MXFP4 export refuses.
    fn mxfp4_quantization_config(&self) -> Option<Value> {
        None
    }
}
