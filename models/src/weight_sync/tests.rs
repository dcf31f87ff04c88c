use burn::tensor::{DType, Device, bf16};

use super::host::{PieceBox, scatter};
use super::*;
use crate::Qwen3MoeConfig;
use crate::export::export_hf_tensors;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tiny Qwen3-MoE (one dense layer, one MoE layer of 4 experts), shared with the wire tests.
pub(super) fn tiny() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        moe_intermediate_size: 8,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        num_experts: 4,
        num_experts_per_tok: 2,
        norm_topk_prob: true,
        mlp_only_layers: vec![0],
        ..Qwen3MoeConfig::default()
    }
}

#[test]
fn scatter_places_boxes_and_casts() {
    // A [2, 3] piece into columns 1..4 of a [2, 5] tensor.
    let mut dst = vec![0u8; 2 * 5 * 4];
    let src = f32_bytes(&[1., 2., 3., 4., 5., 6.]);
    let bx = PieceBox {
        full: vec![2, 5],
        offsets: vec![0, 1],
        shape: vec![2, 3],
    };
    scatter("t", &mut dst, DType::F32, &src, DType::F32, &bx).unwrap();
    let got: Vec<f32> = dst
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(got, [0., 1., 2., 3., 0., 0., 4., 5., 6., 0.]);

    // Rows 1..2 of a [3, 2] tensor, cast to bf16 (round to nearest even).
    let mut dst = vec![0u8; 3 * 2 * 2];
    let v = [1.0f32 + f32::EPSILON, -2.5];
    let bx = PieceBox {
        full: vec![3, 2],
        offsets: vec![1, 0],
        shape: vec![1, 2],
    };
    scatter("t", &mut dst, DType::BF16, &f32_bytes(&v), DType::F32, &bx).unwrap();
    let got: Vec<bf16> = dst
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(got[2], bf16::from_f32(v[0]));
    assert_eq!(got[3], bf16::from_f32(v[1]));
    assert_eq!(got[0], bf16::ZERO);

    let err = scatter(
        "x.weight",
        &mut dst,
        DType::BF16,
        &f32_bytes(&v),
        DType::F32,
        &PieceBox {
            full: vec![3, 2],
            offsets: vec![2, 1],
            shape: vec![1, 2],
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("`x.weight`"), "{err}");
}

#[test]
fn buckets_respect_the_limit_and_large_tensors_get_their_own() {
    let t = |name: &str, n: usize| (name.to_owned(), DType::F32, vec![n]);
    // 40, 40, 200 (> 100), 30, 30, 30 bytes into buckets of 100.
    let m = SyncManifest::pack(
        [
            t("a", 10),
            t("b", 10),
            t("big", 50),
            t("c", 6),
            t("d", 8),
            t("e", 8),
        ],
        100,
        SyncDtype::F32,
        ExpertNames::PerExpert,
    );
    let names: Vec<Vec<&str>> = m
        .buckets
        .iter()
        .map(|b| b.tensors.iter().map(|t| t.name.as_str()).collect())
        .collect();
    assert_eq!(
        names,
        vec![vec!["a", "b"], vec!["big"], vec!["c", "d", "e"]]
    );
    assert_eq!(
        m.buckets.iter().map(|b| b.bytes).collect::<Vec<_>>(),
        [80, 200, 88]
    );
    assert_eq!(m.buckets[2].tensors[1].offset, 24);
    assert_eq!(m.total_bytes(), 368);
    assert_eq!(m.num_tensors(), 6);
}

/// A bucket holding the model's own tensors under `names` (f32), optionally with one renamed
/// or reshaped.
fn bucket_of(model: &crate::Qwen3MoeForCausalLM, fused: bool) -> WeightBucket {
    let experts = if fused {
        ExpertNames::Fused
    } else {
        ExpertNames::PerExpert
    };
    let mut tensors = Vec::new();
    let mut data = Vec::new();
    for (name, d) in crate::export::export_hf_tensors_as(model, experts).expect("export") {
        let bytes = d.as_bytes().to_vec();
        tensors.push(SyncedTensor {
            name,
            dtype: d.dtype(),
            shape: d.shape().to_vec(),
            offset: data.len(),
            bytes: bytes.len(),
        });
        data.extend(bytes);
    }
    WeightBucket {
        index: 0,
        count: 1,
        tensors,
        data,
    }
}

#[test]
fn model_receiver_loads_either_expert_layout() {
    let device = Device::flex();
    let source = tiny().init(&device).unwrap();
    let want: Vec<_> = export_hf_tensors(&source)
        .expect("export")
        .map(|(n, d)| (n, d.as_bytes().to_vec()))
        .collect();
    for fused in [false, true] {
        let mut target = tiny().init(&device).unwrap();
        // A different model before the sync.
        target = target.clone().map(&mut Zero);
        {
            let mut rx = ModelReceiver::new(&mut target, &device);
            rx.receive(&bucket_of(&source, fused)).unwrap();
            rx.finish().unwrap();
        }
        let got: Vec<_> = export_hf_tensors(&target)
            .expect("export")
            .map(|(n, d)| (n, d.as_bytes().to_vec()))
            .collect();
        assert!(got == want, "fused = {fused}");
    }
}

/// Sets every float parameter to zero (a model a sync must overwrite); shared with the wire tests.
pub(super) struct Zero;
impl burn::module::ModuleMapper for Zero {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<burn::tensor::Tensor<D>>,
    ) -> burn::module::Param<burn::tensor::Tensor<D>> {
        let (id, t, _) = param.consume();
        burn::module::Param::initialized(id, t.zeros_like())
    }
}

