//! Dense weights on the device and the matvec/matmul kernels over them. A matrix is
//! uploaded once, its rows padded to whole 16-byte units and split into row chunks whose
//! bindings stay under the adapter's limit; one dispatch per chunk writes its rows of y.

use crate::backend::gpu::device::buffers::{f32_bytes, GpuAct};
use crate::backend::gpu::device::context::{Dispatch, Int4Decode};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::kernels::chunk_gemm::{ChunkGemm, GemmTile, GK};
use crate::backend::gpu::kernels::device_matrix::{GpuFormat, GpuMat, MatChunk};
use crate::backend::gpu::kernels::few_tokens::{
    few_token_shape_of, few_tokens_shape, few_tokens_variant, FEW_FROM_GROUPS,
};
use crate::backend::gpu::kernels::matrix_units::{takes_matrix_units, XHalves};
use crate::backend::gpu::kernels::row_split::{digit_shape, rows_per_group_of};
use crate::backend::gpu::kernels::stationary::stationary_consts;
use crate::backend::gpu::GpuBackend;
use crate::quant::{DenseData, DenseMatrix};
use anyhow::{bail, ensure, Result};
use std::cell::{OnceCell, RefCell};

/// Copies `rows` rows of `src_row` bytes into rows of `dst_row` bytes, zero padded.
fn pad_rows(src: &[u8], rows: usize, src_row: usize, dst_row: usize) -> Vec<u8> {
    if src_row == dst_row {
        return src.to_vec();
    }
    let mut out = vec![0u8; rows * dst_row];
    for r in 0..rows {
        out[r * dst_row..r * dst_row + src_row]
            .copy_from_slice(&src[r * src_row..(r + 1) * src_row]);
    }
    out
}

impl GpuBackend {
    pub(in crate::backend::gpu) fn load_matrix_op(&self, m: DenseMatrix) -> Result<GpuMat> {
        let (rows, cols) = (m.rows, m.cols);
        let (format, unit_bytes_per_col, raw_row, payload, scales, scales_per_row): (
            GpuFormat,
            f64,
            usize,
            Vec<u8>,
            Option<Vec<f32>>,
            usize,
        ) = match m.data {
            DenseData::F32(v) => (
                GpuFormat::F32,
                4.0,
                cols * 4,
                bytemuck::cast_slice(&v).to_vec(),
                None,
                0,
            ),
            DenseData::Bf16(v) => (
                GpuFormat::Bf16,
                2.0,
                cols * 2,
                bytemuck::cast_slice(&v).to_vec(),
                None,
                0,
            ),
            DenseData::Int8 { q, scale } => (
                GpuFormat::Int8,
                1.0,
                cols,
                bytemuck::cast_slice(&q).to_vec(),
                Some(scale),
                1,
            ),
            DenseData::Int4 { q, scale } => (
                GpuFormat::Int4,
                0.5,
                cols.div_ceil(2),
                q,
                Some(scale),
                cols.div_ceil(64),
            ),
        };
        ensure!(
            payload.len() == rows * raw_row,
            "load_matrix: {rows}x{cols} {format:?} payload has {} bytes, expected {}",
            payload.len(),
            rows * raw_row
        );
        if let Some(s) = &scales {
            ensure!(
                s.len() == rows * scales_per_row,
                "load_matrix: {rows}x{cols} {format:?} has {} scales, expected {}",
                s.len(),
                rows * scales_per_row
            );
        }
        let uc = format.unit_cols();
        let cols_padded = cols.div_ceil(uc).max(1) * uc;
        let row_bytes = (cols_padded as f64 * unit_bytes_per_col) as usize;
        let padded = pad_rows(&payload, rows, raw_row, row_bytes);
        drop(payload);
        let max_rows_binding = (self.ctx.max_binding / row_bytes.max(1) as u64) as usize;
        // Row groups of either kernel stay within the grid's y limit.
        let max_rows_dispatch = self.ctx.limits.max_compute_workgroups_per_dimension as usize
            * self
                .rows_per_group()
                .min(ChunkGemm::min_tile_rows(self.ctx.wg)) as usize;
        let chunk_rows = max_rows_binding.min(max_rows_dispatch);
        if chunk_rows == 0 {
            bail!(
                "load_matrix: one {cols}-column row ({row_bytes} B) exceeds the adapter's storage binding limit of {} B",
                self.ctx.max_binding
            );
        }
        let mut chunks = Vec::new();
        let mut row0 = 0;
        while row0 < rows {
            let n = chunk_rows.min(rows - row0);
            let w = self
                .ctx
                .buffer_init(&padded[row0 * row_bytes..(row0 + n) * row_bytes], "weights");
            let scale = scales.as_ref().map(|s| {
                self.ctx.buffer_init(
                    f32_bytes(&s[row0 * scales_per_row..(row0 + n) * scales_per_row]),
                    "scales",
                )
            });
            chunks.push(MatChunk {
                row0,
                rows: n,
                w,
                scale,
            });
            row0 += n;
        }
        Ok(GpuMat {
            rows,
            cols,
            cols_padded,
            format,
            chunks,
        })
    }

