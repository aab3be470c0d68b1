//! Absorbed MLA attention on the device over a latent cache that stays there and grows.

use crate::backend::gpu::device::buffers::{GpuAct, GpuMlaCache, GpuRows};
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::row_parts::whole;
use crate::backend::gpu::GpuBackend;
use crate::backend::{MlaAttnWeights, MlaDims};
use anyhow::{ensure, Result};
use std::ops::Range;

/// Heads one `ctx` workgroup carries (the kernel's HT).
const HEAD_TILE: u32 = 8;
/// Lanes per output row of the `outv` kernel.
pub(in crate::backend::gpu) const OUTV_LANES: u32 = 32;
/// Positions a fresh cache holds before it first grows.
const INITIAL_POSITIONS: usize = 64;
/// Positions one `ctx` workgroup walks, at most (fewer chunks only when memory or the grid
/// limit asks).
const CTX_CHUNK: usize = 128;
/// Bytes the `ctx` partial sums may take.
const CTX_PARTIAL_BYTES: usize = 64 << 20;

/// Positions per `ctx` chunk for `rows` query rows of `kv` values over `total` positions:
/// [`CTX_CHUNK`], or longer where the partials would pass [`CTX_PARTIAL_BYTES`] or the
/// grid's `max_z` (`n` tokens × chunks workgroups).
fn ctx_chunk_len(total: usize, n: usize, rows: usize, kv: usize, max_z: usize) -> usize {
    let by_memory = (CTX_PARTIAL_BYTES / (rows * kv * 4).max(1)).max(1);
    let by_grid = (max_z / n.max(1)).max(1);
    let chunks = total.div_ceil(CTX_CHUNK).min(by_memory).min(by_grid).max(1);
    total.div_ceil(chunks).max(1)
}

/// Values one cached position takes in the device buffer (padded to whole vec4s).
fn cache_stride(d: &MlaDims) -> usize {
    (d.kv_lora + d.rope).div_ceil(4) * 4
}

impl GpuBackend {
    /// Positions the largest cache buffer this adapter binds holds.
    pub(in crate::backend::gpu) fn mla_cache_max_positions_op(&self, d: &MlaDims) -> usize {
        (self.ctx.max_binding / (cache_stride(d) * 4) as u64) as usize
    }

    pub(in crate::backend::gpu) fn mla_cache_op(&self, d: &MlaDims) -> Result<GpuMlaCache> {
        let stride = cache_stride(d);
        let capacity = INITIAL_POSITIONS;
        let buf = self.ctx.buffer((capacity * stride * 4) as u64, "mla cache");
        Ok(GpuMlaCache {
            buf,
            capacity,
            len: 0,
            stride,
            dims: *d,
        })
    }

    pub(in crate::backend::gpu) fn grow(&self, cache: &mut GpuMlaCache, need: usize) -> Result<()> {
        if need <= cache.capacity {
            return Ok(());
        }
        // Doubling stops at the binding limit, so a context up to it always fits.
        let most = self.mla_cache_max_positions_op(&cache.dims);
        let capacity = need.max((cache.capacity * 2).min(most));
        let bytes = (capacity * cache.stride * 4) as u64;
        ensure!(
            bytes <= self.ctx.max_binding,
            "mla cache: {capacity} positions x {} values exceed the adapter's binding limit of {} B",
            cache.stride,
            self.ctx.max_binding
        );
        let buf = self.ctx.buffer(bytes, "mla cache");
        self.ctx.copy(
            &cache.buf,
            0,
            &buf,
            0,
            (cache.len * cache.stride * 4) as u64,
        );
        cache.buf = buf;
        cache.capacity = capacity;
        Ok(())
    }

    /// Absorbed MLA over `q`'s rows. The score pass runs one grid row and one
    /// `[total]` row of scores per (token, head), so a window whose rows would exceed the
    /// grid or a binding attends in consecutive blocks of tokens, each appending its latents
    /// before it attends (causal attention sees the same positions either way) and each
    /// reading and writing its rows in place.
    pub(in crate::backend::gpu) fn mla_attend_op(
        &self,
        d: &MlaDims,
        w: &MlaAttnWeights<GpuAct>,
        cache: &mut GpuMlaCache,
        q: &GpuAct,
        c: &GpuAct,
    ) -> Result<GpuAct> {
        let n = q.rows;
        let out = self.alloc(n, d.heads * d.v);
        // A shape mismatch goes to one call over every row, whose checks name it.
        let per = if c.rows == n {
            self.rows_at_once(d, cache.len + n)
        } else {
            n.max(1)
        };
        // At least one call, so an empty window meets the checks too.
        let mut start = 0;
        loop {
            let rows = start..n.min(start + per);
            start = rows.end;
            self.mla_attend_staged(d, w, &mut [(&mut *cache, rows)], q, c, &out)?;
            if start >= n {
                return Ok(out);
            }
        }
    }

