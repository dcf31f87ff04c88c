use super::*;
use crate::config::RopeScaling;
use crate::{DeepseekV3Config, Qwen3Config};

/// `config.json` of Qwen/Qwen3-30B-A3B (transformers 4.51 spelling).
const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

/// The tiny fixture of docs/models.md §Fixtures as transformers 5.23 writes it.
const TINY_523: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"],
  "dtype": "float32",
  "head_dim": 32,
  "hidden_size": 64,
  "intermediate_size": 128,
  "max_position_embeddings": 512,
  "mlp_only_layers": [0],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 32,
  "norm_topk_prob": true,
  "num_attention_heads": 4,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 3,
  "num_key_value_heads": 2,
  "num_local_experts": 8,
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "vocab_size": 256
}"#;

/// `TINY_523` with one top-level key replaced (or added); `value` is raw JSON.
fn tiny_with(key: &str, value: &str) -> String {
    let mut v: Value = serde_json::from_str(TINY_523).unwrap();
    v[key] = serde_json::from_str(value).unwrap();
    v.to_string()
}

fn tiny_without(key: &str) -> String {
    let mut v: Value = serde_json::from_str(TINY_523).unwrap();
    v.as_object_mut().unwrap().remove(key);
    v.to_string()
}

fn invalid_field(result: Result<Qwen3MoeConfig, ModelError>) -> String {
    match result {
        Err(ModelError::InvalidValue { field, .. }) => field,
        other => panic!("expected InvalidValue, got {other:?}"),
    }
}

#[test]
fn parses_qwen3_30b_a3b() {
    let c = Qwen3MoeConfig::from_json_str(QWEN3_30B_A3B).unwrap();
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.num_experts, 128);
    assert_eq!(c.num_experts_per_tok, 8);
    assert!(c.norm_topk_prob);
    assert_eq!(c.num_hidden_layers, 48);
    assert_eq!(c.max_position_embeddings, 40960);
    assert_eq!(c.rope_parameters.rope_theta, 1e6);
    assert_eq!(c.rope_parameters.scaling, RopeScaling::Default);
    assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(c.num_moe_layers(), 48);
    // Keys we do not interpret survive verbatim, interpreted ones do not.
    assert_eq!(c.extra["bos_token_id"], 151643);
    assert_eq!(c.extra["sliding_window"], Value::Null);
    assert_eq!(c.extra["architectures"][0], "Qwen3MoeForCausalLM");
    for key in [
        "hidden_size",
        "torch_dtype",
        "rope_theta",
        "model_type",
        "use_sliding_window",
    ] {
        assert!(
            !c.extra.contains_key(key),
            "{key} should have been consumed"
        );
    }
}

#[test]
fn parses_523_spelling_and_layer_types() {
    let c = Qwen3MoeConfig::from_json_str(TINY_523).unwrap();
    assert_eq!(c.num_experts, 8);
    assert_eq!(c.dtype.as_deref(), Some("float32"));
    assert_eq!(c.rope_parameters.rope_theta, 1e6);
    assert_eq!(
        (c.head_dim, c.hidden_size / c.num_attention_heads),
        (32, 16)
    );
    assert_eq!(
        (0..3).map(|l| c.is_moe_layer(l)).collect::<Vec<_>>(),
        [false, true, true]
    );
    assert_eq!(c.num_moe_layers(), 2);
}

