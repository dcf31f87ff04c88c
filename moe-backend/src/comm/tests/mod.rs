//! Tests of the communication layer: collectives on 1..8 threads against sequential results
//! ([`collectives`]), gradients through every differentiable collective against one-rank
//! computations ([`gradients`]), failure handling ([`failures`]).

use std::time::Duration;

use burn::tensor::Device;

use super::*;
use crate::testing::SplitMix;

mod batched;
mod collectives;
pub(crate) mod device;
mod failures;
mod gradients;

fn dev() -> Device {
    Device::flex()
}

/// Deterministic per-rank input: `rows x cols` values from seed `(tag, rank)`.
fn input(tag: u64, rank: usize, rows: usize, cols: usize) -> Vec<f64> {
    let mut rng = SplitMix::new(tag * 1000 + rank as u64);
    (0..rows * cols).map(|_| rng.uniform(-2.0, 2.0)).collect()
}

fn quick() -> WorldConfig {
    WorldConfig {
        timeout: Duration::from_secs(5),
        ..WorldConfig::default()
    }
}

fn ok<T: std::fmt::Debug>(results: Vec<Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// Random `n x n` split matrix with zeros; `send[i][j]` rows go from i to j.
fn split_matrix(rng: &mut SplitMix, n: usize) -> Vec<Vec<usize>> {
    (0..n)
        .map(|_| {
            (0..n)
                .map(|_| if rng.below(3) == 0 { 0 } else { rng.below(4) })
                .collect()
        })
        .collect()
}
