//! `k3 bench streams`: N greedy streams decoded together, one `forward_batch` a step, against
//! the same streams decoded one at a time in the same run: aggregate and per-stream tok/s,
//! expert GB read per step and its ratio to one stream, and a check that every stream's
//! tokens equal its tokens alone.

use anyhow::{bail, Context, Result};
use clap::Args;
use k3::backend::Backend;
use k3::model::{Logits, Runner, Segment, State};
use k3::sampling::argmax_lowest;
use k3::stats::Stats;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `k3 bench streams`.
#[derive(Args, Debug)]
pub(crate) struct StreamsArgs {
    /// Snapshot directory (config.json, index, shards). Not needed with --demo.
    #[arg(required_unless_present = "demo")]
    model: Option<PathBuf>,
    /// Synthesize the built-in `tiny` model into the cache directory (once) and run it.
    #[arg(long)]
    demo: bool,
    /// Stream counts to run together, comma separated; each is compared with the same
    /// streams decoded one at a time.
    #[arg(long, default_value = "1,4,8")]
    streams: String,
    /// Tokens each stream decodes (timed), after its prompt's prefill (not timed).
    #[arg(long, default_value_t = 32)]
    ngen: usize,
    /// Prompt tokens per stream; stream s draws its ids from seed s + 1, so the streams
    /// route to different experts.
    #[arg(long, default_value_t = 16)]
    prompt: usize,
    /// Rounds; each runs every case in turn, and the report keeps each case's fastest.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    load: super::model_args::ModelArgs,
}

/// Runs `k3 bench streams`.
pub(crate) fn run(a: StreamsArgs) -> Result<()> {
    super::threads::init(a.load.threads)?;
    if a.ngen == 0 {
        bail!("--ngen must be at least 1");
    }
    if a.prompt == 0 {
        bail!("--prompt must be at least 1");
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut counts = Vec::new();
    for t in a
        .streams
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        let n: usize = t
            .parse()
            .with_context(|| format!("--streams: {t:?} is not a number of streams"))?;
        if n == 0 {
            bail!("--streams: 0 streams; give counts of at least 1, e.g. 1,4,8");
        }
        counts.push(n);
    }
    if counts.is_empty() {
        bail!("--streams is empty: give stream counts, e.g. 1,4,8");
    }
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => super::model_args::ensure_demo()?,
    };
    a.load.with_model(&dir, StreamsJob { a: &a, counts })
}

struct StreamsJob<'a> {
    a: &'a StreamsArgs,
    counts: Vec<usize>,
}

/// One case's figures: `n` streams, together or one at a time.
struct Case {
    n: usize,
    together: bool,
    secs: f64,
    /// Of `secs`, the device's kernel time, when the backend keeps count (`--gpu-profile 1`).
    busy: Option<f64>,
    /// The device's kernel-time table of the timed steps (`--gpu-profile 1`).
    profile: Option<String>,
    steps: usize,
    stats: Stats,
}

impl Case {
    /// The case as the tables name it.
    fn name(&self) -> String {
        if self.together {
            format!("{} together", self.n)
        } else {
            format!("{} one at a time", self.n)
        }
    }
    fn tok_s(&self) -> f64 {
        (self.n * self.steps) as f64 / self.secs.max(1e-9)
    }
    /// Decode passes the case ran: one a step together, one a stream and step alone.
    fn passes(&self) -> usize {
        if self.together {
            self.steps
        } else {
            self.steps * self.n
        }
    }
    /// Expert GB read per step of all `n` streams.
    fn gb_per_step(&self) -> f64 {
        self.stats.bytes_streamed as f64 / 1e9 / self.steps as f64
    }
    /// Routed experts run per step of all `n` streams (summed over layers).
    fn experts_per_step(&self) -> f64 {
        self.stats.expert_lookups as f64 / self.steps as f64
    }
}

