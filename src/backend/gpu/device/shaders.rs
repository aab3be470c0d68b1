//! The WGSL sources, one file per op family, and how a kernel's module is composed:
//! kernels that reduce across a workgroup get one of two reduction preludes, subgroup
//! operations when the adapter has them, workgroup memory otherwise.

use std::path::Path;

/// Subgroup reductions (subgroup size read at run time).
const REDUCE_SUBGROUP: &str = include_str!("../../../../shaders_wgsl/reduce_subgroup.wgsl");
/// Workgroup-memory reductions, the fallback.
const REDUCE_SHARED: &str = include_str!("../../../../shaders_wgsl/reduce_shared.wgsl");
/// The matvec driver shared by every weight format.
const MATVEC_COMMON: &str = include_str!("../../../../shaders_wgsl/matvec_common.wgsl");
/// The row-split matvec with x staged in workgroup memory (the 32-column formats).
const MATVEC_STAGED: &str = include_str!("../../../../shaders_wgsl/matvec_staged.wgsl");
/// The row-split matvec over a few tokens at once (int8, int4).
const MATVEC_FEW: &str = include_str!("../../../../shaders_wgsl/matvec_few.wgsl");

/// One WGSL module family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shader {
    /// add, sigmoid_gate.
    Elementwise,
    /// Zero-padded row copy.
    PadRows,
    /// situ / silu.
    Glu,
    /// Grouped RMSNorm.
    RmsNorm,
    /// Block attention-residual mix.
    AttnResMix,
    /// f32 matvec.
    MatvecF32,
    /// bf16 matvec.
    MatvecBf16,
    /// int8-per-row matvec.
    MatvecInt8,
    /// int4-group-64 matvec.
    MatvecInt4,
    /// Native MXFP4 matvec (dense and batched experts).
    MatvecMxfp4,
    /// MoE scatter.
    Moe,
    /// Router top-k.
    Router,
    /// Fused KDA step.
    KdaStep,
    /// Absorbed MLA attention pieces.
    MlaAttend,
    /// The split-K sum of the chunk matmul.
    SumSegments,
    /// Few-row int4 and int8 matmuls on the matrix units (wgpu's cooperative matrices):
    /// not in [`Shader::ALL`], since only adapters with matrix units can build it.
    MatmulCoop,
}

impl Shader {
    /// Every shader every adapter builds, for validation ([`Shader::MatmulCoop`] needs
    /// matrix units and is validated on its own).
    pub const ALL: [Shader; 15] = [
        Shader::Elementwise,
        Shader::PadRows,
        Shader::Glu,
        Shader::RmsNorm,
        Shader::AttnResMix,
        Shader::MatvecF32,
        Shader::MatvecBf16,
        Shader::MatvecInt8,
        Shader::MatvecInt4,
        Shader::MatvecMxfp4,
        Shader::Moe,
        Shader::Router,
        Shader::KdaStep,
        Shader::MlaAttend,
        Shader::SumSegments,
    ];

