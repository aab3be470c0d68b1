//! An expert read as the loader threads take it: whole, or split into pieces that several
//! threads read at once into one destination.
//!
//! A decode step misses a dozen or so 17.5 MB experts a layer. Read whole, each read is
//! one thread's, so a layer's last reads run with fewer reads in flight than there are
//! threads, and more threads only spread the disk over more experts at once, each of
//! which then arrives later. Split into pieces that the threads take in queue order, the
//! disk sees as many reads as there are threads until the layer's last piece, and the
//! experts still complete one after another. Whether that reads faster depends on the disk
//! (a block layer that already cuts a large read into several requests gains nothing), so
//! it is off by default ([`crate::experts::io::expert_reader::DEFAULT_READ_PIECE`]).

use crate::experts::io::expert_reader::ExpertReader;
use crate::experts::io::loader_pool::LoadJob;
use crate::experts::telemetry::disk_meter::DiskMeter;
use crate::platform::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use crate::routed_expert::{ExpertBytes, LoadedExpert};
use anyhow::{anyhow, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// How one contiguous expert's read splits: its byte span widened to whole [`IO_ALIGN`]
/// blocks, cut into pieces of whole blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    /// First block of the widened span.
    start: u64,
    /// The expert's last byte + 1 (a piece never reads past it: the file may end there).
    end: u64,
    /// Bytes of the destination: the span widened to whole blocks.
    region: usize,
    /// Bytes of every piece but the last.
    piece: usize,
    /// Number of pieces, at least 2.
    count: usize,
}

impl SplitPlan {
    /// Pieces of about `piece` bytes (a multiple of [`IO_ALIGN`], at least one block) for
    /// `span`, evened out so that the last is not a sliver; `None` when it is one piece.
    pub(crate) fn new(span: &Range<u64>, piece: usize) -> Option<Self> {
        let start = span.start & !(IO_ALIGN as u64 - 1);
        let region = round_up(span.end as usize) - start as usize;
        let piece = piece.max(IO_ALIGN);
        let count = region.div_ceil(piece);
        if count < 2 {
            return None;
        }
        let piece = round_up(region.div_ceil(count));
        Some(Self {
            start,
            end: span.end,
            region,
            piece,
            count: region.div_ceil(piece),
        })
    }

    /// The file offset the destination's first byte is read from.
    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    /// Number of pieces.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Where piece `k` lies in the destination.
    fn in_region(&self, k: usize) -> Range<usize> {
        let at = k * self.piece;
        at..(at + self.piece).min(self.region)
    }

    /// The file bytes piece `k` reads (the last ends at the expert's end; a direct read
    /// widens it to the block again).
    fn in_file(&self, k: usize) -> Range<u64> {
        let r = self.in_region(k);
        self.start + r.start as u64..(self.start + r.end as u64).min(self.end)
    }
}

/// Where a split read's pieces land.
struct Dest {
    /// The first byte of the region the pieces are read into.
    base: *mut u8,
    /// Bytes at `base` the pieces may fill.
    len: usize,
    /// The memory `base` points into, taken out once every piece is read.
    bytes: Mutex<Option<ExpertBytes>>,
    /// Whether the memory is a region a backend lent.
    lent: bool,
}

// SAFETY: `base` points into the heap memory (or lent mapping) that `bytes` owns; moving
// `Dest` or the box in `bytes` does not move that memory. Threads write through `base`
// only into the disjoint range of the one piece each was handed (`PieceRead::read_piece`),
// and the memory is taken out of `bytes` only after every piece's write has finished.
unsafe impl Send for Dest {}
// SAFETY: as for `Send`: shared access only writes disjoint piece ranges.
unsafe impl Sync for Dest {}

impl Dest {
    fn new(reader: &ExpertReader, job: &LoadJob, plan: &SplitPlan) -> Self {
        if let Some(mut region) = reader.lend_for(&job.loc) {
            // A region smaller than the read fails the pieces that do not fit, and the
            // expert is read again into host memory, as a whole read into it would be.
            let bytes = region.bytes_mut();
            let (base, len) = (bytes.as_mut_ptr(), bytes.len());
            return Self {
                base,
                len,
                bytes: Mutex::new(Some(ExpertBytes::Lent(region))),
                lent: true,
            };
        }
        let mut buf = AlignedBuf::new(plan.region);
        let region = buf.block_region_mut();
        let (base, len) = (region.as_mut_ptr(), region.len());
        Self {
            base,
            len,
            bytes: Mutex::new(Some(ExpertBytes::Host(buf))),
            lent: false,
        }
    }
}

/// One expert read in the loader pool's queues.
pub(crate) struct PieceRead {
    job: LoadJob,
    /// `None`: the expert is read whole, by one thread.
    plan: Option<SplitPlan>,
    dest: OnceLock<Dest>,
    /// Pieces not yet finished.
    left: AtomicUsize,
    /// The first piece's error.
    failure: Mutex<Option<anyhow::Error>>,
}

