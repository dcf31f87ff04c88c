//! FP8 primary weights in `DistributedAdamW`: the cast-and-gather protocol against the single-rank
//! cast of the gathered master (the property of docs/fp8.md §FP8 primary weights), the one-byte
//! parameter all-gather, the lossless re-quantisation by the FP8 GEMMs, packed parameters (codes
//! and scales held by the module, shared with the optimizer) training bit-identically to decoded
//! f32 ones, and the memory they hold.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::LinearConfig;
use burn::optim::GradientsParams;
use burn::tensor::activation::silu;
use burn::tensor::{DType, Tensor, bf16};

use super::*;
use crate::comm::World;
use crate::dispatch::TokenDispatcher;
use crate::fp8::gemm::quantize_weights;
use crate::fp8::{fp8_linear_forward, param_storage_bytes, quantize_blockwise};
use crate::layer::MoeLayer;
use crate::optim::tests::{LR, STEPS, T, ad, batch, config, rank_layer, reference_layer};
use crate::optim::{DistributedAdamW, MomentDtype};
use crate::parallel::{GroupFamily, ParallelLayout};
use crate::router::RouteOptions;
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

/// The packed FP8 weight each float parameter of a module holds (`None`: ordinary values).
fn module_packed<M: Module>(module: &M) -> HashMap<ParamId, Option<PackedFp8>> {
    struct Collect(HashMap<ParamId, Option<PackedFp8>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .insert(param.id, PackedFp8::from_tensor(&param.val()));
        }
    }
    let mut c = Collect(HashMap::new());
    module.visit(&mut c);
    c.0
}

/// What one rank checks after a step: every FP8 weight equals the single-rank blockwise cast
/// of its BF16-cast master (bytes and scales), the module holds those codes and scales (packed
/// storage: the optimizer's very storage, no copy) or the decoded values, and the FP8 GEMM's
/// own quantisation of those values is lossless (pow2 scales).
fn check_rank(optim: &DistributedAdamW, layer: &MoeLayer, config: &Fp8PrimaryConfig, what: &str) {
    let fp8 = optim.fp8.as_ref().unwrap();
    let held = module_packed(layer);
    for (id, packed) in &held {
        match (optim.packed_fp8_weight(*id), packed, config.storage) {
            (Some(mine), Some(p), Fp8Storage::Packed) => {
                assert_eq!(mine.grid(), p.grid(), "{what}: grid of {id}");
                assert!(
                    std::ptr::eq(mine.codes().as_ptr(), p.codes().as_ptr()),
                    "{what}: the module's FP8 codes of {id} are not the optimizer's storage"
                );
            }
            (Some(_), None, Fp8Storage::Decoded) | (None, None, _) => {}
            (mine, p, storage) => panic!(
                "{what}: parameter {id}: optimizer FP8 {}, module packed {} under {storage:?}",
                mine.is_some(),
                p.is_some()
            ),
        }
    }
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

/// The FP8 recipe the test layers compute with: the primary weights' square blocks (4×4 for
/// non-square ones, whose packed weights the GEMMs then re-quantise from their decoded values).
fn recipe_for(config: &Fp8PrimaryConfig) -> Fp8Recipe {
    let b = if config.block[0] == config.block[1] {
        config.block[0]
    } else {
        4
    };
    Fp8Recipe::new()
        .with_block_size(b)
        .with_pow2_scales(config.pow2_scales)
}

/// `sum(layer(x) · w)` with every FP8 primary weight consumed by the FP8 GEMMs: the routed
/// experts (the layer's recipe) and the shared experts' linears (`fp8_linear_forward`).
fn fp8_loss(
    layer: &MoeLayer,
    x: Tensor<2>,
    w: Tensor<2>,
    d: &dyn TokenDispatcher,
    recipe: &Fp8Recipe,
) -> Tensor<1> {
    let routed = MoeLayer {
        shared_experts: None,
        ..layer.clone()
    };
    let state = layer.router.init_state();
    let mut out = routed
        .forward_with(x.clone(), &state, &RouteOptions::default(), d)
        .unwrap()
        .output;
    if let Some(s) = &layer.shared_experts {
        let z = silu(fp8_linear_forward(&s.gate_proj, x.clone(), recipe))
            * fp8_linear_forward(&s.up_proj, x, recipe);
        out = out + fp8_linear_forward(&s.down_proj, z, recipe);
    }
    (out * w).sum()
}

/// What a rank's run saw: the loss bits of every step, and the flat `(dense, expert)`
/// parameter values (decoded) after enabling and after every step.
type RunTrace = (Vec<u32>, Vec<(Vec<f32>, Vec<f32>)>);

/// Trains `STEPS` steps from `reference` under `world` ranks of `spec` with FP8 primary
/// weights of `config`, checking every rank after enabling and after every step.
fn run(world: usize, spec: &str, config: Fp8PrimaryConfig, reference: &MoeLayer) -> Vec<RunTrace> {
    let layout = ParallelLayout::parse(world, spec).unwrap();
    let recipe = recipe_for(&config);
    let (layout_ref, reference_ref) = (&layout, reference);
    let results = World::run(world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let (dispatcher, layer) = rank_layer(&pg, layout_ref, reference_ref)?;
        let layer = layer.with_fp8_experts(Some(recipe))?;
        let mut optim = DistributedAdamW::new(
            &layer,
            &pg,
            ctx.world()?,
            crate::optim::tests::config(None, MomentDtype::F32),
        )?;
        let mut layer = optim.enable_fp8_primary_weights(layer, config, &select)?;
        let what = format!("world {world} `{spec}` {config:?} rank {}", ctx.rank());
        check_rank(&optim, &layer, &config, &format!("{what} init"));
        let mut trace: RunTrace = (Vec::new(), vec![optim.table().flatten_values(&layer)?]);
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
            let loss = fp8_loss(&layer, x, w, &dispatcher, &recipe);
            trace.0.push(loss.clone().into_scalar::<f32>().to_bits());
            let grads = GradientsParams::from_grads(loss.backward(), &layer);
            layer = optim.step(LR, layer, grads)?.0;
            check_rank(&optim, &layer, &config, &format!("{what} step {step}"));
            trace.1.push(optim.table().flatten_values(&layer)?);
        }
        Ok(trace)
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("world {world} `{spec}` rank {r}: {e}")))
        .collect()
}

