//! Weight-sync throughput (issue 19, item 6): a Qwen3-MoE sharded over 4 in-process ranks
//! (`tp=2,ep=4`) streams its full HF tensors through `moe_models::weight_sync` to rank 0 in
//! buckets, compared with a plain memory copy of the same bytes in the same run.
//!
//! Run: `cargo bench --bench weight_sync` (`WS_BENCH_ONLY=<i>` times the `i`-th case alone;
//! sizes via `WS_BENCH_LAYERS`, `WS_BENCH_HIDDEN`, `WS_BENCH_EXPERTS`, `WS_BENCH_EXPERT_WIDTH`;
//! layout via `WS_BENCH_LAYOUT`; defaults 8 layers, hidden 1024, 32 experts of width 128,
//! vocabulary 8192: 142 M parameters, 0.57 GB in f32).
//!
//! Reported, median of 3 after one warm-up sync (which also runs the backend's lazy random
//! init): per dtype (bf16, f32) and expert naming (per expert, fused) the producer alone with
//! 512 MiB buckets (the buckets are dropped on rank 0), bf16 per-expert with 32 MiB buckets,
//! then bf16 per-expert into a `ModelReceiver` that rebuilds a rollout model; GB/s count the
//! bytes of the buckets. Baselines, on one thread, median of 3 after a warm-up: a plain copy of
//! the same bytes into a fresh allocation (`Vec::clone`: the destination's pages fault in as the
//! sync's fresh buckets do; the ratio is against this one)
//! and into a destination already written once (`copy_from_slice`, the bandwidth ceiling). For
//! context, the path the sync replaces: `gather_full` (the whole model on every
//! rank) and then `export_hf_tensors` on rank 0, f32. The peak sync buffers of any rank come
//! from `SyncStats`. System allocator (a freed bucket goes back to the OS, so every bucket's
//! pages fault in, as the fresh-allocation baseline's do).

use moe_models::Qwen3MoeForCausalLM;
use std::time::Instant;

use burn::tensor::Device;
use moe_backend::BackendError;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::Qwen3MoeConfig;
use moe_models::distributed::{DispatcherKind, Sharded, gather_full};
use moe_models::export::{ExportHf, for_each_hf_tensor};
use moe_models::weight_sync::{
    DEFAULT_BUCKET_BYTES, ExpertNames, ModelReceiver, SyncDtype, SyncOptions, SyncStats,
    WeightReceiver, WeightSync, sync_weights,
};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A timed configuration: its label, options and whether rank 0 rebuilds a model.
struct Case {
    label: &'static str,
    dtype: SyncDtype,
    experts: ExpertNames,
    bucket_bytes: usize,
    receiver: bool,
}

/// Rank 0's view of one case: bytes synced, median seconds, max peak buffer over ranks.
struct Measured {
    bytes: u64,
    tensors: usize,
    buckets: usize,
    seconds: f64,
    peak: u64,
    max_tensor: u64,
}

