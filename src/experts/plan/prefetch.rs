//! Next-layer expert prefetch: once a MoE layer has routed, the next MoE layer's router is
//! scored on the current hidden state and the experts it picks that no cache holds are read
//! ahead, so the disk keeps reading through the rest of this layer and the next layer's
//! attention instead of idling until the next router runs.
//!
//! A guess is only a read: when its layer routes for real, the guesses it needs are handed
//! to the layer's stream as reads already in flight (or done), in the place a fresh read
//! would have taken, and the rest are dropped — unread when no loader thread had started
//! them, as wasted bytes otherwise. The experts a layer computes with, their order and their
//! bytes are the same with or without guesses, so the logits are too.

use crate::checkpoint::Checkpoint;
use crate::experts::io::expert_reader::ExpertReader;
use crate::experts::io::loader_pool::{LoadJob, LoaderPool};
use crate::experts::plan::prefetch_gate::{BusyShare, DiskLoad, PrefetchGate, RoundOutcome};
use crate::routed_expert::LoadedExpert;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::Duration;

/// A read guessed for a layer, waiting for that layer to route.
struct Pending {
    id: u32,
    bytes: u64,
    rx: Receiver<Result<LoadedExpert>>,
}

/// A layer's guess round: what scoring its router ahead took, and the reads it queued.
#[derive(Default)]
struct Round {
    router: Duration,
    reads: Vec<Pending>,
}

/// The guessed reads of every MoE layer that has not routed yet, and the gate that decides
/// which layers guess (`prefetch_gate.rs`).
#[derive(Default)]
pub(crate) struct Prefetcher {
    pending: Mutex<HashMap<usize, Round>>,
    gate: Mutex<PrefetchGate>,
    busy_share: Mutex<BusyShare>,
    /// Guess on every pass, whatever the gate judges (`--prefetch always`).
    always: AtomicBool,
}

/// Most experts guessed for one layer: one read per loader thread. The disk idles between
/// layers for about one round of reads (a layer's misses keep it busy otherwise), and a
/// wrong guess costs a read the disk then owes to the experts really needed, so only the
/// heaviest guesses are read.
pub(crate) fn guess_limit(top_k: usize, load_threads: usize) -> usize {
    load_threads.min(top_k).max(1)
}

impl Prefetcher {
    /// Guess on every pass (`true`, `--prefetch always`) or where the gate judges it pays.
    pub(crate) fn set_always(&self, always: bool) {
        self.always.store(always, Ordering::Relaxed);
    }

    /// Whether guesses are made on every pass ([`Self::set_always`]).
    pub(crate) fn always(&self) -> bool {
        self.always.load(Ordering::Relaxed)
    }

    /// Whether `layer` guesses on this pass (the gate's judgement unless [`Self::set_always`];
    /// counted in `stats`).
    pub(crate) fn should_guess(&self, layer: usize, stats: &mut Stats) -> Result<bool> {
        let judged = self
            .gate
            .lock()
            .map_err(|_| anyhow!("expert prefetch gate poisoned"))?
            .should_guess(layer);
        let guess = judged || self.always.load(Ordering::Relaxed);
        if guess {
            stats.prefetch_rounds += 1;
        } else {
            stats.prefetch_rounds_skipped += 1;
        }
        Ok(guess)
    }

    /// Queues guessed reads of `ids` (experts of `layer` that no cache holds, in canonical
    /// order) behind the running layer's own reads; an expert already guessed is skipped.
    /// `router` is what scoring the layer's router ahead took, a cost of the round.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn issue(
        &self,
        pool: &LoaderPool,
        ck: &Checkpoint,
        reader: &ExpertReader,
        layer: usize,
        ids: &[u32],
        router: Duration,
        stats: &mut Stats,
    ) -> Result<()> {
        let mut pending = self
            .pending
            .lock()
            .map_err(|_| anyhow!("expert prefetch table poisoned"))?;
        let round = pending.entry(layer).or_default();
        round.router += router;
        let list = &mut round.reads;
        for &id in ids {
            if list.iter().any(|p| p.id == id) {
                continue;
            }
            let loc = ExpertReader::locate(ck, layer, id)?.clone();
            reader.expect_unchanged(ck, loc.shard)?;
            let (reply, rx) = channel();
            let bytes = loc.byte_len();
            pool.submit_guess(
                layer,
                LoadJob {
                    path: ck.shard_path(loc.shard).to_path_buf(),
                    loc,
                    id,
                    reply,
                },
            )?;
            list.push(Pending { id, bytes, rx });
            stats.prefetch_guesses += 1;
        }
        Ok(())
    }

    /// `layer` has routed and must read `misses`: returns the guessed reads among them (in
    /// flight or done; those still queued now lead the loaders' queue), and drops its other
    /// guesses, counting the bytes of those a loader had already started. The round's
    /// outcome goes to the gate, weighed with the disk's totals so far (`busy`, the time a
    /// read was in flight, and the `bytes` read).
    pub(crate) fn settle(
        &self,
        pool: &LoaderPool,
        layer: usize,
        misses: &[u32],
        (busy, bytes): (Duration, u64),
        stats: &mut Stats,
    ) -> Result<HashMap<u32, Receiver<Result<LoadedExpert>>>> {
        let share = self
            .busy_share
            .lock()
            .map_err(|_| anyhow!("expert prefetch gate poisoned"))?
            .sample(std::time::Instant::now(), busy);
        let disk = match share {
            Some(busy_share) if bytes > 0 && !busy.is_zero() => Some(DiskLoad {
                rate: bytes as f64 / busy.as_secs_f64(),
                busy_share,
            }),
            _ => None,
        };
        let Some(round) = self
            .pending
            .lock()
            .map_err(|_| anyhow!("expert prefetch table poisoned"))?
            .remove(&layer)
        else {
            return Ok(HashMap::new());
        };
        let settled = if round.reads.is_empty() {
            Default::default()
        } else {
            pool.settle(layer, misses)?
        };
        let mut outcome = RoundOutcome {
            router: round.router,
            queued: round.reads.len(),
            ..RoundOutcome::default()
        };
        let mut used = HashMap::new();
        for g in round.reads {
            if misses.contains(&g.id) {
                stats.prefetch_hits += 1;
                // A guess still queued is only moved up: it saved no time.
                if !settled.promoted.contains(&g.id) {
                    outcome.useful_bytes += g.bytes;
                }
                used.insert(g.id, g.rx);
            } else if settled.dropped.contains(&g.id) {
                stats.prefetch_unread += 1;
            } else {
                stats.prefetch_wasted_bytes += g.bytes;
                outcome.wasted_bytes += g.bytes;
            }
        }
        self.gate
            .lock()
            .map_err(|_| anyhow!("expert prefetch gate poisoned"))?
            .observe(layer, outcome, disk);
        Ok(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_one_read_per_loader_within_a_token() {
        assert_eq!(guess_limit(16, 4), 4);
        assert_eq!(guess_limit(2, 4), 2);
        assert_eq!(guess_limit(16, 1), 1);
        assert_eq!(guess_limit(0, 4), 1);
    }
}
