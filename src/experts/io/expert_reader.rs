//! Reads one expert's six MXFP4 tensors from its shard: one read when they are back to
//! back, six otherwise; or, through the loader pool, a contiguous expert in pieces that
//! several threads read at once (`piece_read.rs`).

use crate::checkpoint::{Checkpoint, ExpertLocation};
use crate::experts::io::piece_read::SplitPlan;
use crate::experts::io::shard_io::{region_len, FaultPlan, IoMode, ShardIo};
use crate::platform::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use crate::routed_expert::{ExpertBytes, LentRegion, LoadedExpert, ReadLender};
use anyhow::{anyhow, Context, Result};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of one piece when the loader pool splits an expert's read (see
/// [`ExpertReader::set_read_piece`]); 0, the default, reads every expert in one read. On the
/// virtual disk the figures of docs/perf.md come from, decode-shaped reads of whole experts
/// already run as fast as plain parallel reads of the same shape and split reads ran no
/// faster; `k3 bench reader --piece-kib` measures another disk.
pub const DEFAULT_READ_PIECE: usize = 0;

/// Reads experts through a [`ShardIo`].
pub struct ExpertReader {
    io: ShardIo,
    lender: Option<Arc<dyn ReadLender>>,
    /// Piece size of the loader pool's split reads; 0: one read per expert.
    piece: AtomicUsize,
}

impl ExpertReader {
    /// A reader in `mode` (`K3_DIRECT`).
    pub fn new(mode: IoMode) -> Self {
        Self {
            io: ShardIo::new(mode),
            lender: None,
            piece: AtomicUsize::new(DEFAULT_READ_PIECE),
        }
    }

    /// Makes the loader pool read a contiguous expert larger than `bytes` (rounded up to
    /// whole [`IO_ALIGN`] blocks) as pieces of about that size, which its threads read at
    /// once; 0 reads every expert in one read. Reads made through [`ExpertReader::read`]
    /// are never split.
    pub fn set_read_piece(&self, bytes: usize) {
        self.piece.store(round_up(bytes), Ordering::Relaxed);
    }

    /// The piece size in force (0: one read per expert).
    pub fn read_piece(&self) -> usize {
        self.piece.load(Ordering::Relaxed)
    }

    /// How the loader pool splits the read of the expert at `loc`: `None` when it is one
    /// read (tensors not back to back, splitting off, or the expert no larger than a piece).
    pub(crate) fn split_plan(&self, loc: &ExpertLocation) -> Option<SplitPlan> {
        let piece = self.read_piece();
        if !loc.contiguous || piece == 0 {
            return None;
        }
        SplitPlan::new(&loc.span(), piece)
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
            if let Some((mut buf, off)) = self.read_lent(path, &span, loc)? {
                let parts = shifted_parts(loc, off);
                // The lent region is host-visible until the backend takes it: its scale
                // bytes are checked there, as a host read's are.
                refuse_nan_scales(path, buf.host_view(), &parts)?;
                return Ok(LoadedExpert::new(id, buf, parts));
            }
            let (buf, off) = self.io.read(path, &span)?;
            return self.host_expert(path, loc, id, buf, off);
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
        let Some(mut region) = self.lend_for(loc) else {
            return Ok(None);
        };
        match self.io.read_into_lent(path, span, region.bytes_mut()) {
            Ok(off) => Ok(Some((ExpertBytes::Lent(region), off))),
            Err(lent_err) => {
                drop(region);
                self.read_after_lent_failure(path, span, lent_err)
                    .map(|(buf, off)| Some((ExpertBytes::Host(buf), off)))
            }
        }
    }

    /// A lent region for the contiguous expert at `loc`, when there is a lender with one
    /// free and every tensor lies on a 4-byte boundary (devices copy in 4-byte units).
    pub(crate) fn lend_for(&self, loc: &ExpertLocation) -> Option<Box<dyn LentRegion>> {
        let lender = self.lender.as_ref()?;
        let aligned = loc
            .parts
            .iter()
            .all(|r| r.start % 4 == 0 && (r.end - r.start) % 4 == 0);
        if !aligned {
            return None;
        }
        lender.lend(region_len(&loc.span()))
    }

    /// Reads `span` into host memory after a read of it into a lent region failed with
    /// `lent_err`: when this read succeeds the region, not the file, was at fault, and the
    /// lender stops lending.
    fn read_after_lent_failure(
        &self,
        path: &Path,
        span: &Range<u64>,
        lent_err: anyhow::Error,
    ) -> Result<(AlignedBuf, usize)> {
        let (buf, off) = self.io.read(path, span)?;
        if let Some(lender) = &self.lender {
            lender.refuse(&format!("{lent_err:#}"));
        }
        Ok((buf, off))
    }

    /// Reads `range` of the shard at `path` (one piece of a split read, starting on an
    /// [`IO_ALIGN`] boundary) into `dst`, memory a backend lent when `lent`.
    pub(crate) fn read_piece_into(
        &self,
        path: &Path,
        range: &Range<u64>,
        dst: &mut [u8],
        lent: bool,
    ) -> Result<()> {
        if range.start % IO_ALIGN as u64 != 0 {
            return Err(anyhow!(
                "internal: a read piece at offset {} of {} is not block-aligned",
                range.start,
                path.display()
            ));
        }
        // An aligned start lands at the region's start in every mode.
        if lent {
            self.io.read_into_lent(path, range, dst)?;
        } else {
            self.io.read_into(path, range, dst)?;
        }
        Ok(())
    }

    /// The expert `id` at `loc` once every piece of its split read (`plan`) is in `bytes`;
    /// `failure` is the first piece's error, if one failed. A read into a lent region that
    /// failed is done again, whole, into host memory, as an unsplit read does.
    pub(crate) fn finish_split(
        &self,
        path: &Path,
        loc: &ExpertLocation,
        id: u32,
        plan: &SplitPlan,
        bytes: ExpertBytes,
        failure: Option<anyhow::Error>,
    ) -> Result<LoadedExpert> {
        let span = loc.span();
        let mut bytes = match (failure, bytes) {
            (None, b) => b,
            (Some(lent_err), ExpertBytes::Lent(region)) => {
                drop(region);
                let (buf, off) = self.read_after_lent_failure(path, &span, lent_err)?;
                return self.host_expert(path, loc, id, buf, off);
            }
            (Some(e), _) => return Err(e),
        };
        let off = (span.start - plan.start()) as usize;
        let parts = shifted_parts(loc, off);
        refuse_nan_scales(path, bytes.host_view(), &parts)?;
        Ok(LoadedExpert::new(id, bytes, parts))
    }

    /// The contiguous expert `id` at `loc`, read into `buf` with its first byte at `off`.
    fn host_expert(
        &self,
        path: &Path,
        loc: &ExpertLocation,
        id: u32,
        buf: AlignedBuf,
        off: usize,
    ) -> Result<LoadedExpert> {
        let parts = shifted_parts(loc, off);
        refuse_nan_scales(path, &buf, &parts)?;
        Ok(LoadedExpert::new(id, ExpertBytes::Host(buf), parts))
    }
}

/// Where the six tensors of the contiguous expert at `loc` lie in a buffer that holds its
/// first byte at `off`.
fn shifted_parts(loc: &ExpertLocation, off: usize) -> [Range<usize>; 6] {
    let start = loc.span().start;
    loc.parts
        .clone()
        .map(|r| off + (r.start - start) as usize..off + (r.end - start) as usize)
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
