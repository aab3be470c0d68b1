//! LAB: the kernel benchmark as it stood before `benches/gpu_kernels.rs` became named cases:
//! 32 numbered blocks of matvec geometries, chunk tiles, checks and probes (the MXFP4 twin,
//! the clock and ordering probes, per-pass times). It built as `benches/gpu_kernels.rs` at the
//! commit that moved it here; to run it again, copy this file to `benches/gpu_kernels.rs`
//! and the folder's other files to `benches/gpu_kernels/` (beside the bench's own
//! `read_kernel.rs` and `read_bench.wgsl`). Block numbers are those
//! lab/notebook.md cites.
//!
//! GPU kernel bandwidth at K3 shapes, each against a plain read kernel over a buffer of the
//! same size in the same run (the roofline the matvecs are judged by).
//!
//! `cargo bench --bench gpu_kernels [-- quick] [matvec] [blocks=2,3] [wgsl=DIR] [down_rpl=N]
//! [nochecks=bounds,loop,div]` — `quick` uses small shapes (lavapipe), `matvec` runs only the
//! one-token matvec blocks, `blocks=` only the listed blocks (counted from 1, in the order of
//! `blocks` in `main`), `wgsl=` composes the kernels from DIR's files, `down_rpl=` sets the
//! rows a lane of the MoE's down projection in the blocks that take the default geometry,
//! `nochecks=` builds the matvec modules without those of wgpu's runtime checks and with the
//! others (`nochecks=none`: all of them; unset: the engine's `default_matvec_checks`).
//! Each kernel's runs alternate with the read kernel's, so both see the GPU in the same state.
//! Times come from timestamp queries around the recorded passes when the adapter has them
//! (`TIMESTAMP_QUERY_INSIDE_ENCODERS`), else from the wall clock around a full sync.
//! `K3_ADAPTER=NAME` picks the adapter.

use k3::backend::gpu::device::buffers::GpuAct;
use k3::backend::gpu::kernels::chunk_gemm::ChunkGemm;
use k3::backend::gpu::kernels::stationary::Stationary;
use k3::backend::gpu::{GpuBackend, GpuOptions, Int4Decode, MatvecShape};
use k3::backend::{Backend, ExpertAssignment, ExpertPayload, ExpertResidency, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights, MlaDims, RouterParams};
use k3::routed_expert::{ExpertKey, ExpertWeights};
use k3::quant::{DenseData, DenseFormat, DenseMatrix, Mxfp4View};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

#[path = "gpu_kernels/clock_probes.rs"]
mod clock_probes;
#[path = "gpu_kernels/mxfp4_twin.rs"]
mod mxfp4_twin;
#[path = "gpu_kernels/pass_times.rs"]
mod pass_times;
#[path = "gpu_kernels/read_kernel.rs"]
mod read_kernel;

/// Timed repetitions per kernel (after one warm-up).
const REPS: usize = 8;

/// Seconds of back-to-back read passes before each timed line, so the line runs at the
/// GPU's full clock. The H200 under Vulkan drops its SM clock from 1980 to 345 MHz within
/// a few seconds of light use (the host generating a line's data) and takes 0.1-0.5 s of
/// sustained work to raise it again; untimed, the int4 head took 954 µs at the low clock
/// and 224 µs at the high one (docs/perf.md, session 10). `K3_BENCH_HEAT=0` turns it off.
const HEAT_SECS: f64 = 0.6;

struct Timer<'a> {
    g: &'a GpuBackend,
    /// The plain read kernel (the roofline).
    read: read_kernel::ReadKernel,
    qs: Option<wgpu::QuerySet>,
    /// The heater's source buffer and sink, and its seconds (0: off).
    heat: (wgpu::Buffer, wgpu::Buffer, f64),
}

