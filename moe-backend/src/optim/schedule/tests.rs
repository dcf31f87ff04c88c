//! Schedules against closed forms written out here from Megatron's
//! `OptimizerParamScheduler.get_lr` / `get_wd`, with a few values worked out by hand.

use std::f64::consts::PI;

use super::*;

const MAX: f64 = 1.0;
const MIN: f64 = 0.1;
const INIT: f64 = 0.01;
const WARMUP: usize = 10;
const DECAY: usize = 110;

fn sched(decay_style: LrDecayStyle) -> LrSchedule {
    LrSchedule {
        max_lr: MAX,
        min_lr: MIN,
        warmup_steps: WARMUP,
        warmup_init_lr: INIT,
        decay_steps: DECAY,
        decay_style,
    }
}

#[track_caller]
fn close(got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-12 * want.abs().max(1.0),
        "got {got}, want {want}"
    );
}

/// Megatron: `init_lr + (max_lr - init_lr) * num_steps / lr_warmup_steps`.
fn warmup(step: u64) -> f64 {
    INIT + (MAX - INIT) * step as f64 / WARMUP as f64
}

/// Megatron: `decay_ratio = (num_steps - warmup) / (decay_steps - warmup)`.
fn ratio(step: u64) -> f64 {
    (step as f64 - WARMUP as f64) / (DECAY as f64 - WARMUP as f64)
}

/// Megatron: `min_lr + coeff * (max_lr - min_lr)`.
fn from_coeff(coeff: f64) -> f64 {
    MIN + coeff * (MAX - MIN)
}

#[test]
fn warmup_is_linear_from_init_and_shared_by_all_styles() {
    let styles = [
        LrDecayStyle::Constant,
        LrDecayStyle::Linear,
        LrDecayStyle::Cosine,
        LrDecayStyle::InverseSquareRoot,
        LrDecayStyle::Wsd {
            decay_steps_wsd: 40,
            style: WsdDecay::Linear,
        },
    ];
    for style in styles {
        let s = sched(style);
        s.validate().unwrap();
        // Step 0 (first optimizer step) runs at init_lr, as Megatron after `step(0)`.
        close(s.lr(0), INIT);
        // Hand: 0.01 + 0.99 * 5 / 10 = 0.505.
        close(s.lr(5), 0.505);
        close(s.lr(5), warmup(5));
        close(s.lr(1), warmup(1));
        // End of warmup is exactly max_lr.
        assert_eq!(s.lr(WARMUP as u64), MAX, "{style:?}");
    }
}

#[test]
fn default_init_lr_zero_makes_step_zero_a_no_op() {
    let s = LrSchedule {
        warmup_init_lr: 0.0,
        ..sched(LrDecayStyle::Cosine)
    };
    assert_eq!(s.lr(0), 0.0);
    close(s.lr(3), MAX * 3.0 / WARMUP as f64);
}

#[test]
fn constant_stays_at_max_lr_even_past_decay_steps() {
    let s = sched(LrDecayStyle::Constant);
    for step in [10, 11, 60, 110, 111, 10_000] {
        assert_eq!(s.lr(step), MAX, "step {step}");
    }
    let c = LrSchedule::constant(3e-4);
    c.validate().unwrap();
    for step in [0, 1, 5, 1_000_000] {
        assert_eq!(c.lr(step), 3e-4);
    }
}

#[test]
fn linear_decay() {
    let s = sched(LrDecayStyle::Linear);
    for step in [10u64, 35, 60, 109, 110] {
        close(s.lr(step), from_coeff(1.0 - ratio(step)));
    }
    // Hand: step 35 → r = 25/100, lr = 0.1 + 0.75 * 0.9 = 0.775; step 60 → 0.55.
    close(s.lr(35), 0.775);
    close(s.lr(60), 0.55);
    close(s.lr(110), MIN);
    assert_eq!(s.lr(111), MIN);
    assert_eq!(s.lr(100_000), MIN);
}

#[test]
fn cosine_decay() {
    let s = sched(LrDecayStyle::Cosine);
    for step in [10u64, 35, 60, 85, 110] {
        close(
            s.lr(step),
            from_coeff(0.5 * ((PI * ratio(step)).cos() + 1.0)),
        );
    }
    // Hand: step 35 → r = 1/4, coeff = (cos(π/4) + 1)/2 = 0.853553390593..,
    // lr = 0.1 + 0.9 * 0.853553390593 = 0.868198051533946; step 60 → r = 1/2, lr = 0.55.
    close(
        s.lr(35),
        0.1 + 0.9 * (0.5 * (std::f64::consts::FRAC_1_SQRT_2 + 1.0)),
    );
    assert!((s.lr(35) - 0.868_198_051_533_946).abs() < 1e-12);
    close(s.lr(60), 0.55);
    close(s.lr(110), MIN);
    assert_eq!(s.lr(111), MIN);
}

