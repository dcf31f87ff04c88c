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
//! **Global rank 0 assembles every tensor, and no rank ever holds the model.** Every rank knows the
//! whole plan up front: the pipeline stages exchange the names, shapes and dtypes of their local
//! tensors over the `pp` group (no data), and every rank merges them into the whole model's export
//! order (a layer's tensors come from the stage owning it, the embedding from the first stage, the
//! final norm, output layer and MTP layers from the last; the last stage's copy of a shared
//! embedding is left out). The pipeline split itself (1F1B, interleaved `vpp`, an uneven
//! `pipeline_layout`) needs no input: each stage's model names its layers by their global index.
//! Each tensor is split as the one sharding table says ([`crate::families::shard_rule`]) over
//! the ranks of the stage holding it in global rank 0's replica: a replicated tensor is sent by
//! that stage's `tp` rank 0 (rank 0's own copy on the first stage); a TP-split one piece by piece
//! by the stage's `tp` ranks (the members of rank 0's `tp-pp` group on that stage); routed experts
//! by the stage's members of rank 0's expert `tp-ep-pp` group (EP × ETP) — for per-expert names
//! only the ETP ranks of the expert's owner send, each just that expert's slice. Ranks holding
//! only copies of those pieces (the other data-parallel or expert-data-parallel replicas, the
//! other context-parallel ranks) send nothing. Senders cast their pieces to the sync dtype (bf16 by default) and rank 0
//! copies them straight into the current bucket, so no rank holds more than one bucket plus one
//! tensor's pieces ([`SyncStats::peak_buffer_bytes`] reports it; a sender counts its piece and the
//! piece's cast copy). Flow control: once the tensors a group has sent since its last barrier reach
//! the size of the largest tensor, its members wait at a barrier until rank 0 has them all, so less
//! than two tensors' pieces are ever queued in the transport.
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
//! # Across processes
//!
//! [`WireSender`] streams a sync over any [`std::io::Write`] (e.g. a `TcpStream`) in a
//! documented, versioned wire format ([`wire`]: its docs are the specification an external
//! engine implements), and [`receive_wire`] reads it on the other side into any
//! receiver, checking magic, version, every CRC32C and the buckets' order and sizes.
//!
//! Limits: weights travel as the module holds them: FP8 layers' high-precision weights, with
//! FP8 primary weights their decoded FP8 values.

mod bucket;
mod host;
mod plan;
mod producer;
mod receiver;
#[cfg(test)]
mod tests;
pub mod wire;
#[cfg(test)]
mod wire_tests;

use burn::tensor::DType;
use moe_backend::BackendError;
use moe_backend::comm::Comm;

use crate::ModelError;
pub use crate::export::ExpertNames;

pub use bucket::{BucketMeta, SyncManifest, SyncedTensor, WeightBucket};
pub use producer::{SyncStats, WeightSync, sync_weights};
pub use receiver::{ModelReceiver, SyncTarget, WeightReceiver};
pub use wire::{
    MAX_ACK_MESSAGE_BYTES, MAX_MANIFEST_BYTES, WIRE_MAGIC, WIRE_VERSION, WireSender, WireStats,
    read_ack, receive_wire, write_ack,
};

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
    /// The wire stream could not be read or written, or ends early.
    #[error("weight sync wire: {what} at byte {offset}: {source}")]
    WireIo {
        /// What was being read or written (names the bucket and its first tensor).
        what: String,
        /// Byte offset in the stream where that field starts.
        offset: u64,
        /// The I/O error (`UnexpectedEof` for a truncated stream).
        #[source]
        source: std::io::Error,
    },
    /// The stream does not start with the wire format's magic.
    #[error(
        "weight sync wire: not a weight-sync stream: magic {found:02x?} at byte 0, expected \
         {expected:02x?}"
    )]
    WireMagic {
        /// The first 8 bytes of the stream.
        found: [u8; 8],
        /// [`WIRE_MAGIC`].
        expected: [u8; 8],
    },
    /// The stream's format version is not one this reader supports.
    #[error(
        "weight sync wire: the stream has format version {found} (byte 8), this reader supports \
         version {supported}"
    )]
    WireVersion {
        /// The stream's version.
        found: u32,
        /// [`WIRE_VERSION`].
        supported: u32,
    },
    /// The stream breaks the wire format (an unexpected frame tag, an invalid manifest, a wrong
    /// end frame).
    #[error("weight sync wire: at byte {offset}: {reason}")]
    WireFormat {
        /// Byte offset in the stream of the offending field.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A bucket frame arrived out of order.
    #[error(
        "weight sync wire: at byte {offset}: bucket {found} arrived where bucket {expected} was next"
    )]
    WireBucketOrder {
        /// Byte offset of the bucket frame.
        offset: u64,
        /// The bucket the manifest puts next.
        expected: usize,
        /// The index the frame carries.
        found: u64,
    },
    /// A bucket frame's length differs from the manifest's.
    #[error(
        "weight sync wire: {bucket} at byte {offset} has {found} bytes, the manifest says {expected}"
    )]
    WireBucketSize {
        /// The bucket (index and first tensor).
        bucket: String,
        /// Byte offset of the bucket frame.
        offset: u64,
        /// The manifest's length.
        expected: u64,
        /// The frame's length.
        found: u64,
    },
    /// A bucket's bytes do not match its CRC32C.
    #[error(
        "weight sync wire: {bucket} is corrupt: CRC32C of its {bytes} bytes at byte {offset} is \
         {found:#010x}, the frame says {expected:#010x}"
    )]
    WireChecksum {
        /// The bucket (index and first tensor).
        bucket: String,
        /// Byte offset of the bucket's data.
        offset: u64,
        /// Its length.
        bytes: u64,
        /// The CRC32C the frame carries.
        expected: u32,
        /// The CRC32C of the bytes received.
        found: u32,
    },
    /// The reading side of a wire stream refused the sync (its acknowledgement).
    #[error("weight sync wire: the receiving side refused the weights: {message}")]
    WireRejected {
        /// Its reason.
        message: String,
    },
    /// An error of a user-defined receiver.
    #[error("weight sync: receiver failed: {0}")]
    Receiver(Box<dyn std::error::Error + Send + Sync>),
}
