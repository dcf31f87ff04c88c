//! One MoE layer on its own: train a small [`MoeLayer`] on the CPU (Flex backend, one rank) to
//! imitate a randomly initialised "teacher" MoE layer, with Adam, the switch load-balancing
//! loss and shared experts — the layer API without a model around it.
//!
//! Run: `cargo run --release --example moe_layer` (`RUST_LOG=debug` for per-step logs).

use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use burn_moe::backend::layer::{MoeLayer, MoeLayerConfig};
use burn_moe::backend::router::{AuxLossSpec, AuxLossType, RouteOptions, TopKRouterConfig};
use tracing::{debug, info};

const HIDDEN: usize = 64;
const EXPERTS: usize = 8;
const TOPK: usize = 2;
const FFN: usize = 128;
const TOKENS: usize = 256;
const STEPS: usize = 60;

fn layer_config(aux: bool) -> MoeLayerConfig {
    let mut router = TopKRouterConfig::new(HIDDEN, EXPERTS, TOPK);
    if aux {
        router = router.with_aux_losses(vec![AuxLossSpec {
            kind: AuxLossType::Aux,
            coeff: 1e-2,
        }]);
    }
    MoeLayerConfig::new(router, FFN)
        .with_shared_ffn_hidden_size(Some(FFN))
        .with_init_std(0.1)
}

/// Reuse the large buffers every training step frees (see `moe_backend::alloc`).
#[global_allocator]
static ALLOC: burn_moe::backend::alloc::LargeBlockCache =
    burn_moe::backend::alloc::LargeBlockCache::new(16 << 20, 4 << 30);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    burn_moe::init_logging();
    let device = Device::flex().autodiff();
    let teacher = layer_config(false).init(&device)?;
    let mut student: MoeLayer = layer_config(true).init(&device)?;
    let mut optim = AdamConfig::new().init();
    let opts = RouteOptions::default();
    info!(
        hidden = HIDDEN,
        experts = EXPERTS,
        topk = TOPK,
        ffn = FFN,
        tokens = TOKENS,
        "training student MoE layer"
    );
    let mut first = None;
    let mut last = 0.0f64;
    for step in 0..STEPS {
        let x = Tensor::<2>::random([TOKENS, HIDDEN], Distribution::Normal(0.0, 1.0), &device);
        let target = teacher
            .forward(x.clone(), &teacher.router.init_state(), &opts)?
            .output
            .detach();
        let state = student.router.init_state();
        let out = student.forward(x, &state, &opts)?;
        let loss = (out.output - target).powf_scalar(2.0).mean();
        let value = loss.clone().into_scalar::<f32>() as f64;
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optim.step(3e-3, student, grads);
        let aux = out
            .routing
            .losses
            .first()
            .map(|l| l.value())
            .transpose()?
            .unwrap_or(0.0);
        debug!(step, loss = value, aux, tokens_per_expert = ?out.routing.tokens_per_expert, "step");
        if step % 10 == 0 || step + 1 == STEPS {
            info!(step, loss = value, aux, tokens_per_expert = ?out.routing.tokens_per_expert, "progress");
        }
        first.get_or_insert(value);
        last = value;
    }
    let first = first.unwrap_or(last);
    info!(
        first_loss = first,
        final_loss = last,
        reduction = first / last.max(f64::MIN_POSITIVE),
        "done"
    );
    Ok(())
}
