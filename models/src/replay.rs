//! Router replay for RL (docs/training-and-rl.md §Router replay): record the routing of a forward
//! pass, store it in a small safetensors file, and force it in a later Qwen3-MoE or DeepSeek-V3
//! forward.
//!
//! # File format
//!
//! A safetensors file (8-byte little-endian header length, JSON header padded with spaces
//! to a multiple of 8, raw little-endian data) holding, for **every MoE layer** of the
//! model, one tensor
//!
//! | name | dtype | shape | contents |
//! |---|---|---|---|
//! | `layers.{i}.topk_indices` | `I32` | `[T, k]` | expert ids selected for each token |
//!
//! - `i` is the decoder-layer index of HF's `model.layers.{i}` (so dense layers such as
//!   Qwen3-MoE's `mlp_only_layers` or DeepSeek-V3's first `first_k_dense_replace` layers
//!   have no tensor and the set of `i` must equal the model's MoE layers); DeepSeek-V3's MTP
//!   modules, stored as decoder layers `N + j`, may follow as `layers.{N+j}.topk_indices`
//!   (a routing recorded by a training forward that ran them,
//!   [`crate::distributed::replay`]); the single-rank forward here runs the main model
//!   only and leaves them out;
//! - `T = B·S`: tokens of the micro-batch in `b·S + s` order (the row-major flattening of
//!   `input_ids [B, S]`), the same for every layer;
//! - the order of the `k` ids in a row does not matter for the routing weights (they are gathered
//!   at the ids, docs/routing-and-dispatch.md §Router replay); ids are in `0..E` and distinct
//!   within a row;
//! - `__metadata__` (all values are strings, as safetensors requires): `model_type`
//!   (`"qwen3_moe"` / `"deepseek_v3"`) and `k` are required; the writer also sets
//!   `format = "moe-router-replay"`, `version = "1"` and `num_tokens`. Other keys are ignored.
//!
//! An inference engine writes one such file per rollout micro-batch; the trainer reads it
//! with [`RouterReplayFile::read`] and runs [`replay_routing`], which puts every MoE router
//! in moe-backend's `ReplayForward` mode with the recorded ids
//! ([`moe_backend::router::RouterReplay`]): the top-k selection is skipped and the routing
//! weights are gathered at the forced ids, then normalised and scaled as usual.
//! [`record_routing`] produces the file from one of our own forwards.

mod format;

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::ModelError;

/// The `format` metadata value written into replay files.
pub const REPLAY_FORMAT: &str = "moe-router-replay";

/// The tensor name of decoder layer `layer`'s indices: `layers.{layer}.topk_indices`.
pub fn replay_tensor_name(layer: usize) -> String {
    format!("layers.{layer}.topk_indices")
}

pub(crate) fn replay_error(reason: impl Into<String>) -> ModelError {
    ModelError::InvalidInput {
        what: "router replay",
        reason: reason.into(),
    }
}

/// The routing of one forward pass: per MoE layer, `[T, k]` expert ids (host values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterReplayFile {
    /// HF `model_type` of the model the routing belongs to.
    pub model_type: String,
    /// `k`, experts per token.
    pub topk: usize,
    /// `T = B·S` tokens, rows in `b·S + s` order.
    pub num_tokens: usize,
    /// Decoder-layer index → row-major `[T, k]` expert ids.
    pub layers: BTreeMap<usize, Vec<i32>>,
}

pub use crate::routing::ReplaySpec;

impl RouterReplayFile {
    /// An empty routing for `num_tokens` tokens and `topk` experts each.
    pub fn new(model_type: impl Into<String>, topk: usize, num_tokens: usize) -> Self {
        Self {
            model_type: model_type.into(),
            topk,
            num_tokens,
            layers: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) layer `layer`'s row-major `[T, k]` ids.
    pub fn insert_layer(&mut self, layer: usize, indices: Vec<i32>) -> Result<(), ModelError> {
        let expected = self.num_tokens * self.topk;
        if indices.len() != expected {
            return Err(replay_error(format!(
                "`{}`: {} ids, expected T·k = {} · {} = {expected}",
                replay_tensor_name(layer),
                indices.len(),
                self.num_tokens,
                self.topk
            )));
        }
        self.layers.insert(layer, indices);
        Ok(())
    }

    /// Adds layer `layer`'s ids from a `[T, k]` int tensor (e.g. a forward's
    /// `topk_indices`).
    pub fn insert_tensor(
        &mut self,
        layer: usize,
        indices: Tensor<2, Int>,
    ) -> Result<(), ModelError> {
        let dims = indices.dims();
        if dims != [self.num_tokens, self.topk] {
            return Err(replay_error(format!(
                "`{}`: shape {dims:?}, expected [{}, {}]",
                replay_tensor_name(layer),
                self.num_tokens,
                self.topk
            )));
        }
        let values = indices
            .into_data()
            .try_into_vec_as::<i32>()
            .map_err(|e| replay_error(format!("`{}`: {e:?}", replay_tensor_name(layer))))?;
        self.insert_layer(layer, values)
    }

    /// Serialises to the safetensors bytes of the module-level format; an error names a layer
    /// whose ids do not fill `[num_tokens, topk]` (possible only when
    /// [`layers`](Self::layers) was edited directly).
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        format::encode(self)
    }

