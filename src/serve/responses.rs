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

/// Responses the store keeps at most; the oldest goes first.
pub const MAX_STORED_RESPONSES: usize = 256;

/// Bytes of stored responses and conversations the store keeps at most (their JSON).
pub const MAX_STORED_BYTES: usize = 64 << 20;

/// Ids of `store: false` responses remembered, so a later reference gets the reason.
const MAX_UNSTORED_IDS: usize = 4096;

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

/// What one output item holds.
#[derive(Clone, Debug)]
enum ItemBody {
    Reasoning(String),
    Message(String),
    Call {
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// One output item of a response.
#[derive(Clone, Debug)]
struct OutItem {
    id: String,
    body: ItemBody,
    status: &'static str,
}

/// The output items and events of one response, built from the engine's events: a
/// reasoning or message item opens when its kind of text starts, tool calls follow at the
/// end. The whole answer of a request that does not stream is built the same way.
pub struct ResponseEvents {
    id: String,
    model: String,
    created_at: u64,
    echo: Map<String, Value>,
    summary: bool,
    namespaces: HashMap<String, String>,
    items: Vec<OutItem>,
    open: bool,
    seq: u64,
    finished: Option<Value>,
    failed: Option<String>,
}

impl ResponseEvents {
    /// The events of response `id`; `summary` reports think text as the reasoning summary,
    /// `namespaces` names the namespace of each function declared in one.
    pub fn new(
        id: &str,
        model: &str,
        echo: Map<String, Value>,
        summary: bool,
        namespaces: HashMap<String, String>,
    ) -> Self {
        Self {
            id: id.to_string(),
            model: model.to_string(),
            created_at: now_secs(),
            echo,
            summary,
            namespaces,
            items: Vec::new(),
            open: false,
            seq: 0,
            finished: None,
            failed: None,
        }
    }

    fn event(&mut self, kind: &'static str, mut data: Value) -> SseFrame {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        SseFrame::named(kind, data.to_string())
    }

    /// The id's tail that item ids are built on.
    fn base(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }

    fn item_json(&self, item: &OutItem, whole: bool) -> Value {
        match &item.body {
            ItemBody::Reasoning(text) => {
                let part = |kind: &str| {
                    if whole {
                        json!([{"type": kind, "text": text}])
                    } else {
                        json!([])
                    }
                };
                let mut v = json!({"id": item.id, "type": "reasoning", "status": item.status});
                if self.summary {
                    v["summary"] = part("summary_text");
                } else {
                    v["summary"] = json!([]);
                    v["content"] = part("reasoning_text");
                }
                v
            }
            ItemBody::Message(text) => {
                let content = if whole {
                    json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
                } else {
                    json!([])
                };
                json!({"id": item.id, "type": "message", "status": item.status,
                       "role": "assistant", "content": content})
            }
            ItemBody::Call {
                call_id,
                name,
                arguments,
            } => {
                let mut v = json!({"id": item.id, "type": "function_call", "status": item.status,
                                   "call_id": call_id, "name": name,
                                   "arguments": if whole { arguments.as_str() } else { "" }});
                if let Some(ns) = self.namespaces.get(name) {
                    v["namespace"] = json!(ns);
                }
                v
            }
        }
    }

    /// The `response` object in its present state.
    fn response(&self, status: &str, o: Option<&Outcome>, error: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": null,
            "model": self.model,
            "output": self.items.iter().map(|i| self.item_json(i, true)).collect::<Vec<_>>(),
            "usage": null,
        });
        if let Value::Object(m) = &mut v {
            for (k, e) in &self.echo {
                m.insert(k.clone(), e.clone());
            }
        }
        if status == "incomplete" {
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if let Some(o) = o {
            v["completed_at"] = json!(now_secs());
            v["usage"] = usage(o);
        }
        v
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<SseFrame> {
        let r = self.response("in_progress", None, None);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn open_item(&mut self, body: ItemBody, out: &mut Vec<SseFrame>) {
        let index = self.items.len();
        let prefix = match body {
            ItemBody::Reasoning(_) => "rs",
            ItemBody::Message(_) => "msg",
            ItemBody::Call { .. } => "fc",
        };
        let item = OutItem {
            id: format!("{prefix}_{}_{index}", self.base()),
            body,
            status: "in_progress",
        };
        let added = self.item_json(&item, false);
        let id = item.id.clone();
        let kind = std::mem::discriminant(&item.body);
        self.items.push(item);
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        let at = json!({"item_id": id, "output_index": index});
        let with = |mut v: Value, k: &str, x: Value| {
            v[k] = x;
            v
        };
        if kind == std::mem::discriminant(&ItemBody::Message(String::new())) {
            let part =
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
            let d = with(with(at, "content_index", json!(0)), "part", part);
            out.push(self.event("response.content_part.added", d));
        } else if kind == std::mem::discriminant(&ItemBody::Reasoning(String::new())) {
            if self.summary {
                let part = json!({"type": "summary_text", "text": ""});
                let d = with(with(at, "summary_index", json!(0)), "part", part);
                out.push(self.event("response.reasoning_summary_part.added", d));
            } else {
                let part = json!({"type": "reasoning_text", "text": ""});
                let d = with(with(at, "content_index", json!(0)), "part", part);
                out.push(self.event("response.content_part.added", d));
            }
        }
        self.open = true;
    }

    /// Closes the open text item with `status`.
    fn close_item(&mut self, status: &'static str, out: &mut Vec<SseFrame>) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let index = self.items.len() - 1;
        self.items[index].status = status;
        let item = self.items[index].clone();
        let at = |k: &str, v: Value| {
            let mut d = json!({"item_id": item.id, "output_index": index});
            d[k] = v;
            d
        };
        match &item.body {
            ItemBody::Message(text) => {
                let mut d = at("content_index", json!(0));
                d["text"] = json!(text);
                d["logprobs"] = json!([]);
                out.push(self.event("response.output_text.done", d));
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let mut d = at("content_index", json!(0));
                d["part"] = part;
                out.push(self.event("response.content_part.done", d));
            }
            ItemBody::Reasoning(text) if self.summary => {
                let mut d = at("summary_index", json!(0));
                d["text"] = json!(text);
                out.push(self.event("response.reasoning_summary_text.done", d));
                let mut d = at("summary_index", json!(0));
                d["part"] = json!({"type": "summary_text", "text": text});
                out.push(self.event("response.reasoning_summary_part.done", d));
            }
            ItemBody::Reasoning(text) => {
                let mut d = at("content_index", json!(0));
                d["text"] = json!(text);
                out.push(self.event("response.reasoning_text.done", d));
                let mut d = at("content_index", json!(0));
                d["part"] = json!({"type": "reasoning_text", "text": text});
                out.push(self.event("response.content_part.done", d));
            }
            ItemBody::Call { .. } => {}
        }
        let done = self.item_json(&item, true);
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
    }

    fn text(&mut self, field: Field, text: String, out: &mut Vec<SseFrame>) {
        let same = self.open
            && matches!(
                (field, self.items.last().map(|i| &i.body)),
                (Field::Reasoning, Some(ItemBody::Reasoning(_)))
                    | (Field::Content, Some(ItemBody::Message(_)))
            );
        if !same {
            self.close_item("completed", out);
            let body = match field {
                Field::Reasoning => ItemBody::Reasoning(String::new()),
                Field::Content => ItemBody::Message(String::new()),
            };
            self.open_item(body, out);
        }
        let index = self.items.len() - 1;
        let item_id = self.items[index].id.clone();
        let d = json!({"item_id": item_id, "output_index": index});
        let (kind, d) = match &mut self.items[index].body {
            ItemBody::Message(t) => {
                t.push_str(&text);
                let mut d = d;
                d["content_index"] = json!(0);
                d["delta"] = json!(text);
                d["logprobs"] = json!([]);
                ("response.output_text.delta", d)
            }
            ItemBody::Reasoning(t) => {
                t.push_str(&text);
                let mut d = d;
                let (k, idx) = if self.summary {
                    ("response.reasoning_summary_text.delta", "summary_index")
                } else {
                    ("response.reasoning_text.delta", "content_index")
                };
                d[idx] = json!(0);
                d["delta"] = json!(text);
                (k, d)
            }
            ItemBody::Call { .. } => return,
        };
        out.push(self.event(kind, d));
    }

    /// Frames for one engine event, and whether the stream ended.
    pub fn frame(&mut self, ev: Event) -> (Vec<SseFrame>, bool) {
        let mut out = Vec::new();
        match ev {
            Event::Delta(Delta { text, field, .. }) => {
                if !text.is_empty() {
                    self.text(field, text, &mut out);
                }
                (out, false)
            }
            Event::Done(o) => {
                let c = o.first();
                let incomplete = c.finish == FinishReason::Length;
                let last_status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                let has_message = self
                    .items
                    .iter()
                    .any(|i| matches!(i.body, ItemBody::Message(_)));
                if !has_message && c.tool_calls.is_empty() {
                    self.close_item("completed", &mut out);
                    self.open_item(ItemBody::Message(String::new()), &mut out);
                }
                self.close_item(
                    if c.tool_calls.is_empty() {
                        last_status
                    } else {
                        "completed"
                    },
                    &mut out,
                );
                for (k, call) in c.tool_calls.iter().enumerate() {
                    let call_id = format!("call_{}_{k}", self.base());
                    let body = ItemBody::Call {
                        call_id,
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                    };
                    self.open_item(body, &mut out);
                    self.open = false;
                    let index = self.items.len() - 1;
                    self.items[index].status = "completed";
                    let item_id = self.items[index].id.clone();
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": call.arguments}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": item_id, "output_index": index, "name": call.name,
                               "arguments": call.arguments}),
                    ));
                    let done = self.item_json(&self.items[index], true);
                    out.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": done}),
                    ));
                }
                let status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                let r = self.response(status, Some(&o), None);
                let kind = if incomplete {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.push(self.event(kind, json!({"response": r})));
                self.finished = Some(r);
                (out, true)
            }
            Event::Failed(m) => {
                self.close_item("incomplete", &mut out);
                let error = json!({"code": "server_error", "message": m});
                let r = self.response("failed", None, Some(error));
                out.push(self.event("response.failed", json!({"response": r})));
                self.failed = Some(m);
                (out, true)
            }
        }
    }

    /// The finished `response` object, once the engine's `Done` came.
    pub fn finished(&self) -> Option<&Value> {
        self.finished.as_ref()
    }

    /// The answer as a chat message (thinking, text and calls with their call ids), for
    /// the stored conversation.
    pub fn assistant_message(&self) -> Value {
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for i in &self.items {
            match &i.body {
                ItemBody::Reasoning(t) => reasoning.push_str(t),
                ItemBody::Message(t) => content.push_str(t),
                ItemBody::Call {
                    call_id,
                    name,
                    arguments,
                } => calls.push(json!({"id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": arguments}})),
            }
        }
        let mut m = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            m["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }
}

