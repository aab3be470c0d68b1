//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on
//! the engine the other routes use. The typed body becomes the one internal chat request:
//! `input` items (messages, function calls and their outputs, reasoning passed back) are
//! translated into chat messages, `previous_response_id` prepends the conversation a stored
//! response ended, function tools take the chat shape and `text.format` the
//! `response_format` one. The outcome is a `response` object, or its typed stream of events
//! with `sequence_number`s; both are built by [`ResponseEvents`], so the two agree.

use super::api_error::ApiError;
use super::body_json::{from_value, parse_body, refuse_unknown, Unknown};
use super::constrain::Api;
use super::engine::{Delta, Event, Field, FinishReason, JobKind, Outcome};
use super::http::{chat_ids_marked, sse_response, with_seed, App};
use super::openai::now_secs;
use super::openai_body;
use super::request::{ChatRequest, Defaults, Limits, ResponseFormat, ToolChoice, R};
use super::sampling_fields::{type_error, SamplingFields};
use super::sse::{event_stream, SseFrame};
use crate::tokenizer::ThinkingEffort;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

mod events;
mod store;

pub use events::ResponseEvents;
pub use store::{ResponseStore, MAX_STORED_BYTES, MAX_STORED_RESPONSES};

/// `reasoning`.
#[derive(Deserialize)]
struct ReasoningBody {
    effort: Option<String>,
    summary: Option<String>,
    /// The older name of `summary`.
    generate_summary: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// `text`.
#[derive(Deserialize)]
struct TextBody {
    format: Option<FormatBody>,
    verbosity: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// `text.format`.
#[derive(Deserialize)]
struct FormatBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    schema: Option<Value>,
    strict: Option<bool>,
    /// Shown to the model by OpenAI's servers; K3's grammar needs only the schema.
    #[allow(dead_code)]
    description: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// `stream_options`.
#[derive(Deserialize)]
struct StreamOptionsBody {
    /// Padding fields OpenAI adds against side channels: the server adds none.
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// The body of `POST /v1/responses` as sent: every field the route reads, typed; the rest
/// lands in `unknown` and is refused by name.
#[derive(Deserialize)]
struct ResponsesBody {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    reasoning: Option<ReasoningBody>,
    text: Option<TextBody>,
    stream: Option<bool>,
    stream_options: Option<StreamOptionsBody>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    metadata: Option<Map<String, Value>>,
    user: Option<String>,
    prompt_cache_key: Option<String>,
    /// A caching hint: the engine keeps the prefix it holds anyway.
    #[allow(dead_code)]
    prompt_cache_retention: Option<String>,
    safety_identifier: Option<String>,
    /// Ids a client attaches to its requests for its own records (Codex's turn and
    /// thread ids).
    #[allow(dead_code)]
    client_metadata: Option<Map<String, Value>>,
    service_tier: Option<String>,
    /// Extra output OpenAI can add (`reasoning.encrypted_content`, …): the reasoning
    /// items carry their text in the clear, so there is nothing else to include.
    #[allow(dead_code)]
    include: Option<Vec<String>>,
    truncation: Option<String>,
    background: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A checked `/v1/responses` request.
pub struct ResponsesRequest {
    /// The internal chat request.
    pub chat: ChatRequest,
    /// The request fields the `response` object reports back.
    pub echo: Map<String, Value>,
    /// The conversation in chat messages without `instructions`: the previous response's
    /// and this input, kept with the answer for a later `previous_response_id`.
    pub conversation: Vec<Value>,
    /// Whether the response is kept (`store`, true by default).
    pub store: bool,
    /// Whether the think text is reported as the reasoning summary (`reasoning.summary`).
    pub summary: bool,
    /// The namespace of each function declared in one, for the calls of it.
    pub namespaces: HashMap<String, String>,
}

fn field_is(field: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::field(field, message)
}

/// One content part of an input message.
#[derive(Deserialize)]
struct PartBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
    refusal: Option<String>,
    /// Citations of an `output_text` passed back: not part of the prompt.
    #[allow(dead_code)]
    annotations: Option<Value>,
    /// Log-probabilities of an `output_text` passed back: not part of the prompt.
    #[allow(dead_code)]
    logprobs: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// The text of a message's `content` (a string or text parts) or of a function call's
/// `output`.
fn parts_text(v: Option<Value>, field: &str) -> R<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (k, p) in parts.into_iter().enumerate() {
                let f = format!("{field}[{k}]");
                if !p.is_object() {
                    return Err(type_error(&f, "an object", &p));
                }
                let part: PartBody = from_value(p, &f)?;
                let text = match part.kind.as_deref() {
                    Some("input_text" | "output_text" | "text") => part.text,
                    Some("refusal") => part.refusal,
                    Some(other) => {
                        return Err(field_is(
                            &format!("{f}.type"),
                            format!("{other:?} parts are not supported (text only: input_text, output_text)"),
                        ))
                    }
                    None => return Err(field_is(&format!("{f}.type"), "is missing")),
                };
                refuse_unknown(&part.unknown, &f)?;
                match text {
                    Some(t) => out.push_str(&t),
                    None => return Err(field_is(&format!("{f}.text"), "is missing")),
                }
            }
            Ok(out)
        }
        Some(v) => Err(type_error(field, "a string or an array of text parts", &v)),
    }
}

/// A `message` input item (with or without `"type": "message"`).
#[derive(Deserialize)]
struct MessageItem {
    role: Option<String>,
    content: Option<Value>,
    /// The item's id, when passed back from an earlier output.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status, when passed back from an earlier output.
    #[allow(dead_code)]
    status: Option<String>,
    /// Commentary or final answer, a label of OpenAI's own models' turns.
    #[allow(dead_code)]
    phase: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `function_call` input item: a call an earlier answer made.
#[derive(Deserialize)]
struct FunctionCallItem {
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    /// The namespace of a function declared in one: function names are unique anyway.
    #[allow(dead_code)]
    namespace: Option<String>,
    /// The item's id, when passed back from an earlier output.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status, when passed back from an earlier output.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `function_call_output` input item: a call's result.
#[derive(Deserialize)]
struct FunctionOutputItem {
    call_id: Option<String>,
    output: Option<Value>,
    /// The function's name; the call with `call_id` names it anyway.
    #[allow(dead_code)]
    name: Option<String>,
    /// The item's id.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// One text part of a reasoning item (`summary_text` or `reasoning_text`).
#[derive(Deserialize)]
struct ReasoningPart {
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    text: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `reasoning` input item: an earlier answer's thinking, passed back.
#[derive(Deserialize)]
struct ReasoningItem {
    summary: Option<Vec<Value>>,
    content: Option<Vec<Value>>,
    /// OpenAI's encrypted reasoning: opaque to any other server, so not read. This
    /// server's own reasoning items carry their text in `content` or `summary`.
    #[allow(dead_code)]
    encrypted_content: Option<String>,
    /// The item's id.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

fn reasoning_text(parts: Option<Vec<Value>>, field: &str) -> R<String> {
    let mut out = String::new();
    for (k, p) in parts.unwrap_or_default().into_iter().enumerate() {
        let f = format!("{field}[{k}]");
        if !p.is_object() {
            return Err(type_error(&f, "an object", &p));
        }
        let part: ReasoningPart = from_value(p, &f)?;
        refuse_unknown(&part.unknown, &f)?;
        out.push_str(&part.text.unwrap_or_default());
    }
    Ok(out)
}

/// The call ids and names of the tool calls in chat messages.
fn calls_of(messages: &[Value]) -> Vec<(String, String)> {
    messages
        .iter()
        .filter_map(|m| m.get("tool_calls")?.as_array())
        .flatten()
        .filter_map(|c| {
            let id = c.get("id")?.as_str()?.to_string();
            let name = c.get("function")?.get("name")?.as_str()?.to_string();
            Some((id, name))
        })
        .collect()
}

/// Appends `input` (a string, or a list of items) to `out` as chat messages.
fn translate_input(input: Value, out: &mut Vec<Value>) -> R<()> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(a) => a,
        v => return Err(type_error("input", "a string or an array of items", &v)),
    };
    let mut calls = calls_of(out);
    let mut reasoning: Option<String> = None;
    for (i, mut item) in items.into_iter().enumerate() {
        let f = format!("input[{i}]");
        let Value::Object(o) = &mut item else {
            return Err(type_error(&f, "an object", &item));
        };
        // The type picks the struct the item is read into.
        let kind = match o.remove("type") {
            None | Some(Value::Null) => "message".to_string(),
            Some(Value::String(s)) => s,
            Some(v) => return Err(type_error(&format!("{f}.type"), "a string", &v)),
        };
        match kind.as_str() {
            "message" => {
                let m: MessageItem = from_value(item, &f)?;
                let role = match m.role.as_deref() {
                    Some(r @ ("user" | "system" | "developer" | "assistant")) => r.to_string(),
                    Some(other) => {
                        return Err(field_is(
                            &format!("{f}.role"),
                            format!("{other:?} is not one of user, system, developer, assistant"),
                        ))
                    }
                    None => return Err(field_is(&format!("{f}.role"), "is missing")),
                };
                refuse_unknown(&m.unknown, &f)?;
                let text = parts_text(m.content, &format!("{f}.content"))?;
                let mut msg = json!({"role": role, "content": text});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        msg["reasoning_content"] = json!(r);
                    }
                } else {
                    // Thinking passed back belongs to the assistant turn after it.
                    reasoning = None;
                }
                out.push(msg);
            }
            "function_call" => {
                let c: FunctionCallItem = from_value(item, &f)?;
                refuse_unknown(&c.unknown, &f)?;
                let call_id = c
                    .call_id
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.call_id"), "is missing"))?;
                let name = c
                    .name
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
                let arguments = c.arguments.unwrap_or_default();
                calls.push((call_id.clone(), name.clone()));
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                // Calls of one answer join its assistant message.
                let joins = out
                    .last()
                    .is_some_and(|m| m["role"] == "assistant" && reasoning.is_none());
                if !joins {
                    let mut msg = json!({"role": "assistant", "content": ""});
                    if let Some(r) = reasoning.take() {
                        msg["reasoning_content"] = json!(r);
                    }
                    out.push(msg);
                }
                if let Some(Value::Object(last)) = out.last_mut() {
                    match last.get_mut("tool_calls") {
                        Some(Value::Array(a)) => a.push(call),
                        _ => {
                            last.insert("tool_calls".into(), Value::Array(vec![call]));
                        }
                    }
                }
            }
            "function_call_output" => {
                let r: FunctionOutputItem = from_value(item, &f)?;
                refuse_unknown(&r.unknown, &f)?;
                let call_id = r
                    .call_id
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.call_id"), "is missing"))?;
                let Some((_, name)) = calls.iter().rev().find(|(id, _)| *id == call_id) else {
                    return Err(field_is(
                        &format!("{f}.call_id"),
                        format!("{call_id:?} answers no function_call before it (in input or the previous response)"),
                    ));
                };
                let text = parts_text(r.output, &format!("{f}.output"))?;
                reasoning = None;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "name": name,
                                "content": text}));
            }
            "reasoning" => {
                let r: ReasoningItem = from_value(item, &f)?;
                refuse_unknown(&r.unknown, &f)?;
                let content = reasoning_text(r.content, &format!("{f}.content"))?;
                let text = if content.is_empty() {
                    reasoning_text(r.summary, &format!("{f}.summary"))?
                } else {
                    content
                };
                reasoning.get_or_insert_with(String::new).push_str(&text);
            }
            "item_reference" => {
                return Err(field_is(
                    &format!("{f}.type"),
                    "item_reference is not supported; send the item itself, or previous_response_id",
                ))
            }
            other => {
                return Err(field_is(
                    &format!("{f}.type"),
                    format!("{other:?} items are not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(())
}

/// One declared tool in the Responses shape.
#[derive(Deserialize)]
struct ToolBody {
    name: Option<String>,
    description: Option<Value>,
    parameters: Option<Value>,
    strict: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `namespace` tool: function tools grouped under a name (Codex declares its sub-agent
/// tools so). Its functions are offered as they are; a call of one names the namespace.
#[derive(Deserialize)]
struct NamespaceBody {
    name: Option<String>,
    /// What the group is for; each function keeps its own description.
    #[allow(dead_code)]
    description: Option<Value>,
    tools: Option<Vec<Value>>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// One function tool (at `f`) in the chat shape.
fn function_tool(mut t: Value, f: &str) -> R<Value> {
    let Value::Object(o) = &mut t else {
        return Err(type_error(f, "an object", &t));
    };
    match o.remove("type") {
        Some(Value::String(k)) if k == "function" => {}
        Some(Value::String(k)) => {
            return Err(field_is(
                &format!("{f}.type"),
                format!(
                    "{k:?} tools are not supported by this server (function tools only){}",
                    if k == "web_search" {
                        "; Codex CLI declares it unless its config.toml sets web_search = \"disabled\""
                    } else {
                        ""
                    }
                ),
            ))
        }
        Some(v) => return Err(type_error(&format!("{f}.type"), "a string", &v)),
        None => return Err(field_is(&format!("{f}.type"), "is missing")),
    }
    let t: ToolBody = from_value(t, f)?;
    refuse_unknown(&t.unknown, f)?;
    let name = t
        .name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
    let mut func = json!({"name": name});
    if let Some(d) = t.description.filter(|d| !d.is_null()) {
        func["description"] = d;
    }
    if let Some(p) = t.parameters.filter(|p| !p.is_null()) {
        func["parameters"] = p;
    }
    if let Some(s) = t.strict {
        func["strict"] = json!(s);
    }
    Ok(json!({"type": "function", "function": func}))
}

/// Declared tools: `tools` in the chat shape (a namespace's functions in its place), and
/// the namespace of each function declared in one.
struct Tools {
    chat: Vec<Value>,
    namespaces: HashMap<String, String>,
}

/// Reads `tools`: function tools and namespaces of them; a tool of any other type is
/// refused naming it, and so is a function name declared twice.
fn tools(v: Option<Value>) -> R<Tools> {
    let mut out = Tools {
        chat: Vec::new(),
        namespaces: HashMap::new(),
    };
    let a = match v {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(type_error("tools", "an array", &v)),
    };
    let add = |out: &mut Tools, tool: Value, f: &str| -> R<()> {
        let name = openai_body::tool_name(&tool)
            .unwrap_or_default()
            .to_string();
        if out
            .chat
            .iter()
            .any(|t| openai_body::tool_name(t) == Some(name.as_str()))
        {
            return Err(field_is(
                &format!("{f}.name"),
                format!("{name:?} is declared twice"),
            ));
        }
        out.chat.push(tool);
        Ok(())
    };
    for (i, t) in a.into_iter().enumerate() {
        let f = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("namespace") {
            let tool = function_tool(t, &f)?;
            add(&mut out, tool, &f)?;
            continue;
        }
        let mut t = t;
        if let Value::Object(o) = &mut t {
            o.remove("type");
        }
        let ns: NamespaceBody = from_value(t, &f)?;
        refuse_unknown(&ns.unknown, &f)?;
        let name = ns
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
        for (k, inner) in ns.tools.unwrap_or_default().into_iter().enumerate() {
            let fk = format!("{f}.tools[{k}]");
            let tool = function_tool(inner, &fk)?;
            if let Some(n) = openai_body::tool_name(&tool) {
                out.namespaces.insert(n.to_string(), name.clone());
            }
            add(&mut out, tool, &fk)?;
        }
    }
    Ok(out)
}

/// `tool_choice`: `auto`, `none`, `required`, or `{"type": "function", "name": ...}`.
fn tool_choice(v: Option<&Value>, tools: &[Value]) -> R<ToolChoice> {
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(field_is(
                    "tool_choice",
                    format!("{other:?} is not one of auto, none, required"),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| field_is("tool_choice.name", "is missing"))?;
                openai_body::named_tool(name, tools, "tool_choice.name")?
            }
            Some(other) => {
                return Err(field_is(
                    "tool_choice.type",
                    format!("{other:?} is not supported (auto, none, required or a function)"),
                ))
            }
            None => return Err(field_is("tool_choice.type", "is missing")),
        },
        Some(v) => return Err(type_error("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() && choice == ToolChoice::Required {
        return Err(field_is(
            "tool_choice",
            "\"required\" needs at least one tool in `tools`",
        ));
    }
    Ok(choice)
}

/// `text.format` as the internal `response_format`, and its echo.
fn text_format(t: Option<TextBody>) -> R<(ResponseFormat, Value)> {
    let Some(t) = t else {
        return Ok((ResponseFormat::Text, json!({"format": {"type": "text"}})));
    };
    refuse_unknown(&t.unknown, "text")?;
    match t.verbosity.as_deref() {
        None | Some("medium") => {}
        Some(other) => {
            return Err(field_is(
                "text.verbosity",
                format!("{other:?} is not supported (only the default, \"medium\")"),
            ))
        }
    }
    let Some(f) = t.format else {
        return Ok((ResponseFormat::Text, json!({"format": {"type": "text"}})));
    };
    refuse_unknown(&f.unknown, "text.format")?;
    let format = match f.kind.as_deref() {
        Some("text") => ResponseFormat::Text,
        Some("json_object") => ResponseFormat::JsonObject,
        Some("json_schema") => ResponseFormat::JsonSchema {
            name: f.name.clone().unwrap_or_default(),
            schema: f
                .schema
                .clone()
                .ok_or_else(|| field_is("text.format.schema", "is missing"))?,
            strict: f.strict.unwrap_or(false),
        },
        Some(other) => {
            return Err(field_is(
                "text.format.type",
                format!("{other:?} is not one of text, json_object, json_schema"),
            ))
        }
        None => return Err(field_is("text.format.type", "is missing")),
    };
    let mut echo = json!({"type": f.kind});
    if let ResponseFormat::JsonSchema {
        name,
        schema,
        strict,
    } = &format
    {
        echo["name"] = json!(name);
        echo["schema"] = schema.clone();
        echo["strict"] = json!(strict);
    }
    Ok((format, json!({"format": echo})))
}

/// `reasoning`: thinking on or off and its effort, whether the think text is reported as
/// the summary, and the echo.
fn reasoning(
    r: Option<ReasoningBody>,
    default_thinking: bool,
) -> R<(bool, Option<ThinkingEffort>, bool, Value)> {
    let Some(r) = r else {
        return Ok((
            default_thinking,
            Some(ThinkingEffort::Max),
            false,
            json!({"effort": null, "summary": null}),
        ));
    };
    refuse_unknown(&r.unknown, "reasoning")?;
    let (mut thinking, mut effort) = (default_thinking, Some(ThinkingEffort::Max));
    match r.effort.as_deref() {
        None => {}
        Some("xhigh") => {
            thinking = true;
            effort = Some(ThinkingEffort::Max);
        }
        Some(s) => match openai_body::effort(s, "reasoning.effort")? {
            Some(e) => {
                thinking = true;
                effort = Some(e);
            }
            None => thinking = false,
        },
    }
    let summary = r.summary.or(r.generate_summary);
    let field = "reasoning.summary";
    let summarize = match summary.as_deref() {
        None => false,
        Some("auto" | "concise" | "detailed") => true,
        Some(other) => {
            return Err(field_is(
                field,
                format!("{other:?} is not one of auto, concise, detailed"),
            ))
        }
    };
    Ok((
        thinking,
        effort,
        summarize,
        json!({"effort": r.effort, "summary": summary}),
    ))
}

/// Reads a `/v1/responses` body; `store` resolves `previous_response_id`.
pub fn read_request(
    body: &[u8],
    limits: &Limits,
    defaults: &Defaults,
    store: &ResponseStore,
) -> R<ResponsesRequest> {
    let mut b: ResponsesBody = parse_body(body)?;
    refuse_unknown(&b.unknown, "")?;
    if let Some(o) = b.stream_options.take() {
        refuse_unknown(&o.unknown, "stream_options")?;
    }
    match b.service_tier.as_deref() {
        None | Some("auto" | "default") => {}
        Some(other) => {
            return Err(field_is(
                "service_tier",
                format!("{other:?} is not supported (auto or default)"),
            ))
        }
    }
    match b.truncation.as_deref() {
        None | Some("disabled") => {}
        Some(other) => {
            return Err(field_is(
                "truncation",
                format!("{other:?} is not supported: a conversation longer than the context is refused, never cut (\"disabled\")"),
            ))
        }
    }
    if b.background == Some(true) {
        return Err(field_is(
            "background",
            "is not supported: a response is generated while the request waits",
        ));
    }
    if let Some(m) = &b.metadata {
        if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_string()) {
            return Err(type_error(&format!("metadata.{k}"), "a string", v));
        }
    }
    let mut conversation = match b.previous_response_id.as_deref() {
        None => Vec::new(),
        Some(id) => store.conversation(id)?,
    };
    match b.input.take() {
        None | Some(Value::Null) if conversation.is_empty() => {
            return Err(field_is("input", "is missing"))
        }
        None | Some(Value::Null) => {}
        Some(v) => translate_input(v, &mut conversation)?,
    }
    if conversation.is_empty() {
        return Err(field_is("input", "must hold at least one item"));
    }
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = b.instructions.as_ref().filter(|i| !i.is_empty()) {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(conversation.iter().cloned());
    if messages.len() > limits.max_messages {
        return Err(field_is(
            "input",
            format!(
                "the conversation is {} messages, at most {}",
                messages.len(),
                limits.max_messages
            ),
        ));
    }
    let messages = openai_body::messages(Some(Value::Array(messages)), limits)?;
    let fields = SamplingFields {
        temperature: b.temperature,
        top_p: b.top_p,
        max_tokens: b.max_output_tokens.map(|n| ("max_output_tokens", n)),
        stream: b.stream,
        model: b.model.take(),
        ..SamplingFields::default()
    };
    let params = fields.params(limits, &defaults.sampling)?;
    let tools_sent = b.tools.take();
    let Tools {
        chat: tools,
        namespaces,
    } = tools(tools_sent.clone())?;
    let choice_sent = b.tool_choice.take();
    let tool_choice = tool_choice(choice_sent.as_ref(), &tools)?;
    let (response_format, text_echo) = text_format(b.text.take())?;
    let (thinking, effort, summary, reasoning_echo) =
        reasoning(b.reasoning.take(), defaults.thinking)?;
    let parallel = b.parallel_tool_calls.unwrap_or(true);
    let store_it = b.store.unwrap_or(true);
    let mut echo = Map::new();
    let mut put = |k: &str, v: Value| {
        echo.insert(k.to_string(), v);
    };
    put("instructions", json!(b.instructions));
    put("max_output_tokens", json!(b.max_output_tokens));
    put(
        "metadata",
        Value::Object(b.metadata.take().unwrap_or_default()),
    );
    put("parallel_tool_calls", json!(parallel));
    put("previous_response_id", json!(b.previous_response_id));
    put("reasoning", reasoning_echo);
    put("service_tier", json!("default"));
    put("store", json!(store_it));
    put("temperature", json!(params.sampling.temperature));
    put("text", text_echo);
    put(
        "tool_choice",
        choice_sent
            .filter(|v| !v.is_null())
            .unwrap_or(json!("auto")),
    );
    put(
        "tools",
        tools_sent.filter(|v| !v.is_null()).unwrap_or(json!([])),
    );
    put("top_p", json!(params.sampling.top_p));
    put("truncation", json!("disabled"));
    put("user", json!(b.user));
    put("prompt_cache_key", json!(b.prompt_cache_key));
    put("safety_identifier", json!(b.safety_identifier));
    put("background", json!(false));
    Ok(ResponsesRequest {
        chat: ChatRequest {
            messages,
            tools,
            tools_breakpoint: false,
            tool_choice,
            single_tool_call: !parallel,
            response_format,
            thinking,
            effort,
            params,
        },
        echo,
        conversation,
        store: store_it,
        summary,
        namespaces,
    })
}

/// Keeps a finished response when the request asked for it.
fn keep(app: &App, events: &ResponseEvents, conversation: &mut Vec<Value>, store: bool) {
    let Some(r) = events.finished() else { return };
    if !store {
        if let Some(id) = r["id"].as_str() {
            app.responses.put_unstored(id);
        }
        return;
    }
    let mut conv = std::mem::take(conversation);
    conv.push(events.assistant_message());
    app.responses.put(r.clone(), conv);
}

/// `POST /v1/responses`.
pub async fn create(State(app): State<Arc<App>>, body: Body) -> Result<Response, ApiError> {
    let bytes = app.body(body).await?;
    let req = read_request(&bytes, &app.limits, &app.defaults, &app.responses)?;
    let ResponsesRequest {
        mut chat,
        echo,
        mut conversation,
        store,
        summary,
        namespaces,
    } = req;
    app.check_model(&chat.params)?;
    let ids = chat_ids_marked(&app, &mut chat)?;
    let place = app.queue_place()?;
    chat.params.constraint = app.constrain(&place, &chat, Api::Responses, ids.len())?;
    let (stream, seed) = (chat.params.stream, chat.params.sampling.seed);
    let kind = JobKind::Chat {
        thinking: chat.thinking,
        single_tool_call: chat.single_tool_call,
    };
    let (job, mut rx, guard) = app.submit(place, ids, chat.params, kind, false)?;
    let id = app.responses.response_id(&job);
    let mut events = ResponseEvents::new(&id, &app.model_name, echo, summary, namespaces);
    if !stream {
        while let Some(ev) = rx.recv().await {
            let (_, end) = events.frame(ev);
            if end {
                break;
            }
        }
        drop(guard);
        if let Some(m) = events.failed.take() {
            return Err(ApiError::status(500, m));
        }
        keep(&app, &events, &mut conversation, store);
        return match events.finished() {
            Some(r) => Ok(with_seed(Json(r.clone()).into_response(), seed)),
            None => Err(ApiError::status(500, "the engine dropped the request")),
        };
    }
    let first = events.start();
    let app2 = app.clone();
    let frame = move |ev: Event| {
        let out = events.frame(ev);
        keep(&app2, &events, &mut conversation, store);
        out
    };
    Ok(with_seed(
        sse_response(event_stream(first, rx, guard, frame)),
        seed,
    ))
}

/// `GET /v1/responses/{id}`.
pub async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.responses.get(&id) {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.responses.delete(&id) {
        Ok(()) => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Err(e) => e.into_response(),
    }
}
