//! A shard file's size and modification time when it was opened, so that a shard replaced,
//! truncated or rewritten while the engine runs is reported instead of read: its tensor
//! offsets were validated against the file as it was.

use anyhow::{bail, Result};
use std::fs::Metadata;
use std::path::Path;
use std::time::SystemTime;

/// Size and modification time of an open file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    /// Bytes.
    pub len: u64,
    /// Last modification, where the filesystem records one.
    pub modified: Option<SystemTime>,
}

impl FileStamp {
    /// The stamp of `meta`.
    pub fn of(meta: &Metadata) -> FileStamp {
        FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
        }
    }

    /// Fails, naming `path` and the `offset` just read, when `now` differs from this stamp.
    pub fn check(&self, path: &Path, offset: u64, now: &FileStamp) -> Result<()> {
        let what = if now.len != self.len {
            format!("its size went from {} to {} bytes", self.len, now.len)
        } else if now.modified != self.modified {
            "it was modified in place".to_string()
        } else {
            return Ok(());
        };
        bail!(
            "{}: the shard changed while k3 was running ({what}); the bytes read at offset \
             {offset} are not used. Restart k3 once the file is complete",
            path.display()
        )
    }
}
