//! `moe logprobs`: per-token next-token log-probabilities and entropies of a Qwen3-MoE,
//! DeepSeek-V3 or Qwen3 checkpoint (FP8 releases are dequantised on load) over a batch of token
//! ids (RL reference / old-policy scoring), under any parallel layout — tensor, sequence,
//! context, pipeline (1F1B or interleaved), expert and data parallelism: in-process ranks
//! (threads) by default, or one process per rank when a launcher (torchrun, mpirun, srun)
//! started it. Every layout runs the same sharded path
//! (`moe_models::distributed::logprob_pipeline::shard_logprobs`: vocab-parallel log-probs on the
//! last pipeline stage, whole rows gathered over context parallelism); `--layout ""` is one
//! rank.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use burn::tensor::{Device, Tensor};
use burn_moe::backend::BackendError;
use burn_moe::backend::comm::GroupComms;
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout};
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};
use burn_moe::launch::{Placement, Transport, run_spmd};
use burn_moe::models::ModelError;
use burn_moe::models::distributed::logprob_pipeline::shard_logprobs;
use burn_moe::models::distributed::{DispatcherKind, ParallelCausalLm};
use burn_moe::models::family::Family;
use burn_moe::models::hf::WeightPrecision;
use burn_moe::models::hf::{AnyCausalLm, ModelVisitor};
use burn_moe::models::train::TrainBatch;

/// Name of the token-id tensor read from `--input`.
const INPUT_IDS: &str = "input_ids";

/// Arguments of `moe logprobs`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF Qwen3-MoE, DeepSeek-V3 or Qwen3 checkpoint directory or hub-cache model id (FP8
    /// DeepSeek-V3 releases are dequantised to f32 on load).
    #[arg(long, value_name = "DIR")]
    pub model: String,
    /// Safetensors file holding integer (I64 or I32) `input_ids` of shape [batch, seq],
    /// seq ≥ 2.
    #[arg(long, value_name = "IDS.safetensors")]
    pub input: PathBuf,
    /// Output safetensors file: F32 `logprobs` [batch, seq-1] (log p(ids[b, t+1] | ids[b, ..=t]))
    /// and F32 `entropy` [batch, seq-1] (of the same next-token distributions).
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// Parallel layout, e.g. `tp=2,ep=4` or `world=4,tp=2,ep=2,etp=2` (omitted sizes are 1;
    /// the world is derived, or set by the launcher's process count). The batch is split
    /// over the data-parallel replicas, so it must divide by their number. Empty: one rank.
    #[arg(long, default_value = "")]
    pub layout: String,
    /// Sequences per micro-batch of a data-parallel replica (Megatron's
    /// `--micro-batch-size`; under pipeline parallelism the micro-batches fill the pipeline).
    /// Default: a replica's whole share of the batch in one micro-batch (with `vpp > 1`, the
    /// largest size giving the interleaved schedule a multiple of `pp` micro-batches).
    #[arg(long, value_name = "N")]
    pub micro_batch_size: Option<usize>,
    /// Seconds a rank waits for the others in a collective before the job fails.
    #[arg(long, default_value_t = 300)]
    pub comm_timeout: u64,
}

/// Reads integer `input_ids` `[B, S]` (I64 or I32) from `path`, checking `B ≥ 1`, `S ≥ 2`.
fn read_input_ids(path: &Path) -> anyhow::Result<(Vec<i64>, [usize; 2])> {
    let file = SafetensorsFile::open(path)?;
    let view = file.tensor(INPUT_IDS).with_context(|| {
        format!(
            "{}: no `{INPUT_IDS}` tensor (expected integer token ids [batch, seq])",
            path.display()
        )
    })?;
    let &[batch, seq] = view.shape else {
        bail!(
            "{}: `{INPUT_IDS}` has shape {:?}, expected [batch, seq]",
            path.display(),
            view.shape
        );
    };
    if !matches!(view.dtype, Dtype::I64 | Dtype::I32) {
        bail!(
            "{}: `{INPUT_IDS}` is {:?}; token ids must be I64 or I32",
            path.display(),
            view.dtype
        );
    }
    if batch == 0 || seq < 2 {
        bail!(
            "{}: `{INPUT_IDS}` has shape [{batch}, {seq}]; log-probs of the next token need at \
             least one sequence of at least 2 tokens",
            path.display()
        );
    }
    let ids = view
        .to_tensor_data()?
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|e| anyhow::anyhow!("{}: `{INPUT_IDS}`: {e:?}", path.display()))?;
    Ok((ids, [batch, seq]))
}

