//! Reading a request body into a typed struct: serde errors become a 400 that names the
//! field at fault (its path, as `messages[2].content`), and a field the struct does not
//! know is refused by name instead of being ignored.

use super::api_error::ApiError;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeMap;

/// Fields a body struct did not claim (its `#[serde(flatten)]` catch-all).
pub(crate) type Unknown = BTreeMap<String, Value>;

/// Parses `body` as JSON into `T`; a syntax error is a 400 without a field, a wrong type
/// or a missing field a 400 naming its path.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::status(400, format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::status(400, "the body must be a JSON object"));
    }
    from_value(v, "")
}

/// Reads `v` (found at `at`, "" for the body itself) into `T`, naming the failing path.
pub(crate) fn from_value<T: DeserializeOwned>(v: Value, at: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let inner = readable(&e.inner().to_string());
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        let field = match (at.is_empty(), path.is_empty()) {
            (true, _) => path,
            (false, true) => at.to_string(),
            (false, false) if path.starts_with('[') => format!("{at}{path}"),
            (false, false) => format!("{at}.{path}"),
        };
        if field.is_empty() {
            ApiError::status(400, inner)
        } else {
            ApiError::field(&field, inner)
        }
    })
}

/// serde's wording for the JSON types a client sends.
fn readable(msg: &str) -> String {
    msg.replace("expected f64", "expected a number")
        .replace("expected f32", "expected a number")
        .replace("expected u64", "expected a whole number >= 0")
        .replace("expected u32", "expected a whole number >= 0")
        .replace("expected usize", "expected a whole number >= 0")
        .replace("expected a sequence", "expected an array")
        .replace("expected a map", "expected an object")
}

/// Refuses the first unknown field that is not null, naming it with its path prefix
/// (`at`, "" at the top): `"logit_bias is not supported"`. A null counts as left out,
/// as clients send unset optional fields as null.
pub(crate) fn refuse_unknown(unknown: &Unknown, at: &str) -> Result<(), ApiError> {
    match unknown.iter().find(|(_, v)| !v.is_null()) {
        None => Ok(()),
        Some((k, _)) => {
            let field = if at.is_empty() {
                k.clone()
            } else {
                format!("{at}.{k}")
            };
            Err(ApiError {
                param: Some(field.clone()),
                ..ApiError::status(
                    400,
                    format!("{field} is not supported by this server (docs/api.md lists the fields it reads)"),
                )
            })
        }
    }
}
