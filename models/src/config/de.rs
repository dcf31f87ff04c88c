//! Serde plumbing shared by the `config.json` structs: the parse entry point that turns serde
//! errors into [`ModelError`]s naming the field, the `null` conventions HF configs use, and
//! the resolution of keys that have two accepted spellings.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_path_to_error::Segment;

use crate::ModelError;

/// Parses `text` (a JSON object) into `T`; errors name the offending field.
///
/// `model_type` is checked against `expected` before anything else, so a config of another
/// model family is reported as such rather than by its first unfamiliar field.
pub(crate) fn parse<T: DeserializeOwned>(
    text: &str,
    expected: &'static str,
) -> Result<T, ModelError> {
    let value: Value = serde_json::from_str(text).map_err(|e| ModelError::InvalidJson {
        reason: e.to_string(),
    })?;
    if !value.is_object() {
        return Err(ModelError::InvalidJson {
            reason: format!("top level is {}, not an object", describe(&value)),
        });
    }
    let head: ModelTypeJson = deserialize("", &value)?;
    check_model_type(head.model_type.as_deref(), expected)?;
    deserialize("", &value)
}

/// Just the `model_type` of a config, read ahead of the rest.
#[derive(Deserialize)]
struct ModelTypeJson {
    #[serde(default)]
    model_type: Option<String>,
}

/// [`ModelError::WrongModelType`] unless `found` is `expected`.
pub(crate) fn check_model_type(
    found: Option<&str>,
    expected: &'static str,
) -> Result<(), ModelError> {
    match found {
        Some(t) if t == expected => Ok(()),
        found => Err(ModelError::WrongModelType {
            expected,
            found: found.map_or_else(|| "absent".to_owned(), |t| format!("\"{t}\"")),
        }),
    }
}

/// Deserializes `value`, found at field `at` (empty for the top level), into `T`.
pub(crate) fn deserialize<T: DeserializeOwned>(at: &str, value: &Value) -> Result<T, ModelError> {
    serde_path_to_error::deserialize(value).map_err(|e| field_error(at, value, e))
}

/// A serde error as the [`ModelError`] that names the field it was found at.
///
/// Field names are the dotted object keys (`rope_parameters.factor`); a list index is reported
/// after the value found (`mlp_only_layers` … `found -1 at index 1`).
fn field_error(
    at: &str,
    root: &Value,
    err: serde_path_to_error::Error<serde_json::Error>,
) -> ModelError {
    let mut field = at.to_owned();
    let mut index = None;
    let mut found = Some(root);
    for segment in err.path().iter() {
        match segment {
            Segment::Map { key } => {
                if !field.is_empty() {
                    field.push('.');
                }
                field.push_str(key);
                found = found.and_then(|v| v.get(key));
            }
            Segment::Seq { index: i } => {
                index = Some(*i);
                found = found.and_then(|v| v.get(*i));
            }
            Segment::Enum { .. } | Segment::Unknown => found = None,
        }
    }
    let message = err.into_inner().to_string();
    let expected = message
        .rsplit_once(", expected ")
        .and_then(|(_, e)| expectation(e));
    match (expected, found) {
        (Some(expected), Some(found)) => ModelError::WrongType {
            field,
            expected,
            found: match index {
                Some(i) => format!("{} at index {i}", describe(found)),
                None => describe(found),
            },
        },
        _ => ModelError::InvalidValue {
            field,
            reason: message,
        },
    }
}

/// Our wording of serde's "expected …" for the types the config structs use.
fn expectation(serde_expected: &str) -> Option<&'static str> {
    Some(match serde_expected {
        "usize" | "u64" => "a non-negative integer",
        "f64" => "a number",
        "a boolean" => "a boolean",
        "a string" => "a string",
        "a sequence" => "a list",
        OBJECT_OR_NULL => OBJECT_OR_NULL,
        _ => return None,
    })
}

/// The `expecting` of nested config objects that may also be `null`.
pub(crate) const OBJECT_OR_NULL: &str = "an object or null";

/// A short rendering of a JSON value for error messages.
pub(crate) fn describe(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 60 {
        let cut = (0..=57).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// `deserialize_with` for a field where `null` means the same as absent and the default is
/// the type's default (`false`, `[]`): pair it with `#[serde(default)]`.
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `deserialize_with` for a boolean where `null` means the same as absent and the default is
/// `true`: pair it with `#[serde(default = "yes")]`.
pub(crate) fn null_as_true<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(true))
}

/// `#[serde(default = "yes")]`.
pub(crate) fn yes() -> bool {
    true
}

/// `deserialize_with` for an optional field whose value, when present, must not be `null`
/// (`None` only when absent): pair it with `#[serde(default)]`.
pub(crate) fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// One concept spelled two ways (`first` | `second`): the value of whichever is present.
/// Both present with different values is [`ModelError::ConflictingFields`].
pub(crate) fn either<T: PartialEq + ToString>(
    (first, a): (&'static str, Option<T>),
    (second, b): (&'static str, Option<T>),
) -> Result<Option<T>, ModelError> {
    match (a, b) {
        (Some(a), Some(b)) if a != b => Err(ModelError::ConflictingFields {
            first,
            second,
            a: a.to_string(),
            b: b.to_string(),
        }),
        (a, b) => Ok(a.or(b)),
    }
}

/// Rejects any `hidden_act` but SiLU (`null` and absent mean HF's default, `"silu"`).
pub(crate) fn check_silu(hidden_act: Option<&str>) -> Result<(), ModelError> {
    match hidden_act {
        Some(act) if act != "silu" => Err(ModelError::invalid(
            "hidden_act",
            format!("\"{act}\" is not supported (only \"silu\")"),
        )),
        _ => Ok(()),
    }
}

/// Defines one `fn name() -> T` per HF class default, for `#[serde(default = "...")]` and for
/// the public configs' `Default` impls (one source for each number).
macro_rules! hf_defaults {
    ($($name:ident: $ty:ty = $value:expr;)*) => {
        $(pub(super) fn $name() -> $ty { $value })*
    };
}
pub(crate) use hf_defaults;
