//! What a conversation's state costs in memory: the MLA layers' latent KV cache, which grows
//! with the context, and the KDA layers' fixed recurrent state. The RAM clamp reserves both
//! before it sizes the expert cache.

use crate::config::{AttnKind, Config};

/// Bytes of a conversation's state, in GB (1e9 bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StateSize {
    /// MLA latent KV cache (compressed kv + rope key per token per MLA layer) at
    /// `context_tokens` of context.
    pub kv_gb: f64,
    /// KDA recurrent state (a head_dim x head_dim matrix per head) plus the short
    /// convolutions' history, over every KDA layer.
    pub kda_gb: f64,
}

/// The state of one conversation of up to `context_tokens` tokens, in f32.
pub fn state_size(cfg: &Config, context_tokens: usize) -> StateSize {
    let mla = cfg
        .layer_kinds
        .iter()
        .filter(|k| **k == AttnKind::Mla)
        .count();
    let kda = cfg.layer_kinds.len() - mla;
    let kv =
        mla as f64 * context_tokens as f64 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) as f64 * 4.0;
    let p = cfg.kda_width() as f64;
    let per_kda = cfg.kda.num_heads as f64 * (cfg.kda.head_dim * cfg.kda.head_dim) as f64 * 4.0
        + 3.0 * (cfg.kda.conv_kernel.saturating_sub(1)) as f64 * p * 4.0;
    StateSize {
        kv_gb: kv / 1e9,
        kda_gb: kda as f64 * per_kda / 1e9,
    }
}

/// Bytes one state snapshot takes: the KDA states of every KDA layer.
pub fn snapshot_bytes(cfg: &Config) -> usize {
    (state_size(cfg, 0).kda_gb * 1e9).round() as usize
}
