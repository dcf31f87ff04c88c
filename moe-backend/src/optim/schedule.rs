//! Learning-rate and weight-decay schedules with the semantics of Megatron-LM's
//! `OptimizerParamScheduler` (`megatron/core/optimizer_param_scheduler.py`).
//!
//! [`LrSchedule`] gives the learning rate and [`WdSchedule`] the weight decay as pure functions
//! of the number of optimizer steps already taken; [`SchedulerState`] is that count, the only
//! mutable state to checkpoint. [`no_weight_decay`] is Megatron's default rule for the parameters
//! that get no weight decay.
//!
//! # Step convention
//!
//! `lr(step)` / `wd(step)` take `step` = the number of optimizer steps **already taken**, i.e. the
//! value to use for the optimizer step about to run. This is exactly Megatron's `num_steps` when
//! it counts iterations (increment 1): the constructor calls `step(0)`, so optimizer step 0 uses
//! `num_steps = 0`; after each optimizer step the training loop calls `step(increment)`, so
//! optimizer step `k` (0-based) runs with `num_steps = k`. Consequently:
//!
//! * step 0 gives `warmup_init_lr` when `warmup_steps > 0` (Megatron's default `init_lr = 0`
//!   makes the first update a no-op), step `warmup_steps / 2` gives the midpoint, and step
//!   `warmup_steps` gives exactly `max_lr`;
//! * the decay runs over steps `warmup_steps ..= decay_steps`, reaching `min_lr` at
//!   `decay_steps`; every later step gives `min_lr` (except [`LrDecayStyle::Constant`], which
//!   stays at `max_lr` forever, as in Megatron).
//!
//! Megatron may count in samples (increment = global batch size); here every length
//! (`warmup_steps`, `decay_steps`, `decay_steps_wsd`, `wd_incr_steps`) is in optimizer steps.

use std::f64::consts::PI;

use crate::error::{BackendError, Result};

#[cfg(test)]
mod tests;

fn config_err(field: &'static str, detail: impl Into<String>) -> BackendError {
    BackendError::Config {
        field,
        detail: detail.into(),
    }
}

fn check_non_negative(field: &'static str, value: f64) -> Result<()> {
    if !value.is_finite() || value < 0.0 {
        return Err(config_err(
            field,
            format!("must be finite and >= 0, got {value}"),
        ));
    }
    Ok(())
}

/// Annealing shape of the last phase of a warmup-stable-decay ([`LrDecayStyle::Wsd`]) schedule
/// (Megatron's `lr_wsd_decay_style`). With `r` = fraction of the annealing phase done (0 → 1),
/// the learning rate is `min_lr + coeff(r) * (max_lr - min_lr)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WsdDecay {
    /// `coeff = 1 - r` (`"linear"`).
    Linear,
    /// `coeff = (cos(π r) + 1) / 2` (`"cosine"`).
    Cosine,
    /// `coeff = 2 · 0.5^r - 1` (`"exponential"`).
    Exponential,
    /// `coeff = 1 - √r` (`"minus_sqrt"`).
    MinusSqrt,
}

impl WsdDecay {
    fn coeff(self, r: f64) -> f64 {
        match self {
            WsdDecay::Linear => 1.0 - r,
            WsdDecay::Cosine => 0.5 * ((PI * r).cos() + 1.0),
            WsdDecay::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
            WsdDecay::MinusSqrt => 1.0 - r.sqrt(),
        }
    }
}

