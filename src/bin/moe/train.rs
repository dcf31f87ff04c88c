//! `moe train`: fine-tune a Qwen3-MoE checkpoint under a parallel layout, on in-process ranks
//! (threads, the default) or as one process per rank when a launcher started it:
//! `torchrun --nproc-per-node 4 --no-python moe train …` (TCP), `mpirun -np 4 moe train …` or
//! `srun moe train …` (MPI in a build with `--features mpi`, else TCP).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use burn_moe::backend::optim::{
    DynamicScalerConfig, GradScalerConfig, LrDecayStyle, LrSchedule, MuonConfig, Precision,
    WdIncrStyle, WdSchedule, WsdDecay,
};
use burn_moe::backend::router::AuxLossType;
use burn_moe::bridge::export::parse_size;
use burn_moe::bridge::tensorboard::EventWriter;
use burn_moe::bridge::text::sft::Truncation;
use burn_moe::job_data::{SftPacking, SftSettings};
use burn_moe::launch::{self, Placement};
use burn_moe::models::distributed::{CpCommType, DispatcherKind};
use burn_moe::models::train::TrainerConfig;
use burn_moe::models::weight_sync::SyncDtype;
use burn_moe::preempt;
use burn_moe::train_job::{
    EvalJob, ExitPolicy, MetricsWriter, StepMetrics, TrainJob, TrainJobReport, run_job,
};

/// How the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// Processes when a launcher started this one (MPI under mpirun / srun in an `mpi`
    /// build, else TCP), threads otherwise.
    Auto,
    /// All ranks as threads of this process.
    Threads,
    /// One process per rank over TCP (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    Tcp,
    /// One process per rank over MPI (needs a build with `--features mpi`).
    Mpi,
    /// One process per rank over NCCL, one GPU each (needs a build with `--features nccl`);
    /// automatic under a launcher with `--device cuda` in such a build. Without a launcher,
    /// one process on GPU 0.
    Nccl,
}

/// Learning-rate decay styles (Megatron's `--lr-decay-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DecayStyle {
    /// `--lr` after the warmup.
    Constant,
    /// Linear to `--min-lr` at `--lr-decay-iters`.
    Linear,
    /// Half cosine to `--min-lr` at `--lr-decay-iters`.
    Cosine,
    /// `lr·sqrt(warmup / step)`, floored at `--min-lr`.
    InverseSquareRoot,
    /// Warmup-stable-decay: `--lr` until the last `--lr-wsd-decay-iters` steps before
    /// `--lr-decay-iters`, then annealing to `--min-lr`.
    Wsd,
}

/// Annealing shapes of the WSD schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WsdStyle {
    /// Linear.
    Linear,
    /// Half cosine.
    Cosine,
    /// Exponential.
    Exponential,
    /// `1 - sqrt(r)`.
    MinusSqrt,
}

/// Weight-decay increase shapes (Megatron's `--weight-decay-incr-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WdStyle {
    /// `--end-weight-decay` throughout (needs equal start and end).
    Constant,
    /// Linear.
    Linear,
    /// Half cosine.
    Cosine,
}

/// Token dispatcher of the MoE layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Dispatcher {
    /// Megatron's AlltoAll dispatcher (permute, all-to-all-v over EP, sort by local expert).
    AllToAll,
    /// All-gather the tokens over EP and keep the local experts' rows.
    AllGather,
    /// One all-to-all over the combined TP×EP group.
    Flex,
}

/// `--sft-packing` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SftPackingArg {
    /// Several examples per row.
    Packed,
    /// One example per row, padded.
    None,
}

/// `--sft-truncation` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SftTruncationArg {
    /// Keep the first `--seq-len` tokens.
    Truncate,
    /// Refuse the example, naming its line.
    Refuse,
}

/// Optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerKind {
    /// ZeRO-1 AdamW for every parameter.
    Adamw,
    /// Muon (Newton–Schulz-orthogonalised momentum) for the weight matrices, AdamW for the
    /// embedding, LM head, norms and biases; the same learning rate.
    Muon,
}

/// Activation recompute: Burn's per-operation gradient checkpointing and/or Megatron's
/// module-level selective recompute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recompute {
    /// Recompute memory-bound operations (Burn's gradient checkpointing).
    pub memory_bound: bool,
    /// The modules recomputed in the backward pass.
    pub modules: moe_models::plan::activations::Recompute,
}

/// Parses `--cp-comm-type`.
fn parse_cp_comm_type(s: &str) -> Result<CpCommType, String> {
    s.parse()
        .map_err(|e: burn_moe::models::ModelError| e.to_string())
}

