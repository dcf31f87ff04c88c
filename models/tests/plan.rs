//! The planner's per-rank parameter counts equal what the sharded models really hold on each
//! in-process rank.

use burn::module::Module;
use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::deepseek_v3::DeepseekV3;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::families::Family;
use moe_models::plan::rank_params_of;
use moe_models::qwen3_moe::Qwen3Moe;
use moe_models::{DeepseekV3Config, Qwen3MoeConfig};
use moe_models::{DeepseekV3ForCausalLM, Qwen3MoeForCausalLM};

const LAYOUTS: [(usize, &str); 6] = [
    (1, ""),
    (2, "ep=2"),
    (4, "tp=2,ep=4"),
    (4, "tp=2,ep=2,etp=2"),
    (4, "ep=2,etp=2"),
    (8, "tp=2,ep=4,etp=2"),
];

fn fixture(name: &str) -> String {
    format!(
        "{}/../tests/fixtures/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn qwen3_moe_rank_params_match_the_sharded_model() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let full = config.init(&Device::flex()).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = rank_params_of::<Qwen3MoeForCausalLM>(&config, &layout, 0)
            .unwrap()
            .total() as usize;
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard =
                Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(shard.model.num_params())
        }) {
            assert_eq!(held.unwrap(), planned, "{spec}");
        }
    }
    let single = ParallelLayout::single();
    assert_eq!(
        rank_params_of::<Qwen3MoeForCausalLM>(&config, &single, 0)
            .unwrap()
            .total(),
        moe_models::families::param_count::<Qwen3Moe>(&config)
            .unwrap()
            .total
    );
}

#[test]
fn deepseek_v3_rank_params_match_the_sharded_model() {
    // With its MTP module (on the one pipeline stage here).
    let config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    assert_eq!(config.num_nextn_predict_layers, 1);
    let full = config.init(&Device::flex()).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = rank_params_of::<DeepseekV3ForCausalLM>(&config, &layout, 0)
            .unwrap()
            .total() as usize;
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let shard =
                Sharded::<DeepseekV3ForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(shard.model.num_params())
        }) {
            assert_eq!(held.unwrap(), planned, "{spec}");
        }
    }
    // One rank: the main model and the MTP module without its stored copies of the
    // embedding and the head (the main model's, shared).
    let single = ParallelLayout::single();
    let count = moe_models::families::param_count::<DeepseekV3>(&config).unwrap();
    let copies = 2 * (config.vocab_size * config.hidden_size) as u64;
    assert_eq!(
        rank_params_of::<DeepseekV3ForCausalLM>(&config, &single, 0)
            .unwrap()
            .total(),
        count.total + count.mtp - copies
    );
}

/// Pipeline stages of DeepSeek-V3: the planner's per-stage parameters (the MTP module and the
/// last stage's copy of the embedding included) equal what each stage's shard holds.
#[test]
fn deepseek_v3_stage_params_match_the_sharded_stages() {
    let config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    let full = config.init(&Device::flex()).unwrap();
    for (world, spec) in [
        (3, "pp=3"),
        (4, "pp=2,ep=2,pp_layout=Et|ttmL"),
        (4, "tp=2,pp=2,pp_layout=Ett|tmL"),
        (2, "pp=2,vpp=2,pp_layout=E|t|t|tmL"),
    ] {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let stage = pg.groups.get(moe_backend::parallel::GroupFamily::Pp).index;
            let shard =
                Sharded::<DeepseekV3ForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok((stage, shard.model.num_params()))
        }) {
            let (stage, n) = held.unwrap();
            let planned = rank_params_of::<DeepseekV3ForCausalLM>(&config, &layout, stage)
                .unwrap()
                .total();
            assert_eq!(n as u64, planned, "{spec} stage {stage}");
        }
    }
}

