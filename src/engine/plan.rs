//! The memory plan of one run, computed in one place from the checkpoint's config, the
//! machine's measurements ([`Machine`]) and the [`EngineConfig`]: the RAM clamp (expert
//! cache slots or the unified pool, the reserve), the context, the state reserved for each
//! sequence, the VRAM split (the expert tier and the prefill window), the prefill window and
//! the streaming settings. [`Plan::new`] does no I/O and prints nothing; its `Display` gives
//! the start-up lines (`[K3][RAM_GB=...]`, `[K3] context:`, `[K3] state:`, `[K3] expert
//! reads:`, `[K3] fewer experts`, `[K3] prefill window:`). Measuring the machine and
//! applying the plan to a loaded model are `streaming.rs`'s.

use super::config::{EngineConfig, Prefetch, MAX_CONTEXT};
use super::tiers::{
    unmeasured_tier, vram_split, vram_window_tokens, TierSize, TIER_MARGIN_MIN_BYTES,
};
use crate::config::Config;
use crate::experts::cache::pressure_guard::CacheSize;
use crate::experts::cache::ram_budget::{
    self, BudgetInputs, BudgetPlan, ContextAsk, WindowAsk, CONTEXT_SHARE,
};
use crate::experts::plan::expert_selection::ExpertSelection;
use crate::experts::{IoMode, StreamConfig};
use crate::model::context::{checkpoint_context, kv_shape};
use crate::model::prefill_window::bytes_per_token;
use crate::model::state_size::{snapshot_bytes, state_size};
use crate::session::SnapshotLimits;
use anyhow::{bail, Result};
use std::fmt;

/// A discrete GPU's memory as measured before the plan (after the dense weights, with no
/// expert tier held).
#[derive(Clone, Debug, PartialEq)]
pub enum Vram {
    /// The state lives in host RAM (the CPU, a unified-memory GPU): no VRAM is planned.
    Host,
    /// A discrete GPU that reports its free memory.
    Free {
        /// Free bytes.
        free: u64,
        /// Whether the backend keeps a VRAM expert tier.
        has_tier: bool,
    },
    /// A discrete GPU that cannot report its free memory.
    Unknown {
        /// Whether the backend keeps a VRAM expert tier.
        has_tier: bool,
        /// Why not, for the tier line.
        reason: String,
    },
}

/// What the plan needs to know of this machine and backend, measured once before it.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Resident memory of this process with the dense weights loaded, GB.
    pub resident_gb: f64,
    /// Memory the OS can still give, GB.
    pub available_gb: f64,
    /// The footprint the OS tolerates before it compresses memory, GB (macOS only).
    pub ceiling_gb: Option<f64>,
    /// Whether the state (MLA caches, KDA states, snapshots) takes host RAM.
    pub state_in_ram: bool,
    /// Whether the backend's expert tier is the only expert cache (unified memory).
    pub unified_pool: bool,
    /// The GPU's own memory.
    pub vram: Vram,
    /// Positions one MLA cache buffer holds on this backend (`None`: no bound).
    pub mla_cache_max_positions: Option<usize>,
    /// Tokens one forward pass may take on this backend (its widest MoE row's bound).
    pub max_window: usize,
}

/// The expert cache a backend keeps besides the host cache.
#[derive(Clone, Debug, PartialEq)]
pub enum TierPlan {
    /// None: the CPU, or a discrete GPU without a tier.
    None,
    /// The unified pool of `slots` slots, the only expert cache.
    Pool {
        /// Slots in all.
        slots: usize,
    },
    /// A VRAM tier of the size decided (the backend reports the slots it makes of it).
    Vram(TierSize),
}

/// The sequence state the plan reserves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StateReservation {
    /// Sequences asked for (`k3 serve --parallel`; 1 elsewhere).
    pub parallel: usize,
    /// Sequences whose full-context state the plan reserves (at most `parallel`).
    pub sequences: usize,
    /// Tokens of one full context.
    pub context: usize,
    /// Bytes of one sequence's state at the full context (its MLA caches and KDA state).
    pub sequence_bytes: u64,
    /// Whether it takes host RAM (else VRAM).
    pub in_ram: bool,
}

impl StateReservation {
    /// Bytes of every reserved sequence's state together: what the sequences running at
    /// once may grow to.
    pub fn total_bytes(&self) -> u64 {
        self.sequences as u64 * self.sequence_bytes
    }
}

