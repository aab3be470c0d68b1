//! The step API: a generation begun on a session and advanced a step at a time (a prompt
//! slice or a fed token, then a picked token), so one engine can batch several sequences;
//! and `generate`, its blocking loop for one sequence.

use super::prefill::cancelled;
use super::{
    kept_boundaries, window, DecodeOptions, Finish, Flow, Generation, Phase, Session, Stepper,
    TokenEvent,
};
use crate::backend::Backend;
use crate::model::Segment;
use crate::stats::Stats;
use anyhow::{bail, Result};
use std::time::Instant;

impl<'m, B: Backend> Session<'m, B> {
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
    /// consumed whole and `s` ends cancelled.
    pub fn stopped_in_pass(&mut self, s: &mut Stepper) -> Result<()> {
        s.end(Finish::Cancelled);
        self.rewind_part_advanced()
    }
}
