//! FP8 primary weights in `DistributedAdamW`: the cast-and-gather protocol against the
//! single-rank cast of the gathered master (fp8.md §4 property), the one-byte parameter
//! all-gather, and the lossless re-quantisation by the FP8 GEMMs.

use burn::optim::GradientsParams;
use burn::tensor::{DType, bf16};

use super::*;
use crate::comm::World;
use crate::fp8::gemm::quantize_weights;
use crate::fp8::quantize_blockwise;
use crate::layer::MoeLayer;
use crate::optim::tests::{LR, STEPS, T, ad, batch, config, loss, rank_layer, reference_layer};
use crate::optim::{DistributedAdamW, MomentDtype};
use crate::parallel::{GroupFamily, ParallelLayout};
use crate::testing::{tensor, values};

fn slot(offset: usize, numel: usize) -> Fp8Slot {
    Fp8Slot {
        id: ParamId::new(),
        path: String::new(),
        offset,
        grid: BlockGrid::stacked(1, 1, numel, [1, 4], false).unwrap(),
    }
}

#[test]
fn segments_follow_slot_boundaries() {
    let slots = [slot(2, 3), slot(5, 2), slot(9, 4)];
    let segs: Vec<(usize, usize, Option<usize>)> = segments(0, 14, &slots)
        .iter()
        .map(|s| (s.start, s.end, s.slot))
        .collect();
    assert_eq!(
        segs,
        vec![
            (0, 2, None),
            (2, 5, Some(0)),
            (5, 7, Some(1)),
            (7, 9, None),
            (9, 13, Some(2)),
            (13, 14, None)
        ]
    );
    let cut: Vec<_> = segments(3, 10, &slots)
        .iter()
        .map(|s| (s.start, s.end, s.slot))
        .collect();
    assert_eq!(
        cut,
        vec![
            (3, 5, Some(0)),
            (5, 7, Some(1)),
            (7, 9, None),
            (9, 10, Some(2))
        ]
    );
    assert!(segments(4, 4, &slots).is_empty());
}

/// Routed experts and the shared expert's linears (a dense-class FP8 parameter next to the
/// f32 router and biases).
fn select(info: &ParamInfo) -> Option<Fp8ParamLayout> {
    if info.path.contains("shared_experts") && info.path.ends_with("weight") {
        Fp8ParamLayout::linear(info)
    } else {
        Fp8ParamLayout::experts(info)
    }
}

/// The full unpadded master of a class, gathered for the check.
fn full_master(shard: &crate::optim::distributed_adam::Shard) -> Vec<f32> {
    let mut v = values(shard.comm.all_gather(shard.master.clone()).unwrap())
        .into_iter()
        .map(|x| x as f32)
        .collect::<Vec<_>>();
    v.truncate(shard.len);
    v
}

