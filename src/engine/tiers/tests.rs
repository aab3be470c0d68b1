use super::*;

const G: u64 = 1_000_000_000;

#[test]
fn vram_default_is_free_minus_the_larger_margin_and_half_goes_to_the_window() {
    // Large: 10% of 100 GB beats 2 GB; a window bound of 30 GB takes 30 of the 90.
    let s = vram_split(None, 100 * G, 0, 30 * G);
    assert_eq!((s.tier.bytes, s.window_bytes), (60 * G, 30 * G));
    assert!(
        s.tier
            .why
            .contains("free VRAM 100.0 GB - margin 10.0 GB - prefill window 30.0 GB"),
        "{}",
        s.tier.why
    );
    // A window bound beyond half the room gets half.
    let s = vram_split(None, 100 * G, 0, u64::MAX);
    assert_eq!((s.tier.bytes, s.window_bytes), (45 * G, 45 * G));
    // Small: the 2 GB floor beats 10% of 8 GB.
    assert_eq!(vram_split(None, 8 * G, 0, 0).tier.bytes, 6 * G);
    // Below the margin: off, and the line says so.
    let s = vram_split(None, G, 0, G);
    assert_eq!((s.tier.bytes, s.window_bytes), (0, 0));
    assert!(s.tier.why.contains("nothing left"), "{}", s.tier.why);
}

#[test]
fn the_default_vram_window_is_bounded_and_chunk_lifts_the_bound() {
    assert_eq!(
        vram_window_tokens(131_072, false),
        DEFAULT_VRAM_WINDOW_TOKENS
    );
    assert_eq!(vram_window_tokens(1_000, false), 1_000);
    assert_eq!(vram_window_tokens(65_536, true), 65_536);
}

#[test]
fn vram_default_leaves_the_state_and_snapshots_out() {
    // 100 GB free - 10 GB margin - 14.5 GB of MLA cache, KDA state and snapshots.
    let state = 14_500_000_000;
    let s = vram_split(None, 100 * G, state, G);
    assert_eq!(s.tier.bytes, 90 * G - state - G);
    assert!(
        s.tier
            .why
            .contains("margin 10.0 GB - state and snapshots 14.5 GB - prefill window 1.0 GB"),
        "{}",
        s.tier.why
    );
    assert_eq!(vram_split(None, 8 * G, 20 * G, G).tier.bytes, 0);
}

#[test]
fn vram_unknown_keeps_the_tier_off_and_says_why() {
    let s = unmeasured_tier(None, "no budget ext");
    assert_eq!(s.bytes, 0);
    assert!(
        s.why.contains("no budget ext") && s.why.contains("K3_GPU_GB"),
        "{}",
        s.why
    );
    assert_eq!(unmeasured_tier(Some(2.0), "no budget ext").bytes, 2 * G);
}

#[test]
fn vram_asked_size_wins_and_the_window_gets_half_of_what_it_leaves() {
    // 100 GB free - 10 GB margin - 10 GB state - 60 GB asked: the window gets 10 GB.
    let s = vram_split(Some(60.0), 100 * G, 10 * G, u64::MAX);
    assert_eq!((s.tier.bytes, s.window_bytes), (60 * G, 10 * G));
    assert_eq!(s.tier.why, "asked 60 GB");
    // More than fits is still what was asked; the window is then what nothing leaves.
    let s = vram_split(Some(500.0), 100 * G, 0, u64::MAX);
    assert_eq!((s.tier.bytes, s.window_bytes), (500 * G, 0));
    let s = vram_split(Some(0.0), 100 * G, 0, 2 * G);
    assert_eq!((s.tier.bytes, s.window_bytes), (0, 2 * G));
    assert!(s.tier.why.contains("off"), "{}", s.tier.why);
}