/// The planner's optimizer traffic per step equals what the in-process ZeRO-1 step sends.
#[test]
fn zero1_step_traffic_matches_the_planner() {
    use burn::optim::GradientsParams;
    use moe_backend::optim::{DistributedAdamW, DistributedAdamWConfig};
    use moe_backend::parallel::GroupFamily;
    use moe_models::param_plan::Planned;
    use moe_models::plan::zero1_step_bytes;

    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let device = Device::flex().autodiff();
    let full = config.init(&device).unwrap();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let planned = zero1_step_bytes(
            &rank_params_of::<Qwen3MoeForCausalLM>(&config, &layout, 0).unwrap(),
            &layout,
        );
        let (full_ref, layout_ref, dev) = (&full, &layout, &device);
        for (rank, sent) in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let world_comm = ctx.world()?;
            let shard =
                Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let classes = shard
                .model
                .param_classes()
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let mut optim = DistributedAdamW::with_classes(
                &shard.model,
                &pg,
                world_comm.clone(),
                DistributedAdamWConfig::default(),
                &classes.classifier(),
            )?;
            let ids: Vec<i64> = (0..32).map(|i| (i * 7 % 256) as i64).collect();
            let out = shard
                .forward_loss(&ids, &ids, 2, dev)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let grads = GradientsParams::from_grads(out.loss.backward(), &shard.model);
            let comms = [
                pg.comm(GroupFamily::DpCp).clone(),
                pg.comm(GroupFamily::ExptDp).clone(),
                pg.comm(GroupFamily::Tp).clone(),
                world_comm,
            ];
            let sent = || comms.iter().map(|c| c.traffic().bytes_sent).sum::<u64>();
            let before = sent();
            optim.step(1e-3, shard.model.clone(), grads)?;
            Ok(sent() - before)
        })
        .into_iter()
        .enumerate()
        {
            assert_eq!(sent.unwrap(), planned, "{spec} rank {rank}");
        }
    }
}

