//! Per-token next-token log-probs and entropy (issue 19): the vocab-parallel computation of a
//! sharded Qwen3-MoE under folded layouts equals the single-rank `log_softmax` one (values and
//! gradients), the single-rank one equals `log_softmax` of the transformers goldens, and the
//! vocab-parallel primitive equals `log_softmax` on random logits for every TP size.

mod common;

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{FixtureSource, Golden, fixtures};
use moe_backend::comm::World;
use moe_backend::parallel::{ParallelLayout, replicate};
use moe_backend::testing::XorShift64;
use moe_models::distributed::logprobs::vocab_parallel_logprobs;
use moe_models::distributed::{DispatcherKind, Sharded};
use moe_models::rl::logprobs::{model_logprobs, model_logprobs_detached};
use moe_models::{ModelError, Qwen3MoeConfig, Qwen3MoeForCausalLM};

const B: usize = 4;
const S: usize = 12;

fn ad() -> Device {
    Device::flex().autodiff()
}

/// The committed qwen3_moe fixture (transformers weights), every parameter requiring grad.
fn fixture_model(device: &Device) -> Qwen3MoeForCausalLM {
    let path = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(path.join("config.json")).expect("config");
    Qwen3MoeForCausalLM::from_weights(&config, &FixtureSource::open(&path), device)
        .expect("load")
        .set_require_grad(true)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

/// `max |a − b|` and `max |b|`.
fn max_err(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "lengths");
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (err, b.iter().map(|v| v.abs()).fold(0f32, f32::max))
}

/// Asserts `max|a − b| ≤ rtol · max|b|` and returns the measured ratio.
fn assert_rel(a: &[f32], b: &[f32], rtol: f32, what: &str) -> f32 {
    let (err, scale) = max_err(a, b);
    let ratio = err / scale.max(1e-12);
    assert!(
        err <= rtol * scale.max(1e-12),
        "{what}: max error {err:.3e} > {rtol:.0e} · max|value| {scale:.4e}"
    );
    ratio
}

