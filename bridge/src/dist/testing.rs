//! Test helpers: random layouts and a tiny MoE model's canonical tensors (every split dimension
//! divisible by 8), drawn with the workspace's seeded [`SplitMix`].

use moe_backend::parallel::ParallelLayout;
pub use moe_backend::testing::SplitMix;

use super::files::TensorMeta;
use super::index::TensorKind;
use super::sharding::ShardRule;
use crate::BridgeError;
use crate::mapping::{ExpectedTable, ExpertLayout, Registry};
use crate::safetensors::Dtype;
use crate::schema::ModelSchema;

/// Power-of-two divisors of `n` (the tiny model's split dims are multiples of 8).
fn divisors(n: usize) -> Vec<usize> {
    [1, 2, 4, 8]
        .into_iter()
        .filter(|d| n.is_multiple_of(*d))
        .collect()
}

/// A random valid layout of world 1..=`max_world` over tp, cp, pp, ep, etp (dp, edp derived).
pub fn random_layout(rng: &mut SplitMix, max_world: usize) -> ParallelLayout {
    loop {
        let world = 1 + rng.below(max_world);
        let tp = rng.pick(&divisors(world));
        let pp = if rng.below(5) == 0 {
            rng.pick(&divisors(world / tp))
        } else {
            1
        };
        let cp = if rng.below(5) == 0 {
            rng.pick(&divisors(world / (tp * pp)))
        } else {
            1
        };
        let ep = rng.pick(&divisors(world / pp));
        let etp = rng.pick(&divisors(world / (pp * ep)));
        let spec = format!("tp={tp},cp={cp},pp={pp},ep={ep},etp={etp}");
        if let Ok(layout) = ParallelLayout::parse(world, &spec) {
            return layout;
        }
    }
}

/// Number of layers of [`tiny_moe_tensors`].
pub const TINY_LAYERS: usize = 3;

/// Canonical tensors of a tiny MoE model mixing Qwen3-MoE and DeepSeek-V3 names: layer 0
/// dense, layers 1–2 MoE with 8 experts; F32 except BF16 experts and an F32 router bias.
pub fn tiny_moe_tensors() -> Vec<TensorMeta> {
    let (h, v, e, im, f) = (16, 32, 8, 8, 16);
    let mut out = vec![
        ("model.embed_tokens.weight", vec![v, h], Dtype::F32),
        ("model.norm.weight", vec![h], Dtype::F32),
        ("lm_head.weight", vec![v, h], Dtype::F32),
    ];
    let mut names: Vec<(String, Vec<usize>, Dtype)> = out
        .drain(..)
        .map(|(n, s, d)| (n.to_owned(), s, d))
        .collect();
    for l in 0..TINY_LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let mut layer = vec![
            (p("input_layernorm.weight"), vec![h], Dtype::F32),
            (p("post_attention_layernorm.weight"), vec![h], Dtype::F32),
            (p("self_attn.q_proj.weight"), vec![h, h], Dtype::F32),
            (p("self_attn.k_proj.weight"), vec![8, h], Dtype::F32),
            (p("self_attn.v_proj.weight"), vec![8, h], Dtype::F32),
            (p("self_attn.o_proj.weight"), vec![h, h], Dtype::F32),
            (p("self_attn.q_norm.weight"), vec![4], Dtype::F32),
            (
                p("self_attn.kv_a_proj_with_mqa.weight"),
                vec![24, h],
                Dtype::BF16,
            ),
            (p("self_attn.kv_b_proj.weight"), vec![32, 8], Dtype::BF16),
        ];
        if l == 0 {
            layer.extend([
                (p("mlp.gate_proj.weight"), vec![f, h], Dtype::F32),
                (p("mlp.up_proj.weight"), vec![f, h], Dtype::F32),
                (p("mlp.down_proj.weight"), vec![h, f], Dtype::F32),
            ]);
        } else {
            layer.extend([
                (p("mlp.gate.weight"), vec![e, h], Dtype::F32),
                (p("mlp.gate.e_score_correction_bias"), vec![e], Dtype::F32),
                (
                    p("mlp.experts.gate_up_proj"),
                    vec![e, 2, im, h],
                    Dtype::BF16,
                ),
                (p("mlp.experts.down_proj"), vec![e, h, im], Dtype::BF16),
                (
                    p("mlp.shared_experts.gate_proj.weight"),
                    vec![im, h],
                    Dtype::BF16,
                ),
                (
                    p("mlp.shared_experts.up_proj.weight"),
                    vec![im, h],
                    Dtype::BF16,
                ),
                (
                    p("mlp.shared_experts.down_proj.weight"),
                    vec![h, im],
                    Dtype::BF16,
                ),
            ]);
        }
        names.extend(layer);
    }
    names
        .into_iter()
        .map(|(fqn, global_shape, dtype)| TensorMeta {
            fqn,
            kind: TensorKind::Param,
            dtype,
            global_shape,
            hf: Vec::new(),
        })
        .collect()
}

