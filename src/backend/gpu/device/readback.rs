//! The host-mapped buffer a readback copies into, kept for the next one: a decode step reads
//! back each MoE layer's routing and the logits (5.2 MB a step at 8 streams of K3's
//! vocabulary), and a fresh `MAP_READ` buffer each time costs an allocation and a mapping of
//! new host pages.

use std::sync::Mutex;

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
