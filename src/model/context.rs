//! The context a conversation may hold (prompt plus answer). K3 has no positional
//! embedding, so only memory bounds it: the checkpoint's own limit when its config states
//! one, else [`DEFAULT_CONTEXT`], shrunk by the RAM plan when memory is short
//! (`experts::ram_budget`), or what `--max-tokens` asks. The MLA caches grow as they are
//! used; nothing is reserved up front.

use super::mla::Mla;
use super::K3Model;
use crate::backend::Backend;
use crate::config::{AttnKind, Config};
use crate::experts::cache::ram_budget::{KvShape, DEFAULT_CONTEXT};

/// The checkpoint's limit and where it comes from: its config's `max_position_embeddings`,
/// else [`DEFAULT_CONTEXT`].
pub fn checkpoint_context(cfg: &Config) -> (usize, String) {
    match cfg.max_position_embeddings {
        Some(n) => (n, "the checkpoint's max_position_embeddings".into()),
        None => (
            DEFAULT_CONTEXT,
            "default; the checkpoint's config states no max_position_embeddings".into(),
        ),
    }
}

/// What one token of context costs in the MLA caches of `cfg`.
pub fn kv_shape(cfg: &Config) -> KvShape {
    KvShape {
        mla_layers: cfg
            .layer_kinds
            .iter()
            .filter(|k| **k == AttnKind::Mla)
            .count(),
        values_per_token: cfg.kv_lora_rank + cfg.qk_rope_head_dim,
    }
}

impl<B: Backend> K3Model<B> {
    /// Tokens a conversation may hold, prompt plus answer.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Sets the context (the RAM plan's, or `--max-tokens`).
    pub fn set_context(&mut self, tokens: usize) {
        self.context = tokens;
    }

    /// The default context's limit on this model and backend: the checkpoint's, lowered to
    /// the positions one MLA cache holds on the backend, with where it comes from.
    pub fn context_limit(&self) -> (usize, String) {
        let (limit, why) = checkpoint_context(&self.ckpt.config);
        match self
            .backend
            .mla_cache_max_positions(&Mla::<B>::dims(&self.ckpt.config))
        {
            Some(cap) if cap < limit => (
                cap,
                format!(
                    "the positions one MLA cache buffer holds on this adapter; {why} is {limit}"
                ),
            ),
            _ => (limit, why),
        }
    }
}
