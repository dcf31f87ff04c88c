//! [`Fp8Recipe`]: the blockwise FP8 training recipe (docs/fp8.md §Recipes, Hopper default).

use burn::config::Config;

use super::formats::Fp8Format;
use crate::error::BackendError;

/// Blockwise FP8 recipe for linear layers (docs/fp8.md §Recipes): weights in `b×b` blocks,
/// activations and gradients in `1×b` tiles along the GEMM reduction dimension (rowwise for fprop
/// and dgrad, columnwise along tokens for wgrad), all E4M3 by default, f32 accumulation.
///
/// The reduction blocks of both operands of every GEMM must coincide, which is why one block
/// size `b` serves weights and activations.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct Fp8Recipe {
    /// Block size `b` (128 in the Hopper recipe and DeepSeek-V3).
    #[config(default = 128)]
    pub block_size: usize,
    /// Round scales down to powers of two (Transformer Engine's default for blockwise).
    #[config(default = true)]
    pub pow2_scales: bool,
    /// Format of the weights.
    #[config(default = "Fp8Format::E4M3")]
    pub weight_format: Fp8Format,
    /// Format of the forward activations (GEMM inputs).
    #[config(default = "Fp8Format::E4M3")]
    pub activation_format: Fp8Format,
    /// Format of the output gradients (E4M3 in the blockwise recipe; E5M2 gives the hybrid
    /// variant).
    #[config(default = "Fp8Format::E4M3")]
    pub grad_format: Fp8Format,
}

impl Default for Fp8Recipe {
    fn default() -> Self {
        Self::new()
    }
}

impl Fp8Recipe {
    /// Checks that the block size is positive.
    pub fn validate(&self) -> crate::Result<()> {
        if self.block_size == 0 {
            return Err(BackendError::Config {
                field: "block_size",
                detail: "the FP8 block size must be positive".into(),
            });
        }
        Ok(())
    }
}
