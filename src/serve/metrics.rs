//! Counters of the server, written as Prometheus text at `/metrics`.

use super::histogram::{Histogram, DURATION_BUCKETS, TOKEN_BUCKETS};
use crate::stats::Stats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Totals since the server started.
pub struct Metrics {
    /// Answers by HTTP status.
    by_status: Mutex<BTreeMap<u16, u64>>,
    /// Requests waiting for the engine.
    pub queue_depth: AtomicUsize,
    /// Whether the engine is generating now.
    pub busy: AtomicBool,
    totals: Mutex<Totals>,
    /// Requests the engine finished.
    pub generations: AtomicU64,
    /// State snapshots the engine holds.
    pub snapshots: AtomicUsize,
    /// Bytes those snapshots take.
    pub snapshot_bytes: AtomicUsize,
    /// Sequences in flight.
    pub active_sequences: AtomicUsize,
    /// Sequences per engine step.
    batch: Mutex<Histogram>,
}

#[derive(Clone)]
struct Totals {
    prompt_tokens: u64,
    cached_tokens: u64,
    prefilled_tokens: u64,
    generated_tokens: u64,
    prefill_secs: f64,
    decode_secs: f64,
    ttft: Histogram,
    per_token: Histogram,
    queue_wait: Histogram,
    duration: Histogram,
    last_prefill_tps: f64,
    last_decode_tps: f64,
    stats: Stats,
}

impl Default for Totals {
    fn default() -> Self {
        Self {
            prompt_tokens: 0,
            cached_tokens: 0,
            prefilled_tokens: 0,
            generated_tokens: 0,
            prefill_secs: 0.0,
            decode_secs: 0.0,
            ttft: Histogram::new(DURATION_BUCKETS),
            per_token: Histogram::new(TOKEN_BUCKETS),
            queue_wait: Histogram::new(DURATION_BUCKETS),
            duration: Histogram::new(DURATION_BUCKETS),
            last_prefill_tps: 0.0,
            last_decode_tps: 0.0,
            stats: Stats::default(),
        }
    }
}

/// What one finished generation adds.
pub struct GenerationSample {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of them, reused from the engine's state.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Seconds in prefill.
    pub prefill_secs: f64,
    /// Seconds in decode.
    pub decode_secs: f64,
    /// Seconds from the start of the job to its first token, if one came.
    pub ttft_secs: Option<f64>,
    /// Seconds the request waited in the queue.
    pub queue_secs: f64,
    /// Seconds from queueing to the end of the job.
    pub request_secs: f64,
    /// Engine counters (prefill and decode).
    pub stats: Stats,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            by_status: Mutex::default(),
            queue_depth: AtomicUsize::default(),
            busy: AtomicBool::default(),
            totals: Mutex::default(),
            generations: AtomicU64::default(),
            snapshots: AtomicUsize::default(),
            snapshot_bytes: AtomicUsize::default(),
            active_sequences: AtomicUsize::default(),
            batch: Mutex::new(Histogram::new(BATCH_BUCKETS)),
        }
    }
}

/// Bounds of the batch-size histogram (sequences per step).
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

impl Metrics {
    /// Counts one engine step of `n` sequences.
    pub fn observe_batch(&self, n: usize) {
        if let Ok(mut b) = self.batch.lock() {
            b.observe(n as f64);
        }
    }

    /// Counts an answer.
    pub fn count_status(&self, status: u16) {
        if let Ok(mut m) = self.by_status.lock() {
            *m.entry(status).or_default() += 1;
        }
    }

