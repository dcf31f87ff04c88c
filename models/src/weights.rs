//! Loading modules from HF tensor names (models.md §6).
//!
//! The models do not read files themselves: a [`WeightSource`] hands out named f32 tensors (the
//! bridge implements it for HF checkpoint directories; tests implement it over fixture files),
//! and [`WeightLoader`] turns them into Burn modules with shape checks whose errors name the
//! tensor. Checkpoint linears are `[out, in]`; Burn's [`Linear`] stores `[in, out]`, so the
//! loader transposes.

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Tensor, TensorData};

use crate::ModelError;
use crate::layers::{Mlp, RmsNorm};

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
}

/// Builds modules from a [`WeightSource`] on one device.
#[derive(Clone, Copy)]
pub struct WeightLoader<'a> {
    source: &'a dyn WeightSource,
    device: &'a Device,
}

impl<'a> WeightLoader<'a> {
    /// A loader reading `source` onto `device`.
    pub fn new(source: &'a dyn WeightSource, device: &'a Device) -> Self {
        Self { source, device }
    }

    /// The device tensors are created on.
    pub fn device(&self) -> &Device {
        self.device
    }

    /// Whether the source holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// Host values of `name`, which must have exactly the shape `expected`.
    pub fn host(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (shape, values) = self.source.tensor_f32(name)?;
        if shape != expected {
            return Err(ModelError::TensorShape {
                name: name.to_owned(),
                expected: expected.to_vec(),
                found: shape,
            });
        }
        let numel: usize = shape.iter().product();
        if values.len() != numel {
            return Err(ModelError::TensorRead {
                name: name.to_owned(),
                reason: format!("{} values for shape {shape:?}", values.len()),
            });
        }
        Ok(values)
    }

    /// The tensor `name` with shape `expected`.
    pub fn tensor<const D: usize>(
        &self,
        name: &str,
        expected: [usize; D],
    ) -> Result<Tensor<D>, ModelError> {
        let values = self.host(name, &expected)?;
        Ok(Tensor::from_data(
            TensorData::new(values, expected),
            self.device,
        ))
    }

    /// A linear `d_in → d_out` from `{prefix}.weight` `[d_out, d_in]` (and `{prefix}.bias`
    /// `[d_out]` when `bias`).
    pub fn linear(
        &self,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let weight = self.tensor(&format!("{prefix}.weight"), [d_out, d_in])?;
        let bias = if bias {
            Some(Param::from_tensor(
                self.tensor(&format!("{prefix}.bias"), [d_out])?,
            ))
        } else {
            None
        };
        Ok(Linear {
            weight: Param::from_tensor(weight.transpose()),
            bias,
        })
    }

    /// An RMSNorm from `{prefix}.weight` `[size]`.
    pub fn rms_norm(&self, prefix: &str, size: usize, epsilon: f64) -> Result<RmsNorm, ModelError> {
        Ok(RmsNorm {
            weight: Param::from_tensor(self.tensor(&format!("{prefix}.weight"), [size])?),
            epsilon,
        })
    }

    /// A dense SwiGLU MLP from `{prefix}.{gate_proj,up_proj,down_proj}.weight`.
    pub fn mlp(&self, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp, ModelError> {
        Ok(Mlp {
            gate_proj: self.linear(&format!("{prefix}.gate_proj"), hidden, inter, false)?,
            up_proj: self.linear(&format!("{prefix}.up_proj"), hidden, inter, false)?,
            down_proj: self.linear(&format!("{prefix}.down_proj"), inter, hidden, false)?,
            fp8: None,
        })
    }

    /// An embedding table from `name` `[vocab, hidden]`.
    pub fn embedding(
        &self,
        name: &str,
        vocab: usize,
        hidden: usize,
    ) -> Result<Embedding, ModelError> {
        Ok(Embedding {
            weight: Param::from_tensor(self.tensor(name, [vocab, hidden])?),
        })
    }

    /// Routed experts under `prefix` (`...mlp.experts`) as moe-backend's stacked weights:
    /// `fc1 [E, 2·Im, H]` (rows `[gate; up]`) and `fc2 [E, H, Im]`.
    ///
    /// Accepts the stacked layout (`{prefix}.gate_up_proj [E, 2·Im, H]`,
    /// `{prefix}.down_proj [E, H, Im]`) or per-expert names
    /// (`{prefix}.{e}.{gate_proj,up_proj} [Im, H]`, `{prefix}.{e}.down_proj [H, Im]`);
    /// a mix of both is rejected (models.md §6).
    pub fn experts(
        &self,
        prefix: &str,
        num_experts: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<(Tensor<3>, Tensor<3>), ModelError> {
        let stacked_gate_up = format!("{prefix}.gate_up_proj");
        let stacked_down = format!("{prefix}.down_proj");
        let stacked = [&stacked_gate_up, &stacked_down]
            .into_iter()
            .find(|n| self.contains(n));
        let per_expert = (0..num_experts)
            .flat_map(|e| {
                ["gate_proj", "up_proj", "down_proj"].map(|p| format!("{prefix}.{e}.{p}.weight"))
            })
            .find(|n| self.contains(n));
        match (stacked, per_expert) {
            (Some(stacked), Some(per_expert)) => Err(ModelError::MixedExpertLayout {
                prefix: prefix.to_owned(),
                stacked: stacked.clone(),
                per_expert,
            }),
            (Some(_), None) => Ok((
                self.tensor(&stacked_gate_up, [num_experts, 2 * inter, hidden])?,
                self.tensor(&stacked_down, [num_experts, hidden, inter])?,
            )),
            (None, _) => {
                let mut fc1 = Vec::with_capacity(num_experts * 2 * inter * hidden);
                let mut fc2 = Vec::with_capacity(num_experts * hidden * inter);
                for e in 0..num_experts {
                    let p = format!("{prefix}.{e}");
                    fc1.extend(self.host(&format!("{p}.gate_proj.weight"), &[inter, hidden])?);
                    fc1.extend(self.host(&format!("{p}.up_proj.weight"), &[inter, hidden])?);
                    fc2.extend(self.host(&format!("{p}.down_proj.weight"), &[hidden, inter])?);
                }
                Ok((
                    Tensor::from_data(
                        TensorData::new(fc1, [num_experts, 2 * inter, hidden]),
                        self.device,
                    ),
                    Tensor::from_data(
                        TensorData::new(fc2, [num_experts, hidden, inter]),
                        self.device,
                    ),
                ))
            }
        }
    }
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
    fn linear_is_transposed_and_shapes_are_checked() {
        let device = Device::flex();
        let mut src = MapSource::default();
        src.put("a.weight", &[3, 2]);
        let loader = WeightLoader::new(&src, &device);
        let lin = loader.linear("a", 2, 3, false).unwrap();
        assert_eq!(lin.weight.dims(), [2, 3]);
        let err = loader.linear("a", 3, 2, false).unwrap_err().to_string();
        assert!(
            err.contains("`a.weight`") && err.contains("[3, 2]"),
            "{err}"
        );
        let err = loader.linear("b", 3, 2, false).unwrap_err().to_string();
        assert!(err.contains("`b.weight` is missing"), "{err}");
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
}
