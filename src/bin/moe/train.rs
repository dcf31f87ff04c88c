//! `moe train`: fine-tune a Qwen3-MoE checkpoint under a parallel layout, on in-process ranks
//! (threads, the default) or as one process per rank when started by an MPI launcher
//! (`mpirun -np 4 moe train …`, `srun moe train …`; build with `--features mpi`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use burn_moe::backend::comm::launch::Launch;
use burn_moe::models::distributed::DispatcherKind;
use burn_moe::models::train::TrainerConfig;
use burn_moe::train_job::{MetricsWriter, StepMetrics, TrainJob, TrainJobReport, run_threads};

/// How the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// Processes when a launcher started this one (mpirun / srun), else threads.
    Auto,
    /// All ranks as threads of this process.
    Threads,
    /// One process per rank over MPI (needs a build with `--features mpi`).
    Mpi,
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

/// Arguments of `moe train`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF Qwen3-MoE directory or distributed checkpoint (root or `iter_*` directory).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Parallel layout, e.g. `tp=2,ep=4` or `world=8,tp=2,ep=4,etp=2` (omitted sizes are 1;
    /// the world is derived, or set by the launcher's process count).
    #[arg(long, default_value = "")]
    pub layout: String,
    /// Train until this many optimizer steps have been taken (a resumed run continues to it).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Sequences per step over all data-parallel replicas.
    #[arg(long, default_value_t = 8)]
    pub gbs: usize,
    /// Tokens per sequence of the built-in corpus (a `--data` file sets its own).
    #[arg(long, default_value_t = 16)]
    pub seq_len: usize,
    /// Token ids: a safetensors file with integer `input_ids` [N, S]; without it, a built-in
    /// corpus of arithmetic sequences is used.
    #[arg(long, value_name = "IDS.safetensors")]
    pub data: Option<PathBuf>,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Gradient clipping by global norm (0 disables it).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
    /// Coefficient of the load-balancing loss (0 disables it).
    #[arg(long, default_value_t = 1e-3)]
    pub aux_loss_coeff: f64,
    /// Token dispatcher of the MoE layers.
    #[arg(long, value_enum, default_value_t = Dispatcher::AllToAll)]
    pub dispatcher: Dispatcher,
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
    /// JSON-lines metrics: one object per step (`step`, `loss`, `aux_loss`, `grad_norm`, `lr`,
    /// `tokens_per_s`), written by rank 0 (appended to with `--resume`).
    #[arg(long, value_name = "FILE")]
    pub metrics_out: Option<PathBuf>,
    /// How the ranks run.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    pub transport: Transport,
    /// Seconds a rank waits for the others in a collective before the job fails.
    #[arg(long, default_value_t = 300)]
    pub comm_timeout: u64,
}

fn job(args: &Args) -> TrainJob {
    let defaults = TrainerConfig::default();
    let mut trainer = TrainerConfig {
        lr: args.lr,
        aux_loss_coeff: args.aux_loss_coeff,
        dispatcher: match args.dispatcher {
            Dispatcher::AllToAll => DispatcherKind::AllToAll,
            Dispatcher::AllGather => DispatcherKind::AllGather,
            Dispatcher::Flex => DispatcherKind::Flex,
        },
        ..defaults
    };
    trainer.optimizer.weight_decay = args.weight_decay as f32;
    trainer.optimizer.epsilon = args.adam_eps as f32;
    trainer.optimizer.max_grad_norm = (args.clip_grad > 0.0).then_some(args.clip_grad);
    TrainJob {
        model: args.model.clone(),
        layout: args.layout.clone(),
        steps: args.steps,
        gbs: args.gbs,
        seq_len: args.seq_len,
        data: args.data.clone(),
        trainer,
        save: args.save.clone(),
        save_every: args.save_every,
        resume: args.resume,
        metrics_out: args.metrics_out.clone(),
    }
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
}

/// Runs `moe train`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let job = job(&args);
    let launch = Launch::from_env()?;
    let processes = match args.transport {
        Transport::Threads => false,
        Transport::Mpi => true,
        Transport::Auto => launch.as_ref().is_some_and(|l| l.world_size > 1),
    };
    if processes {
        return run_processes(&args, &job);
    }
    let metrics = match &job.metrics_out {
        Some(path) => Some(MetricsWriter::open(path, job.resume)?),
        None => None,
    };
    let bar = crate::progress::bar(job.steps as u64, "training");
    let on_step = |m: &StepMetrics| {
        bar.set_position(m.step as u64);
        bar.set_message(format!("loss {:.4}", m.loss));
        tracing::info!(
            step = m.step,
            loss = m.loss,
            aux_loss = m.aux_loss,
            grad_norm = m.grad_norm,
            "step"
        );
        if let Some(w) = &metrics
            && let Err(e) = w.write(m)
        {
            tracing::error!("{e}");
        }
    };
    let report = run_threads(&job, &on_step)
        .with_context(|| format!("training {} failed", job.model.display()))?;
    bar.finish_and_clear();
    print_summary(&report);
    Ok(())
}

#[cfg(feature = "mpi")]
fn run_processes(args: &Args, job: &TrainJob) -> anyhow::Result<()> {
    use burn_moe::backend::comm::mpi::{MpiConfig, MpiWorld};
    let world = MpiWorld::init(MpiConfig {
        timeout: Duration::from_secs(args.comm_timeout),
    })?;
    let metrics = match (&job.metrics_out, world.rank()) {
        (Some(path), 0) => Some(MetricsWriter::open(path, job.resume)?),
        _ => None,
    };
    let on_step = |m: &StepMetrics| {
        tracing::info!(
            step = m.step,
            loss = m.loss,
            aux_loss = m.aux_loss,
            grad_norm = m.grad_norm,
            "step"
        );
        if let Some(w) = &metrics
            && let Err(e) = w.write(m)
        {
            tracing::error!("{e}");
        }
    };
    let report = world.run(|ctx| {
        burn_moe::train_job::run_rank(ctx, job, &on_step).map_err(|e| {
            burn_moe::backend::BackendError::Config {
                field: "train",
                detail: e.to_string(),
            }
        })
    })?;
    if world.rank() == 0 {
        print_summary(&report);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_processes(_args: &Args, _job: &TrainJob) -> anyhow::Result<()> {
    let _ = Duration::ZERO;
    anyhow::bail!(
        "this process was started by a multi-process launcher (or --transport mpi was given), \
         but `moe` was built without MPI: rebuild with `cargo build --release --features mpi` \
         (needs OpenMPI and libclang), or run the ranks as threads with --transport threads"
    )
}
