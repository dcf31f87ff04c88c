//! Bytes per rank and wall time of one dispatch + combine for the three token dispatchers on
//! an in-process world, against the all-to-all volume formula `T·k·h·bytes·(EP−1)/EP`
//! (docs/parallelism.md §Planner formulas). Run: `cargo bench --bench dispatch`.

use std::time::Instant;

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_moe::backend::comm::World;
use burn_moe::backend::dispatch::{
    AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher, TokenDispatcher,
};
use burn_moe::backend::parallel::{GroupFamily, ParallelLayout};
use moe_backend::testing::SplitMix;

#[derive(Clone, Copy, Debug)]
enum Kind {
    AllToAll,
    AllGather,
    Flex,
}

#[derive(Clone, Copy, Debug)]
enum Routing {
    /// k distinct experts uniformly at random.
    Uniform,
    /// k distinct experts of one random EP rank (tokens favour few ranks).
    Clustered,
}

struct Case {
    ep: usize,
    t: usize,
    h: usize,
    e: usize,
    k: usize,
}

fn probs(rng: &mut SplitMix, case: &Case, routing: Routing) -> Vec<f32> {
    let mut p = vec![0.0f32; case.t * case.e];
    let l = case.e / case.ep;
    for row in p.chunks_mut(case.e) {
        let picks: Vec<usize> = match routing {
            Routing::Uniform => rng.distinct(case.e, case.k),
            Routing::Clustered => {
                let owner = rng.below(case.ep);
                rng.distinct(l, case.k.min(l))
                    .into_iter()
                    .map(|j| owner * l + j)
                    .collect()
            }
        };
        for j in picks {
            row[j] = 1.0 / case.k as f32;
        }
    }
    p
}

/// Mean bytes sent per rank during dispatch, and mean ms of dispatch + combine.
fn run(case: &Case, kind: Kind, routing: Routing) -> (f64, f64) {
    let layout = ParallelLayout::parse(case.ep, &format!("ep={}", case.ep)).expect("layout");
    let results = World::run(case.ep, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let tp_ep = pg.comm(GroupFamily::TpEp).clone();
        let d: Box<dyn TokenDispatcher> = match kind {
            Kind::AllToAll => Box::new(AllToAllDispatcher::new(
                pg.comm(GroupFamily::Ep).clone(),
                pg.comm(GroupFamily::ExptTp).clone(),
                tp_ep.clone(),
                case.e,
            )?),
            Kind::AllGather => {
                Box::new(AllGatherDispatcher::new(tp_ep.clone(), case.e, case.ep, 1)?)
            }
            Kind::Flex => Box::new(FlexDispatcher::new(tp_ep.clone(), case.e, case.ep, 1)?),
        };
        let mut rng = SplitMix::new(17 + ctx.rank() as u64);
        let dev = Device::flex();
        let p = Tensor::<2>::from_data(
            TensorData::new(probs(&mut rng, case, routing), [case.t, case.e]),
            &dev,
        );
        let map = p.clone().greater_elem(0.0);
        let x: Vec<f32> = (0..case.t * case.h)
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [case.t, case.h]), (&dev, DType::F32));
        let families = [GroupFamily::Ep, GroupFamily::ExptTp, GroupFamily::TpEp];
        let sent = || -> u64 {
            families
                .iter()
                .map(|f| pg.comm(*f).traffic().bytes_sent)
                .sum()
        };
        let before = sent();
        let start = Instant::now();
        let dispatched = d.dispatch(x, p, map)?;
        let bytes = sent() - before;
        let y = d.combine(dispatched.rows, dispatched.state)?;
        let _ = y.into_data();
        Ok((bytes as f64, start.elapsed().as_secs_f64() * 1e3))
    });
    let n = results.len() as f64;
    let (mut bytes, mut ms) = (0.0, 0.0);
    for r in results {
        let (b, t) = r.expect("rank failed");
        bytes += b / n;
        ms += t / n;
    }
    (bytes, ms)
}

fn main() {
    println!("dispatch traffic per rank (payload bytes addressed to other ranks, one dispatch)");
    println!("formula: T·k·h·4·(EP−1)/EP (probs, counts and padding excluded)\n");
    println!(
        "{:>3} {:>5} {:>5} {:>4} {:>2} {:>10} {:>10} {:>12} {:>8} {:>10}",
        "EP", "T", "h", "E", "k", "routing", "dispatcher", "MiB/rank", "÷formula", "ms"
    );
    for ep in [2, 4, 8] {
        let case = Case {
            ep,
            t: 1024,
            h: 1024,
            e: 32,
            k: 4,
        };
        let formula = (case.t * case.k * case.h * 4) as f64 * (ep - 1) as f64 / ep as f64;
        for routing in [Routing::Uniform, Routing::Clustered] {
            for kind in [Kind::AllToAll, Kind::Flex, Kind::AllGather] {
                let (bytes, ms) = run(&case, kind, routing);
                println!(
                    "{:>3} {:>5} {:>5} {:>4} {:>2} {:>10} {:>10} {:>12.2} {:>8.3} {:>10.1}",
                    ep,
                    case.t,
                    case.h,
                    case.e,
                    case.k,
                    format!("{routing:?}"),
                    format!("{kind:?}"),
                    bytes / (1 << 20) as f64,
                    bytes / formula,
                    ms
                );
            }
        }
    }
}