impl<'a> Timer<'a> {
    /// A timer that heats the GPU for `heat_secs` before each line.
    fn new(g: &'a GpuBackend, heat_secs: f64) -> Self {
        let qs = g.ctx.has_timestamps().then(|| {
            g.ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("bench"),
                ty: wgpu::QueryType::Timestamp,
                count: 4 * REPS as u32,
            })
        });
        let bytes = (64u64 << 20).min(g.ctx.max_binding) / 16 * 16;
        let heat = (
            g.ctx.buffer(bytes, "heater src"),
            g.ctx.buffer(4 << 20, "heater sink"),
            heat_secs,
        );
        Self {
            g,
            read: read_kernel::ReadKernel::new(&g.ctx),
            qs,
            heat,
        }
    }

    /// Keeps the GPU busy with read passes, 64 at a submission, for the heater's seconds.
    fn heat(&self) {
        let (src, sink, secs) = &self.heat;
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < *secs {
            for _ in 0..64 {
                self.dispatch_read(src, sink, src.size());
            }
            self.g.sync().unwrap();
        }
    }

    /// Median seconds of `f` (its recorded GPU work), over REPS runs after a warm-up.
    fn time(&self, mut f: impl FnMut()) -> f64 {
        self.medians(&mut [&mut f])[0]
    }

    /// Median seconds of `f` and of the plain read kernel over `bytes`, their runs
    /// interleaved: the H200 switches between a fast and a slow state within one call
    /// (docs/perf.md, session 7), and a ratio is only fair when both see the same one.
    fn time_vs_read(&self, bytes: u64, f: &mut dyn FnMut()) -> (f64, f64) {
        let bytes = bytes.min(self.g.ctx.max_binding) / 16 * 16;
        let src = self.g.ctx.buffer(bytes, "read src");
        let sink = self.g.ctx.buffer(4 << 20, "read sink");
        let m = self.medians(&mut [f, &mut || self.dispatch_read(&src, &sink, bytes)]);
        (m[0], m[1])
    }

    /// Median seconds of each of `fs` (at most 2), run in turn REPS times after a warm-up.
    fn medians(&self, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
        let k = fs.len();
        assert!(k <= 2);
        for f in fs.iter_mut() {
            f();
        }
        self.g.sync().unwrap();
        self.heat();
        let mut secs = vec![Vec::with_capacity(REPS); k];
        match &self.qs {
            Some(qs) => {
                let n = (2 * REPS * k) as u32;
                for r in 0..REPS {
                    for (i, f) in fs.iter_mut().enumerate() {
                        let q = (2 * (r * k + i)) as u32;
                        self.g.ctx.record(|e| e.write_timestamp(qs, q));
                        f();
                        self.g.ctx.record(|e| e.write_timestamp(qs, q + 1));
                    }
                }
                let resolve = self.g.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("timestamps"),
                    size: 8 * u64::from(n),
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                });
                self.g
                    .ctx
                    .record(|e| e.resolve_query_set(qs, 0..n, &resolve, 0));
                let bytes = self.g.ctx.read(&resolve, 0, 8 * u64::from(n)).unwrap();
                let ticks: &[u64] = bytemuck::cast_slice(&bytes);
                let period = f64::from(self.g.ctx.queue.get_timestamp_period()) * 1e-9;
                for r in 0..REPS {
                    for (i, s) in secs.iter_mut().enumerate() {
                        let q = 2 * (r * k + i);
                        s.push(ticks[q + 1].saturating_sub(ticks[q]) as f64 * period);
                    }
                }
            }
            None => {
                for _ in 0..REPS {
                    for (f, s) in fs.iter_mut().zip(&mut secs) {
                        let t = Instant::now();
                        f();
                        self.g.sync().unwrap();
                        s.push(t.elapsed().as_secs_f64());
                    }
                }
            }
        }
        secs.into_iter()
            .map(|mut s| {
                s.sort_by(f64::total_cmp);
                s[REPS / 2]
            })
            .collect()
    }

    /// Median seconds of the plain read kernel over `bytes`.
    fn read(&self, bytes: u64) -> f64 {
        let bytes = bytes.min(self.g.ctx.max_binding) / 16 * 16;
        self.read_in(&self.g.ctx.buffer(bytes, "read src"), bytes)
    }

    /// Median seconds of the plain read kernel over the first `bytes` of `src`.
    fn read_in(&self, src: &wgpu::Buffer, bytes: u64) -> f64 {
        let sink = self.g.ctx.buffer(4 << 20, "read sink");
        self.time(|| self.dispatch_read(src, &sink, bytes))
    }

    /// Records the plain read kernel over the first `bytes` of `src`.
    fn dispatch_read(&self, src: &wgpu::Buffer, sink: &wgpu::Buffer, bytes: u64) {
        self.read.dispatch(&self.g.ctx, src, sink, bytes);
    }
}

