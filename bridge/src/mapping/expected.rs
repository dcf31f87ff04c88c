//! The HF tensors a model's `config.json` implies: name, shape and role of every tensor the
//! model loads (models.md §6), per family ([`qwen3_expected`], [`qwen3_moe_expected`],
//! [`deepseek_v3_expected`]), with the optional FP8 `*_scale_inv` companions of every matrix
//! (checkpoints.md §2) and DeepSeek-V3's MTP layers.
//!
//! This is the shape source of checkpoint validation ([`HfCheckpoint::check`]): a weight the
//! table requires must be present with exactly this shape; a tensor the table does not list is
//! one the model does not use.
//!
//! Shapes are computed with checked arithmetic and the table is bounded
//! ([`MAX_TENSORS`], [`MAX_ELEMENTS`]), so an absurd config is an error rather than an
//! overflow, a huge allocation or a hang.
//!
//! [`HfCheckpoint::check`]: crate::hf::HfCheckpoint::check

use std::collections::BTreeMap;
use std::path::Path;

use moe_models::{DeepseekV3Config, Qwen3Config, Qwen3MoeConfig};

use super::registry::ExpertLayout;
use crate::BridgeError;
use crate::fp8::{scale_inv_name, scale_shape};
use crate::weights::ModelConfig;

/// Most HF tensors a config may imply (DeepSeek-V3 has about 92 000 with its scales).
pub const MAX_TENSORS: u128 = 10_000_000;
/// Most parameters a config may imply (2⁵⁰ ≈ 1.1·10¹⁵, three orders above the largest
/// released MoE models): beyond this the config is taken to be corrupt.
pub const MAX_ELEMENTS: u128 = 1 << 50;

/// What an expected tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfRole {
    /// A model weight: any float dtype, or a one-byte (FP8) dtype with a `_scale_inv`.
    Weight,
    /// The FP8 inverse scale of the weight named by [`ExpectedHf::scale_of`]: a float dtype
    /// (or `F8_E8M0`), shape `[.., ceil(M/b0), ceil(N/b1)]`.
    ScaleInv,
}

/// One HF tensor a config implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedHf {
    /// Shape, PyTorch `[out, in]` orientation.
    pub shape: Vec<usize>,
    /// Whether the model cannot load without it (`false`: a tied `lm_head`, DeepSeek-V3's
    /// MTP copies of `embed_tokens` / `shared_head.head`, FP8 scales).
    pub required: bool,
    /// Weight or FP8 scale.
    pub role: HfRole,
    /// For a scale: the weight it scales.
    pub scale_of: Option<String>,
}

/// Expected HF tensors by name.
pub type ExpectedTable = BTreeMap<String, ExpectedHf>;

/// Collects the table; every size product is checked.
struct Builder<'a> {
    path: &'a Path,
    table: ExpectedTable,
    elements: u128,
    block: [usize; 2],
}

impl<'a> Builder<'a> {
    fn new(path: &'a Path, block: [usize; 2]) -> Self {
        Self {
            path,
            table: BTreeMap::new(),
            elements: 0,
            block,
        }
    }

    fn too_big(&self, field: &str, reason: String) -> BridgeError {
        BridgeError::InvalidConfig {
            path: self.path.to_path_buf(),
            field: field.to_owned(),
            reason,
        }
    }

    /// `a · b`, an error naming `what` when it overflows.
    fn mul(&self, a: usize, b: usize, what: &str) -> Result<usize, BridgeError> {
        a.checked_mul(b)
            .ok_or_else(|| self.too_big(what, format!("{a} · {b} overflows")))
    }

    /// `a + b`, an error naming `what` when it overflows.
    fn add(&self, a: usize, b: usize, what: &str) -> Result<usize, BridgeError> {
        a.checked_add(b)
            .ok_or_else(|| self.too_big(what, format!("{a} + {b} overflows")))
    }

    fn insert(
        &mut self,
        name: String,
        shape: Vec<usize>,
        required: bool,
    ) -> Result<(), BridgeError> {
        let numel = shape
            .iter()
            .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
            .unwrap_or(u128::MAX);
        self.elements = self.elements.saturating_add(numel);
        if self.elements > MAX_ELEMENTS {
            return Err(self.too_big(
                "(sizes)",
                format!(
                    "the config implies more than {MAX_ELEMENTS} parameters (reached at \
                     `{name}` {shape:?}); its sizes are not plausible"
                ),
            ));
        }
        if shape.len() >= 2
            && let Some(scale) = scale_shape(&shape, self.block)
        {
            self.table.insert(
                scale_inv_name(&name),
                ExpectedHf {
                    shape: scale,
                    required: false,
                    role: HfRole::ScaleInv,
                    scale_of: Some(name.clone()),
                },
            );
        }
        self.table.insert(
            name,
            ExpectedHf {
                shape,
                required,
                role: HfRole::Weight,
                scale_of: None,
            },
        );
        Ok(())
    }

