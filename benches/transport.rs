//! One MoE layer step (AlltoAll dispatch → local experts' grouped GEMMs → combine, forward and
//! backward) under expert parallelism, with the ranks as threads of one process, as TCP
//! processes (started torchrun-style) and as MPI processes, on the same routing: milliseconds
//! per step and the EP all-to-all bytes each rank sends (which must be equal).
//!
//! Run: `cargo bench --features mpi --bench transport` (it starts itself as EP processes, with
//! `RANK`/`WORLD_SIZE`/`MASTER_*` and with `mpirun -np EP`; OpenMPI needed). `-- --quick` for a
//! smaller case.

use std::process::Command;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use burn_moe::backend::comm::launch::Launch;
use burn_moe::backend::comm::mpi::{MpiConfig, MpiWorld};
use burn_moe::backend::comm::tcp::{TcpConfig, TcpWorld};
use burn_moe::backend::comm::{RankCtx, World};
use burn_moe::backend::dispatch::{AllToAllDispatcher, TokenDispatcher};
use burn_moe::backend::experts::GroupedExpertsConfig;
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout};
use moe_backend::testing::SplitMix;

#[path = "common/tcp_ranks.rs"]
mod tcp_ranks;

#[derive(Clone, Copy, Debug)]
struct Case {
    ep: usize,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    experts: usize,
    topk: usize,
    steps: usize,
}

fn case(quick: bool) -> Case {
    if quick {
        Case {
            ep: 4,
            tokens: 128,
            hidden: 256,
            ffn: 128,
            experts: 16,
            topk: 2,
            steps: 2,
        }
    } else {
        Case {
            ep: 4,
            tokens: 512,
            hidden: 1024,
            ffn: 512,
            experts: 32,
            topk: 4,
            steps: 4,
        }
    }
}

