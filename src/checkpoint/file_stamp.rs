//! A shard file's identity when it was opened — size, modification time, device and inode,
//! and the inode's change time — so that a shard replaced, truncated or rewritten while the
//! engine runs is reported instead of read: its tensor offsets were validated against the
//! file as it was. The change time matters because a rewrite can restore the modification
//! time (`touch -r`, `cp -p`, `rsync -t`), but the kernel sets the change time on every
//! write and metadata change and no call sets it back.

use anyhow::{Context, Result};
use std::fs::{File, Metadata};
use std::path::Path;
use std::time::SystemTime;

/// Size, modification time and (where the OS has them) inode and change time of an open file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    /// Bytes.
    pub len: u64,
    /// Last modification, where the filesystem records one.
    pub modified: Option<SystemTime>,
    /// Device and inode (Unix), volume and file index (Windows): another file renamed over
    /// the path has other ones.
    pub id: Option<(u64, u64)>,
    /// The change time: the inode's in seconds and nanoseconds (Unix), the file's in
    /// 100-nanosecond ticks (Windows).
    pub changed: Option<(i64, i64)>,
}

impl FileStamp {
    /// The stamp of `meta`, the metadata of a file or path. On Windows it holds no identity
    /// or change time: [`FileStamp::of_file`] reads those from an open handle.
    pub fn of(meta: &Metadata) -> FileStamp {
        #[cfg(unix)]
        let (id, changed) = {
            use std::os::unix::fs::MetadataExt;
            (
                Some((meta.dev(), meta.ino())),
                Some((meta.ctime(), meta.ctime_nsec())),
            )
        };
        #[cfg(not(unix))]
        let (id, changed) = (None, None);
        FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
            id,
            changed,
        }
    }

    /// The stamp of the open file `f`, with its identity and change time on every OS.
    pub fn of_file(f: &File) -> std::io::Result<FileStamp> {
        let stamp = FileStamp::of(&f.metadata()?);
        #[cfg(windows)]
        let stamp = {
            let (id, changed) = crate::platform::file_identity::of_handle(f);
            FileStamp {
                id,
                changed,
                ..stamp
            }
        };
        Ok(stamp)
    }

    /// The stamp of whatever file is at `path` now. On Unix its metadata (opening a FIFO
    /// put there would block); on Windows an open handle, the only way to its identity.
    fn of_path(path: &Path) -> std::io::Result<FileStamp> {
        #[cfg(windows)]
        return FileStamp::of_file(&File::open(path)?);
        #[cfg(not(windows))]
        return std::fs::metadata(path).map(|m| FileStamp::of(&m));
    }

    /// What differs between this stamp and `now`, in a few words; `None` when nothing does.
    fn difference(&self, now: &FileStamp) -> Option<String> {
        if now.id != self.id {
            Some("another file was put in its place".to_string())
        } else if now.len != self.len {
            Some(format!(
                "its size went from {} to {} bytes",
                self.len, now.len
            ))
        } else if now.modified != self.modified || now.changed != self.changed {
            Some("it was modified in place".to_string())
        } else {
            None
        }
    }

    /// Fails, naming `path` and the `offset` just read, when `now` differs from this stamp.
    pub fn check(&self, path: &Path, offset: u64, now: &FileStamp) -> Result<()> {
        match self.difference(now) {
            None => Ok(()),
            Some(what) => Err(changed(path, offset, &what)),
        }
    }

    /// Fails, naming `path` and the `offset` just read, unless both the open file `f` and
    /// the file at `path` still have this stamp: the first catches a write or truncation,
    /// the second a file renamed over the path or the path removed (what a re-download
    /// does), whose new bytes other readers would open.
    pub fn check_file(&self, f: &File, path: &Path, offset: u64) -> Result<()> {
        // The path first: a file renamed over it or removed also changes the open file's
        // change time (its link count), which would read as an edit.
        match FileStamp::of_path(path) {
            Ok(now) => self.check(path, offset, &now)?,
            Err(e) => {
                let what = format!("it is gone from its path ({e})");
                return Err(changed(path, offset, &what));
            }
        }
        let now = FileStamp::of_file(f)
            .with_context(|| format!("{}: cannot read the shard's size", path.display()))?;
        self.check(path, offset, &now)
    }
}

/// The error of a shard that changed under a running engine.
fn changed(path: &Path, offset: u64, what: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{}: the shard changed while k3 was running ({what}); the bytes read at offset \
         {offset} are not used. Restart k3 once the file is complete",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_that_restores_the_modification_time_is_still_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.safetensors");
        std::fs::write(&p, [1u8; 64]).unwrap();
        let f = File::open(&p).unwrap();
        let stamp = FileStamp::of_file(&f).unwrap();
        stamp.check_file(&f, &p, 0).unwrap();
        let was = stamp.modified.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&p, [2u8; 64]).unwrap();
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(was)
            .unwrap();
        let e = format!("{:#}", stamp.check_file(&f, &p, 8).unwrap_err());
        assert!(
            e.contains("changed while k3 was running (it was modified in place)")
                && e.contains("offset 8"),
            "{e}"
        );
    }

    #[test]
    fn a_file_renamed_over_the_path_or_removed_is_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.safetensors");
        std::fs::write(&p, [1u8; 64]).unwrap();
        let f = File::open(&p).unwrap();
        let stamp = FileStamp::of_file(&f).unwrap();
        let tmp = dir.path().join("new");
        std::fs::write(&tmp, [1u8; 64]).unwrap();
        match std::fs::rename(&tmp, &p) {
            Ok(()) => {}
            // A Windows without POSIX rename semantics (Wine's) keeps an open file in
            // place: the change cannot happen there.
            Err(e) if cfg!(windows) && e.kind() == std::io::ErrorKind::PermissionDenied => return,
            Err(e) => panic!("rename over the shard: {e}"),
        }
        let e = format!("{:#}", stamp.check_file(&f, &p, 0).unwrap_err());
        assert!(e.contains("another file was put in its place"), "{e}");
        std::fs::remove_file(&p).unwrap();
        let e = format!("{:#}", stamp.check_file(&f, &p, 0).unwrap_err());
        assert!(e.contains("it is gone from its path"), "{e}");
    }
}