/// Bytes of one sequence's state at `tokens` tokens of context.
pub(crate) fn sequence_bytes(cfg: &Config, tokens: usize) -> u64 {
    let s = state_size(cfg, tokens);
    ((s.kv_gb + s.kda_gb) * 1e9) as u64
}

/// The whole memory plan of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The RAM clamp: budget, reserve, context, cache slots, the RAM-sized window.
    pub budget: BudgetPlan,
    /// The sequence state reserved.
    pub state: StateReservation,
    /// How experts are read and how many host-cache slots a layer keeps.
    pub stream: StreamConfig,
    /// Next-layer prefetch (`--prefetch`, with the pipe on).
    pub prefetch: bool,
    /// Prefetch on every layer, without the gate (`--prefetch always`).
    pub prefetch_always: bool,
    /// The prefetch setting asked for, for the reads line.
    prefetch_asked: Prefetch,
    /// Which experts a token may leave out.
    pub selection: ExpertSelection,
    /// The backend's expert tier or pool.
    pub tier: TierPlan,
    /// The expert cache the memory-pressure guard watches (`None`: `--memory-pressure off`).
    pub pressure: Option<(CacheSize, usize)>,
    /// Tokens a prefill pass takes.
    pub prefill_window: usize,
    /// Activation bytes a token of the window holds.
    pub window_bytes_per_token: u64,
    /// What bounds the window, for its line.
    window_why: String,
    /// The in-RAM snapshots the reserve counts, GB.
    pub snapshots_gb: f64,
}

