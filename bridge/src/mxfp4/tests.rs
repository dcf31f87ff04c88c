//! The MXFP4 codec against transformers' dequantisation (goldens from
//! `tests/fixtures/make_mxfp4_golden.py`), bit-exact re-packing, the OCP rounding rule against
//! an f64 nearest-value search, and clear errors.

use std::path::PathBuf;

use super::*;
use crate::safetensors::SafetensorsFile;

fn golden() -> SafetensorsFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/mxfp4.golden.safetensors");
    SafetensorsFile::open(&path).expect("golden")
}

/// `(blocks, blocks shape, scales, scales shape)` of the golden.
fn packed(file: &SafetensorsFile) -> (Vec<u8>, Vec<usize>, Vec<u8>, Vec<usize>) {
    let b = file.tensor("gate_up_proj_blocks").expect("blocks");
    let s = file.tensor("gate_up_proj_scales").expect("scales");
    (
        b.bytes.to_vec(),
        b.shape.to_vec(),
        s.bytes.to_vec(),
        s.shape.to_vec(),
    )
}

#[test]
fn decoding_equals_transformers_bit_for_bit() {
    let file = golden();
    let (blocks, bshape, scales, sshape) = packed(&file);
    let (shape, values) = decode_mxfp4("w", &blocks, &bshape, &scales, &sshape).expect("decode");
    let (e, r, k) = (shape[0], shape[1], shape[2]);
    assert_eq!(shape, vec![bshape[0], bshape[1], bshape[2] * 32]);
    // transformers returns [E, K, R]: the decoded rows transposed.
    let want = file.tensor("gate_up_proj").expect("golden values");
    assert_eq!(want.shape, &[e, k, r]);
    let want = want.to_f32_vec().expect("f32");
    let mut negative_zeros = 0;
    for x in 0..e {
        for i in 0..r {
            for j in 0..k {
                let ours = values[(x * r + i) * k + j];
                let theirs = want[(x * k + j) * r + i];
                assert_eq!(ours.to_bits(), theirs.to_bits(), "[{x}, {i}, {j}]");
                negative_zeros += usize::from(ours == 0.0 && ours.is_sign_negative());
            }
        }
    }
    assert!(negative_zeros >= 32, "the golden's -0 block decodes to -0");
}

#[test]
fn unchanged_weights_repack_bit_for_bit() {
    let (blocks, bshape, scales, sshape) = packed(&golden());
    let (shape, values) = decode_mxfp4("w", &blocks, &bshape, &scales, &sshape).expect("decode");
    let again = encode_mxfp4("w", &values, &shape, Some(&scales)).expect("encode");
    assert_eq!(again.blocks_shape, bshape);
    assert_eq!(again.scales_shape, sshape);
    assert_eq!(again.scales, scales, "scales");
    assert_eq!(again.blocks, blocks, "codes");
    // Without the reference the values still round-trip exactly (the scale may differ).
    let fresh = encode_mxfp4("w", &values, &shape, None).expect("encode");
    let (_, back) = decode_mxfp4(
        "w",
        &fresh.blocks,
        &fresh.blocks_shape,
        &fresh.scales,
        &fresh.scales_shape,
    )
    .expect("decode");
    let same = values.iter().zip(&back).all(|(a, b)| a == b);
    assert!(
        same,
        "every decoded value is representable at the OCP scale"
    );
}

/// The nearest FP4 value to `x` in f64 (ties to the code with an even mantissa bit), saturating.
fn nearest(x: f64) -> f64 {
    let mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let a = x.abs().min(6.0);
    let mut best = 0;
    for c in 1..8 {
        let (d_best, d_c) = ((a - mags[best]).abs(), (a - mags[c]).abs());
        if d_c < d_best || (d_c == d_best && c % 2 == 0) {
            best = c;
        }
    }
    mags[best].copysign(x)
}

