//! Mixed precision: Megatron-Core's BF16 recipe (`--bf16`; `Float16Module`, the distributed
//! optimizer's FP32 main parameters, `accumulate_allreduce_grads_in_fp32`), see
//! docs/training-and-rl.md §Mixed precision (BF16).
//!
//! Under [`Precision::Bf16`] the module's trainable parameters are held in BF16
//! ([`cast_trainable`]), so the forward and backward passes compute in BF16 (on the CPU backend
//! Flex every BF16 op computes in f32 and rounds its result once to BF16; matmuls accumulate in
//! f32). The optimizer ([`super::DistributedAdamW`]) keeps the f32 main weights and moments: it
//! reads gradients as f32 and writes each new parameter as its f32 main weight rounded to the
//! parameter's dtype (round to nearest even). Gradients of several micro-batches are
//! accumulated in f32 ([`grads_to_dtype`] before accumulating, Megatron's default
//! `accumulate_allreduce_grads_in_fp32`), or in BF16 with the reduction in BF16
//! ([`super::DistributedAdamW::set_grad_reduce_dtype`]). Buffers that do not require gradients
//! (the expert bias of aux-loss-free balancing) keep their dtype (f32), as Megatron keeps
//! `expert_bias` in f32. The layers keep their precision-critical parts in f32 whatever the
//! parameters' dtype: router logits, scores, top-k and aux losses (`moe_router_dtype = fp32`),
//! RMSNorm statistics, the attention softmax and the cross-entropy.
//!
//! [`Precision::F16`] is Megatron's `--fp16`: the same recipe with F16 in place of BF16 (a dtype
//! choice), plus loss scaling ([`super::grad_scaler`]), since F16's 5 exponent bits let small
//! gradients underflow.

use std::fmt;
use std::str::FromStr;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Tensor};

use super::params::like_param_as;
use crate::error::BackendError;

/// The precision of a training run's parameters, activations and gradients (the optimizer's
/// main weights and moments are f32 in both; see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in f32 (the CPU default).
    #[default]
    F32,
    /// Megatron's BF16 mixed precision (`--bf16`): BF16 parameters, activations and
    /// gradients, f32 main weights, moments and gradient accumulation.
    Bf16,
    /// Megatron's FP16 mixed precision (`--fp16`): the BF16 recipe with F16 parameters,
    /// activations and gradients, plus loss scaling ([`super::grad_scaler`]).
    F16,
}

