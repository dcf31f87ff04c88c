//! HF layout shared by the families built from the same blocks ([`super`]): the MTP layers'
//! plan rows, names, copies and expected tensors, and the DeepSeek-style MoE block's router
//! bias and shared experts (their names as the DeepSeek-V3 and GLM-4.5 releases spell them).

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedBuilder as Builder, ExpertLayout, Rule};
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

/// The tensors of MTP layer `p` besides its decoder layer: `enorm`, `hnorm`, `eh_proj`
/// `[H, 2H]`, `shared_head.norm`, and the optional copies of `embed_tokens` and
/// `shared_head.head` (`[V, H]`).
pub fn expected_mtp_extras(
    b: &mut Builder<'_>,
    layer: usize,
    hidden: usize,
    vocab: usize,
) -> Result<(), BridgeError> {
    let p = layer_of(layer);
    b.norm(&join(&p, ENORM), hidden)?;
    b.norm(&join(&p, HNORM), hidden)?;
    let two_h = b.mul(2, hidden, "hidden_size")?;
    b.linear(&join(&p, EH_PROJ), two_h, hidden, false)?;
    b.norm(&format!("{p}.{SHARED_HEAD}.norm"), hidden)?;
    let (embed_copy, head_copy) = mtp_copy_names(layer);
    b.insert(embed_copy, vec![vocab, hidden], false)?;
    b.insert(head_copy, vec![vocab, hidden], false)
}

/// The routed experts, router bias and shared experts of an MoE block `m` (`mlp`) as
/// DeepSeek-V3 stores them: router weight, experts in `layout`, F32
/// `gate.e_score_correction_bias`, shared experts of width `Im · n_shared_experts`.
pub fn expected_sigmoid_moe(
    b: &mut Builder<'_>,
    m: &str,
    moe: &super::moe::SigmoidGroupMoe,
    layout: ExpertLayout,
) -> Result<(), BridgeError> {
    let (e, im, h) = (
        moe.n_routed_experts,
        moe.moe_intermediate_size,
        moe.hidden_size,
    );
    n::expected_moe(b, m, e, im, h, layout)?;
    b.weight(format!("{m}.{}.{EXPERT_BIAS}", n::ROUTER), vec![e])?;
    if moe.n_shared_experts > 0 {
        let shared = b.mul(im, moe.n_shared_experts, "n_shared_experts")?;
        n::expected_mlp(b, &join(m, SHARED_EXPERTS), h, shared)?;
    }
    Ok(())
}