/// The tiny model's parameters plus `optim.{master|exp_avg|exp_avg_sq}.<fqn>` (F32, the
/// parameter's global shape) for every parameter.
pub fn tiny_moe_with_optimizer() -> Vec<TensorMeta> {
    let params = tiny_moe_tensors();
    let mut out = params.clone();
    for state in super::sharding::OPTIM_STATES {
        for p in &params {
            out.push(TensorMeta {
                fqn: format!("optim.{state}.{}", p.fqn),
                kind: TensorKind::Optim,
                dtype: Dtype::F32,
                global_shape: p.global_shape.clone(),
                hf: Vec::new(),
            });
        }
    }
    out
}

/// Deterministic bytes for a tensor (distinct per fqn and position), finite values only: an
/// element of a float dtype whose random bits are NaN or infinite gets bit 6 of its top byte
/// cleared (its exponent is then below all-ones in every float format), as a checkpoint never
/// holds a non-finite value (reading one is refused).
pub fn synthetic_bytes(meta: &TensorMeta) -> Vec<u8> {
    let size = meta.dtype.size();
    let n: usize = meta.global_shape.iter().product::<usize>() * size;
    let seed = meta.fqn.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = SplitMix::new(seed);
    let mut bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
    for element in bytes.chunks_exact_mut(size) {
        if crate::safetensors::elem::count_non_finite(meta.dtype, element) > 0 {
            element[size - 1] &= !0x40;
        }
    }
    bytes
}

/// The split of the tiny model's tensors (the models' table for these names: TP rows of the
/// embedding, head, `q/k/v_proj`, `q_b_proj`, `kv_b_proj` and dense `gate/up_proj`, TP columns
/// of `o_proj` and dense `down_proj`, EP × ETP of the routed experts, the rest replicated).
pub fn tiny_rule(name: &str) -> ShardRule {
    const ROWS: [&str; 7] = [
        ".q_proj.weight",
        ".k_proj.weight",
        ".v_proj.weight",
        ".q_b_proj.weight",
        ".kv_b_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    ];
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        ShardRule::Tp { dim: 0 }
    } else if name.contains(".shared_experts.") {
        ShardRule::Replicated
    } else if name.contains(".mlp.experts.") {
        ShardRule::Expert { etp_dim: 2 }
    } else if ROWS.iter().any(|s| name.ends_with(s)) {
        ShardRule::Tp { dim: 0 }
    } else if name.ends_with(".o_proj.weight") || name.ends_with("mlp.down_proj.weight") {
        ShardRule::Tp { dim: 1 }
    } else {
        ShardRule::Replicated
    }
}

/// The pipeline placement of the tiny model's tensors (`model.layers.{i}` in layer `i`, the
/// final norm and head last, the rest first).
pub fn tiny_stage(name: &str) -> crate::dist::StagePlace {
    use crate::dist::StagePlace;
    match name.strip_prefix("model.layers.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|l| l.parse().ok())
            .map_or(StagePlace::Last, StagePlace::Layer),
        None if name.starts_with("model.norm.") || name.starts_with("lm_head.") => StagePlace::Last,
        None => StagePlace::First,
    }
}

/// The tiny model as a [`ModelSchema`]: split by [`tiny_rule`]; it has no `config.json` (the
/// format tests write none), so parsing one is an error.
#[derive(Debug, Clone)]
pub struct TinyModel;

impl TinyModel {
    /// What reading a `config.json` as the tiny model gives.
    fn no_config(path: &std::path::Path) -> BridgeError {
        BridgeError::UnknownModelType {
            path: path.to_path_buf(),
            model_type: "tiny".to_owned(),
            known: String::new(),
        }
    }
}

impl ModelSchema for TinyModel {
    fn from_config(_: &serde_json::Value, path: &std::path::Path) -> Result<Self, BridgeError> {
        Err(Self::no_config(path))
    }

    fn registry_of(_: &serde_json::Value, path: &std::path::Path) -> Result<Registry, BridgeError> {
        Err(Self::no_config(path))
    }

    fn shard_rule(name: &str) -> ShardRule {
        tiny_rule(name)
    }

    fn stage_place(name: &str) -> crate::dist::StagePlace {
        tiny_stage(name)
    }

    fn tied_head(config: &serde_json::Value) -> Option<String> {
        let tied = config
            .get("tie_word_embeddings")
            .and_then(serde_json::Value::as_bool);
        (tied == Some(true)).then(|| "lm_head.weight".to_owned())
    }

    fn model_type(&self) -> &str {
        "tiny"
    }

    fn num_layers(&self) -> usize {
        TINY_LAYERS
    }

    fn expected_hf_tensors(
        &self,
        _: ExpertLayout,
        _: &std::path::Path,
        _: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError> {
        Ok(ExpectedTable::new())
    }
}
