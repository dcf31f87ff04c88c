//! RMSNorm with HF semantics (docs/models.md §Shared building blocks).

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{DType, Device, Tensor};

/// Configuration of an [`RmsNorm`] over the last dimension.
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Size of the normalised (last) dimension, e.g. `hidden_size` or `head_dim`.
    pub size: usize,
    /// Added to the mean square before the reciprocal square root (HF `rms_norm_eps`).
    #[config(default = 1e-6)]
    pub epsilon: f64,
}

impl RmsNormConfig {
    /// Creates the module with `weight` initialised to ones.
    pub fn init(&self, device: &Device) -> RmsNorm {
        RmsNorm {
            weight: Initializer::Ones.init([self.size], device),
            epsilon: self.epsilon,
        }
    }
}

/// Root-mean-square normalisation over the last dimension, as HF's `Qwen3RMSNorm` /
/// `DeepseekV3RMSNorm`:
///
/// `x32 = f32(x)`; `y = x32 · rsqrt(mean(x32², -1) + eps)`; `out = weight ⊙ cast(y, dtype(x))`.
///
/// The statistics are always computed in f32; the result is cast back to the input dtype
/// *before* the weight is applied (the weight is cast to the input dtype too, so the output
/// dtype is the input dtype).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Per-feature scale `[size]` (HF name `weight`).
    pub weight: Param<Tensor<1>>,
    /// Numerical-stability epsilon.
    pub epsilon: f64,
}

impl RmsNorm {
    /// Normalises `x` `[..., size]` over its last dimension; the output has `x`'s shape and dtype.
    ///
    /// # Panics
    ///
    /// If the last dimension of `x` is not the weight's size.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let [size] = self.weight.dims();
        let dims = x.dims();
        assert_eq!(
            dims[D - 1],
            size,
            "RmsNorm: last dimension of input {dims:?} must equal the weight size {size}"
        );
        let dtype = x.dtype();
        let x32 = x.cast(DType::F32);
        let inv_rms = (x32.clone().square().mean_dim(D - 1) + self.epsilon)
            .sqrt()
            .recip();
        let y = (x32 * inv_rms).cast(dtype);
        y * self.weight.val().cast(dtype).unsqueeze()
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, TensorData, Tolerance};

    use super::*;
    use crate::testing;

    fn device() -> Device {
        Device::flex()
    }

    #[test]
    fn matches_naive_rows_on_random_data() {
        let device = device();
        let (rows, cols, eps) = (7, 33, 1e-6);
        let x = Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, 3.0), &device);
        let weight = Tensor::<1>::random([cols], Distribution::Normal(1.0, 0.1), &device);
        let mut norm = RmsNormConfig::new(cols).with_epsilon(eps).init(&device);
        norm.weight = Param::from_tensor(weight.clone());

        let out = norm.forward(x.clone()).into_data();
        let x_host = x.into_data().try_to_vec::<f32>().unwrap();
        let w_host = weight.into_data().try_to_vec::<f32>().unwrap();
        let expected = testing::rms_norm(&x_host, cols, &w_host, eps);
        out.assert_approx_eq::<f32>(
            &TensorData::new(expected, [rows, cols]),
            Tolerance::rel_abs(1e-5, 1e-6),
        );
    }

    #[test]
    fn weight_starts_at_one_and_rows_get_unit_rms() {
        let device = device();
        let norm = RmsNormConfig::new(16).init(&device);
        assert_eq!(
            norm.weight.val().into_data().try_to_vec::<f32>().unwrap(),
            [1.0; 16]
        );
        let x = Tensor::<3>::random([2, 3, 16], Distribution::Uniform(-5.0, 5.0), &device);
        let ms = norm.forward(x).square().mean_dim(2);
        ms.into_data().assert_approx_eq::<f32>(
            &TensorData::ones::<f32, _>([2, 3, 1]),
            Tolerance::rel_abs(1e-4, 1e-5),
        );
    }

    #[test]
    fn keeps_the_input_dtype_and_tiny_inputs_stay_finite() {
        let device = device();
        let norm = RmsNormConfig::new(8).with_epsilon(1e-5).init(&device);
        let x = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), &device);
        let x16 = x.clone().cast(DType::BF16);
        let out = norm.forward(x16.clone());
        assert_eq!(out.dtype(), DType::BF16);
        let reference = norm.forward(x16.cast(DType::F32));
        out.cast(DType::F32)
            .into_data()
            .assert_approx_eq::<f32>(&reference.into_data(), Tolerance::rel_abs(1e-2, 1e-2));

        let zeros = norm.forward(Tensor::<2>::zeros([2, 8], &device));
        assert!(
            zeros
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|v| *v == 0.0)
        );
    }

    #[test]
    fn gradients_reach_the_weight() {
        let device = device().autodiff();
        let norm = RmsNormConfig::new(5).init(&device);
        let x = Tensor::<2>::random([3, 5], Distribution::Normal(0.0, 1.0), &device);
        let grads = norm.forward(x).sum().backward();
        let g = norm.weight.grad(&grads).expect("weight gradient");
        assert_eq!(g.dims(), [5]);
    }
}
