//! `moe train --sync-weights-to` into a separate `moe receive-weights` process (under
//! `tp=2,ep=4` and under a pipeline layout): the receiver generates what `moe generate`
//! generates from the run's exported checkpoint, and a receiver holding another model refuses
//! the sync naming the tensor.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

use common::{FIXTURE, MOE, check, output_text, scratch, train_args};

const PROMPT: &str = "3,141,59,26,5";
const NEW_TOKENS: &str = "12";

/// `moe receive-weights` for `model` on a free port: the child and the address it listens on.
fn receiver(model: &str) -> (Child, String, std::thread::JoinHandle<String>) {
    let mut child = Command::new(MOE)
        .args([
            "receive-weights",
            "--model",
            model,
            "--listen",
            "127.0.0.1:0",
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            NEW_TOKENS,
            "--ignore-eos",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("moe receive-weights");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut seen = String::new();
    let addr = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).expect("stderr") == 0 {
            let _ = child.kill();
            panic!("receive-weights exited before listening:\n{seen}");
        }
        seen.push_str(&line);
        if let Some(addr) = line.trim().strip_prefix("listening on ") {
            break addr.to_owned();
        }
    };
    // The rest of stderr, drained so that the child never blocks on it.
    let rest = std::thread::spawn(move || {
        let mut text = seen;
        let _ = stderr.read_to_string(&mut text);
        text
    });
    (child, addr, rest)
}

fn moe(args: &[&str]) -> std::process::Output {
    Command::new(MOE).args(args).output().expect("moe")
}

#[test]
fn four_rank_train_syncs_into_a_separate_generator() {
    sync_into_a_separate_generator("weight-wire", FIXTURE, "tp=2,ep=4", 3);
}

/// The same under pipeline parallelism: two stages (the fixture's 3 layers split 1 + 2, the
/// embedding on the first, the final norm and output layer on the last), experts over 2 ranks
/// and 2 data-parallel replicas.
#[test]
fn pipeline_train_syncs_into_a_separate_generator() {
    sync_into_a_separate_generator("weight-wire-pp", FIXTURE, "pp=2,ep=2,pp_layout=Et|ttL", 2);
}

/// gpt-oss from its MXFP4 release (`tests/fixtures/gpt_oss_mxfp4`) under `tp=2,ep=2,etp=2`: the
/// experts travel in the release layout (`gate_up_proj [E, H, 2I]` gate/up interleaved, its
/// bias interleaved, `down_proj [E, I, H]`, the stacked `down_proj_bias`), each EP·ETP rank
/// converting its slice; the receiver, holding the MXFP4 release decoded, generates what
/// `moe generate` generates from the run's exported checkpoint.
#[test]
fn gpt_oss_train_syncs_its_release_layout_into_a_separate_generator() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt_oss_mxfp4");
    sync_into_a_separate_generator("weight-wire-gpt-oss", model, "world=4,tp=2,ep=2,etp=2", 2);
}

/// `moe train` of `model` under `layout` for `steps` steps syncing into `moe receive-weights`
/// (holding `model`): the receiver generates what `moe generate` generates from the run's
/// exported checkpoint.
fn sync_into_a_separate_generator(name: &str, model: &str, layout: &str, steps: usize) {
    let dir = scratch(name);
    let (mut rx, addr, rx_err) = receiver(model);
    let train = Command::new(MOE)
        .args(train_args(
            &dir,
            layout,
            steps,
            &[
                "--model",
                model,
                "--sync-weights-to",
                &addr,
                "--sync-bucket-size",
                "64KiB",
                "--transport",
                "threads",
            ],
        ))
        .output()
        .expect("moe train");
    let train = check(
        train,
        &format!("moe train --layout {layout} --sync-weights-to"),
    );
    let rx_out = {
        let mut s = String::new();
        rx.stdout
            .take()
            .expect("stdout")
            .read_to_string(&mut s)
            .expect("stdout");
        s
    };
    let status = rx.wait().expect("receiver");
    let rx_err = rx_err.join().expect("stderr");
    assert!(
        status.success(),
        "receive-weights failed:\n{rx_out}\n{rx_err}"
    );
    // Several buckets of at most 64 KiB (the largest tensor, 256 × 64 bf16, is 32 KiB).
    let buckets: Vec<usize> = rx_err
        .lines()
        .filter(|l| l.contains("received the weights"))
        .filter_map(|l| l.split("buckets=").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert!(matches!(buckets[..], [n] if n > 2), "{rx_err}");
    assert!(
        output_text(&train).contains("synced the trained weights"),
        "{}",
        output_text(&train)
    );

    // The run's checkpoint, exported in the sync's dtype, and `moe generate` on it.
    let ckpt = dir.join("ckpt").display().to_string();
    let hf = dir.join("hf").display().to_string();
    check(
        moe(&["export", &ckpt, "--out", &hf, "--dtype", "bf16"]),
        "moe export",
    );
    let generate = |model: &str| {
        let out = check(
            moe(&[
                "generate",
                "--model",
                model,
                "--prompt-ids",
                PROMPT,
                "--max-new-tokens",
                NEW_TOKENS,
                "--ignore-eos",
            ]),
            "moe generate",
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let want = generate(&hf);
    assert_eq!(want.trim().split(',').count(), 12, "{want}");
    assert_eq!(rx_out, want, "receiver vs moe generate on the export");
    // The sync changed the receiver's model: the untrained fixture continues otherwise.
    assert_ne!(generate(model), want, "training changed nothing to compare");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_receiver_of_another_model_names_the_tensor() {
    let dir = scratch("weight-wire-other");
    let dense = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3");
    let (mut rx, addr, rx_err) = receiver(dense);
    let train = Command::new(MOE)
        .args(train_args(
            &dir,
            "tp=2,ep=4",
            1,
            &["--sync-weights-to", &addr, "--transport", "threads"],
        ))
        .output()
        .expect("moe train");
    let status = rx.wait().expect("receiver");
    let rx_err = rx_err.join().expect("stderr");
    assert!(!status.success(), "{rx_err}");
    assert!(
        rx_err.contains(
            "tensor `model.layers.1.mlp.gate.weight` is not a tensor of the target model"
        ),
        "{rx_err}"
    );
    // The trainer learns the receiver's reason from its acknowledgement.
    let text = output_text(&train);
    assert!(!train.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "weight sync to {addr}: weight sync wire: the receiving side refused the weights: \
             weight sync: tensor `model.layers.1.mlp.gate.weight` is not a tensor of the target \
             model"
        )),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn train_fails_naming_an_address_nobody_listens_on() {
    let dir = scratch("weight-wire-nobody");
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").to_string()
    };
    let train = Command::new(MOE)
        .args(train_args(
            &dir,
            "tp=2,ep=4",
            1,
            &["--sync-weights-to", &addr, "--transport", "threads"],
        ))
        .output()
        .expect("moe train");
    let text = output_text(&train);
    assert!(!train.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "weight sync to {addr}: weight sync: cannot connect"
        )),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
