//! Typed field access on a `config.json` object, with errors that name the field.
//!
//! Every accessor *removes* the key it reads, so after parsing the object holds exactly the keys
//! no parser understood; those are kept verbatim for export (models.md §2).

use serde_json::{Map, Value};

use crate::ModelError;

/// A JSON object being taken apart field by field.
#[derive(Debug)]
pub(crate) struct JsonObject {
    map: Map<String, Value>,
    /// Prefix for field names in errors, e.g. `rope_parameters.` for a nested object.
    prefix: &'static str,
}

impl JsonObject {
    /// Parses `text`, which must be a JSON object.
    pub(crate) fn parse(text: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::InvalidJson {
            reason: e.to_string(),
        })?;
        match value {
            Value::Object(map) => Ok(Self { map, prefix: "" }),
            other => Err(ModelError::InvalidJson {
                reason: format!("top level is {}, not an object", describe(&other)),
            }),
        }
    }

    /// Takes `key` as a nested object; `None` if absent or `null`.
    pub(crate) fn object(
        &mut self,
        key: &'static str,
        prefix: &'static str,
    ) -> Result<Option<JsonObject>, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(map)) => Ok(Some(JsonObject { map, prefix })),
            Some(other) => Err(self.wrong_type(key, "an object or null", &other)),
        }
    }

    /// Removes and returns the raw value under `key`.
    pub(crate) fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key)
    }

    /// Whether `key` is present (possibly `null`).
    pub(crate) fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// Whether `key` is present and `null`.
    pub(crate) fn is_null(&self, key: &str) -> bool {
        matches!(self.map.get(key), Some(Value::Null))
    }

    /// The keys nobody consumed.
    pub(crate) fn into_remaining(self) -> Map<String, Value> {
        self.map
    }

    /// A non-negative integer; `None` if absent. `null` is rejected.
    pub(crate) fn opt_usize(&mut self, key: &'static str) -> Result<Option<usize>, ModelError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => self.as_usize(key, &v).map(Some),
        }
    }

    /// A non-negative integer; `None` if absent or `null`.
    pub(crate) fn nullable_usize(
        &mut self,
        key: &'static str,
    ) -> Result<Option<usize>, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => self.as_usize(key, &v).map(Some),
        }
    }

    /// A non-negative integer, `default` if absent.
    pub(crate) fn usize_or(
        &mut self,
        key: &'static str,
        default: usize,
    ) -> Result<usize, ModelError> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    /// A number (integers accepted); `None` if absent or `null`.
    pub(crate) fn nullable_f64(&mut self, key: &'static str) -> Result<Option<f64>, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x)),
                None => Err(self.wrong_type(key, "a number", &v)),
            },
        }
    }

    /// A number (integers accepted), `default` if absent. `null` is rejected.
    pub(crate) fn f64_or(&mut self, key: &'static str, default: f64) -> Result<f64, ModelError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.wrong_type(key, "a number", &v)),
        }
    }

    /// A boolean, `default` if absent or `null`.
    pub(crate) fn bool_or(&mut self, key: &'static str, default: bool) -> Result<bool, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(b),
            Some(other) => Err(self.wrong_type(key, "a boolean", &other)),
        }
    }

    /// A string; `None` if absent or `null`.
    pub(crate) fn string(&mut self, key: &'static str) -> Result<Option<String>, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong_type(key, "a string", &other)),
        }
    }

    /// A list of non-negative integers; empty if absent or `null`.
    pub(crate) fn usize_list(&mut self, key: &'static str) -> Result<Vec<usize>, ModelError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| usize::try_from(x).ok())
                        .ok_or_else(|| self.wrong_type(key, "a list of non-negative integers", v))
                })
                .collect(),
            Some(other) => Err(self.wrong_type(key, "a list of non-negative integers", &other)),
        }
    }

    /// One concept spelled two ways (`first` | `second`): the value of whichever is present.
    /// Both present with different values is an error naming both.
    pub(crate) fn either_usize(
        &mut self,
        first: &'static str,
        second: &'static str,
    ) -> Result<Option<usize>, ModelError> {
        let a = self.opt_usize(first)?;
        let b = self.opt_usize(second)?;
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

    /// One string concept spelled two ways; as [`Self::either_usize`].
    pub(crate) fn either_string(
        &mut self,
        first: &'static str,
        second: &'static str,
    ) -> Result<Option<String>, ModelError> {
        let a = self.string(first)?;
        let b = self.string(second)?;
        match (a, b) {
            (Some(a), Some(b)) if a != b => Err(ModelError::ConflictingFields {
                first,
                second,
                a,
                b,
            }),
            (a, b) => Ok(a.or(b)),
        }
    }

    /// The field name as it appears in errors (with the nesting prefix).
    pub(crate) fn field(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn as_usize(&self, key: &str, v: &Value) -> Result<usize, ModelError> {
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> ModelError {
        ModelError::WrongType {
            field: self.field(key),
            expected,
            found: describe(found),
        }
    }
}

/// A short rendering of a JSON value for error messages.
fn describe(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 60 {
        let cut = (0..=57).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push_str("...");
    }
    s
}
