//! The RAM clamp: how many expert slots per layer fit beside the dense weights, the page
//! cache, activations, the MLA cache, the KDA state, the state snapshots and the prompt
//! cache's working set. `K3_EXPERT_GB` is a request; this decides what is granted. On a
//! unified-memory GPU the request (with `K3_GPU_GB`) is one pool of slots shared by every
//! MoE layer, clamped here once as the RAM it is.
//!
//! It also decides the context when `--max-tokens` does not: K3 has no positional
//! embedding, so the context is bounded by memory alone. The default is the checkpoint's
//! limit (or [`DEFAULT_CONTEXT`]) unless its MLA cache would take more than
//! [`CONTEXT_SHARE`] of the memory left for experts; the cache grows as it is used, but the
//! plan reserves it whole so that a full context never pushes the expert cache into swap.

use anyhow::Result;
use std::fmt;

/// Page cache kept free for the OS and buffered reads, in GB.
pub const PAGE_CACHE_GB: f64 = 2.5;
/// Activations and scratch, in GB.
pub const ACTIVATIONS_GB: f64 = 1.2;
/// Share of the OS-reported available memory the engine may take.
pub const AVAILABLE_SHARE: f64 = 0.88;
/// Share of physical RAM the footprint stays under on macOS: past it the memory
/// compressor starts and every phase slows 3-5x, compute included (the C engine measured
/// the edge near 100 GB of an M5 Max's 128, docs/platforms.md).
pub const MACOS_FOOTPRINT_SHARE: f64 = 100.0 / 128.0;

/// The footprint ceiling of this machine, GB: [`MACOS_FOOTPRINT_SHARE`] of its RAM on
/// macOS, none elsewhere (or where the RAM cannot be read).
pub fn os_footprint_ceiling_gb() -> Option<f64> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    crate::platform::available_memory::total_bytes().map(|b| b as f64 / 1e9 * MACOS_FOOTPRINT_SHARE)
}

/// The default context when the checkpoint's config states none.
pub const DEFAULT_CONTEXT: usize = 131_072;
/// The default context, shrunk to fit memory, is a multiple of this many tokens.
pub const CONTEXT_STEP: usize = 1024;
/// Share of the memory left for experts the default context's MLA cache may take.
pub const CONTEXT_SHARE: f64 = 0.5;
/// The default context never shrinks below this (the clamp then reports what fits).
pub const MIN_DEFAULT_CONTEXT: usize = 4096;
/// Share of the memory the expert cache leaves that the prefill window may take beside
/// [`ACTIVATIONS_GB`] (the VRAM budget uses the same share of what its tier leaves).
pub const WINDOW_SHARE: f64 = 0.5;

/// The prefill window the plan sizes in host RAM: at most `bound` tokens (`--chunk`, the
/// backend's limits), each `bytes_per_token` of activations at the peak of a pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowAsk {
    /// The most tokens a window may take before memory is counted.
    pub bound: usize,
    /// Activation bytes a token of the window holds (`prefill_window::bytes_per_token`).
    pub bytes_per_token: u64,
}

/// How the context is chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum ContextAsk {
    /// `--max-tokens` / `K3_MAXT`: exactly this many tokens.
    Asked(usize),
    /// As many tokens as memory affords, up to `limit`; `why` names where the limit comes
    /// from (the checkpoint's config, the default, the adapter's buffer size).
    Default {
        /// The most tokens the default may be.
        limit: usize,
        /// Where `limit` comes from, for the context line.
        why: String,
    },
}

/// The MLA latent cache's shape: what one token of context costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvShape {
    /// MLA layers, each caching every token.
    pub mla_layers: usize,
    /// Values cached per token per MLA layer (`kv_lora_rank + qk_rope_head_dim`: 576).
    pub values_per_token: usize,
}

impl KvShape {
    /// Bytes one token of context takes over every MLA layer (f32 values).
    pub fn bytes_per_token(&self) -> f64 {
        (self.mla_layers * self.values_per_token * 4) as f64
    }
}

