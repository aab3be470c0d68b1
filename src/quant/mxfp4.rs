//! MXFP4 (compressed-tensors `mxfp4-pack-quantized`): E2M1 nibbles with E8M0 scales per 32.

/// A borrowed MXFP4 matrix `[rows, cols]`: `packed` is `rows · cols/2` bytes (low nibble =
/// even column), `scales` is `rows · cols/32` E8M0 exponents.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4View<'a> {
    /// Output dimension.
    pub rows: usize,
    /// Input dimension (a multiple of 32).
    pub cols: usize,
    /// Packed nibbles.
    pub packed: &'a [u8],
    /// Scale exponents.
    pub scales: &'a [u8],
}
