//! The engine worker: the one thread that owns the model. It takes jobs from a bounded
//! queue one at a time, runs them through the shared decode loop on one [`Session`]
//! (so a request that extends the held conversation prefills only its new tokens), and
//! streams what it generates back to the request's handler. An error or a panic in a job
//! answers that job with an error and leaves the engine serving.

use super::live::LiveFigures;
use super::logprobs::{LogprobEntry, LogprobWriter};
use super::metrics::{GenerationSample, Metrics};
use super::reply::{parse_reply, pieces_from_ids, ToolCallOut};
use super::request::GenParams;
use super::stop_strings::StopStrings;
use crate::backend::Backend;
use crate::model::K3Model;
use crate::sampling::Sampler;
use crate::session::{
    DecodeOptions, Finish, Flow, Generation, Session, SnapshotLimits, TokenEvent,
};
use crate::stats::Stats;
use crate::token_picker::TokenPicker;
use crate::tokenizer::{chat_stop_ids, Channel, ChatEvent, ChatSplitter, StreamDecoder, Tokenizer};
use anyhow::Result;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

/// Events a job's channel holds before the engine waits for its handler: a streaming
/// client that reads nothing pauses the engine, not the server's memory.
pub const EVENTS_IN_FLIGHT: usize = 64;
/// How often a paused engine looks again at a full channel.
const FULL_POLL: Duration = Duration::from_millis(2);

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
    /// Where the job's events go (bounded: [`EVENTS_IN_FLIGHT`]).
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
    /// restart from the state at the prompt's end).
    pub cached_tokens: usize,
    /// Tokens generated, over all choices.
    pub completion_tokens: usize,
    /// Think-channel tokens generated, over all choices.
    pub reasoning_tokens: usize,
    /// Seconds from the job's start to its first token.
    pub ttft_secs: f64,
    /// Seconds in prefill.
    pub prefill_secs: f64,
    /// Seconds in decode.
    pub decode_secs: f64,
    /// Engine counters of the job.
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

/// State the engine shares with the HTTP side.
#[derive(Default)]
pub struct EngineShared {
    /// Counters.
    pub metrics: Metrics,
    /// The running job's cancel flag, so shutdown can stop it.
    pub current: Mutex<Option<Arc<AtomicBool>>>,
    /// Raised at shutdown: jobs still queued end at once, cancelled.
    pub stopping: AtomicBool,
    /// The figures of the last decode steps.
    pub live: LiveFigures,
}

