//! Every GPU op against the CPU oracle on random inputs (llama.cpp's test-backend-ops
//! habit), on shapes that are and are not multiples of the workgroup size, through both
//! reduction paths (subgroups and workgroup memory). Without an adapter the tests skip,
//! except under CI=true where they fail.

use crate::support;

use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::experts::vram_budget;
use k3::backend::gpu::kernels::chunk_gemm::ChunkGemm;
use k3::backend::gpu::kernels::stationary::Stationary;
use k3::backend::gpu::{GpuBackend, GpuMat, GpuOptions, Int4Decode, MatvecShape, DIGITS_FROM_ROWS};
use k3::backend::{
    Backend, ExpertAssignment, ExpertPayload, ExpertResidency, FreeDeviceMemory, Glu, KdaDims,
    KdaStepInputs, KdaStepWeights, MlaAttnWeights, MlaDims, RouterParams,
};
use k3::quant::{DenseFormat, DenseMatrix, Mxfp4View};
use k3::routed_expert::{ExpertKey, ExpertWeights};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::rel_l2;

const F32_TOL: f64 = 1e-5;
const MXFP4_TOL: f64 = 1e-6;

/// The GPU backends to test: the subgroup path (when the adapter has it) and the fallback.
/// The backend `opts` asks for, or `None` (a pass) where no adapter exists at all; an
/// adapter that exists but refuses these options fails the test.
fn gpu_with(opts: &GpuOptions) -> Option<GpuBackend> {
    match GpuBackend::new(opts) {
        Ok(g) => Some(g),
        Err(_) => {
            assert!(
                gpus(None).is_empty(),
                "the adapter opens but not with {opts:?}"
            );
            None
        }
    }
}

/// A backend whose chunk kernel serves chunks from 2 tokens on, so the small shapes here
/// reach it (none where no adapter exists).
fn chunked_gpu(max_binding: Option<u64>) -> Option<GpuBackend> {
    gpu_with(&GpuOptions {
        allow_cpu_adapter: true,
        max_binding,
        chunk_gemm: Some(ChunkGemm {
            from_tokens: 2,
            ..ChunkGemm::default()
        }),
        ..Default::default()
    })
}

fn gpus(max_binding: Option<u64>) -> Vec<GpuBackend> {
    let mut out = Vec::new();
    for no_subgroups in [false, true] {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            no_subgroups,
            max_binding,
            poison_reused: true,
            ..Default::default()
        };
        match GpuBackend::new(&opts) {
            Ok(b) => {
                let has = b.ctx.subgroups;
                out.push(b);
                if !has && !no_subgroups {
                    eprintln!("adapter has no subgroups: only the workgroup-memory path is tested");
                    break;
                }
            }
            Err(e) => {
                support::skip_gpu_tests(&e);
                return Vec::new();
            }
        }
    }
    out
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: GPU produced non-finite values"
    );
    let e = rel_l2(got, want);
    assert!(e <= tol, "{what}: rel L2 {e:e} > {tol:e}");
}

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

struct Pair<'a> {
    g: &'a GpuBackend,
    c: CpuBackend,
}

impl Pair<'_> {
    fn up(
        &self,
        v: &[f32],
        r: usize,
        c: usize,
    ) -> (k3::backend::gpu::GpuRows, k3::backend::cpu::CpuAct) {
        (
            self.g.upload(v, r, c).unwrap(),
            self.c.upload(v, r, c).unwrap(),
        )
    }
}

#[test]
fn elementwise_ops_match_cpu() {
    let mut rng = StdRng::seed_from_u64(1);
    for g in gpus(None) {
        let p = Pair {
            g: &g,
            c: CpuBackend::new(),
        };
        for (r, c) in [(1, 1), (3, 257), (17, 1000)] {
            let (ga, ca) = p.up(&rand_vec(&mut rng, r * c, 4.0), r, c);
            let (gb, cb) = p.up(&rand_vec(&mut rng, r * c, 4.0), r, c);
            let add = g.download(&g.add(&ga, &gb).unwrap()).unwrap();
            check("add", &add, &p.c.add(&ca, &cb).unwrap().data, F32_TOL);
            let sg = g.download(&g.sigmoid_gate(&ga, &gb).unwrap()).unwrap();
            check(
                "sigmoid_gate",
                &sg,
                &p.c.sigmoid_gate(&ca, &cb).unwrap().data,
                F32_TOL,
            );
            for glu in [
                Glu::Silu,
                Glu::Situ {
                    beta: 3.0,
                    linear_beta: 2.5,
                },
            ] {
                let got = g.download(&g.glu(&ga, &gb, glu).unwrap()).unwrap();
                check(
                    &format!("{glu:?}"),
                    &got,
                    &p.c.glu(&ca, &cb, glu).unwrap().data,
                    F32_TOL,
                );
            }
            if r > 2 {
                let got = g.download(&g.slice_rows(&ga, 1, r - 2).unwrap()).unwrap();
                assert_eq!(
                    got,
                    p.c.slice_rows(&ca, 1, r - 2).unwrap().data,
                    "slice_rows"
                );
            }
        }
    }
}

#[test]
fn rmsnorm_and_attn_res_mix_match_cpu() {
    let mut rng = StdRng::seed_from_u64(2);
    for g in gpus(None) {
        let p = Pair {
            g: &g,
            c: CpuBackend::new(),
        };
        for (r, c, group) in [
            (1, 32, 32),
            (3, 96, 32),
            (5, 300, 300),
            (2, 1000, 1000),
            (4, 390, 13),
            // K3's width, and one whose last stride is short: several unrolled strides
            // (rmsnorm.wgsl) per lane.
            (1, 7168, 7168),
            (2, 4500, 4500),
        ] {
            let (gx, cx) = p.up(&rand_vec(&mut rng, r * c, 3.0), r, c);
            let (gw, cw) = p.up(&rand_vec(&mut rng, group, 1.0), 1, group);
            let got = g
                .download(&g.rmsnorm(&gx, &gw, group, 1e-6).unwrap())
                .unwrap();
            check(
                "rmsnorm",
                &got,
                &p.c.rmsnorm(&cx, &cw, group, 1e-6).unwrap().data,
                F32_TOL,
            );
        }
        // 63 banked entries and the current one: the most the kernel holds.
        for (r, c, banked) in [
            (1, 64, 0),
            (3, 300, 1),
            (2, 1000, 4),
            (1, 7168, 3),
            (2, 4500, 2),
            (2, 100, 63),
        ] {
            let (gcur, ccur) = p.up(&rand_vec(&mut rng, r * c, 2.0), r, c);
            let (gw, cw) = p.up(&rand_vec(&mut rng, c, 1.0), 1, c);
            let bank: Vec<_> = (0..banked)
                .map(|_| p.up(&rand_vec(&mut rng, r * c, 2.0), r, c))
                .collect();
            let gb: Vec<_> = bank.iter().map(|b| &b.0).collect();
            let cb: Vec<_> = bank.iter().map(|b| &b.1).collect();
            let got = g
                .download(&g.attn_res_mix(&gb, &gcur, &gw, 1e-6).unwrap())
                .unwrap();
            check(
                "attn_res_mix",
                &got,
                &p.c.attn_res_mix(&cb, &ccur, &cw, 1e-6).unwrap().data,
                F32_TOL,
            );
        }
    }
}

fn matmul_case(
    g: &GpuBackend,
    rng: &mut StdRng,
    fmt: DenseFormat,
    n: usize,
    rows: usize,
    cols: usize,
) {
    let w = DenseMatrix::from_f32(rows, cols, rand_vec(rng, rows * cols, 0.5), fmt).unwrap();
    let x = rand_vec(rng, n * cols, 1.0);
    matmul_against_cpu(g, w, &x, n, &format!("matmul {fmt:?} n={n} {rows}x{cols}"));
}

/// `w · x` for the `n` rows of `x` on the GPU and the CPU, held to the f32 tolerance.
fn matmul_against_cpu(g: &GpuBackend, w: DenseMatrix, x: &[f32], n: usize, what: &str) {
    let c = CpuBackend::new();
    let cols = x.len() / n;
    let gm = g.load_matrix(w.clone()).unwrap();
    let got = g
        .download(&g.matmul(&gm, &g.upload(x, n, cols).unwrap()).unwrap())
        .unwrap();
    let want = c.matmul(&w, &c.upload(x, n, cols).unwrap()).unwrap().data;
    check(what, &got, &want, F32_TOL);
}

/// A chunk of tokens goes through the tiled chunk kernel (each weight unit decoded once per
/// tile); its sums are those of the one-token matvec, token by token, in every format and
/// tile width, with last tiles (of rows and of tokens) that are not full and rows whose width
/// is not a whole number of K steps. The two sum in different orders, so they agree to
/// rounding, not bit for bit.
#[test]
fn the_chunk_kernel_gives_the_one_token_sums() {
    let mut rng = StdRng::seed_from_u64(12);
    // K split over segments (the 640-column rows) and not; the next step's loads in
    // registers (where the tile allows) and not.
    for (tile_tokens, split_k, prefetch) in [
        (None, true, true),
        (Some(16), false, false),
        (Some(32), true, true),
        (Some(64), true, false),
    ] {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            chunk_gemm: Some(ChunkGemm {
                from_tokens: 2,
                tile_tokens,
                split_k,
                prefetch,
            }),
            ..Default::default()
        };
        let Some(g) = gpu_with(&opts) else {
            return;
        };
        for fmt in [
            DenseFormat::F32,
            DenseFormat::Bf16,
            DenseFormat::Int8,
            DenseFormat::Int4,
        ] {
            for (rows, cols, n) in [(45, 200, 11), (300, 96, 70), (40, 640, 9)] {
                let w =
                    DenseMatrix::from_f32(rows, cols, rand_vec(&mut rng, rows * cols, 0.5), fmt)
                        .unwrap();
                let gm = g.load_matrix(w).unwrap();
                let x = rand_vec(&mut rng, n * cols, 1.0);
                assert!(
                    g.ctx.gemm_tile(n).is_some(),
                    "{n} tokens should take the chunk kernel"
                );
                let all = g
                    .download(&g.matmul(&gm, &g.upload(&x, n, cols).unwrap()).unwrap())
                    .unwrap();
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let one = g
                        .download(&g.matmul(&gm, &g.upload(xt, 1, cols).unwrap()).unwrap())
                        .unwrap();
                    check(
                        &format!("chunk vs one token, {fmt:?} {rows}x{cols} tile {tile_tokens:?} split {split_k} prefetch {prefetch} token {t}"),
                        &all[t * rows..(t + 1) * rows],
                        &one,
                        1e-6,
                    );
                }
            }
        }
    }
}

