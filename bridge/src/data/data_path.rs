//! Megatron's `--data-path` list: one dataset prefix, or `weight prefix` pairs.
//!
//! Follows `get_blend_from_list` in megatron-core 0.19.2 `megatron/core/datasets/utils.py`:
//! weights are Python floats (need not sum to 1), prefixes are stripped of surrounding
//! whitespace. Stricter than Megatron: where Megatron silently reads a list whose "weights" do
//! not parse as a list of unweighted prefixes (blended by dataset size), this refuses it, as it
//! does an odd count above one, a weight that is negative, zero (Megatron's `BlendedDataset`
//! asserts every weight is positive), infinite or NaN, an empty prefix and weights whose sum
//! overflows.

use std::path::PathBuf;

use crate::BridgeError;

/// A parsed `--data-path`: the prefixes and, for the `weight prefix ...` form, their weights as
/// given (not normalised).
#[derive(Debug, Clone, PartialEq)]
pub struct DataBlend {
    /// The dataset prefixes (`<prefix>.idx` / `<prefix>.bin`), in order.
    pub prefixes: Vec<PathBuf>,
    /// One weight per prefix, `None` for a lone prefix.
    pub weights: Option<Vec<f64>>,
}

/// Parses Megatron's `--data-path` forms: `prefix` alone, or `w1 p1 w2 p2 ...`.
pub fn parse_data_path(args: &[String]) -> Result<DataBlend, BridgeError> {
    let fail = |position: usize, item: &str, reason: &str| BridgeError::InvalidDataPath {
        position,
        item: item.to_string(),
        reason: reason.to_string(),
    };
    let prefix = |position: usize, item: &str| {
        let trimmed = item.trim();
        if trimmed.is_empty() {
            return Err(fail(position, item, "empty dataset prefix"));
        }
        Ok(PathBuf::from(trimmed))
    };
    match args {
        [] => Err(fail(
            0,
            "",
            "no dataset: give a prefix, or `weight prefix` pairs",
        )),
        [single] => Ok(DataBlend {
            prefixes: vec![prefix(1, single)?],
            weights: None,
        }),
        _ if args.len() % 2 == 1 => Err(fail(
            args.len(),
            args.last().map(String::as_str).unwrap_or_default(),
            &format!(
                "{} items: several datasets are given as `weight prefix` pairs, so the count \
                 must be even",
                args.len()
            ),
        )),
        _ => {
            let mut prefixes = Vec::with_capacity(args.len() / 2);
            let mut weights = Vec::with_capacity(args.len() / 2);
            for (pair, chunk) in args.chunks_exact(2).enumerate() {
                let [weight_item, prefix_item] = chunk else {
                    continue;
                };
                let position = 2 * pair + 1;
                let weight: f64 = weight_item.trim().parse().map_err(|_| {
                    fail(
                        position,
                        weight_item,
                        "not a number: several datasets are given as `weight prefix` pairs",
                    )
                })?;
                if !weight.is_finite() {
                    return Err(fail(position, weight_item, "weight is not finite"));
                }
                if weight < 0.0 {
                    return Err(fail(position, weight_item, "negative weight"));
                }
                if weight == 0.0 {
                    return Err(fail(
                        position,
                        weight_item,
                        "zero weight (Megatron requires every weight > 0; leave the dataset out)",
                    ));
                }
                weights.push(weight);
                prefixes.push(prefix(position + 1, prefix_item)?);
            }
            let total: f64 = weights.iter().sum();
            if !(total.is_finite() && total > 0.0) {
                return Err(fail(
                    1,
                    args.first().map(String::as_str).unwrap_or_default(),
                    &format!("the weights sum to {total}, not a positive finite number"),
                ));
            }
            Ok(DataBlend {
                prefixes,
                weights: Some(weights),
            })
        }
    }
}
