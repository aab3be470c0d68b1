//! A byte buffer whose start is aligned for O_DIRECT reads.

use std::ops::{Deref, DerefMut};

/// Alignment O_DIRECT needs for buffers, offsets and lengths on the filesystems we meet.
pub const IO_ALIGN: usize = 4096;

/// `len` bytes starting at an `IO_ALIGN` boundary inside an owned allocation.
pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// Zeroed buffer of `len` bytes (rounded up to whole alignment blocks for the device).
    pub fn new(len: usize) -> Self {
        let cap = round_up(len) + IO_ALIGN;
        let raw = vec![0u8; cap];
        let addr = raw.as_ptr() as usize;
        let start = (IO_ALIGN - addr % IO_ALIGN) % IO_ALIGN;
        Self { raw, start, len }
    }

    /// The whole aligned region including the padding up to a block boundary.
    pub fn block_region_mut(&mut self) -> &mut [u8] {
        let end = self.start + round_up(self.len);
        &mut self.raw[self.start..end]
    }
}

/// Rounds `n` up to a multiple of [`IO_ALIGN`].
pub fn round_up(n: usize) -> usize {
    n.div_ceil(IO_ALIGN) * IO_ALIGN
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_is_aligned_and_region_is_whole_blocks() {
        for len in [0, 1, 4095, 4096, 4097, 100_000] {
            let mut b = AlignedBuf::new(len);
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(b.len(), len);
            assert_eq!(b.block_region_mut().len() % IO_ALIGN, 0);
            assert!(b.block_region_mut().len() >= len);
        }
    }
}
