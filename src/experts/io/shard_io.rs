//! Positional reads from shard files: uncached through a second descriptor (O_DIRECT on
//! Linux, F_NOCACHE on macOS, FILE_FLAG_NO_BUFFERING on Windows; see
//! [`crate::platform::uncached_read`]), or buffered with a read-ahead hint.

use crate::checkpoint::file_stamp::FileStamp;
use crate::platform::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use crate::platform::input_file::{self, FileKind};
use crate::platform::positional_read::read_at;
use crate::platform::uncached_read;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// How expert bytes are read (`K3_DIRECT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Bypass the page cache: O_DIRECT (Linux) / F_NOCACHE (macOS) /
    /// FILE_FLAG_NO_BUFFERING (Windows).
    Direct,
    /// Through the page cache, with a WILLNEED hint per expert.
    Buffered,
}

impl IoMode {
    /// The mode as the run's first lines and `k3 inspect` name it, with the OS mechanism.
    pub fn describe(self) -> String {
        match self {
            IoMode::Direct => format!("direct ({})", uncached_read::UNCACHED_MECHANISM),
            IoMode::Buffered => "buffered (page cache, read-ahead hints)".to_string(),
        }
    }
}

/// What an injected fault does to one positional read of a shard ([`ShardIo::inject_faults`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFault {
    /// The read fails with an error of this kind.
    Error(std::io::ErrorKind),
    /// The read reports at most this many bytes (a short read; 0 looks like end of file).
    Short(usize),
}

/// Decides, for each positional read the reader makes, whether it goes wrong: the seam
/// through which tests inject I/O errors and short reads into the read path.
pub trait FaultPlan: Send + Sync {
    /// The fault for a read of up to `len` bytes of `path` at `offset`, or `None`.
    fn fault(&self, path: &Path, offset: u64, len: usize) -> Option<ReadFault>;
}

