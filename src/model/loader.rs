//! Turns checkpoint tensors into backend-resident weights, each named by its schema entry
//! (a block's [`crate::checkpoint::ModelTensors`] set) and checked against it.

use super::weight_cache::{PendingWrite, WeightCache, WeightCacheSetting, WriteReport};
use crate::backend::Backend;
use crate::checkpoint::schema::{self, dense_tensors, TensorSpec};
use crate::checkpoint::{Checkpoint, Dtype, Tensor, TensorInfo};
use crate::quant::{DenseFormat, DenseMatrix};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::time::Instant;

/// How a model loads: the progress bar, the quantized-weight cache, the start-up lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Whether and where quantized matrices are cached.
    pub weight_cache: WeightCacheSetting,
    /// Print the start-up lines (load time, weight cache, repacked container) on stderr.
    pub announce: bool,
}

impl Default for LoadOptions {
    /// No bar, no cache, no lines: the library's quiet load.
    fn default() -> Self {
        Self {
            progress: false,
            weight_cache: WeightCacheSetting::Off,
            announce: false,
        }
    }
}

/// How a model's start went, for the stats lines and `--stats-json`.
pub struct Startup {
    /// Seconds from the process's start ([`crate::stats::process_start`]) to the model
    /// ready: what a user waits before the prompt is read.
    pub ready_s: f64,
    /// Of those, seconds loading the dense weights.
    pub dense_s: f64,
    /// The weight cache's words when the model was ready (`hit (…)`, `writing … in the
    /// background`, `off`, …).
    pub cache: String,
    /// The cache write left to the background, until waited for.
    pending: Option<PendingWrite>,
    /// How that write ended, once waited for.
    pub write: Option<WriteReport>,
}

impl Startup {
    /// A start that took `ready_s` (`dense_s` of it loading) and left `pending` to finish.
    pub fn new(ready_s: f64, dense_s: f64, cache: String, pending: Option<PendingWrite>) -> Self {
        Self {
            ready_s,
            dense_s,
            cache,
            pending,
            write: None,
        }
    }

    /// Waits for a cache write still under way (printing its progress when the load was
    /// announced) and returns how it ended; `None` when the start wrote no cache.
    pub fn wait_for_cache_write(&mut self) -> Option<&WriteReport> {
        if let Some(p) = self.pending.take() {
            self.write = Some(p.wait());
        }
        self.write.as_ref()
    }

    /// Whether a cache write is still under way.
    pub fn writing(&self) -> bool {
        self.pending.as_ref().is_some_and(|p| !p.is_done())
    }

    /// `[K3] start-up: ready in Rs (dense weights Ds) | weight cache: …`
    pub fn line(&self) -> String {
        let cache = match &self.write {
            Some(w) if w.built => format!(
                "{} in {:.1}s ({:.1}s after ready, {:.1}s waited for)",
                w.line, w.write_s, w.after_ready_s, w.waited_s
            ),
            Some(w) => w.line.clone(),
            None => self.cache.clone(),
        };
        format!(
            "[K3] start-up: ready in {:.1}s (dense weights {:.1}s) | weight cache: {cache}",
            self.ready_s, self.dense_s
        )
    }

    /// The start's figures for `--stats-json`.
    pub fn json(&self) -> serde_json::Value {
        let write = self.write.as_ref().map(|w| {
            serde_json::json!({
                "built": w.built,
                "bytes": w.bytes,
                "write_s": w.write_s,
                "after_ready_s": w.after_ready_s,
                "waited_s": w.waited_s,
                "state": w.line,
            })
        });
        serde_json::json!({
            "ready_s": self.ready_s,
            "dense_load_s": self.dense_s,
            "weight_cache": self.cache,
            "weight_cache_write": write,
        })
    }
}

