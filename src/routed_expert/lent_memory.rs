//! Memory a backend lends for expert reads, so the bytes land where its device copies them
//! from: the GPU backend's upload staging, on GPUs whose staging is host memory. The read
//! then needs no second host copy into that staging.

use std::any::Any;

/// A lender of read destinations.
pub trait ReadLender: Send + Sync {
    /// A region of at least `len` bytes that starts on an [`IO_ALIGN`] boundary and spans
    /// whole blocks of it, or `None` when none is free now (the read then goes to host memory).
    ///
    /// [`IO_ALIGN`]: crate::platform::aligned_buf::IO_ALIGN
    fn lend(&self, len: usize) -> Option<Box<dyn LentRegion>>;

    /// A read into a lent region failed where the same read into host memory succeeded:
    /// the lender stops lending (it says so once) and reads go to host memory from then on.
    fn refuse(&self, why: &str);
}

/// One lent region, owned by the expert read into it until the expert is dropped.
pub trait LentRegion: Send + Sync {
    /// The bytes to read into; empty once the backend has taken the region for its device.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// The region as `Any`, for its lender to find its own type again.
    fn as_any(&self) -> &dyn Any;
}
