//! The bounded queue between the load, which quantizes matrices, and the weight cache's
//! writer thread: the load waits only when the queued copies pass a byte limit, and once
//! the writer is gone (finished, failed or panicked) nothing more is queued.

use super::Parts;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Bytes of matrix copies queued for the writer thread beyond the one it writes: the load
/// waits for the writer only when the disk falls this far behind.
pub(super) const MAX_BACKLOG: u64 = 512 << 20;

/// Matrix copies on their way to the writer thread, bounded by their bytes.
pub(super) struct Queue {
    state: Mutex<Backlog>,
    changed: Condvar,
    /// Bytes queued beyond which a sender waits.
    limit: u64,
}

#[derive(Default)]
struct Backlog {
    items: VecDeque<Parts>,
    bytes: u64,
    /// The load sent its last matrix.
    closed: bool,
    /// The writer thread ended (a panic included): nothing more is taken.
    writer_gone: bool,
    /// Tests hold the writer here to end a process while it writes.
    #[cfg(test)]
    paused: bool,
}

impl Queue {
    pub(super) fn new(limit: u64) -> Self {
        Self {
            state: Mutex::default(),
            changed: Condvar::new(),
            limit,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Backlog> {
        // The backlog stays consistent under every panic that can poison it (each change
        // is one push or pop with its byte count).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Backlog>) -> MutexGuard<'a, Backlog> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `p`, first waiting while the backlog is full; dropped once the writer ended.
    pub(super) fn send(&self, p: Parts) {
        let len = p.bytes();
        let mut g = self.lock();
        while !g.items.is_empty() && g.bytes + len > self.limit && !g.writer_gone {
            g = self.wait(g);
        }
        if g.writer_gone {
            return;
        }
        g.bytes += len;
        g.items.push_back(p);
        self.changed.notify_all();
    }

    /// The next matrix, or `None` once the load closed the queue and it is empty.
    pub(super) fn recv(&self) -> Option<Parts> {
        let mut g = self.lock();
        loop {
            #[cfg(test)]
            if g.paused {
                g = self.wait(g);
                continue;
            }
            if let Some(p) = g.items.pop_front() {
                g.bytes -= p.bytes();
                self.changed.notify_all();
                return Some(p);
            }
            if g.closed {
                return None;
            }
            g = self.wait(g);
        }
    }

    /// Holds the writer before its next matrix (`on`) or lets it go on.
    #[cfg(test)]
    pub(super) fn set_paused(&self, on: bool) {
        self.lock().paused = on;
        self.changed.notify_all();
    }

    /// Whether the load sent its last matrix.
    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    pub(super) fn writer_gone(&self) {
        let mut g = self.lock();
        g.writer_gone = true;
        g.items.clear();
        g.bytes = 0;
        self.changed.notify_all();
    }
}

/// Marks the queue's writer gone when the writer thread ends, however it ends.
pub(super) struct WriterGone(pub(super) Arc<Queue>);

impl Drop for WriterGone {
    fn drop(&mut self) {
        self.0.writer_gone();
    }
}
