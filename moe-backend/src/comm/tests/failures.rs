//! Failures, argument checks, group derivation and traffic accounting.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Int, Tensor, TensorData};

use super::*;
use crate::error::BackendError;
use crate::parallel::{GroupFamily, ParallelLayout};
use crate::testing::tensor;

// ---------------------------------------------------------------------------------------
// Failures.

#[test]
fn a_failing_rank_aborts_pending_collectives_within_the_timeout() {
    let start = Instant::now();
    let out = World::run_with(4, quick(), |ctx| {
        let world = ctx.world()?;
        let x = tensor(vec![1.0], [1], &dev(), DType::F32);
        world.all_reduce(x.clone(), ReduceOp::Sum)?;
        if ctx.rank() == 2 {
            return Err(BackendError::Config {
                field: "test",
                detail: "rank 2 gives up".into(),
            });
        }
        world.all_reduce(x, ReduceOp::Sum).map(|_| ())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "no rank waited for the timeout"
    );
    for (r, res) in out.iter().enumerate() {
        let err = res.as_ref().expect_err("every rank fails").to_string();
        if r == 2 {
            assert!(err.contains("rank 2 gives up"), "{err}");
        } else {
            assert!(
                err.contains("rank 2") && err.contains("gives up"),
                "rank {r}: {err}"
            );
        }
    }
}

#[test]
fn a_panicking_rank_aborts_the_others() {
    let out = World::run_with(3, quick(), |ctx| {
        if ctx.rank() == 0 {
            panic!("boom on rank 0");
        }
        ctx.world()?.barrier()
    });
    assert!(
        matches!(&out[0], Err(BackendError::RankPanicked { rank: 0, message }) if message.contains("boom"))
    );
    for res in &out[1..] {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 0"), "{err}");
    }
}

#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    let config = WorldConfig {
        timeout: Duration::from_millis(300),
        ..WorldConfig::default()
    };
    let start = Instant::now();
    let out = World::run_with(2, config, |ctx| {
        if ctx.rank() == 1 {
            // Rank 1 is stuck in local work and never joins.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        ctx.world()?.barrier()
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    match &out[0] {
        Err(BackendError::Timeout { waiting, .. }) => assert_eq!(waiting, &vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn mismatched_sizes_and_order_name_the_ranks() {
    let out = World::run_with(2, quick(), |ctx| {
        let rows = 2 + ctx.rank();
        let x = tensor(vec![0.0; rows], [rows], &dev(), DType::F32);
        ctx.world()?.all_reduce(x, ReduceOp::Sum).map(|_| ())
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("shape mismatch: rank 0 passed [2]") && err.contains("rank 1 passed [3]"),
            "{err}"
        );
        assert!(err.contains("failures.rs"), "call site missing: {err}");
    }
    let out = World::run_with(2, quick(), |ctx| {
        let world = ctx.world()?;
        let x = tensor(vec![0.0; 2], [2], &dev(), DType::F32);
        if ctx.rank() == 0 {
            world.all_reduce(x, ReduceOp::Sum).map(|_| ())
        } else {
            world.all_gather(x).map(|_| ())
        }
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("order mismatch: rank 0 called all_reduce")
                && err.contains("rank 1 called all_gather"),
            "{err}"
        );
    }
    // all_to_all_v whose receive splits disagree with the senders.
    let out = World::run_with(2, quick(), |ctx| {
        let x = tensor(vec![0.0; 2], [2, 1], &dev(), DType::F32);
        let recv = if ctx.rank() == 1 { [1, 2] } else { [1, 1] };
        ctx.world()?.all_to_all_v(x, &[1, 1], &recv).map(|_| ())
    });
    for res in &out {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("rank 1 sends 1 rows to rank 1") && err.contains("expects 2"),
            "{err}"
        );
    }
}

#[test]
fn bad_groups_are_rejected() {
    let out = World::run(2, |ctx| {
        assert!(ctx.group("g", &[0, 0]).is_err());
        assert!(ctx.group("g", &[0, 5]).is_err());
        assert!(ctx.group("g", &[1 - ctx.rank()]).is_err());
        Ok(())
    });
    ok(out);
}

#[test]
fn process_group_communicators_follow_the_layout() {
    // World 8, TP2 / EP4: all-reduce over dp, expt_dp and tp of the global rank.
    let layout = ParallelLayout::parse(8, "tp=2,etp=1,ep=4").unwrap();
    let layout_ref = &layout;
    let out = ok(World::run(8, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let rank =
            Tensor::<1, Int>::from_data(TensorData::new(vec![ctx.rank() as i32], [1]), &dev());
        let mut sums = Vec::new();
        for family in [
            GroupFamily::Tp,
            GroupFamily::Dp,
            GroupFamily::Ep,
            GroupFamily::ExptDp,
        ] {
            let s = pg.comm(family).all_reduce(rank.clone(), ReduceOp::Sum)?;
            sums.push(crate::ops::int_tensor_to_usize(s)[0]);
        }
        Ok((sums, pg.groups.local_expert_ids(8)?))
    }));
    for (r, (sums, experts)) in out.iter().enumerate() {
        let tp = (r / 2) * 2;
        assert_eq!(sums[0], tp + tp + 1, "tp sum rank {r}");
        assert_eq!(sums[1], if r % 2 == 0 { 12 } else { 16 }, "dp sum rank {r}");
        assert_eq!(sums[2], if r < 4 { 6 } else { 22 }, "ep sum rank {r}");
        assert_eq!(sums[3], (r % 4) * 2 + 4, "expt_dp sum rank {r}");
        assert_eq!(experts, &((r % 4) * 2..(r % 4) * 2 + 2));
    }
}

#[test]
fn traffic_counts_bytes_addressed_to_other_members() {
    let out = ok(World::run(3, |ctx| {
        let world = ctx.world()?;
        let r = ctx.rank();
        // Rank r sends r+1 rows of 2 f32 to each member (its own block is not traffic).
        let rows = 3 * (r + 1);
        let x = tensor(vec![0.0; rows * 2], [rows, 2], &dev(), DType::F32);
        world.all_to_all_v(x, &[r + 1; 3], &[1, 2, 3])?;
        world.all_reduce(tensor(vec![0.0; 4], [4], &dev(), DType::F32), ReduceOp::Sum)?;
        Ok(world.traffic())
    }));
    for (r, t) in out.iter().enumerate() {
        assert_eq!(t.calls, 2);
        assert_eq!(
            t.bytes_sent,
            (2 * (r as u64 + 1) * 2 * 4) + 2 * 16,
            "rank {r}"
        );
    }
}
