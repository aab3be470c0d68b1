//! Whether the GPU's matrix units (wgpu's experimental cooperative matrices) can carry the
//! dense matmuls of a decode step of several streams: an int4 matmul of 1 to 8 tokens
//! (lab/coop_probe.wgsl) checked against the host in f64 and timed by the wall clock over
//! chains of dispatches. Compare with `cargo bench --features lab --bench gpu_kernels --
//! int4-7168x7168-8-tokens ...` in the same device call.
//!
//! ```text
//! mkdir -p examples && cp lab/coop_probe.rs examples/
//! cargo build --release --example coop_probe
//! coop_probe [--check]     # --check: parse and validate the WGSL with naga only
//! ```

use std::time::Instant;

const WGSL: &str = include_str!("../lab/coop_probe.wgsl");

fn validate() -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(WGSL).map_err(|e| e.emit_to_string(WGSL))?;
    let mut v = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    );
    v.validate(&module).map_err(|e| format!("{e:?}"))?;
    Ok(())
}

/// Tiny deterministic generator (no dependency on the host's rand state).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn unit(&mut self) -> f32 {
        self.next() as f32 / (1u64 << 31) as f32 * 2.0 - 1.0
    }
}

/// B of the kernel for `x` ([tokens][k]): per token the power of two that brings its
/// largest |x| near 2^11, and columns hi (t) and lo (8 + t).
fn split_x(x: &[Vec<f32>], k: usize) -> (Vec<half::f16>, Vec<f32>) {
    let mut b = vec![half::f16::ZERO; k * 16];
    let mut down = vec![0f32; 8];
    for (t, row) in x.iter().enumerate() {
        let m = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let e = if m > 0.0 { m.log2().floor() as i32 } else { 0 };
        let up = 2f32.powi(10 - e);
        down[t] = 1.0 / up;
        for (i, &v) in row.iter().enumerate() {
            let s = v * up;
            let hi = half::f16::from_f32(s);
            let lo = half::f16::from_f32(s - hi.to_f32());
            b[i * 16 + t] = hi;
            b[i * 16 + 8 + t] = lo;
        }
    }
    (b, down)
}

