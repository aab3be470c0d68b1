//! What a generation reports: each token as it comes, the caller's answer to it, and the
//! whole generation with why it ended.

use crate::stats::{RunReport, Stats};

/// What the decode loop should do after a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now (the token is still reported).
    Stop,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Finish {
    /// A stop id was generated, or the token callback said stop.
    #[default]
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The cancel flag was raised (between prefill layers or between tokens).
    Cancelled,
}

/// One generated token and what producing it cost.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// The token.
    pub id: u32,
    /// Its index among the generated tokens (0-based).
    pub index: usize,
    /// Seconds of the forward pass that produced its logits (0 for the first: prefill's).
    pub secs: f64,
    /// Counters of that forward pass.
    pub stats: Stats,
}

/// What a generation produced and how long it took.
#[derive(Debug, Default)]
pub struct Generation {
    /// Generated ids (the prompt excluded).
    pub tokens: Vec<u32>,
    /// Logits of every prompt position fed by this call, when requested.
    pub prompt_logits: Vec<f32>,
    /// Prompt tokens the session already held (prefix reuse) or loaded from the prompt
    /// cache on disk.
    pub cached_tokens: usize,
    /// Of `cached_tokens`, those loaded from the prompt cache on disk.
    pub disk_cached_tokens: usize,
    /// Prompt tokens fed by this call.
    pub prefilled_tokens: usize,
    /// Seconds in prefill.
    pub prefill_secs: f64,
    /// Seconds in decode.
    pub decode_secs: f64,
    /// Counters of the prefill.
    pub prefill_stats: Stats,
    /// Counters of the decode.
    pub decode_stats: Stats,
    /// Why it ended.
    pub finish: Finish,
}

impl RunReport for Generation {
    fn generated_tokens(&self) -> usize {
        self.tokens.len()
    }
    fn prefill(&self) -> (f64, &Stats) {
        (self.prefill_secs, &self.prefill_stats)
    }
    fn decode(&self) -> (f64, &Stats) {
        (self.decode_secs, &self.decode_stats)
    }
}
