//! JSON written with every object's keys in sorted order. serde_json keeps insertion order
//! when any crate in the build turns on its `preserve_order` feature (llguidance does), so
//! files whose bytes are compared or fingerprinted (synth's checkpoint, the synthetic
//! tokenizer and their fixtures) are written through here to stay the same either way.

use serde_json::Value;

/// `v` with the keys of every object, at every depth, in sorted order.
pub fn sorted_keys(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted_keys(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted_keys).collect()),
        other => other.clone(),
    }
}

/// `v` as pretty-printed JSON with sorted keys (no trailing newline).
pub fn to_string_pretty(v: &Value) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&sorted_keys(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_out_sorted_at_every_depth_whatever_the_insertion_order() {
        let mut inner = serde_json::Map::new();
        inner.insert("z".into(), Value::from(1));
        inner.insert("a".into(), Value::from(2));
        let mut outer = serde_json::Map::new();
        outer.insert("b".into(), Value::Array(vec![Value::Object(inner.clone())]));
        outer.insert("a".into(), Value::Object(inner));
        let text = serde_json::to_string(&sorted_keys(&Value::Object(outer))).unwrap();
        assert_eq!(text, r#"{"a":{"a":2,"z":1},"b":[{"a":2,"z":1}]}"#);
    }
}
