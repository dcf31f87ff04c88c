//! Sharded loading (issue 15, item 3): a rank that reads only its own boxes of an HF directory
//! builds exactly the shard that cutting the fully loaded model gives, bit for bit (parameters,
//! names, shapes, local head counts through a forward), for Qwen3-MoE, DeepSeek-V3 with MTP,
//! the DeepSeek-V3 FP8 release fixture (boxes dequantised with their blocks' scales) and dense
//! Qwen3, under several layouts; a skeleton has the same local shapes; a checkpoint that does
//! not fit the model fails before any shard is built, naming the tensor.

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device};
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::models::distributed::{DispatcherKind, LoadShard, Sharded};
use burn_moe::models::export::{ExpertNames, ExportHf, export_hf_tensors_as};
use burn_moe::models::hf::{ModelConfig, load_shard_checked};
use burn_moe::models::{DeepseekV3ForCausalLM, ModelError, Qwen3ForCausalLM, Qwen3MoeForCausalLM};
use moe_backend::BackendError;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;

/// Layouts of the MoE fixtures (4 heads / 2 KV heads, 8 experts, expert width 16 or 32).
const MOE_LAYOUTS: [(usize, &str); 5] = [
    (1, ""),
    (2, "tp=2"),
    (4, "tp=2,ep=4"),
    (4, "ep=2,etp=2"),
    (4, "tp=2,ep=2,etp=2"),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Every tensor of a (shard) model by HF name, with routed experts stacked: name, shape,
/// dtype and the exact bytes.
type Tensors = Vec<(String, Vec<usize>, DType, Vec<u8>)>;

fn tensors<M: ExportHf>(model: &M) -> Tensors {
    export_hf_tensors_as(model, ExpertNames::Fused)
        .expect("export")
        .map(|(name, data)| {
            (
                name,
                data.shape().to_vec(),
                data.dtype(),
                data.as_bytes().to_vec(),
            )
        })
        .collect()
}

/// What two shards are compared on: their tensors and the bits of one forward's loss.
type Fingerprint = (Tensors, u32);

fn be(e: impl std::fmt::Display) -> BackendError {
    BackendError::Replay(e.to_string())
}

const IDS: [i64; 8] = [3, 17, 42, 5, 99, 7, 1, 250];

fn loss_bits(loss: burn::tensor::Tensor<1>) -> u32 {
    loss.into_scalar::<f32>().to_bits()
}

/// On every rank of every layout: the shard `load` reads straight from `dir` equals the shard
/// `shard` cuts from the fully loaded model, and `skeleton` has its local shapes.
fn check_family<S: Send>(
    dir: &Path,
    load: impl Fn(&HfCheckpoint, &moe_backend::comm::GroupComms) -> Result<S, ModelError> + Sync,
    shard: impl Fn(&HfCheckpoint, &moe_backend::comm::GroupComms) -> Result<S, ModelError> + Sync,
    skeleton: impl Fn(&moe_backend::comm::GroupComms) -> Result<S, ModelError> + Sync,
    fingerprint: impl Fn(&S) -> Result<Fingerprint, ModelError> + Sync,
    layouts: &[(usize, &str)],
) {
    let ckpt = HfCheckpoint::open(dir).expect("open fixture");
    for &(world, spec) in layouts {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let results = World::run(world, |ctx| {
            let pg = ctx.process_groups(&layout)?;
            let direct = fingerprint(&load(&ckpt, &pg).map_err(be)?).map_err(be)?;
            let cut = fingerprint(&shard(&ckpt, &pg).map_err(be)?).map_err(be)?;
            let empty = fingerprint(&skeleton(&pg).map_err(be)?).map_err(be)?;
            Ok((direct, cut, empty))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (direct, cut, empty) =
                result.unwrap_or_else(|e| panic!("{} {spec} rank {rank}: {e}", dir.display()));
            let names: Vec<&str> = direct.0.iter().map(|t| t.0.as_str()).collect();
            assert_eq!(
                names,
                cut.0.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(),
                "{spec} rank {rank}: tensor names"
            );
            for (a, b) in direct.0.iter().zip(&cut.0) {
                assert!(a == b, "{spec} rank {rank}: `{}` differs", a.0);
            }
            assert_eq!(direct.1, cut.1, "{spec} rank {rank}: loss bits");
            let shapes = |t: &Tensors| -> Vec<(String, Vec<usize>, DType)> {
                t.iter()
                    .map(|(n, s, d, _)| (n.clone(), s.clone(), *d))
                    .collect()
            };
            assert_eq!(
                shapes(&empty.0),
                shapes(&direct.0),
                "{spec} rank {rank}: skeleton shapes"
            );
            assert!(
                empty.0.iter().all(|t| t.3.iter().all(|&b| b == 0)),
                "{spec} rank {rank}: the skeleton is zeros"
            );
        }
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn qwen3_moe_config(ckpt: &HfCheckpoint) -> burn_moe::models::Qwen3MoeConfig {
    let config = ModelConfig::from_dir(ckpt.dir()).expect("config");
    config
        .config_as::<burn_moe::models::Qwen3MoeConfig>()
        .unwrap_or_else(|| panic!("not the family: {}", config.model_type()))
        .clone()
}

fn deepseek_config(ckpt: &HfCheckpoint) -> burn_moe::models::DeepseekV3Config {
    let config = ModelConfig::from_dir(ckpt.dir()).expect("config");
    config
        .config_as::<burn_moe::models::DeepseekV3Config>()
        .unwrap_or_else(|| panic!("not the family: {}", config.model_type()))
        .clone()
}

fn qwen3_config(ckpt: &HfCheckpoint) -> burn_moe::models::Qwen3Config {
    let config = ModelConfig::from_dir(ckpt.dir()).expect("config");
    config
        .config_as::<burn_moe::models::Qwen3Config>()
        .unwrap_or_else(|| panic!("not the family: {}", config.model_type()))
        .clone()
}

#[test]
fn qwen3_moe_sharded_load_equals_shard_of_full_load() {
    let kind = DispatcherKind::AllToAll;
    check_family(
        &fixture("qwen3_moe"),
        |ckpt, pg| {
            load_shard_checked::<Qwen3MoeForCausalLM>(ckpt, pg, kind, &device())
                .map(|(s, _)| s)
                .map_err(|e| ModelError::InvalidInput {
                    what: "checkpoint",
                    reason: e.to_string(),
                })
        },
        |ckpt, pg| {
            let full = Qwen3MoeForCausalLM::from_weights(&qwen3_moe_config(ckpt), ckpt, &device())?;
            Sharded::<Qwen3MoeForCausalLM>::shard(&full, pg, kind)
        },
        |pg| {
            let ckpt = HfCheckpoint::open(fixture("qwen3_moe")).expect("open");
            Qwen3MoeForCausalLM::shard_skeleton(&qwen3_moe_config(&ckpt), pg, kind, &device())
        },
        |s: &Sharded<Qwen3MoeForCausalLM>| {
            let out = s.forward_loss(&IDS, &IDS, 2, &device())?;
            Ok((tensors(&s.model), loss_bits(out.loss)))
        },
        &MOE_LAYOUTS,
    );
}

fn deepseek(name: &str) {
    let kind = DispatcherKind::AllToAll;
    let dir = fixture(name);
    check_family(
        &dir,
        |ckpt, pg| {
            Sharded::<DeepseekV3ForCausalLM>::load(
                &deepseek_config(ckpt),
                ckpt,
                pg,
                kind,
                &device(),
            )
        },
        |ckpt, pg| {
            let full =
                DeepseekV3ForCausalLM::from_weights(&deepseek_config(ckpt), ckpt, &device())?;
            Sharded::<DeepseekV3ForCausalLM>::shard(&full, pg, kind)
        },
        |pg| {
            let ckpt = HfCheckpoint::open(&dir).expect("open");
            DeepseekV3ForCausalLM::shard_skeleton(&deepseek_config(&ckpt), pg, kind, &device())
        },
        |s: &Sharded<DeepseekV3ForCausalLM>| {
            use burn_moe::models::distributed::CausalLmShard;
            // The main loss and, with MTP modules, the MTP losses.
            let out = s.forward_train(&IDS, &IDS, 2, &device(), 1.0, true)?;
            let mut bits = loss_bits(out.loss);
            for l in out.mtp_losses {
                bits ^= loss_bits(l).rotate_left(7);
            }
            Ok((tensors(&s.model), bits))
        },
        &MOE_LAYOUTS,
    );
}

#[test]
fn deepseek_v3_with_mtp_sharded_load_equals_shard_of_full_load() {
    let ckpt = HfCheckpoint::open(fixture("deepseek_v3")).expect("open");
    assert!(deepseek_config(&ckpt).num_nextn_predict_layers > 0, "MTP");
    deepseek("deepseek_v3");
    // The same checkpoint split into 13 files.
    deepseek("deepseek_v3_sharded");
}

/// FP8 release weights with 16×16 blocks: every rank dequantises only its boxes (TP halves of
/// `q_b_proj` / `kv_b_proj` / `o_proj`, ETP halves of the experts) with the scales of the
/// blocks they touch, and gets the bits of the whole-tensor dequantisation.
#[test]
fn deepseek_v3_fp8_sharded_load_dequantises_only_the_boxes() {
    deepseek("deepseek_v3_fp8");
}

#[test]
fn dense_qwen3_sharded_load_equals_shard_of_full_load() {
    let kind = DispatcherKind::AllToAll;
    check_family(
        &fixture("qwen3"),
        |ckpt, pg| {
            Sharded::<Qwen3ForCausalLM>::load(&qwen3_config(ckpt), ckpt, pg, kind, &device())
        },
        |ckpt, pg| {
            let full = Qwen3ForCausalLM::from_weights(&qwen3_config(ckpt), ckpt, &device())?;
            Sharded::<Qwen3ForCausalLM>::shard(&full, pg, kind)
        },
        |pg| {
            let ckpt = HfCheckpoint::open(fixture("qwen3")).expect("open");
            Qwen3ForCausalLM::shard_skeleton(&qwen3_config(&ckpt), pg, kind, &device())
        },
        |s: &Sharded<Qwen3ForCausalLM>| {
            use burn_moe::models::distributed::CausalLmShard;
            let out = s.forward_train(&IDS, &IDS, 2, &device(), 1.0, false)?;
            Ok((tensors(&s.model), loss_bits(out.loss)))
        },
        &[(1, ""), (2, "tp=2"), (4, "tp=2,dp=2")],
    );
}

/// A checkpoint that contradicts its config fails validation before any rank builds its
/// shard, and the error names the tensor and the expected shape.
#[test]
fn a_mis_shaped_checkpoint_fails_before_any_shard_is_built() {
    use burn_moe::bridge::safetensors::{Dtype, SafetensorsFile, TensorView, write_safetensors};
    let src = fixture("qwen3_moe");
    let dir = std::env::temp_dir().join(format!("sharded-load-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy");
    }
    let file = SafetensorsFile::open(src.join("model.safetensors")).expect("open");
    let bad = "model.layers.1.mlp.experts.3.up_proj.weight";
    let views = file.tensors().expect("tensors");
    let mut owned = Vec::new();
    for v in &views {
        if v.name == bad {
            // One row short.
            let shape = vec![v.shape[0] - 1, v.shape[1]];
            let n = shape.iter().product::<usize>() * v.dtype.size();
            owned.push((v.name.to_owned(), v.dtype, shape, v.bytes[..n].to_vec()));
        } else {
            owned.push((
                v.name.to_owned(),
                v.dtype,
                v.shape.to_vec(),
                v.bytes.to_vec(),
            ));
        }
    }
    let path = dir.join("model.safetensors");
    let views: Vec<TensorView<'_>> = owned
        .iter()
        .map(|(n, d, s, b): &(String, Dtype, Vec<usize>, Vec<u8>)| {
            TensorView::new(n, *d, s, b).expect("view")
        })
        .collect();
    write_safetensors(&path, &views).expect("write");
    let ckpt = HfCheckpoint::open(&dir).expect("open");
    let layout = ParallelLayout::parse(2, "ep=2").expect("layout");
    let results = World::run(2, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        Ok(load_shard_checked::<Qwen3MoeForCausalLM>(
            &ckpt,
            &pg,
            DispatcherKind::AllToAll,
            &device(),
        )
        .map(|_| ()))
    });
    std::fs::remove_dir_all(&dir).ok();
    for result in results {
        let err: ModelError = result.expect("rank").expect_err("mis-shaped");
        let text = err.to_string();
        assert!(text.contains(bad), "{text}");
        assert!(text.contains("16"), "expected shape in: {text}");
    }
}

/// Any box of an FP8 weight, aligned to its 16×16 scale blocks or not, reads as the same box of
/// the whole-tensor dequantisation.
#[test]
fn fp8_boxes_off_the_block_grid_match_the_whole_tensor() {
    use burn_moe::models::weights::slice_box;
    let ckpt = HfCheckpoint::open(fixture("deepseek_v3_fp8")).expect("open");
    let names: Vec<String> = ckpt
        .tensor_names()
        .filter(|n| ckpt.contains(&format!("{n}_scale_inv")))
        .map(str::to_owned)
        .collect();
    assert!(!names.is_empty(), "the fixture has FP8 weights");
    for name in names {
        let (shape, whole) = ckpt.read_f32(&name).expect("read");
        let offsets = [3.min(shape[0] - 1), 5.min(shape[1] - 1)];
        let extent = [shape[0] - offsets[0] - 1, shape[1] - offsets[1] - 2];
        let got = ckpt.read_box_f32(&name, &offsets, &extent).expect("box");
        let want = slice_box(&whole, &shape, &offsets, &extent);
        assert!(
            got.iter()
                .map(|v| v.to_bits())
                .eq(want.iter().map(|v| v.to_bits())),
            "{name}"
        );
    }
}