    /// Adds a finished generation.
    pub fn add(&self, s: &GenerationSample) {
        self.generations.fetch_add(1, Ordering::Relaxed);
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        let prefilled = s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens);
        t.prompt_tokens += s.prompt_tokens as u64;
        t.cached_tokens += s.cached_tokens as u64;
        t.prefilled_tokens += prefilled as u64;
        t.generated_tokens += s.generated_tokens as u64;
        t.prefill_secs += s.prefill_secs;
        t.decode_secs += s.decode_secs;
        if let Some(x) = s.ttft_secs {
            t.ttft.observe(x);
        }
        if s.generated_tokens > 1 && s.decode_secs > 0.0 {
            t.per_token
                .observe(s.decode_secs / (s.generated_tokens - 1) as f64);
        }
        t.queue_wait.observe(s.queue_secs);
        t.duration.observe(s.request_secs);
        if prefilled > 0 && s.prefill_secs > 0.0 {
            t.last_prefill_tps = prefilled as f64 / s.prefill_secs;
        }
        if s.generated_tokens > 1 && s.decode_secs > 0.0 {
            t.last_decode_tps = (s.generated_tokens - 1) as f64 / s.decode_secs;
        }
        t.stats = t.stats.plus(&s.stats);
    }

    /// Each rank's expert figures when this server heads a job of several ranks (empty
    /// otherwise), over the server's life.
    pub fn ranks(&self) -> Vec<crate::ranks::RankFigures> {
        let t = self.totals.lock().map(|t| t.clone()).unwrap_or_default();
        crate::ranks::figures(&t.stats)
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        let t = self.totals.lock().map(|t| t.clone()).unwrap_or_default();
        metric(
            "k3_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            t.prompt_tokens.to_string(),
        );
        metric(
            "k3_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens reused from the engine's state.",
            t.cached_tokens.to_string(),
        );
        metric(
            "k3_prefilled_tokens_total",
            "counter",
            "Prompt tokens run through the model.",
            t.prefilled_tokens.to_string(),
        );
        metric(
            "k3_generated_tokens_total",
            "counter",
            "Tokens generated.",
            t.generated_tokens.to_string(),
        );
        metric(
            "k3_prefill_seconds_total",
            "counter",
            "Seconds in prefill.",
            format!("{:.6}", t.prefill_secs),
        );
        metric(
            "k3_decode_seconds_total",
            "counter",
            "Seconds in decode.",
            format!("{:.6}", t.decode_secs),
        );
        metric(
            "k3_prefill_tokens_per_second",
            "gauge",
            "Prefill rate of the last request that prefilled.",
            format!("{:.3}", t.last_prefill_tps),
        );
        metric(
            "k3_decode_tokens_per_second",
            "gauge",
            "Decode rate of the last request that decoded.",
            format!("{:.3}", t.last_decode_tps),
        );
        metric(
            "k3_expert_hit_ratio",
            "gauge",
            "Experts found cached, of those needed.",
            format!("{:.4}", t.stats.hit_percent() / 100.0),
        );
        metric(
            "k3_expert_lookups_total",
            "counter",
            "Experts needed (per layer per chunk).",
            t.stats.expert_lookups.to_string(),
        );
        metric(
            "k3_streamed_bytes_total",
            "counter",
            "Expert bytes read from disk.",
            t.stats.bytes_streamed.to_string(),
        );
        let busy = t.stats.disk_busy.as_secs_f64();
        metric(
            "k3_disk_gigabytes_per_second",
            "gauge",
            "Expert bytes read per second of disk busy time, in GB/s.",
            format!(
                "{:.3}",
                if busy > 0.0 {
                    t.stats.bytes_streamed as f64 / 1e9 / busy
                } else {
                    0.0
                }
            ),
        );
        metric(
            "k3_queue_length",
            "gauge",
            "Requests waiting for the engine.",
            self.queue_depth.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "k3_engine_busy",
            "gauge",
            "1 while the engine generates.",
            u8::from(self.busy.load(Ordering::Relaxed)).to_string(),
        );
        metric(
            "k3_state_snapshots",
            "gauge",
            "State snapshots held for prompts that diverge from the held conversation.",
            self.snapshots.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "k3_state_snapshot_bytes",
            "gauge",
            "Bytes the state snapshots take.",
            self.snapshot_bytes.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "k3_active_sequences",
            "gauge",
            "Sequences in flight in the engine (prefilling or decoding; a request of n choices runs n).",
            self.active_sequences.load(Ordering::Relaxed).to_string(),
        );
        if let Ok(b) = self.batch.lock() {
            b.render(
                "k3_batch_size",
                "Sequences per engine step (one batched forward pass).",
                &mut o,
            );
        }
        render_ranks(&crate::ranks::figures(&t.stats), &mut o);
        t.ttft.render(
            "k3_time_to_first_token_seconds",
            "Seconds from a request's start in the engine to its first token.",
            &mut o,
        );
        t.per_token.render(
            "k3_time_per_output_token_seconds",
            "Seconds per generated token after the first (each request's mean).",
            &mut o,
        );
        t.queue_wait.render(
            "k3_queue_wait_seconds",
            "Seconds each request waited in the queue for an engine slot.",
            &mut o,
        );
        t.duration.render(
            "k3_request_duration_seconds",
            "Seconds from a request's queueing to the end of its generation.",
            &mut o,
        );
        let _ = writeln!(
            o,
            "# HELP k3_requests_total Answers by HTTP status.\n# TYPE k3_requests_total counter"
        );
        if let Ok(m) = self.by_status.lock() {
            for (status, n) in m.iter() {
                let _ = writeln!(o, "k3_requests_total{{status=\"{status}\"}} {n}");
            }
        }
        o
    }
}

/// The per-rank series of an expert-parallel job, labelled by rank and host; nothing
/// without ranks.
fn render_ranks(f: &[crate::ranks::RankFigures], o: &mut String) {
    if f.is_empty() {
        return;
    }
    type Value = fn(&crate::ranks::RankFigures) -> String;
    let series: [(&str, &str, &str, Value); 4] = [
        (
            "k3_rank_expert_hit_ratio",
            "gauge",
            "A rank's experts found cached, of those it looked up.",
            |r| format!("{:.4}", r.hit_percent() / 100.0),
        ),
        (
            "k3_rank_expert_lookups_total",
            "counter",
            "Experts a rank looked up.",
            |r| r.lookups.to_string(),
        ),
        (
            "k3_rank_streamed_bytes_total",
            "counter",
            "Expert bytes a rank read from disk.",
            |r| r.bytes.to_string(),
        ),
        (
            "k3_rank_disk_gigabytes_per_second",
            "gauge",
            "A rank's expert bytes per second of its disk busy time, in GB/s.",
            |r| format!("{:.3}", r.gb_per_s()),
        ),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for r in f {
            let host = r.host.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                o,
                "{name}{{rank=\"{}\",host=\"{host}\"}} {}",
                r.rank,
                value(r)
            );
        }
    }
}