fn main() {
    if std::env::args().any(|a| a == "--check") {
        match validate() {
            Ok(()) => println!("coop_probe.wgsl: valid"),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
        return;
    }
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all());
    let inst = wgpu::Instance::new(desc);
    let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
    let Some(adapter) = adapters
        .into_iter()
        .find(|a| a.get_info().device_type != wgpu::DeviceType::Cpu)
        .or_else(|| {
            pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
                .into_iter()
                .next()
        })
    else {
        println!("no adapter");
        return;
    };
    let info = adapter.get_info();
    println!("adapter: {} ({:?})", info.name, info.backend);
    let props = adapter.cooperative_matrix_properties();
    for m in &props {
        println!(
            "  matrix unit {}x{}x{} {:?}->{:?} saturating {}",
            m.m_size, m.n_size, m.k_size, m.ab_type, m.cr_type, m.saturating_accumulation
        );
    }
    let want = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    if !adapter.features().contains(want) {
        println!(
            "adapter lacks {:?}: f16 {}, coop {}",
            want,
            adapter.features().contains(wgpu::Features::SHADER_F16),
            adapter
                .features()
                .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        );
        return;
    }
    let mut limits = adapter.limits();
    limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(1 << 31);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("coop_probe"),
        required_features: want,
        required_limits: limits,
        // SAFETY: the probe uses the cooperative-matrix feature only as this file's kernel
        // does; a driver fault ends the probe, not the engine.
        experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    }))
    .expect("device");
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("coop_probe"),
        source: wgpu::ShaderSource::Wgsl(WGSL.into()),
    });
    let pipe = |entry: &str| {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        })
    };
    let (int4, mxfp4) = (pipe("coop_int4"), pipe("coop_mxfp4"));
    for &(rows, k) in &[
        (7168usize, 7168usize),
        (49152, 7168),
        (163840, 7168),
        (1536, 7168),
    ] {
        run_case(&device, &queue, &int4, Format::Int4, rows, k, 64, (1, 0), true);
    }
    // v2 whole (checked), then split (timing only).
    let v2 = pipe("coop_int4_v2");
    for &rows in &[7168usize, 49152, 163840, 1536] {
        print!("v2 ");
        run_case(&device, &queue, &v2, Format::Int4, rows, 7168, 16, (1, 112), true);
    }
    for segs in [4u32, 8, 16, 28] {
        for &rows in &[7168usize, 49152, 163840, 1536] {
            print!("v2 segs {segs}: ");
            run_case(&device, &queue, &v2, Format::Int4, rows, 7168, 16, (segs, 112u32.div_ceil(segs)), false);
        }
    }
    // v3 whole (checked), then split (timing only).
    let v3 = pipe("coop_int4_v3");
    for &rows in &[7168usize, 49152, 163840, 1536] {
        print!("v3 ");
        run_case(&device, &queue, &v3, Format::Int4, rows, 7168, 64, (1, 112), true);
    }
    for segs in [4u32, 8, 16, 28] {
        for &rows in &[7168usize, 49152, 163840, 1536] {
            print!("v3 segs {segs}: ");
            run_case(&device, &queue, &v3, Format::Int4, rows, 7168, 64, (segs, 112u32.div_ceil(segs)), false);
        }
    }
    // Where the time goes, and K split over workgroups (timing only).
    for (entry, segs) in [
        ("coop_mma_only", 1u32),
        ("coop_decode_only", 1),
        ("coop_int4_split", 4),
        ("coop_int4_split", 16),
        ("coop_int4_split", 56),
    ] {
        let p = pipe(entry);
        for &rows in &[7168usize, 163840] {
            print!("{entry} segs {segs}: ");
            run_case(&device, &queue, &p, Format::Int4, rows, 7168, 64, (segs, 112u32.div_ceil(segs)), false);
        }
    }
    // 16 experts' w1|w3 (2 x 3072 rows each) and w2 (7168 x 3072) of one decode step.
    for &(rows, k) in &[(16 * 6144usize, 7168usize), (16 * 7168, 3072)] {
        run_case(&device, &queue, &mxfp4, Format::Mxfp4, rows, k, 64, (1, 0), true);
    }
}

/// The weight format of a case.
#[derive(Clone, Copy, Debug)]
enum Format {
    Int4,
    Mxfp4,
}

/// Column c's weight of row r: int4 times its group scale, or E2M1 times 2^(s - 127).
fn weight(
    f: Format,
    words: &[u32],
    scales: &[f32],
    bytes: &[u8],
    k: usize,
    r: usize,
    c: usize,
) -> f64 {
    let q = words[r * k / 8 + c / 8];
    let n = (q >> (4 * (c % 8))) & 0xF;
    match f {
        Format::Int4 => {
            let v = ((q << (28 - 4 * (c % 8))) as i32 >> 28) as f64;
            v * scales[r * k / 64 + c / 64] as f64
        }
        Format::Mxfp4 => {
            let e = (n >> 1) & 3;
            let m = (n & 1) as f64;
            let mag = if e == 0 {
                0.5 * m
            } else {
                2f64.powi(e as i32 - 1) * (1.0 + 0.5 * m)
            };
            let v = if n >= 8 { -mag } else { mag };
            v * 2f64.powi(bytes[r * k / 32 + c / 32] as i32 - 127)
        }
    }
}

