//! The column-stationary matvec's policy: which one-token matvecs take it and how many rows a
//! workgroup computes. The kernels are `cs_rows` and its entry points `dense_cs` and
//! `moe_cs` (shaders_wgsl/matvec_common.wgsl, matvec_mxfp4.wgsl): lane c of a row span owns
//! unit c of every row, so its slice of x is loaded once and the span reads each row whole.
//!
//! Measured (docs/perf.md#kernels): it wins where the row-split kernel has too few
//! workgroups to fill the GPU (one expert's 3072 × 3584 MXFP4 rows, int4 1536 × 7168 and
//! 3072 × 7168) and loses where that kernel fills it (int4 12288 × 7168, 16 experts' 98304
//! rows). So it takes only dispatches the row-split kernel would run in few workgroups.

use anyhow::{bail, Result};

/// Row sums the kernel's workgroup memory holds (`cs_part`): one per subgroup of a span per
/// row of the workgroup's block.
const PART_SLOTS: u32 = 1024;

/// When one-token matvecs take the column-stationary kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stationary {
    /// Off: every one-token matvec takes the row-split kernel.
    pub enabled: bool,
    /// Rows each lane computes together (1..=8).
    pub rows_per_lane: u32,
    /// Workgroups a dispatch aims at: a GPU's worth several times over, so that the last
    /// wave's tail stays short.
    pub target_groups: u32,
    /// Dispatches the row-split kernel would run in fewer workgroups than this take the
    /// column-stationary one (`u64::MAX`: all it applies to; benchmarks compare).
    pub below_groups: u64,
}

impl Default for Stationary {
    fn default() -> Self {
        Self {
            enabled: true,
            rows_per_lane: 4,
            target_groups: 512,
            below_groups: 256,
        }
    }
}

/// One dispatch's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CsPlan {
    /// Lanes per row span (`SPAN`): a power of two ≥ the row's units.
    pub span: u32,
    /// Rows per workgroup (`row_block`).
    pub row_block: u32,
    /// Rows per lane (`RPL`).
    pub rows_per_lane: u32,
}

impl CsPlan {
    /// The pipeline overrides.
    pub fn consts(&self) -> [(&'static str, u32); 2] {
        [("SPAN", self.span), ("RPL", self.rows_per_lane)]
    }

    /// Workgroups along the rows of one item (token or expert pair) of `rows` rows.
    pub fn groups(&self, rows: usize) -> u32 {
        (rows as u32).div_ceil(self.row_block)
    }
}

impl Stationary {
    /// Checks the settings.
    pub fn checked(self) -> Result<Self> {
        if !(1..=8).contains(&self.rows_per_lane) || self.target_groups == 0 {
            bail!("column-stationary matvec {self:?}: rows per lane must be 1..=8 and the target at least one workgroup");
        }
        Ok(self)
    }

    /// Whether a dispatch the row-split kernel would run in `groups` workgroups should take
    /// this kernel instead.
    pub fn wants(&self, groups: u64) -> bool {
        self.enabled && groups < self.below_groups
    }

    /// The plan for rows of `units` 16-byte units, `rows` rows per item and `items` items
    /// (tokens or expert pairs) in one dispatch, on workgroups of `wg` lanes whose
    /// subgroups hold `sub.0 ..= sub.1` lanes (1 and 1 without subgroups; 0 = unknown); or
    /// `None` where the kernel does not apply (rows wider than a workgroup, or a block that
    /// would not fit its workgroup memory).
    pub fn plan(
        &self,
        units: usize,
        rows: usize,
        items: usize,
        wg: u32,
        sub: (u32, u32),
    ) -> Option<CsPlan> {
        if !self.enabled || units == 0 || rows == 0 || units > wg as usize {
            return None;
        }
        let sub_min = sub.0.max(1);
        // An unknown largest subgroup may be the whole workgroup.
        let sub_max = if sub.1 == 0 { wg } else { sub.1 };
        // A subgroup must not straddle two spans.
        let span = (units as u32).next_power_of_two().max(sub_max);
        if span > wg || wg % span != 0 {
            return None;
        }
        let per_row = span / sub_min;
        let unit = (wg / span) * self.rows_per_lane;
        let cap = PART_SLOTS / per_row / unit * unit;
        if cap == 0 {
            return None;
        }
        let total = rows as u64 * items.max(1) as u64;
        let want = total
            .div_ceil(u64::from(self.target_groups))
            .min(u64::from(cap)) as u32;
        let row_block = want.div_ceil(unit).max(1) * unit;
        Some(CsPlan {
            span,
            row_block: row_block.min(cap),
            rows_per_lane: self.rows_per_lane,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fit_the_workgroup_memory_and_the_rows() {
        let s = Stationary::default();
        // int4 7168 columns on NVIDIA: one span of 256, blocks of whole lane groups.
        let p = s.plan(224, 12288, 1, 256, (32, 32)).unwrap();
        assert_eq!(p.span, 256);
        assert_eq!(p.row_block % 4, 0);
        assert!(p.row_block * (p.span / 32) <= PART_SLOTS);
        assert!(p.groups(12288) >= 512);
        // MXFP4 expert rows (112 units): two spans of 128.
        let p = s.plan(112, 6144, 16, 256, (32, 32)).unwrap();
        assert_eq!((p.span, p.row_block % 8), (128, 0));
        // Without subgroups every lane keeps its own sum: the block shrinks to fit.
        let p = s.plan(224, 12288, 1, 256, (1, 1)).unwrap();
        assert_eq!(p.row_block, 4);
        // Eight rows per lane of 256-lane spans do not fit without subgroups.
        let eight = Stationary {
            rows_per_lane: 8,
            ..s
        };
        assert!(eight.plan(224, 12288, 1, 256, (1, 1)).is_none());
        // Rows wider than the workgroup, subgroups wider than the span, or the kernel off.
        assert!(s.plan(300, 100, 1, 256, (32, 32)).is_none());
        assert_eq!(s.plan(24, 100, 1, 256, (8, 64)).unwrap().span, 64);
        assert!(s.plan(112, 100, 1, 64, (32, 128)).is_none());
        let off = Stationary {
            enabled: false,
            ..s
        };
        assert!(off.plan(112, 6144, 16, 256, (32, 32)).is_none());
        assert!(!off.wants(1));
        assert!(s.wants(96) && !s.wants(384));
        assert!(Stationary {
            rows_per_lane: 9,
            ..s
        }
        .checked()
        .is_err());
    }
}
