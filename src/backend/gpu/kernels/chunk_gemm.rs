//! When a matmul over a chunk of tokens takes the tiled `gemm` kernels (which decode each
//! weight unit once for the whole tile) rather than the one-token matvec per token, and the
//! tile they use.

use anyhow::{bail, Result};

/// Tokens from which a matmul takes the chunk kernel by default: the matvec per token still
/// wins at 8 tokens and loses at 16 (docs/perf.md#prefill).
pub const GEMM_FROM_TOKENS: u32 = 16;

/// Columns of one K step of the kernel (`GK` in matvec_common.wgsl).
pub const GK: u64 = 32;

/// Workgroups a chunk matmul aims for, splitting K when its tiles are fewer: several per SM
/// of a large GPU (a hundred or more SMs), so one workgroup's load latency hides behind
/// another's work. Without the split a 32-token chunk of a 12288-row matrix ran 96
/// workgroups and cost the same as 4 tokens (docs/perf.md#prefill).
const TARGET_GROUPS: u64 = 1024;
/// The fewest K steps a segment keeps, so the partial sums stay small next to the weights.
const MIN_SEG_STEPS: u64 = 8;

/// The chunk-kernel policy (`GpuOptions::chunk_gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkGemm {
    /// Tokens from which matmuls take the chunk kernel; 0 = never (always the matvec).
    pub from_tokens: u32,
    /// Tokens per tile (16, 32 or 64) instead of the smallest tile that holds the chunk.
    pub tile_tokens: Option<u32>,
    /// Split K over several workgroups when the tiles alone would not fill the GPU.
    pub split_k: bool,
    /// Issue the next K step's loads before this step's multiply-adds, where the tile
    /// allows.
    pub prefetch: bool,
}

impl Default for ChunkGemm {
    fn default() -> Self {
        Self {
            from_tokens: GEMM_FROM_TOKENS,
            tile_tokens: None,
            split_k: true,
            prefetch: true,
        }
    }
}

/// A tile: lanes along rows (`GTR`, 4 rows each) and along tokens (`GTC`, 4 tokens each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmTile {
    /// Lanes along rows.
    pub gtr: u32,
    /// Lanes along tokens.
    pub gtc: u32,
    /// Whether the next K step's loads may be held in registers (`ChunkGemm::prefetch`).
    pub prefetch: bool,
}

impl GemmTile {
    /// Output rows of one workgroup.
    pub fn rows(self) -> u32 {
        4 * self.gtr
    }

    /// Tokens of one workgroup.
    pub fn tokens(self) -> u32 {
        4 * self.gtc
    }

    /// Workgroup memory the kernel declares for it (decoded weights, inputs, row starts).
    pub fn shared_bytes(self) -> u64 {
        16 * GK * u64::from(self.gtr + self.gtc) + 16 * u64::from(self.gtc)
    }

    /// The pipeline overrides for workgroups of `wg` lanes and weights of `unit_cols`
    /// columns per unit: `PF` (loads of the next K step in registers) where every lane
    /// stages at most one unit and two vec4 of x per step.
    pub fn consts(self, wg: u32, unit_cols: u32) -> [(&'static str, u32); 3] {
        let units = 4 * self.gtr * (GK as u32 / unit_cols.max(1));
        let pf = units <= wg && 32 * self.gtc <= 2 * wg;
        [
            ("GTR", self.gtr),
            ("GTC", self.gtc),
            ("PF", u32::from(pf && self.prefetch)),
        ]
    }
}

impl ChunkGemm {
    /// Checks the policy.
    pub fn checked(self) -> Result<Self> {
        if self.tile_tokens.is_some_and(|t| ![16, 32, 64].contains(&t)) {
            bail!("chunk gemm {self:?}: tile tokens must be 16, 32 or 64");
        }
        Ok(self)
    }

    /// Whether a matmul of `n` tokens takes the chunk kernel.
    pub fn applies(self, n: usize) -> bool {
        self.from_tokens > 0 && n >= self.from_tokens as usize
    }

    /// The tile for chunks of `n` tokens on workgroups of `wg` lanes with `shared` bytes of
    /// workgroup memory: 16 tokens for chunks that fit them (taller tiles, fewer idle lanes),
    /// 32 otherwise (the 64-token tile measured slower at every chunk size, 128 and 512
    /// tokens included: docs/perf.md#prefill); a wider one where that does not fit the memory; `None` when none
    /// does (the matvec then serves every chunk).
    pub fn tile(self, wg: u32, n: usize, shared: u64) -> Option<GemmTile> {
        let want = self.tile_tokens.unwrap_or(if n <= 16 { 16 } else { 32 });
        let fits = |t: GemmTile| t.gtr >= 1 && t.shared_bytes() <= shared;
        let of = |tokens: u32| {
            let gtc = (tokens / 4).min(wg);
            GemmTile {
                gtr: wg / gtc,
                gtc,
                prefetch: self.prefetch,
            }
        };
        [want, 32, 64].into_iter().map(of).find(|&t| fits(t))
    }

