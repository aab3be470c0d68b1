//! Kernel parameters of one submission, kept in slots of reused uniform buffers.
//!
//! Every dispatch used to make its own uniform buffer with its words written at creation: a
//! buffer, an allocation and (wgpu stages writes at creation through a second buffer and a
//! copy) a staging buffer per kernel, 100-odd of each per decode token. Here a dispatch
//! takes the next slot of the pending submission; the slots' words are written with one
//! `Queue::write_buffer` per buffer just before the submission (wgpu orders that write
//! after every earlier submission, which read the slots' previous words, and before this
//! one), and the buffers serve every later submission.

use std::num::NonZeroU64;

/// Slots per uniform buffer.
const SLOTS: usize = 256;

/// The largest parameter block a slot holds; larger ones get a buffer of their own.
pub(crate) const SLOT_BYTES: usize = 256;

/// Slots of the pending submission and the buffers that hold them.
pub(crate) struct ParamArena {
    /// Bytes from one slot to the next: `SLOT_BYTES` rounded up to the device's uniform
    /// offset alignment.
    stride: usize,
    buffers: Vec<wgpu::Buffer>,
    /// The pending submission's words, slot after slot.
    staged: Vec<u8>,
}

impl ParamArena {
    /// An empty arena for a device whose uniform bindings start at multiples of `align`.
    pub(crate) fn new(align: u32) -> Self {
        Self {
            stride: SLOT_BYTES.div_ceil(align as usize) * align as usize,
            buffers: Vec::new(),
            staged: Vec::new(),
        }
    }

    /// Stages `words` (at most `SLOT_BYTES`) for the pending submission and returns the
    /// binding of their slot.
    pub(crate) fn push(&mut self, device: &wgpu::Device, words: &[u8]) -> wgpu::BufferBinding<'_> {
        debug_assert!(words.len() <= SLOT_BYTES && !words.is_empty());
        let slot = self.staged.len() / self.stride;
        let (buf, within) = (slot / SLOTS, slot % SLOTS);
        if buf == self.buffers.len() {
            self.buffers
                .push(device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("params"),
                    size: (SLOTS * self.stride) as u64,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }));
        }
        let start = self.staged.len();
        self.staged.extend_from_slice(words);
        self.staged.resize(start + self.stride, 0);
        // The binding spans the whole slot: D3D12 rounds constant buffer views up to 256
        // bytes, which a slot always holds.
        wgpu::BufferBinding {
            buffer: &self.buffers[buf],
            offset: (within * self.stride) as u64,
            size: NonZeroU64::new(self.stride as u64),
        }
    }

    /// Writes the staged slots through `queue` (call right before the submission that
    /// reads them) and starts the next submission at slot 0.
    pub(crate) fn write(&mut self, queue: &wgpu::Queue) {
        for (buf, words) in self
            .buffers
            .iter()
            .zip(self.staged.chunks(SLOTS * self.stride))
        {
            queue.write_buffer(buf, 0, words);
        }
        self.staged.clear();
    }
}
