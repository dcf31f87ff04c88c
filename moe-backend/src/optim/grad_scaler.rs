//! Loss scaling for FP16 mixed precision: Megatron-Core's `megatron/core/optimizer/grad_scaler.py`
//! (`ConstantGradScaler`, `DynamicGradScaler`) and the unscale-and-check step of its mixed
//! precision optimizer (`_unscale_main_grads_and_check_for_nan`), see
//! docs/training-and-rl.md §Mixed precision (FP16 and loss scaling).
//!
//! Under [`super::Precision::F16`] the loss is multiplied by the scale before the backward pass
//! so that small gradients stay representable in F16 (5 exponent bits: normal values from
//! 2⁻¹⁴, subnormal from 2⁻²⁴, largest 65504). The micro-batches' gradients are accumulated in
//! f32 main gradients, then [`unscale_grads`] multiplies them by `1 / scale` and reports
//! whether any is NaN or infinite; the caller agrees on that over every rank (one collective,
//! as Megatron's all-reduce max of `found_inf`) and, on an overflow, skips the step (no
//! parameter, moment or step-count update) and calls [`GradScaler::update`]:
//!
//! - dynamic: an overflow sets the growth tracker to 0 and decrements the hysteresis tracker;
//!   when that reaches 0 (`hysteresis` overflows since the last growth) the scale is
//!   multiplied by `backoff_factor` (not below `min_scale`). A finite step increments the
//!   growth tracker; after `growth_interval` consecutive finite steps the scale is multiplied
//!   by `growth_factor` and both trackers are reset. Megatron's defaults
//!   ([`DynamicScalerConfig::default`]): `--initial-loss-scale` 2³², `--min-loss-scale` 1,
//!   growth 2, backoff 0.5, `--loss-scale-window` 1000, `--hysteresis` 2.
//! - constant (`--loss-scale S`): the scale never changes.
//!
//! The scale is held as an f32, as Megatron's `torch.float` tensor (the factors are powers of
//! two, so every scale is exact). [`GradScalerState`] is what a checkpoint keeps (Megatron's
//! `state_dict`: `scale`, `growth_tracker`, `hysteresis_tracker`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use crate::error::BackendError;

/// Megatron's `DynamicGradScaler` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicScalerConfig {
    /// The first scale (`--initial-loss-scale`, default 2³²).
    pub initial_scale: f64,
    /// The scale never backs off below this (`--min-loss-scale`, default 1).
    pub min_scale: f64,
    /// Factor of a growth (> 1; Megatron: 2).
    pub growth_factor: f64,
    /// Factor of a back-off (in (0, 1); Megatron: 0.5).
    pub backoff_factor: f64,
    /// Consecutive finite steps before the scale grows (`--loss-scale-window`, default 1000).
    pub growth_interval: u64,
    /// Overflows since the last growth before the scale backs off (`--hysteresis`, default 2).
    pub hysteresis: u64,
}

impl Default for DynamicScalerConfig {
    fn default() -> Self {
        Self {
            initial_scale: 4_294_967_296.0,
            min_scale: 1.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
        }
    }
}

/// Which loss scaler an FP16 run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradScalerConfig {
    /// A fixed scale (Megatron's `ConstantGradScaler`, `--loss-scale S`).
    Constant(f64),
    /// Megatron's `DynamicGradScaler` (the default).
    Dynamic(DynamicScalerConfig),
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self::Dynamic(DynamicScalerConfig::default())
    }
}

/// The state a checkpoint keeps (Megatron's `DynamicGradScaler.state_dict`; a constant scaler
/// has only its scale).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f64,
    /// Consecutive finite steps since the last overflow or growth.
    pub growth_tracker: u64,
    /// Overflows still tolerated before the next back-off.
    pub hysteresis_tracker: i64,
}

/// What [`GradScaler::update`] did with the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleChange {
    /// Unchanged.
    Kept,
    /// Multiplied by the growth factor.
    Grew,
    /// Multiplied by the back-off factor (or clamped to the minimum).
    BackedOff,
}

/// A loss scaler (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f32,
    growth_tracker: u64,
    hysteresis_tracker: i64,
}

fn config_err(field: &'static str, detail: String) -> BackendError {
    BackendError::Config { field, detail }
}

/// `v` as a positive finite f32 scale.
fn scale_value(field: &'static str, v: f64) -> Result<f32, BackendError> {
    let f = v as f32;
    if !(v > 0.0 && f.is_finite() && f > 0.0) {
        return Err(config_err(
            field,
            format!("{v} (expected a positive, finite f32 value)"),
        ));
    }
    Ok(f)
}

