//! The host's work between two passes: every job in flight moves on as far as it goes
//! without one (its sequences pick their tokens, later choices start, ended choices free
//! their slots). Jobs move on side by side, each on a pool thread with the slots its
//! sequences hold: a sampled token's pick over K3's vocabulary takes milliseconds, and
//! several streams picking in turn left the device waiting
//! (docs/perf.md#several-clients-at-once).

use super::{free_slot, Seq, Slot, ROOM_TO_PICK};
use crate::backend::Backend;
use crate::session::{Finish, Phase};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use rayon::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::admission::start_choice;

/// The slots one job's running sequences hold, borrowed apart from the other jobs' slots.
struct JobSlots<'a, 'm, B: Backend> {
    held: Vec<(usize, &'a mut Slot<'m, B>)>,
}

impl<'m, B: Backend> JobSlots<'_, 'm, B> {
    /// Slot `i`, which one of the job's running sequences holds.
    fn get(&mut self, i: usize) -> Result<&mut Slot<'m, B>> {
        match self.held.iter_mut().find(|(at, _)| *at == i) {
            Some((_, slot)) => Ok(slot),
            None => bail!("internal: slot {i} is not held by the job that uses it"),
        }
    }
}

/// Each job's slots: those of its sequences that have not ended (an ended one's slot may
/// already serve another job).
fn slots_by_job<'a, 'm, B: Backend>(
    slots: &'a mut [Slot<'m, B>],
    active: &[Seq<'_>],
) -> Vec<JobSlots<'a, 'm, B>> {
    let mut each: Vec<Option<&'a mut Slot<'m, B>>> = slots.iter_mut().map(Some).collect();
    active
        .iter()
        .map(|q| JobSlots {
            held: q
                .lanes
                .iter()
                .filter(|l| !l.done)
                .filter_map(|l| {
                    each.get_mut(l.slot)
                        .and_then(Option::take)
                        .map(|s| (l.slot, s))
                })
                .collect(),
        })
        .collect()
}

