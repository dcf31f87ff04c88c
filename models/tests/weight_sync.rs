//! Weight sync from a training layout (issue 19, item 6): after one training step under
//! `tp=2,ep=4`, `ep=2,etp=2` and `tp=2,ep=2,etp=2` (4 in-process ranks), the model a
//! [`ModelReceiver`] rebuilds from the synced buckets equals the full model gathered from the
//! same trainer — bit for bit in f32, the bf16 rounding of it in bf16 — for Qwen3-MoE and
//! DeepSeek-V3 (MTP included), with per-expert and fused expert names, delivered to rank 0 or
//! broadcast to every rank; and no rank holds more than one bucket plus one tensor's pieces.
//! Under pipeline and context parallelism (issue 36: `pp=2,ep=2`, `pp=2,vpp=2`, `pp=2,cp=2`,
//! an uneven `pp_layout` and `tp=2,pp=2,ep=2,etp=2`) the synced tensors equal the HF export
//! (`moe export`'s conversion) of the trained model's distributed checkpoint.

use burn::module::{ModuleMapper, Param};
use burn::tensor::{Device, Tensor, bf16};
use moe_backend::BackendError;
use moe_backend::comm::{GroupComms, World};
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{CausalLmShard, ParallelCausalLm, gather_full};
use moe_models::export::{ExportHf, export_hf_tensors};
use moe_models::families::gpt_oss::{GptOssConfig, GptOssForCausalLM};
use moe_models::families::mixtral::{MixtralConfig, MixtralForCausalLM};
use moe_models::train::{TrainBatch, Trainer, TrainerConfig};
use moe_models::weight_sync::{
    ExpertNames, ModelReceiver, SyncDest, SyncDtype, SyncOptions, SyncStats, SyncTarget,
    WeightSync, WeightSyncError, sync_weights,
};
use moe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3MoeConfig};
use moe_models::{Qwen3MoeForCausalLM, deepseek_v3::DeepseekV3FeedForward};

const LAYOUTS: [(usize, &str); 3] = [(4, "tp=2,ep=4"), (4, "ep=2,etp=2"), (4, "tp=2,ep=2,etp=2")];
const BUCKET: usize = 16 << 10;
const S: usize = 8;

fn fixture(name: &str) -> String {
    format!(
        "{}/../tests/fixtures/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn be(e: impl std::fmt::Display) -> BackendError {
    BackendError::Replay(e.to_string())
}

/// A model the test trains, gathers and syncs.
trait Case: ParallelCausalLm + ExportHf + SyncTarget + Clone + Send + Sync {
    fn gather(shard: &Self::Shard, pg: &GroupComms) -> Result<Self, ModelError>;
    fn shard_model(shard: &Self::Shard) -> &Self {
        shard.model()
    }
}

impl Case for Qwen3MoeForCausalLM {
    fn gather(shard: &Self::Shard, pg: &GroupComms) -> Result<Self, ModelError> {
        gather_full(shard, pg)
    }
}

impl Case for GptOssForCausalLM {
    fn gather(shard: &Self::Shard, pg: &GroupComms) -> Result<Self, ModelError> {
        gather_full(shard, pg)
    }
}

impl Case for MixtralForCausalLM {
    fn gather(shard: &Self::Shard, pg: &GroupComms) -> Result<Self, ModelError> {
        gather_full(shard, pg)
    }
}

impl Case for DeepseekV3ForCausalLM {
    fn gather(shard: &Self::Shard, pg: &GroupComms) -> Result<Self, ModelError> {
        gather_full(shard, pg)
    }
}

/// Zeroes every float parameter: the rollout model before its first sync.
struct Zero;
impl ModuleMapper for Zero {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, _) = param.consume();
        Param::initialized(id, t.zeros_like())
    }
}

type Tensors = Vec<(String, Vec<usize>, Vec<u8>)>;

fn tensors<M: ExportHf>(m: &M) -> Tensors {
    export_hf_tensors(m)
        .expect("export")
        .map(|(name, data)| (name, data.shape().to_vec(), data.as_bytes().to_vec()))
        .collect()
}

