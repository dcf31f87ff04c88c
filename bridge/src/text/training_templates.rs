//! The chat templates TRL swaps in for assistant-only loss.
//!
//! TRL 1.16.0's `SFTTrainer.__init__` (`trl/trainer/sft_trainer.py`), when
//! `assistant_only_loss=True` and the model's chat template (its `default` one when it ships
//! several) has no `{% generation %}` tag (`has_generation_markers`), replaces it by
//! `get_training_chat_template(processing_class)` (`trl/chat_template_utils.py`): a training
//! variant chosen by the exact text of the model's template, or a `ValueError` when TRL knows no
//! variant. The files of `training_templates/` are TRL's originals and variants for the model
//! families burn-moe trains (Qwen3, Qwen3-Instruct-2507, DeepSeek-V3); other templates TRL
//! patches (Llama 3, Gemma, Phi-3, …) belong to models burn-moe does not load and are refused
//! with TRL's message.

use super::chat::ChatTemplate;
use crate::BridgeError;

/// A template TRL recognizes and the training variant it swaps in.
#[derive(Debug, Clone, Copy)]
pub struct TrainingTemplate {
    /// TRL's name of the template (`qwen3`, `qwen3_instruct_2507`, `deepseekv3`).
    pub name: &'static str,
    /// The model's template, as TRL compares it (exact text).
    pub original: &'static str,
    /// The training variant, with `{% generation %}` around the assistant output.
    pub training: &'static str,
}

/// The templates of TRL 1.16.0 embedded here (see the module docs).
pub const TRAINING_TEMPLATES: [TrainingTemplate; 3] = [
    TrainingTemplate {
        name: "qwen3",
        original: include_str!("training_templates/qwen3.jinja"),
        training: include_str!("training_templates/qwen3_training.jinja"),
    },
    TrainingTemplate {
        name: "qwen3_instruct_2507",
        original: include_str!("training_templates/qwen3_instruct_2507.jinja"),
        training: include_str!("training_templates/qwen3_instruct_2507_training.jinja"),
    },
    TrainingTemplate {
        name: "deepseekv3",
        original: include_str!("training_templates/deepseekv3.jinja"),
        training: include_str!("training_templates/deepseekv3_training.jinja"),
    },
];

/// TRL's message when it has no training variant of a template without `{% generation %}`.
pub const UNPATCHABLE_TEMPLATE: &str = "The chat template is not training-compatible (missing \
    prefix-preservation or `{% generation %}` markers) and patching is not supported for this \
    template. Please manually modify the chat template for training.";

/// TRL's training variant of `source` (exact text match), if it has one.
pub fn training_variant(source: &str) -> Option<&'static TrainingTemplate> {
    TRAINING_TEMPLATES.iter().find(|t| t.original == source)
}

/// The template to render with for assistant-only loss, as TRL 1.16 picks it: `template`
/// itself when it has `{% generation %}` tags, else TRL's training variant of it (named
/// `trl:<name>`, its path the original's), else TRL's refusal as a
/// [`BridgeError::ChatTemplate`] of `template`.
pub fn assistant_mask_template(template: &ChatTemplate) -> Result<ChatTemplate, BridgeError> {
    if template.has_generation_markers() {
        return Ok(template.clone());
    }
    match training_variant(&template.source) {
        Some(variant) => Ok(ChatTemplate {
            source: variant.training.to_string(),
            path: template.path.clone(),
            name: Some(format!("trl:{}", variant.name)),
        }),
        None => Err(BridgeError::ChatTemplate {
            path: template.path.clone(),
            name: template.name.clone(),
            line: None,
            reason: format!(
                "assistant-only loss needs `{{% generation %}}` tags, which this template lacks, \
                 and TRL has no training variant of it (it has one for {}): {UNPATCHABLE_TEMPLATE}",
                TRAINING_TEMPLATES.map(|t| t.name).join(", ")
            ),
        }),
    }
}