/// Columns `cols` of the rows of a row-major `[_, width]` matrix.
fn columns(v: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    v.chunks(width)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

/// `B × S` ids: the golden's two rows, then two pseudo-random rows; labels are the ids with a
/// masked prompt (row 0, first 4 tokens), a masked middle token (row 2) and a masked last
/// token (row 3).
fn batch(vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let (shape, mut ids) = Golden::open("qwen3_moe").i64("input_ids");
    assert_eq!(shape, vec![2, S]);
    ids.extend(XorShift64::new(0x2545_f491_4f6c_dd1d).ids((B - 2) * S, vocab));
    let mut labels = ids.clone();
    for at in [0, 1, 2, 3, 2 * S + 7, 4 * S - 1] {
        labels[at] = -100;
    }
    (ids, labels)
}

/// Single-rank values and gradients of one replica's rows.
struct Reference {
    logprobs: Vec<f32>,
    entropy: Vec<f32>,
    /// ∂ Σ logprobs / ∂ lm_head `[H, V]`.
    head: Vec<f32>,
    /// ∂ Σ logprobs / ∂ embed_tokens `[V, H]`.
    embed: Vec<f32>,
    /// ∂ Σ entropy / ∂ lm_head `[H, V]`.
    head_entropy: Vec<f32>,
}

fn reference(full: &Qwen3MoeForCausalLM, ids: &[i64], labels: &[i64], rows: usize) -> Reference {
    let model = replicate(full);
    let out = model_logprobs(&model, ids, labels, rows, &ad()).expect("logprobs");
    let (logprobs, entropy) = (values(out.logprobs.clone()), values(out.entropy.clone()));
    let g = out.logprobs.sum().backward();
    let head_w = model.lm_head.as_ref().expect("untied head").weight.val();
    let head = values(head_w.grad(&g).expect("head grad"));
    let embed = values(
        model
            .model
            .embed_tokens
            .as_ref()
            .unwrap()
            .weight
            .val()
            .grad(&g)
            .expect("embed grad"),
    );
    let model = replicate(full);
    let out = model_logprobs(&model, ids, labels, rows, &ad()).expect("logprobs");
    let g = out.entropy.sum().backward();
    let head_w = model.lm_head.as_ref().expect("untied head").weight.val();
    let head_entropy = values(head_w.grad(&g).expect("head grad"));
    Reference {
        logprobs,
        entropy,
        head,
        embed,
        head_entropy,
    }
}

/// One rank's results.
struct RankOut {
    replica: usize,
    vocab: std::ops::Range<usize>,
    logprobs: Vec<f32>,
    entropy: Vec<f32>,
    detached: (Vec<f32>, Vec<f32>),
    head: Vec<f32>,
    embed: Vec<f32>,
    head_entropy: Vec<f32>,
}

fn to_backend(e: ModelError) -> moe_backend::BackendError {
    moe_backend::BackendError::Config {
        field: "model",
        detail: e.to_string(),
    }
}

fn run_layout(
    spec: &str,
    full: &Qwen3MoeForCausalLM,
    ids: &[i64],
    labels: &[i64],
) -> (ParallelLayout, Vec<RankOut>) {
    let layout = ParallelLayout::parse_spec(spec).expect("layout");
    let replicas = layout.dp * layout.cp;
    let rows = B / replicas;
    let layout_ref = &layout;
    let results = World::run(layout.world, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let par = Sharded::<Qwen3MoeForCausalLM>::shard(full, &pg, DispatcherKind::AllToAll)
            .map_err(to_backend)?;
        let r = par.replica;
        let my_ids = &ids[r * rows * S..(r + 1) * rows * S];
        let my_labels = &labels[r * rows * S..(r + 1) * rows * S];
        let out = par
            .forward_logprobs(my_ids, my_labels, rows, &ad())
            .map_err(to_backend)?;
        let (logprobs, entropy) = (values(out.logprobs.clone()), values(out.entropy.clone()));
        let g = out.logprobs.sum().backward();
        let head_w = par.model.lm_head.as_ref().expect("head").weight.val();
        let head = values(head_w.grad(&g).expect("head grad"));
        let embed_w = par.model.model.embed_tokens.as_ref().unwrap().weight.val();
        let embed = values(embed_w.grad(&g).expect("embed grad"));
        let out = par
            .forward_logprobs(my_ids, my_labels, rows, &ad())
            .map_err(to_backend)?;
        let g = out.entropy.sum().backward();
        let head_entropy = values(head_w.grad(&g).expect("head grad"));
        let det = par
            .forward_logprobs_detached(my_ids, my_labels, rows)
            .map_err(to_backend)?;
        assert!(
            !det.logprobs.is_autodiff() && !det.entropy.is_autodiff(),
            "detached results must not use autodiff"
        );
        let (vl, tp_rank) = (embed_w.dims()[0], pg.groups.tp_rank());
        Ok(RankOut {
            replica: r,
            vocab: vl * tp_rank..vl * (tp_rank + 1),
            logprobs,
            entropy,
            detached: (values(det.logprobs), values(det.entropy)),
            head,
            embed,
            head_entropy,
        })
    });
    let outs = results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}")))
        .collect();
    (layout, outs)
}