/// What one rank checks after a step: every FP8 weight equals the single-rank blockwise cast
/// of its BF16-cast master (bytes and scales), the module holds the decoded values, and the
/// FP8 GEMM's own quantisation of those values is lossless (pow2 scales).
fn check_rank(optim: &DistributedAdamW, layer: &MoeLayer, config: &Fp8PrimaryConfig, what: &str) {
    let fp8 = optim.fp8.as_ref().unwrap();
    let (dense_vals, expert_vals) = optim.table().flatten_values(layer).unwrap();
    for (shard, slots, vals) in [
        (&optim.dense, &fp8.dense, &dense_vals),
        (&optim.expert, &fp8.expert, &expert_vals),
    ] {
        let master = full_master(shard);
        let mut covered = vec![false; shard.len];
        for s in slots {
            let g = s.grid;
            let w = optim.fp8_weight(s.id).unwrap();
            let canon_master: Vec<f32> = {
                let m = &master[s.offset..s.end()];
                // Storage -> canonical [matrices, rows, cols], BF16-cast (the model dtype).
                let per = g.rows * g.cols;
                (0..g.matrices)
                    .flat_map(|e| {
                        (0..g.rows).flat_map(move |r| {
                            (0..g.cols).map(move |c| {
                                let j = if g.transposed {
                                    c * g.rows + r
                                } else {
                                    r * g.cols + c
                                };
                                bf16::from_f32(m[e * per + j]).to_f32()
                            })
                        })
                    })
                    .collect()
            };
            let canon_bytes = w.canonical_data();
            for e in 0..g.matrices {
                let per = g.rows * g.cols;
                let q = quantize_blockwise(
                    &canon_master[e * per..(e + 1) * per],
                    g.rows,
                    g.cols,
                    [g.b0, g.b1],
                    Fp8Format::E4M3,
                    config.pow2_scales,
                )
                .unwrap();
                assert_eq!(
                    canon_bytes[e * per..(e + 1) * per],
                    q.data[..],
                    "{what}: `{}` matrix {e} bytes",
                    s.path
                );
                let nb = g.shape()[0] * g.shape()[1];
                assert_eq!(
                    w.scale_inv[e * nb..(e + 1) * nb],
                    q.scale_inv[..],
                    "{what}: `{}` matrix {e} scales",
                    s.path
                );
            }
            assert_eq!(
                vals[s.offset..s.end()],
                w.dequantize()[..],
                "{what}: `{}` module values are not the decoded FP8 weight",
                s.path
            );
            covered[s.offset..s.end()]
                .iter_mut()
                .for_each(|c| *c = true);
            if config.pow2_scales && !g.transposed && config.block[0] == config.block[1] {
                let recipe = Fp8Recipe::new().with_block_size(config.block[0]);
                let decoded = w.dequantize();
                let again = quantize_weights(&decoded, g.matrices, g.rows, g.cols, &recipe)
                    .unwrap()
                    .iter()
                    .flat_map(|b| b.dequantize())
                    .collect::<Vec<_>>();
                assert_eq!(again, decoded, "{what}: `{}` GEMM re-quantisation", s.path);
            }
        }
        // Everything else is the f32 master itself.
        for (i, c) in covered.iter().enumerate() {
            if !c {
                assert_eq!(vals[i], master[i], "{what}: f32 element {i}");
            }
        }
    }
}

fn run(world: usize, spec: &str, config: Fp8PrimaryConfig) {
    let layout = ParallelLayout::parse(world, spec).unwrap();
    let reference = reference_layer();
    let (layout_ref, reference_ref) = (&layout, &reference);
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let (dispatcher, layer) = rank_layer(&pg, layout_ref, reference_ref)?;
        let mut optim = DistributedAdamW::new(
            &layer,
            &pg,
            ctx.world()?,
            crate::optim::tests::config(None, MomentDtype::F32),
        )?;
        let mut layer = optim.enable_fp8_primary_weights(layer, config, &select)?;
        let what = format!("world {world} `{spec}` {config:?} rank {}", ctx.rank());
        check_rank(&optim, &layer, &config, &format!("{what} init"));
        for step in 0..STEPS {
            let r = ctx.rank();
            let x = tensor(
                batch(step, r, 1),
                [T, crate::optim::tests::H],
                &ad(),
                DType::F32,
            );
            let w = tensor(
                batch(step, r, 2),
                [T, crate::optim::tests::H],
                &ad(),
                DType::F32,
            );
            let grads =
                GradientsParams::from_grads(loss(&layer, x, w, &dispatcher).backward(), &layer);
            layer = optim.step(LR, layer, grads)?.0;
            check_rank(&optim, &layer, &config, &format!("{what} step {step}"));
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("world {world} `{spec}` rank {r}: {e}"));
    }
}