/// Per-pass GPU time of small kernels (`Part::Passes`): each timed span holds `n` passes,
/// so a chain's figure per pass is its span over `n`.
fn passes(g: &GpuBackend, t: &Timer<'_>, quick: bool) {
    let d = 7168;
    let x = g.upload(&vec![0.5; d], 1, d).unwrap();
    let w = g.upload(&vec![1.0; d], 1, d).unwrap();
    let m = g
        .load_matrix(dense(&mut StdRng::seed_from_u64(3), 12288, d, 4))
        .unwrap();
    let chain = |n: usize, norm: bool| {
        let mut y = x.clone();
        for _ in 0..n {
            y = if norm {
                g.rmsnorm(&y, &w, d, 1e-6).unwrap()
            } else {
                g.add(&y, &x).unwrap()
            };
        }
    };
    for (name, norm) in [
        ("add over 7168", false),
        ("rmsnorm of 7168 (one workgroup)", true),
    ] {
        let one = t.time(|| chain(1, norm));
        let many = t.time(|| chain(64, norm));
        println!(
            "passes: {name}: one pass alone {:.1} us; 64 chained {:.1} us a pass",
            one * 1e6,
            many / 64.0 * 1e6
        );
    }
    // The AttnRes mix of a decode step: one row, eight bank entries and the current one.
    let bank: Vec<GpuAct> = (0..8).map(|_| x.clone()).collect();
    let refs: Vec<&GpuAct> = bank.iter().collect();
    let mix = t.time(|| {
        g.attn_res_mix(&refs, &x, &w, 1e-6).unwrap();
    });
    println!(
        "passes: attn-res mix of 9 entries x 7168, one row: {:.1} us",
        mix * 1e6
    );
    // The router of a decode step: one row, top 16 of 896, read back (wall clock: the
    // readback ends the span, so this is a call's latency, not its GPU time alone).
    let mut rng = StdRng::seed_from_u64(5);
    let logits: Vec<f32> = (0..896).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let logits = g.upload(&logits, 1, 896).unwrap();
    let bias = vec![0.01; 896];
    let params = RouterParams {
        top_k: 16,
        renormalize: true,
        scaling: 2.5,
    };
    g.router_topk(&logits, &bias, params).unwrap();
    let calls = 50;
    let t0 = Instant::now();
    for _ in 0..calls {
        g.router_topk(&logits, &bias, params).unwrap();
    }
    println!(
        "passes: router top-16 of 896 with its readback: {:.1} us a call (wall clock)",
        t0.elapsed().as_secs_f64() / f64::from(calls) * 1e6
    );
    let mv = t.time(|| {
        g.matmul(&m, &x).unwrap();
    });
    // The norm's weight is uploaded outside the timed span.
    let w_out = g.upload(&vec![1.0; 12288], 1, 12288).unwrap();
    let mv_norm = t.time(|| {
        let y = g.matmul(&m, &x).unwrap();
        g.rmsnorm(&g.add(&y, &y).unwrap(), &w_out, 12288, 1e-6)
            .unwrap();
    });
    println!(
        "passes: int4 matvec 12288x7168 {:.1} us; with an add and an rmsnorm behind it {:.1} us (+{:.1} us)",
        mv * 1e6,
        mv_norm * 1e6,
        (mv_norm - mv) * 1e6
    );
    // One workgroup per head, a lane walking its state column's rows: the same kind.
    kda_lines(g, t, quick);
}

/// The KDA step at 96 heads × 128 × 128 (8 heads when `quick`): one token, a 64-token
/// chunk, and the chunk's tokens as one-token calls.
fn kda_lines(g: &GpuBackend, t: &Timer<'_>, quick: bool) {
    // KDA step: 96 heads x 128 x 128 state.
    let (heads, hd) = (if quick { 8 } else { 96 }, 128);
    let kd = KdaDims {
        heads,
        head_dim: hd,
        conv_k: 4,
        lower_bound: Some(-5.0),
        norm_eps: 1e-6,
    };
    let p = kd.width();
    let up = |n: usize, c: usize| g.upload(&vec![0.1; n * c], n, c).unwrap();
    let kw = KdaStepWeights {
        conv_q: up(1, p * 4),
        conv_k: up(1, p * 4),
        conv_v: up(1, p * 4),
        a_log: up(1, heads),
        dt_bias: up(1, p),
        o_norm: up(1, hd),
    };
    let mut st = g.kda_state(&kd).unwrap();
    // A step's inputs for n tokens (q, k, v, f, beta, gate), and one step over them.
    let inputs =
        |n: usize| -> Vec<GpuAct> { [p, p, p, p, heads, p].iter().map(|&w| up(n, w)).collect() };
    let step = |st: &mut _, i: &[GpuAct]| {
        g.kda_step(&kd, &kw, st, KdaStepInputs::from_slice(i).unwrap())
            .unwrap();
    };
    // One token (decode) and a 64-token chunk (prefill: the tokens run in order inside).
    for n in [1usize, 64] {
        let i = inputs(n);
        // The state is read and written once per token.
        let bytes = (2 * n * heads * hd * hd * 4) as u64;
        let (secs, read) = t.time_vs_read(bytes, &mut || step(&mut st, &i));
        let name = format!("kda step {heads} heads x {hd}x{hd}, {n} token(s)");
        report(t, &name, bytes, secs, read);
    }
    // The chunk's baseline in the same run: its 64 tokens as 64 one-token (fused) calls.
    let one = inputs(1);
    let bytes = (2 * 64 * heads * hd * hd * 4) as u64;
    let (secs, read) = t.time_vs_read(bytes, &mut || {
        for _ in 0..64 {
            step(&mut st, &one);
        }
    });
    let name = format!("kda step {heads} heads x {hd}x{hd}, 64 x 1 token");
    report(t, &name, bytes, secs, read);
}

/// A kernel's line: its bandwidth against the read kernel's (`read` seconds over the same
/// bytes, or the binding limit's worth where they are more).
fn report(t: &Timer<'_>, name: &str, bytes: u64, secs: f64, read: f64) {
    let bw = bytes as f64 / secs / 1e9;
    let rbw = bytes.min(t.g.ctx.max_binding) as f64 / read / 1e9;
    println!(
        "{name:<44} {:>9.1} MB {:>9.1} us {:>8.1} GB/s   read {:>8.1} GB/s   {:>5.1} %",
        bytes as f64 / 1e6,
        secs * 1e6,
        bw,
        rbw,
        100.0 * bw / rbw
    );
}

fn rand_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

fn mxfp4(rng: &mut StdRng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    (
        rand_bytes(rng, rows * cols / 2),
        (0..rows * cols / 32)
            .map(|_| rng.random_range(118u8..126))
            .collect(),
    )
}

