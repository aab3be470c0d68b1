//! The leaf values of `config.json` as serde types, each refusing a wrong value in k3's
//! words ("expected a boolean, got a number (1)"), and [`read`], which deserializes a raw
//! struct and names a failing field by its JSON path (`text_config.hidden_size`).

use anyhow::{anyhow, bail, Result};
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_path_to_error::Segment;
use std::fmt;
use std::marker::PhantomData;

/// What a leaf says when it is given `null`: [`read`] turns it into "missing field", as a
/// `null` counts as absent.
const NULL_IS_MISSING: &str = "(null, read as missing)";

/// A non-negative integer.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Int(pub usize);

/// A finite number.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Num(pub f64);

/// A boolean.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Flag(pub bool);

/// A string.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Text(pub String);

/// A token id (a `u32`).
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Token(pub u32);

/// One token id or a list of them (`eos_token_id`).
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Tokens(pub Vec<u32>);

/// A list of layer numbers (`kda_layers`, `full_attn_layers`).
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "Value")]
pub(super) struct Layers(pub Vec<usize>);

/// A JSON object read as `T`: serde's derived structs would also take a list of their
/// fields' values in order, which a config never means.
#[derive(Debug)]
pub(super) struct Obj<T>(pub T);

fn present(v: Value) -> Result<Value, String> {
    match v {
        Value::Null => Err(NULL_IS_MISSING.to_string()),
        v => Ok(v),
    }
}

fn non_negative(v: &Value) -> Result<usize, String> {
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| format!("expected a non-negative integer, got {}", describe(v)))
}

fn token(v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("expected a token id, got {}", describe(v)))
}

impl TryFrom<Value> for Int {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        non_negative(&present(v)?).map(Int)
    }
}

impl TryFrom<Value> for Num {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        let v = present(v)?;
        let x = v
            .as_f64()
            .ok_or_else(|| format!("expected a number, got {}", describe(&v)))?;
        if !x.is_finite() {
            return Err(format!("expected a finite number, got {x}"));
        }
        Ok(Num(x))
    }
}

impl TryFrom<Value> for Flag {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        let v = present(v)?;
        v.as_bool()
            .map(Flag)
            .ok_or_else(|| format!("expected a boolean, got {}", describe(&v)))
    }
}

impl TryFrom<Value> for Text {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        match present(v)? {
            Value::String(s) => Ok(Text(s)),
            v => Err(format!("expected a string, got {}", describe(&v))),
        }
    }
}

impl TryFrom<Value> for Token {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        token(&present(v)?).map(Token)
    }
}

impl TryFrom<Value> for Tokens {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        match present(v)? {
            Value::Array(list) => list.iter().map(token).collect::<Result<_, _>>().map(Tokens),
            v => Ok(Tokens(vec![token(&v)?])),
        }
    }
}

impl TryFrom<Value> for Layers {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        match present(v)? {
            Value::Array(list) => list
                .iter()
                .map(non_negative)
                .collect::<Result<_, _>>()
                .map(Layers),
            v => Err(format!(
                "expected a list of layer numbers, got {}",
                describe(&v)
            )),
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Visit<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Obj<T>, E> {
                Err(E::custom(NULL_IS_MISSING))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map)).map(Obj)
            }
        }
        d.deserialize_any(Visit(PhantomData))
    }
}

/// [`read`] of a JSON object (a `null` here is a wrong value, not a missing field).
pub(super) fn read_object<T: DeserializeOwned>(v: &Value, at: &str) -> Result<T> {
    if v.is_null() {
        bail!("{}: expected an object, got null", display_path(at));
    }
    read::<Obj<T>>(v, at).map(|o| o.0)
}

/// Deserializes `v`, found at `at` ("" for the root), into `T`; an error names the field by
/// its full path: a wrong leaf in its own words, a missing or `null` field as "missing
/// field `path`", a non-object where an object belongs as "expected an object, got ...".
pub(super) fn read<T: DeserializeOwned>(v: &Value, at: &str) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let mut path = at.to_string();
        let mut found = Some(v);
        for seg in e.path().iter() {
            let key = match seg {
                Segment::Map { key } => key.clone(),
                Segment::Seq { index } => index.to_string(),
                Segment::Enum { variant } => variant.clone(),
                Segment::Unknown => "?".to_string(),
            };
            found = found.and_then(|x| x.get(&key));
            path = join(&path, &key);
        }
        let msg = e.inner().to_string();
        if msg == NULL_IS_MISSING {
            anyhow!("missing field `{path}`")
        } else if let Some(name) = msg
            .strip_prefix("missing field `")
            .and_then(|m| m.strip_suffix('`'))
        {
            anyhow!("missing field `{}`", join(&path, name))
        } else if msg.starts_with("invalid type") {
            // Every leaf words its own errors: serde's own are [`Obj`]'s and maps'.
            let got = found.map_or_else(|| "something else".to_string(), describe);
            anyhow!("{}: expected an object, got {got}", display_path(&path))
        } else {
            anyhow!("{}: {msg}", display_path(&path))
        }
    })
}

/// `field` of the object at `path` ("" for the root).
pub(super) fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
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
