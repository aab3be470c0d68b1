//! OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) read from JSON into
//! checked values; every error names the field at fault.

use super::api_error::ApiError;
use crate::sampling::SamplerConfig;
use crate::tokenizer::ThinkingEffort;
use serde_json::{Map, Value};

/// Limits a request must stay inside.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most messages in one request.
    pub max_messages: usize,
    /// Most tokens a request may ask to generate.
    pub max_tokens: usize,
    /// Tokens generated when the request names no limit.
    pub default_max_tokens: usize,
    /// Most stop strings.
    pub max_stop: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_messages: 1024,
            max_tokens: 32768,
            default_max_tokens: 1024,
            max_stop: 16,
        }
    }
}

/// Who speaks a request message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiRole {
    /// `system` (or `developer`)
    System,
    /// `user`
    User,
    /// `assistant`
    Assistant,
    /// `tool`: a tool's result
    Tool,
}

/// A tool call as a client sends it back in an assistant message.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCallIn {
    /// The call's id, if the client kept it.
    pub id: Option<String>,
    /// The function's name.
    pub name: String,
    /// The arguments: a JSON object, or the string OpenAI sends.
    pub arguments: Value,
}

/// One message of a chat request.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiMessage {
    /// Who speaks.
    pub role: ApiRole,
    /// The text (text parts of a content array joined).
    pub content: String,
    /// An assistant turn's thinking (`reasoning_content`).
    pub reasoning: Option<String>,
    /// An assistant turn's tool calls.
    pub tool_calls: Vec<ToolCallIn>,
    /// A tool result's call id.
    pub tool_call_id: Option<String>,
    /// The `name` field (a tool result's function name).
    pub name: Option<String>,
}

impl ApiMessage {
    /// A message with only a role and text.
    pub fn text(role: ApiRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No tool calls.
    None,
    /// At least one tool call.
    Required,
    /// A call of this function.
    Function(String),
}

/// What every generation request carries besides its prompt.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// Sampling settings.
    pub sampling: SamplerConfig,
    /// OpenAI's presence penalty (subtracted once from every id already generated).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty (subtracted per occurrence).
    pub frequency_penalty: f32,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Server-sent events instead of one JSON answer.
    pub stream: bool,
    /// A final usage chunk when streaming.
    pub include_usage: bool,
    /// Keep generating past end-of-turn and end-of-sequence ids (llama.cpp's `ignore_eos`).
    pub ignore_eos: bool,
}

/// A checked `/v1/chat/completions` request.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ApiMessage>,
    /// Tool declarations, as sent (`{"type":"function","function":{...}}`).
    pub tools: Vec<Value>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// Open the think channel.
    pub thinking: bool,
    /// The thinking effort announced (`reasoning_effort`).
    pub effort: Option<ThinkingEffort>,
    /// Everything else.
    pub params: GenParams,
}

/// A checked `/v1/completions` request.
#[derive(Clone, Debug)]
pub struct CompletionRequest {
    /// The prompt text.
    pub prompt: String,
    /// Everything else.
    pub params: GenParams,
}

type R<T> = Result<T, ApiError>;

/// Parses a body as a JSON object.
pub fn parse_object(body: &[u8]) -> R<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::status(400, format!("the body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::status(400, "the body must be a JSON object")),
    }
}

fn type_error(field: &str, want: &str, got: &Value) -> ApiError {
    let kind = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    ApiError::field(field, format!("must be {want}, got {kind}"))
}

fn opt<'a>(m: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    m.get(field).filter(|v| !v.is_null())
}

fn get_bool(m: &Map<String, Value>, field: &str) -> R<Option<bool>> {
    match opt(m, field) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(type_error(field, "a boolean", v)),
    }
}

fn get_f32(m: &Map<String, Value>, field: &str) -> R<Option<f32>> {
    match opt(m, field) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) if x.is_finite() && x.abs() <= f32::MAX as f64 => Ok(Some(x as f32)),
            _ => Err(ApiError::field(field, "must be a finite number")),
        },
        Some(v) => Err(type_error(field, "a number", v)),
    }
}

