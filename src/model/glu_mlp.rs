//! `down · glu(gate·x, up·x)`: layer 0's dense MLP and the fused shared experts.

use super::loader::Loader;
use crate::backend::{matmul_each, Backend, Glu};
use crate::checkpoint::model_tensors::GluTensors;
use crate::quant::DenseFormat;
use anyhow::Result;

/// A gated MLP with its three projections.
pub(crate) struct GluMlp<B: Backend> {
    gate: B::Mat,
    up: B::Mat,
    down: B::Mat,
}

impl<B: Backend> GluMlp<B> {
    /// Loads the three projections of `t` in format `fmt`.
    pub(crate) fn load(ld: &Loader<'_, B>, t: &GluTensors, fmt: DenseFormat) -> Result<Self> {
        Ok(Self {
            gate: ld.matrix(&t.gate, fmt)?,
            up: ld.matrix(&t.up, fmt)?,
            down: ld.matrix(&t.down, fmt)?,
        })
    }

    /// Applies the MLP to every row of `x`.
    pub(crate) fn forward(&self, b: &B, x: &B::Act, glu: Glu) -> Result<B::Act> {
        let [g, u] = matmul_each(b, [&self.gate, &self.up], x)?;
        b.matmul(&self.down, &b.glu(&g, &u, glu)?)
    }
}