#[test]
fn sharded_logprobs_and_entropy_equal_one_rank_under_folded_layouts() {
    let full = fixture_model(&ad());
    let vocab = full.config().vocab_size;
    let hidden = full.config().hidden_size;
    let (ids, labels) = batch(vocab);
    // "" is the parallel code path on one rank.
    for spec in ["", "world=4,tp=2,ep=4", "ep=2", "tp=2,ep=2,etp=2"] {
        let (layout, outs) = run_layout(spec, &full, &ids, &labels);
        let replicas = layout.dp * layout.cp;
        let rows = B / replicas;
        let refs: Vec<Reference> = (0..replicas)
            .map(|r| {
                let span = r * rows * S..(r + 1) * rows * S;
                reference(&full, &ids[span.clone()], &labels[span], rows)
            })
            .collect();
        // The gathered log-probs / entropies of every replica against the whole batch's.
        let mut gathered = (vec![0f32; B * (S - 1)], vec![0f32; B * (S - 1)]);
        let mut worst = [0f32; 6];
        for (rank, out) in outs.iter().enumerate() {
            let what = |s: &str| format!("{spec} rank {rank}: {s}");
            let want = &refs[out.replica];
            let span = out.replica * rows * (S - 1)..(out.replica + 1) * rows * (S - 1);
            gathered.0[span.clone()].copy_from_slice(&out.logprobs);
            gathered.1[span].copy_from_slice(&out.entropy);
            // Forward-only kernels may round differently from the autodiff ones.
            assert_rel(
                &out.detached.0,
                &out.logprobs,
                1e-6,
                &what("detached logprobs"),
            );
            assert_rel(
                &out.detached.1,
                &out.entropy,
                1e-6,
                &what("detached entropy"),
            );
            let cols = out.vocab.clone();
            let checks = [
                (&out.head, columns(&want.head, vocab, cols.clone()), 1e-5),
                (
                    &out.embed,
                    want.embed[cols.start * hidden..cols.end * hidden].to_vec(),
                    1e-5,
                ),
                (
                    &out.head_entropy,
                    columns(&want.head_entropy, vocab, cols),
                    1e-5,
                ),
            ];
            for (i, ((got, exp, tol), name)) in checks
                .into_iter()
                .zip([
                    "d Σlogprobs / d lm_head",
                    "d Σlogprobs / d embed",
                    "d Σentropy / d lm_head",
                ])
                .enumerate()
            {
                worst[2 + i] = worst[2 + i].max(assert_rel(got, &exp, tol, &what(name)));
            }
        }
        let want_lp: Vec<f32> = refs.iter().flat_map(|r| r.logprobs.clone()).collect();
        let want_h: Vec<f32> = refs.iter().flat_map(|r| r.entropy.clone()).collect();
        worst[0] = assert_rel(&gathered.0, &want_lp, 1e-5, &format!("{spec}: logprobs"));
        worst[1] = assert_rel(&gathered.1, &want_h, 1e-5, &format!("{spec}: entropy"));
        // Masked targets give 0 (row 0 positions 0..3 score labels 1..4, three are −100).
        for t in 0..3 {
            assert_eq!(gathered.0[t], 0.0, "{spec}: masked logprob at {t}");
            assert_eq!(gathered.1[t], 0.0, "{spec}: masked entropy at {t}");
        }
        println!(
            "layout {spec:?}: max err / max|value|: logprobs {:.2e}, entropy {:.2e}, \
             dΣlp/dhead {:.2e}, dΣlp/dembed {:.2e}, dΣH/dhead {:.2e}",
            worst[0], worst[1], worst[2], worst[3], worst[4]
        );
    }
}

#[test]
fn single_rank_logprobs_equal_log_softmax_of_the_transformers_goldens() {
    let device = Device::flex();
    let model = fixture_model(&device);
    let golden = Golden::open("qwen3_moe");
    let (_, ids) = golden.i64("input_ids");
    let (shape, logits) = golden.f32("logits");
    let (b, s, v) = (shape[0], shape[1], shape[2]);
    let out = model_logprobs(&model, &ids, &ids, b, &device).expect("logprobs");
    assert_eq!(out.logprobs.dims(), [b, s - 1]);
    let (lp, ent) = (values(out.logprobs), values(out.entropy));
    // log_softmax of the golden logits, in f64.
    let (mut want_lp, mut want_h) = (Vec::new(), Vec::new());
    for row in 0..b {
        for t in 0..s - 1 {
            let l = &logits[(row * s + t) * v..(row * s + t + 1) * v];
            let max = l.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let target = ids[row * s + t + 1] as usize;
            want_lp.push((l[target] as f64 - lse) as f32);
            want_h.push(
                -l.iter()
                    .map(|&x| {
                        let lp = x as f64 - lse;
                        lp.exp() * lp
                    })
                    .sum::<f64>() as f32,
            );
        }
    }
    let scale = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (e_lp, _) = max_err(&lp, &want_lp);
    let (e_h, _) = max_err(&ent, &want_h);
    println!(
        "golden: max|logprob err| {e_lp:.3e}, max|entropy err| {e_h:.3e}, max|logit| {scale:.4}"
    );
    assert!(e_lp <= 1e-4 * scale, "logprobs: {e_lp} > 1e-4 · {scale}");
    assert!(e_h <= 1e-4 * scale, "entropy: {e_h} > 1e-4 · {scale}");

    // Forward-only mode gives the same values as plain tensors.
    let det = model_logprobs_detached(&model, &ids, &ids, b).expect("detached");
    assert!(!det.logprobs.is_autodiff());
    assert_eq!(values(det.logprobs), lp);

    // Masking, and clear errors.
    let mut labels = ids.clone();
    labels[5] = -100;
    let masked = model_logprobs(&model, &ids, &labels, b, &device).expect("masked");
    let masked = values(masked.logprobs);
    assert_eq!(masked[4], 0.0);
    assert_eq!(masked[3], lp[3]);
    labels[5] = v as i64;
    let err = model_logprobs(&model, &ids, &labels, b, &device).unwrap_err();
    assert!(err.to_string().contains("labels"), "{err}");
    let err = model_logprobs(&model, &ids[..b], &ids[..b], b, &device).unwrap_err();
    assert!(err.to_string().contains("at least 2 tokens"), "{err}");
}

