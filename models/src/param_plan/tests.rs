use super::*;

fn plan() -> ParallelPlan {
    ParallelPlan::new(
        "toy",
        vec![
            PlanEntry {
                module: "layers.*.proj.weight".into(),
                hf: "model.layers.{0}.proj.weight".into(),
                storage: Storage::Transposed,
                split: ShardRule::Tp { dim: 0 },
                grad: GradClass::Param(ParamClass::DenseTpSharded),
                fp8: true,
            },
            PlanEntry {
                module: "mtp.*.norm.weight".into(),
                hf: "model.layers.{0+L}.norm.weight".into(),
                storage: Storage::Same,
                split: ShardRule::Replicated,
                grad: GradClass::Param(ParamClass::DenseSequenceParallel),
                fp8: false,
            },
        ],
    )
}

#[test]
fn patterns_capture_one_segment_and_templates_substitute() {
    let p = plan();
    let r = p.resolve("layers.7.proj.weight", 3).unwrap();
    assert_eq!(r.hf_name, "model.layers.7.proj.weight");
    assert_eq!(r.entry.split, ShardRule::Tp { dim: 0 });
    // MTP module 1 of a 3-layer model is stored as layer 4.
    let r = p.resolve("mtp.1.norm.weight", 3).unwrap();
    assert_eq!(r.hf_name, "model.layers.4.norm.weight");
    // `*` is one segment: neither fewer nor more.
    for path in [
        "layers.proj.weight",
        "layers.1.2.proj.weight",
        "layers.1.proj",
    ] {
        assert_eq!(
            p.resolve(path, 3).unwrap_err(),
            PlanError::Unclassified {
                family: "toy",
                path: path.into()
            }
        );
    }
}

#[test]
fn an_unclassified_or_doubly_classified_parameter_is_an_error_naming_it() {
    let mut p = plan();
    let e = p
        .resolve("layers.0.extra.weight", 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`layers.0.extra.weight`") && e.contains("toy"),
        "{e}"
    );
    let mut dup = p.entries[0].clone();
    dup.module = "layers.0.*.weight".into();
    p.entries.push(dup);
    let e = p.resolve("layers.0.proj.weight", 1).unwrap_err();
    assert!(matches!(e, PlanError::Ambiguous { .. }), "{e}");
    let bad = PlanEntry {
        module: "x.*".into(),
        hf: "y.{0+L}".into(),
        ..plan().entries[0].clone()
    };
    let e = ParallelPlan::new("toy", vec![bad])
        .resolve("x.a", 1)
        .unwrap_err();
    assert!(e.to_string().contains("not an index"), "{e}");
}

#[test]
fn the_model_plans_have_unique_patterns() {
    for plan in crate::families::plans() {
        let mut seen = std::collections::HashSet::new();
        for e in plan.entries() {
            assert!(
                seen.insert(e.module.clone()),
                "{}: {}",
                plan.family(),
                e.module
            );
            // Every entry resolves its own pattern (captures stand for indices).
            let path = e.module.replace('*', "0");
            let r = plan.resolve(&path, 2).unwrap();
            assert_eq!(r.entry, e);
            // The checkpoint's split table agrees with the plan.
            assert_eq!(
                crate::families::shard_rule(&r.hf_name),
                e.split,
                "{}: {}",
                plan.family(),
                r.hf_name
            );
        }
    }
}

#[test]
fn hf_names_place_tensors_on_pipeline_stages() {
    use moe_bridge::ModelSchema;
    use moe_bridge::dist::StagePlace;

    use crate::hf::ModelConfig;

    let place = hf_names::stage_place;
    assert_eq!(place(&hf_names::embed_weight()), StagePlace::First);
    assert_eq!(place(&hf_names::router_weight(3)), StagePlace::Layer(3));
    assert_eq!(place(&hf_names::lm_head_weight()), StagePlace::Last);
    assert_eq!(place(&hf_names::final_norm_weight()), StagePlace::Last);
    let (embed_copy, head_copy) = crate::families::deepseek_v3::plan::mtp_copy_names(7);
    assert_eq!(place(&embed_copy), StagePlace::Layer(7));
    assert!(crate::families::deepseek_v3::plan::is_mtp_head_copy(
        &head_copy
    ));
    assert_eq!(
        hf_names::split_stacked(&hf_names::stacked_down("x.experts")),
        Some(("x.experts", false))
    );
    let tied = serde_json::json!({"tie_word_embeddings": true});
    assert_eq!(
        <ModelConfig as ModelSchema>::tied_head(&tied),
        Some(hf_names::lm_head_weight())
    );
    assert_eq!(
        <ModelConfig as ModelSchema>::tied_head(&serde_json::json!({})),
        None
    );
}