/// The property of docs/fp8.md §FP8 primary weights through the optimizer: for DistOpt groups of
/// 1–4 ranks (EDP 1, 2, 3, 4; dense `dp_cp` up to 4), with shard boundaries cutting through blocks
/// and partial edge blocks, the gathered FP8 bytes and scales equal the single-rank cast, bit for
/// bit.
#[test]
fn fp8_primary_weights_equal_the_unsharded_cast_under_any_group_size() {
    for (block, pow2) in [([4, 4], true), ([3, 5], false), ([16, 16], true)] {
        let config = Fp8PrimaryConfig {
            block,
            pow2_scales: pow2,
            storage: Fp8Storage::Packed,
        };
        for (world, spec) in [
            (1, ""),
            (3, ""),
            (4, ""),
            (2, "ep=2"),
            (4, "ep=2"),
            (4, "ep=2,etp=2"),
        ] {
            run(world, spec, config, &reference_layer());
        }
    }
}

/// Packed FP8 primary parameters (the module holds the E4M3 codes and block scales, which the
/// FP8 GEMMs use as they are) train bit-identically to the decoded-f32 emulation (the module
/// holds `decode(q) · scale_inv` as f32 and the GEMMs re-quantise it): the same loss bits at
/// every step and the same parameters, under several layouts — with the GEMMs' blocks equal to
/// the primary blocks (the packed codes used directly) and with other blocks (decoded and
/// re-quantised in both).
#[test]
fn packed_fp8_primary_weights_train_bit_identically_to_decoded_ones() {
    for (block, pow2) in [([4, 4], true), ([3, 5], false)] {
        for (world, spec) in [(1, ""), (2, "ep=2"), (4, "ep=2")] {
            let config = Fp8PrimaryConfig {
                block,
                pow2_scales: pow2,
                storage: Fp8Storage::Packed,
            };
            let start = reference_layer();
            let packed = run(world, spec, config, &start);
            let decoded = run(
                world,
                spec,
                config.with_storage(Fp8Storage::Decoded),
                &start,
            );
            for (r, (p, d)) in packed.iter().zip(&decoded).enumerate() {
                let what = format!("{block:?} world {world} `{spec}` rank {r}");
                assert_eq!(p.0, d.0, "{what}: losses");
                assert!(p.0.iter().all(|b| f32::from_bits(*b).is_finite()), "{what}");
                for (step, (a, b)) in p.1.iter().zip(&d.1).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a.0), bits(&b.0), "{what}: dense values at {step}");
                    assert_eq!(bits(&a.1), bits(&b.1), "{what}: expert values at {step}");
                }
            }
        }
    }
}

