//! Safetensors files: header parsing and validation (readers and writers follow).
//!
//! Layout: an 8-byte little-endian header length `n`, `n` bytes of JSON, then the data section.
//! Unlike burn-store we accept the FP8 dtypes (`F8_E4M3`, `F8_E5M2`, `F8_E8M0`), which
//! DeepSeek-V3 release checkpoints use (checkpoints.md §2).

mod dtype;
mod header;

pub use dtype::Dtype;
pub use header::{MAX_HEADER_LEN, SafetensorsHeader, TensorInfo, read_header};
