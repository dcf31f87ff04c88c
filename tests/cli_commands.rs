//! `moe plan`, `moe upcycle` and the distributed-checkpoint commands end to end on the fixtures.

use std::process::Command;

fn moe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(args)
        .output()
        .expect("run moe")
}

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn plan_reports_the_parameters_a_rank_holds() {
    let out = moe(&[
        "plan",
        "--model",
        &fixture("qwen3_moe"),
        "--layout",
        "tp=2,ep=4",
        "--seq",
        "16",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // Same count the in-process shard holds (models/tests/plan.rs checks the library side).
    let config = burn_moe::models::Qwen3MoeConfig::from_file(format!(
        "{}/config.json",
        fixture("qwen3_moe")
    ))
    .unwrap();
    let layout = burn_moe::backend::parallel::ParallelLayout::parse_spec("tp=2,ep=4").unwrap();
    let expected = burn_moe::models::plan::rank_params_of::<burn_moe::models::Qwen3MoeForCausalLM>(
        &config, &layout, 0,
    )
    .unwrap()
    .total();
    assert_eq!(report["stages"][0]["params"].as_u64(), Some(expected));
    assert_eq!(report["tokens_per_rank"].as_u64(), Some(8));
    // An impossible layout is refused with the training code's error.
    let bad = moe(&[
        "plan",
        "--model",
        &fixture("qwen3_moe"),
        "--gpus",
        "6",
        "--layout",
        "tp=4",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not divisible"));
}

#[test]
fn upcycle_writes_a_loadable_moe_checkpoint() {
    let out_dir = std::env::temp_dir().join(format!("moe-upcycle-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out_str = out_dir.to_string_lossy().to_string();
    let out = moe(&[
        "upcycle",
        "--from",
        &fixture("qwen3"),
        "--out",
        &out_str,
        "--experts",
        "4",
        "--topk",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inspect = moe(&["inspect", &out_str]);
    assert!(
        inspect.status.success(),
        "{}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    assert!(String::from_utf8_lossy(&inspect.stdout).contains("qwen3_moe"));
    // Granularity that does not divide the experts is an error naming the field.
    let bad = moe(&[
        "upcycle",
        "--from",
        &fixture("qwen3"),
        "--out",
        &out_str,
        "--experts",
        "3",
        "--topk",
        "2",
        "--granularity",
        "2",
        "--overwrite",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("granularity"));
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn convert_reshard_validate_export_round_trip_is_bit_exact() {
    use burn_moe::bridge::hf::HfCheckpoint;
    let base = std::env::temp_dir().join(format!("moe-dist-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (a, b, hf) = (base.join("a"), base.join("b"), base.join("hf"));
    let s = |p: &std::path::Path| p.to_string_lossy().to_string();
    let src = fixture("qwen3_moe");
    for args in [
        vec![
            "convert",
            "--from-hf",
            &src,
            "--out",
            &s(&a),
            "--layout",
            "world=4,tp=2,ep=4",
        ],
        vec!["validate", &s(&a)],
        vec!["reshard", &s(&a), "--out", &s(&b), "--layout", "ep=2,etp=2"],
        vec!["export", &s(&b), "--out", &s(&hf)],
    ] {
        let out = moe(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (orig, back) = (
        HfCheckpoint::open(&src).unwrap(),
        HfCheckpoint::open(&hf).unwrap(),
    );
    let mut names: Vec<String> = orig.tensor_names().map(str::to_string).collect();
    let mut back_names: Vec<String> = back.tensor_names().map(str::to_string).collect();
    names.sort();
    back_names.sort();
    assert_eq!(names, back_names);
    for name in &names {
        let (x, y) = (orig.tensor(name).unwrap(), back.tensor(name).unwrap());
        assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{name}");
        assert!(x.bytes == y.bytes, "{name} differs");
    }
    // A half-written checkpoint is refused.
    std::fs::remove_file(a.join("iter_0000000").join(".complete")).unwrap();
    let out = moe(&["validate", &s(&a.join("iter_0000000"))]);
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&base);
}

/// `moe validate` warns about the temporary directories of saves that died (stale) or are still
/// running (live), and still succeeds on a valid checkpoint.
#[test]
fn validate_warns_about_leftover_temporary_save_directories() {
    use burn_moe::bridge::dist::commit::{NO_OWNER_GRACE, TempDirOwner};
    let root = std::env::temp_dir().join(format!("moe-dist-tmp-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let s = |p: &std::path::Path| p.to_string_lossy().to_string();
    let out = moe(&[
        "convert",
        "--from-hf",
        &fixture("qwen3_moe"),
        "--out",
        &s(&root),
        "--layout",
        "world=2,tp=2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stale = root.join(".tmp-iter_0000001-killed");
    std::fs::create_dir(&stale).unwrap();
    let old = std::time::SystemTime::now() - NO_OWNER_GRACE * 2;
    std::fs::File::open(&stale)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let live = root.join(".tmp-iter_0000001-running");
    std::fs::create_dir(&live).unwrap();
    TempDirOwner::current().write(&live).unwrap();
    let out = moe(&["validate", &s(&root)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid"));
    let line = |dir: &std::path::Path| {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        stderr
            .lines()
            .find(|l| l.starts_with("warning:") && l.contains(&name))
            .unwrap_or_else(|| panic!("no warning about {name}: {stderr}"))
            .to_owned()
    };
    assert!(
        line(&stale).contains("removed by the next save"),
        "{stderr}"
    );
    assert!(line(&live).contains("a save in progress"), "{stderr}");
    let _ = std::fs::remove_dir_all(&root);
}

/// `moe convert` keeps an FP8 release checkpoint in FP8 and `moe export` writes it back bit for
/// bit; `--dequantize` stores BF16, and `--dtype bf16` dequantises on export.
#[test]
fn fp8_checkpoints_stay_fp8_through_convert_and_export() {
    use burn_moe::bridge::hf::HfCheckpoint;
    use burn_moe::bridge::safetensors::Dtype;
    let base = std::env::temp_dir().join(format!("moe-dist-fp8-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let s = |p: &std::path::Path| p.to_string_lossy().to_string();
    let src = fixture("deepseek_v3_fp8");
    let (fp8, bf16) = (base.join("fp8"), base.join("bf16"));
    let (hf_fp8, hf_bf16, hf_deq) = (base.join("hf8"), base.join("hf16"), base.join("hfdq"));
    let layout = "world=4,tp=2,ep=2";
    for args in [
        vec![
            "convert",
            "--from-hf",
            &src,
            "--out",
            &s(&fp8),
            "--layout",
            layout,
        ],
        vec!["validate", &s(&fp8)],
        vec!["export", &s(&fp8), "--out", &s(&hf_fp8)],
        vec!["export", &s(&fp8), "--out", &s(&hf_bf16), "--dtype", "bf16"],
        vec![
            "convert",
            "--from-hf",
            &src,
            "--out",
            &s(&bf16),
            "--layout",
            layout,
            "--dequantize",
        ],
        vec!["export", &s(&bf16), "--out", &s(&hf_deq)],
    ] {
        let out = moe(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let same = |a: &HfCheckpoint, b: &HfCheckpoint| {
        let names: Vec<&str> = a.tensor_names().collect();
        assert_eq!(names, b.tensor_names().collect::<Vec<_>>());
        for name in names {
            let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
            assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{name}");
            assert!(x.bytes == y.bytes, "{name} differs");
        }
    };
    let source = HfCheckpoint::open(&src).unwrap();
    same(&source, &HfCheckpoint::open(&hf_fp8).unwrap());
    let reference = HfCheckpoint::open(fixture("deepseek_v3_fp8_dequant")).unwrap();
    same(&reference, &HfCheckpoint::open(&hf_bf16).unwrap());
    same(&reference, &HfCheckpoint::open(&hf_deq).unwrap());
    let o_proj = "model.layers.0.self_attn.o_proj.weight";
    assert_eq!(
        HfCheckpoint::open(&hf_fp8)
            .unwrap()
            .tensor(o_proj)
            .unwrap()
            .dtype,
        Dtype::F8E4M3
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn plan_reports_memory_and_traffic_and_searches_layouts() {
    let model = fixture("deepseek_v3");
    let out = moe(&[
        "plan",
        "--model",
        &model,
        "--gpus",
        "4",
        "--layout",
        "tp=2,ep=4",
        "--seq",
        "16",
        "--recompute",
        "mla_up_proj,moe_act",
        "--fp8",
        "--optimizer-dtype",
        "bf16",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let stage = &report["stages"][0];
    assert!(stage["activations_gb"].as_f64().unwrap() > 0.0);
    assert!(
        stage["activations_by_module_gb"]["experts"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(stage["comm"]["step"]["ep"].as_f64().unwrap() > 0.0);
    assert!(stage["comm"]["step"]["tp"].as_f64().unwrap() > 0.0);
    // The table form prints too.
    let table = moe(&[
        "plan", "--model", &model, "--gpus", "4", "--layout", "ep=4", "--seq", "16",
    ]);
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    assert!(String::from_utf8_lossy(&table.stdout).contains("activations by module"));
    // Without --layout: the search.
    let found = moe(&[
        "plan", "--model", &model, "--gpus", "4", "--seq", "16", "--json",
    ]);
    assert!(
        found.status.success(),
        "{}",
        String::from_utf8_lossy(&found.stderr)
    );
    let found: serde_json::Value = serde_json::from_slice(&found.stdout).expect("json");
    assert!(!found["layouts"].as_array().unwrap().is_empty());
    let none = moe(&[
        "plan",
        "--model",
        &model,
        "--gpus",
        "4",
        "--seq",
        "16",
        "--gpu-memory",
        "0.000001",
    ]);
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("fits in"));
    let bad = moe(&[
        "plan",
        "--model",
        &model,
        "--gpus",
        "4",
        "--recompute",
        "attention",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown module"));
}

/// `moe convert --from-hf org/name@rev` reads the snapshot from a hub cache laid out as
/// `huggingface_hub` writes it (blobs, symlinked snapshot files, `refs/<rev>`), found through
/// `HF_HUB_CACHE`; an unknown id names itself and where it looked, and writes nothing.
#[cfg(unix)]
#[test]
fn convert_reads_a_model_from_the_hub_cache_by_id_and_revision() {
    let base = std::env::temp_dir().join(format!("moe-hub-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let cache = base.join("hub");
    let repo = cache.join("models--acme--tiny-moe");
    let hash = "4f2e0c1d9b8a7f6e5d4c3b2a1f0e9d8c7b6a5f4e";
    let snapshot = repo.join("snapshots").join(hash);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("v1"), hash).unwrap();
    for entry in std::fs::read_dir(fixture("qwen3_moe")).unwrap() {
        let entry = entry.unwrap();
        let blob = repo.join("blobs").join(entry.file_name());
        std::fs::copy(entry.path(), &blob).unwrap();
        std::os::unix::fs::symlink(&blob, snapshot.join(entry.file_name())).unwrap();
    }
    let run = |id: &str, out: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_moe"))
            .args(["convert", "--from-hf", id, "--out"])
            .arg(out)
            .args(["--layout", "ep=2"])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let out = run("acme/tiny-moe@v1", &base.join("ok"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(base.join("ok").join("latest").exists());
    let out = run("acme/tiny-moe@v2", &base.join("missing"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("acme/tiny-moe@v2") && err.contains("refs"),
        "{err}"
    );
    assert!(!base.join("missing").exists());
    let _ = std::fs::remove_dir_all(&base);
}

/// `--device vulkan|cuda` on a binary built without the backend's feature fails with a message
/// naming the feature, before touching the model (`moe train`, `moe logits`).
#[test]
fn gpu_devices_without_their_feature_are_rejected_clearly() {
    let model = fixture("qwen3_moe");
    let ids = std::env::temp_dir().join("moe-cli-device-ids.safetensors");
    let out = std::env::temp_dir().join("moe-cli-device-out.safetensors");
    let (ids, out) = (ids.to_string_lossy(), out.to_string_lossy());
    for (device, feature) in [("vulkan", "vulkan"), ("cuda", "cuda")] {
        if (feature == "vulkan" && cfg!(feature = "vulkan"))
            || (feature == "cuda" && cfg!(feature = "cuda"))
        {
            continue;
        }
        let runs = [
            moe(&[
                "train", "--model", &model, "--steps", "1", "--device", device,
            ]),
            moe(&[
                "logits", "--model", &model, "--input", &ids, "--out", &out, "--device", device,
            ]),
        ];
        for run in runs {
            let err = String::from_utf8_lossy(&run.stderr);
            assert!(!run.status.success(), "--device {device} succeeded");
            assert!(
                err.contains(&format!("built without the `{feature}` feature")),
                "--device {device}: {err}"
            );
            assert_clean_refusal(&run, &format!("--device {device}"));
        }
    }
}

/// A refusal is the CLI's own error: exit code 1, one `error:` line, no panic, backtrace or
/// background-thread `RecvError`.
fn assert_clean_refusal(run: &std::process::Output, what: &str) {
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{what}: {err}");
    assert!(err.starts_with("error: "), "{what}: {err}");
    for bad in ["panicked", "backtrace", "RecvError", "RUST_BACKTRACE"] {
        assert!(!err.contains(bad), "{what}: {bad} in\n{err}");
    }
}

/// `moe train --transport nccl` on a binary built without the `nccl` feature fails before
/// touching the model with an error naming the feature, as does `--device cuda` under a
/// torchrun-style launcher (where an `nccl` build would pick NCCL on its own).
#[test]
fn nccl_transport_without_its_feature_is_rejected_clearly() {
    if cfg!(feature = "nccl") {
        return;
    }
    let model = fixture("qwen3_moe");
    for device in ["cpu", "cuda"] {
        let run = moe(&[
            "train",
            "--model",
            &model,
            "--steps",
            "1",
            "--transport",
            "nccl",
            "--device",
            device,
        ]);
        let err = String::from_utf8_lossy(&run.stderr);
        let named = if device == "cuda" && !cfg!(feature = "cuda") {
            "built without the `cuda` feature"
        } else {
            "this build has no NCCL: rebuild with `--features nccl`"
        };
        assert!(
            err.contains(named),
            "--transport nccl --device {device}: {err}"
        );
        assert_clean_refusal(&run, &format!("--transport nccl --device {device}"));
    }
    // Launched as rank 1 of 2 (no rank 0 listens): refused before any connection attempt.
    let run = Command::new(env!("CARGO_BIN_EXE_moe"))
        .args([
            "train", "--model", &model, "--steps", "1", "--device", "cuda",
        ])
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "9"),
        ])
        .output()
        .expect("moe");
    if !cfg!(feature = "cuda") {
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(err.contains("built without the `cuda` feature"), "{err}");
        assert_clean_refusal(&run, "launched --device cuda");
    }
}

/// `moe plan` takes `vpp` and the pipeline layout from `--layout` (`vpp=V`, `pp_layout=…`) or
/// from `--vpp` / `--pipeline-layout`: an uneven layout gives each stage its layers'
/// parameters (the library's numbers), the same vpp both ways plans the same, and a
/// contradiction or a layout that does not cover the model is refused naming the field.
#[test]
fn plan_follows_the_pipeline_layout_and_vpp() {
    let model = fixture("qwen3_moe");
    let json = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", model.as_str(), "--seq", "16", "--json"];
        args.extend_from_slice(extra);
        let out = moe(&args);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("json")
    };
    let config =
        burn_moe::models::Qwen3MoeConfig::from_file(format!("{model}/config.json")).unwrap();
    let layout =
        burn_moe::backend::parallel::ParallelLayout::parse_spec("pp=2,pp_layout=Et|t*2L").unwrap();
    for report in [
        json(&["--layout", "pp=2", "--pipeline-layout", "Et|t*2L"]),
        json(&["--layout", "pp=2,pp_layout=Et|t*2L"]),
        json(&[
            "--layout",
            "pp=2,pp_layout=Et|t*2L",
            "--pipeline-layout",
            "E t | t*2 L",
        ]),
    ] {
        assert_eq!(report["pipeline_layout"].as_str(), Some("Et|t*2L"));
        assert_eq!(report["pipeline_split"].as_str(), Some("Et*1|t*2L"));
        for stage in 0..2 {
            let want = burn_moe::models::plan::rank_params_of::<
                burn_moe::models::Qwen3MoeForCausalLM,
            >(&config, &layout, stage)
            .unwrap()
            .total();
            assert_eq!(report["stages"][stage]["params"].as_u64(), Some(want));
        }
        assert_eq!(report["stages"][0]["layers"].as_u64(), Some(1));
        assert_eq!(report["stages"][1]["layers"].as_u64(), Some(2));
        assert_eq!(report["stages"][0]["embedding"].as_bool(), Some(true));
        assert_eq!(report["stages"][1]["head"].as_bool(), Some(true));
    }
    // Without a pipeline layout the planner splits 3 layers as 2 + 1, as before.
    let plain = json(&["--layout", "pp=2"]);
    assert!(plain["pipeline_layout"].is_null());
    assert_eq!(plain["pipeline_split"].as_str(), Some("Et*2|t*1L"));
    // vpp from the layout or from --vpp plans the same.
    let from_layout = json(&["--layout", "pp=2,vpp=2,pp_layout=E|t|t|tL"]);
    let from_flag = json(&[
        "--layout",
        "pp=2",
        "--vpp",
        "2",
        "--pipeline-layout",
        "E|t|t|tL",
    ]);
    assert_eq!(from_layout["vpp"].as_u64(), Some(2));
    assert_eq!(from_layout["stages"], from_flag["stages"]);
    assert_eq!(from_layout["layout"], from_flag["layout"]);
    // The table names the split.
    let table = moe(&[
        "plan",
        "--model",
        &model,
        "--layout",
        "pp=2",
        "--pipeline-layout",
        "Et|t*2L",
        "--seq",
        "16",
    ]);
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    assert!(
        String::from_utf8_lossy(&table.stdout).contains("pipeline: Et*1|t*2L (explicit layout)")
    );
    // Refusals name the field.
    for (args, field) in [
        (vec!["--layout", "pp=2,vpp=2", "--vpp", "3"], "vpp"),
        (vec!["--layout", "vpp=2"], "vpp"),
        (
            vec!["--layout", "pp=2", "--pipeline-layout", "Et|tL"],
            "pipeline_layout",
        ),
        (
            vec!["--layout", "pp=2", "--pipeline-layout", "Et|t|tL"],
            "pipeline_layout",
        ),
        (
            vec![
                "--layout",
                "pp=2,pp_layout=Et|t*2L",
                "--pipeline-layout",
                "Et*2|tL",
            ],
            "pipeline_layout",
        ),
    ] {
        let mut all = vec!["plan", "--model", model.as_str(), "--seq", "16"];
        all.extend_from_slice(&args);
        let out = moe(&all);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{args:?}: {err}");
    }
}