/// Per-rank bytes of each collective family over one real training step (forward, backward,
/// ZeRO-1 optimizer step) equal the planner's, for the tiny Qwen3-MoE under several layouts.
///
/// The fixture runs in f32 (4-byte activations and probabilities); counts and routing maps
/// are the flex backend's default integer (int32, 4 bytes). TP, DP (`dp_cp`, `expt_dp`), the
/// norm all-reduce and the count exchange do not depend on routing; the EP all-to-all and ETP
/// volumes do, so the planner is fed the tokens per expert of every `tp_ep` member measured
/// from the router logits of a forward on the same weights and batch (Qwen3 routes to the
/// top-k logits). The AllGather dispatcher's volumes do not depend on routing.
#[test]
fn step_traffic_matches_the_planner() {
    use moe_backend::parallel::GroupFamily;
    use moe_models::distributed::DispatcherKind;
    use moe_models::plan::comm::{CommOptions, Dispatcher, Routing, step_traffic};
    use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

    const FAMILIES: [GroupFamily; 7] = [
        GroupFamily::Tp,
        GroupFamily::Cp,
        GroupFamily::Ep,
        GroupFamily::ExptTp,
        GroupFamily::TpEp,
        GroupFamily::DpCp,
        GroupFamily::ExptDp,
    ];
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let shape = Qwen3Moe::model_shape(&config).unwrap();
    let device = Device::flex().autodiff();
    let full = config.init(&device).unwrap();
    let (batch, seq) = (2, 8);
    let cases = [
        (4, "tp=2,ep=4", DispatcherKind::AllToAll),
        (4, "ep=2,etp=2", DispatcherKind::AllToAll),
        (4, "tp=2,ep=2,etp=2", DispatcherKind::AllToAll),
        (2, "", DispatcherKind::AllToAll),
        (4, "tp=2,ep=4", DispatcherKind::AllGather),
        (2, "cp=2", DispatcherKind::AllToAll),
        (8, "tp=2,cp=2,ep=2", DispatcherKind::AllToAll),
        (8, "cp=2,ep=4", DispatcherKind::AllToAll),
        // Keys and values passed around the ring send what the all-gather sends.
        (4, "cp=4;p2p", DispatcherKind::AllToAll),
        (8, "tp=2,cp=2,ep=2;p2p", DispatcherKind::AllToAll),
    ];
    for (world, spec, kind) in cases {
        let (layout_spec, cp_comm_type) = match spec.strip_suffix(";p2p") {
            Some(l) => (l, moe_models::distributed::CpCommType::P2p),
            None => (spec, moe_models::distributed::CpCommType::AllGather),
        };
        let layout = ParallelLayout::parse(world, layout_spec).unwrap();
        let (full_ref, layout_ref, dev) = (&full, &layout, &device);
        let top_k = config.num_experts_per_tok;
        let results = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let world_comm = ctx.world()?;
            let trainer_config = TrainerConfig {
                dispatcher: kind,
                cp_comm_type,
                ..TrainerConfig::default()
            };
            let mut trainer = Trainer::new(full_ref, &pg, world_comm.clone(), trainer_config, dev)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            // The context-parallel ranks of a replica share its batch.
            let replica = pg.groups.get(GroupFamily::Dp).index;
            let ids: Vec<i64> = (0..batch * seq)
                .map(|i| ((i * 37 + replica * 101 + 11) % 256) as i64)
                .collect();
            // Routing of this step: the same weights and batch, forward only.
            let out = trainer
                .model()
                .forward_loss(&ids, &ids, batch, dev)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let counts: Vec<Vec<f64>> = out
                .router_logits
                .iter()
                .map(|logits| {
                    let [t, e] = logits.dims();
                    let v = logits
                        .to_data()
                        .convert::<f32>()
                        .try_to_vec::<f32>()
                        .unwrap();
                    let mut c = vec![0.0; e];
                    for row in v.chunks(e).take(t) {
                        let mut idx: Vec<usize> = (0..e).collect();
                        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                        for &x in &idx[..top_k] {
                            c[x] += 1.0;
                        }
                    }
                    c
                })
                .collect();
            let sent = |c: &moe_backend::comm::Comm| c.traffic().bytes_sent;
            let before: Vec<u64> = FAMILIES.iter().map(|f| sent(pg.comm(*f))).collect();
            let world_before = sent(&world_comm);
            trainer
                .step(&TrainBatch::causal(ids, batch).unwrap())
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let mut bytes: Vec<u64> = FAMILIES
                .iter()
                .zip(&before)
                .map(|(f, b)| sent(pg.comm(*f)) - b)
                .collect();
            bytes.push(sent(&world_comm) - world_before);
            let tp_ep = pg.groups.get(GroupFamily::TpEp);
            Ok((tp_ep.ranks.clone(), tp_ep.index, counts, bytes))
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>();
        let params = rank_params_of::<Qwen3MoeForCausalLM>(&config, &layout, 0).unwrap();
        let opts = CommOptions {
            seq,
            micro_batch: batch,
            microbatches: 1,
            vpp: 1,
            act_bytes: 4,
            prob_bytes: 4,
            int_bytes: 4,
            dispatcher: match kind {
                DispatcherKind::AllGather => Dispatcher::AllGather,
                _ => Dispatcher::AllToAll,
            },
        };
        for (rank, (group, member, _, measured)) in results.iter().enumerate() {
            let moe_layers = results[rank].2.len();
            let routing = Routing::Measured(
                (0..moe_layers)
                    .map(|l| group.iter().map(|&r| results[r].2[l].clone()).collect())
                    .collect(),
            );
            let plan = step_traffic(&shape, &params, &layout, &opts, 0, *member, &routing)
                .unwrap()
                .total;
            let planned = [
                plan.tp,
                plan.cp,
                plan.ep,
                plan.expt_tp,
                plan.tp_ep,
                plan.dp_cp,
                plan.expt_dp,
                plan.world,
            ];
            let planned: Vec<u64> = planned.iter().map(|&b| b as u64).collect();
            assert_eq!(
                &planned, measured,
                "{spec} {kind:?} rank {rank}: [tp, cp, ep, expt_tp, tp_ep, dp_cp, expt_dp, world]"
            );
        }
    }
}