/// How the learning rate goes from `max_lr` to `min_lr` after the warmup (Megatron's
/// `lr_decay_style`). With `r = (step - warmup_steps) / (decay_steps - warmup_steps)` the
/// learning rate is `min_lr + coeff * (max_lr - min_lr)`, with `coeff` given per style.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrDecayStyle {
    /// `max_lr` after the warmup, forever (also past `decay_steps`; `min_lr` is unused)
    /// (`"constant"`).
    Constant,
    /// `coeff = 1 - r` (`"linear"`).
    Linear,
    /// `coeff = (cos(π r) + 1) / 2` (`"cosine"`).
    Cosine,
    /// `max(min_lr, max_lr · √max(warmup_steps, 1) / √max(step, 1))`: continuous with the
    /// warmup at `step = warmup_steps` (`"inverse-square-root"`).
    InverseSquareRoot,
    /// Warmup-stable-decay (`"WSD"`): `max_lr` until `decay_steps - decay_steps_wsd`, then
    /// annealed to `min_lr` over the last `decay_steps_wsd` steps, with
    /// `r = (step - (decay_steps - decay_steps_wsd)) / decay_steps_wsd` in `style`'s formula.
    Wsd {
        /// Length of the annealing phase, which ends at `decay_steps` (Megatron's
        /// `wsd_decay_steps`). 0 keeps `max_lr` through `decay_steps` then drops to `min_lr`.
        decay_steps_wsd: usize,
        /// Shape of the annealing phase.
        style: WsdDecay,
    },
}

/// Learning-rate schedule: linear warmup from `warmup_init_lr` to `max_lr` over
/// `warmup_steps`, then `decay_style` down to `min_lr` at `decay_steps`, then `min_lr`.
///
/// See the [module docs](self) for the step convention. Call [`validate`](Self::validate)
/// before use: [`lr`](Self::lr) assumes a valid schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of the warmup (Megatron's `max_lr`).
    pub max_lr: f64,
    /// Final learning rate, reached at `decay_steps` (Megatron's `min_lr`).
    pub min_lr: f64,
    /// Warmup length in optimizer steps (Megatron's `lr_warmup_steps`); 0 disables the warmup.
    pub warmup_steps: usize,
    /// Learning rate at step 0 of the warmup (Megatron's `init_lr`, default 0).
    pub warmup_init_lr: f64,
    /// Step at which the decay ends, counted from step 0 and including the warmup (Megatron's
    /// `lr_decay_steps`). Must exceed `warmup_steps`, also for [`LrDecayStyle::Constant`].
    pub decay_steps: usize,
    /// Shape of the decay.
    pub decay_style: LrDecayStyle,
}

impl LrSchedule {
    /// A constant learning rate `lr` from step 0: no warmup, [`LrDecayStyle::Constant`]
    /// (`decay_steps = 1`, unused by that style).
    pub fn constant(lr: f64) -> Self {
        Self {
            max_lr: lr,
            min_lr: lr,
            warmup_steps: 0,
            warmup_init_lr: 0.0,
            decay_steps: 1,
            decay_style: LrDecayStyle::Constant,
        }
    }

