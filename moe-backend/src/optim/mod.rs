//! Distributed optimisation: parameters as flat per-class buffers ([`ParamTable`]) and AdamW as a
//! ZeRO-1 distributed optimizer ([`DistributedAdamW`]) with global grad-norm clipping
//! (docs/parallelism.md §Gradient reduction and scaling, §Distributed optimizer (ZeRO-1)).
//! [`StatePiece`]s map each rank's owned flat ranges to boxes of the global parameters, so the
//! optimizer state can be checkpointed and resharded
//! (docs/checkpoints.md §Distributed checkpoint format). FP8 primary weights ([`fp8_primary`]) cast
//! the master shards straight to blockwise E4M3 after each step (docs/fp8.md §FP8 primary weights);
//! [`precision`] holds BF16 mixed precision (BF16 parameters driven from the f32 masters).

mod distributed_adam;
pub mod fp8_primary;
pub mod grad_scaler;
mod host_step;
pub mod muon;
mod params;
pub mod precision;
pub mod schedule;
mod state;
#[cfg(test)]
mod tests;

pub use distributed_adam::{DistributedAdamW, DistributedAdamWConfig, MomentDtype, StepReport};
pub use fp8_primary::{Fp8ParamLayout, Fp8PrimaryConfig, Fp8Storage, Fp8Weight};
pub use grad_scaler::{
    DynamicScalerConfig, GradScaler, GradScalerConfig, GradScalerState, ScaleChange, unscale_grads,
};
pub use muon::{
    DistributedMuon, MatrixAxis, MuonAdamW, MuonConfig, MuonMatrix, MuonScale, MuonSharding,
    default_muon_select,
};
pub use params::{ParamClass, ParamInfo, ParamTable, default_classify};
pub use precision::{
    MainGradAccumulator, Precision, cast_trainable, grads_to_dtype, trainable_dtype,
};
pub use schedule::{
    LrDecayStyle, LrSchedule, SchedulerState, WdIncrStyle, WdSchedule, WsdDecay, no_weight_decay,
};
pub use state::{FlatBox, OptimState, ParamPlacement, StatePiece, flat_range_boxes, transpose_2d};