fn run_case(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    pipe: &wgpu::ComputePipeline,
    format: Format,
    rows: usize,
    k: usize,
    rows_per_wg: usize,
    (segs, seg_groups): (u32, u32),
    check: bool,
) {
    use wgpu::util::DeviceExt;
    let mut rng = Lcg(rows as u64 * 31 + k as u64);
    let words: Vec<u32> = (0..rows * k / 8).map(|_| rng.next()).collect();
    let scales: Vec<f32> = (0..rows * k / 64)
        .map(|_| 0.01 * (1.0 + rng.unit() * 0.5))
        .collect();
    let bytes: Vec<u8> = (0..rows * k / 32)
        .map(|_| 118 + (rng.next() % 8) as u8)
        .collect();
    let offsets: Vec<i32> = (0..rows)
        .map(|r| {
            *bytes[r * k / 32..(r + 1) * k / 32]
                .iter()
                .max()
                .unwrap_or(&127) as i32
                - 13
        })
        .collect();
    let tokens = 8usize;
    let x: Vec<Vec<f32>> = (0..tokens)
        .map(|_| (0..k).map(|_| rng.unit() * 3.0).collect())
        .collect();
    let (b, down) = split_x(&x, k);
    let buf = |data: &[u8], usage| {
        device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: data,
            usage,
        })
    };
    let st = wgpu::BufferUsages::STORAGE;
    let params = [rows as u32, k as u32, tokens as u32, seg_groups];
    let pb = buf(bytemuck::cast_slice(&params), wgpu::BufferUsages::UNIFORM);
    let wb = buf(bytemuck::cast_slice(&words), st);
    let sb = buf(bytemuck::cast_slice(&scales), st);
    let bb = buf(bytemuck::cast_slice(&b), st);
    let db = buf(bytemuck::cast_slice(&down), st);
    let ob = buf(bytemuck::cast_slice(&offsets), st);
    let ub = buf(&bytes, st);
    let yb = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: (tokens * rows * 4) as u64,
        usage: st | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let rb = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: (tokens * rows * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &match format {
            Format::Int4 => vec![&pb, &wb, &sb, &bb, &db, &yb],
            Format::Mxfp4 => vec![&pb, &wb, &bb, &db, &yb, &ob, &ub],
        }
        .iter()
        .zip(match format {
            Format::Int4 => vec![0u32, 1, 2, 3, 4, 5],
            Format::Mxfp4 => vec![0u32, 1, 3, 4, 5, 6, 7],
        })
        .map(|(b, i)| wgpu::BindGroupEntry {
            binding: i,
            resource: b.as_entire_binding(),
        })
        .collect::<Vec<_>>(),
    });
    let groups = rows.div_ceil(rows_per_wg) as u32;
    let run = |n: usize| {
        let mut enc = device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(pipe);
            pass.set_bind_group(0, &bg, &[]);
            for _ in 0..n {
                pass.dispatch_workgroups(groups, segs, 1);
            }
        }
        queue.submit([enc.finish()]);
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("poll");
    };
    run(3);
    let reps = 50;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        run(reps);
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    if !check {
        println!("{rows}x{k}: {:.1} us a dispatch", best * 1e6);
        return;
    }
    // Check against the host.
    let mut enc = device.create_command_encoder(&Default::default());
    enc.copy_buffer_to_buffer(&yb, 0, &rb, 0, (tokens * rows * 4) as u64);
    queue.submit([enc.finish()]);
    rb.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let view = rb.slice(..).get_mapped_range().expect("map");
    let got: Vec<f32> = bytemuck::cast_slice(&view).to_vec();
    let (mut max_err, mut max_ref) = (0f64, 0f64);
    for r in (0..rows).step_by((rows / 512).max(1)) {
        for (t, xt) in x.iter().enumerate() {
            let mut s = 0f64;
            for c in 0..k {
                s += weight(format, &words, &scales, &bytes, k, r, c) * xt[c] as f64;
            }
            max_err = max_err.max((s - got[t * rows + r] as f64).abs());
            max_ref = max_ref.max(s.abs());
        }
    }
    let wbytes = (words.len() * 4) as f64
        + match format {
            Format::Int4 => (scales.len() * 4) as f64,
            Format::Mxfp4 => bytes.len() as f64,
        };
    println!(
        "coop {format:?} {rows}x{k}, {tokens} tokens: {:.1} us a dispatch ({:.0} GB/s of weights), max |err| {:.2e} of max |y| {:.2e} ({:.1e} relative)",
        best * 1e6,
        wbytes / best / 1e9,
        max_err,
        max_ref,
        max_err / max_ref
    );
}
