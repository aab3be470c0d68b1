//! `down · glu(gate·x, up·x)`: layer 0's dense MLP and the fused shared experts.

use super::loader::Loader;
use crate::backend::{matmul_each, Backend, Glu};
use crate::quant::DenseFormat;
use anyhow::Result;

/// A gated MLP with its three projections.
pub struct GluMlp<B: Backend> {
    gate: B::Mat,
    up: B::Mat,
    down: B::Mat,
}

impl<B: Backend> GluMlp<B> {
    /// Loads `{prefix}gate_proj.weight`, `up_proj`, `down_proj` in format `fmt`.
    pub fn load(ld: &Loader<'_, B>, prefix: &str, fmt: DenseFormat) -> Result<Self> {
        let m = |n: &str| ld.matrix(&format!("{prefix}{n}.weight"), fmt);
        Ok(Self {
            gate: m("gate_proj")?,
            up: m("up_proj")?,
            down: m("down_proj")?,
        })
    }

    /// Applies the MLP to every row of `x`.
    pub fn forward(&self, b: &B, x: &B::Act, glu: Glu) -> Result<B::Act> {
        let [g, u] = matmul_each(b, [&self.gate, &self.up], x)?;
        b.matmul(&self.down, &b.glu(&g, &u, glu)?)
    }
}
