//! `moe logits`: one forward pass over a batch of token ids, written to safetensors.

use std::path::PathBuf;

use anyhow::{Context, bail};
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};
use burn_moe::device::DeviceChoice;
use burn_moe::models::CausalLm;
use burn_moe::models::causal_lm::token_ids;
use burn_moe::models::hf::WeightPrecision;

/// Name of the token-id tensor read from `--input`.
pub const INPUT_IDS: &str = "input_ids";

/// Arguments of `moe logits`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// HF checkpoint directory or hub-cache model id.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// Safetensors file holding I64 `input_ids` of shape [batch, seq].
    #[arg(long, value_name = "IDS.safetensors")]
    pub input: PathBuf,
    /// Output safetensors file: F32 `logits` [batch, seq, vocab] (and `loss`, `aux_loss`).
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// Also compute the losses HF reports with labels = input_ids: F32 `loss` `[1]` (cross
    /// entropy, plus router_aux_loss_coef · aux for Qwen3-MoE) and `aux_loss` `[1]` (HF's
    /// load-balancing loss; 0 for models without one).
    #[arg(long)]
    pub labels: bool,
    /// Weight precision: `f32` keeps the stored values (the default, used for parity);
    /// `bf16` rounds every weight to bf16 first. Arithmetic is f32 either way.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Compute device: `cpu` (Flex), `vulkan` or `cuda` (the GPU backends need a binary built
    /// with the `vulkan` / `cuda` feature).
    #[arg(long, value_enum, default_value_t = crate::DeviceArg::Cpu)]
    pub device: crate::DeviceArg,
}

/// `--dtype` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// Weights as stored (widened to f32).
    F32,
    /// Weights rounded to bf16.
    Bf16,
}

impl From<Precision> for WeightPrecision {
    fn from(p: Precision) -> Self {
        match p {
            Precision::F32 => WeightPrecision::F32,
            Precision::Bf16 => WeightPrecision::Bf16,
        }
    }
}

/// Reads I64 `input_ids` `[B, S]` from `path`.
fn read_input_ids(path: &PathBuf) -> anyhow::Result<(Vec<i64>, [usize; 2])> {
    let file = SafetensorsFile::open(path)?;
    let view = file.tensor(INPUT_IDS)?;
    view.expect_dtype(Dtype::I64)?;
    let &[batch, seq] = view.shape else {
        bail!(
            "{}: `{INPUT_IDS}` has shape {:?}, expected [batch, seq]",
            path.display(),
            view.shape
        );
    };
    let ids = view
        .to_tensor_data()?
        .try_into_vec::<i64>()
        .map_err(|e| anyhow::anyhow!("{}: `{INPUT_IDS}`: {e:?}", path.display()))?;
    Ok((ids, [batch, seq]))
}

/// Runs `moe logits`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let device = DeviceChoice::from(args.device).device()?;
    let (ids, shape) = read_input_ids(&args.input)?;
    let model = crate::progress::load_model(&args.model, args.dtype.into(), &device)?;
    let input = token_ids(&ids, shape, model.vocab_size(), &device)
        .with_context(|| format!("{}: `{INPUT_IDS}`", args.input.display()))?;
    tracing::info!(batch = shape[0], seq = shape[1], "forward");
    let (logits, losses) = crate::progress::with_spinner("forward", || {
        if args.labels {
            model
                .losses(input, &ids)
                .map(|(l, losses)| (l, Some(losses)))
        } else {
            model.logits(input).map(|l| (l, None))
        }
    })?;
    let dims = logits.dims().to_vec();
    let values = logits
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read the logits back: {e:?}"))?;
    let mut tensors = vec![OwnedTensor::from_f32("logits", dims, &values)?];
    if let Some(losses) = losses {
        let loss = losses.loss.into_scalar::<f32>();
        let aux = losses.aux_loss.map_or(0.0, |a| a.into_scalar::<f32>());
        tracing::info!(loss, aux_loss = aux, "losses");
        tensors.push(OwnedTensor::from_f32("loss", vec![1], &[loss])?);
        tensors.push(OwnedTensor::from_f32("aux_loss", vec![1], &[aux])?);
    }
    let views: Vec<_> = tensors.iter().map(OwnedTensor::view).collect();
    write_safetensors(&args.out, &views)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