#[test]
fn absent_keys_take_hf_defaults() {
    let c = Qwen3MoeConfig::from_json_str(r#"{"model_type": "qwen3_moe"}"#).unwrap();
    assert_eq!(c, Qwen3MoeConfig::default());
    assert_eq!(c.num_key_value_heads, 4);
    assert_eq!(c.head_dim, 64);
    let c = Qwen3MoeConfig::from_json_str(&tiny_with("mlp_only_layers", "null")).unwrap();
    assert!(c.mlp_only_layers.is_empty());
    let c = Qwen3MoeConfig::from_json_str(&tiny_with("head_dim", "null")).unwrap();
    assert_eq!(c.head_dim, 16);
    let c = Qwen3MoeConfig::from_json_str(&tiny_without("num_key_value_heads")).unwrap();
    assert_eq!(c.num_key_value_heads, 4);
}

#[test]
fn both_spellings_must_agree() {
    let same = tiny_with("num_experts", "8");
    assert_eq!(Qwen3MoeConfig::from_json_str(&same).unwrap().num_experts, 8);
    let err = Qwen3MoeConfig::from_json_str(&tiny_with("num_experts", "16")).unwrap_err();
    assert!(matches!(
        err,
        ModelError::ConflictingFields {
            first: "num_experts",
            second: "num_local_experts",
            ..
        }
    ));
    let err = Qwen3MoeConfig::from_json_str(&tiny_with("torch_dtype", "\"bfloat16\"")).unwrap_err();
    assert!(matches!(
        err,
        ModelError::ConflictingFields { first: "dtype", .. }
    ));
}

#[test]
fn cross_field_rules_name_the_field() {
    let r = Qwen3MoeConfig::from_json_str(&tiny_with("num_experts_per_tok", "9"));
    assert_eq!(invalid_field(r), "num_experts_per_tok");
    let r = Qwen3MoeConfig::from_json_str(&tiny_with("num_key_value_heads", "3"));
    assert_eq!(invalid_field(r), "num_key_value_heads");
    // hidden 66 is not divisible by 4 heads: fine with head_dim, an error without.
    let odd = tiny_with("hidden_size", "66");
    assert_eq!(Qwen3MoeConfig::from_json_str(&odd).unwrap().head_dim, 32);
    let mut v: Value = serde_json::from_str(&odd).unwrap();
    v.as_object_mut().unwrap().remove("head_dim");
    let err = Qwen3MoeConfig::from_json_str(&v.to_string()).unwrap_err();
    assert!(err.to_string().contains("`hidden_size`"), "{err}");
    assert_eq!(invalid_field(Err(err)), "hidden_size");
}

#[test]
fn zero_sizes_are_rejected() {
    for field in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "decoder_sparse_step",
        "max_position_embeddings",
        "num_experts_per_tok",
    ] {
        let r = Qwen3MoeConfig::from_json_str(&tiny_with(field, "0"));
        assert_eq!(invalid_field(r), field);
    }
    // Zero experts is a dense model, not an error.
    let dense = tiny_with("num_local_experts", "0");
    let c = Qwen3MoeConfig::from_json_str(&dense).unwrap();
    assert_eq!(c.num_moe_layers(), 0);
}

#[test]
fn wrong_types_and_nulls() {
    for (field, value) in [
        ("hidden_size", "\"64\""),
        ("hidden_size", "-64"),
        ("hidden_size", "64.5"),
        ("hidden_size", "null"),
        ("rms_norm_eps", "\"1e-6\""),
        ("norm_topk_prob", "1"),
        ("mlp_only_layers", "[0, -1]"),
        ("rope_parameters", "[]"),
    ] {
        match Qwen3MoeConfig::from_json_str(&tiny_with(field, value)) {
            Err(ModelError::WrongType { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field} = {value}: expected WrongType, got {other:?}"),
        }
    }
    let err = Qwen3MoeConfig::from_json_str(&tiny_with("num_key_value_heads", "null")).unwrap_err();
    assert!(matches!(
        err,
        ModelError::MissingField {
            field: "num_key_value_heads",
            ..
        }
    ));
}

#[test]
fn unsupported_features_are_rejected() {
    let err = Qwen3MoeConfig::from_json_str(&tiny_with("model_type", "\"qwen3\"")).unwrap_err();
    assert!(matches!(err, ModelError::WrongModelType { .. }));
    let err = Qwen3MoeConfig::from_json_str(&tiny_without("model_type")).unwrap_err();
    assert!(err.to_string().contains("model_type"));
    let r = Qwen3MoeConfig::from_json_str(&tiny_with("hidden_act", "\"gelu\""));
    assert_eq!(invalid_field(r), "hidden_act");
    let r = Qwen3MoeConfig::from_json_str(&tiny_with("use_sliding_window", "true"));
    assert_eq!(invalid_field(r), "use_sliding_window");
    let r = Qwen3MoeConfig::from_json_str(&tiny_with("rms_norm_eps", "0"));
    assert_eq!(invalid_field(r), "rms_norm_eps");
}

#[test]
fn invalid_json_is_an_error() {
    for text in ["", "{", "[1, 2]", "{\"model_type\": \"qwen3_moe\",}"] {
        let err = Qwen3MoeConfig::from_json_str(text).unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidJson { .. }),
            "{text:?}: {err:?}"
        );
    }
}

