//! Reads an expert's six tensors straight from its shard: one read when they are
//! contiguous, six otherwise. The foundation path, with no cache in front of it.

use crate::backend::ExpertWeights;
use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::quant::Mxfp4View;
use anyhow::{anyhow, Context, Result};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

/// One expert's bytes in host memory, with where each of its six tensors starts.
#[derive(Clone, Debug)]
pub struct LoadedExpert {
    /// The expert's id within its layer.
    pub id: u32,
    buf: Vec<u8>,
    parts: [Range<usize>; 6],
}

impl LoadedExpert {
    /// Bytes held.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True when no bytes are held.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Views the bytes as the expert's three MXFP4 matrices.
    pub fn weights(&self, cfg: &Config) -> Result<ExpertWeights<'_>> {
        let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
        let p = |k: usize| &self.buf[self.parts[k].clone()];
        Ok(ExpertWeights {
            w1: Mxfp4View::new(i, d, p(0), p(1)).context("expert w1")?,
            w2: Mxfp4View::new(d, i, p(2), p(3)).context("expert w2")?,
            w3: Mxfp4View::new(i, d, p(4), p(5)).context("expert w3")?,
        })
    }
}

/// Reads experts with positional reads on shared file handles.
pub struct DirectReader {
    files: Mutex<HashMap<usize, Arc<File>>>,
}

impl Default for DirectReader {
    fn default() -> Self {
        Self::new()
    }
}

impl DirectReader {
    /// A reader with no files opened yet.
    pub fn new() -> Self {
        Self { files: Mutex::new(HashMap::new()) }
    }

    fn file(&self, ck: &Checkpoint, shard: usize) -> Result<Arc<File>> {
        let mut files = self.files.lock().map_err(|_| anyhow!("expert file table poisoned"))?;
        if let Some(f) = files.get(&shard) {
            return Ok(f.clone());
        }
        let path = ck.shard_path(shard);
        let f = Arc::new(
            File::open(path).with_context(|| format!("opening expert shard {}", path.display()))?,
        );
        files.insert(shard, f.clone());
        Ok(f)
    }

    /// Reads expert `e` of layer `layer`.
    pub fn read(&self, ck: &Checkpoint, layer: usize, e: u32) -> Result<LoadedExpert> {
        let loc = ck.experts().get(layer, e as usize).ok_or_else(|| {
            anyhow!("expert {e} of layer {layer} is not in the checkpoint's expert table")
        })?;
        let file = self.file(ck, loc.shard)?;
        let path = ck.shard_path(loc.shard);
        let span = loc.span();
        let mut parts: [Range<usize>; 6] = Default::default();
        let buf = if loc.contiguous {
            let mut buf = vec![0u8; (span.end - span.start) as usize];
            read_at(&file, &mut buf, span.start, path)?;
            for (p, r) in parts.iter_mut().zip(&loc.parts) {
                *p = (r.start - span.start) as usize..(r.end - span.start) as usize;
            }
            buf
        } else {
            let total: u64 = loc.parts.iter().map(|r| r.end - r.start).sum();
            let mut buf = vec![0u8; total as usize];
            let mut at = 0usize;
            for (p, r) in parts.iter_mut().zip(&loc.parts) {
                let len = (r.end - r.start) as usize;
                read_at(&file, &mut buf[at..at + len], r.start, path)?;
                *p = at..at + len;
                at += len;
            }
            buf
        };
        Ok(LoadedExpert { id: e, buf, parts })
    }
}

fn read_at(f: &File, buf: &mut [u8], offset: u64, path: &std::path::Path) -> Result<()> {
    f.read_exact_at(buf, offset).with_context(|| {
        format!(
            "reading {} expert bytes at offset {offset} of {} (was the shard truncated or replaced?)",
            buf.len(),
            path.display()
        )
    })
}
