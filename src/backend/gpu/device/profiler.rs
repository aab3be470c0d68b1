//! GPU time per kernel (`--gpu-profile` / `K3_GPU_PROFILE=1`). Every compute pass writes a
//! timestamp at its start and its end; each submission resolves the pending ones, waits for
//! them and adds every pass's time to its entry point's total. The wait makes a profiled run
//! slower than a plain one (the host no longer records ahead of the GPU), but the times are
//! the GPU's own. The table goes to stderr when the backend is dropped. A pass's start
//! timestamp may be written before the barrier that waits for the previous pass, so a small
//! kernel after a large one can carry that one's tail: its figure is an upper bound.

use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::sync::mpsc;

/// Passes timed between two submissions (two queries each).
const PASSES: u32 = 2048;

/// What the totals are kept by: the entry point and its grid, which tells a shape apart
/// (the head's matvec from a projection's).
type PassKey = (&'static str, (u32, u32, u32));

/// Timestamp queries of the passes recorded since the last submission, and the totals.
pub(crate) struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Entry point and grid of each pending pass, in query order.
    pending: Vec<PassKey>,
    /// Per entry point and grid: passes and GPU seconds.
    totals: HashMap<PassKey, (u64, f64)>,
    /// Seconds per timestamp tick.
    tick: f64,
}

impl Profiler {
    /// A profiler for `device` (which must have `TIMESTAMP_QUERY`).
    pub(crate) fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let bytes = u64::from(2 * PASSES) * 8;
        let buffer = |usage, label| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Self {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("k3 profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * PASSES,
            }),
            resolve: buffer(
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                "profile resolve",
            ),
            readback: buffer(
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                "profile readback",
            ),
            pending: Vec::new(),
            totals: HashMap::new(),
            tick: f64::from(queue.get_timestamp_period()) * 1e-9,
        }
    }

    /// The timestamp writes of the next pass (`entry` over `groups`), or `None` when every
    /// query is taken and the pending ones must be submitted first.
    pub(crate) fn next_pass(
        &mut self,
        entry: &'static str,
        groups: (u32, u32, u32),
    ) -> Option<(wgpu::QuerySet, u32)> {
        let k = self.pending.len() as u32;
        if k >= PASSES {
            return None;
        }
        self.pending.push((entry, groups));
        Some((self.queries.clone(), 2 * k))
    }

    /// Records the resolve of the pending queries into `enc`; the count to collect after
    /// the submission.
    pub(crate) fn resolve(&self, enc: &mut wgpu::CommandEncoder) -> u32 {
        let n = self.pending.len() as u32;
        if n > 0 {
            enc.resolve_query_set(&self.queries, 0..2 * n, &self.resolve, 0);
            enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, u64::from(n) * 16);
        }
        n
    }

    /// After the submission that resolved `n` passes: waits for their times and adds them up.
    pub(crate) fn collect(&mut self, device: &wgpu::Device, n: u32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let len = u64::from(n) * 16;
        let (tx, rx) = mpsc::channel();
        self.readback
            .map_async(wgpu::MapMode::Read, ..len, move |r| {
                // The receiver waits below; a send can only fail if it is gone.
                let _ = tx.send(r);
            });
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("GPU profile: waiting for the timestamps: {e}"))?;
        rx.recv()
            .map_err(|_| anyhow!("GPU profile: the timestamp readback was dropped"))?
            .map_err(|e| anyhow!("GPU profile: mapping the timestamps: {e}"))?;
        {
            let bytes = self
                .readback
                .get_mapped_range(..len)
                .map_err(|e| anyhow!("GPU profile: reading the timestamps: {e:?}"))?;
            let ticks: &[u64] = bytemuck::cast_slice(&bytes);
            for (i, entry) in self.pending.drain(..).enumerate() {
                let t = ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * self.tick;
                let e = self.totals.entry(entry).or_insert((0, 0.0));
                e.0 += 1;
                e.1 += t;
            }
        }
        self.readback.unmap();
        Ok(())
    }

    /// Passes and GPU seconds so far per entry point (all grids together).
    pub(crate) fn by_entry(&self) -> HashMap<&'static str, (u64, f64)> {
        let mut by_entry: HashMap<&'static str, (u64, f64)> = HashMap::new();
        for (&(entry, _), &(calls, secs)) in &self.totals {
            let e = by_entry.entry(entry).or_insert((0, 0.0));
            e.0 += calls;
            e.1 += secs;
        }
        by_entry
    }

    /// The totals as two tables (see [`Self::report`]), then starts them again from zero:
    /// a benchmark's table per case.
    pub(crate) fn take_report(&mut self) -> String {
        let s = self.report();
        self.totals.clear();
        s
    }

    /// The totals as two tables, longest first: per kernel, then per kernel and grid (the
    /// first `SHAPES` rows).
    pub(crate) fn report(&self) -> String {
        let by_entry = self.by_entry();
        let all: f64 = by_entry.values().map(|v| v.1).sum();
        let passes: u64 = by_entry.values().map(|v| v.0).sum();
        let mut s = format!(
            "[K3-GPU] profile: {:.1} ms of GPU time in {passes} passes\n",
            all * 1e3
        );
        let rows = by_entry.into_iter().map(|(e, v)| (e.to_string(), v));
        table(&mut s, "kernel", rows, all, usize::MAX);
        let rows = self
            .totals
            .iter()
            .map(|(&(e, g), &v)| (format!("{e} {}x{}x{}", g.0, g.1, g.2), v));
        table(&mut s, "kernel and grid", rows, all, SHAPES);
        s
    }
}

/// Rows of the per-grid table.
const SHAPES: usize = 25;

/// Appends `rows` (name, passes, seconds), longest first, at most `limit` of them.
fn table(
    s: &mut String,
    head: &str,
    rows: impl Iterator<Item = (String, (u64, f64))>,
    all: f64,
    limit: usize,
) {
    let mut rows: Vec<_> = rows.collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    s.push_str(&format!(
        "  {head:<28} {:>8} {:>11} {:>10} {:>6}\n",
        "passes", "total ms", "mean us", "share"
    ));
    for (name, (calls, secs)) in rows.into_iter().take(limit) {
        s.push_str(&format!(
            "  {name:<28} {calls:>8} {:>11.2} {:>10.1} {:>5.1}%\n",
            secs * 1e3,
            secs / calls as f64 * 1e6,
            100.0 * secs / all.max(f64::MIN_POSITIVE)
        ));
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if !self.totals.is_empty() {
            tracing::info!("{}", self.report().trim_end());
        }
    }
}
