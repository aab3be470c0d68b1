//! Reading typed fields out of the config's JSON, each error naming the field by its JSON
//! path and the value found.

use super::limits::{DIM_LIMITS, FLOAT_RANGES};
use anyhow::{anyhow, bail, Result};
use serde_json::{Map, Value};

/// A JSON object together with its path, so that errors can name fields fully.
pub(super) struct Obj<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) path: String,
}

impl<'a> Obj<'a> {
    pub(super) fn new(v: &'a Value, path: &str) -> Result<Obj<'a>> {
        match v {
            Value::Object(map) => Ok(Obj {
                map,
                path: path.to_string(),
            }),
            other => bail!(
                "{}: expected an object, got {}",
                display_path(path),
                describe(other)
            ),
        }
    }

    pub(super) fn field_name(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    pub(super) fn opt(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    pub(super) fn req(&self, name: &str) -> Result<&'a Value> {
        self.opt(name)
            .ok_or_else(|| anyhow!("missing field `{}`", self.field_name(name)))
    }

    pub(super) fn child(&self, name: &str) -> Result<Obj<'a>> {
        Obj::new(self.req(name)?, &self.field_name(name))
    }

    pub(super) fn usize(&self, name: &str) -> Result<usize> {
        as_usize(self.req(name)?, &self.field_name(name))
    }

    /// A positive dimension, at most its [`DIM_LIMITS`] entry.
    pub(super) fn positive(&self, name: &str) -> Result<usize> {
        let v = self.usize(name)?;
        if v == 0 {
            bail!(
                "{}: 0 is not allowed (must be positive)",
                self.field_name(name)
            );
        }
        if let Some(&(_, max)) = DIM_LIMITS.iter().find(|(n, _)| *n == name) {
            if v > max {
                bail!(
                    "{}: {v} is out of range (at most {max}; Kimi K3's own values are far below)",
                    self.field_name(name)
                );
            }
        }
        Ok(v)
    }

    pub(super) fn f32(&self, name: &str) -> Result<f32> {
        let field = self.field_name(name);
        let v = self.req(name)?;
        let x = v
            .as_f64()
            .ok_or_else(|| anyhow!("{field}: expected a number, got {}", describe(v)))?;
        if !x.is_finite() {
            bail!("{field}: expected a finite number, got {x}");
        }
        if let Some(&(_, lo, hi)) = FLOAT_RANGES.iter().find(|(n, _, _)| *n == name) {
            if !(lo as f64..=hi as f64).contains(&x) {
                bail!("{field}: {x} is out of range (expected {lo} to {hi})");
            }
        }
        Ok(x as f32)
    }

    pub(super) fn positive_f32(&self, name: &str) -> Result<f32> {
        let x = self.f32(name)?;
        if x <= 0.0 {
            bail!(
                "{}: {x} is not allowed (must be positive)",
                self.field_name(name)
            );
        }
        Ok(x)
    }

    pub(super) fn bool(&self, name: &str) -> Result<bool> {
        let v = self.req(name)?;
        v.as_bool().ok_or_else(|| {
            anyhow!(
                "{}: expected a boolean, got {}",
                self.field_name(name),
                describe(v)
            )
        })
    }

    pub(super) fn str(&self, name: &str) -> Result<&'a str> {
        let v = self.req(name)?;
        v.as_str().ok_or_else(|| {
            anyhow!(
                "{}: expected a string, got {}",
                self.field_name(name),
                describe(v)
            )
        })
    }

    /// A boolean the engine only runs one way.
    pub(super) fn require_bool(&self, name: &str, want: bool, why: &str) -> Result<()> {
        let got = self.bool(name)?;
        if got != want {
            bail!("{}: {got} is not supported ({why})", self.field_name(name));
        }
        Ok(())
    }

    /// A string the engine only runs one way.
    pub(super) fn require_str(&self, name: &str, want: &str, why: &str) -> Result<()> {
        let got = self.str(name)?;
        if got != want {
            bail!(
                "{}: \"{got}\" is not supported ({why}; expected \"{want}\")",
                self.field_name(name)
            );
        }
        Ok(())
    }
}

pub(super) fn display_path(path: &str) -> &str {
    if path.is_empty() {
        "the config root"
    } else {
        path
    }
}

/// A short description of a JSON value for "expected X, got Y" messages.
pub(super) fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => return "null".to_string(),
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    };
    let mut text = v.to_string();
    if text.len() > 40 {
        let cut = (0..=40)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text.truncate(cut);
        text.push_str("...");
    }
    format!("{kind} ({text})")
}

pub(super) fn as_usize(v: &Value, field: &str) -> Result<usize> {
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| {
            anyhow!(
                "{field}: expected a non-negative integer, got {}",
                describe(v)
            )
        })
}

pub(super) fn as_token(v: &Value, field: &str) -> Result<u32> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| anyhow!("{field}: expected a token id, got {}", describe(v)))
}
