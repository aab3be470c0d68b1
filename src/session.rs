//! A conversation with the model and the one decode loop that `k3 run`, `k3 chat` and
//! `k3 serve` share: the state of everything fed so far (so a new turn only feeds its own
//! tokens: prefix reuse), prefill in windows, and token-by-token decode under one stop rule.
//!
//! A new prompt that extends what was consumed feeds only its suffix. One that diverges
//! from it (a client resending a conversation whose earlier answer the template renders
//! differently from how it was generated) goes back to the longest state snapshot that is
//! a prefix of both and feeds the rest; snapshots are taken at the end of each prompt,
//! within [`SnapshotLimits`].

use crate::backend::Backend;
use crate::model::trace::Trace;
use crate::model::Segment;
use crate::model::{Logits, Runner, State, StateSnapshot};
use crate::stats::{RunReport, Stats};
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Largest bound on the prefill window accepted (`--chunk` / `K3_CHUNK`), which memory and
/// the backend's limits bound further ([`crate::model::Runtime::prefill_window`]).
pub const MAX_WINDOW: usize = 1 << 22;

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

/// The stop rule and switches of [`Session::generate`].
#[derive(Clone, Copy, Default)]
pub struct DecodeOptions<'a> {
    /// Tokens to generate at most (0 generates nothing).
    pub max_tokens: usize,
    /// Stop when one of these ids is generated (it is still reported).
    pub stop_ids: &'a [u32],
    /// Checked before each layer of a prefill window and between tokens; raised means
    /// stop now.
    pub cancel: Option<&'a AtomicBool>,
    /// Keep the logits of every prompt position fed by this call.
    pub all_logits: bool,
    /// Per-layer hidden dumps.
    pub trace: Option<&'a Trace>,
    /// A prompt position to keep a state snapshot at besides the prompt's end: where the
    /// next prompt of the conversation is expected to part from this one (the server's
    /// tool-choice note), so that prompt resumes there instead of from the start.
    pub snapshot_at: Option<usize>,
    /// Prompt positions at message boundaries later prompts are likely to share (the end
    /// of the system prompt and tools, a client's cache breakpoints), ascending: the
    /// prefill keeps a state snapshot at each and stores it in the prompt cache, so a
    /// prompt that shares only those messages resumes there. The last [`MAX_BOUNDARIES`]
    /// are kept a prompt.
    pub boundaries: &'a [usize],
}

/// Message boundaries kept per prompt ([`DecodeOptions::boundaries`]), the last ones (a
/// client puts its latest breakpoint last; Anthropic allows four): each costs a state
/// snapshot in RAM and a prompt-cache entry on disk.
pub const MAX_BOUNDARIES: usize = 4;