/// Parses `--recompute`: `none`, `memory-bound`, `selective` (Megatron's default,
/// `core_attn`) or a comma-separated list of `memory-bound` and module names.
fn parse_recompute(s: &str) -> Result<Recompute, String> {
    let mut memory_bound = false;
    let mut modules = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item {
            "none" => {}
            "memory-bound" => memory_bound = true,
            other => modules.push(other),
        }
    }
    let modules = if modules.is_empty() {
        moe_models::plan::activations::Recompute::None
    } else {
        modules.join(",").parse().map_err(|e| format!("{e}"))?
    };
    Ok(Recompute {
        memory_bound,
        modules,
    })
}

/// Arguments of `moe train`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF Qwen3-MoE, DeepSeek-V3 or dense Qwen3 directory (an FP8 release trains dequantised) or a
    /// distributed checkpoint (root or `iter_*` directory).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Parallel layout, e.g. `tp=2,ep=4` or `world=8,tp=2,ep=4,etp=2` (omitted sizes are 1;
    /// the world is derived, or set by the launcher's process count). Pipeline parallelism:
    /// `pp=P`, with `vpp=V` virtual stages per rank (interleaved 1F1B); layers split evenly
    /// unless `--pipeline-layout` is given.
    #[arg(long, default_value = "")]
    pub layout: String,
    /// Which layers each virtual pipeline stage holds (Megatron's
    /// `--pipeline-model-parallel-layout`): stages separated by `|`, `E` the embedding, `t` a
    /// decoder layer, `m` an MTP module, `L` the final norm, output layer and loss, `X*N`
    /// repeats; e.g. `"Et*3|t*4|t*4|t*3L"` or `"E|t*2|t*2|ttmL"`.
    #[arg(long, value_name = "LAYOUT")]
    pub pipeline_layout: Option<String>,
    /// Train until this many optimizer steps have been taken (a resumed run continues to it).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Sequences per step over all data-parallel replicas.
    #[arg(long, default_value_t = 8)]
    pub gbs: usize,
    /// Sequences per micro-batch of a data-parallel replica (default: the replica's whole
    /// share, one micro-batch); gradients accumulate over the micro-batches of a step.
    #[arg(long)]
    pub mbs: Option<usize>,
    /// Tokens per sequence of the built-in corpus and of text `--data` (a safetensors
    /// `--data` file sets its own).
    #[arg(long, default_value_t = 16)]
    pub seq_len: usize,
    /// Training data: a safetensors file with integer `input_ids` [N, S], or text: a `.jsonl`
    /// file (one object per line with a `text` string) or a `.txt` file (one document per
    /// line), tokenized with the model's tokenizer.json, each document followed by the EOS
    /// token, concatenated and cut into rows of `--seq-len` tokens (the last partial row
    /// dropped). A `.jsonl` file of SFT rows — conversations (`messages`) or `prompt` /
    /// `completion` pairs, as HF TRL reads them — trains on the assistant / completion tokens
    /// only (see `--sft-*`). Without it, a built-in corpus of arithmetic sequences is used.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Directory with the tokenizer (tokenizer.json, tokenizer_config.json) for text `--data`
    /// (default: `--model`; needed when that is a distributed checkpoint).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Megatron indexed datasets (`prefix.bin` + `prefix.idx` from Megatron's
    /// preprocess_data.py): one prefix, or weight–prefix pairs to blend (`--data-path 0.3 a
    /// 0.7 b`). Samples of `--seq-len + 1` tokens across documents, shuffled by `--seed`, as
    /// Megatron's GPTDataset builds them.
    #[arg(long, value_name = "[WEIGHT] PREFIX", num_args = 1.., conflicts_with = "data")]
    pub data_path: Vec<String>,
    /// Seed of the data order (`--data-path`).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// SFT data (`--data` JSONL with `messages`, or `prompt` and `completion`): `packed`
    /// (several examples per row, best-fit decreasing as TRL packs; attention and positions
    /// never cross examples) or `none` (one example per row, padded).
    #[arg(long, value_enum, default_value_t = SftPackingArg::Packed)]
    pub sft_packing: SftPackingArg,
    /// SFT examples longer than `--seq-len`: `truncate` (keep the start, as TRL) or `refuse`.
    #[arg(long, value_enum, default_value_t = SftTruncationArg::Truncate)]
    pub sft_truncation: SftTruncationArg,
    /// SFT conversations: train on every token, not only the assistant turns.
    #[arg(long)]
    pub sft_train_on_prompts: bool,
    /// TensorBoard event files (loss, aux and MTP losses, grad norm, learning rate, tokens/s,
    /// validation loss, skipped steps), written by rank 0, flushed every step; a resumed run
    /// adds a file to the same directory.
    #[arg(long, value_name = "DIR")]
    pub tensorboard_dir: Option<PathBuf>,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// AdamW weight decay (norms and biases are exempt, as in Megatron).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Weight decay at step 0 of an increasing schedule (with `--end-weight-decay`).
    #[arg(long, requires = "end_weight_decay")]
    pub start_weight_decay: Option<f64>,
    /// Weight decay at the end of the increase (with `--start-weight-decay`).
    #[arg(long, requires = "start_weight_decay")]
    pub end_weight_decay: Option<f64>,
    /// Shape of the weight-decay increase (over `--steps`).
    #[arg(long, value_enum, default_value_t = WdStyle::Linear)]
    pub weight_decay_incr_style: WdStyle,
    /// Learning-rate warmup in steps (linear from `--lr-warmup-init` to `--lr`).
    #[arg(long, default_value_t = 0, value_name = "STEPS")]
    pub lr_warmup_iters: usize,
    /// Learning rate at the start of the warmup.
    #[arg(long, default_value_t = 0.0)]
    pub lr_warmup_init: f64,
    /// Learning-rate decay after the warmup (Megatron's `--lr-decay-style`).
    #[arg(long, value_enum, default_value_t = DecayStyle::Constant)]
    pub lr_decay_style: DecayStyle,
    /// Step at which the decay reaches `--min-lr` (default: `--steps`).
    #[arg(long, value_name = "STEPS")]
    pub lr_decay_iters: Option<usize>,
    /// Final learning rate of the decay.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// Length of WSD's final annealing phase (with `--lr-decay-style wsd`).
    #[arg(long, default_value_t = 0, value_name = "STEPS")]
    pub lr_wsd_decay_iters: usize,
    /// Shape of WSD's annealing phase.
    #[arg(long, value_enum, default_value_t = WsdStyle::Linear)]
    pub lr_wsd_decay_style: WsdStyle,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Gradient clipping by global norm (0 disables it).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
    /// Coefficient of the routers' load-balancing loss (0 disables it). Default: the model's
    /// config.json (`router_aux_loss_coef` of Qwen3-MoE, `aux_loss_alpha` of DeepSeek), else
    /// 1e-3.
    #[arg(long)]
    pub aux_loss_coeff: Option<f64>,
    /// Which load-balancing loss: Megatron's `aux_loss` (counts over a micro-batch of a
    /// replica), `seq_aux_loss` (per sequence) or `global_aux_loss` (over the global batch).
    /// Default: `seq-aux` when config.json says `seq_aux: true` (DeepSeek-V3 releases), else
    /// `aux`.
    #[arg(long, value_enum)]
    pub aux_loss_type: Option<AuxLoss>,
    /// Coefficient of the router z-loss (0 disables it).
    #[arg(long, default_value_t = 0.0)]
    pub z_loss_coeff: f64,
    /// Megatron's BF16 mixed precision: BF16 parameters, activations and gradients; f32 main
    /// weights, Adam moments and gradient accumulation; router, norm statistics, attention
    /// softmax and cross-entropy in f32 (docs/training-and-rl.md §Mixed precision (BF16)).
    /// The default on `--device cuda`; elsewhere f32 is.
    #[arg(long, conflicts_with_all = ["fp32", "fp16"])]
    pub bf16: bool,
    /// Megatron's FP16 mixed precision: the `--bf16` recipe with F16 parameters, activations
    /// and gradients, plus loss scaling (dynamic by default: `--initial-loss-scale`,
    /// `--min-loss-scale`, `--loss-scale-window`, `--hysteresis`; or `--loss-scale S`)
    /// (docs/training-and-rl.md §Mixed precision (FP16 and loss scaling)).
    #[arg(long, conflicts_with = "fp32")]
    pub fp16: bool,
    /// With `--fp16`: a constant loss scale (Megatron's `--loss-scale`); without it the scale
    /// is dynamic.
    #[arg(long, requires = "fp16", value_name = "S")]
    pub loss_scale: Option<f64>,
    /// With `--fp16`: the dynamic scaler's first scale (Megatron's `--initial-loss-scale`).
    #[arg(
        long,
        requires = "fp16",
        default_value_t = 4_294_967_296.0,
        value_name = "S"
    )]
    pub initial_loss_scale: f64,
    /// With `--fp16`: the dynamic scaler never backs off below this (`--min-loss-scale`).
    #[arg(long, requires = "fp16", default_value_t = 1.0, value_name = "S")]
    pub min_loss_scale: f64,
    /// With `--fp16`: finite steps before the dynamic scale doubles (`--loss-scale-window`).
    #[arg(long, requires = "fp16", default_value_t = 1000, value_name = "N")]
    pub loss_scale_window: u64,
    /// With `--fp16`: overflows tolerated before the dynamic scale halves (`--hysteresis`).
    #[arg(long, requires = "fp16", default_value_t = 2, value_name = "N")]
    pub hysteresis: u64,
    /// f32 parameters, activations and gradients (the default except on `--device cuda`).
    #[arg(long)]
    pub fp32: bool,
    /// With `--bf16`: accumulate the micro-batches' gradients and reduce them over the
    /// data-parallel groups in BF16 (Megatron's `--grad-reduce-in-bf16`) instead of f32.
    #[arg(long, requires = "bf16")]
    pub grad_reduce_in_bf16: bool,
    /// Weight of DeepSeek-V3's multi-token-prediction loss (Megatron's
    /// `mtp_loss_scaling_factor`, divided over the MTP depths; 0 leaves the MTP modules
    /// untrained).
    #[arg(long, default_value_t = 0.1)]
    pub mtp_loss_scaling_factor: f64,
    /// Aux-loss-free balancing rate of DeepSeek-V3's expert bias (Megatron's
    /// `moe_router_bias_update_rate`; 0 freezes the bias).
    #[arg(long, default_value_t = 1e-3)]
    pub expert_bias_update_rate: f64,
    /// Optimizer of the weight matrices.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Activation recompute (results are bit-identical; memory lower, steps slower):
    /// `none`; `memory-bound` (Burn's gradient checkpointing: the outputs of element-wise
    /// operations, activations and norms are recomputed in the backward pass); and/or
    /// Megatron's module-level selective recompute, a comma-separated list of `core_attn`
    /// (attention scores and probabilities), `moe_act` (routed experts' activation),
    /// `shared_experts`, `mlp` (dense MLPs), or `selective` (= `core_attn`); or `full` (every
    /// decoder layer keeps only its input and runs again in the backward pass). Example:
    /// `--recompute core_attn,moe_act`.
    #[arg(long, value_parser = parse_recompute, default_value = "none")]
    pub recompute: Recompute,
    /// Token dispatcher of the MoE layers.
    #[arg(long, value_enum, default_value_t = Dispatcher::AllToAll)]
    pub dispatcher: Dispatcher,
    /// Run each MoE layer's shared experts while its token dispatch is in flight (Megatron's
    /// `--moe-shared-expert-overlap`; forward pass, results bit-identical).
    #[arg(long)]
    pub moe_shared_expert_overlap: bool,
    /// How attention exchanges keys and values over the context-parallel group (Megatron's
    /// `--cp-comm-type`): `all_gather` or `p2p` (around the ring).
    #[arg(long, value_parser = parse_cp_comm_type, default_value = "all_gather")]
    pub cp_comm_type: CpCommType,
    /// Checkpoint root: the trainer (parameters, optimizer state, step) is saved there as
    /// `iter_*` directories with a `latest` pointer.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Save every K steps (0: only at the end).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub save_every: usize,
    /// Continue from the latest checkpoint under `--save` (saved under any layout).
    #[arg(long)]
    pub resume: bool,
    /// JSON-lines metrics: one object per step (`step`, `loss`, `aux_loss`, `mtp_loss`,
    /// `grad_norm`, `lr`, `tokens_per_s`, `skipped_steps`, and `eval_loss` / `eval_ppl` on
    /// evaluation steps), written by rank 0 (appended to with `--resume`).
    #[arg(long, value_name = "FILE")]
    pub metrics_out: Option<PathBuf>,
    /// Compute device of every rank: `cpu` (Flex), `vulkan` or `cuda` (the GPU backends need
    /// a binary built with the `vulkan` / `cuda` feature).
    #[arg(long, value_enum, default_value_t = crate::DeviceArg::Cpu)]
    pub device: crate::DeviceArg,
    /// How the ranks run.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    pub transport: Transport,
    /// Seconds a rank waits for the others in a collective before the job fails.
    #[arg(long, default_value_t = 300)]
    pub comm_timeout: u64,
    /// Train on even when a step's loss or gradient norm is NaN or infinite. By default
    /// (Megatron's `--check-for-nan-in-loss-and-grad`) such a step fails the job before the
    /// optimizer updates anything and before any save, naming the step, the rank and the value.
    #[arg(long)]
    pub no_check_for_nan_in_loss_and_grad: bool,
    /// Skip up to N non-finite steps (no update; counted as `skipped_steps` in the metrics)
    /// before failing.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub skip_nonfinite_steps: u64,
    /// Signals that make every rank finish its step, save a checkpoint (with `--save`) and exit
    /// 0, comma-separated (`none` disables; a second signal exits at once). Slurm sends
    /// SIGTERM before it kills a job.
    #[arg(long, default_value = "SIGTERM,SIGINT", value_name = "SIGNALS")]
    pub exit_signal: String,
    /// Finish the step, save and exit 0 once the job has run this many minutes.
    #[arg(long, value_name = "MINUTES")]
    pub exit_duration_in_mins: Option<f64>,
    /// Finish the step, save and exit 0 after a step that is a multiple of N.
    #[arg(long, value_name = "N")]
    pub exit_interval: Option<usize>,
    /// After each save, keep only the K newest checkpoints (and the one `latest` names);
    /// older `iter_*` directories are removed crash-safely.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_last: Option<u64>,
    /// Held-out data for a validation loss (and perplexity), in any `--data` format; logged
    /// with the training metrics (`eval_loss`, `eval_ppl`). Changes nothing of the training.
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate after every N steps (and after the last step).
    #[arg(long, default_value_t = 1000, value_name = "N", requires = "eval_data")]
    pub eval_interval: usize,
    /// Global batches (`--gbs` sequences each) per evaluation; the same batches every time.
    #[arg(long, default_value_t = 100, value_name = "K", requires = "eval_data")]
    pub eval_iters: usize,
    /// After the last step, stream the trained weights (HF names) to a rollout process
    /// listening at HOST:PORT, e.g. `moe receive-weights --listen HOST:PORT`, in the
    /// weight-sync wire format. Rank 0 connects; the sync is collective over the job's ranks.
    #[arg(long, value_name = "HOST:PORT")]
    pub sync_weights_to: Option<String>,
    /// The dtype the weights travel in with `--sync-weights-to`.
    #[arg(long, value_enum, default_value_t = SyncDtypeArg::Bf16, requires = "sync_weights_to")]
    pub sync_dtype: SyncDtypeArg,
    /// Largest bucket of `--sync-weights-to`, e.g. `512MiB` (the default), `100MB` or a byte
    /// count (a larger tensor travels in a bucket of its own).
    #[arg(
        long,
        value_name = "SIZE",
        default_value = "512MiB",
        value_parser = parse_size,
        requires = "sync_weights_to"
    )]
    pub sync_bucket_size: u64,
}

