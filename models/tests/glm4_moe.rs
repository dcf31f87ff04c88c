//! GLM-4.5 MoE (`tests/fixtures/glm4_moe`, `make_family_fixtures.py`) against transformers
//! 5.23 and itself:
//!
//! - parity with the goldens: logits within 1e-4 of max|logit|, the CE loss, the routing of
//!   both MoE layers (router logits, top-k sets and weights), the MTP layer's logits, greedy
//!   decoding with the KV cache;
//! - training through the [`Trainer`] equal to the PyTorch reference (the transformers model
//!   and `torch.optim.AdamW`, 6 steps: per-step losses and gradient norms, the parameters
//!   after the last step);
//! - parallel training (MTP loss on) under tp / pp / ep·etp / cp layouts equal to `world=1`;
//! - a config contradicting the weights refused, naming the field.

mod common;

use burn::tensor::Device;
use common::{FixtureSource, Golden, family, fixtures, max_errors};
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_models::WeightSource;
use moe_models::causal_lm::{GenerationConfig, causal_lm_loss, generate, token_ids};
use moe_models::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm};
use moe_models::families::glm4_moe::{Glm4MoeConfig, Glm4MoeForCausalLM};
use moe_models::train::{StepStats, TrainBatch, Trainer, TrainerConfig};
use moe_models::weights::ModuleWeights;

fn load(device: &Device) -> Glm4MoeForCausalLM {
    let path = fixtures().join("glm4_moe");
    let config = Glm4MoeConfig::from_file(path.join("config.json")).expect("config");
    Glm4MoeForCausalLM::from_weights(&config, &FixtureSource::open(&path), device).expect("load")
}

fn tensor2(golden: &Golden, key: &str) -> (Vec<usize>, Vec<f32>) {
    golden.f32(key)
}

/// Rows of `(index, weight)` sorted by expert (HF's top-k is `sorted=False`).
fn sorted_rows(idx: &[i64], w: &[f32], k: usize) -> Vec<Vec<(i64, f32)>> {
    idx.chunks(k)
        .zip(w.chunks(k))
        .map(|(i, w)| {
            let mut row: Vec<(i64, f32)> = i.iter().copied().zip(w.iter().copied()).collect();
            row.sort_by_key(|p| p.0);
            row
        })
        .collect()
}

fn assert_within(what: &str, got: &[f32], want: &[f32]) {
    let (err, scale) = max_errors(got, want);
    println!(
        "glm4_moe {what}: max err {err:.3e}, max|golden| {scale:.4}, ratio {:.3e}",
        err / scale
    );
    assert!(
        err <= 1e-4 * scale,
        "{what}: max error {err} > 1e-4 · {scale}"
    );
}