/// fp8.md §4 property through the optimizer: for DistOpt groups of 1–4 ranks (EDP 1, 2, 3, 4;
/// dense `dp_cp` up to 4), with shard boundaries cutting through blocks and partial edge
/// blocks, the gathered FP8 bytes and scales equal the single-rank cast, bit for bit.
#[test]
fn fp8_primary_weights_equal_the_unsharded_cast_under_any_group_size() {
    for (block, pow2) in [([4, 4], true), ([3, 5], false), ([16, 16], true)] {
        let config = Fp8PrimaryConfig {
            block,
            pow2_scales: pow2,
        };
        for (world, spec) in [
            (1, ""),
            (3, ""),
            (4, ""),
            (2, "ep=2"),
            (4, "ep=2"),
            (4, "ep=2,etp=2"),
        ] {
            run(world, spec, config);
        }
    }
}

/// The parameter all-gather of an all-FP8 class moves one byte per element (plus the packed
/// amax all-reduce), a quarter of the f32 gather.
#[test]
fn fp8_parameter_gather_sends_one_byte_per_element() {
    let layout = ParallelLayout::parse(4, "ep=2").unwrap();
    let reference = reference_layer();
    let (layout_ref, reference_ref) = (&layout, &reference);
    let results = World::run(4, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let (_, layer) = rank_layer(&pg, layout_ref, reference_ref)?;
        let mut optim = DistributedAdamW::new(
            &layer,
            &pg,
            ctx.world()?,
            crate::optim::tests::config(None, MomentDtype::F32),
        )?;
        let comm = pg.comm(GroupFamily::ExptDp).clone();
        let before = comm.traffic().bytes_sent;
        optim.gather_parameters()?;
        let f32_bytes = comm.traffic().bytes_sent - before;
        let config = Fp8PrimaryConfig {
            block: [8, 8],
            pow2_scales: true,
        };
        let before = comm.traffic().bytes_sent;
        let _ = optim.enable_fp8_primary_weights(layer, config, &Fp8ParamLayout::experts)?;
        let fp8_bytes = comm.traffic().bytes_sent - before;
        let blocks: usize = optim
            .fp8
            .as_ref()
            .unwrap()
            .expert
            .iter()
            .map(|s| s.grid.num_blocks())
            .sum();
        Ok((f32_bytes, fp8_bytes, blocks, optim.expert.size, comm.size()))
    });
    for res in results {
        let (f32_bytes, fp8_bytes, blocks, shard, n) = res.unwrap();
        let others = (n - 1) as u64;
        // All experts are FP8: the shard goes out as one byte per element (a quarter of the
        // f32 gather), the packed amaxes as f32 (one per 8x8 block).
        assert_eq!(f32_bytes, 4 * shard as u64 * others);
        assert_eq!(fp8_bytes, (shard as u64 + 4 * blocks as u64) * others);
        assert!(10 * fp8_bytes < 3 * f32_bytes, "{fp8_bytes} vs {f32_bytes}");
    }
}

/// Loaded FP8 weights are checked against their parameter's grid.
#[test]
fn set_fp8_weights_checks_grids() {
    let layer = reference_layer();
    let layout = ParallelLayout::parse(1, "").unwrap();
    let res = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut optim =
            DistributedAdamW::new(&layer, &pg, ctx.world()?, config(None, MomentDtype::F32))?;
        let id = layer.experts.fc1.id;
        let bad = Fp8Weight {
            grid: BlockGrid::new(1, 1, [1, 1])?,
            data: vec![0],
            scale_inv: vec![1.0],
        };
        let off = optim.set_fp8_weights(HashMap::from([(id, bad.clone())]));
        let config = Fp8PrimaryConfig {
            block: [4, 4],
            pow2_scales: true,
        };
        let layer2 =
            optim.enable_fp8_primary_weights(layer.clone(), config, &Fp8ParamLayout::experts)?;
        let good = optim.fp8_weight(id).cloned().unwrap();
        let wrong = optim.set_fp8_weights(HashMap::from([(id, bad)]));
        let router =
            optim.set_fp8_weights(HashMap::from([(layer2.router.weight.id, good.clone())]));
        let ok = optim.set_fp8_weights(HashMap::from([(id, good)]));
        Ok((off.is_err(), wrong.is_err(), router.is_err(), ok.is_ok()))
    });
    assert_eq!(res[0].as_ref().unwrap(), &(true, true, true, true));
}