/// `usage` in the Responses shape.
fn usage(o: &Outcome) -> Value {
    let reasoning: usize = o.choices.iter().map(|c| c.reasoning_tokens).sum();
    json!({
        "input_tokens": o.prompt_tokens,
        "input_tokens_details": {"cached_tokens": o.cached_tokens},
        "output_tokens": o.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    })
}

/// A stored response: the object `GET` returns and the conversation it ended.
struct Kept {
    response: Value,
    conversation: Vec<Value>,
    bytes: usize,
}

#[derive(Default)]
struct StoreInner {
    kept: HashMap<String, Kept>,
    order: VecDeque<String>,
    bytes: usize,
    unstored: VecDeque<String>,
}

/// The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
/// [`MAX_STORED_RESPONSES`] and [`MAX_STORED_BYTES`], in memory, the oldest dropped first.
/// Ids carry a number drawn at start, so an id from another run of the server is unknown
/// here rather than naming some other response.
pub struct ResponseStore {
    nonce: u64,
    inner: Mutex<StoreInner>,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a response id names nothing held.
fn not_held(id: &str, unstored: bool) -> String {
    if unstored {
        format!("response {id:?} was made with store: false, so nothing of it was kept; send the conversation in `input` instead")
    } else {
        format!("response {id:?} is not held by this server: deleted, dropped (it keeps the last {MAX_STORED_RESPONSES} responses, {} MiB at most), or never made here", MAX_STORED_BYTES >> 20)
    }
}

impl ResponseStore {
    /// An empty store with a fresh id number.
    pub fn new() -> Self {
        Self {
            nonce: rand::random(),
            inner: Mutex::new(StoreInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        // A panic while holding the lock leaves the maps consistent: each step is one
        // insert or remove.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The response id for engine job `job`.
    pub fn response_id(&self, job: &str) -> String {
        format!("resp_{:016x}_{job}", self.nonce)
    }

    /// Keeps a finished response and the conversation it ended; one larger than the
    /// whole store is not kept.
    pub fn put(&self, response: Value, conversation: Vec<Value>) {
        let Some(id) = response["id"].as_str().map(str::to_string) else {
            return;
        };
        let bytes = response.to_string().len()
            + conversation
                .iter()
                .map(|m| m.to_string().len())
                .sum::<usize>();
        if bytes > MAX_STORED_BYTES {
            eprintln!("[K3] serve: response {id} is {bytes} bytes, more than the store holds ({MAX_STORED_BYTES}): not kept");
            return;
        }
        let mut s = self.lock();
        while s.order.len() >= MAX_STORED_RESPONSES || s.bytes + bytes > MAX_STORED_BYTES {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            if let Some(k) = s.kept.remove(&old) {
                s.bytes -= k.bytes;
            }
        }
        s.order.push_back(id.clone());
        s.bytes += bytes;
        s.kept.insert(
            id,
            Kept {
                response,
                conversation,
                bytes,
            },
        );
    }

    /// Remembers that response `id` was made with `store: false`.
    pub fn put_unstored(&self, id: &str) {
        let mut s = self.lock();
        if s.unstored.len() >= MAX_UNSTORED_IDS {
            s.unstored.pop_front();
        }
        s.unstored.push_back(id.to_string());
    }

    /// The conversation response `id` ended, its answer included; a 400 naming
    /// `previous_response_id` when it is not held.
    pub fn conversation(&self, id: &str) -> R<Vec<Value>> {
        let s = self.lock();
        match s.kept.get(id) {
            Some(k) => Ok(k.conversation.clone()),
            None => Err(field_is(
                "previous_response_id",
                not_held(id, s.unstored.iter().any(|u| u == id)),
            )),
        }
    }

    /// The stored response object, or the 404.
    pub fn get(&self, id: &str) -> R<Value> {
        let s = self.lock();
        match s.kept.get(id) {
            Some(k) => Ok(k.response.clone()),
            None => Err(ApiError::status(
                404,
                not_held(id, s.unstored.iter().any(|u| u == id)),
            )),
        }
    }

    /// Forgets response `id`, or the 404.
    pub fn delete(&self, id: &str) -> R<()> {
        let mut s = self.lock();
        match s.kept.remove(id) {
            Some(k) => {
                s.bytes -= k.bytes;
                s.order.retain(|o| o != id);
                Ok(())
            }
            None => {
                let unstored = s.unstored.iter().any(|u| u == id);
                Err(ApiError::status(404, not_held(id, unstored)))
            }
        }
    }
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
    chat.params.constraint = app.constrain(&chat, Api::Responses, ids.len())?;
    let (stream, seed) = (chat.params.stream, chat.params.sampling.seed);
    let kind = JobKind::Chat {
        thinking: chat.thinking,
        single_tool_call: chat.single_tool_call,
    };
    let (job, mut rx, guard) = app.submit(ids, chat.params, kind, false)?;
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
