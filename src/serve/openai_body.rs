//! The OpenAI bodies (`/v1/chat/completions`, `/v1/completions`) read into typed structs
//! that become the internal request. Every error names the field at fault; a field the
//! server does not know is a 400 naming it (`body_json.rs`).

use super::api_error::ApiError;
use super::body_json::{from_value, parse_body, refuse_unknown, Unknown};
use super::field_policy::{self, refuse_unknown_except};
use super::request::{
    ApiMessage, ApiRole, ChatRequest, CompletionRequest, Defaults, Limits, ResponseFormat,
    ToolCallIn, ToolChoice, MAX_TOP_LOGPROBS, R,
};
use super::sampling_fields::{stop_strings, type_error, SamplingFields};
use crate::tokenizer::ThinkingEffort;
use serde::Deserialize;
use serde_json::{Map, Value};

/// `stream_options`.
#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// `chat_template_kwargs` (vLLM's and llama.cpp's way to switch thinking).
#[derive(Deserialize)]
struct TemplateKwargs {
    enable_thinking: Option<bool>,
    thinking: Option<bool>,
    thinking_effort: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// The body of `/v1/chat/completions` and `/v1/completions` as sent: every field either
/// route reads, typed; the rest lands in `unknown` and is refused.
#[derive(Deserialize)]
struct OpenAiBody {
    model: Option<String>,
    messages: Option<Value>,
    prompt: Option<Value>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    repeat_penalty: Option<f64>,
    seed: Option<serde_json::Number>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    ignore_eos: Option<bool>,
    n: Option<u64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
    reasoning_effort: Option<String>,
    chat_template_kwargs: Option<TemplateKwargs>,
    logprobs: Option<Value>,
    top_logprobs: Option<u64>,
    #[serde(flatten)]
    unknown: Unknown,
}

impl OpenAiBody {
    /// The shared fields, and the field a route does not take refused by name (those of
    /// [`field_policy::OPENAI`] accepted and ignored).
    fn sampling_fields(&mut self) -> R<SamplingFields> {
        refuse_unknown_except(&self.unknown, "", field_policy::OPENAI)?;
        let include_usage = match self.stream_options.take() {
            None => None,
            Some(o) => {
                refuse_unknown(&o.unknown, "stream_options")?;
                o.include_usage
            }
        };
        let max_tokens = self
            .max_completion_tokens
            .map(|n| ("max_completion_tokens", n))
            .or(self.max_tokens.map(|n| ("max_tokens", n)));
        let repetition_penalty = self
            .repetition_penalty
            .map(|r| ("repetition_penalty", r))
            .or(self.repeat_penalty.map(|r| ("repeat_penalty", r)));
        Ok(SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty,
            seed: self.seed.take(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_tokens,
            stop: ("stop", stop_strings(self.stop.take())?),
            stream: self.stream,
            include_usage,
            ignore_eos: self.ignore_eos,
            n: self.n,
            model: self.model.take(),
        })
    }
}

fn not_for_route(field: &str, route: &str, instead: &str) -> ApiError {
    ApiError::field(field, format!("is not a field of {route}; {instead}"))
}

/// Text of a `content` field: a string, null, or an array of `{"type":"text","text":...}`.
fn content_text(v: Option<Value>, field: &str) -> R<String> {
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: Option<String>,
        text: Option<String>,
        #[serde(flatten)]
        unknown: Unknown,
    }
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, p) in parts.into_iter().enumerate() {
                let f = format!("{field}[{i}]");
                if !p.is_object() {
                    return Err(type_error(&f, "an object", &p));
                }
                let part: Part = from_value(p, &f)?;
                match part.kind.as_deref() {
                    Some("text") | Some("input_text") => {}
                    Some(other) => {
                        return Err(ApiError::field(
                            &format!("{f}.type"),
                            format!("{other:?} parts are not supported (text only)"),
                        ))
                    }
                    None => return Err(ApiError::field(&format!("{f}.type"), "is missing")),
                }
                refuse_unknown(&part.unknown, &f)?;
                match part.text {
                    Some(s) => out.push_str(&s),
                    None => return Err(ApiError::field(&format!("{f}.text"), "is missing")),
                }
            }
            Ok(out)
        }
        Some(v) => Err(type_error(field, "a string or an array of text parts", &v)),
    }
}

