//! Flags that choose how the expert cache evicts (`--cache-policy`), what it pins from the
//! usage history (`--usage-pins`, `--usage-file`), and the routing trace a run records
//! (`--route-trace`); their start-up and end-of-run work.

use anyhow::Result;
use clap::Args;
use k3::backend::Backend;
use k3::experts::cache_policy::{CacheSetup, PolicyKind};
use k3::experts::route_trace::{RouteTap, TraceHeader};
use k3::experts::usage_history::{default_path, PinMode, UsageHistory};
use k3::model::K3Model;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Expert cache policy, usage pins and routing trace flags.
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// Which expert a full layer cache gives up: lru, lfu-decay (decayed use counts) or 2q
    /// (scan-resistant); docs/tuning.md compares them. Never changes the output.
    #[arg(
        long = "cache-policy",
        env = "K3_CACHE_POLICY",
        default_value = "lfu-decay"
    )]
    pub cache_policy: PolicyKind,
    /// Pin each layer's most used experts (at most half its slots) from the usage history of
    /// earlier runs: off, on (pins, and this run's use is added to the history at the end),
    /// read-only (pins; the history file is not changed, for A/B runs).
    #[arg(long = "usage-pins", env = "K3_USAGE_PINS", default_value = "off")]
    pub usage_pins: PinMode,
    /// The usage history file (default: .k3_usage in the snapshot directory).
    #[arg(long = "usage-file", env = "K3_USAGE_FILE", value_name = "FILE")]
    pub usage_file: Option<PathBuf>,
    /// Record every MoE layer's routing (positions, experts, weights) into FILE as JSON
    /// lines, written at the end of the run; `k3 bench cache FILE` (a `--features lab`
    /// build) replays it.
    #[arg(long = "route-trace", env = "K3_ROUTE_TRACE", value_name = "FILE")]
    pub route_trace: Option<PathBuf>,
}

impl CacheArgs {
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
                eprintln!("[K3] {e:#}: ignored, the history starts again");
                None
            }
        }
    }

    /// Installs the policy, the pins for `slots` a layer and the routing tap in `model`.
    pub fn configure<B: Backend>(&self, model: &mut K3Model<B>, slots: usize) -> Result<()> {
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
                    eprintln!(
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
                None => eprintln!("[K3] usage pins: no history at {} yet", path.display()),
            }
        }
        if self.cache_policy != PolicyKind::LfuDecay {
            eprintln!("[K3] expert cache policy: {}", self.cache_policy);
        }
        model.experts_mut().set_cache_setup(CacheSetup {
            kind: self.cache_policy,
            pins: Arc::new(pins),
        })?;
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
        model.experts_mut().set_route_tap(tap);
        Ok(())
    }

    /// End of the run: writes the routing trace, and merges this run's expert use into the
    /// usage history (`--usage-pins on`). A history that cannot be written is reported, not
    /// fatal: the run's output is already out.
    pub fn finish<B: Backend>(&self, model: &K3Model<B>) -> Result<()> {
        let Some(tap) = model.experts().route_tap().cloned() else {
            return Ok(());
        };
        if let Some((path, n)) = tap.write_trace()? {
            eprintln!(
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
                Ok(()) => eprintln!(
                    "[K3] usage history: {} ({:.0} selections a layer)",
                    path.display(),
                    h.selections()
                ),
                Err(e) => eprintln!("[K3] usage history not saved: {e:#}"),
            }
        }
        Ok(())
    }
}
