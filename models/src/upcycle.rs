//! Upcycling a dense Qwen3 HF checkpoint into a Qwen3-MoE one (docs/checkpoints.md §Upcycling,
//! Megatron `upcycling_utils`).
//!
//! Every layer's dense SwiGLU MLP becomes a sparse block of `E` experts of width `F/G`:
//! - **virtual groups**: the dense MLP is split into `G` shards (gate and up row blocks split
//!   separately, down column blocks); expert `e` takes shard `e % G`, so the experts are
//!   `[s0 … s_{G−1}] × R` with `R = E/G`;
//! - **router**: a seeded `N(0, initializer_range²)` draw of `[E, H]` whose first `E/G` rows
//!   are each repeated `G` times (`[r0×G, r1×G, …]`), so a top-`G` choice picks a whole group;
//! - **scale**: `s = G` (post-softmax) or `R·G²/k` (pre-softmax); each of gate, up and down is
//!   multiplied by `c = s^(1/3)` (GLU rule).
//!
//! Everything else (embeddings, attention, norms, a tied or untied `lm_head`) is copied
//! byte for byte; the dense `post_attention_layernorm` becomes the MoE pre-MLP norm unchanged.
//! The result is written atomically ([`HfDirWriter`]) with per-expert HF names
//! (`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`,
//! `model.layers.{l}.mlp.gate.weight`) and a Qwen3-MoE `config.json` ([`upcycled_config`]).
//!
//! Exactness: `G = 1` post-softmax reproduces the dense logits up to rounding; `G > 1` with
//! `k = G` is exact for ReLU-like activations and approximate for SiLU (Megatron's
//! `test_upcycling` tolerance is `rtol 0.1, atol 0.1`, docs/checkpoints.md §Upcycling).

mod math;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use self::math::{
    ExpertShard, RouterMode, SplitMix64, UpcycleScale, split_dense_mlp, upcycled_router,
};
use moe_bridge::BridgeError;
use moe_bridge::export::{
    DEFAULT_MAX_SHARD_SIZE, copy_other_files, default_generation_config, export_config,
};
use moe_bridge::fp8::{OutDtype, is_scale_inv};
use moe_bridge::hf::{CONFIG_FILE, GENERATION_CONFIG_FILE, HfCheckpoint};
use moe_bridge::safetensors::{Dtype, HfDirWriter, OwnedTensor, ShardPlan};

use crate::families::{self, UpcycledMoe};
use crate::param_plan::hf_names;

/// What to build (`moe upcycle --experts E --topk K --granularity G [--seed S]`).
#[derive(Debug, Clone, PartialEq)]
pub struct UpcycleOptions {
    /// `E`, routed experts per layer.
    pub experts: usize,
    /// `k`, experts per token.
    pub topk: usize,
    /// `G = F_dense / F_moe` (1 = every expert is a full copy of the dense MLP).
    pub granularity: usize,
    /// Seed of the router draw.
    pub seed: u64,
    /// Post- or pre-softmax routing (sets `norm_topk_prob`).
    pub router_mode: RouterMode,
    /// Largest shard in bytes.
    pub max_shard_size: u64,
    /// Replace an existing output directory.
    pub overwrite: bool,
}

impl Default for UpcycleOptions {
    fn default() -> Self {
        Self {
            experts: 8,
            topk: 2,
            granularity: 1,
            seed: 0,
            router_mode: RouterMode::PostSoftmax,
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            overwrite: false,
        }
    }
}

/// What an upcycling wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct UpcycleSummary {
    /// The written directory.
    pub target: PathBuf,
    /// Sizes and factors used (`R`, `F/G`, `s`, `c`).
    pub scale: UpcycleScale,
    /// Layers converted (all of them).
    pub moe_layers: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Σ tensor bytes.
    pub total_size: u64,
    /// Safetensors files written.
    pub shards: usize,
}

/// The dense MLP tensor names of layer `l` (`gate`, `up`, `down`).
fn dense_mlp_names(l: usize) -> [String; 3] {
    hf_names::dense_mlp_weights(l)
}