impl Plan {
    /// The plan for the model of `cfg` on `machine` as `engine` asks: no I/O, no printing.
    pub fn new(cfg: &Config, machine: &Machine, engine: &EngineConfig) -> Result<Plan> {
        engine.experts.check_expert_gb()?;
        let vram = match &machine.vram {
            Vram::Free { free, has_tier } => Some((*free, *has_tier)),
            _ => None,
        };
        let context = match engine.context_tokens {
            Some(n) if n == 0 || n > MAX_CONTEXT => {
                bail!("K3_MAXT / --max-tokens must be between 1 and {MAX_CONTEXT} tokens, got {n}")
            }
            Some(n) => ContextAsk::Asked(n),
            None => {
                let (limit, why) = vram_context_limit(cfg, machine);
                ContextAsk::Default {
                    limit: limit.min(MAX_CONTEXT),
                    why,
                }
            }
        };
        let kda_gb = state_size(cfg, 0).kda_gb;
        let snapshot_gb = snapshot_reserve_gb(cfg, engine.snapshots);
        // Snapshots live where the state does: in device memory on a discrete GPU, where
        // the VRAM budget counts them.
        let snapshots_gb = if machine.state_in_ram {
            snapshot_gb
        } else {
            0.0
        };
        // On unified memory both budgets are one pool of RAM, clamped as such.
        let pool = machine.unified_pool;
        let request_gb = if pool {
            engine.experts.expert_gb + engine.experts.gpu_tier_gb()?.unwrap_or(0.0)
        } else {
            engine.experts.expert_gb
        };
        let window_bound = engine
            .max_window
            .unwrap_or(crate::session::MAX_WINDOW)
            .min(machine.max_window);
        let per_token = bytes_per_token(cfg);
        let parallel = engine.parallel.max(1);
        // With the state in VRAM the sequences are counted against it; in RAM the clamp
        // counts them.
        let sequences = match (&context, vram) {
            (_, None) => parallel,
            (ctx, Some((free, _))) => {
                let tokens = match ctx {
                    ContextAsk::Asked(n) => *n,
                    ContextAsk::Default { limit, .. } => *limit,
                };
                let room = free.saturating_sub(TIER_MARGIN_MIN_BYTES.max(free / 10)) as f64;
                ram_budget::fit_sequences(
                    parallel,
                    sequence_bytes(cfg, tokens) as f64 / 1e9,
                    room / 1e9,
                )
            }
        };
        let budget = ram_budget::plan(&BudgetInputs {
            ram_gb: engine.memory.ram_gb,
            resident_gb: machine.resident_gb,
            available_gb: machine.available_gb,
            context,
            sequences,
            kv: kv_shape(cfg),
            kda_gb,
            snapshots_gb,
            prompt_cache_gb: if engine.prompt_cache.in_use {
                engine.prompt_cache.plan_gb()?
            } else {
                0.0
            },
            state_in_ram: machine.state_in_ram,
            // With free VRAM measured the window's activations live there, sized below.
            window: vram.is_none().then_some(WindowAsk {
                bound: window_bound,
                bytes_per_token: per_token,
            }),
            request_gb,
            slot_bytes: cfg.expert_bytes() as u64,
            moe_layers: cfg.moe_layer_count(),
            experts: cfg.num_experts,
            overcommit: engine.memory.overcommit,
            pool,
            ceiling_gb: machine.ceiling_gb,
        })?;
        let state = StateReservation {
            parallel,
            sequences: budget.sequences,
            context: budget.context,
            sequence_bytes: sequence_bytes(cfg, budget.context),
            in_ram: machine.state_in_ram,
        };
        let stream = StreamConfig {
            mode: if engine.streaming.direct {
                IoMode::Direct
            } else {
                IoMode::Buffered
            },
            pipe: engine.streaming.pipe,
            load_threads: engine.streaming.load_threads,
            slots_per_layer: budget.slots,
        };
        let prefetch = stream.pipe && engine.streaming.prefetch != Prefetch::Off;
        let selection = engine.experts.selection()?;
        let pressure = engine.memory.memory_pressure.then(|| {
            if pool {
                (CacheSize::Pool(budget.pool_slots), cfg.moe_layer_count())
            } else {
                (CacheSize::PerLayer(budget.slots), 1)
            }
        });
        let bound = window_bound.min(budget.context);
        let mut tier = if pool {
            TierPlan::Pool {
                slots: budget.pool_slots,
            }
        } else {
            TierPlan::None
        };
        let (tokens, by_memory, place) = match (vram, budget.window) {
            (Some((free, has_tier)), _) => {
                let reserve_tokens = vram_window_tokens(bound, engine.max_window.is_some());
                // The sequences' state and the snapshots take VRAM on a discrete GPU.
                let state_gb =
                    state.sequences as f64 * (budget.kv_gb + budget.kda_gb) + snapshot_gb;
                let split = vram_split(
                    if has_tier {
                        engine.experts.gpu_tier_gb()?
                    } else {
                        Some(0.0)
                    },
                    free,
                    (state_gb * 1e9) as u64,
                    reserve_tokens as u64 * per_token,
                );
                if has_tier {
                    tier = TierPlan::Vram(split.tier);
                }
                let by_memory = (split.window_bytes / per_token.max(1)).max(1) as usize;
                let place = format!(
                    "{:.1} GB of VRAM: at most {} tokens' worth unless --chunk asks for more, and at most half of what the margin and the state leave",
                    split.window_bytes as f64 / 1e9,
                    reserve_tokens
                );
                (bound.min(by_memory), by_memory, place)
            }
            (None, Some(w)) => {
                // A discrete GPU that cannot report its free VRAM: the tier is as asked, or
                // off; the window is sized in RAM as on the CPU.
                if let Vram::Unknown {
                    has_tier: true,
                    reason,
                } = &machine.vram
                {
                    tier = TierPlan::Vram(unmeasured_tier(engine.experts.gpu_tier_gb()?, reason));
                }
                (
                    w.tokens,
                    w.by_memory,
                    format!(
                        "{:.1} GB of RAM: the activation reserve and half of what the expert cache leaves",
                        w.by_memory as f64 * per_token as f64 / 1e9
                    ),
                )
            }
            (None, None) => bail!("internal: the RAM plan sized no prefill window"),
        };
        let max = machine.max_window.max(1);
        let w = tokens.clamp(1, max);
        let window_why = if engine.max_window.is_some_and(|c| c <= w) {
            "--chunk / K3_CHUNK".to_string()
        } else if w < by_memory.min(bound) || (w < by_memory && w == max) {
            format!("the adapter's limits on one dispatch or binding ({max} tokens)")
        } else if w == budget.context && budget.context < by_memory {
            "the context".to_string()
        } else {
            format!("memory: {place}")
        };
        Ok(Plan {
            budget,
            state,
            stream,
            prefetch,
            prefetch_always: engine.streaming.prefetch == Prefetch::Always,
            prefetch_asked: engine.streaming.prefetch,
            selection,
            tier,
            pressure,
            prefill_window: w,
            window_bytes_per_token: per_token,
            window_why,
            snapshots_gb,
        })
    }

