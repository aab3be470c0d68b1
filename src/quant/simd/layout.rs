//! The activation layout of the nibble formats' fused kernels.

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

#[cfg(test)]
mod tests {
    use super::*;

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
