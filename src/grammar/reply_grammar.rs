//! What a constrained reply must look like, written as an llguidance Lark grammar: the
//! JSON itself (`%json` with the schema), framed the way the reply is read back — bare for
//! a completion, or K3's XTML for a chat reply (think channel, response, tools section,
//! `<|end_of_msg|>`), so the chat splitter and the tool-call parser see their usual format.

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use super::schema_check::{any_object_schema, prepare_open_schema, prepare_schema};

/// Most tools a forced call may offer (OpenAI's own limit on `tools`): each one's schema
/// is compiled into the grammar, whose time and memory grow with them.
pub const MAX_FORCED_TOOLS: usize = 128;

/// What the text must be.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against `schema` (`response_format: {"type": "json_schema"}`). Strict
    /// refuses a schema with keywords llguidance cannot enforce; otherwise those keywords
    /// are ignored and the rest is enforced.
    JsonSchema {
        /// The JSON schema.
        schema: Value,
        /// OpenAI's `strict`.
        strict: bool,
    },
    /// One call of one of `tools`, its arguments valid against that tool's parameter
    /// schema (`tool_choice: "required"` offers every tool, a named function one).
    ToolCall {
        /// The tools the call may use.
        tools: Vec<ToolSchema>,
    },
}

/// A tool a forced call may name.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSchema {
    /// The function's name.
    pub name: String,
    /// The JSON schema of its arguments (an object schema; `{}` accepts any object).
    pub parameters: Value,
    /// Refuse keywords llguidance cannot enforce instead of ignoring them (OpenAI's
    /// `function.strict`).
    pub strict: bool,
}

/// Where the constrained text sits in what the model generates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyFrame {
    /// A completion: the text, then an end-of-sequence id. Tool calls need a chat frame.
    Bare,
    /// A chat reply after K3's generation prompt: with `thinking`, free think text of at
    /// most `think_tokens` tokens and the think channel's close first; then the response
    /// (the JSON, or empty before a tools section), closed as K3 closes a message.
    Chat {
        /// The generation prompt opened the think channel.
        thinking: bool,
        /// Tokens the think channel may take before it must close.
        think_tokens: usize,
    },
}

/// The Lark grammar of a reply under `c` in `frame`.
pub fn reply_lark(c: &OutputConstraint, frame: ReplyFrame) -> Result<String> {
    let mut rules = Vec::new();
    let body = match c {
        OutputConstraint::JsonObject => {
            let any = prepare_open_schema(&any_object_schema())?;
            rules.push(prepared_json_rule("value", any, true)?);
            "value".to_string()
        }
        OutputConstraint::JsonSchema { schema, strict } => {
            rules.push(json_rule("value", schema, *strict)?);
            "value".to_string()
        }
        OutputConstraint::ToolCall { tools } => {
            let ReplyFrame::Chat { .. } = frame else {
                bail!("a forced tool call needs a chat reply; completions cannot call tools");
            };
            if tools.is_empty() {
                bail!("a forced tool call needs at least one tool");
            }
            if tools.len() > MAX_FORCED_TOOLS {
                bail!(
                    "a forced tool call offers {} tools; the grammar takes at most {MAX_FORCED_TOOLS} (each tool's schema is compiled into it)",
                    tools.len()
                );
            }
            let mut calls = Vec::new();
            for (i, t) in tools.iter().enumerate() {
                rules.push(json_rule(&format!("args_{i}"), &t.parameters, t.strict)?);
                let open = format!("call tool=\"{}\" index=\"1\"", attr_escape(&t.name));
                rules.push(format!(
                    "call_{i}: <|open|> {} <|sep|> <|open|> {} <|sep|> args_{i} <|close|> \"json\" <|sep|> <|close|> \"call\" <|sep|>",
                    lit(&open),
                    lit("json type=\"object\""),
                ));
                calls.push(format!("call_{i}"));
            }
            rules.push(format!("call: {}", calls.join(" | ")));
            // The response stays empty: the reply is the call.
            "<|close|> \"response\" <|sep|> <|open|> \"tools\" <|sep|> call <|close|> \"tools\" <|sep|>"
                .to_string()
        }
    };
    let start = match frame {
        ReplyFrame::Bare => format!("start: {body}"),
        ReplyFrame::Chat {
            thinking,
            think_tokens,
        } => {
            let close_response = if matches!(c, OutputConstraint::ToolCall { .. }) {
                ""
            } else {
                " <|close|> \"response\" <|sep|>"
            };
            let think = if thinking {
                rules.push(format!(
                    "think[max_tokens={}]: /(?s:.*)/",
                    think_tokens.max(1)
                ));
                "think <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> "
            } else {
                ""
            };
            format!(
                "start: {think}{body}{close_response} <|close|> \"message\" <|sep|> <|end_of_msg|>"
            )
        }
    };
    let mut out = start;
    for r in rules {
        out.push('\n');
        out.push_str(&r);
    }
    Ok(out)
}

