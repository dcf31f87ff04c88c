//! `moe generate`: continue a prompt with a KV cache, greedily or by sampling with HF's
//! temperature → top-k → top-p processors (`moe_models::rollout`). The prompt is token ids
//! (`--prompt-ids`) or text (`--prompt`, encoded with the model's tokenizer.json, optionally
//! through its chat template with `--chat`); the continuation is printed as ids, text or both.

use anyhow::{Context, bail};
use burn::tensor::Device;
use burn_moe::bridge::Tokenizer;
use burn_moe::bridge::hf::{HfCheckpoint, resolve_model_dir};
use burn_moe::models::CausalLm;
use burn_moe::models::family::Family;
use burn_moe::models::hf::WeightPrecision;
use burn_moe::models::hf::{AnyCausalLm, ModelVisitor};
use burn_moe::models::rollout::{Rollout, SamplingConfig, generate_batch};
use serde_json::Value;

/// Arguments of `moe generate`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt_ids", "prompt"])))]
pub struct Args {
    /// HF checkpoint directory or hub-cache model id.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// Prompt token ids, comma-separated (e.g. `1,2,3`).
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1..)]
    pub prompt_ids: Vec<usize>,
    /// Prompt text, encoded with the model's tokenizer.json (with its special tokens, e.g. a
    /// BOS, as transformers' `encode` adds them).
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Send `--prompt` as one user message through the model's chat template (from
    /// tokenizer_config.json or chat_template.jinja), with the assistant turn opened.
    // `conflicts_with`, as `requires = "prompt"` went unchecked here (the argument is in the
    // required `input` group); the group then makes `--prompt` present.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// What to print of the continuation: its token ids (comma-separated), its text (special
    /// tokens skipped), or both (ids on the first line). Default: text for `--prompt`, ids for
    /// `--prompt-ids`.
    #[arg(long, value_enum, value_name = "WHAT")]
    pub print: Option<Print>,
    /// Number of tokens to generate at most.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_new_tokens: usize,
    /// Sample from softmax(logits / T) instead of greedy decoding (T > 0).
    #[arg(long, value_name = "T", value_parser = positive_temperature)]
    pub temperature: Option<f64>,
    /// Keep only the K most likely tokens when sampling (and those tied with the K-th).
    #[arg(long, value_name = "K", requires = "temperature")]
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums
    /// to at least P (0 ≤ P ≤ 1), after temperature and top-k.
    #[arg(long, value_name = "P", requires = "temperature")]
    pub top_p: Option<f64>,
    /// Seed of the sampler (same seed, same tokens).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Extra stop token ids, comma-separated (generation ends after producing one; it is
    /// printed), in addition to the end-of-sequence token(s) unless `--ignore-eos`.
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1..)]
    pub stop_ids: Vec<i64>,
    /// Do not stop at the end-of-sequence token(s) of generation_config.json / config.json.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// `--print` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Print {
    /// Token ids, comma-separated.
    Ids,
    /// The decoded text (needs the model's tokenizer).
    Text,
    /// The ids on one line, then the text.
    Both,
}

/// Parses `--temperature`: a finite number > 0.
fn positive_temperature(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 => Ok(t),
        _ => Err(format!(
            "`{text}` is not a positive number (omit --temperature for greedy decoding)"
        )),
    }
}

/// Runs `moe generate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    run_with(args, None)
}

/// Runs `moe generate` with `model` (on the Flex device) instead of the one `--model` loads
/// (`--model` still provides the tokenizer and the end-of-sequence ids).
pub fn run_with(args: Args, model: Option<AnyCausalLm>) -> anyhow::Result<()> {
    let device = Device::flex();
    let print = args.print.unwrap_or(if args.prompt.is_some() {
        Print::Text
    } else {
        Print::Ids
    });
    let mut eos: Vec<usize> = if args.ignore_eos {
        Vec::new()
    } else {
        eos_ids(&args.model)?
    };
    // The tokenizer, when text goes in or out, or when it is the only source of the
    // end-of-sequence id.
    let dir = resolve_model_dir(&args.model)?;
    let tokenizer = if args.prompt.is_some() || print != Print::Ids {
        Some(Tokenizer::from_dir(&dir)?)
    } else if eos.is_empty() && !args.ignore_eos {
        // Only the end-of-sequence id is at stake: a broken tokenizer is worth a warning.
        Tokenizer::from_dir_if_present(&dir).unwrap_or_else(|e| {
            tracing::warn!("{e}; generation will not stop at the tokenizer's eos_token");
            None
        })
    } else {
        None
    };
    if eos.is_empty()
        && !args.ignore_eos
        && let Some(tokenizer) = &tokenizer
    {
        eos = tokenizer
            .generation_stop_ids()
            .into_iter()
            .map(|t| t as usize)
            .collect();
    }
    let prompt: Vec<i64> = match (&args.prompt, &tokenizer) {
        (Some(text), Some(tokenizer)) => encode_prompt(tokenizer, text, args.chat)?,
        _ => args.prompt_ids.iter().map(|&t| t as i64).collect(),
    };
    let mut config = SamplingConfig {
        // No --temperature: greedy decoding (temperature 0).
        temperature: args.temperature.unwrap_or(0.0),
        top_k: args.top_k,
        top_p: args.top_p,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: args.stop_ids.clone(),
        seed: args.seed,
    };
    if args.max_new_tokens == 0 {
        println!();
        return Ok(());
    }
    config.validate()?;
    let model = match model {
        Some(model) => model,
        None => crate::progress::load_model(&args.model, WeightPrecision::F32, &device)?,
    };
    // End-of-sequence ids the model cannot produce are dropped (they never match).
    let vocab = model.vocab_size();
    config
        .stop_tokens
        .extend(eos.iter().filter(|&&t| t < vocab).map(|&t| t as i64));
    if let (Some(tokenizer), Some(&bad)) = (
        tokenizer.as_ref().filter(|_| args.prompt.is_some()),
        prompt.iter().find(|&&t| t as usize >= vocab),
    ) {
        bail!(
            "{}: the prompt encodes to token id {bad} ({:?}), outside the model's vocabulary of \
             {vocab} (is this the model's own tokenizer?)",
            tokenizer.path().display(),
            tokenizer.id_to_token(bad as u32).unwrap_or_default()
        );
    }
    let started = std::time::Instant::now();
    let rollout =
        crate::progress::with_spinner("generating", || rollout(&model, prompt.clone(), &config))
            .context("generation failed")?;
    let seconds = started.elapsed().as_secs_f64();
    let new = &rollout.tokens;
    tracing::info!(
        tokens = new.len(),
        finish_reason = ?rollout.finish_reason,
        seconds,
        tokens_per_second = new.len() as f64 / seconds.max(1e-9),
        "generated"
    );
    if print != Print::Text {
        let ids: Vec<String> = new.iter().map(i64::to_string).collect();
        println!("{}", ids.join(","));
    }
    if print != Print::Ids
        && let Some(tokenizer) = &tokenizer
    {
        println!("{}", continuation_text(tokenizer, &prompt, new)?);
    }
    Ok(())
}