/// `--search`: DeepSeek-V3 on 256 GPUs with the GB200's 192 GB (report Table 17): the best
/// layouts are valid training layouts and fit; a 1 GB budget is refused with a clear error.
#[test]
fn search_ranks_valid_layouts_that_fit() {
    use moe_models::plan::PlanOptions;
    use moe_models::plan::search::{Hardware, search};
    use moe_models::plan::shape::PlannedModel;

    let config = DeepseekV3Config::from_json_str(
        r#"{"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "first_k_dense_replace": 3}"#,
    )
    .unwrap();
    let model = PlannedModel::of::<DeepseekV3>(&config).unwrap().unwrap();
    let opts = PlanOptions {
        global_batch: Some(8192),
        ..PlanOptions::default()
    };
    let hw = Hardware {
        memory_bytes: 192e9,
        peak_flops: 989e12,
        link_bytes_per_s: 400e9,
    };
    let found = search(&model, 256, &opts, &hw, 5).unwrap();
    assert_eq!(found.len(), 5);
    for c in &found {
        let l = &c.plan.layout;
        let again = ParallelLayout::parse(
            256,
            &format!("tp={},pp={},ep={},etp={}", l.tp, l.pp, l.ep, l.etp),
        )
        .unwrap();
        assert_eq!(&again, l);
        assert!(c.plan.peak_memory() <= 192e9, "{l}");
        assert_eq!(256 % l.ep, 0);
    }
    assert!(found.windows(2).all(|w| w[0].step_s() <= w[1].step_s()));
    let tiny = Hardware {
        memory_bytes: 1e9,
        ..hw
    };
    let err = search(&model, 256, &opts, &tiny, 5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fits in 1.0 GB"), "{err}");
}

/// DeepSeek-V3's MLA under context parallelism: each attention layer all-gathers the
/// compressed latent and the shared rotary key (not the per-head keys and values) over `cp`,
/// and the planner's `cp` (and `tp`, `dp_cp`) traffic equals what a real training step sends.
/// No expert parallelism, so the routing does not enter; no MTP module (the planner's shape
/// has none).
#[test]
fn mla_context_parallel_traffic_matches_the_planner() {
    use moe_backend::parallel::GroupFamily;
    use moe_models::plan::comm::{CommOptions, Dispatcher, Routing, step_traffic};
    use moe_models::train::{TrainBatch, Trainer, TrainerConfig};

    const FAMILIES: [GroupFamily; 3] = [GroupFamily::Tp, GroupFamily::Cp, GroupFamily::DpCp];
    let mut config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    config.num_nextn_predict_layers = 0;
    let shape = DeepseekV3::model_shape(&config).unwrap();
    let device = Device::flex().autodiff();
    let full = config.init(&device).unwrap();
    let (batch, seq) = (2, 8);
    for (world, spec) in [(2, "cp=2"), (4, "tp=2,cp=2"), (4, "cp=2")] {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let (full_ref, layout_ref, dev) = (&full, &layout, &device);
        let measured = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let trainer_config = TrainerConfig {
                mtp_loss_scaling_factor: 0.0,
                ..TrainerConfig::default()
            };
            let mut trainer = Trainer::new(full_ref, &pg, ctx.world()?, trainer_config, dev)
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            let replica = pg.groups.get(GroupFamily::Dp).index;
            let ids: Vec<i64> = (0..batch * seq)
                .map(|i| ((i * 37 + replica * 101 + 11) % 256) as i64)
                .collect();
            let sent = |c: &moe_backend::comm::Comm| c.traffic().bytes_sent;
            let before: Vec<u64> = FAMILIES.iter().map(|f| sent(pg.comm(*f))).collect();
            trainer
                .step(&TrainBatch::causal(ids, batch).unwrap())
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok(FAMILIES
                .iter()
                .zip(&before)
                .map(|(f, b)| sent(pg.comm(*f)) - b)
                .collect::<Vec<u64>>())
        });
        let params = rank_params_of::<DeepseekV3ForCausalLM>(&config, &layout, 0).unwrap();
        let opts = CommOptions {
            seq,
            micro_batch: batch,
            microbatches: 1,
            vpp: 1,
            act_bytes: 4,
            prob_bytes: 4,
            int_bytes: 4,
            dispatcher: Dispatcher::AllToAll,
        };
        let plan = step_traffic(&shape, &params, &layout, &opts, 0, 0, &Routing::Uniform)
            .unwrap()
            .total;
        let planned: Vec<u64> = [plan.tp, plan.cp, plan.dp_cp]
            .iter()
            .map(|&b| b as u64)
            .collect();
        assert!(planned[1] > 0, "{spec}: the layers exchange latents");
        for (rank, got) in measured.into_iter().enumerate() {
            assert_eq!(got.unwrap(), planned, "{spec} rank {rank}: [tp, cp, dp_cp]");
        }
    }
}

