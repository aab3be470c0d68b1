//! The instruction set of the CPU kernels, chosen once at start, and the fused row kernels
//! of every weight format dispatched on it.
//!
//! A fused kernel reads a weight row in its stored encoding and computes its dot product
//! with up to `MAX_TOKENS` activation rows at once, in the same operation order for each
//! token whatever their number: a matvec (one token) and a chunk matmul (many) give the
//! same bits per output. The portable decode-then-dot kernels stay the reference each
//! SIMD kernel is tested against.

/// Defines an ISA module's `dot_tokens` (the entry [`dot_tokens`] dispatches to): checks the
/// token rows against the matrix, slices row `r` of its encoding and hands it to the
/// module's row kernels (`f32_row`, `bf16_row`, `int8_row`, `int4_row`, `mxfp4_row`), all
/// compiled with `$features`. `$split` is the column block the module's [`prepare`]d x
/// comes in. The prologue is written once here; the modules supply only row kernels.
macro_rules! isa_dot_tokens {
    ($features:literal, $split:expr) => {
        /// Fused `w[r] · x_t` for every token (see [`super::dot_tokens`]).
        ///
        /// # Safety
        /// The CPU must have the target features this function enables.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn dot_tokens<const T: usize>(
            w: &EncodedRows<'_>,
            r: usize,
            xs: &[&[f32]; T],
            xp: &[&[f32]; T],
        ) -> [f32; T] {
            const { assert!(T <= MAX_TOKENS) };
            let c = w.cols;
            for t in 0..T {
                assert!(
                    xs[t].len() == c,
                    "fused dot: x row of {} for {c} columns",
                    xs[t].len()
                );
                if w.packs_nibbles() {
                    assert!(
                        xp[t].len() >= c / $split * $split,
                        "fused dot: short prepared x"
                    );
                }
            }
            match w.data {
                Encoded::F32(v) => f32_row(&v[r * c..(r + 1) * c], xs),
                Encoded::Bf16(b) => bf16_row(&b[r * c..(r + 1) * c], xs),
                Encoded::Int8 { q, scale } => {
                    let s = scale[r];
                    int8_row(&q[r * c..(r + 1) * c], xs).map(|v| v * s)
                }
                Encoded::Int4 { packed, scale } => {
                    let (rb, rg) = (int4::row_bytes(c), int4::row_groups(c));
                    int4_row(
                        &packed[r * rb..(r + 1) * rb],
                        &scale[r * rg..(r + 1) * rg],
                        c,
                        xs,
                        xp,
                    )
                }
                Encoded::Mxfp4 { packed, scales } => {
                    let (rb, rs) = (c / 2, c / mxfp4::BLOCK);
                    mxfp4_row(
                        &packed[r * rb..(r + 1) * rb],
                        &scales[r * rs..(r + 1) * rs],
                        xs,
                        xp,
                    )
                }
            }
        }
    };
}
use isa_dot_tokens;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
pub(crate) mod idot_neon;
#[cfg(target_arch = "x86_64")]
pub(crate) mod idot_x86;
mod layout;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod vector;

use anyhow::{bail, Result};
use std::sync::OnceLock;

/// Tokens one fused kernel call serves (the accumulators of four tokens fit the sixteen
/// AVX2 registers beside the decoded weights).
pub(crate) const MAX_TOKENS: usize = 4;

/// Columns per block accumulator: each block's partial sums are added into the row's
/// accumulators, which keeps f32 sums short (a few terms per lane per block).
pub(crate) const BLOCK_COLS: usize = 64;

/// The instruction set the CPU kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Plain Rust: decode each row to f32, then a 16-lane dot product.
    Portable,
    /// x86-64 AVX2 with FMA.
    Avx2Fma,
    /// x86-64 AVX-512 (foundation), with AVX2 and FMA.
    Avx512,
    /// aarch64 Advanced SIMD (NEON).
    Neon,
}