fn get_u64(m: &Map<String, Value>, field: &str) -> R<Option<u64>> {
    match opt(m, field) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(x) => Ok(Some(x)),
            None => Err(ApiError::field(field, "must be a whole number >= 0")),
        },
        Some(v) => Err(type_error(field, "a whole number", v)),
    }
}

fn get_str<'a>(m: &'a Map<String, Value>, field: &str) -> R<Option<&'a str>> {
    match opt(m, field) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(type_error(field, "a string", v)),
    }
}

fn in_range(field: &str, x: f32, lo: f32, hi: f32) -> R<f32> {
    if x < lo || x > hi {
        return Err(ApiError::field(
            field,
            format!("{x} is outside [{lo}, {hi}]"),
        ));
    }
    Ok(x)
}

/// The fields shared by both endpoints.
fn gen_params(m: &Map<String, Value>, limits: &Limits, base: &SamplerConfig) -> R<GenParams> {
    let mut s = *base;
    if let Some(t) = get_f32(m, "temperature")? {
        s.temperature = in_range("temperature", t, 0.0, 100.0)?;
    }
    if let Some(p) = get_f32(m, "top_p")? {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::field("top_p", format!("{p} is outside (0, 1]")));
        }
        s.top_p = p;
    }
    if let Some(k) = get_u64(m, "top_k")? {
        s.top_k = usize::try_from(k).unwrap_or(usize::MAX);
    }
    if let Some(p) = get_f32(m, "min_p")? {
        s.min_p = in_range("min_p", p, 0.0, 1.0)?;
    }
    for field in ["repetition_penalty", "repeat_penalty"] {
        if let Some(r) = get_f32(m, field)? {
            if r <= 0.0 || r > 100.0 {
                return Err(ApiError::field(field, format!("{r} is outside (0, 100]")));
            }
            s.repetition_penalty = r;
        }
    }
    if let Some(seed) = opt(m, "seed") {
        s.seed = match seed {
            Value::Number(n) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .ok_or_else(|| ApiError::field("seed", "must be a whole number"))?,
            v => return Err(type_error("seed", "a whole number", v)),
        };
    }
    let presence_penalty = get_f32(m, "presence_penalty")?
        .map(|p| in_range("presence_penalty", p, -2.0, 2.0))
        .transpose()?
        .unwrap_or(0.0);
    let frequency_penalty = get_f32(m, "frequency_penalty")?
        .map(|p| in_range("frequency_penalty", p, -2.0, 2.0))
        .transpose()?
        .unwrap_or(0.0);
    let mut max_tokens = None;
    for field in ["max_completion_tokens", "max_tokens"] {
        if let Some(n) = get_u64(m, field)? {
            if n == 0 || n > limits.max_tokens as u64 {
                return Err(ApiError::field(
                    field,
                    format!("{n} is outside 1..={}", limits.max_tokens),
                ));
            }
            max_tokens.get_or_insert(n as usize);
        }
    }
    let stop = match opt(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(type_error(&format!("stop[{i}]"), "a string", v)),
            })
            .collect::<R<Vec<_>>>()?,
        Some(v) => return Err(type_error("stop", "a string or an array of strings", v)),
    };
    if stop.len() > limits.max_stop {
        return Err(ApiError::field(
            "stop",
            format!("{} stop strings, at most {}", stop.len(), limits.max_stop),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::field("stop", "stop strings must not be empty"));
    }
    let include_usage = match opt(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => get_bool(o, "include_usage")
            .map_err(|e| ApiError::field("stream_options.include_usage", e.message))?
            .unwrap_or(false),
        Some(v) => return Err(type_error("stream_options", "an object", v)),
    };
    Ok(GenParams {
        model: get_str(m, "model")?.map(str::to_string),
        sampling: s,
        presence_penalty,
        frequency_penalty,
        max_tokens: max_tokens.unwrap_or(limits.default_max_tokens),
        stop,
        stream: get_bool(m, "stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: get_bool(m, "ignore_eos")?.unwrap_or(false),
    })
}

/// Text of a `content` field: a string, null, or an array of `{"type":"text","text":...}`.
fn content_text(v: Option<&Value>, field: &str) -> R<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let f = format!("{field}[{i}]");
                let Value::Object(o) = p else {
                    return Err(type_error(&f, "an object", p));
                };
                match get_str(o, "type").map_err(|e| ApiError::field(&f, e.message))? {
                    Some("text") | Some("input_text") => {}
                    Some(other) => {
                        return Err(ApiError::field(
                            &format!("{f}.type"),
                            format!("{other:?} parts are not supported (text only)"),
                        ))
                    }
                    None => return Err(ApiError::field(&format!("{f}.type"), "is missing")),
                }
                match o.get("text") {
                    Some(Value::String(s)) => out.push_str(s),
                    Some(v) => return Err(type_error(&format!("{f}.text"), "a string", v)),
                    None => return Err(ApiError::field(&format!("{f}.text"), "is missing")),
                }
            }
            Ok(out)
        }
        Some(v) => Err(type_error(field, "a string or an array of text parts", v)),
    }
}

