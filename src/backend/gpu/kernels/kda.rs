//! The KDA step on the device, the state updated in place: a token or a few in one fused
//! dispatch (a workgroup per head), chunks in three (conv and decays, the state columns of
//! each head over several workgroups, the gated norm).

use crate::backend::gpu::device::buffers::{GpuAct, GpuKdaState, GpuRows};
use crate::backend::gpu::device::context::Dispatch;
use crate::backend::gpu::device::pipeline::{AdapterShape, VariantList};
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::row_parts::{rows_of, whole};
use crate::backend::gpu::GpuBackend;
use crate::backend::{KdaDims, KdaStepInputs, KdaStepWeights};
use anyhow::{ensure, Result};
use std::ops::Range;

/// Epsilon of the per-head l2 normalization of q and k (docs/model.md, "KDA layer"); the same
/// value as the CPU oracle's `KDA_L2_EPS`.
const KDA_L2_EPS: f32 = 1e-6;

/// Tokens from which a call runs the three passes rather than the fused kernel: one token is
/// cheaper fused, while a chunk's tokens each cost about the one-token time there and far
/// less in passes (docs/perf.md#kernels).
const PASSES_FROM_TOKENS: usize = 4;
/// Packed KDA weights kept at most: K3's 69 KDA layers fit with room.
const MAX_PACKED_KDA_WEIGHTS: usize = 256;

/// Widest head the kernel's workgroup arrays hold.
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// One step call's packed bindings (kda_step.wgsl): inputs of `n_all` rows, weights, output.
struct KdaCall<'a> {
    d: &'a KdaDims,
    inbuf: &'a wgpu::Buffer,
    wbuf: &'a wgpu::Buffer,
    out: &'a GpuAct,
    n_all: usize,
}

impl<'a> KdaCall<'a> {
    fn new(
        d: &'a KdaDims,
        inbuf: &'a wgpu::Buffer,
        wbuf: &'a wgpu::Buffer,
        out: &'a GpuAct,
    ) -> Self {
        Self {
            d,
            inbuf,
            wbuf,
            out,
            n_all: out.rows,
        }
    }
}

impl GpuBackend {
    pub(in crate::backend::gpu) fn kda_state_op(&self, d: &KdaDims) -> Result<GpuKdaState> {
        ensure!(d.conv_k >= 1, "kda: conv kernel width must be at least 1");
        ensure!(
            d.head_dim <= MAX_HEAD_DIM,
            "kda: head_dim {} exceeds the GPU kernel's {MAX_HEAD_DIM}",
            d.head_dim
        );
        let bytes = (GpuKdaState::values(d) * 4) as u64;
        let buf = self.ctx.buffer(bytes, "kda state");
        // Fresh buffers are zeroed by wgpu, which is exactly the initial state.
        Ok(GpuKdaState { buf, dims: *d })
    }