impl SimdLevel {
    /// The name printed on the backend line and accepted by `K3_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2Fma => "avx2+fma",
            Self::Avx512 => "avx512",
            Self::Neon => "neon",
        }
    }

    /// Whether this CPU can run the level's kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2Fma.is_supported() && std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(target_arch = "aarch64")]
            Self::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }

    /// Every level this CPU can run, portable first, the fastest last.
    pub fn available() -> Vec<SimdLevel> {
        [Self::Portable, Self::Avx2Fma, Self::Avx512, Self::Neon]
            .into_iter()
            .filter(|l| l.is_supported())
            .collect()
    }

    /// The fastest level this CPU can run.
    pub fn detect() -> SimdLevel {
        Self::available().pop().unwrap_or(SimdLevel::Portable)
    }

    /// Parses a `K3_SIMD` value: `auto`, `portable`, `avx2` (or `avx2+fma`), `avx512`,
    /// `neon`.
    pub fn from_name(name: &str) -> Result<SimdLevel> {
        let level = match name.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => return Ok(Self::detect()),
            "portable" => Self::Portable,
            "avx2" | "avx2+fma" => Self::Avx2Fma,
            "avx512" => Self::Avx512,
            "neon" => Self::Neon,
            other => bail!("K3_SIMD={other:?}: use auto, portable, avx2, avx512 or neon"),
        };
        if !level.is_supported() {
            bail!(
                "K3_SIMD={name}: this CPU cannot run {} kernels (it has: {})",
                level.name(),
                Self::available()
                    .iter()
                    .map(|l| l.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(level)
    }
}

static LEVEL: OnceLock<SimdLevel> = OnceLock::new();

/// The level the CPU kernels use: set by [`configure`], else the fastest the CPU has
/// (detected once).
pub fn level() -> SimdLevel {
    *LEVEL.get_or_init(SimdLevel::detect)
}

/// Chooses the level `wanted` names (`K3_SIMD`, read by the command line; `None`: the
/// fastest the CPU has) and fixes it for the process; a later call returns the level
/// already fixed.
pub fn configure(wanted: Option<&str>) -> Result<SimdLevel> {
    let wanted = match wanted {
        Some(v) => SimdLevel::from_name(v)?,
        None => SimdLevel::detect(),
    };
    Ok(*LEVEL.get_or_init(|| wanted))
}

/// A weight matrix's rows in their stored encoding, for the fused kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Encoded<'a> {
    /// Row-major f32.
    F32(&'a [f32]),
    /// Row-major bf16 bit patterns.
    Bf16(&'a [u16]),
    /// Row-major int8 with one scale per row.
    Int8 { q: &'a [i8], scale: &'a [f32] },
    /// int4 nibbles, rows padded to whole bytes, one scale per 64 columns.
    Int4 { packed: &'a [u8], scale: &'a [f32] },
    /// MXFP4 nibbles with one E8M0 exponent per 32 columns (cols a multiple of 32).
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// An [`Encoded`] matrix with its shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EncodedRows<'a> {
    /// The payload.
    pub(crate) data: Encoded<'a>,
    /// Output dimension.
    pub(crate) rows: usize,
    /// Input dimension.
    pub(crate) cols: usize,
}

impl EncodedRows<'_> {
    /// Whether the fused kernels read x in a [`prepare`]d layout (the nibble formats,
    /// whose low and high nibbles decode to even and odd columns).
    pub(crate) fn packs_nibbles(&self) -> bool {
        matches!(self.data, Encoded::Int4 { .. } | Encoded::Mxfp4 { .. })
    }
}

/// One row of x in the layout `level`'s nibble kernels read (see [`layout`]); empty for a
/// level without them.
pub(crate) fn prepare(level: SimdLevel, x: &[f32]) -> Vec<f32> {
    match level {
        SimdLevel::Avx2Fma => layout::top_byte_lanes(x),
        SimdLevel::Neon | SimdLevel::Avx512 => layout::pair_split(x),
        SimdLevel::Portable => Vec::new(),
    }
}

/// `out[t] = Σ_c w[r, c] · x_t[c]` for the `T ≤ MAX_TOKENS` tokens `xs` (natural order);
/// `xp` holds the same rows [`prepare`]d where the format packs nibbles (else the same
/// slices as `xs`).
pub(crate) fn dot_tokens<const T: usize>(
    level: SimdLevel,
    w: &EncodedRows<'_>,
    r: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [f32; T] {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2Fma => {
            debug_assert!(level.is_supported());
            // SAFETY: a level other than Portable only reaches here after
            // `is_supported()` confirmed AVX2 and FMA (checked by every matmul entry).
            unsafe { avx2::dot_tokens(w, r, xs, xp) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            debug_assert!(level.is_supported());
            // SAFETY: AVX-512F, AVX2 and FMA were confirmed by `is_supported()` at the
            // matmul entry.
            unsafe { avx512::dot_tokens(w, r, xs, xp) }
        }
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => {
            debug_assert!(level.is_supported());
            // SAFETY: NEON was confirmed by `is_supported()` at the matmul entry.
            unsafe { neon::dot_tokens(w, r, xs, xp) }
        }
        _ => portable_dot_tokens(w, r, xs),
    }
}

/// Rows a many-token matmul hands one [`dot_rows_tokens`] call.
pub(crate) const ROW_BLOCK: usize = 4;

/// `out[i][t] = Σ_c w[r + i, c] · x_t[c]` for the [`ROW_BLOCK`] rows from `r`, with the same
/// bits as [`dot_tokens`] row by row. On AVX-512 the nibble formats run both rows in one
/// pass, so each x vector loaded feeds two rows' multiply-adds: a many-token matmul is
/// bound by loading x from L2, not by its arithmetic (lab/notebook.md, "CPU prefill: four rows").
pub(crate) fn dot_rows_tokens<const T: usize>(
    level: SimdLevel,
    w: &EncodedRows<'_>,
    r: usize,
    xs: &[&[f32]; T],
    xp: &[&[f32]; T],
) -> [[f32; T]; ROW_BLOCK] {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 {
        debug_assert!(level.is_supported());
        // SAFETY: AVX-512F, AVX2 and FMA were confirmed by `is_supported()` at the
        // matmul entry.
        if let Some(out) = unsafe { avx512::dot_rows_tokens::<ROW_BLOCK, T>(w, r, xs, xp) } {
            return out;
        }
    }
    std::array::from_fn(|i| dot_tokens(level, w, r + i, xs, xp))
}

/// Decode-then-dot in plain Rust, for a level without kernels on this target.
fn portable_dot_tokens<const T: usize>(
    w: &EncodedRows<'_>,
    r: usize,
    xs: &[&[f32]; T],
) -> [f32; T] {
    let mut row = vec![0f32; w.cols];
    decode_portable(w, r, &mut row);
    std::array::from_fn(|t| super::kernel::dot(&row, xs[t]))
}

/// Decodes row `r` with the formats' portable decoders.
fn decode_portable(w: &EncodedRows<'_>, r: usize, out: &mut [f32]) {
    let c = w.cols;
    match w.data {
        Encoded::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
        Encoded::Bf16(b) => super::bf16::decode_row(&b[r * c..(r + 1) * c], out),
        Encoded::Int8 { q, scale } => {
            super::int8::decode_row(&q[r * c..(r + 1) * c], scale[r], out)
        }
        Encoded::Int4 { packed, scale } => {
            let (rb, rg) = (super::int4::row_bytes(c), super::int4::row_groups(c));
            super::int4::decode_row(
                &packed[r * rb..(r + 1) * rb],
                &scale[r * rg..(r + 1) * rg],
                out,
            );
        }
        Encoded::Mxfp4 { packed, scales } => {
            let view = super::Mxfp4View {
                rows: w.rows,
                cols: c,
                packed,
                scales,
            };
            view.dequantize_row(r, out);
        }
    }
}

/// Half the E8M0 scale: the SIMD kernels decode E2M1 as twice its value (small integers).
#[inline]
pub(crate) fn mxfp4_half_scale(s: u8) -> f32 {
    super::mxfp4::e8m0(s) * 0.5
}

/// The E2M1 code's value times two, for every nibble: exact small integers.
pub(crate) const E2M1_TWICE: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Sign-extends nibble `c` of a packed int4 row (low nibble = even column).
#[inline]
pub(crate) fn int4_nibble(packed: &[u8], c: usize) -> i8 {
    let b = packed[c / 2];
    if c % 2 == 0 {
        ((b << 4) as i8) >> 4
    } else {
        (b as i8) >> 4
    }
}