/// One tool call of an assistant message as sent.
#[derive(Deserialize)]
struct ToolCallBody {
    id: Option<String>,
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    function: Option<FunctionBody>,
    /// Some clients put the function's fields at the call's level.
    name: Option<String>,
    arguments: Option<Value>,
    /// The position in a streamed delta, echoed back by some clients.
    #[allow(dead_code)]
    index: Option<u64>,
    #[serde(flatten)]
    unknown: Unknown,
}

#[derive(Deserialize)]
struct FunctionBody {
    name: Option<String>,
    arguments: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

fn tool_calls_in(v: Option<Vec<Value>>, field: &str) -> R<Vec<ToolCallIn>> {
    let Some(a) = v else {
        return Ok(Vec::new());
    };
    a.into_iter()
        .enumerate()
        .map(|(i, c)| {
            let f = format!("{field}[{i}]");
            if !c.is_object() {
                return Err(type_error(&f, "an object", &c));
            }
            let call: ToolCallBody = from_value(c, &f)?;
            refuse_unknown(&call.unknown, &f)?;
            let (name, arguments) = match call.function {
                Some(func) => {
                    refuse_unknown(&func.unknown, &format!("{f}.function"))?;
                    (func.name, func.arguments)
                }
                None => (call.name, call.arguments),
            };
            let name =
                name.ok_or_else(|| ApiError::field(&format!("{f}.function.name"), "is missing"))?;
            let arguments = match arguments {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(a @ (Value::String(_) | Value::Object(_))) => a,
                Some(v) => {
                    return Err(type_error(
                        &format!("{f}.function.arguments"),
                        "a JSON object or a string",
                        &v,
                    ))
                }
            };
            Ok(ToolCallIn {
                id: call.id,
                name,
                arguments,
            })
        })
        .collect()
}

/// One message of `messages` as sent.
#[derive(Deserialize)]
struct MessageBody {
    role: Option<String>,
    content: Option<Value>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
    name: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// Reads the `messages` array.
pub fn messages(v: Option<Value>, limits: &Limits) -> R<Vec<ApiMessage>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Err(ApiError::field("messages", "is missing"));
    };
    let Value::Array(a) = v else {
        return Err(type_error("messages", "an array", &v));
    };
    if a.is_empty() {
        return Err(ApiError::field(
            "messages",
            "must hold at least one message",
        ));
    }
    if a.len() > limits.max_messages {
        return Err(ApiError::field(
            "messages",
            format!("{} messages, at most {}", a.len(), limits.max_messages),
        ));
    }
    a.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let f = format!("messages[{i}]");
            if !m.is_object() {
                return Err(type_error(&f, "an object", &m));
            }
            let m: MessageBody = from_value(m, &f)?;
            let role = match m.role.as_deref() {
                Some("system") | Some("developer") => ApiRole::System,
                Some("user") => ApiRole::User,
                Some("assistant") => ApiRole::Assistant,
                Some("tool") => ApiRole::Tool,
                Some(other) => {
                    return Err(ApiError::field(
                        &format!("{f}.role"),
                        format!("{other:?} is not one of system, user, assistant, tool"),
                    ))
                }
                None => return Err(ApiError::field(&format!("{f}.role"), "is missing")),
            };
            refuse_unknown(&m.unknown, &f)?;
            Ok(ApiMessage {
                role,
                content: content_text(m.content, &format!("{f}.content"))?,
                reasoning: m.reasoning_content.or(m.reasoning),
                tool_calls: tool_calls_in(m.tool_calls, &format!("{f}.tool_calls"))?,
                tool_call_id: m.tool_call_id,
                name: m.name,
                cache_breakpoint: false,
            })
        })
        .collect()
}

