//! GPU kernels at K3 shapes, each case against the read roofline of the same bytes: a plain
//! streaming-read kernel over a buffer of that size, its runs interleaved with the case's
//! so both see the GPU in the same state (docs/perf.md#kernels reports these lines).
//!
//! `cargo bench --bench gpu_kernels [-- quick] [list] [CASE ...]`: every case, or those
//! named; `quick` shrinks the shapes (lavapipe), `list` prints the names. `K3_ADAPTER=NAME`
//! picks the adapter, `K3_BENCH_HEAT=SECS` the read passes run before each line so it
//! starts at the GPU's full clock (0.6 s; 0 in quick mode). Times come from timestamp
//! queries around the recorded passes where the adapter has them, else the wall clock.
//! Variants of the engine's kernels are measured with the `K3_LAB_*` switches
//! (`src/backend/gpu/lab_switches.rs`) in a lab build, `cargo bench --features lab --bench
//! gpu_kernels`; the probes that study them are in lab/gpu_probes/.

#[cfg(feature = "lab")]
use k3::backend::gpu::device::lab_switches::LabSwitches;
use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::{
    Backend, ExpertAssignment, ExpertPayload, ExpertResidency, Glu, MlaAttnWeights, MlaDims,
};
use k3::quant::{DenseData, DenseMatrix, Mxfp4View};
use k3::routed_expert::{ExpertKey, ExpertWeights};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "gpu_kernels/read_kernel.rs"]
mod read_kernel;
#[path = "gpu_kernels/roofline.rs"]
mod roofline;

/// Timed repetitions per line (after one warm-up), and the median is reported.
const REPS: usize = 8;
/// K3's hidden size, expert width and vocabulary.
const D: usize = 7168;
const I: usize = 3072;
const VOCAB: usize = 163840;

/// A case: its name and what it runs.
type Case = (&'static str, fn(&Bench<'_>));

/// Every case, in the order they run.
const CASES: &[Case] = &[
    ("int4-12288x7168", |b| b.dense(4, 12288, D, 1, 1)),
    ("int4-1536x7168", |b| b.dense(4, 1536, D, 1, 1)),
    ("int4-head", |b| b.dense(4, VOCAB, D, 1, 1)),
    ("int4-kda-projections", |b| b.dense(4, 12288, D, 1, 4)),
    ("int4-12288x7168-32-tokens", |b| b.dense(4, 12288, D, 32, 1)),
    ("int8-12288x7168", |b| b.dense(8, 12288, D, 1, 1)),
    ("int8-head", |b| b.dense(8, VOCAB, D, 1, 1)),
    // A decode step of 4 and 8 streams (the few-token kernel; K3_LAB_FEW_TOKEN_DENSE=off
    // runs one matvec a row).
    ("int8-head-4-tokens", |b| b.dense(8, VOCAB, D, 4, 1)),
    ("int8-head-8-tokens", |b| b.dense(8, VOCAB, D, 8, 1)),
    ("int4-kda-projections-4-tokens", |b| {
        b.dense(4, 12288, D, 4, 4)
    }),
    ("int4-kda-projections-8-tokens", |b| {
        b.dense(4, 12288, D, 8, 4)
    }),
    ("int4-1536x7168-8-tokens", |b| b.dense(4, 1536, D, 8, 1)),
    ("int4-3072x7168-8-tokens", |b| b.dense(4, 3072, D, 8, 1)),
    ("int4-7168x7168-4-tokens", |b| b.dense(4, 7168, D, 4, 1)),
    ("int4-7168x7168-8-tokens", |b| b.dense(4, 7168, D, 8, 1)),
    ("mxfp4-expert", |b| b.mxfp4(I, 3584)),
    ("mxfp4-16-experts-w1w3", |b| b.mxfp4(32 * I, 3584)),
    ("mxfp4-16-experts-w2", |b| b.mxfp4(16 * 3584, I)),
    ("moe-resident-16x1", |b| b.moe(16, 1)),
    ("moe-resident-16x8", |b| b.moe(16, 8)),
    ("mla-attend-4096", |b| b.mla(4096)),
    ("rmsnorm-7168", |b| b.rmsnorm()),
    ("dispatch-chain", |b| b.dispatch_chain()),
];

/// The GPU, the roofline and the timing of every line.
struct Bench<'a> {
    g: &'a GpuBackend,
    roof: roofline::Roofline,
    quick: bool,
    rng: std::cell::RefCell<StdRng>,
}

