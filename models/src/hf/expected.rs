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
//! ([`MAX_TENSORS`](moe_bridge::mapping::MAX_TENSORS),
//! [`MAX_ELEMENTS`](moe_bridge::mapping::MAX_ELEMENTS)) by moe-bridge's
//! [`ExpectedBuilder`](moe_bridge::mapping::ExpectedBuilder), so
//! an absurd config is an error rather than an overflow, a huge allocation or a hang.
//!
//! [`HfCheckpoint::check`]: moe_bridge::hf::HfCheckpoint::check

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedBuilder as Builder, ExpectedTable, ExpertLayout};

use super::load::ModelConfig;
use crate::{DeepseekV3Config, Qwen3Config, Qwen3MoeConfig};

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
    Ok(b.finish())
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
    Ok(b.finish())
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
    Ok(b.finish())
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

    use moe_bridge::fp8::DEFAULT_BLOCK_SIZE;
    use moe_bridge::hf::HfCheckpoint;
    use moe_bridge::mapping::HfRole;

    use super::*;

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
