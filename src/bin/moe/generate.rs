//! `moe generate`: continue a prompt of token ids with a KV cache.

use anyhow::Context;
use burn::tensor::Device;
use burn_moe::bridge::hf::{HfCheckpoint, resolve_model_dir};
use burn_moe::bridge::weights::WeightPrecision;
use burn_moe::models::{GenerationConfig, Sampling};
use serde_json::Value;

/// Arguments of `moe generate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF checkpoint directory or hub-cache model id.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// Prompt token ids, comma-separated (e.g. `1,2,3`).
    #[arg(long, value_name = "IDS", value_delimiter = ',', required = true, num_args = 1..)]
    pub prompt_ids: Vec<usize>,
    /// Number of tokens to generate at most.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_new_tokens: usize,
    /// Sample from softmax(logits / T) instead of greedy decoding (T > 0).
    #[arg(long, value_name = "T", value_parser = positive_temperature)]
    pub temperature: Option<f64>,
    /// Keep only the K most likely tokens when sampling.
    #[arg(long, value_name = "K", requires = "temperature")]
    pub top_k: Option<usize>,
    /// Seed of the sampler (same seed, same tokens).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Do not stop at the end-of-sequence token(s) of generation_config.json / config.json.
    #[arg(long)]
    pub ignore_eos: bool,
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
    let device = Device::flex();
    let sampling = match args.temperature {
        Some(temperature) => Sampling::Sample {
            temperature,
            top_k: args.top_k,
            seed: args.seed,
        },
        None => Sampling::Greedy,
    };
    let eos_token_ids = if args.ignore_eos {
        Vec::new()
    } else {
        eos_ids(&args.model)?
    };
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        sampling,
        eos_token_ids,
    };
    let model = crate::progress::load_model(&args.model, WeightPrecision::F32, &device)?;
    let started = std::time::Instant::now();
    let new = crate::progress::with_spinner("generating", || {
        model.generate(&args.prompt_ids, &config, &device)
    })
    .context("generation failed")?;
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        tokens = new.len(),
        seconds,
        tokens_per_second = new.len() as f64 / seconds.max(1e-9),
        "generated"
    );
    let text: Vec<String> = new.iter().map(usize::to_string).collect();
    println!("{}", text.join(","));
    Ok(())
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
