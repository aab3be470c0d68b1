//! JSON parsed into a [`serde_json::Value`] with duplicate object keys refused. serde_json's
//! own `Value` keeps the last of two equal keys, so a config or shard header with a field
//! or tensor listed twice would load whichever came second; every file k3 trusts is read
//! through [`parse_str`] / [`parse_slice`] instead, and the error names the key, the object
//! it appears twice in and the line and column of its second entry.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;

/// Parses JSON text, refusing an object that holds the same key twice.
pub fn parse_str(text: &str) -> serde_json::Result<Value> {
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Unique {
        path: String::new(),
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// [`parse_str`] over bytes (which must be UTF-8).
pub fn parse_slice(bytes: &[u8]) -> serde_json::Result<Value> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = Unique {
        path: String::new(),
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// Checks JSON text for an object that holds the same key twice without building its tree
/// (a tokenizer's vocabulary is 10^5 keys).
pub fn check_str(text: &str) -> serde_json::Result<()> {
    let mut de = serde_json::Deserializer::from_str(text);
    Checked {
        path: String::new(),
    }
    .deserialize(&mut de)?;
    de.end()
}

/// Deserializes one value; `path` is where it sits (`weight_map`, `a.b[3]`), for errors.
struct Unique {
    path: String,
}

impl<'de> DeserializeSeed<'de> for Unique {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl Unique {
    fn child(&self, key: &str) -> String {
        child_path(&self.path, key)
    }
}

fn child_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn twice<E: de::Error>(path: &str, key: &str) -> E {
    let within = if path.is_empty() {
        "the top-level object".to_string()
    } else {
        format!("`{path}`")
    };
    E::custom(format_args!(
        "key `{key}` appears twice in {within} (both entries are refused: remove one)"
    ))
}

/// [`Unique`] that keeps only each object's keys, to find a second entry.
struct Checked {
    path: String,
}

impl<'de> DeserializeSeed<'de> for Checked {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        while seq
            .next_element_seed(Checked {
                path: format!("{}[{i}]", self.path),
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if seen.contains(&key) {
                return Err(twice(&self.path, &key));
            }
            map.next_value_seed(Checked {
                path: child_path(&self.path, &key),
            })?;
            seen.insert(key);
        }
        Ok(())
    }
}

impl<'de> Visitor<'de> for Unique {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Unique {
            path: format!("{}[{}]", self.path, out.len()),
        })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(twice(&self.path, &key));
            }
            let v = map.next_value_seed(Unique {
                path: self.child(&key),
            })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_are_refused_naming_key_object_and_line() {
        let e = parse_str("{\"a\": {\"b\": 1,\n \"b\": 2}}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `b` appears twice in `a`") && e.contains("line 2"),
            "{e}"
        );
        let e = parse_str(r#"[{"x": 1}, {"y": 1, "y": 1}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`[1]`"), "{e}");
        let e = parse_slice(br#"{"k": 1, "k": 1}"#).unwrap_err().to_string();
        assert!(e.contains("the top-level object"), "{e}");
        let e = check_str(r#"{"model": {"vocab": {"a": 0, "b": 1, "a": 2}}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `a` appears twice in `model.vocab`"), "{e}");
        assert!(check_str(r#"{"a": [{"a": 1}], "b": {"a": 2}}"#).is_ok());
    }

    #[test]
    fn values_equal_serde_json_s_without_duplicates() {
        let text = r#"{"a": [1, -2, 3.5, true, null, "s"], "b": {"c": {}}, "d": 1e300}"#;
        assert_eq!(
            parse_str(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
        assert!(parse_str("{} x").is_err(), "trailing text is refused");
    }
}
