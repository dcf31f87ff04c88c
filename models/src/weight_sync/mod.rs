//! Weight sync for RL: the full HF-named tensors of a model trained under any layout, streamed
//! in flat byte buckets to the rollout side without gathering the whole model on any rank
//! (slime and NeMo-RL hand HF-named tensors to their inference engines in ~512 MB buckets
//! the same way).
//!
//! # Producer
//!
//! [`WeightSync::new`] is called on **every rank** of the training world with that rank's shard
//! (e.g. `trainer.model().model()`) and its [`GroupComms`](moe_backend::comm::GroupComms); the
//! sync is collective (every rank drains the iterator, or calls [`WeightSync::run`] /
//! [`sync_weights`]). Tensors come in one fixed order, the order of
//! [`crate::export::export_hf_tensors`] on the full model, under the same HF names (transposed
//! to PyTorch `[out, in]`, a tied `lm_head` omitted, DeepSeek-V3's MTP layers as
//! `model.layers.{N+j}.*`), with routed experts per expert or fused ([`ExpertNames`],
//! selectable).
//!
//! **Global rank 0 assembles every tensor.** Each tensor is split as the one sharding table says
//! ([`crate::distributed::shard_rule`]): a replicated tensor is rank 0's own copy; a TP-split one
//! is sent piece by piece to rank 0 by the members of rank 0's `tp` group; routed experts by the
//! members of rank 0's expert `tp_ep` group (EP × ETP) — for per-expert names only the ETP ranks
//! of the expert's owner send, each just that expert's slice. Other data-parallel replicas take
//! no part. Senders cast their pieces to the sync dtype (bf16 by default) and rank 0 copies
//! them straight into the current bucket, so no rank holds more than one bucket plus one
//! tensor's pieces ([`SyncStats::peak_buffer_bytes`] reports it). Flow control: once the
//! tensors a group has sent since its last barrier reach the size of the largest tensor, its
//! members wait at a barrier until rank 0 has them all, so less than two tensors' pieces are
//! ever queued in the transport.
//!
//! A bucket packs consecutive tensors into one flat little-endian byte buffer of at most
//! [`SyncOptions::bucket_bytes`] (default 512 MiB; a larger tensor gets a bucket of its own)
//! with each tensor's name, dtype, shape and byte range ([`WeightBucket`]). Every rank knows
//! the whole plan up front ([`SyncManifest`]). With [`SyncDest::Broadcast`] rank 0 broadcasts
//! each bucket over a group (e.g. the world), so every member gets every bucket.
//!
//! # Receivers
//!
//! A [`WeightReceiver`] consumes the buckets (`begin` with the manifest, `receive` per bucket,
//! `finish`). [`ModelReceiver`] updates a generation model (Qwen3, Qwen3-MoE, DeepSeek-V3) in
//! place through the models' own HF loading path (`from_weights`), checking every name and shape
//! against the model's export and reporting unknown, mis-shaped, duplicate and missing tensors
//! by name.
//!
//! Limits: pipeline and context parallelism are not supported (the sharded models do not run
//! them either). Weights travel as the module holds them: FP8 layers' high-precision weights,
//! with FP8 primary weights their decoded FP8 values.

mod bucket;
mod host;
mod producer;
mod receiver;
#[cfg(test)]
mod tests;

use burn::tensor::DType;
use moe_backend::BackendError;
use moe_backend::comm::Comm;

use crate::ModelError;
pub use crate::export::ExpertNames;

pub use bucket::{BucketMeta, SyncManifest, SyncedTensor, WeightBucket};
pub use producer::{SyncStats, WeightSync, sync_weights};
pub use receiver::{ModelReceiver, SyncTarget, WeightReceiver};

/// Default bucket size: 512 MiB (slime's and NeMo-RL's order of magnitude).
pub const DEFAULT_BUCKET_BYTES: usize = 512 << 20;

