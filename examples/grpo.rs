//! GRPO on the tiny Qwen3-MoE of `tests/fixtures/qwen3_moe`: the model learns to copy the
//! first digit of its prompt from a rule-based reward, on 4 in-process ranks with the experts
//! sharded over them (EP4). Each step: weight sync → rollouts → rewards → group-normalised
//! advantages → PPO-clipped policy update (see `burn_moe::grpo`).
//!
//! Run: `cargo run --release --example grpo` (optionally `-- <steps> <layout> <lr> <entropy coefficient>`). Under a
//! launcher (`torchrun --nproc-per-node 4 --no-python target/release/examples/grpo`, or
//! `mpirun` in a build with `--features mpi`) the ranks are processes.

use burn_moe::grpo::{GrpoOptions, grpo_on};
use burn_moe::launch::{Placement, Transport};

fn main() -> anyhow::Result<()> {
    burn_moe::init_logging();
    let mut options = GrpoOptions::default();
    let mut args = std::env::args().skip(1);
    if let Some(steps) = args.next() {
        options.steps = steps.parse()?;
    }
    if let Some(layout) = args.next() {
        options.layout = layout;
    }
    if let Some(lr) = args.next() {
        options.lr = lr.parse()?;
    }
    if let Some(entropy) = args.next() {
        options.entropy_coef = entropy.parse()?;
    }
    let placement = Placement::decide(Transport::Auto, 0)?;
    let reporter = placement.is_reporter();
    let report = grpo_on(&placement, &options, &|step, report| {
        let i = report.mean_rewards.len() - 1;
        tracing::info!(
            step,
            mean_reward = format!("{:.3}", report.mean_rewards[i]),
            exact = format!("{:.3}", report.exact[i]),
            "grpo"
        );
    })?;
    if reporter {
        let n = report.mean_rewards.len();
        let head = report.mean_rewards.iter().take(5).sum::<f64>() / 5f64.min(n as f64);
        let tail = report.mean_rewards.iter().rev().take(5).sum::<f64>() / 5f64.min(n as f64);
        println!(
            "{}: mean reward {head:.3} (first 5 steps) -> {tail:.3} (last 5), exact copies {:.2} -> {:.2}, {:.1} s",
            report.layout,
            report.exact.first().copied().unwrap_or(0.0),
            report.exact.last().copied().unwrap_or(0.0),
            report.seconds
        );
    }
    Ok(())
}
