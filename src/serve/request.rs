//! The one internal request the engine runs — [`ChatRequest`] or [`CompletionRequest`],
//! both carrying [`GenParams`]. The OpenAI bodies become it in `openai_body.rs`,
//! Anthropic's in `anthropic/request.rs`, both through the sampling fields of
//! `sampling_fields.rs`.

use super::api_error::ApiError;
use crate::grammar::TokenConstraint;
use crate::sampling::SamplerConfig;
use crate::tokenizer::ThinkingEffort;
use serde_json::Value;

/// Choices one request may ask for (`n`); more is a 400.
pub const MAX_CHOICES: usize = 8;

/// Alternatives per token `top_logprobs` may ask for, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: usize = 20;

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
    /// Whether a client's cache breakpoint (Anthropic `cache_control`) ends in this
    /// message: the prompt cache keeps a state where the message ends.
    pub cache_breakpoint: bool,
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
            cache_breakpoint: false,
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

/// `response_format`.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ResponseFormat {
    /// Free text (`{"type": "text"}` or no field).
    #[default]
    Text,
    /// Any JSON object (`json_object`).
    JsonObject,
    /// JSON that validates against a schema (`json_schema`).
    JsonSchema {
        /// `json_schema.name`.
        name: String,
        /// `json_schema.schema` (an empty object when left out).
        schema: Value,
        /// `json_schema.strict`.
        strict: bool,
    },
}

/// What every generation request carries besides its prompt.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// Sampling settings (OpenAI's presence and frequency penalties among them); the seed is the request's, or a random one ([`Self::seed_given`]).
    pub sampling: SamplerConfig,
    /// Whether the request named its seed (otherwise `sampling.seed` is random).
    pub seed_given: bool,
    /// Tokens to generate at most (per choice).
    pub max_tokens: usize,
    /// Tokens the think channel may take before it is closed (Anthropic's
    /// `thinking.budget_tokens`); `None` leaves it to the model and `max_tokens`.
    pub think_budget: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Server-sent events instead of one JSON answer.
    pub stream: bool,
    /// A final usage chunk when streaming.
    pub include_usage: bool,
    /// Keep generating past end-of-turn and end-of-sequence ids (llama.cpp's `ignore_eos`).
    pub ignore_eos: bool,
    /// Choices to generate (`n`), each its own sampling stream from the same prompt.
    pub n: usize,
    /// Token log-probabilities: `Some(k)` reports the chosen token's and `k` alternatives
    /// (chat `logprobs` + `top_logprobs`, completions `logprobs`).
    pub logprobs: Option<usize>,
    /// The compiled output constraint (`response_format`, a forced `tool_choice`), set
    /// once the prompt is known ([`super::constrain::compile`]).
    pub constraint: Option<RequestConstraint>,
    /// Prompt ids before the point where the conversation's next request is expected to
    /// part from this one (the tool-choice note only this turn carries), set from the
    /// rendered prompt: the engine keeps a state snapshot there.
    pub snapshot_at: Option<usize>,
    /// Prompt ids before each message boundary later prompts are likely to share (the end
    /// of the system prompt and tools), set from the rendered prompt: the engine keeps a
    /// state there in RAM and in the prompt cache.
    pub boundaries: Vec<usize>,
}

/// A checked chat request (`/v1/chat/completions` or `/v1/messages`).
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ApiMessage>,
    /// Tool declarations, as sent (`{"type":"function","function":{...}}`).
    pub tools: Vec<Value>,
    /// Whether a client's cache breakpoint (Anthropic `cache_control` on a tool) ends the
    /// tool declarations: the prompt cache keeps a state where they end.
    pub tools_breakpoint: bool,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// Whether only one tool call may come (`parallel_tool_calls: false`).
    pub single_tool_call: bool,
    /// `response_format`.
    pub response_format: ResponseFormat,
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

/// A request field's value, or the 400 that names the field.
pub(super) type R<T> = Result<T, ApiError>;

/// What a request gets for the fields it leaves out (the server's flags).
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    /// Sampling settings (the seed is drawn per request).
    pub sampling: SamplerConfig,
    /// Whether chat opens the think channel.
    pub thinking: bool,
}

/// A compiled constraint a job carries; each choice samples under its own copy.
#[derive(Clone)]
pub struct RequestConstraint {
    /// The grammar state at the reply's start, the first step's mask computed.
    pub constraint: TokenConstraint,
    /// Seconds the compile took (the grammar and the first step's mask).
    pub compile_secs: f64,
}

impl std::fmt::Debug for RequestConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestConstraint")
            .field("compile_secs", &self.compile_secs)
            .finish_non_exhaustive()
    }
}
