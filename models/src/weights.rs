//! Reading model weights from HF tensor names (docs/models.md §HF tensor names), whole or as one
//! rank's shard.
//!
//! The models do not read files themselves: a [`WeightSource`] hands out named f32 tensors, or
//! boxes of them (the bridge implements it for HF checkpoint directories with positioned reads
//! of the box alone; tests implement it over fixture files). A model is built by its parallel
//! plan ([`crate::param_plan::load_with`]): its own lazily initialised structure (nothing is
//! allocated) is walked parameter by parameter, each read by the HF name, storage and split
//! of its plan entry through a [`WeightLoader`], with shape checks whose errors name the
//! tensor. Checkpoint linears are `[out, in]`; Burn's `Linear` stores `[in, out]`, so the
//! loader transposes.
//!
//! **Sharded loading.** A loader made with [`WeightLoader::sharded`] reads, for every tensor,
//! only this rank's box (TP rows or columns, the EP range of the routed experts and their ETP
//! block), so the modules built are the rank's shard at local shapes and nothing larger than
//! one box is ever materialised. Local sizes (heads, widths, vocabulary rows, local experts)
//! follow from the boxes. [`WeightLoader::skeleton`] builds the same local shapes filled with
//! zeros, without a source (a skeleton that a distributed-checkpoint restore then fills).

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};

use crate::ModelError;
use crate::param_plan::hf_names;

mod module;

pub use module::ModuleWeights;
pub(crate) use module::adopt_param_ids;

/// A source of checkpoint tensors addressed by their HF names (e.g.
/// `model.layers.0.self_attn.q_proj.weight`), upcast to f32.
pub trait WeightSource {
    /// The tensor's shape and its values in row-major order, converted to f32.
    ///
    /// Errors: [`ModelError::MissingTensor`] when absent, [`ModelError::TensorRead`] when it
    /// cannot be read or converted.
    fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError>;

    /// Whether the source holds a tensor of that name.
    fn contains(&self, hf_name: &str) -> bool;

    /// The box at `offsets` of extent `shape` of tensor `hf_name` (canonical PyTorch
    /// orientation, as stored), whose whole shape must be `global`: row-major f32 values of
    /// the box alone.
    ///
    /// The default reads the whole tensor with [`tensor_f32`](Self::tensor_f32) and cuts the
    /// box out; sources that can read part of a tensor (the bridge's HF checkpoints) read only
    /// the box.
    ///
    /// Errors: [`ModelError::MissingTensor`] when absent, [`ModelError::TensorShape`] when the
    /// stored shape is not `global`, [`ModelError::TensorRead`] when the box does not lie
    /// inside `global` or the read fails.
    fn tensor_box_f32(
        &self,
        hf_name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        check_box(hf_name, global, offsets, shape)?;
        let (found, values) = self.tensor_f32(hf_name)?;
        if found != global {
            return Err(ModelError::TensorShape {
                name: hf_name.to_owned(),
                expected: global.to_vec(),
                found,
            });
        }
        if values.len() != global.iter().product::<usize>() {
            return Err(ModelError::TensorRead {
                name: hf_name.to_owned(),
                reason: format!("{} values for shape {global:?}", values.len()),
            });
        }
        Ok(slice_box(&values, global, offsets, shape))
    }
}

/// Checks that the box at `offsets` of extent `shape` lies inside a tensor of shape `global`
/// (same rank); the error names `name`.
pub fn check_box(
    name: &str,
    global: &[usize],
    offsets: &[usize],
    shape: &[usize],
) -> Result<(), ModelError> {
    let inside = offsets.len() == global.len()
        && shape.len() == global.len()
        && (0..global.len()).all(|d| {
            offsets[d]
                .checked_add(shape[d])
                .is_some_and(|end| end <= global[d])
        });
    if inside {
        Ok(())
    } else {
        Err(ModelError::TensorRead {
            name: name.to_owned(),
            reason: format!(
                "the box at {offsets:?} of shape {shape:?} does not lie inside {global:?}"
            ),
        })
    }
}