    /// `Backend::kda_step`: the parts of the rows in order, the state carrying each part's
    /// tokens into the next.
    pub(in crate::backend::gpu) fn kda_step_rows(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuRows>,
        st: &mut GpuKdaState,
        inp: KdaStepInputs<'_, GpuRows>,
    ) -> Result<GpuRows> {
        let w = weights_whole(w)?;
        let all = inp.all();
        crate::backend::shape_checks::kda_inputs(d, all.map(|a| (a.rows, a.cols)))?;
        let cut = all
            .iter()
            .map(|a| self.uniform(a))
            .collect::<Result<Vec<_>>>()?;
        let parts = (0..cut[0].parts.len())
            .map(|k| {
                let inp = KdaStepInputs::of([0, 1, 2, 3, 4, 5].map(|i| &cut[i].parts[k]));
                self.kda_step_op(d, &w, st, inp)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(rows_of(parts, d.width()))
    }

    /// `Backend::kda_step_pieces`: rows held in several parts take the piece-at-a-time way.
    pub(in crate::backend::gpu) fn kda_step_pieces_rows(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuRows>,
        pieces: &mut [(&mut GpuKdaState, Range<usize>)],
        inp: KdaStepInputs<'_, GpuRows>,
    ) -> Result<Option<GpuRows>> {
        let [q, k, v, f, beta, gate] = inp.all().map(|a| a.parts.as_slice());
        let ([q], [k], [v], [f], [beta], [gate]) = (q, k, v, f, beta, gate) else {
            return Ok(None);
        };
        let inp = KdaStepInputs::of([q, k, v, f, beta, gate]);
        Ok(self
            .kda_step_pieces_op(d, &weights_whole(w)?, pieces, inp)?
            .map(GpuRows::one))
    }

    pub(in crate::backend::gpu) fn kda_step_op(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        st: &mut GpuKdaState,
        inp: KdaStepInputs<'_, GpuAct>,
    ) -> Result<GpuAct> {
        let n = inp.q.rows;
        check_state(d, st)?;
        self.kda_check(d, w, &inp)?;
        let out = self.alloc(n, d.width());
        if n == 0 {
            return Ok(out);
        }
        let (inbuf, wbuf) = self.kda_pack(d, w, &inp);
        let call = KdaCall::new(d, &inbuf.buf, &wbuf, &out);
        if n < PASSES_FROM_TOKENS {
            self.kda_fused(&call, st, 0..n, &out, 0);
        } else {
            self.kda_passes(&call, st);
        }
        Ok(out)
    }

    /// The step of several pieces of one batch, each its own sequence: `inp` over every
    /// piece's rows, piece i's rows advancing its state. The inputs and weights are packed
    /// once for all pieces, and each piece is one fused dispatch into an output of its own,
    /// the outputs then copied into one: dispatches that share no written buffer run side
    /// by side on the device, where one shared output put a barrier between every two
    /// (docs/perf.md#several-streams-in-one-pass). `None` where a piece has the rows of a
    /// chunk (the three passes serve it through `kda_step_op`).
    pub(in crate::backend::gpu) fn kda_step_pieces_op(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        pieces: &mut [(&mut GpuKdaState, Range<usize>)],
        inp: KdaStepInputs<'_, GpuAct>,
    ) -> Result<Option<GpuAct>> {
        let n = inp.q.rows;
        if pieces.iter().any(|(_, r)| r.len() >= PASSES_FROM_TOKENS) {
            return Ok(None);
        }
        self.kda_check(d, w, &inp)?;
        for (st, _) in pieces.iter() {
            check_state(d, st)?;
        }
        let ranges: Vec<Range<usize>> = pieces.iter().map(|(_, r)| r.clone()).collect();
        crate::backend::shape_checks::pieces_cover("kda_step", &ranges, n)?;
        let out = self.alloc(n, d.width());
        if n == 0 {
            return Ok(Some(out));
        }
        let (inbuf, wbuf) = self.kda_pack(d, w, &inp);
        let call = KdaCall::new(d, &inbuf.buf, &wbuf, &out);
        let mut outs = Vec::with_capacity(pieces.len());
        for (st, rows) in pieces.iter() {
            if rows.start < rows.end {
                let own = self.alloc(rows.len(), d.width());
                self.kda_fused(&call, st, rows.clone(), &own, 0);
                outs.push((own, rows.start));
            }
        }
        let row = (d.width() * 4) as u64;
        for (own, start) in &outs {
            self.ctx.copy(
                &own.buf,
                0,
                &out.buf,
                *start as u64 * row,
                own.rows as u64 * row,
            );
        }
        Ok(Some(out))
    }

    /// The shapes of one step call: inputs and weights against `d`.
    fn kda_check(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        inp: &KdaStepInputs<'_, GpuAct>,
    ) -> Result<()> {
        let (p, k, h) = (d.width(), d.conv_k, d.heads);
        crate::backend::shape_checks::kda_inputs(d, inp.all().map(|a| (a.rows, a.cols)))?;
        ensure!(
            w.conv_q.len() == p * k
                && w.conv_k.len() == p * k
                && w.conv_v.len() == p * k
                && w.a_log.len() >= h
                && w.dt_bias.len() == p
                && w.o_norm.len() == d.head_dim,
            "kda_step: conv/A_log/dt_bias/o_norm sizes do not match {h} heads x {}",
            d.head_dim
        );
        ensure!(
            inp.q.rows <= self.ctx.limits.max_compute_workgroups_per_dimension as usize,
            "kda_step: a chunk of {} tokens exceeds the adapter's {} workgroups per dimension; use a smaller --chunk",
            inp.q.rows,
            self.ctx.limits.max_compute_workgroups_per_dimension
        );
        Ok(())
    }

    /// The inputs and the weights, each packed into one binding (a kernel may have only a
    /// few), laid out as kda_step.wgsl reads them.
    fn kda_pack(
        &self,
        d: &KdaDims,
        w: &KdaStepWeights<GpuAct>,
        inp: &KdaStepInputs<'_, GpuAct>,
    ) -> (GpuAct, wgpu::Buffer) {
        let (p, h) = (d.width(), d.heads);
        let n = inp.q.rows;
        let np = (n * p * 4) as u64;
        let inputs = self.scratch(5 * np + (n * h * 4) as u64, "kda inputs");
        let inbuf = &inputs.buf;
        for (i, a) in [inp.q, inp.k, inp.v, inp.f, inp.gate]
            .into_iter()
            .enumerate()
        {
            self.ctx.copy(&a.buf, 0, inbuf, np * i as u64, np);
        }
        self.ctx
            .copy(&inp.beta.buf, 0, inbuf, 5 * np, (n * h * 4) as u64);
        (inputs, self.kda_weights_packed(d, w))
    }

    /// The six step weights of a layer packed into one binding, as kda_step.wgsl reads them:
    /// packed once per layer and kept (keyed by the six buffers, which the layer holds for
    /// its life), so a step copies only its inputs. Weights in pooled buffers, whose
    /// buffers may come back holding other values, are packed at every call.
    fn kda_weights_packed(&self, d: &KdaDims, w: &KdaStepWeights<GpuAct>) -> wgpu::Buffer {
        let six = [
            &w.conv_q, &w.conv_k, &w.conv_v, &w.a_log, &w.dt_bias, &w.o_norm,
        ];
        if six.iter().any(|a| a.lease.is_some()) {
            return self.kda_weights_pack(d, w);
        }
        let key = six.map(|a| a.buf.clone());
        let mut packed = self.kda_weights.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(buf) = packed.get(&key) {
            return buf.clone();
        }
        let wbuf = self.kda_weights_pack(d, w);
        // A model holds one entry a KDA layer; more means weights made and dropped (tests,
        // a reload), whose entries would only keep their buffers alive.
        if packed.len() >= MAX_PACKED_KDA_WEIGHTS {
            packed.clear();
        }
        packed.insert(key, wbuf.clone());
        wbuf
    }

    /// The six step weights copied into one new buffer.
    fn kda_weights_pack(&self, d: &KdaDims, w: &KdaStepWeights<GpuAct>) -> wgpu::Buffer {
        let (p, k, h) = (d.width(), d.conv_k, d.heads);
        let pk = (p * k * 4) as u64;
        let (hb, pb, db) = ((h * 4) as u64, (p * 4) as u64, (d.head_dim * 4) as u64);
        let wbuf = self.ctx.buffer(3 * pk + hb + pb + db, "kda weights");
        self.ctx.copy(&w.conv_q.buf, 0, &wbuf, 0, pk);
        self.ctx.copy(&w.conv_k.buf, 0, &wbuf, pk, pk);
        self.ctx.copy(&w.conv_v.buf, 0, &wbuf, 2 * pk, pk);
        self.ctx.copy(&w.a_log.buf, 0, &wbuf, 3 * pk, hb);
        self.ctx.copy(&w.dt_bias.buf, 0, &wbuf, 3 * pk + hb, pb);
        self.ctx.copy(&w.o_norm.buf, 0, &wbuf, 3 * pk + hb + pb, db);
        wbuf
    }

    /// The `KdaParams` of kda_step.wgsl for rows `rows` of packed inputs of `n_all` rows,
    /// written from row `orow0` of the output on.
    fn kda_params(d: &KdaDims, rows: &Range<usize>, n_all: usize, orow0: usize) -> [u32; 11] {
        [
            rows.len() as u32,
            d.heads as u32,
            d.head_dim as u32,
            d.conv_k as u32,
            u32::from(d.lower_bound.is_some()),
            d.lower_bound.unwrap_or(0.0).to_bits(),
            d.norm_eps.to_bits(),
            KDA_L2_EPS.to_bits(),
            rows.start as u32,
            n_all as u32,
            orow0 as u32,
        ]
    }

    /// `kda_fused` over `rows` of the call's inputs with state `st`, into `out` from row
    /// `orow0` on.
    fn kda_fused(
        &self,
        c: &KdaCall<'_>,
        st: &GpuKdaState,
        rows: Range<usize>,
        out: &GpuAct,
        orow0: usize,
    ) {
        let KdaCall {
            d,
            inbuf,
            wbuf,
            n_all,
            ..
        } = *c;
        let params = Self::kda_params(d, &rows, n_all, orow0);
        self.ctx.dispatch(&Dispatch {
            shader: Shader::KdaStep,
            entry: "kda_fused",
            consts: &[("WG", head_lanes(self.ctx.wg, d.head_dim))],
            params: &params,
            buffers: &[inbuf, wbuf, &st.buf, &out.buf],
            groups: (d.heads as u32, 1, 1),
        });
    }

    /// The three passes of a chunk: every row of the call.
    fn kda_passes(&self, c: &KdaCall<'_>, st: &GpuKdaState) {
        let KdaCall {
            d,
            inbuf,
            wbuf,
            out,
            n_all: n,
        } = *c;
        let (p, h) = (d.width(), d.heads);
        let np = (n * p * 4) as u64;
        let params = Self::kda_params(d, &(0..n), n, 0);
        let wg = self.ctx.wg;
        let mid = self.scratch(4 * np, "kda conv outputs and decays");
        let mid = &mid.buf;
        // Each pass binds what its entry point uses (bindings as in kda_step.wgsl).
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_conv",
                consts: &[],
                params: &params,
                buffers: &[inbuf, wbuf, &st.buf, mid],
                groups: self.ctx.grid((4 * p as u32).div_ceil(wg)),
            },
            [1, 2, 3, 5],
        );
        let cg = state_columns_per_group(d.head_dim, wg);
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_state",
                consts: &[("CG", cg)],
                params: &params,
                buffers: &[inbuf, &st.buf, &out.buf, mid],
                groups: (h as u32, (d.head_dim as u32).div_ceil(cg), 1),
            },
            [1, 3, 4, 5],
        );
        let norm_wg = head_lanes(wg, d.head_dim);
        self.ctx.dispatch_at(
            &Dispatch {
                shader: Shader::KdaStep,
                entry: "kda_norm",
                consts: &[("WG", norm_wg)],
                params: &params,
                buffers: &[inbuf, wbuf, &out.buf],
                groups: (n as u32, h as u32, 1),
            },
            [1, 2, 4],
        );
    }
}

