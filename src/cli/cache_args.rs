//! Flags that choose how the expert cache evicts (`--cache-policy`), what it pins from the
//! usage history (`--usage-pins`, `--usage-file`), and the routing trace a run records
//! (`--route-trace`), mapped onto the engine's [`CacheConfig`].

use clap::Args;
use k3::engine::config::CacheConfig;
use k3::experts::cache::cache_policy::PolicyKind;
use k3::experts::cache::usage_history::PinMode;
use std::path::PathBuf;

/// Expert cache policy, usage pins and routing trace flags.
#[derive(Args, Debug, Clone)]
pub(crate) struct CacheArgs {
    /// Which expert a full layer cache gives up: lru, lfu-decay (decayed use counts), 2q
    /// (scan-resistant) or auto (lru or lfu-decay, whichever would have hit more over the
    /// layer's recent lookups); docs/tuning.md compares them. Never changes the output.
    #[arg(long = "cache-policy", env = "K3_CACHE_POLICY", default_value_t = PolicyKind::default())]
    pub cache_policy: PolicyKind,
    /// Pin each layer's most used experts (at most half its slots) from the usage history of
    /// earlier runs: off, on (pins, and this run's use is added to the history at the end),
    /// read-only (pins; the history file is not changed, for A/B runs).
    #[arg(long = "usage-pins", env = "K3_USAGE_PINS", default_value = "off")]
    pub usage_pins: PinMode,
    /// The usage history file (default: .k3_usage in the snapshot directory). It is
    /// replaced whole when saved: a symlink there is replaced, not followed; a FIFO or
    /// device there is refused (a warning; the run goes on).
    #[arg(long = "usage-file", env = "K3_USAGE_FILE", value_name = "FILE")]
    pub usage_file: Option<PathBuf>,
    /// Record every MoE layer's routing (positions, experts, weights) into FILE as JSON
    /// lines, written at the end of the run; `k3 bench cache FILE` (a `--features lab`
    /// build) replays it. `-` is standard output; a FIFO or device is written in place, a
    /// symlink is followed, a regular file is replaced whole.
    #[arg(long = "route-trace", env = "K3_ROUTE_TRACE", value_name = "FILE")]
    pub route_trace: Option<PathBuf>,
}

impl CacheArgs {
    /// The cache settings these flags ask for.
    pub(crate) fn config(&self) -> CacheConfig {
        CacheConfig {
            policy: self.cache_policy,
            usage_pins: self.usage_pins,
            usage_file: self.usage_file.clone(),
            route_trace: self.route_trace.clone(),
        }
    }
}
