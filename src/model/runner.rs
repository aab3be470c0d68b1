//! A loaded model paired with its runtime: what a session, the server and a command run.

use super::k3::{K3Model, Logits, Segment, State};
use super::runtime::{Runtime, RuntimeSettings};
use super::trace::Trace;
use crate::backend::Backend;
use crate::quant::{partner, pool};
use crate::stats::Stats;
use anyhow::{Context, Result};
use std::sync::atomic::AtomicBool;

/// A loaded model and its runtime: what a session, the server and a command run. It reads
/// as the model ([`std::ops::Deref`]) for the weights' side: the checkpoint, the backend,
/// fresh states.
pub struct Runner<B: Backend> {
    /// The weights and the layer schedule.
    pub model: K3Model<B>,
    /// The services each pass is lent.
    pub rt: Runtime,
}

impl<B: Backend> std::ops::Deref for Runner<B> {
    type Target = K3Model<B>;
    fn deref(&self) -> &K3Model<B> {
        &self.model
    }
}

impl<B: Backend> Runner<B> {
    /// `model` with the runtime of `settings` ([`Runtime::new`]).
    pub fn new(model: K3Model<B>, settings: RuntimeSettings) -> Result<Self> {
        let rt = Runtime::new(&model.ckpt.config, &model.backend, settings)?;
        Ok(Runner { model, rt })
    }

    /// [`K3Model::forward`] with this runtime.
    pub fn forward(
        &self,
        st: &mut State<B>,
        ids: &[u32],
        want: Logits,
        stats: &mut Stats,
        trace: Option<&Trace>,
    ) -> Result<Vec<f32>> {
        self.model.forward(&self.rt, st, ids, want, stats, trace)
    }

    /// [`K3Model::forward_until`] with this runtime.
    pub fn forward_until(
        &self,
        st: &mut State<B>,
        ids: &[u32],
        want: Logits,
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<f32>>> {
        self.model
            .forward_until(&self.rt, st, ids, want, stats, trace, cancel)
    }

    /// [`K3Model::forward_batch`] with this runtime. A decode step of several sequences
    /// runs as passes of part of the sequences at once (two halves, or more parts on wide
    /// machines: `split_parts`) where the backend asks for it ([`Backend::split_pass`])
    /// and nothing the pass shares cares: no trace, no other ranks, no route trace, and
    /// every routed expert in the host cache, so no part reads one (and none guesses the
    /// next layer's). Each sequence's logits are the same bits either way.
    pub fn forward_batch(
        &self,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        if trace.is_none() && self.splits(segs)? {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            let parts = split_parts(segs.len(), rayon::current_num_threads(), cores);
            return self.forward_parts(segs, parts, stats, cancel);
        }
        self.model
            .forward_batch(&self.rt, segs, stats, trace, cancel)
    }

    /// A split step as `parts` passes at once, one on this thread and the others on the
    /// partner crew ([`partner::scatter`]; two parts are the first partner's halves), each
    /// part's ops kept on its thread: one stream of a small model leaves all cores but one
    /// idle (its ops are too small for the pool), so sequences run side by side instead. The
    /// crew's threads spin for the next job, so a hand-off costs a cache-line exchange where
    /// the pool's wake-ups cost tens of microseconds a step.
    fn forward_parts(
        &self,
        segs: &mut [Segment<'_, B>],
        parts: usize,
        stats: &mut Stats,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let outs: Vec<(usize, Stats, PassOut)> = partner::scatter(segs, parts, &|at, part| {
            let mut own = Stats::default();
            let out = pool::on_this_thread(|| self.one_part(part, &mut own, cancel));
            (at, own, out)
        });
        let mut together = Stats::default();
        let mut logits = Some(Vec::with_capacity(segs.len()));
        for (at, own, out) in outs {
            together = together.alongside(&own);
            let out = if at == 0 {
                out?
            } else {
                out.with_context(|| part_context(at))?
            };
            match (out, logits.as_mut()) {
                (Some(l), Some(all)) => all.extend(l),
                _ => logits = None,
            }
        }
        *stats = stats.plus(&together);
        Ok(logits)
    }

    /// One part of a split step: a pass over `part` alone, without read-ahead.
    fn one_part(
        &self,
        part: &mut [Segment<'_, B>],
        stats: &mut Stats,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        self.model
            .forward_pass(&self.rt, part, stats, None, cancel, false)
    }

    /// Whether a pass of `segs` runs as parts (see [`Self::forward_batch`]).
    fn splits(&self, segs: &[Segment<'_, B>]) -> Result<bool> {
        let cfg = &self.model.ckpt.config;
        // A step a pass would refuse before its first layer runs as one pass, so the error
        // names the segment as it stands in the step and no sequence advances.
        if segs.len() < 2
            || segs.iter().any(|s| {
                s.ids.len() != 1
                    || s.ids.iter().any(|&id| id as usize >= cfg.vocab_size)
                    || s.state.layers.len() != self.model.layer_count()
            })
            || self.rt.remote.is_some()
            || !self
                .model
                .backend
                .split_pass(segs.len(), cfg.vocab_size * cfg.hidden_size)
        {
            return Ok(false);
        }
        if let Some(tap) = self.rt.experts.route_tap() {
            if tap.records_trace()? {
                return Ok(false);
            }
        }
        self.model.every_expert_cached(&self.rt)
    }
}

/// Parts a split step of `rows` sequences runs as on `threads` compute threads and `cores`
/// cores: two (the partner's halves) up to three threads, else a sequence or more a thread,
/// as many parts as threads at most. Never more threads than cores: the crew's threads spin
/// for their next job, and two spinning on one core starve each other.
fn split_parts(rows: usize, threads: usize, cores: usize) -> usize {
    let threads = threads.min(cores);
    if threads < 4 {
        2
    } else {
        rows.min(threads)
    }
}

/// What a pass over some segments gives: each segment's logits, or none when cancelled.
type PassOut = Result<Option<Vec<Vec<f32>>>>;

/// The context of an error in the part of a split step from segment `at`.
fn part_context(at: usize) -> String {
    format!("in the part of a split step from segment {at} (the numbers above count from there)")
}

#[cfg(test)]
mod tests {
    use super::split_parts;

    #[test]
    fn wide_machines_split_a_step_into_parts_narrow_ones_in_halves() {
        assert_eq!(split_parts(4, 2, 2), 2);
        assert_eq!(split_parts(8, 3, 16), 2);
        assert_eq!(split_parts(4, 16, 16), 4);
        assert_eq!(split_parts(8, 16, 16), 8);
        assert_eq!(split_parts(20, 16, 16), 16);
        // More threads than cores count as the cores.
        assert_eq!(split_parts(8, 8, 2), 2);
        assert_eq!(split_parts(8, 16, 6), 6);
    }
}
