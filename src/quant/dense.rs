//! [`DenseMatrix`] and [`DenseFormat`]: construction in any load-time format, and the
//! CPU kernels dispatched to the format's module.

use super::kernel::{self, RowSource};
use super::simd::{self, Encoded, EncodedRows, SimdLevel};
use super::{bf16, int4, int8, DenseData, DenseFormat, DenseMatrix};
use anyhow::{bail, Result};

impl DenseFormat {
    /// The format of a `K3_BITS`-style bit count: 4, 8, 16 or 32.
    pub fn from_bits(bits: u32) -> Result<Self> {
        Ok(match bits {
            4 => Self::Int4,
            8 => Self::Int8,
            16 => Self::Bf16,
            32 => Self::F32,
            other => bail!(
                "unsupported dense weight bits {other}: allowed 4 (int4 group 64), \
                 8 (int8 per row), 16 (bf16), 32 (f32)"
            ),
        })
    }

    /// Bits per weight as named by `K3_BITS` (scales not counted).
    pub fn bits(&self) -> u32 {
        match self {
            Self::Int4 => 4,
            Self::Int8 => 8,
            Self::Bf16 => 16,
            Self::F32 => 32,
        }
    }
}

/// Row-major f32 `[rows, cols]` as a [`RowSource`].
struct F32Rows<'a> {
    values: &'a [f32],
    rows: usize,
    cols: usize,
}

impl RowSource for F32Rows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        out.copy_from_slice(self.row(r));
    }
    fn borrowed(&self, r: usize) -> Option<&[f32]> {
        Some(self.row(r))
    }
    fn encoded(&self) -> EncodedRows<'_> {
        EncodedRows {
            data: Encoded::F32(self.values),
            rows: self.rows,
            cols: self.cols,
        }
    }
}

impl F32Rows<'_> {
    fn row(&self, r: usize) -> &[f32] {
        &self.values[r * self.cols..(r + 1) * self.cols]
    }
}

fn check_len(what: &str, rows: usize, cols: usize, len: usize) -> Result<()> {
    if rows.checked_mul(cols) != Some(len) {
        bail!("{what}: {len} values given for a [{rows}, {cols}] matrix (need rows·cols)");
    }
    Ok(())
}

/// Binds `$src` to the matrix's [`RowSource`] and evaluates `$body` (static dispatch per
/// format: a closure cannot be generic over the four source types).
macro_rules! with_rows {
    ($m:expr, $src:ident => $body:expr) => {{
        let (rows, cols) = ($m.rows, $m.cols);
        match &$m.data {
            DenseData::F32(values) => {
                let $src = F32Rows { values, rows, cols };
                $body
            }
            DenseData::Bf16(bits) => {
                let $src = bf16::Bf16Rows { bits, rows, cols };
                $body
            }
            DenseData::Int8 { q, scale } => {
                let $src = int8::Int8Rows {
                    q,
                    scale,
                    rows,
                    cols,
                };
                $body
            }
            DenseData::Int4 { q, scale } => {
                let $src = int4::Int4Rows {
                    packed: q,
                    scale,
                    rows,
                    cols,
                };
                $body
            }
        }
    }};
}