/// Parameters of each Qwen3-MoE part, computed from the config alone (not by the planner):
/// `(embedding, final norm + untied head, decoder layer l)`.
fn qwen3_moe_part_params(c: &Qwen3MoeConfig) -> (u64, u64, Vec<u64>) {
    let (v, h) = (c.vocab_size as u64, c.hidden_size as u64);
    let (nh, nkv, hd) = (
        c.num_attention_heads as u64,
        c.num_key_value_heads as u64,
        c.head_dim as u64,
    );
    let embedding = v * h;
    let head = h + if c.tie_word_embeddings { 0 } else { v * h };
    // q, k, v, o projections; q/k norms; input and post-attention norms.
    let attention = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 2 * hd + 2 * h;
    let layers = (0..c.num_hidden_layers)
        .map(|l| {
            let mlp = if c.is_moe_layer(l) {
                let (e, f) = (c.num_experts as u64, c.moe_intermediate_size as u64);
                e * h + e * 3 * h * f
            } else {
                3 * h * c.intermediate_size as u64
            };
            attention + mlp
        })
        .collect();
    (embedding, head, layers)
}

/// An uneven (explicit) pipeline layout gives each stage exactly the parameters of what it
/// holds: its layers, the embedding where `E` is, the final norm and head where `L` is; the
/// same numbers the sharded model holds on each pipeline rank.
#[test]
fn explicit_pipeline_layouts_give_each_stage_its_parameters() {
    use moe_backend::parallel::GroupFamily;
    use moe_models::plan::shape::PlannedModel;
    use moe_models::plan::{PlanOptions, plan_layout};

    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let (embedding, head, layers) = qwen3_moe_part_params(&config);
    assert_eq!(
        embedding + head + layers.iter().sum::<u64>(),
        moe_models::families::param_count::<Qwen3Moe>(&config)
            .unwrap()
            .total
    );
    let model = PlannedModel::of::<Qwen3Moe>(&config.clone())
        .unwrap()
        .unwrap();
    let opts = PlanOptions {
        seq: 16,
        global_batch: None,
        ..PlanOptions::default()
    };
    let full = config.init(&Device::flex()).unwrap();
    // Per pipeline rank: embedding?, head?, layers.
    type Holds = Vec<(bool, bool, Vec<usize>)>;
    // (world, layout, what each rank holds)
    let cases: [(usize, &str, Holds); 5] = [
        (
            2,
            "pp=2,pp_layout=Et|t*2L",
            vec![(true, false, vec![0]), (false, true, vec![1, 2])],
        ),
        (
            2,
            "pp=2,pp_layout=Et*2|tL",
            vec![(true, false, vec![0, 1]), (false, true, vec![2])],
        ),
        (
            3,
            "pp=3,pp_layout=E|t*2|tL",
            vec![
                (true, false, vec![]),
                (false, false, vec![0, 1]),
                (false, true, vec![2]),
            ],
        ),
        // Interleaved: rank 0 holds virtual stages 0 (E) and 2 (layer 1), rank 1 holds 1
        // (layer 0) and 3 (layer 2, L).
        (
            2,
            "pp=2,vpp=2,pp_layout=E|t|t|tL",
            vec![(true, false, vec![1]), (false, true, vec![0, 2])],
        ),
        // Without a layout the planner splits 3 layers over 2 stages as 2 + 1 (as it always
        // did; training needs the layout for that).
        (
            2,
            "pp=2",
            vec![(true, false, vec![0, 1]), (false, true, vec![2])],
        ),
    ];
    for (world, spec, holds) in cases {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let plan = plan_layout(&model, &layout, &opts).unwrap();
        assert_eq!(plan.stages.len(), holds.len(), "{spec}");
        for (stage, (e, l, held)) in plan.stages.iter().zip(&holds) {
            let want = u64::from(*e) * embedding
                + u64::from(*l) * head
                + held.iter().map(|&i| layers[i]).sum::<u64>();
            assert_eq!(stage.params.total(), want, "{spec} stage {}", stage.stage);
            assert_eq!(
                (stage.holds_embedding(), stage.holds_head()),
                (*e, *l),
                "{spec} stage {}",
                stage.stage
            );
            let mut got: Vec<usize> = stage.chunks.iter().flat_map(|p| p.layers.clone()).collect();
            got.sort_unstable();
            assert_eq!(&got, held, "{spec} stage {}", stage.stage);
            // The per-rank wrapper follows the layout's split too.
            assert_eq!(
                rank_params_of::<Qwen3MoeForCausalLM>(&config, &layout, stage.stage)
                    .unwrap()
                    .total(),
                want,
                "{spec}"
            );
        }
        let json = plan.to_json();
        assert_eq!(
            json["pipeline_layout"].as_str(),
            layout.pp_layout.as_deref(),
            "{spec}"
        );
        if spec.contains("pp_layout") {
            // The explicit layout, normalised.
            let split = json["pipeline_split"].as_str().unwrap().to_string();
            let again = moe_backend::parallel::pipeline::PipelineSplit::parse(
                &split, 3, 0, layout.pp, layout.vpp,
            )
            .unwrap();
            assert_eq!(&again, &plan.split, "{spec}");
        }
        // The sharded model holds the same on each pipeline rank (an even split is what
        // training needs without a layout, so only explicit layouts run).
        if !spec.contains("pp_layout") {
            continue;
        }
        let (full_ref, layout_ref) = (&full, &layout);
        for held in World::run(world, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let rank = pg.groups.get(GroupFamily::Pp).index;
            let shard =
                Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok((rank, shard.model.num_params()))
        }) {
            let (rank, n) = held.unwrap();
            assert_eq!(
                n as u64,
                plan.stages[rank].params.total(),
                "{spec} rank {rank}"
            );
        }
    }
}

