//! The context a conversation may hold (prompt plus answer). K3 has no positional
//! embedding, so only memory bounds it: the checkpoint's own limit when its config states
//! one, else [`DEFAULT_CONTEXT`], shrunk by the RAM plan when memory is short
//! (`experts::ram_budget`), or what `--max-tokens` asks. The MLA caches grow as they are
//! used; nothing is reserved up front.

use crate::config::{AttnKind, Config};
use crate::experts::cache::ram_budget::{KvShape, DEFAULT_CONTEXT};

/// The checkpoint's limit and where it comes from: its config's `max_position_embeddings`,
/// else [`DEFAULT_CONTEXT`].
pub(crate) fn checkpoint_context(cfg: &Config) -> (usize, String) {
    match cfg.max_position_embeddings {
        Some(n) => (n, "the checkpoint's max_position_embeddings".into()),
        None => (
            DEFAULT_CONTEXT,
            "default; the checkpoint's config states no max_position_embeddings".into(),
        ),
    }
}

/// What one token of context costs in the MLA caches of `cfg`.
pub(crate) fn kv_shape(cfg: &Config) -> KvShape {
    KvShape {
        mla_layers: cfg
            .layer_kinds
            .iter()
            .filter(|k| **k == AttnKind::Mla)
            .count(),
        values_per_token: cfg.kv_lora_rank + cfg.qk_rope_head_dim,
    }
}