impl super::model_args::ModelJob for StreamsJob<'_> {
    type Out = ();
    fn run<B: Backend>(self, model: &mut Runner<B>, _plan: &k3::engine::Plan) -> Result<()> {
        let StreamsJob { a, counts } = self;
        let cfg = model.ckpt.config.clone();
        let most = counts.iter().copied().max().unwrap_or(1);
        if most > model.max_window() {
            bail!(
                "--streams: {most} streams are more rows than this backend runs in one pass ({})",
                model.max_window()
            );
        }
        let prompts: Vec<Vec<u32>> = (0..most)
            .map(|s| {
                super::bench_prefill::prompt_ids(
                    a.prompt,
                    s as u64 + 1,
                    cfg.vocab_size,
                    cfg.bos_token_id,
                )
            })
            .collect();
        let backend = model.backend.name();
        println!(
            "[K3] bench streams: backend {backend}, {} tokens a stream",
            a.ngen
        );
        let engine = a.load.config()?;
        // Case 0 is every stream alone: the baseline, and the tokens the batches must match.
        let shapes: Vec<(usize, bool)> = std::iter::once((most, false))
            .chain(counts.iter().map(|&n| (n, true)))
            .collect();
        let mut cases: Vec<Option<Case>> = shapes.iter().map(|_| None).collect();
        let mut reference: Vec<Vec<u32>> = Vec::new();
        let mut mismatches = Vec::new();
        for _ in 0..a.rounds {
            for (k, &(n, together)) in shapes.iter().enumerate() {
                // From empty caches each time, so no case inherits another's experts.
                k3::engine::streaming::replan(model, &engine, |_| {})?;
                let (case, tokens) = decode(model, &prompts[..n], a.ngen, together)?;
                if !together {
                    reference = tokens;
                } else {
                    for (s, t) in tokens.iter().enumerate() {
                        let first = t.iter().zip(&reference[s]).position(|(x, y)| x != y);
                        if let Some(step) = first {
                            mismatches.push(format!(
                                "{n} streams: stream {s} differs from its run alone at token \
                                 {step} ({} vs {})",
                                t[step], reference[s][step]
                            ));
                        }
                    }
                }
                if cases[k].as_ref().is_none_or(|c| case.secs < c.secs) {
                    cases[k] = Some(case);
                }
            }
        }
        let cases: Vec<Case> = cases.into_iter().flatten().collect();
        report(a, &backend, &cases, &mismatches)?;
        if !mismatches.is_empty() {
            bail!(
                "batched streams did not decode the tokens they decode alone:\n{}",
                mismatches.join("\n")
            );
        }
        println!("[K3] bench streams: every stream's tokens equal its tokens alone");
        Ok(())
    }
}