/// A state made for `d`.
fn check_state(d: &KdaDims, st: &GpuKdaState) -> Result<()> {
    ensure!(
        st.dims == *d,
        "kda_step: state was made for {:?}, called with {:?}",
        st.dims,
        d
    );
    Ok(())
}

/// The step's weights, each read whole.
fn weights_whole(w: &KdaStepWeights<GpuRows>) -> Result<KdaStepWeights<GpuAct>> {
    let op = "kda_step";
    Ok(KdaStepWeights {
        conv_q: whole(&w.conv_q, op, "conv_q")?.clone(),
        conv_k: whole(&w.conv_k, op, "conv_k")?.clone(),
        conv_v: whole(&w.conv_v, op, "conv_v")?.clone(),
        a_log: whole(&w.a_log, op, "A_log")?.clone(),
        dt_bias: whole(&w.dt_bias, op, "dt_bias")?.clone(),
        o_norm: whole(&w.o_norm, op, "o_norm")?.clone(),
    })
}

/// The workgroup of the fused kernel and of the gated norm over heads of `head_dim`: one
/// lane per state or output column (at least a 32-lane block), as a wider one would idle.
pub(in crate::backend::gpu) fn head_lanes(wg: u32, head_dim: usize) -> u32 {
    wg.min((head_dim as u32).next_power_of_two().max(32))
}

