//! Completeness report of an HF checkpoint against the canonical tensors a model expects, like
//! transformers' loading info (docs/checkpoints.md §Name mapping): missing, unexpected, mismatched,
//! duplicate.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use super::registry::{ExpertLayout, Registry};
use super::rule::HfTarget;
use crate::BridgeError;
use crate::safetensors::Dtype;

/// What the model expects of one canonical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// Canonical shape (stacked experts: `[E, 2, Im, H]` / `[E, H, Im]`).
    pub shape: Vec<usize>,
    /// Required HF dtype, if any (leave `None` for FP8 sources, whose stored dtype differs).
    pub dtype: Option<Dtype>,
}

/// One HF tensor whose shape, dtype or expert index does not fit its canonical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The HF tensor.
    pub hf: String,
    /// The canonical tensor it maps to.
    pub canon: String,
    /// What does not fit.
    pub reason: String,
}

/// The outcome of matching a checkpoint's keys against a model.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoadReport {
    /// The checkpoint's expert layout (`None`: no routed experts).
    pub layout: Option<ExpertLayout>,
    /// Canonical tensors not fully produced (some HF piece absent).
    pub missing: Vec<String>,
    /// HF keys consumed by no rule, or mapping to a canonical tensor the model lacks.
    pub unexpected: Vec<String>,
    /// HF tensors of the wrong shape or dtype, or with an out-of-range expert index.
    pub mismatched: Vec<Mismatch>,
    /// HF keys that map to a canonical piece another key already provides.
    pub duplicate: Vec<String>,
    /// HF keys deliberately ignored (scales, RoPE buffers, MTP copies).
    pub ignored: Vec<String>,
}

/// Identifies what one HF tensor provides: the canonical name plus expert and part.
type PieceKey = (String, Option<usize>, Option<usize>);

impl LoadReport {
    /// Matches `hf` tensors (name, dtype, shape) against `expected` canonical tensors through
    /// `registry`. Fails only when the checkpoint mixes expert layouts; everything else is
    /// reported. `path` names the checkpoint in errors.
    pub fn build<'a>(
        registry: &Registry,
        hf: impl IntoIterator<Item = (&'a str, Dtype, &'a [usize])>,
        expected: &BTreeMap<String, ExpectedTensor>,
        path: &Path,
    ) -> Result<Self, BridgeError> {
        let mut entries: Vec<(&str, Dtype, &[usize])> = hf.into_iter().collect();
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let layout = registry.detect_layout(entries.iter().map(|e| e.0), path)?;
        let mut report = LoadReport {
            layout,
            ..Self::default()
        };
        let mut produced: BTreeSet<PieceKey> = BTreeSet::new();
        for (name, dtype, shape) in entries {
            let Some(resolved) = registry.hf_to_canon(name) else {
                report.unexpected.push(name.to_owned());
                continue;
            };
            if let HfTarget::Ignored { .. } = resolved.target {
                report.ignored.push(name.to_owned());
                continue;
            }
            let canon = resolved.target.canon().unwrap_or_default().to_owned();
            let Some(want) = expected.get(&canon) else {
                report.unexpected.push(name.to_owned());
                continue;
            };
            let mismatch = |reason: String| Mismatch {
                hf: name.to_owned(),
                canon: canon.clone(),
                reason,
            };
            let (key, piece_shape) = match piece_of(&resolved.target, &want.shape) {
                Ok(found) => found,
                Err(reason) => {
                    report.mismatched.push(mismatch(reason));
                    continue;
                }
            };
            if piece_shape != shape {
                report.mismatched.push(mismatch(format!(
                    "shape {shape:?}, expected {piece_shape:?}"
                )));
            } else if want.dtype.is_some_and(|d| d != dtype) {
                let want_dtype = want.dtype.map_or_else(String::new, |d| d.to_string());
                report
                    .mismatched
                    .push(mismatch(format!("dtype {dtype}, expected {want_dtype}")));
            }
            if !produced.insert(key) {
                report.duplicate.push(name.to_owned());
            }
        }
        let layout = layout.unwrap_or(ExpertLayout::PerExpert);
        for (canon, want) in expected {
            let num_experts = want.shape.first().copied().unwrap_or(0);
            let complete = registry
                .canon_to_hf(canon, num_experts, layout)
                .is_some_and(|r| {
                    r.pieces
                        .iter()
                        .all(|p| produced.contains(&(canon.clone(), p.expert, p.part)))
                });
            if !complete {
                report.missing.push(canon.clone());
            }
        }
        Ok(report)
    }

    /// No missing, unexpected, mismatched or duplicate tensors.
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.mismatched.is_empty()
            && self.duplicate.is_empty()
    }

    /// Strict mode: the report itself when clean, else [`BridgeError::IncompleteCheckpoint`]
    /// with a summary naming the first few offending tensors.
    pub fn into_strict(self, path: &Path) -> Result<Self, BridgeError> {
        if self.is_clean() {
            return Ok(self);
        }
        Err(BridgeError::IncompleteCheckpoint {
            path: path.to_path_buf(),
            summary: self.to_string(),
        })
    }
}

