//! `k3 synth`: write a random-weight checkpoint in the published format.

use anyhow::Result;
use clap::Args;
use k3::synth::{synthesize, synthesize_over, write_config_only, Preset, Routing, SynthOptions};
use std::path::PathBuf;

/// Flags of `k3 synth`.
#[derive(Args, Debug)]
pub(crate) struct SynthArgs {
    /// Size preset: tiny (tests, seconds), small (CPU benchmarks), k3-slice (real K3 dimensions, tens of GB).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Number of layers (overrides the preset; at most 1024).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Routed experts per MoE layer (overrides the preset; at most 65536, and at most
    /// 262144 over all MoE layers).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Routed experts each token picks (overrides the preset's; 1 to --experts): e.g. K3's
    /// 16 of 896 on a small preset, so cache sizes scale as a fraction of the experts.
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// How the weights route: random (the default: tokens pick near-independent experts) or
    /// local (embedding, router and output rows share topic directions, so consecutive tokens
    /// of the text the model writes reuse experts as real K3 text does:
    /// docs/tuning.md#a-checkpoint-with-real-k3-locality).
    #[arg(long, default_value = "random")]
    pub routing: String,
    /// Seed: the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created; must be empty unless --force).
    pub out: PathBuf,
    /// Write into a non-empty OUT: the files synth writes replace those of the same name;
    /// nothing else there is deleted or changed.
    #[arg(long)]
    pub force: bool,
    /// Write only config.json, no tensors (seconds, any preset): enough for
    /// `k3 inspect --plan`, e.g. `--preset k3-slice --layers 93` for the full K3's plan.
    #[arg(long = "config-only", env = "K3_SYNTH_CONFIG_ONLY", value_parser = clap::builder::FalseyValueParser::new())]
    pub config_only: bool,
}

/// Runs `k3 synth`.
pub(crate) fn run(a: SynthArgs) -> Result<()> {
    let preset: Preset = a.preset.parse()?;
    let routing: Routing = a.routing.parse()?;
    let opts = SynthOptions {
        preset,
        layers: a.layers,
        experts: a.experts,
        top_k: a.top_k,
        routing,
        seed: a.seed,
        progress: true,
    };
    if a.config_only {
        let path = write_config_only(&opts, &a.out, a.force)?;
        eprintln!("[K3] synth: config only -> {}", path.display());
        return Ok(());
    }
    let s = if a.force {
        synthesize_over(&opts, &a.out)?
    } else {
        synthesize(&opts, &a.out)?
    };
    eprintln!(
        "[K3] synth: {} tensors, {} shard(s), {:.3} GB -> {}",
        s.tensors,
        s.shards,
        s.bytes as f64 / 1e9,
        a.out.display()
    );
    Ok(())
}
