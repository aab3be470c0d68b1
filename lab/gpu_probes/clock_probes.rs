//! The bench parts that ask what state the GPU is in rather than how fast a kernel is:
//! `Part::Order` (kernels alone against interleaved with the read kernel, then the steps a
//! block takes), `Part::Clock` (the int4 head after idling and after back-to-back work),
//! `Part::Repeat` (the heads timed again and again, each in fresh allocations).
//! Their lines carry Unix times to match nvidia-smi's clock samples
//! (lab/device/device_clock_states.sh). Session 10 found the H200's SM clock behind most "slow"
//! lines (docs/perf.md, "The GPU's clock").

use super::{assignments, dense, mxfp4, Timer};
use k3::backend::gpu::GpuBackend;
use k3::backend::{Backend, ExpertResidency, Glu};
use k3::quant::Mxfp4View;
use rand::rngs::StdRng;
use std::time::Instant;

/// A large matvec of the probes: its name, its weight bytes and the op's call.
pub(super) type MatvecCase<'a> = (String, u64, Box<dyn FnMut() + 'a>);

/// Dense matvecs of `dense` (rows, bits) over 7168 columns, then 16 experts' MXFP4 w1|w3
/// (98304×3584), each against x of 0.5s (the small shapes under `quick`).
pub(super) fn large_matvecs<'a>(
    g: &'a GpuBackend,
    rng: &mut StdRng,
    quick: bool,
    dense_shapes: &[(usize, u32)],
) -> Vec<MatvecCase<'a>> {
    let s = |full: usize, small: usize| if quick { small } else { full };
    let cols = s(7168, 512);
    let x = g.upload(&vec![0.5; cols], 1, cols).unwrap();
    let mut cases: Vec<MatvecCase<'a>> = Vec::new();
    for &(rows, bits) in dense_shapes {
        let rows = s(rows, rows / 16);
        let m = g.load_matrix(dense(rng, rows, cols, bits)).unwrap();
        let x = x.clone();
        cases.push((
            format!("int{bits} matvec {rows}x{cols}"),
            m.byte_size(),
            Box::new(move || {
                g.matmul(&m, &x).unwrap();
            }),
        ));
    }
    let (rows, d) = (s(98304, 8192), s(3584, 384));
    let (pb, sb) = mxfp4(rng, rows, d);
    let xb = g.upload(&vec![0.5; d], 1, d).unwrap();
    let bytes = (pb.len() + sb.len()) as u64;
    cases.push((
        format!("mxfp4 matvec {rows}x{d}"),
        bytes,
        Box::new(move || {
            let wb = Mxfp4View::new(rows, d, &pb, &sb).unwrap();
            g.matmul_mxfp4(wb, &xb).unwrap();
        }),
    ));
    cases
}

/// `Part::Order`: the int4 12288×7168 matvec, the int4 head and 16 experts' MXFP4 w1|w3,
/// each timed alone, then the read kernel over a buffer of the same size alone, then the
/// two interleaved rep by rep.
pub(super) fn order_lines(g: &GpuBackend, t: &Timer<'_>, rng: &mut StdRng, quick: bool) {
    let mut cases = large_matvecs(g, rng, quick, &[(12288, 4), (163840, 4)]);
    for (name, bytes, mut f) in cases.drain(..) {
        let alone = t.time(&mut f);
        let read_alone = t.read(bytes);
        let (mv, read) = t.time_vs_read(bytes, &mut f);
        let gbs = |secs: f64| bytes as f64 / secs / 1e9;
        println!(
            "order: [{}] {name:<28} alone {:>8.1} us, interleaved {:>8.1} us; read alone {:>7.1} GB/s, interleaved {:>7.1} GB/s; alone/alone {:>5.1} %, interleaved {:>5.1} %",
            unix_time(),
            alone * 1e6,
            mv * 1e6,
            gbs(read_alone),
            gbs(read),
            read_alone / alone * 100.0,
            read / mv * 100.0
        );
    }
    state_probes(g, t, rng, quick);
}

