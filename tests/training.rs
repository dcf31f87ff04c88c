//! Cross-crate: the facade's MoE layer trains end to end with Burn's Adam (gradients reach the
//! router, the grouped experts and the shared experts, and the loss falls).

use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use burn_moe::backend::layer::MoeLayerConfig;
use burn_moe::backend::router::{AuxLossSpec, AuxLossType, RouteOptions, TopKRouterConfig};

#[test]
fn moe_layer_learns_a_teacher_layer() {
    let device = Device::flex().autodiff();
    let cfg = |aux: f64| {
        let router = TopKRouterConfig::new(16, 4, 2).with_aux_losses(vec![AuxLossSpec {
            kind: AuxLossType::Aux,
            coeff: aux,
        }]);
        MoeLayerConfig::new(router, 32)
            .with_shared_ffn_hidden_size(Some(16))
            .with_init_std(0.2)
    };
    let teacher = cfg(0.0).init(&device).expect("teacher");
    let mut student = cfg(1e-2).init(&device).expect("student");
    let params_before = student.num_params();
    let opts = RouteOptions::default();
    let x = Tensor::<2>::random([64, 16], Distribution::Normal(0.0, 1.0), &device);
    let target = teacher
        .forward(x.clone(), &teacher.router.init_state(), &opts)
        .expect("teacher")
        .output
        .detach();
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::new();
    for _ in 0..40 {
        let out = student
            .forward(x.clone(), &student.router.init_state(), &opts)
            .expect("forward");
        let loss = (out.output - target.clone()).powf_scalar(2.0).mean();
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = loss.backward();
        assert!(
            student.router.weight.grad(&grads).is_some(),
            "router weight gets a gradient"
        );
        assert!(
            student.experts.fc1.grad(&grads).is_some(),
            "fc1 gets a gradient"
        );
        let shared = student.shared_experts.as_ref().expect("shared");
        assert!(
            shared.down_proj.weight.grad(&grads).is_some(),
            "shared expert gets a gradient"
        );
        let grads = GradientsParams::from_grads(grads, &student);
        student = optim.step(1e-2, student, grads);
    }
    assert_eq!(student.num_params(), params_before);
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(
        last < 0.5 * first,
        "loss should at least halve: {first} -> {last}"
    );
}