#[test]
fn dense_matmul_matches_cpu_in_every_format() {
    let mut rng = StdRng::seed_from_u64(3);
    for g in gpus(None) {
        for fmt in [
            DenseFormat::F32,
            DenseFormat::Bf16,
            DenseFormat::Int8,
            DenseFormat::Int4,
        ] {
            for (n, rows, cols) in [
                (1, 5, 7),
                (1, 64, 128),
                (3, 33, 70),
                (9, 257, 200),
                (20, 9, 64),
            ] {
                matmul_case(&g, &mut rng, fmt, n, rows, cols);
            }
        }
    }
}

/// A decode step of a few streams: int8 and int4 (float decode and digits) matmuls of 2 to 8
/// rows take the few-token kernel (`dense_few`), on both reductions, with rows that leave a
/// partial row group and rows of several x tiles; a matrix of a few row groups does not. Each row's sums are within the f32
/// tolerance of that row alone through the one-token kernel and of the CPU; where
/// the adapter has timestamps, the profile shows the kernel ran, and the switch off keeps
/// to one matvec a row.
#[test]
fn few_token_matmuls_give_each_row_its_one_token_sums() {
    let mut rng = StdRng::seed_from_u64(46);
    let decodes = [None, Some(Int4Decode::Float), Some(Int4Decode::Digits)];
    let mut tried = 0;
    for (few, profile, no_subgroups, decode) in decodes.iter().flat_map(|&d| {
        [
            (true, true, false, d),
            (true, false, true, d),
            (false, true, false, d),
        ]
    }) {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            no_subgroups,
            poison_reused: true,
            profile,
            few_token_dense: Some(few),
            matvec: Some(MatvecShape {
                int4_decode: decode,
                ..MatvecShape::default()
            }),
            // The column-stationary kernel would take some one-row matvecs below; the rows
            // alone are compared with the row-split kernel the few-token one mirrors.
            stationary: Some(Stationary {
                enabled: false,
                ..Stationary::default()
            }),
            ..Default::default()
        };
        let g = match GpuBackend::new(&opts) {
            Ok(g) => g,
            // The profile needs timestamps; without them the subgroup case runs unprofiled.
            Err(_) if profile => match gpu_with(&GpuOptions {
                profile: false,
                ..opts.clone()
            }) {
                Some(g) => g,
                None => return,
            },
            Err(_) => match gpu_with(&opts) {
                Some(g) => g,
                None => return,
            },
        };
        let c = CpuBackend::new();
        for fmt in [DenseFormat::Int8, DenseFormat::Int4] {
            // Rows enough for the kernel's fewest row groups (int8 takes 256 rows a group,
            // int4 64 or 128), the last group partial.
            let rows = if fmt == DenseFormat::Int8 {
                16_500
            } else {
                12_300
            };
            for (n, cols) in [(2, 5100), (3, 1000), (5, 1000), (8, 2000)] {
                let w =
                    DenseMatrix::from_f32(rows, cols, rand_vec(&mut rng, rows * cols, 0.5), fmt)
                        .unwrap();
                let x = rand_vec(&mut rng, n * cols, 1.0);
                let gm = g.load_matrix(w.clone()).unwrap();
                let before = passes_of(&g, "dense_few");
                let got = g
                    .download(&g.matmul(&gm, &g.upload(&x, n, cols).unwrap()).unwrap())
                    .unwrap();
                let ran = passes_of(&g, "dense_few") - before;
                let what = format!("{fmt:?} {decode:?} few={few} n={n} {rows}x{cols}");
                if g.ctx.has_timestamps() && profile {
                    assert_eq!(ran > 0, few, "{what}: dense_few passes {ran}");
                }
                tried += usize::from(ran > 0);
                // Each row as it comes alone through the one-token kernel, to rounding (the
                // two split a row's units over their lanes differently).
                for (t, xt) in x.chunks(cols).enumerate() {
                    let alone = g
                        .download(&g.matmul(&gm, &g.upload(xt, 1, cols).unwrap()).unwrap())
                        .unwrap();
                    check(
                        &format!("{what}: row {t} against the row alone"),
                        &got[t * rows..(t + 1) * rows],
                        &alone,
                        F32_TOL,
                    );
                }
                let want = c.matmul(&w, &c.upload(&x, n, cols).unwrap()).unwrap().data;
                check(&what, &got, &want, F32_TOL);
            }
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        assert!(tried > 0, "no case reached the few-token kernel");
    }
    // 1536 rows are 12 of the kernel's row groups: one matvec a row keeps the GPU fuller.
    if let Some((g, true)) = profiled_gpu() {
        matmul_case(&g, &mut rng, DenseFormat::Int8, 4, 1536, 300);
        assert_eq!(passes_of(&g, "dense_few"), 0, "a 1536-row matrix");
    }
}

#[test]
fn matvec_geometries_other_than_the_default_agree() {
    let mut rng = StdRng::seed_from_u64(10);
    // Every int4 decode, under several geometries (rows per lane up to 8, including counts
    // that leave partial row groups; rows split over 32-lane blocks and not).
    for (i, (lanes_per_row, lanes_per_block, rows_per_lane, int4_decode)) in [
        (8, 4, 3, None),
        (32, 32, 1, Some(Int4Decode::Float)),
        (16, 4, 8, None),
        (32, 32, 4, Some(Int4Decode::Digits)),
        (32, 32, 2, Some(Int4Decode::Float)),
    ]
    .into_iter()
    .enumerate()
    {
        let shape = Some(MatvecShape {
            lanes_per_row,
            lanes_per_block,
            rows_per_lane,
            int4_decode,
            pipelined: i != 1,
            unchecked: i == 1,
            // x staged in tiles of 5 units (lanes' walks cross tiles), and not staged.
            stage_x: [u32::MAX, u32::MAX, 5, u32::MAX, 0][i],
            // The digit decode's rows a lane, apart from the others' (3: a last group short).
            digit_rows_per_lane: [2, 1, 8, 3, 4][i],
        });
        // Chunks of tokens through the matvec too (the chunk kernel off), and with another tile.
        let chunk_gemm = [
            Some(ChunkGemm {
                from_tokens: 0,
                ..ChunkGemm::default()
            }),
            None,
            Some(ChunkGemm {
                from_tokens: 2,
                tile_tokens: Some(32),
                split_k: false,
                prefetch: false,
            }),
            Some(ChunkGemm {
                from_tokens: 0,
                ..ChunkGemm::default()
            }),
            None,
        ][i];
        // The row-split kernel even where the column-stationary one would take these shapes.
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            matvec: shape,
            expert_matvec: shape,
            chunk_gemm,
            stationary: Some(Stationary {
                enabled: false,
                ..Stationary::default()
            }),
            ..Default::default()
        };
        let Some(g) = gpu_with(&opts) else {
            return;
        };
        // Rows of 1000 columns give every lane several int4 units, so the prefetch
        // pipelines turn over.
        for fmt in [DenseFormat::F32, DenseFormat::Int8, DenseFormat::Int4] {
            for (n, rows, cols) in [(1, 37, 96), (5, 70, 200), (2, 19, 1000)] {
                matmul_case(&g, &mut rng, fmt, n, rows, cols);
            }
        }
        // Some blocks take the per-element path for huge scales in every decode variant.
        mxfp4_case(&g, &mut rng, 3, 45, 128, true);
        // Rows of 34 units (blocks of int4 digits' layout, whole and short), and the MoE's
        // gate/up and down passes (the column-stationary kernel is off here).
        mxfp4_case(&g, &mut rng, 2, 40, 1088, false);
        moe_case(&g, &mut rng, 3, 1088, 96, 3);
    }
}

/// The column-stationary kernel on every dispatch it applies to: rows per lane 1, 3 and 8,
/// blocks of the fewest and the most rows, on the subgroup path and the fallback; rows of
/// 1 to 256 units (one span of the workgroup, or several), counts that leave partial blocks.
#[test]
fn column_stationary_matvec_matches_cpu() {
    let mut rng = StdRng::seed_from_u64(12);
    for (rows_per_lane, target_groups) in [(1, 1_000_000), (3, 7), (8, 1)] {
        for no_subgroups in [false, true] {
            let opts = GpuOptions {
                allow_cpu_adapter: true,
                no_subgroups,
                stationary: Some(Stationary {
                    enabled: true,
                    rows_per_lane,
                    target_groups,
                    below_groups: u64::MAX,
                }),
                ..Default::default()
            };
            let Some(g) = gpu_with(&opts) else {
                return;
            };
            for fmt in [DenseFormat::F32, DenseFormat::Int8, DenseFormat::Int4] {
                for (n, rows, cols) in [(1, 37, 96), (2, 70, 8192), (1, 301, 40)] {
                    matmul_case(&g, &mut rng, fmt, n, rows, cols);
                }
            }
            for (n, rows, cols) in [(1, 45, 128), (2, 97, 3584), (1, 5, 32)] {
                mxfp4_case(&g, &mut rng, n, rows, cols, true);
            }
            moe_case(&g, &mut rng, 3, 96, 64, 3);
        }
    }
}

