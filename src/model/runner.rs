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
    /// runs as two passes of half the sequences at once where the backend asks for it
    /// ([`Backend::split_pass`]) and nothing the pass shares cares: no trace, no other
    /// ranks, no route trace, and every routed expert in the host cache, so neither half
    /// reads one (and neither guesses the next layer's). Each sequence's logits are the
    /// same bits either way.
    pub fn forward_batch(
        &self,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        if trace.is_none() && self.splits(segs)? {
            let (lo, hi) = segs.split_at_mut(segs.len().div_ceil(2));
            let mut other = Stats::default();
            let mut own = Stats::default();
            // Each half keeps its ops on its thread: the two halves fill the cores.
            let (a, b) = partner::join(
                || {
                    pool::on_this_thread(|| {
                        self.model
                            .forward_pass(&self.rt, lo, &mut own, None, cancel, false)
                    })
                },
                || {
                    pool::on_this_thread(|| {
                        self.model
                            .forward_pass(&self.rt, hi, &mut other, None, cancel, false)
                    })
                },
            );
            *stats = stats.plus(&own.alongside(&other));
            let at = lo.len();
            let b = b.with_context(|| {
                format!(
                    "in the half of a split step from segment {at} (the numbers above count \
                     from there)"
                )
            });
            return Ok(match (a?, b?) {
                (Some(mut a), Some(b)) => {
                    a.extend(b);
                    Some(a)
                }
                _ => None,
            });
        }
        self.model
            .forward_batch(&self.rt, segs, stats, trace, cancel)
    }

    /// Whether a pass of `segs` runs as two halves (see [`Self::forward_batch`]).
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