    /// Query rows one call attends at once over `total` positions: one grid row and one
    /// `[total]` row of scores a (row, head), within the grid and a binding.
    fn rows_at_once(&self, d: &MlaDims, total: usize) -> usize {
        let h = d.heads.max(1);
        let by_grid = self.ctx.limits.max_compute_workgroups_per_dimension as usize / h;
        let by_scores = (self.ctx.max_binding / (h as u64 * total.max(1) as u64 * 4)) as usize;
        by_grid.min(by_scores).max(1)
    }

    /// The attention of several pieces of one pass, each its own sequence with its own
    /// cache: piece i's rows of `q` and `c` attend over cache i. `None` where a piece's rows
    /// would exceed the score pass's grid or binding (one piece at a time serves those
    /// through [`Self::mla_attend_op`]).
    pub(in crate::backend::gpu) fn mla_attend_pieces_op(
        &self,
        d: &MlaDims,
        w: &MlaAttnWeights<GpuAct>,
        pieces: &mut [(&mut GpuMlaCache, Range<usize>)],
        q: &GpuAct,
        c: &GpuAct,
    ) -> Result<Option<GpuAct>> {
        let ranges: Vec<Range<usize>> = pieces.iter().map(|(_, r)| r.clone()).collect();
        crate::backend::shape_checks::pieces_cover("mla_attend", &ranges, q.rows)?;
        let too_many = |(cache, rows): &(&mut GpuMlaCache, Range<usize>)| {
            rows.len() > self.rows_at_once(d, cache.len + rows.len())
        };
        if pieces.iter().any(too_many) {
            return Ok(None);
        }
        let out = self.alloc(q.rows, d.heads * d.v);
        self.mla_attend_staged(d, w, pieces, q, c, &out)?;
        Ok(Some(out))
    }

    /// The kernels of every piece, recorded stage by stage (every piece's append, then every
    /// piece's query, scores, softmax, context and output) into the pieces' rows of `out`:
    /// a piece's stages write buffers of its own, so the pieces' dispatches of one stage run
    /// side by side on the device, where piece after piece put a barrier between every two
    /// dispatches. Rows are read and written in place (`row0`), so no piece is sliced out
    /// or copied back.
    fn mla_attend_staged(
        &self,
        d: &MlaDims,
        w: &MlaAttnWeights<GpuAct>,
        pieces: &mut [(&mut GpuMlaCache, Range<usize>)],
        q: &GpuAct,
        c: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        let (h, r, nope, kv) = (d.heads, d.rope, d.nope, d.kv_lora);
        let qw = nope + r;
        crate::backend::shape_checks::mla_inputs(d, (q.rows, q.cols), (c.rows, c.cols))?;
        ensure!(
            w.wk.len() == h * nope * kv && w.wv.len() == h * d.v * kv && w.kv_norm.len() == kv,
            "mla_attend: kv_b_proj blocks do not match {h} heads"
        );
        let max_z = self.ctx.limits.max_compute_workgroups_per_dimension as usize;
        let mut calls = Vec::with_capacity(pieces.len());
        for (cache, rows) in pieces.iter_mut() {
            ensure!(
                cache.dims == *d,
                "mla_attend: cache was made for {:?}, called with {:?}",
                cache.dims,
                d
            );
            let n = rows.len();
            if n == 0 {
                continue;
            }
            let pos0 = cache.len;
            let total = pos0 + n;
            self.grow(cache, total)?;
            cache.len = total;
            let cs = cache.stride;
            let nh = n * h;
            let plen = ctx_chunk_len(total, n, nh, kv, max_z);
            let chunks = total.div_ceil(plen);
            calls.push(PieceCall {
                cache: cache.buf.clone(),
                params: [
                    n as u32,
                    h as u32,
                    kv as u32,
                    r as u32,
                    nope as u32,
                    d.v as u32,
                    cs as u32,
                    pos0 as u32,
                    total as u32,
                    d.norm_eps.to_bits(),
                    (1.0 / (qw as f32).sqrt()).to_bits(),
                    plen as u32,
                    rows.start as u32,
                ],
                n,
                cs,
                total,
                chunks,
                query: self.scratch((nh * cs * 4) as u64, "mla query"),
                scores: self.scratch((nh * total * 4) as u64, "mla scores"),
                probs: self.scratch((nh * total * 4) as u64, "mla probs"),
                ctx: self.scratch((nh * kv * 4) as u64, "mla ctx"),
                // One chunk writes the ctx itself; more write partial sums that ctx_sum
                // adds up.
                partial: (chunks > 1)
                    .then(|| self.scratch((chunks * nh * kv * 4) as u64, "mla ctx partials")),
            });
        }
        let attend = |entry: &'static str,
                      consts: &[(&'static str, u32)],
                      k: &PieceCall,
                      buffers: &[&wgpu::Buffer],
                      groups| {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::MlaAttend,
                entry,
                consts,
                params: &k.params,
                buffers,
                groups,
            });
        };
        for k in &calls {
            attend(
                "append",
                &[],
                k,
                &[&c.buf, &k.cache, &w.kv_norm.buf],
                (k.n as u32, 1, 1),
            );
        }
        for k in &calls {
            let groups = self.ctx.grid((k.n * h) as u32);
            attend("qabs", &[], k, &[&q.buf, &k.query.buf, &w.wk.buf], groups);
        }
        // Scores: the cache is the matrix of an f32 matvec, one "token" per (t, head).
        let rpg = self.rows_per_group();
        for k in &calls {
            let (total, cs, nh) = (k.total as u32, k.cs as u32, (k.n * h) as u32);
            self.ctx.dispatch(&Dispatch {
                shader: Shader::MatvecF32,
                entry: "dense",
                consts: &self.mv_consts(),
                params: &[total, cs / 4, nh, 0, total, cs / 4, 0, 0],
                buffers: &[&k.query.buf, &k.scores.buf, &k.cache],
                groups: (nh, total.div_ceil(rpg), 1),
            });
        }
        for k in &calls {
            let groups = self.ctx.grid((k.n * h) as u32);
            attend("softmax", &[], k, &[&k.scores.buf, &k.probs.buf], groups);
        }
        for k in &calls {
            let to = k.partial.as_ref().unwrap_or(&k.ctx);
            let groups = (
                (kv as u32).div_ceil(self.ctx.wg),
                (h as u32).div_ceil(HEAD_TILE),
                (k.n * k.chunks) as u32,
            );
            attend("ctx", &[], k, &[&k.probs.buf, &to.buf, &k.cache], groups);
        }
        for k in &calls {
            if let Some(part) = &k.partial {
                let groups = self.ctx.grid(((k.n * h * kv) as u32).div_ceil(self.ctx.wg));
                attend("ctx_sum", &[], k, &[&part.buf, &k.ctx.buf], groups);
            }
        }
        let rpw = self.ctx.wg / OUTV_LANES;
        for k in &calls {
            let groups = ((d.v as u32).div_ceil(rpw), (k.n * h) as u32, 1);
            attend(
                "outv",
                &[("LPR", OUTV_LANES)],
                k,
                &[&k.ctx.buf, &out.buf, &w.wv.buf],
                groups,
            );
        }
        Ok(())
    }
}