#[test]
fn no_warmup_starts_the_decay_at_step_zero() {
    let s = LrSchedule {
        warmup_steps: 0,
        ..sched(LrDecayStyle::Linear)
    };
    s.validate().unwrap();
    assert_eq!(s.lr(0), MAX);
    // r = 55 / 110 = 0.5.
    close(s.lr(55), 0.55);
    close(s.lr(110), MIN);
}

#[test]
fn inverse_square_root() {
    // Megatron: max(min_lr, max_lr * sqrt(max(warmup, 1)) / sqrt(max(num_steps, 1))) after the
    // warmup, min_lr past lr_decay_steps.
    let s = LrSchedule {
        max_lr: 1.0,
        min_lr: 0.05,
        warmup_steps: 4,
        warmup_init_lr: 0.0,
        decay_steps: 10_000,
        decay_style: LrDecayStyle::InverseSquareRoot,
    };
    s.validate().unwrap();
    assert_eq!(s.lr(0), 0.0);
    close(s.lr(2), 0.5); // warmup midpoint
    assert_eq!(s.lr(4), 1.0); // warmup end: sqrt(4)/sqrt(4)
    close(s.lr(5), 4f64.sqrt() / 5f64.sqrt());
    close(s.lr(16), 0.5); // hand: 1 * 2 / 4
    close(s.lr(400), 0.1); // hand: 2 / 20
    // 2 / sqrt(9999) ≈ 0.020 < min_lr: clamped.
    assert_eq!(s.lr(9_999), 0.05);
    assert_eq!(s.lr(10_001), 0.05);

    // Without warmup both max(·, 1) kick in: step 0 and 1 give max_lr, step 4 gives max_lr / 2.
    let s = LrSchedule {
        warmup_steps: 0,
        ..s
    };
    s.validate().unwrap();
    assert_eq!(s.lr(0), 1.0);
    assert_eq!(s.lr(1), 1.0);
    close(s.lr(4), 0.5);
}

#[test]
fn wsd_stable_then_each_annealing_style() {
    // Anneal over the last 40 of 110 steps: stable (max_lr) through step 70.
    let anneal_start = (DECAY - 40) as u64;
    let r = |step: u64| (step - anneal_start) as f64 / 40.0;
    type Coeff = fn(f64) -> f64;
    let cases: [(WsdDecay, Coeff); 4] = [
        (WsdDecay::Linear, |r| 1.0 - r),
        (WsdDecay::Cosine, |r| 0.5 * ((PI * r).cos() + 1.0)),
        (WsdDecay::Exponential, |r| 2.0 * 0.5f64.powf(r) - 1.0),
        (WsdDecay::MinusSqrt, |r| 1.0 - r.sqrt()),
    ];
    for (style, coeff) in cases {
        let s = sched(LrDecayStyle::Wsd {
            decay_steps_wsd: 40,
            style,
        });
        s.validate().unwrap();
        close(s.lr(5), warmup(5));
        for step in [10u64, 11, 40, 69, 70] {
            assert_eq!(s.lr(step), MAX, "{style:?} stable at {step}");
        }
        for step in [71u64, 80, 90, 100, 110] {
            close(s.lr(step), from_coeff(coeff(r(step))));
        }
        close(s.lr(110), MIN);
        assert_eq!(s.lr(111), MIN);
        assert_eq!(s.lr(5_000), MIN);
    }
    // Hand values at step 80 (r = 1/4) and 90 (r = 1/2).
    let at = |style, step| {
        sched(LrDecayStyle::Wsd {
            decay_steps_wsd: 40,
            style,
        })
        .lr(step)
    };
    close(at(WsdDecay::Linear, 80), 0.1 + 0.9 * 0.75); // 0.775
    close(at(WsdDecay::MinusSqrt, 80), 0.55); // 1 - sqrt(1/4) = 1/2
    close(at(WsdDecay::Cosine, 90), 0.55); // (cos(π/2) + 1)/2 = 1/2
    // 2 * 0.5^0.5 - 1 = sqrt(2) - 1 = 0.41421356..; 0.1 + 0.9 * 0.41421356 = 0.47279220..
    close(
        at(WsdDecay::Exponential, 90),
        0.1 + 0.9 * (std::f64::consts::SQRT_2 - 1.0),
    );
}

