//! One choice of a request while it runs: its sampler, stop rules, think budget, logprobs
//! and the streamer that turns its tokens into the events its client reads.

use super::job::deliver;
use super::job::{ChoiceOut, Delta, Event, Field, FinishReason, Job, JobKind};
use super::logprobs::{LogprobEntry, LogprobWriter};
use super::reply::{parse_reply, pieces_from_ids};
use super::stop_strings::StopStrings;
use crate::backend::Backend;
use crate::sampling::Sampler;
use crate::session::{Finish, Flow, Generation, Session, Stepper, TokenEvent};
use crate::token_picker::TokenPicker;
use crate::tokenizer::{chat_stop_ids, Channel, ChatEvent, ChatSplitter, StreamDecoder, Tokenizer};
use anyhow::Result;
use std::cell::RefCell;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::Sender;

/// Turns one choice's generated text into events: the think channel as reasoning (or as
/// `<think>…</think>` inside content when inline), the rest as content through the stop
/// strings; the tools channel is held for parsing at the end.
struct Streamer {
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
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

impl Streamer {
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
            &self.events,
            &self.cancel,
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

pub(super) enum Output<'t> {
    Chat(Box<ChatSplitter<'t>>),
    Text(StreamDecoder<'t>),
}

/// One choice's own parts: its sampler and constraint, think budget, stop strings,
/// logprobs and the streaming of its text.
pub(super) struct ChoiceRun<'t> {
    picker: RefCell<TokenPicker>,
    writer: LogprobWriter<'t>,
    all_logprobs: Option<Vec<LogprobEntry>>,
    output: Output<'t>,
    st: Streamer,
    budget: Option<ThinkBudget>,
    pick_secs: f64,
    reasoning_tokens: usize,
}

impl<'t> ChoiceRun<'t> {
    /// Choice `choice` of `job`, with the ids that stop it.
    pub(super) fn new(
        tok: &'t Tokenizer,
        eos: &[u32],
        job: &Job,
        choice: usize,
    ) -> Result<(Self, Vec<u32>)> {
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
        let mut stop_ids = match job.kind {
            JobKind::Chat { .. } => chat_stop_ids(tok, eos),
            JobKind::Completion => eos.to_vec(),
        };
        let output = match job.kind {
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
        let st = Streamer {
            events: job.events.clone(),
            stall_timeout: job.stall_timeout,
            cancel: job.cancel.clone(),
            choice,
            inline: job.inline_reasoning,
            in_think: false,
            stops: StopStrings::new(&p.stop),
            reasoning: String::new(),
            content: String::new(),
            pending: Vec::new(),
        };
        let budget = match job.kind {
            JobKind::Chat { thinking: true, .. } => p
                .think_budget
                .and_then(|b| ThinkBudget::new(tok, b, p.constraint.is_some())),
            _ => None,
        };
        let run = Self {
            picker,
            writer: LogprobWriter::new(tok),
            all_logprobs: p.logprobs.map(|_| Vec::new()),
            output,
            st,
            budget,
            pick_secs: 0.0,
            reasoning_tokens: 0,
        };
        Ok((run, stop_ids))
    }

    /// Picks the choice's next token on `session` and streams what it shows.
    pub(super) fn step<B: Backend>(
        &mut self,
        session: &mut Session<'_, B>,
        stepper: &mut Stepper,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<()> {
        let Self {
            picker,
            writer,
            all_logprobs,
            output,
            st,
            budget,
            pick_secs,
            reasoning_tokens,
        } = self;
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
            *pick_secs += t.elapsed().as_secs_f64();
            id
        };
        session.pick(stepper, &mut pick, &mut |ev| {
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
            match output {
                Output::Chat(s) => {
                    if s.channel() == Channel::Think {
                        *reasoning_tokens += 1;
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
        })
    }

    /// Ends the choice: flushes its text, parses its tool calls; returns it with the
    /// seconds its picks took.
    pub(super) fn finish(mut self, tok: &Tokenizer, job: &Job, g: &Generation) -> (ChoiceOut, f64) {
        let p = &job.params;
        let st = &mut self.st;
        match &mut self.output {
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
        let stop_string = st.stops.matched().map(str::to_string);
        let c = ChoiceOut {
            reasoning: std::mem::take(&mut st.reasoning),
            content: std::mem::take(&mut st.content),
            tool_calls,
            finish,
            stop_string,
            completion_tokens: g.tokens.len(),
            reasoning_tokens: self.reasoning_tokens,
            logprobs: self.all_logprobs,
        };
        (c, self.pick_secs)
    }
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
