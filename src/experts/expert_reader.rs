//! Reads one expert's six MXFP4 tensors from its shard: one read when they are back to
//! back, six otherwise.

use super::aligned_buf::AlignedBuf;
use super::shard_io::{IoMode, ShardIo};
use crate::backend::ExpertWeights;
use crate::checkpoint::{Checkpoint, ExpertLocation};
use crate::config::Config;
use crate::quant::Mxfp4View;
use anyhow::{anyhow, Context, Result};
use std::ops::Range;
use std::path::Path;

/// One expert's bytes in host memory and where each of its six tensors lies in them.
pub struct LoadedExpert {
    /// The expert's id within its layer.
    pub id: u32,
    buf: AlignedBuf,
    parts: [Range<usize>; 6],
}

impl LoadedExpert {
    /// Bytes of the six tensors.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|r| r.len()).sum()
    }

    /// True when the expert holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Views the bytes as the expert's three MXFP4 matrices (gate w1, down w2, up w3).
    pub fn weights(&self, cfg: &Config) -> Result<ExpertWeights<'_>> {
        let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
        let p = |k: usize| &self.buf[self.parts[k].clone()];
        Ok(ExpertWeights {
            w1: Mxfp4View::new(i, d, p(0), p(1))
                .with_context(|| format!("expert {} w1", self.id))?,
            w2: Mxfp4View::new(d, i, p(2), p(3))
                .with_context(|| format!("expert {} w2", self.id))?,
            w3: Mxfp4View::new(i, d, p(4), p(5))
                .with_context(|| format!("expert {} w3", self.id))?,
        })
    }
}

/// Reads experts through a [`ShardIo`].
pub struct ExpertReader {
    io: ShardIo,
}

impl ExpertReader {
    /// A reader in `mode` (`K3_DIRECT`).
    pub fn new(mode: IoMode) -> Self {
        Self {
            io: ShardIo::new(mode),
        }
    }

    /// The I/O mode in force.
    pub fn mode(&self) -> IoMode {
        self.io.mode()
    }

    /// Where expert `e` of `layer` lives.
    pub fn locate(ck: &Checkpoint, layer: usize, e: u32) -> Result<&ExpertLocation> {
        ck.experts().get(layer, e as usize).ok_or_else(|| {
            anyhow!("expert {e} of layer {layer} is not in the checkpoint's expert table")
        })
    }

    /// Asks the kernel to start reading expert `e` (buffered mode only).
    pub fn will_need(&self, ck: &Checkpoint, layer: usize, e: u32) -> Result<()> {
        let loc = Self::locate(ck, layer, e)?;
        self.io.will_need(ck.shard_path(loc.shard), &loc.span());
        Ok(())
    }

    /// Reads expert `e` of `layer`.
    pub fn read(&self, ck: &Checkpoint, layer: usize, e: u32) -> Result<LoadedExpert> {
        let loc = Self::locate(ck, layer, e)?;
        self.read_location(ck.shard_path(loc.shard), loc, e)
            .with_context(|| format!("loading expert {e} of layer {layer}"))
    }

    /// Reads the expert `id` whose tensors lie at `loc` in the shard at `path`.
    pub fn read_location(
        &self,
        path: &Path,
        loc: &ExpertLocation,
        id: u32,
    ) -> Result<LoadedExpert> {
        if loc.contiguous {
            let span = loc.span();
            let (buf, off) = self.io.read(path, &span)?;
            let parts = loc.parts.clone().map(|r| {
                off + (r.start - span.start) as usize..off + (r.end - span.start) as usize
            });
            return Ok(LoadedExpert { id, buf, parts });
        }
        let total: usize = loc.parts.iter().map(|r| (r.end - r.start) as usize).sum();
        let mut buf = AlignedBuf::new(total);
        let mut parts: [Range<usize>; 6] = Default::default();
        let mut at = 0usize;
        for (p, r) in parts.iter_mut().zip(&loc.parts) {
            let (piece, off) = self.io.read(path, r)?;
            let len = (r.end - r.start) as usize;
            buf[at..at + len].copy_from_slice(&piece[off..off + len]);
            *p = at..at + len;
            at += len;
        }
        Ok(LoadedExpert { id, buf, parts })
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// An expert with no bytes, for cache-policy tests.
    pub fn fake_expert(id: u32) -> std::sync::Arc<LoadedExpert> {
        std::sync::Arc::new(LoadedExpert {
            id,
            buf: AlignedBuf::new(0),
            parts: Default::default(),
        })
    }
}