    /// Parses safetensors bytes (errors name the tensor or field; [`read`](Self::read) adds
    /// the path).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ModelError> {
        format::decode(bytes)
    }

    /// Writes the file atomically ([`moe_backend::fs::write_atomic`]: a reader sees the old
    /// file or the new one, never part of it).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), ModelError> {
        let path = path.as_ref();
        let bytes = self.to_bytes().map_err(|e| e.in_file(path))?;
        moe_backend::fs::write_atomic_bytes(path, &bytes)
            .map_err(|e| replay_error(format!("cannot write: {}", e.source)).in_file(path))
    }

    /// Reads and parses a replay file; errors carry the path.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .map_err(|e| replay_error(format!("cannot read: {e}")).in_file(path))?;
        Self::from_bytes(&bytes).map_err(|e| e.in_file(path))
    }

    /// Checks the routing against a model and a forward of `num_tokens` tokens: model type,
    /// `k`, exactly the model's MoE layers (optionally followed by its MTP layers), `T`, ids
    /// in `0..E` and distinct per row.
    pub fn check(&self, spec: &ReplaySpec, num_tokens: usize) -> Result<(), ModelError> {
        if self.model_type != spec.model_type {
            return Err(replay_error(format!(
                "model_type \"{}\" does not match the model's \"{}\"",
                self.model_type, spec.model_type
            )));
        }
        if self.topk != spec.topk {
            return Err(replay_error(format!(
                "k = {} does not match the model's num_experts_per_tok = {}",
                self.topk, spec.topk
            )));
        }
        let layers: Vec<usize> = self.layers.keys().copied().collect();
        let with_mtp: Vec<usize> = spec
            .moe_layers
            .iter()
            .chain(&spec.mtp_layers)
            .copied()
            .collect();
        if layers != spec.moe_layers && layers != with_mtp {
            let mtp = match spec.mtp_layers.is_empty() {
                true => String::new(),
                false => format!(" (then MTP layers {:?})", spec.mtp_layers),
            };
            return Err(replay_error(format!(
                "{} layers {layers:?}, the model has {} MoE layers {:?}{mtp}",
                layers.len(),
                spec.moe_layers.len(),
                spec.moe_layers
            )));
        }
        if self.num_tokens != num_tokens {
            return Err(replay_error(format!(
                "{} tokens recorded, the forward has B·S = {num_tokens}",
                self.num_tokens
            )));
        }
        for (&layer, ids) in &self.layers {
            for (row, chunk) in ids.chunks(self.topk.max(1)).enumerate() {
                for (j, &id) in chunk.iter().enumerate() {
                    if id < 0 || id as usize >= spec.num_experts {
                        return Err(replay_error(format!(
                            "`{}` row {row}: expert {id} out of range 0..{}",
                            replay_tensor_name(layer),
                            spec.num_experts
                        )));
                    }
                    if chunk[..j].contains(&id) {
                        return Err(replay_error(format!(
                            "`{}` row {row}: expert {id} selected twice",
                            replay_tensor_name(layer)
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The forced ids `[T, k]` of every MoE layer (ascending layer), on `device`: what the
    /// routers replay (`ReplayForward`).
    pub fn layer_indices(&self, device: &Device) -> Vec<Tensor<2, Int>> {
        self.layers
            .values()
            .map(|ids| {
                let data = TensorData::new(ids.clone(), [self.num_tokens, self.topk]);
                Tensor::from_data(data, device)
            })
            .collect()
    }
}

/// A model whose MoE routers can be recorded and replayed.
pub trait RouterReplayModel {
    /// What a replay file for this model must hold.
    fn replay_spec(&self) -> ReplaySpec;

    /// Logits `[B, S, V]` and the `[B·S, k]` selected experts of every MoE layer (ascending
    /// layer); with `replay`, every MoE layer's routers forced to its ids (ascending layer).
    fn forward_routing(
        &self,
        input_ids: Tensor<2, Int>,
        replay: Option<Vec<Tensor<2, Int>>>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2, Int>>), ModelError>;
}

/// Every family's model at `world = 1`: its routing recorded (or forced) through the
/// single-rank forward on its local context.
impl<M: crate::distributed::ShardModel> RouterReplayModel for M {
    fn replay_spec(&self) -> ReplaySpec {
        crate::distributed::ShardModel::replay_spec(self).unwrap_or_else(|| ReplaySpec {
            model_type: M::parallel_plan().family(),
            moe_layers: Vec::new(),
            mtp_layers: Vec::new(),
            topk: 0,
            num_experts: 0,
        })
    }

    fn forward_routing(
        &self,
        input_ids: Tensor<2, Int>,
        replay: Option<Vec<Tensor<2, Int>>>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2, Int>>), ModelError> {
        let ctx = crate::families::local_context::<M>(self.model_config())?;
        let mut trace = crate::distributed::RouterTrace::recording(1.0, replay);
        let logits = ctx.logits(self, input_ids, None, None, &mut trace)?.logits;
        Ok((logits, trace.selected))
    }
}

/// Runs `model` on `input_ids [B, S]` and records its natural routing: returns the logits
/// and the replay file (`T = B·S`).
pub fn record_routing<M: RouterReplayModel>(
    model: &M,
    input_ids: Tensor<2, Int>,
) -> Result<(Tensor<3>, RouterReplayFile), ModelError> {
    let [b, s] = input_ids.dims();
    let spec = model.replay_spec();
    let (logits, indices) = model.forward_routing(input_ids, None)?;
    let mut file = RouterReplayFile::new(spec.model_type, spec.topk, b * s);
    for (layer, idx) in spec.moe_layers.iter().zip(indices) {
        file.insert_tensor(*layer, idx)?;
    }
    Ok((logits, file))
}

/// Runs `model` on `input_ids [B, S]` with every MoE router forced to `replay`'s ids
/// (checked first with [`RouterReplayFile::check`]); returns the logits and the selected
/// experts of every MoE layer (equal to the forced ids). The main model's forward runs no MTP
/// module: a file's MTP layers are checked and not used.
pub fn replay_routing<M: RouterReplayModel>(
    model: &M,
    input_ids: Tensor<2, Int>,
    replay: &RouterReplayFile,
) -> Result<(Tensor<3>, Vec<Tensor<2, Int>>), ModelError> {
    let [b, s] = input_ids.dims();
    let spec = model.replay_spec();
    replay.check(&spec, b * s)?;
    let mut forced = replay.layer_indices(&input_ids.device());
    forced.truncate(spec.moe_layers.len());
    model.forward_routing(input_ids, Some(forced))
}

fn invalid(what: &'static str, reason: String) -> ModelError {
    ModelError::InvalidInput { what, reason }
}

impl crate::routing::RoutedExperts {
    /// The same routing as a single-rank replay file ([`crate::replay`]) for a model
    /// described by `spec` (checked with [`validate`](Self::validate) first); MTP layers, when
    /// covered, as `layers.{N+j}.topk_indices`.
    pub fn to_replay_file(&self, spec: &ReplaySpec) -> Result<RouterReplayFile, ModelError> {
        self.validate(self.batch, self.seq, spec)?;
        let t = self.num_tokens();
        let mut file = RouterReplayFile::new(spec.model_type, self.topk, t);
        let mtp = match self.covers_mtp(spec) {
            true => spec.mtp_layers.as_slice(),
            false => &[],
        };
        for (l, &layer) in spec.moe_layers.iter().chain(mtp).enumerate() {
            let ids = self.layer_rows(l, 0..t).into_iter().map(|v| v as i32);
            file.insert_layer(layer, ids.collect())?;
        }
        Ok(file)
    }

    /// The routing of a single-rank replay file whose `T` tokens form `batch` sequences
    /// (layers in ascending decoder-layer order: the MTP layers `N + j`, if any, last).
    pub fn from_replay_file(file: &RouterReplayFile, batch: usize) -> Result<Self, ModelError> {
        if batch == 0 || !file.num_tokens.is_multiple_of(batch) {
            return Err(invalid(
                "routed_experts.batch",
                format!("{} tokens do not form {batch} sequences", file.num_tokens),
            ));
        }
        let layers: Vec<Vec<i64>> = file
            .layers
            .values()
            .map(|ids| ids.iter().map(|&v| i64::from(v)).collect())
            .collect();
        Self::from_layers(batch, file.num_tokens / batch, file.topk, &layers)
    }
}

#[cfg(test)]
mod tests;
