//! `moe logprobs`: per-token next-token log-probabilities and entropies of a Qwen3-MoE or
//! DeepSeek-V3 checkpoint (FP8 releases are dequantised on load) over a batch of token ids (RL reference / old-policy scoring), under any
//! parallel layout: in-process ranks (threads) by default, or one process per rank when a
//! launcher (torchrun, mpirun, srun) started it. The sharded runs compute them vocab-parallel
//! (`moe_models::distributed::logprobs`); `--layout ""` runs the single-rank model.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use burn::tensor::{Device, Tensor};
use burn_moe::backend::BackendError;
use burn_moe::backend::comm::GroupComms;
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout};
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};
use burn_moe::launch::{Placement, Transport, run_spmd};
use burn_moe::models::distributed::{DispatcherKind, ParallelDeepseekV3, ParallelQwen3Moe};
use burn_moe::models::hf::AnyCausalLm;
use burn_moe::models::hf::WeightPrecision;
use burn_moe::models::rl::logprobs::{TokenLogProbs, deepseek_v3_logprobs, qwen3_moe_logprobs};
use burn_moe::models::{DeepseekV3ForCausalLM, ModelError, Qwen3MoeForCausalLM};

/// Name of the token-id tensor read from `--input`.
const INPUT_IDS: &str = "input_ids";

/// Arguments of `moe logprobs`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF Qwen3-MoE or DeepSeek-V3 checkpoint directory or hub-cache model id (FP8
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
    let tokens = batch / replicas * seq;
    if !tokens.is_multiple_of(layout.tp) {
        bail!(
            "a replica's {tokens} tokens ({} sequences of {seq}) do not split into tp = {} \
             sequence-parallel blocks under layout {layout}",
            batch / replicas,
            layout.tp
        );
    }
    Ok(())
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

fn host(t: Tensor<2>) -> anyhow::Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read the results back: {e:?}"))
}

fn model_error(e: burn_moe::models::ModelError) -> BackendError {
    BackendError::Shape {
        op: "model",
        detail: e.to_string(),
    }
}

/// A checkpoint `moe logprobs` scores.
enum Scored {
    Qwen3Moe(Qwen3MoeForCausalLM),
    DeepseekV3(DeepseekV3ForCausalLM),
}

impl Scored {
    fn vocab_size(&self) -> usize {
        match self {
            Self::Qwen3Moe(m) => m.config().vocab_size,
            Self::DeepseekV3(m) => m.config().vocab_size,
        }
    }

    /// Single-rank log-probs of `ids [batch, S]` (scored against themselves).
    fn logprobs(
        &self,
        ids: &[i64],
        batch: usize,
        device: &Device,
    ) -> Result<TokenLogProbs, ModelError> {
        match self {
            Self::Qwen3Moe(m) => qwen3_moe_logprobs(m, ids, ids, batch, device),
            Self::DeepseekV3(m) => deepseek_v3_logprobs(m, ids, ids, batch, device),
        }
    }

    /// This rank's shard's log-probs of its replica's `ids`: `(replica, replicas, result)`.
    fn sharded_logprobs(
        &self,
        groups: &GroupComms,
        ids: &[i64],
        [batch, seq]: [usize; 2],
        device: &Device,
    ) -> Result<(usize, TokenLogProbs), ModelError> {
        let kind = DispatcherKind::AllToAll;
        let mine = |replica: usize, replicas: usize| {
            let rows = batch / replicas;
            (rows, &ids[replica * rows * seq..(replica + 1) * rows * seq])
        };
        match self {
            Self::Qwen3Moe(m) => {
                let par = ParallelQwen3Moe::shard(m, groups, kind)?;
                let (rows, mine) = mine(par.replica, par.replicas);
                Ok((rows, par.forward_logprobs(mine, mine, rows, device)?))
            }
            Self::DeepseekV3(m) => {
                let par = ParallelDeepseekV3::shard(m, groups, kind)?;
                let (rows, mine) = mine(par.replica, par.replicas);
                Ok((rows, par.forward_logprobs(mine, mine, rows, device)?))
            }
        }
    }
}

/// Log-probs and entropies of the whole batch (row-major `[B, S-1]` each) on the ranks of
/// `placement`: every rank shards `full`, scores its replica's rows, and the replicas' rows
/// are all-gathered over `dp_cp` (in replica order).
fn sharded(
    full: &Scored,
    ids: &[i64],
    [batch, seq]: [usize; 2],
    layout: &ParallelLayout,
    placement: &Placement,
    timeout: Duration,
) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
    let device = Device::flex();
    run_spmd(placement, timeout, |ctx| {
        let groups = ctx.process_groups(layout)?;
        let (rows, out) = full
            .sharded_logprobs(&groups, ids, [batch, seq], &device)
            .map_err(model_error)?;
        let dp_cp = groups.comm(GroupFamily::DpCp);
        let n = rows * (seq - 1);
        let gather = |t: Tensor<2>| -> Result<Vec<f32>, BackendError> {
            let all = dp_cp.all_gather(t.reshape([n]))?;
            all.into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| BackendError::Config {
                    field: "logprobs",
                    detail: format!("cannot read the results back: {e:?}"),
                })
        };
        Ok((gather(out.logprobs)?, gather(out.entropy)?))
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
    let full = match crate::progress::load_model(&args.model, WeightPrecision::F32, &device)? {
        AnyCausalLm::Qwen3Moe(m) => Scored::Qwen3Moe(m),
        AnyCausalLm::DeepseekV3(m) => Scored::DeepseekV3(m),
        AnyCausalLm::Qwen3(_) => bail!(
            "{}: `moe logprobs` runs MoE checkpoints (Qwen3-MoE, DeepSeek-V3) only",
            args.model
        ),
    };
    let vocab = full.vocab_size();
    check_vocab(&ids, seq, vocab, &args.input)?;
    tracing::info!(batch, seq, layout = %layout, "log-probs");
    let (logprobs, entropy) = crate::progress::with_spinner("log-probs", || {
        if layout.world == 1 {
            let TokenLogProbs { logprobs, entropy } = full.logprobs(&ids, batch, &device)?;
            anyhow::Ok((host(logprobs)?, host(entropy)?))
        } else {
            let timeout = Duration::from_secs(args.comm_timeout);
            Ok(sharded(&full, &ids, shape, &layout, &placement, timeout)?)
        }
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