#[test]
fn changed_weights_follow_the_ocp_rule() {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut values = Vec::new();
    for block in 0..64 {
        // Magnitudes over many binades, ties at the midpoints, and an all-zero block.
        let scale = 2f32.powi(block % 21 - 10);
        for i in 0..BLOCK {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            let v = match (block, i % 8) {
                (7, _) => 0.0,
                (_, 0) => 2.5 * scale,
                (_, 1) => -0.25 * scale,
                _ => (u * 14.0 - 7.0) * scale,
            };
            values.push(v);
        }
    }
    let shape = [2, values.len() / 2];
    let packed = encode_mxfp4("w", &values, &shape, None).expect("encode");
    assert_eq!(packed.blocks_shape, vec![2, shape[1] / 32, 16]);
    let (_, back) = decode_mxfp4(
        "w",
        &packed.blocks,
        &packed.blocks_shape,
        &packed.scales,
        &packed.scales_shape,
    )
    .expect("decode");
    for (g, block) in values.chunks(BLOCK).enumerate() {
        let amax = block.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
        let e = if amax == 0.0 {
            -127
        } else {
            amax.log2().floor() as i32 - 2
        };
        assert_eq!(i32::from(packed.scales[g]) - 127, e, "block {g}: scale");
        let s = 2f64.powi(e);
        for (i, &x) in block.iter().enumerate() {
            let want = nearest(f64::from(x) / s) * s;
            assert_eq!(
                f64::from(back[g * BLOCK + i]),
                want,
                "block {g} value {i}: {x}"
            );
        }
    }
}

#[test]
fn bad_packed_weights_are_refused_naming_the_tensor() {
    let blocks = vec![0u8; 2 * 16];
    let err = decode_mxfp4("m.w_blocks", &blocks, &[2, 16], &[127, 255], &[2]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("m.w_blocks") && msg.contains("0xFF"), "{msg}");
    let err = decode_mxfp4("m.w_blocks", &blocks, &[2, 16], &[127], &[1]).unwrap_err();
    assert!(err.to_string().contains("do not pair"), "{err}");
    let err = decode_mxfp4("m.w_blocks", &blocks, &[1, 32], &[127], &[1]).unwrap_err();
    assert!(err.to_string().contains("do not pair"), "{err}");
    let err = decode_mxfp4("m.w_blocks", &blocks[..8], &[2, 16], &[1, 2], &[2]).unwrap_err();
    assert!(err.to_string().contains("8 code bytes"), "{err}");
    let err = encode_mxfp4("m.w", &[0.0; 48], &[48], None).unwrap_err();
    assert!(err.to_string().contains("blocks of 32"), "{err}");
    let err = encode_mxfp4("m.w", &[f32::NAN; 32], &[32], None).unwrap_err();
    assert!(err.to_string().contains("finite"), "{err}");
    let err = encode_mxfp4("m.w", &[0.0; 64], &[64], Some(&[1])).unwrap_err();
    assert!(
        err.to_string().contains("1 reference scales for 2 blocks"),
        "{err}"
    );
    assert_eq!(mxfp4_base("a.gate_up_proj_blocks"), Some("a.gate_up_proj"));
    assert_eq!(mxfp4_base("a.down_proj_scales"), Some("a.down_proj"));
    assert_eq!(mxfp4_base("a.down_proj"), None);
}

/// transformers' parameter (`[E, K, R]`, the golden's `gate_up_proj`) packs back to the
/// golden's blocks and scales through [`encode_mxfp4_param`] with the golden's scales as the
/// reference; [`mxfp4_pair_shapes`] gives their shapes; a width that 32 does not divide and a
/// vector are refused naming the tensor.
#[test]
fn transformers_parameters_pack_back_to_the_release_pair() {
    let file = golden();
    let (blocks, bshape, scales, sshape) = packed(&file);
    let param = file.tensor("gate_up_proj").expect("golden values");
    let values = param.to_f32_vec().expect("f32");
    let packed = encode_mxfp4_param("w", &values, param.shape, Some(&scales)).expect("encode");
    assert_eq!(
        (packed.blocks_shape, packed.scales_shape),
        (bshape.clone(), sshape.clone())
    );
    assert_eq!((packed.blocks, packed.scales), (blocks, scales));
    assert_eq!(
        mxfp4_pair_shapes("w", param.shape).expect("shapes"),
        (bshape, sshape)
    );
    let err = mxfp4_pair_shapes("m.w", &[2, 48, 6])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`m.w`") && err.contains("[2, 48, 6]"), "{err}");
    let err = encode_mxfp4_param("m.w", &[0.0; 32], &[32], None).unwrap_err();
    assert!(err.to_string().contains("`m.w`"), "{err}");
}
