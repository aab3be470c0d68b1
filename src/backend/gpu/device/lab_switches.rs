//! Experiment switches of the GPU backend: settings that exist to measure the engine's
//! alternatives against its defaults, not for users, so `k3 run --help` does not list them.
//! They are read from `K3_LAB_*` environment variables here and nowhere else; unset, every
//! default stays.
//!
//! | Variable | Values | Default | What it changes |
//! |---|---|---|---|
//! | `K3_LAB_CHUNK_FROM` | tokens | 16 | prefill chunks of at least this many tokens run their matmuls through the tiled chunk kernel, smaller ones one matvec per token (0: always the matvec) |
//! | `K3_LAB_READ_STAGING` | auto, on, off | auto | whether streamed experts are read straight into mapped upload buffers (auto: on a discrete GPU whose staging is host memory, and in the unified expert pool) |
//! | `K3_LAB_INT4_DECODE` | auto, digits, float | auto | how one-token int4 matvecs meet x (auto: digits where the int4 matrices of one input have 32768 rows or more together) |
//! | `K3_LAB_STAGE_X` | on, off | on | whether the one-token int4 (outside digits) and MXFP4 matvecs copy x into workgroup memory first |
//! | `K3_LAB_EXPERT_POOL` | auto, on, off | auto | whether the expert tier is the single expert pool, the host cache keeping nothing (auto: where CPU and GPU share memory); off keeps the discrete GPU's host cache + VRAM tier |
//! | `K3_LAB_FEW_TOKEN_EXPERTS` | on, off | off | whether experts that 2–15 rows of a call share run four rows a workgroup (`moe_t4`) instead of one matvec item a row |
//! | `K3_LAB_FEW_TOKEN_DENSE` | on, off | on | whether int8 and int4 matmuls of 2–8 rows run the few-token kernel (`dense_few`) instead of one matvec a row |
//! | `K3_LAB_FEW_TOKEN_SHAPE` | `LxR` (lanes a row: 4, 8, 16 or 32; rows a lane: 1–4) | per format | the few-token kernel's lanes a row and rows a lane, for every format |
//! | `K3_LAB_MATRIX_UNITS` | off, on, 1, 2, 4 | off | whether int4 and int8 matmuls of 2–8 rows run on the matrix units where the adapter has them (matmul_coop.wgsl), and at how many subgroups a workgroup (on: 4) |
//!
//! A switch whose alternative lost is removed, with its record in lab/notebook.md ("Lab
//! switches and GPU options removed").

use crate::backend::gpu::device::context::{GpuOptions, Int4Decode, MatvecShape, ReadStaging};
use crate::backend::gpu::kernels::chunk_gemm::ChunkGemm;
use crate::backend::gpu::kernels::matrix_units::{DEFAULT_SUBGROUPS, SUBGROUP_COUNTS};
use anyhow::{bail, Result};

/// The experiment switches set in the environment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LabSwitches {
    /// `K3_LAB_CHUNK_FROM`.
    pub chunk_from: Option<u32>,
    /// `K3_LAB_READ_STAGING`.
    pub read_staging: ReadStaging,
    /// `K3_LAB_INT4_DECODE` (`None`: auto).
    pub int4_decode: Option<Int4Decode>,
    /// `K3_LAB_STAGE_X` (false: off).
    pub stage_x: bool,
    /// `K3_LAB_EXPERT_POOL` (`None`: auto).
    pub expert_pool: Option<bool>,
    /// `K3_LAB_FEW_TOKEN_EXPERTS` (true: on).
    pub few_token_experts: bool,
    /// `K3_LAB_FEW_TOKEN_DENSE` (`None`: unset).
    pub few_token_dense: Option<bool>,
    /// `K3_LAB_FEW_TOKEN_SHAPE` (`None`: unset).
    pub few_token_shape: Option<(u32, u32)>,
    /// `K3_LAB_MATRIX_UNITS`: subgroups a workgroup (`None`: off).
    pub matrix_units: Option<u32>,
}

