//! State snapshots behind the server's prefix reuse: a prompt that diverges from what the
//! session holds returns to the longest snapshot that is a prefix of it and gives exactly
//! the tokens and logits of a fresh session; the snapshots stay within their bounds; the
//! GPU backend's copy and truncate ops give what the CPU's do.

use crate::support;

use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::Backend;
use k3::model::{FormatPolicy, Runner};
use k3::sampling::argmax_lowest;
use k3::session::{DecodeOptions, Flow, Generation, Session, SnapshotLimits};
use support::rel_l2;

const P1: [u32; 11] = [768, 5, 300, 17, 17, 999, 42, 0, 511, 7, 88];
const GEN: usize = 6;

fn cpu() -> Runner<k3::backend::cpu::CpuBackend> {
    support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        support::serial_stream(),
    )
}

fn gpu() -> Option<Runner<GpuBackend>> {
    support::gpu_model(
        &support::tiny(0),
        GpuOptions::default(),
        support::serial_stream(),
    )
}

/// Greedy generation of `n` tokens; returns it with the logits each token was picked from.
fn greedy<B: Backend>(s: &mut Session<'_, B>, prompt: &[u32], n: usize) -> (Generation, Vec<f32>) {
    let mut seen = Vec::new();
    let g = s
        .generate(
            prompt,
            &DecodeOptions {
                max_tokens: n,
                ..DecodeOptions::default()
            },
            &mut |logits, _| {
                seen.extend_from_slice(logits);
                argmax_lowest(logits)
            },
            &mut |_| Ok(Flow::Continue),
        )
        .unwrap();
    (g, seen)
}

fn limits<B: Backend>(m: &Runner<B>, count: usize, snapshots: f64) -> SnapshotLimits {
    let one = m.snapshot_bytes() + m.vocab_size() * 4;
    SnapshotLimits {
        count,
        bytes: (one as f64 * snapshots) as usize,
    }
}

/// The second prompt: the first, then a turn that differs from what was generated after
/// it (the way a re-rendered assistant turn differs), then a new turn.
fn diverging(p1: &[u32], generated: &[u32]) -> Vec<u32> {
    let mut p2 = p1.to_vec();
    p2.extend(generated.iter().take(2).map(|&t| (t + 1) % 1000));
    p2.extend([9, 8, 7, 6, 5, 4, 3]);
    p2
}

/// What the diverging prompt gives: from a snapshot, and from a fresh session.
fn reused_and_fresh<B: Backend>(
    m: &Runner<B>,
    chunk: usize,
) -> ((Generation, Vec<f32>), (Generation, Vec<f32>)) {
    let mut s = Session::with_max_window(m, chunk).unwrap();
    s.set_snapshot_limits(limits(m, 4, 4.0));
    let (g1, _) = greedy(&mut s, &P1, GEN);
    let p2 = diverging(&P1, &g1.tokens);
    assert!(
        !p2.starts_with(s.tokens()),
        "the test needs a divergent prompt"
    );
    let reused = greedy(&mut s, &p2, GEN);
    let mut fresh = Session::with_max_window(m, chunk).unwrap();
    let f = greedy(&mut fresh, &p2, GEN);
    (reused, f)
}

#[test]
fn a_diverging_prompt_resumes_from_a_snapshot_with_the_fresh_tokens_and_logits() {
    let m = cpu();
    for chunk in [1, 4, 32] {
        let ((g, logits), (f, fresh_logits)) = reused_and_fresh(&m, chunk);
        assert_eq!(g.cached_tokens, P1.len(), "chunk {chunk}");
        assert_eq!(g.prefilled_tokens, 9);
        assert_eq!(f.cached_tokens, 0);
        assert_eq!(g.tokens, f.tokens, "chunk {chunk}");
        assert_eq!(logits, fresh_logits, "chunk {chunk}: logits differ");
    }
}

#[test]
fn the_longest_snapshot_that_is_a_prefix_is_restored_and_the_abandoned_branch_dropped() {
    let m = cpu();
    let mut s = Session::with_max_window(&m, 4).unwrap();
    s.set_snapshot_limits(limits(&m, 8, 8.0));
    // Three turns, each prompt extending the last one's tokens exactly.
    let mut prompt = P1.to_vec();
    let mut ends = Vec::new();
    for turn in 0..3u32 {
        let (g, _) = greedy(&mut s, &prompt, 3);
        // What was held: all but the last answer token and the two new ones.
        let held = if turn == 0 { 0 } else { prompt.len() - 3 };
        assert_eq!(g.cached_tokens, held, "turn {turn}");
        ends.push(prompt.len());
        prompt = s.tokens().to_vec();
        prompt.extend(&g.tokens[g.tokens.len() - 1..]);
        prompt.extend([100 + turn, 200 + turn]);
    }
    assert_eq!(s.snapshot_count(), 3);
    // Diverge just after the second prompt's end: that snapshot is the one to return to.
    let mut p = s.tokens()[..ends[1]].to_vec();
    p.extend([1, 2, 3]);
    let (g, logits) = greedy(&mut s, &p, 4);
    assert_eq!(g.cached_tokens, ends[1]);
    // The third prompt's snapshot lay past the divergence and is gone; this prompt's is new.
    assert_eq!(s.snapshot_count(), 3);
    let mut fresh = Session::with_max_window(&m, 4).unwrap();
    let (f, fresh_logits) = greedy(&mut fresh, &p, 4);
    assert_eq!(g.tokens, f.tokens);
    assert_eq!(logits, fresh_logits);
    // A prompt that is exactly a snapshot's tokens feeds nothing and still matches.
    let p1 = s.tokens()[..ends[0]].to_vec();
    let (g, logits) = greedy(&mut s, &p1, 4);
    assert_eq!((g.cached_tokens, g.prefilled_tokens), (ends[0], 0));
    let mut fresh = Session::with_max_window(&m, 4).unwrap();
    let (f, fresh_logits) = greedy(&mut fresh, &p1, 4);
    assert_eq!(g.tokens, f.tokens);
    assert_eq!(logits, fresh_logits);
}

