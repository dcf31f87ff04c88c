//! The HF tensor names of the Llama-family layout every built-in model shares (Qwen3,
//! Qwen3-MoE, DeepSeek-V3): `model.embed_tokens`, `model.layers.{i}` with
//! `input_layernorm` / `post_attention_layernorm`, `self_attn.{q,k,v,o}_proj`, a SwiGLU
//! `mlp.{gate,up,down}_proj` or an MoE `mlp` (router `mlp.gate`, routed experts
//! `mlp.experts.{e}.…` or stacked `mlp.experts.gate_up_proj` / `down_proj`), `model.norm` and
//! `lm_head`.
//!
//! This is the one place these literals are spelled (a test enforces it); each model's plan
//! file (`qwen3.rs`, `qwen3_moe.rs`, `deepseek_v3.rs`) builds its parallel plan and name-mapping
//! rules from these (the expected-tensor table is derived from the plan,
//! [`crate::families::expected`]) and adds its own names (Qwen3's `q_norm` /
//! `k_norm`, DeepSeek-V3's MLA projections, MTP modules and router bias). Burn module paths
//! of the built-in models use the same field names, so the plan rows read them from here too.

use std::fmt::Display;

use moe_bridge::dist::StagePlace;
use moe_bridge::mapping::Rule;

/// Prefix of the decoder layers: layer `i` is `model.layers.{i}`.
pub const LAYERS: &str = "model.layers";
/// The token embedding module.
pub const EMBED_TOKENS: &str = "model.embed_tokens";
/// The final norm module.
pub const FINAL_NORM: &str = "model.norm";
/// The LM head module.
pub const LM_HEAD: &str = "lm_head";

/// A layer's pre-attention norm.
pub const INPUT_LAYERNORM: &str = "input_layernorm";
/// A layer's pre-MLP norm.
pub const POST_ATTENTION_LAYERNORM: &str = "post_attention_layernorm";
/// A layer's attention module.
pub const SELF_ATTN: &str = "self_attn";
/// A layer's MLP (dense or MoE) module.
pub const MLP: &str = "mlp";

/// Attention query projection.
pub const Q_PROJ: &str = "q_proj";
/// Attention key projection.
pub const K_PROJ: &str = "k_proj";
/// Attention value projection.
pub const V_PROJ: &str = "v_proj";
/// Attention output projection.
pub const O_PROJ: &str = "o_proj";

/// SwiGLU gate projection.
pub const GATE_PROJ: &str = "gate_proj";
/// SwiGLU up projection.
pub const UP_PROJ: &str = "up_proj";
/// SwiGLU down projection.
pub const DOWN_PROJ: &str = "down_proj";
/// The three SwiGLU projections, in order.
pub const MLP_PROJS: [&str; 3] = [GATE_PROJ, UP_PROJ, DOWN_PROJ];

/// The names of a routed expert's three SwiGLU projections in a checkpoint that stores one
/// tensor per expert and projection (`{experts}.{e}.{gate|up|down}.weight`). Llama's names
/// ([`ExpertProjections::LLAMA`]) are the default; a family whose release spells them
/// otherwise declares its own on its plan
/// ([`ParallelPlan::with_expert_projections`](super::ParallelPlan::with_expert_projections)).
/// The canonical (stacked) names do not depend on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertProjections {
    /// The gate projection (`x → silu(x Wgᵀ)`), `[Im, H]`.
    pub gate: &'static str,
    /// The up projection, `[Im, H]`.
    pub up: &'static str,
    /// The down projection, `[H, Im]`.
    pub down: &'static str,
}

impl ExpertProjections {
    /// Llama's `gate_proj` / `up_proj` / `down_proj`.
    pub const LLAMA: Self = Self {
        gate: GATE_PROJ,
        up: UP_PROJ,
        down: DOWN_PROJ,
    };

    /// `[gate, up, down]`.
    pub fn all(&self) -> [&'static str; 3] {
        [self.gate, self.up, self.down]
    }
}

impl Default for ExpertProjections {
    fn default() -> Self {
        Self::LLAMA
    }
}

/// An MoE block's router, inside `mlp` (`mlp.gate.weight`).
pub const ROUTER: &str = "gate";
/// An MoE block's routed experts, inside `mlp`.
pub const EXPERTS: &str = "experts";
/// The router's expert bias, inside `mlp.gate` (kept F32 on export).
pub const EXPERT_BIAS: &str = "e_score_correction_bias";
/// The shared experts, inside `mlp`.
pub const SHARED_EXPERTS: &str = "shared_experts";
/// Qwen3's per-head query norm, inside `self_attn`.
pub const Q_NORM: &str = "q_norm";
/// Qwen3's per-head key norm, inside `self_attn`.
pub const K_NORM: &str = "k_norm";
/// Stacked routed experts' fused gate/up projection (`[E, 2, Im, H]` canonical).
pub const GATE_UP_PROJ: &str = "gate_up_proj";

