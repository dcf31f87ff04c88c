//! The parallel plans cover every parameter (issue 15, "plan coverage"): each parameter and
//! buffer of every model, full and sharded under several layouts, resolves to exactly one plan
//! entry, whose canonical HF name exists in the model's HF checkpoint fixture with the shape the
//! rank's shard implies (storage transform × split), whose split equals the distributed
//! checkpoint's table, and whose gradient class agrees with whether the tensor requires grad.
//! Adding a parameter to a model without a plan entry fails here.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::optim::{ParamInfo, default_muon_select};
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm, ShardRule};
use moe_models::families::shard_rule;
use moe_models::param_plan::{GradClass, MuonMatrices, Planned, PlannedTensor, Storage};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// Name → shape of every tensor of a fixture checkpoint (its safetensors header).
fn checkpoint_shapes(name: &str) -> HashMap<String, Vec<usize>> {
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).expect("fixture");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect()
}

/// The canonical global shape of a planned tensor held by a rank of `layout`.
fn global_shape(t: &PlannedTensor, layout: &ParallelLayout) -> Vec<usize> {
    let mut shape = match (t.entry.storage, t.shape.as_slice()) {
        (Storage::Same, s) => s.to_vec(),
        (Storage::Transposed, [a, b]) => vec![*b, *a],
        (Storage::GatedExperts, [e, f2, h]) => vec![*e, 2, f2 / 2, *h],
        (Storage::GatedExperts, [e, f2]) => vec![*e, 2, f2 / 2],
        (s, shape) => panic!("{}: {s:?} storage of a {shape:?} tensor", t.path),
    };
    match t.entry.split {
        ShardRule::Replicated => {}
        ShardRule::Tp { dim } => shape[dim] *= layout.tp,
        ShardRule::Expert { etp_dim } => {
            shape[0] *= layout.ep;
            shape[etp_dim] *= layout.etp;
        }
        ShardRule::ExpertReplicated => shape[0] *= layout.ep,
    }
    shape
}

/// The HF checkpoint tensors (name, shape) a canonical tensor stands for: itself, or for
/// stacked routed experts the per-expert tensors HF stores.
fn hf_tensors(name: &str, shape: &[usize]) -> Vec<(String, Vec<usize>)> {
    if let Some(prefix) = name.strip_suffix(".gate_up_proj") {
        let [e, 2, f, h] = shape else {
            panic!("{name}: {shape:?}")
        };
        (0..*e)
            .flat_map(|x| {
                [
                    (format!("{prefix}.{x}.gate_proj.weight"), vec![*f, *h]),
                    (format!("{prefix}.{x}.up_proj.weight"), vec![*f, *h]),
                ]
            })
            .collect()
    } else if let Some(prefix) = name.strip_suffix(".experts.down_proj") {
        let [e, h, f] = shape else {
            panic!("{name}: {shape:?}")
        };
        (0..*e)
            .map(|x| {
                (
                    format!("{prefix}.experts.{x}.down_proj.weight"),
                    vec![*h, *f],
                )
            })
            .collect()
    } else {
        vec![(name.to_owned(), shape.to_vec())]
    }
}

/// Checks every tensor of one rank's module against the plan and the fixture; returns the HF
/// names it covers.
fn check_rank(
    family: &str,
    planned: &[PlannedTensor],
    layout: &ParallelLayout,
    hf: Option<&HashMap<String, Vec<usize>>>,
) -> BTreeSet<String> {
    let mut covered = BTreeSet::new();
    for t in planned {
        assert_eq!(
            shard_rule(&t.hf_name),
            t.entry.split,
            "{family} {layout}: `{}` ({}) split",
            t.path,
            t.hf_name
        );
        assert_eq!(
            matches!(t.entry.grad, GradClass::Param(_)),
            t.trainable,
            "{family}: `{}` trainable vs plan {:?}",
            t.path,
            t.entry.grad
        );
        for (name, shape) in hf_tensors(&t.hf_name, &global_shape(t, layout)) {
            if let Some(hf) = hf {
                let found = hf
                    .get(&name)
                    .unwrap_or_else(|| panic!("{family}: `{}` names `{name}`, absent", t.path));
                assert_eq!(found, &shape, "{family} {layout}: `{}` as `{name}`", t.path);
            }
            covered.insert(name);
        }
    }
    covered
}

