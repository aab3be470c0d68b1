//! A conversation with the model and the one decode loop that `k3 run`, `k3 chat` and
//! `k3 serve` share: the state of everything fed so far (so a new turn only feeds its own
//! tokens: prefix reuse), prefill in windows, and token-by-token decode under one stop rule.
//!
//! A new prompt that extends what was consumed feeds only its suffix. One that diverges
//! from it (a client resending a conversation whose earlier answer the template renders
//! differently from how it was generated) goes back to the longest state snapshot that is
//! a prefix of both and feeds the rest; snapshots are taken at the end of each prompt,
//! within [`SnapshotLimits`].
//!
//! Its parts: `prefill.rs` (the prefill loop and a session's feed through it), `options.rs`
//! (what a generation is asked), `report.rs` (what it reports), `snapshots.rs` (prefix reuse
//! and state snapshots), `prompt_cache.rs` (the prompt cache's load and store), `stepper.rs`
//! (a generation in progress) and `step.rs` (the step API and `generate`, its blocking loop).

mod options;
mod prefill;
mod prompt_cache;
mod report;
mod snapshots;
mod step;
mod stepper;

pub use options::{kept_boundaries, DecodeOptions, MAX_BOUNDARIES};
pub use prefill::{check_window, prefill, window, MAX_WINDOW};
pub use report::{Finish, Flow, Generation, TokenEvent};
pub use snapshots::SnapshotLimits;
pub use stepper::{Phase, Stepper};

use crate::backend::Backend;
use crate::model::{Runner, State};
use crate::stats::Stats;
use anyhow::Result;
use snapshots::Snapshot;

/// Model state plus the tokens it has consumed.
pub struct Session<'m, B: Backend> {
    model: &'m Runner<B>,
    state: State<B>,
    tokens: Vec<u32>,
    /// Logits after the last consumed token (empty when nothing was consumed).
    last_logits: Vec<f32>,
    /// Bound on the prefill window besides the model's own.
    max_window: usize,
    /// Snapshots of earlier points of `tokens`, shortest first; each one's tokens are a
    /// prefix of `tokens` (those of an abandoned branch are dropped when it is left).
    snapshots: Vec<Snapshot<B>>,
    snapshot_limits: SnapshotLimits,
    /// Counters since the session started.
    pub stats: Stats,
}

impl<'m, B: Backend> Session<'m, B> {
    /// An empty conversation; prompts are prefilled in windows of the model's prefill
    /// window ([`crate::model::Runtime::prefill_window`], which `--chunk` bounds through the engine).
    pub fn new(model: &'m Runner<B>) -> Result<Self> {
        Self::with_max_window(model, MAX_WINDOW)
    }

    /// [`Self::new`] with windows of at most `max_window` tokens, below the model's own
    /// (tests and benchmarks that compare windows on one loaded model).
    pub fn with_max_window(model: &'m Runner<B>, max_window: usize) -> Result<Self> {
        check_window(max_window)?;
        Ok(Self {
            model,
            state: model.new_state()?,
            tokens: Vec::new(),
            last_logits: Vec::new(),
            max_window,
            snapshots: Vec::new(),
            snapshot_limits: SnapshotLimits::default(),
            stats: Stats::default(),
        })
    }

    /// A new session that holds what this one holds: a copy of its state
    /// ([`crate::model::K3Model::copy_state`]), its tokens and the logits after them, under the same
    /// window and snapshot limits. Its snapshots stay here: the copy goes on its own branch.
    pub fn fork(&self) -> Result<Session<'m, B>> {
        Ok(Self {
            model: self.model,
            state: self.model.copy_state(&self.state)?,
            tokens: self.tokens.clone(),
            last_logits: self.last_logits.clone(),
            max_window: self.max_window,
            snapshots: Vec::new(),
            snapshot_limits: self.snapshot_limits,
            stats: Stats::default(),
        })
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m Runner<B> {
        self.model
    }

    /// Tokens consumed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets everything.
    pub fn reset(&mut self) -> Result<()> {
        // The tokens go first: should the new state fail, the session is empty, not stale.
        self.tokens.clear();
        self.last_logits.clear();
        self.snapshots.clear();
        self.state = self.model.new_state()?;
        Ok(())
    }
}