impl Precision {
    /// The dtype the module's trainable parameters are held in.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Bytes of one parameter element (and of one gradient element as the backward pass
    /// produces it): 4 for f32, 2 for BF16 and F16.
    pub fn param_bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The name used on the command line and in configs (`fp32`, `bf16`, `fp16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        }
    }

    /// Whether the recipe scales the loss (FP16: its gradients underflow without it).
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::F16
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Precision::F16),
            other => Err(BackendError::Config {
                field: "precision",
                detail: format!("`{other}` (expected fp32, bf16 or fp16)"),
            }),
        }
    }
}

/// `module` with every trainable float parameter (one that requires gradients) cast to
/// `dtype` (round to nearest even), ids, autodiff and gradient requirement kept; buffers
/// (parameters without gradients, such as the expert bias) keep their dtype.
pub fn cast_trainable<M: Module>(module: M, dtype: DType) -> M {
    struct Caster(DType);
    impl ModuleMapper for Caster {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| {
                if !t.is_require_grad() || t.dtype() == dtype {
                    return t;
                }
                like_param_as(t.clone().without_autodiff(), &t, dtype)
            })
        }
    }
    module.map(&mut Caster(dtype))
}

/// `grads` with every gradient of `module`'s float parameters cast to `dtype` (e.g. f32 before
/// accumulating micro-batches, Megatron's `accumulate_allreduce_grads_in_fp32`); gradients of
/// other modules' parameters are left out.
pub fn grads_to_dtype<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    dtype: DType,
) -> GradientsParams {
    struct Caster<'a> {
        from: &'a mut GradientsParams,
        to: GradientsParams,
        dtype: DType,
    }
    impl ModuleVisitor for Caster<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.from.remove::<D>(param.id) {
                self.to.register::<D>(param.id, g.cast(self.dtype));
            }
        }
    }
    let mut caster = Caster {
        from: &mut grads,
        to: GradientsParams::new(),
        dtype,
    };
    module.visit(&mut caster);
    caster.to
}

/// Burn's [`GradientsAccumulator`] with every micro-batch's gradients cast to a main-gradient
/// dtype first (Megatron's `main_grad` buffers: f32 under BF16 with
/// `accumulate_allreduce_grads_in_fp32`); without one, exactly Burn's accumulator.
pub struct MainGradAccumulator<M> {
    inner: GradientsAccumulator<M>,
    dtype: Option<DType>,
}

impl<M: Module> MainGradAccumulator<M> {
    /// An empty accumulator casting to `dtype` (`None`: gradients kept as the backward pass
    /// produced them).
    pub fn new(dtype: Option<DType>) -> Self {
        Self {
            inner: GradientsAccumulator::new(),
            dtype,
        }
    }

    /// Adds `grads` (of `module`'s parameters) to the sums, cast first when a dtype is set.
    pub fn accumulate(&mut self, module: &M, grads: GradientsParams) {
        let grads = match self.dtype {
            Some(dtype) => grads_to_dtype(module, grads, dtype),
            None => grads,
        };
        self.inner.accumulate(module, grads);
    }

    /// The accumulated gradients (the accumulator starts over).
    pub fn grads(&mut self) -> GradientsParams {
        self.inner.grads()
    }
}

/// The dtype of `module`'s first trainable float parameter (`None` without one).
pub fn trainable_dtype<M: Module>(module: &M) -> Option<DType> {
    struct Probe(Option<DType>);
    impl ModuleVisitor for Probe {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() && param.val().is_require_grad() {
                self.0 = Some(param.val().dtype());
            }
        }
    }
    let mut probe = Probe(None);
    module.visit(&mut probe);
    probe.0
}

#[cfg(test)]
mod tests {
    //! What Burn 0.22.1's Flex backend does with BF16 tensors (the facts the recipe relies on),
    //! and the module / gradient casts.

    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{DType, Device, Tensor, TensorData, bf16};

    use super::*;

    fn bf(v: f32) -> f32 {
        bf16::from_f32(v).to_f32()
    }

    fn host(t: Tensor<2>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    fn t2(v: &[f32], shape: [usize; 2], dtype: DType, device: &Device) -> Tensor<2> {
        Tensor::<2>::from_data(TensorData::new(v.to_vec(), shape), device).cast(dtype)
    }

    #[test]
    fn flex_bf16_matmul_accumulates_in_f32_and_rounds_once() {
        let device = Device::flex();
        // 256 + 1 + 1: a BF16 accumulator (spacing 2 at 256) would give 256 (ties to even),
        // an f32 one 258, which is a BF16 value.
        let a = t2(&[256.0, 1.0, 1.0], [1, 3], DType::BF16, &device);
        let b = t2(&[1.0, 1.0, 1.0], [3, 1], DType::BF16, &device);
        let c = a.matmul(b);
        assert_eq!(c.dtype(), DType::BF16);
        assert_eq!(host(c), vec![258.0]);
        // Random values: the product of the BF16 inputs in f32, rounded once.
        let (x, w): (Vec<f32>, Vec<f32>) = (0..24)
            .map(|i| ((i as f32 * 0.37).sin(), (i as f32 * 0.91).cos()))
            .unzip();
        let xb = t2(&x, [4, 6], DType::BF16, &device);
        let wb = t2(&w, [6, 4], DType::BF16, &device);
        let got = host(xb.clone().matmul(wb.clone()));
        let want = host(xb.cast(DType::F32).matmul(wb.cast(DType::F32)));
        assert_eq!(got, want.iter().map(|&v| bf(v)).collect::<Vec<_>>());
    }

    #[test]
    fn flex_bf16_elementwise_and_sum_round_each_result() {
        let device = Device::flex();
        let a = t2(&[1.0, 256.0], [1, 2], DType::BF16, &device);
        let b = t2(&[1.0 / 512.0, 1.0], [1, 2], DType::BF16, &device);
        // Each sum rounded to BF16: 1 + 2⁻⁹ → 1 (8 mantissa bits), 256 + 1 → 256 (ties even).
        assert_eq!(host(a.clone() + b), vec![1.0, 256.0]);
        // A reduction accumulates in f32 and rounds once: 256 + 1 + 1 = 258.
        let s = t2(&[256.0, 1.0, 1.0], [1, 3], DType::BF16, &device).sum_dim(1);
        assert_eq!(s.dtype(), DType::BF16);
        assert_eq!(host(s), vec![258.0]);
        // Casts round to nearest even and are exact back to f32.
        let x = t2(
            &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3.0e-3],
            [1, 3],
            DType::F32,
            &device,
        );
        assert_eq!(
            host(x.cast(DType::BF16).cast(DType::F32)),
            vec![1.0, 1.015625, bf(3.0e-3)]
        );
    }

    #[test]
    fn flex_autodiff_through_casts_gives_gradients_in_the_leaf_dtype() {
        let device = Device::flex().autodiff();
        let w = t2(&[0.3, -1.7, 2.2, 0.05], [2, 2], DType::BF16, &device).require_grad();
        let x = t2(&[1.1, 0.9, -0.4, 2.5], [2, 2], DType::BF16, &device);
        // BF16 matmul, then the loss in f32 (as the cross-entropy is).
        let y = x.clone().matmul(w.clone()).cast(DType::F32);
        let loss = (y.clone() * y).sum();
        let grads = loss.backward();
        let g = w.grad(&grads).unwrap();
        assert_eq!(g.dtype(), DType::BF16);
        // dL/dW = xᵀ · 2y with y = bf16(x·w) and the f32 gradient 2y cast back to BF16
        // before the BF16 matmul.
        let xf = x.without_autodiff().cast(DType::F32);
        let wf = w.without_autodiff().cast(DType::F32);
        let yb = xf.clone().matmul(wf).cast(DType::BF16).cast(DType::F32);
        let want = xf.transpose().matmul(yb.mul_scalar(2.0));
        let want: Vec<f32> = host(want).into_iter().map(bf).collect();
        assert_eq!(host(g), want);
    }

    #[test]
    fn cast_trainable_keeps_ids_gradients_and_buffers() {
        let device = Device::flex().autodiff();
        let linear: Linear = LinearConfig::new(3, 2).init(&device);
        let id = linear.weight.id;
        let before = host(linear.weight.val().without_autodiff());
        let cast = cast_trainable(linear, DType::BF16);
        assert_eq!(cast.weight.id, id);
        assert!(cast.weight.val().is_require_grad());
        assert_eq!(trainable_dtype(&cast), Some(DType::BF16));
        let after = host(cast.weight.val().without_autodiff().cast(DType::F32));
        assert_eq!(after, before.iter().map(|&v| bf(v)).collect::<Vec<_>>());
        // A buffer (no gradient) is left alone.
        let frozen = cast_trainable(LinearConfig::new(3, 2).init(&device).no_grad(), DType::BF16);
        assert_eq!(frozen.weight.val().dtype(), DType::F32);
        // The gradients follow: BF16 from the backward pass, f32 after `grads_to_dtype`.
        let x = t2(&[1.0, 2.0, 3.0], [1, 3], DType::BF16, &device);
        let grads = cast.forward(x).cast(DType::F32).sum().backward();
        let grads = GradientsParams::from_grads(grads, &cast);
        assert_eq!(grads.get::<2>(id).unwrap().dtype(), DType::BF16);
        let grads = grads_to_dtype(&cast, grads, DType::F32);
        assert_eq!(grads.get::<2>(id).unwrap().dtype(), DType::F32);
    }

    #[test]
    fn precision_names_round_trip() {
        for p in [Precision::F32, Precision::Bf16, Precision::F16] {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert!("fp8".parse::<Precision>().is_err());
        assert_eq!(Precision::Bf16.param_dtype(), DType::BF16);
        assert_eq!(Precision::F16.param_dtype(), DType::F16);
        assert_eq!(Precision::F16.param_bytes(), 2);
    }
}