/// `vocab_parallel_logprobs` on random logits against `log_softmax` (values, and the gradient
/// of `Σ logprobs + 0.3 · Σ entropy` w.r.t. the logits), for tp = 1, 2, 4.
#[test]
fn vocab_parallel_primitive_equals_log_softmax_with_gradients() {
    let (n, v) = (6, 16);
    let mut rng = XorShift64::new(0x9e37_79b9_7f4a_7c15);
    let logits: Vec<f32> = (0..n * v)
        .map(|_| rng.below(10_000) as f32 / 1000.0 - 5.0)
        .collect();
    let mut targets = rng.ids(n, v);
    targets[2] = -100;
    // Reference on one rank.
    let l = Tensor::<2>::from_data(TensorData::new(logits.clone(), [n, v]), &ad()).require_grad();
    let logp = log_softmax(l.clone(), 1);
    let idx: Vec<i32> = targets.iter().map(|&t| t.max(0) as i32).collect();
    let keep: Vec<f32> = targets.iter().map(|&t| (t >= 0) as u8 as f32).collect();
    let keep = Tensor::<2>::from_data(TensorData::new(keep, [n, 1]), &ad());
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [n, 1]), &ad());
    let lp = logp.clone().gather(1, idx) * keep.clone();
    let h = (logp.clone().exp() * logp).sum_dim(1).neg() * keep;
    let (want_lp, want_h) = (values(lp.clone()), values(h.clone()));
    let g = (lp.sum() + h.sum().mul_scalar(0.3)).backward();
    let want_grad = values(l.grad(&g).expect("grad"));
    let (lr, tr) = (&logits, &targets);
    for tp in [1, 2, 4] {
        let outs = World::run(tp, |ctx| {
            let comm = ctx.world()?;
            let part = v / tp;
            let cols = ctx.rank() * part..(ctx.rank() + 1) * part;
            let local = Tensor::<2>::from_data(
                TensorData::new(columns(lr, v, cols.clone()), [n, part]),
                &ad(),
            )
            .require_grad();
            let (lp, h) = vocab_parallel_logprobs(local.clone(), tr, cols.clone(), &comm)
                .map_err(to_backend)?;
            let (vlp, vh) = (values(lp.clone()), values(h.clone()));
            let g = (lp.sum() + h.sum().mul_scalar(0.3)).backward();
            Ok((cols, vlp, vh, values(local.grad(&g).expect("grad"))))
        });
        for (rank, out) in outs.into_iter().enumerate() {
            let (cols, lp, h, grad) = out.unwrap_or_else(|e| panic!("tp {tp} rank {rank}: {e}"));
            let what = format!("tp {tp} rank {rank}");
            let e_lp = assert_rel(&lp, &want_lp, 1e-6, &format!("{what}: logprobs"));
            let e_h = assert_rel(&h, &want_h, 1e-6, &format!("{what}: entropy"));
            let e_g = assert_rel(
                &grad,
                &columns(&want_grad, v, cols),
                1e-5,
                &format!("{what}: gradient"),
            );
            println!(
                "{what}: max err / max|value|: logprobs {e_lp:.2e}, entropy {e_h:.2e}, \
                 d(Σlp + 0.3ΣH)/dlogits {e_g:.2e}"
            );
            assert_eq!((lp[2], h[2]), (0.0, 0.0), "{what}: ignored row");
        }
    }
    // A target outside the vocabulary is an error.
    let err = World::run(2, |ctx| {
        let comm = ctx.world()?;
        let local = Tensor::<2>::zeros([1, 4], &Device::flex());
        Ok(
            vocab_parallel_logprobs(local, &[8], ctx.rank() * 4..(ctx.rank() + 1) * 4, &comm)
                .is_err(),
        )
    });
    assert!(err.into_iter().all(|r| r.expect("run")));
}