#[test]
fn glm4_moe_matches_transformers() {
    let device = Device::flex();
    let model = load(&device);
    let config = model.config().clone();
    assert_eq!(config.partial_rotary_factor, 0.5);
    assert!(config.use_qk_norm && config.attention_bias);
    let golden = Golden::open("glm4_moe");
    let (shape, ids) = golden.i64("input_ids");
    let t = token_ids(&ids, [shape[0], shape[1]], config.vocab_size, &device).expect("ids");
    let out = model.forward(t.clone()).expect("forward");

    let (lshape, want) = golden.f32("logits");
    assert_eq!(out.logits.dims().to_vec(), lshape);
    let got = out.logits.clone().into_data().try_to_vec::<f32>().unwrap();
    assert_within("logits", &got, &want);

    let loss = causal_lm_loss(out.logits.clone(), &ids)
        .expect("loss")
        .into_scalar::<f32>();
    let (_, want_loss) = golden.f32("loss");
    let rel = (loss - want_loss[0]).abs() / want_loss[0];
    println!(
        "glm4_moe loss: ours {loss:.7}, golden {:.7}, rel {rel:.3e}",
        want_loss[0]
    );
    assert!(rel <= 1e-5, "loss {loss} vs {}", want_loss[0]);

    // Layers 1 and 2 are the MoE layers (first_k_dense_replace = 1).
    assert_eq!(out.routing.len(), 2);
    let k = config.num_experts_per_tok;
    for (routing, layer) in out.routing.iter().zip([1, 2]) {
        let (rshape, want) = tensor2(&golden, &format!("router_logits.{layer}"));
        assert_eq!(routing.router_logits.dims().to_vec(), rshape);
        let got = routing
            .router_logits
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_within(&format!("router logits {layer}"), &got, &want);
        let (_, want_idx) = golden.i64(&format!("topk_indices.{layer}"));
        let (_, want_w) = golden.f32(&format!("topk_weights.{layer}"));
        let got_idx = (routing.topk_indices.clone().into_data())
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap();
        let got_w = routing
            .topk_weights
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let (ours, theirs) = (
            sorted_rows(&got_idx, &got_w, k),
            sorted_rows(&want_idx, &want_w, k),
        );
        let mut max_w = 0f32;
        for (r, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let ia: Vec<i64> = a.iter().map(|p| p.0).collect();
            let ib: Vec<i64> = b.iter().map(|p| p.0).collect();
            assert_eq!(ia, ib, "layer {layer} row {r} selects different experts");
            for (x, y) in a.iter().zip(b) {
                max_w = max_w.max((x.1 - y.1).abs());
            }
        }
        println!("glm4_moe layer {layer}: top-k sets identical, max weight err {max_w:.3e}");
        assert!(
            max_w <= 1e-5,
            "layer {layer}: top-k weights differ by {max_w}"
        );
    }

    // The MTP layer (model.layers.3) on h⁰ = the main model's final-normed output.
    assert_eq!(model.mtp.len(), 1);
    let mtp = model.forward_mtp(t, out.hidden).expect("mtp");
    let (mshape, want) = golden.f32("mtp_logits");
    assert_eq!(mtp[0].dims().to_vec(), mshape);
    let got = mtp[0].clone().into_data().try_to_vec::<f32>().unwrap();
    assert_within("MTP logits", &got, &want);

    // Greedy decoding with the KV cache.
    let (_, prompt) = golden.i64("prompt_ids");
    let (_, want) = golden.i64("greedy_ids");
    let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let new = want.len() - prompt.len();
    let got = generate(&model, &prompt, &GenerationConfig::greedy(new), &device).expect("generate");
    let want: Vec<usize> = want[prompt.len()..].iter().map(|&t| t as usize).collect();
    assert_eq!(got, want, "greedy continuation differs from transformers");
}

fn ad() -> Device {
    Device::flex().autodiff()
}

#[test]
fn glm4_moe_training_matches_pytorch() {
    let golden = Golden::open("glm4_moe.train");
    let (shape, ids) = golden.i64("train_ids");
    let [steps, batch, seq] = [shape[0], shape[1], shape[2]];
    let (_, losses) = golden.f32("losses");
    let (_, grad_norms) = golden.f32("grad_norms");
    let start = replicate(&load(&ad()));
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let (ids, start, layout) = (&ids, &start, &layout);
    let mut out = World::run(1, |ctx| {
        let pg = ctx.process_groups(layout)?;
        let mut trainer = Trainer::new(
            start,
            &pg,
            ctx.world()?,
            family::reference_settings(),
            &ad(),
        )
        .map_err(family::be)?;
        let mut stats: Vec<StepStats> = Vec::new();
        for t in 0..steps {
            let at = t * batch * seq;
            let b = TrainBatch::causal(ids[at..at + batch * seq].to_vec(), batch)
                .map_err(family::be)?;
            stats.push(trainer.step(&b).map_err(family::be)?);
        }
        Ok((stats, trainer.model().model().clone()))
    });
    let (stats, trained) = out.remove(0).expect("world 1");
    for (t, s) in stats.iter().enumerate() {
        let rel = (s.loss - losses[t]).abs() / losses[t];
        let rel_norm = (s.grad_norm as f32 - grad_norms[t]).abs() / grad_norms[t];
        println!(
            "step {t}: loss {:.7} vs {:.7} (rel {rel:.2e}), grad norm {:.6} vs {:.6} (rel {rel_norm:.2e})",
            s.loss, losses[t], s.grad_norm, grad_norms[t]
        );
        assert!(rel <= 1e-4, "step {t}: loss {} vs {}", s.loss, losses[t]);
        assert!(
            rel_norm <= 1e-4,
            "step {t}: grad norm {} vs {}",
            s.grad_norm,
            grad_norms[t]
        );
    }
    // Every parameter of the main model after the last step (the golden holds the checkpoint
    // names of the directory but the MTP layer, which the reference leaves as loaded).
    let trained = ModuleWeights::new(&trained).expect("weights");
    let names: Vec<String> = golden
        .names()
        .into_iter()
        .filter(|n| n.starts_with("model.") || n.starts_with("lm_head."))
        .collect();
    assert!(names.len() > 90, "{} parameters", names.len());
    let (mut worst, mut worst_name) = (0f32, String::new());
    for name in &names {
        let (shape, want) = golden.f32(name);
        let (got_shape, got) = expert_or_tensor(&trained, name);
        assert_eq!(got_shape, shape, "{name}");
        let (err, scale) = max_errors(&got, &want);
        let rel = err / scale.max(1e-6);
        if rel > worst {
            (worst, worst_name) = (rel, name.clone());
        }
    }
    println!("final parameters: worst max|err| / max|param| = {worst:.3e} ({worst_name})");
    assert!(worst <= 1e-4, "{worst_name}: {worst}");
}