    /// `y[t · stride + row0 + r] = Σ_s part[s][t][r]` for `(tokens, rows) = shape` and
    /// `(stride, row0) = place`: the split-K chunk kernel's partial sums added up.
    pub(in crate::backend::gpu) fn sum_segments(
        &self,
        part: &wgpu::Buffer,
        y: &wgpu::Buffer,
        shape: (usize, usize),
        place: (usize, usize),
        segs: u32,
    ) {
        let n = (shape.0 * shape.1) as u32;
        self.ctx.dispatch(&Dispatch {
            shader: Shader::SumSegments,
            entry: "sum_segments",
            consts: &[],
            params: &[n, shape.1 as u32, place.0 as u32, place.1 as u32, segs, n],
            buffers: &[part, y],
            groups: self.ctx.grid(n.div_ceil(self.ctx.wg)),
        });
    }

    /// One row chunk `c` of `w` for `n` tokens through the chunk kernel with tile `t`:
    /// `bufs` are the dispatch's storage buffers (x, y, weights, scales), `params` the
    /// matvec parameter block. Where K is split, the segments' partial sums go to a scratch
    /// buffer and a `sum_segments` pass writes y.
    fn gemm_chunk(
        &self,
        w: &GpuMat,
        c: &MatChunk,
        n: usize,
        (y, mut bufs): (&wgpu::Buffer, Vec<&wgpu::Buffer>),
        t: GemmTile,
        mut params: [u32; 11],
    ) {
        let groups = (
            (n as u32).div_ceil(t.tokens()),
            (c.rows as u32).div_ceil(t.rows()),
        );
        let out = n * c.rows;
        let (segs, seg_steps) = self.ctx.chunk_gemm.segments(
            u64::from(groups.0) * u64::from(groups.1),
            w.cols_padded.div_ceil(GK as usize) as u64,
            out as u64 * 4,
            self.ctx.max_binding,
        );
        params[9] = seg_steps;
        let part = (segs > 1).then(|| {
            // Each segment's outputs as [token][chunk row], segment after segment.
            params[3] = 0;
            params[4] = c.rows as u32;
            params[10] = out as u32;
            self.ctx
                .buffer(u64::from(segs) * out as u64 * 4, "chunk partial sums")
        });
        if let Some(pb) = &part {
            bufs[1] = pb;
        }
        self.ctx.dispatch(&Dispatch {
            shader: w.format.shader(),
            entry: "gemm",
            consts: &t.consts(self.ctx.wg, w.format.unit_cols() as u32),
            params: &params,
            buffers: &bufs,
            groups: (groups.0, groups.1, segs),
        });
        if let Some(pb) = &part {
            self.sum_segments(pb, y, (n, c.rows), (w.rows, c.row0), segs);
        }
    }

    pub(in crate::backend::gpu) fn matmul_op(&self, w: &GpuMat, x: &GpuAct) -> Result<GpuAct> {
        self.matmul_sharing(w, x, &SharedX::of(&[w]))
    }

    /// `W · x` for each of `ws`: they share x's padded copies and its int4 `x_planes`
    /// pass, so the digit decode is taken when their int4 rows together reach
    /// [`DIGITS_FROM_ROWS`].
    pub(in crate::backend::gpu) fn matmul_many_op(
        &self,
        ws: &[&GpuMat],
        x: &GpuAct,
    ) -> Result<Vec<GpuAct>> {
        let shared = SharedX::of(ws);
        ws.iter()
            .map(|w| self.matmul_sharing(w, x, &shared))
            .collect()
    }

