//! Parallel layouts and process groups (docs/parallelism.md §Parallel folding to
//! §Group test vectors).
//!
//! A [`ParallelLayout`] folds two grids over the same ranks: dense `TP × CP × DP × PP` and
//! expert `ETP × EP × EDP × PP`. [`GroupTable`] enumerates every group family with Megatron's
//! masked orthogonal rank-group algorithm; [`ProcessGroups`] is one rank's view of it,
//! including the global expert ids its EP position owns. Communicators for these groups come
//! from [`crate::comm`].

mod groups;
mod layout;
pub mod pipeline;
mod replicate;
mod router_sync;
pub mod schedule;
pub mod tensor_parallel;

pub use groups::{Grid, GroupFamily, GroupTable, Membership, ProcessGroups, local_expert_range};
pub use layout::{
    DEFAULT_ORDER, LayoutSpec, ParallelLayout, RankGenerator,
    generate_masked_orthogonal_rank_groups,
};
pub use replicate::replicate;
pub use router_sync::{GroupCountReducer, update_expert_bias_distributed};