    fn weight(&mut self, name: String, shape: Vec<usize>) -> Result<(), BridgeError> {
        self.insert(name, shape, true)
    }

    /// `{prefix}.weight [out, in]` and, with `bias`, `{prefix}.bias [out]`.
    fn linear(
        &mut self,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<(), BridgeError> {
        self.weight(format!("{prefix}.weight"), vec![d_out, d_in])?;
        if bias {
            self.weight(format!("{prefix}.bias"), vec![d_out])?;
        }
        Ok(())
    }

    fn norm(&mut self, prefix: &str, size: usize) -> Result<(), BridgeError> {
        self.weight(format!("{prefix}.weight"), vec![size])
    }

    /// A SwiGLU MLP `{prefix}.{gate,up,down}_proj`.
    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize) -> Result<(), BridgeError> {
        self.linear(&format!("{prefix}.gate_proj"), hidden, inter, false)?;
        self.linear(&format!("{prefix}.up_proj"), hidden, inter, false)?;
        self.linear(&format!("{prefix}.down_proj"), inter, hidden, false)
    }

    /// Routed experts `{prefix}.*` in `layout`.
    fn experts(
        &mut self,
        prefix: &str,
        experts: usize,
        inter: usize,
        hidden: usize,
        layout: ExpertLayout,
    ) -> Result<(), BridgeError> {
        match layout {
            ExpertLayout::PerExpert => {
                for e in 0..experts {
                    self.mlp(&format!("{prefix}.{e}"), hidden, inter)?;
                }
                Ok(())
            }
            ExpertLayout::Stacked => {
                let fused = self.mul(2, inter, "moe_intermediate_size")?;
                self.weight(
                    format!("{prefix}.gate_up_proj"),
                    vec![experts, fused, hidden],
                )?;
                self.weight(format!("{prefix}.down_proj"), vec![experts, hidden, inter])
            }
        }
    }

    /// Embedding, final norm and LM head (optional when tied: HF loads and then re-ties it).
    fn top_level(&mut self, vocab: usize, hidden: usize, tied: bool) -> Result<(), BridgeError> {
        self.weight("model.embed_tokens.weight".to_owned(), vec![vocab, hidden])?;
        self.norm("model.norm", hidden)?;
        self.insert("lm_head.weight".to_owned(), vec![vocab, hidden], !tied)
    }

    /// Fails before building when the table would exceed [`MAX_TENSORS`].
    fn bound(&self, layers: usize, per_layer: u128, field: &str) -> Result<(), BridgeError> {
        // ×2 for the scale companions.
        let count = (layers as u128)
            .saturating_mul(per_layer.saturating_mul(2))
            .saturating_add(8);
        if count > MAX_TENSORS {
            return Err(self.too_big(
                field,
                format!(
                    "implies about {count} tensors (more than {MAX_TENSORS}); the config is \
                     not plausible"
                ),
            ));
        }
        Ok(())
    }
}

/// Qwen-style attention: `q/k/v/o_proj` (biases with `attention_bias`) and `q_norm`/`k_norm`.
#[allow(clippy::too_many_arguments)]
fn qwen_attention(
    b: &mut Builder<'_>,
    prefix: &str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bias: bool,
) -> Result<(), BridgeError> {
    let q = b.mul(heads, head_dim, "num_attention_heads")?;
    let kv = b.mul(kv_heads, head_dim, "num_key_value_heads")?;
    b.linear(&format!("{prefix}.q_proj"), hidden, q, bias)?;
    b.linear(&format!("{prefix}.k_proj"), hidden, kv, bias)?;
    b.linear(&format!("{prefix}.v_proj"), hidden, kv, bias)?;
    b.linear(&format!("{prefix}.o_proj"), q, hidden, bias)?;
    b.norm(&format!("{prefix}.q_norm"), head_dim)?;
    b.norm(&format!("{prefix}.k_norm"), head_dim)
}

/// Dense Qwen3 (`Qwen3ForCausalLM`). `path` names the config in errors; `block` is the FP8
/// block size of the scale companions.
pub fn qwen3_expected(
    c: &Qwen3Config,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    b.bound(c.num_hidden_layers, 16, "num_hidden_layers")?;
    let h = c.hidden_size;
    b.top_level(c.vocab_size, h, c.tie_word_embeddings)?;
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        b.norm(&format!("{p}.input_layernorm"), h)?;
        b.norm(&format!("{p}.post_attention_layernorm"), h)?;
        qwen_attention(
            &mut b,
            &format!("{p}.self_attn"),
            h,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )?;
        b.mlp(&format!("{p}.mlp"), h, c.intermediate_size)?;
    }
    Ok(b.table)
}

