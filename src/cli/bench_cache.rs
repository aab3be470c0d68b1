//! `k3 bench cache`: replays routing traces through every cache policy at every budget and
//! prints hit rate and bytes read per token; without a trace, calibrated synthetic traces of
//! the full K3 (docs/tuning.md#routing-traces-and-cache-policies).

use anyhow::{bail, Context, Result};
use clap::Args;
use k3::experts::cache::cache_policy::PolicyKind;
use k3::experts::cache::ram_budget::requested_slots;
use k3::experts::cache::usage_history::UsageHistory;
use k3::experts::lab::cache_policy_sim::{
    dedup_factor, replay, replay_best_fixed_set, replay_optimal, usage_of,
};
use k3::experts::lab::cache_policy_synth::{
    self as synth, RoutingModel, TraceShape, FITTED, TARGET_DEDUP_32, TARGET_HIT_44GB,
    TARGET_HIT_8GB,
};
use k3::experts::telemetry::route_trace::RouteTrace;
use std::path::PathBuf;

/// Flags of `k3 bench cache`.
#[derive(Args, Debug)]
pub(crate) struct CacheArgs {
    /// A trace recorded with `--route-trace`; without one, a calibrated synthetic trace of
    /// the full K3 is generated.
    trace: Option<PathBuf>,
    /// Cache requests to replay, GB (1e9 bytes) for all MoE layers, comma separated; slots per
    /// layer as the engine sizes them. The default is what a 64, 128 and 256 GB machine leaves
    /// the full K3 (docs/tuning.md).
    #[arg(long, default_value = "18,75,188")]
    expert_gb: String,
    /// A trace whose routes make the usage history for the pinned rows (a recorded trace
    /// has none otherwise; synthetic traces use earlier sessions of the same model).
    #[arg(long)]
    history: Option<PathBuf>,
    /// Synthetic: earlier sessions (as long as the measured one) the usage history learns.
    #[arg(long, default_value_t = 4)]
    history_sessions: usize,
    /// Synthetic: prompt tokens, prefilled in chunks of 32.
    #[arg(long, default_value_t = 256)]
    prompt: usize,
    /// Synthetic: decoded tokens after the prompt.
    #[arg(long, default_value_t = 1000)]
    decode: usize,
    /// Synthetic: MoE layers simulated (alike and independent; fewer is faster).
    #[arg(long, default_value_t = 92)]
    layers: usize,
    /// Synthetic: seed of the measured session.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Synthetic: route with SET,DRIFT,REUSE[,SIGMA] (working-set size, drift, reuse
    /// probability, spread of log popularity, 0.3 by default) instead of the fitted model, to
    /// see how a policy fares off the fit.
    #[arg(long, value_name = "SET,DRIFT,REUSE[,SIGMA]")]
    routing: Option<String>,
    /// Synthetic: also write the generated trace here.
    #[arg(long)]
    write_trace: Option<PathBuf>,
    /// Rerun the fit of the routing model to the published figures and print its best
    /// points instead of the policy table.
    #[arg(long)]
    fit: bool,
}

fn parse_gbs(s: &str) -> Result<Vec<f64>> {
    s.split(',')
        .map(|t| {
            let g: f64 = t
                .trim()
                .parse()
                .with_context(|| format!("--expert-gb: {t:?} is not a number of GB"))?;
            if !(g.is_finite() && g >= 0.0) {
                bail!("--expert-gb: {g} must be a number of GB >= 0");
            }
            Ok(g)
        })
        .collect()
}

