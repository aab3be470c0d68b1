//! `Part::Twin`: the CUDA probe's MXFP4 matvec (lab/cuda_probe/mxfp4_matvec.cu, 65 % of
//! the read kernel on 16 experts' w1|w3 in session 9) written again in WGSL with the same
//! structure (mxfp4_twin.wgsl), timed against the read kernel at the probe's two shapes,
//! with variants of its decode. Session 11 (docs/perf.md): the twin ran at the engine's
//! 53-55 %, so the gap to CUDA is in what the Vulkan path compiles, and 87 % with the decode
//! removed, so the decode is the bound; placing the f16 pairs by multiplies gained 5 points
//! and went into the engine.

use super::{mxfp4, report, Timer};
use k3::backend::gpu::GpuBackend;
use k3::quant::Mxfp4View;
use rand::rngs::StdRng;
use rand::Rng;

const SOURCE: &str = include_str!("mxfp4_twin.wgsl");

/// How a variant widens the decode's f16 pairs to f32.
#[derive(Clone, Copy, PartialEq)]
enum Widen {
    /// `unpack2x16float`, as the engine's kernel does.
    Unpack,
    /// No conversion: the pair's bits taken as both f32s (wrong values; it times the
    /// decode without the widening).
    Bits,
}

/// A twin variant.
struct Variant {
    name: &'static str,
    lanes_per_row: u32,
    /// x staged in workgroup memory, else read from global memory.
    staged: bool,
    /// The twin's DECODE (mxfp4_twin.wgsl's header says what each value does).
    decode: u32,
    /// wgpu's runtime checks kept.
    checks: bool,
    widen: Widen,
}

impl Variant {
    /// Whether the variant computes the matvec (the others time an instruction mix).
    fn exact(&self) -> bool {
        [1, 2, 3, 4, 6, 7, 8].contains(&self.decode) && self.widen == Widen::Unpack
    }
}

/// A variant with x staged in workgroup memory.
const fn v(
    name: &'static str,
    lanes_per_row: u32,
    decode: u32,
    checks: bool,
    widen: Widen,
) -> Variant {
    Variant {
        name,
        lanes_per_row,
        staged: true,
        decode,
        checks,
        widen,
    }
}

const VARIANTS: [Variant; 15] = [
    v("8 lanes, x staged padded", 8, 1, true, Widen::Unpack),
    v("8 lanes, unchecked", 8, 1, false, Widen::Unpack),
    v("8 lanes, decode removed", 8, 0, true, Widen::Unpack),
    v(
        "8 lanes, f16 pairs not widened (wrong values)",
        8,
        1,
        true,
        Widen::Bits,
    ),
    v("8 lanes, conversion-free decode", 8, 2, true, Widen::Unpack),
    v(
        "8 lanes, f16 pairs 2 words, conversion-free 2",
        8,
        3,
        true,
        Widen::Unpack,
    ),
    v(
        "8 lanes, f16 pairs 3 words, conversion-free 1",
        8,
        4,
        true,
        Widen::Unpack,
    ),
    v(
        "8 lanes, byte dot products (timing only)",
        8,
        5,
        true,
        Widen::Unpack,
    ),
    v(
        "8 lanes, f16 pairs by multiplies",
        8,
        6,
        true,
        Widen::Unpack,
    ),
    v(
        "8 lanes, f16 pairs by multiplies, unchecked",
        8,
        6,
        false,
        Widen::Unpack,
    ),
    v(
        "8 lanes, by multiplies, not widened (wrong values)",
        8,
        6,
        true,
        Widen::Bits,
    ),
    v(
        "8 lanes, multiplies, 1 pair of 4 unconverted",
        8,
        7,
        true,
        Widen::Unpack,
    ),
    v(
        "8 lanes, multiplies, 2 pairs of 4 unconverted",
        8,
        8,
        true,
        Widen::Unpack,
    ),
    Variant {
        staged: false,
        ..v("8 lanes, x from global memory", 8, 1, true, Widen::Unpack)
    },
    v("32 lanes, x staged padded", 32, 1, true, Widen::Unpack),
];

