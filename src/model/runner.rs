//! A loaded model paired with its runtime: what a session, the server and a command run.

use super::k3::{K3Model, Logits, Segment, State};
use super::runtime::{Runtime, RuntimeSettings};
use super::trace::Trace;
use crate::backend::Backend;
use crate::stats::Stats;
use anyhow::Result;
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

    /// [`K3Model::forward_batch`] with this runtime.
    pub fn forward_batch(
        &self,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        self.model
            .forward_batch(&self.rt, segs, stats, trace, cancel)
    }
}