fn main() {
    let layers = env_usize("WS_BENCH_LAYERS", 8);
    let hidden = env_usize("WS_BENCH_HIDDEN", 1024);
    let experts = env_usize("WS_BENCH_EXPERTS", 32);
    let width = env_usize("WS_BENCH_EXPERT_WIDTH", 128);
    let spec = std::env::var("WS_BENCH_LAYOUT").unwrap_or_else(|_| "tp=2,ep=4".to_owned());
    let world = 4;
    let cfg = Qwen3MoeConfig {
        vocab_size: 8192,
        hidden_size: hidden,
        intermediate_size: 4 * hidden,
        moe_intermediate_size: width,
        num_hidden_layers: layers,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: hidden / 8,
        num_experts: experts,
        num_experts_per_tok: 2,
        norm_topk_prob: true,
        ..Qwen3MoeConfig::default()
    };
    let layout = match ParallelLayout::parse(world, &spec) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("layout {spec}: {e}");
            std::process::exit(1);
        }
    };
    let full = match cfg.init(&Device::flex()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cannot build the model: {e}");
            std::process::exit(1);
        }
    };
    let params = moe_models::export::export_hf_tensors(&full)
        .expect("export")
        .total_bytes()
        / 4;
    println!(
        "Qwen3-MoE: {layers} layers, hidden {hidden}, {experts} experts of width {width}, vocab \
         {}: {:.1} M parameters; {world} ranks, {spec}",
        cfg.vocab_size,
        params as f64 / 1e6,
    );
    let cases = [
        Case {
            label: "bf16, per-expert names",
            dtype: SyncDtype::Bf16,
            experts: ExpertNames::PerExpert,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            receiver: false,
        },
        Case {
            label: "bf16, fused experts",
            dtype: SyncDtype::Bf16,
            experts: ExpertNames::Fused,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            receiver: false,
        },
        Case {
            label: "f32, per-expert names",
            dtype: SyncDtype::F32,
            experts: ExpertNames::PerExpert,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            receiver: false,
        },
        Case {
            label: "f32, fused experts",
            dtype: SyncDtype::F32,
            experts: ExpertNames::Fused,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            receiver: false,
        },
        Case {
            label: "bf16, per-expert, 32 MiB buckets",
            dtype: SyncDtype::Bf16,
            experts: ExpertNames::PerExpert,
            bucket_bytes: 32 << 20,
            receiver: false,
        },
        Case {
            label: "bf16, per-expert, into a ModelReceiver",
            dtype: SyncDtype::Bf16,
            experts: ExpertNames::PerExpert,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            receiver: true,
        },
    ];
    // `WS_BENCH_ONLY=<i>` times case `i` alone (e.g. for a profile).
    let only = std::env::var("WS_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let cases: Vec<Case> = cases
        .into_iter()
        .enumerate()
        .filter(|(i, _)| only.is_none_or(|o| o == *i))
        .map(|(_, c)| c)
        .collect();
    let (full_ref, layout_ref, cases_ref) = (&full, &layout, &cases);
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let world = ctx.world()?;
        let be = |e: &dyn std::fmt::Display| BackendError::Replay(e.to_string());
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
            .map_err(|e| be(&e))?;
        // The rollout model rank 0 updates (its own random init; replaced by the sync).
        let mut rollout = (ctx.rank() == 0)
            .then(|| full_ref.config().init(&Device::flex()))
            .transpose()
            .map_err(|e| be(&e))?;
        // Warm-up: the lazy random init of the shard's tensors runs here.
        sync_weights(&shard.model, &pg, SyncOptions::default(), None).map_err(|e| be(&e))?;
        let mut out = Vec::new();
        for case in cases_ref {
            let options = SyncOptions {
                dtype: case.dtype,
                experts: case.experts,
                bucket_bytes: case.bucket_bytes,
                ..SyncOptions::default()
            };
            let mut times = Vec::new();
            let mut last = SyncStats::default();
            let mut info = (0, 0, 0);
            for _ in 0..3 {
                world.barrier()?;
                let start = Instant::now();
                let sync =
                    WeightSync::new(&shard.model, &pg, options.clone()).map_err(|e| be(&e))?;
                let manifest = sync.manifest();
                info = (
                    manifest.total_bytes(),
                    manifest
                        .tensors()
                        .map(|t| t.bytes as u64)
                        .max()
                        .unwrap_or(0),
                    manifest.buckets.len(),
                );
                let mut rx = match (&mut rollout, case.receiver) {
                    (Some(model), true) => Some(ModelReceiver::new(model, &Device::flex())),
                    _ => None,
                };
                last = sync
                    .run(rx.as_mut().map(|r| r as &mut dyn WeightReceiver))
                    .map_err(|e| be(&e))?;
                times.push(start.elapsed().as_secs_f64());
            }
            out.push((median(times), last, info));
        }
        // The replaced path: every rank gathers the full model, rank 0 exports it.
        let mut times = Vec::new();
        for _ in 0..3 {
            world.barrier()?;
            let start = Instant::now();
            let gathered = gather_full(&shard, &pg).map_err(|e| be(&e))?;
            if ctx.rank() == 0 {
                for_each_hf_tensor(&gathered, |_, data| {
                    std::hint::black_box(data.as_bytes().len());
                    Ok::<(), moe_models::ModelError>(())
                })
                .map_err(|e| be(&e))?;
            }
            drop(gathered);
            world.barrier()?;
            times.push(start.elapsed().as_secs_f64());
        }
        Ok((out, median(times)))
    });
    let (per_rank, gather_secs): (Vec<_>, Vec<f64>) =
        match results.into_iter().collect::<Result<Vec<_>, _>>() {
            Ok(r) => r.into_iter().unzip(),
            Err(e) => {
                eprintln!("sync failed: {e}");
                std::process::exit(1);
            }
        };
    let measured: Vec<Measured> = (0..cases.len())
        .map(|c| {
            let (seconds, stats, (bytes, max_tensor, buckets)) = per_rank[0][c];
            Measured {
                bytes,
                tensors: stats.tensors,
                buckets,
                seconds,
                peak: per_rank
                    .iter()
                    .map(|r| r[c].1.peak_buffer_bytes)
                    .max()
                    .unwrap_or(0),
                max_tensor,
            }
        })
        .collect();

    // Baselines: plain copies of the same bytes, into a fresh allocation and into a
    // destination already written once.
    let memcpy = |bytes: u64| {
        let src = vec![1u8; bytes as usize];
        let (mut fresh, mut warm) = (Vec::new(), Vec::new());
        let mut dst = vec![0u8; bytes as usize];
        dst.copy_from_slice(&src);
        for _ in 0..4 {
            let start = Instant::now();
            let fresh_dst = src.clone();
            std::hint::black_box(&fresh_dst);
            fresh.push(start.elapsed().as_secs_f64());
            drop(fresh_dst);
            let start = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            warm.push(start.elapsed().as_secs_f64());
        }
        (median(fresh[1..].to_vec()), median(warm[1..].to_vec()))
    };
    let gb_s = |bytes: u64, secs: f64| bytes as f64 / secs / 1e9;
    for (case, m) in cases.iter().zip(&measured) {
        let (fresh, warm) = memcpy(m.bytes);
        let rate = gb_s(m.bytes, m.seconds);
        println!(
            "{:<40}: {:.1} MB ({} tensors, {} buckets) in {:.3} s = {rate:.2} GB/s; memcpy \
             fresh {fresh:.3} s = {:.2} GB/s, warm {warm:.3} s = {:.2} GB/s; ratio {:.3} of \
             fresh ({:.3} of warm); peak sync buffers of any rank {:.1} MB (largest tensor \
             {:.1} MB)",
            case.label,
            m.bytes as f64 / 1e6,
            m.tensors,
            m.buckets,
            m.seconds,
            gb_s(m.bytes, fresh),
            gb_s(m.bytes, warm),
            rate / gb_s(m.bytes, fresh),
            rate / gb_s(m.bytes, warm),
            m.peak as f64 / 1e6,
            m.max_tensor as f64 / 1e6,
        );
    }
    let f32_bytes = full.hf_tensors().expect("export").total_bytes();
    let gather = gather_secs.first().copied().unwrap_or(f64::NAN);
    println!(
        "{:<40}: {:.1} MB in {gather:.3} s = {:.2} GB/s (every rank holds the full model)",
        "replaced: gather on every rank + export",
        f32_bytes as f64 / 1e6,
        gb_s(f32_bytes, gather),
    );
}
