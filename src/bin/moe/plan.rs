//! `moe plan`: per-GPU parameters, memory (weights, gradients, optimizer, activations by
//! module) and per-layer / per-step communication of a layout, without running it; with
//! `--layout` omitted, the best layouts of `--gpus` that fit `--gpu-memory`
//! (docs/parallelism.md §Planner formulas; models in `moe_models::plan`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use burn_moe::backend::parallel::{LayoutSpec, ParallelLayout};
use burn_moe::models::hf::ModelConfig;
use burn_moe::models::plan::comm::Dispatcher;
use burn_moe::models::plan::search::{Hardware, search};
use burn_moe::models::plan::shape::PlannedModel;
use burn_moe::models::plan::{
    LayoutPlan, PlanOptions, a2a_remote_bytes, compute_comm_ratio, plan_layout,
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
    /// Without it, layouts of `--gpus` are searched (`--search`).
    #[arg(long)]
    pub layout: Option<String>,
    /// Search layouts even if `--layout` is given.
    #[arg(long)]
    pub search: bool,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    pub seq: usize,
    /// Micro-batch size.
    #[arg(long, default_value_t = 1)]
    pub mbs: usize,
    /// Global batch in sequences (default: 4·pp micro-batches per step).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Virtual pipeline stages per rank (interleaved 1F1B): the same as `vpp=V` in `--layout`
    /// (which it must agree with); with the search, applied to the layouts with `pp > 1`.
    #[arg(long)]
    pub vpp: Option<usize>,
    /// Which layers each virtual pipeline stage holds, in Megatron's
    /// `--pipeline-model-parallel-layout` syntax (e.g. `Et*3|t*4|t*4|t*3L`; `m` for MTP
    /// modules): the same as `pp_layout=…` in `--layout` (which it must agree with). Without
    /// it, layers are split contiguously (the remainder on the earlier virtual stages).
    #[arg(long, value_name = "LAYOUT")]
    pub pipeline_layout: Option<String>,
    /// FP8 activations (linear inputs) and FP8 primary weights.
    #[arg(long)]
    pub fp8: bool,
    /// Recomputation: none, selective, full, or a module list
    /// (core_attn,moe_act,layernorm,mla_up_proj,mlp,moe,shared_experts).
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// Memory-efficient permutation (router probabilities applied before fc2).
    #[arg(long)]
    pub memory_efficient_permutation: bool,
    /// Adam moment precision (bf16 or fp32).
    #[arg(long, default_value = "fp32")]
    pub optimizer_dtype: String,
    /// Adam moments in bf16 (same as `--optimizer-dtype bf16`).
    #[arg(long)]
    pub bf16_moments: bool,
    /// Plan an f32 run (`moe train --fp32`, the CPU default): 4-byte parameters, activations
    /// and dispatched tokens. Default: BF16 mixed precision (`moe train --bf16`, the CUDA
    /// default).
    #[arg(long)]
    pub fp32: bool,
    /// Plan an FP16 run (`moe train --fp16`): the same bytes as BF16 (2-byte parameters,
    /// gradients, activations and dispatched tokens; f32 main weights and moments).
    #[arg(long, conflicts_with = "fp32")]
    pub fp16: bool,
    /// ZeRO-1 distributed optimizer (`--distributed-optimizer false` replicates it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub distributed_optimizer: bool,
    /// Token dispatcher: alltoall or allgather.
    #[arg(long, default_value = "alltoall")]
    pub dispatcher: String,
    /// GPU memory budget in GB for the search.
    #[arg(long, default_value_t = 80.0)]
    pub gpu_memory: f64,
    /// Layouts the search prints.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Peak dense throughput per GPU in TFLOP/s.
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
    /// Link bandwidth per GPU in GB/s.
    #[arg(long, default_value_t = 400.0)]
    pub link_gbps: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn options(args: &Args) -> anyhow::Result<PlanOptions> {
    let mut optimizer_dtype = args.optimizer_dtype.parse()?;
    if args.bf16_moments {
        optimizer_dtype = burn_moe::models::plan::memory::OptimizerDtype::Bf16;
    }
    Ok(PlanOptions {
        seq: args.seq,
        micro_batch: args.mbs,
        global_batch: args.global_batch,
        vpp: args.vpp.unwrap_or(1),
        fp8: args.fp8,
        recompute: args.recompute.parse()?,
        memory_efficient_permutation: args.memory_efficient_permutation,
        optimizer_dtype,
        distributed_optimizer: args.distributed_optimizer,
        dispatcher: match args.dispatcher.as_str() {
            "alltoall" | "all_to_all" => Dispatcher::AllToAll,
            "allgather" | "all_gather" => Dispatcher::AllGather,
            other => bail!("--dispatcher: `{other}` (expected alltoall or allgather)"),
        },
        precision: if args.fp32 {
            burn_moe::backend::optim::Precision::F32
        } else if args.fp16 {
            burn_moe::backend::optim::Precision::F16
        } else {
            burn_moe::backend::optim::Precision::Bf16
        },
    })
}

fn load_model(path: &std::path::Path) -> anyhow::Result<PlannedModel> {
    let path = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let config = ModelConfig::from_json(&value, &path)?;
    match PlannedModel::from_config(&config)? {
        Some(model) => Ok(model),
        None => bail!(
            "`moe plan` needs an MoE model; `{}` is dense",
            config.model_type()
        ),
    }
}

/// Runs `moe plan`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let model = load_model(&args.model)?;
    let opts = options(&args)?;
    if args.search || args.layout.is_none() {
        if args.pipeline_layout.is_some() {
            bail!(
                "pipeline_layout: --pipeline-layout needs --layout without --search (the search \
                 splits layers contiguously)"
            );
        }
        let Some(gpus) = args.gpus else {
            bail!("--gpus is needed to search layouts (or give --layout)");
        };
        let hw = Hardware {
            memory_bytes: args.gpu_memory * 1e9,
            peak_flops: args.peak_tflops * 1e12,
            link_bytes_per_s: args.link_gbps * 1e9,
        };
        let found = search(&model, gpus, &opts, &hw, args.top)?;
        if args.json {
            let rows: Vec<_> = found
                .iter()
                .map(|c| {
                    json!({
                        "layout": c.plan.layout.to_string(),
                        "vpp": c.plan.vpp,
                        "peak_gb": c.plan.peak_memory() / 1e9,
                        "step_bytes": c.plan.max_step_bytes(),
                        "compute_s": c.compute_s,
                        "comm_s": c.comm_s,
                        "step_s": c.step_s(),
                    })
                })
                .collect();
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({ "layouts": rows }))?
            );
            return Ok(());
        }
        println!(
            "{:>4} {:<44} {:>9} {:>12} {:>10} {:>10}",
            "rank", "layout", "peak GB", "step GB", "comp s", "step s"
        );
        for (i, c) in found.iter().enumerate() {
            println!(
                "{:>4} {:<44} {:>9.1} {:>12.2} {:>10.3} {:>10.3}",
                i + 1,
                c.plan.layout.to_string(),
                c.plan.peak_memory() / 1e9,
                c.plan.max_step_bytes() / 1e9,
                c.compute_s,
                c.step_s()
            );
        }
        return Ok(());
    }
    let mut spec: LayoutSpec = args.layout.as_deref().unwrap_or("").parse()?;
    if let Some(gpus) = args.gpus {
        spec.world = Some(gpus);
    }
    merge_pipeline_flags(&mut spec, &args)?;
    let layout = ParallelLayout::from_spec(&spec)?;
    // The layout carries vpp now (plan_layout takes it from there).
    let opts = PlanOptions { vpp: 1, ..opts };
    let plan = plan_layout(&model, &layout, &opts)?;
    let shape = model.shape();
    // Tokens per rank entering the MoE layer: the micro-batch split over TP (SP) and CP.
    let tokens = args.seq * args.mbs / (layout.tp * layout.cp).max(1);
    let a2a = a2a_remote_bytes(tokens, shape.top_k, shape.hidden, 2, layout.ep);
    let ratio = compute_comm_ratio(
        shape.moe_ffn,
        args.link_gbps * 1e9,
        args.peak_tflops * 1e12,
        Some(layout.ep),
    );
    if args.json {
        let mut report = plan.to_json();
        if let Some(obj) = report.as_object_mut() {
            obj.insert("tokens_per_rank".into(), json!(tokens));
            obj.insert(
                "ep_dispatch_bytes_per_layer_per_direction".into(),
                json!(a2a),
            );
            obj.insert(
                "ep_dispatch_combine_fwd_bwd_bytes_per_layer".into(),
                json!(4.0 * a2a),
            );
            obj.insert("ep_compute_comm_ratio".into(), json!(ratio));
        }
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&plan);
    println!(
        "EP dispatch per MoE layer and direction: {:.2} MiB/rank ({tokens} tokens/rank, k={}, \
         h={}, bf16); dispatch+combine fwd+bwd {:.2} MiB",
        a2a / (1 << 20) as f64,
        shape.top_k,
        shape.hidden,
        4.0 * a2a / (1 << 20) as f64
    );
    println!("EP compute/communication ratio R = {ratio:.2} (hideable when R > 1)");
    Ok(())
}

