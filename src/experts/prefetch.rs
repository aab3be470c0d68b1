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

use super::expert_reader::{ExpertReader, LoadedExpert};
use super::loader_pool::{LoadJob, LoaderPool};
use crate::checkpoint::Checkpoint;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;

/// A read guessed for a layer, waiting for that layer to route.
struct Pending {
    id: u32,
    bytes: u64,
    rx: Receiver<Result<LoadedExpert>>,
}

/// The guessed reads of every MoE layer that has not routed yet.
#[derive(Default)]
pub struct Prefetcher {
    pending: Mutex<HashMap<usize, Vec<Pending>>>,
}

/// Most experts guessed for one layer: one read per loader thread. The disk idles between
/// layers for about one round of reads (a layer's misses keep it busy otherwise), and a
/// wrong guess costs a read the disk then owes to the experts really needed, so only the
/// heaviest guesses are read.
pub fn guess_limit(top_k: usize, load_threads: usize) -> usize {
    load_threads.min(top_k).max(1)
}

impl Prefetcher {
    /// Queues guessed reads of `ids` (experts of `layer` that no cache holds, in canonical
    /// order) behind the running layer's own reads; an expert already guessed is skipped.
    pub fn issue(
        &self,
        pool: &LoaderPool,
        ck: &Checkpoint,
        reader: &ExpertReader,
        layer: usize,
        ids: &[u32],
        stats: &mut Stats,
    ) -> Result<()> {
        let mut pending = self
            .pending
            .lock()
            .map_err(|_| anyhow!("expert prefetch table poisoned"))?;
        let list = pending.entry(layer).or_default();
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
    /// guesses, counting the bytes of those a loader had already started.
    pub fn settle(
        &self,
        pool: &LoaderPool,
        layer: usize,
        misses: &[u32],
        stats: &mut Stats,
    ) -> Result<HashMap<u32, Receiver<Result<LoadedExpert>>>> {
        let guesses = self
            .pending
            .lock()
            .map_err(|_| anyhow!("expert prefetch table poisoned"))?
            .remove(&layer)
            .unwrap_or_default();
        if guesses.is_empty() {
            return Ok(HashMap::new());
        }
        let settled = pool.settle(layer, misses)?;
        let mut used = HashMap::new();
        for g in guesses {
            if misses.contains(&g.id) {
                stats.prefetch_hits += 1;
                used.insert(g.id, g.rx);
            } else if settled.dropped.contains(&g.id) {
                stats.prefetch_unread += 1;
            } else {
                stats.prefetch_wasted_bytes += g.bytes;
            }
        }
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
