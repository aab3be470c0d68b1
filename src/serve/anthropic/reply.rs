//! Answering `/v1/messages`: the outcome as a whole `message` or its stream of events,
//! errors in Anthropic's shape.

use crate::serve::api_error::ApiError;
use crate::serve::context_edits;
use crate::serve::job::{Delta, Event, Field, FinishReason, Outcome};
use crate::serve::sse::SseFrame;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

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
    let c = o.first();
    match (c.finish, &c.stop_string) {
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

/// `context_management` of an answer: what each applied edit cleared.
pub fn applied_edits(applied: &[context_edits::AppliedEdit]) -> Value {
    let edits: Vec<Value> = applied
        .iter()
        .map(|a| {
            let count = if a.kind == "clear_thinking_20251015" {
                "cleared_thinking_turns"
            } else {
                "cleared_tool_uses"
            };
            json!({"type": a.kind, count: a.cleared, "cleared_input_tokens": a.cleared_tokens})
        })
        .collect();
    json!({"applied_edits": edits})
}

/// A whole `message`.
pub fn message(id: &str, model: &str, o: &Outcome) -> Value {
    let mut content = Vec::new();
    let first = o.first();
    if !first.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": first.reasoning, "signature": ""}));
    }
    if !first.content.is_empty() {
        content.push(json!({"type": "text", "text": first.content}));
    }
    for (i, c) in first.tool_calls.iter().enumerate() {
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
    input_tokens: usize,
    open: Option<Field>,
    index: usize,
    /// The applied context edits, reported in `message_delta`.
    pub context_management: Option<Value>,
}

fn event(kind: &'static str, data: Value) -> SseFrame {
    let mut d = data;
    d["type"] = json!(kind);
    SseFrame::named(kind, d.to_string())
}

impl StreamEvents {
    /// Events for answer `id` to a prompt of `input_tokens`.
    pub fn new(id: &str, model: &str, input_tokens: usize) -> Self {
        Self {
            id: id.to_string(),
            model: model.to_string(),
            input_tokens,
            open: None,
            index: 0,
            context_management: None,
        }
    }

    /// `message_start`.
    pub fn start(&self) -> Vec<SseFrame> {
        vec![event(
            "message_start",
            json!({"message": {
                "id": format!("msg_{}", self.id), "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
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
            // A piece with only log-probabilities: Anthropic reports none.
            Event::Delta(Delta { text, .. }) if text.is_empty() => (out, false),
            Event::Delta(Delta { field, text, .. }) => {
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
                for (i, c) in o.first().tool_calls.iter().enumerate() {
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
                let mut delta = json!({"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(&o)});
                if let Some(cm) = self.context_management.take() {
                    delta["context_management"] = cm;
                }
                out.push(event("message_delta", delta));
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
