//! A request as the engine takes it (a `Job`) and what the engine sends back: the events
//! of a streaming reply, the outcome of each choice, and the view of a sequence in flight.

use super::logprobs::LogprobEntry;
use super::reply::ToolCallOut;
use super::request::GenParams;
use crate::stats::Stats;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

/// How often a paused engine looks again at a full channel.
pub(super) const FULL_POLL: Duration = Duration::from_millis(2);

/// What a job's prompt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// A chat turn rendered with or without the think channel.
    Chat {
        /// The generation prompt opened the think channel.
        thinking: bool,
        /// Only the first tool call is kept (`parallel_tool_calls: false`).
        single_tool_call: bool,
    },
    /// Plain text continuation.
    Completion,
}

/// One request for the engine.
pub struct Job {
    /// The request's id (for the log line).
    pub id: String,
    /// The prompt's ids.
    pub ids: Vec<u32>,
    /// Sampling, limits and stop strings.
    pub params: GenParams,
    /// Chat or completion.
    pub kind: JobKind,
    /// Think text goes into `content` inside `<think>…</think>` (`--reasoning-format inline`).
    pub inline_reasoning: bool,
    /// Where the job's events go (bounded: `EVENTS_IN_FLIGHT`).
    pub events: Sender<Event>,
    /// Longest wait for the handler to take an event before the job is cancelled.
    pub stall_timeout: Duration,
    /// Raised when the client went away (or the server stops).
    pub cancel: Arc<AtomicBool>,
    /// When the request was queued.
    pub queued: Instant,
}

/// Which field a streamed piece of text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// `reasoning_content` (the think channel).
    Reasoning,
    /// `content`.
    Content,
}

/// Why the answer ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn, or a stop string or id came.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
    /// The model called tools.
    ToolCalls,
}

impl FinishReason {
    /// OpenAI's name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// One choice of an answer.
#[derive(Clone, Debug)]
pub struct ChoiceOut {
    /// The think-channel text.
    pub reasoning: String,
    /// The response text.
    pub content: String,
    /// Tool calls parsed from the reply.
    pub tool_calls: Vec<ToolCallOut>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// Tokens it generated.
    pub completion_tokens: usize,
    /// Of those, the tokens generated inside the think channel (its tags included).
    pub reasoning_tokens: usize,
    /// Every generated token's log-probability, when the request asked for them.
    pub logprobs: Option<Vec<LogprobEntry>>,
}

/// How a job ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The choices (`n` of them), in order.
    pub choices: Vec<ChoiceOut>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the engine's state (for the first choice; later choices
    /// start from a copy of its state at the prompt's end).
    pub cached_tokens: usize,
    /// Tokens generated, over all choices.
    pub completion_tokens: usize,
    /// Think-channel tokens generated, over all choices.
    pub reasoning_tokens: usize,
    /// Seconds from the job's start to its first token.
    pub ttft_secs: f64,
    /// Seconds in prefill.
    pub prefill_secs: f64,
    /// Seconds in decode (the longest choice's: the choices decode together).
    pub decode_secs: f64,
    /// Engine counters of the job: its share of each step's, by the rows it fed.
    pub stats: Stats,
    /// Whether the job was cancelled.
    pub cancelled: bool,
    /// The seed of the first choice's sampler (choice `i` uses `seed + i`).
    pub seed: u64,
    /// Seconds compiling the output constraint took, when the request had one.
    pub constraint_compile_secs: Option<f64>,
    /// Seconds choosing tokens took (penalties, the constraint's mask and advance, the
    /// sampler), over all choices.
    pub pick_secs: f64,
}

impl Outcome {
    /// The first choice (every job has at least one).
    pub fn first(&self) -> &ChoiceOut {
        &self.choices[0]
    }
}

/// A piece of streamed text.
#[derive(Clone, Debug)]
pub struct Delta {
    /// The choice it belongs to.
    pub choice: usize,
    /// Reasoning or content.
    pub field: Field,
    /// The text (empty when the piece only carries log-probabilities).
    pub text: String,
    /// The log-probabilities of the tokens generated since the previous piece.
    pub logprobs: Vec<LogprobEntry>,
}

/// What the engine sends a handler.
#[derive(Clone, Debug)]
pub enum Event {
    /// New text of one choice's field.
    Delta(Delta),
    /// The job ended.
    Done(Box<Outcome>),
    /// The job failed (the engine goes on).
    Failed(String),
}

/// One sequence in flight, as `/health` lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SequenceView {
    /// The request's id.
    pub id: String,
    /// `prefill` while its prompt is fed, `decode` after.
    pub state: &'static str,
    /// The choice it runs (of the request's `n`).
    pub choice: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens its state holds (reused or fed so far): the prefill's progress.
    pub prefilled_tokens: usize,
    /// Tokens its choice generated so far.
    pub generated_tokens: usize,
}

/// Hands `ev` to the job's handler, waiting while its channel is full (the client reads
/// slower than the engine writes) until there is room, the handler is gone, `stall`
/// passes, or (unless `last`, the job's final event) the job is cancelled. An event not
/// delivered cancels the job; returns whether it was delivered.
pub(super) fn deliver(
    events: &Sender<Event>,
    cancel: &AtomicBool,
    stall: Duration,
    ev: Event,
    last: bool,
) -> bool {
    let t0 = Instant::now();
    let mut ev = ev;
    loop {
        match events.try_send(ev) {
            Ok(()) => return true,
            Err(TrySendError::Full(back))
                if t0.elapsed() < stall && (last || !cancel.load(Ordering::SeqCst)) =>
            {
                ev = back;
                std::thread::sleep(FULL_POLL);
            }
            Err(_) => {
                // The client left, stopped reading for too long, or the job is cancelled.
                cancel.store(true, Ordering::SeqCst);
                return false;
            }
        }
    }
}