#[test]
fn moe_layer_rule() {
    let c = Qwen3MoeConfig {
        num_hidden_layers: 8,
        decoder_sparse_step: 2,
        mlp_only_layers: vec![3, 100],
        ..Qwen3MoeConfig::default()
    };
    let moe: Vec<usize> = (0..8).filter(|&l| c.is_moe_layer(l)).collect();
    assert_eq!(moe, [1, 5, 7]);
    let broken = Qwen3MoeConfig {
        decoder_sparse_step: 0,
        ..c.clone()
    };
    assert!(!broken.is_moe_layer(1)); // no division by zero
    let dense = Qwen3MoeConfig {
        num_experts: 0,
        ..c
    };
    assert_eq!(dense.num_moe_layers(), 0);
}

#[test]
fn legacy_yarn_rope_scaling_gets_hf_defaults() {
    let mut v: Value = serde_json::from_str(TINY_523).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("rope_parameters");
    obj.insert("rope_theta".into(), 10000.into());
    obj.insert("original_max_position_embeddings".into(), 128.into());
    obj.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "yarn", "factor": null, "beta_fast": 0, "beta_slow": null}),
    );
    let c = Qwen3MoeConfig::from_json_str(&v.to_string()).unwrap();
    assert_eq!(c.rope_parameters.rope_type(), "yarn");
    let RopeScaling::Yarn(y) = c.rope_parameters.scaling else {
        panic!("expected yarn");
    };
    assert_eq!(y.original_max_position_embeddings, 128);
    assert_eq!(y.factor, 4.0); // 512 / 128
    assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
    assert!(y.truncate);
    assert!(!c.extra.contains_key("original_max_position_embeddings"));

    let r = Qwen3MoeConfig::from_json_str(&tiny_with(
        "rope_parameters",
        r#"{"rope_type": "linear", "factor": 2.0}"#,
    ));
    assert_eq!(invalid_field(r), "rope_parameters.rope_type");
    let r = Qwen3MoeConfig::from_json_str(&tiny_with(
        "rope_parameters",
        r#"{"rope_type": "default", "rope_theta": 0}"#,
    ));
    assert_eq!(invalid_field(r), "rope_theta");
}

