//! # moe-backend
//!
//! Mixture-of-Experts compute for Burn, following Megatron-Core's four phases of an MoE layer:
//!
//! 1. **route**: [`router::TopKRouter`] scores tokens, picks top-k experts (optionally
//!    group-limited, with capacity dropping/padding) and attaches load-balancing losses;
//! 2. **dispatch**: [`ops::permute`] gathers token rows into expert-major order;
//! 3. **compute**: [`experts::GroupedExperts`] runs every expert's SwiGLU as grouped GEMMs
//!    ([`ops::grouped_matmul`]);
//! 4. **combine**: [`ops::unpermute`] scatter-adds the k copies of every token back.
//!
//! [`layer::MoeLayer`] strings the four phases together on one rank (plus shared experts).
//! The kernels are a Burn backend extension, [`ops::MoeOps`], implemented for the Flex CPU
//! backend with hand-written backward passes for `Autodiff`, and with CubeCL GPU kernels for
//! Burn's Cube backend.
//!
//! Across ranks:
//!
//! - [`parallel`]: parallel layouts (`TP × CP × DP × PP` dense, `ETP × EP × EDP × PP` expert)
//!   and their process groups, tensor-parallel linears, pipeline schedules;
//! - [`comm`]: SPMD communication with differentiable collectives, ranks as threads
//!   ([`comm::World`]) or as processes (TCP, and MPI / NCCL behind features);
//! - [`dispatch`]: the token dispatchers that move routed tokens to the ranks owning their
//!   experts and back (local, all-gather, all-to-all, flex);
//! - [`optim`]: ZeRO-1 distributed AdamW and Muon over flat parameter buffers, with
//!   checkpointable state pieces and Megatron-style learning-rate schedules;
//! - [`fp8`]: FP8 codecs, blockwise quantisation, emulated FP8 GEMMs and FP8 primary weights.
//!
//! Also: [`alloc::LargeBlockCache`], a global allocator binaries can opt into, which reuses
//! the multi-gigabyte buffers every training step frees instead of faulting them in again;
//! [`fs`], the workspace's one atomic file write ([`fs::write_atomic`]); and [`BackendError`],
//! whose messages name the operation, argument or configuration field involved.
//!
//! ## Feature flags
//!
//! - `testing`: naive reference implementations and seeded generators (`SplitMix`,
//!   `XorShift64`) for this crate's and other crates' tests (`testing` module).
//! - `mpi`, `nccl`: ranks as processes over MPI (needs an MPI library at build time) or over
//!   NCCL, one GPU each (libcuda and libnccl loaded at run time).
//! - `vulkan`: CubeCL kernels on Burn's Vulkan runtime (builds offline; `.ci/gpu-lavapipe`, part
//!   of CI, runs their tests on Mesa's lavapipe and the tiled grouped GEMM on llvmpipe's OpenGL).
//! - `cuda`, `rocm`: the same kernels on Burn's CUDA / ROCm runtimes. These only forward to
//!   Burn's features and need Burn's own build prerequisites (`cuda` downloads LLVM at build
//!   time and fails offline; `rocm` needs a ROCm installation).
//! - `autotune`: Burn's autotuning of its own CubeCL kernels (used for the dense baseline of the
//!   `cube_ops` bench).
//!
//! Burn's `fusion` feature must stay off with the GPU features: the kernels implement `MoeOps`
//! for `CubeBackend`, the type Burn dispatches to without fusion.

pub mod alloc;
pub mod comm;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_mem;
pub mod devices;
pub mod dispatch;
pub mod error;
pub mod experts;
pub mod fp8;
pub mod fs;
pub mod layer;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod recompute;
pub mod router;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use error::{BackendError, Result};
