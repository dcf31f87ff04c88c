//! Test support: a [`WeightSource`] over the committed HF fixture directories (single file or
//! sharded with `model.safetensors.index.json`) and golden-file reading, using the
//! `safetensors` crate directly. The production reader lives in `moe-bridge`.

#![allow(dead_code)]

pub mod family;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use moe_models::{ModelError, WeightSource};
use safetensors::{Dtype, SafeTensors};

/// `tests/fixtures` at the workspace root.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests")
        .join("fixtures")
}

/// Every tensor of a checkpoint directory, decoded to f32 up front (fixtures are tiny).
pub struct FixtureSource {
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl FixtureSource {
    /// Reads `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Self {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).expect("index");
            let json: serde_json::Value = serde_json::from_str(&text).expect("index json");
            let mut names: Vec<String> = json["weight_map"]
                .as_object()
                .expect("weight_map")
                .values()
                .map(|v| v.as_str().expect("file").to_owned())
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut tensors = HashMap::new();
        for file in files {
            let bytes = std::fs::read(&file).expect("read shard");
            let st = SafeTensors::deserialize(&bytes).expect("parse shard");
            for (name, view) in st.tensors() {
                let values = to_f32(view.dtype(), view.data());
                tensors.insert(name, (view.shape().to_vec(), values));
            }
        }
        Self { tensors }
    }
}

fn to_f32(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        other => panic!("fixture dtype {other:?} not handled by the test source"),
    }
}

impl WeightSource for FixtureSource {
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        self.tensors
            .get(hf_name)
            .cloned()
            .ok_or_else(|| ModelError::MissingTensor {
                name: hf_name.to_owned(),
            })
    }

    fn contains(&self, hf_name: &str) -> bool {
        self.tensors.contains_key(hf_name)
    }
}

/// A golden file: named tensors as f32 or i64 host values.
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    /// Reads `tests/fixtures/<name>.golden.safetensors`.
    pub fn open(name: &str) -> Self {
        let path = fixtures().join(format!("{name}.golden.safetensors"));
        Self {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn view(&self, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("golden");
        let v = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("golden `{name}`: {e}"));
        (v.dtype(), v.shape().to_vec(), v.data().to_vec())
    }

    /// Whether the golden holds `name`.
    pub fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.bytes)
            .map(|st| st.names().contains(&name))
            .unwrap_or(false)
    }

    /// Every tensor name of the golden.
    pub fn names(&self) -> Vec<String> {
        let st = SafeTensors::deserialize(&self.bytes).expect("golden");
        st.names().into_iter().map(|n| n.to_owned()).collect()
    }

    /// An F32 tensor: shape and values.
    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (dtype, shape, data) = self.view(name);
        (shape, to_f32(dtype, &data))
    }

    /// An I64 tensor: shape and values.
    pub fn i64(&self, name: &str) -> (Vec<usize>, Vec<i64>) {
        let (dtype, shape, data) = self.view(name);
        assert_eq!(dtype, Dtype::I64, "golden `{name}` is {dtype:?}");
        let values = data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        (shape, values)
    }
}

/// `max |a − b|` and `max |b|`.
pub fn max_errors(ours: &[f32], golden: &[f32]) -> (f32, f32) {
    assert_eq!(ours.len(), golden.len(), "length mismatch");
    let err = ours
        .iter()
        .zip(golden)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = golden.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    (err, scale)
}