/// Submitting after every pass, and profiling (timestamps around every pass, each
/// submission waited for), change when work runs, not what it computes; the profile names
/// the kernels that ran. An adapter without timestamp queries refuses the profile by name.
#[test]
fn early_submits_and_the_profiler_keep_the_sums() {
    let mut rng = StdRng::seed_from_u64(13);
    for (submit_every, profile) in [(Some(1), false), (None, true)] {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            submit_every,
            profile,
            ..Default::default()
        };
        let g = match GpuBackend::new(&opts) {
            Ok(g) => g,
            Err(e) => {
                if gpus(None).is_empty() {
                    return;
                }
                let msg = format!("{e:#}");
                assert!(profile && msg.contains("--gpu-profile"), "{msg}");
                continue;
            }
        };
        for fmt in [DenseFormat::F32, DenseFormat::Int4] {
            matmul_case(&g, &mut rng, fmt, 1, 37, 96);
            matmul_case(&g, &mut rng, fmt, 3, 70, 300);
        }
        moe_case(&g, &mut rng, 2, 64, 32, 2);
        let busy = g.busy_seconds();
        assert_eq!(busy.is_some(), profile);
        assert!(busy.is_none_or(|s| s > 0.0), "{busy:?}");
        let report = g.ctx.profile_report();
        assert_eq!(report.is_some(), profile);
        if let Some(r) = report {
            assert!(r.contains("dense") && r.contains("scatter"), "{r}");
        }
        // A take hands over the tables so far and starts them again: the next take holds
        // only what ran in between.
        let taken = g.take_profile();
        assert_eq!(taken.is_some(), profile);
        assert!(
            taken.as_ref().is_none_or(|r| r.contains("dense")),
            "{taken:?}"
        );
        moe_case(&g, &mut rng, 2, 64, 32, 2);
        if let Some(r) = g.take_profile() {
            assert!(r.contains("moe") && !r.contains("dense "), "{r}");
        }
    }
}

/// By default int4 takes the integer digits from `DIGITS_FROM_ROWS` rows on and the f32
/// decode below (the profile shows whether the digit pass ran); both sides match the CPU.
#[test]
fn int4_takes_digits_from_the_row_threshold() {
    let mut rng = StdRng::seed_from_u64(23);
    for (rows, digits) in [(DIGITS_FROM_ROWS + 5, true), (DIGITS_FROM_ROWS - 40, false)] {
        let Some((g, profiled)) = profiled_gpu() else {
            return;
        };
        matmul_case(&g, &mut rng, DenseFormat::Int4, 1, rows, 64);
        if let Some(report) = g.ctx.profile_report().filter(|_| profiled) {
            assert_eq!(report.contains("x_planes"), digits, "{rows} rows: {report}");
        }
    }
}

/// A profiling backend and `true`, or where the adapter has no timestamp queries a plain
/// one and `false` (its tests still check the sums).
fn profiled_gpu() -> Option<(GpuBackend, bool)> {
    match GpuBackend::new(&GpuOptions {
        allow_cpu_adapter: true,
        profile: true,
        ..Default::default()
    }) {
        Ok(g) => Some((g, true)),
        Err(_) => gpu_with(&GpuOptions {
            allow_cpu_adapter: true,
            ..Default::default()
        })
        .map(|g| (g, false)),
    }
}

/// Passes of kernel `entry` the profiler has seen (0 without a profile).
fn passes_of(g: &GpuBackend, entry: &str) -> u64 {
    g.ctx
        .profile_by_entry()
        .and_then(|p| p.get(entry).map(|e| e.0))
        .unwrap_or(0)
}

/// `ws` (loaded as `gms`) through one `matmul_many` call on `x`, each result held to the
/// CPU's sums.
fn matmul_many_against_cpu(g: &GpuBackend, ws: &[DenseMatrix], gms: &[GpuMat], x: &[f32]) {
    let c = CpuBackend::new();
    let cols = x.len();
    let refs: Vec<_> = gms.iter().collect();
    let ys = g
        .matmul_many(&refs, &g.upload(x, 1, cols).unwrap())
        .unwrap();
    assert_eq!(ys.len(), ws.len());
    for (i, (y, w)) in ys.iter().zip(ws).enumerate() {
        let want = c.matmul(w, &c.upload(x, 1, cols).unwrap()).unwrap().data;
        check(
            &format!("matmul_many {i} {:?}", w.format()),
            &g.download(y).unwrap(),
            &want,
            F32_TOL,
        );
    }
}

/// `(rows, format)` matrices of `cols` random columns, and their GPU copies.
fn matrices(
    g: &GpuBackend,
    rng: &mut StdRng,
    cols: usize,
    shapes: &[(usize, DenseFormat)],
) -> (Vec<DenseMatrix>, Vec<GpuMat>) {
    let ws: Vec<DenseMatrix> = shapes
        .iter()
        .map(|&(r, f)| DenseMatrix::from_f32(r, cols, rand_vec(rng, r * cols, 0.5), f).unwrap())
        .collect();
    let gms = ws
        .iter()
        .map(|w| g.load_matrix(w.clone()).unwrap())
        .collect();
    (ws, gms)
}

/// int4 matrices of one input share one digit pass: three of a third of `DIGITS_FROM_ROWS`
/// rows each (one alone stays on the f32 decode) take the digits together, with one
/// `x_planes` pass, beside an int8 matrix; every result matches the CPU's.
#[test]
fn int4_matrices_of_one_input_share_one_digit_pass() {
    let Some((g, profiled)) = profiled_gpu() else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(24);
    let cols = 96;
    let rows = DIGITS_FROM_ROWS / 3 + 1;
    let shapes = [
        (rows, DenseFormat::Int4),
        (rows, DenseFormat::Int8),
        (rows, DenseFormat::Int4),
        (rows, DenseFormat::Int4),
    ];
    let (ws, gms) = matrices(&g, &mut rng, cols, &shapes);
    let x = rand_vec(&mut rng, cols, 1.0);
    // Apart, no matrix reaches the threshold.
    g.matmul(&gms[0], &g.upload(&x, 1, cols).unwrap()).unwrap();
    let before = passes_of(&g, "x_planes");
    matmul_many_against_cpu(&g, &ws, &gms, &x);
    let after = passes_of(&g, "x_planes");
    if profiled {
        assert_eq!(
            (before, after),
            (0, 1),
            "x_planes passes apart, then together"
        );
    }
}

/// Matrices of one input whose width is not a whole number of units pad x once between
/// them, and each result still matches the CPU's.
#[test]
fn matrices_of_one_input_pad_it_once() {
    let Some((g, profiled)) = profiled_gpu() else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(25);
    let cols = 33;
    let shapes = [40, 7, 19].map(|r| (r, DenseFormat::Bf16));
    let (ws, gms) = matrices(&g, &mut rng, cols, &shapes);
    let x = rand_vec(&mut rng, cols, 1.0);
    matmul_many_against_cpu(&g, &ws, &gms, &x);
    if profiled {
        let pads = passes_of(&g, "pad");
        assert_eq!(pads, 1, "pad passes for three matrices of one x");
    }
}

/// Every dispatch's parameters reach its own kernel: 300 matvecs over three shapes recorded
/// before any readback (more slots than one uniform buffer holds; with early submits, many
/// submissions reusing the buffers), each held to the CPU's sums.
#[test]
fn parameter_slots_follow_their_dispatch_across_submissions() {
    let mut rng = StdRng::seed_from_u64(22);
    let c = CpuBackend::new();
    let shapes = [(37, 96), (70, 64), (5, 33)];
    let mats: Vec<DenseMatrix> = shapes
        .iter()
        .map(|&(r, k)| {
            DenseMatrix::from_f32(r, k, rand_vec(&mut rng, r * k, 0.5), DenseFormat::Int4).unwrap()
        })
        .collect();
    let xs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(_, k)| rand_vec(&mut rng, k, 1.0))
        .collect();
    let want: Vec<Vec<f32>> = mats
        .iter()
        .zip(&xs)
        .map(|(m, x)| c.matmul(m, &c.upload(x, 1, x.len()).unwrap()).unwrap().data)
        .collect();
    for submit_every in [None, Some(7)] {
        let Some(g) = gpu_with(&GpuOptions {
            allow_cpu_adapter: true,
            submit_every,
            ..Default::default()
        }) else {
            return;
        };
        let gm: Vec<_> = mats
            .iter()
            .map(|m| g.load_matrix(m.clone()).unwrap())
            .collect();
        let gx: Vec<_> = xs
            .iter()
            .map(|x| g.upload(x, 1, x.len()).unwrap())
            .collect();
        let ys: Vec<_> = (0..300)
            .map(|i| g.matmul(&gm[i % 3], &gx[i % 3]).unwrap())
            .collect();
        for (i, y) in ys.iter().enumerate() {
            let what = format!("matvec {i} (submit every {submit_every:?})");
            check(&what, &g.download(y).unwrap(), &want[i % 3], F32_TOL);
        }
    }
}

/// Two threads recording into one backend at once, with early submits: each dispatch's
/// parameter slot is taken with its pass under one lock, so every result is its own.
#[test]
fn parameter_slots_hold_with_two_threads_recording() {
    let mut rng = StdRng::seed_from_u64(24);
    let Some(g) = gpu_with(&GpuOptions {
        allow_cpu_adapter: true,
        submit_every: Some(5),
        ..Default::default()
    }) else {
        return;
    };
    let c = CpuBackend::new();
    let cases: Vec<(DenseMatrix, Vec<f32>)> = [(40, 64), (9, 160)]
        .iter()
        .map(|&(r, k)| {
            let w = DenseMatrix::from_f32(r, k, rand_vec(&mut rng, r * k, 0.5), DenseFormat::F32)
                .unwrap();
            (w, rand_vec(&mut rng, k, 1.0))
        })
        .collect();
    std::thread::scope(|s| {
        for (w, x) in &cases {
            let (g, c) = (&g, &c);
            s.spawn(move || {
                let want = c.matmul(w, &c.upload(x, 1, x.len()).unwrap()).unwrap().data;
                let gm = g.load_matrix(w.clone()).unwrap();
                let gx = g.upload(x, 1, x.len()).unwrap();
                let ys: Vec<_> = (0..150).map(|_| g.matmul(&gm, &gx).unwrap()).collect();
                for (i, y) in ys.iter().enumerate() {
                    let what = format!("{}x{} matvec {i}", w.rows, w.cols);
                    check(&what, &g.download(y).unwrap(), &want, F32_TOL);
                }
            });
        }
    });
}

