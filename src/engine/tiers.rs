//! The backend's expert tier: sized in VRAM on a discrete GPU (shared with the prefill
//! window after a margin and the state), or as the single expert pool on unified memory,
//! with the `[K3-GPU] expert tier:` lines that say how.

use super::config::ExpertConfig;
use crate::backend::Backend;
use crate::experts::cache::ram_budget;
use crate::model::K3Model;
use anyhow::Result;

/// Sizes `model`'s expert tier to `bytes` (as many whole expert slots as fit, at most one
/// per expert); `None` when the backend keeps no tier.
pub fn size_expert_tier<B: Backend>(model: &K3Model<B>, bytes: u64) -> Result<Option<usize>> {
    let cfg = &model.ckpt.config;
    model.backend.configure_expert_tier(
        bytes,
        cfg.num_experts * cfg.moe_layer_count(),
        cfg.moe_intermediate_size,
        cfg.routed_expert_hidden_size,
    )
}

/// Sizes the unified pool to `slots` (granted by the RAM clamp from `K3_EXPERT_GB` plus
/// `K3_GPU_GB`) and prints `[K3-GPU] expert tier: unified pool ...`.
pub(super) fn configure_pool<B: Backend>(
    model: &K3Model<B>,
    experts: &ExpertConfig,
    slots: usize,
) -> Result<()> {
    let eb = model.ckpt.config.expert_bytes() as u64;
    let n = size_expert_tier(model, slots as u64 * eb)?.unwrap_or(0);
    tracing::info!(
        "[K3-GPU] expert tier: unified pool of {n} slots ({:.1} GB; --expert-gb {} + --gpu-expert-gb {}, clamped to RAM) | the only expert cache: no host copies, evicted experts dropped",
        n as f64 * eb as f64 / 1e9,
        experts.expert_gb,
        experts.gpu_tier_gb()?.unwrap_or(0.0)
    );
    Ok(())
}

/// Sizes the backend's VRAM expert tier to `size` (see [`vram_split`]) and prints
/// `[K3-GPU] expert tier: ...`, with what it and the host cache of `host_slots` a layer
/// keep together (they are exclusive: an expert lives in one of them).
pub(super) fn configure_gpu_tier<B: Backend>(
    model: &K3Model<B>,
    host_slots: usize,
    size: &TierSize,
) -> Result<()> {
    let cfg = &model.ckpt.config;
    let n = size_expert_tier(model, size.bytes)?.unwrap_or(0);
    let host = host_slots * cfg.moe_layer_count();
    let kept = if n > 0 {
        format!(
            " | with the host cache's {host}: {} experts, each in one",
            host + n
        )
    } else {
        String::new()
    };
    tracing::info!(
        "[K3-GPU] expert tier: {n} slots ({:.1} GB; {}){kept}",
        n as f64 * cfg.expert_bytes() as f64 / 1e9,
        size.why
    );
    Ok(())
}

/// Free VRAM the default tier leaves to everything else, at least: activations, the MLA
/// cache and KDA state allocated after the measurement, and other programs on the GPU.
pub(super) const TIER_MARGIN_MIN_BYTES: u64 = 2_000_000_000;

/// The VRAM expert tier's size and how it was decided.
#[derive(Clone, Debug, PartialEq)]
pub struct TierSize {
    /// Bytes for the tier (0 = off).
    pub bytes: u64,
    /// The decision, for the start-up line.
    pub why: String,
}

/// A discrete GPU's free VRAM shared out: the expert tier and the prefill window.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct VramSplit {
    /// The tier.
    pub(super) tier: TierSize,
    /// Bytes the prefill window's activations may take.
    pub(super) window_bytes: u64,
}

/// The VRAM budget of a discrete GPU with `free` bytes free after the dense weights: a
/// margin of max(2 GB, 10% of free) for other programs and scratch, then `state_bytes` (the
/// MLA caches at the full context, the KDA state and the snapshots), then the tier and the
/// prefill window. A tier size asked for always wins (0 turns it off) and the window gets
/// half of what it leaves; by default the window takes half of the room, at most
/// `window_max` bytes (its bound), and the tier the rest.
pub(super) fn vram_split(
    asked_gb: Option<f64>,
    free: u64,
    state_bytes: u64,
    window_max: u64,
) -> VramSplit {
    let gb = |b: u64| b as f64 / 1e9;
    let margin = TIER_MARGIN_MIN_BYTES.max(free / 10);
    let room = free.saturating_sub(margin).saturating_sub(state_bytes);
    let half = |b: u64| (b as f64 * ram_budget::WINDOW_SHARE) as u64;
    if let Some(a) = asked_gb {
        let tier = asked_tier(a);
        let window_bytes = window_max.min(half(room.saturating_sub(tier.bytes)));
        return VramSplit { tier, window_bytes };
    }
    let window_bytes = window_max.min(half(room));
    let bytes = room - window_bytes;
    let state = if state_bytes > 0 {
        format!(" - state and snapshots {:.1} GB", gb(state_bytes))
    } else {
        String::new()
    };
    VramSplit {
        tier: TierSize {
            bytes,
            why: format!(
                "default = free VRAM {:.1} GB - margin {:.1} GB{state} - prefill window {:.1} GB{}",
                gb(free),
                gb(margin),
                gb(window_bytes),
                if bytes == 0 { ": nothing left" } else { "" }
            ),
        },
        window_bytes,
    }
}

/// Most prompt tokens the default prefill window reserves VRAM for on a GPU with its own
/// memory (`--chunk` asks for more): an agent's preamble of up to 16k tokens reads each
/// routed expert once, and the expert tier keeps the rest of the room for decode.
pub const DEFAULT_VRAM_WINDOW_TOKENS: usize = 16_384;

/// Prompt tokens the window reserves VRAM for on a GPU with its own memory: its `bound`
/// when `--chunk` set it, else at most [`DEFAULT_VRAM_WINDOW_TOKENS`], so the tier, which
/// every decoded token reads from, keeps the rest and a longer prompt runs in several
/// windows.
pub(super) fn vram_window_tokens(bound: usize, bound_set: bool) -> usize {
    if bound_set {
        bound
    } else {
        bound.min(DEFAULT_VRAM_WINDOW_TOKENS)
    }
}

/// A tier of `gb` GB asked for (0: off).
fn asked_tier(gb: f64) -> TierSize {
    TierSize {
        bytes: (gb * 1e9) as u64,
        why: if gb == 0.0 {
            "asked 0 = off".into()
        } else {
            format!("asked {gb} GB")
        },
    }
}

/// The tier where free VRAM cannot be measured (`reason`): as asked, else off.
pub(super) fn unmeasured_tier(asked_gb: Option<f64>, reason: &str) -> TierSize {
    match asked_gb {
        Some(a) => asked_tier(a),
        None => TierSize {
            bytes: 0,
            why: format!("default off: {reason}; set K3_GPU_GB to keep experts in VRAM"),
        },
    }
}

#[cfg(test)]
mod tests;