/// `name` from `weights`; a per-expert name (`….mlp.experts.{e}.{gate,up,down}_proj.weight`,
/// the fixture's layout) is cut from the stacked tensors the model holds (`gate_up_proj`
/// `[E, 2I, H]` with the gate rows first, `down_proj` `[E, H, I]`).
fn expert_or_tensor(weights: &ModuleWeights, name: &str) -> (Vec<usize>, Vec<f32>) {
    let Some((experts, rest)) = name.split_once(".mlp.experts.") else {
        return weights.tensor_f32(name).expect(name);
    };
    let (e, proj) = rest.split_once('.').expect("expert index");
    let e: usize = e.parse().expect("expert index");
    let stacked = |p: &str| {
        let full = format!("{experts}.mlp.experts.{p}");
        weights.tensor_f32(&full).expect(&full)
    };
    let (shape, values, rows) = match proj {
        "gate_proj.weight" | "up_proj.weight" => {
            let (shape, values) = stacked("gate_up_proj");
            let i = shape[1] / 2;
            let first = if proj.starts_with("gate") { 0 } else { i };
            (shape, values, first..first + i)
        }
        "down_proj.weight" => {
            let (shape, values) = stacked("down_proj");
            let h = shape[1];
            (shape, values, 0..h)
        }
        other => panic!("unexpected expert tensor {other}"),
    };
    let (per_expert, cols) = (shape[1] * shape[2], shape[2]);
    let out = rows
        .clone()
        .flat_map(|r| {
            let at = e * per_expert + r * cols;
            values[at..at + cols].to_vec()
        })
        .collect();
    (vec![rows.len(), cols], out)
}

/// Deterministic ids of sequence `i` of `step`.
fn sequence(step: usize, i: usize, seq: usize) -> Vec<i64> {
    moe_backend::testing::XorShift64::new(
        0x51_7cc1_b727_u64.wrapping_mul((step * 131 + i + 1) as u64),
    )
    .ids(seq, 256)
}

const STEPS: usize = 3;
const SEQ: usize = 8;
const MBS: usize = 2;

/// Replica `r`'s batch at `step` (of `MBS` sequences; one label masked).
fn replica_batch(step: usize, r: usize) -> TrainBatch {
    let ids: Vec<i64> = (0..MBS)
        .flat_map(|i| sequence(step, r * MBS + i, SEQ))
        .collect();
    let mut labels = ids.clone();
    labels[(step + r) % (MBS * SEQ)] = -100;
    TrainBatch::new(ids, labels, MBS).expect("batch")
}

/// Depth-1 MTP targets of `batch` (token `i + 2` of each row, not masked).
fn mtp_targets(batch: &TrainBatch) -> usize {
    (batch.labels.chunks(SEQ))
        .map(|row| row[2..].iter().filter(|&&t| t != -100).count())
        .sum()
}