/// Everything the clamp needs, injected so the arithmetic is testable.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetInputs {
    /// `RAM_GB`: an explicit budget that replaces the measurement.
    pub ram_gb: Option<f64>,
    /// Resident memory after the dense weights are loaded, GB.
    pub resident_gb: f64,
    /// Memory the OS can still give, GB.
    pub available_gb: f64,
    /// The context asked for, or the default's limit.
    pub context: ContextAsk,
    /// Sequences whose state the plan reserves at the full context (`k3 serve
    /// --parallel`; 1 elsewhere). With the state in RAM the first is always reserved and
    /// the others as far as their states together stay within [`CONTEXT_SHARE`] of the
    /// memory left beside the weights and the fixed reserve; elsewhere the VRAM budget
    /// chose the count and it is taken as given.
    pub sequences: usize,
    /// What one token of context costs in the MLA cache.
    pub kv: KvShape,
    /// KDA recurrent state, GB.
    pub kda_gb: f64,
    /// In-RAM state snapshots at their limits, GB.
    pub snapshots_gb: f64,
    /// The prompt cache's bound (`--prompt-cache-gb`; 0 when off), GB: its working set is
    /// one entry on the host, the state at the full context, at most this.
    pub prompt_cache_gb: f64,
    /// Whether the MLA cache, the KDA state and the snapshots take host RAM (the CPU, a
    /// unified-memory GPU); on a discrete GPU the VRAM budget counts them instead.
    pub state_in_ram: bool,
    /// The prefill window to size from the RAM the expert cache leaves (`None`: its
    /// activations live in VRAM, sized by the VRAM budget).
    pub window: Option<WindowAsk>,
    /// `K3_EXPERT_GB`, in GB (1e9 bytes).
    pub request_gb: f64,
    /// Bytes of one cache slot (one expert).
    pub slot_bytes: u64,
    /// MoE layers sharing the cache.
    pub moe_layers: usize,
    /// Experts per layer (the most slots a layer can use).
    pub experts: usize,
    /// `K3_RAM_OVERCOMMIT=1`: keep one slot per layer even when it does not fit.
    pub overcommit: bool,
    /// The request is one pool of slots shared by every MoE layer (the GPU tier of a
    /// unified-memory adapter), not a host cache of slots per layer.
    pub pool: bool,
    /// The footprint the OS tolerates before it compresses memory, GB
    /// ([`os_footprint_ceiling_gb`]); a measured budget stays under it, `RAM_GB` does not.
    pub ceiling_gb: Option<f64>,
}

/// The prefill window the RAM plan sized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowPlan {
    /// Tokens a pass takes: the bound, the context and memory, whichever is least.
    pub tokens: usize,
    /// Tokens memory alone allows.
    pub by_memory: usize,
    /// Its activations at the peak of a pass, GB.
    pub gb: f64,
}

/// The granted cache size and the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetPlan {
    /// Total budget, GB.
    pub budget_gb: f64,
    /// Resident memory, GB.
    pub resident_gb: f64,
    /// Reserve, GB (page cache + activations + KV + KDA + snapshots + prompt cache).
    pub reserve_gb: f64,
    /// The context in tokens (prompt plus answer).
    pub context: usize,
    /// How the context was chosen, for the context line.
    pub context_why: String,
    /// The MLA cache's shape behind `kv_gb`.
    pub kv: KvShape,
    /// One sequence's MLA cache at the full context, GB.
    pub kv_gb: f64,
    /// One sequence's KDA state, GB.
    pub kda_gb: f64,
    /// Sequences whose state (`kv_gb + kda_gb` each) the reserve holds.
    pub sequences: usize,
    /// Snapshot part of the reserve, GB.
    pub snapshots_gb: f64,
    /// Prompt-cache part of the reserve, GB.
    pub prompt_cache_gb: f64,
    /// Whether KV, KDA and snapshots are part of the reserve (they take host RAM).
    pub state_in_ram: bool,
    /// The prefill window sized in RAM: its tokens, what memory alone allows, and its
    /// activations in GB (`None` when the VRAM budget sizes it).
    pub window: Option<WindowPlan>,
    /// Left for experts, GB.
    pub for_experts_gb: f64,
    /// Slots per layer that `K3_EXPERT_GB` asked for (in a pool: slots in all).
    pub requested_slots: usize,
    /// Slots per layer granted to the host cache (0 in a pool: it keeps nothing).
    pub slots: usize,
    /// Slots granted to the unified pool, shared by every MoE layer (0 without one).
    pub pool_slots: usize,
    /// Resident + reserve + granted cache, GB.
    pub projected_peak_gb: f64,
    /// The footprint ceiling when it lowered the budget, GB.
    pub capped_at_gb: Option<f64>,
}

