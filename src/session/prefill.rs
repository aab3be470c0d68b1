//! The prefill loop: a prompt fed in windows, layer-major within each, with cancellation and
//! progress; the free [`prefill`] and a session's feed both run it.

use super::{DecodeOptions, Session};
use crate::backend::Backend;
use crate::model::trace::Trace;
use crate::model::{Logits, Runner, State};
use crate::stats::Stats;
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// Largest bound on the prefill window accepted (`--chunk` / `K3_CHUNK`), which memory and
/// the backend's limits bound further ([`crate::model::Runtime::prefill_window`]).
pub const MAX_WINDOW: usize = 1 << 22;

/// Whether the cancel flag is raised.
pub(super) fn cancelled(flag: Option<&AtomicBool>) -> bool {
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

impl<B: Backend> Session<'_, B> {
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
}