/// `--sync-dtype` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncDtypeArg {
    /// bfloat16, rounded to nearest-even (what inference engines load).
    Bf16,
    /// float32, bit for bit the training weights.
    F32,
}

/// `--aux-loss-type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuxLoss {
    /// Megatron's `aux_loss`.
    Aux,
    /// Megatron's `seq_aux_loss`.
    SeqAux,
    /// Megatron's `global_aux_loss` (counts over the data-parallel group, averaged over the
    /// step's micro-batches).
    GlobalAux,
}

/// `--bf16` / `--fp16` / `--fp32`, else BF16 on CUDA devices (Megatron's GPU recipe) and f32
/// elsewhere (the CPU, and Vulkan devices, which may lack BF16).
fn precision(args: &Args) -> Precision {
    if args.fp16 {
        return Precision::F16;
    }
    match (args.bf16, args.fp32, args.device) {
        (true, _, _) => Precision::Bf16,
        (false, true, _) => Precision::F32,
        (false, false, crate::DeviceArg::Cuda) => Precision::Bf16,
        (false, false, _) => Precision::F32,
    }
}

fn job(args: &Args) -> TrainJob {
    let defaults = TrainerConfig::default();
    let mut trainer = TrainerConfig {
        lr: args.lr,
        z_loss_coeff: args.z_loss_coeff,
        precision: precision(args),
        accumulate_allreduce_grads_in_fp32: !args.grad_reduce_in_bf16,
        grad_scaler: match args.loss_scale {
            Some(scale) => GradScalerConfig::Constant(scale),
            None => GradScalerConfig::Dynamic(DynamicScalerConfig {
                initial_scale: args.initial_loss_scale,
                min_scale: args.min_loss_scale,
                growth_interval: args.loss_scale_window,
                hysteresis: args.hysteresis,
                ..DynamicScalerConfig::default()
            }),
        },
        mtp_loss_scaling_factor: args.mtp_loss_scaling_factor,
        muon: (args.optimizer == OptimizerKind::Muon).then(MuonConfig::default),
        update_expert_bias: args.expert_bias_update_rate != 0.0,
        expert_bias_update_rate: Some(args.expert_bias_update_rate),
        dispatcher: match args.dispatcher {
            Dispatcher::AllToAll => DispatcherKind::AllToAll,
            Dispatcher::AllGather => DispatcherKind::AllGather,
            Dispatcher::Flex => DispatcherKind::Flex,
        },
        ..defaults
    };
    let decay_style = match args.lr_decay_style {
        DecayStyle::Constant => LrDecayStyle::Constant,
        DecayStyle::Linear => LrDecayStyle::Linear,
        DecayStyle::Cosine => LrDecayStyle::Cosine,
        DecayStyle::InverseSquareRoot => LrDecayStyle::InverseSquareRoot,
        DecayStyle::Wsd => LrDecayStyle::Wsd {
            decay_steps_wsd: args.lr_wsd_decay_iters,
            style: match args.lr_wsd_decay_style {
                WsdStyle::Linear => WsdDecay::Linear,
                WsdStyle::Cosine => WsdDecay::Cosine,
                WsdStyle::Exponential => WsdDecay::Exponential,
                WsdStyle::MinusSqrt => WsdDecay::MinusSqrt,
            },
        },
    };
    if args.lr_warmup_iters > 0 || decay_style != LrDecayStyle::Constant {
        trainer.lr_schedule = Some(LrSchedule {
            max_lr: args.lr,
            min_lr: args.min_lr,
            warmup_steps: args.lr_warmup_iters,
            warmup_init_lr: args.lr_warmup_init,
            decay_steps: args.lr_decay_iters.unwrap_or(args.steps),
            decay_style,
        });
    }
    trainer.optimizer.weight_decay = args.weight_decay as f32;
    if let (Some(start_wd), Some(end_wd)) = (args.start_weight_decay, args.end_weight_decay) {
        trainer.wd_schedule = Some(WdSchedule {
            start_wd,
            end_wd,
            wd_incr_steps: args.steps,
            wd_incr_style: match args.weight_decay_incr_style {
                WdStyle::Constant => WdIncrStyle::Constant,
                WdStyle::Linear => WdIncrStyle::Linear,
                WdStyle::Cosine => WdIncrStyle::Cosine,
            },
        });
    }
    trainer.recompute = args.recompute.modules.clone();
    trainer.moe_shared_expert_overlap = args.moe_shared_expert_overlap;
    trainer.cp_comm_type = args.cp_comm_type;
    trainer.optimizer.epsilon = args.adam_eps as f32;
    trainer.check_for_nan_in_loss_and_grad = !args.no_check_for_nan_in_loss_and_grad;
    trainer.skip_nonfinite_steps = args.skip_nonfinite_steps;
    trainer.optimizer.max_grad_norm = (args.clip_grad > 0.0).then_some(args.clip_grad);
    TrainJob {
        model: args.model.clone(),
        layout: match &args.pipeline_layout {
            Some(split) if args.layout.trim().is_empty() => format!("pp_layout={split}"),
            Some(split) => format!("{},pp_layout={split}", args.layout),
            None => args.layout.clone(),
        },
        steps: args.steps,
        gbs: args.gbs,
        mbs: args.mbs,
        seq_len: args.seq_len,
        data: args.data.clone(),
        tokenizer: args.tokenizer.clone(),
        data_path: args.data_path.clone(),
        seed: args.seed,
        sft: SftSettings {
            packing: match args.sft_packing {
                SftPackingArg::Packed => SftPacking::Packed,
                SftPackingArg::None => SftPacking::Padded,
            },
            truncation: match args.sft_truncation {
                SftTruncationArg::Truncate => Truncation::Truncate,
                SftTruncationArg::Refuse => Truncation::Refuse,
            },
            assistant_only_loss: !args.sft_train_on_prompts,
        },
        trainer,
        save: args.save.clone(),
        save_every: args.save_every,
        resume: args.resume,
        metrics_out: args.metrics_out.clone(),
        recompute: args.recompute.memory_bound,
        device: args.device.into(),
        aux_loss_coeff: args.aux_loss_coeff,
        aux_loss_type: args.aux_loss_type.map(|kind| match kind {
            AuxLoss::Aux => AuxLossType::Aux,
            AuxLoss::SeqAux => AuxLossType::SeqAux,
            AuxLoss::GlobalAux => AuxLossType::GlobalAux,
        }),
        keep_last: args.keep_last.map(|k| k as usize),
        exit: ExitPolicy {
            signal: None,
            duration: args
                .exit_duration_in_mins
                .map(|m| Duration::from_secs_f64((m * 60.0).max(0.0))),
            interval: args.exit_interval,
        },
        eval: args.eval_data.as_ref().map(|data| EvalJob {
            data: data.clone(),
            interval: args.eval_interval,
            iters: args.eval_iters,
        }),
        sync_weights_to: args.sync_weights_to.clone(),
        sync_dtype: match args.sync_dtype {
            SyncDtypeArg::Bf16 => SyncDtype::Bf16,
            SyncDtypeArg::F32 => SyncDtype::F32,
        },
        sync_bucket_bytes: usize::try_from(args.sync_bucket_size.max(1)).unwrap_or(usize::MAX),
    }
}