/// A dropped activation's buffer goes back to the pool and the next activation of its size
/// takes it (filled with NaN here, so a kernel that left part of it unwritten would show);
/// the sums are those the first matmul wrote into a new buffer.
#[test]
fn activation_buffers_are_reused_and_the_sums_stay() {
    let mut rng = StdRng::seed_from_u64(14);
    let w =
        DenseMatrix::from_f32(70, 96, rand_vec(&mut rng, 70 * 96, 0.5), DenseFormat::Int4).unwrap();
    let x = rand_vec(&mut rng, 2 * 96, 1.0);
    let opts = GpuOptions {
        allow_cpu_adapter: true,
        poison_reused: true,
        ..Default::default()
    };
    let Some(g) = gpu_with(&opts) else {
        return;
    };
    let m = g.load_matrix(w.clone()).unwrap();
    let xa = g.upload(&x, 2, 96).unwrap();
    let first = g.matmul(&m, &xa).unwrap();
    let want = g.download(&first).unwrap();
    let copy = first.clone();
    drop(first);
    assert_eq!(g.pooled_bytes(), 0, "a clone still holds the buffer");
    drop(copy);
    assert!(
        g.pooled_bytes() > 0,
        "the dropped activation's buffer is pooled"
    );
    let again = g.download(&g.matmul(&m, &xa).unwrap()).unwrap();
    assert_eq!(again, want);
}

/// A call the device refuses (here a buffer past the adapter's size limit, as an
/// out-of-memory would be) no longer panics inside wgpu: the next wait returns an error that
/// names it and says what to do.
#[test]
fn a_device_error_is_returned_not_panicked() {
    for g in gpus(None).into_iter().take(1) {
        let too_big = g.ctx.limits.max_buffer_size.saturating_add(1 << 20);
        let _b = g.ctx.buffer(too_big, "oversized test buffer");
        let err = format!("{:#}", g.ctx.finish().unwrap_err());
        assert!(
            err.contains("reported an error") && err.contains("--backend cpu"),
            "{err}"
        );
        let x = g.upload(&[1.0; 4], 1, 4).unwrap();
        assert!(g.download(&x).is_err());
    }
}

/// The mix runs one workgroup row per input row and holds at most 64 entries: more rows
/// than the adapter's grid allows, or more entries, is an error that says so, not a panic
/// inside wgpu.
#[test]
fn attn_res_mix_refuses_what_its_kernel_cannot_hold() {
    for g in gpus(None).into_iter().take(1) {
        let rows = g.ctx.limits.max_compute_workgroups_per_dimension as usize + 1;
        let cur = g.upload(&vec![1.0; rows], rows, 1).unwrap();
        let w = g.upload(&[1.0], 1, 1).unwrap();
        let err = format!("{:#}", g.attn_res_mix(&[], &cur, &w, 1e-6).unwrap_err());
        assert!(
            err.contains("rows in one call") && err.contains("K3_CHUNK"),
            "{err}"
        );
        let cur = g.upload(&[1.0; 4], 1, 4).unwrap();
        let w = g.upload(&[1.0; 4], 1, 4).unwrap();
        let bank = vec![&cur; 64];
        let err = format!("{:#}", g.attn_res_mix(&bank, &cur, &w, 1e-6).unwrap_err());
        assert!(
            err.contains("65 entries") && err.contains("at most 64"),
            "{err}"
        );
        g.ctx.finish().unwrap();
    }
}

#[test]
fn dense_matmul_splits_rows_below_the_binding_limit() {
    let mut rng = StdRng::seed_from_u64(4);
    // A 4 KiB binding cap forces many row chunks even on these small matrices.
    for g in gpus(Some(4096)) {
        for fmt in [DenseFormat::F32, DenseFormat::Int4, DenseFormat::Int8] {
            let m = g
                .load_matrix(DenseMatrix::from_f32(300, 160, vec![0.5; 300 * 160], fmt).unwrap())
                .unwrap();
            assert!(
                m.chunks.len() > 1,
                "{fmt:?}: expected a split, got one chunk"
            );
            matmul_case(&g, &mut rng, fmt, 3, 300, 160);
        }
    }
    // The chunk kernel over row chunks, K split (640 columns) and not.
    if let Some(g) = chunked_gpu(Some(4096)) {
        for fmt in [DenseFormat::F32, DenseFormat::Int4, DenseFormat::Int8] {
            for cols in [160, 640] {
                let m = g
                    .load_matrix(
                        DenseMatrix::from_f32(90, cols, vec![0.5; 90 * cols], fmt).unwrap(),
                    )
                    .unwrap();
                assert!(m.chunks.len() > 1, "{fmt:?} {cols}: expected a split");
                matmul_case(&g, &mut rng, fmt, 20, 90, cols);
            }
        }
    }
}

/// Random MXFP4 bytes with scales around 2^0 (and the zero scale).
fn rand_mxfp4(rng: &mut StdRng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let packed = (0..rows * cols / 2).map(|_| rng.random::<u8>()).collect();
    let scales = (0..rows * cols / 32)
        .map(|i| {
            if i % 17 == 5 {
                0
            } else {
                rng.random_range(120u8..134)
            }
        })
        .collect();
    (packed, scales)
}

/// The GPU's MXFP4 matmul of a random `rows × cols` matrix against `n` random tokens, checked
/// against the CPU's dequantized matmul; with `huge`, every 7th block from the 4th takes the
/// per-element path for huge scales.
fn mxfp4_case(g: &GpuBackend, rng: &mut StdRng, n: usize, rows: usize, cols: usize, huge: bool) {
    let (packed, mut scales) = rand_mxfp4(rng, rows, cols);
    if huge {
        for s in scales.iter_mut().skip(3).step_by(7) {
            *s = 245;
        }
    }
    let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
    let x = rand_vec(rng, n * cols, 1.0);
    let got = g
        .download(
            &g.matmul_mxfp4(view, &g.upload(&x, n, cols).unwrap())
                .unwrap(),
        )
        .unwrap();
    let c = CpuBackend::new();
    let deq = DenseMatrix::from_f32(rows, cols, view.dequantize(), DenseFormat::F32).unwrap();
    let want = c
        .matmul(&deq, &c.upload(&x, n, cols).unwrap())
        .unwrap()
        .data;
    check(
        &format!("mxfp4 n={n} {rows}x{cols} huge {huge}"),
        &got,
        &want,
        MXFP4_TOL,
    );
}

#[test]
fn mxfp4_matvec_matches_cpu_dequantized() {
    let mut rng = StdRng::seed_from_u64(5);
    for g in gpus(None).into_iter().chain(chunked_gpu(None)) {
        // Two are large enough (rows × tokens ≥ 32768) for the expert geometry; the others
        // take the dense one, and on the chunked backend those of several tokens the chunk
        // kernel (split over K for the 640-column rows).
        for (n, rows, cols) in [
            (1, 64, 96),
            (5, 33, 256),
            (12, 100, 64),
            (1, 33000, 64),
            (3, 11000, 96),
            (12, 100, 640),
        ] {
            mxfp4_case(&g, &mut rng, n, rows, cols, false);
        }
    }
}

#[test]
fn mxfp4_special_scales_decode_as_on_the_cpu() {
    let (rows, cols) = (4, 64);
    let mut packed = vec![0x21u8; rows * cols / 2];
    packed[0] = 0x00;
    // Row 0: scale 255 (+inf) on a block with a zero nibble -> NaN; row 1: scale 0 -> 0.
    let mut scales = vec![127u8; rows * cols / 32];
    scales[0] = 255;
    scales[2] = 0;
    scales[3] = 0;
    let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
    let x = vec![1.0f32; cols];
    let c = CpuBackend::new();
    let deq = DenseMatrix::from_f32(rows, cols, view.dequantize(), DenseFormat::F32).unwrap();
    let want = c
        .matmul(&deq, &c.upload(&x, 1, cols).unwrap())
        .unwrap()
        .data;
    for g in gpus(None) {
        let got = g
            .download(
                &g.matmul_mxfp4(view, &g.upload(&x, 1, cols).unwrap())
                    .unwrap(),
            )
            .unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a == b || (a.is_nan() && b.is_nan()),
                "row {i}: GPU {a} vs CPU {b}"
            );
        }
    }
}