impl GradScaler {
    /// A scaler at its initial scale; the settings are checked as Megatron asserts them
    /// (scales positive, `min_scale ≤ initial_scale`, `growth_factor > 1`,
    /// `0 < backoff_factor < 1`, `growth_interval > 0`, `hysteresis > 0`).
    pub fn new(config: GradScalerConfig) -> Result<Self, BackendError> {
        let (scale, hysteresis) = match config {
            GradScalerConfig::Constant(scale) => (scale_value("loss_scale", scale)?, 0),
            GradScalerConfig::Dynamic(c) => {
                let initial = scale_value("initial_loss_scale", c.initial_scale)?;
                let min = scale_value("min_loss_scale", c.min_scale)?;
                if min > initial {
                    return Err(config_err(
                        "min_loss_scale",
                        format!(
                            "{} above the initial scale {}",
                            c.min_scale, c.initial_scale
                        ),
                    ));
                }
                if !(c.growth_factor > 1.0 && c.growth_factor.is_finite()) {
                    return Err(config_err(
                        "loss_scale_growth_factor",
                        format!("{} (expected > 1)", c.growth_factor),
                    ));
                }
                if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
                    return Err(config_err(
                        "loss_scale_backoff_factor",
                        format!("{} (expected in (0, 1))", c.backoff_factor),
                    ));
                }
                if c.growth_interval == 0 {
                    return Err(config_err("loss_scale_window", "0 (expected > 0)".into()));
                }
                let hysteresis = i64::try_from(c.hysteresis)
                    .ok()
                    .filter(|&h| h > 0)
                    .ok_or_else(|| {
                        config_err("hysteresis", format!("{} (expected > 0)", c.hysteresis))
                    })?;
                (initial, hysteresis)
            }
        };
        Ok(Self {
            config,
            scale,
            growth_tracker: 0,
            hysteresis_tracker: hysteresis,
        })
    }

    /// The settings.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// The scale the next backward pass multiplies the loss by.
    pub fn scale(&self) -> f64 {
        f64::from(self.scale)
    }

    /// `1 / scale` (computed in f64 and rounded to f32, as Megatron's `inv_scale`).
    pub fn inv_scale(&self) -> f64 {
        f64::from((1.0 / f64::from(self.scale)) as f32)
    }

    /// Whether the scale changes with overflows (a dynamic scaler).
    pub fn is_dynamic(&self) -> bool {
        matches!(self.config, GradScalerConfig::Dynamic(_))
    }

    /// Whether an overflow now is one loss scaling cannot absorb: a constant scaler, or a
    /// dynamic one whose scale is at its minimum already (the trainer's non-finite guard
    /// decides about such a step).
    pub fn overflow_is_divergence(&self) -> bool {
        match self.config {
            GradScalerConfig::Constant(_) => true,
            GradScalerConfig::Dynamic(c) => f64::from(self.scale) <= c.min_scale,
        }
    }

    /// Megatron's `update(found_inf)` after a step (see the module docs).
    pub fn update(&mut self, found_inf: bool) -> ScaleChange {
        let GradScalerConfig::Dynamic(c) = self.config else {
            return ScaleChange::Kept;
        };
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                let backed =
                    ((f64::from(self.scale) * c.backoff_factor) as f32).max(c.min_scale as f32);
                let change = if backed != self.scale {
                    ScaleChange::BackedOff
                } else {
                    ScaleChange::Kept
                };
                self.scale = backed;
                return change;
            }
            ScaleChange::Kept
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == c.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_tracker = c.hysteresis as i64;
                self.scale = (f64::from(self.scale) * c.growth_factor) as f32;
                return ScaleChange::Grew;
            }
            ScaleChange::Kept
        }
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale(),
            growth_tracker: self.growth_tracker,
            hysteresis_tracker: self.hysteresis_tracker,
        }
    }

    /// Restores a checkpoint's state (a constant scaler keeps its configured scale, as
    /// Megatron's `ConstantGradScaler.load_state_dict` ignores the checkpoint).
    pub fn load_state(&mut self, state: &GradScalerState) -> Result<(), BackendError> {
        if !self.is_dynamic() {
            return Ok(());
        }
        self.scale = scale_value("grad_scaler.scale", state.scale)?;
        self.growth_tracker = state.growth_tracker;
        self.hysteresis_tracker = state.hysteresis_tracker;
        Ok(())
    }
}

