//! Ending a job: its answer to its handler, its counters to the metrics, its slots free.

use super::{free_slot, EngineShared, Seq, Slot};
use crate::backend::Backend;
use crate::serve::job::{deliver, Event};
use crate::serve::metrics::GenerationSample;
use std::sync::atomic::Ordering;

/// Ends `q`'s job: its answer (or `failure`: a message, empty for a panic) goes to its
/// handler, its counters to the metrics, and the slots of its choices still running are
/// free at once (reset after a failure, whose state may be half-advanced).
pub(super) fn finish_job<B: Backend>(
    q: Seq<'_>,
    failure: Option<String>,
    slots: &mut [Slot<'_, B>],
    shared: &EngineShared,
    remaining: usize,
) {
    for lane in q.lanes.iter().filter(|l| !l.done) {
        let slot = &mut slots[lane.slot];
        free_slot(slot);
        if failure.is_some() {
            // The state may be half-advanced: the slot's next request starts from scratch.
            slot.session = None;
        }
    }
    let job = q.job;
    let batch = if q.steps > 0 {
        q.batch_rows as f64 / q.steps as f64
    } else {
        0.0
    };
    let event = match failure {
        None => {
            let mut outcome = q.out;
            outcome.choices = q.finished.into_iter().flatten().collect();
            outcome.ttft_secs = q.ttft.unwrap_or(0.0);
            let queue_secs = q.started.duration_since(job.queued).as_secs_f64();
            shared.metrics.add(&GenerationSample {
                prompt_tokens: outcome.prompt_tokens,
                cached_tokens: outcome.cached_tokens,
                generated_tokens: outcome.completion_tokens,
                prefill_secs: outcome.prefill_secs,
                decode_secs: outcome.decode_secs,
                ttft_secs: (outcome.completion_tokens > 0).then_some(outcome.ttft_secs),
                queue_secs,
                request_secs: job.queued.elapsed().as_secs_f64(),
                stats: outcome.stats.clone(),
            });
            let kept = crate::session::kept_boundaries(&job.params.boundaries);
            let kept = if kept.is_empty() {
                String::new()
            } else {
                let at: Vec<String> = kept.iter().map(|b| b.to_string()).collect();
                format!(" | boundaries at {}", at.join(", "))
            };
            let st = &outcome.stats;
            tracing::info!(
                "[K3] serve {}: prompt {} (cached {}) | generated {} | queued {:.3}s | ttft {:.3}s | prefill {:.3}s | decode {:.3}s | batch {batch:.1} over {} steps | experts {} needed, {} cached, {} bytes read | {}{}{kept}",
                job.id,
                outcome.prompt_tokens,
                outcome.cached_tokens,
                outcome.completion_tokens,
                queue_secs,
                outcome.ttft_secs,
                outcome.prefill_secs,
                outcome.decode_secs,
                q.steps,
                st.expert_lookups,
                st.expert_hits,
                st.bytes_streamed,
                outcome.choices.last().map_or("stop", |c| c.finish.as_str()),
                if outcome.cancelled { " (cancelled)" } else { "" }
            );
            if outcome.choices.is_empty() {
                Event::Failed("internal: the request ended without a choice".into())
            } else {
                Event::Done(Box::new(outcome))
            }
        }
        Some(e) => {
            if e.is_empty() {
                tracing::error!(
                    "[K3] serve {}: the engine panicked; its state is reset",
                    job.id
                );
                Event::Failed("internal error in the engine; the request was dropped".into())
            } else {
                tracing::warn!("[K3] serve {}: failed: {e}", job.id);
                Event::Failed(e)
            }
        }
    };
    let m = &shared.metrics;
    let sessions = slots.iter().filter_map(|s| s.session.as_ref());
    let (count, bytes) = sessions.fold((0, 0), |(c, b), s| {
        (c + s.snapshot_count(), b + s.snapshot_bytes())
    });
    m.snapshots.store(count, Ordering::Relaxed);
    m.snapshot_bytes.store(bytes, Ordering::Relaxed);
    // Idle before the answer leaves, so a client that then asks /health sees it so.
    if let Ok(mut s) = shared.sequences.lock() {
        s.retain(|v| v.id != job.id);
    }
    m.active_sequences.store(remaining, Ordering::Relaxed);
    m.busy.store(remaining > 0, Ordering::SeqCst);
    deliver(&job.events, &job.cancel, job.stall_timeout, event, true);
}