#[test]
fn wsd_edge_phases() {
    // Zero-length annealing: max_lr through decay_steps, min_lr right after.
    let s = sched(LrDecayStyle::Wsd {
        decay_steps_wsd: 0,
        style: WsdDecay::Cosine,
    });
    s.validate().unwrap();
    assert_eq!(s.lr(110), MAX);
    assert_eq!(s.lr(111), MIN);
    // Annealing longer than the post-warmup span starts during the warmup window: the first
    // decay step already anneals (anneal start 110 - 105 = 5 < warmup 10).
    let s = sched(LrDecayStyle::Wsd {
        decay_steps_wsd: 105,
        style: WsdDecay::Linear,
    });
    s.validate().unwrap();
    assert_eq!(s.lr(10), MAX); // still the warmup branch
    close(s.lr(11), from_coeff(1.0 - 6.0 / 105.0));
    close(s.lr(110), MIN);
    // The whole decay span as annealing phase is accepted.
    sched(LrDecayStyle::Wsd {
        decay_steps_wsd: DECAY,
        style: WsdDecay::Linear,
    })
    .validate()
    .unwrap();
}

#[test]
fn weight_decay_increments() {
    let wd = |wd_incr_style| WdSchedule {
        start_wd: 0.02,
        end_wd: 0.1,
        wd_incr_steps: 100,
        wd_incr_style,
    };
    // Megatron: start_wd + coeff * (end_wd - start_wd), r = num_steps / wd_incr_steps.
    let lin = wd(WdIncrStyle::Linear);
    lin.validate().unwrap();
    let cos = wd(WdIncrStyle::Cosine);
    cos.validate().unwrap();
    for step in [0u64, 25, 50, 99, 100] {
        let r = step as f64 / 100.0;
        close(lin.wd(step), 0.02 + r * 0.08);
        close(
            cos.wd(step),
            0.02 + 0.5 * ((PI * (1.0 - r)).cos() + 1.0) * 0.08,
        );
    }
    // Hand: linear at 25 → 0.02 + 0.25 * 0.08 = 0.04; cosine at 25 → coeff
    // (cos(3π/4) + 1)/2 = (1 - 0.70710678)/2 = 0.14644661, wd = 0.03171573.
    close(lin.wd(25), 0.04);
    close(
        cos.wd(25),
        0.02 + 0.08 * 0.5 * (1.0 - std::f64::consts::FRAC_1_SQRT_2),
    );
    assert!((cos.wd(25) - 0.031_715_728_752_538).abs() < 1e-12);
    close(cos.wd(50), 0.06);
    assert_eq!(lin.wd(0), 0.02);
    close(cos.wd(0), 0.02);
    for step in [101, 1_000] {
        assert_eq!(lin.wd(step), 0.1);
        assert_eq!(cos.wd(step), 0.1);
    }
    let c = WdSchedule::constant(0.1);
    c.validate().unwrap();
    for step in [0, 1, 1_000] {
        assert_eq!(c.wd(step), 0.1);
    }
}