/// Checks `tools`: each one `{"type": "function", "function": {"name": ...}}`.
pub fn tools(v: Option<Value>) -> R<Vec<Value>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Value::Array(a) = v else {
        return Err(type_error("tools", "an array", &v));
    };
    for (i, t) in a.iter().enumerate() {
        let f = format!("tools[{i}]");
        let Value::Object(o) = t else {
            return Err(type_error(&f, "an object", t));
        };
        match o.get("type") {
            None => {}
            Some(Value::String(s)) if s == "function" => {}
            Some(v) => {
                return Err(ApiError::field(
                    &format!("{f}.type"),
                    format!("{v} tools are not supported (function only)"),
                ))
            }
        }
        let func = match o.get("function") {
            Some(Value::Object(fo)) => fo,
            Some(v) => return Err(type_error(&format!("{f}.function"), "an object", v)),
            None => return Err(ApiError::field(&format!("{f}.function"), "is missing")),
        };
        match func.get("name") {
            Some(Value::String(s)) if !s.is_empty() => {}
            Some(v) => {
                return Err(type_error(
                    &format!("{f}.function.name"),
                    "a non-empty string",
                    v,
                ))
            }
            None => return Err(ApiError::field(&format!("{f}.function.name"), "is missing")),
        }
    }
    Ok(a)
}

/// The function name a tool declaration names.
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

/// Checks a chosen function against the declared tools.
pub fn named_tool(name: &str, tools: &[Value], field: &str) -> R<ToolChoice> {
    if !tools.iter().any(|t| tool_name(t) == Some(name)) {
        return Err(ApiError::field(
            field,
            format!("{name:?} is not among the declared tools"),
        ));
    }
    Ok(ToolChoice::Function(name.to_string()))
}

fn tool_choice(v: Option<Value>, tools: &[Value]) -> R<ToolChoice> {
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::field(
                    "tool_choice",
                    format!("{other:?} is not one of none, auto, required"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::field("tool_choice.function.name", "is missing"))?;
            named_tool(name, tools, "tool_choice.function.name")?
        }
        Some(v) => return Err(type_error("tool_choice", "a string or an object", &v)),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(ApiError::field(
            "tool_choice",
            "\"required\" needs at least one tool in `tools`",
        ));
    }
    Ok(choice)
}

fn response_format(v: Option<Value>) -> R<ResponseFormat> {
    #[derive(Deserialize)]
    struct Body {
        #[serde(rename = "type")]
        kind: Option<String>,
        json_schema: Option<SchemaBody>,
        #[serde(flatten)]
        unknown: Unknown,
    }
    #[derive(Deserialize)]
    struct SchemaBody {
        name: Option<String>,
        schema: Option<Value>,
        strict: Option<bool>,
        #[allow(dead_code)]
        description: Option<String>,
        #[serde(flatten)]
        unknown: Unknown,
    }
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    if !v.is_object() {
        return Err(type_error("response_format", "an object", &v));
    }
    let b: Body = from_value(v, "response_format")?;
    refuse_unknown(&b.unknown, "response_format")?;
    match b.kind.as_deref() {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let s = b
                .json_schema
                .ok_or_else(|| ApiError::field("response_format.json_schema", "is missing"))?;
            refuse_unknown(&s.unknown, "response_format.json_schema")?;
            Ok(ResponseFormat::JsonSchema {
                name: s.name.unwrap_or_default(),
                schema: s.schema.unwrap_or_else(|| Value::Object(Map::new())),
                strict: s.strict.unwrap_or(false),
            })
        }
        Some(other) => Err(ApiError::field(
            "response_format.type",
            format!("{other:?} is not one of text, json_object, json_schema"),
        )),
        None => Err(ApiError::field("response_format.type", "is missing")),
    }
}

/// The template's `thinking_effort` for a `reasoning_effort` or `thinking_effort` value;
/// `None` turns thinking off (`none`, `minimal`).
pub fn effort(s: &str, field: &str) -> R<Option<ThinkingEffort>> {
    if matches!(s, "none" | "minimal") {
        return Ok(None);
    }
    ThinkingEffort::from_name(s).map(Some).ok_or_else(|| {
        ApiError::field(
            field,
            format!("{s:?} is not one of none, minimal, low, medium, high, max"),
        )
    })
}