/// `{module}.weight`.
pub fn weight(module: &str) -> String {
    format!("{module}.weight")
}

/// `{a}.{b}`.
pub fn join(a: &str, b: &str) -> String {
    format!("{a}.{b}")
}

/// Decoder layer `l`'s module (`l` may be an index, `*` or a plan template such as `{0}`).
pub fn layer(l: impl Display) -> String {
    format!("{LAYERS}.{l}")
}

/// The embedding weight.
pub fn embed_weight() -> String {
    weight(EMBED_TOKENS)
}

/// The final norm weight.
pub fn final_norm_weight() -> String {
    weight(FINAL_NORM)
}

/// The LM head weight.
pub fn lm_head_weight() -> String {
    weight(LM_HEAD)
}

/// The decoder layer index of a name under `model.layers.{i}.`, if any.
pub fn layer_index(name: &str) -> Option<usize> {
    let rest = name.strip_prefix(LAYERS)?.strip_prefix('.')?;
    rest.split('.').next()?.parse().ok()
}

/// Whether `name` is a tensor of the final norm or the LM head (last pipeline stage).
pub fn is_final_norm_or_head(name: &str) -> bool {
    [FINAL_NORM, LM_HEAD]
        .iter()
        .any(|m| name.strip_prefix(m).is_some_and(|r| r.starts_with('.')))
}

/// The pipeline placement of canonical tensor `name`: its decoder layer (the last stage when
/// its index is unreadable), the final norm and LM head on the last stage, the embedding (and
/// anything else) on the first.
pub fn stage_place(name: &str) -> StagePlace {
    if name
        .strip_prefix(LAYERS)
        .is_some_and(|r| r.starts_with('.'))
    {
        return layer_index(name).map_or(StagePlace::Last, StagePlace::Layer);
    }
    if is_final_norm_or_head(name) {
        StagePlace::Last
    } else {
        StagePlace::First
    }
}

/// Whether `name` is an embedding or LM-head matrix, including copies of them elsewhere
/// (`…embed_tokens.weight` of any module, `…lm_head…`).
pub fn mentions_embedding_or_head(name: &str) -> bool {
    name.contains(EMBED_TOKENS.rsplit('.').next().unwrap_or(EMBED_TOKENS)) || name.contains(LM_HEAD)
}

/// Whether `name` is an MoE router weight (`….{moe block}.gate.weight`, the block `mlp` or a
/// family's own name; projections are never named `gate`).
pub fn is_router_weight(name: &str) -> bool {
    name.ends_with(&format!(".{}", weight(ROUTER)))
}

/// Stacked routed experts `{experts}.gate_up_proj`.
pub fn stacked_gate_up(experts: &str) -> String {
    join(experts, GATE_UP_PROJ)
}

/// Stacked routed experts `{experts}.down_proj`.
pub fn stacked_down(experts: &str) -> String {
    join(experts, DOWN_PROJ)
}

/// `(experts prefix, is gate_up)` of a stacked routed-expert name, `None` for other names.
pub fn split_stacked(name: &str) -> Option<(&str, bool)> {
    if let Some(p) = name.strip_suffix(&format!(".{GATE_UP_PROJ}")) {
        return Some((p, true));
    }
    name.strip_suffix(&format!(".{DOWN_PROJ}"))
        .map(|p| (p, false))
}

/// Expert `e`'s projection `proj` weight, per-expert layout: `{experts}.{e}.{proj}.weight`.
pub fn expert_proj_weight(experts: &str, e: impl Display, proj: &str) -> String {
    format!("{experts}.{e}.{proj}.weight")
}

/// The dense MLP weights of layer `l` (`gate`, `up`, `down`).
pub fn dense_mlp_weights(l: usize) -> [String; 3] {
    let mlp = join(&layer(l), MLP);
    MLP_PROJS.map(|p| weight(&join(&mlp, p)))
}

/// The MoE router weight of layer `l`.
pub fn router_weight(l: usize) -> String {
    weight(&join(&join(&layer(l), MLP), ROUTER))
}

/// The routed-experts module of layer `l`.
pub fn experts_of(l: usize) -> String {
    join(&join(&layer(l), MLP), EXPERTS)
}

// ---- Name-mapping rules (moe-bridge's engine) ----

/// Embedding, final norm and LM head, HF name = canonical name.
pub fn top_level_rules() -> Vec<Rule> {
    [embed_weight(), final_norm_weight(), lm_head_weight()]
        .iter()
        .map(|n| Rule::same(n))
        .collect()
}

/// `model.layers.*.<suffix>` for each suffix, HF name = canonical name.
pub fn per_layer<S: AsRef<str>>(suffixes: impl IntoIterator<Item = S>) -> Vec<Rule> {
    suffixes
        .into_iter()
        .map(|s| Rule::same(&join(&layer("*"), s.as_ref())))
        .collect()
}