/// Folds `--vpp` and `--pipeline-layout` into the layout spec: used where `--layout` gives
/// none, refused (naming the field) where it gives another.
fn merge_pipeline_flags(spec: &mut LayoutSpec, args: &Args) -> anyhow::Result<()> {
    if let Some(vpp) = args.vpp {
        match spec.vpp {
            Some(given) if given != vpp => {
                bail!("vpp: --vpp {vpp} contradicts vpp={given} in --layout (give one of them)")
            }
            _ => spec.vpp = Some(vpp),
        }
    }
    if let Some(text) = &args.pipeline_layout {
        let bare = |t: &str| t.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        match &spec.pp_layout {
            Some(given) if bare(given) != bare(text) => bail!(
                "pipeline_layout: --pipeline-layout `{text}` contradicts pp_layout={given} in \
                 --layout (give one of them)"
            ),
            Some(_) => {}
            None => spec.pp_layout = Some(text.clone()),
        }
    }
    Ok(())
}

fn print_table(plan: &LayoutPlan) {
    let gb = |b: f64| b / 1e9;
    println!(
        "{} vpp={} microbatches/step={}",
        plan.layout, plan.vpp, plan.microbatches
    );
    println!(
        "pipeline: {} ({})",
        burn_moe::models::plan::split_layout(&plan.split),
        if plan.pipeline_layout.is_some() {
            "explicit layout"
        } else {
            "contiguous split"
        }
    );
    println!(
        "{:>5} {:>7} {:>6} {:>14} {:>9} {:>11} {:>9} {:>9}",
        "stage", "layers", "holds", "params/rank", "w+g GB", "master+opt", "act GB", "total GB"
    );
    for s in &plan.stages {
        let holds = format!(
            "{}{}{}",
            if s.holds_embedding() { "E" } else { "" },
            if s.mtp_modules() > 0 { "m" } else { "" },
            if s.holds_head() { "L" } else { "" }
        );
        println!(
            "{:>5} {:>7} {:>6} {:>14} {:>9.2} {:>11.2} {:>9.2} {:>9.2}",
            s.stage,
            s.layer_count(),
            holds,
            s.params.total(),
            gb(s.state.weights_grads()),
            gb(s.state.master_optimizer()),
            gb(s.activations.total()),
            gb(s.memory())
        );
    }
    if let Some(peak) = plan.peak() {
        println!("activations by module, stage {} (GB):", peak.stage);
        for (name, b) in peak.activations.modules() {
            if b > 0.0 {
                println!("  {name:<22} {:>9.2}", gb(b));
            }
        }
        println!(
            "communication per step, stage {} (GB sent per rank):",
            peak.stage
        );
        println!(
            "  {:<8} {:>12} {:>12} {:>12}",
            "family", "per layer*", "optimizer", "step"
        );
        let first_moe = peak.traffic.layers.iter().find(|l| l.moe);
        for (i, (name, step)) in peak.traffic.total.families().iter().enumerate() {
            let layer = first_moe.map(|l| l.bytes.families()[i].1).unwrap_or(0.0);
            let opt = peak.traffic.optimizer.families()[i].1;
            println!(
                "  {name:<8} {:>12.4} {:>12.4} {:>12.4}",
                gb(layer),
                gb(opt),
                gb(*step)
            );
        }
        println!("  * one MoE layer, one micro-batch, forward + backward");
    }
}
