//! FP8 (docs/fp8.md): E4M3/E5M2 codecs, per-tensor and blockwise scaled quantisation, emulated FP8
//! GEMMs with the blockwise recipe (the `Fp8Ops` backend extension, used by the experts when
//! [`Fp8Recipe`] is set), and FP8 primary weights — the f32 master shards of the distributed
//! optimizer cast straight to blockwise FP8 without a BF16 weight copy, with per-block amaxes
//! all-reduced (MAX) over the data-parallel group, and held by the module as packed E4M3 codes
//! and block scales ([`PackedFp8`]) that the GEMMs read directly.

mod blockwise;
mod formats;
pub mod gemm;
mod ops;
mod packed;
mod primary_weights;
mod recipe;

pub use blockwise::{Fp8Blocks, quantize_blockwise, quantize_columnwise, quantize_per_tensor};
pub(crate) use blockwise::{decode_scaled, simd};
pub use formats::{
    E4M3_MAX, E5M2_MAX, Fp8Format, e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2,
};
pub use ops::{Fp8Ops, fp8_grouped_matmul, fp8_linear, fp8_linear_forward, linear_maybe_fp8};
pub use packed::{PackedFp8, dequantize_param, param_storage_bytes};
pub use primary_weights::{
    BlockGrid, accumulate_block_amax, cast_master_shard, cast_shard_with_scales,
    compute_scale_from_amax, partial_block_amax,
};
pub use recipe::Fp8Recipe;
