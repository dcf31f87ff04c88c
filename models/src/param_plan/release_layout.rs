//! How an HF release stores a canonical tensor when its layout differs from the canonical one
//! (docs/checkpoints.md §Canonical names and sharding): the plan's [`ReleaseLayout`]s, applied
//! at the HF boundary only — loading a checkpoint converts the release's tensor to the
//! canonical one, HF export converts back. Distributed checkpoints, resharding and the weight
//! sync see canonical tensors.
//!
//! The layouts are transformers 5.23's fused expert parameters (`GptOssExperts`:
//! `gate_up_proj [E, H, 2F]` input-major with gate / up interleaved on the last dim,
//! `gate_up_proj_bias [E, 2F]` interleaved, `down_proj [E, F, H]` input-major) against the
//! canonical stacked experts (`gate_up_proj [E, 2F, H]` rows `[gate; up]`, bias `[E, 2F]` as
//! `[gate; up]`, `down_proj [E, H, F]`); the conversions are moe-backend's
//! `experts::layout` permutations on host values (exact: pure data movement).

use crate::ModelError;

/// A release layout of a canonical tensor (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseLayout {
    /// Canonical `[E, 2F, H]` (rows `[gate; up]`) stored `[E, H, 2F]`, column `2f` gate row
    /// `f`, column `2f + 1` up row `f`.
    InterleavedGateUp,
    /// Canonical `[E, 2F]` (`[gate; up]`) stored `[E, 2F]` interleaved.
    InterleavedGateUpBias,
    /// Canonical `[E, H, F]` stored input-major `[E, F, H]` (the last two dims swapped).
    InputMajorExperts,
    /// Stored as the canonical tensor, stacked (never split per expert on export).
    Stacked,
}

fn error(name: &str, shape: &[usize], what: &str) -> ModelError {
    ModelError::TensorRead {
        name: name.to_owned(),
        reason: format!("release layout: shape {shape:?}: {what}"),
    }
}

impl ReleaseLayout {
    /// The stored shape of canonical shape `canonical` (`name` in errors).
    pub fn stored_shape(self, name: &str, canonical: &[usize]) -> Result<Vec<usize>, ModelError> {
        match (self, canonical) {
            (Self::InterleavedGateUp, &[e, f2, h]) if f2.is_multiple_of(2) => Ok(vec![e, h, f2]),
            (Self::InterleavedGateUpBias, &[e, f2]) if f2.is_multiple_of(2) => Ok(vec![e, f2]),
            (Self::InputMajorExperts, &[e, h, f]) => Ok(vec![e, f, h]),
            (Self::Stacked, s) => Ok(s.to_vec()),
            _ => Err(error(
                name,
                canonical,
                "a canonical shape this layout cannot hold",
            )),
        }
    }

    /// The canonical shape of stored shape `stored` (`name` in errors).
    pub fn canonical_shape(self, name: &str, stored: &[usize]) -> Result<Vec<usize>, ModelError> {
        match (self, stored) {
            (Self::InterleavedGateUp, &[e, h, f2]) if f2.is_multiple_of(2) => Ok(vec![e, f2, h]),
            (Self::InterleavedGateUpBias, &[e, f2]) if f2.is_multiple_of(2) => Ok(vec![e, f2]),
            (Self::InputMajorExperts, &[e, f, h]) => Ok(vec![e, h, f]),
            (Self::Stacked, s) => Ok(s.to_vec()),
            _ => Err(error(
                name,
                stored,
                "a stored shape this layout cannot hold",
            )),
        }
    }

    /// The canonical values of the stored `values` of shape `stored` (row-major).
    pub fn to_canonical<T: Copy>(
        self,
        name: &str,
        stored: &[usize],
        values: &[T],
    ) -> Result<Vec<T>, ModelError> {
        self.permute(name, stored, values, true)
    }

    /// The stored values of the canonical `values` of shape `canonical` (row-major).
    pub fn to_stored<T: Copy>(
        self,
        name: &str,
        canonical: &[usize],
        values: &[T],
    ) -> Result<Vec<T>, ModelError> {
        self.permute(name, canonical, values, false)
    }

