//! The model the planner counts: its dimensions ([`ModelShape`], from the family) and its
//! per-rank parameters, read off the family's own model and parallel plan
//! ([`super::chunk_params_of`]: the lazily built model of a pipeline stage, every parameter
//! split as its plan row says), so that adding a parameter is one plan row.

use std::sync::Arc;

use moe_backend::parallel::ParallelLayout;
use moe_backend::parallel::pipeline::StageParts;

use super::{PlanError, RankParams, chunk_params_of, layout_chunks};
use crate::ModelError;
use crate::distributed::ShardModel;
use crate::families::Family;
use crate::hf::{ConfigVisitor, ModelConfig};
pub use crate::param_plan::model_shape::{AttentionShape, ModelShape};

/// Per-rank parameters of a rank holding some chunks under a layout.
type ChunkParams =
    dyn Fn(&ParallelLayout, &[StageParts]) -> Result<RankParams, ModelError> + Send + Sync;

/// A model the planner can count parameters of: any family that describes its shape
/// ([`Family::model_shape`]; the MoE families).
#[derive(Clone)]
pub struct PlannedModel {
    model_type: &'static str,
    shape: ModelShape,
    mtp: usize,
    params: Arc<ChunkParams>,
}

impl std::fmt::Debug for PlannedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannedModel")
            .field("model_type", &self.model_type)
            .field("shape", &self.shape)
            .field("mtp", &self.mtp)
            .finish_non_exhaustive()
    }
}

impl PlannedModel {
    /// The planner's model of family `F` at `config`; `None` for a family without a
    /// planner shape (dense models).
    pub fn of<F: Family>(config: &F::Config) -> Result<Option<Self>, ModelError> {
        let Some(shape) = F::model_shape(config) else {
            return Ok(None);
        };
        let mtp = <F::Model as ShardModel>::stack_shape(config)?.pipeline.mtp;
        let config = config.clone();
        Ok(Some(Self {
            model_type: F::MODEL_TYPE,
            shape,
            mtp,
            params: Arc::new(move |layout: &ParallelLayout, chunks: &[StageParts]| {
                chunk_params_of::<F::Model>(&config, layout, chunks)
            }),
        }))
    }

    /// The planner's model of `config`'s family, `None` for a family it does not plan.
    pub fn from_config(config: &ModelConfig) -> Result<Option<Self>, ModelError> {
        struct Planned;
        impl ConfigVisitor for Planned {
            type Output = Result<Option<PlannedModel>, ModelError>;
            fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
                PlannedModel::of::<F>(config)
            }
        }
        config.visit(Planned)?
    }

    /// HF `model_type` of the planned model.
    pub fn model_type(&self) -> &'static str {
        self.model_type
    }

    /// The planner's dimensions.
    pub fn shape(&self) -> ModelShape {
        self.shape.clone()
    }

    /// MTP modules of the model (DeepSeek-V3's `num_nextn_predict_layers`): an explicit
    /// pipeline layout must place them (`m`), the last stage holds them.
    pub fn mtp_modules(&self) -> usize {
        self.mtp
    }

    /// Parameters a rank of pipeline stage `stage` holds under `layout`'s split (its `vpp` and
    /// `pp_layout`).
    pub fn rank_params(
        &self,
        layout: &ParallelLayout,
        stage: usize,
    ) -> Result<RankParams, PlanError> {
        let chunks = layout_chunks(layout, self.shape.layers(), self.mtp, stage);
        self.chunk_params(layout, &chunks)
    }

    /// Parameters a rank holding `chunks` (virtual stages, see [`super::rank_chunks`]) holds.
    pub fn chunk_params(
        &self,
        layout: &ParallelLayout,
        chunks: &[StageParts],
    ) -> Result<RankParams, PlanError> {
        (self.params)(layout, chunks).map_err(PlanError::from)
    }
}