/// The canonical piece an HF tensor provides and the HF shape it must have.
fn piece_of(target: &HfTarget, canon_shape: &[usize]) -> Result<(PieceKey, Vec<usize>), String> {
    match target {
        HfTarget::Direct { canon, .. } => Ok(((canon.clone(), None, None), canon_shape.to_vec())),
        HfTarget::ExpertSlice {
            canon,
            expert,
            part,
        } => {
            let (&num_experts, rest) = canon_shape
                .split_first()
                .ok_or_else(|| "canonical tensor is a scalar".to_owned())?;
            if *expert >= num_experts {
                return Err(format!("expert {expert} out of range (E = {num_experts})"));
            }
            let shape = match part {
                Some(p) => {
                    let (&parts, inner) = rest
                        .split_first()
                        .ok_or_else(|| "canonical tensor has no part dimension".to_owned())?;
                    if *p >= parts {
                        return Err(format!("part {p} out of range ({parts} parts)"));
                    }
                    inner.to_vec()
                }
                None => rest.to_vec(),
            };
            Ok(((canon.clone(), Some(*expert), *part), shape))
        }
        HfTarget::Fused { canon, split_parts } => {
            let shape = match split_parts {
                Some(parts) => match canon_shape {
                    [e, p, inner, tail @ ..] if p == parts => {
                        let mut s = vec![*e, p * inner];
                        s.extend_from_slice(tail);
                        s
                    }
                    _ => {
                        return Err(format!(
                            "canonical shape {canon_shape:?} has no {parts} parts"
                        ));
                    }
                },
                None => canon_shape.to_vec(),
            };
            Ok(((canon.clone(), None, None), shape))
        }
        HfTarget::Ignored { .. } => Err("ignored tensor".to_owned()),
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn list(f: &mut fmt::Formatter<'_>, label: &str, names: &[String]) -> fmt::Result {
            if names.is_empty() {
                return Ok(());
            }
            let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
            let more = names.len().saturating_sub(shown.len());
            write!(f, "{label} ({}): {}", names.len(), shown.join(", "))?;
            if more > 0 {
                write!(f, ", … {more} more")?;
            }
            f.write_str("; ")
        }
        list(f, "missing", &self.missing)?;
        list(f, "unexpected", &self.unexpected)?;
        let mismatched: Vec<String> = self
            .mismatched
            .iter()
            .map(|m| format!("{} ({})", m.hf, m.reason))
            .collect();
        list(f, "mismatched", &mismatched)?;
        list(f, "duplicate", &self.duplicate)?;
        if self.is_clean() {
            f.write_str("clean")?;
        }
        Ok(())
    }
}