/// The layout of `spec` for the ranks `placement` runs (threads: the spec's world; processes:
/// the launcher's).
fn layout_for(spec: &str, placement: &Placement) -> anyhow::Result<ParallelLayout> {
    let layout = match placement {
        Placement::Threads { .. } => ParallelLayout::parse_spec(spec),
        Placement::Process { .. } => {
            let world = placement.world().unwrap_or(1);
            ParallelLayout::parse(world, spec)
        }
    };
    layout.with_context(|| format!("bad --layout `{spec}`"))
}

/// Checks that a `[batch, seq]` batch splits over the replicas of `layout` and the sequence-
/// parallel blocks of their TP groups.
fn check_split(layout: &ParallelLayout, [batch, seq]: [usize; 2]) -> anyhow::Result<()> {
    let replicas = layout.dp;
    if !batch.is_multiple_of(replicas) {
        bail!(
            "the batch of {batch} sequences does not split over the {replicas} data-parallel \
             replicas of layout {layout}; use a batch divisible by {replicas} or another layout"
        );
    }
    let cp = layout.cp;
    if cp > 1 && !seq.is_multiple_of(2 * cp) {
        bail!(
            "context parallelism cuts every sequence into 2·cp = {} chunks; the sequence length \
             {seq} is not divisible by it (layout {layout})",
            2 * cp
        );
    }
    let tokens = batch / replicas * seq / cp;
    if !tokens.is_multiple_of(layout.tp) {
        bail!(
            "a rank's {tokens} tokens ({} sequences of {seq} over cp = {cp}) do not split into \
             tp = {} sequence-parallel blocks under layout {layout}",
            batch / replicas,
            layout.tp
        );
    }
    Ok(())
}

/// The default micro-batch size of a replica's `rows`: all of them in one micro-batch, except
/// under the interleaved schedule (`vpp > 1`), which needs a multiple of `pp` micro-batches:
/// then the largest size giving one.
fn default_micro_batch_size(rows: usize, layout: &ParallelLayout) -> anyhow::Result<usize> {
    if layout.vpp <= 1 {
        return Ok(rows);
    }
    (1..=rows)
        .rev()
        .find(|&mbs| rows.is_multiple_of(mbs) && (rows / mbs).is_multiple_of(layout.pp))
        .with_context(|| {
            format!(
                "the interleaved pipeline schedule (vpp = {}) needs a multiple of pp = {} \
                 micro-batches per replica; a replica's {rows} sequences cannot make one \
                 (use a batch with a multiple of {} sequences per replica)",
                layout.vpp, layout.pp, layout.pp
            )
        })
}

/// Checks every id is in `0..vocab`, naming the first bad one.
fn check_vocab(ids: &[i64], seq: usize, vocab: usize, path: &Path) -> anyhow::Result<()> {
    if let Some(at) = ids.iter().position(|&t| t < 0 || t as u64 >= vocab as u64) {
        bail!(
            "{}: `{INPUT_IDS}` row {} column {} holds {}, outside the vocabulary 0..{vocab}",
            path.display(),
            at / seq,
            at % seq,
            ids[at]
        );
    }
    Ok(())
}

fn model_error(e: burn_moe::models::ModelError) -> BackendError {
    BackendError::Shape {
        op: "model",
        detail: e.to_string(),
    }
}