/// Serves jobs until every sender of `jobs` is gone, keeping state snapshots within
/// `snapshots` so a prompt that diverges from the held conversation reuses what it can.
pub fn run_engine<B: Backend>(
    model: &K3Model<B>,
    tok: &Tokenizer,
    snapshots: SnapshotLimits,
    jobs: mpsc::Receiver<Job>,
    shared: &EngineShared,
) -> Result<()> {
    let mut session = Session::new(model)?;
    session.set_snapshot_limits(snapshots);
    let one = model.snapshot_bytes() + model.vocab_size() * 4;
    if snapshots.count == 0 {
        tracing::info!("[K3] serve: state snapshots off: a resent conversation that diverges from the held one is prefilled from its start");
    } else if one > snapshots.bytes {
        tracing::warn!(
            "[K3] serve: WARNING: one state snapshot takes {:.1} MB, more than --snapshot-mb {:.0}: none is kept",
            one as f64 / 1e6,
            snapshots.bytes as f64 / (1 << 20) as f64
        );
    } else {
        tracing::info!(
            "[K3] serve: state snapshots: up to {} of {:.1} MB each, {:.0} MB at most",
            snapshots.count.min(snapshots.bytes / one),
            one as f64 / 1e6,
            snapshots.bytes as f64 / (1 << 20) as f64
        );
    }
    let state = crate::model::state_size::state_size(&model.ckpt.config, 1);
    let disk = match model.prompt_cache() {
        Some(c) => format!(
            "; on disk as prompt-cache entries of {:.1} MB + {:.1} KB a token (prompts of {}+ tokens, {:.2} GB in all)",
            (state.kda_gb * 1e9 + model.vocab_size() as f64 * 4.0) / 1e6,
            state.kv_gb * 1e9 / 1e3,
            crate::model::prompt_cache::MIN_TOKENS,
            c.max_bytes() as f64 / 1e9
        ),
        None => String::new(),
    };
    tracing::info!(
        "[K3] serve: states kept at each prompt's end and at up to {} message boundaries a prompt (the end of its system prompt and tools, each Anthropic cache_control breakpoint; the last ones when there are more): in RAM as snapshots of {:.1} MB each ({:.0} MB in all){disk}",
        crate::session::MAX_BOUNDARIES,
        one as f64 / 1e6,
        snapshots.bytes as f64 / (1 << 20) as f64
    );
    let eos = model.ckpt.config.eos_token_ids.clone();
    while let Ok(job) = jobs.recv() {
        shared.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
        shared.metrics.busy.store(true, Ordering::SeqCst);
        if let Ok(mut c) = shared.current.lock() {
            *c = Some(job.cancel.clone());
        }
        if shared.stopping.load(Ordering::SeqCst) {
            job.cancel.store(true, Ordering::SeqCst);
        }
        let started = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_job(&mut session, tok, &eos, &job, &shared.live)
        }));
        let event = match result {
            Ok(Ok(outcome)) => {
                shared.metrics.add(&GenerationSample {
                    prompt_tokens: outcome.prompt_tokens,
                    cached_tokens: outcome.cached_tokens,
                    generated_tokens: outcome.completion_tokens,
                    prefill_secs: outcome.prefill_secs,
                    decode_secs: outcome.decode_secs,
                    ttft_secs: (outcome.completion_tokens > 0).then_some(outcome.ttft_secs),
                    queue_secs: started.duration_since(job.queued).as_secs_f64(),
                    request_secs: job.queued.elapsed().as_secs_f64(),
                    stats: outcome.stats.clone(),
                });
                let kept = crate::session::kept_boundaries(&job.params.boundaries);
                let kept = if kept.is_empty() {
                    String::new()
                } else {
                    let at: Vec<String> = kept.iter().map(|b| b.to_string()).collect();
                    format!(" | boundaries at {}", at.join(", "))
                };
                tracing::info!(
                    "[K3] serve {}: prompt {} (cached {}) | generated {} | queued {:.3}s | ttft {:.3}s | prefill {:.3}s | decode {:.3}s | {}{}{kept}",
                    job.id,
                    outcome.prompt_tokens,
                    outcome.cached_tokens,
                    outcome.completion_tokens,
                    started.duration_since(job.queued).as_secs_f64(),
                    outcome.ttft_secs,
                    outcome.prefill_secs,
                    outcome.decode_secs,
                    outcome.first().finish.as_str(),
                    if outcome.cancelled { " (cancelled)" } else { "" }
                );
                Event::Done(Box::new(outcome))
            }
            Ok(Err(e)) => {
                tracing::warn!("[K3] serve {}: failed: {e:#}", job.id);
                Event::Failed(format!("{e:#}"))
            }
            Err(_) => {
                tracing::error!(
                    "[K3] serve {}: the engine panicked; its state is reset",
                    job.id
                );
                Event::Failed("internal error in the engine; the request was dropped".into())
            }
        };
        if matches!(event, Event::Failed(_)) {
            // The state may be half-advanced: start the next request from scratch.
            session.reset()?;
        }
        let m = &shared.metrics;
        m.snapshots
            .store(session.snapshot_count(), Ordering::Relaxed);
        m.snapshot_bytes
            .store(session.snapshot_bytes(), Ordering::Relaxed);
        if let Ok(mut c) = shared.current.lock() {
            *c = None;
        }
        // Idle before the answer leaves, so a client that then asks /health sees it so.
        shared.metrics.busy.store(false, Ordering::SeqCst);
        deliver(&job.events, &job.cancel, job.stall_timeout, event, true);
    }
    Ok(())
}

