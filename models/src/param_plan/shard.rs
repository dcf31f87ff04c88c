//! Cutting one rank's shard out of a full model by its parallel plan: the generic sharding
//! that any [`Planned`] model (a user's own included) gets without a loader of its own.
//!
//! Every float parameter and buffer is narrowed as its plan entry says: [`ShardRule::Tp`]
//! along the Burn dimension that holds the canonical split dimension (through the entry's
//! [`Storage`]), [`ShardRule::Expert`] to this rank's experts on dimension 0 and its ETP block
//! of the expert FFN (for [`Storage::GatedExperts`] the gate and up halves are narrowed
//! separately, as the gather reassembles them). Parameter ids, gradient settings and every
//! non-tensor field are kept (the full model's ids identify the shard's parameters, what the
//! optimizer tables and checkpoints key on); every tensor is a fresh copy, sharing no storage
//! or autodiff node with `full` (as [`moe_backend::parallel::replicate`] makes them).

use std::ops::Range;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;

use super::{ParallelPlan, PlanError, Planned, Storage};
use crate::ModelError;
use crate::weights::ShardSpec;
use moe_bridge::dist::ShardRule;

/// This rank's shard of `full` under `spec` (e.g.
/// [`ParallelContext::shard_spec`](crate::distributed::ParallelContext::shard_spec)), each
/// parameter narrowed by its entry of `plan` (`main_layers`: the `{0+L}` templates; see the
/// module docs). A parameter the plan does not classify, a split the tensor's storage does not
/// have, or a size that does not divide over its group is an error naming the parameter.
///
/// Fields derived from tensor shapes (e.g. [`Attention`](crate::layers::Attention)'s head
/// counts) keep the full model's values: fix them with the module's own helper
/// ([`Attention::with_local_heads`](crate::layers::Attention::with_local_heads)).
pub fn shard_by_plan<M: Module>(
    full: &M,
    plan: &ParallelPlan,
    main_layers: usize,
    spec: &ShardSpec,
) -> Result<M, ModelError> {
    let mut mapper = Sharder {
        plan,
        main_layers,
        spec,
        path: Vec::new(),
        error: None,
    };
    let shard = full.clone().map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(shard),
    }
}

/// [`shard_by_plan`] with the model's own plan ([`Planned::parallel_plan`]) and layer count.
pub fn shard_planned<M: Planned>(full: &M, spec: &ShardSpec) -> Result<M, ModelError> {
    shard_by_plan(full, &M::parallel_plan(), full.main_layers(), spec)
}

struct Sharder<'a> {
    plan: &'a ParallelPlan,
    main_layers: usize,
    spec: &'a ShardSpec,
    path: Vec<String>,
    error: Option<ModelError>,
}

fn narrow<const D: usize>(t: Tensor<D>, dim: usize, range: &Range<usize>) -> Tensor<D> {
    if range.start == 0 && range.end == t.dims()[dim] {
        t
    } else {
        t.narrow(dim, range.start, range.len())
    }
}

impl Sharder<'_> {
    fn mismatch(&self, path: &str, reason: String) -> ModelError {
        PlanError::Mismatch {
            family: self.plan.family(),
            path: path.to_owned(),
            reason,
        }
        .into()
    }

    /// The Burn dimension holding canonical dimension `dim` of a rank-`rank` tensor stored as
    /// `storage` (gated experts' canonical dims 1 and 2 are handled apart).
    fn burn_dim(
        &self,
        path: &str,
        storage: Storage,
        rank: usize,
        dim: usize,
    ) -> Result<usize, ModelError> {
        let found = match storage {
            Storage::Same => (dim < rank).then_some(dim),
            Storage::Transposed => (rank == 2 && dim < 2).then(|| 1 - dim),
            Storage::GatedExperts => match (rank, dim) {
                (3, 0) => Some(0),
                (3, 3) => Some(2),
                _ => None,
            },
        };
        found.ok_or_else(|| {
            self.mismatch(
                path,
                format!("no canonical dim {dim} in a rank-{rank} {storage:?} tensor"),
            )
        })
    }

    /// This rank's block of the full tensor `t` at `path`.
    fn shard<const D: usize>(&self, path: &str, t: Tensor<D>) -> Result<Tensor<D>, ModelError> {
        let entry = self.plan.resolve(path, self.main_layers)?.entry;
        let storage = entry.storage;
        let spec = self.spec;
        let dims = t.dims();
        match entry.split {
            ShardRule::Replicated => Ok(t),
            ShardRule::Tp { dim } => {
                let d = self.burn_dim(path, storage, D, dim)?;
                let r = ShardSpec::part(path, "tp", dims[d], spec.tp_rank, spec.tp)?;
                Ok(narrow(t, d, &r))
            }
            ShardRule::ExpertReplicated => {
                let experts = spec.expert_range(dims[0])?;
                Ok(narrow(t, 0, &experts))
            }
            ShardRule::Expert { etp_dim } => {
                let experts = spec.expert_range(dims[0])?;
                let t = narrow(t, 0, &experts);
                if storage == Storage::GatedExperts && matches!(etp_dim, 1 | 2) {
                    if etp_dim == 1 {
                        return Err(self.mismatch(
                            path,
                            "gated experts cannot split their gate/up axis over etp".into(),
                        ));
                    }
                    // Burn [E, 2F, H] = canonical [E, 2, F, H]: the same block of the gate
                    // rows and of the up rows.
                    let rows = dims[1];
                    if !rows.is_multiple_of(2) {
                        return Err(self.mismatch(path, format!("{rows} gated rows are odd")));
                    }
                    let f = rows / 2;
                    let block = spec.etp_block(path, f)?;
                    if block.len() == f {
                        return Ok(t);
                    }
                    let gate = t.clone().narrow(1, block.start, block.len());
                    let up = t.narrow(1, f + block.start, block.len());
                    Ok(Tensor::cat(vec![gate, up], 1))
                } else {
                    let d = self.burn_dim(path, storage, D, etp_dim)?;
                    let block = spec.etp_block(path, dims[d])?;
                    Ok(narrow(t, d, &block))
                }
            }
        }
    }
}