impl Bench<'_> {
    /// `full`, or `small` in quick mode.
    fn size(&self, full: usize, small: usize) -> usize {
        if self.quick {
            small
        } else {
            full
        }
    }

    fn bytes(&self, n: usize) -> Vec<u8> {
        let mut rng = self.rng.borrow_mut();
        (0..n).map(|_| rng.random()).collect()
    }

    /// `mats` int`bits` matrices of `rows × cols` against one x of `tokens` tokens, through
    /// `matmul_many` (they share x's padded copy and digit pass, as a KDA layer's do).
    fn dense(&self, bits: u32, rows: usize, cols: usize, tokens: usize, mats: usize) {
        let (rows, cols) = (self.size(rows, rows / 16), self.size(cols, 512));
        let ms: Vec<_> = (0..mats)
            .map(|_| {
                let data = match bits {
                    4 => DenseData::Int4 {
                        q: self.bytes(rows * cols / 2),
                        scale: vec![0.01; rows * cols.div_ceil(64)],
                    },
                    _ => DenseData::Int8 {
                        q: self
                            .bytes(rows * cols)
                            .into_iter()
                            .map(|b| b as i8)
                            .collect(),
                        scale: vec![0.01; rows],
                    },
                };
                self.g
                    .load_matrix(DenseMatrix { rows, cols, data })
                    .unwrap()
            })
            .collect();
        let refs: Vec<_> = ms.iter().collect();
        let x = self
            .g
            .upload(&vec![0.5; tokens * cols], tokens, cols)
            .unwrap();
        let bytes = ms.iter().map(|m| m.byte_size()).sum();
        let name = format!("int{bits} {mats}x {rows}x{cols}, {tokens} token(s)");
        self.roof.line(self.g, &name, bytes, &mut || {
            self.g.matmul_many(&refs, &x).unwrap();
        });
    }

    /// An MXFP4 matrix's scale bytes (118..126: no huge scales) after its packed nibbles.
    fn mxfp4_bytes(&self, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let mut rng = self.rng.borrow_mut();
        let scales = (0..rows * cols / 32)
            .map(|_| rng.random_range(118u8..126))
            .collect();
        drop(rng);
        (self.bytes(rows * cols / 2), scales)
    }

    /// One `rows × cols` MXFP4 matvec (experts stacked as one matrix), one token.
    fn mxfp4(&self, rows: usize, cols: usize) {
        let (rows, cols) = (self.size(rows, rows / 12), self.size(cols, 384));
        let (p, s) = self.mxfp4_bytes(rows, cols);
        let w = Mxfp4View::new(rows, cols, &p, &s).unwrap();
        let x = self.g.upload(&vec![0.5; cols], 1, cols).unwrap();
        let bytes = (p.len() + s.len()) as u64;
        self.roof.line(
            self.g,
            &format!("mxfp4 {rows}x{cols}, 1 token"),
            bytes,
            &mut || {
                self.g.matmul_mxfp4(w, &x).unwrap();
            },
        );
    }

    /// The whole MoE (w1|w3, GLU, w2, scatter) of `experts` experts resident in the VRAM
    /// tier, each taking every one of `tokens` tokens.
    fn moe(&self, experts: usize, tokens: usize) {
        let (i, d) = (self.size(I, 256), self.size(3584, 384));
        let mats: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..experts)
            .map(|_| {
                [
                    self.mxfp4_bytes(i, d),
                    self.mxfp4_bytes(d, i),
                    self.mxfp4_bytes(i, d),
                ]
            })
            .collect();
        let bytes: u64 = mats
            .iter()
            .flatten()
            .map(|(p, s)| (p.len() + s.len()) as u64)
            .sum();
        let assign = |resident: bool| -> Vec<ExpertAssignment<'_>> {
            (mats.iter().enumerate())
                .map(|(e, m)| ExpertAssignment {
                    key: Some(ExpertKey {
                        layer: 1,
                        id: e as u32,
                    }),
                    payload: if resident {
                        ExpertPayload::Resident
                    } else {
                        ExpertPayload::Host(ExpertWeights {
                            w1: view(&m[0], i, d),
                            w2: view(&m[1], d, i),
                            w3: view(&m[2], i, d),
                        })
                    },
                    tokens: (0..tokens).map(|t| (t, 0.1)).collect(),
                })
                .collect()
        };
        let glu = Glu::Situ {
            beta: 10.0,
            linear_beta: 10.0,
        };
        let z = self.g.upload(&vec![0.25; tokens * d], tokens, d).unwrap();
        let mut acc = self.g.zeros(tokens, d).unwrap();
        self.g.configure_expert_tier(bytes, experts, i, d).unwrap();
        // The first call uploads the experts into the tier; the timed ones only compute.
        self.g
            .moe_accumulate(&mut acc, &z, &assign(false), glu)
            .unwrap();
        let resident = assign(true);
        let name = format!("moe resident {experts}x {tokens} token(s)");
        self.roof.line(self.g, &name, bytes, &mut || {
            self.g.moe_accumulate(&mut acc, &z, &resident, glu).unwrap();
        });
    }

    /// One decode step's MLA attention over `positions` cached positions (96 heads).
    fn mla(&self, positions: usize) {
        let positions = self.size(positions, 512);
        let up = |n: usize, c: usize| self.g.upload(&vec![0.1; n * c], n, c).unwrap();
        let md = MlaDims {
            heads: self.size(96, 8),
            kv_lora: 512,
            nope: 128,
            rope: 64,
            v: 128,
            norm_eps: 1e-6,
        };
        let w = MlaAttnWeights {
            kv_norm: up(1, 512),
            wk: up(md.heads * 128, 512),
            wv: up(md.heads * 128, 512),
        };
        let mut cache = self.g.mla_cache(&md).unwrap();
        for start in (0..positions - 1).step_by(256) {
            let n = 256.min(positions - 1 - start);
            let (q, c) = (up(n, md.heads * 192), up(n, 576));
            self.g.mla_attend(&md, &w, &mut cache, &q, &c).unwrap();
        }
        let (q, c, len) = (up(1, md.heads * 192), up(1, 576), cache.len);
        let name = format!("mla {} heads, {positions} positions", md.heads);
        self.roof
            .line(self.g, &name, (positions * 576 * 4) as u64, &mut || {
                cache.len = len;
                self.g.mla_attend(&md, &w, &mut cache, &q, &c).unwrap();
            });
    }

    /// What a dispatch costs the host: a chain of element-wise adds over 7168 values, each
    /// reading the one before, timed as recorded (host only) and as recorded and run (wall).
    /// A decode step records a few hundred such passes, so this is its floor per pass.
    fn dispatch_chain(&self) {
        let n = self.size(2000, 500);
        let x = self.g.upload(&vec![0.5; D], 1, D).unwrap();
        let mut best = (f64::MAX, f64::MAX);
        for rep in 0..=REPS {
            self.g.sync().unwrap();
            let t0 = std::time::Instant::now();
            let mut y = x.clone();
            for _ in 0..n {
                y = self.g.add(&y, &x).unwrap();
            }
            let recorded = t0.elapsed().as_secs_f64();
            self.g.sync().unwrap();
            let ran = t0.elapsed().as_secs_f64();
            if rep > 0 {
                best = (best.0.min(recorded), best.1.min(ran));
            }
        }
        let per = |s: f64| s / n as f64 * 1e6;
        println!(
            "add 1x7168 chained x{n}: {:.2} us a dispatch recorded (host), {:.2} us recorded and run (wall), best of {REPS}",
            per(best.0),
            per(best.1)
        );
    }

    /// A decode step's RMSNorm of one 7168-wide row (one workgroup).
    fn rmsnorm(&self) {
        let x = self.g.upload(&vec![0.5; D], 1, D).unwrap();
        let w = self.g.upload(&vec![1.0; D], 1, D).unwrap();
        self.roof
            .line(self.g, "rmsnorm 1x7168", (2 * D * 4) as u64, &mut || {
                self.g.rmsnorm(&x, &w, D, 1e-6).unwrap();
            });
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.iter().any(|a| a == "list") {
        CASES.iter().for_each(|(name, _)| println!("{name}"));
        return;
    }
    let quick = args.iter().any(|a| a == "quick");
    let named: Vec<&String> = args.iter().filter(|a| *a != "quick").collect();
    if let Some(bad) = named
        .iter()
        .find(|a| !CASES.iter().any(|(n, _)| *n == a.as_str()))
    {
        eprintln!("gpu_kernels: no case {bad:?}; `list` prints the cases");
        std::process::exit(2);
    }
    let opts = GpuOptions {
        adapter: std::env::var("K3_ADAPTER").ok(),
        allow_cpu_adapter: true,
        ..GpuOptions::default()
    };
    #[cfg(feature = "lab")]
    let opts = LabSwitches::from_env()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .apply(opts);
    // Without the lab code a switch would be ignored, and its figures read as the variant's.
    #[cfg(not(feature = "lab"))]
    if let Some((name, _)) =
        std::env::vars_os().find(|(k, _)| k.to_string_lossy().starts_with("K3_LAB_"))
    {
        eprintln!(
            "gpu_kernels: {} is a switch of the lab build: cargo bench --features lab --bench gpu_kernels",
            name.to_string_lossy()
        );
        std::process::exit(2);
    }
    let g = match GpuBackend::new(&opts) {
        Ok(g) => g,
        Err(e) => return println!("no GPU adapter: {e:#}"),
    };
    let (ctx, timing) = (
        &g.ctx,
        ["wall clock", "timestamps"][usize::from(g.ctx.has_timestamps())],
    );
    let (info, sg) = (&ctx.info, ctx.subgroups);
    println!("adapter: {} ({:?}, {:?}), subgroups {sg}, workgroup {}, binding limit {} B, timing: {timing}", info.name, info.backend, info.device_type, ctx.wg, ctx.max_binding);
    let heat_secs = std::env::var("K3_BENCH_HEAT")
        .ok()
        .and_then(|v| v.parse().ok());
    let b = Bench {
        g: &g,
        roof: roofline::Roofline::new(&g, heat_secs.unwrap_or(if quick { 0.0 } else { 0.6 })),
        quick,
        rng: std::cell::RefCell::new(StdRng::seed_from_u64(1)),
    };
    for (name, run) in CASES {
        if named.is_empty() || named.iter().any(|n| n.as_str() == *name) {
            print!("{name:<26} ");
            run(&b);
        }
    }
}

/// The MXFP4 view of `(packed, scales)` as a `rows × cols` matrix.
fn view(m: &(Vec<u8>, Vec<u8>), rows: usize, cols: usize) -> Mxfp4View<'_> {
    Mxfp4View::new(rows, cols, &m.0, &m.1).unwrap()
}