use burn::module::Module;

#[test]
fn model_receiver_errors_name_the_tensor() {
    let device = Device::flex();
    let source = tiny().init(&device).unwrap();
    let mut target = tiny().init(&device).unwrap();
    let good = bucket_of(&source, false);

    // Unknown name.
    let mut bad = good.clone();
    bad.tensors[3].name = "model.layers.0.self_attn.nope.weight".into();
    let err = ModelReceiver::new(&mut target, &device)
        .receive(&bad)
        .unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::UnknownTensor { name } if name.ends_with("nope.weight")),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("`model.layers.0.self_attn.nope.weight`")
    );

    // Shape mismatch.
    let mut bad = good.clone();
    let t = bad.tensors.iter_mut().find(|t| t.shape.len() == 2).unwrap();
    t.shape = vec![t.shape.iter().product()];
    let name = t.name.clone();
    let err = ModelReceiver::new(&mut target, &device)
        .receive(&bad)
        .unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::ShapeMismatch { name: n, .. } if *n == name),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("`{name}`")), "{err}");

    // Missing at finish.
    let mut bad = good.clone();
    let dropped = bad.tensors.remove(5).name;
    let mut rx = ModelReceiver::new(&mut target, &device);
    rx.receive(&bad).unwrap();
    let err = rx.finish().unwrap_err();
    let one = std::slice::from_ref(&dropped);
    assert!(
        matches!(&err, WeightSyncError::MissingTensors { count: 1, names } if names == one),
        "{err}"
    );
    assert!(err.to_string().contains(&dropped), "{err}");

    // Twice.
    let mut rx = ModelReceiver::new(&mut target, &device);
    rx.receive(&good).unwrap();
    let err = rx.receive(&good).unwrap_err();
    assert!(
        matches!(err, WeightSyncError::DuplicateTensor { .. }),
        "{err}"
    );

    // Bytes outside the buffer.
    let mut bad = good.clone();
    bad.data.truncate(bad.data.len() - 4);
    let err = ModelReceiver::new(&mut target, &device)
        .receive(&bad)
        .unwrap_err();
    let last = &good.tensors[good.tensors.len() - 1].name;
    assert!(
        matches!(&err, WeightSyncError::Malformed { name, .. } if name == last),
        "{err}"
    );
}

#[test]
fn one_rank_sync_equals_the_export_in_both_dtypes() {
    use moe_backend::comm::World;
    use moe_backend::parallel::ParallelLayout;

    let device = Device::flex();
    let model = tiny().init(&device).unwrap();
    let layout = ParallelLayout::single();
    let want: Vec<(String, Vec<f32>)> = export_hf_tensors(&model)
        .expect("export")
        .map(|(n, d)| (n, d.convert::<f32>().try_into_vec::<f32>().unwrap()))
        .collect();
    for dtype in [SyncDtype::F32, SyncDtype::Bf16] {
        let (model_ref, layout_ref) = (&model, &layout);
        let results = World::run(1, |ctx| {
            let pg = ctx.process_groups(layout_ref)?;
            let mut target = tiny().init(&Device::flex()).unwrap();
            let options = SyncOptions {
                bucket_bytes: 4096,
                dtype,
                ..SyncOptions::default()
            };
            let mut rx = ModelReceiver::new(&mut target, &Device::flex());
            let stats = sync_weights(model_ref, &pg, options, Some(&mut rx))
                .map_err(|e| moe_backend::BackendError::Replay(e.to_string()))?;
            Ok((
                stats,
                export_hf_tensors(&target)
                    .expect("export")
                    .map(|(n, d)| (n, d.try_into_vec::<f32>().unwrap()))
                    .collect::<Vec<_>>(),
            ))
        });
        let (stats, got) = results.into_iter().next().unwrap().unwrap();
        assert!(stats.buckets > 1 && stats.tensors == want.len());
        for ((gn, gv), (wn, wv)) in got.iter().zip(&want) {
            assert_eq!(gn, wn);
            let wv: Vec<f32> = match dtype {
                SyncDtype::F32 => wv.clone(),
                SyncDtype::Bf16 => wv.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            };
            assert!(
                gv.iter()
                    .map(|v| v.to_bits())
                    .eq(wv.iter().map(|v| v.to_bits())),
                "{gn} ({dtype:?})"
            );
        }
    }
}
