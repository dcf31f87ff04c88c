//! Sharded loading by a model's parallel plan: one rank's shard of any [`Planned`] model (a
//! user's own included) read straight from a [`WeightSource`] (an HF checkpoint directory, a
//! live model through [`crate::weights::ModuleWeights`]), only this rank's box of every tensor.
//!
//! The caller passes a *template*: the full model as its own `init` builds it, ideally with
//! Burn's lazily initialised parameters (then nothing at full size is ever allocated). Each
//! parameter's HF name, canonical shape and split come from its plan entry and the template's
//! (lazy) shape; the loaded parameter keeps the template's id. Routed experts are read through
//! [`WeightLoader::experts`] (stacked or per-expert HF names); every other tensor through
//! [`WeightSource::tensor_box_f32`].

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};

use super::{GradClass, ParallelPlan, PlanError, Planned, Storage, hf_names};
use crate::ModelError;
use crate::weights::{ShardSpec, WeightLoader, WeightSource};
use moe_bridge::dist::ShardRule;

/// This rank's shard (`spec`, e.g.
/// [`ParallelContext::shard_spec`](crate::distributed::ParallelContext::shard_spec)) of the
/// model shaped like `template`, read from `source` by the entries of `plan` (`main_layers`:
/// the `{0+L}` templates); see the module docs. Parameters are created on `device` in f32,
/// trainable unless their entry is a buffer. A tensor the source lacks, or holds at another
/// shape, and a parameter the plan does not classify are errors naming it.
///
/// Fields derived from tensor shapes keep the template's values: fix them with the module's
/// own helper ([`Attention::with_local_heads`](crate::layers::Attention::with_local_heads)).
pub fn load_by_plan<M: Module>(
    template: &M,
    plan: &ParallelPlan,
    main_layers: usize,
    source: &dyn WeightSource,
    spec: &ShardSpec,
    device: &Device,
) -> Result<M, ModelError> {
    let loader = WeightLoader::sharded(source, device, spec);
    load_with(template, plan, main_layers, &loader)
}

/// [`load_by_plan`] through `loader`: its source, shard and device (a skeleton loader builds
/// every parameter as zeros at this rank's shape, reading nothing).
pub fn load_with<M: Module>(
    template: &M,
    plan: &ParallelPlan,
    main_layers: usize,
    loader: &WeightLoader<'_>,
) -> Result<M, ModelError> {
    let mut mapper = Loader {
        plan,
        main_layers,
        loader: *loader,
        path: Vec::new(),
        pending: HashMap::new(),
        error: None,
    };
    let shard = template.clone().map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(shard),
    }
}

/// [`load_by_plan`] with the model's own plan ([`Planned::parallel_plan`]) and layer count.
pub fn load_planned<M: Planned>(
    template: &M,
    source: &dyn WeightSource,
    spec: &ShardSpec,
    device: &Device,
) -> Result<M, ModelError> {
    load_by_plan(
        template,
        &M::parallel_plan(),
        template.main_layers(),
        source,
        spec,
        device,
    )
}

struct Loader<'a> {
    plan: &'a ParallelPlan,
    main_layers: usize,
    loader: WeightLoader<'a>,
    path: Vec<String>,
    /// The other half of an expert pair already read (`fc2` when `fc1` was visited first, or
    /// the reverse), by HF name.
    pending: HashMap<String, TensorData>,
    error: Option<ModelError>,
}

