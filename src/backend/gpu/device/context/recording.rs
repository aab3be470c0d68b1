//! The pending command encoder every op records into, and its submission: dispatches get
//! a parameter slot in the reused uniform buffers, and the encoder goes to the queue when
//! the host must read, after `submit_every` passes, or when a timestamp query set is full.

use super::GpuContext;
use crate::backend::gpu::device::param_arena::{ParamArena, SLOT_BYTES};
use crate::backend::gpu::device::shaders::Shader;
use std::collections::HashMap;
use wgpu::util::DeviceExt;

/// u32 words of every uniform parameter block (the largest kernel struct has 12).
const PARAM_WORDS: usize = 16;

/// One dispatch: pipeline entry, overrides, the uniform parameters and the storage buffers.
pub struct Dispatch<'a> {
    /// Module family.
    pub shader: Shader,
    /// Entry point.
    pub entry: &'static str,
    /// Pipeline-overridable constants (`WG` defaults to the context's workgroup size).
    pub consts: &'a [(&'static str, u32)],
    /// Uniform block at binding 0 (u32 words; f32 as bits), zero-padded here.
    pub params: &'a [u32],
    /// Storage buffers at bindings 1, 2, ...
    pub buffers: &'a [&'a wgpu::Buffer],
    /// Workgroup counts.
    pub groups: (u32, u32, u32),
}

/// What the host has recorded and not yet submitted.
pub(super) struct Pending {
    /// The encoder and the passes in it.
    cmd: Option<(wgpu::CommandEncoder, usize)>,
    /// The compute pass untimed dispatches go into while nothing else is recorded: a pass
    /// a dispatch cost about 13 µs of GPU time each on an H100, a shared one does not
    /// (docs/perf.md#several-streams-in-one-pass), and wgpu still puts a barrier between dispatches
    /// that share a buffer (each dispatch is its own usage scope). It locks the encoder, so
    /// it ends before anything else is recorded.
    pass: Option<wgpu::ComputePass<'static>>,
    /// Its dispatches' parameters, written just before it is submitted.
    params: ParamArena,
}

impl Pending {
    /// The pending encoder and its pass count, created on demand, with the open compute
    /// pass ended.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut (wgpu::CommandEncoder, usize) {
        self.pass = None;
        self.cmd.get_or_insert_with(|| {
            (
                device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("k3 ops"),
                }),
                0,
            )
        })
    }

    /// Counts one more pass (or dispatch in the open pass) on the pending encoder and
    /// returns the count; the open pass stays open.
    fn count_pass(&mut self) -> usize {
        match &mut self.cmd {
            Some((_, passes)) => {
                *passes += 1;
                *passes
            }
            None => 0,
        }
    }

    /// The open compute pass, begun on the pending encoder when there is none.
    fn compute_pass(&mut self, device: &wgpu::Device) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let (enc, _) = self.encoder(device);
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("k3 dispatches"),
                timestamp_writes: None,
            });
            self.pass = Some(pass.forget_lifetime());
        }
        match &mut self.pass {
            Some(pass) => pass,
            None => unreachable!("the pass was begun above"),
        }
    }
}

impl Pending {
    /// Nothing recorded yet; parameter slots aligned to `uniform_align`.
    pub(super) fn new(uniform_align: u32) -> Self {
        Self {
            cmd: None,
            pass: None,
            params: ParamArena::new(uniform_align),
        }
    }
}