impl PieceRead {
    /// The read of `job`, split as `reader` splits it.
    pub(crate) fn new(job: LoadJob, reader: &ExpertReader) -> Self {
        let plan = reader.split_plan(&job.loc);
        let pieces = plan.as_ref().map_or(1, SplitPlan::count);
        Self {
            job,
            plan,
            dest: OnceLock::new(),
            left: AtomicUsize::new(pieces),
            failure: Mutex::new(None),
        }
    }

    /// The expert's id.
    pub(crate) fn id(&self) -> u32 {
        self.job.id
    }

    /// Number of pieces (1 when read whole).
    pub(crate) fn pieces(&self) -> usize {
        self.plan.as_ref().map_or(1, SplitPlan::count)
    }

    /// Reads piece `k`. The pool hands every `k` below [`PieceRead::pieces`] to exactly one
    /// thread; the thread that finishes the last piece sends the expert, or the first
    /// error, to the job's reply channel.
    pub(crate) fn read_piece(&self, k: usize, reader: &ExpertReader, meter: &DiskMeter) {
        meter.begin();
        let Some(plan) = &self.plan else {
            let res = reader.read_location(&self.job.path, &self.job.loc, self.job.id);
            meter.end(res.as_ref().map(|e| e.len() as u64).unwrap_or(0));
            // The consumer may have given up on an error elsewhere, or dropped a wrong
            // guess; nothing to do then.
            let _ = self.job.reply.send(res);
            return;
        };
        let dest = self.dest.get_or_init(|| Dest::new(reader, &self.job, plan));
        if !self.failed() {
            let at = plan.in_region(k);
            let res = if k < plan.count && at.end <= dest.len {
                // SAFETY: piece `k` is handed to this thread alone (the pool's contract
                // above), its range lies inside the `dest.len` bytes at `dest.base`, and
                // no two pieces' ranges overlap; the memory lives until the last piece.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(dest.base.add(at.start), at.end - at.start)
                };
                reader.read_piece_into(&self.job.path, &plan.in_file(k), dst, dest.lent)
            } else {
                Err(anyhow!(
                    "internal: piece {k} ({at:?}) of a {}-piece read does not fit its {}-byte read destination",
                    plan.count,
                    dest.len
                ))
            };
            if let Err(e) = res {
                if let Ok(mut f) = self.failure.lock() {
                    f.get_or_insert(e);
                }
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            meter.end(0);
            return;
        }
        let res = self.finish(reader, plan, dest);
        meter.end(res.as_ref().map(|e| e.len() as u64).unwrap_or(0));
        let _ = self.job.reply.send(res);
    }

    /// Whether a piece has failed already (the rest then skip their reads).
    fn failed(&self) -> bool {
        self.failure.lock().map(|f| f.is_some()).unwrap_or(true)
    }

    fn finish(&self, reader: &ExpertReader, plan: &SplitPlan, dest: &Dest) -> Result<LoadedExpert> {
        let bytes = dest
            .bytes
            .lock()
            .map_err(|_| anyhow!("split expert read poisoned"))?
            .take()
            .ok_or_else(|| anyhow!("internal: a split expert read finished twice"))?;
        let failure = self
            .failure
            .lock()
            .map_err(|_| anyhow!("split expert read poisoned"))?
            .take();
        let job = &self.job;
        reader.finish_split(&job.path, &job.loc, job.id, plan, bytes, failure)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_widened_span_in_whole_blocks() {
        let span = 1000..17_547_264 + 1000;
        let plan = SplitPlan::new(&span, 2 << 20).unwrap();
        assert_eq!(plan.start(), 0);
        assert_eq!(plan.count(), 9);
        let mut at = 0;
        for k in 0..plan.count() {
            let r = plan.in_region(k);
            assert_eq!(r.start, at);
            assert_eq!(r.start % IO_ALIGN, 0);
            assert!(!r.is_empty());
            at = r.end;
        }
        assert_eq!(at, plan.region);
        assert_eq!(plan.region % IO_ALIGN, 0);
        assert_eq!(plan.in_file(plan.count() - 1).end, span.end);
        assert_eq!(plan.in_file(0).start, 0);
    }

    #[test]
    fn an_expert_of_one_piece_is_not_split() {
        assert_eq!(SplitPlan::new(&(4096..8000), 8192), None);
        assert_eq!(
            SplitPlan::new(&(0..2 * 4096), 4096).map(|p| p.count()),
            Some(2)
        );
        // A piece below one block is a block.
        assert_eq!(
            SplitPlan::new(&(0..3 * 4096), 1).map(|p| p.count()),
            Some(3)
        );
    }
}