/// `t` (f32 bytes) rounded to bf16 and back, as a bf16 sync followed by an f32 model gives.
fn bf16_rounded(t: &Tensors) -> Tensors {
    t.iter()
        .map(|(name, shape, bytes)| {
            let rounded = bytes
                .chunks_exact(4)
                .flat_map(|b| {
                    let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    let v = if name.ends_with("e_score_correction_bias") {
                        v
                    } else {
                        bf16::from_f32(v).to_f32()
                    };
                    v.to_le_bytes()
                })
                .collect();
            (name.clone(), shape.clone(), rounded)
        })
        .collect()
}

/// The batch of `replica` (8 tokens per row, 2 rows).
fn batch(replica: usize, vocab: usize) -> TrainBatch {
    let ids: Vec<i64> = (0..2 * S)
        .map(|i| ((replica * 31 + i * 7 + 3) % vocab) as i64)
        .collect();
    TrainBatch::new(ids.clone(), ids, 2).expect("batch")
}

/// What one rank reports: its stats per sync, the model it received per sync (if any) and
/// the gathered reference.
type RankResult = (Vec<SyncStats>, Vec<Option<Tensors>>, Tensors);

/// Trains `full` one step under `layout`, then syncs it with each of `options` into a zeroed
/// rollout model (`dest` rank 0 unless the options say otherwise).
fn train_and_sync<M: Case>(
    full: &M,
    layout: &ParallelLayout,
    options: &[SyncOptions],
    broadcast: &[bool],
) -> Vec<RankResult> {
    let vocab = full.hf_tensors().expect("export").specs()[0].shape[0];
    World::run(layout.world, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let device = Device::flex().autodiff();
        let config = TrainerConfig {
            lr: 1e-2,
            expert_bias_update_rate: Some(1e-2),
            ..TrainerConfig::default()
        };
        let mut trainer = Trainer::new(full, &pg, world.clone(), config, &device).map_err(be)?;
        let replica = pg
            .groups
            .get(moe_backend::parallel::GroupFamily::DpCp)
            .index;
        trainer.step(&batch(replica, vocab)).map_err(be)?;
        let gathered = tensors(&M::gather(trainer.model(), &pg).map_err(be)?);
        let mut stats = Vec::new();
        let mut received = Vec::new();
        for (opts, &bcast) in options.iter().zip(broadcast) {
            let mut opts = opts.clone();
            if bcast {
                opts.dest = SyncDest::Broadcast(world.clone());
            }
            let receives = ctx.rank() == 0 || bcast;
            let mut rollout = full.clone().valid().map(&mut Zero);
            let mut rx = ModelReceiver::new(&mut rollout, &Device::flex());
            let s = sync_weights(
                M::shard_model(trainer.model()),
                &pg,
                opts,
                receives.then_some(&mut rx as &mut dyn moe_models::weight_sync::WeightReceiver),
            )
            .map_err(be)?;
            stats.push(s);
            received.push(receives.then(|| tensors(&rollout)));
        }
        Ok((stats, received, gathered))
    })
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

fn options(dtype: SyncDtype, experts: ExpertNames) -> SyncOptions {
    SyncOptions {
        bucket_bytes: BUCKET,
        dtype,
        experts,
        ..SyncOptions::default()
    }
}

/// The largest synced tensor (in its sync dtype) and the largest in f32 (the pieces travel in
/// the training dtype), from the full model's export.
fn largest<M: ExportHf>(full: &M, experts: ExpertNames, dtype: SyncDtype) -> (u64, u64) {
    let specs = moe_models::export::export_hf_tensors_as(full, experts).expect("export");
    let f32_max = specs
        .specs()
        .iter()
        .map(|s| s.num_bytes())
        .max()
        .unwrap_or(0);
    let out = match dtype {
        SyncDtype::F32 => f32_max,
        SyncDtype::Bf16 => f32_max / 2,
    };
    (out, f32_max)
}