    /// `out[dst(i)] = values[i]` (or the inverse) for the layout's permutation; `shape` is the
    /// shape of `values` (stored when `to_canonical`, canonical otherwise).
    fn permute<T: Copy>(
        self,
        name: &str,
        shape: &[usize],
        values: &[T],
        to_canonical: bool,
    ) -> Result<Vec<T>, ModelError> {
        let count = (shape.iter()).try_fold(1usize, |n, &d| n.checked_mul(d));
        if count != Some(values.len()) {
            return Err(error(
                name,
                shape,
                "a value count that does not match the shape",
            ));
        }
        let mut out = values.to_vec();
        match (self, shape) {
            (Self::Stacked, _) => {}
            // Interleaved column `c` of expert `e` ↔ canonical row `π⁻¹(c)`:
            // `c = 2f` ↔ gate row `f`, `c = 2f + 1` ↔ up row `F + f`.
            (Self::InterleavedGateUpBias, &[e, f2]) if f2.is_multiple_of(2) => {
                let f = f2 / 2;
                for x in 0..e {
                    for c in 0..f2 {
                        let r = if c % 2 == 0 { c / 2 } else { f + c / 2 };
                        let (s, d) = (x * f2 + c, x * f2 + r);
                        if to_canonical {
                            out[d] = values[s];
                        } else {
                            out[s] = values[d];
                        }
                    }
                }
            }
            (Self::InterleavedGateUp, dims) if dims.len() == 3 => {
                let (e, h, f2) = if to_canonical {
                    (dims[0], dims[1], dims[2])
                } else {
                    (dims[0], dims[2], dims[1])
                };
                if !f2.is_multiple_of(2) {
                    return Err(error(name, shape, "an odd gate/up width"));
                }
                let f = f2 / 2;
                for x in 0..e {
                    for i in 0..h {
                        for c in 0..f2 {
                            let r = if c % 2 == 0 { c / 2 } else { f + c / 2 };
                            // stored [x, i, c] ↔ canonical [x, r, i]
                            let s = (x * h + i) * f2 + c;
                            let d = (x * f2 + r) * h + i;
                            if to_canonical {
                                out[d] = values[s];
                            } else {
                                out[s] = values[d];
                            }
                        }
                    }
                }
            }
            (Self::InputMajorExperts, &[e, a, b]) => {
                // Swap the last two dims: `[e, a, b] → [e, b, a]` either way.
                for x in 0..e {
                    for i in 0..a {
                        for j in 0..b {
                            out[(x * b + j) * a + i] = values[(x * a + i) * b + j];
                        }
                    }
                }
            }
            _ => return Err(error(name, shape, "a shape this layout cannot hold")),
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Tensor, TensorData};
    use moe_backend::experts::layout::{fc1_bias_from_interleaved, fc1_from_interleaved};

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_into_vec::<f32>().unwrap()
    }

    /// The host permutations equal moe-backend's tensor ones and invert each other.
    #[test]
    fn release_layouts_match_moe_backend_and_round_trip() {
        let device = Device::flex();
        let (e, h, f) = (2, 3, 4);
        let stored: Vec<f32> = (0..e * h * 2 * f).map(|i| i as f32).collect();
        let t = Tensor::<3>::from_data(TensorData::new(stored.clone(), [e, h, 2 * f]), &device);
        let want = values(fc1_from_interleaved(t).unwrap());
        let l = ReleaseLayout::InterleavedGateUp;
        let got = l.to_canonical("w", &[e, h, 2 * f], &stored).unwrap();
        assert_eq!(got, want);
        assert_eq!(l.to_stored("w", &[e, 2 * f, h], &got).unwrap(), stored);
        assert_eq!(
            l.canonical_shape("w", &[e, h, 2 * f]).unwrap(),
            [e, 2 * f, h]
        );

        let bias: Vec<f32> = (0..e * 2 * f).map(|i| i as f32).collect();
        let t = Tensor::<2>::from_data(TensorData::new(bias.clone(), [e, 2 * f]), &device);
        let want = values(fc1_bias_from_interleaved(t).unwrap());
        let l = ReleaseLayout::InterleavedGateUpBias;
        let got = l.to_canonical("b", &[e, 2 * f], &bias).unwrap();
        assert_eq!(got, want);
        assert_eq!(l.to_stored("b", &[e, 2 * f], &got).unwrap(), bias);

        let down: Vec<f32> = (0..e * f * h).map(|i| i as f32).collect();
        let t = Tensor::<3>::from_data(TensorData::new(down.clone(), [e, f, h]), &device);
        let want = values(t.swap_dims(1, 2));
        let l = ReleaseLayout::InputMajorExperts;
        let got = l.to_canonical("d", &[e, f, h], &down).unwrap();
        assert_eq!(got, want);
        assert_eq!(l.to_stored("d", &[e, h, f], &got).unwrap(), down);
        assert!(l.to_canonical("d", &[e, f], &down[..e * f]).is_err());
    }
}
