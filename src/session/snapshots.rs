//! Prefix reuse: the state snapshots a session keeps at prompt ends, within limits, and the
//! return to the longest one a new prompt shares.

use super::Session;
use crate::backend::Backend;
use crate::model::StateSnapshot;
use anyhow::Result;

/// How many state snapshots a session keeps, and in how many bytes at most.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotLimits {
    /// Snapshots at most (0: none are taken).
    pub count: usize,
    /// Bytes they may take together (KDA states plus the logits kept with each).
    pub bytes: usize,
}

/// The state after `tokens[..state.pos()]` of the session, with the logits that followed.
pub(super) struct Snapshot<B: Backend> {
    state: StateSnapshot<B>,
    last_logits: Vec<f32>,
    bytes: usize,
}

impl<B: Backend> Session<'_, B> {
    /// Keeps state snapshots at the end of each prompt within `limits` (none by default).
    pub fn set_snapshot_limits(&mut self, limits: SnapshotLimits) {
        self.snapshot_limits = limits;
        self.evict_snapshots();
    }

    /// Snapshots held now.
    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// Bytes the snapshots held now take.
    pub fn snapshot_bytes(&self) -> usize {
        self.snapshots.iter().map(|s| s.bytes).sum()
    }

    /// Drops the oldest snapshots until the count and bytes are within the limits.
    fn evict_snapshots(&mut self) {
        let l = self.snapshot_limits;
        while !self.snapshots.is_empty()
            && (self.snapshots.len() > l.count || self.snapshot_bytes() > l.bytes)
        {
            self.snapshots.remove(0);
        }
    }

    /// Takes a snapshot of the current point, when the limits leave room for one.
    pub(super) fn take_snapshot(&mut self) -> Result<()> {
        let pos = self.tokens.len();
        let bytes = self.model.snapshot_bytes() + self.last_logits.len() * 4;
        let l = self.snapshot_limits;
        if pos == 0
            || l.count == 0
            || bytes > l.bytes
            || self.snapshots.last().is_some_and(|s| s.state.pos() >= pos)
        {
            return Ok(());
        }
        let state = self.model.snapshot(&self.state)?;
        self.snapshots.push(Snapshot {
            state,
            last_logits: self.last_logits.clone(),
            bytes,
        });
        self.evict_snapshots();
        Ok(())
    }

    /// After a pass stopped between layers: returns to the longest snapshot of what was
    /// consumed (its KDA layers copied back, the MLA caches cut to it), or resets.
    pub(super) fn rewind_part_advanced(&mut self) -> Result<()> {
        let consumed = self.tokens.len();
        self.snapshots.retain(|s| s.state.pos() <= consumed);
        let Some(snap) = self.snapshots.last() else {
            return self.reset();
        };
        let pos = snap.state.pos();
        if self.model.restore(&mut self.state, &snap.state).is_err() {
            return self.reset();
        }
        self.tokens.truncate(pos);
        self.last_logits.clone_from(&snap.last_logits);
        Ok(())
    }

    /// Keeps the consumed tokens when they are a prefix of `ids`; else returns to the
    /// longest snapshot whose tokens are a prefix of `ids` (resetting when none is) and
    /// drops the snapshots past it, which lie on the abandoned branch. Returns how many
    /// tokens are kept.
    pub(super) fn reuse(&mut self, ids: &[u32]) -> Result<usize> {
        let common = self.common_prefix(ids);
        if common == self.tokens.len() {
            return Ok(common);
        }
        self.snapshots.retain(|s| s.state.pos() <= common);
        let Some(snap) = self.snapshots.last() else {
            self.reset()?;
            return Ok(0);
        };
        let pos = snap.state.pos();
        if let Err(e) = self.model.restore(&mut self.state, &snap.state) {
            // The state may be half restored: forget it all.
            self.reset()?;
            return Err(e);
        }
        self.tokens.truncate(pos);
        self.last_logits.clone_from(&snap.last_logits);
        Ok(pos)
    }

    /// How many of the consumed tokens `ids` starts with.
    fn common_prefix(&self, ids: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Tokens of `ids` a generation of it would reuse from what the session holds (its
    /// consumed tokens when they are a prefix of `ids`, else its longest snapshot that is).
    pub fn reusable(&self, ids: &[u32]) -> usize {
        let common = self.common_prefix(ids);
        if common == self.tokens.len() {
            return common;
        }
        self.snapshots
            .iter()
            .map(|s| s.state.pos())
            .filter(|&p| p <= common)
            .max()
            .unwrap_or(0)
    }
}
