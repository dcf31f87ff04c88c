//! Generation with a KV cache under a parallel layout (issue 15): every rank of
//! `world=4, tp=2, ep=4` runs the same batched rollout loop on its shard (heads, vocabulary and
//! experts split, KV cache of its heads) and produces the tokens and log-probs of the
//! single-rank model, greedy and sampled: Qwen3-MoE, DeepSeek-V3 (MLA latents cached) and
//! dense Qwen3.

mod common;

use burn::tensor::Device;
use common::{FixtureSource, fixtures};
use moe_backend::BackendError;
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::rollout::{Rollout, RolloutModel, SamplingConfig, generate_batch};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, ModelError, Qwen3Config, Qwen3ForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
};

fn be(e: ModelError) -> BackendError {
    BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

fn check(reference: &[Rollout], got: &[Rollout], what: &str) {
    assert_eq!(reference.len(), got.len(), "{what}");
    for (i, (r, g)) in reference.iter().zip(got).enumerate() {
        assert_eq!(r.tokens, g.tokens, "{what}: prompt {i} tokens");
        for (a, b) in r.logprobs.iter().zip(&g.logprobs) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{what}: prompt {i} log-prob {a} vs {b}"
            );
        }
    }
}

/// Greedy and sampled rollouts of `full` at world 1 against every rank's shard under
/// `layouts`.
fn check_generation<M, S>(
    full: &M,
    layouts: &[(usize, &str)],
    shard: impl Fn(&M, &moe_backend::comm::GroupComms) -> Result<S, ModelError> + Sync,
) where
    M: RolloutModel + Sync,
    S: RolloutModel,
{
    let prompts = vec![vec![3, 17, 42, 5, 9], vec![8, 1, 77, 200, 31]];
    let greedy = SamplingConfig::greedy(6);
    let sampled = SamplingConfig {
        temperature: 0.8,
        top_k: Some(20),
        seed: 7,
        ..SamplingConfig::greedy(6)
    };
    let want_greedy = generate_batch(full, &prompts, &greedy).expect("greedy");
    let want_sampled = generate_batch(full, &prompts, &sampled).expect("sampled");
    for r in want_greedy.iter().chain(&want_sampled) {
        assert_eq!((r.tokens.len(), r.logprobs.len()), (6, 6));
    }
    assert_ne!(
        want_greedy[0].tokens, want_sampled[0].tokens,
        "sampling changes tokens"
    );
    for &(world, spec) in layouts {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let results = World::run(world, |ctx| {
            let groups = ctx.process_groups(&layout)?;
            let shard = shard(full, &groups).map_err(be)?;
            let g = generate_batch(&shard, &prompts, &greedy).map_err(be)?;
            let s = generate_batch(&shard, &prompts, &sampled).map_err(be)?;
            Ok((g, s))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (g, s) = r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            check(&want_greedy, &g, &format!("{spec} rank {rank} greedy"));
            check(&want_sampled, &s, &format!("{spec} rank {rank} sampled"));
        }
    }
}

#[test]
fn qwen3_moe_generation_under_tp_and_ep_equals_one_rank() {
    let dir = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    let full = Qwen3MoeForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &dev())
        .expect("load");
    check_generation(
        &full,
        &[(4, "tp=2,ep=4"), (2, "ep=2"), (4, "tp=2,ep=2,etp=2")],
        |m, g| Sharded::<Qwen3MoeForCausalLM>::shard(m, g, DispatcherKind::AllToAll),
    );
}

#[test]
fn deepseek_v3_generation_under_tp_and_ep_equals_one_rank() {
    let dir = fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(dir.join("config.json")).expect("config");
    let full = DeepseekV3ForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &dev())
        .expect("load");
    check_generation(
        &full,
        &[(4, "tp=2,ep=4"), (4, "tp=2,ep=2,etp=2")],
        |m, g| Sharded::<DeepseekV3ForCausalLM>::shard(m, g, DispatcherKind::AllToAll),
    );
}

#[test]
fn qwen3_generation_under_tp_equals_one_rank() {
    let dir = fixtures().join("qwen3");
    let config = Qwen3Config::from_file(dir.join("config.json")).expect("config");
    let full =
        Qwen3ForCausalLM::from_weights(&config, &FixtureSource::open(&dir), &dev()).expect("load");
    check_generation(&full, &[(2, "tp=2"), (4, "tp=2")], |m, g| {
        Sharded::<Qwen3ForCausalLM>::shard(m, g, DispatcherKind::AllToAll)
    });
}

fn dev() -> Device {
    Device::flex()
}

/// A batch that does not split over TP's sequence parallelism is refused, naming `tp`.
#[test]
fn an_odd_batch_under_tp_is_refused() {
    let dir = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(dir.join("config.json")).expect("config");
    let full = config.init(&Device::flex()).expect("init");
    let layout = ParallelLayout::parse(2, "tp=2").expect("layout");
    let results = World::run(2, |ctx| {
        let groups = ctx.process_groups(&layout)?;
        let shard = Sharded::<Qwen3MoeForCausalLM>::shard(&full, &groups, DispatcherKind::AllToAll)
            .map_err(be)?;
        let err = generate_batch(&shard, &[vec![1, 2, 3]], &SamplingConfig::greedy(2))
            .err()
            .map(|e| e.to_string());
        Ok(err)
    });
    for r in results {
        let err = r.expect("rank").expect("an error");
        assert!(err.contains("tp"), "{err}");
    }
}