/// The two layer norms' weights (suffixes under a layer).
pub fn layer_norm_suffixes() -> Vec<String> {
    [INPUT_LAYERNORM, POST_ATTENTION_LAYERNORM]
        .map(weight)
        .to_vec()
}

/// The dense MLP's weights (suffixes under a layer).
pub fn dense_mlp_suffixes() -> Vec<String> {
    MLP_PROJS.map(|p| weight(&join(MLP, p))).to_vec()
}

/// The MoE router weight (suffix under a layer).
pub fn router_suffix() -> String {
    weight(&join(MLP, ROUTER))
}

/// `self_attn.<p>.weight` (and, with `bias`, `.bias`) for each projection `p`.
pub fn attention_suffixes(projs: &[&str], bias: bool) -> Vec<String> {
    let mut out: Vec<String> = projs.iter().map(|p| weight(&join(SELF_ATTN, p))).collect();
    if bias {
        out.extend(projs.iter().map(|p| format!("{SELF_ATTN}.{p}.bias")));
    }
    out
}

/// Per-expert and stacked routed-expert rules (both layouts; one is chosen per checkpoint) of
/// the Llama-family MoE block `model.layers.*.mlp`.
pub fn routed_expert_rules() -> Vec<Rule> {
    routed_expert_rules_in(&join(&layer("*"), MLP), ExpertProjections::LLAMA)
}

/// [`routed_expert_rules`] of the MoE block `block` (a pattern such as
/// `model.layers.*.mlp`) whose per-expert tensors are named by `projs`.
pub fn routed_expert_rules_in(block: &str, projs: ExpertProjections) -> Vec<Rule> {
    let experts = join(block, EXPERTS);
    let gate_up = stacked_gate_up(&experts);
    let down = stacked_down(&experts);
    let [g, u, d] = projs.all().map(|p| expert_proj_weight(&experts, "{e}", p));
    vec![
        Rule::stack_experts(&gate_up, &[&g, &u]),
        Rule::stack_experts(&down, &[&d]),
        Rule::fused_experts(&gate_up, &gate_up, Some(2)),
        Rule::fused_experts(&down, &down, None),
    ]
}

// ---- Multi-token prediction layers (DeepSeek-V3 and GLM-4.5 releases) ----

/// MTP: the shared head module (`shared_head.norm`, `shared_head.head`).
pub const SHARED_HEAD: &str = "shared_head";

/// Whether `name` is the router's expert bias (`….mlp.gate.e_score_correction_bias`), stored
/// F32 whatever the export dtype.
pub fn is_expert_bias(name: &str) -> bool {
    name.ends_with(EXPERT_BIAS)
}

/// Whether `name` is an MTP copy of the LM head (`model.layers.{N+j}.shared_head.head.weight`).
pub fn is_mtp_head_copy(name: &str) -> bool {
    name.contains(&join(SHARED_HEAD, "head"))
}

/// The MTP layer `l`'s copies of the embedding and the LM head, `(embed, head)` names.
pub fn mtp_copy_names(l: usize) -> (String, String) {
    let p = layer(l);
    let embed_suffix = EMBED_TOKENS.rsplit('.').next().unwrap_or(EMBED_TOKENS);
    (
        weight(&join(&p, embed_suffix)),
        weight(&join(&join(&p, SHARED_HEAD), "head")),
    )
}

// ---- Name-mapping rules read off a plan ----

/// The name-mapping rules of a family read off its plan rows (canonical name = HF name for
/// every row, a layer placeholder `{0}` / `{0+L}` matching any layer): dense tensors one rule
/// each (the router's expert bias kept F32 on export), routed experts stacked per layer from
/// the plan's per-expert projection names or taken fused. A family adds only what no row
/// spells: the ignores of tensors its release repeats (MTP copies) and release layouts.
pub fn rules_from_plan(plan: &super::ParallelPlan) -> Vec<Rule> {
    let any_layer = |hf: &str| -> String {
        hf.split('.')
            .map(|seg| if seg.starts_with('{') { "*" } else { seg })
            .collect::<Vec<_>>()
            .join(".")
    };
    let mut rules: Vec<Rule> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut push = |rule: Rule, rules: &mut Vec<Rule>| {
        if seen.insert(format!("{rule:?}")) {
            rules.push(rule);
        }
    };
    for entry in plan.entries() {
        let hf = any_layer(&entry.hf);
        if let Some((experts, _gate_up)) = split_stacked(&hf) {
            let block = experts
                .strip_suffix(&format!(".{EXPERTS}"))
                .unwrap_or(experts);
            for rule in routed_expert_rules_in(block, plan.expert_projections()) {
                push(rule, &mut rules);
            }
            continue;
        }
        let rule = if is_expert_bias(&hf) {
            Rule::same_as_dtype(&hf, moe_bridge::safetensors::Dtype::F32)
        } else {
            Rule::same(&hf)
        };
        push(rule, &mut rules);
    }
    rules
}
