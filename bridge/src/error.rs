//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing checkpoints.
///
/// Every variant names the file and, where one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// Reading the file failed.
    #[error("{path}: I/O error: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is shorter than the 8-byte header-length prefix.
    #[error("{path}: file is {len} bytes, too short for the 8-byte safetensors header length")]
    FileTooShort {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// The header length prefix exceeds the sanity limit.
    #[error("{path}: safetensors header length {header_len} exceeds the limit of {limit} bytes")]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The largest accepted header.
        limit: u64,
    },
    /// The header length prefix points past the end of the file.
    #[error("{path}: truncated: header length {header_len} + 8 exceeds the file size {file_len}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The file's actual length.
        file_len: u64,
    },
    /// The header is not valid UTF-8 JSON, or not a JSON object.
    #[error("{path}: safetensors header is not a valid JSON object: {reason}")]
    InvalidHeaderJson {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// `__metadata__` is not a map of strings to strings (or appears twice).
    #[error("{path}: invalid `__metadata__`: {reason}")]
    InvalidMetadata {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor entry lacks `dtype`, `shape` or `data_offsets`, or has one of the wrong type.
    #[error("{path}: tensor `{tensor}`: invalid header entry: {reason}")]
    InvalidTensorEntry {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong with the entry.
        reason: String,
    },
    /// A tensor's dtype string is not one we read.
    #[error("{path}: tensor `{tensor}`: unsupported dtype \"{dtype}\"")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string found.
        dtype: String,
    },
    /// The same tensor name appears twice in the header.
    #[error("{path}: tensor `{tensor}` appears more than once in the header")]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// The element count or byte size of a tensor overflows.
    #[error("{path}: tensor `{tensor}`: shape {shape:?} overflows when computing its byte size")]
    ShapeOverflow {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape found.
        shape: Vec<usize>,
    },
    /// `data_offsets` has `end < begin`.
    #[error("{path}: tensor `{tensor}`: data_offsets [{begin}, {end}] end before they begin")]
    InvalidOffsets {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Start offset within the data section.
        begin: usize,
        /// End offset within the data section.
        end: usize,
    },
    /// `data_offsets` span a different number of bytes than dtype and shape require.
    #[error(
        "{path}: tensor `{tensor}`: {dtype} {shape:?} needs {expected} bytes \
         but data_offsets span {actual}"
    )]
    ByteLengthMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string.
        dtype: String,
        /// The shape.
        shape: Vec<usize>,
        /// `product(shape) * dtype size`.
        expected: usize,
        /// `end - begin`.
        actual: usize,
    },
    /// A tensor's bytes extend past the end of the data section.
    #[error(
        "{path}: tensor `{tensor}`: data ends at {end}, past the data section's {data_len} bytes"
    )]
    OffsetsOutOfBounds {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// End offset within the data section.
        end: usize,
        /// Length of the data section.
        data_len: usize,
    },
    /// Two tensors share bytes.
    #[error("{path}: tensors `{first}` and `{second}` overlap in the data section")]
    OverlappingTensors {
        /// The file.
        path: PathBuf,
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside it.
        second: String,
    },
    /// Part of the data section belongs to no tensor (the format allows no holes).
    #[error("{path}: data bytes {start}..{end} belong to no tensor (before {next})")]
    DataGap {
        /// The file.
        path: PathBuf,
        /// First uncovered byte (data-section offset).
        start: usize,
        /// End of the uncovered range.
        end: usize,
        /// The tensor after the gap, or "the end of the file".
        next: String,
    },
}
