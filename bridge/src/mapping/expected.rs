//! The HF tensors a model's `config.json` implies: name, shape and role of every tensor the model
//! loads, with the optional FP8 `*_scale_inv` companions of every matrix
//! (docs/checkpoints.md §FP8 release format). The tables themselves are the models' (moe-models
//! declares one per family and hands it over through [`ModelSchema::expected_hf_tensors`]); this
//! module holds their types and the checked [`ExpectedBuilder`] they are written with.
//!
//! This is the shape source of checkpoint validation ([`HfCheckpoint::check`]): a weight the
//! table requires must be present with exactly this shape; a tensor the table does not list is
//! one the model does not use.
//!
//! [`HfCheckpoint::check`]: crate::hf::HfCheckpoint::check
//! [`ModelSchema::expected_hf_tensors`]: crate::schema::ModelSchema::expected_hf_tensors

use std::collections::BTreeMap;
use std::path::Path;

use crate::BridgeError;
use crate::fp8::{scale_inv_name, scale_shape};

/// Most HF tensors a config may imply (DeepSeek-V3 has about 92 000 with its scales).
pub const MAX_TENSORS: u128 = 10_000_000;
/// Most parameters a config may imply (2⁵⁰ ≈ 1.1·10¹⁵, three orders above the largest
/// released MoE models): beyond this the config is taken to be corrupt.
pub const MAX_ELEMENTS: u128 = 1 << 50;

/// What an expected tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfRole {
    /// A model weight: any float dtype, or a one-byte (FP8) dtype with a `_scale_inv`.
    Weight,
    /// The FP8 inverse scale of the weight named by [`ExpectedHf::scale_of`]: a float dtype
    /// (or `F8_E8M0`), shape `[.., ceil(M/b0), ceil(N/b1)]`.
    ScaleInv,
}

/// One HF tensor a config implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedHf {
    /// Shape, PyTorch `[out, in]` orientation.
    pub shape: Vec<usize>,
    /// Whether the model cannot load without it (`false`: a tied `lm_head`, DeepSeek-V3's
    /// MTP copies of `embed_tokens` / `shared_head.head`, FP8 scales).
    pub required: bool,
    /// Weight or FP8 scale.
    pub role: HfRole,
    /// For a scale: the weight it scales.
    pub scale_of: Option<String>,
    /// For a weight a release may store as an MXFP4 pair (`<name>_blocks`, `<name>_scales`,
    /// [`crate::mxfp4`]): the shape of the stored matrix those blocks decode to (its last dim
    /// the blocked input width), which may differ from `shape` by the model's orientation.
    pub mxfp4: Option<Vec<usize>>,
}

/// Expected HF tensors by name.
pub type ExpectedTable = BTreeMap<String, ExpectedHf>;

/// Collects an [`ExpectedTable`] with checked arithmetic: every size product and sum is
/// checked, and the table is bounded ([`MAX_TENSORS`], [`MAX_ELEMENTS`]), so an absurd config
/// is an [`BridgeError::InvalidConfig`] naming the field rather than an overflow, a huge
/// allocation or a hang. The models' tables are written with it.
pub struct ExpectedBuilder<'a> {
    path: &'a Path,
    table: ExpectedTable,
    elements: u128,
    block: [usize; 2],
}

impl<'a> ExpectedBuilder<'a> {
    /// An empty table for the config at `path` (named in errors), FP8 scale companions of
    /// every matrix for block size `block`.
    pub fn new(path: &'a Path, block: [usize; 2]) -> Self {
        Self {
            path,
            table: BTreeMap::new(),
            elements: 0,
            block,
        }
    }

    fn too_big(&self, field: &str, reason: String) -> BridgeError {
        BridgeError::InvalidConfig {
            path: self.path.to_path_buf(),
            field: field.to_owned(),
            reason,
        }
    }

