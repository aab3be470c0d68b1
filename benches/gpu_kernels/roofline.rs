//! The roofline every case of the kernel benchmark is judged by: the plain read kernel over
//! the same bytes, its runs alternated with the case's, after heating the GPU.

use super::read_kernel::ReadKernel;
use super::REPS;
use k3::backend::gpu::GpuBackend;
use std::time::Instant;

/// The read kernel, the heater's buffers and the timestamp queries of one adapter.
pub(crate) struct Roofline {
    read: ReadKernel,
    /// The heater's 64 MiB source and its sink.
    heater: (wgpu::Buffer, wgpu::Buffer),
    qs: Option<wgpu::QuerySet>,
    /// Seconds of back-to-back read passes before each line (0: none).
    heat_secs: f64,
}

impl Roofline {
    /// The roofline on `g`'s adapter, heating `heat_secs` before each line.
    pub(crate) fn new(g: &GpuBackend, heat_secs: f64) -> Self {
        let ctx = &g.ctx;
        Self {
            read: ReadKernel::new(ctx),
            heater: (
                ctx.buffer((64 << 20).min(ctx.max_binding) / 16 * 16, "heater"),
                ctx.buffer(4 << 20, "heater sink"),
            ),
            qs: ctx.has_timestamps().then(|| {
                ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("bench"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                })
            }),
            heat_secs,
        }
    }

    /// The median time of `f`'s recorded work against the read kernel's over `bytes`, their
    /// runs alternated, as one line.
    pub(crate) fn line(&self, g: &GpuBackend, name: &str, bytes: u64, f: &mut dyn FnMut()) {
        let ctx = &g.ctx;
        let bytes = bytes.max(16);
        let rbytes = bytes.min(ctx.max_binding) / 16 * 16;
        let (src, sink) = (ctx.buffer(rbytes, "read src"), ctx.buffer(4 << 20, "sink"));
        let mut read = || self.read.dispatch(ctx, &src, &sink, rbytes);
        f();
        read();
        g.sync().unwrap();
        // Heat: back-to-back read passes, so the line starts at the GPU's full clock.
        let t0 = Instant::now();
        let (hs, hk) = &self.heater;
        while t0.elapsed().as_secs_f64() < self.heat_secs {
            (0..64).for_each(|_| self.read.dispatch(ctx, hs, hk, hs.size()));
            g.sync().unwrap();
        }
        let mut secs = [Vec::new(), Vec::new()];
        for _ in 0..REPS {
            secs[0].push(self.time(g, &mut *f));
            secs[1].push(self.time(g, &mut read));
        }
        let [s, r] = secs.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[REPS / 2]
        });
        let (bw, rbw) = (bytes as f64 / s / 1e9, rbytes as f64 / r / 1e9);
        println!(
            "{name:<28} {:>9.1} MB {:>9.1} us {:>8.1} GB/s   read {:>8.1} GB/s   {:>5.1} % of read",
            bytes as f64 / 1e6,
            s * 1e6,
            bw,
            rbw,
            100.0 * bw / rbw
        );
    }

    /// Seconds of `f`'s recorded work: between two timestamps where the adapter has them,
    /// else the wall clock around a full sync.
    fn time(&self, g: &GpuBackend, f: &mut dyn FnMut()) -> f64 {
        let ctx = &g.ctx;
        let Some(qs) = &self.qs else {
            let t0 = Instant::now();
            f();
            g.sync().unwrap();
            return t0.elapsed().as_secs_f64();
        };
        ctx.record(|e| e.write_timestamp(qs, 0));
        f();
        ctx.record(|e| e.write_timestamp(qs, 1));
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        ctx.record(|e| e.resolve_query_set(qs, 0..2, &resolve, 0));
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&ctx.read(&resolve, 0, 16).unwrap());
        ticks[1].saturating_sub(ticks[0]) as f64
            * f64::from(ctx.queue.get_timestamp_period())
            * 1e-9
    }
}
