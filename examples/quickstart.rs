//! The main job, end to end on the CPU, from the tiny HF Qwen3-MoE in `tests/fixtures/qwen3_moe`:
//!
//! 1. convert it to a distributed checkpoint for 4 ranks (attention TP2 × DP2, experts EP4);
//! 2. fine-tune a few dozen steps on 4 in-process ranks, each restoring its own shard;
//! 3. save parameters + ZeRO-1 optimizer state + training state (atomic, one file per rank);
//! 4. reshard the checkpoint to EP2 × ETP2;
//! 5. export it to an HF directory;
//! 6. reload the export and check it reproduces the trained model's logits.
//!
//! Run: `cargo run --release --example quickstart` (optionally `-- <out-dir> <steps>`; the
//! default output directory is `target/quickstart`).

use std::time::Instant;

use burn_moe::quickstart::{QuickstartEvent, QuickstartOptions, quickstart};

/// Reuse the large buffers every training step frees (see `moe_backend::alloc`).
#[global_allocator]
static ALLOC: burn_moe::backend::alloc::LargeBlockCache =
    burn_moe::backend::alloc::LargeBlockCache::new(16 << 20, 4 << 30);

fn main() -> anyhow::Result<()> {
    burn_moe::init_logging();
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/target/quickstart").into());
    let mut options = QuickstartOptions::new(out);
    if let Some(steps) = args.next() {
        options.train.steps = steps.parse()?;
    }
    let start = Instant::now();
    println!(
        "quickstart: {} -> {}",
        options.train.model_dir.display(),
        options.out_dir.display()
    );
    let report = quickstart(&options, &|event| match event {
        QuickstartEvent::Converting(_) => {}
        QuickstartEvent::Converted(dir) => {
            println!(
                "[1/6] converted HF -> distributed ({}): {}",
                options.train.layout,
                dir.display()
            );
        }
        QuickstartEvent::Step(step, r) => {
            let i = r.losses.len() - 1;
            if step == 0 || (step + 1) % 5 == 0 || step + 1 == options.train.steps {
                println!(
                    "[2/6] step {:>3}/{}  loss {:.4}  aux {:.4}  |g| {:.3}",
                    step + 1,
                    options.train.steps,
                    r.losses[i],
                    r.aux_losses[i],
                    r.grad_norms[i]
                );
            }
        }
        QuickstartEvent::Saved(dir) => {
            println!("[3/6] saved model + optimizer state: {}", dir.display());
        }
        QuickstartEvent::Resharded(dir) => {
            println!(
                "[4/6] resharded to {}: {}",
                options.export_layout,
                dir.display()
            );
        }
        QuickstartEvent::Exported(s) => println!(
            "[5/6] exported {} HF tensors ({} bytes) to {}",
            s.tensors,
            s.total_size,
            s.target.display()
        ),
    })?;
    let first = report.train.losses.first().copied().unwrap_or(f32::NAN);
    let last = report.train.losses.last().copied().unwrap_or(f32::NAN);
    println!(
        "[6/6] the export reloads with the trained logits: max |Δ| = {:.2e} (tolerance {:.0e})",
        report.max_abs_diff, options.tolerance
    );
    let [convert, train, reshard, export, check] = report.seconds;
    println!(
        "done in {:.1}s: loss {first:.4} -> {last:.4} over {} steps; convert {convert:.1}s, \
         train+save {train:.1}s, reshard {reshard:.1}s, export {export:.1}s, check {check:.1}s",
        start.elapsed().as_secs_f64(),
        report.train.losses.len()
    );
    Ok(())
}