/// A pipeline layout that does not cover the model, has the wrong number of stages or misses
/// the MTP modules is refused naming `pipeline_layout`; too few layers for the stages without
/// one is refused as before.
#[test]
fn bad_pipeline_layouts_are_refused_naming_pipeline_layout() {
    use moe_models::plan::shape::PlannedModel;
    use moe_models::plan::{PlanOptions, plan_layout};

    let opts = PlanOptions {
        seq: 16,
        ..PlanOptions::default()
    };
    let qwen =
        PlannedModel::of::<Qwen3Moe>(&Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap())
            .unwrap()
            .unwrap();
    let deepseek = PlannedModel::of::<DeepseekV3>(
        &DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap(),
    )
    .unwrap()
    .unwrap();
    assert_eq!(deepseek.mtp_modules(), 1);
    for (model, spec, says) in [
        (&qwen, "pp=2,pp_layout=Et|tL", "places 2 decoder layers"),
        (&qwen, "pp=2,pp_layout=Et|t*4L", "places 5 decoder layers"),
        (&qwen, "pp=2,pp_layout=Et|t|tL", "has 3 stages"),
        (&qwen, "pp=2,vpp=2,pp_layout=Et|t*2L", "has 2 stages"),
        (&deepseek, "pp=2,pp_layout=Et|t*2L", "MTP"),
    ] {
        let layout = ParallelLayout::parse_spec(spec).unwrap();
        let err = plan_layout(model, &layout, &opts).unwrap_err().to_string();
        assert!(err.contains("pipeline_layout"), "{spec}: {err}");
        assert!(err.contains(says), "{spec}: {err}");
    }
    // DeepSeek-V3's MTP module goes where the layout puts it (with the loss).
    let layout = ParallelLayout::parse_spec("pp=2,pp_layout=Et|t*2mL").unwrap();
    let plan = plan_layout(&deepseek, &layout, &opts).unwrap();
    let mtp: Vec<usize> = plan.stages.iter().map(|s| s.mtp_modules()).collect();
    assert_eq!(mtp, [0, 1]);
    let json = plan.to_json();
    assert_eq!(json["stages"][1]["mtp_modules"].as_u64(), Some(1));
    assert_eq!(json["stages"][1]["head"].as_bool(), Some(true));
    assert_eq!(json["stages"][0]["embedding"].as_bool(), Some(true));
    // Without a layout: the contiguous split, MTP on the last stage.
    let plain = plan_layout(
        &deepseek,
        &ParallelLayout::parse_spec("pp=2").unwrap(),
        &opts,
    )
    .unwrap()
    .to_json();
    assert_eq!(plain["pipeline_split"].as_str(), Some("Et*2|t*1m*1L"));
    assert!(plain["pipeline_layout"].is_null());
    // More stages than layers without a layout: refused as before (naming the layers).
    let err = plan_layout(&qwen, &ParallelLayout::parse_spec("pp=4").unwrap(), &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 layers over 4"), "{err}");
    // ... but an explicit layout may give a stage no layer.
    plan_layout(
        &qwen,
        &ParallelLayout::parse_spec("pp=4,pp_layout=E|t|t|tL").unwrap(),
        &opts,
    )
    .unwrap();
}

/// `vpp=V` in the layout plans what `PlanOptions::vpp` (`moe plan --vpp`) plans; the activation
/// and communication figures equal the contiguous-split functions' with that `vpp`; a
/// contradiction, or `vpp` without pipeline stages, is refused naming `vpp`.
#[test]
fn vpp_from_the_layout_equals_the_vpp_option() {
    use moe_models::plan::activations::stage_activations;
    use moe_models::plan::comm::{Routing, step_traffic};
    use moe_models::plan::shape::PlannedModel;
    use moe_models::plan::{PlanOptions, plan_layout};

    let mut config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    config.num_hidden_layers = 10;
    let model = PlannedModel::of::<Qwen3Moe>(&config).unwrap().unwrap();
    let shape = model.shape();
    let opts = PlanOptions {
        seq: 16,
        global_batch: Some(16),
        ..PlanOptions::default()
    };
    for (world, pp, vpp) in [(2, 2, 2), (4, 2, 2), (4, 4, 2), (2, 2, 5), (3, 3, 3)] {
        let from_layout = ParallelLayout::parse(world, &format!("pp={pp},vpp={vpp}")).unwrap();
        let plain = ParallelLayout::parse(world, &format!("pp={pp}")).unwrap();
        let a = plan_layout(&model, &from_layout, &opts).unwrap();
        let with_option = PlanOptions {
            vpp,
            ..opts.clone()
        };
        let b = plan_layout(&model, &plain, &with_option).unwrap();
        // The same vpp given both ways agrees.
        let c = plan_layout(&model, &from_layout, &with_option).unwrap();
        assert_eq!((a.vpp, b.vpp), (vpp, vpp));
        assert_eq!(a.stages, b.stages, "pp {pp} vpp {vpp}");
        assert_eq!(a.stages, c.stages);
        assert_eq!(a.split, b.split);
        let (mut ja, jb) = (a.to_json(), b.to_json());
        ja["layout"] = jb["layout"].clone();
        assert_eq!(ja, jb);
        let act = with_option.activations(a.microbatches);
        let comm = with_option.comm(a.microbatches);
        for s in &a.stages {
            assert_eq!(s.chunks.len(), vpp);
            assert_eq!(
                s.activations,
                stage_activations(&shape, &plain, &act, s.stage),
                "pp {pp} vpp {vpp} stage {}",
                s.stage
            );
            let traffic = step_traffic(
                &shape,
                &s.params,
                &plain,
                &comm,
                s.stage,
                0,
                &Routing::Uniform,
            )
            .unwrap();
            assert_eq!(s.traffic, traffic, "pp {pp} vpp {vpp} stage {}", s.stage);
        }
    }
    let layout = ParallelLayout::parse(2, "pp=2,vpp=2").unwrap();
    let three = PlanOptions {
        vpp: 3,
        ..opts.clone()
    };
    let err = plan_layout(&model, &layout, &three)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vpp"), "{err}");
    let err = plan_layout(&model, &ParallelLayout::single(), &three)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vpp") && err.contains("pp > 1"), "{err}");
}

/// With a tied output layer the last pipeline stage keeps a copy of the embedding (Megatron's
/// embedding group): the planner counts it there, as the sharded model holds it.
#[test]
fn a_tied_embedding_is_counted_on_the_last_stage_too() {
    use moe_backend::parallel::GroupFamily;
    use moe_models::plan::shape::PlannedModel;
    use moe_models::plan::{PlanOptions, plan_layout};

    let mut config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    config.tie_word_embeddings = true;
    let (embedding, head, layers) = qwen3_moe_part_params(&config);
    let model = PlannedModel::of::<Qwen3Moe>(&config.clone())
        .unwrap()
        .unwrap();
    let opts = PlanOptions {
        seq: 16,
        global_batch: None,
        ..PlanOptions::default()
    };
    let layout = ParallelLayout::parse(2, "pp=2,pp_layout=Et|t*2L").unwrap();
    let plan = plan_layout(&model, &layout, &opts).unwrap();
    let want = [
        embedding + layers[0],
        embedding + head + layers[1] + layers[2],
    ];
    let full = config.init(&Device::flex()).unwrap();
    let (full_ref, layout_ref) = (&full, &layout);
    for held in World::run(2, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let rank = pg.groups.get(GroupFamily::Pp).index;
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
            .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
        Ok((rank, shard.model.num_params()))
    }) {
        let (rank, n) = held.unwrap();
        assert_eq!(plan.stages[rank].params.total(), want[rank], "rank {rank}");
        assert_eq!(n as u64, want[rank], "the sharded model on rank {rank}");
    }
}

