//! Megatron's `moe_shared_expert_overlap` measured on a transport with real latency: one MoE
//! layer forward (router → AlltoAll dispatch → experts → combine, plus shared experts) under
//! expert parallelism, the ranks as TCP processes (started torchrun-style) and as threads,
//! with the shared experts run after the dispatch and while it is in flight
//! ([`MoeLayer::forward_executing`]). Prints the median forward milliseconds per rank and the
//! ratio; the outputs are compared bit for bit.
//!
//! Run: `cargo bench --bench shared_expert_overlap` (`-- --quick` for a smaller case).

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use burn_moe::backend::comm::launch::Launch;
use burn_moe::backend::comm::tcp::{TcpConfig, TcpWorld};
use burn_moe::backend::comm::{RankCtx, World};
use burn_moe::backend::dispatch::{AllToAllDispatcher, TokenDispatcher};
use burn_moe::backend::layer::{MoeExecution, MoeLayer, MoeLayerConfig};
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout, replicate};
use burn_moe::backend::router::{RouteOptions, TopKRouterConfig};
use moe_backend::testing::SplitMix;

#[path = "common/tcp_ranks.rs"]
mod tcp_ranks;

#[derive(Clone, Copy, Debug)]
struct Case {
    ep: usize,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    shared_ffn: usize,
    experts: usize,
    topk: usize,
    steps: usize,
}

fn case(quick: bool) -> Case {
    Case {
        ep: 2,
        tokens: if quick { 256 } else { 2048 },
        hidden: if quick { 256 } else { 1024 },
        ffn: if quick { 128 } else { 512 },
        shared_ffn: if quick { 256 } else { 2048 },
        experts: 16,
        topk: 4,
        steps: if quick { 3 } else { 7 },
    }
}

/// Median forward milliseconds without and with the overlap, and whether the outputs agree.
fn forwards(ctx: &RankCtx, c: Case) -> moe_backend::Result<(f64, f64, bool)> {
    let layout = ParallelLayout::parse(c.ep, &format!("ep={}", c.ep))?;
    let pg = ctx.process_groups(&layout)?;
    let d = AllToAllDispatcher::new(
        pg.comm(GroupFamily::Ep).clone(),
        pg.comm(GroupFamily::ExptTp).clone(),
        pg.comm(GroupFamily::TpEp).clone(),
        c.experts,
    )?;
    let device = Device::flex();
    // Every rank builds the same layer (the initialisation is seeded), then keeps its experts.
    device.seed(3);
    let full: MoeLayer =
        MoeLayerConfig::new(TopKRouterConfig::new(c.hidden, c.experts, c.topk), c.ffn)
            .with_shared_ffn_hidden_size(Some(c.shared_ffn))
            .init(&device)?;
    let layer = MoeLayer {
        router: replicate(&full.router),
        experts: full.experts.shard(d.local_experts(), 0, 1)?,
        shared_experts: full.shared_experts.as_ref().map(replicate),
    };
    let mut rng = SplitMix::new(17 + ctx.rank() as u64);
    let x: Vec<f32> = (0..c.tokens * c.hidden)
        .map(|_| rng.uniform(-1.0, 1.0) as f32)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [c.tokens, c.hidden]), &device);
    let state = layer.router.init_state();
    let mut times = [Vec::new(), Vec::new()];
    let mut outputs: [Option<TensorData>; 2] = [None, None];
    for step in 0..=c.steps {
        for (i, overlap) in [false, true].into_iter().enumerate() {
            let execution = MoeExecution {
                overlap_shared_experts: overlap,
                ..MoeExecution::default()
            };
            pg.comm(GroupFamily::Ep).barrier()?;
            let start = Instant::now();
            let out = layer
                .forward_executing(x.clone(), &state, &RouteOptions::default(), &d, &execution)?
                .output
                .into_data();
            if step > 0 {
                times[i].push(start.elapsed().as_secs_f64() * 1e3);
            }
            outputs[i] = Some(out);
        }
    }
    let same = outputs[0] == outputs[1];
    let [mut plain, mut overlapped] = times;
    Ok((median(&mut plain), median(&mut overlapped), same))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let c = case(quick);
    if let Some(launch) = Launch::from_env().expect("launcher environment") {
        let world = TcpWorld::init(&launch, TcpConfig::default()).expect("TCP");
        let (plain, overlapped, same) = world.run(|ctx| forwards(ctx, c)).expect("forwards");
        println!("RANK {} {plain:.3} {overlapped:.3} {same}", world.rank());
        return;
    }
    println!(
        "MoE layer forward with shared experts (router, AlltoAll dispatch, grouped GEMMs, \
         combine; shared MLP width {}), EP={} T={} h={} F={} E={} k={}, median of {} forwards",
        c.shared_ffn, c.ep, c.tokens, c.hidden, c.ffn, c.experts, c.topk, c.steps
    );
    let threads: Vec<(f64, f64, bool)> = World::run(c.ep, |ctx| forwards(ctx, c))
        .into_iter()
        .map(|r| r.expect("rank"))
        .collect();
    let args: &[&str] = if quick { &["--quick"] } else { &[] };
    let text = tcp_ranks::tcp_processes(c.ep, args);
    let mut tcp = vec![(f64::NAN, f64::NAN, false); c.ep];
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let ["RANK", r, a, b, same] = parts.as_slice()
            && let (Ok(r), Ok(a), Ok(b)) = (r.parse::<usize>(), a.parse::<f64>(), b.parse::<f64>())
            && r < c.ep
        {
            tcp[r] = (a, b, *same == "true");
        }
    }
    println!(
        "| ranks as | rank | sequential ms | overlapped ms | ratio | outputs equal |\n|---|---|---|---|---|---|"
    );
    for (name, rows) in [("threads", &threads), ("TCP processes", &tcp)] {
        for (r, (a, b, same)) in rows.iter().enumerate() {
            println!("| {name} | {r} | {a:.1} | {b:.1} | {:.2} | {same} |", a / b);
        }
    }
}