    fn matmul_sharing(&self, w: &GpuMat, x: &GpuAct, shared: &SharedX) -> Result<GpuAct> {
        ensure!(
            x.cols == w.cols,
            "matmul: input width {} does not match the matrix's {} columns",
            x.cols,
            w.cols
        );
        let (y, run) = self.matmul_output(x.rows, w.rows, w.cols)?;
        if !run {
            return Ok(y);
        }
        let xp = shared.padded(w.cols_padded, || self.padded(x, w.cols_padded));
        let uc = w.format.unit_cols();
        let rpg = self.rows_per_group();
        // A chunk of tokens: the tiled kernel decodes each weight unit once per tile.
        let tile = self.ctx.gemm_tile(x.rows);
        // int4's one-token kernels read x as exact integer digits (the digit decode), made
        // once per call (for all its matrices), by the first row chunk that needs them: by
        // default the row-split kernel where the call's int4 rows reach DIGITS_FROM_ROWS;
        // every one-token kernel when asked.
        let int4 = w.format == GpuFormat::Int4;
        let decode = self.ctx.matvec.int4_decode;
        let split_digits = int4
            && match decode {
                Some(d) => d == Int4Decode::Digits,
                None => shared.int4_rows >= DIGITS_FROM_ROWS,
            };
        let cs_digits = int4 && decode == Some(Int4Decode::Digits);
        // Every int4 matrix of the call has x's width, so one padded width: the planes fit
        // them all.
        let planes_of = || {
            &shared
                .planes
                .get_or_init(|| self.x_planes(&xp.buf, (xp.rows, w.cols_padded / uc)))
                .buf
        };
        // A few rows on the matrix units, where the device has them: x's two f16 parts are
        // made once per call for each width.
        if tile.is_none() && takes_matrix_units(&self.ctx, w, x.rows) {
            let xh = shared.halves(w.cols_padded, || {
                self.x_halves(&xp.buf, x.rows, w.cols_padded)
            });
            self.matmul_matrix_units(w, &xh, &y.buf, x.rows)?;
            return Ok(y);
        }
        // A few rows (a decode step of several streams): each weight unit decoded once for
        // all of them.
        let few_shape = few_tokens_shape(
            self.ctx.matvec,
            split_digits,
            (self.ctx.few_token_shape)
                .unwrap_or_else(|| few_token_shape_of(w.format.shader(), split_digits)),
        );
        let few = (self.ctx.few_token_dense && tile.is_none())
            .then(|| {
                few_tokens_variant(
                    w.format.shader(),
                    few_shape,
                    x.rows,
                    w.cols_padded / uc,
                    self.ctx.shared_bytes(),
                )
            })
            .flatten();
        for c in &w.chunks {
            let mut bufs: Vec<&wgpu::Buffer> = vec![&xp.buf, &y.buf, &c.w];
            if let Some(s) = &c.scale {
                bufs.push(s);
            }
            let params = w.chunk_params(c, x.rows);
            if let Some(t) = tile {
                self.gemm_chunk(w, c, x.rows, (&y.buf, bufs), t, params);
                continue;
            }
            let few_groups = (c.rows as u32).div_ceil(rows_per_group_of(self.ctx.wg, few_shape));
            if let Some(consts) = few.as_ref().filter(|_| few_groups >= FEW_FROM_GROUPS) {
                if split_digits {
                    bufs[0] = planes_of();
                }
                self.ctx.dispatch(&Dispatch {
                    shader: w.format.shader(),
                    entry: "dense_few",
                    consts,
                    params: &params,
                    buffers: &bufs,
                    groups: (1, few_groups, 1),
                });
                continue;
            }
            let split_groups = (c.rows as u32).div_ceil(rpg);
            let plan = (self.ctx.stationary)
                .wants(u64::from(split_groups) * x.rows as u64)
                .then(|| self.ctx.stationary_plan(w.cols_padded / uc, c.rows, x.rows))
                .flatten();
            if let Some(plan) = plan {
                let mut cs = [0u32; 12];
                cs[..11].copy_from_slice(&params);
                cs[11] = plan.row_block;
                if cs_digits {
                    bufs[0] = planes_of();
                }
                let consts = stationary_consts(plan, cs_digits);
                self.ctx.dispatch(&Dispatch {
                    shader: w.format.shader(),
                    entry: "dense_cs",
                    consts: &consts,
                    params: &cs,
                    buffers: &bufs,
                    groups: (x.rows as u32, plan.groups(c.rows), 1),
                });
                continue;
            }
            let mut shape = self.ctx.matvec;
            let mut groups = split_groups;
            if split_digits {
                bufs[0] = planes_of();
                shape = digit_shape(shape);
                groups = (c.rows as u32).div_ceil(rows_per_group_of(self.ctx.wg, shape));
            }
            let (entry, consts) = self.row_split(
                w.format.shader(),
                shape,
                w.cols_padded / uc,
                ("dense", "dense_xs"),
            );
            self.ctx.dispatch(&Dispatch {
                shader: w.format.shader(),
                entry,
                consts: &consts,
                params: &params,
                buffers: &bufs,
                groups: (x.rows as u32, groups, 1),
            });
        }
        Ok(y)
    }