/// The signals of `--exit-signal` (none for `none`).
fn exit_signals(spec: &str) -> anyhow::Result<Vec<i32>> {
    if spec.trim().eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    spec.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| preempt::parse_signal(s).map_err(|e| anyhow::anyhow!("--exit-signal: {e}")))
        .collect()
}

fn print_summary(report: &TrainJobReport) {
    if let (Some(first), Some(last)) = (report.metrics.first(), report.metrics.last()) {
        println!(
            "trained steps {}..{} under {}: loss {:.4} -> {:.4}, {:.0} tokens/s",
            report.first_step + 1,
            last.step,
            report.layout,
            first.loss,
            last.loss,
            report.metrics.iter().map(|m| m.tokens_per_s).sum::<f64>()
                / report.metrics.len() as f64
        );
    }
    for dir in &report.saved {
        println!("saved {}", dir.display());
    }
    if let Some(reason) = &report.stopped {
        let step = report.metrics.last().map_or(report.first_step, |m| m.step);
        match report.saved.last() {
            Some(dir) => println!(
                "stopped after step {step}: {reason}; saved {}; continue with --resume",
                dir.display()
            ),
            None => println!("stopped after step {step}: {reason}; nothing saved (no --save)"),
        }
    }
}

/// Runs `moe train`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut job = job(&args);
    let signals = exit_signals(&args.exit_signal)?;
    if !signals.is_empty() {
        let handlers = preempt::ExitSignals::install(&signals)
            .context("installing the --exit-signal handlers")?;
        job.exit.signal = Some(handlers.flag());
    }
    // A device this binary or machine cannot provide (no feature, no driver, no device) fails
    // here, before any rank starts; too few GPUs for the ranks of this node in `run_job`.
    job.device.probe()?;
    let transport = match args.transport {
        Transport::Auto => launch::Transport::Auto,
        Transport::Threads => launch::Transport::Threads,
        Transport::Tcp => launch::Transport::Tcp,
        Transport::Mpi => launch::Transport::Mpi,
        Transport::Nccl => launch::Transport::Nccl,
    };
    // Threads: the layout's world (fixed by run_job); processes: the launcher's.
    let placement = Placement::decide_for(transport, 1, job.device)?;
    let reporter = placement.is_reporter();
    let metrics = match (&job.metrics_out, reporter) {
        (Some(path), true) => Some(MetricsWriter::open(path, job.resume)?),
        _ => None,
    };
    // TensorBoard: rank 0's writer, created at the run's first step (a resumed run's START
    // event there makes TensorBoard drop what the interrupted run logged past the checkpoint).
    let tensorboard: Option<std::sync::Mutex<Option<EventWriter>>> =
        (reporter && args.tensorboard_dir.is_some()).then(|| std::sync::Mutex::new(None));
    let bar = crate::progress::bar(job.steps as u64, "training");
    if !reporter {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let on_step = |m: &StepMetrics| {
        bar.set_position(m.step as u64);
        bar.set_message(format!("loss {:.4}", m.loss));
        tracing::info!(
            step = m.step,
            loss = m.loss,
            aux_loss = m.aux_loss,
            mtp_loss = m.mtp_loss,
            grad_norm = m.grad_norm,
            eval_loss = m.eval_loss,
            skipped = m.skipped,
            "step"
        );
        if let Some(w) = &metrics
            && let Err(e) = w.write(m)
        {
            tracing::error!("{e}");
        }
        if let (Some(tb), Some(dir)) = (&tensorboard, &args.tensorboard_dir) {
            let mut slot = tb.lock().unwrap_or_else(|p| p.into_inner());
            let step = m.step as i64;
            let scalars: Vec<(&str, f32)> = m
                .scalars()
                .into_iter()
                .map(|(t, v)| (t, v as f32))
                .collect();
            let mut write = || -> Result<(), burn_moe::bridge::BridgeError> {
                if slot.is_none() {
                    *slot = Some(EventWriter::create(dir, step)?);
                }
                if let Some(writer) = slot.as_mut() {
                    writer.add_scalars(step, &scalars)?;
                    writer.flush()?;
                }
                Ok(())
            };
            let written = write();
            if let Err(e) = written {
                tracing::error!("{e}");
            }
        }
    };
    let report = run_job(
        &job,
        &placement,
        Duration::from_secs(args.comm_timeout),
        &on_step,
    )
    .with_context(|| format!("training {} failed", job.model.display()))?;
    bar.finish_and_clear();
    if reporter {
        print_summary(&report);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `moe train` parsed from `args` (after the command name).
    fn parsed(args: &[&str]) -> Result<Args, clap::Error> {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            args: Args,
        }
        Wrap::try_parse_from(std::iter::once("moe-train").chain(args.iter().copied()))
            .map(|w| w.args)
    }

    /// BF16 is the default on CUDA devices and f32 elsewhere; `--bf16` / `--fp32` choose, and
    /// never both.
    #[test]
    fn precision_defaults_follow_the_device() {
        let p = |a: &[&str]| precision(&parsed(a).expect("parse"));
        let model = ["--model", "m"];
        assert_eq!(p(&model), Precision::F32);
        assert_eq!(
            p(&[&model[..], &["--device", "cuda"]].concat()),
            Precision::Bf16
        );
        assert_eq!(
            p(&[&model[..], &["--device", "vulkan"]].concat()),
            Precision::F32
        );
        let cuda_f32 = [&model[..], &["--device", "cuda", "--fp32"]].concat();
        assert_eq!(p(&cuda_f32), Precision::F32);
        assert_eq!(p(&[&model[..], &["--bf16"]].concat()), Precision::Bf16);
        let both = [&model[..], &["--bf16", "--fp32"]].concat();
        let err = parsed(&both).expect_err("refused").to_string();
        assert!(err.contains("--fp32") && err.contains("--bf16"), "{err}");
        // `--fp16` on any device; never with `--bf16` or `--fp32`.
        assert_eq!(p(&[&model[..], &["--fp16"]].concat()), Precision::F16);
        let cuda_f16 = [&model[..], &["--device", "cuda", "--fp16"]].concat();
        assert_eq!(p(&cuda_f16), Precision::F16);
        for other in ["--bf16", "--fp32"] {
            let both = [&model[..], &["--fp16", other]].concat();
            let err = parsed(&both).expect_err("refused").to_string();
            assert!(err.contains("--fp16") && err.contains(other), "{err}");
        }
        // The loss-scaling options belong to `--fp16`.
        let err = parsed(&[&model[..], &["--loss-scale", "1024"]].concat())
            .expect_err("refused")
            .to_string();
        assert!(err.contains("--fp16"), "{err}");
    }

    /// `--fp16` defaults to Megatron's dynamic scaler; `--loss-scale S` is constant.
    #[test]
    fn fp16_loss_scaler_settings() {
        let model = ["--model", "m", "--fp16"];
        let cfg = job(&parsed(&model).expect("parse")).trainer;
        assert_eq!(cfg.precision, Precision::F16);
        assert_eq!(
            cfg.grad_scaler,
            GradScalerConfig::Dynamic(DynamicScalerConfig::default())
        );
        let args = [
            &model[..],
            &["--hysteresis", "1", "--loss-scale-window", "10"],
        ]
        .concat();
        let GradScalerConfig::Dynamic(d) = job(&parsed(&args).expect("parse")).trainer.grad_scaler
        else {
            panic!("dynamic expected")
        };
        assert_eq!((d.hysteresis, d.growth_interval), (1, 10));
        let args = [&model[..], &["--loss-scale", "128"]].concat();
        let cfg = job(&parsed(&args).expect("parse")).trainer;
        assert_eq!(cfg.grad_scaler, GradScalerConfig::Constant(128.0));
    }
}
