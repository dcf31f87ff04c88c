//! `moe`: the burn-moe command line.
//!
//! A thin dispatcher: every subcommand lives in its own module as an `Args` struct (clap
//! derive) and a `run` function that calls the library crates. Logs go to stderr through
//! `tracing` (`RUST_LOG=debug` for more); results go to stdout or the named output files.

mod checkpoint;
mod export;
mod generate;
mod inspect;
mod logits;
mod logprobs;
mod plan;
mod progress;
mod receive_weights;
mod train;
mod upcycle;

use burn_moe::device::DeviceChoice;
use clap::{Parser, Subcommand};

/// `--device` values of `moe train` and `moe logits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceArg {
    /// Burn's Flex CPU backend.
    Cpu,
    /// Burn's Vulkan runtime (binary built with `--features vulkan`).
    Vulkan,
    /// Burn's CUDA runtime, GPU 0 (binary built with `--features cuda`).
    Cuda,
}

impl From<DeviceArg> for DeviceChoice {
    fn from(d: DeviceArg) -> Self {
        match d {
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Vulkan => DeviceChoice::Vulkan,
            DeviceArg::Cuda => DeviceChoice::Cuda,
        }
    }
}

/// Mixture-of-Experts models in Burn: inspect, run and export HuggingFace checkpoints.
///
/// MODEL arguments accept a local HuggingFace checkpoint directory (`model.safetensors` or a
/// sharded `model.safetensors.index.json`, plus `config.json`) or a model id already in the
/// HuggingFace hub cache (`HF_HUB_CACHE`, `HF_HOME`, `~/.cache/huggingface/hub`). Supported
/// architectures: Qwen3, Qwen3-MoE, DeepSeek-V3 (FP8 release checkpoints included).
#[derive(Debug, Parser)]
#[command(name = "moe", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a checkpoint's architecture, parameter counts, dtypes, shards and FP8 status.
    Inspect(inspect::Args),
    /// Run a forward pass over token ids and write the logits (and losses) to safetensors.
    Logits(logits::Args),
    /// Per-token log-probs of the next token and entropies, under any parallel layout.
    Logprobs(logprobs::Args),
    /// Continue a prompt of token ids, greedily or by sampling.
    Generate(generate::Args),
    /// Receive a weight sync over TCP (`moe train --sync-weights-to`) into a model, then
    /// continue a prompt with it as `moe generate` does.
    ReceiveWeights(receive_weights::Args),
    /// Write a checkpoint as a HuggingFace directory (e.g. FP8 → BF16, re-sharding).
    Export(export::Args),
    /// Turn a dense Qwen3 checkpoint into a Qwen3-MoE one (Megatron's upcycling).
    Upcycle(upcycle::Args),
    /// Per-rank parameters, memory and EP communication of a parallel layout.
    Plan(plan::Args),
    /// Convert an HF checkpoint into a distributed checkpoint under a layout.
    Convert(checkpoint::ConvertArgs),
    /// Rewrite a distributed checkpoint under another layout.
    Reshard(checkpoint::ReshardArgs),
    /// Check that every element of every tensor is stored exactly once, and finite.
    Validate(checkpoint::ValidateArgs),
    /// Fine-tune a Qwen3-MoE, DeepSeek-V3 or Qwen3 checkpoint under a parallel layout
    /// (threads, or one process per rank under mpirun / srun).
    Train(Box<train::Args>),
}

fn main() -> std::process::ExitCode {
    burn_moe::init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(args),
        Command::Logits(args) => logits::run(args),
        Command::Logprobs(args) => logprobs::run(args),
        Command::Generate(args) => generate::run(args),
        Command::ReceiveWeights(args) => receive_weights::run(args),
        Command::Export(args) => export::run(args),
        Command::Upcycle(args) => upcycle::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Convert(args) => checkpoint::convert(args),
        Command::Reshard(args) => checkpoint::reshard_cmd(args),
        Command::Validate(args) => checkpoint::validate(args),
        Command::Train(args) => train::run(*args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", describe(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined by `: `, skipping a cause whose text the message already
/// contains (our error types print their source inline).
fn describe(err: &anyhow::Error) -> String {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let err = anyhow::Error::new(burn_moe::bridge::BridgeError::Io {
            path: "x".into(),
            source: io,
        })
        .context("cannot load model m");
        assert_eq!(describe(&err), "cannot load model m: x: I/O error: gone");
    }
}
