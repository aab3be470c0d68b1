//! MXFP4 (compressed-tensors `mxfp4-pack-quantized`): E2M1 nibbles with E8M0 scales per 32.

use super::kernel::{self, RowSource};
use super::simd::{self, Encoded, EncodedRows, SimdLevel};
use anyhow::{bail, Result};

/// Columns sharing one E8M0 scale.
pub const BLOCK: usize = 32;

/// E2M1 value of a nibble (bits 4-7 are ignored): bit 3 is the sign, bits 0-2 index the
/// magnitudes `0, 0.5, 1, 1.5, 2, 3, 4, 6`: for magnitude codes ≥ 2 the 3-bit code is
/// exactly the top of an f32 exponent and mantissa (`2^(e-1) · (1 + m/2)`), code 1 is the
/// lone subnormal 0.5. Rows decode through a 256-entry table of byte pairs built from it.
#[inline]
pub const fn e2m1(nibble: u8) -> f32 {
    let n = nibble as u32;
    let mag = n & 7;
    let normal = (mag << 22) + (126 << 23);
    let small = if mag == 1 { 0x3F00_0000 } else { 0 };
    let bits = if mag >= 2 { normal } else { small };
    f32::from_bits(bits | ((n & 8) << 28))
}

/// The two E2M1 values of every byte (low nibble first), so a row decodes with one table
/// load per byte instead of the bit arithmetic per nibble; the same values as [`e2m1`].
static E2M1_PAIRS: [[f32; 2]; 256] = {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [e2m1(b as u8 & 15), e2m1(b as u8 >> 4)];
        b += 1;
    }
    t
};

/// E8M0 scale: the f32 whose bit pattern is `s << 23`, i.e. `2^(s-127)` for `1..=254`,
/// `0.0` for `s = 0` and `+inf` for `s = 255` (one definition on every path).
#[inline]
pub fn e8m0(s: u8) -> f32 {
    f32::from_bits(u32::from(s) << 23)
}

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

impl<'a> Mxfp4View<'a> {
    /// Checks the shape against the byte lengths: `cols % 32 == 0`,
    /// `packed.len() == rows · cols/2`, `scales.len() == rows · cols/32`.
    pub fn new(rows: usize, cols: usize, packed: &'a [u8], scales: &'a [u8]) -> Result<Self> {
        if cols % BLOCK != 0 {
            bail!("MXFP4 matrix [{rows}, {cols}]: cols must be a multiple of {BLOCK}");
        }
        let want_packed = rows.checked_mul(cols / 2);
        if want_packed != Some(packed.len()) {
            bail!(
                "MXFP4 matrix [{rows}, {cols}]: weight_packed has {} bytes, expected rows·cols/2 = {}",
                packed.len(),
                want_packed.map_or_else(|| "an overflowing count".to_string(), |v| v.to_string())
            );
        }
        let want_scales = rows * (cols / BLOCK);
        if scales.len() != want_scales {
            bail!(
                "MXFP4 matrix [{rows}, {cols}]: weight_scale has {} bytes, expected rows·cols/32 = {want_scales}",
                scales.len()
            );
        }
        Ok(Self {
            rows,
            cols,
            packed,
            scales,
        })
    }

    /// Decodes row `r` into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (rb, rs) = (self.cols / 2, self.cols / BLOCK);
        let packed = &self.packed[r * rb..(r + 1) * rb];
        let scales = &self.scales[r * rs..(r + 1) * rs];
        for ((dst, src), &s) in out
            .chunks_exact_mut(BLOCK)
            .zip(packed.chunks_exact(BLOCK / 2))
            .zip(scales)
        {
            let scale = e8m0(s);
            for (o, &b) in dst.chunks_exact_mut(2).zip(src) {
                let [lo, hi] = E2M1_PAIRS[usize::from(b)];
                o[0] = lo * scale;
                o[1] = hi * scale;
            }
        }
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        kernel::dequantize(self)
    }

    /// x: [n, cols] row-major, y: [n, rows] row-major (overwritten), on the kernels of the
    /// process's [`simd::level`].
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_with(simd::level(), x, n, y);
    }

    /// [`Self::matmul`] on the kernels of `level` (panics if this CPU cannot run it).
    pub fn matmul_with(&self, level: SimdLevel, x: &[f32], n: usize, y: &mut [f32]) {
        kernel::matmul(self, x, n, y, level);
    }
}

impl RowSource for Mxfp4View<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        self.dequantize_row(r, out);
    }
    fn encoded(&self) -> EncodedRows<'_> {
        EncodedRows {
            data: Encoded::Mxfp4 {
                packed: self.packed,
                scales: self.scales,
            },
            rows: self.rows,
            cols: self.cols,
        }
    }
}
