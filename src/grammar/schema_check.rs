//! A JSON schema made fit for the grammar before llguidance compiles it: what the grammar
//! cannot enforce exactly is refused naming its path in the schema, and numbers are shaped
//! so that what the model writes parses back as the schema means it.
//!
//! llguidance compares numeric bounds in 64-bit floats and writes integers as unbounded
//! digit runs, so left alone an `integer` could be 29 digits long (a client reads
//! `2.02e+28`), `-0` (read as the float `-0.0`), and a `number` could carry an exponent
//! past a double's range (`1e999`). Here every `integer` is held to
//! [`-INT_LIMIT`, `INT_LIMIT`] (at most 19 digits, never `-0`) and every `number` to
//! [`-NUM_LIMIT`, `NUM_LIMIT`] (a plain decimal, no exponent); a bound, `const` or `enum`
//! number a double does not hold exactly is refused, and so is a `minProperties` beyond
//! the keys the grammar keeps distinct (extra keys of `additionalProperties` may repeat);
//! under `strict`, extra keys themselves are refused and open objects closed, so a
//! strict object never repeats a key.

use serde_json::{json, Map, Number, Value};

/// The largest integer magnitude the grammar writes: the largest double below 2^63, so
/// llguidance's float bounds keep it exactly and it fits an i64.
pub(crate) const INT_LIMIT: i64 = i64::MAX - 1023;

/// The largest number magnitude the grammar writes for `number`: 2^53, past which doubles
/// skip integers.
pub(crate) const NUM_LIMIT: i64 = 1 << 53;

/// A schema the grammar cannot enforce as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaError {
    /// Where in the schema, as a field path from its root (`.properties.n.minimum`; empty
    /// for the root).
    pub path: String,
    /// Why.
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "schema{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for SchemaError {}

/// `schema` as the grammar compiles it (numbers shaped, and with `strict` off a
/// `minProperties` it cannot enforce dropped, as other unenforceable keywords are), or
/// what in it cannot be enforced.
pub(crate) fn prepare_schema(schema: &Value, strict: bool) -> Result<Value, SchemaError> {
    let mut out = schema.clone();
    let mut path = String::new();
    walk(&mut out, &mut path, strict, Place::Own)?;
    Ok(out)
}

/// `schema` shaped as [`prepare_schema`] does with `strict`, its objects left open: for
/// k3's own schemas (`json_object`'s any object), whose extra keys are the point.
pub(crate) fn prepare_open_schema(schema: &Value) -> Result<Value, SchemaError> {
    let mut out = schema.clone();
    let mut path = String::new();
    walk(&mut out, &mut path, true, Place::Open)?;
    Ok(out)
}

/// Where a subschema sits, for what its object may be made to hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// On its own (or an alternative of `anyOf` / `oneOf`): an object that leaves
    /// `additionalProperties` out is closed under `strict`.
    Own,
    /// Under `allOf`, where closing one part would refuse the other parts' keys.
    AllOf,
    /// A schema whose objects stay open.
    Open,
}

/// The schema of `response_format: json_object`: any object, its numbers shaped as a
/// schema's are (an unconstrained value would allow `-0` and exponents).
pub(crate) fn any_object_schema() -> Value {
    let any = json!({"$ref": "#/$defs/k3_any"});
    json!({
        "type": "object",
        "additionalProperties": any,
        "$defs": {"k3_any": {"anyOf": [
            {"type": ["null", "boolean", "string"]},
            {"type": "number", "minimum": -NUM_LIMIT, "maximum": NUM_LIMIT},
            {"type": "array", "items": any},
            {"type": "object", "additionalProperties": any}
        ]}}
    })
}

const SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
const SCHEMA_LISTS: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
const SCHEMA_ONE: [&str; 9] = [
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
];

fn err(path: &str, message: impl Into<String>) -> SchemaError {
    SchemaError {
        path: path.to_string(),
        message: message.into(),
    }
}