/// [`advance`] for every job of `active`, side by side where there are several. Returns
/// the jobs that are over, by index in ascending order, each with its failure (`None` when
/// it ended well, an empty message for a panic).
pub(super) fn advance_all<'t, 'm, B: Backend>(
    active: &mut [Seq<'t>],
    slots: &mut [Slot<'m, B>],
    tok: &'t Tokenizer,
    eos: &[u32],
) -> Vec<(usize, Option<String>)>
where
    Slot<'m, B>: Send,
{
    let views = slots_by_job(slots, active);
    let one = |(q, mut v): (&mut Seq<'t>, JobSlots<'_, 'm, B>)| match catch_unwind(
        AssertUnwindSafe(|| advance(q, &mut v, tok, eos)),
    ) {
        Ok(Ok(false)) => None,
        Ok(Ok(true)) => Some(None),
        Ok(Err(e)) => Some(Some(format!("{e:#}"))),
        Err(_) => Some(Some(String::new())),
    };
    let ends: Vec<Option<Option<String>>> = if active.len() > 1 {
        active.par_iter_mut().zip(views).map(one).collect()
    } else {
        active.iter_mut().zip(views).map(one).collect()
    };
    ends.into_iter()
        .enumerate()
        .filter_map(|(i, e)| e.map(|e| (i, e)))
        .collect()
}

/// Moves `q` on as far as it goes without a forward pass: once its first choice has the
/// prompt's logits, starts the later choices on copies of that state; then, choice by
/// choice, ends it when cancelled, picks its token when its logits are in, and finishes an
/// ended choice (freeing its slot). A choice whose client has left no room for a token's
/// events skips the step, up to the stall timeout. Returns whether the job is over.
fn advance<'t, B: Backend>(
    q: &mut Seq<'t>,
    slots: &mut JobSlots<'_, '_, B>,
    tok: &'t Tokenizer,
    eos: &[u32],
) -> Result<bool> {
    let cancelled = q.job.cancel.load(Ordering::SeqCst);
    let prompt_in = q.lanes[0]
        .stepper
        .as_ref()
        .is_some_and(|st| st.phase() == Phase::Pick && st.generated() == 0);
    let (src, first_done) = (q.lanes[0].slot, q.lanes[0].done);
    for lane in q.lanes.iter_mut().skip(1) {
        if !lane.waiting() {
            continue;
        }
        if cancelled || first_done {
            // The shared prompt never came in: the choice is dropped with its job.
            lane.done = true;
            free_slot(slots.get(lane.slot)?);
            continue;
        }
        if !prompt_in {
            continue;
        }
        let dst = lane.slot;
        slots.get(dst)?.session = None;
        let copy = match slots.get(src)?.session.as_ref() {
            Some(s) => s.fork()?,
            None => bail!("internal: the first choice's slot holds no session"),
        };
        let session = slots.get(dst)?.session.insert(copy);
        let (run, st) = start_choice(session, tok, eos, &q.job, lane.choice)?;
        lane.run = Some(run);
        lane.stepper = Some(st);
    }
    let Seq {
        job,
        out,
        lanes,
        finished,
        started,
        ttft,
        stalled,
        ..
    } = q;
    for lane in lanes.iter_mut() {
        if lane.done || lane.run.is_none() {
            continue;
        }
        let Some(session) = slots.get(lane.slot)?.session.as_mut() else {
            bail!("internal: a running choice's slot holds no session");
        };
        // A client that reads slower than the engine writes pauses its own request, not
        // the others: it skips steps while its channel is nearly full, and is cancelled
        // once it has read nothing for the stall timeout.
        let at_pick = lane
            .stepper
            .as_ref()
            .is_some_and(|st| st.phase() == Phase::Pick);
        if at_pick && !job.cancel.load(Ordering::SeqCst) {
            if job.events.capacity() < ROOM_TO_PICK {
                let since = *stalled.get_or_insert_with(Instant::now);
                if since.elapsed() < job.stall_timeout {
                    continue;
                }
                job.cancel.store(true, Ordering::SeqCst);
            } else {
                *stalled = None;
            }
        }
        loop {
            let (Some(run), Some(st)) = (lane.run.as_mut(), lane.stepper.as_mut()) else {
                bail!("internal: a sequence without a running choice");
            };
            if job.cancel.load(Ordering::SeqCst) {
                st.end(Finish::Cancelled);
            }
            match st.phase() {
                Phase::Prefill | Phase::Feed(_) => break,
                Phase::Pick => {
                    let t0 = *started;
                    run.step(session, st, &mut |_| {
                        ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    })?;
                }
                Phase::Done(_) => {
                    let (Some(run), Some(st)) = (lane.run.take(), lane.stepper.take()) else {
                        bail!("internal: a sequence without a running choice");
                    };
                    let g = st.into_generation();
                    let (c, pick_secs) = run.finish(tok, job, &g);
                    if lane.choice == 0 {
                        out.cached_tokens = g.cached_tokens;
                    }
                    out.completion_tokens += g.tokens.len();
                    out.reasoning_tokens += c.reasoning_tokens;
                    out.prefill_secs += g.prefill_secs;
                    // The choices decode together: the job's decode time is the longest's.
                    out.decode_secs = out.decode_secs.max(g.decode_secs);
                    out.pick_secs += pick_secs;
                    out.stats = out.stats.plus(&g.prefill_stats.plus(&g.decode_stats));
                    if g.finish == Finish::Cancelled {
                        out.cancelled = true;
                    }
                    if let Some(f) = finished.get_mut(lane.choice) {
                        *f = Some(c);
                    }
                    lane.done = true;
                    free_slot(slots.get(lane.slot)?);
                    break;
                }
            }
        }
    }
    Ok(lanes.iter().all(|l| l.done))
}
