//! Activation memory of Megatron-style recompute (selective: `core_attn`, `moe_act`,
//! `shared_experts`, `mlp`; and `full`): the bytes a training forward leaves allocated for its backward
//! pass, and the peak of forward + backward, counted by a global allocator, for each mode,
//! next to what the planner (`moe plan`'s activation model, `stage_activations`) predicts for
//! the same model, tokens and options.
//!
//! Models (random weights, f32, one rank): a Qwen3-MoE of 2 layers (layer 0 dense through
//! `mlp_only_layers`), hidden 512, GQA 8/4 heads of 64, 16 experts top-4 of width 256, and
//! a DeepSeek-V3 of 2 layers (layer 0 dense), MLA (q_lora 128, kv_lora 128, 8 heads, nope
//! 32, rope 16, v 32), 16 routed experts top-4 of width 256 and one shared expert; vocabulary
//! 4096; a batch of 2 × 512 tokens.
//!
//! Run: `cargo bench --bench recompute_memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::Device;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{CausalLmShard, ParallelCausalLm};
use moe_models::families::Family;
use moe_models::plan::activations::{ActivationOptions, Recompute, stage_activations};
use moe_models::plan::shape::ModelShape;
use moe_models::train::{Trainer, TrainerConfig};
use moe_models::{DeepseekV3Config, Qwen3MoeConfig};

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded to the system allocator with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let grow = new_size - layout.size();
                let now = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const SEQ: usize = 512;
const BATCH: usize = 2;
const VOCAB: usize = 4096;

fn qwen3_moe() -> Qwen3MoeConfig {
    Qwen3MoeConfig {
        vocab_size: VOCAB,
        hidden_size: 512,
        intermediate_size: 1024,
        moe_intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: 64,
        num_experts: 16,
        num_experts_per_tok: 4,
        norm_topk_prob: true,
        mlp_only_layers: vec![0],
        ..Qwen3MoeConfig::default()
    }
}

fn deepseek_v3() -> DeepseekV3Config {
    DeepseekV3Config {
        vocab_size: VOCAB,
        hidden_size: 512,
        intermediate_size: 1024,
        moe_intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 8,
        n_shared_experts: 1,
        n_routed_experts: 16,
        num_experts_per_tok: 4,
        n_group: 1,
        topk_group: 1,
        q_lora_rank: Some(128),
        kv_lora_rank: 128,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 16,
        v_head_dim: 32,
        first_k_dense_replace: 1,
        num_nextn_predict_layers: 0,
        ..DeepseekV3Config::default()
    }
}

/// `(held after the forward, peak of forward + backward)` in bytes above the baseline.
fn measure<M: ParallelCausalLm + Sync>(model: &M, recompute: &Recompute) -> (usize, usize) {
    let device = Device::flex().autodiff();
    let ids: Vec<i64> = (0..BATCH * SEQ)
        .map(|i| ((i * 7919 + 13) % VOCAB) as i64)
        .collect();
    let config = TrainerConfig {
        recompute: recompute.clone(),
        ..TrainerConfig::default()
    };
    let out = World::run(1, |ctx| {
        let groups = ctx.process_groups(&ParallelLayout::single())?;
        let mut trainer =
            Trainer::new(model, &groups, ctx.world()?, config.clone(), &device).expect("trainer");
        let (shard, _) = trainer.parts_mut();
        let run = || {
            let base = LIVE.load(Ordering::Relaxed);
            PEAK.store(base, Ordering::Relaxed);
            let out = shard
                .forward_train(&ids, &ids, BATCH, &device, 1.0, false)
                .expect("forward");
            let held = LIVE.load(Ordering::Relaxed) - base;
            let grads = out.loss.backward();
            let params = moe_backend::recompute::take_param_grads();
            let peak = PEAK.load(Ordering::Relaxed) - base;
            drop((grads, params, out));
            (held, peak)
        };
        run(); // warm-up: lazily built tables, thread pools
        Ok::<_, moe_backend::BackendError>(run())
    });
    out.into_iter().next().expect("rank").expect("run")
}

/// The planner's activation bytes of the one-stage model for one micro-batch (decoder
/// layers, embedding and head; with `full`, the layer inputs plus one recomputed layer), f32
/// activations as the measured models.
fn planned(shape: &ModelShape, recompute: &Recompute) -> f64 {
    let opts = ActivationOptions {
        seq: SEQ,
        micro_batch: BATCH,
        act_bytes: 4,
        recompute: recompute.clone(),
        ..ActivationOptions::default()
    };
    stage_activations(shape, &ParallelLayout::single(), &opts, 0).total()
}

fn report<M: ParallelCausalLm + Sync>(name: &str, model: &M, shape: &ModelShape) {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let modes = [
        "none",
        "core_attn",
        "moe_act",
        "shared_experts",
        "mlp",
        "core_attn,moe_act,shared_experts,mlp",
        "full",
    ];
    println!("\n{name}: {BATCH} x {SEQ} tokens, f32");
    println!(
        "| recompute | held after forward (MiB) | saving | peak fwd+bwd (MiB) | planner stage (MiB) | planner saving |"
    );
    println!("|---|---|---|---|---|---|");
    let none = Recompute::None;
    let (held0, _) = measure(model, &none);
    let plan0 = planned(shape, &none);
    for mode in modes {
        let recompute: Recompute = mode.parse().expect("mode");
        let (held, peak) = measure(model, &recompute);
        let plan = planned(shape, &recompute);
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            mib(held as f64),
            mib(held0 as f64 - held as f64),
            mib(peak as f64),
            mib(plan),
            mib(plan0 - plan)
        );
    }
}

fn main() {
    let device = Device::flex().autodiff();
    let q = qwen3_moe();
    let model = q.init(&device).expect("qwen3-moe");
    let shape = <moe_models::qwen3_moe::Qwen3Moe as Family>::model_shape(&q).expect("shape");
    report("Qwen3-MoE", &model, &shape);
    let d = deepseek_v3();
    let model = d.init(&device).expect("deepseek-v3");
    let shape = <moe_models::deepseek_v3::DeepseekV3 as Family>::model_shape(&d).expect("shape");
    report("DeepSeek-V3", &model, &shape);
}
