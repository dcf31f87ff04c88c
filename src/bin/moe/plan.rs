//! `moe plan`: per-rank parameters, memory and communication of a layout, without running it
//! (parallelism.md §6–§7; formulas in `moe_models::plan`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use burn_moe::backend::parallel::{LayoutSpec, ParallelLayout};
use burn_moe::bridge::weights::ModelConfig;
use burn_moe::models::plan::{
    RankParams, a2a_remote_bytes, bytes_per_param, compute_comm_ratio, deepseek_v3_rank_params,
    qwen3_moe_rank_params,
};
use serde_json::json;

/// Arguments of `moe plan`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF checkpoint directory or a `config.json` file (Qwen3-MoE or DeepSeek-V3).
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// Number of GPUs (ranks); overrides `world=` in `--layout`.
    #[arg(long)]
    pub gpus: Option<usize>,
    /// Layout, e.g. `tp=2,pp=4,ep=64,etp=1,cp=1` (omitted sizes are 1; dp/edp derived).
    #[arg(long, default_value = "")]
    pub layout: String,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    pub seq: usize,
    /// Micro-batch size.
    #[arg(long, default_value_t = 1)]
    pub mbs: usize,
    /// Adam moments in bf16 (`6 + 8/d` bytes per parameter instead of `6 + 12/d`).
    #[arg(long)]
    pub bf16_moments: bool,
    /// Peak dense throughput per GPU in TFLOP/s (for the EP compute/communication ratio).
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// EP link bandwidth per GPU in GB/s.
    #[arg(long, default_value_t = 400.0)]
    pub link_gbps: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `moe plan`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let path = if args.model.is_dir() {
        args.model.join("config.json")
    } else {
        args.model.clone()
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let config = ModelConfig::from_json(&value, &path)?;
    let mut spec: LayoutSpec = args.layout.parse()?;
    if let Some(gpus) = args.gpus {
        spec.world = Some(gpus);
    }
    let layout = ParallelLayout::from_spec(&spec)?;
    let (stage_params, hidden, topk, ffn): (Vec<RankParams>, usize, usize, usize) = match &config {
        ModelConfig::Qwen3Moe(c) => (
            (0..layout.pp)
                .map(|s| qwen3_moe_rank_params(c, &layout, s))
                .collect(),
            c.hidden_size,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
        ),
        ModelConfig::DeepseekV3(c) => (
            (0..layout.pp)
                .map(|s| deepseek_v3_rank_params(c, &layout, s))
                .collect(),
            c.hidden_size,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
        ),
        ModelConfig::Qwen3(_) => bail!("`moe plan` needs an MoE model (qwen3_moe or deepseek_v3)"),
    };
    let moment = if args.bf16_moments { 2 } else { 4 };
    let dense_bpp = bytes_per_param(layout.dp * layout.cp, moment);
    let expert_bpp = bytes_per_param(layout.edp, moment);
    // Tokens per rank entering the MoE layer: the micro-batch split over TP (SP) and CP.
    let tokens = args.seq * args.mbs / (layout.tp * layout.cp).max(1);
    let a2a = a2a_remote_bytes(tokens, topk, hidden, 2, layout.ep);
    let ratio = compute_comm_ratio(
        ffn,
        args.link_gbps * 1e9,
        args.peak_tflops * 1e12,
        Some(layout.ep),
    );
    let stages: Vec<_> = stage_params
        .iter()
        .enumerate()
        .map(|(s, p)| {
            let dense = (p.dense_sharded + p.dense_replicated) as f64;
            let expert = p.expert as f64;
            json!({
                "stage": s,
                "params": p.total(),
                "dense_params": dense,
                "expert_params": expert,
                "weights_grads_gb": (dense + expert) * 6.0 / 1e9,
                "master_optimizer_gb": dense * (dense_bpp - 6.0) / 1e9 + expert * (expert_bpp - 6.0) / 1e9,
            })
        })
        .collect();
    let report = json!({
        "layout": layout.to_string(),
        "tokens_per_rank": tokens,
        "ep_dispatch_bytes_per_layer_per_direction": a2a,
        "ep_dispatch_combine_fwd_bwd_bytes_per_layer": 4.0 * a2a,
        "ep_compute_comm_ratio": ratio,
        "stages": stages,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("{layout}");
    println!(
        "{:>5} {:>16} {:>16} {:>16} {:>12} {:>14}",
        "stage", "params/rank", "dense", "expert", "w+g GB", "master+opt GB"
    );
    for (stage, p) in stage_params.iter().enumerate() {
        let dense = (p.dense_sharded + p.dense_replicated) as f64;
        let expert = p.expert as f64;
        println!(
            "{:>5} {:>16} {:>16} {:>16} {:>12.2} {:>14.2}",
            stage,
            p.total(),
            p.dense_sharded + p.dense_replicated,
            p.expert,
            (dense + expert) * 6.0 / 1e9,
            dense * (dense_bpp - 6.0) / 1e9 + expert * (expert_bpp - 6.0) / 1e9
        );
    }
    println!(
        "EP dispatch per MoE layer and direction: {:.2} MiB/rank ({} tokens/rank, k={topk}, h={hidden}, bf16); dispatch+combine fwd+bwd {:.2} MiB",
        a2a / (1 << 20) as f64,
        tokens,
        4.0 * a2a / (1 << 20) as f64
    );
    println!("EP compute/communication ratio R = {ratio:.2} (hideable when R > 1)");
    Ok(())
}
