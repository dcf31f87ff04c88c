//! `moe upcycle`: a dense Qwen3 checkpoint into a Qwen3-MoE one (docs/checkpoints.md §Upcycling).

use std::path::PathBuf;

use anyhow::Context;
use burn_moe::bridge::export::parse_size;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::models::hf::ModelConfig;
use burn_moe::models::upcycle::{RouterMode, UpcycleOptions, upcycle};

/// Arguments of `moe upcycle`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Dense HF Qwen3 checkpoint directory.
    #[arg(long, value_name = "DIR")]
    pub from: PathBuf,
    /// Output HF Qwen3-MoE directory (written atomically).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Routed experts per layer `E`.
    #[arg(long)]
    pub experts: usize,
    /// Experts per token `k`.
    #[arg(long)]
    pub topk: usize,
    /// Granularity `G = F_dense / F_moe` (1: every expert is a full copy of the dense MLP).
    #[arg(long, default_value_t = 1)]
    pub granularity: usize,
    /// Seed of the router initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Pre-softmax routing (`norm_topk_prob = false`, scale `R·G²/k`) instead of post-softmax.
    #[arg(long)]
    pub pre_softmax: bool,
    /// Largest shard, e.g. `5GB`.
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
    /// Replace the output directory if it exists.
    #[arg(long)]
    pub overwrite: bool,
}

/// Runs `moe upcycle`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let options = UpcycleOptions {
        experts: args.experts,
        topk: args.topk,
        granularity: args.granularity,
        seed: args.seed,
        router_mode: if args.pre_softmax {
            RouterMode::PreSoftmax
        } else {
            RouterMode::PostSoftmax
        },
        max_shard_size: args.max_shard_size,
        overwrite: args.overwrite,
    };
    // The source is validated against its config.json before anything is written (an MoE
    // source passes and is refused by `upcycle` for its model_type).
    let failed = || format!("upcycling {} failed", args.from.display());
    let report = HfCheckpoint::open(&args.from)
        .and_then(|source| source.check::<ModelConfig>())
        .with_context(failed)?;
    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    let summary = upcycle(&args.from, &args.out, &options).with_context(failed)?;
    println!(
        "{}: {} MoE layers, E={} k={} G={} (expert width {}, scale s={} c={:.6}), {} tensors, {} bytes in {} shard(s)",
        summary.target.display(),
        summary.moe_layers,
        summary.scale.experts,
        summary.scale.topk,
        summary.scale.granularity,
        summary.scale.moe_intermediate,
        summary.scale.scale,
        summary.scale.weight_multiplier,
        summary.tensors,
        summary.total_size,
        summary.shards
    );
    Ok(())
}
