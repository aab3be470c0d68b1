//! Per-layer hidden-state dumps (`--trace DIR` / `K3_TRACE`) for comparing backends.

use anyhow::{Context, Result};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Appends each layer's output rows to `DIR/layer_NNN.f32` (little-endian f32, `[pos, H]`).
pub struct Trace {
    dir: PathBuf,
}

impl Trace {
    /// Creates (or empties) the trace directory.
    pub fn create(dir: &Path) -> Result<Self> {
        if dir.exists() {
            for e in
                fs::read_dir(dir).with_context(|| format!("reading trace dir {}", dir.display()))?
            {
                let p = e?.path();
                if p.extension().is_some_and(|x| x == "f32") {
                    fs::remove_file(&p).with_context(|| format!("clearing {}", p.display()))?;
                }
            }
        }
        fs::create_dir_all(dir).with_context(|| format!("creating trace dir {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// Path of layer `i`'s dump inside `dir`.
    pub fn layer_file(dir: &Path, i: usize) -> PathBuf {
        dir.join(format!("layer_{i:03}.f32"))
    }

    /// Appends rows of layer `i`'s output.
    pub fn record(&self, i: usize, rows: &[f32]) -> Result<()> {
        let path = Self::layer_file(&self.dir, i);
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        f.write_all(&bytes)
            .with_context(|| format!("writing {}", path.display()))
    }
}