/// Tries one uncached read of the first block of `path`: `Ok` when the filesystem takes
/// direct reads, else why not (expert reads then fall back to buffered, with one message).
pub fn probe_direct(path: &Path) -> std::result::Result<(), String> {
    let f = uncached_read::open_uncached(path).map_err(|e| e.to_string())?;
    let mut buf = AlignedBuf::new(IO_ALIGN);
    match read_at(&f, buf.block_region_mut(), 0) {
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

struct ShardFiles {
    buffered: File,
    direct: Option<File>,
    /// What the file must still look like after every read: the checkpoint's stamp when
    /// it gave one ([`ShardIo::require_stamp`]), else the file's when it was first opened here.
    stamp: Mutex<FileStamp>,
}

/// Open shard files, shared by the loader threads.
pub struct ShardIo {
    mode: IoMode,
    files: Mutex<HashMap<PathBuf, Arc<ShardFiles>>>,
    direct_refused: AtomicBool,
    /// Injected faults; unset outside tests, which costs one atomic load per read.
    faults: OnceLock<Arc<dyn FaultPlan>>,
}

impl ShardIo {
    /// A reader in `mode`; files are opened on first use.
    pub fn new(mode: IoMode) -> Self {
        Self {
            mode,
            files: Mutex::new(HashMap::new()),
            direct_refused: AtomicBool::new(false),
            faults: OnceLock::new(),
        }
    }

    /// Makes every later read consult `plan` (tests of the read path); a reader takes one
    /// plan for its life.
    pub fn inject_faults(&self, plan: Arc<dyn FaultPlan>) -> Result<()> {
        self.faults
            .set(plan)
            .map_err(|_| anyhow!("internal: faults were already injected into this reader"))
    }

    /// One positional read, through the injected faults when there are any.
    fn read_at(
        &self,
        f: &File,
        path: &Path,
        buf: &mut [u8],
        offset: u64,
    ) -> std::io::Result<usize> {
        match self
            .faults
            .get()
            .and_then(|p| p.fault(path, offset, buf.len()))
        {
            None => read_at(f, buf, offset),
            Some(ReadFault::Error(kind)) => Err(std::io::Error::new(kind, "injected fault")),
            // The whole read happens (a direct read must keep its aligned length) and
            // reports fewer bytes: the rest must be read again.
            Some(ReadFault::Short(n)) => read_at(f, buf, offset).map(|got| got.min(n)),
        }
    }

    /// The mode in force (Direct falls back to Buffered when the filesystem refuses it).
    pub fn mode(&self) -> IoMode {
        if self.direct_refused.load(Ordering::Relaxed) {
            IoMode::Buffered
        } else {
            self.mode
        }
    }

    fn files(&self, path: &Path) -> Result<Arc<ShardFiles>> {
        let mut map = self
            .files
            .lock()
            .map_err(|_| anyhow!("shard file table poisoned"))?;
        if let Some(f) = map.get(path) {
            return Ok(f.clone());
        }
        let buffered = input_file::open(path, FileKind::Shard)
            .with_context(|| format!("opening expert shard {}", path.display()))?
            .file;
        let direct = if self.mode == IoMode::Direct {
            self.open_direct(path)
        } else {
            None
        };
        // The uncached descriptor is a second open by path: it must be the file the checked
        // open judged, not something swapped in between.
        if let Some(d) = &direct {
            let same = input_file::same_file(&buffered, d).with_context(|| {
                format!(
                    "comparing the two descriptors of expert shard {}",
                    path.display()
                )
            })?;
            if !same {
                bail!(
                    "expert shard {} was replaced while it was opened: its uncached descriptor \
                     is another file; leave the snapshot unchanged while k3 runs",
                    path.display()
                );
            }
        }
        let stamp = FileStamp::of_file(&buffered)
            .with_context(|| format!("reading the size of expert shard {}", path.display()))?;
        let f = Arc::new(ShardFiles {
            buffered,
            direct,
            stamp: Mutex::new(stamp),
        });
        map.insert(path.to_path_buf(), f.clone());
        Ok(f)
    }

    fn refuse_direct(&self, path: &Path, why: &str) {
        if !self.direct_refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "[K3] direct I/O refused on {} ({why}): falling back to buffered reads (as K3_DIRECT=0)",
                path.display()
            );
        }
    }

    fn open_direct(&self, path: &Path) -> Option<File> {
        if self.direct_refused.load(Ordering::Relaxed) {
            return None;
        }
        match uncached_read::open_uncached(path) {
            Ok(f) => Some(f),
            Err(e) => {
                self.refuse_direct(path, &e.to_string());
                None
            }
        }
    }

    /// Reads of `path` from now on fail unless the file still has `stamp` (the size and
    /// modification time its tensor offsets were validated against).
    pub fn require_stamp(&self, path: &Path, stamp: FileStamp) -> Result<()> {
        let f = self.files(path)?;
        let mut want = f
            .stamp
            .lock()
            .map_err(|_| anyhow!("shard stamp table poisoned"))?;
        *want = stamp;
        Ok(())
    }

    /// Fails when the file behind `f` no longer has the stamp reads expect of it.
    fn check_unchanged(f: &ShardFiles, path: &Path, offset: u64) -> Result<()> {
        let want = *f
            .stamp
            .lock()
            .map_err(|_| anyhow!("shard stamp table poisoned"))?;
        want.check_file(&f.buffered, path, offset)
    }

    /// Hints the OS to start reading `range` (buffered mode only).
    pub fn will_need(&self, path: &Path, range: &Range<u64>) {
        if self.mode() != IoMode::Buffered {
            return;
        }
        if let Ok(f) = self.files(path) {
            uncached_read::read_ahead_hint(&f.buffered, range.start, range.end - range.start);
        }
    }

    /// Reads `range` of the shard at `path`. Returns the buffer and where `range.start` lies in it.
    pub fn read(&self, path: &Path, range: &Range<u64>) -> Result<(AlignedBuf, usize)> {
        let mut buf = AlignedBuf::new(region_len(range));
        let off = self.read_into(path, range, buf.block_region_mut())?;
        Ok((buf, off))
    }

    /// Reads `range` of the shard at `path` into `dst`, which must start on an [`IO_ALIGN`]
    /// boundary and hold at least [`region_len`] bytes. Returns where `range.start` lies in it.
    pub fn read_into(&self, path: &Path, range: &Range<u64>, dst: &mut [u8]) -> Result<usize> {
        self.read_into_as(path, range, dst, true)
    }

    /// [`ShardIo::read_into`] for memory a backend lent: a direct read the kernel refuses is
    /// an error here, not a switch of every later read to buffered I/O, since the lent
    /// memory (a device mapping, say) rather than the filesystem may be what it refused.
    pub fn read_into_lent(&self, path: &Path, range: &Range<u64>, dst: &mut [u8]) -> Result<usize> {
        self.read_into_as(path, range, dst, false)
    }

    fn read_into_as(
        &self,
        path: &Path,
        range: &Range<u64>,
        dst: &mut [u8],
        may_refuse_direct: bool,
    ) -> Result<usize> {
        let need = region_len(range);
        if dst.len() < need || dst.as_ptr() as usize % IO_ALIGN != 0 {
            return Err(anyhow!(
                "internal: a {}-byte read destination at {:p} for {} bytes (it needs {need}, aligned to {IO_ALIGN})",
                dst.len(),
                dst.as_ptr(),
                range.end - range.start
            ));
        }
        let f = self.files(path).with_context(|| {
            format!(
                "reading bytes {}..{} of {}",
                range.start,
                range.end,
                path.display()
            )
        })?;
        if let Some(direct) = &f.direct {
            if !self.direct_refused.load(Ordering::Relaxed) {
                match self.read_direct(direct, &f.buffered, path, range, dst) {
                    Ok(off) => {
                        Self::check_unchanged(&f, path, range.start)?;
                        return Ok(off);
                    }
                    Err(DirectError::Refused(e)) if may_refuse_direct => {
                        self.refuse_direct(path, &e.to_string())
                    }
                    Err(DirectError::Refused(e)) => {
                        return Err(anyhow::Error::new(e).context(format!(
                            "direct read of {} into lent memory",
                            path.display()
                        )))
                    }
                    Err(DirectError::Other(e)) => return Err(e),
                }
            }
        }
        let len = (range.end - range.start) as usize;
        self.read_full(&f.buffered, &mut dst[..len], range.start, path, range)?;
        Self::check_unchanged(&f, path, range.start)?;
        Ok(0)
    }

    /// Reads the blocks that hold `range` through the uncached descriptor; returns where
    /// `range.start` lies in `region`. A short read that leaves the position unaligned (the
    /// next direct read would be refused) is finished through `buffered`.
    fn read_direct(
        &self,
        f: &File,
        buffered: &File,
        path: &Path,
        range: &Range<u64>,
        region: &mut [u8],
    ) -> std::result::Result<usize, DirectError> {
        let a0 = range.start & !(IO_ALIGN as u64 - 1);
        let region = &mut region[..region_len(range)];
        let need = (range.end - a0) as usize;
        let mut got = 0usize;
        while got < need {
            match self.read_at(f, path, &mut region[got..], a0 + got as u64) {
                Ok(0) => return Err(DirectError::Other(truncated(path, range, a0 + got as u64))),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if uncached_read::is_refusal(&e) && got == 0 => {
                    return Err(DirectError::Refused(e))
                }
                Err(e) => {
                    return Err(DirectError::Other(anyhow::Error::new(e).context(format!(
                        "reading {} at offset {} (direct I/O)",
                        path.display(),
                        a0 + got as u64
                    ))))
                }
            }
            if got % IO_ALIGN != 0 && got < need {
                self.read_full(
                    buffered,
                    &mut region[got..need],
                    a0 + got as u64,
                    path,
                    range,
                )
                .map_err(DirectError::Other)?;
                got = need;
            }
        }
        Ok((range.start - a0) as usize)
    }

    /// Fills `buf` from `offset` of the buffered descriptor; `range` is the expert bytes
    /// the read is for, named when the file ends first.
    fn read_full(
        &self,
        f: &File,
        buf: &mut [u8],
        offset: u64,
        path: &Path,
        range: &Range<u64>,
    ) -> Result<()> {
        let mut got = 0usize;
        while got < buf.len() {
            match self.read_at(f, path, &mut buf[got..], offset + got as u64) {
                Ok(0) => return Err(truncated(path, range, offset + got as u64)),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(anyhow::Error::new(e).context(format!(
                        "reading {} at offset {}",
                        path.display(),
                        offset + got as u64
                    )))
                }
            }
        }
        Ok(())
    }
}