/// Even one slot per layer does not fit: the run must stop (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "not enough memory for one expert per layer: budget {budget_gb:.1} GB = resident {resident_gb:.1} + \
     reserve {reserve_gb:.1} + experts {needed_gb:.1} needed ({moe_layers} layers x {slot_mb:.1} MB). \
     Free memory, set RAM_GB to a larger budget, or K3_RAM_OVERCOMMIT=1 to run anyway (it may swap)"
)]
pub struct RamBudgetError {
    /// Total budget, GB.
    pub budget_gb: f64,
    /// Resident memory, GB.
    pub resident_gb: f64,
    /// Reserve, GB.
    pub reserve_gb: f64,
    /// One slot per layer, GB.
    pub needed_gb: f64,
    /// MoE layers.
    pub moe_layers: usize,
    /// One slot, MB.
    pub slot_mb: f64,
}

/// Slots per layer a request of `request_gb` buys: at least 1, at most `experts`.
pub fn requested_slots(
    request_gb: f64,
    slot_bytes: u64,
    moe_layers: usize,
    experts: usize,
) -> usize {
    let per_slot_all_layers = slot_bytes as f64 * moe_layers.max(1) as f64;
    let slots = (request_gb.max(0.0) * 1e9 / per_slot_all_layers).floor() as usize;
    slots.clamp(1, experts.max(1))
}

/// Slots in all a unified pool of `request_gb` buys: at least one per layer (as the host
/// cache's floor), at most every routed expert.
pub fn requested_pool_slots(
    request_gb: f64,
    slot_bytes: u64,
    moe_layers: usize,
    experts: usize,
) -> usize {
    let slots = (request_gb.max(0.0) * 1e9 / slot_bytes.max(1) as f64).floor() as usize;
    let layers = moe_layers.max(1);
    slots.clamp(layers, experts.max(1) * layers)
}