/// Runs `k3 bench cache`.
pub(crate) fn run(a: CacheArgs) -> Result<()> {
    if a.fit {
        return fit(&a);
    }
    let gbs = parse_gbs(&a.expert_gb)?;
    let mut synthetic = None;
    let (trace, history) = match &a.trace {
        Some(p) => {
            let t = RouteTrace::read(p)?;
            let h = match &a.history {
                Some(hp) => Some(history_of(&[RouteTrace::read(hp)?])?),
                None => None,
            };
            (t, h)
        }
        None => {
            let shape = TraceShape {
                moe_layers: a.layers,
                prompt: a.prompt,
                chunk: 32,
                decode: a.decode,
                seed: a.seed,
            };
            let model = routing_model(a.routing.as_deref())?;
            let t = synth::generate(&model, &shape);
            if let Some(w) = &a.write_trace {
                t.write(w)?;
                eprintln!("[K3] synthetic trace written to {}", w.display());
            }
            let sessions: Vec<RouteTrace> = (0..a.history_sessions)
                .map(|i| {
                    synth::generate(
                        &model,
                        &TraceShape {
                            seed: a.seed + 1000 + i as u64,
                            ..shape
                        },
                    )
                })
                .collect();
            let h = if sessions.is_empty() {
                None
            } else {
                Some(history_of(&sessions)?)
            };
            synthetic = Some((model, shape));
            (t, h)
        }
    };
    let h = &trace.header;
    println!(
        "[K3] bench cache: {} | {} tokens, {} MoE layers, {} experts, top {} | dedup {:.2}x | pins from {}",
        h.source,
        trace.tokens(),
        h.moe_layers.len(),
        h.experts,
        h.top_k,
        dedup_factor(&trace),
        match (&a.trace, &history) {
            (_, None) => "nothing (no --history)".to_string(),
            (Some(_), Some(_)) => "--history".to_string(),
            (None, Some(_)) => format!("{} earlier sessions", a.history_sessions),
        }
    );
    println!("| K3_EXPERT_GB | slots/layer | policy | hit % | GB read/token | vs LRU (points) |");
    println!("|---|---|---|---|---|---|");
    // A recorded trace may come from a model with fewer layers than the full K3: slots per
    // layer are sized for its own MoE layers and expert size.
    // A synthetic trace stands for the full K3 whatever --layers simulates.
    let moe_layers = match &a.trace {
        Some(_) => h.moe_layers.len(),
        None => synth::K3_LAYERS - 1,
    };
    let all_slots: Vec<usize> = gbs
        .iter()
        .map(|&gb| requested_slots(gb, h.expert_bytes, moe_layers, h.experts))
        .collect();
    let oracle = synthetic.map(|(m, shape)| synth::replay_state_oracle(&m, &shape, &all_slots));
    for (i, (&gb, &slots)) in gbs.iter().zip(&all_slots).enumerate() {
        let lru = replay(&trace, PolicyKind::Lru, slots, None).hit_percent();
        let mut rows: Vec<(String, Option<&UsageHistory>)> = PolicyKind::ALL
            .iter()
            .map(|k| (k.name().to_string(), None))
            .collect();
        if let Some(hist) = &history {
            rows.extend(
                PolicyKind::ALL
                    .iter()
                    .map(|k| (format!("{}+pins", k.name()), Some(hist))),
            );
        }
        let opt = replay_optimal(&trace, slots);
        println!(
            "| {gb} | {slots} | optimal (offline bound) | {:.1} | {:.2} | {:+.1} |",
            opt.hit_percent(),
            opt.bytes_per_token() / 1e9,
            opt.hit_percent() - lru
        );
        if let Some(o) = oracle.as_ref().and_then(|o| o.get(i)) {
            println!(
                "| {gb} | {slots} | knows the model's state (online bound) | {:.1} | {:.2} | {:+.1} |",
                o.hit_percent(),
                o.bytes_per_token() / 1e9,
                o.hit_percent() - lru
            );
        }
        let fixed = replay_best_fixed_set(&trace, slots);
        println!(
            "| {gb} | {slots} | best fixed set (hindsight) | {:.1} | {:.2} | {:+.1} |",
            fixed.hit_percent(),
            fixed.bytes_per_token() / 1e9,
            fixed.hit_percent() - lru
        );
        for (name, hist) in rows {
            let kind: PolicyKind = name.trim_end_matches("+pins").parse()?;
            let r = replay(&trace, kind, slots, hist);
            println!(
                "| {gb} | {slots} | {name} | {:.1} | {:.2} | {:+.1} |",
                r.hit_percent(),
                r.bytes_per_token() / 1e9,
                r.hit_percent() - lru
            );
        }
    }
    println!(
        "optimal: Belady's MIN, knowing the whole trace (no policy beats it). knows the \
         model's state (synthetic traces): before each chunk, holds the experts the routing \
         model makes most likely next; no online policy expects more. best fixed set: the \
         most used experts of each layer, held from the start (a bound only when the context \
         never changes). docs/tuning.md#routing-traces-and-cache-policies"
    );
    Ok(())
}

