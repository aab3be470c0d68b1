//! When a dense matmul takes the few-token matvec (`dense_few`, matvec_few.wgsl) and its
//! overrides: the int8 and int4 matmuls of a decode step of two to eight streams, which as
//! one matvec a row decode every weight unit once a row (docs/perf.md#several-streams-in-one-pass).

use crate::backend::gpu::device::context::{Int4Decode, MatvecShape, MATVEC_SHARED_BYTES};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::kernels::row_split::{mv_consts_of, takes_digits};

/// The most rows (tokens) the few-token kernel takes; more take the chunk kernel or one
/// matvec a row.
pub(crate) const FEW_TOKENS_MAX: usize = 8;

/// The few-token kernel's lanes a row and rows a lane for a `shader` matrix (`digits`: int4
/// under the digit decode). Few lanes a row give a workgroup many rows, so the x it stages
/// for every token serves them all (at a one-token kernel's 32 lanes a row the staging and
/// its barriers bound it); rows a lane share each staged x load. Measured on the H100
/// (docs/perf.md#several-streams-in-one-pass): the int8 head is fastest at 4 × 4 (256 rows a
/// workgroup), the int4 matrices at 8 lanes a row (their rows of 7168 columns need the
/// workgroups that 64 or 128 rows a workgroup give), the digits at 4 rows a lane.
pub(crate) fn few_token_shape_of(shader: Shader, digits: bool) -> (u32, u32) {
    match (shader, digits) {
        (Shader::MatvecInt4, true) => (8, 4),
        (Shader::MatvecInt4, false) => (8, 2),
        _ => (4, 4),
    }
}

/// The few-token kernel's shape from the dense one (`dense`) with `(lanes a row, rows a
/// lane)` of `shape` (a row's lanes side by side); `digits`: int4 meets x's integer digits,
/// as the one-token kernel does where the call's int4 rows reach `DIGITS_FROM_ROWS`.
pub(crate) fn few_tokens_shape(dense: MatvecShape, digits: bool, shape: (u32, u32)) -> MatvecShape {
    MatvecShape {
        lanes_per_row: shape.0,
        lanes_per_block: shape.0,
        rows_per_lane: shape.1,
        digit_rows_per_lane: shape.1,
        int4_decode: Some(if digits {
            Int4Decode::Digits
        } else {
            Int4Decode::Float
        }),
        ..dense
    }
}

/// The fewest units a tile of x holds: below it the barriers of the tiles would cost more
/// than the decode saves.
const MIN_TILE_UNITS: u32 = 8;

/// The fewest row groups (workgroups) a matrix chunk takes the kernel from: below it each
/// workgroup's walk along the row is the kernel's time and one matvec a row, with rows ×
/// more workgroups, is faster. On the H100 at 8 lanes a row and 2 rows a lane, int4
/// matrices of 1536 and 3072 rows (24 and 48 groups) ran 2× and 1.2× slower than one matvec
/// a row, 7168 rows (112 groups) 1.4-1.6× faster (docs/perf.md#several-streams-in-one-pass).
pub(crate) const FEW_FROM_GROUPS: u32 = 64;

/// Workgroup memory one staged unit of x takes for one token: its eight vec4s and a pad.
const FEW_UNIT_BYTES: u32 = 9 * 16;

