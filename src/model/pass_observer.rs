//! Everything a forward pass reports besides its result, at the points the pass names: the
//! route tap's chunk start, the stats timers, the disk bytes and busy time of the pass, the
//! prefill progress, the per-layer trace and the non-finite checks. The pass itself
//! ([`super::K3Model::forward`]) keeps only the math.

use super::batch::RowLayout;
use super::prefill_progress::PrefillProgress;
use super::trace::Trace;
use crate::backend::Backend;
use crate::experts::ExpertSource;
use crate::stats::Stats;
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// The observer of one forward pass over the rows of `layout` (one window of one sequence,
/// or several sequences' rows).
pub(super) struct PassObserver<'a> {
    experts: &'a ExpertSource,
    progress: &'a PrefillProgress,
    stats: &'a mut Stats,
    trace: Option<&'a Trace>,
    layout: &'a RowLayout,
    /// The disk's busy time and bytes when the pass began: reads guessed for a next layer
    /// run between the layers' own streams, so the disk is metered over the whole pass.
    disk0: (Duration, u64),
    /// The stats' disk figures when the pass began (the pass adds its own to them).
    stats_disk0: (Duration, u64),
    /// Disk bytes when the running layer began, for the progress line.
    layer_bytes0: u64,
    /// When the running stage began.
    stage: Instant,
}

impl<'a> PassObserver<'a> {
    /// A pass begins: the route tap opens a chunk at the first segment's position, the
    /// progress a window of all the pass's rows.
    pub(super) fn begin(
        experts: &'a ExpertSource,
        progress: &'a PrefillProgress,
        stats: &'a mut Stats,
        trace: Option<&'a Trace>,
        layout: &'a RowLayout,
    ) -> Result<Self> {
        if let Some(tap) = experts.route_tap() {
            tap.begin_chunk(layout.first_pos())?;
        }
        progress.window_started(layout.rows());
        let disk0 = experts.disk_totals();
        let stats_disk0 = (stats.disk_busy, stats.bytes_streamed);
        Ok(Self {
            experts,
            progress,
            stats,
            trace,
            layout,
            disk0,
            stats_disk0,
            layer_bytes0: disk0.1,
            stage: Instant::now(),
        })
    }

    /// The stats the MoE block adds its routing and expert figures to.
    pub(super) fn stats(&mut self) -> &mut Stats {
        self.stats
    }

    /// Time since the last stage ended, and a new stage begins.
    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let t = now - self.stage;
        self.stage = now;
        t
    }

    /// A layer's attention (with its residual mix) is done.
    pub(super) fn attention_done(&mut self) {
        let t = self.lap();
        self.stats.attn += t;
    }

    /// A layer's feed-forward block (dense MLP or MoE, with its residual) is done.
    pub(super) fn ffn_done(&mut self) {
        let t = self.lap();
        self.stats.moe += t;
    }

    /// Whether [`Self::layer_output`] wants the layer's output on the host: with a trace,
    /// or where downloads cost nothing (the CPU), so every layer is checked for NaN/Inf.
    fn wants_layer_output<B: Backend>(&self, b: &B) -> bool {
        self.trace.is_some() || b.downloads_are_free()
    }

    /// Layer `i` produced `h` (the window's rows, `[rows, hidden]`): it is checked and
    /// traced where [`Self::wants_layer_output`], and the progress counts the layer.
    pub(super) fn layer_output<B: Backend>(
        &mut self,
        b: &B,
        i: usize,
        h: &B::Act,
        h_dim: usize,
    ) -> Result<()> {
        if self.wants_layer_output(b) {
            let host = b.download(h)?;
            if let Some(at) = first_non_finite(&host) {
                bail!(
                    "layer {i} produced a non-finite value (NaN or Inf) in its output at \
                     {}: the weights or the input are broken; nothing after it is computed",
                    self.layout.at_row(at / h_dim.max(1))
                );
            }
            if let Some(t) = self.trace {
                t.record(i, &host)?;
            }
        }
        let (_, bytes) = self.experts.disk_totals();
        self.progress
            .layer_done(bytes.saturating_sub(self.layer_bytes0));
        self.layer_bytes0 = bytes;
        self.stage = Instant::now();
        Ok(())
    }

    /// Every layer is done: the pass's disk time and bytes go into the stats.
    pub(super) fn layers_done(&mut self) {
        let (busy1, bytes1) = self.experts.disk_totals();
        self.stats.disk_busy = self.stats_disk0.0 + busy1.saturating_sub(self.disk0.0);
        self.stats.bytes_streamed = self.stats_disk0.1 + bytes1.saturating_sub(self.disk0.1);
        self.stage = Instant::now();
    }

    /// The head produced each segment's `logits` (over `vocab` columns): they are checked
    /// for NaN/Inf and the progress closes the window.
    pub(super) fn head_done(&mut self, logits: &[Vec<f32>], vocab: usize) -> Result<()> {
        let t = self.lap();
        self.stats.head += t;
        for (s, l) in logits.iter().enumerate() {
            if let Some(at) = first_non_finite(l) {
                bail!(
                    "the logits hold a non-finite value (NaN or Inf) at {}; this backend does \
                     not check each layer, so run the same input with --backend cpu (or \
                     --trace DIR) to find the layer that produced it",
                    self.layout.at_logit_row(s, at / vocab.max(1))
                );
            }
        }
        self.progress.window_done();
        Ok(())
    }
}

/// The index of the first value that is NaN or infinite. Blocks of 64 are tested without
/// an early exit, which the compiler vectorizes: a batch's logits are millions of values a
/// step.
fn first_non_finite(v: &[f32]) -> Option<usize> {
    const BLOCK: usize = 64;
    let bad = v
        .chunks(BLOCK)
        .position(|b| !b.iter().fold(true, |all, x| all & x.is_finite()))?;
    let at = bad * BLOCK;
    v[at..].iter().position(|x| !x.is_finite()).map(|i| at + i)
}

#[cfg(test)]
mod tests {
    use super::first_non_finite;

    #[test]
    fn the_first_non_finite_value_is_found_in_any_block() {
        assert_eq!(first_non_finite(&[]), None);
        let mut v = vec![1.0f32; 300];
        assert_eq!(first_non_finite(&v), None);
        for (at, bad) in [
            (0, f32::NAN),
            (63, f32::INFINITY),
            (64, f32::NAN),
            (299, f32::NEG_INFINITY),
        ] {
            let mut w = v.clone();
            w[at] = bad;
            // A later bad value in the same block does not hide the first.
            if at + 1 < w.len() {
                w[at + 1] = f32::NAN;
            }
            assert_eq!(first_non_finite(&w), Some(at), "{bad} at {at}");
        }
        v[130] = f32::NAN;
        v[5] = f32::INFINITY;
        assert_eq!(first_non_finite(&v), Some(5));
    }
}
