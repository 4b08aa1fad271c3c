//! Reading a Hugging Face `config.json`: the text parsed with its `model_type` checked, typed
//! fields with errors that name the file and field, and the size limits that keep a config
//! file from making amprobe set aside memory beyond any real checkpoint's.

use crate::error::{Error, Result};
use std::path::Path;

/// A `config.json`'s text parsed, its `model_type` required to be `model_type`; errors
/// name the file.
pub(crate) fn config_json(text: &str, path: &Path, model_type: &str) -> Result<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::config(path.display().to_string(), format!("not valid JSON: {e}")))?;
    let mt = field(&v, path, "model_type")?.as_str().unwrap_or("");
    if mt != model_type {
        return Err(Error::config(
            format!("{}: model_type", path.display()),
            format!("`{mt}` is not supported (expected `{model_type}`)"),
        ));
    }
    Ok(v)
}

pub(crate) fn field<'a>(
    v: &'a serde_json::Value,
    path: &Path,
    name: &str,
) -> Result<&'a serde_json::Value> {
    v.get(name)
        .ok_or_else(|| Error::config(format!("{}: {name}", path.display()), "missing"))
}

pub(crate) fn usize_field(v: &serde_json::Value, path: &Path, name: &str) -> Result<usize> {
    field(v, path, name)?
        .as_u64()
        .filter(|&n| n > 0)
        .map(|n| n as usize)
        .ok_or_else(|| {
            Error::config(
                format!("{}: {name}", path.display()),
                "expected a positive integer",
            )
        })
}

/// A true/false field of a `config.json` (at `path`), `default` when absent or null.
pub(crate) fn bool_field(
    v: &serde_json::Value,
    path: &Path,
    name: &str,
    default: bool,
) -> Result<bool> {
    match v.get(name) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(x) => x.as_bool().ok_or_else(|| {
            Error::config(
                format!("{}: {name}", path.display()),
                "expected true or false",
            )
        }),
    }
}

/// A dropout probability of a `config.json` (at `path`), `default` when absent or null.
pub(crate) fn prob_field(
    v: &serde_json::Value,
    path: &Path,
    name: &str,
    default: f64,
) -> Result<f64> {
    match v.get(name) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(x) => match x.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => Ok(p),
            _ => Err(Error::config(
                format!("{}: {name}", path.display()),
                format!("{x} is not a dropout probability in [0, 1)"),
            )),
        },
    }
}

/// Refuses a `config.json` (at `path`) that describes more layers than `max_layers` (its
/// field `name` holds `layers`) or more than `max_params` parameters (`params`, `None` past
/// 2^64): a config file alone cannot make amprobe set aside memory beyond any real
/// checkpoint's.
pub(crate) fn check_size(
    path: &Path,
    (name, layers, max_layers): (&str, usize, usize),
    params: Option<u64>,
    max_params: u64,
) -> Result<()> {
    if layers > max_layers {
        return Err(Error::config(
            format!("{}: {name}", path.display()),
            format!("{layers} layers; at most {max_layers} are supported"),
        ));
    }
    match params {
        Some(n) if n <= max_params => Ok(()),
        n => Err(Error::config(
            path.display().to_string(),
            format!(
                "the model it describes has {} parameters; at most {max_params} are supported",
                n.map_or("more than 2^64".to_string(), |n| n.to_string())
            ),
        )),
    }
}
