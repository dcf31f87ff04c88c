//! Layout search: every layout of `gpus` ranks that training accepts
//! ([`ParallelLayout::parse`]) and the model fits ([`check_fit`]),
//! planned (contiguous pipeline splits; `vpp` virtual stages for the layouts with `pp > 1`),
//! filtered by a per-GPU memory budget and ranked by a rough step time:
//! `compute·(1 + bubble) + communication`, with compute `6·P_active·tokens / (world·peak)`,
//! the 1F1B bubble `(pp − 1)/(vpp·m)`, and the busiest rank's step bytes over one link
//! bandwidth (no overlap assumed).

use moe_backend::parallel::ParallelLayout;

use super::PlanError;
use super::report::{LayoutPlan, PlanOptions, check_fit, plan_layout};
use super::shape::PlannedModel;

/// Hardware the ranking assumes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hardware {
    /// Memory per GPU in bytes.
    pub memory_bytes: f64,
    /// Peak FLOP/s per GPU.
    pub peak_flops: f64,
    /// Link bandwidth per GPU in bytes/s.
    pub link_bytes_per_s: f64,
}

/// A ranked layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Its plan.
    pub plan: LayoutPlan,
    /// Estimated compute seconds per step (with the pipeline bubble).
    pub compute_s: f64,
    /// Estimated communication seconds per step.
    pub comm_s: f64,
}

impl Candidate {
    /// Estimated step time.
    pub fn step_s(&self) -> f64 {
        self.compute_s + self.comm_s
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The best `top` layouts of `gpus` ranks that fit `hw.memory_bytes`, fastest first.
pub fn search(
    model: &PlannedModel,
    gpus: usize,
    opts: &PlanOptions,
    hw: &Hardware,
    top: usize,
) -> Result<Vec<Candidate>, PlanError> {
    let shape = model.shape();
    let full = model.rank_params(&ParallelLayout::single(), 0)?;
    let active = (full.dense_sharded + full.dense_replicated) as f64
        + full.expert as f64 * shape.top_k as f64 / shape.experts.max(1) as f64;
    let mut fitting = Vec::new();
    let mut smallest: Option<(f64, String)> = None;
    for tp in divisors(gpus).into_iter().filter(|&t| t <= 8) {
        for pp in divisors(gpus / tp) {
            for ep in divisors(shape.experts)
                .into_iter()
                .filter(|e| gpus.is_multiple_of(*e))
            {
                let mut etps = vec![1];
                if tp > 1 {
                    etps.push(tp);
                }
                for etp in etps {
                    let spec = format!("tp={tp},pp={pp},ep={ep},etp={etp}");
                    let Ok(layout) = ParallelLayout::parse(gpus, &spec) else {
                        continue;
                    };
                    // `opts.vpp` interleaves the layouts with pipeline stages (Megatron refuses
                    // virtual stages without them); every layout keeps the contiguous split.
                    let layout_opts = PlanOptions {
                        vpp: if pp > 1 { opts.vpp } else { 1 },
                        ..opts.clone()
                    };
                    let opts = &layout_opts;
                    if check_fit(model, &layout, opts).is_err() {
                        continue;
                    }
                    let Ok(plan) = plan_layout(model, &layout, opts) else {
                        continue;
                    };
                    let peak = plan.peak_memory();
                    if smallest.as_ref().is_none_or(|(b, _)| peak < *b) {
                        smallest = Some((peak, layout.to_string()));
                    }
                    if peak > hw.memory_bytes {
                        continue;
                    }
                    let m = plan.microbatches as f64;
                    let tokens = m * (opts.micro_batch * opts.seq * layout.dp) as f64;
                    let bubble = (pp as f64 - 1.0) / (plan.vpp as f64 * m);
                    let compute_s =
                        6.0 * active * tokens / (gpus as f64 * hw.peak_flops) * (1.0 + bubble);
                    let comm_s = plan.max_step_bytes() / hw.link_bytes_per_s;
                    fitting.push(Candidate {
                        plan,
                        compute_s,
                        comm_s,
                    });
                }
            }
        }
    }
    let Some((best_bytes, best_layout)) = smallest else {
        return Err(PlanError::NoLayout(gpus));
    };
    if fitting.is_empty() {
        return Err(PlanError::NothingFits {
            gpus,
            budget_gb: hw.memory_bytes / 1e9,
            best_gb: best_bytes / 1e9,
            best_layout,
        });
    }
    fitting.sort_by(|a, b| a.step_s().total_cmp(&b.step_s()));
    fitting.truncate(top.max(1));
    Ok(fitting)
}