/// The attention weights, each read whole.
pub(in crate::backend::gpu) fn weights_whole(
    w: &MlaAttnWeights<GpuRows>,
) -> Result<MlaAttnWeights<GpuAct>> {
    let op = "mla_attend";
    Ok(MlaAttnWeights {
        kv_norm: whole(&w.kv_norm, op, "kv_norm")?.clone(),
        wk: whole(&w.wk, op, "wk")?.clone(),
        wv: whole(&w.wv, op, "wv")?.clone(),
    })
}

/// One piece's part of a staged attention call: its cache, parameters and scratch.
struct PieceCall {
    cache: wgpu::Buffer,
    /// `MlaParams` of mla_attend.wgsl.
    params: [u32; 13],
    n: usize,
    /// Values a cached position takes.
    cs: usize,
    total: usize,
    chunks: usize,
    query: GpuAct,
    scores: GpuAct,
    probs: GpuAct,
    ctx: GpuAct,
    partial: Option<GpuAct>,
}

/// The MLA attention kernels' pipelines.
pub(crate) fn pipeline_variants(_a: AdapterShape, list: &mut VariantList) {
    for entry in ["append", "qabs", "softmax", "ctx", "ctx_sum"] {
        list.push(Shader::MlaAttend, entry, Vec::new());
    }
    list.push(Shader::MlaAttend, "outv", vec![("LPR", OUTV_LANES)]);
}

#[cfg(test)]
mod tests {
    use super::{ctx_chunk_len, CTX_CHUNK};

    #[test]
    fn ctx_chunks_keep_positions_short_within_memory_and_grid() {
        // Decode over 4096 positions, 96 heads of 512: 32 chunks of 128.
        assert_eq!(ctx_chunk_len(4096, 1, 96, 512, 65535), CTX_CHUNK);
        // Short caches stay one chunk.
        assert_eq!(ctx_chunk_len(100, 1, 96, 512, 65535), 100);
        // A 512-token prefill: one chunk's partials would already pass 64 MB, so one chunk.
        assert_eq!(ctx_chunk_len(4096, 512, 512 * 96, 512, 65535), 4096);
        // The grid's z limit (tokens × chunks) caps the chunk count: 16 chunks of 256.
        assert_eq!(ctx_chunk_len(4096, 4000, 4000, 4, 65535), 256);
    }
}
