//! `k3 bench prefill`: a long prompt prefilled with the default window and with `--chunk 32`
//! (or the `--chunks` given), each run from an empty expert cache: time, expert GB read,
//! GB read ÷ the GB of the distinct experts the prompt routes to in each layer (summed over
//! layers: what reading each routed expert once a layer costs), and tokens per second.

use anyhow::{bail, Context, Result};
use clap::Args;
use k3::backend::Backend;
use k3::experts::telemetry::route_trace::{RouteTap, TraceHeader};
use k3::model::Runner;
use k3::stats::Stats;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Flags of `k3 bench prefill`.
#[derive(Args, Debug)]
pub(crate) struct PrefillArgs {
    /// Snapshot directory.
    model: PathBuf,
    /// Prompt length in tokens (ids drawn from a fixed seed, below the special tokens).
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Window bounds to compare with the default one (the whole prompt), comma separated;
    /// 0 leaves a case out.
    #[arg(long = "chunks", default_value = "32")]
    windows: String,
    /// Rounds; each round runs every case once, in turn.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Seed of the prompt's ids.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The prompt's ids (comma separated) instead of `--tokens` drawn ones, to prefill the
    /// same prompt as another engine.
    #[arg(long)]
    ids: Option<String>,
    #[command(flatten)]
    load: super::model_args::ModelArgs,
}

/// Runs `k3 bench prefill`.
pub(crate) fn run(a: PrefillArgs) -> Result<()> {
    super::threads::init(a.load.threads)?;
    if a.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut windows: Vec<Option<usize>> = vec![None];
    for t in a
        .windows
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        let c: usize = t
            .parse()
            .with_context(|| format!("--chunks: {t:?} is not a number of tokens"))?;
        if c > 0 {
            k3::session::check_window(c)?;
            windows.push(Some(c));
        }
    }
    a.load.with_model(&a.model, PrefillJob { a: &a, windows })
}

struct PrefillJob<'a> {
    a: &'a PrefillArgs,
    windows: Vec<Option<usize>>,
}

/// `n` prompt ids from `seed`: a fixed xorshift stream below the first special token.
pub(super) fn prompt_ids(
    n: usize,
    seed: u64,
    vocab: usize,
    first_special: Option<u32>,
) -> Vec<u32> {
    let top = first_special
        .map_or(vocab, |s| (s as usize).min(vocab))
        .max(2) as u64;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + x % (top - 1)) as u32
        })
        .collect()
}

/// One case's figures.
struct Run {
    secs: f64,
    read_gb: f64,
    distinct_gb: f64,
}

impl super::model_args::ModelJob for PrefillJob<'_> {
    type Out = ();
    fn run<B: Backend>(self, model: &mut Runner<B>, _plan: &k3::engine::Plan) -> Result<()> {
        let PrefillJob { a, windows } = self;
        let cfg = model.ckpt.config.clone();
        let ids = match &a.ids {
            Some(list) => super::run_cmd::parse_ids(list)?,
            None => prompt_ids(a.tokens, a.seed, cfg.vocab_size, cfg.bos_token_id),
        };
        if ids.is_empty() {
            bail!("--ids: give at least one token id");
        }
        let default_window = model.rt.prefill_window();
        // The engine's runtime (its routing tap writes the run's trace at the end) comes
        // back once the cases, each on a runtime of its own, are done.
        let mut engine_rt = None;
        println!(
            "| case | window | tokens | prefill s | tok/s | expert GB read | GB of distinct experts per layer, summed | read ÷ distinct |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for round in 0..a.rounds {
            for &max_window in &windows {
                let (r, rt) = one_run(model, &a.load, &ids, max_window, &cfg)?;
                engine_rt.get_or_insert(rt);
                let window = max_window
                    .map_or(default_window, |c| c.min(default_window))
                    .min(ids.len());
                let name = max_window.map_or("default".to_string(), |c| format!("--chunk {c}"));
                println!(
                    "| {name} (round {round}) | {window} | {} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} |",
                    ids.len(),
                    r.secs,
                    ids.len() as f64 / r.secs.max(1e-9),
                    r.read_gb,
                    r.distinct_gb,
                    r.read_gb / r.distinct_gb.max(1e-12)
                );
            }
        }
        if let Some(rt) = engine_rt {
            model.rt = rt;
        }
        Ok(())
    }
}

/// One prefill of `ids` in windows of at most `max_window`, from empty expert caches (the host
/// cache and the GPU tier are sized again, so the last run's experts are not hits), on a
/// runtime of its own; returns the runtime it replaced.
fn one_run<B: Backend>(
    model: &mut Runner<B>,
    load: &super::model_args::ModelArgs,
    ids: &[u32],
    max_window: Option<usize>,
    cfg: &k3::config::Config,
) -> Result<(Run, k3::model::Runtime)> {
    let mut engine = load.config()?;
    engine.max_window = max_window.or(load.max_window);
    let moe_layers: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    let header = TraceHeader::new(
        cfg.num_hidden_layers,
        moe_layers,
        cfg.num_experts,
        cfg.num_experts_per_token,
        cfg.expert_bytes() as u64,
        "k3 bench prefill".into(),
    );
    let tap = Arc::new(RouteTap::new(header, None));
    let (_, mut settings) = k3::engine::streaming::plan_runtime(&model.model, &engine)?;
    settings.route_tap = Some(tap.clone());
    let rt = k3::model::Runtime::new(&model.ckpt.config, &model.backend, settings)?;
    rt.progress().set_print(!engine.load.quiet);
    let replaced = std::mem::replace(&mut model.rt, rt);
    let mut st = model.new_state()?;
    let mut stats = Stats::default();
    let t = Instant::now();
    // The window is the model's, which the engine config above bounds.
    k3::session::prefill(
        model,
        &mut st,
        ids,
        k3::session::MAX_WINDOW,
        false,
        &mut stats,
        None,
    )?;
    let secs = t.elapsed().as_secs_f64();
    let distinct = tap.usage()?.iter().filter(|&&c| c > 0.0).count();
    let run = Run {
        secs,
        read_gb: stats.bytes_streamed as f64 / 1e9,
        distinct_gb: distinct as f64 * cfg.expert_bytes() as f64 / 1e9,
    };
    Ok((run, replaced))
}

#[cfg(test)]
mod tests {
    use super::prompt_ids;

    #[test]
    fn prompt_ids_are_fixed_and_below_the_special_tokens() {
        let a = prompt_ids(500, 1, 1024, Some(900));
        assert_eq!(a, prompt_ids(500, 1, 1024, Some(900)));
        assert_ne!(a, prompt_ids(500, 2, 1024, Some(900)));
        assert!(a.iter().all(|&t| (1..900).contains(&t)));
    }
}