/// Qwen3-MoE (`Qwen3MoeForCausalLM`): MoE layers (router `mlp.gate` and routed experts in
/// `layout`) and the dense layers of `mlp_only_layers` / `decoder_sparse_step`.
pub fn qwen3_moe_expected(
    c: &Qwen3MoeConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    let per_layer = 20 + 3 * c.num_experts as u128;
    b.bound(
        c.num_hidden_layers,
        per_layer,
        "num_hidden_layers/num_experts",
    )?;
    let h = c.hidden_size;
    b.top_level(c.vocab_size, h, c.tie_word_embeddings)?;
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        b.norm(&format!("{p}.input_layernorm"), h)?;
        b.norm(&format!("{p}.post_attention_layernorm"), h)?;
        qwen_attention(
            &mut b,
            &format!("{p}.self_attn"),
            h,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )?;
        if c.is_moe_layer(l) {
            b.weight(format!("{p}.mlp.gate.weight"), vec![c.num_experts, h])?;
            b.experts(
                &format!("{p}.mlp.experts"),
                c.num_experts,
                c.moe_intermediate_size,
                h,
                layout,
            )?;
        } else {
            b.mlp(&format!("{p}.mlp"), h, c.intermediate_size)?;
        }
    }
    Ok(b.table)
}

/// One DeepSeek-V3 decoder layer under `p`: MLA attention, then a dense MLP or an MoE block
/// (router weight and F32 `e_score_correction_bias`, routed experts, shared experts).
fn deepseek_layer(
    b: &mut Builder<'_>,
    c: &DeepseekV3Config,
    p: &str,
    moe: bool,
    layout: ExpertLayout,
) -> Result<(), BridgeError> {
    let (h, nh, bias) = (c.hidden_size, c.num_attention_heads, c.attention_bias);
    b.norm(&format!("{p}.input_layernorm"), h)?;
    b.norm(&format!("{p}.post_attention_layernorm"), h)?;
    let a = format!("{p}.self_attn");
    let qk_head = b.add(c.qk_nope_head_dim, c.qk_rope_head_dim, "qk_nope_head_dim")?;
    let q_out = b.mul(nh, qk_head, "num_attention_heads")?;
    match c.q_lora_rank {
        None => b.linear(&format!("{a}.q_proj"), h, q_out, false)?,
        Some(r) => {
            b.linear(&format!("{a}.q_a_proj"), h, r, bias)?;
            b.norm(&format!("{a}.q_a_layernorm"), r)?;
            b.linear(&format!("{a}.q_b_proj"), r, q_out, false)?;
        }
    }
    let kv_a = b.add(c.kv_lora_rank, c.qk_rope_head_dim, "kv_lora_rank")?;
    b.linear(&format!("{a}.kv_a_proj_with_mqa"), h, kv_a, bias)?;
    b.norm(&format!("{a}.kv_a_layernorm"), c.kv_lora_rank)?;
    let kv_head = b.add(c.qk_nope_head_dim, c.v_head_dim, "v_head_dim")?;
    let kv_b = b.mul(nh, kv_head, "num_attention_heads")?;
    b.linear(&format!("{a}.kv_b_proj"), c.kv_lora_rank, kv_b, false)?;
    let o_in = b.mul(nh, c.v_head_dim, "num_attention_heads")?;
    b.linear(&format!("{a}.o_proj"), o_in, h, bias)?;
    let m = format!("{p}.mlp");
    if !moe {
        return b.mlp(&m, h, c.intermediate_size);
    }
    let (e, im) = (c.n_routed_experts, c.moe_intermediate_size);
    b.weight(format!("{m}.gate.weight"), vec![e, h])?;
    b.weight(format!("{m}.gate.e_score_correction_bias"), vec![e])?;
    b.experts(&format!("{m}.experts"), e, im, h, layout)?;
    if c.n_shared_experts > 0 {
        let shared = b.mul(im, c.n_shared_experts, "n_shared_experts")?;
        b.mlp(&format!("{m}.shared_experts"), h, shared)?;
    }
    Ok(())
}

