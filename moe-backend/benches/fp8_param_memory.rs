//! Weight memory a module holds for an FP8-eligible layer (issue 21,
//! docs/fp8.md §FP8 primary weights), measured from the storage of its parameters
//! ([`param_storage_bytes`]: the distinct buffers its float parameters reference):
//!
//! - before: the parameters as built (f32), and the BF16 reference (two bytes per element);
//! - after: FP8 primary weights enabled in `DistributedAdamW` with the default (packed)
//!   storage: every FP8 parameter holds its E4M3 codes and 128×128 block `scale_inv`
//!   ([`moe_backend::fp8::PackedFp8`]), which the FP8 GEMMs read directly; and, for
//!   comparison, the decoded-f32 storage (`Fp8Storage::Decoded`).
//!
//! Layers: the routed experts of one MoE layer of Qwen3-30B-A3B on one rank of EP=8 (16 local
//! experts, `fc1 [16, 1536, 2048]`, `fc2 [16, 2048, 768]`) and one dense linear (its attention
//! `q_proj`, 2048 → 4096, Burn `[in, out]`). After enabling, one FP8 forward + backward +
//! optimizer step runs and the memory is measured again (the step writes new packed weights).
//!
//! Run: `cargo bench -p moe-backend --bench fp8_param_memory` (add `-- --quick` for smaller
//! shapes).

use std::time::Instant;

use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Tensor};
use moe_backend::comm::World;
use moe_backend::fp8::{Fp8Recipe, fp8_linear_forward, param_storage_bytes};
use moe_backend::layer::MoeLayerConfig;
use moe_backend::optim::{
    DistributedAdamW, DistributedAdamWConfig, Fp8ParamLayout, Fp8PrimaryConfig, Fp8Storage,
};
use moe_backend::parallel::ParallelLayout;
use moe_backend::router::TopKRouterConfig;

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn report(what: &str, numel: usize, before: usize, after: usize, after_step: usize) {
    let bf16 = 2 * numel;
    println!(
        "{what}: {numel} weights; f32 params {:.2} MiB, BF16 reference {:.2} MiB; \
         FP8 primary {:.2} MiB after enabling, {:.2} MiB after a step; saving vs BF16 {:.1}%",
        mib(before),
        mib(bf16),
        mib(after),
        mib(after_step),
        100.0 * (1.0 - after_step as f64 / bf16 as f64)
    );
}

/// `(before, after enabling, after one step)` bytes of the experts of an MoE layer.
fn experts(h: usize, f: usize, e: usize, storage: Fp8Storage) -> (usize, usize, usize) {
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let device = Device::flex().autodiff();
    let recipe = Fp8Recipe::new();
    let out = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let layer = MoeLayerConfig::new(TopKRouterConfig::new(h, e, 2), f)
            .with_init_std(0.02)
            .init(&device)?
            .with_fp8_experts(Some(recipe))?;
        let before = param_storage_bytes(&layer.experts);
        let mut optim =
            DistributedAdamW::new(&layer, &pg, ctx.world()?, DistributedAdamWConfig::default())?;
        let config = Fp8PrimaryConfig::from_recipe(&recipe).with_storage(storage);
        let layer = optim.enable_fp8_primary_weights(layer, config, &Fp8ParamLayout::experts)?;
        let after = param_storage_bytes(&layer.experts);
        // One FP8 step of the experts: 8 tokens per expert.
        let sizes = vec![8; e];
        let x = Tensor::<2>::random([8 * e, h], Distribution::Normal(0.0, 1.0), &device);
        let probs = Tensor::<1>::ones([8 * e], &device);
        let start = Instant::now();
        let loss = layer.experts.forward(x, &sizes, probs)?.sum();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let (layer, _) = optim.step(1e-4, layer, grads)?;
        println!(
            "  experts {storage:?}: FP8 forward + backward + step {:.2} s",
            start.elapsed().as_secs_f64()
        );
        Ok((before, after, param_storage_bytes(&layer.experts)))
    });
    out.into_iter()
        .next()
        .and_then(|r| r.ok())
        .expect("experts run")
}

/// `(before, after enabling, after one step)` bytes of a dense linear `d_in -> d_out`.
fn linear(d_in: usize, d_out: usize, storage: Fp8Storage) -> (usize, usize, usize) {
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let device = Device::flex().autodiff();
    let recipe = Fp8Recipe::new();
    let out = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let linear: Linear = LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .init(&device);
        let before = param_storage_bytes(&linear);
        let mut optim = DistributedAdamW::new(
            &linear,
            &pg,
            ctx.world()?,
            DistributedAdamWConfig::default(),
        )?;
        let config = Fp8PrimaryConfig::from_recipe(&recipe).with_storage(storage);
        let linear = optim.enable_fp8_primary_weights(linear, config, &Fp8ParamLayout::linear)?;
        let after = param_storage_bytes(&linear);
        let x = Tensor::<2>::random([64, d_in], Distribution::Normal(0.0, 1.0), &device);
        let loss = fp8_linear_forward(&linear, x, &recipe).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &linear);
        let (linear, _) = optim.step(1e-4, linear, grads)?;
        Ok((before, after, param_storage_bytes(&linear)))
    });
    out.into_iter()
        .next()
        .and_then(|r| r.ok())
        .expect("linear run")
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // Qwen3-30B-A3B: H = 2048, expert F = 768, 128 experts (16 per rank at EP=8), 32 query
    // heads of 128.
    let (h, f, e, q) = if quick {
        (512, 256, 4, 1024)
    } else {
        (2048, 768, 16, 4096)
    };
    println!("rayon threads: {}", rayon::current_num_threads());
    let numel = e * 3 * f * h;
    let (before, after, step) = experts(h, f, e, Fp8Storage::Packed);
    report(
        &format!(
            "MoE experts [{e}, {}, {h}] + [{e}, {h}, {f}], packed",
            2 * f
        ),
        numel,
        before,
        after,
        step,
    );
    let (before, after, step) = experts(h, f, e, Fp8Storage::Decoded);
    report(
        &format!(
            "MoE experts [{e}, {}, {h}] + [{e}, {h}, {f}], decoded f32",
            2 * f
        ),
        numel,
        before,
        after,
        step,
    );
    for storage in [Fp8Storage::Packed, Fp8Storage::Decoded] {
        let (before, after, step) = linear(h, q, storage);
        report(
            &format!("dense linear {h} -> {q}, {storage:?}"),
            h * q,
            before,
            after,
            step,
        );
    }
}
