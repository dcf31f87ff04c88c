//! FP8 (fp8.md): the E4M3 encoder, scale computation and FP8 primary weights — the f32 master
//! shards of the distributed optimizer cast straight to blockwise FP8 without a BF16 weight
//! copy, with per-block amaxes all-reduced (MAX) over the data-parallel group.

mod formats;
mod primary_weights;

pub use formats::{E4M3_MAX, f32_to_e4m3};
pub use primary_weights::{
    BlockGrid, cast_master_shard, cast_shard_with_scales, compute_scale_from_amax,
    partial_block_amax,
};