/// The trainer's defaults (aux loss, z-loss, expert-bias updates, MTP loss 0.1) with
/// ε = 1e-3 (no amplification of reduction-order rounding) and a visible bias drift.
fn equivalence_config() -> TrainerConfig {
    TrainerConfig {
        lr: 1e-2,
        z_loss_coeff: 1e-3,
        expert_bias_update_rate: Some(1e-2),
        optimizer: moe_backend::optim::DistributedAdamWConfig {
            epsilon: 1e-3,
            ..TrainerConfig::default().optimizer
        },
        ..TrainerConfig::default()
    }
}

/// `(per-step stats, final model)` of the whole global batch (`replicas` batches) on one rank.
fn one_rank(start: &Glm4MoeForCausalLM, replicas: usize) -> (Vec<StepStats>, Glm4MoeForCausalLM) {
    let layout = ParallelLayout::parse(1, "").expect("layout");
    let mut out = World::run(1, |ctx| {
        let pg = ctx.process_groups(&layout)?;
        let mut trainer = Trainer::new(start, &pg, ctx.world()?, equivalence_config(), &ad())
            .map_err(family::be)?;
        let mut stats = Vec::new();
        for step in 0..STEPS {
            let micro: Vec<TrainBatch> = (0..replicas).map(|r| replica_batch(step, r)).collect();
            stats.push(trainer.step_micro_batches(&micro).map_err(family::be)?);
        }
        Ok((stats, trainer.model().model().clone()))
    });
    out.remove(0).expect("world 1")
}

/// Training with the MTP loss under tp, pp, ep·etp and cp layouts equals `world = 1`: losses,
/// MTP losses and gradient norms per step, and every rank's parameters and expert biases.
#[test]
fn glm4_moe_parallel_training_with_mtp_matches_one_rank() {
    let start = replicate(&load(&ad()));
    let layouts: [(usize, &str); 5] = [
        (2, "tp=2"),
        (4, "tp=2,ep=2,etp=2"),
        (3, "pp=3"),
        (4, "cp=2,ep=2"),
        (4, "ep=2"),
    ];
    let mut references: Vec<(usize, (Vec<StepStats>, Glm4MoeForCausalLM))> = Vec::new();
    for (world, spec) in layouts {
        let layout = ParallelLayout::parse(world, spec).expect("layout");
        let replicas = layout.dp;
        if !references.iter().any(|(r, _)| *r == replicas) {
            references.push((replicas, one_rank(&start, replicas)));
        }
        let (want_stats, want_model) = &references
            .iter()
            .find(|(r, _)| *r == replicas)
            .expect("reference")
            .1;
        assert!(
            want_stats.iter().all(|s| s.mtp_loss.is_some()),
            "MTP trains"
        );
        let (start, layout) = (&start, &layout);
        let results = World::run(world, |ctx| {
            let pg = ctx.process_groups(layout)?;
            let mut trainer = Trainer::new(start, &pg, ctx.world()?, equivalence_config(), &ad())
                .map_err(family::be)?;
            let replica = pg.groups.get(moe_backend::parallel::GroupFamily::Dp).index;
            let mut stats = Vec::new();
            for step in 0..STEPS {
                stats.push(
                    trainer
                        .step(&replica_batch(step, replica))
                        .map_err(family::be)?,
                );
            }
            let table = trainer.optimizer().table();
            let mine = table.flatten_values(trainer.model().model())?;
            let mut want_shard = want_model
                .shard(&pg, DispatcherKind::AllToAll)
                .map_err(family::be)?;
            let want = table.flatten_values(want_shard.model())?;
            let biases = |rs: Vec<&mut moe_backend::router::TopKRouter>| -> Vec<Vec<f32>> {
                rs.into_iter()
                    .filter_map(|r| r.expert_bias_values().expect("bias"))
                    .collect()
            };
            let want_bias = biases(want_shard.routers_mut());
            let (shard, _) = trainer.parts_mut();
            let bias = biases(shard.routers_mut());
            Ok((replica, stats, mine, want, bias, want_bias))
        });
        let mut per_step: Vec<Vec<(usize, StepStats)>> = vec![Vec::new(); STEPS];
        for (rank, res) in results.into_iter().enumerate() {
            let (replica, stats, mine, want, bias, want_bias) =
                res.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            family::close(
                &mine.0,
                &want.0,
                &format!("{spec} rank {rank} dense parameters"),
            );
            family::close(
                &mine.1,
                &want.1,
                &format!("{spec} rank {rank} expert parameters"),
            );
            assert_eq!(bias.len(), want_bias.len(), "{spec} rank {rank}: routers");
            for (b, w) in bias.iter().zip(&want_bias) {
                family::close(b, w, &format!("{spec} rank {rank} expert bias"));
            }
            for (step, s) in stats.into_iter().enumerate() {
                per_step[step].push((replica, s));
            }
        }
        for (step, ranks) in per_step.iter().enumerate() {
            let want = want_stats[step];
            let mut seen = vec![false; replicas];
            let (mut loss, mut mtp, mut tokens, mut mtp_tokens) = (0f64, 0f64, 0usize, 0usize);
            for (replica, s) in ranks {
                let rel = (s.grad_norm - want.grad_norm).abs() / want.grad_norm;
                assert!(
                    rel <= 1e-4,
                    "{spec} step {step}: grad norm {} vs {}",
                    s.grad_norm,
                    want.grad_norm
                );
                if !std::mem::replace(&mut seen[*replica], true) {
                    loss += f64::from(s.loss) * s.tokens as f64;
                    // The replica's MTP loss is its mean over its depth-1 targets.
                    let n = mtp_targets(&replica_batch(step, *replica));
                    mtp += f64::from(s.mtp_loss.unwrap_or(f32::NAN)) * n as f64;
                    mtp_tokens += n;
                    tokens += s.tokens;
                }
            }
            assert_eq!(tokens, want.tokens, "{spec} step {step}: tokens");
            let loss = loss / tokens as f64;
            let want_loss = f64::from(want.loss);
            assert!(
                (loss - want_loss).abs() <= 1e-5 * want_loss,
                "{spec} step {step}: loss {loss} vs {want_loss}"
            );
            let mtp = mtp / mtp_tokens as f64;
            let want_mtp = f64::from(want.mtp_loss.unwrap_or(f32::NAN));
            assert!(
                (mtp - want_mtp).abs() <= 1e-5 * want_mtp,
                "{spec} step {step}: MTP loss {mtp} vs {want_mtp}"
            );
        }
        println!("{spec}: equal to world=1 over {STEPS} steps");
    }
}

