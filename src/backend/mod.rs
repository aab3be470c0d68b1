//! The op interface: everything the model computes goes through [`Backend`].
//!
//! The model never knows which backend runs it; a backend never knows which model calls
//! it. Activations are `[rows, cols]` row-major f32 matrices that live inside the backend
//! (host vectors on the CPU; device buffers on a GPU, a window's rows in parts where one
//! binding cannot hold them); `rows` is the number of tokens of the window being processed. Only routing decisions and final logits come back to the host.

pub mod cpu;
pub(crate) mod expert_residency;
pub mod gpu;
pub mod select;
pub(crate) mod shape_checks;

pub use crate::routed_expert::ExpertPayload;
pub use expert_residency::{ExpertResidency, FreeDeviceMemory, TierExchange, TierMoves};

use crate::quant::DenseMatrix;
use crate::routed_expert::{ExpertKey, Route};
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::ops::Range;

/// Shape parameters of one KDA layer, shared by every backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KdaDims {
    /// Number of KDA heads.
    pub heads: usize,
    /// Width of one head (keys and values alike).
    pub head_dim: usize,
    /// Width of the causal short convolution.
    pub conv_k: usize,
    /// `gate_lower_bound` (K3 decay form); `None` selects the Kimi Linear softplus form.
    pub lower_bound: Option<f32>,
    /// Epsilon of the gated output RMSNorm.
    pub norm_eps: f32,
}

impl KdaDims {
    /// Projection width `heads · head_dim`.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Weights of one KDA layer that the fused step needs (projections are done by the model).
pub struct KdaStepWeights<A> {
    /// Depthwise conv taps for q, k, v: each `[1, P·K]`, channel-major, oldest tap first.
    pub conv_q: A,
    /// See `conv_q`.
    pub conv_k: A,
    /// See `conv_q`.
    pub conv_v: A,
    /// `A_log`, the first `heads` entries: `[1, heads]`.
    pub a_log: A,
    /// `dt_bias`: `[1, P]`.
    pub dt_bias: A,
    /// `o_norm.weight`: `[1, head_dim]`.
    pub o_norm: A,
}

/// Per-token inputs of the fused KDA step, all `[n, ·]` for the `n` tokens of a window.
pub struct KdaStepInputs<'a, A> {
    /// `q_proj·x`, `[n, P]`, before the convolution.
    pub q: &'a A,
    /// `k_proj·x`, `[n, P]`.
    pub k: &'a A,
    /// `v_proj·x`, `[n, P]`.
    pub v: &'a A,
    /// `f_b_proj·(f_a_proj·x)`, `[n, P]`, before `dt_bias`.
    pub f: &'a A,
    /// `b_proj·x`, `[n, heads]`, before the sigmoid.
    pub beta: &'a A,
    /// `g_proj·x`, `[n, P]`, before the sigmoid (output gate).
    pub gate: &'a A,
}

impl<'a, A> KdaStepInputs<'a, A> {
    /// The inputs from six activations in field order (q, k, v, f, beta, gate); `None` for
    /// any other count.
    pub fn from_slice(i: &'a [A]) -> Option<Self> {
        let [q, k, v, f, beta, gate] = i else {
            return None;
        };
        Some(Self::of([q, k, v, f, beta, gate]))
    }