fn config_usize(config: &Value, path: &Path, field: &str) -> Result<usize, BridgeError> {
    config
        .get(field)
        .and_then(Value::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| BridgeError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_owned(),
            reason: format!(
                "expected a non-negative integer, found {}",
                config.get(field).map_or("nothing".into(), Value::to_string)
            ),
        })
}

/// The MoE `config.json` of an upcycled dense `source` (docs/checkpoints.md §Upcycling): the
/// family that upcycles from `source`'s `model_type` ([`Family::upcycled_config`]) sets its
/// MoE fields (`moe_intermediate_size = F/G`, `num_experts = E`, `num_experts_per_tok = k`,
/// `norm_topk_prob` = post-softmax) and copies the rest; `None` when no family upcycles from
/// that `model_type`.
///
/// [`Family::upcycled_config`]: crate::families::Family::upcycled_config
pub fn upcycled_config(source: &Value, scale: &UpcycleScale, mode: RouterMode) -> Option<Value> {
    let dense = source.get("model_type").and_then(Value::as_str)?;
    let moe = UpcycledMoe {
        experts: scale.experts,
        topk: scale.topk,
        moe_intermediate: scale.moe_intermediate,
        norm_topk_prob: mode == RouterMode::PostSoftmax,
    };
    families::upcycled_config(dense, source, moe).map(|(_, config)| config)
}

