//! What a loaded model runs with besides its weights, built once: the expert source (its
//! cache, policy, pins, routing tap and reads), which experts a token may leave out,
//! next-layer prefetch, the memory-pressure guard, the prompt cache, the other ranks'
//! experts, the prefill progress, and the row bounds of a pass (the prefill window, the
//! head's rows a call). [`super::Runner`] pairs it with the model for the sessions that run
//! both.

mod pressure_relief;

use super::context::checkpoint_context;
use super::prefill_progress::PrefillProgress;
use super::prefill_window::moe_row_bytes;
use super::prompt_cache::PromptCache;
use crate::backend::Backend;
use crate::config::Config;
use crate::experts::cache::cache_policy::CacheSetup;
use crate::experts::cache::pressure_guard::{CacheSize, PressureGuard};
use crate::experts::plan::expert_selection::ExpertSelection;
use crate::experts::remote::RemoteExperts;
use crate::experts::telemetry::route_trace::RouteTap;
use crate::experts::{ExpertSource, StreamConfig};
use anyhow::Result;
use std::sync::Arc;

/// Everything a [`Runtime`] starts with; the engine fills it from its memory plan, a test
/// names what it needs and leaves the rest at the default.
#[derive(Default)]
pub struct RuntimeSettings {
    /// How experts are read and how many host-cache slots a layer keeps.
    pub stream: StreamConfig,
    /// The cache's eviction policy and pins.
    pub cache: CacheSetup,
    /// The routing tap (`--route-trace`, the usage history), when one is on.
    pub route_tap: Option<Arc<RouteTap>>,
    /// Next-layer prefetch (`--prefetch`); the logits are the same either way.
    pub prefetch: bool,
    /// Prefetch on every layer, without the gate (`--prefetch always`).
    pub prefetch_always: bool,
    /// Which experts a token may leave out (exact by default).
    pub selection: ExpertSelection,
    /// Tokens a conversation may hold; `None`: the checkpoint's limit.
    pub context: Option<usize>,
    /// Tokens a forward pass takes at most; `None`: what the backend allows.
    pub window: Option<usize>,
    /// The memory-pressure guard over the expert cache (`None`: off).
    pub pressure: Option<PressureGuard>,
    /// The prompt cache sessions share (`None`: off).
    pub prompt_cache: Option<Arc<PromptCache>>,
    /// The other ranks' experts when this process heads an expert-parallel job.
    pub remote: Option<Arc<dyn RemoteExperts>>,
}

/// The runtime services of one loaded model, lent to each forward pass.
pub struct Runtime {
    pub(super) experts: ExpertSource,
    pub(super) selection: ExpertSelection,
    pub(super) prefetch: bool,
    context: usize,
    prompt_cache: Option<Arc<PromptCache>>,
    /// Rows of one head matmul when every row's logits are wanted.
    pub(super) head_rows: usize,
    /// Tokens one forward pass takes at most (the prefill window).
    window: usize,
    pub(super) progress: Arc<PrefillProgress>,
    pressure: Option<PressureGuard>,
    pub(super) remote: Option<Arc<dyn RemoteExperts>>,
}

impl Runtime {
    /// The runtime of the model of `cfg` on `backend` with settings `s`: the expert source
    /// is built here, once, over the backend's lent memory and tier exchange; the window is
    /// held within the backend's limits.
    pub fn new<B: Backend>(cfg: &Config, backend: &B, s: RuntimeSettings) -> Result<Runtime> {
        let mut experts = ExpertSource::with_lender(s.stream, backend.read_lender())?
            .with_tier_exchange(backend.tier_exchange());
        experts.set_cache_setup(s.cache)?;
        experts.set_route_tap(s.route_tap);
        experts.set_prefetch_always(s.prefetch_always);
        let max_window = backend.max_rows(moe_row_bytes(cfg));
        Ok(Runtime {
            experts,
            selection: s.selection.validated()?,
            prefetch: s.prefetch,
            context: s.context.unwrap_or(checkpoint_context(cfg).0),
            prompt_cache: s.prompt_cache,
            head_rows: backend.max_rows(cfg.vocab_size * 4),
            window: s.window.unwrap_or(max_window).clamp(1, max_window),
            progress: Arc::default(),
            pressure: s.pressure,
            remote: s.remote,
        })
    }

    /// The expert source (for disk counters, hit rates and the cache's state).
    pub fn experts(&self) -> &ExpertSource {
        &self.experts
    }

    /// Tokens a conversation may hold, prompt plus answer: the plan's, or `--max-tokens`.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Tokens one forward pass takes at most: prompts are prefilled in windows of this
    /// many tokens, each routed expert read once a layer per window.
    pub fn prefill_window(&self) -> usize {
        self.window
    }

    /// Whether next-layer prefetch is on.
    pub fn prefetch(&self) -> bool {
        self.prefetch
    }

    /// The prompt cache sessions share, when one is on.
    pub fn prompt_cache(&self) -> Option<&PromptCache> {
        self.prompt_cache.as_deref()
    }

    /// The progress of the prefill running now, shared with readers on other threads.
    pub fn progress(&self) -> &Arc<PrefillProgress> {
        &self.progress
    }

    /// The expert cache's size as the pressure guard last set it, when one is installed.
    pub fn pressure_cache_size(&self) -> Option<CacheSize> {
        self.pressure.as_ref().map(PressureGuard::size)
    }
}