/// The planner follows the training precision: under `--fp32` every rank's parameters and the
/// activations passed between pipeline stages take 4 bytes instead of BF16's 2, while the f32
/// main weights and moments do not change.
#[test]
fn the_plan_follows_the_training_precision() {
    use moe_backend::optim::Precision;
    use moe_models::plan::shape::PlannedModel;
    use moe_models::plan::{PlanOptions, plan_layout};
    let model =
        PlannedModel::of::<Qwen3Moe>(&Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap())
            .unwrap()
            .unwrap();
    let layout = ParallelLayout::parse(4, "pp=2,ep=2,pp_layout=Et|t*2L").unwrap();
    let plan = |precision| {
        let opts = PlanOptions {
            seq: 16,
            precision,
            ..PlanOptions::default()
        };
        plan_layout(&model, &layout, &opts).expect("plan")
    };
    let (bf16, f32) = (plan(Precision::Bf16), plan(Precision::F32));
    for (a, b) in bf16.stages.iter().zip(&f32.stages) {
        assert!(a.state.weights > 0.0);
        assert_eq!(b.state.weights, 2.0 * a.state.weights, "stage {}", a.stage);
        assert_eq!(b.state.master, a.state.master, "stage {}", a.stage);
        assert_eq!(b.state.moments, a.state.moments, "stage {}", a.stage);
        assert!(a.traffic.total.pp > 0.0);
        assert_eq!(
            b.traffic.total.pp,
            2.0 * a.traffic.total.pp,
            "stage {}",
            a.stage
        );
    }
}

