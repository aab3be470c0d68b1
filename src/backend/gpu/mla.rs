//! Absorbed MLA attention on the device over a latent cache that stays there and grows.

use super::buffers::{GpuAct, GpuMlaCache};
use super::context::Dispatch;
use super::shaders::Shader;
use super::GpuBackend;
use crate::backend::{MlaAttnWeights, MlaDims};
use anyhow::{ensure, Result};

/// Heads one `ctx` workgroup carries (the kernel's HT).
const HEAD_TILE: u32 = 8;
/// Lanes per output row of the `outv` kernel.
const OUTV_LANES: u32 = 32;
/// Positions a fresh cache holds before it first grows.
const INITIAL_POSITIONS: usize = 64;

impl GpuBackend {
    pub(super) fn mla_cache_op(&self, d: &MlaDims) -> Result<GpuMlaCache> {
        let stride = (d.kv_lora + d.rope).div_ceil(4) * 4;
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

    fn grow(&self, cache: &mut GpuMlaCache, need: usize) -> Result<()> {
        if need <= cache.capacity {
            return Ok(());
        }
        let capacity = need.max(cache.capacity * 2);
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

    pub(super) fn mla_attend_op(
        &self,
        d: &MlaDims,
        w: &MlaAttnWeights<GpuAct>,
        cache: &mut GpuMlaCache,
        q: &GpuAct,
        c: &GpuAct,
    ) -> Result<GpuAct> {
        ensure!(
            cache.dims == *d,
            "mla_attend: cache was made for {:?}, called with {:?}",
            cache.dims,
            d
        );
        let (h, r, nope, kv) = (d.heads, d.rope, d.nope, d.kv_lora);
        let qw = nope + r;
        crate::backend::shape_checks::mla_inputs(d, (q.rows, q.cols), (c.rows, c.cols))?;
        ensure!(
            w.wk.len() == h * nope * kv && w.wv.len() == h * d.v * kv && w.kv_norm.len() == kv,
            "mla_attend: kv_b_proj blocks do not match {h} heads"
        );
        let n = q.rows;
        let out = self.alloc(n, h * d.v);
        if n == 0 {
            return Ok(out);
        }
        let pos0 = cache.len;
        self.grow(cache, pos0 + n)?;
        let total = pos0 + n;
        let cs = cache.stride;
        let params = |total: usize| -> [u32; 12] {
            [
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
                0,
            ]
        };
        let pr = params(total);
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MlaAttend,
            entry: "append",
            consts: &[],
            params: &pr,
            buffers: &[&c.buf, &cache.buf, &w.kv_norm.buf],
            groups: (n as u32, 1, 1),
        });
        cache.len = total;
        let rows = n * h;
        let x = self.ctx.buffer((rows * cs * 4) as u64, "mla query");
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MlaAttend,
            entry: "qabs",
            consts: &[],
            params: &pr,
            buffers: &[&q.buf, &x, &w.wk.buf],
            groups: self.ctx.grid(rows as u32),
        });
        // Scores: the cache is the matrix of an f32 matvec, one "token" per (t, head).
        let scores = self.ctx.buffer((rows * total * 4) as u64, "mla scores");
        let rpw = self.ctx.wg / OUTV_LANES;
        let rpg = self.rows_per_group();
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MatvecF32,
            entry: "dense",
            consts: &self.mv_consts(),
            params: &[
                total as u32,
                (cs / 4) as u32,
                rows as u32,
                0,
                total as u32,
                (cs / 4) as u32,
                0,
                0,
            ],
            buffers: &[&x, &scores, &cache.buf],
            groups: (rows as u32, (total as u32).div_ceil(rpg), 1),
        });
        let probs = self.ctx.buffer((rows * total * 4) as u64, "mla probs");
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MlaAttend,
            entry: "softmax",
            consts: &[],
            params: &pr,
            buffers: &[&scores, &probs],
            groups: self.ctx.grid(rows as u32),
        });
        let ctxv = self.ctx.buffer((rows * kv * 4) as u64, "mla ctx");
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MlaAttend,
            entry: "ctx",
            consts: &[],
            params: &pr,
            buffers: &[&probs, &ctxv, &cache.buf],
            groups: (
                (kv as u32).div_ceil(self.ctx.wg),
                (h as u32).div_ceil(HEAD_TILE),
                n as u32,
            ),
        });
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MlaAttend,
            entry: "outv",
            consts: &[("LPR", OUTV_LANES)],
            params: &pr,
            buffers: &[&ctxv, &out.buf, &w.wv.buf],
            groups: ((d.v as u32).div_ceil(rpw), rows as u32, 1),
        });
        Ok(out)
    }
}
