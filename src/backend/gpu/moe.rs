//! Routed experts on the device, batched: every chosen expert × every token that chose it
//! in one dispatch per matrix (per binding-sized batch of experts). Expert bytes are
//! uploaded as their native MXFP4 bytes; rows are gathered from z and scattered back by
//! routing tables built on the host.

use super::buffers::GpuAct;
use super::context::Dispatch;
use super::shaders::Shader;
use super::GpuBackend;
use crate::backend::{ExpertAssignment, Glu};
use crate::quant::Mxfp4View;
use anyhow::{bail, ensure, Result};

/// Columns per MXFP4 scale block (one kernel unit).
const BLOCK: usize = 32;

/// The device copy of a run of experts' matrices: packed nibbles and scale bytes, expert
/// after expert, each expert's matrices stacked row-wise.
struct Arena {
    packed: wgpu::Buffer,
    scales: wgpu::Buffer,
}

/// Routing of one call: work items (slot, pair, 1), one per pair and grouped by expert,
/// gather tables, scatter CSR.
struct Routing {
    /// `[items × 3] | token of pair | pair | csr offsets (rows + 1) | pair ids | weight bits`.
    words: Vec<u32>,
    tok_map: u32,
    id_map: u32,
    csr: u32,
    csr_pairs: u32,
    csr_weights: u32,
    pairs: usize,
    /// Items per batch of experts, as (first item, count).
    batch_items: Vec<(u32, u32)>,
}

fn build_routing(
    experts: &[ExpertAssignment<'_>],
    rows: usize,
    batches: &[std::ops::Range<usize>],
) -> Result<Routing> {
    let mut items = Vec::new();
    let mut tok_of_pair = Vec::new();
    let mut per_token: Vec<Vec<(u32, f32)>> = vec![Vec::new(); rows];
    let mut batch_items = Vec::new();
    for b in batches {
        let first_item = items.len() / 3;
        for (slot, e) in experts[b.clone()].iter().enumerate() {
            for chunk in e.tokens.chunks(1) {
                items.extend([slot as u32, tok_of_pair.len() as u32, chunk.len() as u32]);
                for &(t, w) in chunk {
                    ensure!(t < rows, "moe: token row {t} out of range ({rows} rows)");
                    per_token[t].push((tok_of_pair.len() as u32, w));
                    tok_of_pair.push(t as u32);
                }
            }
        }
        batch_items.push((first_item as u32, (items.len() / 3 - first_item) as u32));
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
        batch_items,
    })
}

impl GpuBackend {
    /// Uploads the given matrices of each expert (stacked per expert) as one arena.
    fn arena(&self, mats: &[Vec<Mxfp4View<'_>>]) -> Result<Arena> {
        let mut parts = Vec::new();
        let mut scales = Vec::new();
        let mut off = 0u64;
        for e in mats {
            for m in e {
                parts.push((off, m.packed));
                off += m.packed.len() as u64;
                scales.extend_from_slice(m.scales);
            }
        }
        let packed = self.ctx.buffer_from_parts(off, &parts, "expert packed")?;
        let scales = self.ctx.buffer_init(&scales, "expert scales");
        Ok(Arena { packed, scales })
    }

    /// One batched MXFP4 matvec: `rows` output rows per expert slot, `cols` inputs.
    #[allow(clippy::too_many_arguments)]
    fn mxfp4_batched(
        &self,
        a: &Arena,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        rt: &wgpu::Buffer,
        rows: usize,
        cols: usize,
        map_off: u32,
        items: (u32, u32),
    ) {
        if items.1 == 0 {
            return;
        }
        debug_assert!(items.1 <= self.ctx.limits.max_compute_workgroups_per_dimension);
        self.ctx.dispatch(&Dispatch {
            shader: Shader::MatvecMxfp4,
            entry: "moe",
            consts: &self.mv_consts(),
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
            ],
            buffers: &[x, y, &a.packed, &a.scales, rt],
            groups: (items.1, (rows as u32).div_ceil(self.rows_per_group()), 1),
        });
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
        let y = self.alloc(x.rows, w.rows);
        if x.rows == 0 || w.rows == 0 {
            return Ok(y);
        }
        let tokens: Vec<(usize, f32)> = (0..x.rows).map(|t| (t, 1.0)).collect();
        let single = [ExpertAssignment {
            weights: crate::backend::ExpertWeights {
                w1: w,
                w2: w,
                w3: w,
            },
            tokens,
        }];
        let rt = build_routing(&single, x.rows, std::slice::from_ref(&(0..1)))?;
        let rtb = self
            .ctx
            .buffer_init(bytemuck::cast_slice(&rt.words), "routing");
        let arena = self.arena(&[vec![w]])?;
        self.mxfp4_batched(
            &arena,
            &x.buf,
            &y.buf,
            &rtb,
            w.rows,
            w.cols,
            rt.tok_map,
            rt.batch_items[0],
        );
        Ok(y)
    }