impl Loader<'_> {
    fn mismatch(&self, path: &str, reason: String) -> ModelError {
        PlanError::Mismatch {
            family: self.plan.family(),
            path: path.to_owned(),
            reason,
        }
        .into()
    }

    /// This rank's routed-expert tensor `hf` (`….gate_up_proj` stored `[E, 2F, H]` or
    /// `….down_proj` stored `[E, H, F]`) whose full Burn shape is `full`.
    fn expert(&mut self, path: &str, hf: &str, full: &[usize]) -> Result<TensorData, ModelError> {
        if let Some(data) = self.pending.remove(hf) {
            return Ok(data);
        }
        let (prefix, fc1, other) = match hf_names::split_stacked(hf) {
            Some((p, true)) => (p, true, hf_names::stacked_down(p)),
            Some((p, false)) => (p, false, hf_names::stacked_gate_up(p)),
            None => {
                return Err(self.mismatch(
                    path,
                    format!(
                        "routed experts must be named `….{}` / `….{}`, not `{hf}`",
                        hf_names::GATE_UP_PROJ,
                        hf_names::DOWN_PROJ
                    ),
                ));
            }
        };
        let (e, f, h) = match (fc1, full) {
            (true, [e, f2, h]) if f2 % 2 == 0 => (*e, f2 / 2, *h),
            (false, [e, h, f]) => (*e, *f, *h),
            _ => {
                return Err(self.mismatch(path, format!("unexpected routed-expert shape {full:?}")));
            }
        };
        let projs = self.plan.expert_projections();
        let (gate_up, down) = self.loader.experts_named(prefix, projs, e, f, h)?;
        let (mine, theirs) = if fc1 {
            (gate_up.into_data(), down.into_data())
        } else {
            (down.into_data(), gate_up.into_data())
        };
        self.pending.insert(other, theirs);
        Ok(mine)
    }

    /// This rank's box of a per-expert tensor `hf` other than the stacked gate/up and down
    /// projections (e.g. expert biases) whose full Burn shape is `full`: its experts along dim
    /// 0 and, with `etp_dim`, its ETP block of that canonical dimension (for gated storage
    /// `[E, 2F]` ≡ canonical `[E, 2, F]`, the same block of the gate and of the up half).
    fn expert_box(
        &self,
        path: &str,
        hf: &str,
        full: &[usize],
        storage: Storage,
        etp_dim: Option<usize>,
    ) -> Result<TensorData, ModelError> {
        let shard = self.loader.shard();
        let experts = shard.expert_range(*full.first().unwrap_or(&0))?;
        let mut offsets = vec![0; full.len()];
        let mut shape = full.to_vec();
        offsets[0] = experts.start;
        shape[0] = experts.len();
        match (storage, etp_dim) {
            (Storage::Same, None) => {}
            (Storage::Same, Some(d)) if d > 0 && d < full.len() => {
                let block = shard.etp_block(hf, full[d])?;
                offsets[d] = block.start;
                shape[d] = block.len();
            }
            (Storage::GatedExperts, Some(2)) if full.len() == 2 && full[1].is_multiple_of(2) => {
                let f = full[1] / 2;
                let block = shard.etp_block(hf, f)?;
                let (l, b) = (experts.len(), block.len());
                let read = |start: usize| {
                    self.loader
                        .host_box(hf, full, &[experts.start, start], &[l, b])
                };
                let (gate, up) = (read(block.start)?, read(f + block.start)?);
                let mut values = Vec::with_capacity(2 * l * b);
                for (g, u) in gate.chunks_exact(b.max(1)).zip(up.chunks_exact(b.max(1))) {
                    values.extend_from_slice(g);
                    values.extend_from_slice(u);
                }
                return Ok(TensorData::new(values, [l, 2 * b]));
            }
            _ => {
                return Err(self.mismatch(
                    path,
                    format!("a per-expert {storage:?} tensor of shape {full:?} split over etp along {etp_dim:?}"),
                ));
            }
        }
        let values = self.loader.host_box(hf, full, &offsets, &shape)?;
        Ok(TensorData::new(values, shape))
    }

    /// This rank's box of the dense tensor `hf` whose full Burn shape is `full`, in Burn
    /// layout.
    fn dense(
        &self,
        path: &str,
        hf: &str,
        full: &[usize],
        storage: Storage,
        split: ShardRule,
    ) -> Result<TensorData, ModelError> {
        let global: Vec<usize> = match (storage, full) {
            (Storage::Same, _) => full.to_vec(),
            (Storage::Transposed, [a, b]) => vec![*b, *a],
            _ => {
                return Err(self.mismatch(
                    path,
                    format!("a {storage:?} tensor of shape {full:?} must be a routed expert"),
                ));
            }
        };
        let mut offsets = vec![0; global.len()];
        let mut shape = global.clone();
        if let ShardRule::Tp { dim } = split {
            let n = *global.get(dim).ok_or_else(|| {
                self.mismatch(path, format!("no dim {dim} in {global:?} to split over tp"))
            })?;
            let r = ShardSpec::part(
                hf,
                "tp",
                n,
                self.loader.shard().tp_rank,
                self.loader.shard().tp,
            )?;
            offsets[dim] = r.start;
            shape[dim] = r.len();
        }
        let values = self.loader.host_box(hf, &global, &offsets, &shape)?;
        Ok(match (storage, shape.as_slice()) {
            (Storage::Transposed, &[rows, cols]) => {
                // Canonical `[out, in]` box to Burn's contiguous `[in, out]`.
                let mut t = vec![0.0f32; values.len()];
                for (r, row) in values.chunks_exact(cols.max(1)).enumerate() {
                    for (c, &v) in row.iter().enumerate() {
                        t[c * rows + r] = v;
                    }
                }
                TensorData::new(t, [cols, rows])
            }
            _ => TensorData::new(values, shape),
        })
    }

    fn load<const D: usize>(
        &mut self,
        path: &str,
        full: &[usize],
    ) -> Result<(Tensor<D>, GradClass), ModelError> {
        let resolved = self.plan.resolve(path, self.main_layers)?;
        let (entry, hf) = (resolved.entry.clone(), resolved.hf_name);
        let stacked_pair = hf_names::split_stacked(&hf).is_some();
        let data = match entry.split {
            ShardRule::Expert { etp_dim: 2 } if stacked_pair => self.expert(path, &hf, full)?,
            ShardRule::Expert { etp_dim } if !stacked_pair => {
                self.expert_box(path, &hf, full, entry.storage, Some(etp_dim))?
            }
            ShardRule::ExpertReplicated => self.expert_box(path, &hf, full, entry.storage, None)?,
            ShardRule::Expert { etp_dim } => {
                return Err(self.mismatch(
                    path,
                    format!("routed experts split over etp along canonical dim {etp_dim} (the expert loader splits dim 2)"),
                ));
            }
            split => self.dense(path, &hf, full, entry.storage, split)?,
        };
        if data.rank() != D {
            return Err(self.mismatch(
                path,
                format!(
                    "read a rank-{} tensor for a rank-{D} parameter",
                    data.rank()
                ),
            ));
        }
        Ok((Tensor::from_data(data, self.loader.device()), entry.grad))
    }
}

