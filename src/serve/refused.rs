//! Request fields the server reads but does not implement. A request that asks for one
//! gets a 400 naming it instead of an answer that quietly ignores it. Every such refusal
//! is one arm here, so a feature that lands removes its arm and nothing else.

use super::api_error::ApiError;
use super::request::{ChatRequest, CompletionRequest, GenParams, ResponseFormat, ToolChoice};

/// Which API a request came through, so a refusal names the field as its client wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`, `/v1/completions`
    OpenAi,
    /// `/v1/messages`
    Anthropic,
}

fn refuse(field: &str, what: &str) -> ApiError {
    ApiError {
        param: Some(field.to_string()),
        ..ApiError::status(400, format!("{what} is not supported yet (docs/api.md)"))
    }
}

fn params(p: &GenParams) -> Result<(), ApiError> {
    if p.logprobs.is_some() {
        return Err(refuse("logprobs", "logprobs"));
    }
    Ok(())
}

/// Refuses what a chat request asks for that the server does not do.
pub fn chat(req: &ChatRequest, api: Api) -> Result<(), ApiError> {
    params(&req.params)?;
    match (&req.tool_choice, api) {
        (ToolChoice::Required, Api::OpenAi) => {
            return Err(refuse("tool_choice", "tool_choice \"required\""))
        }
        (ToolChoice::Function(_), Api::OpenAi) => {
            return Err(refuse("tool_choice", "tool_choice naming a function"))
        }
        (ToolChoice::Required, Api::Anthropic) => {
            return Err(refuse("tool_choice", "tool_choice {\"type\": \"any\"}"))
        }
        (ToolChoice::Function(_), Api::Anthropic) => {
            return Err(refuse("tool_choice", "tool_choice {\"type\": \"tool\"}"))
        }
        _ => {}
    }
    match req.response_format {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => {
            return Err(refuse("response_format", "response_format json_object"))
        }
        ResponseFormat::JsonSchema { .. } => {
            return Err(refuse("response_format", "response_format json_schema"))
        }
    }
    Ok(())
}

/// Refuses what a completion request asks for that the server does not do.
pub fn completion(req: &CompletionRequest) -> Result<(), ApiError> {
    params(&req.params)
}
