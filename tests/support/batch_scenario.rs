//! One scenario for batched forward passes, on either backend: four sequences, two
//! decoding after their prompts and two prefilling, run through `forward_batch` together
//! and each through `forward` alone, step by step.

use k3::backend::Backend;
use k3::model::{Logits, Runner, Segment, State};
use k3::stats::Stats;

/// Each sequence's prompt before the batched steps (empty: it starts in the batch).
pub(crate) const PROMPTS: [&[u32]; 4] = [&[5, 300, 17, 999], &[42, 0, 511], &[], &[]];

/// Each sequence's tokens in the first batched step: two decode one token, two prefill.
pub(crate) const STEP1: [&[u32]; 4] = [&[88], &[7], &[768, 5, 300, 17, 17], &[64, 65, 66]];

/// What each sequence wants of the first step's logits.
pub(crate) const WANT1: [Logits; 4] = [Logits::Last, Logits::Last, Logits::All, Logits::Last];

/// Each sequence's token in the second step (every one decoding).
pub(crate) const STEP2: [u32; 4] = [9, 10, 11, 12];

/// The logits of both steps for every sequence, run alone (`batched` false) or together.
pub(crate) fn run<B: Backend>(m: &Runner<B>, batched: bool) -> Vec<[Vec<f32>; 2]> {
    let mut stats = Stats::default();
    let mut states: Vec<State<B>> = (0..4).map(|_| m.new_state().unwrap()).collect();
    for (st, p) in states.iter_mut().zip(PROMPTS) {
        if !p.is_empty() {
            m.forward(st, p, Logits::Last, &mut stats, None).unwrap();
        }
    }
    let step2: Vec<[u32; 1]> = STEP2.iter().map(|&t| [t]).collect();
    let mut steps: Vec<Vec<Vec<f32>>> = Vec::new();
    for (ids, want) in [
        (STEP1.to_vec(), WANT1.to_vec()),
        (
            step2.iter().map(|t| t.as_slice()).collect(),
            vec![Logits::Last; 4],
        ),
    ] {
        steps.push(if batched {
            let mut segs: Vec<Segment<'_, B>> = states
                .iter_mut()
                .zip(&ids)
                .zip(&want)
                .map(|((state, ids), &want)| Segment { state, ids, want })
                .collect();
            m.forward_batch(&mut segs, &mut stats, None, None)
                .unwrap()
                .unwrap()
        } else {
            states
                .iter_mut()
                .zip(&ids)
                .zip(&want)
                .map(|((st, ids), &want)| m.forward(st, ids, want, &mut stats, None).unwrap())
                .collect()
        });
    }
    for (st, (p, s1)) in states.iter().zip(PROMPTS.iter().zip(STEP1)) {
        assert_eq!(
            st.pos,
            p.len() + s1.len() + 1,
            "each state advances by its rows"
        );
    }
    (0..4)
        .map(|s| [steps[0][s].clone(), steps[1][s].clone()])
        .collect()
}