    /// The `[K3] state:` line: the sequences whose full-context state is reserved, of how
    /// many asked, and the bytes in all.
    pub fn state_line(&self) -> String {
        let s = &self.state;
        let fit = if s.sequences < s.parallel {
            format!(
                "{} of the {} sequences asked (--parallel) fit at the full context",
                s.sequences, s.parallel
            )
        } else if s.parallel == 1 {
            "one sequence at the full context".to_string()
        } else {
            format!("{} sequences at the full context (--parallel)", s.sequences)
        };
        format!(
            "[K3] state: {fit}: {} x {:.1} MB = {:.1} MB reserved in {}",
            s.sequences,
            s.sequence_bytes as f64 / 1e6,
            s.total_bytes() as f64 / 1e6,
            if s.in_ram { "RAM" } else { "VRAM" }
        )
    }

    /// The `[K3] expert reads:` line.
    pub fn reads_line(&self) -> String {
        let sc = &self.stream;
        format!(
            "[K3] expert reads: {} | pipe {} | {} loader threads | prefetch {}",
            sc.mode.describe(),
            if sc.pipe { "on" } else { "off" },
            sc.load_threads,
            if self.prefetch {
                self.prefetch_asked.as_str()
            } else {
                "off"
            }
        )
    }

    /// The `[K3] prefill window:` line.
    pub fn window_line(&self) -> String {
        let w = self.prefill_window;
        let per_token = self.window_bytes_per_token;
        format!(
            "[K3] prefill window: {w} tokens a pass (each routed expert read once a layer per pass) | {:.2} MB of activations a token, {:.1} GB at the full window | bound: {}",
            per_token as f64 / 1e6,
            (w as u64 * per_token) as f64 / 1e9,
            self.window_why
        )
    }
}

impl fmt::Display for Plan {
    /// The plan's start-up lines, one a line, in the order a run prints them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.budget)?;
        writeln!(f, "{}", self.budget.context_line())?;
        writeln!(f, "{}", self.state_line())?;
        writeln!(f, "{}", self.reads_line())?;
        let sel = &self.selection;
        if !sel.is_exact() {
            writeln!(
                f,
                "[K3] fewer experts (not exact): top-p {} | skip uncached below {}",
                sel.top_p.map_or("off".into(), |p| format!("{p:.2}")),
                sel.skip_uncached_below
                    .map_or("off".into(), |w| format!("{w}"))
            )?;
        }
        write!(f, "{}", self.window_line())
    }
}

/// The default context's limit on `machine`: the checkpoint's, lowered to the positions one
/// MLA cache holds on the backend and, on a discrete GPU that reports its free VRAM, to what
/// [`CONTEXT_SHARE`] of it holds beside the tier's margin.
fn vram_context_limit(cfg: &Config, machine: &Machine) -> (usize, String) {
    let (limit, why) = checkpoint_context(cfg);
    let (limit, why) = match machine.mla_cache_max_positions {
        Some(cap) if cap < limit => (
            cap,
            format!("the positions one MLA cache buffer holds on this adapter; {why} is {limit}"),
        ),
        _ => (limit, why),
    };
    let Vram::Free { free, .. } = machine.vram else {
        return (limit, why);
    };
    let room = free.saturating_sub(TIER_MARGIN_MIN_BYTES.max(free / 10)) as f64;
    let per_token = kv_shape(cfg).bytes_per_token();
    let fit = (CONTEXT_SHARE * room / per_token.max(1.0)) as usize / ram_budget::CONTEXT_STEP
        * ram_budget::CONTEXT_STEP;
    let fit = fit.max(ram_budget::MIN_DEFAULT_CONTEXT);
    if fit < limit {
        (
            fit,
            format!(
                "what fits in half the free VRAM ({:.1} GB) beside the margin, under {limit} ({why})",
                free as f64 / 1e9
            ),
        )
    } else {
        (limit, why)
    }
}

/// What the state snapshots take at their limits, in GB: as many as fit in the byte
/// limit, at most the count, each one KDA state and a row of logits.
fn snapshot_reserve_gb(cfg: &Config, l: SnapshotLimits) -> f64 {
    let each = snapshot_bytes(cfg) + 4 * cfg.vocab_size;
    let n = l.count.min(l.bytes / each.max(1));
    (n * each) as f64 / 1e9
}

#[cfg(test)]
mod tests;
