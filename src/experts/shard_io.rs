//! Positional reads from shard files: O_DIRECT on Linux (through a second descriptor),
//! F_NOCACHE on macOS, or buffered with a read-ahead hint.

use super::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use anyhow::{anyhow, Context, Result};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// How expert bytes are read (`K3_DIRECT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Bypass the page cache: O_DIRECT (Linux) / F_NOCACHE (macOS).
    Direct,
    /// Through the page cache, with a WILLNEED hint per expert.
    Buffered,
}

struct ShardFiles {
    buffered: File,
    direct: Option<File>,
}

/// Open shard files, shared by the loader threads.
pub struct ShardIo {
    mode: IoMode,
    files: Mutex<HashMap<PathBuf, Arc<ShardFiles>>>,
    direct_refused: AtomicBool,
}

impl ShardIo {
    /// A reader in `mode`; files are opened on first use.
    pub fn new(mode: IoMode) -> Self {
        Self {
            mode,
            files: Mutex::new(HashMap::new()),
            direct_refused: AtomicBool::new(false),
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
        let buffered =
            File::open(path).with_context(|| format!("opening expert shard {}", path.display()))?;
        let direct = if self.mode == IoMode::Direct {
            self.open_direct(path)
        } else {
            None
        };
        let f = Arc::new(ShardFiles { buffered, direct });
        map.insert(path.to_path_buf(), f.clone());
        Ok(f)
    }

    fn refuse_direct(&self, path: &Path, why: &str) {
        if !self.direct_refused.swap(true, Ordering::Relaxed) {
            eprintln!(
                "[K3] direct I/O refused on {} ({why}): falling back to buffered reads (as K3_DIRECT=0)",
                path.display()
            );
        }
    }

    #[cfg(target_os = "linux")]
    fn open_direct(&self, path: &Path) -> Option<File> {
        use std::os::unix::fs::OpenOptionsExt;
        if self.direct_refused.load(Ordering::Relaxed) {
            return None;
        }
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Some(f),
            Err(e) => {
                self.refuse_direct(path, &e.to_string());
                None
            }
        }
    }

    #[cfg(target_os = "macos")]
    fn open_direct(&self, path: &Path) -> Option<File> {
        use std::os::fd::AsRawFd;
        let f = File::open(path).ok()?;
        // SAFETY: fcntl on a descriptor we own; F_NOCACHE takes an int flag and touches no memory.
        let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
        if rc == -1 {
            self.refuse_direct(path, "F_NOCACHE failed");
            return None;
        }
        Some(f)
    }

    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    fn open_direct(&self, path: &Path) -> Option<File> {
        self.refuse_direct(path, "not supported on this OS");
        None
    }

    /// Hints the kernel to start reading `range` (buffered mode only).
    pub fn will_need(&self, path: &Path, range: &Range<u64>) {
        if self.mode() != IoMode::Buffered {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Ok(f) = self.files(path) {
            use std::os::fd::AsRawFd;
            let len = (range.end - range.start) as libc::off_t;
            // SAFETY: posix_fadvise only reads its integer arguments; the fd is open for the call.
            unsafe {
                libc::posix_fadvise(
                    f.buffered.as_raw_fd(),
                    range.start as libc::off_t,
                    len,
                    libc::POSIX_FADV_WILLNEED,
                );
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (path, range);
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
        let f = self.files(path)?;
        if let Some(direct) = &f.direct {
            if !self.direct_refused.load(Ordering::Relaxed) {
                match read_direct(direct, path, range, dst) {
                    Ok(off) => return Ok(off),
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
        read_full(&f.buffered, dst, range.start, path, len)?;
        Ok(0)
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

fn read_direct(
    f: &File,
    path: &Path,
    range: &Range<u64>,
    region: &mut [u8],
) -> std::result::Result<usize, DirectError> {
    let a0 = range.start & !(IO_ALIGN as u64 - 1);
    let region = &mut region[..region_len(range)];
    let need = (range.end - a0) as usize;
    let mut got = 0usize;
    while got < need {
        match f.read_at(&mut region[got..], a0 + got as u64) {
            Ok(0) => break,
            // A short read at the tail leaves `got` unaligned; the next read would be refused,
            // so finish the remainder (at most one block) through the loop's EOF check.
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && got == 0 => {
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
            break;
        }
    }
    if got < need {
        return Err(DirectError::Other(truncated(path, range, a0 + got as u64)));
    }
    Ok((range.start - a0) as usize)
}

fn read_full(f: &File, buf: &mut [u8], offset: u64, path: &Path, len: usize) -> Result<()> {
    let mut got = 0usize;
    while got < len {
        match f.read_at(&mut buf[got..len], offset + got as u64) {
            Ok(0) => {
                return Err(truncated(
                    path,
                    &(offset..offset + len as u64),
                    offset + got as u64,
                ))
            }
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
}