/// Upcycles the dense Qwen3 HF checkpoint in `from_dense_dir` into a Qwen3-MoE checkpoint at
/// `out_dir` (see the module docs). Errors: the source is not `model_type = "qwen3"`; `G` does
/// not divide `F` or `E`; `k` is out of range; a layer lacks its dense MLP tensors or they
/// have the wrong shape; I/O.
pub fn upcycle(
    from_dense_dir: &Path,
    out_dir: &Path,
    opts: &UpcycleOptions,
) -> Result<UpcycleSummary, BridgeError> {
    let src = HfCheckpoint::open(from_dense_dir)?;
    let config_path = src.dir().join(CONFIG_FILE);
    let config = src.config_json()?;
    let invalid = |field: &str, reason: String| BridgeError::InvalidConfig {
        path: config_path.clone(),
        field: field.to_owned(),
        reason,
    };
    let sources = families::upcycle_sources();
    match config.get("model_type").and_then(Value::as_str) {
        Some(t) if sources.contains(&t) => {}
        other => {
            let found = other.map_or_else(|| "none".to_owned(), |t| format!("\"{t}\""));
            return Err(invalid(
                "model_type",
                format!("upcycling needs a dense {} checkpoint, found {found}", {
                    let quoted: Vec<String> = sources.iter().map(|t| format!("\"{t}\"")).collect();
                    quoted.join(" or ")
                }),
            ));
        }
    }
    let hidden = config_usize(&config, &config_path, "hidden_size")?;
    let dense_f = config_usize(&config, &config_path, "intermediate_size")?;
    let layers = config_usize(&config, &config_path, "num_hidden_layers")?;
    let std = config
        .get("initializer_range")
        .and_then(Value::as_f64)
        .unwrap_or(0.02);
    let scale = UpcycleScale::new(
        opts.experts,
        opts.topk,
        opts.granularity,
        dense_f,
        opts.router_mode,
    )
    .map_err(|(field, reason)| invalid(&format!("upcycle.{field}"), reason))?;

    // Plan: copied tensors keep their dtype; new ones take the dense MLP's float dtype.
    let mlp_names: Vec<[String; 3]> = (0..layers).map(dense_mlp_names).collect();
    let consumed: std::collections::BTreeSet<&str> = mlp_names
        .iter()
        .flat_map(|n| n.iter().map(String::as_str))
        .collect();
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut copied = Vec::new();
    let mut dequantized = false;
    for name in src.tensor_names() {
        if is_scale_inv(name) {
            dequantized = true;
            continue;
        }
        if consumed.contains(name) {
            continue;
        }
        let info = src.info(name)?;
        let dtype = match info.dtype {
            Dtype::F8E4M3 | Dtype::F8E5M2 => Dtype::BF16,
            d => d,
        };
        sizes.insert(name.to_owned(), (info.num_elements() * dtype.size()) as u64);
        copied.push(name.to_owned());
    }
    let mut layer_dtypes = Vec::with_capacity(layers);
    let fm = scale.moe_intermediate;
    for (l, names) in mlp_names.iter().enumerate() {
        let expected = [[dense_f, hidden], [dense_f, hidden], [hidden, dense_f]];
        let mut dtype = Dtype::F32;
        for (name, shape) in names.iter().zip(expected) {
            let info = src.info(name)?;
            if info.shape != shape {
                return Err(BridgeError::ShapeMismatch {
                    path: src.file_of(name)?.to_path_buf(),
                    tensor: name.clone(),
                    expected: shape.to_vec(),
                    actual: info.shape.clone(),
                });
            }
            dtype = match info.dtype {
                Dtype::F32 | Dtype::F64 => Dtype::F32,
                Dtype::F16 => Dtype::F16,
                _ => Dtype::BF16,
            };
        }
        let experts = hf_names::experts_of(l);
        let d = dtype.size() as u64;
        sizes.insert(
            hf_names::router_weight(l),
            (scale.experts * hidden) as u64 * d,
        );
        for e in 0..scale.experts {
            for proj in hf_names::MLP_PROJS {
                sizes.insert(
                    hf_names::expert_proj_weight(&experts, e, proj),
                    (fm * hidden) as u64 * d,
                );
            }
        }
        layer_dtypes.push(dtype);
    }
    let plan = ShardPlan::greedy(&sizes, opts.max_shard_size);
    let shards = plan.num_shards();
    let mut writer = HfDirWriter::create(out_dir, plan, opts.overwrite)?;

    for name in &copied {
        writer.push(src.read_dequantized(name, OutDtype::BF16)?)?;
    }
    let mut rng = SplitMix64::new(opts.seed);
    for (l, (names, dtype)) in mlp_names.iter().zip(&layer_dtypes).enumerate() {
        let experts = hf_names::experts_of(l);
        let [gate, up, down] =
            [&names[0], &names[1], &names[2]].map(|n| src.read_f32(n).map(|(_, values)| values));
        let shards = split_dense_mlp(&gate?, &up?, &down?, hidden, &scale);
        let router = upcycled_router(&mut rng, &scale, hidden, std);
        let out = |name: String, shape: Vec<usize>, values: &[f32]| {
            OwnedTensor::from_f32(name, shape, values).and_then(|t| t.cast(*dtype))
        };
        writer.push(out(
            hf_names::router_weight(l),
            vec![scale.experts, hidden],
            &router,
        )?)?;
        for e in 0..scale.experts {
            let shard = &shards[scale.shard_of(e)];
            let name = |proj| hf_names::expert_proj_weight(&experts, e, proj);
            writer.push(out(
                name(hf_names::GATE_PROJ),
                vec![fm, hidden],
                &shard.gate,
            )?)?;
            writer.push(out(name(hf_names::UP_PROJ), vec![fm, hidden], &shard.up)?)?;
            writer.push(out(
                name(hf_names::DOWN_PROJ),
                vec![hidden, fm],
                &shard.down,
            )?)?;
        }
    }

    let moe_config = upcycled_config(&config, &scale, opts.router_mode).ok_or_else(|| {
        invalid(
            "model_type",
            "no family upcycles this model_type".to_owned(),
        )
    })?;
    let moe_config = export_config(&moe_config, dequantized.then_some(Dtype::BF16), dequantized);
    writer.write_json(CONFIG_FILE, &moe_config)?;
    let generation = match src.generation_config_json()? {
        Some(g) => g,
        None => default_generation_config(&config),
    };
    writer.write_json(GENERATION_CONFIG_FILE, &generation)?;
    copy_other_files(src.dir(), &mut writer)?;
    let target = writer.finish()?;
    Ok(UpcycleSummary {
        target,
        scale,
        moe_layers: layers,
        tensors: sizes.len(),
        total_size: sizes.values().sum(),
        shards,
    })
}

#[cfg(test)]
mod tests;