impl ModuleMapper for Loader<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let path = self.path.join(".");
        // The template's shape without materialising a lazy parameter.
        let full = param.lazy_shape().to_vec();
        match self.load::<D>(&path, &full) {
            Ok((tensor, grad)) => {
                let mut loaded = Param::from_tensor(tensor);
                if grad == GradClass::Buffer {
                    loaded = loaded.set_require_grad(false);
                }
                loaded.id = param.id;
                loaded
            }
            Err(e) => {
                self.error = Some(e);
                param
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::module::ModuleVisitor;
    use moe_backend::BackendError;
    use moe_backend::comm::World;
    use moe_backend::parallel::ParallelLayout;

    use super::*;
    use crate::Qwen3MoeConfig;
    use crate::distributed::{DispatcherKind, ParallelContext};
    use crate::layers::RotaryEmbedding;
    use crate::qwen3_moe::Qwen3MoeForCausalLM;
    use crate::weights::ModuleWeights;

    /// `(path, shape, requires grad, values)` of every float tensor.
    type Fingerprint = Vec<(String, Vec<usize>, bool, Vec<f32>)>;

    #[derive(Default)]
    struct Values {
        path: Vec<String>,
        found: Fingerprint,
    }

    impl ModuleVisitor for Values {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_owned());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.found.push((
                self.path.join("."),
                t.dims().to_vec(),
                t.is_require_grad(),
                t.into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32"),
            ));
        }
    }

    fn fingerprint<M: Module>(m: &M) -> Fingerprint {
        let mut v = Values::default();
        m.visit(&mut v);
        v.found
    }

    /// This rank's part of full parameter `path` (Burn layout) cut by hand, independently of
    /// the plan: vocabulary rows of the embedding and columns of the head, column-parallel
    /// projections by output columns, row-parallel ones by input rows, this rank's experts and
    /// their ETP block (gate and up rows of `fc1`, columns of `fc2`), everything else whole.
    fn naive_slice(path: &str, full: Tensor<3>, spec: &ShardSpec) -> Tensor<3> {
        let block = |t: Tensor<3>, dim: usize, rank: usize, parts: usize| {
            let n = t.dims()[dim] / parts;
            t.narrow(dim, rank * n, n)
        };
        let (tp_rank, tp) = (spec.tp_rank, spec.tp);
        let column = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
            .iter()
            .chain(&["gate_proj.weight", "up_proj.weight", "lm_head.weight"])
            .any(|s| path.ends_with(s));
        let row = path.ends_with("o_proj.weight") || path.ends_with("down_proj.weight");
        if path == "model.embed_tokens.weight" {
            block(full, 1, tp_rank, tp)
        } else if column {
            block(full, 2, tp_rank, tp)
        } else if row {
            block(full, 1, tp_rank, tp)
        } else if path.ends_with("experts.fc1") || path.ends_with("experts.fc2") {
            let experts = spec.experts.clone().unwrap_or(0..full.dims()[0]);
            let mine = full.narrow(0, experts.start, experts.len());
            if path.ends_with("fc2") {
                return block(mine, 2, spec.etp_rank, spec.etp);
            }
            // `fc1` rows are `[gate; up]`: this ETP rank's block of each.
            let f = mine.dims()[1] / 2;
            let gate = block(mine.clone().narrow(1, 0, f), 1, spec.etp_rank, spec.etp);
            let up = block(mine.narrow(1, f, f), 1, spec.etp_rank, spec.etp);
            Tensor::cat(vec![gate, up], 1)
        } else {
            full
        }
    }

    /// Every float parameter as `(path, rank-3 tensor)` (leading dims of size 1 added).
    fn tensors<M: Module>(m: &M) -> Vec<(String, Tensor<3>)> {
        #[derive(Default)]
        struct Collect {
            path: Vec<String>,
            found: Vec<(String, Tensor<3>)>,
        }
        impl ModuleVisitor for Collect {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_owned());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                let dims = t.dims();
                let lead = vec![1; 3 - D];
                let shape: Vec<usize> = lead.into_iter().chain(dims).collect();
                self.found.push((
                    self.path.join("."),
                    t.reshape([shape[0], shape[1], shape[2]]),
                ));
            }
        }
        let mut c = Collect::default();
        m.visit(&mut c);
        c.found
    }

    /// Loading the Qwen3-MoE fixture's shard by its plan from a weight source equals the full
    /// model's parameters cut by hand ([`naive_slice`]) bit for bit (paths, shapes, gradient
    /// settings, values), with the local head counts, under TP, EP and ETP layouts; the
    /// template's parameter ids are kept.
    #[test]
    fn plan_loading_equals_the_full_model_cut_by_hand() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/qwen3_moe/config.json"
        );
        let config = Qwen3MoeConfig::from_file(path).expect("config");
        let device = Device::flex().autodiff();
        let full = config.init(&device).expect("init");
        let want_full = tensors(&full);
        let want_grad = fingerprint(&full);
        for (world, spec) in [
            (4, "tp=2,ep=4"),
            (4, "tp=2,ep=2,etp=2"),
            (2, "ep=2"),
            (1, ""),
        ] {
            let layout = ParallelLayout::parse(world, spec).expect("layout");
            let (config, layout, full, device) = (&config, &layout, &full, &device);
            let (want_full, want_grad) = (&want_full, &want_grad);
            let results = World::run(world, |rank| {
                let pg = rank.process_groups(layout)?;
                let be = |e: ModelError| BackendError::Replay(e.to_string());
                let source = &ModuleWeights::new(full).map_err(be)?;
                let rope =
                    RotaryEmbedding::new(&config.rope_parameters, config.head_dim).map_err(be)?;
                let ctx = ParallelContext::new(
                    &pg,
                    DispatcherKind::AllToAll,
                    Some(config.num_experts),
                    config.vocab_size,
                    rope,
                )
                .map_err(be)?;
                let spec = ctx.shard_spec();
                let template = config.init(device).map_err(be)?;
                let mut shard: Qwen3MoeForCausalLM =
                    load_planned(&template, source, &spec, device).map_err(be)?;
                for layer in &mut shard.model.layers {
                    layer.self_attn = layer.self_attn.clone().with_local_heads().map_err(be)?;
                }
                let got = tensors(&shard);
                assert_eq!(got.len(), want_full.len(), "tensor count");
                for ((path, g), (want_path, w)) in got.iter().zip(want_full) {
                    assert_eq!(path, want_path, "path");
                    let w = naive_slice(path, w.clone(), &spec);
                    assert_eq!(g.dims(), w.dims(), "shape of {path}");
                    assert!(g.clone().into_data() == w.into_data(), "values of {path}");
                }
                let grads: Vec<bool> = fingerprint(&shard).iter().map(|f| f.2).collect();
                let want: Vec<bool> = want_grad.iter().map(|f| f.2).collect();
                assert_eq!(grads, want, "gradient settings");
                let (tp, heads) = (spec.tp, &shard.model.layers);
                assert!(heads.iter().all(|l| {
                    (l.self_attn.num_heads, l.self_attn.num_kv_heads)
                        == (
                            config.num_attention_heads / tp,
                            config.num_key_value_heads / tp,
                        )
                }));
                let ids = |m: &Qwen3MoeForCausalLM| {
                    let mut v = Vec::new();
                    m.visit(&mut IdVisitor(&mut v));
                    v
                };
                assert!(ids(&template) == ids(&shard), "parameter ids");
                Ok(())
            });
            for (rank, got) in results.into_iter().enumerate() {
                got.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
            }
        }
    }

    struct IdVisitor<'a>(&'a mut Vec<burn::module::ParamId>);

    impl ModuleVisitor for IdVisitor<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
}
