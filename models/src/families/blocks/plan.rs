//! HF layout shared by the families built from the same blocks ([`super`]): the MTP layers'
//! plan rows, names and copies, and the DeepSeek-style MoE block's router
//! bias and shared experts (their names as the DeepSeek-V3 and GLM-4.5 releases spell them).

use moe_bridge::mapping::Rule;
use moe_bridge::safetensors::Dtype;

use crate::param_plan::PlanEntry;
use crate::param_plan::hf_names::{
    self as n, EXPERT_BIAS, SHARED_EXPERTS, SHARED_HEAD, join, layer as layer_of, mtp_copy_names,
    weight,
};
use crate::param_plan::rows::{norm, replicated};

/// MTP: embedding norm.
pub const ENORM: &str = "enorm";
/// MTP: hidden-state norm.
pub const HNORM: &str = "hnorm";
/// MTP: the projection of `[embedding; hidden]`.
pub const EH_PROJ: &str = "eh_proj";

/// The plan rows of MTP modules (`mtp.*`, an [`MtpModule`](crate::mtp::MtpModule) stored as
/// layer `num_hidden_layers + j`) whose block's rows `layer(burn_path, hf_prefix)` gives:
/// `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` replicated, the block sharded like any
/// decoder layer.
pub fn mtp_rows(layer: impl Fn(&str, &str) -> Vec<PlanEntry>) -> Vec<PlanEntry> {
    let m = "mtp.*";
    let h = &layer_of("{0+L}");
    let mut rows = norm(&join(m, ENORM), &join(h, ENORM));
    rows.extend(norm(&join(m, HNORM), &join(h, HNORM)));
    rows.extend(replicated(
        &join(m, EH_PROJ),
        &join(h, EH_PROJ),
        false,
        false,
    ));
    rows.extend(layer(&format!("{m}.block"), h));
    rows.extend(norm(
        &format!("{m}.{SHARED_HEAD}_norm"),
        &format!("{h}.{SHARED_HEAD}.norm"),
    ));
    rows
}

/// The release copies of the embedding and the head in the `depths` MTP layers after `layers`
/// decoder layers, `(name, source)` (as DeepSeek-V3 releases carry them; `tied` or an absent `lm_head`
/// makes the embedding the head).
pub fn mtp_copies(
    layers: usize,
    depths: usize,
    tied: bool,
    has: &dyn Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let (embed, lm_head) = (n::embed_weight(), n::lm_head_weight());
    let head = if tied || !has(&lm_head) {
        &embed
    } else {
        &lm_head
    };
    (0..depths)
        .flat_map(|j| {
            let (e, h) = mtp_copy_names(layers + j);
            [(e, embed.clone()), (h, head.clone())]
        })
        .collect()
}

/// The name-mapping rules of the MTP layers' own tensors (`enorm`, `hnorm`, `eh_proj`,
/// `shared_head.norm`) and the ignores of their copies of the embedding and the LM head (the
/// main model's tensors, re-emitted on export). The copies' ignores must come before any rule
/// of the main model's tensors.
pub fn mtp_rules() -> (Vec<Rule>, Vec<Rule>) {
    let (embed_copy, head_copy) = mtp_copy_names(0);
    let any_layer = |name: &str| name.replacen(&layer_of(0), &layer_of("*"), 1);
    let ignores = vec![
        Rule::ignore(&any_layer(&embed_copy), "MTP copy of the embedding weight"),
        Rule::ignore(&any_layer(&head_copy), "MTP copy of the LM head weight"),
    ];
    let own = n::per_layer([ENORM, HNORM, EH_PROJ, &join(SHARED_HEAD, "norm")].map(weight));
    (ignores, own)
}

/// The router's F32 `e_score_correction_bias` (kept F32 on export) and the shared experts'
/// MLP, rules under any layer.
pub fn expert_bias_and_shared_rules() -> Vec<Rule> {
    let mut rules = vec![Rule::same_as_dtype(
        &format!("{}.{}.{}.{EXPERT_BIAS}", layer_of("*"), n::MLP, n::ROUTER),
        Dtype::F32,
    )];
    rules.extend(n::per_layer(
        n::MLP_PROJS.map(|p| weight(&format!("{}.{SHARED_EXPERTS}.{p}", n::MLP))),
    ));
    rules
}