/// Token ids of `--prompt` (through the chat template with `--chat`, then without special
/// tokens, as transformers' `apply_chat_template` encodes).
fn encode_prompt(tokenizer: &Tokenizer, text: &str, chat: bool) -> anyhow::Result<Vec<i64>> {
    let ids = if chat {
        tokenizer.encode(&tokenizer.chat_prompt(text)?, false)?
    } else {
        tokenizer.encode(text, true)?
    };
    if ids.is_empty() {
        bail!(
            "{}: the prompt {text:?} encodes to no tokens",
            tokenizer.path().display()
        );
    }
    Ok(ids.into_iter().map(i64::from).collect())
}

/// The text of `new` as it continues `prompt` (special tokens skipped): the decoded whole
/// minus the decoded prompt, as transformers' text-generation pipeline does, so that
/// tokenizers which drop a leading space when decoding a fragment (Metaspace) print it; the
/// continuation decoded alone if the prompt's text is not a prefix.
fn continuation_text(tokenizer: &Tokenizer, prompt: &[i64], new: &[i64]) -> anyhow::Result<String> {
    let to_u32 = |ids: &[i64]| -> Vec<u32> {
        ids.iter()
            .map(|&t| u32::try_from(t).unwrap_or(u32::MAX))
            .collect()
    };
    let prompt = to_u32(prompt);
    let new = to_u32(new);
    let all: Vec<u32> = prompt.iter().chain(&new).copied().collect();
    let whole = tokenizer.decode(&all, true)?;
    let head = tokenizer.decode(&prompt, true)?;
    Ok(match whole.strip_prefix(&head) {
        Some(rest) => rest.to_string(),
        None => tokenizer.decode(&new, true)?,
    })
}

/// One rollout of `prompt` with the model's own type.
fn rollout(
    model: &AnyCausalLm,
    prompt: Vec<i64>,
    config: &SamplingConfig,
) -> Result<Rollout, burn_moe::models::ModelError> {
    let prompts = [prompt];
    struct Roll<'a>(&'a [Vec<i64>], &'a SamplingConfig);
    impl ModelVisitor for Roll<'_> {
        type Output = Result<Vec<Rollout>, burn_moe::models::ModelError>;
        fn visit<F: Family>(self, model: &F::Model) -> Self::Output {
            generate_batch(model, self.0, self.1)
        }
    }
    let mut out = model.visit(Roll(&prompts, config))??;
    Ok(out.remove(0))
}

/// End-of-sequence ids from `generation_config.json`, else `config.json` (`eos_token_id`, a
/// number or a list; absent or null means none).
fn eos_ids(model: &str) -> anyhow::Result<Vec<usize>> {
    let checkpoint = HfCheckpoint::open(resolve_model_dir(model)?)?;
    let from = |v: Option<&Value>| -> Option<Vec<usize>> {
        match v? {
            Value::Number(n) => n.as_u64().map(|x| vec![x as usize]),
            Value::Array(items) => Some(
                items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as usize)
                    .collect(),
            ),
            _ => None,
        }
    };
    if let Some(generation) = checkpoint.generation_config_json()?
        && let Some(ids) = from(generation.get("eos_token_id"))
    {
        return Ok(ids);
    }
    let config = checkpoint.config_json()?;
    Ok(from(config.get("eos_token_id")).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_must_be_positive() {
        assert_eq!(positive_temperature("0.7"), Ok(0.7));
        for bad in ["0", "-1", "inf", "warm"] {
            assert!(positive_temperature(bad).is_err(), "{bad}");
        }
    }
}
