//! Reading a `/v1/messages` body: the typed body becomes the one internal chat request
//! (text, thinking, tool_use and tool_result blocks; `tools`, `tool_choice`, `thinking`,
//! `output_config`) and the context edits of `context_management`.

use crate::serve::api_error::ApiError;
use crate::serve::body_json::{from_value, parse_body, refuse_unknown, Unknown};
use crate::serve::context_edits::{self, ContextEdit};
use crate::serve::field_policy::{self, refuse_unknown_except};
use crate::serve::openai_body;
use crate::serve::request::{ChatRequest, Defaults, Limits, ResponseFormat, ToolChoice};
use crate::serve::sampling_fields::SamplingFields;
use crate::tokenizer::ThinkingEffort;
use serde::Deserialize;
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

/// Whether a `system` value or a message's `content` carries a `cache_control`
/// breakpoint on one of its blocks.
fn has_breakpoint(content: &Value) -> bool {
    content.as_array().is_some_and(|blocks| {
        blocks
            .iter()
            .any(|b| b.get("cache_control").is_some_and(|c| !c.is_null()))
    })
}

/// One Anthropic message as OpenAI messages (a user turn's tool results become tool
/// messages before its text).
fn translate_message(m: &Value, i: usize, out: &mut Vec<Value>) -> R<()> {
    let f = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        // Claude Code's mid-conversation system entries: a system turn where it stands.
        Some("system") => {
            let text = blocks_text(
                m.get("content").unwrap_or(&Value::Null),
                &format!("{f}.content"),
            )?;
            out.push(json!({"role": "system", "content": text}));
            return Ok(());
        }
        _ => {
            return Err(field_err(
                &format!("{f}.role"),
                "\"user\", \"assistant\" or \"system\"",
            ))
        }
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

/// Anthropic's `tool_choice`.
#[derive(Deserialize)]
struct ToolChoiceBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    disable_parallel_tool_use: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// Anthropic's `thinking`.
#[derive(Deserialize)]
struct ThinkingBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    /// The most tokens the think channel may take: it is closed when they are spent.
    budget_tokens: Option<u64>,
    /// `"summarized"` or `"omitted"`: how a hosted model shows its thinking. k3 shows it
    /// whole, so either is accepted.
    #[allow(dead_code)]
    display: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// Anthropic's `output_config`.
#[derive(Deserialize)]
struct OutputConfigBody {
    effort: Option<String>,
    format: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// One declared tool.
#[derive(Deserialize)]
struct ToolBody {
    name: Option<String>,
    description: Option<Value>,
    input_schema: Option<Value>,
    /// `"custom"` or left out; Anthropic's server tools (`web_search_...`) are refused.
    #[serde(rename = "type")]
    kind: Option<String>,
    /// A prompt-caching breakpoint: the prompt cache keeps a state where the tool
    /// declarations end.
    cache_control: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// The body of `/v1/messages` (and `/v1/messages/count_tokens`) as sent.
#[derive(Deserialize)]
struct MessagesBody {
    model: Option<String>,
    max_tokens: Option<u64>,
    messages: Option<Value>,
    system: Option<Value>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<ToolChoiceBody>,
    thinking: Option<ThinkingBody>,
    output_config: Option<OutputConfigBody>,
    /// The structured-outputs beta's name for `output_config.format`.
    output_format: Option<Value>,
    context_management: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A read `/v1/messages` body: the chat request and the context edits to apply to its
/// history once the prompt's length is known.
pub struct MessagesRequest {
    /// The request.
    pub chat: ChatRequest,
    /// `context_management.edits`.
    pub edits: Vec<ContextEdit>,
}

/// Which route reads the body: `count_tokens` needs no `max_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessagesRoute {
    /// `/v1/messages`
    Messages,
    /// `/v1/messages/count_tokens`
    CountTokens,
}

/// Reads a `/v1/messages` body into a chat request. Thinking is on only when `thinking`
/// asks for it, as Anthropic's API has it (the server's `--think` is for OpenAI clients).
pub fn messages_request(body: &[u8], limits: &Limits, defaults: &Defaults) -> R<MessagesRequest> {
    read_request(body, limits, defaults, MessagesRoute::Messages)
}

/// Reads a `/v1/messages` or `/v1/messages/count_tokens` body.
pub fn read_request(
    body: &[u8],
    limits: &Limits,
    defaults: &Defaults,
    route: MessagesRoute,
) -> R<MessagesRequest> {
    let b: MessagesBody = parse_body(body)?;
    refuse_unknown_except(&b.unknown, "", field_policy::ANTHROPIC)?;
    let max_tokens = match (b.max_tokens, route) {
        (Some(n), _) => Some(("max_tokens", n)),
        (None, MessagesRoute::CountTokens) => None,
        (None, MessagesRoute::Messages) => {
            return Err(field_err("max_tokens", "a whole number (it is required)"))
        }
    };
    let mut messages = Vec::new();
    // The translated messages that end at a `cache_control` breakpoint: each block's
    // breakpoint is kept where its message ends, a message boundary whose tokens do not
    // depend on where the client puts its breakpoints.
    let mut breakpoints = Vec::new();
    if let Some(v) = b.system.as_ref().filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": blocks_text(v, "system")?}));
        if has_breakpoint(v) {
            breakpoints.push(messages.len() - 1);
        }
    }
    let Some(Value::Array(msgs)) = b.messages.as_ref() else {
        return Err(field_err("messages", "an array"));
    };
    for (i, msg) in msgs.iter().enumerate() {
        translate_message(msg, i, &mut messages)?;
        if msg.get("content").is_some_and(has_breakpoint) && !messages.is_empty() {
            breakpoints.push(messages.len() - 1);
        }
    }
    let mut messages = openai_body::messages(Some(Value::Array(messages)), limits)?;
    for i in breakpoints {
        if let Some(m) = messages.get_mut(i) {
            m.cache_breakpoint = true;
        }
    }
    let fields = SamplingFields {
        temperature: b.temperature,
        top_p: b.top_p,
        top_k: b.top_k,
        max_tokens,
        stop: ("stop_sequences", b.stop_sequences.unwrap_or_default()),
        stream: b.stream,
        model: b.model,
        ..SamplingFields::default()
    };
    let params = fields.params(limits, &defaults.sampling)?;
    let mut tools_breakpoint = false;
    let tools: Vec<Value> = b
        .tools
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let f = format!("tools[{i}]");
            if !t.is_object() {
                return Err(field_err(&f, "an object"));
            }
            let t: ToolBody = from_value(t, &f)?;
            refuse_unknown(&t.unknown, &f)?;
            tools_breakpoint |= t.cache_control.as_ref().is_some_and(|c| !c.is_null());
            if let Some(kind) = t.kind.as_deref().filter(|k| *k != "custom") {
                return Err(ApiError::field(
                    &format!("{f}.type"),
                    format!("{kind:?} tools are not supported (custom tools only)"),
                ));
            }
            let name = t
                .name
                .filter(|n| !n.is_empty())
                .ok_or_else(|| field_err(&format!("{f}.name"), "a non-empty string"))?;
            let mut func = json!({"name": name});
            if let Some(d) = t.description {
                func["description"] = d;
            }
            if let Some(s) = t.input_schema {
                func["parameters"] = s;
            }
            Ok(json!({"type": "function", "function": func}))
        })
        .collect::<R<_>>()?;
    let mut single_tool_call = false;
    let tool_choice = match b.tool_choice {
        None => ToolChoice::Auto,
        Some(tc) => {
            refuse_unknown(&tc.unknown, "tool_choice")?;
            single_tool_call = tc.disable_parallel_tool_use == Some(true);
            match tc.kind.as_deref() {
                Some("auto") => ToolChoice::Auto,
                Some("none") => ToolChoice::None,
                Some("any") if tools.is_empty() => {
                    return Err(ApiError::field(
                        "tool_choice",
                        "\"any\" needs at least one tool in `tools`",
                    ))
                }
                Some("any") => ToolChoice::Required,
                Some("tool") => {
                    let name = tc
                        .name
                        .ok_or_else(|| ApiError::field("tool_choice.name", "is missing"))?;
                    openai_body::named_tool(&name, &tools, "tool_choice.name")?
                }
                _ => {
                    return Err(field_err(
                        "tool_choice.type",
                        "one of auto, any, tool, none",
                    ))
                }
            }
        }
    };
    let mut params = params;
    // `None`: the request does not say; an effort then turns thinking on.
    let thinking = match b.thinking {
        None => None,
        Some(th) => {
            refuse_unknown(&th.unknown, "thinking")?;
            match th.kind.as_deref() {
                Some("enabled") => {
                    params.think_budget = match th.budget_tokens {
                        Some(0) => return Err(field_err("thinking.budget_tokens", "at least 1")),
                        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
                        None => None,
                    };
                    Some(true)
                }
                Some("adaptive") => Some(true),
                Some("disabled") => Some(false),
                _ => {
                    return Err(field_err(
                        "thinking.type",
                        "\"enabled\", \"adaptive\" or \"disabled\"",
                    ))
                }
            }
        }
    };
    let mut effort = None;
    let mut format = None;
    if let Some(oc) = b.output_config {
        refuse_unknown(&oc.unknown, "output_config")?;
        effort = oc.effort.as_deref().map(output_effort).transpose()?;
        format = oc
            .format
            .filter(|v| !v.is_null())
            .map(|v| output_format(v, "output_config.format"))
            .transpose()?;
    }
    if let Some(v) = b.output_format.filter(|v| !v.is_null()) {
        if format.is_some() {
            return Err(ApiError::field(
                "output_format",
                "is given twice: send only output_config.format",
            ));
        }
        format = Some(output_format(v, "output_format")?);
    }
    let edits = match b.context_management.as_ref().filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => context_edits::parse(v)?,
    };
    let thinking = thinking.unwrap_or(effort.is_some());
    Ok(MessagesRequest {
        chat: ChatRequest {
            messages,
            tools,
            tools_breakpoint,
            tool_choice,
            single_tool_call,
            response_format: format.unwrap_or(ResponseFormat::Text),
            thinking,
            effort: Some(effort.unwrap_or(ThinkingEffort::Max)),
            params,
        },
        edits,
    })
}