/// The planner's per-rank parameters of the families added through the family list (their
/// fixtures), read off each family's plan, equal what a real shard loaded from the HF
/// directory holds, on every rank and pipeline stage, under TP, EP × ETP and PP.
#[test]
fn every_family_rank_params_match_the_loaded_shard() {
    use moe_models::families::{Family, FamilyVisitor, visit_family};
    use moe_models::hf::load_shard_checked;

    struct Check(&'static str, (usize, &'static str));
    impl FamilyVisitor for Check {
        type Output = ();
        fn visit<F: Family>(self) {
            let (name, pp) = (self.0, self.1);
            let dir = format!("{}/../tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(format!("{dir}/config.json")).unwrap();
            let config =
                <F::Config as moe_models::families::FamilyConfig>::from_json_str(&text).unwrap();
            let ckpt = moe_bridge::hf::HfCheckpoint::open(&dir).unwrap();
            for (world, spec) in [(2, "ep=2"), (4, "tp=2,ep=2,etp=2"), pp] {
                let layout = ParallelLayout::parse(world, spec).unwrap();
                let (ckpt, layout_ref) = (&ckpt, &layout);
                let held = World::run(world, |ctx| {
                    let pg = ctx.process_groups(layout_ref)?;
                    let stage = pg.groups.get(moe_backend::parallel::GroupFamily::Pp).index;
                    let (shard, _) = load_shard_checked::<F::Model>(
                        ckpt,
                        &pg,
                        DispatcherKind::AllToAll,
                        &Device::flex(),
                    )
                    .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
                    Ok((stage, shard.model.num_params()))
                });
                for (rank, r) in held.into_iter().enumerate() {
                    let (stage, held) =
                        r.unwrap_or_else(|e| panic!("{name} {spec} rank {rank}: {e}"));
                    let planned = rank_params_of::<F::Model>(&config, &layout, stage)
                        .unwrap()
                        .total() as usize;
                    assert_eq!(held, planned, "{name} {spec} rank {rank} (stage {stage})");
                }
            }
        }
    }
    // Pipeline stages over the fixtures' layers (GLM-4.5's 3 layers and MTP layer over 3).
    for (model_type, pp) in [
        ("mixtral", (2, "pp=2")),
        ("glm4_moe", (3, "pp=3")),
        ("gpt_oss", (2, "pp=2")),
    ] {
        visit_family(model_type, Check(model_type, pp)).expect("a listed family");
    }
}
