//! The distributed checkpoint index `moe_dcp.index.json`
//! (docs/checkpoints.md §Distributed checkpoint format, `format_version` 1) and the per-file
//! `__metadata__` of the PyTorch DCP HuggingFace storage convention.
//!
//! The index is the source of truth: per fqn its kind, dtype, global shape, HF names and the
//! chunks (file, global offsets, shape, writer rank) that tile it. Each chunk file additionally
//! carries `{"DCP_SHARDING_INFO": "{\"<fqn>\": {\"saved_offsets\": [...]}}", "DCP_VERSION":
//! "1.0", "format": "pt"}` so `torch.distributed.checkpoint` can read the files without the
//! index.

use std::collections::BTreeMap;
use std::path::Path;

use moe_backend::parallel::{LayoutSpec, ParallelLayout};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::BridgeError;
use crate::safetensors::Dtype;

/// Name of the index file inside an `iter_*` directory.
pub const INDEX_FILE: &str = "moe_dcp.index.json";
/// Name of the completion marker, written last.
pub const COMPLETE_MARKER: &str = ".complete";
/// Name of the file in a checkpoint root naming the newest complete `iter_*` directory.
pub const LATEST_FILE: &str = "latest";
/// The index's `format` value.
pub const FORMAT: &str = "moe-dcp";
/// The index's `format_version` this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// `__metadata__` key holding the JSON string of per-fqn `saved_offsets`.
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";
/// `__metadata__` key of the DCP version.
pub const DCP_VERSION_KEY: &str = "DCP_VERSION";
/// The DCP version written.
pub const DCP_VERSION: &str = "1.0";

/// `iter_{step:07}`: the directory name of the checkpoint of `step`.
pub fn iter_dir_name(step: u64) -> String {
    format!("iter_{step:07}")
}

/// `shard-{rank:05}-model-{j:05}-of-{n:05}.safetensors` (`j` is 1-based).
pub fn chunk_file_name(rank: usize, j: usize, n: usize) -> String {
    format!("shard-{rank:05}-model-{j:05}-of-{n:05}.safetensors")
}

/// What a stored tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorKind {
    /// A trainable parameter.
    Param,
    /// A non-trainable buffer (e.g. expert bias).
    Buffer,
    /// Optimizer state (`optim.{master|exp_avg|exp_avg_sq}.<param fqn>`).
    Optim,
    /// Blockwise dequantisation multipliers `<weight fqn>_scale_inv` of an FP8 weight
    /// (see [`super::fp8`]).
    Scale,
}

/// One stored hyper-rectangle of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Global offsets of the chunk's first element.
    pub offsets: Vec<usize>,
    /// Chunk shape.
    pub shape: Vec<usize>,
    /// Rank that wrote the chunk (a virtual rank for offline conversion).
    pub writer_rank: usize,
}

/// Index entry of one fqn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Parameter, buffer or optimizer state.
    pub kind: TensorKind,
    /// Element type of every chunk.
    #[serde(serialize_with = "ser_dtype", deserialize_with = "de_dtype")]
    pub dtype: Dtype,
    /// Shape of the whole tensor (model space, also for optimizer state).
    pub global_shape: Vec<usize>,
    /// HF names (patterns with `*` for the expert index) the tensor maps to.
    #[serde(default)]
    pub hf: Vec<String>,
    /// The chunks that tile the tensor.
    pub chunks: Vec<ChunkEntry>,
}

fn ser_dtype<S: Serializer>(dtype: &Dtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(dtype.as_str())
}

fn de_dtype<'de, D: Deserializer<'de>>(d: D) -> Result<Dtype, D::Error> {
    let text = String::deserialize(d)?;
    Dtype::from_header_str(&text)
        .ok_or_else(|| serde::de::Error::custom(format!("unknown dtype \"{text}\"")))
}

/// Who wrote the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Framework {
    /// `"moe"`.
    pub name: String,
    /// Crate version.
    pub version: String,
    /// Burn version.
    pub burn: String,
}

impl Default for Framework {
    fn default() -> Self {
        Self {
            name: "moe".to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            burn: "0.22.1".to_owned(),
        }
    }
}

/// The parallel layout the checkpoint was saved under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutRecord {
    /// Number of ranks.
    pub world_size: usize,
    /// Rank order.
    pub order: String,
    /// Dense TP.
    pub tp: usize,
    /// CP.
    pub cp: usize,
    /// Dense DP.
    pub dp: usize,
    /// PP.
    pub pp: usize,
    /// Virtual pipeline stages per pipeline rank (absent: 1).
    pub vpp: Option<usize>,
    /// The Megatron-style pipeline layout the layers were split by (absent: even split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_layout: Option<String>,
    /// EP.
    pub ep: usize,
    /// Expert TP.
    pub etp: usize,
    /// Expert DP.
    pub edp: usize,
}