fn walk(
    node: &mut Value,
    path: &mut String,
    strict: bool,
    place: Place,
) -> Result<(), SchemaError> {
    let Value::Object(m) = node else {
        return Ok(());
    };
    let types = types_of(m);
    // A subschema's own objects may be closed again, unless the whole schema stays open.
    let inner = if place == Place::Open {
        Place::Open
    } else {
        Place::Own
    };
    let integer_only = types.iter().any(|t| t == "integer") && !types.iter().any(|t| t == "number");
    let limit = if integer_only { INT_LIMIT } else { NUM_LIMIT };
    for key in ["minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"] {
        if let Some(Value::Number(n)) = m.get(key) {
            let at = format!("{path}.{key}");
            check_bound(n, key.contains("inimum"), limit, &at)?;
        }
    }
    if let Some(c) = m.get("const") {
        check_literal(c, &format!("{path}.const"))?;
    }
    if let Some(Value::Array(e)) = m.get("enum") {
        for (i, v) in e.iter().enumerate() {
            check_literal(v, &format!("{path}.enum[{i}]"))?;
        }
    }
    if strict && place != Place::Open {
        check_extra_keys(m, &types, path, place)?;
    }
    check_min_properties(m, path, strict)?;
    for key in SCHEMA_MAPS {
        if let Some(Value::Object(props)) = m.get_mut(key) {
            for (name, sub) in props.iter_mut() {
                descend(sub, path, &format!(".{key}.{name}"), strict, inner)?;
            }
        }
    }
    for key in SCHEMA_LISTS {
        if let Some(Value::Array(list)) = m.get_mut(key) {
            for (i, sub) in list.iter_mut().enumerate() {
                let place = if key == "allOf" { Place::AllOf } else { inner };
                descend(sub, path, &format!(".{key}[{i}]"), strict, place)?;
            }
        }
    }
    for key in SCHEMA_ONE {
        match m.get_mut(key) {
            Some(Value::Array(list)) if key == "items" => {
                for (i, sub) in list.iter_mut().enumerate() {
                    descend(sub, path, &format!(".{key}[{i}]"), strict, inner)?;
                }
            }
            Some(sub) => descend(sub, path, &format!(".{key}"), strict, inner)?,
            None => {}
        }
    }
    shape_numbers(m, &types, integer_only);
    Ok(())
}

fn descend(
    sub: &mut Value,
    path: &mut String,
    step: &str,
    strict: bool,
    place: Place,
) -> Result<(), SchemaError> {
    let len = path.len();
    path.push_str(step);
    let r = walk(sub, path, strict, place);
    path.truncate(len);
    r
}

