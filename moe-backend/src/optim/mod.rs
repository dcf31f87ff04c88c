//! Distributed optimisation: parameters as flat per-class buffers ([`ParamTable`]) and AdamW
//! as a ZeRO-1 distributed optimizer ([`DistributedAdamW`]) with global grad-norm clipping
//! (parallelism.md §5–§6).

mod distributed_adam;
mod params;
#[cfg(test)]
mod tests;

pub use distributed_adam::{DistributedAdamW, DistributedAdamWConfig, MomentDtype, StepReport};
pub use params::{ParamClass, ParamInfo, ParamTable, default_classify};