impl From<&ParallelLayout> for LayoutRecord {
    fn from(l: &ParallelLayout) -> Self {
        Self {
            world_size: l.world,
            order: l.order.clone(),
            tp: l.tp,
            cp: l.cp,
            dp: l.dp,
            pp: l.pp,
            vpp: (l.vpp > 1).then_some(l.vpp),
            pp_layout: l.pp_layout.clone(),
            ep: l.ep,
            etp: l.etp,
            edp: l.edp,
        }
    }
}

impl LayoutRecord {
    /// The layout as a validated [`ParallelLayout`]; `path` names the index in errors.
    pub fn to_layout(&self, path: &Path) -> Result<ParallelLayout, BridgeError> {
        let spec = LayoutSpec {
            world: Some(self.world_size),
            tp: Some(self.tp),
            cp: Some(self.cp),
            pp: Some(self.pp),
            ep: Some(self.ep),
            etp: Some(self.etp),
            dp: Some(self.dp),
            edp: Some(self.edp),
            order: Some(self.order.clone()),
            vpp: self.vpp,
            pp_layout: self.pp_layout.clone(),
        };
        ParallelLayout::from_spec(&spec).map_err(|e| BridgeError::InvalidDistIndex {
            path: path.to_path_buf(),
            reason: format!("layout: {e}"),
        })
    }
}

/// FP8 storage parameters (when FP8 params are stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fp8Record {
    /// `"e4m3"`.
    pub format: String,
    /// Block size `[b0, b1]`.
    pub weight_block_size: [usize; 2],
    /// Whether scales are powers of two.
    pub pow2_scales: bool,
}

/// Optimizer metadata (`null` for model-only checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerRecord {
    /// Optimizer type, e.g. `"adamw"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Optimizer step count.
    pub step: u64,
    /// Hyper-parameters.
    #[serde(default)]
    pub hparams: BTreeMap<String, Value>,
    /// Dtype of each state (`master`, `exp_avg`, `exp_avg_sq`).
    #[serde(default)]
    pub state_dtypes: BTreeMap<String, String>,
}

/// `moe_dcp.index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DcpIndex {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Writer identification.
    pub framework: Framework,
    /// HF `model_type` of the model, if known.
    pub model_family: Option<String>,
    /// Training step.
    pub step: u64,
    /// Layout the checkpoint was saved under.
    pub layout: LayoutRecord,
    /// FP8 parameters, when FP8 params are stored.
    pub fp8: Option<Fp8Record>,
    /// Every stored fqn.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Optimizer metadata.
    pub optimizer: Option<OptimizerRecord>,
    /// Small JSON state (scheduler, data position, RNG seeds).
    #[serde(default)]
    pub objects: BTreeMap<String, Value>,
}

impl DcpIndex {
    /// An empty index for `step` saved under `layout`.
    pub fn new(step: u64, layout: &ParallelLayout) -> Self {
        Self {
            format: FORMAT.to_owned(),
            format_version: FORMAT_VERSION,
            framework: Framework::default(),
            model_family: None,
            step,
            layout: layout.into(),
            fp8: None,
            tensors: BTreeMap::new(),
            optimizer: None,
            objects: BTreeMap::new(),
        }
    }

    /// Parses an index; `path` names it in errors. Rejects other formats and versions.
    pub fn parse(text: &str, path: &Path) -> Result<Self, BridgeError> {
        let invalid = |reason: String| BridgeError::InvalidDistIndex {
            path: path.to_path_buf(),
            reason,
        };
        let index: DcpIndex = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if index.format != FORMAT {
            return Err(invalid(format!(
                "format is \"{}\", expected \"{FORMAT}\"",
                index.format
            )));
        }
        if index.format_version != FORMAT_VERSION {
            return Err(invalid(format!(
                "format_version {} is not supported (this reader knows {FORMAT_VERSION})",
                index.format_version
            )));
        }
        Ok(index)
    }

