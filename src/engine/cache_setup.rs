//! Setting up the expert cache on a loaded model: the eviction policy, the pins from the
//! usage history, the routing tap, and the end-of-run writes of the trace and history.

use super::config::CacheConfig;
use crate::backend::Backend;
use crate::experts::cache::cache_policy::{CacheSetup, PolicyKind};
use crate::experts::cache::usage_history::{default_path, PinMode, UsageHistory};
use crate::experts::telemetry::route_trace::{RouteTap, TraceHeader};
use crate::model::{K3Model, Runner};
use anyhow::Result;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

impl CacheConfig {
    /// The usage history file: the one named, else the snapshot's default.
    fn usage_path<B: Backend>(&self, model: &K3Model<B>) -> PathBuf {
        self.usage_file
            .clone()
            .unwrap_or_else(|| default_path(&model.ckpt.dir))
    }

    /// The history at the usage file, `None` when there is none yet or when it is corrupt
    /// (reported, then ignored).
    fn history<B: Backend>(&self, model: &K3Model<B>) -> Option<UsageHistory> {
        let cfg = &model.ckpt.config;
        let path = self.usage_path(model);
        match UsageHistory::load(&path, cfg.num_hidden_layers, cfg.num_experts) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("[K3] {e:#}: ignored, the history starts again");
                None
            }
        }
    }

    /// The policy with the pins for `slots` a layer, and the routing tap, for `model`'s
    /// runtime.
    pub fn setup<B: Backend>(
        &self,
        model: &K3Model<B>,
        slots: usize,
    ) -> (CacheSetup, Option<Arc<RouteTap>>) {
        let cfg = model.ckpt.config.clone();
        let mut pins = HashMap::new();
        if self.usage_pins != PinMode::Off {
            let path = self.usage_path(model);
            match self.history(model) {
                Some(h) => {
                    for l in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
                        let p = h.pins(l, slots);
                        if !p.is_empty() {
                            pins.insert(l, p);
                        }
                    }
                    tracing::info!(
                        "[K3] usage pins: {} experts over {} layers from {} ({:.0} selections a layer{})",
                        pins.values().map(Vec::len).sum::<usize>(),
                        pins.len(),
                        path.display(),
                        h.selections(),
                        if self.usage_pins == PinMode::ReadOnly {
                            ", read-only"
                        } else {
                            ""
                        }
                    );
                }
                None => tracing::info!("[K3] usage pins: no history at {} yet", path.display()),
            }
        }
        if self.policy != PolicyKind::default() {
            tracing::info!("[K3] expert cache policy: {}", self.policy);
        }
        let setup = CacheSetup {
            kind: self.policy,
            pins: Arc::new(pins),
        };
        let tap = (self.route_trace.is_some() || self.usage_pins == PinMode::On).then(|| {
            let moe: Vec<usize> = (0..cfg.num_hidden_layers)
                .filter(|&l| cfg.is_moe_layer(l))
                .collect();
            let header = TraceHeader::new(
                cfg.num_hidden_layers,
                moe,
                cfg.num_experts,
                cfg.num_experts_per_token,
                cfg.expert_bytes() as u64,
                model.ckpt.dir.display().to_string(),
            );
            Arc::new(RouteTap::new(header, self.route_trace.clone()))
        });
        (setup, tap)
    }

    /// End of the run: writes the routing trace, and merges this run's expert use into the
    /// usage history (`--usage-pins on`). A history that cannot be written is reported, not
    /// fatal: the run's output is already out.
    pub fn finish<B: Backend>(&self, model: &Runner<B>) -> Result<()> {
        let Some(tap) = model.rt.experts().route_tap().cloned() else {
            return Ok(());
        };
        if let Some((path, n)) = tap.write_trace()? {
            tracing::info!(
                "[K3] route trace: {n} layer records written to {}",
                path.display()
            );
        }
        if self.usage_pins == PinMode::On {
            let cfg = &model.ckpt.config;
            let path = self.usage_path(model);
            let mut h = self
                .history(model)
                .unwrap_or_else(|| UsageHistory::empty(cfg.num_hidden_layers, cfg.num_experts));
            h.merge(&tap.usage()?)?;
            match h.save(&path) {
                Ok(()) => tracing::info!(
                    "[K3] usage history: {} ({:.0} selections a layer)",
                    path.display(),
                    h.selections()
                ),
                Err(e) => tracing::warn!("[K3] usage history not saved: {e:#}"),
            }
        }
        Ok(())
    }
}
