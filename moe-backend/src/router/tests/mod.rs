//! Router-level acceptance properties (docs/routing-and-dispatch.md §Acceptance properties, items
//! 1–8, 10–13), checked against naive host references written here, never against values printed by
//! the code under test.

mod losses;
mod routing;

use burn::module::Param;
use burn::tensor::{Bool, Device, Tensor, TensorData};

use super::testing::f64_tensor;
use super::{RouteOptions, RouterOutput, RouterState, TopKRouter, TopKRouterConfig};

/// f64 router with gate weight `w [E, H]` (row-major host values).
fn router_f64(cfg: TopKRouterConfig, w: &[f64], device: &Device) -> TopKRouter {
    let (e, h) = (cfg.num_experts, cfg.hidden_size);
    let mut router = cfg
        .with_router_dtype(burn::tensor::FloatDType::F64)
        .init(device)
        .expect("valid config");
    router.weight = Param::from_tensor(f64_tensor(w, [e, h], device));
    router
}

/// Forward with default options and a fresh state.
fn route(router: &TopKRouter, x: &[f64], t: usize, device: &Device) -> RouterOutput {
    let state = router.init_state();
    let x = f64_tensor(x, [t, router.config().hidden_size], device);
    router
        .forward(x, &state, &RouteOptions::default())
        .expect("forward")
}

/// Forward with a given state and options.
fn route_with(
    router: &TopKRouter,
    x: Tensor<2>,
    state: &RouterState,
    options: &RouteOptions<'_>,
) -> RouterOutput {
    router.forward(x, state, options).expect("forward")
}

/// `[T]` padding mask from host flags (`true` = padded).
fn padding_mask(flags: &[bool], device: &Device) -> Tensor<1, Bool> {
    Tensor::from_data(TensorData::new(flags.to_vec(), [flags.len()]), device)
}

/// A router built around given parameters keeps them (no initialisation) and checks their
/// shapes and presence against the configuration.
#[test]
fn init_with_params_checks_shapes_and_presence() {
    let device = Device::flex();
    let cfg = TopKRouterConfig::new(3, 4, 2)
        .with_score_function(super::ScoreFunction::Sigmoid)
        .with_enable_expert_bias(true);
    let weight = || Param::from_tensor(Tensor::<2>::ones([4, 3], &device));
    let bias = |n: usize| Some(Param::from_tensor(Tensor::<1>::zeros([n], &device)));
    let router = cfg.init_with_params(weight(), None, bias(4)).unwrap();
    assert_eq!(
        router.weight.val().into_data(),
        Tensor::<2>::ones([4, 3], &device).into_data()
    );
    assert!(
        cfg.init_with_params(weight(), None, bias(3)).is_err(),
        "bias shape"
    );
    assert!(
        cfg.init_with_params(weight(), None, None).is_err(),
        "missing expert bias"
    );
    assert!(
        cfg.init_with_params(weight(), bias(4), bias(4)).is_err(),
        "unconfigured bias"
    );
    let wrong = Param::from_tensor(Tensor::<2>::ones([3, 4], &device));
    assert!(
        cfg.init_with_params(wrong, None, bias(4)).is_err(),
        "weight shape"
    );
}