/// A config whose fields contradict the weights is refused by the HF loader's check of the
/// checkpoint against the config (before any model is built), naming the tensor; a config
/// contradicting itself by its parser, naming the field.
#[test]
fn glm4_moe_config_contradicting_the_weights_is_refused() {
    let device = Device::flex();
    let src = fixtures().join("glm4_moe");
    let dir = std::env::temp_dir().join(format!("glm4_moe_bad_{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).expect("copy");
    let text = std::fs::read_to_string(src.join("config.json")).expect("config");
    let original: serde_json::Value = serde_json::from_str(&text).expect("json");
    let refuse = |field: &str, value: serde_json::Value| -> String {
        let mut json = original.clone();
        json[field] = value;
        std::fs::write(dir.join("config.json"), json.to_string()).expect("write");
        match moe_models::load_causal_lm(&dir, &device) {
            Ok(_) => panic!("loaded a contradicting config"),
            Err(e) => e.to_string(),
        }
    };
    // Sanity: the unedited copy loads.
    std::fs::write(dir.join("config.json"), &text).expect("write");
    assert!(moe_models::load_causal_lm(&dir, &device).is_ok());
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("head_dim", 16.into(), "self_attn."),
        ("n_routed_experts", 4.into(), "mlp.gate"),
        ("first_k_dense_replace", 0.into(), "model.layers.0.mlp."),
        ("intermediate_size", 32.into(), "model.layers.0.mlp."),
        ("num_nextn_predict_layers", 2.into(), "model.layers.4"),
    ];
    for (field, value, names) in cases {
        let e = refuse(field, value);
        println!("{field}: {e}");
        assert!(e.contains(names), "{field}: {e}");
    }
    // Fields contradicting each other: refused by the parser, naming the field.
    let mut json = original.clone();
    json["num_key_value_heads"] = 3.into();
    let e = Glm4MoeConfig::from_json_str(&json.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