fn check_model<M: Case>(full: &M, what: &str) {
    let cases = [
        (SyncDtype::F32, ExpertNames::PerExpert, false),
        (SyncDtype::Bf16, ExpertNames::Fused, false),
        (SyncDtype::F32, ExpertNames::Fused, true),
        (SyncDtype::Bf16, ExpertNames::PerExpert, true),
    ];
    let opts: Vec<SyncOptions> = cases.iter().map(|&(d, e, _)| options(d, e)).collect();
    let bcast: Vec<bool> = cases.iter().map(|c| c.2).collect();
    let total_f32: u64 = full.hf_tensors().expect("export").total_bytes();
    for (world, spec) in LAYOUTS {
        let layout = ParallelLayout::parse(world, spec).unwrap();
        let results = train_and_sync(full, &layout, &opts, &bcast);
        let reference = &results[0].2;
        for (rank, (stats, received, gathered)) in results.iter().enumerate() {
            assert!(gathered == reference, "{what} {spec}: gathers differ");
            for (c, &(dtype, experts, bcast)) in cases.iter().enumerate() {
                let label =
                    format!("{what} {spec} rank {rank} {dtype:?} {experts:?} bcast={bcast}");
                let want = match dtype {
                    SyncDtype::F32 => reference.clone(),
                    SyncDtype::Bf16 => bf16_rounded(reference),
                };
                match &received[c] {
                    Some(got) => {
                        assert_eq!(got.len(), want.len(), "{label}: tensor count");
                        for (g, w) in got.iter().zip(&want) {
                            assert!(g == w, "{label}: `{}` differs", w.0);
                        }
                        assert!(stats[c].buckets > 1, "{label}: {:?}", stats[c]);
                    }
                    None => assert!(rank != 0 && !bcast, "{label}: nothing received"),
                }
                // Memory: one bucket (twice while broadcasting) plus one tensor's pieces.
                let (out_max, f32_max) = largest(full, experts, dtype);
                let buckets = if bcast { 2 } else { 1 } * (BUCKET as u64).max(out_max);
                let s = &stats[c];
                assert!(
                    s.peak_buffer_bytes <= buckets + f32_max,
                    "{label}: peak {} > {buckets} + {f32_max}",
                    s.peak_buffer_bytes
                );
                assert!(s.max_piece_bytes <= f32_max, "{label}: {s:?}");
                assert!(
                    s.peak_buffer_bytes * 2 < total_f32,
                    "{label}: peak {} of a {total_f32}-byte model",
                    s.peak_buffer_bytes
                );
            }
        }
    }
}

#[test]
fn qwen3_moe_syncs_from_training_layouts() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let full = config.init(&Device::flex().autodiff()).unwrap();
    check_model(&full, "qwen3-moe");
}

#[test]
fn deepseek_v3_syncs_from_training_layouts() {
    let config = DeepseekV3Config::from_file(fixture("deepseek_v3")).unwrap();
    assert_eq!(config.num_nextn_predict_layers, 1);
    let full = config.init(&Device::flex().autodiff()).unwrap();
    assert!(
        full.model
            .layers
            .iter()
            .any(|l| matches!(l.mlp, DeepseekV3FeedForward::Moe(_)))
    );
    check_model(&full, "deepseek-v3");
}