/// This rank's part of the log-probs of `ids [batch, S]` under the layout of `groups`: the
/// rows of its data-parallel replica, in micro-batches of `mbs` rows through the model's
/// shard (every layout, pipeline and context parallelism included:
/// [`shard_logprobs`]); `(replica, [rows, S − 1] log-probs, entropies)`.
fn score<M: ParallelCausalLm>(
    full: &M,
    groups: &GroupComms,
    ids: &[i64],
    [batch, seq]: [usize; 2],
    mbs: usize,
    device: &Device,
) -> Result<(usize, Tensor<2>, Tensor<2>), ModelError> {
    let shard = full.shard(groups, DispatcherKind::AllToAll)?;
    let dp = groups.comm(GroupFamily::Dp);
    let (replica, rows) = (dp.rank(), batch / dp.size());
    let mine = &ids[replica * rows * seq..(replica + 1) * rows * seq];
    let micro = mine
        .chunks(mbs * seq)
        .map(|c| TrainBatch::causal(c.to_vec(), c.len() / seq))
        .collect::<Result<Vec<_>, _>>()?;
    let out = shard_logprobs(&shard, &micro, groups, device)?;
    let (lp, h): (Vec<_>, Vec<_>) = out.into_iter().map(|o| (o.logprobs, o.entropy)).unzip();
    Ok((replica, Tensor::cat(lp, 0), Tensor::cat(h, 0)))
}

/// Log-probs and entropies of the whole batch (row-major `[B, S-1]` each) on the ranks of
/// `placement`: every rank shards `full`, scores its replica's rows, and the replicas' rows
/// are all-gathered over the data-parallel group (in replica order).
fn sharded(
    full: &AnyCausalLm,
    ids: &[i64],
    [batch, seq]: [usize; 2],
    mbs: usize,
    layout: &ParallelLayout,
    placement: &Placement,
    timeout: Duration,
) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
    let device = Device::flex();
    run_spmd(placement, timeout, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let shape = [batch, seq];
        struct Score<'a>(&'a GroupComms, &'a [i64], [usize; 2], usize, &'a Device);
        impl ModelVisitor for Score<'_> {
            type Output = Result<(usize, Tensor<2>, Tensor<2>), ModelError>;
            fn visit<F: Family>(self, model: &F::Model) -> Self::Output {
                score(model, self.0, self.1, self.2, self.3, self.4)
            }
        }
        let visited = full.visit(Score(&groups, ids, shape, mbs, &device));
        let (_, lp, h) = visited.and_then(|r| r).map_err(model_error)?;
        let dp = groups.comm(GroupFamily::Dp);
        let n = batch / dp.size() * (seq - 1);
        let gather = |t: Tensor<2>| -> Result<Vec<f32>, BackendError> {
            let all = dp.all_gather(t.reshape([n]))?;
            all.into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| BackendError::Config {
                    field: "logprobs",
                    detail: format!("cannot read the results back: {e:?}"),
                })
        };
        Ok((gather(lp)?, gather(h)?))
    })
}

/// Runs `moe logprobs`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (ids, shape) = read_input_ids(&args.input)?;
    let [batch, seq] = shape;
    let placement = Placement::decide(Transport::Auto, 1)?;
    let layout = layout_for(&args.layout, &placement)?;
    check_split(&layout, shape)?;
    let placement = match placement {
        Placement::Threads { .. } => Placement::Threads {
            world: layout.world,
        },
        other => other,
    };
    let device = Device::flex();
    let full = crate::progress::load_model(&args.model, WeightPrecision::F32, &device)?;
    let vocab = full.config().vocab_size();
    check_vocab(&ids, seq, vocab, &args.input)?;
    let rows = batch / layout.dp;
    let mbs = match args.micro_batch_size {
        Some(mbs) => mbs,
        None => default_micro_batch_size(rows, &layout)?,
    };
    if mbs == 0 || !rows.is_multiple_of(mbs) {
        bail!(
            "--micro-batch-size {mbs} does not divide a replica's {rows} sequences (batch \
             {batch} over {} data-parallel replicas)",
            layout.dp
        );
    }
    tracing::info!(batch, seq, micro_batch_size = mbs, layout = %layout, "log-probs");
    let timeout = Duration::from_secs(args.comm_timeout);
    let (logprobs, entropy) = crate::progress::with_spinner("log-probs", || {
        sharded(&full, &ids, shape, mbs, &layout, &placement, timeout)
    })
    .with_context(|| format!("log-probs of {} under layout {layout}", args.model))?;
    if !placement.is_reporter() {
        return Ok(());
    }
    let dims = vec![batch, seq - 1];
    let tensors = [
        OwnedTensor::from_f32("logprobs", dims.clone(), &logprobs)?,
        OwnedTensor::from_f32("entropy", dims, &entropy)?,
    ];
    let views: Vec<_> = tensors.iter().map(OwnedTensor::view).collect();
    write_safetensors(&args.out, &views)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
