//! Every compute pipeline the engine creates, as data: module, entry point, the override
//! constants its dispatch sets and whether the module takes the subgroup reductions.
//!
//! The dispatch sites build their overrides through the functions here
//! ([`row_split_variant`], [`stationary_consts`], [`mv_consts_of`], ...), and
//! [`pipeline_variants`] runs the same functions over the geometries the engine uses, so the
//! list follows the code. [`GpuContext::pipeline`](super::context::GpuContext::pipeline)
//! builds every pipeline from a [`PipelineVariant`] and refuses one whose kind (module,
//! entry, override names) the list lacks, and `tests/gpu/shader_translation.rs` translates every
//! listed variant to MSL, HLSL and SPIR-V: a new kernel or override is tested on every
//! backend's shading language as soon as the engine can create it.

use super::chunk_gemm::ChunkGemm;
use super::context::{x_tile_units, Int4Decode, MatvecShape};
use super::kda::{head_lanes, state_columns_per_group, MAX_HEAD_DIM};
use super::mla::OUTV_LANES;
use super::shaders::Shader;
use super::stationary::{CsPlan, Stationary};
use std::collections::HashSet;
use std::fmt;

/// Columns of one MXFP4 scale block, the unit of the MXFP4 kernels.
const MXFP4_UNIT_COLS: u32 = 32;

/// One compute pipeline: a module (composed for `subgroups`), an entry point and the
/// override constants its dispatch sets.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PipelineVariant {
    /// Module family.
    pub shader: Shader,
    /// Entry point.
    pub entry: &'static str,
    /// Override constants as the dispatch sets them (`WG` only where it sets its own).
    pub consts: Vec<(&'static str, u32)>,
    /// Whether the module is composed with the subgroup reductions (it then needs the
    /// adapter's SUBGROUP feature).
    pub subgroups: bool,
}

/// What identifies a kind of pipeline whatever the override values: module, entry point
/// and the names of the overrides set.
pub type PipelineKind = (Shader, &'static str, Vec<&'static str>);

impl PipelineVariant {
    /// The full WGSL text of the module.
    pub fn source(&self) -> String {
        self.shader.source(self.subgroups)
    }

    /// Whether creating the pipeline needs the adapter's SUBGROUP feature.
    pub fn needs_subgroups(&self) -> bool {
        self.subgroups && self.shader.reduces()
    }

    /// The override constants the pipeline is created with on workgroups of `wg` lanes:
    /// the dispatch's, and `WG = wg` unless the dispatch sets its own.
    pub fn constants(&self, wg: u32) -> Vec<(&'static str, f64)> {
        let mut all: Vec<(&str, f64)> = self
            .consts
            .iter()
            .map(|&(k, v)| (k, f64::from(v)))
            .collect();
        if !self.consts.iter().any(|&(k, _)| k == "WG") {
            all.push(("WG", f64::from(wg)));
        }
        all
    }

    /// The variant's kind: module, entry and the override names, sorted.
    pub fn kind(&self) -> PipelineKind {
        let mut names: Vec<&'static str> = self.consts.iter().map(|&(k, _)| k).collect();
        names.sort_unstable();
        (self.shader, self.entry, names)
    }
}

impl fmt::Display for PipelineVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let consts: Vec<String> = self
            .consts
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        write!(
            f,
            "{}:{} [{}] subgroups {}",
            self.shader.file(),
            self.entry,
            consts.join(","),
            if self.subgroups { "on" } else { "off" }
        )
    }
}

/// The adapter facts the overrides derive from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdapterShape {
    /// Workgroup size of every kernel (`GpuContext::wg`).
    pub wg: u32,
    /// Workgroup memory a kernel may use, in bytes.
    pub shared_bytes: u32,
    /// Smallest and largest subgroup (`AdapterInfo::subgroup_min_size`, `max`).
    pub subgroup_sizes: (u32, u32),
}

