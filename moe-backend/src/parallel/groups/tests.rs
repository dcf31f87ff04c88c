use super::*;
use crate::testing::SplitMix;
use GroupFamily::*;

fn table(world: usize, spec: &str) -> GroupTable {
    GroupTable::new(&ParallelLayout::parse(world, spec).unwrap()).unwrap()
}

fn v(groups: &[&[usize]]) -> Vec<Vec<usize>> {
    groups.iter().map(|g| g.to_vec()).collect()
}

#[test]
fn world8_dense_tp2_dp4_and_expert_ep4() {
    let t = table(8, "tp=2,etp=1,ep=4");
    assert_eq!(t.groups(Tp), v(&[&[0, 1], &[2, 3], &[4, 5], &[6, 7]]));
    assert_eq!(t.groups(Dp), v(&[&[0, 2, 4, 6], &[1, 3, 5, 7]]));
    assert_eq!(t.groups(Ep), v(&[&[0, 1, 2, 3], &[4, 5, 6, 7]]));
    assert_eq!(t.groups(ExptDp), v(&[&[0, 4], &[1, 5], &[2, 6], &[3, 7]]));
}

#[test]
fn world8_expert_etp2_ep2_edp2() {
    let t = table(8, "tp=2,etp=2,ep=2");
    assert_eq!(t.groups(ExptTp), v(&[&[0, 1], &[2, 3], &[4, 5], &[6, 7]]));
    assert_eq!(t.groups(Ep), v(&[&[0, 2], &[1, 3], &[4, 6], &[5, 7]]));
    assert_eq!(t.groups(TpEp), v(&[&[0, 1, 2, 3], &[4, 5, 6, 7]]));
    assert_eq!(t.groups(ExptDp), v(&[&[0, 4], &[1, 5], &[2, 6], &[3, 7]]));
}

#[test]
fn world16_folding_ep_over_tp_cp() {
    let t = table(16, "tp=2,cp=2,pp=2,ep=4,etp=1");
    assert_eq!(
        &t.groups(Cp)[..5],
        &v(&[&[0, 2], &[1, 3], &[4, 6], &[5, 7], &[8, 10]])[..]
    );
    assert_eq!(
        &t.groups(Dp)[..5],
        &v(&[&[0, 4], &[1, 5], &[2, 6], &[3, 7], &[8, 12]])[..]
    );
    assert_eq!(
        t.groups(DpCp),
        v(&[
            &[0, 2, 4, 6],
            &[1, 3, 5, 7],
            &[8, 10, 12, 14],
            &[9, 11, 13, 15]
        ])
    );
    assert_eq!(
        &t.groups(TpCp)[..2],
        &v(&[&[0, 1, 2, 3], &[4, 5, 6, 7]])[..]
    );
    assert_eq!(
        &t.groups(Mp)[..2],
        &v(&[&[0, 1, 8, 9], &[2, 3, 10, 11]])[..]
    );
    let pp: Vec<Vec<usize>> = (0..8).map(|r| vec![r, r + 8]).collect();
    assert_eq!(t.groups(Pp), pp);
    let quads: Vec<Vec<usize>> = (0..4).map(|q| (4 * q..4 * q + 4).collect()).collect();
    assert_eq!(t.groups(Ep), quads);
    assert_eq!(t.groups(TpEp), quads);
    assert_eq!(
        &t.groups(ExptDp)[..5],
        &v(&[&[0, 4], &[1, 5], &[2, 6], &[3, 7], &[8, 12]])[..]
    );
    assert_eq!(
        t.groups(TpEpPp),
        v(&[&[0, 1, 2, 3, 8, 9, 10, 11], &[4, 5, 6, 7, 12, 13, 14, 15]])
    );
    assert_eq!(t.groups(Embd), pp);
}