    /// `a · b`, an error naming `what` when it overflows.
    pub fn mul(&self, a: usize, b: usize, what: &str) -> Result<usize, BridgeError> {
        a.checked_mul(b)
            .ok_or_else(|| self.too_big(what, format!("{a} · {b} overflows")))
    }

    /// `a + b`, an error naming `what` when it overflows.
    pub fn add(&self, a: usize, b: usize, what: &str) -> Result<usize, BridgeError> {
        a.checked_add(b)
            .ok_or_else(|| self.too_big(what, format!("{a} + {b} overflows")))
    }

    /// Adds weight `name` of `shape` (`required`: the model cannot load without it) and, for
    /// a matrix, its optional FP8 `_scale_inv` companion.
    pub fn insert(
        &mut self,
        name: String,
        shape: Vec<usize>,
        required: bool,
    ) -> Result<(), BridgeError> {
        let numel = shape
            .iter()
            .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
            .unwrap_or(u128::MAX);
        self.elements = self.elements.saturating_add(numel);
        if self.elements > MAX_ELEMENTS {
            return Err(self.too_big(
                "(sizes)",
                format!(
                    "the config implies more than {MAX_ELEMENTS} parameters (reached at \
                     `{name}` {shape:?}); its sizes are not plausible"
                ),
            ));
        }
        if shape.len() >= 2
            && let Some(scale) = scale_shape(&shape, self.block)
        {
            self.table.insert(
                scale_inv_name(&name),
                ExpectedHf {
                    shape: scale,
                    required: false,
                    role: HfRole::ScaleInv,
                    scale_of: Some(name.clone()),
                    mxfp4: None,
                },
            );
        }
        self.table.insert(
            name,
            ExpectedHf {
                shape,
                required,
                role: HfRole::Weight,
                scale_of: None,
                mxfp4: None,
            },
        );
        Ok(())
    }

    /// A required weight `name` of `shape` that may instead be stored as an MXFP4 pair whose
    /// blocks decode to a matrix of shape `stored` ([`ExpectedHf::mxfp4`]).
    pub fn weight_or_mxfp4(
        &mut self,
        name: String,
        shape: Vec<usize>,
        stored: Vec<usize>,
    ) -> Result<(), BridgeError> {
        self.insert(name.clone(), shape, true)?;
        if let Some(entry) = self.table.get_mut(&name) {
            entry.mxfp4 = Some(stored);
        }
        Ok(())
    }

    /// A required weight `name` of `shape`.
    pub fn weight(&mut self, name: String, shape: Vec<usize>) -> Result<(), BridgeError> {
        self.insert(name, shape, true)
    }

    /// `{prefix}.weight [out, in]` and, with `bias`, `{prefix}.bias [out]`.
    pub fn linear(
        &mut self,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<(), BridgeError> {
        self.weight(format!("{prefix}.weight"), vec![d_out, d_in])?;
        if bias {
            self.weight(format!("{prefix}.bias"), vec![d_out])?;
        }
        Ok(())
    }

    /// A norm weight `{prefix}.weight [size]`.
    pub fn norm(&mut self, prefix: &str, size: usize) -> Result<(), BridgeError> {
        self.weight(format!("{prefix}.weight"), vec![size])
    }

    /// `layers` layers of about `per_layer` tensors each: fails when the table would exceed
    /// [`MAX_TENSORS`].
    pub fn bound(&self, layers: usize, per_layer: u128, field: &str) -> Result<(), BridgeError> {
        // ×2 for the scale companions.
        let count = (layers as u128)
            .saturating_mul(per_layer.saturating_mul(2))
            .saturating_add(8);
        if count > MAX_TENSORS {
            return Err(self.too_big(
                field,
                format!(
                    "implies about {count} tensors (more than {MAX_TENSORS}); the config is \
                     not plausible"
                ),
            ));
        }
        Ok(())
    }

    /// The table.
    pub fn finish(self) -> ExpectedTable {
        self.table
    }
}
