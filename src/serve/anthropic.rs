//! Anthropic's `POST /v1/messages` translated onto the same engine: the request becomes a
//! chat request (text, thinking, tool_use and tool_result blocks, tools, tool_choice), the
//! outcome becomes a `message` or its stream of events.

use super::api_error::ApiError;
use super::engine::{Event, Field, FinishReason, Outcome};
use super::request::{chat_request, parse_object, ChatRequest, Defaults, Limits};
use super::sse::SseFrame;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

type R<T> = Result<T, ApiError>;

fn field_err(field: &str, want: &str) -> ApiError {
    ApiError::field(field, format!("must be {want}"))
}

/// Text of a string or an array of `text` blocks.
fn blocks_text(v: &Value, field: &str) -> R<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(a) => {
            let mut out = String::new();
            for (i, b) in a.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    _ => return Err(field_err(&format!("{field}[{i}]"), "a text block")),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(field_err(field, "a string or an array of text blocks")),
    }
}

/// One Anthropic message as OpenAI messages (a user turn's tool results become tool
/// messages before its text).
fn translate_message(m: &Value, i: usize, out: &mut Vec<Value>) -> R<()> {
    let f = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => return Err(field_err(&format!("{f}.role"), "\"user\" or \"assistant\"")),
    };
    let content = m.get("content").unwrap_or(&Value::Null);
    let blocks: Vec<Value> = match content {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(a) => a.clone(),
        _ => {
            return Err(field_err(
                &format!("{f}.content"),
                "a string or an array of blocks",
            ))
        }
    };
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for (k, b) in blocks.iter().enumerate() {
        let bf = format!("{f}.content[{k}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => match b.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => return Err(field_err(&format!("{bf}.text"), "a string")),
            },
            Some("thinking") if role == "assistant" => {
                if let Some(Value::String(t)) = b.get("thinking") {
                    thinking.push_str(t);
                }
            }
            Some("redacted_thinking") => {}
            Some("tool_use") if role == "assistant" => {
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| field_err(&format!("{bf}.name"), "a string"))?;
                let input = match b.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => return Err(field_err(&format!("{bf}.input"), "an object")),
                };
                calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": name, "arguments": input.to_string()},
                }));
            }
            Some("tool_result") if role == "user" => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| field_err(&format!("{bf}.tool_use_id"), "a string"))?;
                let body = blocks_text(
                    b.get("content").unwrap_or(&Value::Null),
                    &format!("{bf}.content"),
                )?;
                out.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
            }
            Some(other) => {
                return Err(ApiError::field(
                    &format!("{bf}.type"),
                    format!("{other:?} blocks are not supported in a {role} message"),
                ))
            }
            None => return Err(field_err(&format!("{bf}.type"), "a string")),
        }
    }
    if role == "user" && text.is_empty() && out.last().is_some_and(|m| m["role"] == "tool") {
        return Ok(());
    }
    let mut msg = json!({"role": role, "content": text});
    if !thinking.is_empty() {
        msg["reasoning_content"] = json!(thinking);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    out.push(msg);
    Ok(())
}

/// Translates a `/v1/messages` body to OpenAI's shape (what [`chat_request`] reads).
pub fn translate(m: &Map<String, Value>) -> R<Value> {
    let mut o = Map::new();
    let mut messages = Vec::new();
    match m.get("system") {
        None | Some(Value::Null) => {}
        Some(v) => messages.push(json!({"role": "system", "content": blocks_text(v, "system")?})),
    }
    let Some(Value::Array(msgs)) = m.get("messages") else {
        return Err(field_err("messages", "an array"));
    };
    for (i, msg) in msgs.iter().enumerate() {
        translate_message(msg, i, &mut messages)?;
    }
    o.insert("messages".into(), Value::Array(messages));
    match m.get("max_tokens") {
        Some(v @ Value::Number(_)) => {
            o.insert("max_tokens".into(), v.clone());
        }
        _ => return Err(field_err("max_tokens", "a whole number (it is required)")),
    }
    for (from, to) in [
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("stop_sequences", "stop"),
    ] {
        if let Some(v) = m.get(from) {
            o.insert(to.into(), v.clone());
        }
    }
    if let Some(tools) = m.get("tools") {
        let Value::Array(a) = tools else {
            return Err(field_err("tools", "an array"));
        };
        let t: Vec<Value> = a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| field_err(&format!("tools[{i}].name"), "a string"))?;
                let mut f = json!({"name": name});
                if let Some(d) = t.get("description") {
                    f["description"] = d.clone();
                }
                if let Some(s) = t.get("input_schema") {
                    f["parameters"] = s.clone();
                }
                Ok(json!({"type": "function", "function": f}))
            })
            .collect::<R<_>>()?;
        o.insert("tools".into(), Value::Array(t));
    }
    if let Some(tc) = m.get("tool_choice") {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                json!({"type": "function", "function": {"name": tc.get("name").cloned().unwrap_or(Value::Null)}})
            }
            _ => {
                return Err(field_err(
                    "tool_choice.type",
                    "one of auto, any, tool, none",
                ))
            }
        };
        o.insert("tool_choice".into(), choice);
    }
    if let Some(th) = m.get("thinking") {
        let on = match th.get("type").and_then(Value::as_str) {
            Some("enabled") => true,
            Some("disabled") => false,
            _ => return Err(field_err("thinking.type", "\"enabled\" or \"disabled\"")),
        };
        o.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": on}),
        );
    }
    Ok(Value::Object(o))
}