#[test]
fn deepseek_v4_1024_ranks() {
    let layout = ParallelLayout::parse(1024, "pp=8,tp=1,cp=2,etp=1,ep=64").unwrap();
    assert_eq!((layout.dp, layout.edp), (64, 2));
    let t = GroupTable::new(&layout).unwrap();
    // Stage 0 holds ranks 0..127.
    let stage0: Vec<usize> = (0..128).collect();
    assert_eq!(t.group_of(DpCp, 0).unwrap(), &stage0[..]);
    let g = t.for_rank(0).unwrap();
    assert_eq!(g.get(Cp).ranks, vec![0, 1]);
    assert_eq!(g.get(Dp).ranks, (0..64).map(|i| 2 * i).collect::<Vec<_>>());
    assert_eq!(g.get(Ep).ranks, (0..64).collect::<Vec<_>>());
    assert_eq!(g.get(TpEp).ranks, (0..64).collect::<Vec<_>>());
    assert_eq!(g.get(ExptDp).ranks, vec![0, 64]);
    assert_eq!(g.get(Pp).ranks, (0..8).map(|p| 128 * p).collect::<Vec<_>>());
    assert_eq!(
        t.groups(Pp),
        layout.expert_generator().unwrap().get_ranks("pp").unwrap()
    );
    // 384 experts -> 6 per EP rank; ranks 0 and 64 hold the same experts, 0 and 1 do not.
    assert_eq!(g.local_expert_ids(384).unwrap(), 0..6);
    let r1 = t.for_rank(1).unwrap();
    assert_eq!(r1.local_expert_ids(384).unwrap(), 6..12);
    let r64 = t.for_rank(64).unwrap();
    assert_eq!(r64.local_expert_ids(384).unwrap(), 0..6);
    assert_eq!(r64.get(ExptDp).ranks, vec![0, 64]);
    assert!(!r1.get(ExptDp).ranks.contains(&0));
    // Coordinates: dense r = c + 2·d_a + 128·p; expert r = e + 64·d_e + 128·p.
    let r = 1 + 2 * 17 + 128 * 3;
    let g = t.for_rank(r).unwrap();
    assert_eq!((g.get(Cp).index, g.get(Dp).index, g.pp_rank()), (1, 17, 3));
    let r = 40 + 64 + 128 * 5;
    let g = t.for_rank(r).unwrap();
    assert_eq!((g.ep_rank(), g.get(ExptDp).index, g.pp_rank()), (40, 1, 5));
}

#[test]
fn uneven_experts_are_rejected() {
    let g = ProcessGroups::new(&ParallelLayout::parse(8, "ep=8").unwrap(), 3).unwrap();
    assert_eq!(g.local_expert_ids(16).unwrap(), 6..8);
    assert!(matches!(
        g.local_expert_ids(12),
        Err(BackendError::Layout { field: "ep", .. })
    ));
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Random valid layouts up to world 64.
fn random_layouts(count: usize) -> Vec<ParallelLayout> {
    let mut rng = SplitMix::new(0x5eed);
    let mut out = Vec::new();
    while out.len() < count {
        let world = 1 + rng.below(64);
        let pick = |rng: &mut SplitMix, n: usize| {
            let d = divisors(n);
            d[rng.below(d.len())]
        };
        let pp = pick(&mut rng, world);
        let tp = pick(&mut rng, world / pp);
        let cp = pick(&mut rng, world / (pp * tp));
        let etp = pick(&mut rng, world / pp);
        let ep = pick(&mut rng, world / (pp * etp));
        let spec = format!("tp={tp},cp={cp},pp={pp},ep={ep},etp={etp}");
        if let Ok(layout) = ParallelLayout::parse(world, &spec) {
            out.push(layout);
        }
    }
    out
}

#[test]
fn every_family_partitions_the_world() {
    for layout in random_layouts(300) {
        let t = GroupTable::new(&layout).unwrap();
        for family in GroupFamily::ALL {
            let mut seen = vec![0usize; layout.world];
            for group in t.groups(family) {
                for &r in group {
                    seen[r] += 1;
                }
            }
            if family == Embd {
                assert!(seen.iter().all(|&c| c <= 1), "{layout}: embd overlaps");
            } else {
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{layout}: {} not a partition",
                    family.name()
                );
            }
        }
        // Expected sizes.
        let size = |f| t.groups(f)[0].len();
        assert_eq!(size(Tp), layout.tp);
        assert_eq!(size(DpCp), layout.dp * layout.cp);
        assert_eq!(size(Ep), layout.ep);
        assert_eq!(size(ExptTp), layout.etp);
        assert_eq!(size(ExptDp), layout.edp);
        assert_eq!(size(Pp), layout.pp);
    }
}

#[test]
fn dense_and_expert_pp_groups_are_equal() {
    for layout in random_layouts(300) {
        let dense = layout.dense_generator().unwrap().get_ranks("pp").unwrap();
        let expert = layout.expert_generator().unwrap().get_ranks("pp").unwrap();
        assert_eq!(dense, expert, "{layout}");
    }
}

#[test]
fn tp_ep_groups_are_unions_of_matching_etp_and_ep_groups() {
    for layout in random_layouts(300) {
        let t = GroupTable::new(&layout).unwrap();
        for rank in 0..layout.world {
            let mut union: Vec<usize> = Vec::new();
            for &e in t.group_of(Ep, rank).unwrap() {
                union.extend_from_slice(t.group_of(ExptTp, e).unwrap());
            }
            union.sort_unstable();
            union.dedup();
            let mut tp_ep = t.group_of(TpEp, rank).unwrap().to_vec();
            tp_ep.sort_unstable();
            assert_eq!(union, tp_ep, "{layout} rank {rank}");
        }
        // Closed form: rows of arange(W).reshape(pp, edp, ep, etp) flattened over (ep, etp).
        if layout.order == crate::parallel::DEFAULT_ORDER {
            let per = layout.ep * layout.etp;
            let closed: Vec<Vec<usize>> = (0..layout.world / per)
                .map(|g| (g * per..(g + 1) * per).collect())
                .collect();
            assert_eq!(t.groups(TpEp), closed, "{layout}");
        }
    }
}
