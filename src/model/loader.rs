//! Turns checkpoint tensors into backend-resident weights, checked against the schema.

use crate::backend::Backend;
use crate::checkpoint::schema::{dense_tensors, TensorSpec};
use crate::checkpoint::Checkpoint;
use crate::quant::{DenseFormat, DenseMatrix};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::HashMap;

/// Loads named tensors from a checkpoint into a backend, with a progress bar in bytes.
pub struct Loader<'a, B: Backend> {
    /// The snapshot being loaded.
    pub ckpt: &'a Checkpoint,
    /// Where the weights go.
    pub backend: &'a B,
    specs: HashMap<String, TensorSpec>,
    bar: ProgressBar,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// Prepares a loader; `progress` shows a bar on stderr.
    pub fn new(ckpt: &'a Checkpoint, backend: &'a B, progress: bool) -> Self {
        let specs: HashMap<String, TensorSpec> = dense_tensors(&ckpt.config)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
        let bar = if progress {
            let total: u64 = specs.values().map(|s| s.byte_len() as u64).sum();
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
            specs,
            bar,
        }
    }

    fn view(&self, name: &str) -> Result<crate::checkpoint::TensorView<'a>> {
        let spec = match self.specs.get(name) {
            Some(s) => s,
            None => bail!("internal: tensor {name} is not in the K3 schema"),
        };
        let v = self.ckpt.tensor_spec(spec)?;
        self.bar.inc(v.bytes.len() as u64);
        Ok(v)
    }

    /// A vector (norm weight, bias) widened to f32.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        self.view(name)?.to_f32()
    }

    /// A vector uploaded as a `[1, len]` activation.
    pub fn vector_act(&self, name: &str) -> Result<B::Act> {
        let v = self.vector(name)?;
        self.backend.upload(&v, 1, v.len())
    }

    /// The elementwise product of two vectors, uploaded (AttnRes `norm ⊙ proj`).
    pub fn product_act(&self, a: &str, b: &str) -> Result<B::Act> {
        let (x, y) = (self.vector(a)?, self.vector(b)?);
        let p: Vec<f32> = x.iter().zip(&y).map(|(u, v)| u * v).collect();
        self.backend.upload(&p, 1, p.len())
    }

    /// A 2-D matrix in host memory, converted to `fmt`.
    pub fn host_matrix(&self, name: &str, fmt: DenseFormat) -> Result<DenseMatrix> {
        let v = self.view(name)?;
        let (rows, cols) = match *v.shape {
            [r, c] => (r, c),
            _ => bail!(
                "tensor {name} in {}: expected 2 dimensions, found {:?}",
                v.file.display(),
                v.shape
            ),
        };
        let m = if v.dtype == crate::checkpoint::Dtype::Bf16 {
            DenseMatrix::from_bf16_bytes(rows, cols, v.bytes, fmt)
        } else {
            DenseMatrix::from_bf16(rows, cols, v.to_bf16_bits()?, fmt)
        };
        m.with_context(|| format!("converting {name} to {fmt:?}"))
    }

    /// A 2-D matrix made resident in the backend in format `fmt`.
    pub fn matrix(&self, name: &str, fmt: DenseFormat) -> Result<B::Mat> {
        let m = self.host_matrix(name, fmt)?;
        self.backend.load_matrix(m)
    }

    /// Closes the progress bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
