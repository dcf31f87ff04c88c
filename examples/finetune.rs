//! Fine-tunes the tiny Qwen3-MoE shipped in `tests/fixtures/qwen3_moe` on 4 in-process ranks
//! (attention TP2 × DP2 with sequence parallelism, experts EP4) on a built-in arithmetic-sequence
//! corpus, printing the loss as it falls.
//!
//! Run: `cargo run --release --example finetune` (optionally `-- <steps> <layout>`). The same
//! binary runs one process per rank when a launcher starts it:
//! `torchrun --nproc-per-node 4 --no-python target/release/examples/finetune 40 tp=2,ep=4`
//! (TCP), or `mpirun -np 4 …` in a build with `--features mpi`.

use burn_moe::finetune::{FinetuneOptions, finetune_on};
use burn_moe::launch::{Placement, Transport};

/// Reuse the large buffers every training step frees (see `moe_backend::alloc`).
#[global_allocator]
static ALLOC: burn_moe::backend::alloc::LargeBlockCache =
    burn_moe::backend::alloc::LargeBlockCache::new(16 << 20, 4 << 30);

fn main() -> anyhow::Result<()> {
    burn_moe::init_logging();
    let mut options = FinetuneOptions::default();
    let mut args = std::env::args().skip(1);
    if let Some(steps) = args.next() {
        options.steps = steps.parse()?;
    }
    if let Some(layout) = args.next() {
        options.layout = layout;
    }
    let placement = Placement::decide(Transport::Auto, 0)?;
    let reporter = placement.is_reporter();
    let report = finetune_on(&placement, &options, &|step, report| {
        let i = report.losses.len() - 1;
        tracing::info!(
            step,
            loss = format!("{:.4}", report.losses[i]),
            aux = format!("{:.4}", report.aux_losses[i]),
            grad_norm = format!("{:.3}", report.grad_norms[i]),
            "train"
        );
    })?;
    if !reporter {
        return Ok(());
    }
    let first = report.losses.first().copied().unwrap_or(f32::NAN);
    let last = report.losses.last().copied().unwrap_or(f32::NAN);
    println!(
        "{}: loss {first:.4} -> {last:.4} over {} steps, {:.0} target tokens/s",
        report.layout,
        report.losses.len(),
        report.tokens_per_second
    );
    Ok(())
}
