use std::path::PathBuf;

use serde_json::json;

use super::*;
use crate::safetensors::elem::bf16_bits_to_f32;
use crate::safetensors::write_safetensors;
use crate::test_util::TempDir;

/// `[rows, cols]` of E4M3 1.0 (`0x38`).
fn ones(rows: usize, cols: usize) -> OwnedTensor {
    OwnedTensor::new(
        "w",
        Dtype::F8E4M3,
        vec![rows, cols],
        vec![0x38; rows * cols],
    )
    .unwrap()
}

fn scales(shape: Vec<usize>, values: &[f32]) -> OwnedTensor {
    OwnedTensor::from_f32("w_scale_inv", shape, values).unwrap()
}

fn bf16_values(t: &OwnedTensor) -> Vec<f32> {
    assert_eq!(t.dtype, Dtype::BF16);
    t.bytes
        .chunks_exact(2)
        .map(|c| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

#[test]
fn golden_ones_128_with_unit_scale() {
    let q = ones(128, 128);
    let s = scales(vec![1, 1], &[1.0]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [128, 128], OutDtype::BF16).unwrap();
    assert_eq!(w.shape, vec![128, 128]);
    assert!(bf16_values(&w).iter().all(|&v| v == 1.0));
}

#[test]
fn golden_ones_256_with_scale_two() {
    let q = ones(256, 256);
    let s = scales(vec![2, 2], &[2.0; 4]);
    let w = dequantize_blockwise(&q.view(), &s.view(), DEFAULT_BLOCK_SIZE, OutDtype::BF16).unwrap();
    assert!(bf16_values(&w).iter().all(|&v| v == 2.0));
}

#[test]
fn golden_per_quadrant_scales() {
    let q = ones(256, 256);
    let s = scales(vec![2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [128, 128], OutDtype::F32).unwrap();
    let v = w.to_f32_vec().unwrap();
    for (i, j, expected) in [
        (0, 0, 1.0),
        (0, 200, 2.0),
        (200, 0, 3.0),
        (255, 255, 4.0),
        (127, 128, 2.0),
    ] {
        assert_eq!(v[i * 256 + j], expected, "({i},{j})");
    }
}

#[test]
fn golden_zeros_keep_shape_with_partial_blocks() {
    let q = OwnedTensor::new("w", Dtype::F8E4M3, vec![100, 70], vec![0; 7000]).unwrap();
    let s = scales(vec![1, 1], &[1.0]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [128, 128], OutDtype::BF16).unwrap();
    assert_eq!(w.shape, vec![100, 70]);
    assert!(bf16_values(&w).iter().all(|&v| v == 0.0));
}

#[test]
fn partial_edge_blocks_use_their_own_scale() {
    // [5, 3] in 2×2 blocks: scale grid [3, 2].
    let q = ones(5, 3);
    let s = scales(vec![3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [2, 2], OutDtype::F32).unwrap();
    let expected = [
        1.0, 1.0, 2.0, //
        1.0, 1.0, 2.0, //
        3.0, 3.0, 4.0, //
        3.0, 3.0, 4.0, //
        5.0, 5.0, 6.0,
    ];
    assert_eq!(w.to_f32_vec().unwrap(), expected);
}

#[test]
fn product_is_rounded_once_to_bf16() {
    // 1.125 (0x39) times a scale that is not a bf16 value: the f32 product is rounded once.
    let q = OwnedTensor::new("w", Dtype::F8E4M3, vec![1, 1], vec![0x39]).unwrap();
    let scale = 1.0 + 2f32.powi(-10);
    let s = scales(vec![1, 1], &[scale]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [128, 128], OutDtype::BF16).unwrap();
    let exact = 1.125f32 * scale;
    assert_eq!(
        w.bytes,
        crate::safetensors::elem::f32_to_bf16_bits(exact).to_le_bytes()
    );
}

#[test]
fn bad_scale_shapes_and_dtypes_are_errors() {
    let q = ones(256, 256);
    let s = scales(vec![1, 2], &[1.0, 1.0]);
    let err = dequantize_blockwise(&q.view(), &s.view(), [128, 128], OutDtype::BF16).unwrap_err();
    assert!(matches!(err, BridgeError::Dequantize { .. }));
    assert!(err.to_string().contains("`w`") && err.to_string().contains("w_scale_inv"));
    let wide = OwnedTensor::from_f32("w", vec![1, 1], &[1.0]).unwrap();
    let s = scales(vec![1, 1], &[1.0]);
    assert!(dequantize_blockwise(&wide.view(), &s.view(), [1, 1], OutDtype::BF16).is_err());
    let flat = OwnedTensor::new("w", Dtype::F8E4M3, vec![4], vec![0; 4]).unwrap();
    assert!(dequantize_blockwise(&flat.view(), &s.view(), [1, 1], OutDtype::BF16).is_err());
    assert!(dequantize_blockwise(&q.view(), &s.view(), [0, 1], OutDtype::BF16).is_err());
}

#[test]
fn batched_leading_dimensions() {
    // [2 experts, 2, 2] with 2×2 blocks: one scale per expert.
    let q = OwnedTensor::new("w", Dtype::F8E4M3, vec![2, 2, 2], vec![0x38; 8]).unwrap();
    let s = scales(vec![2, 1, 1], &[3.0, 5.0]);
    let w = dequantize_blockwise(&q.view(), &s.view(), [2, 2], OutDtype::F32).unwrap();
    assert_eq!(
        w.to_f32_vec().unwrap(),
        [3.0, 3.0, 3.0, 3.0, 5.0, 5.0, 5.0, 5.0]
    );
}

#[test]
fn block_size_from_config_values() {
    let p = Path::new("config.json");
    assert_eq!(
        block_size_from_config(&json!({}), p).unwrap(),
        DEFAULT_BLOCK_SIZE
    );
    let cfg = json!({"quantization_config": {"weight_block_size": [64, 32]}});
    assert_eq!(block_size_from_config(&cfg, p).unwrap(), [64, 32]);
    for bad in [json!([0, 1]), json!([128]), json!("128"), json!([1.5, 2])] {
        let cfg = json!({"quantization_config": {"weight_block_size": bad}});
        let err = block_size_from_config(&cfg, p).unwrap_err();
        assert!(matches!(err, BridgeError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains("weight_block_size"));
    }
}

#[test]
fn quantize_then_dequantize_is_close_with_partial_blocks() {
    let (rows, cols) = (5, 7);
    let w: Vec<f32> = (0..rows * cols)
        .map(|k| ((k * 37 % 23) as f32 - 11.0) * 0.137)
        .collect();
    let (q, s) = quantize_blockwise(&w, [rows, cols], [4, 4]).unwrap();
    assert_eq!(s.len(), 4);
    let q = OwnedTensor::new("w", Dtype::F8E4M3, vec![rows, cols], q).unwrap();
    let s = scales(vec![2, 2], &s);
    let d = dequantize_blockwise(&q.view(), &s.view(), [4, 4], OutDtype::F32).unwrap();
    for (a, b) in d.to_f32_vec().unwrap().iter().zip(&w) {
        assert!((a - b).abs() <= b.abs() / 16.0 + 1e-6, "{a} vs {b}");
    }
    assert!(quantize_blockwise(&w, [rows, cols + 1], [4, 4]).is_none());
    let (_, unit) = quantize_blockwise(&[0.0; 4], [2, 2], [2, 2]).unwrap();
    assert_eq!(unit, vec![1.0]);
}

#[test]
fn checkpoint_hook_follows_the_rule() {
    let dir = TempDir::new("fp8-hook");
    let tensors = [
        ones(3, 2),
        scales(vec![1, 1], &[2.0]),
        OwnedTensor::new("noscale", Dtype::F8E4M3, vec![2], vec![0x38, 0x7E]).unwrap(),
        OwnedTensor::new("bytes", Dtype::U8, vec![2], vec![7, 9]).unwrap(),
        OwnedTensor::from_f32("bias", vec![2], &[0.25, -1.0]).unwrap(),
    ];
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    write_safetensors(&dir.join("model.safetensors"), &views).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"quantization_config": {"weight_block_size": [2, 2]}}"#,
    )
    .unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.fp8_block_size().unwrap(), [2, 2]);
    // [3, 2] in 2×2 blocks needs a [2, 1] scale: the file's [1, 1] is a typed error.
    let err = ckpt.read_dequantized("w", OutDtype::BF16).unwrap_err();
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    std::fs::write(
        dir.join("config.json"),
        r#"{"quantization_config": {"weight_block_size": [128, 128]}}"#,
    )
    .unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    let w = ckpt.read_dequantized("w", OutDtype::BF16).unwrap();
    assert_eq!(bf16_values(&w), vec![2.0; 6]);
    let cast = ckpt.read_dequantized("noscale", OutDtype::BF16).unwrap();
    assert_eq!(bf16_values(&cast), vec![1.0, 448.0]);
    let bytes = ckpt.read_dequantized("bytes", OutDtype::BF16).unwrap();
    assert_eq!(
        (bytes.dtype, bytes.bytes.as_slice()),
        (Dtype::U8, &[7u8, 9][..])
    );
    let bias = ckpt.read_dequantized("bias", OutDtype::BF16).unwrap();
    assert_eq!(bias, tensors[4]);
    assert_eq!(ckpt.read_f32("w").unwrap(), (vec![3, 2], vec![2.0; 6]));
    assert_eq!(ckpt.read_f32("bias").unwrap(), (vec![2], vec![0.25, -1.0]));
}

#[test]
fn fixture_dequantisation_is_bit_exact() {
    let fp8 = HfCheckpoint::open(fixtures().join("deepseek_v3_fp8")).unwrap();
    let reference = HfCheckpoint::open(fixtures().join("deepseek_v3_fp8_dequant")).unwrap();
    let names: Vec<&str> = fp8.tensor_names().filter(|n| !is_scale_inv(n)).collect();
    assert_eq!(names, reference.tensor_names().collect::<Vec<_>>());
    let mut quantised = 0;
    for name in names {
        quantised += usize::from(fp8.tensor(name).unwrap().dtype == Dtype::F8E4M3);
        let got = fp8.read_dequantized(name, OutDtype::BF16).unwrap();
        let want = reference.tensor(name).unwrap();
        assert_eq!(
            (got.dtype, got.shape.as_slice()),
            (want.dtype, want.shape),
            "{name}"
        );
        assert!(got.bytes == want.bytes, "{name}: dequantised bytes differ");
    }
    assert!(quantised > 0);
}

#[test]
fn fixture_quantisation_matches_the_release_recipe() {
    // deepseek_v3_fp8 was made from the F32 deepseek_v3 fixture with the release recipe.
    let source = HfCheckpoint::open(fixtures().join("deepseek_v3")).unwrap();
    let fp8 = HfCheckpoint::open(fixtures().join("deepseek_v3_fp8")).unwrap();
    let block = fp8.fp8_block_size().unwrap();
    let mut checked = 0;
    for name in fp8
        .tensor_names()
        .filter(|n| fp8.contains(&scale_inv_name(n)))
    {
        let src = source.tensor(name).unwrap();
        if src.dtype != Dtype::F32 {
            continue;
        }
        let (rows, cols) = (src.shape[0], src.shape[1]);
        let (q, s) = quantize_blockwise(&src.to_f32_vec().unwrap(), [rows, cols], block).unwrap();
        assert_eq!(q.as_slice(), fp8.tensor(name).unwrap().bytes, "{name}");
        let want = fp8
            .tensor(&scale_inv_name(name))
            .unwrap()
            .to_f32_vec()
            .unwrap();
        assert_eq!(s, want, "{name}");
        checked += 1;
    }
    assert!(checked > 0, "no F32 source tensors to compare");
}