#[test]
fn snapshots_stay_within_their_count_and_bytes() {
    let m = cpu();
    let mut s = Session::with_max_window(&m, 8).unwrap();
    // Room for 2.5 snapshots by bytes and 3 by count: at most 2 are ever held.
    let lim = limits(&m, 3, 2.5);
    s.set_snapshot_limits(lim);
    let mut prompt = P1.to_vec();
    for turn in 0..6u32 {
        let (g, _) = greedy(&mut s, &prompt, 2);
        assert!(
            s.snapshot_count() <= 2,
            "turn {turn}: {}",
            s.snapshot_count()
        );
        assert!(s.snapshot_bytes() <= lim.bytes, "turn {turn}");
        prompt = s.tokens().to_vec();
        prompt.extend(&g.tokens[1..]);
        prompt.push(300 + turn);
    }
    assert_eq!(s.snapshot_count(), 2);
    // By count alone.
    s.set_snapshot_limits(limits(&m, 1, 100.0));
    assert_eq!(s.snapshot_count(), 1);
    // A budget below one snapshot keeps none: a diverging prompt starts over, correctly.
    let mut s = Session::with_max_window(&m, 8).unwrap();
    s.set_snapshot_limits(limits(&m, 4, 0.9));
    let (g1, _) = greedy(&mut s, &P1, GEN);
    assert_eq!(s.snapshot_count(), 0);
    let p2 = diverging(&P1, &g1.tokens);
    let (g, logits) = greedy(&mut s, &p2, GEN);
    assert_eq!(g.cached_tokens, 0);
    let (f, fresh_logits) = greedy(&mut Session::with_max_window(&m, 8).unwrap(), &p2, GEN);
    assert_eq!((g.tokens, logits), (f.tokens, fresh_logits));
    // Off by default: a session that never set limits keeps none.
    let mut plain = Session::with_max_window(&m, 8).unwrap();
    greedy(&mut plain, &P1, 2);
    assert_eq!((plain.snapshot_count(), plain.snapshot_bytes()), (0, 0));
}

#[test]
fn gpu_snapshots_resume_like_a_fresh_gpu_session_and_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for chunk in [1, 4] {
        let ((gr, gl), (gf, gfl)) = reused_and_fresh(&g, chunk);
        let ((cr, _), _) = reused_and_fresh(&c, chunk);
        assert_eq!(gr.cached_tokens, P1.len());
        assert_eq!(
            gr.tokens, gf.tokens,
            "chunk {chunk}: GPU reuse vs fresh GPU"
        );
        assert_eq!(gr.tokens, cr.tokens, "chunk {chunk}: GPU vs CPU");
        let e = rel_l2(&gl, &gfl);
        assert!(e < 1e-5, "chunk {chunk}: logits rel l2 {e}");
    }
}

/// After `P1`, a session's fork and the session itself each continue greedily (the fork
/// first, so a state they shared would show in the original), and a fresh session does.
fn fork_original_fresh<B: Backend>(m: &Runner<B>) -> [(Generation, Vec<f32>); 3] {
    let mut s = Session::with_max_window(m, 4).unwrap();
    assert_eq!(s.sync_to(&P1).unwrap(), P1.len());
    let mut f = s.fork().unwrap();
    assert_eq!(f.tokens(), &P1);
    let forked = greedy(&mut f, &P1, GEN);
    let original = greedy(&mut s, &P1, GEN);
    let fresh = greedy(&mut Session::with_max_window(m, 4).unwrap(), &P1, GEN);
    [forked, original, fresh]
}

#[test]
fn a_forked_session_and_its_original_go_on_apart_as_a_fresh_one_does() {
    let [(f, fl), (o, ol), (n, nl)] = fork_original_fresh(&cpu());
    assert_eq!((f.cached_tokens, f.prefilled_tokens), (P1.len(), 0));
    assert_eq!(f.tokens, n.tokens, "fork vs fresh");
    assert_eq!(o.tokens, n.tokens, "original vs fresh");
    assert_eq!(fl, nl, "the fork's logits differ");
    assert_eq!(ol, nl, "the original's logits differ");
}

#[test]
fn a_forked_gpu_session_goes_on_as_a_fresh_one_does() {
    let Some(g) = gpu() else { return };
    let [(f, fl), (o, ol), (n, nl)] = fork_original_fresh(&g);
    assert_eq!(f.tokens, n.tokens, "fork vs fresh");
    assert_eq!(o.tokens, n.tokens, "original vs fresh");
    for (what, l) in [("fork", &fl), ("original", &ol)] {
        let e = rel_l2(l, &nl);
        assert!(e < 1e-5, "{what}: logits rel l2 {e}");
    }
}
