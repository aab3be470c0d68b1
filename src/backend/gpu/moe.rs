//! Routed experts on the device, batched: every chosen expert × every token that chose it
//! in one dispatch per matrix (per binding-sized batch of experts). Expert bytes are
//! uploaded as their native MXFP4 bytes; rows are gathered from z and scattered back by
//! routing tables built on the host.

use super::buffers::GpuAct;
use super::chunk_gemm::{GemmTile, GK};
use super::context::{Dispatch, MatvecShape};
use super::expert_bytes::{all_host, ExpertSrc, MatSrc, PartSrc};
use super::expert_tier::ExpertTier;
use super::matmul::rows_per_group_of;
use super::pipeline_variants::special_const;
use super::shaders::Shader;
use super::GpuBackend;
use crate::backend::{ExpertAssignment, ExpertWeights, Glu};
use crate::quant::Mxfp4View;
use anyhow::{anyhow, bail, ensure, Result};
use std::collections::{HashMap, HashSet};

/// Columns per MXFP4 scale block (one kernel unit).
const BLOCK: usize = 32;

/// The device copy of a run of experts' matrices: packed nibbles and scale bytes, expert
/// after expert, each expert's matrices stacked row-wise.
#[derive(Clone)]
pub(super) struct Arena {
    packed: wgpu::Buffer,
    scales: wgpu::Buffer,
    /// Whether a matrix this call reads from it may hold a scale above
    /// [`FAST_SCALE_MAX`](super::expert_bytes::FAST_SCALE_MAX): its kernels then keep the
    /// per-element path (`SPECIAL` 1), which costs the batched matvec bandwidth
    /// (docs/perf.md#kernels).
    huge: bool,
}

/// Transient arenas kept for reuse: the first few of a call, each up to
/// [`REUSED_ARENA_BYTES`]. A decode step's 16 experts (≈ 180 + 90 MB) fit, so streaming
/// allocates nothing per layer; a large prefill call's arenas are made for it and dropped
/// after.
const REUSED_ARENAS: usize = 4;
/// The largest packed (or scale) buffer a reused arena keeps.
const REUSED_ARENA_BYTES: u64 = 256 << 20;
/// Below this many output rows over all its (expert, token) pairs, an MXFP4 dispatch uses
/// the dense geometry: the expert geometry's 128-row workgroups would be fewer than about
/// two per SM of a large GPU. Measured at the ends only: one expert's 3072 rows read faster
/// in the dense geometry, 16 experts' 98304 in the expert one (docs/perf.md#kernels).
const FEW_ROWS: u64 = 32768;

/// Routing of one call: work items (slot, first pair, pairs), grouped by arena set, gather
/// tables, scatter CSR.
struct Routing {
    /// `[items × 3] | token of pair | pair | csr offsets (rows + 1) | pair ids | weight bits`.
    words: Vec<u32>,
    tok_map: u32,
    id_map: u32,
    csr: u32,
    csr_pairs: u32,
    csr_weights: u32,
    pairs: usize,
    /// Pairs 0 .. tiled_pairs go through the chunk kernel.
    tiled_pairs: usize,
    /// Per group (arena set): its one-pair items and its tiled items, each as (first item,
    /// count).
    group_items: Vec<[(u32, u32); 2]>,
}

