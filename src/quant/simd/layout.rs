//! The activation layouts of the nibble formats' fused kernels: x reordered once per
//! matmul so that each kernel meets it in the order its decode produces weights.

/// Columns of one [`pair_split`] block.
pub(crate) const SPLIT: usize = 32;

/// `x` with every whole block of 32 columns reordered to its 16 even columns, then its 16
/// odd ones; a last partial block is left out (the kernels read it from `x` itself).
/// A packed byte's low nibble is an even column and its high nibble the next odd one, so
/// SIMD code that splits 16 bytes into low and high nibbles meets x in this order.
pub(crate) fn pair_split(x: &[f32]) -> Vec<f32> {
    let full = x.len() / SPLIT * SPLIT;
    let mut out = Vec::with_capacity(full);
    for block in x[..full].chunks_exact(SPLIT) {
        out.extend(block.iter().step_by(2));
        out.extend(block.iter().skip(1).step_by(2));
    }
    out
}

/// Columns of one [`top_byte_lanes`] chunk (32 packed bytes).
pub(crate) const LANE_CHUNK: usize = 64;

/// `2^-24`: the AVX2 kernels decode a weight as `value · 2^24` (a signed byte placed in the
/// top byte of an i32 lane converts exactly), so x carries the inverse power of two. The
/// products are the unscaled ones exactly, for every |x| ≥ 2^-102.
pub(crate) const TOP_BYTE_SCALE: f32 = 1.0 / 16_777_216.0;

/// The byte of a 32-byte chunk that lane `i` of placement `m` reads: lanes 0-3 from the
/// chunk's first 16 bytes, lanes 4-7 from its last 16, four consecutive bytes per placement.
pub(crate) const fn lane_byte(m: usize, i: usize) -> usize {
    (i / 4) * 16 + 4 * m + i % 4
}

/// `x · 2^-24` with every whole chunk of 64 columns in the AVX2 kernels' order: for each
/// placement `m` of 0..4, the eight low-nibble (even) columns of its lanes, then the eight
/// high-nibble (odd) ones. A last partial chunk is left out (read from `x` itself).
pub(crate) fn top_byte_lanes(x: &[f32]) -> Vec<f32> {
    let full = x.len() / LANE_CHUNK * LANE_CHUNK;
    let mut out = Vec::with_capacity(full);
    for chunk in x[..full].chunks_exact(LANE_CHUNK) {
        for m in 0..4 {
            for nibble in 0..2 {
                for i in 0..8 {
                    out.push(chunk[2 * lane_byte(m, i) + nibble] * TOP_BYTE_SCALE);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_byte_lanes_visits_every_column_once_scaled() {
        let x: Vec<f32> = (0..130).map(|v| v as f32).collect();
        let p = top_byte_lanes(&x);
        assert_eq!(p.len(), 128);
        let mut seen: Vec<f32> = p.iter().map(|v| v / TOP_BYTE_SCALE).collect();
        seen.sort_by(f32::total_cmp);
        assert_eq!(seen, x[..128]);
        // Placement 1, low nibbles: bytes 4..8 and 20..24, even columns.
        assert_eq!(p[16] / TOP_BYTE_SCALE, 8.0);
        assert_eq!(p[20] / TOP_BYTE_SCALE, 40.0);
        assert_eq!(p[24] / TOP_BYTE_SCALE, 9.0);
    }

    #[test]
    fn splits_whole_blocks_and_drops_the_tail() {
        let x: Vec<f32> = (0..70).map(|v| v as f32).collect();
        let p = pair_split(&x);
        assert_eq!(p.len(), 64);
        assert_eq!(&p[..4], &[0.0, 2.0, 4.0, 6.0]);
        assert_eq!(p[15], 30.0);
        assert_eq!(&p[16..18], &[1.0, 3.0]);
        assert_eq!(p[31], 31.0);
        assert_eq!(&p[32..34], &[32.0, 34.0]);
        assert_eq!(p[63], 63.0);
    }
}
