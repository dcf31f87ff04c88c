//! Helpers shared by unit tests: raw file builders (and moe-backend's self-deleting temporary
//! directory).

pub use moe_backend::testing::TempDir;

/// A raw safetensors file: 8-byte length, `header` JSON text, then `data`.
pub fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A valid file written by the reference `safetensors` crate: `a` F32 [2,3] = 0..6,
/// `b` BF16 [2] = [1, -2], `c` F8_E4M3 [2,2] = [1, 2, 448, -1].
pub fn reference_file() -> Vec<u8> {
    use safetensors::Dtype as St;
    use safetensors::tensor::TensorView;
    let a: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b: Vec<u8> = [0x3F80u16, 0xC000]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let c: Vec<u8> = vec![0x38, 0x40, 0x7E, 0xB8];
    let views = vec![
        ("a", TensorView::new(St::F32, vec![2, 3], &a).expect("view")),
        ("b", TensorView::new(St::BF16, vec![2], &b).expect("view")),
        (
            "c",
            TensorView::new(St::F8_E4M3, vec![2, 2], &c).expect("view"),
        ),
    ];
    safetensors::serialize(views, None).expect("serialize")
}