/// Builds the routing tables; `place[e]` is expert e's (group, slot). An expert with at
/// least `tiled.0` tokens gets items of up to `tiled.1` consecutive pairs (for the chunk
/// kernel), listed after the group's one-pair items (for the matvec); `tiled.0 == 0` gives
/// one-pair items only. The tiled experts' pairs are numbered first, so the chunk kernel's
/// outputs are one block of rows (`tiled_pairs`). Each token's pairs are listed in expert
/// list order, so the scatter sums a row's experts in the same order whatever arenas or
/// kernels they go through.
fn build_routing(
    experts: &[ExpertAssignment<'_>],
    rows: usize,
    place: &[(usize, u32)],
    groups: usize,
    tiled: (usize, usize),
) -> Result<Routing> {
    let is_tiled = |n: usize| tiled.0 > 0 && tiled.1 > 0 && n >= tiled.0;
    // Pair ids: the tiled experts' first, then the others, each in group then list order.
    let mut first_pair = vec![0u32; experts.len()];
    let mut next = 0u32;
    let mut tiled_pairs = 0;
    for want_tiled in [true, false] {
        for g in 0..groups {
            for (e, ex) in experts.iter().enumerate() {
                if place[e].0 == g && is_tiled(ex.tokens.len()) == want_tiled {
                    first_pair[e] = next;
                    next += ex.tokens.len() as u32;
                }
            }
        }
        if want_tiled {
            tiled_pairs = next as usize;
        }
    }
    let mut tok_of_pair = vec![0u32; next as usize];
    let mut items = Vec::new();
    let mut group_items = Vec::with_capacity(groups);
    for g in 0..groups {
        let first_item = items.len() / 3;
        let mut tiles = Vec::new();
        for (e, ex) in experts.iter().enumerate() {
            let (eg, slot) = place[e];
            if eg != g {
                continue;
            }
            let p0 = first_pair[e];
            for (k, &(t, _)) in ex.tokens.iter().enumerate() {
                ensure!(t < rows, "moe: token row {t} out of range ({rows} rows)");
                tok_of_pair[p0 as usize + k] = t as u32;
            }
            let n = ex.tokens.len();
            if is_tiled(n) {
                for k in (0..n).step_by(tiled.1) {
                    tiles.extend([slot, p0 + k as u32, tiled.1.min(n - k) as u32]);
                }
            } else {
                items.extend((0..n as u32).flat_map(|k| [slot, p0 + k, 1]));
            }
        }
        let one = (first_item as u32, (items.len() / 3 - first_item) as u32);
        items.extend(tiles);
        let tiled_first = one.0 + one.1;
        group_items.push([one, (tiled_first, items.len() as u32 / 3 - tiled_first)]);
    }
    let mut per_token: Vec<Vec<(u32, f32)>> = vec![Vec::new(); rows];
    for (e, ex) in experts.iter().enumerate() {
        for (j, &(t, w)) in ex.tokens.iter().enumerate() {
            per_token[t].push((first_pair[e] + j as u32, w));
        }
    }
    let pairs = tok_of_pair.len();
    let mut words = items;
    let tok_map = words.len() as u32;
    words.extend(&tok_of_pair);
    let id_map = words.len() as u32;
    words.extend(0..pairs as u32);
    let csr = words.len() as u32;
    let mut off = 0u32;
    words.push(0);
    for t in &per_token {
        off += t.len() as u32;
        words.push(off);
    }
    let csr_pairs = words.len() as u32;
    words.extend(per_token.iter().flatten().map(|&(p, _)| p));
    let csr_weights = words.len() as u32;
    words.extend(per_token.iter().flatten().map(|&(_, w)| w.to_bits()));
    Ok(Routing {
        words,
        tok_map,
        id_map,
        csr,
        csr_pairs,
        csr_weights,
        pairs,
        tiled_pairs,
        group_items,
    })
}

/// How one expert pass runs its tiled items through the chunk kernel.
struct ChunkPass {
    tile: GemmTile,
    /// K segments and steps per segment.
    segs: u32,
    seg_steps: u32,
    /// The partial sums, `segs × pairs × rows`, when K is split.
    part: Option<wgpu::Buffer>,
    pairs: usize,
    rows: usize,
}

impl ChunkPass {
    /// Words between segments' partial outputs (0: one segment, written straight to y).
    fn seg_stride(&self) -> u32 {
        if self.part.is_some() {
            (self.pairs * self.rows) as u32
        } else {
            0
        }
    }
}

/// One set of expert arenas: gate+up rows and down rows, slot-indexed alike.
#[derive(Clone)]
struct ArenaSet {
    up: Arena,
    down: Arena,
}

impl ArenaSet {
    /// This set for one call whose experts in it may (`huge`) hold huge scales.
    fn marked(&self, huge: bool) -> Self {
        Self {
            up: Arena {
                huge,
                ..self.up.clone()
            },
            down: Arena {
                huge,
                ..self.down.clone()
            },
        }
    }
}

/// The VRAM expert tier: bookkeeping plus its device pools (allocated as slots fill).
#[derive(Default)]
pub(super) struct TierState {
    /// Which expert sits in which slot.
    pub book: ExpertTier,
    pools: Vec<ArenaSet>,
    /// Slots whose expert may hold a scale above
    /// [`FAST_SCALE_MAX`](super::expert_bytes::FAST_SCALE_MAX) (its scale bytes had one, or
    /// never passed through host memory).
    huge: HashSet<usize>,
}

/// Device bytes of one `[I, D]` expert's six tensors.
fn expert_bytes(i: usize, d: usize) -> u64 {
    let m = (i * d) as u64;
    3 * m / 2 + 3 * m / BLOCK as u64
}

impl GpuBackend {
    /// Uploads matrices stacked row-wise as one arena, straight from where their bytes are.
    /// Arena `reuse` of a call (below [`REUSED_ARENAS`], bytes within
    /// [`REUSED_ARENA_BYTES`], 4-byte sizes) is written into buffers kept from earlier calls;
    /// queue writes are ordered after the work already submitted against them, device
    /// copies after the work recorded. Others are made for this call.
    fn arena(&self, mats: &[MatSrc<'_>], reuse: Option<usize>) -> Result<Arena> {
        let huge = mats.iter().any(MatSrc::may_have_huge_scales);
        let (mut packed, mut scales) = (Vec::new(), Vec::new());
        let (mut po, mut so) = (0u64, 0u64);
        for m in mats {
            packed.push((po, m.packed));
            po += m.packed.len();
            scales.push((so, m.scales));
            so += m.scales.len();
        }
        // Queue writes need 4-byte offsets and sizes.
        let aligned = mats
            .iter()
            .all(|m| m.packed.len() % 4 == 0 && m.scales.len() % 4 == 0);
        let slot =
            reuse.filter(|&k| k < REUSED_ARENAS && aligned && po.max(so) <= REUSED_ARENA_BYTES);
        let Some(k) = slot else {
            let made = |size: u64, parts: &[(u64, PartSrc<'_>)], label: &str| match all_host(parts)
            {
                Some(h) => self.ctx.buffer_from_parts(size, &h, label),
                None => {
                    let b = self.ctx.buffer(size, label);
                    self.write_srcs(&b, parts);
                    Ok(b)
                }
            };
            return Ok(Arena {
                packed: made(po, &packed, "expert packed")?,
                scales: made(so, &scales, "expert scales")?,
                huge,
            });
        };
        let a = {
            let mut pool = self
                .transient
                .lock()
                .map_err(|_| anyhow!("GPU transient arenas poisoned by an earlier panic"))?;
            if pool.len() <= k {
                pool.resize_with(k + 1, || None);
            }
            let fits = pool[k]
                .as_ref()
                .is_some_and(|a| a.packed.size() >= po && a.scales.size() >= so);
            if !fits {
                pool[k] = Some(Arena {
                    packed: self.ctx.buffer(
                        REUSED_ARENA_BYTES.min(po.max(1).next_power_of_two()),
                        "expert packed (reused)",
                    ),
                    scales: self.ctx.buffer(
                        REUSED_ARENA_BYTES.min(so.max(1).next_power_of_two()),
                        "expert scales (reused)",
                    ),
                    huge: true,
                });
            }
            let kept = pool[k]
                .clone()
                .ok_or_else(|| anyhow!("internal: transient arena {k} missing"))?;
            Arena { huge, ..kept }
        };
        // One staging copy per buffer for host bytes: the parts lie back to back.
        self.write_srcs(&a.packed, &packed);
        self.write_srcs(&a.scales, &scales);
        Ok(a)
    }

    /// One batched MXFP4 matmul: `rows` output rows per expert slot, `cols` inputs; the
    /// one-pair items through the matvec (in geometry `big` where they are many rows), the
    /// tiled ones through the chunk kernel's `tile`.
    #[allow(clippy::too_many_arguments)]
    fn mxfp4_batched(
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

    /// How one expert pass (`rows` × `cols` per expert) runs the `items` tiled items of
    /// `rt`: K segments where the tiles alone would not fill the GPU, and their partial sums.
    fn chunk_pass(
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
    fn finish_chunk_pass(&self, c: Option<&ChunkPass>, y: &wgpu::Buffer) {
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
    fn expert_tiling(&self, most: usize) -> (Option<GemmTile>, (usize, usize)) {
        match self.ctx.gemm_tile(most) {
            Some(t) => (
                Some(t),
                (
                    self.ctx.chunk_gemm.from_tokens as usize,
                    t.tokens() as usize,
                ),
            ),
            None => (None, (0, 0)),
        }
    }

    /// `y[t] = W · x[t]` for a native MXFP4 matrix, decoded in the kernel.
    pub fn matmul_mxfp4(&self, w: Mxfp4View<'_>, x: &GpuAct) -> Result<GpuAct> {
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
            weights: Some(ExpertWeights {
                w1: w,
                w2: w,
                w3: w,
            }),
            staged: None,
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

    /// Sizes the VRAM expert tier: `bytes / expert bytes` slots, at most `experts`, for
    /// `[I, D]` experts. Drops whatever the tier held.
    pub(super) fn configure_tier_op(
        &self,
        bytes: u64,
        experts: usize,
        i: usize,
        d: usize,
    ) -> Result<usize> {
        let per_expert = expert_bytes(i, d);
        if bytes < per_expert.max(1) || experts == 0 {
            *self.tier()? = TierState::default();
            return Ok(0);
        }
        ensure!(
            per_expert > 0 && d % BLOCK == 0 && i % BLOCK == 0 && (i * d) % (4 * BLOCK) == 0,
            "GPU expert tier: expert shape [{i}, {d}] does not give 4-byte aligned MXFP4 tensors"
        );
        let per_pool = (self.ctx.max_binding / (i * d) as u64) as usize;
        ensure!(
            per_pool > 0,
            "GPU expert tier: one expert's gate+up ({} B) exceeds the adapter's binding limit of {} B",
            i * d,
            self.ctx.max_binding
        );
        let capacity = ((bytes / per_expert) as usize).min(experts);
        *self.tier()? = TierState {
            book: ExpertTier::new(capacity, per_pool, (i, d)),
            pools: Vec::new(),
            huge: HashSet::new(),
        };
        Ok(capacity)
    }

    /// Writes expert `w` into slot `slot` of the tier, straight from where its bytes are.
    fn upload_to_slot(&self, t: &mut TierState, slot: usize, w: &ExpertSrc<'_>) -> Result<()> {
        let (i, d) = t.book.dims();
        let per_pool = t.book.per_pool();
        let (p, ls) = (slot / per_pool, (slot % per_pool) as u64);
        while t.pools.len() <= p {
            let n = t.book.pool_slots(t.pools.len()) as u64;
            let m = (i * d) as u64;
            let blk = BLOCK as u64;
            let arena = |packed: u64, scales: u64, what: &str| Arena {
                packed: self
                    .ctx
                    .buffer(n * packed, &format!("expert tier {what} packed")),
                scales: self
                    .ctx
                    .buffer(n * scales, &format!("expert tier {what} scales")),
                // A call's copy of a pool says whether the slots it reads may have huge
                // scales (`TierState::huge`).
                huge: true,
            };
            t.pools.push(ArenaSet {
                up: arena(m, 2 * m / blk, "gate|up"),
                down: arena(m / 2, m / blk, "down"),
            });
        }
        if w.may_have_huge_scales() {
            t.huge.insert(slot);
        } else {
            t.huge.remove(&slot);
        }
        let pool = &t.pools[p];
        let m = (i * d) as u64;
        let (hp, hs) = (m / 2, m / BLOCK as u64);
        // Queue writes are ordered after everything recorded so far (`write` submits first),
        // so work already recorded against an evicted slot still sees its old expert.
        self.write_srcs(
            &pool.up.packed,
            &[(ls * 2 * hp, w.w1.packed), (ls * 2 * hp + hp, w.w3.packed)],
        );
        self.write_srcs(
            &pool.up.scales,
            &[(ls * 2 * hs, w.w1.scales), (ls * 2 * hs + hs, w.w3.scales)],
        );
        self.write_srcs(&pool.down.packed, &[(ls * hp, w.w2.packed)]);
        self.write_srcs(&pool.down.scales, &[(ls * hs, w.w2.scales)]);
        Ok(())
    }

    pub(super) fn moe_accumulate_op(
        &self,
        out: &mut GpuAct,
        z: &GpuAct,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        let d = z.cols;
        crate::backend::shape_checks::moe_accumulator((out.rows, out.cols), (z.rows, z.cols))?;
        if experts.is_empty() {
            return Ok(());
        }
        let mut tier = self.tier()?;
        let name = |e: &ExpertAssignment<'_>| {
            e.key.map_or("an unnamed expert".to_string(), |k| {
                format!("expert {} of layer {}", k.id, k.layer)
            })
        };
        // Where each expert's bytes are: host views, a lent staging buffer, or nothing (it
        // is resident in the tier).
        let srcs: Vec<Option<ExpertSrc<'_>>> = experts
            .iter()
            .map(|ex| match (&ex.weights, &ex.staged) {
                (Some(w), _) => ExpertSrc::host(w, d).map(Some),
                (None, Some(st)) => ExpertSrc::staged(st, d).map(Some),
                (None, None) => Ok(None),
            })
            .collect::<Result<_>>()?;
        let i = match srcs.iter().flatten().next() {
            Some(w) => w.dims.0,
            None => tier.book.dims().0,
        };
        for (ex, src) in experts.iter().zip(&srcs) {
            match src {
                Some(w) => ensure!(
                    w.dims == (i, d),
                    "moe: {} is [{}, {}] but another expert of the call is [{i}, {d}]",
                    name(ex),
                    w.dims.0,
                    w.dims.1
                ),
                None => ensure!(
                    tier.book.dims() == (i, d),
                    "moe: {} is resident as [{}, {}] but the call needs [{i}, {d}]",
                    name(ex),
                    tier.book.dims().0,
                    tier.book.dims().1
                ),
            }
        }
        // Experts per transient batch: each batch's gate+up arena must fit one binding.
        let per_expert = (i * d) as u64;
        let per_batch = (self.ctx.max_binding / per_expert.max(1)) as usize;
        if per_batch == 0 {
            bail!("moe: one expert's gate+up ({per_expert} B) exceeds the adapter's binding limit of {} B", self.ctx.max_binding);
        }
        let pairs: usize = experts.iter().map(|e| e.tokens.len()).sum();
        ensure!(
            pairs <= self.ctx.limits.max_compute_workgroups_per_dimension as usize,
            "moe: {pairs} (token, expert) pairs in one call exceed the adapter's {} workgroups per dimension; use a smaller --chunk",
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        // Place every expert: in a tier slot (resident, or uploaded there now), else in a
        // transient arena for this call only.
        let tier_fits = tier.book.dims() == (i, d);
        let mut place = Vec::with_capacity(experts.len());
        let mut group_of_pool: HashMap<usize, usize> = HashMap::new();
        let mut sets: Vec<Option<ArenaSet>> = Vec::new();
        let mut busy = HashSet::new();
        let mut transient: Vec<Vec<MatSrc<'_>>> = Vec::new();
        let mut transient_down: Vec<Vec<MatSrc<'_>>> = Vec::new();
        let mut transient_group = None;
        for (ex, src) in experts.iter().zip(&srcs) {
            let mut slot = None;
            if let (Some(key), true) = (ex.key, tier_fits) {
                slot = tier.book.lookup(key);
                if slot.is_none() {
                    if let Some(w) = src {
                        if let Some(s) = tier.book.reserve(key, &busy) {
                            self.upload_to_slot(&mut tier, s, w)?;
                            slot = Some(s);
                        }
                    }
                }
            }
            if let Some(s) = slot {
                busy.insert(s);
                let per_pool = tier.book.per_pool();
                let g = *group_of_pool.entry(s / per_pool).or_insert_with(|| {
                    sets.push(None);
                    sets.len() - 1
                });
                let huge = tier.huge.contains(&s);
                match &mut sets[g] {
                    Some(set) => {
                        set.up.huge |= huge;
                        set.down.huge |= huge;
                    }
                    None => {
                        let pool = tier.pools.get(s / per_pool).ok_or_else(|| {
                            anyhow!("internal: GPU expert tier slot {s} has no device pool")
                        })?;
                        sets[g] = Some(pool.marked(huge));
                    }
                }
                place.push((g, (s % per_pool) as u32));
                continue;
            }
            let w = src.as_ref().ok_or_else(|| {
                anyhow!(
                    "moe: {} has no weights and is not resident in the GPU expert tier; pin it with pin_resident_experts before the layer runs",
                    name(ex)
                )
            })?;
            let g = match transient_group {
                Some(g) if transient.last().is_some_and(|b| b.len() / 2 < per_batch) => g,
                _ => {
                    sets.push(None);
                    transient.push(Vec::new());
                    transient_down.push(Vec::new());
                    transient_group = Some(sets.len() - 1);
                    sets.len() - 1
                }
            };
            let (Some(up), Some(down)) = (transient.last_mut(), transient_down.last_mut()) else {
                bail!("internal: no transient arena open");
            };
            place.push((g, down.len() as u32));
            up.extend([w.w1, w.w3]);
            down.push(w.w2);
        }
        drop(tier);
        // Transient arenas fill the groups left empty, in the order they were opened.
        let mut tb = transient.iter().zip(&transient_down);
        for (j, set) in sets.iter_mut().filter(|s| s.is_none()).enumerate() {
            let Some((up, down)) = tb.next() else {
                bail!("internal: a MoE arena group has no buffers");
            };
            *set = Some(ArenaSet {
                up: self.arena(up, Some(2 * j))?,
                down: self.arena(down, Some(2 * j + 1))?,
            });
        }
        let sets: Vec<ArenaSet> = sets.into_iter().flatten().collect();
        let most = experts.iter().map(|e| e.tokens.len()).max().unwrap_or(0);
        let (tile, tiled) = self.expert_tiling(most);
        let rt = build_routing(experts, z.rows, &place, sets.len(), tiled)?;
        if rt.pairs == 0 {
            return Ok(());
        }
        let rtb = self
            .ctx
            .buffer_init(bytemuck::cast_slice(&rt.words), "routing");
        // Activations, so their buffers come back for the next call (no zero-fill each time).
        let h = self.alloc(rt.pairs, 2 * i);
        let act = self.alloc(rt.pairs, i);
        let ypair = self.alloc(rt.pairs, d);
        let (h, ypair) = (&h.buf, &ypair.buf);
        let chunk = self.chunk_pass(tile, &rt, 2 * i, d);
        let (big, big_down) = (self.ctx.expert_matvec, self.ctx.expert_down_matvec);
        for (set, &items) in sets.iter().zip(&rt.group_items) {
            let c = chunk.as_ref();
            self.mxfp4_batched(
                big,
                &set.up,
                &z.buf,
                h,
                &rtb,
                2 * i,
                d,
                rt.tok_map,
                items,
                c,
            );
        }
        self.finish_chunk_pass(chunk.as_ref(), h);
        let iu = i as u32;
        self.glu_strided(h, h, &act, glu, (2 * iu, 2 * iu, iu));
        let chunk = self.chunk_pass(tile, &rt, d, i);
        for (set, &items) in sets.iter().zip(&rt.group_items) {
            let c = chunk.as_ref();
            self.mxfp4_batched(
                big_down, &set.down, &act.buf, ypair, &rtb, d, i, rt.id_map, items, c,
            );
        }
        self.finish_chunk_pass(chunk.as_ref(), ypair);
        if !out.is_empty() {
            self.ctx.dispatch(&Dispatch {
                shader: Shader::Moe,
                entry: "scatter",
                consts: &[],
                params: &[
                    out.len() as u32,
                    d as u32,
                    rt.csr,
                    rt.csr_pairs,
                    rt.csr_weights,
                ],
                buffers: &[ypair, &rtb, &out.buf],
                groups: self.ctx.grid((out.len() as u32).div_ceil(self.ctx.wg)),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::build_routing;
    use crate::backend::ExpertAssignment;

    fn expert(tokens: &[usize]) -> ExpertAssignment<'static> {
        ExpertAssignment {
            key: None,
            weights: None,
            staged: None,
            tokens: tokens.iter().map(|&t| (t, 0.5)).collect(),
        }
    }

    /// Items as (slot, first pair, pairs) triples.
    fn items(words: &[u32], (first, count): (u32, u32)) -> Vec<[u32; 3]> {
        (first..first + count)
            .map(|i| {
                let b = 3 * i as usize;
                [words[b], words[b + 1], words[b + 2]]
            })
            .collect()
    }

    #[test]
    fn tiled_experts_take_the_first_pairs_in_runs_of_a_tile() {
        // Experts 0 and 2 have 5 and 3 tokens (tiled from 3, tiles of 2); expert 1 has 1.
        let experts = [expert(&[0, 1, 2, 3, 4]), expert(&[2]), expert(&[1, 3, 4])];
        // Experts 0 and 1 in group 0 (slots 4 and 7), expert 2 in group 1 (slot 0).
        let place = [(0, 4), (0, 7), (1, 0)];
        let rt = build_routing(&experts, 5, &place, 2, (3, 2)).unwrap();
        assert_eq!((rt.pairs, rt.tiled_pairs), (9, 8));
        let g0 = rt.group_items[0];
        let g1 = rt.group_items[1];
        // Tiled pairs: expert 0 → 0..5, expert 2 → 5..8; expert 1's one pair is 8.
        assert_eq!(items(&rt.words, g0[0]), vec![[7, 8, 1]]);
        assert_eq!(
            items(&rt.words, g0[1]),
            vec![[4, 0, 2], [4, 2, 2], [4, 4, 1]]
        );
        assert_eq!(items(&rt.words, g1[0]), Vec::<[u32; 3]>::new());
        assert_eq!(items(&rt.words, g1[1]), vec![[0, 5, 2], [0, 7, 1]]);
        // Each pair's token, and each token's pairs in expert list order.
        let tok = &rt.words[rt.tok_map as usize..][..rt.pairs];
        assert_eq!(tok, &[0, 1, 2, 3, 4, 1, 3, 4, 2]);
        let csr = &rt.words[rt.csr as usize..][..6];
        let pairs = &rt.words[rt.csr_pairs as usize..][..rt.pairs];
        let of = |t: usize| &pairs[csr[t] as usize..csr[t + 1] as usize];
        assert_eq!(of(2), &[2, 8]);
        assert_eq!(of(3), &[3, 6]);
    }

    #[test]
    fn without_tiling_every_pair_is_its_own_item() {
        let experts = [expert(&[0, 1, 2, 3, 4])];
        let rt = build_routing(&experts, 5, &[(0, 3)], 1, (0, 0)).unwrap();
        assert_eq!(rt.tiled_pairs, 0);
        assert_eq!(rt.group_items[0][1].1, 0);
        assert_eq!(items(&rt.words, rt.group_items[0][0]).len(), 5);
        assert!(build_routing(&[expert(&[5])], 5, &[(0, 0)], 1, (0, 0)).is_err());
    }
}