fn tool_calls_in(v: Option<&Value>, field: &str) -> R<Vec<ToolCallIn>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Value::Array(a) = v else {
        return Err(type_error(field, "an array", v));
    };
    a.iter()
        .enumerate()
        .map(|(i, c)| {
            let f = format!("{field}[{i}]");
            let Value::Object(o) = c else {
                return Err(type_error(&f, "an object", c));
            };
            let func = match o.get("function") {
                Some(Value::Object(fo)) => fo,
                Some(v) => return Err(type_error(&format!("{f}.function"), "an object", v)),
                None => o,
            };
            let name = get_str(func, "name")
                .map_err(|e| ApiError::field(&format!("{f}.function.name"), e.message))?
                .ok_or_else(|| ApiError::field(&format!("{f}.function.name"), "is missing"))?;
            let arguments = match func.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(a @ (Value::String(_) | Value::Object(_))) => a.clone(),
                Some(v) => {
                    return Err(type_error(
                        &format!("{f}.function.arguments"),
                        "a JSON object or a string",
                        v,
                    ))
                }
            };
            Ok(ToolCallIn {
                id: get_str(o, "id")
                    .map_err(|e| ApiError::field(&format!("{f}.id"), e.message))?
                    .map(str::to_string),
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

/// Reads the `messages` array.
pub fn messages(v: Option<&Value>, limits: &Limits) -> R<Vec<ApiMessage>> {
    let Some(v) = v else {
        return Err(ApiError::field("messages", "is missing"));
    };
    let Value::Array(a) = v else {
        return Err(type_error("messages", "an array", v));
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
    a.iter()
        .enumerate()
        .map(|(i, m)| {
            let f = format!("messages[{i}]");
            let Value::Object(o) = m else {
                return Err(type_error(&f, "an object", m));
            };
            let role = match get_str(o, "role")
                .map_err(|e| ApiError::field(&format!("{f}.role"), e.message))?
            {
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
            let reasoning = match opt(o, "reasoning_content").or_else(|| opt(o, "reasoning")) {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(v) => {
                    return Err(type_error(&format!("{f}.reasoning_content"), "a string", v))
                }
            };
            let text = |field: &str| -> R<Option<String>> {
                get_str(o, field)
                    .map(|s| s.map(str::to_string))
                    .map_err(|e| ApiError::field(&format!("{f}.{field}"), e.message))
            };
            Ok(ApiMessage {
                role,
                content: content_text(o.get("content"), &format!("{f}.content"))?,
                reasoning,
                tool_calls: tool_calls_in(o.get("tool_calls"), &format!("{f}.tool_calls"))?,
                tool_call_id: text("tool_call_id")?,
                name: text("name")?,
            })
        })
        .collect()
}

fn tools(m: &Map<String, Value>) -> R<Vec<Value>> {
    let Some(v) = opt(m, "tools") else {
        return Ok(Vec::new());
    };
    let Value::Array(a) = v else {
        return Err(type_error("tools", "an array", v));
    };
    for (i, t) in a.iter().enumerate() {
        let f = format!("tools[{i}]");
        let Value::Object(o) = t else {
            return Err(type_error(&f, "an object", t));
        };
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
    Ok(a.clone())
}

/// The function name a tool declaration names.
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

fn tool_choice(m: &Map<String, Value>, tools: &[Value]) -> R<ToolChoice> {
    let choice = match opt(m, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" | "any" => ToolChoice::Required,
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
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::field("tool_choice.function.name", "is missing"))?;
            if !tools.iter().any(|t| tool_name(t) == Some(name)) {
                return Err(ApiError::field(
                    "tool_choice.function.name",
                    format!("{name:?} is not among the declared tools"),
                ));
            }
            ToolChoice::Function(name.to_string())
        }
        Some(v) => return Err(type_error("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(ApiError::field(
            "tool_choice",
            "\"required\" needs at least one tool in `tools`",
        ));
    }
    Ok(choice)
}

fn effort(s: &str, field: &str) -> R<ThinkingEffort> {
    Ok(match s {
        "low" | "minimal" => ThinkingEffort::Low,
        "medium" => ThinkingEffort::Medium,
        "high" => ThinkingEffort::High,
        "max" => ThinkingEffort::Max,
        other => {
            return Err(ApiError::field(
                field,
                format!("{other:?} is not one of low, medium, high, max"),
            ))
        }
    })
}

/// What a request gets for the fields it leaves out (the server's flags).
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    /// Sampling settings.
    pub sampling: SamplerConfig,
    /// Whether chat opens the think channel.
    pub thinking: bool,
}

/// Reads a `/v1/chat/completions` body.
pub fn chat_request(body: &[u8], limits: &Limits, defaults: &Defaults) -> R<ChatRequest> {
    let m = parse_object(body)?;
    let params = gen_params(&m, limits, &defaults.sampling)?;
    let messages = messages(m.get("messages"), limits)?;
    let tools = tools(&m)?;
    let tool_choice = tool_choice(&m, &tools)?;
    let mut thinking = defaults.thinking;
    let mut effort_v = Some(ThinkingEffort::Max);
    match opt(&m, "chat_template_kwargs") {
        None => {}
        Some(Value::Object(k)) => {
            for field in ["enable_thinking", "thinking"] {
                if let Some(b) = get_bool(k, field).map_err(|e| {
                    ApiError::field(&format!("chat_template_kwargs.{field}"), e.message)
                })? {
                    thinking = b;
                }
            }
            if let Some(s) = get_str(k, "thinking_effort")
                .map_err(|e| ApiError::field("chat_template_kwargs.thinking_effort", e.message))?
            {
                effort_v = Some(effort(s, "chat_template_kwargs.thinking_effort")?);
            }
        }
        Some(v) => return Err(type_error("chat_template_kwargs", "an object", v)),
    }
    if let Some(s) = get_str(&m, "reasoning_effort")? {
        if s == "none" {
            thinking = false;
        } else {
            effort_v = Some(effort(s, "reasoning_effort")?);
        }
    }
    Ok(ChatRequest {
        messages,
        tools,
        tool_choice,
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
    let m = parse_object(body)?;
    let params = gen_params(&m, limits, &defaults.sampling)?;
    let prompt = match m.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(v) => return Err(type_error("prompt", "a string", v)),
        None => return Err(ApiError::field("prompt", "is missing")),
    };
    if prompt.is_empty() {
        return Err(ApiError::field("prompt", "must not be empty"));
    }
    Ok(CompletionRequest { prompt, params })
}