#[test]
fn router_matches_cpu_including_ties() {
    let mut rng = StdRng::seed_from_u64(6);
    let c = CpuBackend::new();
    for g in gpus(None) {
        // K3's 896 experts take the kernel's cached scores; 1100 are past its cache.
        for (rows, experts, k, renormalize) in [
            (1, 8, 2, true),
            (5, 40, 6, true),
            (3, 300, 8, false),
            (2, 896, 16, true),
            (1, 1100, 8, true),
        ] {
            let logits = rand_vec(&mut rng, rows * experts, 3.0);
            let bias = rand_vec(&mut rng, experts, 0.1);
            let params = RouterParams {
                top_k: k,
                renormalize,
                scaling: 2.5,
            };
            let got = g
                .router_topk(&g.upload(&logits, rows, experts).unwrap(), &bias, params)
                .unwrap();
            let want = c
                .router_topk(&c.upload(&logits, rows, experts).unwrap(), &bias, params)
                .unwrap();
            for (gr, cr) in got.iter().zip(&want) {
                let gi: Vec<u32> = gr.iter().map(|r| r.0).collect();
                let ci: Vec<u32> = cr.iter().map(|r| r.0).collect();
                assert_eq!(gi, ci, "router ids");
                let gw: Vec<f32> = gr.iter().map(|r| r.1).collect();
                let cw: Vec<f32> = cr.iter().map(|r| r.1).collect();
                check("router weights", &gw, &cw, F32_TOL);
            }
        }
        // All scores equal: ties go to the lower ids.
        let got = g
            .router_topk(
                &g.upload(&[0.5; 12], 1, 12).unwrap(),
                &[0.0; 12],
                RouterParams {
                    top_k: 3,
                    renormalize: true,
                    scaling: 1.0,
                },
            )
            .unwrap();
        assert_eq!(
            got[0].iter().map(|r| r.0).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }
}

fn moe_case(g: &GpuBackend, rng: &mut StdRng, rows: usize, d: usize, i: usize, n_experts: usize) {
    let routes: Vec<Vec<usize>> = (0..n_experts)
        .map(|e| (0..rows).filter(|t| (t + e) % 3 != 1).collect())
        .collect();
    moe_routes_case(g, rng, rows, (d, i), &routes, false);
}

/// The experts of `routes` (expert e takes rows `routes[e]`) over `rows` rows of width `d`,
/// `i` wide inside, through the GPU's and the CPU's `moe_accumulate`, held to each other;
/// with `huge`, every 7th scale block of each down projection from the 4th is huge (the
/// kernels' per-element path).
fn moe_routes_case(
    g: &GpuBackend,
    rng: &mut StdRng,
    rows: usize,
    (d, i): (usize, usize),
    routes: &[Vec<usize>],
    huge: bool,
) {
    let c = CpuBackend::new();
    let n_experts = routes.len();
    let mut mats: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..n_experts)
        .map(|_| {
            [
                rand_mxfp4(rng, i, d),
                rand_mxfp4(rng, d, i),
                rand_mxfp4(rng, i, d),
            ]
        })
        .collect();
    if huge {
        for m in &mut mats {
            for s in m[1].1.iter_mut().skip(3).step_by(7) {
                *s = 241;
            }
        }
    }
    let experts: Vec<ExpertAssignment<'_>> = mats
        .iter()
        .zip(routes)
        .map(|(m, route)| {
            let tokens: Vec<(usize, f32)> = route
                .iter()
                .map(|&t| (t, rng.random_range(0.05f32..0.5)))
                .collect();
            ExpertAssignment {
                key: None,
                payload: ExpertPayload::Host(ExpertWeights {
                    w1: Mxfp4View::new(i, d, &m[0].0, &m[0].1).unwrap(),
                    w2: Mxfp4View::new(d, i, &m[1].0, &m[1].1).unwrap(),
                    w3: Mxfp4View::new(i, d, &m[2].0, &m[2].1).unwrap(),
                }),
                tokens,
            }
        })
        .collect();
    let z = rand_vec(rng, rows * d, 0.5);
    let glu = Glu::Situ {
        beta: 4.0,
        linear_beta: 3.0,
    };
    // Start from a non-zero accumulator and feed the experts in two calls, as the model does.
    let acc0 = rand_vec(rng, rows * d, 0.5);
    let (first, rest) = experts.split_at(experts.len() / 2);
    let gz = g.upload(&z, rows, d).unwrap();
    let mut gacc = g.upload(&acc0, rows, d).unwrap();
    g.moe_accumulate(&mut gacc, &gz, first, glu).unwrap();
    g.moe_accumulate(&mut gacc, &gz, rest, glu).unwrap();
    let got = g.download(&gacc).unwrap();
    let cz = c.upload(&z, rows, d).unwrap();
    let mut cacc = c.upload(&acc0, rows, d).unwrap();
    c.moe_accumulate(&mut cacc, &cz, first, glu).unwrap();
    c.moe_accumulate(&mut cacc, &cz, rest, glu).unwrap();
    let want = cacc.data;
    check(
        &format!("moe rows={rows} d={d} i={i} experts={n_experts} huge {huge}"),
        &got,
        &want,
        F32_TOL,
    );
}

/// A decode step of several streams: experts taken by one row and experts shared by two to
/// eight (the few-token kernel's items of up to four rows, a fifth row in an item of its
/// own), in the dense and the expert geometry, with and without huge scales, each row held
/// to the CPU's sums, with the few-token kernel on (`GpuOptions::few_token_experts`) and
/// both reductions; where the adapter has timestamps, the profile shows that kernel ran.
#[test]
fn experts_shared_by_a_few_streams_match_cpu() {
    let mut rng = StdRng::seed_from_u64(44);
    let four = vec![
        vec![0],
        vec![0, 1, 2, 3],
        vec![1, 3],
        vec![2],
        vec![0, 2, 3],
    ];
    let eight = vec![
        (0..8).collect(),
        vec![5],
        vec![1, 2, 3, 4, 6],
        vec![0, 7],
        vec![3],
        vec![1, 2, 4],
    ];
    let on = |profile: bool| {
        GpuBackend::new(&GpuOptions {
            allow_cpu_adapter: true,
            few_token_experts: true,
            poison_reused: true,
            profile,
            ..Default::default()
        })
    };
    if gpus(None).is_empty() {
        return;
    }
    // With timestamps where the adapter has them, else a plain backend.
    let (pg, profiled) = match on(true) {
        Ok(g) => (g, true),
        Err(_) => (
            on(false).expect("the adapter opens with the few-token kernel"),
            false,
        ),
    };
    let plain = gpu_with(&GpuOptions {
        allow_cpu_adapter: true,
        few_token_experts: true,
        no_subgroups: true,
        poison_reused: true,
        ..Default::default()
    });
    for g in plain.iter().chain([&pg]) {
        for huge in [false, true] {
            moe_routes_case(g, &mut rng, 4, (96, 64), &four, huge);
            moe_routes_case(g, &mut rng, 8, (64, 96), &eight, huge);
        }
        // 16 items of 2048 gate|up rows: the expert geometry (32768 rows and more).
        let all: Vec<Vec<usize>> = vec![(0..8).collect(); 8];
        moe_routes_case(g, &mut rng, 8, (256, 1024), &all, false);
    }
    if profiled {
        assert!(
            passes_of(&pg, "moe_t4") > 0,
            "the few-token expert kernel (moe_t4) never ran"
        );
    }
}

#[test]
fn batched_moe_matches_cpu() {
    let mut rng = StdRng::seed_from_u64(7);
    for g in gpus(None).into_iter().chain(chunked_gpu(None)) {
        moe_case(&g, &mut rng, 1, 64, 32, 1);
        moe_case(&g, &mut rng, 5, 96, 64, 3);
        moe_case(&g, &mut rng, 11, 64, 96, 4);
        // Long enough rows (16 K steps) for the chunk kernel to split gate|up's K.
        moe_case(&g, &mut rng, 6, 512, 64, 3);
        // Experts of a few MB: their uploads are copied in pieces over several threads.
        moe_case(&g, &mut rng, 2, 2048, 2048, 2);
        // The second call's 21 (expert, token) pairs of 2048 gate|up rows and 2304 down rows:
        // both passes take the expert geometry (32768 rows and more), the down one its own.
        moe_case(&g, &mut rng, 16, 2304, 1024, 3);
    }
    // A small binding cap splits the experts into several batches.
    for g in gpus(Some(8192)).into_iter().chain(chunked_gpu(Some(8192))) {
        moe_case(&g, &mut rng, 4, 64, 64, 5);
        // A prefill window's (token, expert) pairs past what one call's pair buffers hold
        // (16 of 2·64 values in 8 KiB) go in several calls, in list order.
        moe_case(&g, &mut rng, 24, 64, 64, 5);
    }
}

