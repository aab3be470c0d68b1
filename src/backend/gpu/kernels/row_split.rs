//! The row-split matvec kernel's geometry and pipeline overrides, shared by the dense
//! matmuls, the experts and MLA: rows a workgroup computes, the overrides every matvec
//! entry takes, the int4 digit decode's shape, and whether x is staged in workgroup memory.

use crate::backend::gpu::device::context::{x_tile_units, Int4Decode, MatvecShape};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::GpuBackend;

impl GpuBackend {
    /// Output rows one matvec workgroup computes.
    pub(in crate::backend::gpu) fn rows_per_group(&self) -> u32 {
        rows_per_group_of(self.ctx.wg, self.ctx.matvec)
    }

    /// The row-split kernel's entry and overrides for a `shader` matrix with rows of `units`
    /// units under `m` (see [`row_split_variant`]).
    pub(in crate::backend::gpu) fn row_split(
        &self,
        shader: Shader,
        m: MatvecShape,
        units: usize,
        entries: (&'static str, &'static str),
    ) -> (&'static str, Vec<(&'static str, u32)>) {
        row_split_variant(shader, m, units, self.ctx.shared_bytes(), entries)
    }

    /// The dense matvec pipeline overrides, x read from global memory (formats whose unit is
    /// not 32 columns).
    pub(in crate::backend::gpu) fn mv_consts(&self) -> [(&'static str, u32); 4] {
        mv_consts_of(self.ctx.matvec)
    }
}

/// Output rows one workgroup of `wg` lanes computes under `m`.
pub(in crate::backend::gpu) fn rows_per_group_of(wg: u32, m: MatvecShape) -> u32 {
    wg / m.lanes_per_row * m.rows_per_lane
}

/// The matvec pipeline overrides of `m` shared by every matvec entry.
pub(crate) fn mv_consts_of(m: MatvecShape) -> [(&'static str, u32); 4] {
    [
        ("LPR", m.lanes_per_row),
        ("LW", m.lanes_per_block),
        ("RPL", m.rows_per_lane),
        ("PIPE", u32::from(m.pipelined)),
    ]
}

/// Whether a dispatch of `shader` under `m` takes the int4 digit decode.
pub(crate) fn takes_digits(shader: Shader, m: MatvecShape) -> bool {
    shader == Shader::MatvecInt4 && m.int4_decode == Some(Int4Decode::Digits)
}

/// `m` as the row-split kernel of the int4 digit decode runs it: the digits, at
/// `digit_rows_per_lane` rows a lane.
pub(crate) fn digit_shape(m: MatvecShape) -> MatvecShape {
    MatvecShape {
        int4_decode: Some(Int4Decode::Digits),
        rows_per_lane: m.digit_rows_per_lane,
        ..m
    }
}

/// The row-split kernel's entry and overrides for a `shader` matrix with rows of `units`
/// units under `m`, with `shared` bytes of workgroup memory: `entries.0`, or `entries.1`
/// (its twin in matvec_staged.wgsl) with x staged in tiles of [`x_tile_units`], where the
/// shader stages x, the decode reads plain x, and a tile fits the workgroup memory.
pub(crate) fn row_split_variant(
    shader: Shader,
    m: MatvecShape,
    units: usize,
    shared: u32,
    entries: (&'static str, &'static str),
) -> (&'static str, Vec<(&'static str, u32)>) {
    let digits = takes_digits(shader, m);
    let mut consts = mv_consts_of(m).to_vec();
    if digits {
        consts.push(("DIGITS", 1));
    }
    let xt = if shader.stages_x() && !digits {
        x_tile_units(m, units, shared)
    } else {
        0
    };
    if xt == 0 {
        return (entries.0, consts);
    }
    consts.push(("XT", xt));
    (entries.1, consts)
}

/// The MXFP4 kernels' `SPECIAL` override: whether the per-element path for huge scales is
/// compiled in.
pub(crate) fn special_const(huge: bool) -> (&'static str, u32) {
    ("SPECIAL", u32::from(huge))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digit_decode_is_never_staged_and_only_int4_takes_it() {
        let digits = MatvecShape {
            int4_decode: Some(Int4Decode::Digits),
            ..MatvecShape::default()
        };
        let (entry, consts) = row_split_variant(
            Shader::MatvecInt4,
            digits,
            224,
            48 << 10,
            ("dense", "dense_xs"),
        );
        assert_eq!(entry, "dense");
        assert!(consts.contains(&("DIGITS", 1)));
        // The other formats read plain x whatever the int4 decode: MXFP4 stages it.
        let (entry, consts) = row_split_variant(
            Shader::MatvecMxfp4,
            digits,
            224,
            48 << 10,
            ("moe", "moe_xs"),
        );
        assert_eq!(entry, "moe_xs");
        assert!(!consts.iter().any(|&(k, _)| k == "DIGITS"));
        assert!(consts.contains(&("XT", 224)));
        // The float decode stages x; formats without 32-column units never do.
        let (entry, _) = row_split_variant(
            Shader::MatvecInt4,
            MatvecShape::default(),
            224,
            48 << 10,
            ("dense", "dense_xs"),
        );
        assert_eq!(entry, "dense_xs");
        let (entry, _) = row_split_variant(
            Shader::MatvecInt8,
            MatvecShape::default(),
            224,
            48 << 10,
            ("dense", "dense_xs"),
        );
        assert_eq!(entry, "dense");
    }
}