/// The fitted model, or the one `--routing SET,DRIFT,REUSE[,SIGMA]` states.
fn routing_model(s: Option<&str>) -> Result<RoutingModel> {
    let Some(s) = s else {
        return Ok(FITTED);
    };
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let bad =
        || anyhow::anyhow!("--routing: {s:?} is not SET,DRIFT,REUSE[,SIGMA] (e.g. 16,0.0,0.6)");
    let (set, drift, reuse, sigma) = match parts[..] {
        [set, drift, reuse] => (set, drift, reuse, None),
        [set, drift, reuse, sigma] => (set, drift, reuse, Some(sigma)),
        _ => return Err(bad()),
    };
    let sigma = match sigma {
        Some(x) => x.parse::<f64>().map_err(|_| bad())?,
        None => FITTED.sigma,
    };
    if !(sigma.is_finite() && (0.0..=4.0).contains(&sigma)) {
        bail!("--routing: SIGMA is a spread of log popularity in [0, 4], got {s:?}");
    }
    let m = RoutingModel {
        sigma,
        set_size: set.parse().map_err(|_| bad())?,
        drift: drift.parse().map_err(|_| bad())?,
        reuse: reuse.parse().map_err(|_| bad())?,
    };
    if !(0.0..=1.0).contains(&m.drift) || !(0.0..=1.0).contains(&m.reuse) {
        bail!("--routing: drift and reuse are probabilities in [0, 1], got {s:?}");
    }
    Ok(m)
}

/// The usage history that the routes of `traces` (run one after another) leave.
fn history_of(traces: &[RouteTrace]) -> Result<UsageHistory> {
    let first = &traces[0].header;
    let mut h = UsageHistory::empty(first.layers, first.experts);
    for t in traces {
        if (t.header.layers, t.header.experts) != (first.layers, first.experts) {
            bail!(
                "--history: a trace of {} layers x {} experts for one of {} x {}",
                t.header.layers,
                t.header.experts,
                first.layers,
                first.experts
            );
        }
        h.merge(&usage_of(t))?;
    }
    Ok(h)
}

fn fit(a: &CacheArgs) -> Result<()> {
    let layers = a.layers.min(16);
    let decode = a.decode.min(400);
    eprintln!("[K3] fitting the routing model: {layers} layers, {decode} decode tokens a point");
    let pts = synth::fit(FITTED.sigma, layers, decode);
    println!(
        "| set size | drift | reuse | hit % 8 GB (target {TARGET_HIT_8GB}) | hit % 44 GB (target {TARGET_HIT_44GB}) | dedup 32 (target {TARGET_DEDUP_32}) | loss |"
    );
    println!("|---|---|---|---|---|---|---|");
    for p in pts.iter().take(10) {
        let RoutingModel {
            set_size,
            drift,
            reuse,
            ..
        } = p.model;
        println!(
            "| {set_size} | {drift} | {reuse:.2} | {:.1} | {:.1} | {:.2} | {:.1} |",
            p.hit_8gb,
            p.hit_44gb,
            p.dedup_32,
            p.loss()
        );
    }
    Ok(())
}
