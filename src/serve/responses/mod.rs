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
use super::http::{chat_ids_marked, sse_response, with_seed, App};
use super::job::{Delta, Event, Field, FinishReason, JobKind, Outcome};
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
mod input;
mod store;
mod tools;

use input::translate_input;
use tools::{tool_choice, tools, Tools};

pub(crate) use events::ResponseEvents;
pub(crate) use store::ResponseStore;

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
pub(crate) struct ResponsesRequest {
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
pub(crate) fn read_request(
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
pub(crate) async fn create(State(app): State<Arc<App>>, body: Body) -> Result<Response, ApiError> {
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
pub(crate) async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.responses.get(&id) {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.responses.delete(&id) {
        Ok(()) => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Err(e) => e.into_response(),
    }
}
