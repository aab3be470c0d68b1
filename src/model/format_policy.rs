//! Which load-time format each class of dense matrix gets (`K3_BITS` and friends).

use crate::quant::DenseFormat;
use anyhow::Result;

/// Load-time formats: attention/MLP/shared-expert matrices, MLA projections, and the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormatPolicy {
    /// `K3_BITS` (default 4): KDA projections, dense MLP, shared experts, latent projections.
    pub dense: DenseFormat,
    /// `K3_MLA_BITS` (default 8): the MLA projections.
    pub mla: DenseFormat,
    /// `K3_HEAD_BITS` (default 8): `lm_head`.
    pub head: DenseFormat,
}

impl Default for FormatPolicy {
    fn default() -> Self {
        Self {
            dense: DenseFormat::Int4,
            mla: DenseFormat::Int8,
            head: DenseFormat::Int8,
        }
    }
}

impl FormatPolicy {
    /// Builds the policy from bit counts (4, 8, 16 or 32), naming the offending variable.
    pub fn from_bits(dense: u32, mla: u32, head: u32) -> Result<Self> {
        let get = |bits: u32, var: &str| {
            DenseFormat::from_bits(bits).map_err(|e| anyhow::anyhow!("{var}: {e}"))
        };
        Ok(Self {
            dense: get(dense, "K3_BITS / --bits")?,
            mla: get(mla, "K3_MLA_BITS / --mla-bits")?,
            head: get(head, "K3_HEAD_BITS / --head-bits")?,
        })
    }

    /// Every matrix in f32: the setting for conformance runs.
    pub fn exact() -> Self {
        Self {
            dense: DenseFormat::F32,
            mla: DenseFormat::F32,
            head: DenseFormat::F32,
        }
    }
}
