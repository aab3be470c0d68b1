//! Admission: which free slots a queued job's choices take, whether its state fits beside
//! the running sequences, and how a choice starts on its session.

use super::{state_bytes, Lane, Seq, Slot};
use crate::backend::Backend;
use crate::model::Runner;
use crate::serve::choice_run::ChoiceRun;
use crate::serve::job::{Job, Outcome};
use crate::session::{DecodeOptions, Session, SnapshotLimits, Stepper};
use crate::stats::Stats;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// Why a job was not admitted.
pub(super) enum Admit {
    /// Its state does not fit beside the running ones': it waits.
    Wait(Box<Job>),
    /// Its first choice could not start.
    Failed(Box<Job>, anyhow::Error),
}

/// Puts `job`'s `n` choices in free slots, one each: its first choice in the one whose held
/// conversation (or a snapshot of it) shares the longest prefix with its prompt, so a
/// conversation's next turn feeds only its new tokens; the others in those holding least,
/// which take a copy of the first's state once it has the prompt. The sequences' states
/// (prompt plus `max_tokens` each, or what a free slot holds) share `budget` bytes: free
/// slots' conversations are dropped to make room, and a job that still does not fit waits
/// (a job alone always runs).
#[allow(clippy::too_many_arguments)]
pub(super) fn admit<'m, 't, B: Backend>(
    model: &'m Runner<B>,
    tok: &'t Tokenizer,
    eos: &[u32],
    job: Job,
    slots: &mut [Slot<'m, B>],
    active: &[Seq<'t>],
    snapshots: SnapshotLimits,
    budget: usize,
) -> std::result::Result<Seq<'t>, Admit> {
    let cfg = &model.ckpt.config;
    let n = job.params.n.max(1);
    if n > slots.len() {
        let e = anyhow::anyhow!(
            "n: {n} choices need {n} sequences; this server runs {} at once (--parallel)",
            slots.len()
        );
        return Err(Admit::Failed(Box::new(job), e));
    }
    let held = |s: &Slot<'m, B>| {
        if s.busy {
            s.reserved
        } else {
            s.session.as_ref().map_or(0, |x| match x.tokens().len() {
                0 => 0,
                n => state_bytes(cfg, n),
            })
        }
    };
    let Some(first) = (0..slots.len())
        .filter(|&i| !slots[i].busy)
        .max_by_key(|&i| {
            let reuse = slots[i]
                .session
                .as_ref()
                .map_or(0, |s| s.reusable(&job.ids));
            // Ties go to the slot holding least, so held conversations stay.
            (reuse, std::cmp::Reverse(held(&slots[i])))
        })
    else {
        return Err(Admit::Wait(Box::new(job)));
    };
    let mut rest: Vec<usize> = (0..slots.len())
        .filter(|&i| i != first && !slots[i].busy)
        .collect();
    rest.sort_by_key(|&i| held(&slots[i]));
    if rest.len() + 1 < n {
        return Err(Admit::Wait(Box::new(job)));
    }
    rest.truncate(n - 1);
    let chosen: Vec<usize> = std::iter::once(first).chain(rest.iter().copied()).collect();
    let one = state_bytes(cfg, job.ids.len() + job.params.max_tokens);
    let need = one * n;
    let others = |slots: &[Slot<'m, B>]| -> usize {
        (0..slots.len())
            .filter(|i| !chosen.contains(i))
            .map(|i| held(&slots[i]))
            .sum()
    };
    if others(slots) + need > budget {
        for (i, s) in slots.iter_mut().enumerate() {
            if !chosen.contains(&i) && !s.busy {
                s.session = None;
            }
        }
    }
    if !active.is_empty() && others(slots) + need > budget {
        return Err(Admit::Wait(Box::new(job)));
    }
    if slots[first].session.is_none() {
        match Session::new(model) {
            Ok(mut s) => {
                s.set_snapshot_limits(snapshots);
                slots[first].session = Some(s);
            }
            Err(e) => return Err(Admit::Failed(Box::new(job), e)),
        }
    }
    let Some(session) = slots[first].session.as_mut() else {
        return Err(Admit::Failed(
            Box::new(job),
            anyhow::anyhow!("internal: a slot without a session"),
        ));
    };
    let out = Outcome {
        choices: Vec::with_capacity(n),
        prompt_tokens: job.ids.len(),
        cached_tokens: 0,
        completion_tokens: 0,
        reasoning_tokens: 0,
        ttft_secs: 0.0,
        prefill_secs: 0.0,
        decode_secs: 0.0,
        stats: Stats::default(),
        cancelled: false,
        seed: job.params.sampling.seed,
        constraint_compile_secs: job.params.constraint.as_ref().map(|c| c.compile_secs),
        pick_secs: 0.0,
    };
    let started = catch_unwind(AssertUnwindSafe(|| {
        start_choice(session, tok, eos, &job, 0)
    }));
    match started {
        Ok(Ok((run, stepper))) => {
            let mut lanes = vec![Lane {
                slot: first,
                choice: 0,
                run: Some(run),
                stepper: Some(stepper),
                done: false,
            }];
            for (k, &si) in rest.iter().enumerate() {
                lanes.push(Lane {
                    slot: si,
                    choice: k + 1,
                    run: None,
                    stepper: None,
                    done: false,
                });
            }
            for &si in &chosen {
                slots[si].busy = true;
                slots[si].reserved = one;
            }
            Ok(Seq {
                job,
                out,
                lanes,
                finished: vec![None; n],
                started: Instant::now(),
                ttft: None,
                steps: 0,
                batch_rows: 0,
                stalled: None,
            })
        }
        Ok(Err(e)) => {
            slots[first].session = None;
            Err(Admit::Failed(Box::new(job), e))
        }
        Err(_) => {
            slots[first].session = None;
            Err(Admit::Failed(
                Box::new(job),
                anyhow::anyhow!("internal error in the engine; the request was dropped"),
            ))
        }
    }
}

/// Starts choice `choice` of `job` on `session`: its own sampler (`seed + choice`),
/// grammar, stop rules and logprobs; the session reuses what it holds of the prompt (a
/// later choice holds a copy of the first's state at the prompt's end).
pub(super) fn start_choice<'t, B: Backend>(
    session: &mut Session<'_, B>,
    tok: &'t Tokenizer,
    eos: &[u32],
    job: &Job,
    choice: usize,
) -> Result<(ChoiceRun<'t>, Stepper)> {
    let (run, stop_ids) = ChoiceRun::new(tok, eos, job, choice)?;
    let p = &job.params;
    let opts = DecodeOptions {
        max_tokens: p.max_tokens,
        stop_ids: &stop_ids,
        snapshot_at: p.snapshot_at,
        boundaries: &p.boundaries,
        ..DecodeOptions::default()
    };
    let stepper = session.begin(&job.ids, &opts)?;
    Ok((run, stepper))
}
