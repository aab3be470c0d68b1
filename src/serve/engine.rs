//! The engine worker: the one thread that owns the model. It takes jobs from a bounded
//! queue into up to `--parallel` slots, each a [`Session`] of its own (so a request that
//! extends a held conversation prefills only its new tokens; a request of `n` choices takes
//! `n`, the later ones forking the first's state once it holds the prompt), advances every sequence in
//! flight a step at a time through one batched forward pass (a prompt slice for those that
//! prefill, a token for those that decode), and streams what each generates back to its
//! request's handler. An error or a panic in a job answers that job with an error and
//! leaves the engine serving.

mod admission;
mod advance;
mod finish;
mod publish;

use super::choice_run::ChoiceRun;
use super::job::{deliver, ChoiceOut, Event, Job, Outcome, SequenceView, FULL_POLL};
use super::live::LiveFigures;
use super::metrics::Metrics;
use crate::backend::Backend;
use crate::model::Runner;
use crate::session::{Session, SnapshotLimits, Stepper};
use crate::stats::Stats;
use crate::tokenizer::Tokenizer;
use admission::{admit, Admit};
use advance::advance_all;
use anyhow::Result;
use finish::finish_job;
use publish::publish;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

/// Events a job's channel holds before the engine waits for its handler: a streaming
/// client that reads nothing pauses the engine, not the server's memory.
pub(crate) const EVENTS_IN_FLIGHT: usize = 64;
/// Free places a job's channel needs before its sequence picks a token (a token can send
/// a few events: text, held logprobs, the end of a think section).
const ROOM_TO_PICK: usize = 4;

/// State the engine shares with the HTTP side.
#[derive(Default)]
pub struct EngineShared {
    /// Counters.
    pub metrics: Metrics,
    /// The running jobs' cancel flags, so shutdown can stop them.
    pub current: Mutex<Vec<Arc<AtomicBool>>>,
    /// Raised at shutdown: jobs still queued end at once, cancelled.
    pub stopping: AtomicBool,
    /// The figures of the last decode steps.
    pub live: LiveFigures,
    /// The sequences in flight.
    pub sequences: Mutex<Vec<SequenceView>>,
}

/// How the engine runs requests together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EngineOptions {
    /// State snapshots kept, over all slots (each slot keeps its share of the bytes).
    pub snapshots: SnapshotLimits,
    /// Sequences in flight at most (`--parallel`).
    pub parallel: usize,
    /// Prompt tokens a prefilling sequence feeds per step (`--prefill-slice`), at most
    /// the model's prefill window.
    pub prefill_slice: usize,
    /// Bytes of state the sequences together may grow to: what the memory plan reserves.
    pub state_budget: usize,
    /// Sequences whose full-context state that is.
    pub state_sequences: usize,
}

/// A place for one sequence: its session (state, tokens, snapshots), kept after its
/// request ends so a later request that extends the conversation reuses it.
struct Slot<'m, B: Backend> {
    session: Option<Session<'m, B>>,
    /// Bytes of state the sequence running here may grow to (0 when free).
    reserved: usize,
    busy: bool,
}

/// One choice of a job in flight: a sequence in a slot of its own.
struct Lane<'t> {
    slot: usize,
    choice: usize,
    /// Its sampler, grammar, stop rules and streamer; `None` while a later choice waits
    /// for the first to prefill the prompt they share, and once it ended.
    run: Option<ChoiceRun<'t>>,
    stepper: Option<Stepper>,
    /// Its choice ended (its slot is free again).
    done: bool,
}

impl Lane<'_> {
    /// Whether it waits for the shared prompt.
    fn waiting(&self) -> bool {
        !self.done && self.run.is_none()
    }
}

/// A job in flight: its `n` choices, each a sequence of its own ([`Lane`]), decoding
/// together; what the ended choices gave.
struct Seq<'t> {
    job: Job,
    out: Outcome,
    lanes: Vec<Lane<'t>>,
    /// The ended choices, by index.
    finished: Vec<Option<ChoiceOut>>,
    started: Instant,
    ttft: Option<f64>,
    /// Steps it took part in, and the sequences of those steps summed (the batch sizes).
    steps: usize,
    batch_rows: usize,
    /// Since when its client has left no room for the events of a token.
    stalled: Option<Instant>,
}