    /// x in the layout of the int4 digit decode (`x_planes` in matvec_int4.wgsl: per
    /// 32-column unit, x's exact integer digits, their sum and the power of two, stored by
    /// blocks of 32 units). x is `rows` rows of `units` units, and so is the result.
    fn x_planes(&self, x: &wgpu::Buffer, (rows, units): (usize, usize)) -> GpuAct {
        let out = self.alloc(rows, 32 * units);
        let mut params = [0u32; 11];
        params[1] = units as u32;
        params[2] = rows as u32;
        params[5] = (8 * units) as u32;
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::MatvecInt4,
                entry: "x_planes",
                consts: &[],
                params: &params,
                buffers: &[x, &out.buf],
                groups: (
                    // One invocation per output word of a unit.
                    (32 * units as u32).div_ceil(self.ctx.wg),
                    rows as u32,
                    1,
                ),
            },
            [1, 2],
        );
        out
    }
}

/// What the matrices of one [`GpuBackend::matmul_many_op`] call derive from their common x,
/// made at most once each: its copies padded to a matrix's width, and its integer digits
/// (`x_planes`).
struct SharedX {
    /// Rows of the call's int4 matrices, which decide whether the digits pay.
    int4_rows: usize,
    /// x padded to each width asked for so far.
    padded: RefCell<Vec<(usize, GpuAct)>>,
    /// The planes, once a matrix needed them.
    planes: OnceCell<GpuAct>,
    /// x's f16 parts for the matrix units, for each padded width asked for so far.
    halves: RefCell<Vec<(usize, XHalves)>>,
}

impl SharedX {
    fn of(ws: &[&GpuMat]) -> Self {
        Self {
            int4_rows: ws
                .iter()
                .filter(|w| w.format == GpuFormat::Int4)
                .map(|w| w.rows)
                .sum(),
            padded: RefCell::new(Vec::new()),
            planes: OnceCell::new(),
            halves: RefCell::new(Vec::new()),
        }
    }

    /// x's f16 parts for the matrix units at padded width `cols`: made by `make` the first
    /// time that width is asked for.
    fn halves(&self, cols: usize, make: impl FnOnce() -> XHalves) -> XHalves {
        made_once(&self.halves, cols, make)
    }

    /// x padded to `cols` columns: made by `pad` the first time that width is asked for.
    fn padded(&self, cols: usize, pad: impl FnOnce() -> GpuAct) -> GpuAct {
        made_once(&self.padded, cols, pad)
    }
}

/// The value `made` holds for width `cols`, made by `make` (and kept) the first time.
fn made_once<T: Clone>(
    made: &RefCell<Vec<(usize, T)>>,
    cols: usize,
    make: impl FnOnce() -> T,
) -> T {
    let mut made = made.borrow_mut();
    if let Some((_, v)) = made.iter().find(|(c, _)| *c == cols) {
        return v.clone();
    }
    let v = make();
    made.push((cols, v.clone()));
    v
}

/// int4 matrices of at least this many rows (counted over the matrices of one
/// `matmul_many` call, which share the digit pass) take the integer-digit decode by default.
/// The digit pass costs GPU time and a pass of host time: it pays where several large
/// matrices share it (a KDA layer's four 12288-row projections), not on every small int4
/// matvec of a decode step (docs/perf.md#kernels).
pub const DIGITS_FROM_ROWS: usize = 32768;
