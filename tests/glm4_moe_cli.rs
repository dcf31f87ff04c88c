//! The `moe` CLI on the GLM-4.5 MoE fixture (`tests/fixtures/glm4_moe`, one MTP layer):
//! `logits` (with `--labels`) and `logprobs` (one rank and `tp=2,ep=2`) against the
//! transformers goldens, `train` under `tp=2,ep=2` with the MTP loss, and `export` of the
//! trained checkpoint: the release's tensor names (the fixture's), the trained values.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::Device;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};
use burn_moe::models::families::glm4_moe::{Glm4MoeConfig, Glm4MoeForCausalLM};
use common::{MOE, check, field, metrics, params, scratch, threads, train_args};

const GLM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/glm4_moe");
const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/glm4_moe.golden.safetensors"
);

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `moe` with `args` (a command without a transport), which must succeed.
fn moe(args: &[String]) {
    let out = std::process::Command::new(MOE)
        .args(args)
        .output()
        .expect("moe");
    check(out, &format!("moe {}", args.join(" ")));
}

fn read_f32(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(file).expect("open");
    let t = f.tensor(name).expect("tensor");
    (t.shape.to_vec(), t.to_f32_vec().expect("f32"))
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Every tensor of the HF directory `dir` as f32.
fn hf_params(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let hf = HfCheckpoint::open(dir).expect("checkpoint");
    let names: Vec<String> = hf.tensor_names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let v = (hf.tensor(&n).and_then(|t| t.to_tensor_data()))
                .expect("tensor")
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32");
            (n, v)
        })
        .collect()
}

#[test]
fn glm4_moe_logits_logprobs_train_and_export() {
    let dir = scratch("glm4-moe-cli");
    let golden = Path::new(GOLDEN);
    let (lshape, want_logits) = read_f32(golden, "logits");
    let scale = want_logits.iter().fold(0f32, |m, x| m.max(x.abs()));

    // `moe logits --labels` on the golden's input ids.
    let out = dir.join("logits.safetensors");
    moe(&[
        "logits".into(),
        "--model".into(),
        GLM.into(),
        "--input".into(),
        GOLDEN.into(),
        "--out".into(),
        s(&out),
        "--labels".into(),
    ]);
    let (shape, logits) = read_f32(&out, "logits");
    assert_eq!(shape, lshape);
    let err = max_err(&logits, &want_logits);
    println!("moe logits: max err {err:.3e} (max|logit| {scale:.4})");
    assert!(err <= 1e-4 * scale, "logits err {err}");
    let (_, loss) = read_f32(&out, "loss");
    let (_, want_loss) = read_f32(golden, "loss");
    assert!(
        (loss[0] - want_loss[0]).abs() <= 1e-5 * want_loss[0],
        "loss {} vs {}",
        loss[0],
        want_loss[0]
    );

    // `moe logprobs` (one rank and tp=2·ep=2) against log-softmax of the golden logits.
    let ids_file = SafetensorsFile::open(golden).expect("golden");
    let ids: Vec<i64> = (ids_file.tensor("input_ids").expect("ids").to_tensor_data())
        .expect("ids")
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("i64");
    let input = dir.join("ids.safetensors");
    let bytes = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let t = OwnedTensor::new("input_ids", Dtype::I64, lshape[..2].to_vec(), bytes).expect("ids");
    write_safetensors(&input, &[t.view()]).expect("ids file");
    let (b, seq, v) = (lshape[0], lshape[1], lshape[2]);
    let mut want_lp = Vec::new();
    for row in 0..b {
        for t in 0..seq - 1 {
            let l = &want_logits[(row * seq + t) * v..(row * seq + t + 1) * v];
            let max = l.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
            let lse = max
                + l.iter()
                    .map(|&x| (f64::from(x) - max).exp())
                    .sum::<f64>()
                    .ln();
            want_lp.push((f64::from(l[ids[row * seq + t + 1] as usize]) - lse) as f32);
        }
    }
    for layout in ["", "tp=2,ep=2"] {
        let out = dir.join(format!("logprobs{}.safetensors", layout.len()));
        moe(&[
            "logprobs".into(),
            "--model".into(),
            GLM.into(),
            "--input".into(),
            s(&input),
            "--out".into(),
            s(&out),
            "--layout".into(),
            layout.into(),
        ]);
        let (shape, lp) = read_f32(&out, "logprobs");
        assert_eq!(shape, [b, seq - 1]);
        let err = max_err(&lp, &want_lp);
        println!("moe logprobs {layout:?}: max err {err:.3e}");
        assert!(err <= 1e-4 * scale, "{layout}: logprobs err {err}");
    }

    // `moe train` under tp=2·ep=2 (MTP loss on: the fixture has one MTP layer), then `moe
    // export` of the trained checkpoint.
    threads(&train_args(
        &dir,
        "tp=2,ep=2",
        2,
        &["--model", GLM, "--aux-loss-coeff", "0"],
    ));
    let m = metrics(&dir);
    assert_eq!(m.len(), 2);
    assert!(
        m.iter().all(|m| field(m, "mtp_loss").is_finite()),
        "every step reports the MTP loss: {m:?}"
    );
    let exported = dir.join("export");
    moe(&[
        "export".into(),
        s(&dir.join("ckpt")),
        "--out".into(),
        s(&exported),
    ]);
    let (start, trained) = (hf_params(Path::new(GLM)), hf_params(&exported));
    let names = |m: &BTreeMap<String, Vec<f32>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&trained),
        names(&start),
        "the export has the release's (fixture's) tensor names"
    );
    for name in [
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.mlp.shared_experts.down_proj.weight",
    ] {
        assert_ne!(trained[name], start[name], "{name} was trained");
    }
    // The CLI export holds the checkpoint's values (the library's F32 export of the same
    // checkpoint) and loads as the model.
    let library = params(&dir);
    for (name, values) in &library {
        let got = &trained[name];
        assert!(
            max_err(got, values) <= 1e-6 * values.iter().fold(1f32, |m, x| m.max(x.abs())),
            "{name}"
        );
    }
    let config = Glm4MoeConfig::from_file(exported.join("config.json")).expect("config");
    assert_eq!(config.num_nextn_predict_layers, 1);
    assert_eq!(config.partial_rotary_factor, 0.5);
    let hf = HfCheckpoint::open(&exported).expect("export");
    let model = Glm4MoeForCausalLM::from_weights(&config, &hf, &Device::flex()).expect("loads");
    assert_eq!(model.mtp.len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}
