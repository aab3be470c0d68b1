//! `Part::Passes` times chains of small kernels; this part, `Part::PassTimes`, splits a
//! large matvec into the passes it records, each timed by the engine's profiler
//! (`--gpu-profile`), against the read kernel over the matrix's bytes. The int4 head's
//! digit kernel needs an `x_planes` pass first; the `% of read` lines of the other parts time
//! both, so this says what the matvec kernel alone reads at, and what its preparation adds.

use super::clock_probes::large_matvecs;
use super::{dense, Timer};
use k3::backend::gpu::GpuBackend;
use k3::backend::Backend;
use rand::rngs::StdRng;
use std::collections::HashMap;

/// Calls of each op per line, back to back in one submission.
const CALLS: u32 = 20;

/// The int4 head, int4 and int8 at 12288×7168, the int8 head, 16 experts' MXFP4 w1|w3 and
/// four int4 12288×7168 matrices of one input (the GPU heated before each), each pass's mean time and, for the longest, its share of
/// the read kernel's bandwidth over the same bytes.
pub(super) fn pass_time_lines(g: &GpuBackend, t: &Timer<'_>, rng: &mut StdRng, quick: bool) {
    let shapes = [(163840, 4), (12288, 4), (12288, 8), (163840, 8)];
    let mut cases = large_matvecs(g, rng, quick, &shapes);
    // A KDA layer's four int4 projections of one input (q, k, v, g: 12288×7168 each), in one
    // `matmul_many` call as the engine makes it: the four share one digit pass.
    let (rows, cols) = if quick { (768, 512) } else { (12288, 7168) };
    let ms: Vec<_> = (0..4)
        .map(|_| g.load_matrix(dense(rng, rows, cols, 4)).unwrap())
        .collect();
    let x = g.upload(&vec![0.5; cols], 1, cols).unwrap();
    cases.push((
        format!("int4 4 x {rows}x{cols}, one x"),
        ms.iter().map(|m| m.byte_size()).sum(),
        Box::new(move || {
            let refs: Vec<_> = ms.iter().collect();
            g.matmul_many(&refs, &x).unwrap();
        }),
    ));
    for (name, bytes, mut f) in cases.drain(..) {
        // Uploads and pipelines outside the profile.
        f();
        g.sync().unwrap();
        let read = t.read(bytes);
        t.heat();
        let Some(before) = g.ctx.profile_by_entry() else {
            println!("pass times: the backend is not profiling");
            return;
        };
        for _ in 0..CALLS {
            f();
        }
        g.sync().unwrap();
        let after = g.ctx.profile_by_entry().unwrap_or_default();
        let mut passes: Vec<(&str, u64, f64)> = delta(&before, &after);
        passes.sort_by(|a, b| b.2.total_cmp(&a.2));
        let all: f64 = passes.iter().map(|p| p.2).sum::<f64>() / f64::from(CALLS);
        let rbw = bytes.min(g.ctx.max_binding) as f64 / read;
        let pct = |secs: f64| 100.0 * bytes as f64 / secs / rbw;
        let list: Vec<String> = passes
            .iter()
            .map(|&(e, n, secs)| {
                let each = secs / f64::from(CALLS);
                format!("{e} x{} {:.1} us", n / u64::from(CALLS), each * 1e6)
            })
            .collect();
        let longest = passes.first().map_or(0.0, |p| p.2 / f64::from(CALLS));
        println!(
            "pass times: {name:<28} read {:.1} GB/s; all passes {:>7.1} us ({:.1} % of read); the longest alone {:.1} % of read; {}",
            rbw / 1e9,
            all * 1e6,
            pct(all),
            pct(longest),
            list.join(", ")
        );
    }
}

/// Per entry point, the passes and seconds `after` holds beyond `before`.
fn delta(
    before: &HashMap<&'static str, (u64, f64)>,
    after: &HashMap<&'static str, (u64, f64)>,
) -> Vec<(&'static str, u64, f64)> {
    after
        .iter()
        .filter_map(|(&e, &(n, secs))| {
            let (n0, s0) = before.get(e).copied().unwrap_or((0, 0.0));
            (n > n0).then_some((e, n - n0, secs - s0))
        })
        .collect()
}
