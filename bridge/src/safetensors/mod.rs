//! Safetensors files: header validation, mmap reader, tensor views and conversions, writers.
//!
//! Layout: an 8-byte little-endian header length `n`, `n` bytes of JSON, then the data section.
//! Unlike burn-store we accept the FP8 dtypes (`F8_E4M3`, `F8_E5M2`, `F8_E8M0`), which
//! DeepSeek-V3 release checkpoints use (docs/checkpoints.md §FP8 release format).
//!
//! The format itself is the `safetensors` crate's: headers are validated by its
//! `Metadata` and written in its layout (the `header` and `writer` module docs say what is kept on
//! top and why). What stays here: the memory-mapped [`SafetensorsFile`] (the crate's
//! `SafeTensors` borrows a buffer, it does not own a mapping), [`TensorView`]s that name their
//! file and tensor in errors, conversions to f32 and Burn's `TensorData`, the streaming and
//! atomic writers and the sharded HF directory writer.

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
pub use sharded::{HfDirWriter, ShardPlan, commit_dir, write_hf_checkpoint};
pub use view::{MEMORY, OwnedTensor, TensorView};
pub use writer::{planned_header, pt_metadata, serialize, write_safetensors, write_safetensors_to};