/// State columns one `kda_state` workgroup of `wg` lanes updates: an eighth of the head (16
/// of K3's 128, so 8 workgroups a head), a power of two within the workgroup.
pub(in crate::backend::gpu) fn state_columns_per_group(head_dim: usize, wg: u32) -> u32 {
    ((head_dim as u32 / 8).max(1).next_power_of_two()).min(wg)
}

/// Head widths of the KDA kernels: the smallest, K3's and the widest the kernel holds.
const KDA_HEAD_DIMS: [usize; 3] = [4, 128, MAX_HEAD_DIM];

/// The KDA kernels' pipelines at every head width whose overrides differ.
pub(crate) fn pipeline_variants(a: AdapterShape, list: &mut VariantList) {
    for hd in KDA_HEAD_DIMS {
        let lanes = head_lanes(a.wg, hd);
        list.push(Shader::KdaStep, "kda_fused", vec![("WG", lanes)]);
        list.push(Shader::KdaStep, "kda_conv", Vec::new());
        let cg = state_columns_per_group(hd, a.wg);
        list.push(Shader::KdaStep, "kda_state", vec![("CG", cg)]);
        list.push(Shader::KdaStep, "kda_norm", vec![("WG", lanes)]);
    }
}

#[cfg(test)]
mod tests {
    use super::state_columns_per_group;

    #[test]
    fn a_head_spreads_over_eight_workgroups() {
        assert_eq!(state_columns_per_group(128, 256), 16);
        assert_eq!(state_columns_per_group(16, 256), 2);
        assert_eq!(state_columns_per_group(100, 256), 16);
        assert_eq!(state_columns_per_group(4, 64), 1);
        assert_eq!(state_columns_per_group(4096, 64), 64);
    }
}