/// The weight memory a module holds for an FP8-eligible layer (routed experts `[E, 2F, H]` /
/// `[E, H, F]`, a dense linear), measured from its parameters' storage: f32 before, packed FP8
/// primary weights after, against the BF16 reference (two bytes per element). The saving must
/// be at least 45% of the BF16 bytes (E4M3 is one byte plus one f32 scale per block).
#[test]
fn packed_fp8_primary_weights_hold_under_55_percent_of_bf16_bytes() {
    let (h, f, e, b) = (256, 128, 4, 128);
    let layout = ParallelLayout::parse(1, "").unwrap();
    let res = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let router = crate::router::TopKRouterConfig::new(h, e, 2);
        let layer = crate::layer::MoeLayerConfig::new(router, f).init(&ad())?;
        let linear = LinearConfig::new(h, 2 * h).with_bias(false).init(&ad());
        let recipe = Fp8Recipe::new().with_block_size(b);
        let config = Fp8PrimaryConfig::from_recipe(&recipe);
        let mut out = Vec::new();
        // The experts of an MoE layer.
        let before = param_storage_bytes(&layer.experts);
        let mut optim = DistributedAdamW::new(&layer, &pg, ctx.world()?, Default::default())?;
        let layer = optim.enable_fp8_primary_weights(layer, config, &Fp8ParamLayout::experts)?;
        out.push((e * 3 * f * h, before, param_storage_bytes(&layer.experts)));
        // A dense linear.
        let before = param_storage_bytes(&linear);
        let mut optim = DistributedAdamW::new(&linear, &pg, ctx.world()?, Default::default())?;
        let linear = optim.enable_fp8_primary_weights(linear, config, &Fp8ParamLayout::linear)?;
        out.push((2 * h * h, before, param_storage_bytes(&linear)));
        Ok(out)
    });
    for (numel, before, after) in res.into_iter().next().unwrap().unwrap() {
        let bf16 = 2 * numel;
        let saving = 1.0 - after as f64 / bf16 as f64;
        println!(
            "{numel} weights: f32 {before} B, BF16 reference {bf16} B, packed FP8 {after} B, \
             saving {:.1}% of BF16",
            100.0 * saving
        );
        assert_eq!(before, 4 * numel);
        assert!(after > numel, "codes and scales are stored");
        assert!(saving >= 0.45, "saving {saving}");
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
            storage: Fp8Storage::Packed,
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

/// Loaded FP8 weights are checked against their parameter's grid, and applied to the module.
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
            storage: Fp8Storage::Packed,
        };
        let layer2 =
            optim.enable_fp8_primary_weights(layer.clone(), config, &Fp8ParamLayout::experts)?;
        let good = optim.fp8_weight(id).unwrap();
        let wrong = optim.set_fp8_weights(HashMap::from([(id, bad)]));
        let router =
            optim.set_fp8_weights(HashMap::from([(layer2.router.weight.id, good.clone())]));
        // Loaded weights (here: other codes) reach the module's packed parameter on apply.
        let mut loaded = good.clone();
        loaded.data.iter_mut().for_each(|q| *q ^= 1);
        let ok = optim.set_fp8_weights(HashMap::from([(id, loaded.clone())]));
        let layer3 = optim.apply_fp8_weights(layer2)?;
        let held = PackedFp8::from_tensor(&layer3.experts.fc1.val()).expect("packed");
        let applied = held.codes() == &loaded.data[..] && held.scale_inv() == loaded.scale_inv;
        let same = optim.fp8_weight(id) == Some(loaded);
        Ok((
            off.is_err(),
            wrong.is_err(),
            router.is_err(),
            ok.is_ok() && applied && same,
        ))
    });
    assert_eq!(res[0].as_ref().unwrap(), &(true, true, true, true));
}
