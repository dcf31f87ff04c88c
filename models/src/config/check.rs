//! The checks every family's config shares (the Llama-style fields: sizes, heads, norms,
//! loss coefficients), each a typed [`ModelError`] naming the field, so that every family
//! words the same fault the same way (transformers' `PretrainedConfig` validation and the
//! `__post_init__`s of its Llama-derived configs).

use std::path::Path;

use crate::ModelError;

/// Reads the `config.json` at `path` and parses it with `parse`; errors carry the path.
pub(crate) fn read_config_file<T>(
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T, ModelError>,
) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|e| e.in_file(path))
}

/// Refuses the first size field of `fields` that is 0.
pub(crate) fn positive(fields: &[(&'static str, usize)]) -> Result<(), ModelError> {
    match fields.iter().find(|(_, value)| *value == 0) {
        Some((field, _)) => Err(ModelError::invalid(*field, "must be positive, got 0")),
        None => Ok(()),
    }
}

/// Refuses `num_key_value_heads` not dividing `num_attention_heads` (GQA groups).
pub(crate) fn kv_heads_divide(heads: usize, kv_heads: usize) -> Result<(), ModelError> {
    if !heads.is_multiple_of(kv_heads) {
        return Err(ModelError::invalid(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads = {heads}"),
        ));
    }
    Ok(())
}

/// Refuses a field that is not a positive finite number (e.g. `rms_norm_eps`).
pub(crate) fn positive_number(field: &'static str, value: f64) -> Result<(), ModelError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(ModelError::invalid(
            field,
            format!("must be a positive number, got {value}"),
        ));
    }
    Ok(())
}

/// Refuses a field that is not a non-negative finite number (e.g. `router_aux_loss_coef`).
pub(crate) fn non_negative_number(field: &'static str, value: f64) -> Result<(), ModelError> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(ModelError::invalid(
            field,
            format!("must be a non-negative number, got {value}"),
        ));
    }
    Ok(())
}

/// Refuses a training-time noise field (dropout, router jitter) other than 0: training with it
/// would not be HF's.
pub(crate) fn zero_in_training(field: &'static str, value: f64) -> Result<(), ModelError> {
    if value != 0.0 {
        return Err(ModelError::invalid(
            field,
            format!("{value} is not supported (only 0: training would not be HF's)"),
        ));
    }
    Ok(())
}

/// `hidden_size / num_attention_heads` (the head size of a config without `head_dim`), which
/// must divide exactly.
pub(crate) fn derived_head_dim(hidden_size: usize, heads: usize) -> Result<usize, ModelError> {
    if heads == 0 {
        return Err(ModelError::invalid(
            "num_attention_heads",
            "must be positive, got 0",
        ));
    }
    if !hidden_size.is_multiple_of(heads) {
        return Err(ModelError::invalid(
            "hidden_size",
            format!(
                "{hidden_size} is not divisible by num_attention_heads = {heads} \
                 (and head_dim is absent)"
            ),
        ));
    }
    Ok(hidden_size / heads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_names_its_field() {
        let err = |r: Result<(), ModelError>| r.unwrap_err().to_string();
        assert!(err(positive(&[("a", 1), ("head_dim", 0)])).contains("head_dim"));
        assert!(positive(&[("a", 1)]).is_ok());
        assert!(err(kv_heads_divide(8, 3)).contains("num_key_value_heads"));
        assert!(kv_heads_divide(8, 4).is_ok());
        assert!(err(positive_number("rms_norm_eps", f64::NAN)).contains("rms_norm_eps"));
        assert!(err(positive_number("rms_norm_eps", 0.0)).contains("rms_norm_eps"));
        assert!(err(non_negative_number("coef", -1e-3)).contains("coef"));
        assert!(non_negative_number("coef", 0.0).is_ok());
        assert!(err(zero_in_training("attention_dropout", 0.1)).contains("attention_dropout"));
        assert_eq!(derived_head_dim(64, 8).unwrap(), 8);
        assert!(
            derived_head_dim(64, 6)
                .unwrap_err()
                .to_string()
                .contains("hidden_size")
        );
        assert!(derived_head_dim(64, 0).is_err());
    }
}