/// A rule `name: %json {schema}`, compact (no whitespace between tokens, so a model cannot
/// spend its budget on spaces), lenient unless `strict`, the schema made fit for the
/// grammar first ([`prepare_schema`]: its error, a [`super::schema_check::SchemaError`],
/// names the path).
fn json_rule(name: &str, schema: &Value, strict: bool) -> Result<String> {
    prepared_json_rule(name, prepare_schema(schema, strict)?, strict)
}

/// [`json_rule`] of a schema already made fit for the grammar.
fn prepared_json_rule(name: &str, schema: Value, strict: bool) -> Result<String> {
    let mut schema = match schema {
        Value::Object(m) => m,
        Value::Bool(true) => Map::new(),
        Value::Bool(false) => bail!("the JSON schema is `false`: no value satisfies it"),
        other => bail!(
            "a JSON schema must be an object (or true), got {}",
            crate::json_kind::json_kind(&other)
        ),
    };
    let mut opts = match schema.remove("x-guidance") {
        Some(Value::Object(o)) => o,
        Some(_) => bail!("the schema's x-guidance must be an object of llguidance options"),
        None => Map::new(),
    };
    opts.entry("whitespace_flexible").or_insert(json!(false));
    opts.entry("lenient").or_insert(json!(!strict));
    schema.insert("x-guidance".into(), Value::Object(opts));
    Ok(format!("{name}: %json {}", Value::Object(schema)))
}

/// A Lark string literal (Lark strings are JSON strings).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// An XTML attribute value, escaped as the chat template escapes it.
fn attr_escape(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_json_frame_closes_the_message() {
        let g = reply_lark(
            &OutputConstraint::JsonObject,
            ReplyFrame::Chat {
                thinking: false,
                think_tokens: 0,
            },
        )
        .unwrap();
        assert!(g.starts_with(
            "start: value <|close|> \"response\" <|sep|> <|close|> \"message\" <|sep|> <|end_of_msg|>"
        ));
        assert!(g.contains("\"whitespace_flexible\":false"));
    }

    #[test]
    fn tool_call_needs_chat_and_a_tool() {
        let t = OutputConstraint::ToolCall { tools: vec![] };
        let chat = ReplyFrame::Chat {
            thinking: true,
            think_tokens: 8,
        };
        assert!(reply_lark(&t, chat).is_err());
        let t = OutputConstraint::ToolCall {
            tools: vec![ToolSchema {
                name: "f".into(),
                parameters: json!({}),
                strict: true,
            }],
        };
        let e = reply_lark(&t, ReplyFrame::Bare).unwrap_err().to_string();
        assert!(e.contains("needs a chat reply"), "{e}");
        let g = reply_lark(&t, chat).unwrap();
        assert!(g.contains("think[max_tokens=8]"), "{g}");
    }

    #[test]
    fn non_object_schema_is_refused() {
        let c = OutputConstraint::JsonSchema {
            schema: json!("object"),
            strict: true,
        };
        let e = reply_lark(&c, ReplyFrame::Bare).unwrap_err().to_string();
        assert!(e.contains("must be an object"), "{e}");
    }
}