/// Prefills each of `prompts` (not timed), then decodes `ngen` greedy tokens for every
/// stream, timed: all streams in one pass a step (`together`) or one stream at a time.
/// Returns the figures and each stream's tokens (the prefill's pick, then each step's).
fn decode<B: Backend>(
    model: &Runner<B>,
    prompts: &[Vec<u32>],
    ngen: usize,
    together: bool,
) -> Result<(Case, Vec<Vec<u32>>)> {
    let mut untimed = Stats::default();
    let mut states: Vec<State<B>> = Vec::with_capacity(prompts.len());
    let mut tokens: Vec<Vec<u32>> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut st = model.new_state()?;
        let logits = model.forward(&mut st, p, Logits::Last, &mut untimed, None)?;
        states.push(st);
        tokens.push(vec![argmax_lowest(&logits)]);
    }
    let mut stats = Stats::default();
    // The prefill's kernels are not the case's.
    let _ = model.backend.take_profile();
    let busy0 = model.backend.busy_seconds();
    let t = Instant::now();
    if together {
        for _ in 0..ngen {
            let last: Vec<[u32; 1]> = tokens.iter().map(|t| [t[t.len() - 1]]).collect();
            let mut segs: Vec<Segment<'_, B>> = states
                .iter_mut()
                .zip(&last)
                .map(|(state, ids)| Segment {
                    state,
                    ids,
                    want: Logits::Last,
                })
                .collect();
            let logits = model
                .forward_batch(&mut segs, &mut stats, None, None)?
                .context("internal: a pass without a cancel flag was cancelled")?;
            for (t, l) in tokens.iter_mut().zip(&logits) {
                t.push(argmax_lowest(l));
            }
        }
    } else {
        for (st, t) in states.iter_mut().zip(&mut tokens) {
            for _ in 0..ngen {
                let last = [t[t.len() - 1]];
                let logits = model.forward(st, &last, Logits::Last, &mut stats, None)?;
                t.push(argmax_lowest(&logits));
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let busy = busy0.zip(model.backend.busy_seconds()).map(|(a, b)| b - a);
    let profile = model.backend.take_profile();
    let case = Case {
        n: prompts.len(),
        together,
        secs,
        busy,
        profile,
        steps: ngen,
        stats,
    };
    Ok((case, tokens))
}

/// Prints the table and writes `--json`. The first case is the streams one at a time.
fn report(a: &StreamsArgs, backend: &str, cases: &[Case], mismatches: &[String]) -> Result<()> {
    let alone = &cases[0];
    // One stream's decode, the unit of the ratios: the baseline per stream.
    let one_tok_s = alone.tok_s();
    let one_gb = alone.gb_per_step() / alone.n as f64;
    println!(
        "| streams | passes | decode s | aggregate tok/s | tok/s per stream | × one at a time | expert GB read/step | ÷ one stream's | experts run/step | ms a pass: wall / device |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for c in cases {
        let name = c.name();
        let ratio = if one_gb > 0.0 {
            format!("{:.2}", c.gb_per_step() / one_gb)
        } else {
            "n/a (none read)".to_string()
        };
        let per_stream = c.tok_s() / c.n as f64;
        let per_pass = |s: f64| s * 1e3 / c.passes().max(1) as f64;
        let device = match c.busy {
            Some(b) => format!("{:.2} / {:.2}", per_pass(c.secs), per_pass(b)),
            None => format!("{:.2} / n/a (--gpu-profile 1)", per_pass(c.secs)),
        };
        println!(
            "| {name} | {} | {:.3} | {:.1} | {:.1} | {:.2} | {:.4} | {ratio} | {:.0} | {device} |",
            c.passes(),
            c.secs,
            c.tok_s(),
            per_stream,
            c.tok_s() / one_tok_s.max(1e-9),
            c.gb_per_step(),
            c.experts_per_step()
        );
        rows.push(json!({
            "streams": c.n,
            "together": c.together,
            "passes": c.passes(),
            "decode_s": c.secs,
            "aggregate_tok_s": c.tok_s(),
            "tok_s_per_stream": per_stream,
            "speedup_vs_one_at_a_time": c.tok_s() / one_tok_s.max(1e-9),
            "expert_gb_per_step": c.gb_per_step(),
            "expert_gb_per_step_vs_one_stream": (one_gb > 0.0).then(|| c.gb_per_step() / one_gb),
            "experts_run_per_step": c.experts_per_step(),
            "device_busy_s": c.busy,
        }));
    }
    // Where a pass's wall time goes on the host's clock: on the GPU, a phase's time is its
    // recording plus what it waits for (the router's and the logits' readbacks).
    println!();
    println!("| streams | ms a pass: attention | MoE | of it, router wait | head | the rest |");
    println!("|---|---|---|---|---|---|");
    for c in cases {
        let per_pass = |d: std::time::Duration| d.as_secs_f64() * 1e3 / c.passes().max(1) as f64;
        let st = &c.stats;
        let phases = st.attn + st.moe + st.head;
        let rest = (c.secs - phases.as_secs_f64()).max(0.0) * 1e3 / c.passes().max(1) as f64;
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {rest:.2} |",
            c.name(),
            per_pass(st.attn),
            per_pass(st.moe),
            per_pass(st.router_wait),
            per_pass(st.head),
        );
    }
    for c in cases {
        if let Some(p) = &c.profile {
            println!("\n{}, {} passes:\n{}", c.name(), c.passes(), p.trim_end());
        }
    }
    if let Some(path) = &a.json {
        let doc = json!({
            "backend": backend,
            "ngen": a.ngen,
            "prompt_tokens": a.prompt,
            "tokens_match_alone": mismatches.is_empty(),
            "mismatches": mismatches,
            "cases": rows,
        });
        k3::atomic_file::write_atomically(path, serde_json::to_string_pretty(&doc)?.as_bytes())
            .with_context(|| format!("--json: writing {}", path.display()))?;
    }
    Ok(())
}