    pub(super) fn moe_accumulate_op(
        &self,
        out: &mut GpuAct,
        z: &GpuAct,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        let d = z.cols;
        ensure!(
            out.rows == z.rows && out.cols == d,
            "moe: accumulator is {}x{}, latent is {}x{d}",
            out.rows,
            out.cols,
            z.rows
        );
        let Some(first) = experts.first() else {
            return Ok(());
        };
        let i = first.weights.w1.rows;
        for ex in experts {
            let w = &ex.weights;
            ensure!(
                w.w1.cols == d && w.w3.cols == d && w.w3.rows == i && w.w1.rows == i && w.w2.rows == d && w.w2.cols == i,
                "moe: expert shapes w1 {}x{}, w3 {}x{}, w2 {}x{} do not fit latent width {d} and one intermediate width {i}",
                w.w1.rows,
                w.w1.cols,
                w.w3.rows,
                w.w3.cols,
                w.w2.rows,
                w.w2.cols
            );
            for m in [w.w1, w.w2, w.w3] {
                ensure!(
                    m.cols % BLOCK == 0
                        && m.packed.len() == m.rows * m.cols / 2
                        && m.scales.len() == m.rows * m.cols / BLOCK,
                    "moe: an expert matrix {}x{} has {} packed / {} scale bytes",
                    m.rows,
                    m.cols,
                    m.packed.len(),
                    m.scales.len()
                );
            }
        }
        // Experts per batch: each batch's gate+up arena must fit one binding.
        let per_expert = (i * d) as u64;
        let per_batch = (self.ctx.max_binding / per_expert.max(1)) as usize;
        if per_batch == 0 {
            bail!("moe: one expert's gate+up ({per_expert} B) exceeds the adapter's binding limit of {} B", self.ctx.max_binding);
        }
        let batches: Vec<std::ops::Range<usize>> = (0..experts.len())
            .step_by(per_batch)
            .map(|s| s..(s + per_batch).min(experts.len()))
            .collect();
        let pairs: usize = experts.iter().map(|e| e.tokens.len()).sum();
        ensure!(
            pairs <= self.ctx.limits.max_compute_workgroups_per_dimension as usize,
            "moe: {pairs} (token, expert) pairs in one call exceed the adapter's {} workgroups per dimension; use a smaller --chunk",
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        let rt = build_routing(experts, z.rows, &batches)?;
        if rt.pairs == 0 {
            return Ok(());
        }
        let rtb = self
            .ctx
            .buffer_init(bytemuck::cast_slice(&rt.words), "routing");
        let h = self
            .ctx
            .buffer((rt.pairs * 2 * i * 4) as u64, "moe gate|up");
        let act = self.alloc(rt.pairs, i);
        let ypair = self.ctx.buffer((rt.pairs * d * 4) as u64, "moe expert out");
        let mut down = Vec::with_capacity(batches.len());
        for (b, &items) in batches.iter().zip(&rt.batch_items) {
            let up = self.arena(
                &experts[b.clone()]
                    .iter()
                    .map(|e| vec![e.weights.w1, e.weights.w3])
                    .collect::<Vec<_>>(),
            )?;
            self.mxfp4_batched(&up, &z.buf, &h, &rtb, 2 * i, d, rt.tok_map, items);
            down.push(
                self.arena(
                    &experts[b.clone()]
                        .iter()
                        .map(|e| vec![e.weights.w2])
                        .collect::<Vec<_>>(),
                )?,
            );
        }
        let iu = i as u32;
        self.glu_strided(&h, &h, &act, glu, (2 * iu, 2 * iu, iu));
        for (arena, &items) in down.iter().zip(&rt.batch_items) {
            self.mxfp4_batched(arena, &act.buf, &ypair, &rtb, d, i, rt.id_map, items);
        }
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
                buffers: &[&ypair, &rtb, &out.buf],
                groups: self.ctx.grid((out.len() as u32).div_ceil(self.ctx.wg)),
            });
        }
        Ok(())
    }
}
