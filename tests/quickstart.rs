//! The quickstart pipeline of `examples/quickstart.rs` with a few steps: HF → distributed
//! (TP2 × DP2, EP4) → fine-tune on 4 ranks → save with optimizer state → reshard (EP2 × ETP2)
//! → HF export that reloads with the trained logits.

use std::sync::Mutex;

use burn_moe::bridge::dist::{DistCheckpoint, read_train_state};
use burn_moe::models::hf::ModelConfig;
use burn_moe::quickstart::{QuickstartEvent, QuickstartOptions, quickstart};

#[test]
fn quickstart_pipeline_round_trips_the_trained_model() {
    let out = std::env::temp_dir().join(format!("burn-moe-quickstart-{}", std::process::id()));
    let mut options = QuickstartOptions::new(&out);
    options.train.steps = 4;
    let steps = Mutex::new(Vec::new());
    let report = quickstart(&options, &|event| {
        if let QuickstartEvent::Step(step, _) = event {
            steps.lock().expect("lock").push(step);
        }
    })
    .expect("quickstart runs");
    assert_eq!(steps.into_inner().expect("lock"), [0, 1, 2, 3]);
    assert!(report.max_abs_diff <= options.tolerance, "{report:?}");
    assert!(report.train.losses.iter().all(|l| l.is_finite()));
    assert!(report.trained.ends_with("dist/iter_0000004"));
    let trained =
        DistCheckpoint::open::<ModelConfig>(&report.resharded).expect("resharded checkpoint");
    assert_eq!(trained.index().layout.ep, 2);
    assert_eq!(trained.index().layout.etp, 2);
    assert_eq!(trained.index().optimizer.as_ref().map(|o| o.step), Some(4));
    assert_eq!(
        read_train_state(&trained).expect("state").map(|s| s.step),
        Some(4)
    );
    assert!(report.exported.join("config.json").is_file());
    // A second run into the same directory starts clean.
    options.train.steps = 1;
    quickstart(&options, &|_| {}).expect("rerun");
    let _ = std::fs::remove_dir_all(&out);
}