/// Reads a `/v1/messages` body into a chat request.
pub fn messages_request(body: &[u8], limits: &Limits, defaults: &Defaults) -> R<ChatRequest> {
    let m = parse_object(body)?;
    let openai = translate(&m)?;
    chat_request(openai.to_string().as_bytes(), limits, defaults)
}

/// Anthropic's error shape.
pub fn error_response(e: ApiError) -> Response {
    let kind = match e.status {
        400 | 413 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        _ => "api_error",
    };
    let mut r = e.clone().into_response();
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    *r.body_mut() = axum::body::Body::from(body.to_string());
    r
}

/// `stop_reason` and `stop_sequence` of an outcome.
fn stop_reason(o: &Outcome) -> (&'static str, Value) {
    match (o.finish, &o.stop_string) {
        (FinishReason::ToolCalls, _) => ("tool_use", Value::Null),
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (FinishReason::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (FinishReason::Stop, None) => ("end_turn", Value::Null),
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "input_tokens": o.prompt_tokens - o.cached_tokens.min(o.prompt_tokens),
        "cache_read_input_tokens": o.cached_tokens,
        "output_tokens": o.completion_tokens,
    })
}

/// A whole `message`.
pub fn message(id: &str, model: &str, o: &Outcome) -> Value {
    let mut content = Vec::new();
    if !o.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": o.reasoning, "signature": ""}));
    }
    if !o.content.is_empty() {
        content.push(json!({"type": "text", "text": o.content}));
    }
    for (i, c) in o.tool_calls.iter().enumerate() {
        let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
        content.push(json!({"type": "tool_use", "id": format!("toolu_{id}_{i}"), "name": c.name, "input": input}));
    }
    let (reason, seq) = stop_reason(o);
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(o),
    })
}

/// The event stream of one answer: blocks open as their kind of text starts.
pub struct StreamEvents {
    id: String,
    model: String,
    open: Option<Field>,
    index: usize,
}

fn event(kind: &'static str, data: Value) -> SseFrame {
    let mut d = data;
    d["type"] = json!(kind);
    SseFrame::named(kind, d.to_string())
}

impl StreamEvents {
    /// Events for answer `id`.
    pub fn new(id: &str, model: &str) -> Self {
        Self {
            id: id.to_string(),
            model: model.to_string(),
            open: None,
            index: 0,
        }
    }

    /// `message_start`.
    pub fn start(&self) -> Vec<SseFrame> {
        vec![event(
            "message_start",
            json!({"message": {
                "id": format!("msg_{}", self.id), "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }}),
        )]
    }

    fn close(&mut self, out: &mut Vec<SseFrame>) {
        if self.open.take().is_some() {
            out.push(event("content_block_stop", json!({"index": self.index})));
            self.index += 1;
        }
    }

    /// Payloads for one engine event, and whether the stream ended.
    pub fn frame(&mut self, ev: Event) -> (Vec<SseFrame>, bool) {
        let mut out = Vec::new();
        match ev {
            Event::Delta(field, text) => {
                if self.open != Some(field) {
                    self.close(&mut out);
                    let block = match field {
                        Field::Reasoning => json!({"type": "thinking", "thinking": ""}),
                        Field::Content => json!({"type": "text", "text": ""}),
                    };
                    out.push(event(
                        "content_block_start",
                        json!({"index": self.index, "content_block": block}),
                    ));
                    self.open = Some(field);
                }
                let delta = match field {
                    Field::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                    Field::Content => json!({"type": "text_delta", "text": text}),
                };
                out.push(event(
                    "content_block_delta",
                    json!({"index": self.index, "delta": delta}),
                ));
                (out, false)
            }
            Event::Done(o) => {
                self.close(&mut out);
                for (i, c) in o.tool_calls.iter().enumerate() {
                    let block = json!({"type": "tool_use", "id": format!("toolu_{}_{i}", self.id), "name": c.name, "input": {}});
                    out.push(event(
                        "content_block_start",
                        json!({"index": self.index, "content_block": block}),
                    ));
                    out.push(event("content_block_delta", json!({"index": self.index, "delta": {"type": "input_json_delta", "partial_json": c.arguments}})));
                    out.push(event("content_block_stop", json!({"index": self.index})));
                    self.index += 1;
                }
                let (reason, seq) = stop_reason(&o);
                out.push(event(
                    "message_delta",
                    json!({"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(&o)}),
                ));
                out.push(event("message_stop", json!({})));
                (out, true)
            }
            Event::Failed(m) => {
                out.push(event(
                    "error",
                    json!({"error": {"type": "api_error", "message": m}}),
                ));
                (out, true)
            }
        }
    }
}