fn dense(rng: &mut StdRng, rows: usize, cols: usize, bits: u32) -> DenseMatrix {
    let data = match bits {
        4 => DenseData::Int4 {
            q: rand_bytes(rng, rows * cols / 2),
            scale: vec![0.01; rows * cols.div_ceil(64)],
        },
        _ => DenseData::Int8 {
            q: rand_bytes(rng, rows * cols)
                .into_iter()
                .map(|b| b as i8)
                .collect(),
            scale: vec![0.01; rows],
        },
    };
    DenseMatrix { rows, cols, data }
}

/// What one block of the report runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Every kernel at its default geometry.
    All,
    /// The one-token matvecs only (geometry variants).
    Matvec,
    /// Matmuls over chunks of tokens (prefill), against the one-token time.
    Chunk,
    /// The read kernel over a buffer of its own against the same bytes at the start of the
    /// largest buffer a binding allows: whether a large allocation alone reads slower.
    Read,
    /// Host time to record small dispatches (parameters in a fresh uniform buffer per
    /// dispatch when true, else in the reused slots).
    Host(bool),
    /// What one pass of a small kernel costs on the GPU: chains of element-wise adds and
    /// of single-workgroup RMSNorms, against one pass alone and one behind a large matvec.
    Passes,
    /// Three large matvecs and the read kernel each timed alone and interleaved rep by rep
    /// (as every `% of read` line is): whether one slows the other.
    Order,
    /// The int4 head timed after the GPU idled, then after stretches of back-to-back work:
    /// whether load brings the SM clock back up (lab/device/device_clock_states.sh samples it).
    Clock,
    /// The CUDA probe's MXFP4 matvec written again in WGSL (gpu_kernels/mxfp4_twin.rs).
    Twin,
    /// The int8 and int4 heads timed line after line, in fresh allocations.
    Repeat,
    /// Large matvecs split into their passes by the engine's profiler
    /// (gpu_kernels/pass_times.rs).
    PassTimes,
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let chunk = |from_tokens, tile_tokens, split_k, prefetch| {
        Some(ChunkGemm {
            from_tokens,
            tile_tokens,
            split_k,
            prefetch,
        })
    };
    // The first block takes every kernel's default; the matvec blocks apply one geometry to
    // the dense and the expert matvecs alike; the chunk blocks compare the chunk kernel's
    // tiles, with K split and not, the next step's loads in registers and not, against the
    // matvec per token (the chunk kernel off).
    // The column-stationary kernel: off (every one-token matvec row-split, the baseline),
    // then rows per lane and the workgroups a dispatch aims at.
    let cs = |enabled, rows_per_lane, target_groups| {
        Some(Stationary {
            enabled,
            rows_per_lane,
            target_groups,
            below_groups: u64::MAX,
        })
    };
    // The last block makes every activation a new buffer (wgpu then zero-fills each before
    // its first pass), against the block before it, which reuses them.
    // int4's default row-split decode for large matrices is the integer-digit one; the first
    // row-split block takes the f32 decode everywhere, then the digits at 8 rows per lane,
    // unchecked, and in the column-stationary kernel (forced on). The other formats
    // ignore the int4 decode. Block 16 reads a large buffer against small ones, 17 and 18
    // time the host's recording. 19 is the per-pass cost of small kernels. 20 is block 3
    // with x read from global memory instead of staged in workgroup memory; 21 and 22 the
    // expert geometry on every matvec, x staged and not. 23 and 24 are blocks 2 and 3 with
    // every matrix in row chunks of 64 MiB; 25 times three large matvecs and the read kernel
    // alone and interleaved; 26 times the int4 head after idling and after stretches of
    // back-to-back work (the GPU's clock); 27 is a CUDA probe's MXFP4 matvec written again in
    // WGSL; 28 times the int8 and int4 heads line after line; 29 splits large matvecs into
    // their passes (the engine's profiler); 30 to 32 do the same with every int4 matvec on
    // the digit decode (4 and 2 rows a lane), then on the f32 decode at 2.
    // 32 lanes per row, all in one block, with the given rows per lane, decode and checks.
    let dec = |rows_per_lane, decode: u8, unchecked| {
        let decode = if decode == 3 {
            Int4Decode::Digits
        } else {
            Int4Decode::Float
        };
        shape(32, 32, rows_per_lane, Some(decode), unchecked)
    };
    // A one-token block of geometry `m` on the row-split kernel.
    let split = |m| (Some(m), None, cs(false, 4, 2048), Part::Matvec, true, None);
    // The one-token matvecs with every matrix in row chunks of at most 64 MiB, each its own
    // buffer and dispatch (the int4 head then is 11 of them).
    let capped = |m| {
        (
            m,
            None,
            cs(false, 4, 2048),
            Part::Matvec,
            true,
            Some(64u64 << 20),
        )
    };
    let blocks = [
        (None, None, None, Part::All, true, None),
        (None, None, cs(false, 4, 2048), Part::Matvec, true, None),
        split(dec(4, 1, false)),
        split(dec(8, 3, false)),
        split(dec(4, 3, true)),
        (
            Some(dec(4, 3, false)),
            None,
            cs(true, 4, 512),
            Part::Matvec,
            true,
            None,
        ),
        (None, None, cs(true, 4, 2048), Part::Matvec, true, None),
        (None, None, cs(true, 4, 512), Part::Matvec, true, None),
        (
            None,
            chunk(0, None, true, true),
            None,
            Part::Chunk,
            true,
            None,
        ),
        (
            None,
            chunk(2, None, true, true),
            None,
            Part::Chunk,
            true,
            None,
        ),
        (
            None,
            chunk(2, Some(32), true, true),
            None,
            Part::Chunk,
            true,
            None,
        ),
        split(shape(32, 4, 4, Some(Int4Decode::Float), false)),
        split(shape(8, 4, 4, Some(Int4Decode::Float), true)),
        (None, None, None, Part::Matvec, true, None),
        (None, None, None, Part::Matvec, false, None),
        (None, None, None, Part::Read, true, None),
        (None, None, None, Part::Host(false), true, None),
        (None, None, None, Part::Host(true), true, None),
        (None, None, None, Part::Passes, true, None),
        split(unstaged(dec(4, 1, false))),
        split(MatvecShape::experts()),
        split(unstaged(MatvecShape::experts())),
        capped(None),
        capped(Some(dec(4, 1, false))),
        (None, None, None, Part::Order, true, None),
        (None, None, None, Part::Clock, true, None),
        (None, None, None, Part::Twin, true, None),
        (None, None, None, Part::Repeat, true, None),
        (None, None, None, Part::PassTimes, true, None),
        (
            Some(dec(4, 3, false)),
            None,
            None,
            Part::PassTimes,
            true,
            None,
        ),
        (
            Some(dec(2, 3, false)),
            None,
            None,
            Part::PassTimes,
            true,
            None,
        ),
        (
            Some(dec(2, 1, false)),
            None,
            None,
            Part::PassTimes,
            true,
            None,
        ),
    ];
    // `matvec`: only the one-token matvec blocks; `blocks=2,3`: only those (counted from
    // 1), for a shorter device call.
    let matvec_only = std::env::args().any(|a| a == "matvec");
    let picked: Option<Vec<usize>> = std::env::args()
        .find_map(|a| a.strip_prefix("blocks=").map(str::to_string))
        .map(|l| l.split(',').filter_map(|b| b.trim().parse().ok()).collect());
    // `wgsl=DIR`: every kernel composed from DIR's files (a shader variant, no rebuild).
    let wgsl_dir: Option<std::path::PathBuf> =
        std::env::args().find_map(|a| a.strip_prefix("wgsl=").map(std::path::PathBuf::from));
    let down_rpl: Option<u32> =
        std::env::args().find_map(|a| a.strip_prefix("down_rpl=").and_then(|v| v.parse().ok()));
    // `nochecks=bounds,loop,div`: those of wgpu's runtime checks off in the matvec modules.
    let matvec_checks = std::env::args()
        .find_map(|a| a.strip_prefix("nochecks=").map(str::to_string))
        .map(|l| {
            let off = |name: &str| l.split(',').any(|c| c.trim() == name);
            wgpu::ShaderRuntimeChecks {
                bounds_checks: !off("bounds"),
                force_loop_bounding: !off("loop"),
                int_div_checks: !off("div"),
                ..wgpu::ShaderRuntimeChecks::checked()
            }
        });
    for (b, (shape, chunk_gemm, stationary, part, reuse, max_binding)) in
        blocks.into_iter().enumerate()
    {
        let skipped = picked.as_ref().is_some_and(|p| !p.contains(&(b + 1)));
        if skipped || (matvec_only && part != Part::Matvec) {
            continue;
        }
        let opts = GpuOptions {
            adapter: std::env::var("K3_ADAPTER").ok(),
            allow_cpu_adapter: true,
            matvec: shape,
            expert_matvec: shape,
            // A block's geometry applies to the down projection too; `down_rpl=N` sets the
            // default blocks' down geometry to N rows a lane.
            expert_down_matvec: shape.or(down_rpl.map(|n| MatvecShape {
                rows_per_lane: n,
                ..MatvecShape::expert_down()
            })),
            chunk_gemm,
            stationary,
            no_buffer_reuse: !reuse,
            fresh_params: part == Part::Host(true),
            profile: part == Part::PassTimes,
            max_binding,
            wgsl_dir: wgsl_dir.clone(),
            matvec_checks,
            ..Default::default()
        };
        let g = match GpuBackend::new(&opts) {
            Ok(g) => g,
            Err(e) => {
                println!("no GPU adapter: {e:#}");
                return;
            }
        };
        let (m, e, c, st) = (
            g.ctx.matvec,
            g.ctx.expert_matvec,
            g.ctx.chunk_gemm,
            g.ctx.stationary,
        );
        println!(
            "\n== block {}: buffer reuse {reuse}; matvec geometry: dense {}, experts {}, experts' down projection {}; column-stationary {} ({} rows per lane, {} workgroups aimed at, below {} row-split workgroups); chunk kernel from {} tokens, tile {}, split K {}, prefetch {} ==",
            b + 1,
            describe(m),
            describe(e),
            describe(g.ctx.expert_down_matvec),
            if st.enabled { "on" } else { "off" },
            st.rows_per_lane,
            st.target_groups,
            st.below_groups,
            c.from_tokens,
            c.tile_tokens
                .map_or("by chunk".to_string(), |t| format!("{t} tokens")),
            c.split_k,
            c.prefetch
        );
        run(&g, quick, part);
    }
}

