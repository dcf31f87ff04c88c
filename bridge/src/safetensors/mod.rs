//! Safetensors files: header validation, mmap reader, tensor views and conversions, writers.
//!
//! Layout: an 8-byte little-endian header length `n`, `n` bytes of JSON, then the data section.
//! Unlike burn-store we accept the FP8 dtypes (`F8_E4M3`, `F8_E5M2`, `F8_E8M0`), which
//! DeepSeek-V3 release checkpoints use (checkpoints.md §2).

mod dtype;
pub mod elem;
mod header;
mod reader;
mod sharded;
mod view;
mod writer;

pub use dtype::Dtype;
pub use header::{MAX_HEADER_LEN, SafetensorsHeader, TensorInfo, read_header};
pub use reader::SafetensorsFile;
pub use sharded::{HfDirWriter, ShardPlan, write_hf_checkpoint};
pub use view::{MEMORY, OwnedTensor, TensorView};
pub use writer::{pt_metadata, serialize, write_safetensors, write_safetensors_to};