/// Walks the full model and its shards under `layouts` against `M`'s plan.
fn check_model<M: ParallelCausalLm + Clone + Send + Sync + 'static>(
    family: &str,
    full: &M,
    hf: Option<&HashMap<String, Vec<usize>>>,
    layouts: &[(usize, &str)],
) {
    let plan = M::parallel_plan();
    let layers = full.main_layers();
    let single = ParallelLayout::parse(1, "").expect("layout");
    let planned = plan.walk(full, layers).unwrap_or_else(|e| panic!("{e}"));
    let covered = check_rank(family, &planned, &single, hf);
    if let Some(hf) = hf {
        // Every checkpoint tensor is some parameter's.
        let stored: BTreeSet<String> = hf.keys().cloned().collect();
        let missing: Vec<_> = stored.difference(&covered).collect();
        assert!(
            missing.is_empty(),
            "{family}: unplanned checkpoint tensors {missing:?}"
        );
    }
    for &(world, spec) in layouts {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let layout_ref = &layout;
        let plan_ref = &plan;
        let results = World::run(world, |ctx| {
            let groups = ctx.process_groups(layout_ref)?;
            let shard = full.shard(&groups, DispatcherKind::AllToAll).map_err(|e| {
                moe_backend::BackendError::Config {
                    field: "model",
                    detail: e.to_string(),
                }
            })?;
            Ok((
                plan_ref.walk(shard.model(), layers),
                plan_ref.muon_matrices(shard.model(), layers),
            ))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (planned, muon) = r.expect("rank");
            let planned = planned.unwrap_or_else(|e| panic!("{family} {spec} rank {rank}: {e}"));
            check_rank(family, &planned, &layout, hf);
            let muon = muon.unwrap_or_else(|e| panic!("{family} {spec} rank {rank}: {e}"));
            check_muon(family, &planned, &muon);
        }
    }
}

/// The plan's Muon view of every trainable parameter equals the naming convention's
/// ([`default_muon_select`], Megatron's and Keller's rule as module names state it): the
/// plan reproduces it for the built-in models, from splits rather than names.
fn check_muon(family: &str, planned: &[PlannedTensor], muon: &MuonMatrices) {
    let mut matrices = 0;
    for t in planned.iter().filter(|t| t.trainable) {
        let GradClass::Param(class) = t.entry.grad else {
            continue;
        };
        let info = ParamInfo {
            id: t.id,
            path: t.path.clone(),
            shape: t.shape.clone(),
            class,
            offset: 0,
        };
        let from_plan = muon.select(&info);
        assert_eq!(
            from_plan,
            default_muon_select(&info),
            "{family}: Muon's view of `{}`",
            t.path
        );
        matrices += usize::from(from_plan.is_some());
    }
    assert!(matrices > 0, "{family}: no Muon matrix");
}

fn device() -> Device {
    Device::flex().autodiff()
}

#[test]
fn every_qwen3_moe_parameter_is_planned() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe/config.json")).expect("config");
    let model: Qwen3MoeForCausalLM = config.init(&device()).expect("init");
    let hf = checkpoint_shapes("qwen3_moe");
    check_model(
        "qwen3_moe",
        &model,
        Some(&hf),
        &[
            (2, "ep=2"),
            (4, "tp=2,ep=4"),
            (4, "tp=2,ep=2,etp=2"),
            (2, "tp=2,ep=2"),
        ],
    );
}

#[test]
fn every_deepseek_v3_parameter_is_planned() {
    let config = DeepseekV3Config::from_file(fixture("deepseek_v3/config.json")).expect("config");
    let model: DeepseekV3ForCausalLM = config.init(&device()).expect("init");
    assert!(!model.mtp.is_empty(), "the fixture has MTP modules");
    let hf = checkpoint_shapes("deepseek_v3");
    check_model(
        "deepseek_v3",
        &model,
        Some(&hf),
        &[
            (2, "ep=2"),
            (4, "tp=2,ep=4"),
            (4, "tp=2,ep=2,etp=2"),
            (4, "tp=4,ep=2,etp=2"),
        ],
    );
    // Without a query LoRA (`q_proj` direct), which the fixture does not exercise.
    let mut direct = config.clone();
    direct.q_lora_rank = None;
    let model: DeepseekV3ForCausalLM = direct.init(&device()).expect("init");
    check_model("deepseek_v3 (q_proj)", &model, None, &[(4, "tp=2,ep=4")]);
}

#[test]
fn every_qwen3_parameter_is_planned() {
    let config = Qwen3Config::from_file(fixture("qwen3/config.json")).expect("config");
    let model: Qwen3ForCausalLM = config.init(&device()).expect("init");
    let hf = checkpoint_shapes("qwen3");
    check_model("qwen3", &model, Some(&hf), &[(2, "tp=2"), (4, "tp=2")]);
}

/// A parameter without a plan entry is an error naming it (as when a model gains a
/// parameter and its plan is not updated).
#[test]
fn an_unplanned_parameter_is_an_error_naming_it() {
    let config = Qwen3MoeConfig::from_file(fixture("qwen3_moe/config.json")).expect("config");
    let model: Qwen3MoeForCausalLM = config.init(&device()).expect("init");
    let full = Qwen3MoeForCausalLM::parallel_plan();
    let entries = full
        .entries()
        .iter()
        .filter(|e| !e.module.ends_with("k_norm.weight"))
        .cloned()
        .collect();
    let plan = moe_models::param_plan::ParallelPlan::new("qwen3_moe", entries);
    let err = plan.walk(&model, 3).unwrap_err().to_string();
    assert!(
        err.contains("`model.layers.0.self_attn.k_norm.weight`"),
        "{err}"
    );
    let err = plan.classes(&model, 3).unwrap_err().to_string();
    assert!(err.contains("k_norm.weight"), "{err}");
}
