//! Dense SwiGLU MLP (docs/models.md §Shared building blocks): `down(silu(gate(x)) ⊙ up(x))`, no
//! biases.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor};
use moe_backend::fp8::{Fp8Recipe, linear_maybe_fp8};

/// Configuration of a dense SwiGLU [`Mlp`].
#[derive(Config, Debug)]
pub struct MlpConfig {
    /// Model width `H` (input and output size).
    pub hidden_size: usize,
    /// Inner width `I` (`intermediate_size`, or `moe_intermediate_size` for an expert).
    pub intermediate_size: usize,
}

impl MlpConfig {
    /// Creates the module with Burn's default (Kaiming-uniform) initialisation and no biases.
    pub fn init(&self, device: &Device) -> Mlp {
        let linear = |d_in, d_out| LinearConfig::new(d_in, d_out).with_bias(false).init(device);
        Mlp {
            gate_proj: linear(self.hidden_size, self.intermediate_size),
            up_proj: linear(self.hidden_size, self.intermediate_size),
            down_proj: linear(self.intermediate_size, self.hidden_size),
            fp8: None,
        }
    }
}

/// SwiGLU feed-forward block with HF parameter names.
///
/// Burn's [`Linear`] stores its weight as `[in, out]`, the transpose of the checkpoint's
/// `[out, in]`; the bridge transposes at the (de)serialisation boundary.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `H → I`, weight `[H, I]` in Burn (`[I, H]` in checkpoints).
    pub gate_proj: Linear,
    /// `H → I`, weight `[H, I]` in Burn (`[I, H]` in checkpoints).
    pub up_proj: Linear,
    /// `I → H`, weight `[I, H]` in Burn (`[H, I]` in checkpoints).
    pub down_proj: Linear,
    /// FP8 recipe of the three projections (docs/fp8.md §Recipes; `None`: the parameters'
    /// precision).
    #[module(skip)]
    pub fp8: Option<Fp8Recipe>,
}

impl Mlp {
    /// Applies the block to `x` `[..., H]`, returning `[..., H]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let fp8 = self.fp8.as_ref();
        let gate = silu(linear_maybe_fp8(&self.gate_proj, x.clone(), fp8));
        let up = linear_maybe_fp8(&self.up_proj, x, fp8);
        linear_maybe_fp8(&self.down_proj, gate * up, fp8)
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::{Distribution, TensorData, Tolerance};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::testing;

    fn random_vec(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// A bias-free `Linear` holding the checkpoint-layout weight `w` `[out, in]`.
    fn linear_from_hf(w: &[f32], out: usize, inp: usize, device: &Device) -> Linear {
        let w = Tensor::<2>::from_data(TensorData::new(w.to_vec(), [out, inp]), device);
        Linear {
            weight: Param::from_tensor(w.transpose()),
            bias: None,
        }
    }

    #[test]
    fn matches_naive_loops() {
        let device = Device::flex();
        let (tokens, h, i) = (5, 12, 20);
        let mut rng = StdRng::seed_from_u64(7);
        let x = random_vec(&mut rng, tokens * h, 2.0);
        let gate = random_vec(&mut rng, i * h, 0.5);
        let up = random_vec(&mut rng, i * h, 0.5);
        let down = random_vec(&mut rng, h * i, 0.5);
        let mlp = Mlp {
            gate_proj: linear_from_hf(&gate, i, h, &device),
            up_proj: linear_from_hf(&up, i, h, &device),
            down_proj: linear_from_hf(&down, h, i, &device),
            fp8: None,
        };

        let input = Tensor::<2>::from_data(TensorData::new(x.clone(), [tokens, h]), &device);
        let out = mlp.forward(input);
        let expected = testing::swiglu_mlp(&x, h, &gate, &up, &down);
        out.into_data().assert_approx_eq::<f32>(
            &TensorData::new(expected, [tokens, h]),
            Tolerance::rel_abs(1e-4, 1e-5),
        );
    }

    #[test]
    fn config_shapes_and_batched_input() {
        let device = Device::flex();
        let mlp = MlpConfig::new(8, 24).init(&device);
        assert_eq!(mlp.gate_proj.weight.dims(), [8, 24]);
        assert_eq!(mlp.up_proj.weight.dims(), [8, 24]);
        assert_eq!(mlp.down_proj.weight.dims(), [24, 8]);
        assert!(mlp.gate_proj.bias.is_none() && mlp.down_proj.bias.is_none());
        assert_eq!(mlp.num_params(), 3 * 8 * 24);

        // A [B, S, H] input gives the same rows as the flattened [B*S, H] input.
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let batched = mlp.forward(x.clone()).reshape([6, 8]);
        let flat = mlp.forward(x.reshape([6, 8]));
        batched
            .into_data()
            .assert_approx_eq::<f32>(&flat.into_data(), Tolerance::rel_abs(1e-6, 1e-6));
    }

    #[test]
    fn gradients_reach_every_projection() {
        let device = Device::flex().autodiff();
        let mlp = MlpConfig::new(4, 6).init(&device);
        let x = Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), &device);
        let grads = mlp.forward(x).sum().backward();
        for (name, linear) in [
            ("gate_proj", &mlp.gate_proj),
            ("up_proj", &mlp.up_proj),
            ("down_proj", &mlp.down_proj),
        ] {
            let g = linear.weight.grad(&grads);
            assert!(g.is_some(), "{name} has no gradient");
        }
    }
}