#[test]
fn from_file_names_the_path() {
    let dir = std::env::temp_dir().join(format!("moe-models-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.json");
    let err = Qwen3MoeConfig::from_file(&missing).unwrap_err();
    assert!(matches!(err, ModelError::Io { .. }));
    assert!(err.to_string().contains("missing.json"));

    let bad = dir.join("config.json");
    std::fs::write(&bad, tiny_with("num_experts_per_tok", "9")).unwrap();
    let err = Qwen3MoeConfig::from_file(&bad).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("config.json") && text.contains("num_experts_per_tok"),
        "{text}"
    );
    std::fs::write(&bad, TINY_523).unwrap();
    assert_eq!(Qwen3MoeConfig::from_file(&bad).unwrap().num_experts, 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every HF default omitted: each family parses to the values transformers 5.23 gives the same
/// minimal config. Expected numbers printed by `benches/.venv` (transformers 5.23.0) for
/// `cls.from_dict({"model_type": cls.model_type})` with `cls` = `Qwen3Config`,
/// `Qwen3MoeConfig`, `DeepseekV3Config`, reading each attribute named below; `rope_parameters`
/// printed `{'rope_theta': 10000.0, 'rope_type': 'default'}` and `dtype` `None` for all three.
#[test]
fn minimal_configs_match_transformers_defaults() {
    let hf_rope = RopeParameters {
        rope_theta: 10000.0,
        scaling: RopeScaling::Default,
    };
    let q = Qwen3Config::from_json_str(r#"{"model_type": "qwen3"}"#).unwrap();
    let hf = Qwen3Config {
        vocab_size: 151936,
        hidden_size: 4096,
        intermediate_size: 22016,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_parameters: hf_rope.clone(),
        max_position_embeddings: 32768,
        tie_word_embeddings: false,
        attention_bias: false,
        // HF: `sliding_window` None without `use_sliding_window`, every layer full.
        use_sliding_window: false,
        sliding_window: None,
        max_window_layers: 28,
        layer_types: Vec::new(),
        dtype: None,
        extra: Map::new(),
    };
    assert_eq!(q, hf);
    assert_eq!(q, Qwen3Config::default());

    let m = Qwen3MoeConfig::from_json_str(r#"{"model_type": "qwen3_moe"}"#).unwrap();
    let hf = Qwen3MoeConfig {
        vocab_size: 151936,
        hidden_size: 2048,
        intermediate_size: 6144,
        moe_intermediate_size: 768,
        num_hidden_layers: 24,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        // No `head_dim` attribute in HF's Qwen3MoeConfig; its attention falls back to H / nh.
        head_dim: 2048 / 32,
        num_experts: 128,
        num_experts_per_tok: 8,
        norm_topk_prob: false,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        rms_norm_eps: 1e-6,
        rope_parameters: hf_rope.clone(),
        max_position_embeddings: 32768,
        tie_word_embeddings: false,
        router_aux_loss_coef: 0.001,
        output_router_logits: false,
        attention_bias: false,
        dtype: None,
        extra: Map::new(),
    };
    assert_eq!(m, hf);

    let d = DeepseekV3Config::from_json_str(r#"{"model_type": "deepseek_v3"}"#).unwrap();
    let hf = DeepseekV3Config {
        vocab_size: 129280,
        hidden_size: 7168,
        intermediate_size: 18432,
        moe_intermediate_size: 2048,
        num_hidden_layers: 61,
        num_attention_heads: 128,
        num_key_value_heads: 128,
        n_shared_experts: 1,
        n_routed_experts: 256,
        num_experts_per_tok: 8,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        q_lora_rank: Some(1536),
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        first_k_dense_replace: 3,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-6,
        rope_parameters: hf_rope,
        rope_interleave: true,
        attention_bias: false,
        tie_word_embeddings: false,
        // The one deliberate difference: 5.23 prints 1; a config without the key has no MTP
        // weights, so we default to 0.
        num_nextn_predict_layers: 0,
        dtype: None,
        extra: Map::new(),
    };
    assert_eq!(d, hf);
    assert_eq!(d.qk_head_dim(), 192); // HF `qk_head_dim`
}

#[test]
fn unknown_fields_survive_parse_and_serialize() {
    let custom = r#"{"nested": [1, 2.5, null], "s": "x"}"#;
    let text = tiny_with("my_custom_key", custom);
    let c = Qwen3MoeConfig::from_json_str(&text).unwrap();
    let custom: Value = serde_json::from_str(custom).unwrap();
    assert_eq!(c.extra["my_custom_key"], custom);
    let out = serde_json::to_value(&c).unwrap();
    assert_eq!(out["my_custom_key"], custom);
    assert_eq!(out["architectures"][0], "Qwen3MoeForCausalLM");
    // Interpreted keys are written once, in the 5.23 spelling.
    assert_eq!(out["num_experts"], 8);
    assert_eq!(out["dtype"], "float32");
    assert!(out.get("num_local_experts").is_none() && out.get("torch_dtype").is_none());
    assert_eq!(
        out["rope_parameters"],
        serde_json::json!({"rope_type": "default", "rope_theta": 1e6})
    );
    // ... and read back to the same config, through `from_json_str` or serde.
    assert_eq!(Qwen3MoeConfig::from_json_str(&out.to_string()).unwrap(), c);
    assert_eq!(serde_json::from_value::<Qwen3MoeConfig>(out).unwrap(), c);

    let q = Qwen3Config::from_json_str(
        r#"{"model_type": "qwen3", "max_window_layers": 28, "num_hidden_layers": 1,
            "layer_types": ["full_attention"]}"#,
    )
    .unwrap();
    let out = serde_json::to_value(&q).unwrap();
    assert_eq!(out["max_window_layers"], 28);
    assert_eq!(out["layer_types"][0], "full_attention");
    assert_eq!(serde_json::from_value::<Qwen3Config>(out).unwrap(), q);
}

#[test]
fn deepseek_yarn_and_quantization_config_round_trip() {
    let text = r#"{"model_type": "deepseek_v3", "q_lora_rank": null, "num_mtp_layers": 1,
        "max_position_embeddings": 163840, "rope_theta": 10000, "head_dim": 64,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "scoring_func": "sigmoid"}"#;
    let c = DeepseekV3Config::from_json_str(text).unwrap();
    let RopeScaling::Yarn(y) = &c.rope_parameters.scaling else {
        panic!("expected yarn");
    };
    assert_eq!((y.factor, y.original_max_position_embeddings), (40.0, 4096));
    assert_eq!((y.mscale, y.attention_factor), (Some(1.0), None));
    let out = serde_json::to_value(&c).unwrap();
    assert_eq!(
        out["q_lora_rank"],
        Value::Null,
        "null is not the same as absent here"
    );
    assert_eq!(out["num_nextn_predict_layers"], 1);
    assert_eq!(
        (&out["head_dim"], &out["qk_head_dim"]),
        (&64.into(), &192.into())
    );
    assert_eq!(out["quantization_config"]["weight_block_size"][1], 128);
    assert_eq!(out["scoring_func"], "sigmoid");
    assert_eq!(out["rope_parameters"]["rope_type"], "yarn");
    assert_eq!(out["rope_parameters"]["rope_theta"], 10000.0);
    assert!(out.get("rope_scaling").is_none() && out.get("rope_theta").is_none());
    assert_eq!(
        DeepseekV3Config::from_json_str(&out.to_string()).unwrap(),
        c
    );
}

#[test]
fn wrong_types_name_the_field_in_the_message() {
    for (field, value, message) in [
        (
            "num_experts_per_tok",
            "\"8\"",
            "config field `num_experts_per_tok` must be a non-negative integer, found \"8\"",
        ),
        // Integer-valued floats are not integers (as before); integers are fine as floats.
        (
            "hidden_size",
            "64.0",
            "config field `hidden_size` must be a non-negative integer, found 64.0",
        ),
        (
            "router_aux_loss_coef",
            "null",
            "config field `router_aux_loss_coef` must be a number, found null",
        ),
        (
            "output_router_logits",
            "\"no\"",
            "config field `output_router_logits` must be a boolean, found \"no\"",
        ),
        (
            "mlp_only_layers",
            "[0, -1]",
            "config field `mlp_only_layers` must be a non-negative integer, found -1 at index 1",
        ),
        (
            "mlp_only_layers",
            "3",
            "config field `mlp_only_layers` must be a list, found 3",
        ),
        (
            "rope_parameters",
            r#"{"rope_type": "yarn", "factor": "4"}"#,
            "config field `rope_parameters.factor` must be a number, found \"4\"",
        ),
        (
            "rope_scaling",
            "true",
            "config field `rope_scaling` must be an object or null, found true",
        ),
        (
            "num_local_experts",
            "null",
            "config field `num_local_experts` must be a non-negative integer, found null",
        ),
        (
            "dtype",
            "16",
            "config field `dtype` must be a string, found 16",
        ),
    ] {
        let err = Qwen3MoeConfig::from_json_str(&tiny_with(field, value)).unwrap_err();
        assert_eq!(err.to_string(), message, "{field} = {value}");
    }
    let c = Qwen3MoeConfig::from_json_str(&tiny_with("rms_norm_eps", "1")).unwrap();
    assert_eq!(c.rms_norm_eps, 1.0);

    // A legacy top-level `original_max_position_embeddings` is read (and typed) only for YaRN.
    let mut v: Value = serde_json::from_str(TINY_523).unwrap();
    v["original_max_position_embeddings"] = "128".into();
    let c = Qwen3MoeConfig::from_json_str(&v.to_string()).unwrap();
    assert_eq!(c.extra["original_max_position_embeddings"], "128");
    v["rope_parameters"] = serde_json::json!({"rope_type": "yarn"});
    match Qwen3MoeConfig::from_json_str(&v.to_string()) {
        Err(ModelError::WrongType { field, .. }) => {
            assert_eq!(field, "original_max_position_embeddings")
        }
        other => panic!("expected WrongType, got {other:?}"),
    }

    // A config of another family is reported by its model_type, not its first odd field.
    let err = DeepseekV3Config::from_json_str(&tiny_with("hidden_size", "\"x\"")).unwrap_err();
    assert!(matches!(err, ModelError::WrongModelType { .. }), "{err:?}");
    // Deserializing through serde validates too.
    let err =
        serde_json::from_str::<Qwen3MoeConfig>(&tiny_with("num_experts_per_tok", "9")).unwrap_err();
    assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
}
