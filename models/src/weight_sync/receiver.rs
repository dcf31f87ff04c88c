//! Receivers: the [`WeightReceiver`] trait and [`ModelReceiver`], which updates a generation
//! model in place through the models' HF loading path.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use burn::tensor::{DType, Device};

use super::bucket::{SyncManifest, WeightBucket};
use super::host::decode_f32;
use super::{ExpertNames, WeightSyncError};
use crate::ModelError;
use crate::export::{ExportHf, export_hf_tensors_as};
use crate::weights::WeightSource;

/// Consumes the buckets of a weight sync (an inference engine, a file writer, a model in the
/// same process). Called in order: [`begin`](Self::begin) once with the plan,
/// [`receive`](Self::receive) for every bucket, [`finish`](Self::finish) once.
pub trait WeightReceiver {
    /// A sync starts; `manifest` lists every tensor and bucket to come.
    fn begin(&mut self, manifest: &SyncManifest) -> Result<(), WeightSyncError> {
        let _ = manifest;
        Ok(())
    }

    /// One bucket (buckets arrive in order, each once).
    fn receive(&mut self, bucket: &WeightBucket) -> Result<(), WeightSyncError>;

    /// Every bucket has been received.
    fn finish(&mut self) -> Result<(), WeightSyncError> {
        Ok(())
    }
}

/// A model [`ModelReceiver`] can update: its HF export lists the names and shapes it takes, and
/// it rebuilds itself from HF-named tensors with its own `from_weights` (same config).
pub trait SyncTarget: ExportHf + Sized {
    /// The model with the same configuration, every tensor loaded from `source`.
    fn reload(&self, source: &dyn WeightSource, device: &Device) -> Result<Self, ModelError>;
}

impl<M: crate::distributed::ShardModel> SyncTarget for M {
    fn reload(&self, source: &dyn WeightSource, device: &Device) -> Result<Self, ModelError> {
        M::from_loader(
            self.model_config(),
            &crate::weights::WeightLoader::new(source, device),
        )
    }
}

/// Updates a generation model in place with the tensors of a sync.
///
/// Every received tensor is checked against the model's own HF export (both expert layouts
/// are accepted, not mixed): an unknown name, a wrong shape or a tensor received twice is an
/// error naming it; at [`finish`](WeightReceiver::finish) a missing tensor is one too. Each
/// tensor is decoded to f32 as its bucket arrives and kept until `finish`, which rebuilds the
/// model through its `from_weights` ([`SyncTarget`]) on `device`, handing over (not copying)
/// each tensor's values as it is loaded, and replaces `*model`: the receiver holds about one
/// model's f32 weights beside the model it updates. On error the model is left unchanged.
pub struct ModelReceiver<'m, M: SyncTarget> {
    model: &'m mut M,
    device: Device,
    /// Expected shape of every name of either expert layout, and whether it is fused-only /
    /// per-expert-only.
    expected: Option<Expected>,
    store: Store,
    /// The expert names of the sync under way (from its manifest).
    experts: Option<ExpertNames>,
    /// The model's own plan (its family's release layouts).
    plan: Option<crate::param_plan::ParallelPlan>,
}

impl<M: SyncTarget> std::fmt::Debug for ModelReceiver<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelReceiver")
            .field("device", &self.device)
            .field("received", &self.store.tensors.borrow().len())
            .finish()
    }
}

struct Expected {
    shapes: HashMap<String, Vec<usize>>,
    /// Shapes under per-expert names where they differ from the fused ones (tensors the
    /// family's release stores in another layout).
    per_expert_shapes: HashMap<String, Vec<usize>>,
    per_expert: Vec<String>,
    fused: Vec<String>,
    fused_only: HashSet<String>,
}

impl Expected {
    fn of<M: ExportHf>(model: &M) -> Result<Self, ModelError> {
        let per = export_hf_tensors_as(model, ExpertNames::PerExpert)?;
        let fused = export_hf_tensors_as(model, ExpertNames::Fused)?;
        let per_names: Vec<String> = per.specs().iter().map(|s| s.name.clone()).collect();
        let per_set: HashSet<&String> = per_names.iter().collect();
        let fused_only = fused
            .specs()
            .iter()
            .filter(|s| !per_set.contains(&s.name))
            .map(|s| s.name.clone())
            .collect();
        let fused_shapes: HashMap<&String, &Vec<usize>> =
            fused.specs().iter().map(|s| (&s.name, &s.shape)).collect();
        let per_expert_shapes = (per.specs().iter())
            .filter(|s| fused_shapes.get(&s.name).is_some_and(|f| **f != s.shape))
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect();
        let shapes = per
            .specs()
            .iter()
            .chain(fused.specs())
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect();
        Ok(Self {
            shapes,
            per_expert_shapes,
            per_expert: per_names,
            fused: fused.specs().iter().map(|s| s.name.clone()).collect(),
            fused_only,
        })
    }
}

