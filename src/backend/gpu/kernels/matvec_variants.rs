//! The matvec family's pipelines on an adapter: every entry and override set the dense
//! matmuls, the experts and the chunk kernel dispatch under the engine's geometries, listed
//! so that the tests translate each for every backend and the context can build them ahead.

use crate::backend::gpu::device::context::{Int4Decode, MatvecShape};
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::kernels::chunk_gemm::ChunkGemm;
use crate::backend::gpu::kernels::few_tokens::{
    few_token_shape_of, few_tokens_shape, few_tokens_variant, FEW_TOKENS_MAX,
};
use crate::backend::gpu::kernels::row_split::{
    digit_shape, mv_consts_of, row_split_variant, special_const,
};
use crate::backend::gpu::kernels::stationary::{
    stationary_consts, stationary_subgroups, CsPlan, Stationary,
};

/// Columns of one MXFP4 scale block, the unit of the MXFP4 kernels.
const MXFP4_UNIT_COLS: u32 = 32;

/// Row widths, in units, that reach every override value that depends on them: a row of
/// one unit, the model's rows, and rows wider than any x tile or stationary span.
const UNIT_COUNTS: [usize; 6] = [1, 7, 24, 96, 224, 1792];
/// Token counts of chunk matmuls that reach every tile the chunk policy picks.
const CHUNK_TOKENS: [usize; 3] = [16, 32, 512];

/// The matvec pipelines on an adapter of shape `a`, under the engine's geometries (the
/// dense, expert and expert-down matvec shapes, either int4 decode, x staged or not) and the
/// chunk and column-stationary policies' defaults, with the segment sum they share.
pub(crate) fn pipeline_variants(a: AdapterShape, list: &mut VariantList) {
    let subgroups = list.subgroups();
    let mut push = |shader: Shader, entry: &'static str, consts: Vec<(&'static str, u32)>| {
        list.push(shader, entry, consts)
    };
    push(Shader::SumSegments, "sum_segments", Vec::new());

    // Matvec geometries: the dense shape (either int4 decode, x staged or read from global
    // memory), the expert shapes, and the digit decode's row-split shape.
    let dense = MatvecShape::default();
    let mut shapes = Vec::new();
    for base in [dense, MatvecShape::experts(), MatvecShape::expert_down()] {
        for stage_x in [base.stage_x, 0] {
            for int4_decode in [None, Some(Int4Decode::Float), Some(Int4Decode::Digits)] {
                let m = MatvecShape {
                    stage_x,
                    int4_decode,
                    ..base
                };
                shapes.push(m);
                if int4_decode == Some(Int4Decode::Digits) {
                    shapes.push(digit_shape(m));
                }
            }
        }
    }
    let stationary = Stationary::default();
    let sub = stationary_subgroups(subgroups, a.subgroup_sizes);
    let plans: Vec<CsPlan> = UNIT_COUNTS
        .iter()
        .flat_map(|&units| {
            [(12288, 1), (3072, 16)]
                .into_iter()
                .filter_map(move |(rows, items)| stationary.plan(units, rows, items, a.wg, sub))
        })
        .collect();
    let gemm = ChunkGemm::default();
    let tiles: Vec<_> = CHUNK_TOKENS
        .iter()
        .filter_map(|&n| gemm.tile(a.wg, n, u64::from(a.shared_bytes)))
        .collect();

    let dense_formats = [
        (Shader::MatvecF32, 4),
        (Shader::MatvecBf16, 8),
        (Shader::MatvecInt8, 16),
        (Shader::MatvecInt4, 32),
    ];
    for (shader, unit_cols) in dense_formats {
        for &m in &shapes {
            for units in UNIT_COUNTS {
                let (entry, consts) =
                    row_split_variant(shader, m, units, a.shared_bytes, ("dense", "dense_xs"));
                push(shader, entry, consts);
            }
        }
        for &plan in &plans {
            push(shader, "dense_cs", stationary_consts(plan, false));
            if shader == Shader::MatvecInt4 {
                push(shader, "dense_cs", stationary_consts(plan, true));
            }
        }
        for &t in &tiles {
            push(shader, "gemm", t.consts(a.wg, unit_cols).to_vec());
        }
        for m in [false, true]
            .map(|digits| few_tokens_shape(dense, digits, few_token_shape_of(shader, digits)))
        {
            for units in UNIT_COUNTS {
                for tokens in 2..=FEW_TOKENS_MAX {
                    if let Some(consts) =
                        few_tokens_variant(shader, m, tokens, units, a.shared_bytes)
                    {
                        push(shader, "dense_few", consts);
                    }
                }
            }
        }
    }
    push(Shader::MatvecInt4, "x_planes", Vec::new());

    for huge in [false, true] {
        let special = special_const(huge);
        for &m in &shapes {
            for units in UNIT_COUNTS {
                let (entry, mut consts) = row_split_variant(
                    Shader::MatvecMxfp4,
                    m,
                    units,
                    a.shared_bytes,
                    ("moe", "moe_xs"),
                );
                consts.push(special);
                push(Shader::MatvecMxfp4, entry, consts);
            }
        }
        for &plan in &plans {
            let mut consts = stationary_consts(plan, false);
            consts.push(special);
            push(Shader::MatvecMxfp4, "moe_cs", consts);
        }
        for &m in &shapes {
            let mut consts = mv_consts_of(m).to_vec();
            consts.push(special);
            push(Shader::MatvecMxfp4, "moe_t4", consts);
        }
    }
    for &t in &tiles {
        push(
            Shader::MatvecMxfp4,
            "moe_gemm",
            t.consts(a.wg, MXFP4_UNIT_COLS).to_vec(),
        );
    }
}
