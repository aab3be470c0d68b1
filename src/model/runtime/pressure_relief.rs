//! The runtime's side of the memory-pressure guard: when the OS reports pressure, the
//! expert cache (the host cache or the unified pool) shrinks before the next forward pass.

use super::Runtime;
use crate::backend::Backend;
use crate::config::Config;
use crate::experts::cache::pressure_guard::CacheSize;
use anyhow::{bail, Result};
use std::time::Instant;

impl Runtime {
    /// Shrinks the expert cache when the guard's source reports memory pressure: the host
    /// cache keeps its most valued experts, the unified pool of `backend` (running the
    /// model of `cfg`) starts over smaller.
    pub(in crate::model) fn relieve_memory_pressure<B: Backend>(
        &self,
        cfg: &Config,
        backend: &B,
    ) -> Result<()> {
        let Some(shrink) = self.pressure.as_ref().and_then(|g| g.poll(Instant::now())) else {
            return Ok(());
        };
        let eb = cfg.expert_bytes() as f64;
        let layers = cfg.moe_layer_count() as f64;
        let (gb, what) = match (shrink.before, shrink.after) {
            (CacheSize::Pool(a), CacheSize::Pool(b)) => {
                backend.configure_expert_tier(
                    b as u64 * cfg.expert_bytes() as u64,
                    cfg.num_experts * cfg.moe_layer_count(),
                    cfg.moe_intermediate_size,
                    cfg.routed_expert_hidden_size,
                )?;
                (
                    (a - b) as f64 * eb / 1e9,
                    format!("unified pool {a}->{b} slots (it starts over empty)"),
                )
            }
            (CacheSize::PerLayer(a), CacheSize::PerLayer(b)) => {
                self.experts.shrink_host_cache(b)?;
                (
                    (a - b) as f64 * eb * layers / 1e9,
                    format!("host cache {a}->{b} slots/layer"),
                )
            }
            (a, b) => bail!("internal: the pressure guard turned {a:?} into {b:?}"),
        };
        tracing::info!(
            "[K3] memory pressure {} ({}): {what}, {gb:.1} GB handed back",
            shrink.level,
            shrink.from
        );
        Ok(())
    }
}