    /// File name under shaders_wgsl/.
    pub fn file(self) -> &'static str {
        match self {
            Shader::Elementwise => "elementwise.wgsl",
            Shader::PadRows => "pad_rows.wgsl",
            Shader::Glu => "glu.wgsl",
            Shader::RmsNorm => "rmsnorm.wgsl",
            Shader::AttnResMix => "attn_res_mix.wgsl",
            Shader::MatvecF32 => "matvec_f32.wgsl",
            Shader::MatvecBf16 => "matvec_bf16.wgsl",
            Shader::MatvecInt8 => "matvec_int8.wgsl",
            Shader::MatvecInt4 => "matvec_int4.wgsl",
            Shader::MatvecMxfp4 => "matvec_mxfp4.wgsl",
            Shader::Moe => "moe.wgsl",
            Shader::Router => "router.wgsl",
            Shader::KdaStep => "kda_step.wgsl",
            Shader::MlaAttend => "mla_attend.wgsl",
            Shader::SumSegments => "sum_segments.wgsl",
            Shader::MatmulCoop => "matmul_coop.wgsl",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Shader::Elementwise => include_str!("../../../../shaders_wgsl/elementwise.wgsl"),
            Shader::PadRows => include_str!("../../../../shaders_wgsl/pad_rows.wgsl"),
            Shader::Glu => include_str!("../../../../shaders_wgsl/glu.wgsl"),
            Shader::RmsNorm => include_str!("../../../../shaders_wgsl/rmsnorm.wgsl"),
            Shader::AttnResMix => include_str!("../../../../shaders_wgsl/attn_res_mix.wgsl"),
            Shader::MatvecF32 => include_str!("../../../../shaders_wgsl/matvec_f32.wgsl"),
            Shader::MatvecBf16 => include_str!("../../../../shaders_wgsl/matvec_bf16.wgsl"),
            Shader::MatvecInt8 => include_str!("../../../../shaders_wgsl/matvec_int8.wgsl"),
            Shader::MatvecInt4 => include_str!("../../../../shaders_wgsl/matvec_int4.wgsl"),
            Shader::MatvecMxfp4 => include_str!("../../../../shaders_wgsl/matvec_mxfp4.wgsl"),
            Shader::Moe => include_str!("../../../../shaders_wgsl/moe.wgsl"),
            Shader::Router => include_str!("../../../../shaders_wgsl/router.wgsl"),
            Shader::KdaStep => include_str!("../../../../shaders_wgsl/kda_step.wgsl"),
            Shader::MlaAttend => include_str!("../../../../shaders_wgsl/mla_attend.wgsl"),
            Shader::SumSegments => include_str!("../../../../shaders_wgsl/sum_segments.wgsl"),
            Shader::MatmulCoop => include_str!("../../../../shaders_wgsl/matmul_coop.wgsl"),
        }
    }

    /// Whether the kernel reduces across a workgroup (and so takes a reduction prelude).
    pub fn reduces(self) -> bool {
        !matches!(
            self,
            Shader::Elementwise
                | Shader::PadRows
                | Shader::Glu
                | Shader::Moe
                | Shader::SumSegments
                | Shader::MatmulCoop
        )
    }

    /// Whether the module is one of the matvec family (shares matvec_common.wgsl).
    pub fn is_matvec(self) -> bool {
        matches!(
            self,
            Shader::MatvecF32
                | Shader::MatvecBf16
                | Shader::MatvecInt8
                | Shader::MatvecInt4
                | Shader::MatvecMxfp4
        )
    }

    /// Whether the module has the row-split entries that stage x in workgroup memory
    /// (`dense_xs`, and `moe_xs` for MXFP4): the formats whose unit is 32 columns.
    pub fn stages_x(self) -> bool {
        matches!(self, Shader::MatvecInt4 | Shader::MatvecMxfp4)
    }

    /// Whether the module has the few-token matvec entry (`dense_few`): the dense formats
    /// whose matrices a batched decode step meets at several rows (the int8 head, the int4
    /// projections).
    pub fn has_few_tokens(self) -> bool {
        matches!(self, Shader::MatvecInt8 | Shader::MatvecInt4)
    }

    /// The full module text; `subgroups` picks the reduction prelude.
    pub fn source(self, subgroups: bool) -> String {
        let text = |name: &str| match name {
            "reduce_subgroup.wgsl" => REDUCE_SUBGROUP,
            "reduce_shared.wgsl" => REDUCE_SHARED,
            "matvec_common.wgsl" => MATVEC_COMMON,
            "matvec_staged.wgsl" => MATVEC_STAGED,
            "matvec_few.wgsl" => MATVEC_FEW,
            _ => self.body(),
        };
        let built_in = self.compose(subgroups, &mut |name| {
            Ok::<_, std::convert::Infallible>(text(name).to_string())
        });
        match built_in {
            Ok(s) => s,
            Err(never) => match never {},
        }
    }

    /// The module composed as [`Shader::source`] does, from the files of `dir` instead of
    /// the text built in: a tool can then try shader variants without a rebuild.
    pub fn source_from(self, subgroups: bool, dir: &Path) -> anyhow::Result<String> {
        self.compose(subgroups, &mut |name| {
            let path = dir.join(name);
            crate::platform::input_file::read_text(
                &path,
                crate::platform::input_file::FileKind::ShaderSource,
            )
        })
    }

    /// The preludes the module takes, then its own file, each through `text` (by file name).
    fn compose<E>(
        self,
        subgroups: bool,
        text: &mut dyn FnMut(&str) -> Result<String, E>,
    ) -> Result<String, E> {
        let mut s = String::new();
        if self.reduces() {
            s.push_str(&text(if subgroups {
                "reduce_subgroup.wgsl"
            } else {
                "reduce_shared.wgsl"
            })?);
            s.push('\n');
        }
        if self.is_matvec() {
            s.push_str(&text("matvec_common.wgsl")?);
            s.push('\n');
        }
        if self.stages_x() {
            s.push_str(&text("matvec_staged.wgsl")?);
            s.push('\n');
        }
        if self.has_few_tokens() {
            s.push_str(&text("matvec_few.wgsl")?);
            s.push('\n');
        }
        s.push_str(&text(self.file())?);
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::Shader;
    use crate::backend::gpu::{pipeline_variants, AdapterShape};
    use naga::valid::{
        Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator,
    };

    fn validate(sh: Shader, subgroups: bool) {
        let src = sh.source(subgroups);
        let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
            panic!(
                "{} (subgroups={subgroups}):\n{}",
                sh.file(),
                e.emit_to_string(&src)
            )
        });
        // unpack2x16float (the MXFP4 decode) needs f16-in-f32, which the context checks for.
        let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | if subgroups {
                Capabilities::SUBGROUP
            } else {
                Capabilities::empty()
            };
        let mut v = Validator::new(ValidationFlags::all(), caps);
        if subgroups {
            v.subgroup_stages(ShaderStages::COMPUTE);
            v.subgroup_operations(SubgroupOperationSet::all());
        }
        let info = v.validate(&module).unwrap_or_else(|e| {
            panic!(
                "{} (subgroups={subgroups}):\n{}",
                sh.file(),
                e.emit_to_string(&src)
            )
        });
        // Overrides must resolve with their defaults, as wgpu resolves them at pipeline time,
        // and with every set the engine's dispatches use.
        let mut sets = vec![naga::back::PipelineConstants::default()];
        for a in AdapterShape::TYPICAL {
            for v in pipeline_variants(a, subgroups) {
                if v.shader == sh {
                    sets.push(
                        v.constants(a.wg)
                            .into_iter()
                            .map(|(k, x)| (k.to_string(), x))
                            .collect(),
                    );
                }
            }
        }
        for consts in &sets {
            naga::back::pipeline_constants::process_overrides(&module, &info, None, consts)
                .unwrap_or_else(|e| {
                    panic!(
                        "{} (subgroups={subgroups}) {consts:?}: overrides: {e}",
                        sh.file()
                    )
                });
        }
    }

    #[test]
    fn every_shader_validates_with_the_fallback_reductions() {
        for sh in Shader::ALL {
            validate(sh, false);
        }
    }

    #[test]
    fn every_shader_validates_with_subgroup_reductions() {
        for sh in Shader::ALL {
            validate(sh, true);
        }
    }

    #[test]
    fn modules_read_from_the_source_tree_equal_the_built_in_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders_wgsl");
        for sh in Shader::ALL {
            for subgroups in [false, true] {
                let from_tree = sh.source_from(subgroups, &dir);
                assert_eq!(from_tree.ok(), Some(sh.source(subgroups)), "{}", sh.file());
            }
        }
        // The error names the file as the OS joins it (`\` before the file name on Windows).
        let nowhere = std::path::Path::new("/nonexistent-k3-wgsl");
        let named = nowhere.join("reduce_subgroup.wgsl").display().to_string();
        let missing = Shader::MatvecInt4
            .source_from(true, nowhere)
            .map_err(|e| format!("{e:#}"));
        assert!(
            matches!(&missing, Err(m) if m.contains(&named)),
            "{missing:?}"
        );
    }
}