/// The stream's names and order are the export's, and the fused names are HF's stacked
/// experts; a receiver's error names the tensor, after the collective has completed on every
/// rank.
#[test]
fn stream_order_and_receiver_errors() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe")).unwrap();
    let full = config.init(&Device::flex()).unwrap();
    let layout = ParallelLayout::parse(4, "tp=2,ep=4").unwrap();
    let export_names: Vec<String> = full
        .hf_tensors()
        .expect("export")
        .specs()
        .iter()
        .map(|s| s.name.clone())
        .collect();
    let (full_ref, layout_ref) = (&full, &layout);
    let results = World::run(4, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let shard = moe_models::distributed::Sharded::<Qwen3MoeForCausalLM>::shard(
            full_ref,
            &pg,
            moe_models::distributed::DispatcherKind::AllToAll,
        )
        .map_err(be)?;
        let sync = WeightSync::new(&shard.model, &pg, SyncOptions::default()).map_err(be)?;
        let names: Vec<String> = sync.manifest().tensors().map(|t| t.name.clone()).collect();
        let fused = WeightSync::new(
            &shard.model,
            &pg,
            SyncOptions {
                experts: ExpertNames::Fused,
                ..SyncOptions::default()
            },
        )
        .map_err(be)?;
        let fused_names: Vec<(String, Vec<usize>)> = fused
            .manifest()
            .tensors()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        // Drain both (collective).
        let one_bucket = sync.run(None).map_err(be)?;
        fused.run(None).map_err(be)?;
        // A target of another shape: the receiver fails on rank 0, naming the tensor.
        let mut other_cfg = full_ref.config().clone();
        other_cfg.vocab_size = 128;
        let mut other = other_cfg.init(&Device::flex()).map_err(be)?;
        let mut rx = ModelReceiver::new(&mut other, &Device::flex());
        let err = sync_weights(
            &shard.model,
            &pg,
            SyncOptions::default(),
            (ctx.rank() == 0)
                .then_some(&mut rx as &mut dyn moe_models::weight_sync::WeightReceiver),
        )
        .err()
        .map(|e: WeightSyncError| e.to_string());
        Ok((names, fused_names, one_bucket, err))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (names, fused, stats, err) = r.expect("rank");
        assert_eq!(names, export_names, "rank {rank}");
        assert!(fused.contains(&(
            "model.layers.1.mlp.experts.gate_up_proj".to_owned(),
            vec![8, 32, 64]
        )));
        assert!(fused.contains(&(
            "model.layers.1.mlp.experts.down_proj".to_owned(),
            vec![8, 64, 16]
        )));
        assert!(!fused.iter().any(|(n, _)| n.contains("experts.0.")));
        if rank == 0 {
            assert_eq!(stats.buckets, 1, "the fixture fits one 512 MiB bucket");
            let err = err.expect("rank 0 fails");
            assert!(
                err.contains("`model.embed_tokens.weight`") && err.contains("[256, 64]"),
                "{err}"
            );
        } else {
            assert_eq!(stats.buckets, 0);
            assert!(err.is_none(), "rank {rank}: {err:?}");
        }
    }
}

/// Records the order of the tensors a sync delivers, passing the buckets on to a model.
struct Recorder<'a> {
    inner: &'a mut dyn moe_models::weight_sync::WeightReceiver,
    names: Vec<String>,
}

impl moe_models::weight_sync::WeightReceiver for Recorder<'_> {
    fn begin(
        &mut self,
        manifest: &moe_models::weight_sync::SyncManifest,
    ) -> Result<(), WeightSyncError> {
        self.inner.begin(manifest)
    }

    fn receive(
        &mut self,
        bucket: &moe_models::weight_sync::WeightBucket,
    ) -> Result<(), WeightSyncError> {
        self.names
            .extend(bucket.tensors.iter().map(|t| t.name.clone()));
        self.inner.receive(bucket)
    }

    fn finish(&mut self) -> Result<(), WeightSyncError> {
        self.inner.finish()
    }
}

/// The fixture `name`'s config with 4 decoder layers (so that `pp = 2, vpp = 2` gives every
/// virtual stage a layer), as the JSON a checkpoint stores.
fn four_layer_config(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name)).expect("config");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("config json");
    config["num_hidden_layers"] = 4.into();
    config
}

/// Every tensor of the HF export (`moe export`'s conversion, F32) of the distributed
/// checkpoint under `dir`, by name.
fn exported(dir: &std::path::Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    use moe_bridge::dist::DistCheckpoint;
    use moe_bridge::dist::convert::export_dist_to_hf;
    use moe_bridge::export::ExportOptions;
    use moe_bridge::hf::HfCheckpoint;
    use moe_bridge::safetensors::Dtype;

    let ckpt = DistCheckpoint::open::<moe_models::ModelConfig>(dir.join("ckpt")).expect("ckpt");
    let hf = dir.join("hf");
    let opts = ExportOptions {
        dtype: Some(Dtype::F32),
        ..ExportOptions::default()
    };
    export_dist_to_hf::<moe_models::ModelConfig>(&ckpt, &hf, &opts).expect("export");
    let hf = HfCheckpoint::open(&hf).expect("export opens");
    let names: Vec<String> = hf.tensor_names().map(str::to_owned).collect();
    names
        .into_iter()
        .map(|n| {
            let data = hf
                .tensor(&n)
                .and_then(|t| t.to_tensor_data())
                .expect("tensor");
            assert_eq!(data.dtype(), burn::tensor::DType::F32, "{n}");
            (n, (data.shape().to_vec(), data.as_bytes().to_vec()))
        })
        .collect()
}

