//! Files k3 writes (synthesized shards, the weight cache, usage history, route traces,
//! dumps) go through [`AtomicFile`]: they are written under a temporary name beside their
//! destination and renamed into place only once complete and synced, so a full disk, an
//! error or a killed process never leaves a file under the real name that later loads as
//! valid. Every error names the file and the byte offset it happened at.

use anyhow::{Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Bytes buffered before a write reaches the file.
const BUFFER_BYTES: usize = 8 << 20;

/// A file being written under a temporary name; [`AtomicFile::commit`] renames it into place
/// and dropping it uncommitted removes the temporary file.
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    written: u64,
}

/// The temporary name `path` is written under until it is complete.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

impl AtomicFile {
    /// Starts writing `path` (under `path.partial` until committed).
    pub fn create(path: &Path) -> Result<Self> {
        Self::with_buffer(path, BUFFER_BYTES)
    }

    /// [`AtomicFile::create`] with a write buffer of `bytes` (many files open at once
    /// each take a small one).
    pub fn with_buffer(path: &Path, bytes: usize) -> Result<Self> {
        let tmp = partial_path(path);
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            out: Some(BufWriter::with_capacity(bytes, file)),
            written: 0,
        })
    }

    /// The destination path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Appends `bytes`; an error names the file and the offset.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(out) = self.out.as_mut() else {
            return Err(self.closed());
        };
        let (tmp, at) = (&self.tmp, self.written);
        out.write_all(bytes).with_context(|| {
            format!(
                "writing {} at byte {} (disk full?)",
                tmp.display(),
                reached(tmp, at)
            )
        })?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and syncs the file, then renames it to its destination; on failure the
    /// temporary file is removed.
    pub fn commit(mut self) -> Result<u64> {
        let out = self.out.take().ok_or_else(|| self.closed())?;
        let done = self.finish(out);
        if done.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        done
    }

    fn finish(&self, out: BufWriter<File>) -> Result<u64> {
        let at = self.written;
        let file = out.into_inner().map_err(|e| {
            anyhow::Error::new(e.into_error()).context(format!(
                "flushing {} at byte {} of {at} (disk full?)",
                self.tmp.display(),
                reached(&self.tmp, at)
            ))
        })?;
        file.sync_all()
            .with_context(|| format!("syncing {} (disk full?)", self.tmp.display()))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).with_context(|| {
            format!("renaming {} to {}", self.tmp.display(), self.path.display())
        })?;
        Ok(self.written)
    }

    fn closed(&self) -> anyhow::Error {
        anyhow::anyhow!(
            "internal: {} written after it was closed",
            self.path.display()
        )
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            // Uncommitted: the partial file must not outlive the failed write.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Where a failed write stopped: the bytes that reached `tmp` (what is buffered had not),
/// or `fallback` when its size cannot be read (`/dev/full` has none).
fn reached(tmp: &Path, fallback: u64) -> u64 {
    match std::fs::metadata(tmp) {
        Ok(m) if m.is_file() => m.len(),
        _ => fallback,
    }
}

/// Writes `bytes` to `path` through a temporary name and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_file_appears_whole_and_the_partial_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        let mut f = AtomicFile::create(&path).unwrap();
        f.write_all(b"hello ").unwrap();
        f.write_all(b"world").unwrap();
        assert!(!path.exists(), "nothing under the real name before commit");
        assert_eq!(f.commit().unwrap(), 11);
        assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
        assert!(!partial_path(&path).exists());
    }

    #[test]
    fn dropped_uncommitted_file_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.bin");
        std::fs::write(&path, b"old").unwrap();
        let mut f = AtomicFile::create(&path).unwrap();
        f.write_all(b"new but unfinished").unwrap();
        drop(f);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"old",
            "the old file is kept"
        );
        assert!(!partial_path(&path).exists());
    }

    #[test]
    fn a_failed_commit_removes_the_partial_file() {
        let dir = tempfile::tempdir().unwrap();
        // The destination is a non-empty directory: the rename fails after the sync.
        let path = dir.path().join("d");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("x"), b"x").unwrap();
        let mut f = AtomicFile::create(&path).unwrap();
        f.write_all(b"bytes").unwrap();
        let e = format!("{:#}", f.commit().unwrap_err());
        assert!(e.contains("renaming"), "{e}");
        assert!(!partial_path(&path).exists());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_device_names_the_file_and_offset() {
        // /dev/full fails every write with ENOSPC; the rename is never reached.
        let mut f = AtomicFile {
            path: PathBuf::from("/nonexistent/dest"),
            tmp: PathBuf::from("/dev/full"),
            out: Some(BufWriter::with_capacity(
                16,
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            )),
            written: 0,
        };
        f.write_all(b"0123456789").unwrap();
        let err = f.write_all(b"0123456789abcdef").unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("/dev/full") && msg.contains("at byte 10"),
            "{msg}"
        );
        // Drop would remove the temporary: keep /dev/full.
        f.out = None;
    }
}