/// Views of one expert's three matrices (`[I, D]` gate and up, `[D, I]` down).
fn views(m: &[(Vec<u8>, Vec<u8>); 3], i: usize, d: usize) -> ExpertWeights<'_> {
    ExpertWeights {
        w1: Mxfp4View::new(i, d, &m[0].0, &m[0].1).unwrap(),
        w2: Mxfp4View::new(d, i, &m[1].0, &m[1].1).unwrap(),
        w3: Mxfp4View::new(i, d, &m[2].0, &m[2].1).unwrap(),
    }
}

/// Experts 0.. of layer 1, each taking tokens 0..`tokens` at weight 0.1; `resident`: passed
/// without host weights (they must sit in the VRAM tier).
fn assignments(
    experts: &[[(Vec<u8>, Vec<u8>); 3]],
    i: usize,
    d: usize,
    tokens: usize,
    resident: bool,
) -> Vec<ExpertAssignment<'_>> {
    experts
        .iter()
        .enumerate()
        .map(|(e, m)| ExpertAssignment {
            key: Some(ExpertKey {
                layer: 1,
                id: e as u32,
            }),
            payload: if resident {
                ExpertPayload::Resident
            } else {
                ExpertPayload::Host(views(m, i, d))
            },
            tokens: (0..tokens).map(|r| (r, 0.1)).collect(),
        })
        .collect()
}