/// Applies the clamp: the cache may only shrink to fit.
pub fn plan(i: &BudgetInputs) -> Result<BudgetPlan, RamBudgetError> {
    let measured = i.resident_gb + AVAILABLE_SHARE * i.available_gb;
    let capped_at_gb = match (i.ram_gb, i.ceiling_gb) {
        (None, Some(c)) if c < measured => Some(c),
        _ => None,
    };
    let budget_gb = i.ram_gb.or(capped_at_gb).unwrap_or(measured);
    // On a discrete GPU the state and its snapshots live in VRAM (the tier's budget counts
    // them); the prompt cache's working set is a host copy wherever the state lives.
    let in_ram = if i.state_in_ram { 1.0 } else { 0.0 };
    let fixed_gb = PAGE_CACHE_GB + ACTIVATIONS_GB + in_ram * (i.kda_gb + i.snapshots_gb);
    let (context, context_why) = choose_context(
        &i.context,
        i.kv,
        budget_gb - i.resident_gb - fixed_gb,
        i.state_in_ram,
    );
    let kv_gb = context as f64 * i.kv.bytes_per_token() / 1e9;
    let sequences = if i.state_in_ram {
        fit_sequences(
            i.sequences,
            kv_gb + i.kda_gb,
            budget_gb - i.resident_gb - fixed_gb,
        )
    } else {
        i.sequences.max(1)
    };
    let more = (sequences - 1) as f64;
    let prompt_cache_gb = i.prompt_cache_gb.min(kv_gb + i.kda_gb).max(0.0);
    let reserve_gb =
        fixed_gb + in_ram * (sequences as f64 * kv_gb + more * i.kda_gb) + prompt_cache_gb;
    let for_experts_gb = budget_gb - i.resident_gb - reserve_gb;
    // A host cache grows by a slot in every layer at once, a pool by one slot.
    let (per_slot_gb, requested, least) = if i.pool {
        let layers = i.moe_layers.max(1);
        let r = requested_pool_slots(i.request_gb, i.slot_bytes, i.moe_layers, i.experts);
        (i.slot_bytes as f64 / 1e9, r, layers)
    } else {
        let r = requested_slots(i.request_gb, i.slot_bytes, i.moe_layers, i.experts);
        (i.slot_bytes as f64 * i.moe_layers as f64 / 1e9, r, 1)
    };
    let fit = if per_slot_gb > 0.0 {
        (for_experts_gb / per_slot_gb).floor().max(0.0) as usize
    } else {
        requested
    };
    let slots = if fit >= least {
        requested.min(fit)
    } else if i.overcommit {
        least
    } else {
        return Err(RamBudgetError {
            budget_gb,
            resident_gb: i.resident_gb,
            reserve_gb,
            needed_gb: per_slot_gb * least as f64,
            moe_layers: i.moe_layers,
            slot_mb: i.slot_bytes as f64 / 1e6,
        });
    };
    let cache_gb = slots as f64 * per_slot_gb;
    let window = i.window.map(|w| {
        // The activation reserve, and half of what the expert cache leaves.
        let gb = ACTIVATIONS_GB + WINDOW_SHARE * (for_experts_gb - cache_gb).max(0.0);
        let by_memory = ((gb * 1e9 / w.bytes_per_token.max(1) as f64) as usize).max(1);
        let tokens = w.bound.min(context).min(by_memory).max(1);
        WindowPlan {
            tokens,
            by_memory,
            gb: tokens as f64 * w.bytes_per_token as f64 / 1e9,
        }
    });
    // What the window takes beyond the activation reserve comes out of the spare memory.
    let window_extra_gb = window.map_or(0.0, |w| (w.gb - ACTIVATIONS_GB).max(0.0));
    Ok(BudgetPlan {
        budget_gb,
        resident_gb: i.resident_gb,
        reserve_gb,
        context,
        context_why,
        kv: i.kv,
        kv_gb,
        kda_gb: i.kda_gb,
        sequences,
        snapshots_gb: i.snapshots_gb,
        prompt_cache_gb,
        state_in_ram: i.state_in_ram,
        window,
        for_experts_gb,
        requested_slots: requested,
        slots: if i.pool { 0 } else { slots },
        pool_slots: if i.pool { slots } else { 0 },
        projected_peak_gb: i.resident_gb + reserve_gb + cache_gb + window_extra_gb,
        capped_at_gb,
    })
}

/// Sequences of `each_gb` state whose reserve `asked` wants, when `room_gb` is left beside
/// the weights and the fixed reserve: the first always, the others while all of them stay
/// within [`CONTEXT_SHARE`] of the room (a full context of each may then be held at once).
pub fn fit_sequences(asked: usize, each_gb: f64, room_gb: f64) -> usize {
    let asked = asked.max(1);
    if each_gb <= 0.0 {
        return asked;
    }
    let fit = (CONTEXT_SHARE * room_gb.max(0.0) / each_gb).floor();
    (fit.min(asked as f64) as usize).clamp(1, asked)
}

