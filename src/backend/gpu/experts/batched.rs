//! The batched MXFP4 expert matmuls: every (expert, token) pair of one arena group in one
//! dispatch, through the matvec, the column-stationary kernel or the chunk kernel.

use super::arena::Arena;
use super::routing::{build_routing, Routing};
use super::BLOCK;
use crate::backend::gpu::device::buffers::{GpuAct, GpuRows};
use crate::backend::gpu::device::context::{Dispatch, MatvecShape};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::kernels::chunk_gemm::{GemmTile, GK};
use crate::backend::gpu::kernels::row_split::{mv_consts_of, rows_per_group_of, special_const};
use crate::backend::gpu::GpuBackend;
use crate::backend::{ExpertAssignment, ExpertPayload};
use crate::quant::Mxfp4View;
use crate::routed_expert::ExpertWeights;
use anyhow::{ensure, Result};

/// Below this many output rows over all its (expert, token) pairs, an MXFP4 dispatch uses
/// the dense geometry: the expert geometry's 128-row workgroups would be fewer than about
/// two per SM of a large GPU. Measured at the ends only: one expert's 3072 rows read faster
/// in the dense geometry, 16 experts' 98304 in the expert one (docs/perf.md#kernels).
pub(super) const FEW_ROWS: u64 = 32768;

/// Pairs of one expert that one workgroup of the few-token kernel (`moe_t4`) runs.
pub(super) const T4_PAIRS: usize = 4;

/// How one expert pass runs its tiled items through the chunk kernel.
pub(super) struct ChunkPass {
    pub(super) tile: GemmTile,
    /// K segments and steps per segment.
    pub(super) segs: u32,
    pub(super) seg_steps: u32,
    /// The partial sums, `segs × pairs × rows`, when K is split.
    pub(super) part: Option<wgpu::Buffer>,
    pub(super) pairs: usize,
    pub(super) rows: usize,
}

impl ChunkPass {
    /// Words between segments' partial outputs (0: one segment, written straight to y).
    pub(super) fn seg_stride(&self) -> u32 {
        if self.part.is_some() {
            (self.pairs * self.rows) as u32
        } else {
            0
        }
    }
}