/// A matvec geometry (pipelined): lanes per row, lanes per block, rows per lane (the digit
/// decode's too), int4 decode (None = default), unchecked.
fn shape(
    lanes_per_row: u32,
    lanes_per_block: u32,
    rows_per_lane: u32,
    int4_decode: Option<Int4Decode>,
    unchecked: bool,
) -> MatvecShape {
    MatvecShape {
        lanes_per_row,
        lanes_per_block,
        rows_per_lane,
        int4_decode,
        pipelined: true,
        unchecked,
        stage_x: u32::MAX,
        digit_rows_per_lane: rows_per_lane,
    }
}

/// `m` with x read from global memory in the row-split kernel.
fn unstaged(m: MatvecShape) -> MatvecShape {
    MatvecShape { stage_x: 0, ..m }
}

/// One geometry in words, as the report prints it.
fn describe(m: MatvecShape) -> String {
    format!(
        "{} lanes per row ({} per block), {} rows per lane ({} with int4 digits), int4 decode {}, pipelined {}, unchecked {}, x staged {}",
        m.lanes_per_row,
        m.lanes_per_block,
        m.rows_per_lane,
        m.digit_rows_per_lane,
        m.int4_decode
            .map_or("default".to_string(), |d| format!("{d:?}").to_lowercase()),
        m.pipelined,
        m.unchecked,
        if m.stage_x == 0 {
            "no".to_string()
        } else if m.stage_x == u32::MAX {
            "as it fits".to_string()
        } else {
            format!("{} units a tile", m.stage_x)
        },
    )
}

/// A chunk's line: its time against `one` (the same kernel's one-token time in this block)
/// and the multiply-adds per second it reaches.
fn report_chunk(name: &str, n: usize, secs: f64, one: f64, fmas: f64) {
    println!(
        "{name:<44} {:>9.1} us   {:>6.2}x one token ({:>5.3} per token)   {:>6.2} TFMA/s",
        secs * 1e6,
        secs / one,
        secs / one / n as f64,
        fmas / secs / 1e12
    );
}

