//! `moe receive-weights`: the rollout side of a weight sync in another process. Loads the model
//! of `--model` (its config.json and weights: the skeleton the sync updates), listens on
//! `--listen HOST:PORT`, accepts one connection, reads one sync in the weight-sync wire format
//! (`moe_models::weight_sync::wire`, what `moe train --sync-weights-to` sends) into the model,
//! checking every tensor's name and shape against it, answers with the format's
//! acknowledgement (loaded, or refused with the reason), then continues the prompt exactly as
//! `moe generate` does with the same flags.

use std::io::BufReader;
use std::net::TcpListener;
use std::time::Duration;

use anyhow::Context;
use burn::tensor::Device;
use burn_moe::models::family::Family;
use burn_moe::models::hf::{ModelVisitorMut, WeightPrecision};
use burn_moe::models::weight_sync::wire::WireStats;
use burn_moe::models::weight_sync::{ModelReceiver, WeightSyncError, receive_wire, write_ack};

/// Arguments of `moe receive-weights`.
#[derive(Debug, clap::Args)]
#[group(id = "receive_weights")]
pub struct Args {
    /// Address to listen on for the sync, `HOST:PORT` (port 0: any free port; the address is
    /// printed to stderr as `listening on HOST:PORT`).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: String,
    /// The prompt and generation settings, as `moe generate` takes them (`--model` is the
    /// model the sync updates).
    #[command(flatten)]
    pub generate: crate::generate::Args,
}

/// Runs `moe receive-weights`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let device = Device::flex();
    let model_name = args.generate.model.clone();
    let mut model = crate::progress::load_model(&model_name, WeightPrecision::F32, &device)?;
    let listener = TcpListener::bind(&args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let local = listener
        .local_addr()
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    eprintln!("listening on {local}");
    let (stream, peer) = listener
        .accept()
        .with_context(|| format!("accepting a connection on {local}"))?;
    tracing::info!(%peer, "receiving a weight sync");
    let result = {
        let reader = BufReader::with_capacity(1 << 20, &stream);
        struct Receive<'a, R>(R, &'a Device);
        impl<R: std::io::Read> ModelVisitorMut for Receive<'_, R> {
            type Output = Result<WireStats, WeightSyncError>;
            fn visit<F: Family>(self, model: &mut F::Model) -> Self::Output {
                receive_wire(self.0, &mut ModelReceiver::new(model, self.1))
            }
        }
        model
            .visit_mut(Receive(reader, &device))
            .map_err(WeightSyncError::from)
            .and_then(|r| r)
    };
    // The acknowledgement; after a refusal, read the rest of the stream until the sender
    // closes (or a minute passes) so that its writes do not fail before it reads the reason.
    if let Err(e) = write_ack(&stream, result.as_ref()) {
        tracing::warn!(%peer, "cannot acknowledge the sync: {e}");
    } else if result.is_err() {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        let _ = std::io::copy(&mut &stream, &mut std::io::sink());
    }
    let stats =
        result.with_context(|| format!("receiving weights from {peer} into {model_name}"))?;
    tracing::info!(
        tensors = stats.tensors,
        buckets = stats.buckets,
        bytes = stats.stream_bytes,
        seconds = stats.seconds,
        "received the weights"
    );
    crate::generate::run_with(args.generate, Some(model))
}
