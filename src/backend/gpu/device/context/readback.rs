//! Readbacks: device buffers copied to the host after all recorded work, through a
//! host-mapped buffer kept for the next one. A decode step reads back each MoE layer's
//! routing and the logits (5.2 MB a step at 8 streams of K3's vocabulary), and a fresh
//! `MAP_READ` buffer each time costs an allocation and a mapping of new host pages.

use super::GpuContext;
use crate::backend::split_pieces;
use anyhow::{anyhow, Result};
use std::sync::{mpsc, Mutex};

/// The largest buffer kept: a prompt's every-row logits can be gigabytes, which stay held
/// by nobody once read.
const KEEP_AT_MOST: u64 = 64 << 20;

/// The buffer kept between readbacks, if any.
#[derive(Default)]
pub(crate) struct Readback {
    kept: Mutex<Option<wgpu::Buffer>>,
}

impl Readback {
    /// A buffer of at least `size` bytes to copy into and map: the kept one where it is
    /// large enough, else a new one (sizes rounded up to a power of two, so a step's
    /// readbacks settle on one buffer).
    pub(crate) fn take(&self, device: &wgpu::Device, size: u64) -> wgpu::Buffer {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        match kept.take() {
            Some(b) if b.size() >= size => b,
            old => {
                // A smaller one goes back for the next small readback.
                *kept = old;
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("readback"),
                    size: size.next_power_of_two().max(wgpu::COPY_BUFFER_ALIGNMENT),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            }
        }
    }

    /// `b` (unmapped) back for the next readback, where it is the largest seen and not
    /// over [`KEEP_AT_MOST`].
    pub(crate) fn give_back(&self, b: wgpu::Buffer) {
        if b.size() > KEEP_AT_MOST {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.as_ref().is_none_or(|k| k.size() < b.size()) {
            *kept = Some(b);
        }
    }
}

impl GpuContext {
    /// Copies `bytes` from `buf` at `offset` to the host, after all recorded work.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        self.read_with(buf, offset, bytes, |mapped| mapped.to_vec())
    }

    /// Copies `values` f32 from `buf` at `offset` to the host, after all recorded work:
    /// straight from the mapped readback into the vector (a head's logits are megabytes a
    /// step, and each host copy of them costs the step a fraction of a millisecond).
    pub fn read_f32(&self, buf: &wgpu::Buffer, offset: u64, values: usize) -> Result<Vec<f32>> {
        if values == 0 {
            return Ok(Vec::new());
        }
        let mut out = vec![0f32; values];
        self.read_with(buf, offset, (values * 4) as u64, |mapped| {
            bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(mapped);
        })?;
        Ok(out)
    }

    /// The first `values` f32 of `buf` as consecutive pieces of `lens` values (which add up
    /// to `values`), each copied straight from the mapping ([`split_pieces`]).
    pub fn read_f32_pieces(
        &self,
        buf: &wgpu::Buffer,
        values: usize,
        lens: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        if values == 0 {
            return split_pieces(&[], lens);
        }
        self.read_with(buf, 0, (values * 4) as u64, |mapped| {
            match bytemuck::try_cast_slice::<u8, f32>(mapped) {
                Ok(all) => split_pieces(all, lens),
                // A mapping not aligned to 4 bytes (no driver known to give one): one copy more.
                Err(_) => split_pieces(&bytemuck::pod_collect_to_vec::<u8, f32>(mapped), lens),
            }
        })?
    }

    /// `f` on `bytes` (not 0) of `buf` from `offset`, mapped on the host after all recorded
    /// work.
    fn read_with<T>(
        &self,
        buf: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<T> {
        let pending = self.begin_read(buf, offset, bytes);
        self.finish_read(pending, f)
    }

    /// Begins reading `bytes` (not 0) of `buf` from `offset` after all recorded work: the
    /// copy is submitted and its mapping asked for. What is recorded and submitted before
    /// [`Self::finish_read`] runs on the device while the host waits there.
    pub(crate) fn begin_read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> PendingRead {
        let size = bytes.div_ceil(4) * 4;
        let staging = self.readback.take(&self.device, size);
        self.record(|enc| enc.copy_buffer_to_buffer(buf, offset, &staging, 0, size));
        let submission = self.flush();
        let (tx, mapped) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| {
            let _ = tx.send(r);
        });
        PendingRead {
            staging,
            size,
            bytes,
            submission,
            mapped,
        }
    }

    /// `f` on a begun readback's bytes, once the submission that carries its copy is done
    /// (not what was submitted after it).
    pub(crate) fn finish_read<T>(&self, p: PendingRead, f: impl FnOnce(&[u8]) -> T) -> Result<T> {
        let PendingRead {
            staging,
            size,
            bytes,
            submission,
            mapped,
        } = p;
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: submission,
                timeout: None,
            })
            .map_err(|e| anyhow!("waiting for the GPU on {}: {e}", self.info.name))?;
        let mapped = mapped
            .recv()
            .map_err(|_| anyhow!("GPU readback was dropped"))?;
        // An error the device reported earlier explains a failed map better than the map.
        self.check_errors()?;
        mapped.map_err(|e| anyhow!("mapping the readback buffer: {e}"))?;
        let out = f(&staging
            .get_mapped_range(..size)
            .map_err(|e| anyhow!("reading back: {e:?}"))?[..bytes as usize]);
        staging.unmap();
        self.readback.give_back(staging);
        Ok(out)
    }
}

/// A readback under way ([`GpuContext::begin_read`]): its copy submitted, its mapping asked
/// for.
pub(crate) struct PendingRead {
    staging: wgpu::Buffer,
    size: u64,
    bytes: u64,
    /// The submission that carries the copy.
    submission: Option<wgpu::SubmissionIndex>,
    mapped: mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
}