impl ModuleMapper for Sharder<'_> {
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
        let (id, value, _) = param.consume();
        let require_grad = value.is_require_grad();
        match self.shard(&path, value.clone()) {
            Ok(local) => {
                // A fresh tensor (own storage, own autodiff leaf): ranks of an in-process
                // world sharding one full model must not share graph nodes.
                let (device, dtype) = (local.device(), local.dtype());
                let local = Tensor::from_data(local.into_data(), (&device, dtype));
                let local = if require_grad {
                    local.require_grad()
                } else {
                    local
                };
                Param::initialized(id, local)
            }
            Err(e) => {
                self.error = Some(e);
                Param::initialized(id, value)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{ModuleVisitor, ParamId};
    use burn::tensor::Device;
    use moe_backend::BackendError;
    use moe_backend::comm::World;
    use moe_backend::parallel::{ParallelLayout, replicate};

    use super::*;
    use crate::Qwen3MoeConfig;
    use crate::distributed::{DispatcherKind, Sharded};
    use crate::qwen3_moe::Qwen3MoeForCausalLM;

    /// `(path, id, shape, requires grad, values)` of every float tensor.
    type Fingerprint = Vec<(String, ParamId, Vec<usize>, bool, Vec<f32>)>;

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
                param.id,
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

    /// The generic plan-driven sharding of the Qwen3-MoE fixture equals the built-in loader's
    /// shard bit for bit (paths, ids, shapes, gradient settings, values), and the local head
    /// counts recomputed from the shapes equal the loader's, under TP, EP and ETP layouts.
    #[test]
    fn plan_sharding_equals_the_builtin_qwen3_moe_shard() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/qwen3_moe/config.json"
        );
        let config = Qwen3MoeConfig::from_file(path).expect("config");
        let full = replicate(&config.init(&Device::flex().autodiff()).expect("init"));
        for (world, spec) in [
            (4, "tp=2,ep=4"),
            (4, "tp=2,ep=2,etp=2"),
            (2, "ep=2"),
            (1, ""),
        ] {
            let layout = ParallelLayout::parse(world, spec).expect("layout");
            let (full_ref, layout_ref) = (&full, &layout);
            let results = World::run(world, |ctx| {
                let pg = ctx.process_groups(layout_ref)?;
                let be = |e: ModelError| BackendError::Replay(e.to_string());
                let builtin =
                    Sharded::<Qwen3MoeForCausalLM>::shard(full_ref, &pg, DispatcherKind::AllToAll)
                        .map_err(be)?;
                let ctx = crate::distributed::ParallelContext::new(
                    &pg,
                    DispatcherKind::AllToAll,
                    Some(full_ref.config().num_experts),
                    full_ref.config().vocab_size,
                    crate::layers::RotaryEmbedding::new(
                        &full_ref.config().rope_parameters,
                        full_ref.config().head_dim,
                    )
                    .map_err(be)?,
                )
                .map_err(be)?;
                let mut generic: Qwen3MoeForCausalLM =
                    shard_planned(full_ref, &ctx.shard_spec()).map_err(be)?;
                for layer in &mut generic.model.layers {
                    layer.self_attn = layer.self_attn.clone().with_local_heads().map_err(be)?;
                }
                let heads = |m: &Qwen3MoeForCausalLM| -> Vec<(usize, usize)> {
                    m.model
                        .layers
                        .iter()
                        .map(|l| (l.self_attn.num_heads, l.self_attn.num_kv_heads))
                        .collect()
                };
                Ok((
                    fingerprint(&builtin.model),
                    fingerprint(&generic),
                    heads(&builtin.model),
                    heads(&generic),
                ))
            });
            for (rank, got) in results.into_iter().enumerate() {
                let (want, got, want_heads, got_heads) =
                    got.unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
                assert_eq!(got.len(), want.len(), "{spec} rank {rank}: tensor count");
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g.0, w.0, "{spec} rank {rank}: path");
                    assert_eq!(g.1, w.1, "{spec} rank {rank}: id of {}", g.0);
                    assert_eq!(g.2, w.2, "{spec} rank {rank}: shape of {}", g.0);
                    assert_eq!(g.3, w.3, "{spec} rank {rank}: grad of {}", g.0);
                    assert!(g.4 == w.4, "{spec} rank {rank}: values of {}", g.0);
                }
                assert_eq!(got_heads, want_heads, "{spec} rank {rank}: head counts");
            }
        }
    }
}