impl GpuContext {
    /// Runs `f` on the pending encoder (created on demand).
    pub fn record<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        self.record_pending(|st| f(&mut st.encoder(&self.device).0))
    }

    /// Runs `f` on what is pending under one lock, counts the pass it records, and submits
    /// once `submit_every` passes are pending.
    fn record_pending<R>(&self, f: impl FnOnce(&mut Pending) -> R) -> R {
        let mut guard = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut guard);
        let full = guard.count_pass() >= self.submit_every;
        drop(guard);
        if full {
            self.flush();
        }
        r
    }

    /// Records one compute dispatch.
    pub fn dispatch(&self, d: &Dispatch<'_>) {
        self.dispatch_at(d, 1..=d.buffers.len() as u32);
    }

    /// Records a dispatch whose storage buffers go to the given binding numbers, for entry
    /// points that use only some of their module's bindings (a pipeline's derived layout
    /// holds only the bindings its entry point uses).
    pub fn dispatch_at(&self, d: &Dispatch<'_>, bindings: impl IntoIterator<Item = u32>) {
        let pipe = self.pipeline(d.shader, d.entry, d.consts);
        // Every parameter block is padded to one size, at least as large as any kernel's.
        let mut words = d.params.to_vec();
        words.resize(words.len().max(PARAM_WORDS).div_ceil(4) * 4, 0);
        let words: &[u8] = bytemuck::cast_slice(&words);
        let timed = self.profile_slot(d.entry, d.groups);
        let layout = pipe.get_bind_group_layout(0);
        let bind = |params: wgpu::BindingResource<'_>| {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: params,
            }];
            for (b, binding) in d.buffers.iter().zip(bindings) {
                entries.push(wgpu::BindGroupEntry {
                    binding,
                    resource: b.as_entire_binding(),
                });
            }
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.entry),
                layout: &layout,
                entries: &entries,
            })
        };
        let encode = |enc: &mut wgpu::CommandEncoder, bg: &wgpu::BindGroup| {
            let timestamp_writes = timed
                .as_ref()
                .map(|(qs, k)| wgpu::ComputePassTimestampWrites {
                    query_set: qs,
                    beginning_of_pass_write_index: Some(*k),
                    end_of_pass_write_index: Some(k + 1),
                });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.entry),
                timestamp_writes,
            });
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        };
        if words.len() > SLOT_BYTES {
            let ubuf = self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: words,
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            let bg = bind(ubuf.as_entire_binding());
            self.record(|enc| encode(enc, &bg));
            return;
        }
        // The slot, the bind group and the pass go in under one lock, so the slot belongs
        // to the submission that carries the pass.
        self.record_pending(|st| {
            let bg = bind(wgpu::BindingResource::Buffer(
                st.params.push(&self.device, words),
            ));
            if timed.is_some() {
                encode(&mut st.encoder(&self.device).0, &bg);
                return;
            }
            let pass = st.compute_pass(&self.device);
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        });
    }

    /// Records a buffer-to-buffer copy.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    ) {
        if bytes > 0 {
            self.record(|enc| enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes));
        }
    }

    /// The per-kernel GPU times so far (work submitted and waited for), when profiling.
    pub fn profile_report(&self) -> Option<String> {
        self.flush();
        let prof = self.profiler.as_ref()?;
        Some(prof.lock().unwrap_or_else(|e| e.into_inner()).report())
    }

    /// The per-kernel GPU times since the last take (work submitted and waited for), when
    /// profiling; the totals start again from zero.
    pub fn profile_take(&self) -> Option<String> {
        self.flush();
        let prof = self.profiler.as_ref()?;
        Some(prof.lock().unwrap_or_else(|e| e.into_inner()).take_report())
    }

    /// The per-kernel passes and GPU seconds so far (work submitted and waited for), when
    /// profiling.
    pub fn profile_by_entry(&self) -> Option<HashMap<&'static str, (u64, f64)>> {
        self.flush();
        let prof = self.profiler.as_ref()?;
        Some(prof.lock().unwrap_or_else(|e| e.into_inner()).by_entry())
    }

    /// When profiling, the query set and first index of the next pass's timestamps (the
    /// pending work submitted first when every query is taken).
    fn profile_slot(
        &self,
        entry: &'static str,
        groups: (u32, u32, u32),
    ) -> Option<(wgpu::QuerySet, u32)> {
        let prof = self.profiler.as_ref()?;
        loop {
            let next = prof
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .next_pass(entry, groups);
            if next.is_some() {
                return next;
            }
            self.flush();
        }
    }

    /// Submits the pending encoder, if any (when profiling, with its passes' timestamps,
    /// which it then waits for), and returns its submission.
    pub fn flush(&self) -> Option<wgpu::SubmissionIndex> {
        // The parameter slots are written and the encoder submitted under the lock, so no
        // other thread stages the next submission's slots in between.
        let mut guard = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        guard.pass = None;
        let (mut enc, _) = guard.cmd.take()?;
        guard.params.write(&self.queue);
        let Some(prof) = &self.profiler else {
            return Some(self.queue.submit([enc.finish()]));
        };
        let mut prof = prof.lock().unwrap_or_else(|e| e.into_inner());
        let n = prof.resolve(&mut enc);
        let index = self.queue.submit([enc.finish()]);
        drop(guard);
        if let Err(e) = prof.collect(&self.device, n) {
            tracing::error!("[K3-GPU] {e:#}");
        }
        Some(index)
    }
}