/// The context for `ask` when `room_gb` is left beside everything but the MLA cache and
/// the experts, with how it was chosen; with the state outside RAM (`in_ram` false) RAM
/// does not bound it (the VRAM budget already lowered the limit).
fn choose_context(ask: &ContextAsk, kv: KvShape, room_gb: f64, in_ram: bool) -> (usize, String) {
    match ask {
        ContextAsk::Asked(n) => (*n, "--max-tokens / K3_MAXT".into()),
        ContextAsk::Default { limit, why } if !in_ram => (*limit, why.clone()),
        ContextAsk::Default { limit, why } => {
            let per_token_gb = kv.bytes_per_token() / 1e9;
            if per_token_gb <= 0.0 {
                return (*limit, why.clone());
            }
            let fit = (CONTEXT_SHARE * room_gb.max(0.0) / per_token_gb).floor();
            let fit = (fit.min(usize::MAX as f64) as usize) / CONTEXT_STEP * CONTEXT_STEP;
            if fit >= *limit {
                (*limit, why.clone())
            } else {
                (
                    fit.max(MIN_DEFAULT_CONTEXT).min(*limit),
                    format!(
                        "default: what fits in {:.0}% of the memory left for experts, under {limit} ({why}); --max-tokens / K3_MAXT sets it",
                        CONTEXT_SHARE * 100.0
                    ),
                )
            }
        }
    }
}

impl BudgetPlan {
    /// The `[K3] context:` line: the tokens, how they were chosen, and what the MLA cache
    /// costs per token and at the full context.
    pub fn context_line(&self) -> String {
        format!(
            "[K3] context: {} tokens ({}) | MLA cache {} values x {} layers x 4 B = {:.1} KB a token, {:.2} GB at the full context, allocated as used",
            self.context,
            self.context_why,
            self.kv.values_per_token,
            self.kv.mla_layers,
            self.kv.bytes_per_token() / 1e3,
            self.kv_gb,
        )
    }
}

impl fmt::Display for BudgetPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[K3][RAM_GB={:.1}] resident {:.1} + reserve {:.1} (page cache {PAGE_CACHE_GB:.1} + act {ACTIVATIONS_GB:.1}",
            self.budget_gb,
            self.resident_gb,
            self.reserve_gb,
        )?;
        if self.state_in_ram {
            let n = self.sequences as f64;
            write!(
                f,
                " + KV {:.1} + KDA {:.1}",
                n * self.kv_gb,
                n * self.kda_gb
            )?;
            if self.snapshots_gb > 0.0 {
                write!(f, " + snapshots {:.1}", self.snapshots_gb)?;
            }
        }
        if self.prompt_cache_gb > 0.0 {
            write!(f, " + prompt cache {:.1}", self.prompt_cache_gb)?;
        }
        if !self.state_in_ram {
            write!(f, "; KV, KDA and snapshots in VRAM")?;
        }
        write!(
            f,
            ") -> {:.1} GB for experts; ",
            self.for_experts_gb.max(0.0)
        )?;
        if self.pool_slots > 0 {
            write!(
                f,
                "unified pool {}->{} slots",
                self.requested_slots, self.pool_slots
            )?;
        } else {
            write!(f, "cache {}->{}/layer", self.requested_slots, self.slots)?;
        }
        if let Some(w) = self.window {
            write!(f, "; prefill window {} tokens {:.1} GB", w.tokens, w.gb)?;
        }
        write!(f, " (projected peak {:.1} GB)", self.projected_peak_gb)?;
        if let Some(c) = self.capped_at_gb {
            write!(
                f,
                "; budget held to the macOS compression ceiling {c:.1} GB ({:.0}% of RAM)",
                MACOS_FOOTPRINT_SHARE * 100.0
            )?;
        }
        Ok(())
    }
}

/// Resident and available memory of this process and machine, in GB.
#[derive(Clone, Copy, Debug)]
pub struct MemoryProbe {
    /// Resident set of this process.
    pub resident_gb: f64,
    /// What the OS can still give (see [`crate::platform::available_memory`]).
    pub available_gb: f64,
}

/// Measures resident and available memory now.
pub fn probe() -> Result<MemoryProbe> {
    Ok(MemoryProbe {
        resident_gb: crate::stats::rss_gb(),
        available_gb: crate::platform::available_memory::available_bytes()? as f64 / 1e9,
    })
}

#[cfg(test)]
mod tests;