/// Per-step milliseconds (after one warm-up step) and EP bytes this rank sent per step.
fn layer_steps(ctx: &RankCtx, c: Case) -> moe_backend::Result<(Vec<f64>, u64)> {
    let layout = ParallelLayout::parse(c.ep, &format!("ep={}", c.ep))?;
    let pg = ctx.process_groups(&layout)?;
    let d = AllToAllDispatcher::new(
        pg.comm(GroupFamily::Ep).clone(),
        pg.comm(GroupFamily::ExptTp).clone(),
        pg.comm(GroupFamily::TpEp).clone(),
        c.experts,
    )?;
    let device = Device::flex().autodiff();
    let experts = GroupedExpertsConfig::new(c.experts, c.hidden, c.ffn)
        .init(&device)?
        .shard(d.local_experts(), 0, 1)?;
    let mut rng = SplitMix::new(17 + ctx.rank() as u64);
    let mut probs = vec![0.0f32; c.tokens * c.experts];
    for row in probs.chunks_mut(c.experts) {
        for j in rng.distinct(c.experts, c.topk) {
            row[j] = 1.0 / c.topk as f32;
        }
    }
    let x: Vec<f32> = (0..c.tokens * c.hidden)
        .map(|_| rng.uniform(-1.0, 1.0) as f32)
        .collect();
    let p = Tensor::<2>::from_data(TensorData::new(probs, [c.tokens, c.experts]), &device);
    let map = p.clone().greater_elem(0.0);
    let x =
        Tensor::<2>::from_data(TensorData::new(x, [c.tokens, c.hidden]), &device).require_grad();
    let ep = pg.comm(GroupFamily::Ep);
    let mut ms = Vec::new();
    let mut bytes = 0;
    for step in 0..=c.steps {
        let before = ep.traffic().bytes_sent;
        let start = Instant::now();
        let dispatched = d.dispatch(x.clone(), p.clone(), map.clone())?;
        let y = experts.forward(
            dispatched.rows,
            &dispatched.tokens_per_local_expert,
            dispatched.probs,
        )?;
        let out = d.combine(y, dispatched.state)?;
        let grads = out.sum().backward();
        let _ = x.grad(&grads).map(|g| g.into_data());
        if step > 0 {
            ms.push(start.elapsed().as_secs_f64() * 1e3);
            bytes = ep.traffic().bytes_sent - before;
        }
    }
    Ok((ms, bytes))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let c = case(quick);
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        let world = MpiWorld::init(MpiConfig::default()).expect("MPI");
        let (mut ms, bytes) = world.run(|ctx| layer_steps(ctx, c)).expect("layer steps");
        println!("RANK {} {:.3} {bytes}", world.rank(), median(&mut ms));
        return;
    }
    if let Some(launch) = Launch::from_env().expect("launcher environment") {
        let world = TcpWorld::init(&launch, TcpConfig::default()).expect("TCP");
        let (mut ms, bytes) = world.run(|ctx| layer_steps(ctx, c)).expect("layer steps");
        println!("RANK {} {:.3} {bytes}", world.rank(), median(&mut ms));
        return;
    }
    println!(
        "MoE layer step (AlltoAll dispatch + grouped GEMMs + combine, fwd+bwd), EP={} \
         T={} h={} F={} E={} k={}, median of {} steps",
        c.ep, c.tokens, c.hidden, c.ffn, c.experts, c.topk, c.steps
    );
    let threads: Vec<(f64, u64)> = World::run(c.ep, |ctx| layer_steps(ctx, c))
        .into_iter()
        .map(|r| {
            let (mut ms, bytes) = r.expect("rank");
            (median(&mut ms), bytes)
        })
        .collect();
    let exe = std::env::current_exe().expect("bench binary");
    // MPI processes.
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(c.ep.to_string())
        .arg(&exe);
    if quick {
        cmd.arg("--quick");
    }
    let out = cmd.output().expect("mpirun (install openmpi-bin)");
    assert!(
        out.status.success(),
        "mpirun failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mpi = parse_ranks(&String::from_utf8_lossy(&out.stdout), c.ep);
    // TCP processes, started as torchrun starts them.
    let args: &[&str] = if quick { &["--quick"] } else { &[] };
    let text = tcp_ranks::tcp_processes(c.ep, args);
    let tcp = parse_ranks(&text, c.ep);
    println!(
        "{:>4} {:>11} {:>9} {:>9} {:>14} {:>14} {:>14}",
        "rank", "threads ms", "tcp ms", "mpi ms", "threads EP B", "tcp EP B", "mpi EP B"
    );
    for r in 0..c.ep {
        println!(
            "{r:>4} {:>11.1} {:>9.1} {:>9.1} {:>14} {:>14} {:>14}",
            threads[r].0, tcp[r].0, mpi[r].0, threads[r].1, tcp[r].1, mpi[r].1
        );
    }
    let equal = (0..c.ep).all(|r| threads[r].1 == tcp[r].1 && threads[r].1 == mpi[r].1);
    let mean = |v: &[(f64, u64)]| v.iter().map(|x| x.0).sum::<f64>() / v.len() as f64;
    println!(
        "mean step: threads {:.1} ms, TCP processes {:.1} ms ({:.2}x), MPI processes {:.1} ms \
         ({:.2}x); EP bytes per rank equal on all three: {equal}",
        mean(&threads),
        mean(&tcp),
        mean(&tcp) / mean(&threads),
        mean(&mpi),
        mean(&mpi) / mean(&threads),
    );
}

/// `RANK r ms bytes` lines of the ranks' output.
fn parse_ranks(text: &str, n: usize) -> Vec<(f64, u64)> {
    let mut ranks = vec![(f64::NAN, 0u64); n];
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let ["RANK", r, ms, bytes] = parts.as_slice()
            && let (Ok(r), Ok(ms), Ok(bytes)) =
                (r.parse::<usize>(), ms.parse::<f64>(), bytes.parse::<u64>())
            && r < n
        {
            ranks[r] = (ms, bytes);
        }
    }
    ranks
}