impl AdapterShape {
    /// Adapters whose facts give different overrides: a discrete GPU (48 KiB of workgroup
    /// memory, 32-lane subgroups), Apple's GPUs (32 KiB), and a small one (64 lanes, 16 KiB,
    /// where no chunk tile of 256 lanes fits and fewer units of x are staged).
    pub const TYPICAL: [AdapterShape; 3] = [
        AdapterShape {
            wg: 256,
            shared_bytes: 48 << 10,
            subgroup_sizes: (32, 32),
        },
        AdapterShape {
            wg: 256,
            shared_bytes: 32 << 10,
            subgroup_sizes: (32, 32),
        },
        AdapterShape {
            wg: 64,
            shared_bytes: 16 << 10,
            subgroup_sizes: (8, 64),
        },
    ];
}

/// The matvec pipeline overrides of `m` shared by every matvec entry.
pub fn mv_consts_of(m: MatvecShape) -> [(&'static str, u32); 4] {
    [
        ("LPR", m.lanes_per_row),
        ("LW", m.lanes_per_block),
        ("RPL", m.rows_per_lane),
        ("PIPE", u32::from(m.pipelined)),
    ]
}

/// Whether a dispatch of `shader` under `m` takes the int4 digit decode.
fn takes_digits(shader: Shader, m: MatvecShape) -> bool {
    shader == Shader::MatvecInt4 && m.int4_decode == Some(Int4Decode::Digits)
}

/// `m` as the row-split kernel of the int4 digit decode runs it: the digits, at
/// `digit_rows_per_lane` rows a lane.
pub fn digit_shape(m: MatvecShape) -> MatvecShape {
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
pub fn row_split_variant(
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

/// The column-stationary kernel's overrides for `plan`, with the int4 digit decode or not.
pub fn stationary_consts(plan: CsPlan, digits: bool) -> Vec<(&'static str, u32)> {
    let mut consts = plan.consts().to_vec();
    if digits {
        consts.push(("DIGITS", 1));
    }
    consts
}

/// The subgroup sizes the column-stationary plan assumes: the adapter's with subgroup
/// reductions, one lane without.
pub fn stationary_subgroups(subgroups: bool, sizes: (u32, u32)) -> (u32, u32) {
    if subgroups {
        sizes
    } else {
        (1, 1)
    }
}

/// The MXFP4 kernels' `SPECIAL` override: whether the per-element path for huge scales is
/// compiled in.
pub fn special_const(huge: bool) -> (&'static str, u32) {
    ("SPECIAL", u32::from(huge))
}

/// Row widths, in units, that reach every override value that depends on them: a row of
/// one unit, the model's rows, and rows wider than any x tile or stationary span.
const UNIT_COUNTS: [usize; 6] = [1, 7, 24, 96, 224, 1792];
/// Token counts of chunk matmuls that reach every tile the chunk policy picks.
const CHUNK_TOKENS: [usize; 3] = [16, 32, 512];
/// Head widths of the KDA kernels: the smallest, K3's and the widest the kernel holds.
const KDA_HEAD_DIMS: [usize; 3] = [4, 128, MAX_HEAD_DIM];

/// Every pipeline the engine creates on an adapter of shape `a`, its modules composed with
/// the subgroup reductions (`subgroups`) or the workgroup-memory ones, under the engine's
/// geometries (the dense, expert and expert-down matvec shapes, either int4 decode, x
/// staged or not) and the chunk and column-stationary policies' defaults.
pub fn pipeline_variants(a: AdapterShape, subgroups: bool) -> Vec<PipelineVariant> {
    let mut out: Vec<PipelineVariant> = Vec::new();
    let mut push = |shader: Shader, entry: &'static str, consts: Vec<(&'static str, u32)>| {
        let v = PipelineVariant {
            shader,
            entry,
            consts,
            subgroups,
        };
        if !out.contains(&v) {
            out.push(v);
        }
    };
    let plain: [(Shader, &[&'static str]); 9] = [
        (Shader::Elementwise, &["add", "sigmoid_gate"]),
        (Shader::PadRows, &["pad"]),
        (Shader::Glu, &["situ", "silu"]),
        (Shader::RmsNorm, &["rmsnorm"]),
        (Shader::AttnResMix, &["scores", "mix"]),
        (Shader::Moe, &["scatter"]),
        (Shader::Router, &["topk"]),
        (Shader::SumSegments, &["sum_segments"]),
        (
            Shader::MlaAttend,
            &["append", "qabs", "softmax", "ctx", "ctx_sum"],
        ),
    ];
    for (shader, entries) in plain {
        for &entry in entries {
            push(shader, entry, Vec::new());
        }
    }
    push(Shader::MlaAttend, "outv", vec![("LPR", OUTV_LANES)]);
    for hd in KDA_HEAD_DIMS {
        let lanes = head_lanes(a.wg, hd);
        push(Shader::KdaStep, "kda_fused", vec![("WG", lanes)]);
        push(Shader::KdaStep, "kda_conv", Vec::new());
        let cg = state_columns_per_group(hd, a.wg);
        push(Shader::KdaStep, "kda_state", vec![("CG", cg)]);
        push(Shader::KdaStep, "kda_norm", vec![("WG", lanes)]);
    }

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
    }
    for &t in &tiles {
        push(
            Shader::MatvecMxfp4,
            "moe_gemm",
            t.consts(a.wg, MXFP4_UNIT_COLS).to_vec(),
        );
    }
    out
}

/// The kinds of every pipeline [`pipeline_variants`] lists for an adapter of shape `a`.
pub fn pipeline_kinds(a: AdapterShape, subgroups: bool) -> HashSet<PipelineKind> {
    pipeline_variants(a, subgroups)
        .iter()
        .map(PipelineVariant::kind)
        .collect()
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

    #[test]
    fn every_module_and_both_reductions_are_listed() {
        for a in AdapterShape::TYPICAL {
            for subgroups in [false, true] {
                let vs = pipeline_variants(a, subgroups);
                for sh in Shader::ALL {
                    assert!(vs.iter().any(|v| v.shader == sh), "{sh:?} in {a:?}");
                }
                assert!(vs.iter().all(|v| v.subgroups == subgroups));
                // The int4 digits in both kernels, x staged and not, SPECIAL both ways.
                for (sh, entry, name) in [
                    (Shader::MatvecInt4, "dense", "DIGITS"),
                    (Shader::MatvecInt4, "dense_cs", "DIGITS"),
                    (Shader::MatvecInt4, "dense_xs", "XT"),
                    (Shader::MatvecMxfp4, "moe_xs", "XT"),
                    (Shader::MatvecMxfp4, "moe_cs", "SPECIAL"),
                ] {
                    assert!(
                        vs.iter().any(|v| v.shader == sh
                            && v.entry == entry
                            && v.consts.iter().any(|&(k, _)| k == name)),
                        "{sh:?} {entry} {name} in {a:?}"
                    );
                }
                assert!(vs
                    .iter()
                    .any(|v| v.entry == "moe" && v.consts.contains(&("SPECIAL", 0))));
            }
        }
    }

    #[test]
    fn constants_add_the_workgroup_size_unless_the_dispatch_sets_it() {
        let v = PipelineVariant {
            shader: Shader::KdaStep,
            entry: "kda_norm",
            consts: vec![("WG", 32)],
            subgroups: true,
        };
        assert_eq!(v.constants(256), vec![("WG", 32.0)]);
        let v = PipelineVariant {
            consts: vec![("CG", 16)],
            entry: "kda_state",
            ..v
        };
        assert_eq!(v.constants(256), vec![("CG", 16.0), ("WG", 256.0)]);
        assert!(v.needs_subgroups());
        let plain = PipelineVariant {
            shader: Shader::Elementwise,
            ..v.clone()
        };
        assert!(!plain.needs_subgroups());
        assert_eq!(
            v.to_string(),
            "kda_step.wgsl:kda_state [CG=16] subgroups on"
        );
    }
}