/// Hands `ev` to the job's handler, waiting while its channel is full (the client reads
/// slower than the engine writes) until there is room, the handler is gone, `stall`
/// passes, or (unless `last`, the job's final event) the job is cancelled. An event not
/// delivered cancels the job; returns whether it was delivered.
fn deliver(
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

/// Turns one choice's generated text into events: the think channel as reasoning (or as
/// `<think>…</think>` inside content when inline), the rest as content through the stop
/// strings; the tools channel is held for parsing at the end.
struct Streamer<'a> {
    events: &'a Sender<Event>,
    cancel: &'a AtomicBool,
    stall_timeout: Duration,
    choice: usize,
    inline: bool,
    in_think: bool,
    stops: StopStrings,
    reasoning: String,
    content: String,
    /// Log-probabilities not yet sent: they go with the next piece of text.
    pending: Vec<LogprobEntry>,
}

impl Streamer<'_> {
    fn send(&mut self, field: Field, text: String) {
        if text.is_empty() {
            return;
        }
        let (field, text) = match (self.inline, field) {
            (false, f) => (f, text),
            (true, Field::Reasoning) if !self.in_think => {
                self.in_think = true;
                (Field::Content, format!("<think>{text}"))
            }
            (true, Field::Reasoning) => (Field::Content, text),
            (true, Field::Content) if self.in_think => {
                self.in_think = false;
                (Field::Content, format!("</think>{text}"))
            }
            (true, Field::Content) => (Field::Content, text),
        };
        match field {
            Field::Reasoning => self.reasoning.push_str(&text),
            Field::Content => self.content.push_str(&text),
        }
        let delta = Delta {
            choice: self.choice,
            field,
            text,
            logprobs: std::mem::take(&mut self.pending),
        };
        self.deliver(delta);
    }

    fn deliver(&mut self, delta: Delta) {
        deliver(
            self.events,
            self.cancel,
            self.stall_timeout,
            Event::Delta(delta),
            false,
        );
    }

    /// Sends the log-probabilities of tokens that showed no text (structure, a held-back
    /// stop string, end of sequence) in a piece of their own.
    fn flush_logprobs(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let delta = Delta {
            choice: self.choice,
            field: Field::Content,
            text: String::new(),
            logprobs: std::mem::take(&mut self.pending),
        };
        self.deliver(delta);
    }

    /// Closes an inline think section left open at the end.
    fn end_think(&mut self) {
        if self.in_think {
            self.in_think = false;
            self.inline = false;
            self.send(Field::Content, "</think>".to_string());
        }
    }

    fn text(&mut self, channel: Channel, text: &str) {
        match channel {
            Channel::Think => self.send(Field::Reasoning, text.to_string()),
            Channel::Tools => {}
            Channel::Response | Channel::Other => {
                let shown = self.stops.push(text);
                self.send(Field::Content, shown);
            }
        }
    }

    fn chat_events(&mut self, evs: Vec<ChatEvent>) {
        for ev in evs {
            if let ChatEvent::Text { channel, text } = ev {
                self.text(channel, &text);
            }
        }
    }
}