/// The names in `type` (a string or a list of strings).
fn types_of(m: &Map<String, Value>) -> Vec<String> {
    match m.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// An integer written as one (an i64 or a u64), as i128.
fn as_integer(n: &Number) -> Option<i128> {
    n.as_i64()
        .map(i128::from)
        .or_else(|| n.as_u64().map(i128::from))
}

/// A bound llguidance compares as a double: refused where the double is not the number
/// written and the difference could let a value past it, and where it lies beyond what
/// the grammar writes for the node's type (`limit`) on the side that binds.
fn check_bound(n: &Number, lower: bool, limit: i64, at: &str) -> Result<(), SchemaError> {
    let limit = limit as i128;
    let Some(f) = n.as_f64().filter(|f| f.is_finite()) else {
        return Err(err(at, format!("{n} is not a finite number")));
    };
    // Past the type's limit on the loose side the limit binds instead.
    if (lower && f <= -(limit as f64)) || (!lower && f >= limit as f64) {
        return Ok(());
    }
    if (lower && f > limit as f64) || (!lower && f < -(limit as f64)) {
        return Err(err(
            at,
            format!(
                "{n} leaves no value the grammar writes: it writes numbers between -{limit} and {limit} (integers of at most 19 digits, other numbers as plain decimals)"
            ),
        ));
    }
    let exact = match as_integer(n) {
        Some(i) => f as i128 == i,
        // A double past 2^53 may not be the number the client wrote.
        None => f.abs() <= NUM_LIMIT as f64,
    };
    if !exact {
        return Err(err(
            at,
            format!(
                "{n} is past what the grammar compares exactly (bounds are 64-bit floats; integers past 2^53 must be ones a double holds)"
            ),
        ));
    }
    Ok(())
}

/// A `const` or `enum` value: every number in it must be one the grammar writes exactly.
fn check_literal(v: &Value, at: &str) -> Result<(), SchemaError> {
    match v {
        Value::Number(n) => {
            // A double past 2^53 may not be the number the client wrote.
            let too_big = match as_integer(n) {
                Some(i) => i.abs() > INT_LIMIT as i128,
                None => n.as_f64().is_none_or(|f| f.abs() > NUM_LIMIT as f64),
            };
            if too_big {
                return Err(err(
                    at,
                    format!(
                        "{n} is past 64 bits or past a double's exact integers; the grammar writes integers of at most 19 digits (up to {INT_LIMIT})"
                    ),
                ));
            }
            Ok(())
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| check_literal(x, &format!("{at}[{i}]"))),
        Value::Object(o) => o
            .iter()
            .try_for_each(|(k, x)| check_literal(x, &format!("{at}.{k}"))),
        _ => Ok(()),
    }
}

/// Under `strict`, an object's keys are distinct: the grammar writes each declared
/// property at most once, but keys beyond them (`additionalProperties` other than
/// `false`, `patternProperties`) form a repetition that may write one key twice. Such an
/// object is refused naming the keyword, and one that leaves `additionalProperties` out is
/// closed (OpenAI's and Anthropic's strict modes require `false` there), except under
/// `allOf`, where closing one part would refuse the others' keys.
fn check_extra_keys(
    m: &mut Map<String, Value>,
    types: &[String],
    path: &str,
    place: Place,
) -> Result<(), SchemaError> {
    if let Some(p) = m.get("patternProperties") {
        if p.as_object().is_none_or(|p| !p.is_empty()) {
            return Err(err(
                &format!("{path}.patternProperties"),
                "keys matched by a pattern may repeat one another in what the grammar writes; under strict, declare the keys in `properties` with additionalProperties false",
            ));
        }
    }
    let object = types.iter().any(|t| t == "object")
        || ["properties", "required", "minProperties", "maxProperties"]
            .iter()
            .any(|k| m.contains_key(*k));
    match m.get("additionalProperties") {
        Some(Value::Bool(false)) => Ok(()),
        Some(_) => Err(err(
            &format!("{path}.additionalProperties"),
            "keys beyond `properties` may repeat one another in what the grammar writes; under strict it must be false (declare the keys in `properties`), or send the schema without strict",
        )),
        None if object && place == Place::Own => {
            m.insert("additionalProperties".into(), Value::Bool(false));
            Ok(())
        }
        None => Ok(()),
    }
}

/// `minProperties` holds only where the grammar keeps the keys distinct: the required
/// keys, or one more from the declared optional ones when nothing else is allowed.
/// Extra keys (`additionalProperties`, `patternProperties`) may repeat one another, so a
/// count that needs them is refused (strict) or dropped (otherwise).
fn check_min_properties(
    m: &mut Map<String, Value>,
    path: &str,
    strict: bool,
) -> Result<(), SchemaError> {
    let Some(min) = m.get("minProperties").and_then(Value::as_u64) else {
        return Ok(());
    };
    let mut required: Vec<&str> = match m.get("required") {
        Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    required.sort_unstable();
    required.dedup();
    let r = required.len() as u64;
    let optional = match m.get("properties") {
        Some(Value::Object(p)) => p.keys().any(|k| !required.contains(&k.as_str())),
        _ => false,
    };
    let closed = m.get("additionalProperties") == Some(&Value::Bool(false))
        && match m.get("patternProperties") {
            None => true,
            Some(Value::Object(p)) => p.is_empty(),
            Some(_) => false,
        };
    let max_ok = match m.get("maxProperties").and_then(Value::as_u64) {
        None => true,
        Some(max) => max == r + 1,
    };
    if min <= r || (min == r + 1 && optional && closed && max_ok) {
        return Ok(());
    }
    if !strict {
        m.remove("minProperties");
        return Ok(());
    }
    Err(err(
        &format!("{path}.minProperties"),
        format!(
            "{min} is more than the grammar keeps distinct: it guarantees the {r} required keys (one more of the declared optional ones when additionalProperties is false); list the keys in `required` instead"
        ),
    ))
}

/// Holds an `integer` to [-INT_LIMIT, INT_LIMIT] without `-0` (two ranges, negative and
/// not), a `number` to [-NUM_LIMIT, NUM_LIMIT] (bounded, llguidance writes no exponent).
fn shape_numbers(m: &mut Map<String, Value>, types: &[String], integer_only: bool) {
    let extra = if integer_only {
        json!({"anyOf": [
            {"minimum": 0, "maximum": INT_LIMIT},
            {"minimum": -INT_LIMIT, "maximum": -1}
        ]})
    } else if types.iter().any(|t| t == "number") {
        json!({"minimum": -NUM_LIMIT, "maximum": NUM_LIMIT})
    } else {
        return;
    };
    match m.get_mut("allOf") {
        Some(Value::Array(all)) => all.push(extra),
        _ => {
            m.insert("allOf".into(), json!([extra]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn numbers_past_64_bits_are_refused_naming_the_path() {
        for (schema, path) in [
            (r#"{"type":"integer","minimum":1e29}"#, ".minimum"),
            (
                r#"{"properties":{"n":{"type":"integer","const":18446744073709551616}}}"#,
                ".properties.n.const",
            ),
            (r#"{"enum":[1, 1e29]}"#, ".enum[1]"),
            (
                r#"{"type":"integer","maximum":-18446744073709551615}"#,
                ".maximum",
            ),
            (
                r#"{"type":"integer","minimum":1152921504606846977}"#,
                ".minimum",
            ),
            (
                r#"{"items":{"type":"number","minimum":1e20}}"#,
                ".items.minimum",
            ),
        ] {
            let e = prepare_schema(&parse(schema), false).unwrap_err();
            assert_eq!(e.path, path, "{schema}: {e}");
        }
        // The loose side past the limit is the limit's business; exact bounds pass.
        for ok in [
            r#"{"type":"integer","maximum":9223372036854775807}"#,
            r#"{"type":"integer","minimum":-1e30,"maximum":1152921504606846976}"#,
            r#"{"type":"number","minimum":-0.5,"exclusiveMaximum":1e300}"#,
            r#"{"const":9223372036854774784}"#,
        ] {
            prepare_schema(&parse(ok), true).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    #[test]
    fn min_properties_past_the_required_keys_is_refused_or_dropped() {
        let s = json!({"type": "object", "minProperties": 3});
        let e = prepare_schema(&s, true).unwrap_err();
        assert_eq!(e.path, ".minProperties");
        let lenient = prepare_schema(&s, false).unwrap();
        assert!(lenient.get("minProperties").is_none(), "{lenient}");
        for ok in [
            json!({"required": ["a", "b"], "minProperties": 2}),
            json!({"properties": {"a": {}, "b": {}}, "minProperties": 1,
                   "additionalProperties": false}),
        ] {
            assert_eq!(
                prepare_schema(&ok, true).unwrap()["minProperties"],
                ok["minProperties"]
            );
        }
    }

    #[test]
    fn integers_and_numbers_get_their_ranges() {
        let s =
            prepare_schema(&json!({"type": "integer", "allOf": [{"minimum": 3}]}), true).unwrap();
        assert_eq!(s["allOf"].as_array().unwrap().len(), 2, "{s}");
        assert_eq!(s["allOf"][1]["anyOf"][0]["maximum"], INT_LIMIT);
        let s = prepare_schema(&json!({"type": ["number", "null"]}), true).unwrap();
        assert_eq!(s["allOf"][0]["maximum"], NUM_LIMIT);
        let s = prepare_schema(&json!({"type": "string"}), true).unwrap();
        assert!(s.get("allOf").is_none());
    }
}