    /// Checks Megatron's constructor assertions, plus finiteness: every rate is finite and
    /// `>= 0`, `min_lr <= max_lr`, `warmup_init_lr <= max_lr`, `decay_steps > 0`,
    /// `warmup_steps < decay_steps`, and for WSD `decay_steps_wsd <= decay_steps`.
    ///
    /// The error is [`BackendError::Config`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("max_lr", self.max_lr)?;
        check_non_negative("min_lr", self.min_lr)?;
        check_non_negative("warmup_init_lr", self.warmup_init_lr)?;
        if self.min_lr > self.max_lr {
            return Err(config_err(
                "min_lr",
                format!("must be <= max_lr ({}), got {}", self.max_lr, self.min_lr),
            ));
        }
        if self.warmup_init_lr > self.max_lr {
            return Err(config_err(
                "warmup_init_lr",
                format!(
                    "must be <= max_lr ({}), got {}",
                    self.max_lr, self.warmup_init_lr
                ),
            ));
        }
        if self.decay_steps == 0 {
            return Err(config_err("decay_steps", "must be > 0"));
        }
        if self.warmup_steps >= self.decay_steps {
            return Err(config_err(
                "warmup_steps",
                format!(
                    "must be < decay_steps ({}), got {}",
                    self.decay_steps, self.warmup_steps
                ),
            ));
        }
        if let LrDecayStyle::Wsd {
            decay_steps_wsd, ..
        } = self.decay_style
            && decay_steps_wsd > self.decay_steps
        {
            return Err(config_err(
                "decay_steps_wsd",
                format!(
                    "the WSD annealing phase must fit in decay_steps ({}), got {decay_steps_wsd}",
                    self.decay_steps
                ),
            ));
        }
        Ok(())
    }

    /// The learning rate for the optimizer step that runs after `step` steps were taken
    /// (Megatron's `get_lr` with `num_steps = step`).
    pub fn lr(&self, step: u64) -> f64 {
        let warmup = self.warmup_steps as u64;
        let decay = self.decay_steps as u64;
        // Linear warmup, including `step == warmup` (which gives `max_lr`).
        if warmup > 0 && step <= warmup {
            return self.warmup_init_lr
                + (self.max_lr - self.warmup_init_lr) * step as f64 / warmup as f64;
        }
        if self.decay_style == LrDecayStyle::Constant {
            return self.max_lr;
        }
        if step > decay {
            return self.min_lr;
        }
        if self.decay_style == LrDecayStyle::InverseSquareRoot {
            let w = warmup.max(1) as f64;
            let s = step.max(1) as f64;
            return self.min_lr.max(self.max_lr * w.sqrt() / s.sqrt());
        }
        let ratio = (step - warmup) as f64 / (decay - warmup) as f64;
        let coeff = match self.decay_style {
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => 0.5 * ((PI * ratio).cos() + 1.0),
            LrDecayStyle::Wsd {
                decay_steps_wsd,
                style,
            } => {
                let anneal_start = decay - decay_steps_wsd as u64;
                if step <= anneal_start {
                    1.0
                } else {
                    style.coeff((step - anneal_start) as f64 / decay_steps_wsd as f64)
                }
            }
            LrDecayStyle::Constant | LrDecayStyle::InverseSquareRoot => unreachable!(),
        };
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

/// How the weight decay goes from `start_wd` to `end_wd` (Megatron's `wd_incr_style`). With
/// `r = step / wd_incr_steps` the weight decay is `start_wd + coeff * (end_wd - start_wd)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WdIncrStyle {
    /// `end_wd` throughout; requires `start_wd == end_wd` (`"constant"`).
    Constant,
    /// `coeff = r` (`"linear"`).
    Linear,
    /// `coeff = (cos(π (1 - r)) + 1) / 2` (`"cosine"`).
    Cosine,
}

/// Weight-decay schedule: `start_wd` at step 0, increased to `end_wd` at `wd_incr_steps`, then
/// `end_wd` (same step convention as [`LrSchedule`]; see the [module docs](self)).
///
/// Call [`validate`](Self::validate) before use: [`wd`](Self::wd) assumes a valid schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct WdSchedule {
    /// Weight decay at step 0 (Megatron's `start_wd`).
    pub start_wd: f64,
    /// Weight decay from `wd_incr_steps` on (Megatron's `end_wd`).
    pub end_wd: f64,
    /// Length of the increase in optimizer steps (Megatron's `wd_incr_steps`).
    pub wd_incr_steps: usize,
    /// Shape of the increase.
    pub wd_incr_style: WdIncrStyle,
}

impl WdSchedule {
    /// A constant weight decay `wd` ([`WdIncrStyle::Constant`]).
    pub fn constant(wd: f64) -> Self {
        Self {
            start_wd: wd,
            end_wd: wd,
            wd_incr_steps: 0,
            wd_incr_style: WdIncrStyle::Constant,
        }
    }

