//! A conversation's state copied to host memory and back, for the prompt cache: every KDA
//! layer's recurrent state and every MLA layer's latent cache, in the backend-neutral
//! layouts of [`Backend::kda_state_read`] and [`Backend::mla_cache_read`]. The attention
//! residuals mix a token's own layer outputs only, so nothing else crosses tokens.

use super::k3::LayerState;
use super::kda::Kda;
use super::mla::Mla;
use super::{K3Model, State};
use crate::backend::Backend;
use crate::config::AttnKind;
use anyhow::{ensure, Result};

/// What this model's states look like: an entry must match it before any of it is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateShape {
    /// Logits after a token (the vocabulary).
    pub vocab: usize,
    /// Every layer's state, in layer order.
    pub layers: Vec<LayerShape>,
}

/// One layer's state as this model holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerShape {
    /// A KDA layer: this many values whatever the length.
    Kda(usize),
    /// An MLA layer: this many values per cached position.
    Mla(usize),
}

/// One layer's state on the host.
#[derive(Clone, Debug, PartialEq)]
pub enum HostLayer {
    /// A KDA layer's histories and delta-rule state.
    Kda(Vec<f32>),
    /// An MLA layer's cached positions, `kv_lora + rope` values each.
    Mla(Vec<f32>),
}

impl HostLayer {
    /// The layer's values.
    pub fn values(&self) -> &[f32] {
        match self {
            HostLayer::Kda(v) | HostLayer::Mla(v) => v,
        }
    }
}

/// The state after `pos` tokens, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostState {
    /// Tokens consumed.
    pub pos: usize,
    /// Every layer's state, in layer order.
    pub layers: Vec<HostLayer>,
}

impl HostState {
    /// Bytes of its values.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.values().len() * 4).sum()
    }
}

impl<B: Backend> K3Model<B> {
    /// What this model's states look like on the host: its vocabulary and, per layer, a
    /// KDA state's values or an MLA cache's values per position.
    pub fn state_shape(&self) -> StateShape {
        let cfg = &self.ckpt.config;
        let (kda, mla) = (Kda::<B>::dims(cfg), Mla::<B>::dims(cfg));
        // The three convolution histories, then the delta-rule state of every head.
        let kda_values = 3 * kda.conv_k.saturating_sub(1) * kda.width()
            + kda.heads * kda.head_dim * kda.head_dim;
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Kda => LayerShape::Kda(kda_values),
                AttnKind::Mla => LayerShape::Mla(mla.kv_lora + mla.rope),
            })
            .collect();
        StateShape {
            vocab: cfg.vocab_size,
            layers,
        }
    }

    /// Copies `st` to the host.
    pub fn state_to_host(&self, st: &State<B>) -> Result<HostState> {
        let layers = st
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Kda(s) => HostLayer::Kda(self.backend.kda_state_read(s)?),
                    LayerState::Mla(c) => HostLayer::Mla(self.backend.mla_cache_read(c)?),
                })
            })
            .collect::<Result<_>>()?;
        Ok(HostState {
            pos: st.pos,
            layers,
        })
    }

    /// A state made from `h`, checked against this model's layer kinds and shapes.
    pub fn state_from_host(&self, h: &HostState) -> Result<State<B>> {
        let cfg = &self.ckpt.config;
        ensure!(
            h.layers.len() == cfg.layer_kinds.len(),
            "a saved state of {} layers does not fit this model's {}",
            h.layers.len(),
            cfg.layer_kinds.len()
        );
        let (kda, mla) = (Kda::<B>::dims(cfg), Mla::<B>::dims(cfg));
        let row = mla.kv_lora + mla.rope;
        let layers = h
            .layers
            .iter()
            .zip(&cfg.layer_kinds)
            .enumerate()
            .map(|(i, (l, kind))| {
                Ok(match (l, kind) {
                    (HostLayer::Kda(v), AttnKind::Kda) => {
                        LayerState::Kda(self.backend.kda_state_write(&kda, v)?)
                    }
                    (HostLayer::Mla(v), AttnKind::Mla) => {
                        ensure!(
                            v.len() == h.pos * row,
                            "a saved MLA cache of layer {i} holds {} values, not {} positions of {row}",
                            v.len(),
                            h.pos
                        );
                        LayerState::Mla(self.backend.mla_cache_write(&mla, v)?)
                    }
                    _ => anyhow::bail!("a saved state's layer {i} is not a {kind:?} layer"),
                })
            })
            .collect::<Result<_>>()?;
        Ok(State { layers, pos: h.pos })
    }
}
