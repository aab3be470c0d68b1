//! The plain read kernel (`read_bench.wgsl`), the roofline every kernel of the benchmark is
//! judged by: every thread streams vec4<u32> loads through the buffer, so it is read once,
//! coalesced. The bench builds its own pipeline; the engine's shader table holds only what
//! the engine runs.

use k3::backend::gpu::GpuContext;
use wgpu::util::DeviceExt;

/// The read kernel's pipeline on one context.
pub(crate) struct ReadKernel {
    pipeline: wgpu::ComputePipeline,
}

impl ReadKernel {
    /// Compiles the kernel for `ctx`'s device and workgroup size.
    pub(crate) fn new(ctx: &GpuContext) -> Self {
        let module = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("read_bench.wgsl"),
                source: wgpu::ShaderSource::Wgsl(include_str!("read_bench.wgsl").into()),
            });
        let pipeline = ctx
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some("stream_read"),
                layout: None,
                module: &module,
                entry_point: Some("stream_read"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &[("WG", f64::from(ctx.wg))],
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        Self { pipeline }
    }

    /// Records one read of the first `bytes` of `src` into `ctx`'s pending work, its fold
    /// written to `sink`.
    pub(crate) fn dispatch(
        &self,
        ctx: &GpuContext,
        src: &wgpu::Buffer,
        sink: &wgpu::Buffer,
        bytes: u64,
    ) {
        // Enough workgroups to fill a large GPU several times over.
        let groups = ctx
            .limits
            .max_compute_workgroups_per_dimension
            .min(4 * 132 * 8);
        let threads = groups * ctx.wg;
        let params: [u32; 4] = [(bytes / 16) as u32, threads, 0, 0];
        let ubuf = ctx
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("read params"),
                contents: bytemuck::cast_slice(&params),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let bind = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("stream_read"),
            layout: &self.pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: ubuf.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: src.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: sink.as_entire_binding(),
                },
            ],
        });
        ctx.record(|enc| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("stream_read"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        });
    }
}