/// DeepSeek-V3 (`DeepseekV3ForCausalLM`): dense layers `0..first_k_dense_replace`, MoE layers
/// after, and the `num_nextn_predict_layers` MTP layers `model.layers.{N+j}` (required: the
/// model loads them) with their optional copies of `embed_tokens` and `shared_head.head`.
pub fn deepseek_v3_expected(
    c: &DeepseekV3Config,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    let layers = c
        .num_hidden_layers
        .saturating_add(c.num_nextn_predict_layers);
    let per_layer = 30 + 3 * c.n_routed_experts as u128;
    b.bound(
        layers,
        per_layer,
        "num_hidden_layers/num_nextn_predict_layers/n_routed_experts",
    )?;
    let (h, v) = (c.hidden_size, c.vocab_size);
    b.top_level(v, h, c.tie_word_embeddings)?;
    for l in 0..c.num_hidden_layers {
        deepseek_layer(
            &mut b,
            c,
            &format!("model.layers.{l}"),
            c.is_moe_layer(l),
            layout,
        )?;
    }
    for j in 0..c.num_nextn_predict_layers {
        let p = format!("model.layers.{}", c.num_hidden_layers + j);
        deepseek_layer(&mut b, c, &p, true, layout)?;
        b.norm(&format!("{p}.enorm"), h)?;
        b.norm(&format!("{p}.hnorm"), h)?;
        let two_h = b.mul(2, h, "hidden_size")?;
        b.linear(&format!("{p}.eh_proj"), two_h, h, false)?;
        b.norm(&format!("{p}.shared_head.norm"), h)?;
        b.insert(format!("{p}.embed_tokens.weight"), vec![v, h], false)?;
        b.insert(format!("{p}.shared_head.head.weight"), vec![v, h], false)?;
    }
    Ok(b.table)
}

/// The HF tensors `config` implies, routed experts in `layout`, FP8 scale companions for
/// `block` (see the module docs). `path` names the config in errors.
pub fn expected_hf_tensors(
    config: &ModelConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    match config {
        ModelConfig::Qwen3(c) => qwen3_expected(c, path, block),
        ModelConfig::Qwen3Moe(c) => qwen3_moe_expected(c, layout, path, block),
        ModelConfig::DeepseekV3(c) => deepseek_v3_expected(c, layout, path, block),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::fp8::DEFAULT_BLOCK_SIZE;
    use crate::hf::HfCheckpoint;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    /// Every fixture's tensors are exactly the required ones (plus allowed optional ones),
    /// with the implied shapes.
    #[test]
    fn fixtures_match_their_config_tables() {
        for name in [
            "qwen3",
            "qwen3_moe",
            "qwen3_moe_bf16",
            "deepseek_v3",
            "deepseek_v3_sharded",
            "deepseek_v3_fp8",
            "deepseek_v3_fp8_dequant",
        ] {
            let dir = fixtures().join(name);
            let config = ModelConfig::from_dir(&dir).unwrap();
            let ckpt = HfCheckpoint::open(&dir).unwrap();
            let block = ckpt.fp8_block_size().unwrap();
            let path = dir.join("config.json");
            let table =
                expected_hf_tensors(&config, ExpertLayout::PerExpert, &path, block).unwrap();
            for (n, want) in &table {
                if want.required {
                    assert!(ckpt.contains(n), "{name}: {n} missing");
                }
            }
            for n in ckpt.tensor_names() {
                let want = table
                    .get(n)
                    .unwrap_or_else(|| panic!("{name}: {n} unexpected"));
                assert_eq!(ckpt.info(n).unwrap().shape, want.shape, "{name}: {n}");
            }
        }
    }

    #[test]
    fn stacked_layout_and_scales() {
        let dir = fixtures().join("qwen3_moe");
        let config = ModelConfig::from_dir(&dir).unwrap();
        let path = dir.join("config.json");
        let t = expected_hf_tensors(&config, ExpertLayout::Stacked, &path, [16, 16]).unwrap();
        assert_eq!(
            t["model.layers.1.mlp.experts.gate_up_proj"].shape,
            [8, 32, 64]
        );
        assert_eq!(t["model.layers.2.mlp.experts.down_proj"].shape, [8, 64, 16]);
        let scale = &t["model.layers.2.mlp.experts.down_proj_scale_inv"];
        assert_eq!(scale.shape, [8, 4, 1]);
        assert_eq!(scale.role, HfRole::ScaleInv);
        assert!(!scale.required);
        assert!(!t.contains_key("model.layers.1.mlp.experts.0.up_proj.weight"));
        assert!(!t.contains_key("model.layers.0.mlp.gate.weight"));
        assert_eq!(t["model.layers.0.mlp.up_proj.weight"].shape, [64, 64]);
    }

    #[test]
    fn absurd_sizes_are_config_errors_not_overflows() {
        let path = Path::new("config.json");
        let huge = Qwen3Config {
            num_attention_heads: usize::MAX / 2,
            num_key_value_heads: 1,
            head_dim: 4,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&huge, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(matches!(err, BridgeError::InvalidConfig { .. }), "{err}");
        let layers = Qwen3Config {
            num_hidden_layers: 1 << 40,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&layers, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(err.to_string().contains("num_hidden_layers"), "{err}");
        let wide = Qwen3Config {
            hidden_size: 1 << 30,
            intermediate_size: 1 << 30,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&wide, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(err.to_string().contains("not plausible"), "{err}");
    }
}