/// What one rank reports from a pipeline run: whether it is in one of global rank 0's groups
/// that send (dense `tp-pp`, expert `tp-ep-pp`), and per sync its stats and, where it received,
/// the tensor names in stream order and the rebuilt model's tensors.
type PipelineResult = (bool, Vec<(SyncStats, Option<(Vec<String>, Tensors)>)>);

/// Trains `full` (its config `config`) one step of two micro-batches under `layout`, saves the
/// distributed checkpoint under `dir`, then syncs the trained shards as each `(options,
/// broadcast)` says into zeroed rollout models.
fn train_save_and_sync<M: Case + moe_models::checkpoint::PlacedModel>(
    full: &M,
    config: &serde_json::Value,
    layout: &ParallelLayout,
    dir: &std::path::Path,
    syncs: &[(SyncOptions, bool)],
) -> Vec<PipelineResult> {
    let vocab = full.hf_tensors().expect("export").specs()[0].shape[0];
    World::run(layout.world, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let world = ctx.world()?;
        let device = Device::flex().autodiff();
        let trainer_config = TrainerConfig {
            lr: 1e-2,
            expert_bias_update_rate: Some(1e-2),
            ..TrainerConfig::default()
        };
        let mut trainer =
            Trainer::new(full, &pg, world.clone(), trainer_config, &device).map_err(be)?;
        let replica = pg.groups.get(moe_backend::parallel::GroupFamily::Dp).index;
        let micro = [batch(2 * replica, vocab), batch(2 * replica + 1, vocab)];
        trainer.step_micro_batches(&micro).map_err(be)?;
        let mut meta = moe_bridge::dist::SaveMeta::new(1, layout);
        meta.config = Some(config.clone());
        let state = moe_bridge::dist::TrainState::default();
        moe_models::checkpoint::save_trainer(&world, &dir.join("ckpt"), meta, &trainer, &state)
            .map_err(be)?;
        let mut out = Vec::new();
        for (opts, bcast) in syncs {
            let mut opts = opts.clone();
            if *bcast {
                opts.dest = SyncDest::Broadcast(world.clone());
            }
            let receives = ctx.rank() == 0 || *bcast;
            let mut rollout = full.clone().valid().map(&mut Zero);
            let mut rx = ModelReceiver::new(&mut rollout, &Device::flex());
            let mut rec = Recorder {
                inner: &mut rx,
                names: Vec::new(),
            };
            let stats = sync_weights(
                M::shard_model(trainer.model()),
                &pg,
                opts,
                receives.then_some(&mut rec as &mut dyn moe_models::weight_sync::WeightReceiver),
            )
            .map_err(be)?;
            let names = rec.names;
            drop(rx);
            out.push((stats, receives.then(|| (names, tensors(&rollout)))));
        }
        use moe_backend::parallel::GroupFamily::{Mp, TpEpPp};
        let sends = [Mp, TpEpPp]
            .iter()
            .any(|&f| pg.comm(f).ranks().contains(&0));
        Ok((sends, out))
    })
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