/// The dtype tensors travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncDtype {
    /// bfloat16, rounded to nearest-even from the f32 weights (what inference engines load).
    #[default]
    Bf16,
    /// float32, bit for bit the training weights.
    F32,
}

impl SyncDtype {
    /// The Burn dtype.
    pub fn dtype(self) -> DType {
        match self {
            SyncDtype::Bf16 => DType::BF16,
            SyncDtype::F32 => DType::F32,
        }
    }
}

/// Which ranks receive the buckets.
#[derive(Debug, Clone, Default)]
pub enum SyncDest {
    /// Global rank 0 only (the rank that assembles them).
    #[default]
    Rank0,
    /// Every member of this group: rank 0 broadcasts each bucket over it. Every rank passes
    /// its handle to the same group, which must contain global rank 0: in practice the world,
    /// so that every data-parallel replica can generate.
    Broadcast(Comm),
}

/// Settings of a sync.
#[derive(Debug, Clone)]
pub struct SyncOptions {
    /// Largest bucket in bytes (`≥ 1`; a tensor larger than this travels in its own bucket).
    pub bucket_bytes: usize,
    /// The dtype tensors travel in (`e_score_correction_bias` is always F32,
    /// [`crate::export::keeps_f32`]).
    pub dtype: SyncDtype,
    /// Per-expert or fused routed-expert tensors.
    pub experts: ExpertNames,
    /// Which ranks receive the buckets.
    pub dest: SyncDest,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            dtype: SyncDtype::default(),
            experts: ExpertNames::default(),
            dest: SyncDest::default(),
        }
    }
}

/// Everything that can go wrong in a weight sync; errors about a tensor name it.
#[derive(Debug, thiserror::Error)]
pub enum WeightSyncError {
    /// An option or the layout cannot be used.
    #[error("weight sync: {0}")]
    Unsupported(String),
    /// A collective failed (or another rank failed).
    #[error("weight sync: communication failed: {0}")]
    Comm(#[from] BackendError),
    /// The target model could not be rebuilt from the received tensors.
    #[error("weight sync: {0}")]
    Model(#[from] ModelError),
    /// The shard does not look like a model the sync can place (e.g. a fused expert tensor of
    /// an odd shape).
    #[error("weight sync: tensor `{name}`: {reason}")]
    Layout {
        /// The HF tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The receiver does not know a tensor of that name.
    #[error("weight sync: tensor `{name}` is not a tensor of the target model")]
    UnknownTensor {
        /// The HF tensor.
        name: String,
    },
    /// A tensor's shape differs from the target model's.
    #[error(
        "weight sync: tensor `{name}` has shape {found:?}, the target model expects {expected:?}"
    )]
    ShapeMismatch {
        /// The HF tensor.
        name: String,
        /// The target's shape.
        expected: Vec<usize>,
        /// The received shape.
        found: Vec<usize>,
    },
    /// A tensor arrived twice in one sync.
    #[error("weight sync: tensor `{name}` was received twice")]
    DuplicateTensor {
        /// The HF tensor.
        name: String,
    },
    /// Tensors of the target model never arrived.
    #[error(
        "weight sync: {count} tensor(s) of the target model were not received, e.g. `{}`",
        names.join("`, `")
    )]
    MissingTensors {
        /// How many are missing.
        count: usize,
        /// The first few missing names.
        names: Vec<String>,
    },
    /// A tensor's dtype cannot be decoded.
    #[error("weight sync: tensor `{name}` has dtype {dtype:?}, expected F32, BF16 or F16")]
    UnsupportedDtype {
        /// The HF tensor.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A bucket's bytes do not match its metadata.
    #[error("weight sync: tensor `{name}`: {reason}")]
    Malformed {
        /// The HF tensor.
        name: String,
        /// What does not match.
        reason: String,
    },
    /// An error of a user-defined receiver.
    #[error("weight sync: receiver failed: {0}")]
    Receiver(Box<dyn std::error::Error + Send + Sync>),
}