enum Output<'t> {
    Chat(Box<ChatSplitter<'t>>),
    Text(StreamDecoder<'t>),
}

/// Runs a job's choices one after another from the same prompt: the first prefills it,
/// the later ones go back to the state snapshot taken at its end (or prefill again when
/// snapshots are off), each with its own sampler (`seed + i`).
fn run_job<B: Backend>(
    session: &mut Session<'_, B>,
    tok: &Tokenizer,
    eos: &[u32],
    job: &Job,
    live: &LiveFigures,
) -> Result<Outcome> {
    let t0 = Instant::now();
    let n = job.params.n.max(1);
    let mut out = Outcome {
        choices: Vec::with_capacity(n),
        prompt_tokens: job.ids.len(),
        cached_tokens: 0,
        completion_tokens: 0,
        reasoning_tokens: 0,
        ttft_secs: 0.0,
        prefill_secs: 0.0,
        decode_secs: 0.0,
        stats: Stats::default(),
        cancelled: false,
        seed: job.params.sampling.seed,
        constraint_compile_secs: job.params.constraint.as_ref().map(|c| c.compile_secs),
        pick_secs: 0.0,
    };
    let mut ttft = None;
    for choice in 0..n {
        let (c, g, pick_secs) = run_choice(session, tok, eos, job, choice, &mut |ev| {
            ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            if ev.index > 0 {
                live.push(ev.secs, &ev.stats);
            }
        })?;
        if choice == 0 {
            out.cached_tokens = g.cached_tokens;
        }
        out.completion_tokens += g.tokens.len();
        out.reasoning_tokens += c.reasoning_tokens;
        out.prefill_secs += g.prefill_secs;
        out.decode_secs += g.decode_secs;
        out.pick_secs += pick_secs;
        out.stats = out.stats.plus(&g.prefill_stats.plus(&g.decode_stats));
        out.choices.push(c);
        if g.finish == Finish::Cancelled {
            out.cancelled = true;
            break;
        }
    }
    out.ttft_secs = ttft.unwrap_or(0.0);
    Ok(out)
}

fn run_choice<B: Backend>(
    session: &mut Session<'_, B>,
    tok: &Tokenizer,
    eos: &[u32],
    job: &Job,
    choice: usize,
    on_token: &mut dyn FnMut(&TokenEvent),
) -> Result<(ChoiceOut, Generation, f64)> {
    let p = &job.params;
    let mut sampling = p.sampling;
    sampling.seed = sampling.seed.wrapping_add(choice as u64);
    let constraint = p.constraint.as_ref().map(|c| c.constraint.clone());
    let picker = RefCell::new(
        TokenPicker::new(
            Sampler::new(sampling)?.with_prompt_len(job.ids.len()),
            constraint,
            p.logprobs,
        )
        .with_budget(p.max_tokens),
    );
    let mut writer = LogprobWriter::new(tok);
    let mut all_logprobs = p.logprobs.map(|_| Vec::new());
    let mut stop_ids = match job.kind {
        JobKind::Chat { .. } => chat_stop_ids(tok, eos),
        JobKind::Completion => eos.to_vec(),
    };
    let mut output = match job.kind {
        JobKind::Chat { thinking, .. } => {
            let splitter = ChatSplitter::new(tok, thinking, eos)?;
            Output::Chat(Box::new(if p.ignore_eos {
                splitter.without_stops()
            } else {
                splitter
            }))
        }
        JobKind::Completion => Output::Text(StreamDecoder::new(tok, false)),
    };
    if p.ignore_eos {
        stop_ids.clear();
    }
    let mut st = Streamer {
        events: &job.events,
        stall_timeout: job.stall_timeout,
        cancel: &job.cancel,
        choice,
        inline: job.inline_reasoning,
        in_think: false,
        stops: StopStrings::new(&p.stop),
        reasoning: String::new(),
        content: String::new(),
        pending: Vec::new(),
    };
    let mut pick_secs = 0.0;
    let mut reasoning_tokens = 0usize;
    let mut budget = match job.kind {
        JobKind::Chat { thinking: true, .. } => p
            .think_budget
            .and_then(|b| ThinkBudget::new(tok, b, p.constraint.is_some())),
        _ => None,
    };
    let mut pick = |logits: &[f32], history: &[u32]| {
        let t = Instant::now();
        let id = match budget.as_mut().and_then(ThinkBudget::forced) {
            Some(id) => {
                picker.borrow_mut().force(id);
                id
            }
            None => {
                let id = picker.borrow_mut().pick(logits, history);
                if let Some(b) = budget.as_mut() {
                    b.saw(id);
                }
                id
            }
        };
        pick_secs += t.elapsed().as_secs_f64();
        id
    };
    let opts = DecodeOptions {
        max_tokens: p.max_tokens,
        stop_ids: &stop_ids,
        cancel: Some(&job.cancel),
        snapshot_at: p.snapshot_at,
        boundaries: &p.boundaries,
        ..DecodeOptions::default()
    };
    let g = session.generate(&job.ids, &opts, &mut pick, &mut |ev| {
        let mut pk = picker.borrow_mut();
        if let Some(e) = pk.take_error() {
            return Err(e);
        }
        on_token(ev);
        if let Some(lp) = pk.take_logprobs() {
            let entry = writer.entry(&lp);
            if let Some(all) = all_logprobs.as_mut() {
                all.push(entry.clone());
            }
            st.pending.push(entry);
        }
        match &mut output {
            Output::Chat(s) => {
                if s.channel() == Channel::Think {
                    reasoning_tokens += 1;
                }
                let evs = s.push(ev.id)?;
                st.chat_events(evs);
            }
            Output::Text(d) => {
                let text = d.push(ev.id)?;
                st.text(Channel::Response, &text);
            }
        }
        // A finished constraint allows only end-of-sequence ids, which `ignore_eos` would
        // otherwise repeat to the budget's end.
        Ok(if st.stops.hit() || pk.constraint_finished() {
            Flow::Stop
        } else {
            Flow::Continue
        })
    })?;
    match &mut output {
        Output::Chat(s) => {
            let evs = if p.constraint.is_some() {
                s.finish_framed()
            } else {
                s.finish()
            };
            st.chat_events(evs);
        }
        Output::Text(d) => {
            let text = d.finish();
            st.text(Channel::Response, &text);
        }
    }
    let tail = st.stops.finish();
    st.send(Field::Content, tail);
    let mut tool_calls = Vec::new();
    if let JobKind::Chat {
        thinking,
        single_tool_call,
    } = job.kind
    {
        let reply = parse_reply(&pieces_from_ids(tok, &g.tokens), thinking);
        tool_calls = reply.tool_calls;
        if single_tool_call {
            tool_calls.truncate(1);
        }
        st.send(Field::Content, reply.unparsed_tools);
    }
    st.end_think();
    st.flush_logprobs();
    let finish = if !tool_calls.is_empty() {
        FinishReason::ToolCalls
    } else if g.finish == Finish::Length && !st.stops.hit() {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    let c = ChoiceOut {
        reasoning: st.reasoning,
        content: st.content,
        tool_calls,
        finish,
        stop_string: st.stops.matched().map(str::to_string),
        completion_tokens: g.tokens.len(),
        reasoning_tokens,
        logprobs: all_logprobs,
    };
    Ok((c, g, pick_secs))
}

/// `thinking.budget_tokens` in the decode loop: once the think channel has taken its
/// budget, the channel's close is forced into the sequence. Without an output constraint
/// the whole frame (`<|close|>think<|sep|><|open|>response<|sep|>`) is forced, so the model
/// goes on in the response section; under one, only `<|close|>`, and the grammar (which
/// bounds the think channel itself) leads on to the response.
struct ThinkBudget {
    left: usize,
    open: bool,
    close: u32,
    /// The ids still to force, last first.
    forcing: Vec<u32>,
    frame: Vec<u32>,
}

impl ThinkBudget {
    /// `None` when the vocabulary lacks the frame's control tokens (a reply then thinks
    /// unbounded, as the model's own stop rule has it).
    fn new(tok: &Tokenizer, budget: usize, constrained: bool) -> Option<Self> {
        let close = tok.special_id("<|close|>")?;
        let mut frame = vec![close];
        if !constrained {
            frame.extend(tok.encode("think"));
            frame.push(tok.special_id("<|sep|>")?);
            frame.push(tok.special_id("<|open|>")?);
            frame.extend(tok.encode("response"));
            frame.push(tok.special_id("<|sep|>")?);
        }
        frame.reverse();
        Some(Self {
            left: budget,
            open: true,
            close,
            forcing: Vec::new(),
            frame,
        })
    }

    /// The id this step must take, if the budget forces one.
    fn forced(&mut self) -> Option<u32> {
        if self.open && self.left == 0 && self.forcing.is_empty() {
            self.forcing = std::mem::take(&mut self.frame);
        }
        let id = self.forcing.pop()?;
        if self.forcing.is_empty() {
            self.open = false;
        }
        Some(id)
    }

    /// Counts a sampled id: one more think token, or the model closing the channel itself.
    fn saw(&mut self, id: u32) {
        if !self.open {
            return;
        }
        if id == self.close {
            self.open = false;
        } else {
            self.left = self.left.saturating_sub(1);
        }
    }
}
