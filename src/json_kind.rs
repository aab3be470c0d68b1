//! The kind of a JSON value as the API and grammar errors name it ("must be a string, got
//! an array"), written once for every message that says what a client sent.

use serde_json::Value;

/// `null`, `a boolean`, `a number`, `a string`, `an array` or `an object`.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::json_kind;
    use serde_json::json;

    #[test]
    fn every_kind_has_its_article() {
        let kinds: Vec<_> = [
            json!(null),
            json!(true),
            json!(1.5),
            json!("x"),
            json!([1]),
            json!({"a": 1}),
        ]
        .iter()
        .map(json_kind)
        .collect();
        assert_eq!(
            kinds,
            [
                "null",
                "a boolean",
                "a number",
                "a string",
                "an array",
                "an object"
            ]
        );
    }
}