    /// The inputs from six activations in field order (q, k, v, f, beta, gate).
    pub fn of([q, k, v, f, beta, gate]: [&'a A; 6]) -> Self {
        Self {
            q,
            k,
            v,
            f,
            beta,
            gate,
        }
    }

    /// The six activations in field order.
    pub fn all(&self) -> [&'a A; 6] {
        [self.q, self.k, self.v, self.f, self.beta, self.gate]
    }
}

/// Shape parameters of one gated-MLA layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    /// Number of attention heads.
    pub heads: usize,
    /// `kv_lora_rank`: width of the cached latent.
    pub kv_lora: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim` (used un-rotated).
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// Epsilon of `kv_a_layernorm`.
    pub norm_eps: f32,
}

impl MlaDims {
    /// Values a cached position holds: the latent, then the rope part.
    pub fn cache_row(&self) -> usize {
        self.kv_lora + self.rope
    }

    /// How many whole cached positions `values` holds (`mla_cache_write`'s input on every
    /// backend); anything else is an error.
    pub fn cache_positions(&self, values: &[f32]) -> Result<usize> {
        let row = self.cache_row();
        anyhow::ensure!(
            row > 0 && values.len() % row == 0,
            "mla_cache_write: {} values are not whole positions of {row}",
            values.len()
        );
        Ok(values.len() / row)
    }
}

/// Weights the absorbed MLA attention needs, split per head from `kv_b_proj`.
pub struct MlaAttnWeights<A> {
    /// `kv_a_layernorm.weight`, `[1, kv_lora]`.
    pub kv_norm: A,
    /// K blocks of `kv_b_proj`: `[heads · nope, kv_lora]` (head-major, as stored).
    pub wk: A,
    /// V blocks of `kv_b_proj`: `[heads · v, kv_lora]`.
    pub wv: A,
}

/// One routed expert and the tokens of the window that chose it.
#[derive(Clone, Debug)]
pub struct ExpertAssignment<'a> {
    /// Which expert this is; `None` for anonymous weights a backend must not keep.
    pub key: Option<ExpertKey>,
    /// Where the expert's bytes are: host views, memory this backend lent for the read,
    /// or resident in the backend (reported by `Backend::pin_resident_experts`).
    pub payload: ExpertPayload<'a>,
    /// `(token row, routing weight)` pairs, rows in increasing order.
    pub tokens: Vec<(usize, f32)>,
}

/// The gated linear unit used by the MLPs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `situ(g, u) = β·tanh(g/β)·σ(g) · βl·tanh(u/βl)` (K3).
    Situ {
        /// `activation_situ_beta`.
        beta: f32,
        /// `activation_situ_linear_beta`.
        linear_beta: f32,
    },
    /// `silu(g)·u` (Kimi Linear).
    Silu,
}

/// Router settings of a MoE layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    /// Experts chosen per token.
    pub top_k: usize,
    /// Divide the chosen scores by their sum.
    pub renormalize: bool,
    /// `routed_scaling_factor`.
    pub scaling: f32,
}

/// [`Backend::matmul_many`] of `N` matrices on one input, as an array.
pub fn matmul_each<B: Backend, const N: usize>(
    b: &B,
    ws: [&B::Mat; N],
    x: &B::Act,
) -> Result<[B::Act; N]> {
    let ys = b.matmul_many(&ws, x)?;
    let got = ys.len();
    ys.try_into()
        .map_err(|_| anyhow::anyhow!("matmul_many returned {got} results for {N} matrices"))
}

/// The op interface every backend implements (docs/architecture.md#the-op-interface).
// Sync, with sendable activations and states, so that the pieces of a batch
// (`map_pieces`) or the two halves of a decode step (`split_pass`) may run on two threads.
pub trait Backend: ExpertResidency + Sync {
    /// A `[rows, cols]` f32 activation matrix resident in the backend.
    type Act: Send + Sync;
    /// A dense weight matrix in its load-time format, resident in the backend.
    type Mat: Sync;
    /// Recurrent state of one KDA layer (conv history + delta-rule state).
    type KdaState: Send;
    /// Latent cache of one MLA layer.
    type MlaCache: Send;

    /// Human-readable name (`cpu`, or `gpu: ` and the adapter's name and API).
    fn name(&self) -> String;

    /// Copies host values into a new `[rows, cols]` activation.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Act>;
    /// Copies host values into a new `[rows, cols]` weight, which ops read whole: one
    /// buffer on a GPU whatever its rows, where an activation's rows may be in parts.
    fn upload_weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Act> {
        self.upload(data, rows, cols)
    }
    /// Copies an activation back to the host, row-major.
    fn download(&self, x: &Self::Act) -> Result<Vec<f32>>;
    /// Copies an activation back to the host as consecutive pieces of `lens` values, which
    /// add up to its length: a batch's logits, a piece a sequence. A backend that can copies
    /// each piece straight from the device's data, where a download and a split copy twice.
    fn download_pieces(&self, x: &Self::Act, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        split_pieces(&self.download(x)?, lens)
    }
    /// `(rows, cols)` of an activation.
    fn shape(&self, x: &Self::Act) -> (usize, usize);
    /// Rows `start..start+count` of an activation, as a new activation.
    fn slice_rows(&self, x: &Self::Act, start: usize, count: usize) -> Result<Self::Act>;
    /// The rows of `parts` one after another, as a new activation (all of one width).
    fn concat_rows(&self, parts: &[&Self::Act]) -> Result<Self::Act>;
    /// The most rows one buffer of an op may take when its widest per-row buffer is
    /// `row_bytes` bytes: the adapter's binding and dispatch limits on a GPU, no bound on
    /// the CPU. An op that needs the whole window in one buffer (the routed experts) bounds
    /// a pass's rows by it.
    fn max_rows(&self, row_bytes: usize) -> usize {
        let _ = row_bytes;
        usize::MAX
    }
    /// Learns the widest per-row buffer any op of the model takes (`row_bytes`), so that an
    /// activation holds its rows in parts that each fit [`Backend::max_rows`] of it and
    /// every op maps over the parts (the GPU); a backend without such bounds ignores it.
    fn fit_rows(&mut self, row_bytes: usize) {
        let _ = row_bytes;
    }
    /// Makes a dense weight resident.
    fn load_matrix(&self, m: DenseMatrix) -> Result<Self::Mat>;
    /// Fresh zero state for a KDA layer.
    fn kda_state(&self, dims: &KdaDims) -> Result<Self::KdaState>;
    /// Fresh empty latent cache for an MLA layer.
    fn mla_cache(&self, dims: &MlaDims) -> Result<Self::MlaCache>;
    /// A copy of a KDA state (a snapshot of it, or a snapshot put back into use).
    fn kda_state_copy(&self, state: &Self::KdaState) -> Result<Self::KdaState>;
    /// Forgets an MLA cache's positions from `len` on; the earlier ones stay as they were.
    fn mla_truncate(&self, cache: &mut Self::MlaCache, len: usize) -> Result<()>;
    /// A KDA state's values on the host: the q, k and v convolution histories (each
    /// `[conv_k - 1, width]`), then the delta-rule state `[heads, head_dim, head_dim]`.
    fn kda_state_read(&self, state: &Self::KdaState) -> Result<Vec<f32>>;
    /// A KDA state holding `values`, laid out as [`Backend::kda_state_read`] returns them.
    fn kda_state_write(&self, dims: &KdaDims, values: &[f32]) -> Result<Self::KdaState>;
    /// An MLA cache's positions on the host: for each, the normalized latent then the rope
    /// part (`kv_lora + rope` values).
    fn mla_cache_read(&self, cache: &Self::MlaCache) -> Result<Vec<f32>>;
    /// An MLA cache holding the positions of `values`, laid out as
    /// [`Backend::mla_cache_read`] returns them.
    fn mla_cache_write(&self, dims: &MlaDims, values: &[f32]) -> Result<Self::MlaCache>;
    /// Positions one MLA cache can hold at most (`None`: as many as memory holds); the
    /// GPU's cache is one buffer, bounded by the adapter's largest binding.
    fn mla_cache_max_positions(&self, _dims: &MlaDims) -> Option<usize> {
        None
    }
    /// Whether states, caches and snapshots take host RAM (the CPU, a unified-memory GPU)
    /// rather than device memory of their own, for the RAM plan and the VRAM budget.
    fn state_in_host_ram(&self) -> bool {
        true
    }

    /// `y[t] = W · x[t]` for every row: `[n, in] -> [n, out]`.
    fn matmul(&self, w: &Self::Mat, x: &Self::Act) -> Result<Self::Act>;
    /// [`Backend::matmul`] of each of `ws` on the same `x`, so a backend may share work
    /// that depends on x alone (the GPU's int4 digit pass).
    fn matmul_many(&self, ws: &[&Self::Mat], x: &Self::Act) -> Result<Vec<Self::Act>> {
        ws.iter().map(|w| self.matmul(w, x)).collect()
    }
    /// Whether a decode pass of `rows` rows of a model whose widest op takes `row_work`
    /// multiply-adds a row may run as two passes of half the sequences at once, on two
    /// threads. The CPU backend does where a row's ops are too small for its pool, so one
    /// thread a half is what keeps its cores busy; the GPU runs one pass.
    fn split_pass(&self, rows: usize, row_work: usize) -> bool {
        let _ = (rows, row_work);
        false
    }
    /// `f` on every item, the results in item order: the pieces of a batch, each a
    /// sequence's attention on its own state. A backend may run two items at once; the CPU
    /// backend gives half of them to its partner thread.
    fn map_pieces<T: Send, R: Send>(
        &self,
        items: &mut [T],
        f: &(dyn Fn(&mut T) -> R + Sync),
    ) -> Vec<R> {
        items.iter_mut().map(f).collect()
    }
    /// RMSNorm of each `group`-wide slice of every row with weight `w` (`[1, group]`).
    fn rmsnorm(&self, x: &Self::Act, w: &Self::Act, group: usize, eps: f32) -> Result<Self::Act>;
    /// `a + b`, elementwise.
    fn add(&self, a: &Self::Act, b: &Self::Act) -> Result<Self::Act>;
    /// `x ⊙ σ(gate)`, elementwise.
    fn sigmoid_gate(&self, x: &Self::Act, gate: &Self::Act) -> Result<Self::Act>;
    /// `glu(g, u)`, elementwise.
    fn glu(&self, g: &Self::Act, u: &Self::Act, glu: Glu) -> Result<Self::Act>;
    /// Block attention-residual mix of the bank entries and `cur`, row by row.
    fn attn_res_mix(
        &self,
        bank: &[&Self::Act],
        cur: &Self::Act,
        w: &Self::Act,
        eps: f32,
    ) -> Result<Self::Act>;
    /// The fused KDA token step over the window's rows in order: conv + SiLU, l2 norms,
    /// decay gate, delta-rule update, gated output RMSNorm. Returns `[n, P]` before `o_proj`.
    fn kda_step(
        &self,
        dims: &KdaDims,
        w: &KdaStepWeights<Self::Act>,
        state: &mut Self::KdaState,
        inp: KdaStepInputs<'_, Self::Act>,
    ) -> Result<Self::Act>;
    /// The KDA step of several pieces of one pass at once, each its own sequence: `inp` over
    /// every piece's rows, piece i's rows `pieces[i].1` advancing its state `pieces[i].0`,
    /// the outputs in row order. `None` where the backend has no way that beats one
    /// [`Backend::kda_step`] a piece, and the caller runs them so.
    fn kda_step_pieces(
        &self,
        _dims: &KdaDims,
        _w: &KdaStepWeights<Self::Act>,
        _pieces: &mut [(&mut Self::KdaState, Range<usize>)],
        _inp: KdaStepInputs<'_, Self::Act>,
    ) -> Result<Option<Self::Act>> {
        Ok(None)
    }
    /// Absorbed causal MLA: appends each row's latent (`c = kv_a·x`, `[n, kv_lora+rope]`,
    /// normalized inside) to the cache and attends with `q` (`[n, heads·(nope+rope)]`).
    /// Returns `[n, heads·v]` before the output gate.
    fn mla_attend(
        &self,
        dims: &MlaDims,
        w: &MlaAttnWeights<Self::Act>,
        cache: &mut Self::MlaCache,
        q: &Self::Act,
        c: &Self::Act,
    ) -> Result<Self::Act>;
    /// The attention of several pieces of one pass at once, each its own sequence: piece
    /// i's rows `pieces[i].1` of `q` and `c` attend over (and append to) its cache
    /// `pieces[i].0`, the outputs in row order. `None` where the backend has no way that
    /// beats one [`Backend::mla_attend`] a piece, and the caller runs them so.
    fn mla_attend_pieces(
        &self,
        _dims: &MlaDims,
        _w: &MlaAttnWeights<Self::Act>,
        _pieces: &mut [(&mut Self::MlaCache, Range<usize>)],
        _q: &Self::Act,
        _c: &Self::Act,
    ) -> Result<Option<Self::Act>> {
        Ok(None)
    }
    /// Router: `σ(logits)`, top-k of score + bias (ties to the lower id), renormalized
    /// weights from the unbiased scores. Returns one route per row, on the host.
    fn router_topk(
        &self,
        logits: &Self::Act,
        bias: &[f32],
        params: RouterParams,
    ) -> Result<Vec<Route>>;
    /// [`Backend::router_topk`], with `meanwhile` (work that needs no route) recorded
    /// behind the router where the host would otherwise wait for the routes with the device
    /// idle. The default runs the router alone, and the caller runs that work where it fits
    /// (the CPU behind the experts' reads); so may a backend that did not take it.
    fn router_topk_then(
        &self,
        logits: &Self::Act,
        bias: &[f32],
        params: RouterParams,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Route>> {
        let _ = meanwhile;
        self.router_topk(logits, bias, params)
    }
    /// `acc[t] += w_{e,t} · W2_e · glu(W1_e·z[t], W3_e·z[t])` for each listed expert in list
    /// order, over the rows that chose it. Accumulating in place lets the caller feed experts
    /// in batches as they arrive from disk without changing the per-row summation order.
    fn moe_accumulate(
        &self,
        acc: &mut Self::Act,
        z: &Self::Act,
        experts: &[ExpertAssignment<'_>],
        glu: Glu,
    ) -> Result<()>;
    /// Whether [`Backend::download`] is a plain host copy (no device round trip), so the
    /// model can afford to check every layer's output for NaN and Inf.
    fn downloads_are_free(&self) -> bool {
        false
    }
    /// A `[rows, cols]` activation of zeros.
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    /// Seconds the device has spent running kernels so far, when it keeps count (the GPU
    /// under `--gpu-profile`); benchmarks set it against wall time to see the host's share.
    fn busy_seconds(&self) -> Option<f64> {
        None
    }
    /// The device's kernel-time table since the last take, when it keeps one (the GPU under
    /// `--gpu-profile`), and a fresh start for the next; benchmarks print one a case.
    fn take_profile(&self) -> Option<String> {
        None
    }
}

/// `all` as consecutive pieces of `lens` values, which must add up to its length. A batch's
/// logits (megabytes at several streams) copy a piece a pool thread.
pub fn split_pieces(all: &[f32], lens: &[usize]) -> Result<Vec<Vec<f32>>> {
    let total: usize = lens.iter().sum();
    ensure!(
        total == all.len(),
        "internal: pieces of {total} values in all asked of {} values",
        all.len()
    );
    let mut rest = all;
    let pieces: Vec<&[f32]> = lens
        .iter()
        .map(|&n| {
            let (mine, more) = rest.split_at(n);
            rest = more;
            mine
        })
        .collect();
    Ok(pieces
        .par_iter()
        .with_min_len(crate::quant::pool::min_len(pieces.len(), total))
        .map(|p| p.to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::KdaStepInputs;

    #[test]
    fn kda_inputs_come_from_exactly_six_activations_in_field_order() {
        let six = [1, 2, 3, 4, 5, 6];
        let i = KdaStepInputs::from_slice(&six).unwrap();
        assert_eq!([*i.q, *i.k, *i.v, *i.f, *i.beta, *i.gate], six);
        assert!(KdaStepInputs::from_slice(&six[..5]).is_none());
    }
}