/// The box at `offsets` of extent `shape` of the row-major `values` of shape `global` (the box
/// must lie inside, [`check_box`]), row-major.
pub fn slice_box(values: &[f32], global: &[usize], offsets: &[usize], shape: &[usize]) -> Vec<f32> {
    let n = shape.len();
    let numel: usize = shape.iter().product();
    let mut out = Vec::with_capacity(numel);
    if numel == 0 {
        return out;
    }
    if n == 0 {
        out.extend_from_slice(&values[..1]);
        return out;
    }
    // Trailing dims that are whole form one contiguous run.
    let mut k = 1;
    let mut run = shape[n - 1];
    while k < n && shape[n - k] == global[n - k] {
        run *= shape[n - k - 1];
        k += 1;
    }
    let outer = n - k;
    let mut strides = vec![1usize; n];
    for d in (0..n - 1).rev() {
        strides[d] = strides[d + 1] * global[d + 1];
    }
    let mut idx = vec![0usize; outer];
    loop {
        let start: usize = (0..n)
            .map(|d| (offsets[d] + if d < outer { idx[d] } else { 0 }) * strides[d])
            .sum();
        out.extend_from_slice(&values[start..start + run]);
        let mut d = outer;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Which part of every canonical tensor one rank holds: its TP coordinates (dense tensors
/// split as the plan says), its range of routed experts (EP) and its block of every
/// expert's FFN width (ETP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// Rank in the TP group.
    pub tp_rank: usize,
    /// TP group size.
    pub tp: usize,
    /// This rank's routed experts (global ids); `None`: all of them.
    pub experts: Option<Range<usize>>,
    /// Rank in the expert-TP group.
    pub etp_rank: usize,
    /// Expert-TP group size.
    pub etp: usize,
    /// The parts of the model this rank's pipeline stage holds; `None`: every part.
    pub stage: Option<StageHolding>,
}

/// What one pipeline rank holds of a model (its virtual stages' parts together).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StageHolding {
    /// Global indices of its decoder layers, increasing.
    pub layers: Vec<usize>,
    /// The token embedding: the first stage's, or the last stage's copy for a tied output
    /// layer or the MTP modules (Megatron's embedding group).
    pub embedding: bool,
    /// The final norm and the output layer (the last stage).
    pub head: bool,
    /// The MTP modules (the last stage).
    pub mtp: bool,
}

/// The whole model (one rank holding everything).
static FULL: ShardSpec = ShardSpec::FULL;

impl ShardSpec {
    /// Every tensor whole.
    pub const FULL: ShardSpec = ShardSpec {
        tp_rank: 0,
        tp: 1,
        experts: None,
        etp_rank: 0,
        etp: 1,
        stage: None,
    };

    /// `[r·n/p, (r+1)·n/p)`, or an error naming `name` and `group` when `p ∤ n`.
    pub(crate) fn part(
        name: &str,
        group: &'static str,
        n: usize,
        rank: usize,
        size: usize,
    ) -> Result<Range<usize>, ModelError> {
        if size == 0 || rank >= size || !n.is_multiple_of(size) {
            return Err(ModelError::layout(
                group,
                format!("`{name}`: size {n} cannot be split into part {rank} of {group} = {size}"),
            ));
        }
        let part = n / size;
        Ok(rank * part..(rank + 1) * part)
    }

    /// This rank's routed experts out of `num_experts`.
    pub fn expert_range(&self, num_experts: usize) -> Result<Range<usize>, ModelError> {
        match &self.experts {
            None => Ok(0..num_experts),
            Some(r) if r.start < r.end && r.end <= num_experts => Ok(r.clone()),
            Some(r) => Err(ModelError::layout(
                "ep",
                format!("local experts {r:?} do not lie in 0..{num_experts}"),
            )),
        }
    }

    /// This rank's block of an expert FFN of width `ffn` (ETP).
    pub fn etp_block(&self, name: &str, ffn: usize) -> Result<Range<usize>, ModelError> {
        Self::part(name, "etp", ffn, self.etp_rank, self.etp)
    }
}

/// Builds modules from a [`WeightSource`] on one device, whole or as one rank's shard (see
/// the module docs).
#[derive(Clone, Copy)]
pub struct WeightLoader<'a> {
    /// `None`: a skeleton (zeros at local shapes).
    source: Option<&'a dyn WeightSource>,
    device: &'a Device,
    shard: &'a ShardSpec,
}

impl<'a> WeightLoader<'a> {
    /// A loader reading every tensor of `source` whole onto `device`.
    pub fn new(source: &'a dyn WeightSource, device: &'a Device) -> Self {
        Self {
            source: Some(source),
            device,
            shard: &FULL,
        }
    }