/// Experts kept in the VRAM tier (some resident, passed without host weights; some
/// uploaded into slots; some transient when every slot is pinned or busy) give the CPU's sums.
#[test]
fn moe_through_the_expert_tier_matches_cpu() {
    let mut rng = StdRng::seed_from_u64(9);
    let c = CpuBackend::new();
    let (rows, d, i, n) = (6, 64, 64, 5);
    let mut mats: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..n)
        .map(|_| {
            [
                rand_mxfp4(&mut rng, i, d),
                rand_mxfp4(&mut rng, d, i),
                rand_mxfp4(&mut rng, i, d),
            ]
        })
        .collect();
    // Expert 1's down matrix has huge scales (the per-element path) and lands in a slot:
    // its pool's dispatches must keep that path when it is resident, the other pool's may
    // drop it. Its gate and up scales are tiny (2^-50), so its output stays finite and of
    // the others' order.
    for m in [0, 2] {
        for s in mats[1][m].1.iter_mut().filter(|s| **s != 0) {
            *s = 77;
        }
    }
    for s in mats[1][1].1.iter_mut().skip(3).step_by(7) {
        *s = 241;
    }
    let tokens: Vec<Vec<(usize, f32)>> = (0..n)
        .map(|e| {
            (0..rows)
                .filter(|t| (t + e) % 3 != 1)
                .map(|t| (t, rng.random_range(0.05f32..0.5)))
                .collect()
        })
        .collect();
    let assign = |e: usize, host: bool| ExpertAssignment {
        key: Some(ExpertKey {
            layer: 2,
            id: e as u32,
        }),
        payload: if host {
            ExpertPayload::Host(ExpertWeights {
                w1: Mxfp4View::new(i, d, &mats[e][0].0, &mats[e][0].1).unwrap(),
                w2: Mxfp4View::new(d, i, &mats[e][1].0, &mats[e][1].1).unwrap(),
                w3: Mxfp4View::new(i, d, &mats[e][2].0, &mats[e][2].1).unwrap(),
            })
        } else {
            ExpertPayload::Resident
        },
        tokens: tokens[e].clone(),
    };
    let all: Vec<ExpertAssignment<'_>> = (0..n).map(|e| assign(e, true)).collect();
    let z = rand_vec(&mut rng, rows * d, 0.5);
    let glu = Glu::Silu;
    let cz = c.upload(&z, rows, d).unwrap();
    let mut cacc = c.zeros(rows, d).unwrap();
    c.moe_accumulate(&mut cacc, &cz, &all, glu).unwrap();
    c.moe_accumulate(&mut cacc, &cz, &all, glu).unwrap();
    let expert_bytes = (3 * (i * d / 2 + i * d / 32)) as u64;
    // A binding cap of two experts' gate+up puts the 3 slots in two device pools.
    let cap = Some((2 * i * d) as u64);
    for g in gpus(cap).into_iter().chain(chunked_gpu(cap)) {
        assert_eq!(
            g.configure_expert_tier(3 * expert_bytes + 1, n, i, d)
                .unwrap(),
            Some(3)
        );
        let gz = g.upload(&z, rows, d).unwrap();
        let mut gacc = g.zeros(rows, d).unwrap();
        // First pass: 3 experts land in slots, 2 run from transient arenas.
        g.moe_accumulate(&mut gacc, &gz, &all, glu).unwrap();
        assert_eq!(g.resident_experts().unwrap(), 3);
        let ids: Vec<u32> = (0..n as u32).collect();
        let resident = g.pin_resident_experts(2, &ids).unwrap();
        assert_eq!(resident.iter().filter(|&&r| r).count(), 3);
        assert!(
            !g.pin_resident_experts(3, &ids).unwrap().contains(&true),
            "another layer's experts are not resident"
        );
        let resident = g.pin_resident_experts(2, &ids).unwrap();
        // Second pass: resident experts come without host weights.
        let second: Vec<ExpertAssignment<'_>> = (0..n).map(|e| assign(e, !resident[e])).collect();
        g.moe_accumulate(&mut gacc, &gz, &second, glu).unwrap();
        check(
            "moe through the expert tier",
            &g.download(&gacc).unwrap(),
            &cacc.data,
            F32_TOL,
        );
        // An expert that is neither resident nor given weights is an error naming it.
        let missing = resident.iter().position(|&r| !r).unwrap();
        let err = g
            .moe_accumulate(&mut gacc, &gz, &[assign(missing, false)], glu)
            .unwrap_err();
        assert!(
            format!("{err:#}").contains(&format!("expert {missing} of layer 2")),
            "{err:#}"
        );
    }
    // The CPU has no tier and refuses experts without host weights.
    assert_eq!(c.configure_expert_tier(1 << 30, n, i, d).unwrap(), None);
    assert_eq!(c.pin_resident_experts(2, &[0, 1]).unwrap(), vec![false; 2]);
    let mut cacc = c.zeros(rows, d).unwrap();
    assert!(c
        .moe_accumulate(&mut cacc, &cz, &[assign(0, false)], glu)
        .is_err());
}

#[test]
fn kda_step_matches_cpu_across_chunks() {
    let mut rng = StdRng::seed_from_u64(8);
    let c = CpuBackend::new();
    for g in gpus(None) {
        for (heads, hd, k, lb) in [
            (2, 16, 4, Some(-5.0f32)),
            (3, 40, 3, None),
            (1, 128, 1, Some(-3.0)),
        ] {
            let d = KdaDims {
                heads,
                head_dim: hd,
                conv_k: k,
                lower_bound: lb,
                norm_eps: 1e-6,
            };
            let p = d.width();
            let wv = kda_weight_values(&mut rng, &d);
            let gw = kda_weights_on(&g, &wv);
            let cw = kda_weights_on(&c, &wv);
            let mut gs = g.kda_state(&d).unwrap();
            let mut cs = c.kda_state(&d).unwrap();
            for n in [3, 1, 5] {
                let v: Vec<Vec<f32>> = [p, p, p, p, heads, p]
                    .iter()
                    .map(|&w| rand_vec(&mut rng, n * w, 2.0))
                    .collect();
                let ga: Vec<_> = v
                    .iter()
                    .zip([p, p, p, p, heads, p])
                    .map(|(x, w)| g.upload(x, n, w).unwrap())
                    .collect();
                let ca: Vec<_> = v
                    .iter()
                    .zip([p, p, p, p, heads, p])
                    .map(|(x, w)| c.upload(x, n, w).unwrap())
                    .collect();
                let gi = KdaStepInputs::from_slice(&ga).unwrap();
                let ci = KdaStepInputs::from_slice(&ca).unwrap();
                let got = g
                    .download(&g.kda_step(&d, &gw, &mut gs, gi).unwrap())
                    .unwrap();
                let want = c.kda_step(&d, &cw, &mut cs, ci).unwrap().data;
                check(
                    &format!("kda heads={heads} dk={hd} K={k} n={n}"),
                    &got,
                    &want,
                    F32_TOL,
                );
            }
        }
    }
}

#[test]
fn mla_attend_matches_cpu_as_the_cache_grows() {
    let mut rng = StdRng::seed_from_u64(9);
    let c = CpuBackend::new();
    // A 256 KiB binding cap: the longer calls' scores exceed one binding, so they attend in
    // blocks of tokens, each appending its latents first.
    for g in gpus(None).into_iter().chain(gpus(Some(1 << 18))) {
        // nope 7: the query absorption's 4-way unrolled sum also takes its remainder loop.
        for (heads, kv, nope, rope, v) in [(3, 40, 8, 4, 12), (9, 64, 16, 6, 16), (2, 32, 7, 4, 8)]
        {
            let d = MlaDims {
                heads,
                kv_lora: kv,
                nope,
                rope,
                v,
                norm_eps: 1e-6,
            };
            let (nw, wk, wv) = (
                rand_vec(&mut rng, kv, 1.0),
                rand_vec(&mut rng, heads * nope * kv, 0.3),
                rand_vec(&mut rng, heads * v * kv, 0.3),
            );
            let gw = MlaAttnWeights {
                kv_norm: g.upload(&nw, 1, kv).unwrap(),
                wk: g.upload(&wk, heads * nope, kv).unwrap(),
                wv: g.upload(&wv, heads * v, kv).unwrap(),
            };
            let cw = MlaAttnWeights {
                kv_norm: c.upload(&nw, 1, kv).unwrap(),
                wk: c.upload(&wk, heads * nope, kv).unwrap(),
                wv: c.upload(&wv, heads * v, kv).unwrap(),
            };
            let mut gc = g.mla_cache(&d).unwrap();
            let mut cc = c.mla_cache(&d).unwrap();
            // 3 + 1 + 70 positions grow the cache past its first capacity; the 200-token
            // call and the decode step after it split the positions into chunks of 128.
            for n in [3, 1, 70, 200, 1] {
                let q = rand_vec(&mut rng, n * heads * (nope + rope), 1.0);
                let cv = rand_vec(&mut rng, n * (kv + rope), 1.0);
                let got = g
                    .download(
                        &g.mla_attend(
                            &d,
                            &gw,
                            &mut gc,
                            &g.upload(&q, n, heads * (nope + rope)).unwrap(),
                            &g.upload(&cv, n, kv + rope).unwrap(),
                        )
                        .unwrap(),
                    )
                    .unwrap();
                let want = c
                    .mla_attend(
                        &d,
                        &cw,
                        &mut cc,
                        &c.upload(&q, n, heads * (nope + rope)).unwrap(),
                        &c.upload(&cv, n, kv + rope).unwrap(),
                    )
                    .unwrap()
                    .data;
                check(
                    &format!("mla heads={heads} kv={kv} n={n}"),
                    &got,
                    &want,
                    F32_TOL,
                );
            }
        }
    }
}

/// Several sequences' MLA attention in one call (`mla_attend_pieces`): each piece's rows,
/// read and written in place with its own cache, give the CPU's attention of those rows
/// alone, over calls that grow the caches unequally; pieces that do not cover the rows in
/// order are an error naming the op.
#[test]
fn mla_pieces_in_one_call_match_each_alone_on_cpu() {
    let mut rng = StdRng::seed_from_u64(17);
    let c = CpuBackend::new();
    let (d, [nw, wk, wv]) = small_mla(&mut rng);
    let (qw, cw_) = (d.heads * (d.nope + d.rope), d.kv_lora + d.rope);
    fn weights<B: Backend>(b: &B, d: &MlaDims, w: [&[f32]; 3]) -> MlaAttnWeights<B::Act> {
        MlaAttnWeights {
            kv_norm: b.upload(w[0], 1, d.kv_lora).unwrap(),
            wk: b.upload(w[1], d.heads * d.nope, d.kv_lora).unwrap(),
            wv: b.upload(w[2], d.heads * d.v, d.kv_lora).unwrap(),
        }
    }
    let cw = weights(&c, &d, [&nw, &wk, &wv]);
    for g in gpus(None) {
        let gw = weights(&g, &d, [&nw, &wk, &wv]);
        let mut gc: Vec<_> = (0..4).map(|_| g.mla_cache(&d).unwrap()).collect();
        let mut cc: Vec<_> = (0..4).map(|_| c.mla_cache(&d).unwrap()).collect();
        // A prompt slice beside decode rows, an empty piece, then 70 rows that grow one
        // cache past its first capacity.
        for lens in [[3usize, 1, 0, 2], [1, 1, 1, 1], [70, 1, 2, 1], [1, 1, 1, 1]] {
            let n: usize = lens.iter().sum();
            let q = rand_vec(&mut rng, n * qw, 1.0);
            let cv = rand_vec(&mut rng, n * cw_, 1.0);
            let (gq, gcv) = (g.upload(&q, n, qw).unwrap(), g.upload(&cv, n, cw_).unwrap());
            let mut at = 0;
            let mut pieces = Vec::new();
            for (cache, &len) in gc.iter_mut().zip(&lens) {
                pieces.push((cache, at..at + len));
                at += len;
            }
            let got = g
                .mla_attend_pieces(&d, &gw, &mut pieces, &gq, &gcv)
                .unwrap()
                .expect("pieces within the grid run in one call");
            let got = g.download(&got).unwrap();
            let ow = d.heads * d.v;
            let mut at = 0;
            for (s, &len) in lens.iter().enumerate() {
                let want = c
                    .mla_attend(
                        &d,
                        &cw,
                        &mut cc[s],
                        &c.upload(&q[at * qw..(at + len) * qw], len, qw).unwrap(),
                        &c.upload(&cv[at * cw_..(at + len) * cw_], len, cw_).unwrap(),
                    )
                    .unwrap()
                    .data;
                check(
                    &format!("mla piece {s} of {lens:?}"),
                    &got[at * ow..(at + len) * ow],
                    &want,
                    F32_TOL,
                );
                at += len;
            }
        }
        let (gq, gcv) = (
            g.upload(&vec![0.5; 5 * qw], 5, qw).unwrap(),
            g.upload(&vec![0.5; 5 * cw_], 5, cw_).unwrap(),
        );
        let [a, b, ..] = &mut gc[..] else {
            unreachable!()
        };
        let mut gap = vec![(&mut *a, 0..1), (&mut *b, 2..5)];
        let e = format!(
            "{:#}",
            g.mla_attend_pieces(&d, &gw, &mut gap, &gq, &gcv)
                .unwrap_err()
        );
        assert!(e.contains("mla_attend: pieces"), "{e}");
        assert!(e.contains("do not cover the 5 rows in order"), "{e}");
    }
}