    /// K segments for a dispatch of `groups` tiles over `steps` K steps whose output takes
    /// `out_bytes`, with partial sums of at most `max_bytes`: (segments, steps per segment).
    pub fn segments(self, groups: u64, steps: u64, out_bytes: u64, max_bytes: u64) -> (u32, u32) {
        let steps = steps.max(1);
        if !self.split_k {
            return (1, steps as u32);
        }
        let want = TARGET_GROUPS
            .div_ceil(groups.max(1))
            .min(steps / MIN_SEG_STEPS)
            .min(max_bytes / out_bytes.max(1))
            .max(1);
        let seg_steps = steps.div_ceil(want);
        (steps.div_ceil(seg_steps) as u32, seg_steps as u32)
    }

    /// The fewest output rows a tile of `wg` lanes can have (bounds the rows per dispatch).
    pub fn min_tile_rows(wg: u32) -> u32 {
        4 * (wg / 16).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_chunks_get_taller_tiles_within_the_memory() {
        let g = ChunkGemm::default();
        let tile = |gtr, gtc| {
            Some(GemmTile {
                gtr,
                gtc,
                prefetch: true,
            })
        };
        assert_eq!(g.tile(256, 8, 48 << 10), tile(64, 4));
        assert_eq!(g.tile(256, 20, 48 << 10), tile(32, 8));
        assert_eq!(g.tile(256, 500, 48 << 10), tile(32, 8));
        // 24 KB of workgroup memory: a 256-row tile (34 KB) does not fit, a 128-row one does.
        assert_eq!(g.tile(256, 8, 24 << 10), tile(32, 8));
        // 16 KB: no tile of 256 lanes fits, so chunks take the matvec.
        assert_eq!(g.tile(256, 8, 16 << 10), None);
        assert_eq!(g.tile(64, 8, 16 << 10), tile(16, 4));
        let forced = ChunkGemm {
            tile_tokens: Some(64),
            ..g
        };
        assert_eq!(forced.tile(256, 8, 48 << 10), tile(16, 16));
        for (wg, n, shared) in [(256, 8, 48 << 10), (64, 100, 16 << 10)] {
            let t = g.tile(wg, n, shared).map(GemmTile::rows);
            assert!(t >= Some(ChunkGemm::min_tile_rows(wg)));
        }
    }

    #[test]
    fn the_threshold_and_bad_tiles() {
        let g = ChunkGemm::default();
        assert!(!g.applies(GEMM_FROM_TOKENS as usize - 1) && g.applies(GEMM_FROM_TOKENS as usize));
        let off = ChunkGemm {
            from_tokens: 0,
            ..g
        };
        assert!(!off.applies(1000));
        let bad = ChunkGemm {
            tile_tokens: Some(8),
            ..g
        };
        assert!(bad.checked().is_err());
    }

    #[test]
    fn prefetch_only_where_each_lane_stages_one_unit() {
        let t = |gtr, gtc| GemmTile {
            gtr,
            gtc,
            prefetch: true,
        };
        // int4 (32 columns a unit): 256 rows of one unit each on 256 lanes.
        assert_eq!(t(64, 4).consts(256, 32)[2], ("PF", 1));
        // f32 (4 columns): 8 units a row; int8 (16): 2, on 128 rows.
        assert_eq!(t(64, 4).consts(256, 4)[2], ("PF", 0));
        assert_eq!(t(32, 8).consts(256, 16)[2], ("PF", 1));
        // 16 lanes along tokens on a 64-lane workgroup: 512 x vec4 for 64 lanes.
        assert_eq!(t(4, 16).consts(64, 32)[2], ("PF", 0));
        let off = GemmTile {
            prefetch: false,
            ..t(64, 4)
        };
        assert_eq!(off.consts(256, 32)[2], ("PF", 0));
    }

    #[test]
    fn k_splits_only_where_tiles_are_few() {
        let g = ChunkGemm::default();
        // 96 tiles over 224 steps: 11 segments of 21 steps (the last one shorter).
        assert_eq!(g.segments(96, 224, 1 << 20, 1 << 30), (11, 21));
        // Enough tiles, or too few steps to keep 8 per segment: no split.
        assert_eq!(g.segments(2000, 224, 1 << 20, 1 << 30), (1, 224));
        assert_eq!(g.segments(10, 12, 1 << 20, 1 << 30), (1, 12));
        // The partial sums' memory caps the split.
        assert_eq!(g.segments(96, 224, 1 << 20, 3 << 20), (3, 75));
        let off = ChunkGemm {
            split_k: false,
            ..g
        };
        assert_eq!(off.segments(96, 224, 1 << 20, 1 << 30), (1, 224));
    }
}