/// Bytes a read of `range` needs in its destination: the range widened to whole
/// [`IO_ALIGN`] blocks, as direct I/O reads it.
pub fn region_len(range: &Range<u64>) -> usize {
    let a0 = range.start & !(IO_ALIGN as u64 - 1);
    round_up(range.end as usize) - a0 as usize
}

enum DirectError {
    Refused(std::io::Error),
    Other(anyhow::Error),
}

fn truncated(path: &Path, range: &Range<u64>, ends_at: u64) -> anyhow::Error {
    anyhow!(
        "{}: expert bytes {}..{} are needed but the file ends at offset {ends_at} \
         (was the shard truncated or replaced after start-up? re-download it)",
        path.display(),
        range.start,
        range.end
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn pattern_file(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        f.flush().unwrap();
        (f, data)
    }

    #[test]
    fn direct_and_buffered_reads_return_the_same_bytes_at_unaligned_ranges() {
        let (f, data) = pattern_file(3 * IO_ALIGN + 123);
        for mode in [IoMode::Direct, IoMode::Buffered] {
            let io = ShardIo::new(mode);
            for r in [
                0..10u64,
                4090..4200,
                5000..8192,
                (3 * IO_ALIGN as u64)..(3 * IO_ALIGN as u64 + 123),
                1..12411,
            ] {
                let (buf, off) = io.read(f.path(), &r).unwrap();
                let len = (r.end - r.start) as usize;
                assert_eq!(
                    &buf[off..off + len],
                    &data[r.start as usize..r.end as usize],
                    "{mode:?} {r:?}"
                );
            }
        }
    }

    #[test]
    fn reading_past_the_end_names_file_and_offset() {
        let (f, _) = pattern_file(5000);
        for mode in [IoMode::Direct, IoMode::Buffered] {
            let e = ShardIo::new(mode)
                .read(f.path(), &(4000..9000))
                .unwrap_err();
            let msg = format!("{e:#}");
            assert!(msg.contains(&f.path().display().to_string()), "{msg}");
            assert!(msg.contains("ends at offset 5000"), "{mode:?}: {msg}");
        }
    }

    #[test]
    fn probing_direct_reads_agrees_with_the_reader() {
        let (f, data) = pattern_file(2 * IO_ALIGN);
        let io = ShardIo::new(IoMode::Direct);
        let (buf, off) = io.read(f.path(), &(3..10)).unwrap();
        assert_eq!(&buf[off..off + 7], &data[3..10]);
        // A filesystem that refuses the probe makes the reader fall back, and one that takes
        // it keeps the reader direct.
        assert_eq!(probe_direct(f.path()).is_ok(), io.mode() == IoMode::Direct);
    }

    #[test]
    fn modes_name_the_os_mechanism() {
        #[cfg(target_os = "linux")]
        assert_eq!(IoMode::Direct.describe(), "direct (O_DIRECT)");
        assert!(IoMode::Buffered.describe().starts_with("buffered"));
    }

    #[test]
    fn a_shard_rewritten_in_place_after_opening_is_reported_not_read() {
        let (f, _) = pattern_file(3 * IO_ALIGN);
        // Each reader stamps the file when it first opens it.
        for mode in [IoMode::Direct, IoMode::Buffered] {
            let io = ShardIo::new(mode);
            io.read(f.path(), &(0..100)).unwrap();
            // Same size, other bytes, a later modification time: what an in-place
            // overwrite looks like.
            let h = std::fs::OpenOptions::new()
                .write(true)
                .open(f.path())
                .unwrap();
            let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
            h.set_modified(later).unwrap();
            let e = format!("{:#}", io.read(f.path(), &(0..100)).unwrap_err());
            assert!(e.contains(&f.path().display().to_string()), "{e}");
            assert!(
                e.contains("modified in place") && e.contains("offset 0"),
                "{mode:?}: {e}"
            );
        }
    }

    #[test]
    fn a_stamp_from_the_checkpoint_catches_a_change_before_the_first_read() {
        let (f, _) = pattern_file(2 * IO_ALIGN);
        let io = ShardIo::new(IoMode::Buffered);
        let mut validated = FileStamp::of_file(&std::fs::File::open(f.path()).unwrap()).unwrap();
        validated.len += 1;
        io.require_stamp(f.path(), validated).unwrap();
        let e = format!("{:#}", io.read(f.path(), &(0..10)).unwrap_err());
        assert!(e.contains("size went from"), "{e}");
    }
}