/// The int4 head and the read kernel timed alone after each of a series of steps a bench
/// block takes before its head line (allocations, a second head loaded and dropped, the
/// MoE's uploads and resident runs, MXFP4 matvecs that upload per call): which step puts
/// the GPU into the state where the head and the read kernel run at a third of their speed.
/// The read kernel runs over a new buffer and over one allocated before the steps, to tell
/// a slow GPU from slow new allocations.
fn state_probes(g: &GpuBackend, t: &Timer<'_>, rng: &mut StdRng, quick: bool) {
    let s = |full: usize, small: usize| if quick { small } else { full };
    let (rows, cols) = (s(163840, 10240), s(7168, 512));
    let head = g.load_matrix(dense(rng, rows, cols, 4)).unwrap();
    let x = g.upload(&vec![0.5; cols], 1, cols).unwrap();
    let bytes = head.byte_size().min(g.ctx.max_binding) / 16 * 16;
    let old = g.ctx.buffer(bytes, "read src allocated first");
    let probe = |step: &str| {
        let mv = t.time(|| {
            g.matmul(&head, &x).unwrap();
        });
        let fresh = t.read(bytes);
        let first = t.read_in(&old, bytes);
        println!(
            "state: [{}] after {step:<40} head {:>7.1} us; read new buffer {:>7.1} GB/s, first buffer {:>7.1} GB/s",
            unix_time(),
            mv * 1e6,
            bytes as f64 / fresh / 1e9,
            bytes as f64 / first / 1e9
        );
    };
    probe("nothing");
    let churn = (256u64 << 20).min(g.ctx.max_binding) / 16 * 16;
    for _ in 0..8 {
        t.read_in(&g.ctx.buffer(churn, "churn"), churn);
    }
    probe("8 x 256 MiB allocated, read, dropped");
    drop(g.load_matrix(dense(rng, rows, cols, 8)).unwrap());
    probe("an int8 head loaded and dropped");
    let (i, d) = (s(3072, 256), s(3584, 384));
    let experts: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..16)
        .map(|_| [mxfp4(rng, i, d), mxfp4(rng, d, i), mxfp4(rng, i, d)])
        .collect();
    let assign = |resident: bool| assignments(&experts, i, d, 1, resident);
    let glu = Glu::Situ {
        beta: 10.0,
        linear_beta: 10.0,
    };
    let z = g.upload(&vec![0.25; d], 1, d).unwrap();
    let mut acc = g.zeros(1, d).unwrap();
    g.configure_expert_tier(0, 0, i, d).unwrap();
    for _ in 0..4 {
        g.moe_accumulate(&mut acc, &z, &assign(false), glu).unwrap();
    }
    g.sync().unwrap();
    probe("16 experts uploaded 4 times");
    let tier: u64 = experts
        .iter()
        .flatten()
        .map(|(p, s)| (p.len() + s.len()) as u64)
        .sum();
    g.configure_expert_tier(tier, 16, i, d).unwrap();
    g.moe_accumulate(&mut acc, &z, &assign(false), glu).unwrap();
    for _ in 0..8 {
        g.moe_accumulate(&mut acc, &z, &assign(true), glu).unwrap();
    }
    g.sync().unwrap();
    probe("16 experts resident, 8 runs");
    let (pb, sb) = mxfp4(rng, s(98304, 8192), d);
    let wb = Mxfp4View::new(s(98304, 8192), d, &pb, &sb).unwrap();
    for _ in 0..4 {
        g.matmul_mxfp4(wb, &z).unwrap();
    }
    g.sync().unwrap();
    probe("4 MXFP4 98304-row matvecs, uploaded");
    for r in [12288, 3072, 1536] {
        for bits in [4, 8] {
            let m = g.load_matrix(dense(rng, s(r, r / 16), cols, bits)).unwrap();
            for _ in 0..4 {
                g.matmul(&m, &x).unwrap();
            }
        }
    }
    g.sync().unwrap();
    probe("int4/int8 12288, 3072, 1536 loaded, run");
}

/// `Part::Clock`: the int4 head timed at the start, after 6 s idle, then after 0.1, 0.5 and
/// 2 s of back-to-back head matvecs in one submission, and after 6 s idle again.
pub(super) fn clock_lines(g: &GpuBackend, rng: &mut StdRng, quick: bool) {
    // Unheated: the heater is what this part tests.
    let t = &Timer::new(g, 0.0);
    let s = |full: usize, small: usize| if quick { small } else { full };
    let (rows, cols) = (s(163840, 10240), s(7168, 512));
    let head = g.load_matrix(dense(rng, rows, cols, 4)).unwrap();
    let x = g.upload(&vec![0.5; cols], 1, cols).unwrap();
    let report = |step: &str| {
        let secs = t.time(|| {
            g.matmul(&head, &x).unwrap();
        });
        println!(
            "clock: [{}] head {:>7.1} us {step}",
            unix_time(),
            secs * 1e6
        );
    };
    let idle = || std::thread::sleep(std::time::Duration::from_secs(if quick { 1 } else { 6 }));
    report("at the start");
    idle();
    report("after 6 s idle");
    for load in [0.1, 0.5, 2.0] {
        // Matvecs recorded back to back until `load` seconds of them have run.
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < load {
            for _ in 0..50 {
                g.matmul(&head, &x).unwrap();
            }
            g.sync().unwrap();
        }
        report(&format!("after {load} s of back-to-back head matvecs"));
    }
    idle();
    report("after 6 s idle");
}

/// `Part::Repeat`: the int8 and the int4 head, each loaded three times (a new allocation
/// each time) and timed three times against the read kernel per load. Session 11 read the
/// int8 head at 71.8 and 89.9 % of the read kernel in two runs whose read kernel ran at the
/// same speed: whether a head's time moves from line to line, or with its allocation.
pub(super) fn repeat_lines(g: &GpuBackend, t: &Timer<'_>, rng: &mut StdRng, quick: bool) {
    let s = |full: usize, small: usize| if quick { small } else { full };
    let (rows, cols) = (s(163840, 10240), s(7168, 512));
    let x = g.upload(&vec![0.5; cols], 1, cols).unwrap();
    for bits in [8, 4] {
        let data = dense(rng, rows, cols, bits);
        for load in 1..=3 {
            let m = g.load_matrix(data.clone()).unwrap();
            let bytes = m.byte_size();
            for rep in 1..=3 {
                let (mv, read) = t.time_vs_read(bytes, &mut || {
                    g.matmul(&m, &x).unwrap();
                });
                let gbs = |secs: f64| bytes.min(g.ctx.max_binding) as f64 / secs / 1e9;
                println!(
                    "repeat: [{}] int{bits} head {rows}x{cols}, load {load}, line {rep}: {:>7.1} us, read {:>7.1} GB/s, {:>5.1} %",
                    unix_time(),
                    mv * 1e6,
                    gbs(read),
                    bytes as f64 / mv / (bytes.min(g.ctx.max_binding) as f64 / read) * 100.0
                );
            }
        }
    }
}

/// Seconds since the Unix epoch, to line a report up with the GPU's clock samples
/// (nvidia-smi's timestamps, lab/device/device_clock_states.sh).
fn unix_time() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:03}", t.as_secs(), t.subsec_millis())
}