impl Seq<'_> {
    /// Its sequences that still run (or wait for the shared prompt).
    fn running(&self) -> usize {
        self.lanes.iter().filter(|l| !l.done).count()
    }
}

/// Sequences in flight over `active`.
fn sequences(active: &[Seq<'_>]) -> usize {
    active.iter().map(Seq::running).sum()
}

/// Bytes of one sequence's state at `tokens` tokens of context, as the memory plan counts
/// them.
fn state_bytes(cfg: &crate::config::Config, tokens: usize) -> usize {
    usize::try_from(crate::engine::plan::sequence_bytes(cfg, tokens)).unwrap_or(usize::MAX)
}

/// Serves jobs until every sender of `jobs` is gone: up to `opts.parallel` at once, each
/// in a slot of its own ([`Session`]), all advanced together a step at a time: every
/// sequence that prefills feeds its next slice of at most `opts.prefill_slice` prompt
/// tokens, every one that decodes its last token, in one [`Runner::forward_batch`]; then
/// each picks its token. A job that finishes, fails or is cancelled frees its slot at once.
pub(crate) fn run_engine<B: Backend>(
    model: &Runner<B>,
    tok: &Tokenizer,
    opts: EngineOptions,
    jobs: mpsc::Receiver<Job>,
    shared: &EngineShared,
) -> Result<()> {
    let parallel = opts.parallel.max(1);
    let snapshots = SnapshotLimits {
        count: opts.snapshots.count,
        bytes: opts.snapshots.bytes / parallel,
    };
    let one = model.snapshot_bytes() + model.vocab_size() * 4;
    if snapshots.count == 0 {
        tracing::info!("[K3] serve: state snapshots off: a resent conversation that diverges from the held one is prefilled from its start");
    } else if one > snapshots.bytes {
        tracing::warn!(
            "[K3] serve: WARNING: one state snapshot takes {:.1} MB, more than --snapshot-mb {:.0} / --parallel {parallel}: none is kept",
            one as f64 / 1e6,
            opts.snapshots.bytes as f64 / (1 << 20) as f64
        );
    } else {
        tracing::info!(
            "[K3] serve: state snapshots: up to {} of {:.1} MB each per slot, {:.0} MB at most per slot (--snapshot-mb / --parallel {parallel})",
            snapshots.count.min(snapshots.bytes / one),
            one as f64 / 1e6,
            snapshots.bytes as f64 / (1 << 20) as f64
        );
    }
    let cfg = &model.ckpt.config;
    let state = crate::model::state_size::state_size(cfg, 1);
    let disk = match model.rt.prompt_cache() {
        Some(c) => format!(
            "; on disk as prompt-cache entries of {:.1} MB + {:.1} KB a token (prompts of {}+ tokens, {:.2} GB in all)",
            (state.kda_gb * 1e9 + model.vocab_size() as f64 * 4.0) / 1e6,
            state.kv_gb * 1e9 / 1e3,
            crate::model::prompt_cache::MIN_TOKENS,
            c.max_bytes() as f64 / 1e9
        ),
        None => String::new(),
    };
    tracing::info!(
        "[K3] serve: states kept at each prompt's end and at up to {} message boundaries a prompt (the end of its system prompt and tools, each Anthropic cache_control breakpoint; the last ones when there are more): in RAM as snapshots of {:.1} MB each ({:.0} MB in all){disk}",
        crate::session::MAX_BOUNDARIES,
        one as f64 / 1e6,
        opts.snapshots.bytes as f64 / (1 << 20) as f64
    );
    let whole = crate::session::window(model, crate::session::MAX_WINDOW);
    let slice = opts.prefill_slice.clamp(1, whole);
    // Slicing a prompt re-reads, slice after slice, every routed expert it touches unless the
    // host cache holds each layer's every expert: then a lone prompt with nobody queued
    // behind it feeds whole windows, as `k3 run` does (docs/api.md, "Several requests at once").
    let slices_reread = model.rt.experts().slots_per_layer() < cfg.num_experts;
    // The sequences share the state the memory plan reserves: a context's for each that fit.
    let budget = opts.state_budget;
    let contexts = match opts.state_sequences {
        0 | 1 => "one".to_string(),
        n => n.to_string(),
    };
    tracing::info!(
        "[K3] serve: up to {parallel} sequences at once (--parallel), sharing {:.1} MB of state ({contexts} {}-token context{}); prompts fed {slice} tokens a step (--prefill-slice)",
        budget as f64 / 1e6,
        model.rt.context(),
        if opts.state_sequences > 1 { "s" } else { "" }
    );
    let eos = cfg.eos_token_ids.clone();
    let mut slots: Vec<Slot<'_, B>> = (0..parallel)
        .map(|_| Slot {
            session: None,
            reserved: 0,
            busy: false,
        })
        .collect();
    let mut active: Vec<Seq<'_>> = Vec::new();
    let mut waiting: Option<Job> = None;
    // The job whose wait for memory the log told (once a job).
    let mut told_wait: Option<String> = None;
    // The job whose wait for free slots the log told.
    let mut told_slots: Option<String> = None;
    let mut closed = false;
    loop {
        // Admit queued jobs while slots and the memory allow; block only when idle.
        loop {
            let free = slots.iter().filter(|s| !s.busy).count();
            if free == 0 {
                break;
            }
            let job = match waiting.take() {
                Some(j) => j,
                None if closed => break,
                None if active.is_empty() => match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                },
                None => match jobs.try_recv() {
                    Ok(j) => j,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                },
            };
            // A job of `n` choices waits for `n` free slots, ahead of those queued after it.
            if job.params.n.max(1) > free && job.params.n <= slots.len() {
                if told_slots.as_deref() != Some(job.id.as_str()) {
                    told_slots = Some(job.id.clone());
                    tracing::info!(
                        "[K3] serve {}: waits in the queue for {} free slots, one a choice ({free} free of --parallel {})",
                        job.id,
                        job.params.n,
                        slots.len()
                    );
                }
                waiting = Some(job);
                break;
            }
            match admit(
                model, tok, &eos, job, &mut slots, &active, snapshots, budget,
            ) {
                Ok(seq) => {
                    shared.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                    if shared.stopping.load(Ordering::SeqCst) {
                        seq.job.cancel.store(true, Ordering::SeqCst);
                    }
                    active.push(seq);
                }
                Err(Admit::Wait(job)) => {
                    if told_wait.as_deref() == Some(job.id.as_str()) {
                        waiting = Some(*job);
                        break;
                    }
                    told_wait = Some(job.id.clone());
                    tracing::info!(
                        "[K3] serve {}: waits in the queue: its state ({} x ({} prompt + {} answer tokens)) does not fit beside the {} running (--max-tokens / K3_MAXT bounds the state they share)",
                        job.id,
                        job.params.n.max(1),
                        job.ids.len(),
                        job.params.max_tokens,
                        sequences(&active)
                    );
                    waiting = Some(*job);
                    break;
                }
                Err(Admit::Failed(job, e)) => {
                    shared.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!("[K3] serve {}: failed: {e:#}", job.id);
                    deliver(
                        &job.events,
                        &job.cancel,
                        job.stall_timeout,
                        Event::Failed(format!("{e:#}")),
                        true,
                    );
                }
            }
        }
        if active.is_empty() {
            shared.metrics.busy.store(false, Ordering::SeqCst);
            publish(shared, &active);
            if closed && waiting.is_none() {
                break;
            }
            continue;
        }
        shared.metrics.busy.store(true, Ordering::SeqCst);
        if shared.stopping.load(Ordering::SeqCst) {
            for q in &active {
                q.job.cancel.store(true, Ordering::SeqCst);
            }
        }
        // Picks: every sequence whose logits are in takes its token; later choices start
        // once the first has prefilled their prompt; ended choices free their slots, ended
        // jobs leave.
        let ends = advance_all(&mut active, &mut slots, tok, &eos);
        let mut ended = Vec::new();
        for (i, failure) in ends.into_iter().rev() {
            ended.push((active.remove(i), failure));
        }
        let remaining = sequences(&active);
        for (q, failure) in ended.into_iter().rev() {
            finish_job(q, failure, &mut slots, shared, remaining);
        }
        publish(shared, &active);
        // One batched pass for every sequence that feeds tokens this step.
        let mut owner = vec![None; slots.len()];
        for (qi, q) in active.iter().enumerate() {
            for (li, lane) in q.lanes.iter().enumerate() {
                if lane.stepper.is_some() {
                    owner[lane.slot] = Some((qi, li));
                }
            }
        }
        let alone = active.len() == 1
            && waiting.is_none()
            && shared.metrics.queue_depth.load(Ordering::SeqCst) == 0;
        let feed = if alone && slices_reread { whole } else { slice };
        let mut segs = Vec::new();
        let mut who = Vec::new();
        for (si, slot) in slots.iter_mut().enumerate() {
            let (Some((qi, li)), Some(session)) = (owner[si], slot.session.as_mut()) else {
                continue;
            };
            if let Some(seg) = active[qi].lanes[li]
                .stepper
                .as_ref()
                .and_then(|st| session.segment(st, feed))
            {
                segs.push(seg);
                who.push((qi, li));
            }
        }
        if segs.is_empty() {
            // Every sequence waits for its client: look again shortly.
            std::thread::sleep(FULL_POLL);
            continue;
        }
        let lens: Vec<usize> = segs.iter().map(|s| s.ids.len()).collect();
        let decoding = lens.iter().filter(|&&n| n == 1).count();
        // A lone sequence's pass stops between layers when its client leaves; a shared
        // pass runs to its end (a slice is bounded), and the step after ends the one that left.
        let cancel = (segs.len() == 1).then(|| active[who[0].0].job.cancel.clone());
        let t = Instant::now();
        let mut stats = Stats::default();
        let r = catch_unwind(AssertUnwindSafe(|| {
            model.forward_batch(&mut segs, &mut stats, None, cancel.as_deref())
        }));
        drop(segs);
        let secs = t.elapsed().as_secs_f64();
        shared.metrics.observe_batch(who.len());
        // The live figures count tokens: a step gives each decoding sequence one, in a
        // share of its seconds; its counters go with the first.
        for k in 0..decoding {
            let none = Stats::default();
            let st = if k == 0 { &stats } else { &none };
            shared.live.push(secs / decoding as f64, st);
        }
        let mut jobs_in: Vec<usize> = who.iter().map(|w| w.0).collect();
        jobs_in.sort_unstable();
        jobs_in.dedup();
        for &qi in &jobs_in {
            active[qi].steps += 1;
            active[qi].batch_rows += who.len();
        }
        let failure = match r {
            Ok(Ok(Some(logits))) => {
                // Each sequence takes the step's counters in proportion to the rows it fed,
                // so the requests' counters add up to the step's.
                let shares = stats.split(&lens);
                let mut failed = Vec::new();
                for ((((qi, li), n), l), share) in who.iter().zip(&lens).zip(logits).zip(shares) {
                    let q = &mut active[*qi];
                    let lane = &mut q.lanes[*li];
                    let (Some(session), Some(st)) =
                        (slots[lane.slot].session.as_mut(), lane.stepper.as_mut())
                    else {
                        continue;
                    };
                    if let Err(e) = session.apply(st, *n, l, secs, share) {
                        failed.push((*qi, format!("{e:#}")));
                    }
                }
                failed
            }
            Ok(Ok(None)) => {
                let (qi, li) = who[0];
                let q = &mut active[qi];
                let lane = &mut q.lanes[li];
                if let (Some(session), Some(st)) =
                    (slots[lane.slot].session.as_mut(), lane.stepper.as_mut())
                {
                    if let Err(e) = session.stopped_in_pass(st) {
                        tracing::warn!("[K3] serve {}: {e:#}", q.job.id);
                    }
                }
                Vec::new()
            }
            Ok(Err(e)) => jobs_in.iter().map(|&qi| (qi, format!("{e:#}"))).collect(),
            Err(_) => jobs_in.iter().map(|&qi| (qi, String::new())).collect(),
        };
        // Failed jobs leave, highest index first so the others keep theirs.
        let mut failure = failure;
        failure.sort_by_key(|f| std::cmp::Reverse(f.0));
        failure.dedup_by_key(|f| f.0);
        for (qi, e) in failure {
            let q = active.swap_remove(qi);
            let remaining = sequences(&active);
            finish_job(q, Some(e), &mut slots, shared, remaining);
        }
    }
    Ok(())
}

/// Marks a slot free; its session stays for a later request that extends its conversation.
fn free_slot<B: Backend>(slot: &mut Slot<'_, B>) {
    slot.busy = false;
    slot.reserved = 0;
}