/// Each variant at 16 experts' w1|w3 (98304 × 3584) and one expert's w1 (3072 × 3584),
/// checked against the host's dequantized matvec over its first rows, then timed.
pub(super) fn twin_lines(g: &GpuBackend, t: &Timer<'_>, rng: &mut StdRng, quick: bool) {
    if !g.ctx.subgroups {
        println!("twin: the adapter has no subgroups (the twin reduces through shuffles)");
        return;
    }
    let cols = if quick { 512 } else { 3584 };
    let units = (cols / 32) as u32;
    let xh: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let ctx = &g.ctx;
    let x = ctx.buffer_init(bytemuck::cast_slice(&xh), "twin x");
    for rows in [
        if quick { 8192 } else { 98304 },
        if quick { 384 } else { 3072 },
    ] {
        let (packed, scales) = mxfp4(rng, rows, cols);
        let w = ctx.buffer_init(&packed, "twin w");
        let sc = ctx.buffer_init(&scales, "twin scales");
        let y = ctx.buffer(4 * rows as u64, "twin y");
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("twin params"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        ctx.queue.write_buffer(
            &params,
            0,
            bytemuck::cast_slice(&[rows as u32, units, 0, 0]),
        );
        let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
        let checked = 64.min(rows);
        let mut want = vec![0.0f64; checked];
        let mut row = vec![0.0f32; cols];
        for (r, out) in want.iter_mut().enumerate() {
            view.dequantize_row(r, &mut row);
            *out = row
                .iter()
                .zip(&xh)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
        }
        let bytes = (packed.len() + scales.len()) as u64;
        for var in &VARIANTS {
            let (name, lpr) = (var.name, var.lanes_per_row);
            // A row's lanes meet through shuffles inside one subgroup.
            if lpr > ctx.info.subgroup_min_size {
                println!(
                    "twin {name}: skipped, subgroups of {} lanes",
                    ctx.info.subgroup_min_size
                );
                continue;
            }
            let pipe = pipeline(g, var);
            let bind = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("twin"),
                layout: &pipe.get_bind_group_layout(0),
                entries: &[
                    entry(0, &params),
                    entry(1, &w),
                    entry(2, &sc),
                    entry(3, &x),
                    entry(4, &y),
                ],
            });
            let groups = (rows as u32).div_ceil(256 / lpr * 4);
            let mut run = || {
                ctx.record(|e| {
                    let mut pass = e.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                    pass.set_pipeline(&pipe);
                    pass.set_bind_group(0, &bind, &[]);
                    pass.dispatch_workgroups(groups, 1, 1);
                })
            };
            run();
            let got = ctx.read(&y, 0, 4 * checked as u64).unwrap();
            let got: &[f32] = bytemuck::cast_slice(&got);
            let (num, den) = got.iter().zip(&want).fold((0.0, 0.0), |(n, d), (&a, &b)| {
                (n + (f64::from(a) - b).powi(2), d + b * b)
            });
            let rel = (num / den).sqrt();
            let (secs, read) = t.time_vs_read(bytes, &mut run);
            let label = format!("twin {rows}x{cols}, {name}");
            report(t, &label, bytes, secs, read);
            if var.exact() {
                println!("  rel L2 against the host over {checked} rows: {rel:.2e}");
            }
        }
    }
}

fn entry(binding: u32, b: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: b.as_entire_binding(),
    }
}

/// The twin's source with `widen` as the variant asks.
fn source(widen: Widen) -> String {
    let (a, b) = (
        SOURCE.find("// WIDEN BEGIN").unwrap(),
        SOURCE.find("// WIDEN END").unwrap(),
    );
    let (prefix, body) = match widen {
        Widen::Unpack => return SOURCE.to_string(),
        Widen::Bits => (
            "",
            "fn widen(h: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(h)); }\n",
        ),
    };
    format!("{prefix}{}{body}{}", &SOURCE[..a], &SOURCE[b..])
}

fn pipeline(g: &GpuBackend, var: &Variant) -> wgpu::ComputePipeline {
    let dev = &g.ctx.device;
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some("mxfp4_twin.wgsl"),
        source: wgpu::ShaderSource::Wgsl(source(var.widen).into()),
    };
    let module = if var.checks {
        dev.create_shader_module(desc)
    } else {
        // SAFETY: the twin clamps every row to the matrix and every unit to the row, stages
        // at most 128 units (3584 columns here), and its loops step by LPR >= 1 towards
        // uniform bounds far below u32::MAX.
        unsafe { dev.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
    };
    let consts = [
        ("LPR", f64::from(var.lanes_per_row)),
        ("DECODE", f64::from(var.decode)),
        ("XMODE", f64::from(u32::from(!var.staged))),
    ];
    dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("twin"),
        layout: None,
        module: &module,
        entry_point: Some("twin"),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &consts,
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    })
}
