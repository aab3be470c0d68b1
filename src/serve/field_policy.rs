//! The policy for request fields k3 does not read. A field that changes what the model
//! generates is implemented or refused with a 400 naming it; a field that only labels,
//! stores, routes or bills a request changes nothing k3 computes, so it is accepted and
//! ignored — clients send these routinely. The lists here are the one place that says
//! which fields those are, per API; docs/api.md repeats them with the same reasons.

use super::api_error::ApiError;
use super::body_json::{refuse_unknown, Unknown};
use super::sampling_fields::type_error;
use serde_json::Value;

/// The values an accepted-but-unused field may hold; anything else is a 400 naming it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Accepts {
    /// `true` or `false`.
    Bool,
    /// Any string.
    String,
    /// Any JSON object.
    Object,
    /// One of these strings (other values ask for something k3 does not do).
    OneOf(&'static [&'static str]),
}

/// A field that is accepted and has no effect, with the reason.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InertField {
    /// The field's name at the body's top level.
    pub name: &'static str,
    /// The values it may hold.
    pub accepts: Accepts,
    /// Why it changes nothing here (what docs/api.md says).
    pub why: &'static str,
}

/// OpenAI's labelling, storage, routing and billing fields (chat completions, completions
/// and responses bodies).
pub(crate) const OPENAI: &[InertField] = &[
    InertField {
        name: "store",
        accepts: Accepts::Bool,
        why: "k3 keeps no completion after answering, so there is nothing to store or list later; `true` is accepted as well",
    },
    InertField {
        name: "metadata",
        accepts: Accepts::Object,
        why: "labels for stored completions; k3 stores none",
    },
    InertField {
        name: "user",
        accepts: Accepts::String,
        why: "an end-user id for abuse monitoring; k3 monitors no one",
    },
    InertField {
        name: "safety_identifier",
        accepts: Accepts::String,
        why: "an end-user id for abuse monitoring; k3 monitors no one",
    },
    InertField {
        name: "prompt_cache_key",
        accepts: Accepts::String,
        why: "routes requests to a hosted prompt cache; k3 reuses the prefix it holds for every request",
    },
    InertField {
        name: "prompt_cache_retention",
        accepts: Accepts::String,
        why: "how long a hosted prompt cache keeps a prefix; k3's prompt cache is set by its flags",
    },
    InertField {
        name: "service_tier",
        accepts: Accepts::OneOf(&["auto", "default"]),
        why: "a processing and billing class; k3 has one, the default (\"flex\", \"priority\" and \"scale\" ask for one it lacks and are refused)",
    },
];

/// Anthropic's labelling, routing and caching fields (`/v1/messages`, `count_tokens`).
pub(crate) const ANTHROPIC: &[InertField] = &[
    InertField {
        name: "metadata",
        accepts: Accepts::Object,
        why: "`user_id` for abuse monitoring; k3 monitors no one",
    },
    InertField {
        name: "service_tier",
        accepts: Accepts::OneOf(&["auto", "standard_only"]),
        why: "a capacity and billing class; k3 has one",
    },
    InertField {
        name: "inference_geo",
        accepts: Accepts::String,
        why: "the region a hosted request runs in; k3 runs where it is started",
    },
    InertField {
        name: "cache_control",
        accepts: Accepts::Object,
        why: "automatic caching at the prompt's last block; k3 keeps the state at every prompt's end anyway (`cache_control` on blocks, tools and system text marks a boundary the prompt cache keeps)",
    },
];

impl InertField {
    /// Checks `v` (not null) against what the field accepts.
    fn check(&self, v: &Value, field: &str) -> Result<(), ApiError> {
        let ok = match (self.accepts, v) {
            (Accepts::Bool, Value::Bool(_)) => true,
            (Accepts::String, Value::String(_)) => true,
            (Accepts::Object, Value::Object(_)) => true,
            (Accepts::OneOf(allowed), Value::String(s)) => {
                if allowed.contains(&s.as_str()) {
                    true
                } else {
                    return Err(ApiError::field(
                        field,
                        format!(
                            "{s:?} is not supported; this server accepts {}",
                            allowed
                                .iter()
                                .map(|a| format!("{a:?}"))
                                .collect::<Vec<_>>()
                                .join(" or ")
                        ),
                    ));
                }
            }
            _ => false,
        };
        if ok {
            return Ok(());
        }
        let want = match self.accepts {
            Accepts::Bool => "a boolean",
            Accepts::String | Accepts::OneOf(_) => "a string",
            Accepts::Object => "an object",
        };
        Err(type_error(field, want, v))
    }
}

/// Refuses the first unknown field (not null) that `inert` does not list, naming it; a
/// listed one is accepted when its value has the kind the field takes, and ignored.
pub(crate) fn refuse_unknown_except(
    unknown: &Unknown,
    at: &str,
    inert: &[InertField],
) -> Result<(), ApiError> {
    let mut rest = Unknown::new();
    for (k, v) in unknown {
        match inert.iter().find(|f| f.name == k) {
            Some(f) if !v.is_null() => {
                let field = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                f.check(v, &field)?;
                tracing::debug!("request field {field} accepted and ignored: {}", f.why);
            }
            Some(_) => {}
            None => {
                rest.insert(k.clone(), v.clone());
            }
        }
    }
    refuse_unknown(&rest, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn unknown(v: Value) -> Unknown {
        match v {
            Value::Object(o) => o.into_iter().collect(),
            _ => Unknown::new(),
        }
    }

    #[test]
    fn listed_fields_pass_and_others_are_named() {
        let ok = unknown(json!({"store": false, "metadata": {"a": "b"}, "user": "u",
            "prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto"}));
        assert!(refuse_unknown_except(&ok, "", OPENAI).is_ok());
        let store_true = unknown(json!({"store": true}));
        assert!(refuse_unknown_except(&store_true, "", OPENAI).is_ok());
        let e = refuse_unknown_except(&unknown(json!({"logit_bias": {}})), "", OPENAI)
            .err()
            .map(|e| e.param);
        assert_eq!(e, Some(Some("logit_bias".to_string())));
    }

    #[test]
    fn a_listed_field_with_a_wrong_value_is_refused_by_name() {
        let e = refuse_unknown_except(&unknown(json!({"store": "no"})), "", OPENAI)
            .err()
            .map(|e| e.message);
        assert_eq!(e.as_deref(), Some("store: must be a boolean, got a string"));
        let e = refuse_unknown_except(&unknown(json!({"service_tier": "flex"})), "", OPENAI)
            .err()
            .map(|e| e.message)
            .unwrap_or_default();
        assert!(
            e.starts_with("service_tier: \"flex\" is not supported"),
            "{e}"
        );
        assert!(
            refuse_unknown_except(&unknown(json!({"store": false})), "", ANTHROPIC).is_err(),
            "store is not an Anthropic field"
        );
    }
}
