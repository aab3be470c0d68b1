//! Several sequences in one model step: each [`Segment`] is one sequence's state and the
//! tokens it feeds this step (one while it decodes, a slice of its prompt while it
//! prefills). This version runs the segments one after another, each through
//! [`K3Model::forward_until`], so every segment's logits are exactly those of a pass
//! alone.

use super::{K3Model, Logits, State};
use crate::backend::Backend;
use crate::model::trace::Trace;
use crate::stats::Stats;
use anyhow::Result;
use std::sync::atomic::AtomicBool;

/// One sequence's part of a batched step.
pub struct Segment<'s, B: Backend> {
    /// The sequence's state, advanced by `ids`.
    pub state: &'s mut State<B>,
    /// The tokens it feeds this step.
    pub ids: &'s [u32],
    /// Which rows' logits it wants back.
    pub want: Logits,
}

impl<B: Backend> K3Model<B> {
    /// Runs every segment's rows, segments one after another; each segment's logits as
    /// `forward` would give it alone; `None` when `cancel` was raised (the segments before
    /// the one it stopped in are advanced, that one is part-advanced).
    pub fn forward_batch(
        &self,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let mut out = Vec::with_capacity(segs.len());
        for s in segs.iter_mut() {
            match self.forward_until(s.state, s.ids, s.want, stats, trace, cancel)? {
                Some(l) => out.push(l),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }
}
