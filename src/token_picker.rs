//! The per-step choice the decode loop makes ([`crate::session::Session::generate`]'s
//! `pick`): the grammar's mask on the logits, the sampler's draw, the grammar advanced by
//! the drawn id, and the log-probabilities of that step when asked for.

use anyhow::{Error, Result};

use crate::grammar::TokenConstraint;
use crate::sampling::{Sampler, TokenLogprobs};

/// A sampler with an optional output constraint and log-probability record.
pub struct TokenPicker {
    sampler: Sampler,
    constraint: Option<TokenConstraint>,
    /// `Some(n)`: record each step's log-probabilities with the `n` best alternatives.
    top_logprobs: Option<usize>,
    /// Tokens the reply may still take, when bounded: the constraint closes in time.
    remaining: Option<usize>,
    scratch: Vec<f32>,
    last: Option<TokenLogprobs>,
    error: Option<Error>,
}

impl TokenPicker {
    /// Picks with `sampler`, under `constraint` when given; records log-probabilities with
    /// `top_logprobs` alternatives when that is `Some`.
    pub fn new(
        sampler: Sampler,
        constraint: Option<TokenConstraint>,
        top_logprobs: Option<usize>,
    ) -> Self {
        Self {
            sampler,
            constraint,
            top_logprobs,
            remaining: None,
            scratch: Vec::new(),
            last: None,
            error: None,
        }
    }

    /// Bounds the reply to `max_tokens` picks, so a constraint closes its structure before
    /// they run out (when the grammar leaves a way to).
    pub fn with_budget(mut self, max_tokens: usize) -> Self {
        self.remaining = Some(max_tokens);
        self
    }

    /// The next id. A constraint that fails (a grammar that allows nothing, a token it
    /// refuses) leaves its error for [`Self::take_error`], which the token callback checks
    /// first, and returns an id that callback then discards.
    pub fn pick(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        match self.try_pick(logits, history) {
            Ok(id) => id,
            Err(e) => {
                self.error = Some(e);
                0
            }
        }
    }

    fn try_pick(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        let logits = match self.constraint.as_mut() {
            Some(c) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(logits);
                c.mask_logits(&mut self.scratch, self.remaining)?;
                &self.scratch[..]
            }
            None => logits,
        };
        let id = match self.top_logprobs {
            Some(n) => {
                let (id, lp) = self.sampler.sample_with_logprobs(logits, history, n);
                self.last = Some(lp);
                id
            }
            None => self.sampler.sample(logits, history),
        };
        if let Some(r) = self.remaining.as_mut() {
            *r = r.saturating_sub(1);
        }
        if let Some(c) = self.constraint.as_mut() {
            c.commit(id)?;
        }
        Ok(id)
    }

    /// Takes `id` as this step's pick without sampling (a forced token, such as the think
    /// channel's close when its budget is spent): the constraint advances by it and the
    /// step records no log-probabilities.
    pub fn force(&mut self, id: u32) {
        self.last = None;
        if let Some(r) = self.remaining.as_mut() {
            *r = r.saturating_sub(1);
        }
        if let Some(c) = self.constraint.as_mut() {
            if let Err(e) = c.commit(id) {
                self.error = Some(e);
            }
        }
    }

    /// The error of the last pick, if it failed.
    pub fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }

    /// The log-probabilities of the last pick, when they are recorded.
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.last.take()
    }

    /// Whether the constrained text is complete (false without a constraint).
    pub fn constraint_finished(&self) -> bool {
        self.constraint
            .as_ref()
            .is_some_and(TokenConstraint::is_finished)
    }
}
