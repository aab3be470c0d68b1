//! Reads one expert's six MXFP4 tensors from its shard: one read when they are back to
//! back, six otherwise.

use super::shard_io::{region_len, FaultPlan, IoMode, ShardIo};
use crate::checkpoint::{Checkpoint, ExpertLocation};
use crate::platform::aligned_buf::AlignedBuf;
use crate::routed_expert::{ExpertBytes, LoadedExpert, ReadLender};
use anyhow::{anyhow, Context, Result};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Reads experts through a [`ShardIo`].
pub struct ExpertReader {
    io: ShardIo,
    lender: Option<Arc<dyn ReadLender>>,
}

impl ExpertReader {
    /// A reader in `mode` (`K3_DIRECT`).
    pub fn new(mode: IoMode) -> Self {
        Self {
            io: ShardIo::new(mode),
            lender: None,
        }
    }

    /// Reads contiguous experts into regions `lender` lends where it can.
    pub fn with_lender(mut self, lender: Option<Arc<dyn ReadLender>>) -> Self {
        self.lender = lender;
        self
    }

    /// Makes every later read consult `plan`: I/O errors and short reads injected into the
    /// read path, for tests.
    pub fn inject_faults(&self, plan: Arc<dyn FaultPlan>) -> Result<()> {
        self.io.inject_faults(plan)
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

    /// Later reads of shard `shard` fail if the file no longer has the size and modification
    /// time `ck` validated its offsets against.
    pub fn expect_unchanged(&self, ck: &Checkpoint, shard: usize) -> Result<()> {
        self.io
            .require_stamp(ck.shard_path(shard), ck.shard_stamp(shard))
    }

    /// Reads expert `e` of `layer`.
    pub fn read(&self, ck: &Checkpoint, layer: usize, e: u32) -> Result<LoadedExpert> {
        let loc = Self::locate(ck, layer, e)?;
        let path = ck.shard_path(loc.shard);
        let span = loc.span();
        self.expect_unchanged(ck, loc.shard)
            .and_then(|()| self.read_location(path, loc, e))
            .with_context(|| {
                format!(
                    "loading expert {e} of layer {layer} (bytes {}..{} of {})",
                    span.start,
                    span.end,
                    path.display()
                )
            })
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
            let at = |off: usize| {
                loc.parts.clone().map(|r| {
                    off + (r.start - span.start) as usize..off + (r.end - span.start) as usize
                })
            };
            if let Some((mut buf, off)) = self.read_lent(path, &span, loc)? {
                let parts = at(off);
                // The lent region is host-visible until the backend takes it: its scale
                // bytes are checked there, as a host read's are.
                match &mut buf {
                    ExpertBytes::Lent(r) => refuse_nan_scales(path, r.bytes_mut(), &parts)?,
                    ExpertBytes::Host(b) => refuse_nan_scales(path, b, &parts)?,
                    ExpertBytes::Handed(h) => refuse_nan_scales(path, h.bytes(), &parts)?,
                }
                return Ok(LoadedExpert::new(id, buf, parts));
            }
            let (buf, off) = self.io.read(path, &span)?;
            let parts = at(off);
            refuse_nan_scales(path, &buf, &parts)?;
            return Ok(LoadedExpert::new(id, ExpertBytes::Host(buf), parts));
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
        refuse_nan_scales(path, &buf, &parts)?;
        Ok(LoadedExpert::new(id, ExpertBytes::Host(buf), parts))
    }

    /// Reads the contiguous expert at `span` into a lent region, when there is a lender with
    /// a region free and every tensor lies on a 4-byte boundary (devices copy in 4-byte
    /// units; the offset direct I/O adds is one of whole blocks or the span's own). `None`:
    /// nothing was read, the caller reads into host memory. A read that fails into the lent
    /// region is done again into host memory; when that succeeds, the lender stops lending.
    fn read_lent(
        &self,
        path: &Path,
        span: &Range<u64>,
        loc: &ExpertLocation,
    ) -> Result<Option<(ExpertBytes, usize)>> {
        let Some(lender) = &self.lender else {
            return Ok(None);
        };
        let aligned = loc
            .parts
            .iter()
            .all(|r| r.start % 4 == 0 && (r.end - r.start) % 4 == 0);
        if !aligned {
            return Ok(None);
        }
        let Some(mut region) = lender.lend(region_len(span)) else {
            return Ok(None);
        };
        match self.io.read_into_lent(path, span, region.bytes_mut()) {
            Ok(off) => Ok(Some((ExpertBytes::Lent(region), off))),
            Err(lent_err) => {
                drop(region);
                // The same read into host memory tells a bad region from a bad file.
                let (buf, off) = self.io.read(path, span)?;
                lender.refuse(&format!("{lent_err:#}"));
                Ok(Some((ExpertBytes::Host(buf), off)))
            }
        }
    }
}

/// E8M0 reserves 255 for NaN: a scale byte of 255 makes its whole group of 32 weights NaN,
/// and the logits with them. A released checkpoint never holds one, so it means the bytes
/// are corrupt; the expert is refused rather than computed with.
///
/// The scan is `<[u8]>::contains`, which reads a word at a time (memory lent by a GPU may be
/// write-combined, where each narrow read is slow); the position is found only on a hit.
fn refuse_nan_scales(path: &Path, buf: &[u8], parts: &[Range<usize>; 6]) -> Result<()> {
    for k in [1, 3, 5] {
        let scales = buf.get(parts[k].clone()).ok_or_else(|| {
            anyhow!(
                "internal: expert tensor {} lies at {:?}, outside its {}-byte read buffer",
                crate::checkpoint::schema::EXPERT_PARTS[k],
                parts[k],
                buf.len()
            )
        })?;
        if !scales.contains(&0xFF) {
            continue;
        }
        if let Some(at) = scales.iter().position(|&b| b == 0xFF) {
            anyhow::bail!(
                "{}: expert tensor {}: scale byte {at} is 255, which E8M0 reserves for NaN (corrupt shard bytes; re-download the shard)",
                path.display(),
                crate::checkpoint::schema::EXPERT_PARTS[k]
            );
        }
    }
    Ok(())
}
