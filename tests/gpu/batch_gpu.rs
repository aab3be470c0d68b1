//! Several sequences in one GPU forward pass: each segment's logits match its own pass
//! within the tolerance of chunked prefill, with and without activation parts cutting
//! segments.

use crate::support;
use support::batch_scenario;
use support::rel_l2;

use k3::backend::gpu::GpuOptions;

/// Batched against alone on one GPU model: the ops differ only in rows per call.
const BATCH_TOL: f64 = 1e-5;

#[test]
fn gpu_segments_get_their_own_logits() {
    // Parts of 3 rows cut the prefilling segments: attention runs across part edges, and
    // each sequence's logits stay those of one part.
    let mut one_part: Option<Vec<[Vec<f32>; 2]>> = None;
    for part_rows in [None, Some(3)] {
        let opts = GpuOptions {
            part_rows,
            ..Default::default()
        };
        let Some(m) = support::gpu_model(&support::tiny(0), opts, support::serial_stream()) else {
            return;
        };
        if part_rows.is_some() {
            assert_eq!(m.backend.part_rows(), 3);
        }
        let alone = batch_scenario::run(&m, false);
        let together = batch_scenario::run(&m, true);
        for (s, (a, t)) in alone.iter().zip(&together).enumerate() {
            for step in 0..2 {
                assert_eq!(t[step].len(), a[step].len());
                let d = rel_l2(&t[step], &a[step]);
                assert!(
                    d < BATCH_TOL,
                    "parts of {part_rows:?} rows, segment {s}, step {step}: rel L2 {d}"
                );
            }
        }
        assert!(
            rel_l2(&alone[0][1], &alone[1][1]) > 1e-3,
            "sequences differ"
        );
        if let Some(whole) = &one_part {
            for (s, (a, w)) in alone.iter().zip(whole).enumerate() {
                for step in 0..2 {
                    let d = rel_l2(&a[step], &w[step]);
                    assert!(
                        d < BATCH_TOL,
                        "segment {s}, step {step}: parts against one part, rel L2 {d}"
                    );
                }
            }
        }
        one_part.get_or_insert(alone);
    }
}
