//! Faults injected into the expert read path ([`FaultPlan`]) and the bytes a read gives,
//! shared by the read-path test binaries.

use k3::checkpoint::Checkpoint;
use k3::experts::{FaultPlan, ReadFault};
use k3::routed_expert::LoadedExpert;
use std::io::ErrorKind;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Fails every read that covers byte `at` with `kind`, `left` times.
pub(crate) struct ErrorAt {
    /// The byte whose read fails.
    pub at: u64,
    /// The error the read returns.
    pub kind: ErrorKind,
    /// Reads left to fail.
    pub left: AtomicUsize,
}

impl ErrorAt {
    /// Fails the first `times` reads that cover byte `at`.
    pub(crate) fn new(at: u64, kind: ErrorKind, times: usize) -> Self {
        Self {
            at,
            kind,
            left: AtomicUsize::new(times),
        }
    }
}

impl FaultPlan for ErrorAt {
    fn fault(&self, _: &Path, offset: u64, len: usize) -> Option<ReadFault> {
        let covers = offset <= self.at && self.at < offset + len as u64;
        (covers && self.left.load(Ordering::Relaxed) > 0).then(|| {
            self.left.fetch_sub(1, Ordering::Relaxed);
            ReadFault::Error(self.kind)
        })
    }
}

/// Every read reports at most `max` bytes (odd counts leave direct reads unaligned);
/// `seen` counts the reads.
pub(crate) struct ShortReads {
    /// The most bytes a read reports.
    pub max: usize,
    /// Reads seen so far.
    pub seen: AtomicUsize,
}

impl ShortReads {
    /// Reads of at most `max` bytes.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            seen: AtomicUsize::new(0),
        }
    }
}

impl FaultPlan for ShortReads {
    fn fault(&self, _: &Path, _: u64, _: usize) -> Option<ReadFault> {
        self.seen.fetch_add(1, Ordering::Relaxed);
        Some(ReadFault::Short(self.max))
    }
}

/// The six tensors of a host-memory expert, in disk order.
pub(crate) fn expert_parts(e: &LoadedExpert, ck: &Checkpoint) -> Vec<Vec<u8>> {
    let w = e.weights(&ck.config).unwrap();
    [
        w.w1.packed,
        w.w1.scales,
        w.w2.packed,
        w.w2.scales,
        w.w3.packed,
        w.w3.scales,
    ]
    .iter()
    .map(|p| p.to_vec())
    .collect()
}