impl LabSwitches {
    /// The switches of the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// The switches `get` gives values for (an empty value counts as unset).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let chunk_from = match get("K3_LAB_CHUNK_FROM") {
            None => None,
            Some(v) => Some(v.trim().parse::<u32>().map_err(|_| {
                anyhow::anyhow!("K3_LAB_CHUNK_FROM must be a token count (0 or more), got {v:?}")
            })?),
        };
        let read_staging = match get("K3_LAB_READ_STAGING").as_deref().map(str::trim) {
            None | Some("auto") => ReadStaging::Auto,
            Some("on") => ReadStaging::On,
            Some("off") => ReadStaging::Off,
            Some(v) => bail!("K3_LAB_READ_STAGING must be auto, on or off, got {v:?}"),
        };
        let int4_decode = match get("K3_LAB_INT4_DECODE").as_deref().map(str::trim) {
            None | Some("auto") => None,
            Some("digits") => Some(Int4Decode::Digits),
            Some("float") => Some(Int4Decode::Float),
            Some(v) => bail!("K3_LAB_INT4_DECODE must be auto, digits or float, got {v:?}"),
        };
        let stage_x = match get("K3_LAB_STAGE_X").as_deref().map(str::trim) {
            None | Some("on") => true,
            Some("off") => false,
            Some(v) => bail!("K3_LAB_STAGE_X must be on or off, got {v:?}"),
        };
        let expert_pool = match get("K3_LAB_EXPERT_POOL").as_deref().map(str::trim) {
            None | Some("auto") => None,
            Some("on") => Some(true),
            Some("off") => Some(false),
            Some(v) => bail!("K3_LAB_EXPERT_POOL must be auto, on or off, got {v:?}"),
        };
        let few_token_experts = match get("K3_LAB_FEW_TOKEN_EXPERTS").as_deref().map(str::trim) {
            None | Some("off") => false,
            Some("on") => true,
            Some(v) => bail!("K3_LAB_FEW_TOKEN_EXPERTS must be on or off, got {v:?}"),
        };
        let few_token_dense = match get("K3_LAB_FEW_TOKEN_DENSE").as_deref().map(str::trim) {
            None => None,
            Some("on") => Some(true),
            Some("off") => Some(false),
            Some(v) => bail!("K3_LAB_FEW_TOKEN_DENSE must be on or off, got {v:?}"),
        };
        let few_token_shape = match get("K3_LAB_FEW_TOKEN_SHAPE") {
            None => None,
            Some(v) => {
                let bad = || {
                    anyhow::anyhow!(
                        "K3_LAB_FEW_TOKEN_SHAPE must be LxR (lanes a row 4, 8, 16 or 32; rows a lane 1-4), got {v:?}"
                    )
                };
                let (l, r) = v.trim().split_once('x').ok_or_else(bad)?;
                let l: u32 = l.parse().map_err(|_| bad())?;
                let r: u32 = r.parse().map_err(|_| bad())?;
                if ![4, 8, 16, 32].contains(&l) || !(1..=4).contains(&r) {
                    return Err(bad());
                }
                Some((l, r))
            }
        };
        let matrix_units = match get("K3_LAB_MATRIX_UNITS").as_deref().map(str::trim) {
            None | Some("off") => None,
            Some("on") => Some(DEFAULT_SUBGROUPS),
            Some(v) => match v.parse::<u32>() {
                Ok(n) if SUBGROUP_COUNTS.contains(&n) => Some(n),
                _ => bail!("K3_LAB_MATRIX_UNITS must be off, on, 1, 2 or 4, got {v:?}"),
            },
        };
        Ok(Self {
            chunk_from,
            read_staging,
            int4_decode,
            stage_x,
            expert_pool,
            few_token_experts,
            few_token_dense,
            few_token_shape,
            matrix_units,
        })
    }

    /// `opts` with the switches applied over its settings.
    pub fn apply(&self, opts: GpuOptions) -> GpuOptions {
        let stage_x = if self.stage_x { u32::MAX } else { 0 };
        let staged = |m: MatvecShape| MatvecShape { stage_x, ..m };
        GpuOptions {
            chunk_gemm: match self.chunk_from {
                Some(from_tokens) => Some(ChunkGemm {
                    from_tokens,
                    ..opts.chunk_gemm.unwrap_or_default()
                }),
                None => opts.chunk_gemm,
            },
            read_staging: self.read_staging,
            expert_pool: self.expert_pool.or(opts.expert_pool),
            few_token_experts: self.few_token_experts || opts.few_token_experts,
            few_token_dense: self.few_token_dense.or(opts.few_token_dense),
            few_token_shape: self.few_token_shape.or(opts.few_token_shape),
            matrix_units: self.matrix_units.or(opts.matrix_units),
            matvec: Some(MatvecShape {
                int4_decode: self.int4_decode,
                ..staged(opts.matvec.unwrap_or_default())
            }),
            expert_matvec: Some(staged(
                opts.expert_matvec.unwrap_or_else(MatvecShape::experts),
            )),
            expert_down_matvec: Some(staged(
                opts.expert_down_matvec
                    .unwrap_or_else(MatvecShape::expert_down),
            )),
            ..opts
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> Result<LabSwitches> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|&(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LabSwitches::from_lookup(|name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn unset_switches_keep_every_default() {
        let s = lookup(&[("K3_LAB_STAGE_X", "")]).unwrap();
        assert_eq!(
            s,
            LabSwitches {
                stage_x: true,
                ..LabSwitches::default()
            }
        );
        let opts = s.apply(GpuOptions::default());
        assert_eq!(opts.chunk_gemm, None);
        assert_eq!(opts.submit_every, None);
        assert_eq!(opts.read_staging, ReadStaging::Auto);
        assert_eq!(opts.expert_pool, None);
        assert!(!opts.few_token_experts);
        assert_eq!(opts.few_token_dense, None);
        assert_eq!(opts.matrix_units, None);
        assert_eq!(opts.matvec, Some(MatvecShape::default()));
        assert_eq!(opts.expert_matvec, Some(MatvecShape::experts()));
        assert_eq!(opts.expert_down_matvec, Some(MatvecShape::expert_down()));
    }

    #[test]
    fn every_switch_reaches_its_option() {
        let s = lookup(&[
            ("K3_LAB_CHUNK_FROM", "0"),
            ("K3_LAB_READ_STAGING", "off"),
            ("K3_LAB_INT4_DECODE", "digits"),
            ("K3_LAB_STAGE_X", "off"),
            ("K3_LAB_EXPERT_POOL", "off"),
            ("K3_LAB_FEW_TOKEN_EXPERTS", "on"),
            ("K3_LAB_FEW_TOKEN_DENSE", "off"),
            ("K3_LAB_FEW_TOKEN_SHAPE", "8x4"),
            ("K3_LAB_MATRIX_UNITS", "2"),
        ])
        .unwrap();
        let opts = s.apply(GpuOptions {
            adapter: Some("lavapipe".into()),
            ..GpuOptions::default()
        });
        assert_eq!(opts.adapter.as_deref(), Some("lavapipe"));
        assert_eq!(opts.chunk_gemm.map(|c| c.from_tokens), Some(0));
        assert_eq!(opts.read_staging, ReadStaging::Off);
        assert_eq!(opts.expert_pool, Some(false));
        assert!(opts.few_token_experts);
        assert_eq!(opts.few_token_dense, Some(false));
        assert_eq!(opts.few_token_shape, Some((8, 4)));
        assert_eq!(opts.matrix_units, Some(2));
        let m = opts.matvec.unwrap();
        assert_eq!((m.int4_decode, m.stage_x), (Some(Int4Decode::Digits), 0));
        assert_eq!(opts.expert_matvec.unwrap().stage_x, 0);
        assert_eq!(opts.expert_down_matvec.unwrap().stage_x, 0);
        assert_eq!(opts.expert_down_matvec.unwrap().rows_per_lane, 2);
        let float = lookup(&[
            ("K3_LAB_INT4_DECODE", "float"),
            ("K3_LAB_READ_STAGING", "on"),
            ("K3_LAB_EXPERT_POOL", "on"),
        ])
        .unwrap();
        assert_eq!(float.int4_decode, Some(Int4Decode::Float));
        assert_eq!(float.read_staging, ReadStaging::On);
        assert_eq!(float.expert_pool, Some(true));
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (name, value) in [
            ("K3_LAB_CHUNK_FROM", "-1"),
            ("K3_LAB_READ_STAGING", "maybe"),
            ("K3_LAB_INT4_DECODE", "half"),
            ("K3_LAB_STAGE_X", "yes"),
            ("K3_LAB_EXPERT_POOL", "yes"),
            ("K3_LAB_FEW_TOKEN_EXPERTS", "auto"),
            ("K3_LAB_MATRIX_UNITS", "8"),
            ("K3_LAB_MATRIX_UNITS", "auto"),
        ] {
            let err = lookup(&[(name, value)]).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains(value), "{err}");
        }
    }
}