/// `grads` of `module`'s float parameters cast to f32 and multiplied by `inv_scale` (the f32
/// main gradients, unscaled), and whether any of them holds a NaN or an infinity on this rank
/// (one read of a device scalar). Gradients of other modules' parameters are left out.
pub fn unscale_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    inv_scale: f64,
) -> Result<(GradientsParams, bool), BackendError> {
    struct Unscaler<'a> {
        from: &'a mut GradientsParams,
        to: GradientsParams,
        inv_scale: f64,
        /// Σ over gradients of `sum(g · 0)`: NaN exactly when some element is not finite.
        probe: Option<Tensor<1>>,
    }
    impl ModuleVisitor for Unscaler<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.from.remove::<D>(param.id) {
                let g = g.cast(DType::F32);
                let g = if self.inv_scale == 1.0 {
                    g
                } else {
                    g.mul_scalar(self.inv_scale)
                };
                let zero = g.clone().mul_scalar(0.0).sum();
                self.probe = Some(match self.probe.take() {
                    Some(p) => p + zero,
                    None => zero,
                });
                self.to.register::<D>(param.id, g);
            }
        }
    }
    let mut unscaler = Unscaler {
        from: &mut grads,
        to: GradientsParams::new(),
        inv_scale,
        probe: None,
    };
    module.visit(&mut unscaler);
    let found_inf = match unscaler.probe {
        Some(probe) => {
            let v = probe
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| config_err("gradients", format!("unreadable check value: {e:?}")))?;
            v.iter().any(|x| !x.is_finite())
        }
        None => false,
    };
    Ok((unscaler.to, found_inf))
}

