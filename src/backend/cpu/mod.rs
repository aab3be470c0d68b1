//! The CPU backend: the reference implementation every other backend is checked against.
//! f32 everywhere, f64 where a reduction is cheap to widen, rayon across rows and heads.

mod elementwise;
mod kda;
mod mla;
mod moe;
mod norm;
mod router;
mod state_copy;

use super::{
    Backend, ExpertAssignment, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights,
    MlaDims, RouterParams,
};

use crate::quant::idot::IdotKernel;
use crate::quant::{partner, pool, DenseMatrix};
use crate::routed_expert::Route;
use anyhow::{ensure, Result};

pub use kda::{conv_silu_step, KdaState};
pub use mla::MlaCache;

/// A `[rows, cols]` row-major f32 matrix in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuAct {
    /// Number of rows (tokens).
    pub rows: usize,
    /// Width of a row.
    pub cols: usize,
    /// `rows · cols` values.
    pub data: Vec<f32>,
}

impl CpuAct {
    /// Wraps host values, checking the length.
    pub fn new(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self> {
        ensure!(
            data.len() == rows * cols,
            "activation of {rows}x{cols} needs {} values, got {}",
            rows * cols,
            data.len()
        );
        Ok(Self { rows, cols, data })
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// The reference backend.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    /// The integer-dot kernel of the routed experts (`K3_IDOT=1`); `None` = exact.
    idot: Option<IdotKernel>,
}

/// The backend line's description: `cpu (N threads, <SIMD level>)`, with `, idot
/// <kernel>` when the routed experts run on integer dots.
pub fn describe(backend: &CpuBackend) -> String {
    let idot = backend
        .idot
        .map_or(String::new(), |k| format!(", idot {}", k.name()));
    format!(
        "cpu ({} threads, {}{idot})",
        rayon::current_num_threads(),
        crate::quant::simd::level().name()
    )
}

impl CpuBackend {
    /// A CPU backend using the global rayon pool, exact everywhere.
    pub fn new() -> Self {
        Self::default()
    }

    /// A CPU backend whose routed experts run on int8 activations with integer dots
    /// (`K3_IDOT=1`, not exact) on `kernel`, or exactly with `None`.
    ///
    /// Panics if this CPU cannot run `kernel` (a caller bug: take one from
    /// [`IdotKernel::for_level`] or [`IdotKernel::available`]).
    pub fn with_idot(kernel: Option<IdotKernel>) -> Self {
        if let Some(k) = kernel {
            assert!(
                k.is_supported(),
                "this CPU cannot run {} integer dots",
                k.name()
            );
        }
        Self { idot: kernel }
    }

    /// The integer-dot kernel of the routed experts, `None` when they are exact.
    pub fn idot(&self) -> Option<IdotKernel> {
        self.idot
    }
}

fn same_shape(a: &CpuAct, b: &CpuAct, op: &str) -> Result<()> {
    super::shape_checks::same_shape(op, (a.rows, a.cols), (b.rows, b.cols))
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Mat = DenseMatrix;
    type KdaState = KdaState;
    type MlaCache = MlaCache;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuAct> {
        CpuAct::new(data.to_vec(), rows, cols)
    }

    fn download(&self, x: &CpuAct) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn download_pieces(&self, x: &CpuAct, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        crate::backend::split_pieces(&x.data, lens)
    }

    fn shape(&self, x: &CpuAct) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn slice_rows(&self, x: &CpuAct, start: usize, count: usize) -> Result<CpuAct> {
        ensure!(
            start + count <= x.rows,
            "slice_rows: rows {start}..{} of a {}-row activation",
            start + count,
            x.rows
        );
        CpuAct::new(
            x.data[start * x.cols..(start + count) * x.cols].to_vec(),
            count,
            x.cols,
        )
    }

    fn concat_rows(&self, parts: &[&CpuAct]) -> Result<CpuAct> {
        let cols =
            crate::backend::shape_checks::concat_rows(parts.iter().map(|a| (a.rows, a.cols)))?;
        let rows = parts.iter().map(|a| a.rows).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for a in parts {
            data.extend_from_slice(&a.data);
        }
        CpuAct::new(data, rows, cols)
    }

    fn load_matrix(&self, m: DenseMatrix) -> Result<DenseMatrix> {
        Ok(m)
    }

    fn kda_state(&self, dims: &KdaDims) -> Result<KdaState> {
        Ok(KdaState::new(dims))
    }

    fn mla_cache(&self, dims: &MlaDims) -> Result<MlaCache> {
        Ok(MlaCache::new(dims))
    }

    fn kda_state_copy(&self, state: &KdaState) -> Result<KdaState> {
        state_copy::kda_state_copy(state)
    }

    fn mla_truncate(&self, cache: &mut MlaCache, len: usize) -> Result<()> {
        state_copy::mla_truncate(cache, len)
    }

    fn kda_state_read(&self, state: &KdaState) -> Result<Vec<f32>> {
        Ok(state_copy::kda_state_read(state))
    }

    fn kda_state_write(&self, dims: &KdaDims, values: &[f32]) -> Result<KdaState> {
        state_copy::kda_state_write(dims, values)
    }

    fn mla_cache_read(&self, cache: &MlaCache) -> Result<Vec<f32>> {
        Ok(state_copy::mla_cache_read(cache))
    }

    fn mla_cache_write(&self, dims: &MlaDims, values: &[f32]) -> Result<MlaCache> {
        state_copy::mla_cache_write(dims, values)
    }

    fn matmul(&self, w: &DenseMatrix, x: &CpuAct) -> Result<CpuAct> {
        ensure!(
            x.cols == w.cols,
            "matmul: input width {} does not match the matrix's {} columns",
            x.cols,
            w.cols
        );
        let mut y = vec![0.0f32; x.rows * w.rows];
        w.matmul(&x.data, x.rows, &mut y);
        CpuAct::new(y, x.rows, w.rows)
    }

    /// Several rows' matrices split between this thread and the partner thread, in two runs
    /// of whole matrices of about equal work, when they are too small for the pool.
    fn matmul_many(&self, ws: &[&DenseMatrix], x: &CpuAct) -> Result<Vec<CpuAct>> {
        if ws.len() < 2 || x.rows < 2 {
            return ws.iter().map(|w| self.matmul(w, x)).collect();
        }
        let work: Vec<usize> = ws.iter().map(|w| w.rows * w.cols * x.rows).collect();
        let total: usize = work.iter().sum();
        if total >= pool::POOL_WORK_FROM || !pool::partner_pays(x.rows, total) {
            return ws.iter().map(|w| self.matmul(w, x)).collect();
        }
        let (lo, hi) = ws.split_at(partner::even_cut(&work));
        let run = |part: &[&DenseMatrix]| -> Result<Vec<CpuAct>> {
            part.iter().map(|w| self.matmul(w, x)).collect()
        };
        let (a, b) = partner::join(|| run(lo), || run(hi));
        let mut out = a?;
        out.extend(b?);
        Ok(out)
    }

    fn split_pass(&self, rows: usize, row_work: usize) -> bool {
        rows >= 2 && row_work < pool::POOL_WORK_FROM && partner::available()
    }

    /// The first half of the items (the larger, as the partner may still be waking) on this
    /// thread, the rest on the partner thread.
    fn map_pieces<T: Send, R: Send>(
        &self,
        items: &mut [T],
        f: &(dyn Fn(&mut T) -> R + Sync),
    ) -> Vec<R> {
        if items.len() < 2 {
            return items.iter_mut().map(f).collect();
        }
        let (lo, hi) = items.split_at_mut(items.len().div_ceil(2));
        let run = |part: &mut [T]| part.iter_mut().map(f).collect::<Vec<R>>();
        let (mut a, b) = partner::join(|| run(lo), || run(hi));
        a.extend(b);
        a
    }

    fn rmsnorm(&self, x: &CpuAct, w: &CpuAct, group: usize, eps: f32) -> Result<CpuAct> {
        norm::rmsnorm(x, w, group, eps)
    }

    fn add(&self, a: &CpuAct, b: &CpuAct) -> Result<CpuAct> {
        same_shape(a, b, "add")?;
        elementwise::zip(a, b, elementwise::ADD_COST, |x, y| x + y)
    }

    fn sigmoid_gate(&self, x: &CpuAct, gate: &CpuAct) -> Result<CpuAct> {
        same_shape(x, gate, "sigmoid_gate")?;
        elementwise::zip(x, gate, elementwise::SIGMOID_COST, |v, g| {
            v * elementwise::sigmoid(g)
        })
    }

    fn glu(&self, g: &CpuAct, u: &CpuAct, glu: Glu) -> Result<CpuAct> {
        same_shape(g, u, "glu")?;
        elementwise::zip(g, u, elementwise::GLU_COST, |a, b| {
            elementwise::glu(a, b, glu)
        })
    }

    fn attn_res_mix(&self, bank: &[&CpuAct], cur: &CpuAct, w: &CpuAct, eps: f32) -> Result<CpuAct> {
        for b in bank {
            same_shape(b, cur, "attn_res_mix")?;
        }
        norm::attn_res_mix(bank, cur, w, eps)
    }

    fn kda_step(
        &self,
        dims: &KdaDims,
        w: &KdaStepWeights<CpuAct>,
        state: &mut KdaState,
        inp: KdaStepInputs<'_, CpuAct>,
    ) -> Result<CpuAct> {
        kda::kda_step(dims, w, state, inp)
    }

    fn mla_attend(
        &self,
        dims: &MlaDims,
        w: &MlaAttnWeights<CpuAct>,
        cache: &mut MlaCache,
        q: &CpuAct,
        c: &CpuAct,
    ) -> Result<CpuAct> {
        mla::mla_attend(dims, w, cache, q, c)
    }

    fn router_topk(
        &self,
        logits: &CpuAct,
        bias: &[f32],
        params: RouterParams,
    ) -> Result<Vec<Route>> {
        router::router_topk(logits, bias, params)
    }

    fn moe_accumulate(
        &self,
        acc: &mut CpuAct,
        z: &CpuAct,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()> {
        moe::moe_accumulate(acc, z, experts, glu, self.idot)
    }

    fn downloads_are_free(&self) -> bool {
        true
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CpuAct> {
        CpuAct::new(vec![0.0; rows * cols], rows, cols)
    }
}

/// Host RAM is the CPU's only expert memory (the cache of `ExpertSource`): no tier.
impl crate::backend::ExpertResidency for CpuBackend {}
