//! Disk busy time: the union of the intervals in which at least one read was in flight.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
struct Inner {
    in_flight: usize,
    since: Option<Instant>,
    busy: Duration,
    bytes: u64,
}

/// Measures how long the disk was busy and how many bytes it delivered.
#[derive(Default)]
pub(crate) struct DiskMeter {
    inner: Mutex<Inner>,
}

impl DiskMeter {
    /// A read starts.
    pub(crate) fn begin(&self) {
        if let Ok(mut g) = self.inner.lock() {
            if g.in_flight == 0 {
                g.since = Some(Instant::now());
            }
            g.in_flight += 1;
        }
    }

    /// A read of `bytes` ends.
    pub(crate) fn end(&self, bytes: u64) {
        if let Ok(mut g) = self.inner.lock() {
            g.in_flight = g.in_flight.saturating_sub(1);
            g.bytes += bytes;
            if g.in_flight == 0 {
                if let Some(s) = g.since.take() {
                    g.busy += s.elapsed();
                }
            }
        }
    }

    /// `(busy time, bytes)` so far.
    pub(crate) fn totals(&self) -> (Duration, u64) {
        self.inner
            .lock()
            .map(|g| (g.busy, g.bytes))
            .unwrap_or_default()
    }
}