#[cfg(test)]
mod tests {
    //! The scaler against Megatron's rules written out as a closed form: for a scripted
    //! sequence of overflows, the expected scale after each step is derived by hand from the
    //! rules in `grad_scaler.py` (comments), not by running the code under test.

    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Device, TensorData};

    use super::*;

    fn dynamic(initial: f64, interval: u64, hysteresis: u64) -> GradScaler {
        GradScaler::new(GradScalerConfig::Dynamic(DynamicScalerConfig {
            initial_scale: initial,
            growth_interval: interval,
            hysteresis,
            ..DynamicScalerConfig::default()
        }))
        .unwrap()
    }

    #[test]
    fn megatron_defaults() {
        let s = GradScaler::new(GradScalerConfig::default()).unwrap();
        assert_eq!(s.scale(), 2f64.powi(32));
        assert_eq!(s.inv_scale(), 2f64.powi(-32));
        assert_eq!(
            s.state(),
            GradScalerState {
                scale: 2f64.powi(32),
                growth_tracker: 0,
                hysteresis_tracker: 2
            }
        );
    }

    #[test]
    fn hysteresis_two_backs_off_on_the_second_overflow_and_every_one_after() {
        // growth_interval 3, hysteresis 2, initial 2^10.
        let mut s = dynamic(1024.0, 3, 2);
        // (found_inf, expected scale after the update, growth, hysteresis tracker)
        let script = [
            // 1st overflow: tracker 2 → 1, no back-off.
            (true, 1024.0, 0, 1),
            // 2nd: tracker 1 → 0 → back-off to 512.
            (true, 512.0, 0, 0),
            // 3rd: tracker −1, back-off again (the tracker only resets on growth).
            (true, 256.0, 0, -1),
            // Two finite steps: growth tracker 1, 2.
            (false, 256.0, 1, -1),
            (false, 256.0, 2, -1),
            // An overflow resets growth; tracker −2 → back-off.
            (true, 128.0, 0, -2),
            // Three finite steps: the third grows ×2 and resets both trackers.
            (false, 128.0, 1, -2),
            (false, 128.0, 2, -2),
            (false, 256.0, 0, 2),
            // After a growth the hysteresis applies again: one overflow tolerated.
            (true, 256.0, 0, 1),
            (true, 128.0, 0, 0),
        ];
        for (i, (found_inf, scale, growth, hyst)) in script.into_iter().enumerate() {
            s.update(found_inf);
            let st = s.state();
            assert_eq!(
                (st.scale, st.growth_tracker, st.hysteresis_tracker),
                (scale, growth, hyst),
                "step {i}"
            );
        }
    }

    #[test]
    fn back_off_stops_at_the_minimum_and_then_counts_as_divergence() {
        let mut s = GradScaler::new(GradScalerConfig::Dynamic(DynamicScalerConfig {
            initial_scale: 8.0,
            min_scale: 2.0,
            hysteresis: 1,
            ..DynamicScalerConfig::default()
        }))
        .unwrap();
        assert!(!s.overflow_is_divergence());
        assert_eq!(s.update(true), ScaleChange::BackedOff);
        assert_eq!(s.scale(), 4.0);
        assert_eq!(s.update(true), ScaleChange::BackedOff);
        assert_eq!(s.scale(), 2.0);
        assert!(s.overflow_is_divergence());
        // max(2 · 0.5, 2) = 2.
        assert_eq!(s.update(true), ScaleChange::Kept);
        assert_eq!(s.scale(), 2.0);
    }

    #[test]
    fn default_window_grows_after_exactly_1000_finite_steps() {
        let mut s = GradScaler::new(GradScalerConfig::default()).unwrap();
        for _ in 0..999 {
            assert_eq!(s.update(false), ScaleChange::Kept);
        }
        assert_eq!(s.update(false), ScaleChange::Grew);
        assert_eq!(s.scale(), 2f64.powi(33));
    }

    #[test]
    fn constant_scaler_never_changes_and_ignores_a_checkpoint() {
        let mut s = GradScaler::new(GradScalerConfig::Constant(128.0)).unwrap();
        assert!(s.overflow_is_divergence());
        for found_inf in [true, true, false, true] {
            assert_eq!(s.update(found_inf), ScaleChange::Kept);
        }
        s.load_state(&GradScalerState {
            scale: 4.0,
            growth_tracker: 3,
            hysteresis_tracker: 1,
        })
        .unwrap();
        assert_eq!(s.scale(), 128.0);
    }

    #[test]
    fn state_round_trips_and_resumes_identically() {
        let mut a = dynamic(64.0, 2, 2);
        let script = [true, false, true, true, false, false, true];
        for &f in &script[..4] {
            a.update(f);
        }
        let mut b = dynamic(64.0, 2, 2);
        b.load_state(&a.state()).unwrap();
        for &f in &script[4..] {
            a.update(f);
            b.update(f);
            assert_eq!(a.state(), b.state());
        }
    }

    #[test]
    fn bad_settings_are_named() {
        let bad = |c: DynamicScalerConfig| {
            GradScaler::new(GradScalerConfig::Dynamic(c))
                .unwrap_err()
                .to_string()
        };
        let d = DynamicScalerConfig::default();
        assert!(
            bad(DynamicScalerConfig {
                min_scale: 2f64.powi(40),
                ..d
            })
            .contains("min_loss_scale")
        );
        assert!(bad(DynamicScalerConfig { hysteresis: 0, ..d }).contains("hysteresis"));
        assert!(
            bad(DynamicScalerConfig {
                growth_interval: 0,
                ..d
            })
            .contains("loss_scale_window")
        );
        assert!(
            bad(DynamicScalerConfig {
                backoff_factor: 1.0,
                ..d
            })
            .contains("backoff")
        );
        assert!(
            bad(DynamicScalerConfig {
                initial_scale: 1e39,
                ..d
            })
            .contains("initial_loss_scale")
        );
        let e = GradScaler::new(GradScalerConfig::Constant(0.0)).unwrap_err();
        assert!(e.to_string().contains("loss_scale"), "{e}");
    }

    #[test]
    fn unscale_multiplies_into_f32_and_finds_non_finite_values() {
        let device = Device::flex().autodiff();
        let linear: Linear = LinearConfig::new(2, 2).init(&device);
        let wid = linear.weight.id;
        let grads_of = |values: Vec<f32>| {
            let mut g = GradientsParams::new();
            let t = Tensor::<2>::from_data(TensorData::new(values, [2, 2]), &Device::flex())
                .cast(DType::F16);
            g.register::<2>(wid, t);
            g
        };
        let (g, found) =
            unscale_grads(&linear, grads_of(vec![1024.0, -8.0, 0.5, 0.0]), 1.0 / 256.0).unwrap();
        assert!(!found);
        let g = g.get::<2>(wid).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        let v = g.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(v, vec![4.0, -0.03125, 0.001953125, 0.0]);
        // 1e5 overflows F16 (largest 65504): infinite.
        let (_, found) =
            unscale_grads(&linear, grads_of(vec![1.0, 1e5, 0.0, 0.0]), 1.0 / 256.0).unwrap();
        assert!(found);
        let (_, found) =
            unscale_grads(&linear, grads_of(vec![f32::NAN, 1.0, 0.0, 0.0]), 1.0).unwrap();
        assert!(found);
    }
}
