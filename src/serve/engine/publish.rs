//! What the engine shows of the sequences in flight on `/health` and `/metrics`.

use super::{EngineShared, Seq};
use crate::serve::job::SequenceView;
use crate::session::{Phase, Stepper};
use std::sync::atomic::Ordering;

/// Shows the sequences in flight on `/health` and `/metrics` (each running choice of a
/// request one; a later choice that waits for the shared prompt shows its prefill), and
/// keeps their jobs' cancel flags where shutdown finds them.
pub(super) fn publish(shared: &EngineShared, active: &[Seq<'_>]) {
    let mut views = Vec::new();
    for q in active {
        let first = q.lanes[0].stepper.as_ref();
        for lane in q.lanes.iter().filter(|l| !l.done) {
            let view = match lane.stepper.as_ref() {
                Some(st) => SequenceView {
                    id: q.job.id.clone(),
                    state: if st.phase() == Phase::Prefill {
                        "prefill"
                    } else {
                        "decode"
                    },
                    choice: lane.choice,
                    prompt_tokens: st.prompt_len(),
                    prefilled_tokens: st.prompt_fed(),
                    generated_tokens: st.generated(),
                },
                None => SequenceView {
                    id: q.job.id.clone(),
                    state: "prefill",
                    choice: lane.choice,
                    prompt_tokens: q.job.ids.len(),
                    prefilled_tokens: first.map_or(0, Stepper::prompt_fed),
                    generated_tokens: 0,
                },
            };
            views.push(view);
        }
    }
    shared
        .metrics
        .active_sequences
        .store(views.len(), Ordering::Relaxed);
    if let Ok(mut s) = shared.sequences.lock() {
        *s = views;
    }
    if let Ok(mut c) = shared.current.lock() {
        *c = active.iter().map(|q| q.job.cancel.clone()).collect();
    }
}
