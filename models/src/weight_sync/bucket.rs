//! Buckets: the wire format of the sync (metadata plus one flat byte buffer).

use burn::tensor::{DType, TensorData};

use super::host::decode_f32;
use super::{ExpertNames, SyncDtype, WeightSyncError};

/// One tensor of a bucket: its HF name, dtype, shape and byte range in the bucket's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncedTensor {
    /// HF tensor name.
    pub name: String,
    /// dtype of its bytes (little-endian).
    pub dtype: DType,
    /// Shape, PyTorch orientation, row-major.
    pub shape: Vec<usize>,
    /// Byte offset in the bucket's buffer.
    pub offset: usize,
    /// Byte length (`product(shape) · dtype size`).
    pub bytes: usize,
}

impl SyncedTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The metadata of one bucket: its tensors, packed back to back from offset 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BucketMeta {
    /// The tensors, in sync order.
    pub tensors: Vec<SyncedTensor>,
    /// Length of the bucket's buffer in bytes.
    pub bytes: usize,
}

/// The whole plan of a sync, the same on every rank and known before any data moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncManifest {
    /// Every bucket, in order.
    pub buckets: Vec<BucketMeta>,
    /// The dtype tensors travel in.
    pub dtype: SyncDtype,
    /// How routed experts are named.
    pub experts: ExpertNames,
}

impl SyncManifest {
    /// Every tensor, in sync order.
    pub fn tensors(&self) -> impl Iterator<Item = &SyncedTensor> {
        self.buckets.iter().flat_map(|b| b.tensors.iter())
    }

    /// Number of tensors.
    pub fn num_tensors(&self) -> usize {
        self.buckets.iter().map(|b| b.tensors.len()).sum()
    }

    /// Σ bytes of every bucket.
    pub fn total_bytes(&self) -> u64 {
        self.buckets.iter().map(|b| b.bytes as u64).sum()
    }

    /// Packs `tensors` (name, dtype, shape) in order into buckets of at most `bucket_bytes`
    /// (a tensor larger than that gets a bucket of its own).
    pub(crate) fn pack(
        tensors: impl IntoIterator<Item = (String, DType, Vec<usize>)>,
        bucket_bytes: usize,
        dtype: SyncDtype,
        experts: ExpertNames,
    ) -> Self {
        let mut buckets = Vec::new();
        let mut current = BucketMeta::default();
        for (name, tensor_dtype, shape) in tensors {
            let bytes = shape.iter().product::<usize>() * tensor_dtype.size();
            if !current.tensors.is_empty() && current.bytes + bytes > bucket_bytes {
                buckets.push(std::mem::take(&mut current));
            }
            current.tensors.push(SyncedTensor {
                name,
                dtype: tensor_dtype,
                shape,
                offset: current.bytes,
                bytes,
            });
            current.bytes += bytes;
        }
        if !current.tensors.is_empty() {
            buckets.push(current);
        }
        Self {
            buckets,
            dtype,
            experts,
        }
    }
}

/// One bucket as a receiver gets it: the tensors' metadata and their bytes, packed back to
/// back (each tensor little-endian, row-major, at [`SyncedTensor::offset`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightBucket {
    /// Position of the bucket in the sync (0-based).
    pub index: usize,
    /// Number of buckets of the sync.
    pub count: usize,
    /// The tensors, in sync order.
    pub tensors: Vec<SyncedTensor>,
    /// The flat buffer.
    pub data: Vec<u8>,
}

impl WeightBucket {
    /// The bytes of `tensor` (one of [`Self::tensors`]), checked against the buffer.
    pub fn bytes_of(&self, tensor: &SyncedTensor) -> Result<&[u8], WeightSyncError> {
        let expected = tensor.numel() * tensor.dtype.size();
        if tensor.bytes != expected {
            return Err(WeightSyncError::Malformed {
                name: tensor.name.clone(),
                reason: format!(
                    "{} bytes for a {:?} {:?} tensor ({expected} expected)",
                    tensor.bytes, tensor.dtype, tensor.shape
                ),
            });
        }
        tensor
            .offset
            .checked_add(tensor.bytes)
            .and_then(|end| self.data.get(tensor.offset..end))
            .ok_or_else(|| WeightSyncError::Malformed {
                name: tensor.name.clone(),
                reason: format!(
                    "bytes {}..+{} lie outside the bucket's {} bytes",
                    tensor.offset,
                    tensor.bytes,
                    self.data.len()
                ),
            })
    }

    /// Every tensor with its bytes.
    pub fn iter(
        &self,
    ) -> impl Iterator<Item = Result<(&SyncedTensor, &[u8]), WeightSyncError>> + '_ {
        self.tensors
            .iter()
            .map(|t| self.bytes_of(t).map(|bytes| (t, bytes)))
    }

    /// `tensor` as Burn [`TensorData`] (a copy of its bytes).
    pub fn tensor_data(&self, tensor: &SyncedTensor) -> Result<TensorData, WeightSyncError> {
        let bytes = self.bytes_of(tensor)?;
        Ok(TensorData::from_bytes_vec(
            bytes.to_vec(),
            tensor.shape.clone(),
            tensor.dtype,
        ))
    }

    /// `tensor`'s values as f32 (F32, BF16 and F16 tensors).
    pub fn values_f32(&self, tensor: &SyncedTensor) -> Result<Vec<f32>, WeightSyncError> {
        decode_f32(&tensor.name, self.bytes_of(tensor)?, tensor.dtype)
    }
}
