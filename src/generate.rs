//! Prefill in chunks and decode token by token: the main job, independent of the CLI.

use crate::backend::Backend;
use crate::model::trace::Trace;
use crate::model::{K3Model, Logits, State};
use crate::stats::Stats;
use anyhow::{bail, Result};
use std::time::Instant;

/// Largest prefill chunk accepted (`K3_CHUNK`).
pub const MAX_CHUNK: usize = 512;

/// Runs the prompt through the model `chunk` tokens at a time. Returns the logits of
/// every prompt position when `all` is set, else those of the last position.
pub fn prefill<B: Backend>(
    model: &K3Model<B>,
    st: &mut State<B>,
    ids: &[u32],
    chunk: usize,
    all: bool,
    stats: &mut Stats,
    trace: Option<&Trace>,
) -> Result<Vec<f32>> {
    if chunk == 0 || chunk > MAX_CHUNK {
        bail!("--chunk / K3_CHUNK must be between 1 and {MAX_CHUNK}, got {chunk}");
    }
    if ids.is_empty() {
        bail!("the prompt is empty: give at least one token id");
    }
    let want = if all { Logits::All } else { Logits::Last };
    let mut out = Vec::new();
    for c in ids.chunks(chunk) {
        let logits = model.forward(st, c, want, stats, trace)?;
        if all {
            out.extend(logits);
        } else {
            out = logits;
        }
    }
    Ok(out)
}

/// What a generation produced and how long it took.
#[derive(Debug, Default)]
pub struct Generation {
    /// Generated ids (the prompt excluded).
    pub tokens: Vec<u32>,
    /// Logits of every prompt position, when requested.
    pub prompt_logits: Vec<f32>,
    /// Seconds in prefill.
    pub prefill_secs: f64,
    /// Seconds in decode.
    pub decode_secs: f64,
    /// Counters of the prefill.
    pub prefill_stats: Stats,
    /// Counters of the decode.
    pub decode_stats: Stats,
}

/// Settings of [`generate`].
pub struct GenerateOptions<'a> {
    /// Tokens to generate at most.
    pub ngen: usize,
    /// Prefill chunk size.
    pub chunk: usize,
    /// Keep the logits of every prompt position.
    pub all_logits: bool,
    /// Stop when one of these ids is generated (it is still reported).
    pub stop_ids: &'a [u32],
    /// Per-layer hidden dumps.
    pub trace: Option<&'a Trace>,
}

/// One generated token and what producing it cost.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// The token.
    pub id: u32,
    /// Its index among the generated tokens (0-based).
    pub index: usize,
    /// Seconds of the forward pass that produced its logits (0 for the first: prefill's).
    pub secs: f64,
    /// Counters of that forward pass.
    pub stats: Stats,
}

/// Prefills `prompt`, then samples up to `ngen` tokens with `pick`, calling `on_token`
/// for each as soon as it exists.
pub fn generate<B: Backend>(
    model: &K3Model<B>,
    prompt: &[u32],
    opts: &GenerateOptions<'_>,
    pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
    on_token: &mut dyn FnMut(&TokenEvent) -> Result<()>,
) -> Result<Generation> {
    let mut st = model.new_state()?;
    let mut g = Generation::default();
    let t0 = Instant::now();
    let logits = prefill(
        model,
        &mut st,
        prompt,
        opts.chunk,
        opts.all_logits,
        &mut g.prefill_stats,
        opts.trace,
    )?;
    g.prefill_secs = t0.elapsed().as_secs_f64();
    let v = model.vocab_size();
    let mut last = logits[logits.len() - v..].to_vec();
    if opts.all_logits {
        g.prompt_logits = logits;
    }
    let mut history = prompt.to_vec();
    let t1 = Instant::now();
    let (mut secs, mut step_stats) = (0.0, Stats::default());
    for index in 0..opts.ngen {
        let id = pick(&last, &history);
        history.push(id);
        g.tokens.push(id);
        on_token(&TokenEvent { id, index, secs, stats: step_stats.clone() })?;
        if opts.stop_ids.contains(&id) || index + 1 == opts.ngen {
            break;
        }
        let (t, before) = (Instant::now(), g.decode_stats.clone());
        last = model.forward(&mut st, &[id], Logits::Last, &mut g.decode_stats, opts.trace)?;
        secs = t.elapsed().as_secs_f64();
        step_stats = g.decode_stats.since(&before);
    }
    g.decode_secs = t1.elapsed().as_secs_f64();
    Ok(g)
}
