//! A generation in progress on a session: where it is, what it has fed and generated, and
//! the tokens its next step feeds.

use super::{Finish, Generation};
use crate::model::Logits;
use crate::stats::Stats;
use std::time::Instant;

/// Where a [`Stepper`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Feeding the prompt.
    Prefill,
    /// The logits of the last fed token are in: the next step picks a token.
    Pick,
    /// A picked token waits to be fed.
    Feed(u32),
    /// The generation ended.
    Done(Finish),
}

/// A generation in progress on a [`Session`](super::Session)
/// ([`Session::begin`](super::Session::begin)), advanced a step at a time, so one engine can
/// run several sequences' steps in one batched forward pass.
#[derive(Debug)]
pub struct Stepper {
    pub(super) prompt: Vec<u32>,
    /// The prompt and the tokens generated so far (what penalties look back on).
    pub(super) history: Vec<u32>,
    /// Prompt tokens the session holds.
    pub(super) fed: usize,
    /// Prompt positions worth a snapshot, ascending, past what was reused.
    pub(super) points: Vec<usize>,
    /// Of them, the message boundaries (also stored in the prompt cache).
    pub(super) boundaries: Vec<usize>,
    pub(super) max_tokens: usize,
    pub(super) stop_ids: Vec<u32>,
    pub(super) all_logits: bool,
    pub(super) phase: Phase,
    pub(super) g: Generation,
    pub(super) t0: Instant,
    /// When the prefill ended.
    pub(super) t1: Option<Instant>,
    /// Seconds and counters of the pass that produced the logits held now.
    pub(super) secs: f64,
    pub(super) step_stats: Stats,
}

impl Stepper {
    /// Where it is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Prompt tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Prompt tokens the session holds (reused or fed).
    pub fn prompt_fed(&self) -> usize {
        self.fed
    }

    /// Prompt tokens reused from the session or the prompt cache.
    pub fn cached_tokens(&self) -> usize {
        self.g.cached_tokens
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.g.tokens.len()
    }

    /// Ends it now with `f` (a cancelled prefill holds the slices fed whole).
    pub fn end(&mut self, f: Finish) {
        if matches!(self.phase, Phase::Done(_)) {
            return;
        }
        match self.t1 {
            Some(t1) => self.g.decode_secs = t1.elapsed().as_secs_f64(),
            None => self.g.prefill_secs = self.t0.elapsed().as_secs_f64(),
        }
        self.phase = Phase::Done(f);
    }

    /// What it produced (call once it is done; an unfinished one counts as cancelled).
    pub fn into_generation(mut self) -> Generation {
        self.end(Finish::Cancelled);
        if let Phase::Done(f) = self.phase {
            self.g.finish = f;
        }
        self.g
    }

    /// The tokens this step feeds: the next prompt slice of at most `slice` tokens,
    /// ending at the next snapshot point, or the picked token; empty otherwise.
    pub(super) fn step_ids(&self, slice: usize) -> &[u32] {
        match self.phase {
            Phase::Prefill => {
                let next = self
                    .points
                    .iter()
                    .copied()
                    .find(|&p| p > self.fed)
                    .unwrap_or(self.prompt.len());
                let end = next.min(self.fed + slice.max(1));
                &self.prompt[self.fed..end]
            }
            Phase::Feed(_) => &self.history[self.history.len() - 1..],
            Phase::Pick | Phase::Done(_) => &[],
        }
    }

    /// Which logits the step's pass returns.
    pub(super) fn want(&self) -> Logits {
        if self.phase == Phase::Prefill && self.all_logits {
            Logits::All
        } else {
            Logits::Last
        }
    }
}