/// Reads a `/v1/chat/completions` body.
pub fn chat_request(body: &[u8], limits: &Limits, defaults: &Defaults) -> R<ChatRequest> {
    let mut b: OpenAiBody = parse_body(body)?;
    let fields = b.sampling_fields()?;
    if b.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(not_for_route(
            "prompt",
            "/v1/chat/completions",
            "send `messages`, or use /v1/completions",
        ));
    }
    let mut params = fields.params(limits, &defaults.sampling)?;
    params.logprobs = match b.logprobs.take() {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {
            if b.top_logprobs.is_some() {
                return Err(ApiError::field("top_logprobs", "needs `logprobs: true`"));
            }
            None
        }
        Some(Value::Bool(true)) => {
            let k = b.top_logprobs.unwrap_or(0);
            if k > MAX_TOP_LOGPROBS as u64 {
                return Err(ApiError::field(
                    "top_logprobs",
                    format!("{k} is outside 0..={MAX_TOP_LOGPROBS}"),
                ));
            }
            Some(k as usize)
        }
        Some(v) => return Err(type_error("logprobs", "a boolean", &v)),
    };
    let messages = messages(b.messages.take(), limits)?;
    let tools = tools(b.tools.take())?;
    let tool_choice = tool_choice(b.tool_choice.take(), &tools)?;
    let mut thinking = defaults.thinking;
    let mut effort_v = Some(ThinkingEffort::Max);
    if let Some(k) = b.chat_template_kwargs.take() {
        refuse_unknown(&k.unknown, "chat_template_kwargs")?;
        if let Some(on) = k.thinking.or(k.enable_thinking) {
            thinking = on;
        }
        if let Some(s) = k.thinking_effort.as_deref() {
            match effort(s, "chat_template_kwargs.thinking_effort")? {
                Some(e) => effort_v = Some(e),
                None => thinking = false,
            }
        }
    }
    if let Some(s) = b.reasoning_effort.as_deref() {
        match effort(s, "reasoning_effort")? {
            Some(e) => {
                thinking = true;
                effort_v = Some(e);
            }
            None => thinking = false,
        }
    }
    Ok(ChatRequest {
        messages,
        tools,
        tools_breakpoint: false,
        tool_choice,
        single_tool_call: b.parallel_tool_calls == Some(false),
        response_format: response_format(b.response_format.take())?,
        thinking,
        effort: effort_v,
        params,
    })
}

/// Reads a `/v1/completions` body.
pub fn completion_request(
    body: &[u8],
    limits: &Limits,
    defaults: &Defaults,
) -> R<CompletionRequest> {
    let mut b: OpenAiBody = parse_body(body)?;
    let fields = b.sampling_fields()?;
    for (field, set) in [
        (
            "messages",
            b.messages.as_ref().is_some_and(|v| !v.is_null()),
        ),
        ("tools", b.tools.as_ref().is_some_and(|v| !v.is_null())),
        (
            "tool_choice",
            b.tool_choice.as_ref().is_some_and(|v| !v.is_null()),
        ),
        ("parallel_tool_calls", b.parallel_tool_calls.is_some()),
        (
            "response_format",
            b.response_format.as_ref().is_some_and(|v| !v.is_null()),
        ),
        ("reasoning_effort", b.reasoning_effort.is_some()),
        ("chat_template_kwargs", b.chat_template_kwargs.is_some()),
        ("top_logprobs", b.top_logprobs.is_some()),
    ] {
        if set {
            return Err(not_for_route(
                field,
                "/v1/completions",
                "it belongs to /v1/chat/completions",
            ));
        }
    }
    let mut params = fields.params(limits, &defaults.sampling)?;
    params.logprobs = match b.logprobs.take() {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(k) if k <= 5 => Some(k as usize),
            _ => return Err(ApiError::field("logprobs", format!("{n} is outside 0..=5"))),
        },
        Some(v) => return Err(type_error("logprobs", "a whole number", &v)),
    };
    let prompt = match b.prompt.take() {
        Some(Value::String(s)) => s,
        Some(Value::Array(mut a)) if a.len() == 1 && a[0].is_string() => match a.pop() {
            Some(Value::String(s)) => s,
            _ => String::new(),
        },
        Some(Value::Array(a)) if a.len() > 1 => {
            return Err(ApiError::field(
                "prompt",
                "several prompts in one request are not supported; send one string",
            ))
        }
        None | Some(Value::Null) => return Err(ApiError::field("prompt", "is missing")),
        Some(v) => return Err(type_error("prompt", "a string", &v)),
    };
    if prompt.is_empty() {
        return Err(ApiError::field("prompt", "must not be empty"));
    }
    Ok(CompletionRequest { prompt, params })
}