/// Loads tensors from a checkpoint into a backend, with a progress bar in bytes.
pub struct Loader<'a, B: Backend> {
    /// The snapshot being loaded.
    pub ckpt: &'a Checkpoint,
    /// Where the weights go.
    pub backend: &'a B,
    bar: ProgressBar,
    cache: RefCell<WeightCache>,
    started: Instant,
    /// Matrices of a repacked container loaded as stored: int8, int4.
    container: Cell<(usize, usize)>,
    /// The tensors read or checked so far ([`Self::unread`]).
    read: RefCell<HashSet<String>>,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// Prepares a loader without a weight cache; `progress` shows a bar on stderr.
    pub fn new(ckpt: &'a Checkpoint, backend: &'a B, progress: bool) -> Self {
        Self::with_cache(ckpt, backend, progress, WeightCache::off())
    }

    /// Prepares a loader that takes quantized matrices from `cache` or records them there.
    pub fn with_cache(
        ckpt: &'a Checkpoint,
        backend: &'a B,
        progress: bool,
        cache: WeightCache,
    ) -> Self {
        let bar = if progress {
            let total: u64 = dense_tensors(&ckpt.config)
                .iter()
                .map(|s| s.byte_len() as u64)
                .sum();
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "[K3] loading dense weights {bar:40} {binary_bytes}/{binary_total_bytes} {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        Self {
            ckpt,
            backend,
            bar,
            cache: RefCell::new(cache),
            started: Instant::now(),
            container: Cell::new((0, 0)),
            read: RefCell::default(),
        }
    }

    /// The stored tensor of `spec`, checked against it, not read.
    fn stored(&self, spec: &TensorSpec) -> Result<TensorInfo<'a>> {
        self.read.borrow_mut().insert(spec.name.clone());
        self.ckpt.tensor_spec_info(spec)
    }

    /// The stored tensor of `spec`, checked against it and read.
    fn view(&self, spec: &TensorSpec) -> Result<Tensor> {
        self.stored(spec)?;
        let t = self.ckpt.tensor(&spec.name)?;
        self.bar.inc(t.bytes.len() as u64);
        Ok(t)
    }

    /// Checks a tensor's stored dtype and shape against its spec without reading it.
    pub fn check_stored(&self, spec: &TensorSpec) -> Result<()> {
        self.stored(spec).map(|_| ())
    }

    /// The schema's dense tensors this loader has not read or checked. A loaded model has
    /// read them all, as the schema is the blocks' own tensor sets; one left over would be
    /// a tensor the checkpoint must hold for nothing.
    pub fn unread(&self) -> Vec<String> {
        let read = self.read.borrow();
        dense_tensors(&self.ckpt.config)
            .into_iter()
            .map(|s| s.name)
            .filter(|n| !read.contains(n))
            .collect()
    }

    /// A vector (norm weight, bias) widened to f32.
    pub fn vector(&self, spec: &TensorSpec) -> Result<Vec<f32>> {
        self.view(spec)?.to_f32()
    }

    /// A vector whose values decide something (the router's bias picks experts): a NaN or
    /// infinity there still gives finite-looking outputs, so it is refused at load.
    pub fn decision_vector(&self, spec: &TensorSpec) -> Result<Vec<f32>> {
        let view = self.view(spec)?;
        let v = view.to_f32()?;
        refuse_non_finite(&spec.name, &v, &view.file)?;
        Ok(v)
    }

    /// [`Self::matrix`] for a matrix whose products decide something (the router's gate):
    /// its stored values are checked for NaN and infinity before it loads.
    pub fn decision_matrix(&self, spec: &TensorSpec, fmt: DenseFormat) -> Result<B::Mat> {
        // A repacked container's U8 values have finite-checked scales (schema.rs).
        if self.stored(spec)?.dtype != Dtype::U8 {
            let view = self.ckpt.tensor(&spec.name)?;
            refuse_non_finite(&spec.name, &view.to_f32()?, &view.file)?;
        }
        self.matrix(spec, fmt)
    }

    /// A vector uploaded as a `[1, len]` activation.
    pub fn vector_act(&self, spec: &TensorSpec) -> Result<B::Act> {
        let v = self.vector(spec)?;
        self.backend.upload(&v, 1, v.len())
    }

    /// The elementwise product of two vectors, uploaded (AttnRes `norm ⊙ proj`).
    pub fn product_act(&self, a: &TensorSpec, b: &TensorSpec) -> Result<B::Act> {
        let (x, y) = (self.vector(a)?, self.vector(b)?);
        let p: Vec<f32> = x.iter().zip(&y).map(|(u, v)| u * v).collect();
        self.backend.upload(&p, 1, p.len())
    }

    /// A 2-D matrix in host memory, converted to `fmt`: from the weight cache when it holds
    /// it, else quantized (and recorded in the cache). A matrix a repacked container stores
    /// pre-quantized loads as stored (see `Self::container_matrix`).
    pub fn host_matrix(&self, spec: &TensorSpec, fmt: DenseFormat) -> Result<DenseMatrix> {
        let name = spec.name.as_str();
        self.read.borrow_mut().insert(spec.name.clone());
        if self.ckpt.tensor_info(name)?.dtype == Dtype::U8 {
            let stored = self.ckpt.tensor(name)?;
            self.bar.inc(stored.bytes.len() as u64);
            return self.container_matrix(spec, &stored, fmt);
        }
        let info = self.stored(spec)?;
        let (rows, cols) = match *info.shape {
            [r, c] => (r, c),
            _ => bail!(
                "tensor {name} in {}: expected 2 dimensions, found {:?}",
                info.file.display(),
                info.shape
            ),
        };
        let cached = WeightCache::holds(fmt);
        if cached {
            if let Some(m) = self.cache.borrow_mut().take(name, fmt, rows, cols) {
                self.bar.inc(info.byte_len as u64);
                return Ok(m);
            }
        }
        // Read only now: a cache hit never reads the shard's bytes.
        let v = self.view(spec)?;
        let m = if v.dtype == Dtype::Bf16 {
            DenseMatrix::from_bf16_bytes(rows, cols, &v.bytes, fmt)
        } else {
            DenseMatrix::from_bf16(rows, cols, v.to_bf16_bits()?, fmt)
        }
        .with_context(|| format!("converting {name} to {fmt:?}"))?;
        if cached {
            self.cache.borrow_mut().store(name, &m);
        }
        Ok(m)
    }

    /// A matrix of the C engine's repacked container: `U8` values with a `<name>.qs` f32
    /// scale tensor, int8 per row or int4 in groups of 64 (docs/model.md, load-time
    /// formats). It loads in the format it is stored in, whatever `fmt` asks, except that a
    /// matrix wanted in f32 (MLA's `kv_b_proj`, split on the host) is widened from it.
    fn container_matrix(
        &self,
        spec: &TensorSpec,
        q: &Tensor,
        fmt: DenseFormat,
    ) -> Result<DenseMatrix> {
        let scale_name = format!("{}.qs", spec.name);
        let s = self.ckpt.tensor(&scale_name).with_context(|| {
            format!(
                "{}: tensor `{}` is U8 (pre-quantized) but its scales `{scale_name}` are missing",
                q.file.display(),
                spec.name
            )
        })?;
        let m = schema::container_matrix(spec, &q.shape, &q.bytes, s.dtype, &s.shape, &s.bytes)
            .with_context(|| format!("{}: repacked tensor `{}`", q.file.display(), spec.name))?;
        let (i8s, i4s) = self.container.get();
        self.container.set(match m.format() {
            DenseFormat::Int8 => (i8s + 1, i4s),
            _ => (i8s, i4s + 1),
        });
        if fmt == DenseFormat::F32 {
            let (rows, cols) = (m.rows, m.cols);
            return DenseMatrix::from_f32(rows, cols, m.dequantize(), DenseFormat::F32);
        }
        Ok(m)
    }

    /// A 2-D matrix made resident in the backend in format `fmt`.
    pub fn matrix(&self, spec: &TensorSpec, fmt: DenseFormat) -> Result<B::Mat> {
        let m = self.host_matrix(spec, fmt)?;
        self.backend.load_matrix(m)
    }

    /// Closes the progress bar and completes the weight cache, waiting for its write;
    /// returns the start-up lines (the dense load's time and the weight cache's state, then
    /// any notes).
    pub fn finish(&self) -> Vec<String> {
        let (mut lines, _, pending) = self.finish_in_background(false);
        if let Some(p) = pending {
            let r = p.wait();
            lines[0] = format!("{} | weight cache: {}", self.loaded_line(), r.line);
        }
        lines
    }

    /// Closes the progress bar and hands a weight cache still being written to the
    /// returned [`PendingWrite`] (the model is ready; the file is finished while it runs;
    /// `announce`: its progress and outcome go to stderr); returns the start-up lines and
    /// the weight cache's words among them.
    pub fn finish_in_background(
        &self,
        announce: bool,
    ) -> (Vec<String>, String, Option<PendingWrite>) {
        self.bar.finish_and_clear();
        let cache = self.cache.replace(WeightCache::off());
        let (state, notes, pending) = cache.finish_in_background(announce);
        let mut lines = vec![format!("{} | weight cache: {state}", self.loaded_line())];
        let (i8s, i4s) = self.container.get();
        if i8s + i4s > 0 {
            lines.push(format!(
                "[K3] repacked container: {} matrices loaded as stored ({i8s} int8 per row, \
                 {i4s} int4 g64); K3_BITS / K3_MLA_BITS / K3_HEAD_BITS do not apply to them",
                i8s + i4s
            ));
        }
        lines.extend(notes);
        (lines, state, pending)
    }

    /// Seconds since the loader was made.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn loaded_line(&self) -> String {
        format!("[K3] dense weights loaded in {:.1}s", self.elapsed_s())
    }
}

/// Refuses a tensor holding NaN or infinity, naming it, its shard and the first such index.
fn refuse_non_finite(name: &str, values: &[f32], file: &std::path::Path) -> Result<()> {
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        bail!(
            "{}: tensor `{name}` holds {} at element {i}: the router would choose experts \
             from it; the checkpoint is corrupt (re-download the shard)",
            file.display(),
            values[i]
        );
    }
    Ok(())
}