impl GpuBackend {
    /// One batched MXFP4 matmul: `rows` output rows per expert slot, `cols` inputs; the
    /// one-pair items through the matvec (in geometry `big` where they are many rows), the
    /// tiled ones through the chunk kernel's `tile`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mxfp4_batched(
        &self,
        big: MatvecShape,
        a: &Arena,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        rt: &wgpu::Buffer,
        rows: usize,
        cols: usize,
        map_off: u32,
        items: [(u32, u32); 2],
        chunk: Option<&ChunkPass>,
    ) {
        let [one, tiled] = items;
        let params = |first: u32, seg: (u32, u32), row_block: u32| {
            [
                rows as u32,
                (cols / BLOCK) as u32,
                0,
                0,
                rows as u32,
                (cols / 4) as u32,
                (cols / BLOCK) as u32,
                map_off,
                first,
                seg.0,
                seg.1,
                row_block,
            ]
        };
        let mut buffers = [x, y, &a.packed, &a.scales, rt];
        if let (Some(c), true) = (chunk, tiled.1 > 0) {
            debug_assert!(tiled.1 <= self.ctx.limits.max_compute_workgroups_per_dimension);
            if let Some(pb) = &c.part {
                buffers[1] = pb;
            }
            self.ctx.dispatch(&Dispatch {
                shader: Shader::MatvecMxfp4,
                entry: "moe_gemm",
                consts: &c.tile.consts(self.ctx.wg, BLOCK as u32),
                params: &params(tiled.0, (c.seg_steps, c.seg_stride()), 0),
                buffers: &buffers,
                groups: (tiled.1, (rows as u32).div_ceil(c.tile.rows()), c.segs),
            });
            buffers[1] = y;
        }
        if chunk.is_none() && tiled.1 > 0 {
            self.mxfp4_t4(big, a, &buffers, (rows, cols), map_off, tiled);
        }
        if one.1 == 0 {
            return;
        }
        debug_assert!(one.1 <= self.ctx.limits.max_compute_workgroups_per_dimension);
        // The expert geometry gives each lane a long run but few workgroups per expert; a
        // dispatch of a few thousand rows in all would leave most of the GPU idle, so it
        // takes the dense geometry, or where even that runs few workgroups, the
        // column-stationary kernel (docs/perf.md#kernels).
        let total = u64::from(one.1) * rows as u64;
        let shape = if total >= FEW_ROWS {
            big
        } else {
            self.ctx.matvec
        };
        let split_groups = (rows as u32).div_ceil(rows_per_group_of(self.ctx.wg, shape));
        let plan = (total < FEW_ROWS
            && self
                .ctx
                .stationary
                .wants(u64::from(split_groups) * u64::from(one.1)))
        .then(|| self.ctx.stationary_plan(cols / BLOCK, rows, one.1 as usize))
        .flatten();
        let special = special_const(a.huge);
        if let Some(plan) = plan {
            let mut consts = plan.consts().to_vec();
            consts.push(special);
            self.ctx.dispatch(&Dispatch {
                shader: Shader::MatvecMxfp4,
                entry: "moe_cs",
                consts: &consts,
                params: &params(one.0, (0, 0), plan.row_block),
                buffers: &buffers,
                groups: (one.1, plan.groups(rows), 1),
            });
            return;
        }
        let (entry, mut consts) =
            self.row_split(Shader::MatvecMxfp4, shape, cols / BLOCK, ("moe", "moe_xs"));
        consts.push(special);
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MatvecMxfp4,
            entry,
            consts: &consts,
            params: &params(one.0, (0, 0), 0),
            buffers: &buffers,
            groups: (one.1, split_groups, 1),
        });
    }

    /// The items of up to [`T4_PAIRS`] pairs of one expert (`items`: first, count) through
    /// `moe_t4`, which decodes each weight unit once for the item's pairs: in geometry `big`
    /// where the items cover many rows, else the dense one (as the one-pair items).
    fn mxfp4_t4(
        &self,
        big: MatvecShape,
        a: &Arena,
        buffers: &[&wgpu::Buffer; 5],
        (rows, cols): (usize, usize),
        map_off: u32,
        items: (u32, u32),
    ) {
        debug_assert!(items.1 <= self.ctx.limits.max_compute_workgroups_per_dimension);
        let shape = if u64::from(items.1) * rows as u64 >= FEW_ROWS {
            big
        } else {
            self.ctx.matvec
        };
        let mut consts = mv_consts_of(shape).to_vec();
        consts.push(special_const(a.huge));
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MatvecMxfp4,
            entry: "moe_t4",
            consts: &consts,
            params: &[
                rows as u32,
                (cols / BLOCK) as u32,
                0,
                0,
                rows as u32,
                (cols / 4) as u32,
                (cols / BLOCK) as u32,
                map_off,
                items.0,
                0,
                0,
                0,
            ],
            buffers,
            groups: (
                items.1,
                (rows as u32).div_ceil(rows_per_group_of(self.ctx.wg, shape)),
                1,
            ),
        });
    }

    /// How one expert pass (`rows` × `cols` per expert) runs the `items` tiled items of
    /// `rt`: K segments where the tiles alone would not fill the GPU, and their partial sums.
    pub(super) fn chunk_pass(
        &self,
        tile: Option<GemmTile>,
        rt: &Routing,
        rows: usize,
        cols: usize,
    ) -> Option<ChunkPass> {
        let tile = tile?;
        let items: u64 = rt.group_items.iter().map(|g| u64::from(g[1].1)).sum();
        if items == 0 {
            return None;
        }
        let out = (rt.tiled_pairs * rows) as u64 * 4;
        let (segs, seg_steps) = self.ctx.chunk_gemm.segments(
            items * u64::from((rows as u32).div_ceil(tile.rows())),
            cols.div_ceil(GK as usize) as u64,
            out,
            self.ctx.max_binding,
        );
        let part = (segs > 1).then(|| {
            self.ctx
                .buffer(u64::from(segs) * out, "expert partial sums")
        });
        Some(ChunkPass {
            tile,
            segs,
            seg_steps,
            part,
            pairs: rt.tiled_pairs,
            rows,
        })
    }

    /// Adds up a pass's K segments into `y` (rows = pairs) once all its groups ran.
    pub(super) fn finish_chunk_pass(&self, c: Option<&ChunkPass>, y: &wgpu::Buffer) {
        if let Some(ChunkPass {
            part: Some(pb),
            segs,
            pairs,
            rows,
            ..
        }) = c
        {
            self.sum_segments(pb, y, (*pairs, *rows), (*rows, 0), *segs);
        }
    }

    /// The chunk kernel's tile for a call whose busiest expert has `most` tokens, and the
    /// `tiled` argument of [`build_routing`] that goes with it.
    pub(super) fn expert_tiling(&self, most: usize) -> (Option<GemmTile>, (usize, usize)) {
        match self.ctx.gemm_tile(most) {
            Some(t) => (
                Some(t),
                (
                    self.ctx.chunk_gemm.from_tokens as usize,
                    t.tokens() as usize,
                ),
            ),
            // Fewer tokens than a tile, with the few-token kernel on: experts with two or
            // more go through `moe_t4` in items of up to T4_PAIRS pairs, the rest one pair
            // an item.
            None if most >= 2 && self.ctx.few_token_experts => (None, (2, T4_PAIRS)),
            None => (None, (0, 0)),
        }
    }

    /// `y[t] = W · x[t]` for a native MXFP4 matrix, decoded in the kernel, over each part
    /// of `x`.
    pub fn matmul_mxfp4(&self, w: Mxfp4View<'_>, x: &GpuRows) -> Result<GpuRows> {
        let parts = x
            .parts
            .iter()
            .map(|p| self.matmul_mxfp4_part(w, p))
            .collect::<Result<Vec<_>>>()?;
        Ok(crate::backend::gpu::row_parts::rows_of(parts, w.rows))
    }

    /// [`Self::matmul_mxfp4`] of one part.
    fn matmul_mxfp4_part(&self, w: Mxfp4View<'_>, x: &GpuAct) -> Result<GpuAct> {
        ensure!(
            x.cols == w.cols && w.cols % BLOCK == 0,
            "matmul_mxfp4: input width {} vs {} columns (a multiple of {BLOCK})",
            x.cols,
            w.cols
        );
        ensure!(
            w.packed.len() == w.rows * w.cols / 2 && w.scales.len() == w.rows * w.cols / BLOCK,
            "matmul_mxfp4: byte lengths do not match {}x{}",
            w.rows,
            w.cols
        );
        let (y, run) = self.matmul_output(x.rows, w.rows, w.cols)?;
        if !run {
            return Ok(y);
        }
        let tokens: Vec<(usize, f32)> = (0..x.rows).map(|t| (t, 1.0)).collect();
        let single = [ExpertAssignment {
            key: None,
            payload: ExpertPayload::Host(ExpertWeights {
                w1: w,
                w2: w,
                w3: w,
            }),
            tokens,
        }];
        let (tile, tiled) = self.expert_tiling(x.rows);
        let rt = build_routing(&single, x.rows, &[(0, 0)], 1, tiled)?;
        let rtb = self
            .ctx
            .buffer_init(bytemuck::cast_slice(&rt.words), "routing");
        let arena = self.arena(&[w.into()], None)?;
        let chunk = self.chunk_pass(tile, &rt, w.rows, w.cols);
        self.mxfp4_batched(
            self.ctx.expert_matvec,
            &arena,
            &x.buf,
            &y.buf,
            &rtb,
            w.rows,
            w.cols,
            rt.tok_map,
            rt.group_items[0],
            chunk.as_ref(),
        );
        self.finish_chunk_pass(chunk.as_ref(), &y.buf);
        Ok(y)
    }
}
