//! How a matvec workgroup is laid out (lanes per row, rows per lane, the int4 decode, x
//! staged in workgroup memory), and the overrides derived from it and the adapter.

use anyhow::{bail, Result};

/// How the one-token int4 matvecs meet x.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Decode {
    /// Every weight decoded to f32 by bit placement (no conversion instructions) and
    /// multiplied with x as it is.
    Float,
    /// x split into exact integer digits by an `x_planes` pass and met by byte dot products
    /// (x rounded to 2^-22 of each 32-column unit's largest value).
    Digits,
}

/// How a matvec workgroup is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecShape {
    /// Lanes that share one output row (a power of two ≤ 32; a row over two 32-lane blocks
    /// measured slower: docs/perf.md#kernels).
    pub lanes_per_row: u32,
    /// Of a row's lanes, how many sit side by side in one 32-lane block (the `LW` override; a
    /// power of two, 4..=lanes_per_row); fewer means a block's x loads touch fewer lines and
    /// the row's partial sums meet in workgroup memory. Capped to fit the workgroup.
    pub lanes_per_block: u32,
    /// Rows each lane group computes together, sharing its loads of x (1..=8).
    pub rows_per_lane: u32,
    /// How one-token int4 matvecs meet x (the `DIGITS` override of `matvec_int4.wgsl`;
    /// other formats ignore it). `None`: the digits in the row-split kernel where the int4
    /// matrices of one input have `DIGITS_FROM_ROWS` rows or
    /// more together, the float decode elsewhere; `Some(d)`: `d` in every one-token int4
    /// matvec.
    pub int4_decode: Option<Int4Decode>,
    /// Load the next unit's weights before computing this one (the `PIPE` override; two
    /// units ahead measured no faster: docs/perf.md#kernels).
    pub pipelined: bool,
    /// Build the matvec shaders without wgpu's injected bounds checks and loop bounding
    /// (the driver's robust buffer access still applies); benchmarks measure what it buys.
    pub unchecked: bool,
    /// The most 32-column units of x the row-split kernel of the 32-column formats (int4
    /// outside the digit decode, MXFP4) stages in workgroup memory at a time, padded against
    /// bank conflicts: the `XT` override, sized by [`x_tile_units`]. 0 reads x from global
    /// memory; the default, `u32::MAX`, stages as much as the workgroup memory holds.
    pub stage_x: u32,
    /// Rows a lane in the row-split kernel of the int4 digit decode, in place of
    /// `rows_per_lane`: two read faster there, where int8 and MXFP4 are slower at two
    /// (docs/perf.md#kernels).
    pub digit_rows_per_lane: u32,
}

impl Default for MatvecShape {
    fn default() -> Self {
        Self {
            lanes_per_row: 32,
            lanes_per_block: 32,
            rows_per_lane: 4,
            int4_decode: None,
            pipelined: true,
            unchecked: false,
            stage_x: u32::MAX,
            digit_rows_per_lane: 2,
        }
    }
}

impl MatvecShape {
    /// The expert kernel's default: its rows are short (3072 or 3584 columns), so fewer lanes
    /// per row give each lane a longer run, and rows split over blocks share their x lines
    /// (docs/perf.md#kernels).
    pub fn experts() -> Self {
        Self {
            lanes_per_row: 8,
            lanes_per_block: 4,
            ..Self::default()
        }
    }

    /// The expert kernel's default in the MoE's down projection: two rows a lane instead of
    /// four, at least as fast there (docs/perf.md#kernels).
    pub fn expert_down() -> Self {
        Self {
            rows_per_lane: 2,
            ..Self::experts()
        }
    }

    /// Checks the shape and fits its split to a workgroup of `wg` lanes.
    pub(super) fn fitted(mut self, wg: u32) -> Result<Self> {
        if !self.lanes_per_row.is_power_of_two()
            || self.lanes_per_row > 32
            || !self.lanes_per_block.is_power_of_two()
            || self.lanes_per_block < 4
            || !(1..=8).contains(&self.rows_per_lane)
            || !(1..=8).contains(&self.digit_rows_per_lane)
        {
            bail!("matvec shape {self:?}: lanes per row must be a power of two ≤ 32, lanes per block a power of two ≥ 4, rows per lane (and digit rows per lane) 1..=8");
        }
        self.lanes_per_block = split_lanes(self.lanes_per_row, self.lanes_per_block, wg);
        Ok(self)
    }
}

/// Workgroup memory the row-split matvec entries use besides staged x (`mv_part`, the
/// reduction prelude's `red_buf`), with room to spare.
pub(crate) const MATVEC_SHARED_BYTES: u32 = 4096;

/// Bytes of workgroup memory one staged unit of x takes: its eight vec4s and a pad vec4.
const STAGED_UNIT_BYTES: u32 = 9 * 16;

/// The `XT` override of a row-split matvec over rows of `units` 32-column units under `m`,
/// with `shared` bytes of workgroup memory: all the units where they fit, else the most
/// that do, at most `m.stage_x`; 0 (x from global memory) where `m.stage_x` is 0 or fewer
/// than 8 units fit. (The int4 digit decode reads x's digits and is never staged; its
/// caller asks for no tile.)
pub fn x_tile_units(m: MatvecShape, units: usize, shared: u32) -> u32 {
    let room = shared.saturating_sub(MATVEC_SHARED_BYTES) / STAGED_UNIT_BYTES;
    if m.stage_x == 0 || room < 8 {
        return 0;
    }
    room.min(m.stage_x)
        .min(u32::try_from(units).unwrap_or(u32::MAX))
}

/// The `LW` a workgroup of `wg` lanes can hold: a row split over `lpr / lw` 32-lane blocks
/// needs whole blocks, as many per workgroup as the split; otherwise the row's lanes stay
/// side by side (`lw = lpr`).
fn split_lanes(lpr: u32, lw: u32, wg: u32) -> u32 {
    let lw = lw.min(lpr);
    if lw == lpr || (wg % 32 == 0 && (wg / 32) % (lpr / lw) == 0) {
        lw
    } else {
        lpr
    }
}

#[cfg(test)]
mod tests {
    use super::{split_lanes, x_tile_units, MatvecShape};

    #[test]
    fn staged_x_takes_what_fits() {
        let m = MatvecShape::default();
        // 224 units (7168 columns) fit NVIDIA's 48 KiB whole, and 199 of them 32 KiB.
        assert_eq!(x_tile_units(m, 224, 49152), 224);
        assert_eq!(x_tile_units(m, 224, 32768), 199);
        // A short row is staged whole.
        assert_eq!(x_tile_units(m, 5, 49152), 5);
        // Room for fewer than 8 units: not staged.
        assert_eq!(x_tile_units(m, 224, 5000), 0);
        let off = MatvecShape { stage_x: 0, ..m };
        assert_eq!(x_tile_units(off, 224, 49152), 0);
        let small = MatvecShape { stage_x: 5, ..m };
        assert_eq!(x_tile_units(small, 224, 49152), 5);
    }

    #[test]
    fn a_row_is_split_over_blocks_only_when_the_workgroup_holds_them() {
        assert_eq!(split_lanes(32, 4, 256), 4);
        assert_eq!(split_lanes(32, 32, 256), 32);
        // 8 blocks of 32 per row need a workgroup of at least 256 lanes.
        assert_eq!(split_lanes(32, 4, 128), 32);
        assert_eq!(split_lanes(32, 8, 128), 8);
        assert_eq!(split_lanes(8, 4, 64), 4);
        assert_eq!(split_lanes(8, 16, 64), 8);
    }
}