/// The boundaries of `marked` (ascending) a prompt keeps: the last [`MAX_BOUNDARIES`].
pub fn kept_boundaries(marked: &[usize]) -> &[usize] {
    &marked[marked.len().saturating_sub(MAX_BOUNDARIES)..]
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

fn cancelled(flag: Option<&AtomicBool>) -> bool {
    flag.is_some_and(|f| f.load(Ordering::SeqCst))
}

/// Checks a bound on the prefill window against `1..=MAX_WINDOW`.
pub fn check_window(max_window: usize) -> Result<()> {
    if max_window == 0 || max_window > MAX_WINDOW {
        bail!("--chunk / K3_CHUNK must be between 1 and {MAX_WINDOW}, got {max_window}");
    }
    Ok(())
}

/// Tokens one forward pass of a prompt takes: the model's prefill window, at most
/// `max_window`.
pub fn window<B: Backend>(model: &Runner<B>, max_window: usize) -> usize {
    max_window.min(model.rt.prefill_window()).max(1)
}

/// Runs the prompt through the model in windows of at most `max_window` tokens ([`window`]),
/// layer-major within each window. Returns the logits of
/// every prompt position when `all` is set, else those of the last position.
pub fn prefill<B: Backend>(
    model: &Runner<B>,
    st: &mut State<B>,
    ids: &[u32],
    max_window: usize,
    all: bool,
    stats: &mut Stats,
    trace: Option<&Trace>,
) -> Result<Vec<f32>> {
    check_window(max_window)?;
    if ids.is_empty() {
        bail!("the prompt is empty: give at least one token id");
    }
    let want = if all { Logits::All } else { Logits::Last };
    let mut out = Vec::new();
    let stopped = feed_windows(
        model,
        st,
        ids,
        max_window,
        want,
        stats,
        trace,
        None,
        &mut |_, l| {
            if all {
                out.extend(l);
            } else {
                out = l;
            }
        },
    )?;
    if stopped.is_some() {
        bail!("internal: a prefill without a cancel flag was cancelled");
    }
    Ok(out)
}

/// Where a [`feed_windows`] stopped when the cancel flag was raised.
enum Stopped {
    /// Between windows: the state holds the windows fed whole.
    BetweenWindows,
    /// Between layers of a window: the state is part-advanced (the layers before the
    /// stop saw the window, the rest did not).
    InWindow,
}

/// The prefill loop: feeds `ids` to `st` in windows of at most `max_window` tokens
/// ([`window`]), one forward pass each, layer-major within the window, and hands each
/// window fed whole to `fed` with its logits. `cancel` is checked before each window and
/// before each layer. A feed of more than one token reports prefill progress, ended on
/// every way out. Returns `None` when every window was fed. After an error the state is
/// half-advanced: the caller resets it.
#[allow(clippy::too_many_arguments)]
fn feed_windows<B: Backend>(
    model: &Runner<B>,
    st: &mut State<B>,
    ids: &[u32],
    max_window: usize,
    want: Logits,
    stats: &mut Stats,
    trace: Option<&Trace>,
    cancel: Option<&AtomicBool>,
    fed: &mut dyn FnMut(&[u32], Vec<f32>),
) -> Result<Option<Stopped>> {
    let progress = model.rt.progress();
    if ids.len() > 1 {
        progress.begin(ids.len(), model.layer_count());
    }
    // Ends the progress on every way out of the loop.
    struct End<'a>(&'a crate::model::prefill_progress::PrefillProgress);
    impl Drop for End<'_> {
        fn drop(&mut self) {
            self.0.end();
        }
    }
    let _end = (ids.len() > 1).then(|| End(progress));
    for c in ids.chunks(window(model, max_window)) {
        if cancelled(cancel) {
            return Ok(Some(Stopped::BetweenWindows));
        }
        match model.forward_until(st, c, want, stats, trace, cancel)? {
            Some(logits) => fed(c, logits),
            None => return Ok(Some(Stopped::InWindow)),
        }
    }
    Ok(None)
}

/// How many state snapshots a session keeps, and in how many bytes at most.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotLimits {
    /// Snapshots at most (0: none are taken).
    pub count: usize,
    /// Bytes they may take together (KDA states plus the logits kept with each).
    pub bytes: usize,
}

