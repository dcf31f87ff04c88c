//! Recompute against the recorded region: same outputs and gradients, bit for bit.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Device, Distribution, Tensor};

use super::*;

fn device() -> Device {
    Device::flex().autodiff()
}

/// A parameter-free region with a matmul, a softmax and an element-wise tail (the shape of
/// core attention).
fn core(x: Tensor<2>) -> Tensor<2> {
    let scores = x.clone().matmul(x.clone().transpose()).mul_scalar(0.25);
    softmax(scores, 1).matmul(silu(x))
}

#[derive(Module, Debug)]
struct Block {
    up: Linear,
    scale: Param<Tensor<1>>,
}

impl Block {
    fn new(device: &Device) -> Self {
        Self {
            up: LinearConfig::new(8, 8).init(device),
            scale: Param::from_tensor(Tensor::random([8], Distribution::Default, device)),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.up.forward(x.clone()) * self.scale.val().unsqueeze();
        x + silu(h)
    }
}

fn bits(t: Tensor<2>) -> Vec<u32> {
    t.into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn bits1(t: Tensor<1>) -> Vec<u32> {
    t.into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn a_recomputed_region_gives_the_recorded_gradients_bit_for_bit() {
    let device = device();
    let x0 = Tensor::<2>::random([6, 8], Distribution::Default, &device);
    let w = Tensor::<2>::random([8, 8], Distribution::Default, &device);
    let run = |recomputed: bool| {
        let x = x0.clone().require_grad();
        // The region's input is an intermediate (tracked, single consumer).
        let h = x.clone().matmul(w.clone());
        let y = if recomputed {
            recompute(h, core)
        } else {
            core(h)
        };
        let out = bits(y.clone());
        let grads = (y.clone() * y).sum().backward();
        (out, bits(x.grad(&grads).unwrap()))
    };
    let (y_ref, dx_ref) = run(false);
    let (y, dx) = run(true);
    assert_eq!(y, y_ref);
    assert_eq!(dx, dx_ref);
}

#[test]
fn a_recomputed_module_hands_its_parameter_gradients_over_bit_for_bit() {
    let device = device();
    let block = Block::new(&device);
    let x0 = Tensor::<2>::random([5, 8], Distribution::Default, &device);
    clear_param_grads();
    let run = |recomputed: bool| {
        let x = x0.clone().require_grad();
        let h = x.clone().mul_scalar(2.0);
        let y = if recomputed {
            recompute_module(&block, h, |b: &Block, h| b.forward(h))
        } else {
            block.forward(h)
        };
        let grads = y.powf_scalar(2.0).sum().backward();
        let dx = bits(x.grad(&grads).unwrap());
        let mut params = GradientsParams::from_grads(grads, &block);
        let sides = take_param_grads();
        assert_eq!(sides.len(), usize::from(recomputed));
        for side in sides {
            for (id, g) in [
                (
                    block.up.weight.id,
                    side.get::<2>(block.up.weight.id).map(bits),
                ),
                (block.scale.id, side.get::<1>(block.scale.id).map(bits1)),
            ] {
                assert!(g.is_some(), "{id:?} has no gradient from the region");
            }
            params = side;
        }
        let w = bits(params.get::<2>(block.up.weight.id).unwrap());
        let s = bits1(params.get::<1>(block.scale.id).unwrap());
        let b = bits1(params.get::<1>(block.up.bias.as_ref().unwrap().id).unwrap());
        (dx, w, s, b)
    };
    let reference = run(false);
    let recomputed = run(true);
    assert_eq!(recomputed, reference);
    assert!(take_param_grads().is_empty());
}

#[test]
fn an_untracked_input_just_runs_the_region() {
    let device = Device::flex();
    let x = Tensor::<2>::random([4, 8], Distribution::Default, &device);
    let y = recompute(x.clone(), core);
    assert_eq!(bits(y), bits(core(x)));
}
