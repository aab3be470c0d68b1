//! A chat request's output constraint: `response_format` (`json_object`, `json_schema`) or a
//! forced tool call (OpenAI `tool_choice` `"required"` or a named function, Anthropic
//! `any` or `tool`) as a grammar over the K3 vocabulary ([`crate::grammar`]). It is compiled
//! where the request is read, so a schema llguidance cannot compile is a 400 naming its
//! field and the compile time stays off the engine's thread.

use super::api_error::ApiError;
use super::openai_body::tool_name;
pub use super::request::RequestConstraint;
use super::request::{ChatRequest, ResponseFormat, ToolChoice};
use crate::grammar::{
    CompilerBusy, GrammarCompiler, OutputConstraint, ReplyFrame, SchemaError, ToolSchema,
    MAX_FORCED_TOOLS,
};
use serde_json::{json, Value};
use std::time::Instant;

/// Which API a request came through, so an error names the field as its client wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`
    OpenAi,
    /// `/v1/messages`
    Anthropic,
    /// `/v1/responses`
    Responses,
}

/// The field a request's output format is in (`response_format`, or `text.format` of the
/// Responses API), and its schema's.
fn format_fields(api: Api) -> (&'static str, &'static str) {
    match api {
        Api::Responses => ("text.format", "text.format.schema"),
        Api::OpenAi | Api::Anthropic => ("response_format", "response_format.json_schema.schema"),
    }
}

/// The field a tool's argument schema is in.
fn schema_field(api: Api, i: usize) -> String {
    match api {
        Api::OpenAi => format!("tools[{i}].function.parameters"),
        Api::Anthropic => format!("tools[{i}].input_schema"),
        Api::Responses => format!("tools[{i}].parameters"),
    }
}

/// A declared tool as a forced call may use it: its argument schema an object schema
/// (`{"type": "object"}` when the declaration has none or leaves the type out).
fn tool_schema(tool: &Value, i: usize, api: Api) -> Result<ToolSchema, ApiError> {
    let name = tool_name(tool).unwrap_or_default().to_string();
    let func = tool.get("function");
    let mut parameters = func
        .and_then(|f| f.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    match &mut parameters {
        Value::Object(o) => match o.get("type") {
            None => {
                o.insert("type".into(), json!("object"));
            }
            Some(Value::String(t)) if t == "object" => {}
            Some(t) => {
                return Err(ApiError::field(
                    &format!("{}.type", schema_field(api, i)),
                    format!("is {t}; a tool's arguments are an object (\"object\")"),
                ))
            }
        },
        Value::Bool(true) => parameters = json!({"type": "object"}),
        _ => {
            return Err(ApiError::field(
                &schema_field(api, i),
                "must be a JSON schema object",
            ))
        }
    }
    let strict = func
        .and_then(|f| f.get("strict"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(ToolSchema {
        name,
        parameters,
        strict,
    })
}

/// What `req`'s reply must be, if anything constrains it, and the field that asks for it.
pub fn output_constraint(
    req: &ChatRequest,
    api: Api,
) -> Result<Option<(OutputConstraint, String)>, ApiError> {
    let forced: Option<Vec<usize>> = match &req.tool_choice {
        ToolChoice::Auto | ToolChoice::None => None,
        ToolChoice::Required => Some((0..req.tools.len()).collect()),
        ToolChoice::Function(name) => Some(
            (0..req.tools.len())
                .filter(|&i| tool_name(&req.tools[i]) == Some(name.as_str()))
                .take(1)
                .collect(),
        ),
    };
    let (format_field, schema_at) = format_fields(api);
    let format = match &req.response_format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => {
            Some((OutputConstraint::JsonObject, format_field.to_string()))
        }
        ResponseFormat::JsonSchema { schema, strict, .. } => Some((
            OutputConstraint::JsonSchema {
                schema: schema.clone(),
                strict: *strict,
            },
            schema_at.to_string(),
        )),
    };
    match (forced, format) {
        (Some(_), Some(_)) => Err(ApiError::field(
            format_field,
            "cannot be combined with a forced tool_choice: the reply is either the tool call or the JSON",
        )),
        (None, f) => Ok(f),
        (Some(ids), None) => {
            if ids.is_empty() {
                return Err(ApiError::field(
                    "tool_choice",
                    "names no declared tool",
                ));
            }
            if ids.len() > MAX_FORCED_TOOLS {
                return Err(ApiError::field(
                    "tools",
                    format!(
                        "{} tools with a forced tool_choice; the grammar takes at most {MAX_FORCED_TOOLS} (name one tool in tool_choice, or offer fewer)",
                        ids.len()
                    ),
                ));
            }
            let tools = ids
                .iter()
                .map(|&i| tool_schema(&req.tools[i], i, api))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some((
                OutputConstraint::ToolCall { tools },
                "tool_choice".to_string(),
            )))
        }
    }
}

/// Compiles `req`'s output constraint (None when nothing constrains it). `max_tokens` is
/// the reply's budget; with thinking on, the think channel may take half of it (or its
/// `think_budget`, when smaller) before it must close. Blocks for the compile: call it where blocking is allowed.
pub fn compile(
    compiler: Option<&GrammarCompiler>,
    req: &ChatRequest,
    api: Api,
    max_tokens: usize,
) -> Result<Option<RequestConstraint>, ApiError> {
    let Some((c, field)) = output_constraint(req, api)? else {
        return Ok(None);
    };
    let Some(compiler) = compiler else {
        return Err(ApiError::field(
            &field,
            "constrained output needs the model's end-of-sequence id, which its config.json does not name (eos_token_id)",
        ));
    };
    // A think budget bounds the channel in the grammar too, so the forced close is one it
    // expects.
    let think_tokens = match req.params.think_budget {
        Some(b) => b.min(max_tokens / 2),
        None => max_tokens / 2,
    };
    let frame = ReplyFrame::Chat {
        thinking: req.thinking,
        think_tokens,
    };
    let t0 = Instant::now();
    match compiler.constrain(&c, frame) {
        Ok(constraint) => Ok(Some(RequestConstraint {
            constraint,
            compile_secs: t0.elapsed().as_secs_f64(),
        })),
        Err(e) => {
            if let Some(busy) = e.downcast_ref::<CompilerBusy>() {
                return Err(ApiError {
                    retry_after: Some(1),
                    ..ApiError::status(429, busy.to_string())
                });
            }
            let field = culprit(compiler, &c, frame, &field, req, api);
            Err(match e.downcast_ref::<SchemaError>() {
                Some(s) => ApiError::field(&format!("{field}{}", s.path), &s.message),
                None => ApiError::field(&field, format!("{e:#}")),
            })
        }
    }
}

/// The field at fault when a constraint does not compile: for a forced call, the first
/// offered tool whose schema does not compile alone.
fn culprit(
    compiler: &GrammarCompiler,
    c: &OutputConstraint,
    frame: ReplyFrame,
    field: &str,
    req: &ChatRequest,
    api: Api,
) -> String {
    let OutputConstraint::ToolCall { tools } = c else {
        return field.to_string();
    };
    for t in tools {
        let alone = OutputConstraint::ToolCall {
            tools: vec![t.clone()],
        };
        let failed = match compiler.constrain(&alone, frame) {
            Ok(_) => false,
            // No place to compile in: the culprit stays unknown.
            Err(e) if e.is::<CompilerBusy>() => return field.to_string(),
            Err(_) => true,
        };
        if failed {
            if let Some(i) = req
                .tools
                .iter()
                .position(|d| tool_name(d) == Some(t.name.as_str()))
            {
                return schema_field(api, i);
            }
        }
    }
    field.to_string()
}
