//! Per-layer hidden-state dumps (`--trace DIR` / `K3_TRACE`) for comparing backends.

use crate::atomic_file::AtomicFile;
use anyhow::{anyhow, bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Write buffer of each layer's file: a trace holds one open file per layer.
const LAYER_BUFFER_BYTES: usize = 64 << 10;

/// Appends each layer's output rows to `DIR/layer_NNN.f32` (little-endian f32, `[pos, H]`).
/// The files are written under temporary names ([`AtomicFile`]) and appear under their
/// real names at [`Trace::finish`]; a failed write (a full disk) discards the whole trace,
/// so no layer file that stops short is ever left to compare against.
pub struct Trace {
    dir: PathBuf,
    files: Mutex<Files>,
}

#[derive(Default)]
struct Files {
    /// Layer `i`'s file at index `i`, opened on its first record.
    open: Vec<Option<AtomicFile>>,
    /// Why the trace was discarded, once a write failed.
    failed: Option<String>,
    /// Set by [`Trace::finish`]: later records are refused.
    finished: bool,
}

impl Trace {
    /// Creates (or empties) the trace directory.
    pub fn create(dir: &Path) -> Result<Self> {
        if dir.exists() {
            for e in
                fs::read_dir(dir).with_context(|| format!("reading trace dir {}", dir.display()))?
            {
                let p = e?.path();
                // A killed run's temporary files go too.
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                if name.ends_with(".f32") || name.ends_with(".f32.partial") {
                    fs::remove_file(&p).with_context(|| format!("clearing {}", p.display()))?;
                }
            }
        }
        fs::create_dir_all(dir).with_context(|| format!("creating trace dir {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            files: Mutex::default(),
        })
    }

    /// Path of layer `i`'s dump inside `dir`.
    pub fn layer_file(dir: &Path, i: usize) -> PathBuf {
        dir.join(format!("layer_{i:03}.f32"))
    }

    fn lock(&self) -> Result<MutexGuard<'_, Files>> {
        self.files
            .lock()
            .map_err(|_| anyhow!("trace {} poisoned", self.dir.display()))
    }

    /// Appends rows of layer `i`'s output.
    pub fn record(&self, i: usize, rows: &[f32]) -> Result<()> {
        let mut files = self.lock()?;
        if let Some(why) = &files.failed {
            bail!("trace {} was discarded: {why}", self.dir.display());
        }
        if files.finished {
            bail!(
                "internal: trace {} recorded after it finished",
                self.dir.display()
            );
        }
        if files.open.len() <= i {
            files.open.resize_with(i + 1, || None);
        }
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        let wrote = match &mut files.open[i] {
            Some(f) => f.write_all(&bytes),
            slot @ None => {
                AtomicFile::with_buffer(&Self::layer_file(&self.dir, i), LAYER_BUFFER_BYTES)
                    .and_then(|mut f| {
                        let r = f.write_all(&bytes);
                        *slot = Some(f);
                        r
                    })
            }
        };
        if let Err(e) = wrote {
            // Dropping the open files removes their temporary names.
            files.open.clear();
            files.failed = Some(format!("{e:#}"));
            return Err(e.context(format!("tracing layer {i} to {}", self.dir.display())));
        }
        Ok(())
    }

    /// Syncs every layer's file and renames it into place; returns how many there are.
    /// A trace whose write failed reports that failure here too.
    pub fn finish(&self) -> Result<usize> {
        let mut files = self.lock()?;
        if let Some(why) = &files.failed {
            bail!("trace {} was discarded: {why}", self.dir.display());
        }
        files.finished = true;
        let open = std::mem::take(&mut files.open);
        let mut placed: Vec<PathBuf> = Vec::new();
        for f in open.into_iter().flatten() {
            let path = f.path().to_path_buf();
            if let Err(e) = f.commit() {
                files.failed = Some(format!("{e:#}"));
                // The layers already renamed into place would be a trace that stops at a
                // layer: they go too, and what cannot be removed is named.
                let left: Vec<String> = placed
                    .iter()
                    .filter(|p| fs::remove_file(p).is_err())
                    .map(|p| p.display().to_string())
                    .collect();
                let what = if left.is_empty() {
                    "the trace is discarded".to_string()
                } else {
                    format!(
                        "the trace is discarded, but these remain: {}",
                        left.join(", ")
                    )
                };
                return Err(e.context(format!("finishing trace {}: {what}", self.dir.display())));
            }
            placed.push(path);
        }
        Ok(placed.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_files_appear_whole_at_finish() {
        let dir = tempfile::tempdir().unwrap();
        let t = Trace::create(dir.path()).unwrap();
        t.record(0, &[1.0, 2.0]).unwrap();
        t.record(1, &[3.0]).unwrap();
        t.record(0, &[4.0]).unwrap();
        assert!(!Trace::layer_file(dir.path(), 0).exists());
        assert_eq!(t.finish().unwrap(), 2);
        let bytes = std::fs::read(Trace::layer_file(dir.path(), 0)).unwrap();
        let want: Vec<u8> = [1.0f32, 2.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(bytes, want);
        assert!(t.record(0, &[5.0]).is_err(), "no record after finish");
    }

    #[test]
    fn a_layer_that_fails_at_finish_takes_the_layers_already_in_place_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let t = Trace::create(dir.path()).unwrap();
        t.record(0, &[1.0]).unwrap();
        t.record(1, &[2.0]).unwrap();
        // Layer 1 cannot be renamed into place: a directory holds its name.
        let blocker = Trace::layer_file(dir.path(), 1);
        std::fs::create_dir(&blocker).unwrap();
        std::fs::write(blocker.join("x"), b"x").unwrap();
        let e = format!("{:#}", t.finish().unwrap_err());
        assert!(e.contains("the trace is discarded"), "{e}");
        assert!(
            !Trace::layer_file(dir.path(), 0).exists(),
            "layer 0 was left"
        );
        assert!(crate::atomic_file::partials_of(&blocker).is_empty());
    }

    #[test]
    fn a_trace_dropped_unfinished_leaves_no_layer_files() {
        let dir = tempfile::tempdir().unwrap();
        let t = Trace::create(dir.path()).unwrap();
        t.record(0, &[1.0]).unwrap();
        drop(t);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