/// The `dense_few` overrides for `tokens` rows of x against a `shader` matrix of rows of
/// `units` units under `m`, with `shared` bytes of workgroup memory; `None` where the format
/// has no few-token entry, `tokens` is outside 2..=[`FEW_TOKENS_MAX`], the shape has more
/// than the kernel's four rows a lane, or a tile of x for every token holds fewer than
/// [`MIN_TILE_UNITS`] units. The tile (`FT`) is a whole number of a row's lanes' units where
/// that fits, so every lane does the same work between two stagings.
pub(crate) fn few_tokens_variant(
    shader: Shader,
    m: MatvecShape,
    tokens: usize,
    units: usize,
    shared: u32,
) -> Option<Vec<(&'static str, u32)>> {
    if !shader.has_few_tokens() || !(2..=FEW_TOKENS_MAX).contains(&tokens) || m.rows_per_lane > 4 {
        return None;
    }
    let tokens = tokens as u32;
    let lpr = m.lanes_per_row.max(1);
    let room = shared.saturating_sub(MATVEC_SHARED_BYTES) / (FEW_UNIT_BYTES * tokens);
    let units = u32::try_from(units).unwrap_or(u32::MAX).max(1);
    // Where a round for every lane does not fit (8 tokens in 32 KB), fewer units a tile
    // leave some lanes idle in each; the weights are still decoded once for all tokens.
    let ft = if room >= lpr { room / lpr * lpr } else { room }.min(units.next_multiple_of(lpr));
    if ft < MIN_TILE_UNITS {
        return None;
    }
    let mut consts = mv_consts_of(m).to_vec();
    if takes_digits(shader, m) {
        consts.push(("DIGITS", 1));
    }
    consts.push(("TOK", tokens));
    consts.push(("FT", ft));
    Some(consts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(consts: &[(&str, u32)], k: &str) -> Option<u32> {
        consts.iter().find(|c| c.0 == k).map(|c| c.1)
    }

    #[test]
    fn tiles_hold_whole_lane_rounds_for_every_token() {
        let m = few_tokens_shape(MatvecShape::default(), false, (4, 2));
        // 48 KB: 44 KB for x, 144 B a unit and token; 4 lanes a row.
        let c = few_tokens_variant(Shader::MatvecInt8, m, 8, 448, 48 << 10).unwrap();
        assert_eq!((get(&c, "TOK"), get(&c, "FT")), (Some(8), Some(36)));
        assert_eq!((get(&c, "LPR"), get(&c, "RPL")), (Some(4), Some(2)));
        let c = few_tokens_variant(Shader::MatvecInt4, m, 2, 224, 48 << 10).unwrap();
        assert_eq!(get(&c, "FT"), Some(156));
        assert_eq!(get(&c, "DIGITS"), None);
        // A short row: the tile stops at the row's units, rounded up to a lane round.
        let c = few_tokens_variant(Shader::MatvecInt4, m, 2, 7, 48 << 10).unwrap();
        assert_eq!(get(&c, "FT"), Some(8));
        // The digit decode says so; other formats ignore it.
        let d = few_tokens_shape(MatvecShape::default(), true, (4, 2));
        let c = few_tokens_variant(Shader::MatvecInt4, d, 4, 224, 48 << 10).unwrap();
        assert_eq!((get(&c, "DIGITS"), get(&c, "RPL")), (Some(1), Some(2)));
        let c = few_tokens_variant(Shader::MatvecInt8, d, 4, 224, 48 << 10).unwrap();
        assert_eq!(get(&c, "DIGITS"), None);
    }

    #[test]
    fn each_format_has_its_measured_shape() {
        assert_eq!(few_token_shape_of(Shader::MatvecInt8, false), (4, 4));
        assert_eq!(few_token_shape_of(Shader::MatvecInt4, false), (8, 2));
        assert_eq!(few_token_shape_of(Shader::MatvecInt4, true), (8, 4));
        let m = few_tokens_shape(MatvecShape::default(), false, (8, 2));
        assert_eq!(
            (m.lanes_per_row, m.lanes_per_block, m.rows_per_lane),
            (8, 8, 2)
        );
    }

    #[test]
    fn outside_its_range_the_kernel_is_not_taken() {
        let m = few_tokens_shape(MatvecShape::default(), false, (4, 2));
        for tokens in [0, 1, FEW_TOKENS_MAX + 1] {
            assert!(few_tokens_variant(Shader::MatvecInt8, m, tokens, 448, 48 << 10).is_none());
        }
        assert!(few_tokens_variant(Shader::MatvecF32, m, 4, 448, 48 << 10).is_none());
        assert!(few_tokens_variant(Shader::MatvecMxfp4, m, 4, 448, 48 << 10).is_none());
        let wide = MatvecShape {
            rows_per_lane: 8,
            ..m
        };
        assert!(few_tokens_variant(Shader::MatvecInt8, wide, 4, 448, 48 << 10).is_none());
        // A row of 32 lanes in 32 KB: 28 KB hold 24 units of 8 tokens, a short tile.
        let wide_row = MatvecShape::default();
        let c = few_tokens_variant(Shader::MatvecInt8, wide_row, 8, 448, 32 << 10).unwrap();
        assert_eq!(get(&c, "FT"), Some(24));
        // 8 KB: 4 KB hold 3 units of 8 tokens, too few.
        assert!(few_tokens_variant(Shader::MatvecInt8, m, 8, 448, 8 << 10).is_none());
    }
}