#[test]
fn free_vram_query_answers_on_every_adapter() {
    // Lavapipe has no VRAM of its own: the tier default must report "unknown", not panic;
    // a real GPU may answer either way (Vulkan with or without VK_EXT_memory_budget).
    let Some(g) = gpus(None).into_iter().next() else {
        return;
    };
    let info = &g.ctx.info;
    let raw = vram_budget::reported_free_bytes(&g.ctx.adapter);
    let free = g.free_device_memory().unwrap();
    eprintln!(
        "{} ({:?}, {:?}): driver reports {raw:?} B free device-local, tier default sees {free:?}",
        info.name, info.backend, info.device_type
    );
    match free {
        // The same query answered a moment ago, without the CPU-type filter.
        FreeDeviceMemory::Bytes(_) => assert!(raw.is_some()),
        FreeDeviceMemory::Unknown(why) => assert!(!why.is_empty()),
    }
    if info.device_type == wgpu::DeviceType::Cpu {
        assert!(matches!(free, FreeDeviceMemory::Unknown(_)), "{free:?}");
    }
}

/// Several sequences' KDA steps in one call (`kda_step_pieces`): each piece's rows, with its
/// own state, give the CPU's step of those rows alone, over two calls so the states carry;
/// a piece of a chunk's rows is left to the piece-at-a-time way, and pieces that do not
/// cover the rows in order are an error.
#[test]
fn kda_pieces_in_one_call_match_each_alone_on_cpu() {
    let mut rng = StdRng::seed_from_u64(31);
    let c = CpuBackend::new();
    let d = KdaDims {
        heads: 3,
        head_dim: 40,
        conv_k: 4,
        lower_bound: Some(-5.0),
        norm_eps: 1e-6,
    };
    let (p, h) = (d.width(), d.heads);
    let wv = kda_weight_values(&mut rng, &d);
    let widths = [p, p, p, p, h, p];
    for g in gpus(None) {
        let gw = kda_weights_on(&g, &wv);
        let cw = kda_weights_on(&c, &wv);
        let mut gs: Vec<_> = (0..4).map(|_| g.kda_state(&d).unwrap()).collect();
        let mut cs: Vec<_> = (0..4).map(|_| c.kda_state(&d).unwrap()).collect();
        // The states carry over from call to call, pieces of equal and unequal lengths.
        for lens in [[1usize, 3, 0, 2], [1, 1, 1, 1], [2, 1, 1, 3], [2, 2, 2, 2]] {
            let n: usize = lens.iter().sum();
            let v: Vec<Vec<f32>> = widths
                .iter()
                .map(|&w| rand_vec(&mut rng, n * w, 2.0))
                .collect();
            let ga: Vec<_> = v
                .iter()
                .zip(widths)
                .map(|(x, w)| g.upload(x, n, w).unwrap())
                .collect();
            let mut at = 0;
            let mut pieces = Vec::new();
            for (st, &len) in gs.iter_mut().zip(&lens) {
                pieces.push((st, at..at + len));
                at += len;
            }
            let gi = KdaStepInputs::from_slice(&ga).unwrap();
            let got = g
                .kda_step_pieces(&d, &gw, &mut pieces, gi)
                .unwrap()
                .expect("pieces of decode rows run in one call");
            let got = g.download(&got).unwrap();
            let mut at = 0;
            for (s, &len) in lens.iter().enumerate() {
                let ca: Vec<_> = v
                    .iter()
                    .zip(widths)
                    .map(|(x, w)| c.upload(&x[at * w..(at + len) * w], len, w).unwrap())
                    .collect();
                let ci = KdaStepInputs::from_slice(&ca).unwrap();
                let want = c.kda_step(&d, &cw, &mut cs[s], ci).unwrap().data;
                check(
                    &format!("kda piece {s} of {lens:?}"),
                    &got[at * p..(at + len) * p],
                    &want,
                    F32_TOL,
                );
                at += len;
            }
        }
        let ga: Vec<_> = widths
            .iter()
            .map(|&w| g.upload(&vec![0.5; 5 * w], 5, w).unwrap())
            .collect();
        let gi = || KdaStepInputs::from_slice(&ga).unwrap();
        let [a, b, ..] = &mut gs[..] else {
            unreachable!()
        };
        let mut chunk = vec![(&mut *a, 0..4), (&mut *b, 4..5)];
        assert!(g
            .kda_step_pieces(&d, &gw, &mut chunk, gi())
            .unwrap()
            .is_none());
        let mut gap = vec![(&mut *a, 0..1), (&mut *b, 2..5)];
        let e = format!(
            "{:#}",
            g.kda_step_pieces(&d, &gw, &mut gap, gi()).unwrap_err()
        );
        assert!(e.contains("do not cover the 5 rows in order"), "{e}");
        let mut short = vec![(&mut *a, 0..1), (&mut *b, 1..3)];
        let e = format!(
            "{:#}",
            g.kda_step_pieces(&d, &gw, &mut short, gi()).unwrap_err()
        );
        assert!(e.contains("pieces end at row 3 of the 5 rows"), "{e}");
    }
}

/// Small MLA dimensions (3 heads, a 40-wide latent) and random weights for them: kv_norm,
/// wk, wv.
pub(crate) fn small_mla(rng: &mut StdRng) -> (MlaDims, [Vec<f32>; 3]) {
    let d = MlaDims {
        heads: 3,
        kv_lora: 40,
        nope: 8,
        rope: 4,
        v: 12,
        norm_eps: 1e-6,
    };
    let w = [
        rand_vec(rng, d.kv_lora, 1.0),
        rand_vec(rng, d.heads * d.nope * d.kv_lora, 0.3),
        rand_vec(rng, d.heads * d.v * d.kv_lora, 0.3),
    ];
    (d, w)
}

/// Random KDA step weights for `d`: conv q, k, v, A_log, dt_bias, o_norm.
pub(crate) fn kda_weight_values(rng: &mut StdRng, d: &KdaDims) -> [Vec<f32>; 6] {
    let (p, k) = (d.width(), d.conv_k);
    [
        rand_vec(rng, p * k, 0.5),
        rand_vec(rng, p * k, 0.5),
        rand_vec(rng, p * k, 0.5),
        rand_vec(rng, d.heads, 1.0),
        rand_vec(rng, p, 1.0),
        rand_vec(rng, d.head_dim, 1.0),
    ]
}

/// The KDA step weights `wv` (conv q, k, v, A_log, dt_bias, o_norm) on backend `b`.
fn kda_weights_on<B: Backend>(b: &B, wv: &[Vec<f32>; 6]) -> KdaStepWeights<B::Act> {
    let up = |v: &Vec<f32>| b.upload(v, 1, v.len()).unwrap();
    KdaStepWeights {
        conv_q: up(&wv[0]),
        conv_k: up(&wv[1]),
        conv_v: up(&wv[2]),
        a_log: up(&wv[3]),
        dt_bias: up(&wv[4]),
        o_norm: up(&wv[5]),
    }
}

#[test]
fn kda_chunk_past_the_grid_limit_is_a_clear_error() {
    let Some(g) = gpus(None).into_iter().next() else {
        return;
    };
    let d = KdaDims {
        heads: 1,
        head_dim: 4,
        conv_k: 2,
        lower_bound: None,
        norm_eps: 1e-6,
    };
    let n = g.ctx.limits.max_compute_workgroups_per_dimension as usize + 1;
    let up = |rows: usize, cols: usize| g.upload(&vec![0.1; rows * cols], rows, cols).unwrap();
    let w = KdaStepWeights {
        conv_q: up(1, 8),
        conv_k: up(1, 8),
        conv_v: up(1, 8),
        a_log: up(1, 1),
        dt_bias: up(1, 4),
        o_norm: up(1, 4),
    };
    let (q, k, v, f, beta, gate) = (up(n, 4), up(n, 4), up(n, 4), up(n, 4), up(n, 1), up(n, 4));
    let mut st = g.kda_state(&d).unwrap();
    let err = g
        .kda_step(
            &d,
            &w,
            &mut st,
            KdaStepInputs {
                q: &q,
                k: &k,
                v: &v,
                f: &f,
                beta: &beta,
                gate: &gate,
            },
        )
        .expect_err("a chunk past the limit must fail");
    assert!(format!("{err:#}").contains("--chunk"), "{err:#}");
}