/// Received tensors (f32), handed to `from_weights` as a [`WeightSource`]; each is moved out
/// when read.
#[derive(Default)]
struct Store {
    tensors: RefCell<HashMap<String, Received>>,
}

struct Received {
    shape: Vec<usize>,
    /// `None` once read.
    values: Option<Vec<f32>>,
}

impl WeightSource for Store {
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let mut tensors = self.tensors.borrow_mut();
        let t = tensors
            .get_mut(hf_name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: hf_name.to_owned(),
            })?;
        // A model may read a tensor more than once (gpt-oss's gated expert bias): a copy.
        let values = t.values.clone().ok_or_else(|| ModelError::TensorRead {
            name: hf_name.to_owned(),
            reason: "no values received".to_owned(),
        })?;
        Ok((t.shape.clone(), values))
    }

    fn contains(&self, hf_name: &str) -> bool {
        self.tensors.borrow().contains_key(hf_name)
    }
}

impl<'m, M: SyncTarget> ModelReceiver<'m, M> {
    /// A receiver updating `model`, rebuilt on `device`.
    pub fn new(model: &'m mut M, device: &Device) -> Self {
        let plan = model.export_plan();
        Self {
            model,
            device: device.clone(),
            expected: None,
            store: Store::default(),
            experts: None,
            plan,
        }
    }

    fn expected(&mut self) -> Result<&Expected, WeightSyncError> {
        if self.expected.is_none() {
            self.expected = Some(Expected::of(&*self.model)?);
        }
        self.expected.as_ref().ok_or_else(|| {
            WeightSyncError::Unsupported("the target model's tensors are unknown".to_owned())
        })
    }

    /// Checks one tensor's name, shape and dtype against the model.
    fn check(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<(), WeightSyncError> {
        let per_expert = self.experts == Some(ExpertNames::PerExpert);
        let expected = self.expected()?;
        let want = (expected.per_expert_shapes.get(name))
            .filter(|_| per_expert)
            .or_else(|| expected.shapes.get(name))
            .ok_or_else(|| WeightSyncError::UnknownTensor {
                name: name.to_owned(),
            })?;
        if want.as_slice() != shape {
            return Err(WeightSyncError::ShapeMismatch {
                name: name.to_owned(),
                expected: want.clone(),
                found: shape.to_vec(),
            });
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(WeightSyncError::UnsupportedDtype {
                name: name.to_owned(),
                dtype,
            });
        }
        Ok(())
    }
}

impl<M: SyncTarget> WeightReceiver for ModelReceiver<'_, M> {
    /// Checks every tensor of the plan before any data moves, and forgets an earlier,
    /// unfinished sync.
    fn begin(&mut self, manifest: &SyncManifest) -> Result<(), WeightSyncError> {
        self.store.tensors.borrow_mut().clear();
        self.experts = Some(manifest.experts);
        for t in manifest.tensors() {
            self.check(&t.name, &t.shape, t.dtype)?;
        }
        Ok(())
    }

    fn receive(&mut self, bucket: &WeightBucket) -> Result<(), WeightSyncError> {
        for item in bucket.iter() {
            let (t, bytes) = item?;
            self.check(&t.name, &t.shape, t.dtype)?;
            let mut tensors = self.store.tensors.borrow_mut();
            if tensors.contains_key(&t.name) {
                return Err(WeightSyncError::DuplicateTensor {
                    name: t.name.clone(),
                });
            }
            let mut shape = t.shape.clone();
            let mut values = decode_f32(&t.name, bytes, t.dtype)?;
            // Stacked under per-expert names too (not fused-only): the release layout.
            let stacked = (self.expected.as_ref())
                .is_some_and(|e| !e.fused_only.contains(&t.name) && e.per_expert.contains(&t.name));
            if self.experts == Some(ExpertNames::PerExpert)
                && stacked
                && let Some(layout) = super::plan::release_layout(self.plan.as_ref(), &t.name)
            {
                // The family's release layout (its HF export), back to the canonical tensor
                // the model loads.
                values = layout.to_canonical(&t.name, &shape, &values)?;
                shape = layout.canonical_shape(&t.name, &shape)?;
            }
            tensors.insert(
                t.name.clone(),
                Received {
                    shape,
                    values: Some(values),
                },
            );
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), WeightSyncError> {
        let store = std::mem::take(&mut self.store);
        let expected = self.expected()?;
        let received = store.tensors.borrow();
        let fused = received.keys().any(|n| expected.fused_only.contains(n));
        let required = if fused {
            &expected.fused
        } else {
            &expected.per_expert
        };
        let missing: Vec<&String> = required
            .iter()
            .filter(|n| !received.contains_key(*n))
            .collect();
        if !missing.is_empty() {
            return Err(WeightSyncError::MissingTensors {
                count: missing.len(),
                names: missing.iter().take(5).map(|n| (*n).clone()).collect(),
            });
        }
        drop(received);
        let model = self.model.reload(&store, &self.device)?;
        *self.model = model;
        Ok(())
    }
}