    /// Reads and parses the index file at `path`.
    pub fn read(path: &Path) -> Result<Self, BridgeError> {
        let text = std::fs::read_to_string(path).map_err(|source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Pretty JSON (two-space indent, sorted tensor keys, trailing newline).
    pub fn to_json(&self, path: &Path) -> Result<String, BridgeError> {
        let mut text =
            serde_json::to_string_pretty(self).map_err(|e| BridgeError::InvalidDistIndex {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        text.push('\n');
        Ok(text)
    }
}

#[derive(Serialize, Deserialize)]
struct SavedOffsets {
    saved_offsets: Vec<usize>,
}

/// The `__metadata__` of a chunk file holding chunks at `saved_offsets` (fqn → global offsets).
pub fn dcp_metadata(saved_offsets: &BTreeMap<String, Vec<usize>>) -> BTreeMap<String, String> {
    let info: BTreeMap<&str, SavedOffsets> = saved_offsets
        .iter()
        .map(|(fqn, offsets)| {
            let saved = SavedOffsets {
                saved_offsets: offsets.clone(),
            };
            (fqn.as_str(), saved)
        })
        .collect();
    // Serialising maps of strings to integer lists cannot fail.
    let info = serde_json::to_string(&info).unwrap_or_else(|_| "{}".to_owned());
    BTreeMap::from([
        (DCP_SHARDING_INFO.to_owned(), info),
        (DCP_VERSION_KEY.to_owned(), DCP_VERSION.to_owned()),
        ("format".to_owned(), "pt".to_owned()),
    ])
}

/// The per-fqn `saved_offsets` of a chunk file's `__metadata__`; `path` names the file.
pub fn parse_dcp_metadata(
    metadata: &BTreeMap<String, String>,
    path: &Path,
) -> Result<BTreeMap<String, Vec<usize>>, BridgeError> {
    let invalid = |reason: String| BridgeError::InvalidDistIndex {
        path: path.to_path_buf(),
        reason,
    };
    let info = metadata
        .get(DCP_SHARDING_INFO)
        .ok_or_else(|| invalid(format!("__metadata__ has no {DCP_SHARDING_INFO}")))?;
    let parsed: BTreeMap<String, SavedOffsets> = serde_json::from_str(info)
        .map_err(|e| invalid(format!("{DCP_SHARDING_INFO} is not valid: {e}")))?;
    Ok(parsed
        .into_iter()
        .map(|(fqn, s)| (fqn, s.saved_offsets))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_round_trips_and_matches_the_spec_spelling() {
        let layout = ParallelLayout::parse(8, "tp=2,ep=4").unwrap();
        let mut index = DcpIndex::new(1200, &layout);
        index.model_family = Some("deepseek_v3".into());
        index.tensors.insert(
            "model.layers.3.mlp.experts.gate_up_proj".into(),
            TensorEntry {
                kind: TensorKind::Param,
                dtype: Dtype::BF16,
                global_shape: vec![8, 2, 32, 64],
                hf: vec!["model.layers.3.mlp.experts.*.gate_proj.weight".into()],
                chunks: vec![ChunkEntry {
                    file: chunk_file_name(0, 1, 1),
                    offsets: vec![0, 0, 0, 0],
                    shape: vec![2, 2, 32, 64],
                    writer_rank: 0,
                }],
            },
        );
        index.optimizer = Some(OptimizerRecord {
            kind: "adamw".into(),
            step: 1200,
            hparams: BTreeMap::new(),
            state_dtypes: BTreeMap::from([("master".into(), "F32".into())]),
        });
        let path = Path::new("idx.json");
        let text = index.to_json(path).unwrap();
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["format"], "moe-dcp");
        assert_eq!(value["layout"]["world_size"], 8);
        assert_eq!(value["layout"]["edp"], 2);
        assert_eq!(value["optimizer"]["type"], "adamw");
        let t = &value["tensors"]["model.layers.3.mlp.experts.gate_up_proj"];
        assert_eq!(t["kind"], "param");
        assert_eq!(t["dtype"], "BF16");
        assert_eq!(
            t["chunks"][0]["file"],
            "shard-00000-model-00001-of-00001.safetensors"
        );
        assert_eq!(DcpIndex::parse(&text, path).unwrap(), index);
        assert_eq!(index.layout.to_layout(path).unwrap(), layout);
        let bad = text.replace("\"format_version\": 1", "\"format_version\": 7");
        let err = DcpIndex::parse(&bad, path).unwrap_err();
        assert!(err.to_string().contains("format_version 7"), "{err}");
        let bad = text.replace("\"BF16\"", "\"Q4\"");
        assert!(DcpIndex::parse(&bad, path).is_err());
    }

    #[test]
    fn dcp_metadata_is_a_json_string_of_saved_offsets() {
        let offsets = BTreeMap::from([("w".to_owned(), vec![0, 512, 0])]);
        let meta = dcp_metadata(&offsets);
        assert_eq!(meta["DCP_VERSION"], "1.0");
        assert_eq!(meta["format"], "pt");
        assert_eq!(
            meta[DCP_SHARDING_INFO],
            r#"{"w":{"saved_offsets":[0,512,0]}}"#
        );
        let path = Path::new("f.safetensors");
        assert_eq!(parse_dcp_metadata(&meta, path).unwrap(), offsets);
        let err = parse_dcp_metadata(&BTreeMap::new(), path).unwrap_err();
        assert!(err.to_string().contains("f.safetensors"));
    }
}