/// `output_config.effort`: Anthropic's levels, announced to the model as its thinking effort.
fn output_effort(s: &str) -> R<ThinkingEffort> {
    ThinkingEffort::from_name(s).ok_or_else(|| {
        ApiError::field(
            "output_config.effort",
            format!("{s:?} is not one of low, medium, high, max"),
        )
    })
}

/// `output_config.format`: `{"type": "json_schema", "schema": {...}}`, compiled into the
/// reply's grammar like OpenAI's `response_format`.
fn output_format(v: Value, field: &str) -> R<ResponseFormat> {
    #[derive(Deserialize)]
    struct Body {
        #[serde(rename = "type")]
        kind: Option<String>,
        schema: Option<Value>,
        #[serde(flatten)]
        unknown: Unknown,
    }
    if !v.is_object() {
        return Err(field_err(field, "an object"));
    }
    let b: Body = from_value(v, field)?;
    refuse_unknown(&b.unknown, field)?;
    match b.kind.as_deref() {
        Some("json_schema") => match b.schema {
            Some(schema @ Value::Object(_)) => Ok(ResponseFormat::JsonSchema {
                name: String::new(),
                schema,
                strict: true,
            }),
            _ => Err(field_err(
                &format!("{field}.schema"),
                "a JSON schema object",
            )),
        },
        _ => Err(field_err(&format!("{field}.type"), "\"json_schema\"")),
    }
}