#[track_caller]
fn config_field(r: Result<()>) -> &'static str {
    match r {
        Err(BackendError::Config { field, detail }) => {
            let msg = BackendError::Config { field, detail }.to_string();
            assert!(msg.contains(field), "{msg}");
            field
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn lr_validation_names_the_field() {
    let ok = sched(LrDecayStyle::Cosine);
    ok.validate().unwrap();
    let cases = [
        (
            LrSchedule {
                max_lr: f64::NAN,
                ..ok.clone()
            },
            "max_lr",
        ),
        (
            LrSchedule {
                max_lr: f64::INFINITY,
                ..ok.clone()
            },
            "max_lr",
        ),
        (
            LrSchedule {
                min_lr: -1e-3,
                ..ok.clone()
            },
            "min_lr",
        ),
        (
            LrSchedule {
                min_lr: 2.0,
                ..ok.clone()
            },
            "min_lr",
        ),
        (
            LrSchedule {
                warmup_init_lr: -0.1,
                ..ok.clone()
            },
            "warmup_init_lr",
        ),
        (
            LrSchedule {
                warmup_init_lr: 1.5,
                ..ok.clone()
            },
            "warmup_init_lr",
        ),
        (
            LrSchedule {
                decay_steps: 0,
                warmup_steps: 0,
                ..ok.clone()
            },
            "decay_steps",
        ),
        (
            LrSchedule {
                warmup_steps: DECAY,
                ..ok.clone()
            },
            "warmup_steps",
        ),
        (
            LrSchedule {
                warmup_steps: DECAY + 1,
                ..ok.clone()
            },
            "warmup_steps",
        ),
        (
            LrSchedule {
                decay_style: LrDecayStyle::Wsd {
                    decay_steps_wsd: DECAY + 1,
                    style: WsdDecay::Linear,
                },
                ..ok.clone()
            },
            "decay_steps_wsd",
        ),
    ];
    for (s, field) in cases {
        assert_eq!(config_field(s.validate()), field, "{s:?}");
    }
    // Boundaries Megatron accepts: min_lr == max_lr, init == max, warmup = decay - 1.
    LrSchedule {
        min_lr: MAX,
        warmup_init_lr: MAX,
        warmup_steps: DECAY - 1,
        ..ok
    }
    .validate()
    .unwrap();
}

#[test]
fn wd_validation_names_the_field() {
    let ok = WdSchedule {
        start_wd: 0.0,
        end_wd: 0.1,
        wd_incr_steps: 10,
        wd_incr_style: WdIncrStyle::Linear,
    };
    ok.validate().unwrap();
    let cases = [
        (
            WdSchedule {
                start_wd: -0.1,
                ..ok.clone()
            },
            "start_wd",
        ),
        (
            WdSchedule {
                end_wd: f64::NAN,
                ..ok.clone()
            },
            "end_wd",
        ),
        (
            WdSchedule {
                start_wd: 0.2,
                ..ok.clone()
            },
            "end_wd",
        ),
        (
            WdSchedule {
                wd_incr_style: WdIncrStyle::Constant,
                ..ok.clone()
            },
            "wd_incr_style",
        ),
        (
            WdSchedule {
                wd_incr_steps: 0,
                ..ok.clone()
            },
            "wd_incr_steps",
        ),
        (
            WdSchedule {
                wd_incr_steps: 0,
                wd_incr_style: WdIncrStyle::Cosine,
                ..ok.clone()
            },
            "wd_incr_steps",
        ),
    ];
    for (s, field) in cases {
        assert_eq!(config_field(s.validate()), field, "{s:?}");
    }
}

#[test]
fn scheduler_state_round_trips_through_pairs() {
    let mut st = SchedulerState::default();
    assert_eq!(st.step, 0);
    st.advance(1);
    st.advance(41);
    assert_eq!(st.step, 42);
    let pairs = st.to_pairs();
    assert_eq!(pairs, vec![("num_steps", 42.0)]);
    assert_eq!(SchedulerState::from_pairs(pairs.clone()).unwrap(), st);
    // Owned keys (as read back from JSON), extra keys ignored.
    let owned = vec![
        ("max_lr".to_string(), 1e-3),
        ("num_steps".to_string(), 42.0),
    ];
    assert_eq!(SchedulerState::from_pairs(owned).unwrap(), st);
    let big = SchedulerState { step: 1 << 53 };
    assert_eq!(SchedulerState::from_pairs(big.to_pairs()).unwrap(), big);

    let field = |pairs: Vec<(&str, f64)>| config_field(SchedulerState::from_pairs(pairs).map(drop));
    assert_eq!(field(vec![]), "num_steps");
    assert_eq!(field(vec![("step", 3.0)]), "num_steps");
    assert_eq!(field(vec![("num_steps", -1.0)]), "num_steps");
    assert_eq!(field(vec![("num_steps", 1.5)]), "num_steps");
    assert_eq!(field(vec![("num_steps", f64::NAN)]), "num_steps");
    assert_eq!(field(vec![("num_steps", 1e300)]), "num_steps");
}

#[test]
fn no_weight_decay_follows_megatron_default() {
    // 1-D parameters: biases and norm weights.
    assert!(no_weight_decay("layers.0.input_norm.weight", &[64]));
    assert!(no_weight_decay("layers.0.attn.q_proj.bias", &[64]));
    assert!(no_weight_decay("final_norm.gamma", &[64]));
    // Biases by name, whatever their rank (stacked expert biases are [E, F]).
    assert!(no_weight_decay("layers.1.mlp.experts.fc1_bias", &[8, 128]));
    assert!(no_weight_decay("bias", &[4, 4]));
    assert!(no_weight_decay("head.bias", &[4, 4]));
    // Matrices keep weight decay.
    assert!(!no_weight_decay("layers.0.attn.q_proj.weight", &[64, 64]));
    assert!(!no_weight_decay("embedding.weight", &[1000, 64]));
    assert!(!no_weight_decay("layers.1.mlp.experts.fc1", &[8, 64, 128]));
    assert!(!no_weight_decay("layers.0.biased_proj.weight", &[64, 64]));
    // 0-D parameters keep it too (Megatron tests len(shape) == 1 only).
    assert!(!no_weight_decay("scale", &[]));
}