/// Pipeline (1F1B, interleaved, uneven) and context-parallel layouts: the synced tensors equal
/// the HF export of the same trained model's distributed checkpoint, bit for bit in f32 (bf16:
/// its rounding), in the order and under the names of the whole model's export; no rank holds
/// more than one bucket (two while broadcasting) plus one tensor's pieces.
fn check_pipeline_model<M: Case + moe_models::checkpoint::PlacedModel>(
    full: &M,
    config: &serde_json::Value,
    what: &str,
    mtp: &str,
) {
    let layouts = [
        (4, "pp=2,ep=2".to_owned()),
        (2, "pp=2,vpp=2".to_owned()),
        (4, "pp=2,cp=2".to_owned()),
        (2, format!("pp=2,pp_layout=Et|t*3{mtp}L")),
        (8, "tp=2,pp=2,ep=2,etp=2".to_owned()),
    ];
    check_layouts(full, config, what, &layouts);
}

/// [`check_pipeline_model`]'s checks under `layouts` (`(world, spec)`).
fn check_layouts<M: Case + moe_models::checkpoint::PlacedModel>(
    full: &M,
    config: &serde_json::Value,
    what: &str,
    layouts: &[(usize, String)],
) {
    let cases = [
        (SyncDtype::F32, ExpertNames::PerExpert, false),
        (SyncDtype::Bf16, ExpertNames::Fused, true),
    ];
    let syncs: Vec<(SyncOptions, bool)> =
        cases.iter().map(|&(d, e, b)| (options(d, e), b)).collect();
    let initial = tensors(full);
    let total_f32: u64 = full.hf_tensors().expect("export").total_bytes();
    for (world, spec) in layouts {
        let layout = ParallelLayout::parse(*world, spec).expect("layout");
        let dir = std::env::temp_dir().join(format!(
            "moe-weight-sync-{what}-{}-{}",
            spec.replace(['=', ',', '|', '*'], "_"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let results = train_save_and_sync(full, config, &layout, &dir, &syncs);
        let reference = exported(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        // The export lists the model's tensors; training moved them.
        assert_eq!(reference.len(), initial.len(), "{what} {spec}");
        let moved = initial
            .iter()
            .filter(|(n, _, b)| reference.get(n).is_some_and(|r| &r.1 != b))
            .count();
        assert!(moved * 2 > initial.len(), "{what} {spec}: {moved} moved");
        for (rank, (sends, per_sync)) in results.iter().enumerate() {
            for (c, &(dtype, experts, bcast)) in cases.iter().enumerate() {
                let label =
                    format!("{what} {spec} rank {rank} {dtype:?} {experts:?} bcast={bcast}");
                let (stats, received) = &per_sync[c];
                match received {
                    Some((names, got)) => {
                        let want_names: Vec<String> =
                            moe_models::export::export_hf_tensors_as(full, experts)
                                .expect("export")
                                .specs()
                                .iter()
                                .map(|s| s.name.clone())
                                .collect();
                        assert_eq!(names, &want_names, "{label}: stream order");
                        assert_eq!(got.len(), reference.len(), "{label}: tensor count");
                        for (name, shape, bytes) in got {
                            let (wshape, wbytes) = &reference[name];
                            let want = match dtype {
                                SyncDtype::F32 => wbytes.clone(),
                                SyncDtype::Bf16 => {
                                    let one = vec![(name.clone(), wshape.clone(), wbytes.clone())];
                                    bf16_rounded(&one).remove(0).2
                                }
                            };
                            assert!(
                                shape == wshape && *bytes == want,
                                "{label}: `{name}` differs"
                            );
                        }
                        assert!(stats.buckets > 1, "{label}: {stats:?}");
                    }
                    None => assert!(rank != 0 && !bcast, "{label}: nothing received"),
                }
                // Ranks of other replicas (data- and context-parallel) hold copies: they send
                // nothing.
                if !sends {
                    assert_eq!(stats.max_piece_bytes, 0, "{label}: {stats:?}");
                }
                let (out_max, f32_max) = largest(full, experts, dtype);
                let buckets = if bcast { 2 } else { 1 } * (BUCKET as u64).max(out_max);
                assert!(
                    stats.peak_buffer_bytes <= buckets + f32_max,
                    "{label}: peak {} > {buckets} + {f32_max}",
                    stats.peak_buffer_bytes
                );
                assert!(stats.max_piece_bytes <= f32_max, "{label}: {stats:?}");
                assert!(
                    stats.peak_buffer_bytes * 2 < total_f32,
                    "{label}: peak {} of a {total_f32}-byte model",
                    stats.peak_buffer_bytes
                );
                eprintln!(
                    "{label}: peak {} B (bound {} B), max bucket {} B, max piece {} B",
                    stats.peak_buffer_bytes,
                    buckets + f32_max,
                    stats.max_bucket_bytes,
                    stats.max_piece_bytes
                );
            }
        }
    }
}

#[test]
fn qwen3_moe_syncs_from_pipeline_and_context_layouts() {
    let config = four_layer_config("qwen3_moe");
    let full = Qwen3MoeConfig::from_json_str(&config.to_string())
        .unwrap()
        .init(&Device::flex().autodiff())
        .unwrap();
    check_pipeline_model(&full, &config, "qwen3-moe", "");
}

#[test]
fn deepseek_v3_with_mtp_syncs_from_pipeline_and_context_layouts() {
    let config = four_layer_config("deepseek_v3");
    let parsed = DeepseekV3Config::from_json_str(&config.to_string()).unwrap();
    assert_eq!(parsed.num_nextn_predict_layers, 1);
    let full = parsed.init(&Device::flex().autodiff()).unwrap();
    check_pipeline_model(&full, &config, "deepseek-v3", "m");
}

/// gpt-oss: the experts' release layout (`gate_up_proj [E, H, 2I]` interleaved, its bias
/// interleaved, `down_proj [E, I, H]`) streamed under per-expert names, the canonical stacked
/// tensors under fused ones, and the ETP-replicated `down_proj_bias` and the gated
/// `gate_up_proj_bias` in both: equal to `moe export` of the same trained checkpoint.
#[test]
fn gpt_oss_syncs_its_release_layout_and_expert_biases() {
    let layouts = [(2, "ep=2".to_owned()), (4, "tp=2,ep=2,etp=2".to_owned())];
    check_layouts(
        &gpt_oss_model(),
        &four_layer_config("gpt_oss"),
        "gpt-oss",
        &layouts,
    );
}

/// gpt-oss under pipeline parallelism (each stage streams its own layers' experts in the
/// release layout, merged into the whole model's export order): `pp=2` alone and with the
/// experts over `ep=2` (two data-parallel replicas), equal to `moe export` bit for bit.
#[test]
fn gpt_oss_syncs_its_release_layout_from_pipeline_layouts() {
    let layouts = [(2, "pp=2".to_owned()), (4, "pp=2,ep=2".to_owned())];
    check_layouts(
        &gpt_oss_model(),
        &four_layer_config("gpt_oss"),
        "gpt-oss-pp",
        &layouts,
    );
}

/// Mixtral: routed experts streamed under its own per-expert names
/// (`block_sparse_moe.experts.{e}.w1/w3/w2`, read off the synced model's plan) and stacked
/// under fused ones, under `ep=2,etp=2` and `pp=2,ep=2`: equal to `moe export`.
#[test]
fn mixtral_syncs_under_its_own_expert_names() {
    let config = four_layer_config("mixtral");
    let full = MixtralConfig::from_json_str(&config.to_string())
        .unwrap()
        .init(&Device::flex().autodiff())
        .unwrap();
    let names: Vec<String> = moe_models::export::export_hf_tensors(&full)
        .expect("export")
        .specs()
        .iter()
        .map(|s| s.name.clone())
        .collect();
    assert!(
        names.contains(&"model.layers.0.block_sparse_moe.experts.0.w3.weight".to_owned()),
        "{names:?}"
    );
    let layouts = [(4, "ep=2,etp=2".to_owned()), (4, "pp=2,ep=2".to_owned())];
    check_layouts(&full, &config, "mixtral", &layouts);
}

/// The gpt-oss fixture with 4 decoder layers (alternating sliding / full attention).
fn gpt_oss_model() -> GptOssForCausalLM {
    let config = four_layer_config("gpt_oss");
    GptOssConfig::from_json_str(&config.to_string())
        .unwrap()
        .init(&Device::flex().autodiff())
        .unwrap()
}