impl DenseMatrix {
    /// Encodes row-major f32 values: quantizes for Int8/Int4, rounds to bf16
    /// (round-to-nearest-even) for Bf16, keeps them for F32.
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>, fmt: DenseFormat) -> Result<Self> {
        check_len("DenseMatrix::from_f32", rows, cols, values.len())?;
        let data = match fmt {
            DenseFormat::F32 => DenseData::F32(values),
            DenseFormat::Bf16 => DenseData::Bf16(bf16::round(&values)),
            DenseFormat::Int8 => {
                let (q, scale) = int8::quantize(rows, cols, &values)?;
                DenseData::Int8 { q, scale }
            }
            DenseFormat::Int4 => {
                let (q, scale) = int4::quantize(rows, cols, &values)?;
                DenseData::Int4 { q, scale }
            }
        };
        Ok(Self { rows, cols, data })
    }

    /// Encodes row-major bf16 bit patterns: Bf16 keeps the bits exactly, F32 widens exactly,
    /// Int8/Int4 quantize the widened values row by row (no whole f32 copy).
    pub fn from_bf16(rows: usize, cols: usize, bits: Vec<u16>, fmt: DenseFormat) -> Result<Self> {
        check_len("DenseMatrix::from_bf16", rows, cols, bits.len())?;
        let row = |r: usize, out: &mut [f32]| {
            bf16::decode_row(&bits[r * cols..(r + 1) * cols], out);
        };
        let data = match fmt {
            DenseFormat::Int8 => {
                let (q, scale) = int8::quantize_rows(rows, cols, row)?;
                DenseData::Int8 { q, scale }
            }
            DenseFormat::Int4 => {
                let (q, scale) = int4::quantize_rows(rows, cols, row)?;
                DenseData::Int4 { q, scale }
            }
            DenseFormat::F32 => DenseData::F32(bits.iter().map(|&b| bf16::widen(b)).collect()),
            DenseFormat::Bf16 => DenseData::Bf16(bits),
        };
        Ok(Self { rows, cols, data })
    }

    /// Encodes row-major little-endian bf16 bytes as stored in a shard (`2 · rows · cols`
    /// bytes, any alignment): the same result as [`Self::from_bf16`] of their bit patterns,
    /// without first copying them out. Int8/Int4 quantize straight from the bytes, rows in
    /// parallel, so reading the source and quantizing overlap across threads.
    pub fn from_bf16_bytes(
        rows: usize,
        cols: usize,
        bytes: &[u8],
        fmt: DenseFormat,
    ) -> Result<Self> {
        if rows.checked_mul(cols).and_then(|n| n.checked_mul(2)) != Some(bytes.len()) {
            bail!(
                "DenseMatrix::from_bf16_bytes: {} bytes given for a bf16 [{rows}, {cols}] matrix \
                 (need 2·rows·cols)",
                bytes.len()
            );
        }
        let row = |r: usize, out: &mut [f32]| {
            let src = &bytes[r * cols * 2..(r + 1) * cols * 2];
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::widen(u16::from_le_bytes([b[0], b[1]]));
            }
        };
        let data = match fmt {
            DenseFormat::Int8 => {
                let (q, scale) = int8::quantize_rows(rows, cols, row)?;
                DenseData::Int8 { q, scale }
            }
            DenseFormat::Int4 => {
                let (q, scale) = int4::quantize_rows(rows, cols, row)?;
                DenseData::Int4 { q, scale }
            }
            DenseFormat::F32 | DenseFormat::Bf16 => {
                let bits = bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                return Self::from_bf16(rows, cols, bits, fmt);
            }
        };
        Ok(Self { rows, cols, data })
    }

    /// The format the payload is stored in.
    pub fn format(&self) -> DenseFormat {
        match self.data {
            DenseData::F32(_) => DenseFormat::F32,
            DenseData::Bf16(_) => DenseFormat::Bf16,
            DenseData::Int8 { .. } => DenseFormat::Int8,
            DenseData::Int4 { .. } => DenseFormat::Int4,
        }
    }

    /// Payload bytes, scales included.
    pub fn byte_size(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        match &self.data {
            DenseData::F32(v) => v.len() * f,
            DenseData::Bf16(v) => v.len() * 2,
            DenseData::Int8 { q, scale } => q.len() + scale.len() * f,
            DenseData::Int4 { q, scale } => q.len() + scale.len() * f,
        }
    }

    /// Decodes row `r` into `out` (`cols` values), e.g. for an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        with_rows!(self, src => src.decode(r, out));
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        with_rows!(self, src => kernel::dequantize(&src))
    }

    /// `y = x · Wᵀ` for `x: [n, cols]`, `y: [n, rows]` (row-major, y overwritten), on the
    /// kernels of the process's [`simd::level`].
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_with(simd::level(), x, n, y);
    }

    /// [`Self::matmul`] on the kernels of `level` (panics if this CPU cannot run it).
    pub fn matmul_with(&self, level: SimdLevel, x: &[f32], n: usize, y: &mut [f32]) {
        with_rows!(self, src => kernel::matmul(&src, x, n, y, level));
    }
}
