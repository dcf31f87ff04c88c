//! A model under pipeline parallelism: which parts this rank holds (its virtual stages'
//! decoder layers, the embedding on the first stage, final norm, output layer and MTP modules
//! on the last, the embedding's copy there when the output layer is tied to it or the MTP
//! modules read it, as Megatron-LM's embedding group), and the chunks the pipeline executor
//! ([`moe_backend::parallel::pipeline::run_pipeline`]) runs.

use std::ops::Range;

use moe_backend::comm::GroupComms;
use moe_backend::parallel::GroupFamily;
use moe_backend::parallel::pipeline::PipelineSplit;

use super::err;
use crate::ModelError;
use crate::weights::StageHolding;

/// What the model looks like to the pipeline: main decoder layers, MTP depths, whether the
/// output layer is tied to the embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineModel {
    /// Main decoder layers.
    pub layers: usize,
    /// MTP modules.
    pub mtp: usize,
    /// Output layer tied to the embedding.
    pub tied: bool,
    /// Hidden size (the activations passed between stages are `[tokens, hidden]`).
    pub hidden: usize,
}

/// One local model chunk (virtual stage) of this pipeline rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkParts {
    /// Virtual stage index (`chunk · pp + rank`).
    pub virtual_stage: usize,
    /// Embeds the micro-batch's tokens (virtual stage 0).
    pub embedding: bool,
    /// The chunk's decoder layers as local indices into the rank's [`crate::layers::LayerStack`].
    pub layers: Range<usize>,
    /// Final norm, output layer, MTP modules and loss (the last virtual stage).
    pub loss: bool,
}

/// This rank's place in its pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelinePlace {
    /// The split of the whole model over the virtual stages.
    pub split: PipelineSplit,
    /// This rank's pipeline rank.
    pub rank: usize,
    /// Its chunks, in chunk order.
    pub chunks: Vec<ChunkParts>,
    /// What it holds (loading reads only these parts).
    pub holding: StageHolding,
    /// The whole model's shape.
    pub model: PipelineModel,
}

impl PipelinePlace {
    /// The place of this rank (`groups`) in a pipeline splitting `model` as `split`.
    pub fn new(
        split: PipelineSplit,
        groups: &GroupComms,
        model: PipelineModel,
    ) -> Result<Self, ModelError> {
        let pp = groups.groups.get(GroupFamily::Pp);
        if split.pp() != pp.size() {
            return Err(ModelError::layout(
                "pipeline_layout",
                format!(
                    "a split over {} pipeline stages for pp = {}",
                    split.pp(),
                    pp.size()
                ),
            ));
        }
        let rank = pp.index;
        let layers = split.rank_layers(rank);
        let mut chunks = Vec::with_capacity(split.vpp());
        let mut at = 0;
        let mut head = false;
        let mut mtp = false;
        let mut embedding = false;
        for chunk in 0..split.vpp() {
            let parts = split.parts(rank, chunk).ok_or_else(|| {
                ModelError::layout(
                    "pipeline_layout",
                    format!("no chunk {chunk} on rank {rank}"),
                )
            })?;
            let n = parts.layers.len();
            chunks.push(ChunkParts {
                virtual_stage: chunk * split.pp() + rank,
                embedding: parts.embedding,
                layers: at..at + n,
                loss: parts.loss,
            });
            at += n;
            head |= parts.loss;
            mtp |= !parts.mtp.is_empty();
            embedding |= parts.embedding;
        }
        if model.mtp > 0 && head && !mtp {
            return Err(ModelError::layout(
                "pipeline_layout",
                "the MTP modules must be on the stage of the loss",
            ));
        }
        // The last stage keeps a copy of the embedding when the output layer or the MTP
        // modules read it (Megatron's embedding group keeps both copies equal).
        embedding |= head && (model.tied || model.mtp > 0);
        Ok(Self {
            split,
            rank,
            chunks,
            holding: StageHolding {
                layers,
                embedding,
                head,
                mtp: mtp && model.mtp > 0,
            },
            model,
        })
    }

    /// The pipeline of `groups`' layout for `model` (`None` when `pp = 1`): the layers split
    /// evenly over `pp · vpp` virtual stages, or as `layout` says (Megatron's
    /// `pipeline_model_parallel_layout` syntax).
    pub fn for_groups(
        groups: &GroupComms,
        model: PipelineModel,
        vpp: usize,
        layout: Option<&str>,
    ) -> Result<Option<Self>, ModelError> {
        let pp = groups.groups.layout.pp;
        if pp == 1 {
            return Ok(None);
        }
        let split = match layout {
            Some(text) => PipelineSplit::parse(text, model.layers, model.mtp, pp, vpp),
            None => PipelineSplit::even(model.layers, model.mtp, pp, vpp),
        }
        .map_err(err)?;
        Self::new(split, groups, model).map(Some)
    }

    /// Whether this rank holds the first virtual stage (the embedding).
    pub fn is_first(&self) -> bool {
        self.chunks.first().is_some_and(|c| c.embedding)
    }

    /// Whether this rank holds the last virtual stage (the loss).
    pub fn is_last(&self) -> bool {
        self.holding.head
    }

    /// Whether this rank holds a copy of the embedding another stage owns (the last stage's
    /// for a tied output layer or the MTP modules): its gradient is summed with the first
    /// stage's over the embedding group, and it is left out of the gradient norm.
    pub fn holds_embedding_copy(&self) -> bool {
        self.holding.embedding && !self.is_first()
    }
}

/// `select_stage` and `device` of a built-in causal LM (`model.layers` a
/// [`crate::layers::LayerStack`], `model.embed_tokens`, `model.norm`, `lm_head`), with an
/// optional extra step for its own parts (DeepSeek-V3's MTP modules).
macro_rules! stage_model {
    ($ty:ty) => {
        $crate::distributed::stage_model!($ty, |_model, _stage| {});
    };
    ($ty:ty, |$model:ident, $stage:ident| $extra:block) => {
        impl $ty {
            /// The parts of the model a pipeline stage holds (`stage`): its decoder layers
            /// (named by their global index), the embedding, final norm and output layer only
            /// where held. Applied to the lazy template before loading, so nothing else is
            /// ever allocated.
            pub fn select_stage(
                mut self,
                stage: &$crate::weights::StageHolding,
            ) -> Result<Self, $crate::ModelError> {
                self.model.layers = self.model.layers.select(&stage.layers)?;
                if !stage.embedding {
                    self.model.embed_tokens = None;
                }
                if !stage.head {
                    self.model.norm = None;
                    self.lm_head = None;
                }
                {
                    let ($model, $stage) = (&mut self, stage);
                    $extra
                }
                Ok(self)
            }

            /// The device the model's parameters live on.
            pub fn device(&self) -> burn::tensor::Device {
                $crate::weights::module_device(self)
            }
        }
    };
}
pub(crate) use stage_model;