#[test]
fn forty_backends_open_one_after_another_in_one_process() {
    // NVIDIA's Vulkan driver stops listing its GPU after 30 wgpu instances in one process,
    // each dropped before the next; the backends therefore share one instance.
    if gpus(None).is_empty() {
        return;
    }
    for i in 0..40 {
        if let Err(e) = GpuBackend::new(&GpuOptions {
            allow_cpu_adapter: true,
            ..Default::default()
        }) {
            panic!("backend {i} of 40 did not open: {e:#}");
        }
    }
}

/// The int4 matvec's integer-digit decode, in the row-split and the
/// column-stationary kernel: x rounded per 32-column unit to integers below 2^22 times a
/// power of two, so it is held to the f32 tolerance on inputs whose magnitudes spread over
/// many orders within a unit, on units of zeros, and on rows that are not a whole number of
/// units.
#[test]
fn int4_integer_digit_decode_matches_cpu_over_wide_ranges() {
    for stationary in [false, true] {
        int4_integer_digits_against_cpu(stationary);
    }
}

fn int4_integer_digits_against_cpu(stationary: bool) {
    let mut rng = StdRng::seed_from_u64(21);
    let shape = Some(MatvecShape {
        lanes_per_row: 32,
        lanes_per_block: 32,
        rows_per_lane: 4,
        int4_decode: Some(Int4Decode::Digits),
        pipelined: true,
        unchecked: false,
        stage_x: u32::MAX,
        // Rows a lane that leave the last workgroup's rows short.
        digit_rows_per_lane: 3,
    });
    let Some(g) = gpu_with(&GpuOptions {
        allow_cpu_adapter: true,
        matvec: shape,
        chunk_gemm: Some(ChunkGemm {
            from_tokens: 0,
            ..ChunkGemm::default()
        }),
        stationary: Some(Stationary {
            enabled: stationary,
            below_groups: u64::MAX,
            ..Stationary::default()
        }),
        ..Default::default()
    }) else {
        return;
    };
    let int4 = |rng: &mut StdRng, rows: usize, cols: usize| {
        DenseMatrix::from_f32(
            rows,
            cols,
            rand_vec(rng, rows * cols, 0.5),
            DenseFormat::Int4,
        )
        .unwrap()
    };
    // 2100 columns are 66 units: two whole blocks of 32 in the planes' layout and a short one.
    for (n, rows, cols) in [(1, 64, 256), (3, 33, 200), (2, 129, 1000), (2, 70, 2100)] {
        let w = int4(&mut rng, rows, cols);
        let x: Vec<f32> = (0..n * cols)
            .map(|k| {
                if (k / 32) % 5 == 3 {
                    0.0
                } else {
                    rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-12..12))
                }
            })
            .collect();
        let what = format!("int4 digits, column-stationary {stationary}, n={n} {rows}x{cols}");
        matmul_against_cpu(&g, w, &x, n, &what);
    }
    // A NaN or an infinity in x makes every output NaN, as on the CPU; the other token's
    // outputs stay finite.
    for bad in [f32::NAN, f32::INFINITY] {
        let (rows, cols) = (40, 96);
        let w = int4(&mut rng, rows, cols);
        let mut x = rand_vec(&mut rng, 2 * cols, 1.0);
        x[50] = bad;
        let gm = g.load_matrix(w).unwrap();
        let y = g
            .download(&g.matmul(&gm, &g.upload(&x, 2, cols).unwrap()).unwrap())
            .unwrap();
        assert!(y[..rows].iter().all(|v| v.is_nan()), "{bad}: {:?}", &y[..4]);
        assert!(y[rows..].iter().all(|v| v.is_finite()));
    }
}

/// `GpuOptions::wgsl_dir` composes the kernels from that directory's files: a copy of
/// shaders_wgsl/ whose `add` subtracts changes what `add` returns, and a directory without
/// the files fails when the backend opens, naming the file it could not read.
#[cfg(feature = "lab")]
#[test]
fn kernels_compose_from_a_wgsl_dir() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders_wgsl");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let elementwise = dir.path().join("elementwise.wgsl");
    let text = std::fs::read_to_string(&elementwise).unwrap();
    let sum = "o[i] = a[i] + b[i];";
    assert!(text.contains(sum), "elementwise.wgsl no longer has {sum}");
    std::fs::write(&elementwise, text.replace(sum, "o[i] = a[i] - b[i];")).unwrap();
    let opts = |d: &std::path::Path| GpuOptions {
        allow_cpu_adapter: true,
        wgsl_dir: Some(d.to_path_buf()),
        ..Default::default()
    };
    let Some(g) = gpu_with(&opts(dir.path())) else {
        return;
    };
    let a = g.upload(&[3.0, 4.0], 1, 2).unwrap();
    let b = g.upload(&[1.0, 0.5], 1, 2).unwrap();
    assert_eq!(g.download(&g.add(&a, &b).unwrap()).unwrap(), vec![2.0, 3.5]);
    let empty = tempfile::tempdir().unwrap();
    let err = match GpuBackend::new(&opts(empty.path())) {
        Ok(_) => panic!("a directory without the WGSL files opened"),
        Err(e) => format!("{e:#}"),
    };
    let missing = empty.path().join("elementwise.wgsl");
    assert!(err.contains(&missing.display().to_string()), "{err}");
}

/// Matvec modules built with one of wgpu's runtime checks off at a time (the benchmarks'
/// `nochecks=`) give the CPU's sums: the kernels' own clamps and bounded loops stand in.
#[cfg(feature = "lab")]
#[test]
fn matvecs_without_single_runtime_checks_match_cpu() {
    let mut rng = StdRng::seed_from_u64(24);
    for off in ["bounds", "loop", "div"] {
        let checks = wgpu::ShaderRuntimeChecks {
            bounds_checks: off != "bounds",
            force_loop_bounding: off != "loop",
            int_div_checks: off != "div",
            ..wgpu::ShaderRuntimeChecks::checked()
        };
        let Some(g) = gpu_with(&GpuOptions {
            allow_cpu_adapter: true,
            matvec_checks: Some(checks),
            ..Default::default()
        }) else {
            return;
        };
        for fmt in [DenseFormat::F32, DenseFormat::Int8, DenseFormat::Int4] {
            matmul_case(&g, &mut rng, fmt, 1, 70, 320);
        }
        // Past DIGITS_FROM_ROWS: the int4 digit kernel; and MXFP4 with huge scales.
        matmul_case(&g, &mut rng, DenseFormat::Int4, 1, DIGITS_FROM_ROWS + 3, 64);
        mxfp4_case(&g, &mut rng, 1, 300, 96, true);
    }
}

/// A matrix of zero columns gives zero sums, as on the CPU, for every dense format and for
/// MXFP4, even where the output lands in a reused (here NaN-poisoned) buffer.
#[test]
fn matmul_over_zero_columns_is_zero() {
    let mut rng = StdRng::seed_from_u64(25);
    let c = CpuBackend::new();
    for g in gpus(None) {
        for fmt in [DenseFormat::F32, DenseFormat::Int8, DenseFormat::Int4] {
            // An earlier output of the same size goes back to the pool first.
            matmul_case(&g, &mut rng, fmt, 2, 5, 64);
            let w = DenseMatrix::from_f32(5, 0, Vec::new(), fmt).unwrap();
            let want = c.matmul(&w, &c.upload(&[], 2, 0).unwrap()).unwrap().data;
            let gw = g.load_matrix(w).unwrap();
            let got = g
                .download(&g.matmul(&gw, &g.upload(&[], 2, 0).unwrap()).unwrap())
                .unwrap();
            assert_eq!(got, want, "{fmt:?}");
            assert_eq!(got, vec![0.0; 10], "{fmt:?}");
        }
        mxfp4_case(&g, &mut rng, 2, 5, 64, false);
        let view = Mxfp4View::new(5, 0, &[], &[]).unwrap();
        let got = g
            .download(&g.matmul_mxfp4(view, &g.upload(&[], 2, 0).unwrap()).unwrap())
            .unwrap();
        assert_eq!(got, vec![0.0; 10], "mxfp4");
    }
}

/// Readbacks share one mapped buffer between them: each, whether smaller or larger than the
/// one before and of any length, gets exactly its own values (no byte of an earlier, longer
/// readback past its end, none missing where it grew); so does a readback in pieces.
#[test]
fn readbacks_of_any_size_in_turn_get_their_own_values() {
    let Some(g) = gpu_with(&GpuOptions {
        allow_cpu_adapter: true,
        ..Default::default()
    }) else {
        return;
    };
    for (i, n) in [300_000usize, 7, 1, 1 << 20, 5, 4096, 300_001]
        .into_iter()
        .enumerate()
    {
        let want: Vec<f32> = (0..n).map(|k| (k * 31 + i) as f32 * 0.5).collect();
        let got = g.download(&g.upload(&want, 1, n).unwrap()).unwrap();
        assert_eq!(got, want, "readback {i} of {n} values");
    }
    // A batch's logits come back a piece a sequence, each straight from the mapping; pieces
    // that do not add up to the activation are refused by name.
    let all: Vec<f32> = (0..100).map(|k| k as f32).collect();
    let x = g.upload(&all, 4, 25).unwrap();
    let pieces = g.download_pieces(&x, &[25, 0, 50, 25]).unwrap();
    let want = [&all[..25], &[][..], &all[25..75], &all[75..]];
    assert_eq!(pieces, want.map(<[f32]>::to_vec));
    // Pieces of a few hundred thousand values, each copied by a pool thread.
    let big: Vec<f32> = (0..300_000).map(|k| k as f32).collect();
    let x_big = g.upload(&big, 3, 100_000).unwrap();
    let pieces = g
        .download_pieces(&x_big, &[100_000, 150_000, 50_000])
        .unwrap();
    let want = [&big[..100_000], &big[100_000..250_000], &big[250_000..]];
    assert_eq!(pieces, want.map(<[f32]>::to_vec));
    let e = g.download_pieces(&x, &[25, 50]).unwrap_err();
    assert!(format!("{e:#}").contains("pieces of 75 values"), "{e:#}");
}