fn run(g: &GpuBackend, quick: bool, part: Part) {
    let all = part == Part::All;
    let ctx = &g.ctx;
    println!(
        "adapter: {} ({:?}, {:?}), subgroups {}, workgroup {}, binding limit {} B, timing: {}",
        ctx.info.name,
        ctx.info.backend,
        ctx.info.device_type,
        ctx.subgroups,
        ctx.wg,
        ctx.max_binding,
        if ctx.has_timestamps() {
            "timestamp queries"
        } else {
            "wall clock"
        }
    );
    let heat = std::env::var("K3_BENCH_HEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 0.0 } else { HEAT_SECS });
    let t = Timer::new(g, heat);
    let mut rng = StdRng::seed_from_u64(1);
    let s = |full: usize, small: usize| if quick { small } else { full };
    if let Part::Host(fresh) = part {
        // Wall clock: the loop records (nothing is submitted before the sync), the sync
        // submits and waits for the GPU.
        let m = g
            .load_matrix(
                DenseMatrix::from_f32(64, 64, vec![0.5; 64 * 64], DenseFormat::F32).unwrap(),
            )
            .unwrap();
        let x = g.upload(&[0.25; 64], 1, 64).unwrap();
        for round in 0..3 {
            let n = 2000;
            let t0 = Instant::now();
            let ys: Vec<GpuAct> = (0..n).map(|_| g.matmul(&m, &x).unwrap()).collect();
            let recorded = t0.elapsed().as_secs_f64();
            g.sync().unwrap();
            let total = t0.elapsed().as_secs_f64();
            drop(ys);
            println!(
                "host, params {}: round {round}: {n} dispatches recorded in {:.1} us each; with the GPU's run {:.1} us each",
                if fresh { "in a buffer per dispatch" } else { "in reused slots" },
                recorded / n as f64 * 1e6,
                total / n as f64 * 1e6
            );
        }
        return;
    }
    if part == Part::Passes {
        passes(g, &t, quick);
        return;
    }
    if part == Part::Order {
        clock_probes::order_lines(g, &t, &mut rng, quick);
        return;
    }
    if part == Part::Clock {
        clock_probes::clock_lines(g, &mut rng, quick);
        return;
    }
    if part == Part::Twin {
        mxfp4_twin::twin_lines(g, &t, &mut rng, quick);
        return;
    }
    if part == Part::Repeat {
        clock_probes::repeat_lines(g, &t, &mut rng, quick);
        return;
    }
    if part == Part::PassTimes {
        pass_times::pass_time_lines(g, &t, &mut rng, quick);
        return;
    }
    if part == Part::Read {
        let big_bytes = ctx.max_binding / 16 * 16;
        let big = ctx.buffer(big_bytes, "large read src");
        for mb in [s(12, 1), s(50, 2), s(187, 4), s(660, 8)] {
            let bytes = (mb as u64) << 20;
            let own = t.read(bytes);
            let window = t.read_in(&big, bytes.min(big_bytes));
            println!(
                "read {mb:>4} MiB: own buffer {:>8.1} GB/s; first {mb} MiB of a {} MiB buffer {:>8.1} GB/s ({:.2}x the time)",
                bytes as f64 / own / 1e9,
                big_bytes >> 20,
                bytes as f64 / window / 1e9,
                window / own
            );
        }
        return;
    }
    let (i, d) = (s(3072, 256), s(3584, 384));

    // MXFP4: one expert's w1, then 16 experts x 1 token through the whole batched MoE.
    let (p1, s1) = mxfp4(&mut rng, i, d);
    let w1 = Mxfp4View::new(i, d, &p1, &s1).unwrap();
    // Chunk lines are judged against the first (one-token) time of their kernel.
    let chunked = part == Part::Chunk;
    let mut one = 0.0;
    // Times `f`; a one-token line also times the read kernel over its bytes, the two
    // interleaved rep by rep so both see the GPU in the same state.
    let mut line = |name: &str, n: usize, bytes: u64, fmas: usize, f: &mut dyn FnMut()| {
        if chunked {
            let secs = t.time(f);
            if n == 1 {
                one = secs;
            }
            report_chunk(name, n, secs, one, fmas as f64);
        } else {
            let (secs, read) = t.time_vs_read(bytes, f);
            report(&t, name, bytes, secs, read);
        }
    };
    let ns: &[usize] = match part {
        Part::All => &[1, 8],
        Part::Chunk => &[1, 8, 32, 128],
        // The one-token matvec blocks (the other parts return before this).
        _ => &[1],
    };
    for &n in ns {
        let x = g.upload(&vec![0.5; n * d], n, d).unwrap();
        line(
            &format!("mxfp4 matvec {i}x{d}, {n} token(s)"),
            n,
            (p1.len() + s1.len()) as u64,
            n * i * d,
            &mut || {
                g.matmul_mxfp4(w1, &x).unwrap();
            },
        );
    }
    // The batched kernel alone at the size of 16 experts' gate and up matrices (one
    // dispatch over 16 × 2 × 3072 rows): what the MoE's largest pass costs.
    let (pb, sb) = mxfp4(&mut rng, 32 * i, d);
    let wb = Mxfp4View::new(32 * i, d, &pb, &sb).unwrap();
    let x1 = g.upload(&vec![0.5; d], 1, d).unwrap();
    line(
        &format!("mxfp4 matvec {}x{d} (16 experts' w1|w3), 1 token", 32 * i),
        1,
        (pb.len() + sb.len()) as u64,
        32 * i * d,
        &mut || {
            g.matmul_mxfp4(wb, &x1).unwrap();
        },
    );
    // The down matrix's shape (d × i, rows of i columns): one expert, and 16 stacked.
    let xd = g.upload(&vec![0.5; i], 1, i).unwrap();
    for ne in [1usize, 16] {
        let (pd, sd) = mxfp4(&mut rng, ne * d, i);
        let wd = Mxfp4View::new(ne * d, i, &pd, &sd).unwrap();
        line(
            &format!("mxfp4 matvec {}x{i} ({ne} experts' w2), 1 token", ne * d),
            1,
            (pd.len() + sd.len()) as u64,
            ne * d * i,
            &mut || {
                g.matmul_mxfp4(wd, &xd).unwrap();
            },
        );
    }
    let experts_bytes: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..16)
        .map(|_| {
            [
                mxfp4(&mut rng, i, d),
                mxfp4(&mut rng, d, i),
                mxfp4(&mut rng, i, d),
            ]
        })
        .collect();
    let moe_cases: &[(usize, usize)] = match part {
        Part::All => &[(1, 1), (16, 1), (16, 8)],
        Part::Chunk => &[(16, 1), (16, 8), (16, 32)],
        // The one-token matvec blocks (the other parts return before this).
        _ => &[(1, 1), (16, 1)],
    };
    let glu = Glu::Situ {
        beta: 10.0,
        linear_beta: 10.0,
    };
    for &(ne, tokens) in moe_cases {
        let z = g.upload(&vec![0.25; tokens * d], tokens, d).unwrap();
        let bytes: u64 = experts_bytes[..ne]
            .iter()
            .flatten()
            .map(|(p, s)| (p.len() + s.len()) as u64)
            .sum();
        // Resident in the VRAM tier (the decode case that matters): the first call uploads,
        // the timed ones only compute.
        g.configure_expert_tier(bytes, ne, i, d).unwrap();
        let assign = |resident: bool| assignments(&experts_bytes[..ne], i, d, tokens, resident);
        let mut acc = g.zeros(tokens, d).unwrap();
        g.moe_accumulate(&mut acc, &z, &assign(false), glu).unwrap();
        let resident = assign(true);
        line(
            &format!("moe resident: {ne} experts x {tokens} token(s)"),
            tokens,
            bytes,
            3 * ne * tokens * i * d,
            &mut || {
                g.moe_accumulate(&mut acc, &z, &resident, glu).unwrap();
            },
        );
        if !all {
            continue;
        }
        // Uploaded from host memory on every call (the tier off, so nothing stays resident).
        g.configure_expert_tier(0, 0, i, d).unwrap();
        let transient = assign(false);
        line(
            &format!("moe uploaded: {ne} experts x {tokens} token(s)"),
            tokens,
            bytes,
            3 * ne * tokens * i * d,
            &mut || {
                g.moe_accumulate(&mut acc, &z, &transient, glu).unwrap();
            },
        );
    }

    // Dense int4 / int8 matvecs: a 12288x7168 projection and the 163840x7168 head.
    let mats: &[(usize, usize)] = match part {
        Part::All => &[(12288, 7168), (163840, 7168)],
        Part::Chunk => &[(12288, 7168)],
        // The one-token matvec blocks (the other parts return before this). The head again
        // here: in the first block it runs after the uploads, when the GPU has slowed down
        // (docs/perf.md, "Third pass").
        _ => &[(12288, 7168), (3072, 7168), (1536, 7168), (163840, 7168)],
    };
    for &(rows, cols) in mats {
        let (rows, cols) = (s(rows, rows / 16), s(cols, 512));
        for bits in [4u32, 8] {
            let m = g.load_matrix(dense(&mut rng, rows, cols, bits)).unwrap();
            let ns: &[usize] = match part {
                Part::All => &[1, 32],
                Part::Chunk => &[1, 2, 4, 8, 16, 32, 128, 512],
                // The one-token matvec blocks (the other parts return before this).
                _ => &[1],
            };
            for &n in ns {
                let x = g.upload(&vec![0.5; n * cols], n, cols).unwrap();
                line(
                    &format!(
                        "int{bits} matvec {rows}x{cols}, {n} token(s), {} chunk(s)",
                        m.chunks.len()
                    ),
                    n,
                    m.byte_size(),
                    n * rows * cols,
                    &mut || {
                        g.matmul(&m, &x).unwrap();
                    },
                );
            }
        }
    }

    if !all {
        return;
    }
    kda_lines(g, &t, quick);
    let up = |n: usize, c: usize| g.upload(&vec![0.1; n * c], n, c).unwrap();

    // MLA decode over 4096 cached positions.
    let md = MlaDims {
        heads: s(96, 8),
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        norm_eps: 1e-6,
    };
    let positions = s(4096, 512);
    let mw = MlaAttnWeights {
        kv_norm: up(1, 512),
        wk: up(md.heads * 128, 512),
        wv: up(md.heads * 128, 512),
    };
    let mut cache = g.mla_cache(&md).unwrap();
    let chunk = 256;
    for start in (0..positions - 1).step_by(chunk) {
        let n = chunk.min(positions - 1 - start);
        g.mla_attend(&md, &mw, &mut cache, &up(n, md.heads * 192), &up(n, 576))
            .unwrap();
    }
    g.sync().unwrap();
    let (q1, c1) = (up(1, md.heads * 192), up(1, 576));
    let base_len = cache.len;
    let bytes = (positions * 576 * 4) as u64;
    let (secs, read) = t.time_vs_read(bytes, &mut || {
        cache.len = base_len;
        g.mla_attend(&md, &mw, &mut cache, &q1, &c1).unwrap();
    });
    let name = format!("mla attend {} heads over {positions} positions", md.heads);
    report(&t, &name, bytes, secs, read);
}