    /// Checks Megatron's assertions: both values finite and `>= 0`, `end_wd >= start_wd`,
    /// `start_wd == end_wd` for [`WdIncrStyle::Constant`], and `wd_incr_steps > 0` for the
    /// other styles (Megatron would divide by zero).
    ///
    /// The error is [`BackendError::Config`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        check_non_negative("start_wd", self.start_wd)?;
        check_non_negative("end_wd", self.end_wd)?;
        if self.end_wd < self.start_wd {
            return Err(config_err(
                "end_wd",
                format!(
                    "must be >= start_wd ({}), got {}",
                    self.start_wd, self.end_wd
                ),
            ));
        }
        match self.wd_incr_style {
            WdIncrStyle::Constant if self.start_wd != self.end_wd => Err(config_err(
                "wd_incr_style",
                format!(
                    "constant needs start_wd == end_wd, got {} and {}",
                    self.start_wd, self.end_wd
                ),
            )),
            WdIncrStyle::Linear | WdIncrStyle::Cosine if self.wd_incr_steps == 0 => {
                Err(config_err(
                    "wd_incr_steps",
                    "must be > 0 for a linear or cosine increase",
                ))
            }
            _ => Ok(()),
        }
    }

    /// The weight decay for the optimizer step that runs after `step` steps were taken
    /// (Megatron's `get_wd` with `num_steps = step`).
    pub fn wd(&self, step: u64) -> f64 {
        let incr = self.wd_incr_steps as u64;
        if step > incr || self.wd_incr_style == WdIncrStyle::Constant {
            return self.end_wd;
        }
        let ratio = step as f64 / incr as f64;
        let coeff = match self.wd_incr_style {
            WdIncrStyle::Linear => ratio,
            WdIncrStyle::Cosine => 0.5 * ((PI * (1.0 - ratio)).cos() + 1.0),
            WdIncrStyle::Constant => unreachable!(),
        };
        self.start_wd + coeff * (self.end_wd - self.start_wd)
    }
}

/// The scheduler's checkpointable state: the number of optimizer steps taken (Megatron's
/// `num_steps`, counted in iterations). The schedules themselves are configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerState {
    /// Optimizer steps already taken: the argument of [`LrSchedule::lr`] / [`WdSchedule::wd`]
    /// for the next step.
    pub step: u64,
}

impl SchedulerState {
    /// Key of the step count in [`to_pairs`](Self::to_pairs) (Megatron's state-dict key).
    pub const STEP_KEY: &'static str = "num_steps";

    /// Counts `increment` more optimizer steps (Megatron's `step(increment)`; call with 1 after
    /// each optimizer step).
    pub fn advance(&mut self, increment: u64) {
        self.step += increment;
    }

    /// The state as `(key, value)` pairs, e.g. to store in a JSON object: `[("num_steps", step)]`.
    /// Exact for step counts up to 2^53.
    pub fn to_pairs(&self) -> Vec<(&'static str, f64)> {
        vec![(Self::STEP_KEY, self.step as f64)]
    }

    /// Reads the state back from [`to_pairs`](Self::to_pairs)' pairs; other keys are ignored.
    /// Fails ([`BackendError::Config`] on field `num_steps`) when the key is missing or its value
    /// is not an integer in `0..=2^53`.
    pub fn from_pairs<K: AsRef<str>>(pairs: impl IntoIterator<Item = (K, f64)>) -> Result<Self> {
        const MAX_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
        let value = pairs
            .into_iter()
            .find(|(k, _)| k.as_ref() == Self::STEP_KEY)
            .map(|(_, v)| v)
            .ok_or_else(|| config_err(Self::STEP_KEY, "missing from the scheduler state"))?;
        if !(0.0..=MAX_EXACT).contains(&value) || value.fract() != 0.0 {
            return Err(config_err(
                Self::STEP_KEY,
                format!("must be an integer in 0..=2^53, got {value}"),
            ));
        }
        Ok(Self { step: value as u64 })
    }
}

/// Megatron's default rule for parameters without weight decay (its `wd_mult = 0` group):
/// 1-D parameters (biases, norm weights) and biases by name.
///
/// `param_path` is the dotted module path (`layers.0.attn.q_proj.bias`). A name counts as a bias
/// when its last segment is `bias` (Megatron's `*.bias`) or ends in `_bias`: our grouped experts
/// stack per-expert biases into 2-D `fc1_bias` / `fc2_bias` `[E, F]` parameters, which Megatron
/// holds as 1-D per-expert biases and so also exempts. 0-D parameters keep weight decay, as in
/// Megatron (`len(param.shape) == 1` only).
pub fn no_weight_decay(param_path: &str, shape: &[usize]) -> bool {
    let last = param_path.rsplit('.').next().unwrap_or(param_path);
    shape.len() == 1 || last == "bias" || last.ends_with("_bias")
}