/// The state after `tokens[..state.pos()]` of the session, with the logits that followed.
struct Snapshot<B: Backend> {
    state: StateSnapshot<B>,
    last_logits: Vec<f32>,
    bytes: usize,
}

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

    /// Keeps state snapshots at the end of each prompt within `limits` (none by default).
    pub fn set_snapshot_limits(&mut self, limits: SnapshotLimits) {
        self.snapshot_limits = limits;
        self.evict_snapshots();
    }

    /// Snapshots held now.
    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// Bytes the snapshots held now take.
    pub fn snapshot_bytes(&self) -> usize {
        self.snapshots.iter().map(|s| s.bytes).sum()
    }

    /// Drops the oldest snapshots until the count and bytes are within the limits.
    fn evict_snapshots(&mut self) {
        let l = self.snapshot_limits;
        while !self.snapshots.is_empty()
            && (self.snapshots.len() > l.count || self.snapshot_bytes() > l.bytes)
        {
            self.snapshots.remove(0);
        }
    }

    /// Takes a snapshot of the current point, when the limits leave room for one.
    fn take_snapshot(&mut self) -> Result<()> {
        let pos = self.tokens.len();
        let bytes = self.model.snapshot_bytes() + self.last_logits.len() * 4;
        let l = self.snapshot_limits;
        if pos == 0
            || l.count == 0
            || bytes > l.bytes
            || self.snapshots.last().is_some_and(|s| s.state.pos() >= pos)
        {
            return Ok(());
        }
        let state = self.model.snapshot(&self.state)?;
        self.snapshots.push(Snapshot {
            state,
            last_logits: self.last_logits.clone(),
            bytes,
        });
        self.evict_snapshots();
        Ok(())
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

    /// Feeds `ids` after what was consumed through the prefill loop ([`feed_windows`]);
    /// stops between layers when `cancel` is raised (returning false). The windows fed
    /// whole stay consumed; one stopped part-way is undone (back to a snapshot, or the
    /// session resets).
    fn feed(
        &mut self,
        ids: &[u32],
        opts: &DecodeOptions<'_>,
        stats: &mut Stats,
        all: &mut Vec<f32>,
    ) -> Result<bool> {
        let want = if opts.all_logits {
            Logits::All
        } else {
            Logits::Last
        };
        let v = self.model.vocab_size();
        let (tokens, last_logits) = (&mut self.tokens, &mut self.last_logits);
        let stopped = feed_windows(
            self.model,
            &mut self.state,
            ids,
            self.max_window,
            want,
            stats,
            opts.trace,
            opts.cancel,
            &mut |c, logits| {
                tokens.extend_from_slice(c);
                *last_logits = logits[logits.len().saturating_sub(v)..].to_vec();
                if opts.all_logits {
                    all.extend(logits);
                }
            },
        );
        match stopped {
            Ok(None) => Ok(true),
            Ok(Some(Stopped::BetweenWindows)) => Ok(false),
            Ok(Some(Stopped::InWindow)) => {
                self.rewind_part_advanced()?;
                Ok(false)
            }
            // A failed forward leaves the state half-advanced: forget it all.
            Err(e) => {
                self.reset()?;
                Err(e)
            }
        }
    }

    /// After a pass stopped between layers: returns to the longest snapshot of what was
    /// consumed (its KDA layers copied back, the MLA caches cut to it), or resets.
    fn rewind_part_advanced(&mut self) -> Result<()> {
        let consumed = self.tokens.len();
        self.snapshots.retain(|s| s.state.pos() <= consumed);
        let Some(snap) = self.snapshots.last() else {
            return self.reset();
        };
        let pos = snap.state.pos();
        if self.model.restore(&mut self.state, &snap.state).is_err() {
            return self.reset();
        }
        self.tokens.truncate(pos);
        self.last_logits.clone_from(&snap.last_logits);
        Ok(())
    }

    /// Brings the session to exactly `ids`: feeds only the new suffix when what was consumed
    /// is a prefix of `ids`, else goes back to the longest snapshot that is one (or starts
    /// over). Returns how many tokens were fed.
    pub fn sync_to(&mut self, ids: &[u32]) -> Result<usize> {
        let reused = self.reuse(ids)?;
        let mut stats = Stats::default();
        self.feed(
            &ids[reused..],
            &DecodeOptions::default(),
            &mut stats,
            &mut Vec::new(),
        )?;
        self.stats = self.stats.plus(&stats);
        Ok(ids.len() - reused)
    }

    /// Keeps the consumed tokens when they are a prefix of `ids`; else returns to the
    /// longest snapshot whose tokens are a prefix of `ids` (resetting when none is) and
    /// drops the snapshots past it, which lie on the abandoned branch. Returns how many
    /// tokens are kept.
    fn reuse(&mut self, ids: &[u32]) -> Result<usize> {
        let common = self
            .tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.tokens.len() {
            return Ok(common);
        }
        self.snapshots.retain(|s| s.state.pos() <= common);
        let Some(snap) = self.snapshots.last() else {
            self.reset()?;
            return Ok(0);
        };
        let pos = snap.state.pos();
        if let Err(e) = self.model.restore(&mut self.state, &snap.state) {
            // The state may be half restored: forget it all.
            self.reset()?;
            return Err(e);
        }
        self.tokens.truncate(pos);
        self.last_logits.clone_from(&snap.last_logits);
        Ok(pos)
    }

    /// Tokens of `ids` a generation of it would reuse from what the session holds (its
    /// consumed tokens when they are a prefix of `ids`, else its longest snapshot that is).
    pub fn reusable(&self, ids: &[u32]) -> usize {
        let common = self
            .tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.tokens.len() {
            return common;
        }
        self.snapshots
            .iter()
            .map(|s| s.state.pos())
            .filter(|&p| p <= common)
            .max()
            .unwrap_or(0)
    }

    /// Loads the longest prefix of `prompt` longer than `reused` tokens that the model's
    /// prompt cache holds, in place of the session's state. Returns the tokens the session
    /// now holds of `prompt` (`reused` when nothing better was loaded).
    fn load_cached_prefix(&mut self, prompt: &[u32], reused: usize) -> usize {
        let Some(pc) = self.model.rt.prompt_cache() else {
            return reused;
        };
        let Some(e) = pc.lookup(prompt, reused, &self.model.state_shape()) else {
            return reused;
        };
        match self.model.state_from_host(&e.state) {
            Ok(state) => {
                self.state = state;
                self.tokens = e.tokens;
                self.last_logits = e.logits;
                // Their MLA rows were the session's own; the loaded ones were computed apart.
                self.snapshots.clear();
                self.tokens.len()
            }
            Err(err) => {
                tracing::warn!(
                    "[K3] prompt cache: {}: {err:#}; prefilling instead",
                    pc.dir().display()
                );
                reused
            }
        }
    }

    /// Stores the state at the end of the prompt just fed in the model's prompt cache, when
    /// it has one that wants it; a failure is a warning.
    fn store_prompt(&self) {
        let Some(pc) = self.model.rt.prompt_cache() else {
            return;
        };
        if !pc.wants(&self.tokens) {
            return;
        }
        match self.model.state_to_host(&self.state) {
            Ok(state) => pc.store(crate::model::prompt_cache::entry_file::Entry {
                tokens: self.tokens.clone(),
                logits: self.last_logits.clone(),
                state,
            }),
            Err(err) => {
                tracing::warn!("[K3] prompt cache: reading the state back: {err:#}; not stored")
            }
        }
    }

    /// Brings the session to `prompt` (reusing the prefix it holds), then samples tokens with
    /// `pick` under one stop rule: a stop id, `max_tokens`, `on_token` returning
    /// [`Flow::Stop`], or the cancel flag (checked between prefill layers and between tokens).
    /// Every generated token but the last is fed back; the last is fed by the next call
    /// that continues from it, so a generation that ends costs no extra forward pass.
    /// This is the blocking form of the step API ([`Self::begin`], [`Self::segment`],
    /// [`Self::apply`], [`Self::pick`]): one sequence, the prompt in whole windows.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &DecodeOptions<'_>,
        pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
        on_token: &mut dyn FnMut(&TokenEvent) -> Result<Flow>,
    ) -> Result<Generation> {
        let mut s = self.begin(prompt, opts)?;
        let slice = window(self.model, self.max_window);
        let progress = self.model.rt.progress();
        // Ends the progress on every way out of the prefill.
        struct End<'a>(&'a crate::model::prefill_progress::PrefillProgress);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                self.0.end();
            }
        }
        let left = s.prompt.len() - s.fed;
        let mut end = (s.phase == Phase::Prefill && left > 1).then(|| {
            progress.begin(left, self.model.layer_count());
            End(progress)
        });
        loop {
            if s.phase != Phase::Prefill {
                end = None;
            }
            if matches!(s.phase, Phase::Done(_)) {
                break;
            }
            if cancelled(opts.cancel) {
                s.end(Finish::Cancelled);
                continue;
            }
            if s.phase == Phase::Pick {
                self.pick(&mut s, pick, on_token)?;
                continue;
            }
            // The cancel flag stops a prefill window between layers; a decode pass is short.
            let cancel = if s.phase == Phase::Prefill {
                opts.cancel
            } else {
                None
            };
            let t = Instant::now();
            let mut stats = Stats::default();
            let ids = s.step_ids(slice);
            let n = ids.len();
            let r = self.model.forward_until(
                &mut self.state,
                ids,
                s.want(),
                &mut stats,
                opts.trace,
                cancel,
            );
            match r {
                Ok(Some(logits)) => {
                    self.apply(&mut s, n, logits, t.elapsed().as_secs_f64(), stats)?
                }
                Ok(None) => {
                    self.stats = self.stats.plus(&stats);
                    self.rewind_part_advanced()?;
                    s.end(Finish::Cancelled);
                }
                Err(e) => {
                    // A failed forward leaves the state half-advanced: forget it all.
                    self.stats = self.stats.plus(&stats);
                    self.reset()?;
                    return Err(e);
                }
            }
        }
        drop(end);
        Ok(s.into_generation())
    }

    /// Starts a generation of `prompt` under `opts`' stop rule: reuses the prefix the
    /// session holds (or a snapshot of it, or a prompt-cache entry), and plans the prefill
    /// of the rest. The session is then advanced with [`Self::segment`]/[`Self::apply`]
    /// (prefill slices and fed tokens) and [`Self::pick`] (each token), until
    /// [`Stepper::phase`] is [`Phase::Done`]. `opts.cancel` and `opts.trace` are the
    /// caller's to apply at each step.
    pub fn begin(&mut self, prompt: &[u32], opts: &DecodeOptions<'_>) -> Result<Stepper> {
        if prompt.is_empty() {
            bail!("the prompt is empty: give at least one token id");
        }
        let mut g = Generation::default();
        let t0 = Instant::now();
        let mut reused = self.reuse(prompt)?;
        if reused == prompt.len() && (opts.all_logits || self.last_logits.is_empty()) {
            // Nothing new to feed, but the caller wants prompt logits this call computes.
            self.reset()?;
            reused = 0;
        }
        if !opts.all_logits && opts.trace.is_none() {
            let loaded = self.load_cached_prefix(prompt, reused);
            if loaded > reused {
                g.disk_cached_tokens = loaded;
                reused = loaded;
            }
        }
        g.cached_tokens = reused;
        g.prefilled_tokens = prompt.len() - reused;
        // The prompt is fed in segments that end at each point worth a state: the
        // divergence mark (a snapshot) and the message boundaries (a snapshot and a
        // prompt-cache entry); the prompt's end comes after.
        let boundaries = kept_boundaries(opts.boundaries).to_vec();
        let mut points: Vec<usize> = opts
            .snapshot_at
            .into_iter()
            .chain(boundaries.iter().copied())
            .filter(|&m| m > reused && m < prompt.len())
            .collect();
        points.sort_unstable();
        points.dedup();
        let mut s = Stepper {
            prompt: prompt.to_vec(),
            history: prompt.to_vec(),
            fed: reused,
            points,
            boundaries,
            max_tokens: opts.max_tokens,
            stop_ids: opts.stop_ids.to_vec(),
            all_logits: opts.all_logits,
            phase: Phase::Prefill,
            g,
            t0,
            t1: None,
            secs: 0.0,
            step_stats: Stats::default(),
        };
        if s.fed == prompt.len() {
            self.end_prefill(&mut s)?;
        }
        Ok(s)
    }

    /// The forward-pass segment of this step for `s`: the next slice of at most `slice`
    /// prompt tokens (ending at the next snapshot point) while it prefills, the picked token
    /// while it decodes; `None` when it needs no pass (a token to pick, or done).
    pub fn segment<'a>(&'a mut self, s: &'a Stepper, slice: usize) -> Option<Segment<'a, B>> {
        if !matches!(s.phase, Phase::Prefill | Phase::Feed(_)) {
            return None;
        }
        Some(Segment {
            state: &mut self.state,
            ids: s.step_ids(slice),
            want: s.want(),
        })
    }

    /// Takes the result of `s`'s segment: `n` tokens fed, their `logits`, the pass's
    /// seconds and counters. At a snapshot point the state is kept; at a message boundary
    /// it also goes to the prompt cache; at the prompt's end both, and `s` goes on to pick.
    pub fn apply(
        &mut self,
        s: &mut Stepper,
        n: usize,
        logits: Vec<f32>,
        secs: f64,
        stats: Stats,
    ) -> Result<()> {
        let v = self.model.vocab_size();
        let ids = s.step_ids(n);
        if ids.len() != n {
            bail!(
                "internal: a step fed {n} tokens where {} were due",
                ids.len()
            );
        }
        self.tokens.extend_from_slice(ids);
        self.last_logits = logits[logits.len().saturating_sub(v)..].to_vec();
        self.stats = self.stats.plus(&stats);
        match s.phase {
            Phase::Prefill => {
                if s.all_logits {
                    s.g.prompt_logits.extend(logits);
                }
                s.g.prefill_stats = s.g.prefill_stats.plus(&stats);
                s.fed += n;
                if s.fed == s.prompt.len() {
                    self.end_prefill(s)?;
                } else if s.points.contains(&s.fed) {
                    self.take_snapshot()?;
                    if s.boundaries.contains(&s.fed) {
                        self.store_prompt();
                    }
                }
            }
            Phase::Feed(_) => {
                s.g.decode_stats = s.g.decode_stats.plus(&stats);
                s.secs = secs;
                s.step_stats = stats;
                s.phase = Phase::Pick;
            }
            Phase::Pick | Phase::Done(_) => {
                bail!("internal: a step applied to a sequence with nothing to feed")
            }
        }
        Ok(())
    }

    /// The prompt is in: keeps the state at its end (a snapshot, and a prompt-cache entry
    /// when this call fed any of it), and `s` goes on to pick its first token.
    fn end_prefill(&mut self, s: &mut Stepper) -> Result<()> {
        self.take_snapshot()?;
        if s.g.prefilled_tokens > 0 {
            self.store_prompt();
        }
        s.t1 = Some(Instant::now());
        s.g.prefill_secs = s.t0.elapsed().as_secs_f64();
        if s.max_tokens == 0 {
            s.end(Finish::Length);
        } else {
            s.phase = Phase::Pick;
        }
        Ok(())
    }

    /// Picks `s`'s next token with `pick` from the logits the session holds and reports it
    /// to `on_token`; the stop rule then ends `s` or leaves the token to be fed.
    pub fn pick(
        &mut self,
        s: &mut Stepper,
        pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
        on_token: &mut dyn FnMut(&TokenEvent) -> Result<Flow>,
    ) -> Result<()> {
        if s.phase != Phase::Pick {
            bail!("internal: a token picked for a sequence without logits");
        }
        let index = s.g.tokens.len();
        let id = pick(&self.last_logits, &s.history);
        s.history.push(id);
        s.g.tokens.push(id);
        let flow = on_token(&TokenEvent {
            id,
            index,
            secs: s.secs,
            stats: s.step_stats.clone(),
        })?;
        if flow == Flow::Stop || s.stop_ids.contains(&id) {
            s.end(Finish::Stop);
        } else if index + 1 == s.max_tokens {
            s.end(Finish::Length);
        } else {
            s.phase = Phase::Feed(id);
        }
        Ok(())
    }

    /// After a batched pass stopped between layers: the session goes back to what it
    /// consumed whole ([`Self::rewind_part_advanced`]) and `s` ends cancelled.
    pub fn stopped_in_pass(&mut self, s: &mut Stepper) -> Result<()> {
        s.end(Finish::Cancelled);
        self.rewind_part_advanced()
    }
}

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

/// A generation in progress on a [`Session`] ([`Session::begin`]), advanced a step at a
/// time, so one engine can run several sequences' steps in one batched forward pass.
#[derive(Debug)]
pub struct Stepper {
    prompt: Vec<u32>,
    /// The prompt and the tokens generated so far (what penalties look back on).
    history: Vec<u32>,
    /// Prompt tokens the session holds.
    fed: usize,
    /// Prompt positions worth a snapshot, ascending, past what was reused.
    points: Vec<usize>,
    /// Of them, the message boundaries (also stored in the prompt cache).
    boundaries: Vec<usize>,
    max_tokens: usize,
    stop_ids: Vec<u32>,
    all_logits: bool,
    phase: Phase,
    g: Generation,
    t0: Instant,
    /// When the prefill ended.
    t1: Option<Instant>,
    /// Seconds and counters of the pass that produced the logits held now.
    secs: f64,
    step_stats: Stats,
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
    fn step_ids(&self, slice: usize) -> &[u32] {
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
    fn want(&self) -> Logits {
        if self.phase == Phase::Prefill && self.all_logits {
            Logits::All
        } else {
            Logits::Last
        }
    }
}