    /// A loader reading only `shard`'s box of every tensor of `source` onto `device`.
    pub fn sharded(source: &'a dyn WeightSource, device: &'a Device, shard: &'a ShardSpec) -> Self {
        Self {
            source: Some(source),
            device,
            shard,
        }
    }

    /// A loader that reads nothing and builds `shard`'s local shapes filled with zeros (routed
    /// experts stacked), e.g. for a restore to overwrite.
    pub fn skeleton(device: &'a Device, shard: &'a ShardSpec) -> Self {
        Self {
            source: None,
            device,
            shard,
        }
    }

    /// The device tensors are created on.
    pub fn device(&self) -> &Device {
        self.device
    }

    /// The part of every tensor this loader reads.
    pub fn shard(&self) -> &ShardSpec {
        self.shard
    }

    /// Whether the source holds `name` (never for a skeleton).
    pub fn contains(&self, name: &str) -> bool {
        self.source.is_some_and(|s| s.contains(name))
    }

    /// Host values of the whole tensor `name`, which must have exactly the shape `expected`.
    pub fn host(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, ModelError> {
        let offsets = vec![0; expected.len()];
        self.host_box(name, expected, &offsets, expected)
    }

    /// Host values of the box at `offsets` of extent `shape` of `name`, whose whole shape must
    /// be `global` (zeros for a skeleton).
    pub fn host_box(
        &self,
        name: &str,
        global: &[usize],
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        check_box(name, global, offsets, shape)?;
        let numel: usize = shape.iter().product();
        let Some(source) = self.source else {
            return Ok(vec![0.0; numel]);
        };
        let values = source.tensor_box_f32(name, global, offsets, shape)?;
        if values.len() != numel {
            return Err(ModelError::TensorRead {
                name: name.to_owned(),
                reason: format!("{} values for a box of shape {shape:?}", values.len()),
            });
        }
        Ok(values)
    }

    fn device_tensor<const D: usize>(&self, values: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
        Tensor::from_data(TensorData::new(values, shape), self.device)
    }

    /// Routed experts under `prefix` (`...mlp.experts`) as moe-backend's stacked weights:
    /// `fc1 [L, 2·Im', H]` (rows `[gate; up]` per expert) and `fc2 [L, H, Im']` for this
    /// rank's `L` experts ([`ShardSpec::expert_range`]) and FFN block `Im'`
    /// ([`ShardSpec::etp_block`]); all `E` experts and `Im' = Im` unsharded.
    ///
    /// Accepts the stacked layout (`{prefix}.gate_up_proj [E, 2·Im, H]`,
    /// `{prefix}.down_proj [E, H, Im]`) or per-expert names
    /// (`{prefix}.{e}.{gate_proj,up_proj} [Im, H]`, `{prefix}.{e}.down_proj [H, Im]`); a mix of
    /// both is rejected (docs/models.md §HF tensor names). Only this rank's boxes are read.
    pub fn experts(
        &self,
        prefix: &str,
        num_experts: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<(Tensor<3>, Tensor<3>), ModelError> {
        let projs = hf_names::ExpertProjections::LLAMA;
        self.experts_named(prefix, projs, num_experts, inter, hidden)
    }

    /// [`experts`](Self::experts) of a checkpoint whose per-expert tensors are named by
    /// `projs` (`{prefix}.{e}.{projs.gate}.weight`, …; the stacked names are the same).
    pub fn experts_named(
        &self,
        prefix: &str,
        projs: hf_names::ExpertProjections,
        num_experts: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<(Tensor<3>, Tensor<3>), ModelError> {
        let local = self.shard.expert_range(num_experts)?;
        let cols = self.shard.etp_block(prefix, inter)?;
        let (l, blk, h) = (local.len(), cols.len(), hidden);
        let stacked_gate_up = hf_names::stacked_gate_up(prefix);
        let stacked_down = hf_names::stacked_down(prefix);
        let stacked = [&stacked_gate_up, &stacked_down]
            .into_iter()
            .find(|n| self.contains(n));
        let per_expert = (0..num_experts)
            .flat_map(|e| {
                projs
                    .all()
                    .map(|p| hf_names::expert_proj_weight(prefix, e, p))
            })
            .find(|n| self.contains(n));
        let (fc1, fc2) = match (stacked, per_expert) {
            (Some(stacked), Some(per_expert)) => {
                return Err(ModelError::MixedExpertLayout {
                    prefix: prefix.to_owned(),
                    stacked: stacked.clone(),
                    per_expert,
                });
            }
            _ if self.source.is_none() => (vec![0.0; l * 2 * blk * h], vec![0.0; l * h * blk]),
            (Some(_), None) if blk == inter => {
                // Whole FFN width: each expert's `[gate; up]` rows are one box.
                let fc1 = self.host_box(
                    &stacked_gate_up,
                    &[num_experts, 2 * inter, h],
                    &[local.start, 0, 0],
                    &[l, 2 * inter, h],
                )?;
                let fc2 = self.host_box(
                    &stacked_down,
                    &[num_experts, h, inter],
                    &[local.start, 0, 0],
                    &[l, h, inter],
                )?;
                (fc1, fc2)
            }
            (Some(_), None) => {
                let global = [num_experts, 2 * inter, h];
                let gate = self.host_box(
                    &stacked_gate_up,
                    &global,
                    &[local.start, cols.start, 0],
                    &[l, blk, h],
                )?;
                let up = self.host_box(
                    &stacked_gate_up,
                    &global,
                    &[local.start, inter + cols.start, 0],
                    &[l, blk, h],
                )?;
                // Per expert: its gate rows, then its up rows.
                let per = blk * h;
                let mut fc1 = Vec::with_capacity(2 * l * per);
                for (g, u) in gate.chunks_exact(per).zip(up.chunks_exact(per)) {
                    fc1.extend_from_slice(g);
                    fc1.extend_from_slice(u);
                }
                let fc2 = self.host_box(
                    &stacked_down,
                    &[num_experts, h, inter],
                    &[local.start, 0, cols.start],
                    &[l, h, blk],
                )?;
                (fc1, fc2)
            }
            (None, _) => {
                let mut fc1 = Vec::with_capacity(l * 2 * blk * h);
                let mut fc2 = Vec::with_capacity(l * h * blk);
                for e in local {
                    for proj in [projs.gate, projs.up] {
                        fc1.extend(self.host_box(
                            &hf_names::expert_proj_weight(prefix, e, proj),
                            &[inter, h],
                            &[cols.start, 0],
                            &[blk, h],
                        )?);
                    }
                    fc2.extend(self.host_box(
                        &hf_names::expert_proj_weight(prefix, e, projs.down),
                        &[h, inter],
                        &[0, cols.start],
                        &[h, blk],
                    )?);
                }
                (fc1, fc2)
            }
        };
        Ok((
            self.device_tensor(fc1, [l, 2 * blk, h]),
            self.device_tensor(fc2, [l, h, blk]),
        ))
    }
}

/// The device of `module`'s parameters (the default device for a module without any).
pub fn module_device<M: burn::module::Module>(module: &M) -> Device {
    module.devices().into_iter().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// An in-memory source for unit tests.
    #[derive(Default)]
    struct MapSource(HashMap<String, (Vec<usize>, Vec<f32>)>);

    impl MapSource {
        fn put(&mut self, name: &str, shape: &[usize]) {
            let n: usize = shape.iter().product();
            let values = (0..n).map(|i| i as f32).collect();
            self.0.insert(name.to_owned(), (shape.to_vec(), values));
        }
    }

    impl WeightSource for MapSource {
        fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
            self.0
                .get(hf_name)
                .cloned()
                .ok_or_else(|| ModelError::MissingTensor {
                    name: hf_name.to_owned(),
                })
        }
        fn contains(&self, hf_name: &str) -> bool {
            self.0.contains_key(hf_name)
        }
    }

    #[test]
    fn experts_accept_either_layout_and_reject_a_mix() {
        let device = Device::flex();
        let (e, im, h) = (2, 3, 4);
        let mut per = MapSource::default();
        for i in 0..e {
            per.put(&format!("x.{i}.gate_proj.weight"), &[im, h]);
            per.put(&format!("x.{i}.up_proj.weight"), &[im, h]);
            per.put(&format!("x.{i}.down_proj.weight"), &[h, im]);
        }
        let (fc1, fc2) = WeightLoader::new(&per, &device)
            .experts("x", e, im, h)
            .unwrap();
        assert_eq!(fc1.dims(), [e, 2 * im, h]);
        assert_eq!(fc2.dims(), [e, h, im]);
        // Expert 1's up rows are the second half of its fc1 block.
        let v = fc1.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(v[(2 * im + im) * h], 0.0);

        let mut stacked = MapSource::default();
        stacked.put("x.gate_up_proj", &[e, 2 * im, h]);
        stacked.put("x.down_proj", &[e, h, im]);
        assert!(
            WeightLoader::new(&stacked, &device)
                .experts("x", e, im, h)
                .is_ok()
        );
        stacked.put("x.1.down_proj.weight", &[h, im]);
        let err = WeightLoader::new(&stacked, &device)
            .experts("x", e, im, h)
            .unwrap_err();
        assert!(matches!(err, ModelError::MixedExpertLayout { .. }), "{err}");
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn slice_box_cuts_any_box() {
        let v: Vec<f32> = (0..24).map(|i| i as f32).collect();
        // [2, 3, 4]: middle row of both matrices, columns 1..3.
        assert_eq!(
            slice_box(&v, &[2, 3, 4], &[0, 1, 1], &[2, 1, 2]),
            [5.0, 6.0, 17.0, 18.0]
        );
        assert_eq!(slice_box(&v, &[2, 3, 4], &[1, 0, 0], &[1, 3, 4]), v[12..]);
        assert!(check_box("t", &[2, 3], &[1, 0], &[2, 3]).is_err());
    }

    /// A sharded loader reads this rank's TP rows / columns, experts and ETP block; per-expert
    /// and stacked layouts give the same shard; a skeleton has the same shapes.
    #[test]
    fn sharded_loader_reads_the_rank_boxes_of_either_expert_layout() {
        let device = Device::flex();
        let (e, im, h) = (4, 4, 3);
        let mut per = MapSource::default();
        let mut stacked = MapSource::default();
        let mut gate_up = vec![0.0f32; e * 2 * im * h];
        let mut down = vec![0.0f32; e * h * im];
        for x in 0..e {
            for (p, rows, cols) in [
                ("gate_proj", im, h),
                ("up_proj", im, h),
                ("down_proj", h, im),
            ] {
                let vals: Vec<f32> = (0..rows * cols)
                    .map(|i| (x * 1000 + i) as f32 + if p == "up_proj" { 0.5 } else { 0.0 })
                    .collect();
                let name = format!("m.{x}.{p}.weight");
                per.0.insert(name, (vec![rows, cols], vals.clone()));
                match p {
                    "gate_proj" => gate_up[x * 2 * im * h..][..im * h].copy_from_slice(&vals),
                    "up_proj" => gate_up[(x * 2 + 1) * im * h..][..im * h].copy_from_slice(&vals),
                    _ => down[x * h * im..][..h * im].copy_from_slice(&vals),
                }
            }
        }
        stacked.0.insert(
            "m.gate_up_proj".into(),
            (vec![e, 2 * im, h], gate_up.clone()),
        );
        stacked
            .0
            .insert("m.down_proj".into(), (vec![e, h, im], down.clone()));
        let spec = ShardSpec {
            tp_rank: 1,
            tp: 2,
            experts: Some(2..4),
            etp_rank: 1,
            etp: 2,
            stage: None,
        };
        let (a1, a2) = WeightLoader::sharded(&per, &device, &spec)
            .experts("m", e, im, h)
            .unwrap();
        let (b1, b2) = WeightLoader::sharded(&stacked, &device, &spec)
            .experts("m", e, im, h)
            .unwrap();
        assert_eq!(a1.dims(), [2, 4, 3]);
        assert_eq!(a2.dims(), [2, 3, 2]);
        let (a1, b1, a2, b2) = (values(a1), values(b1), values(a2), values(b2));
        assert_eq!(a1, b1);
        assert_eq!(a2, b2);
        // Expert 2, gate rows 2..4, then its up rows 2..4.
        let gate = |r: usize| (0..h).map(move |c| (2000 + r * h + c) as f32);
        let want: Vec<f32> = gate(2)
            .chain(gate(3))
            .chain(gate(2).map(|v| v + 0.5))
            .chain(gate(3).map(|v| v + 0.5))
            .collect();
        assert_eq!(a1[..4 * h], want[..]);
        // Expert 2's down_proj columns 2..4.
        assert_eq!(a2[..2], [2002.0, 2003.0]);
        let (s1, s2) = WeightLoader::skeleton(&device, &spec)
            .experts("m", e, im, h)
            .unwrap();
        assert_eq!((s1.dims(), s2.dims()), ([2, 4, 3], [2, 3, 2]));
    }
}
