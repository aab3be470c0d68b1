//! Gated multi-head latent attention (docs/model.md#mla-layer), absorbed form over the latent
//! cache.

use super::format_policy::FormatPolicy;
use super::loader::Loader;
use super::pieces::{each_piece, PieceState};
use crate::backend::{matmul_each, Backend, MlaAttnWeights, MlaDims};
use crate::checkpoint::model_tensors::MlaTensors;
use crate::config::Config;
use anyhow::Result;

/// Weights of one MLA layer (`model.layers.{i}.self_attn.*`).
pub(crate) struct Mla<B: Backend> {
    dims: MlaDims,
    q_a_proj: B::Mat,
    q_a_norm: B::Act,
    q_b_proj: B::Mat,
    kv_a_proj: B::Mat,
    g_proj: B::Mat,
    o_proj: B::Mat,
    attn: MlaAttnWeights<B::Act>,
    q_lora: usize,
    eps: f32,
}

impl<B: Backend> Mla<B> {
    /// Shapes of the layer from the config.
    pub(crate) fn dims(cfg: &Config) -> MlaDims {
        MlaDims {
            heads: cfg.num_attention_heads,
            kv_lora: cfg.kv_lora_rank,
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v: cfg.v_head_dim,
            norm_eps: cfg.rms_norm_eps,
        }
    }

    /// Loads the layer's tensors `t`; `kv_b_proj` is split into per-head K and V blocks
    /// kept in f32.
    pub(crate) fn load(ld: &Loader<'_, B>, t: &MlaTensors, policy: &FormatPolicy) -> Result<Self> {
        let d = Self::dims(&ld.ckpt.config);
        let m = |spec| ld.matrix(spec, policy.mla);
        let kv_b = ld.host_matrix(&t.kv_b_proj, crate::quant::DenseFormat::F32)?;
        let kv_b = kv_b.dequantize();
        let (mut wk, mut wv) = (Vec::new(), Vec::new());
        for block in kv_b.chunks(d.kv_lora * (d.nope + d.v)) {
            let (k, v) = block.split_at(d.kv_lora * d.nope);
            wk.extend_from_slice(k);
            wv.extend_from_slice(v);
        }
        let b = ld.backend;
        Ok(Self {
            q_a_proj: m(&t.q_a_proj)?,
            q_a_norm: ld.vector_act(&t.q_a_norm)?,
            q_b_proj: m(&t.q_b_proj)?,
            kv_a_proj: m(&t.kv_a_proj)?,
            g_proj: m(&t.g_proj)?,
            o_proj: m(&t.o_proj)?,
            attn: MlaAttnWeights {
                kv_norm: ld.vector_act(&t.kv_a_norm)?,
                wk: b.upload_weight(&wk, d.heads * d.nope, d.kv_lora)?,
                wv: b.upload_weight(&wv, d.heads * d.v, d.kv_lora)?,
            },
            q_lora: ld.ckpt.config.q_lora_rank,
            eps: ld.ckpt.config.rms_norm_eps,
            dims: d,
        })
    }

    /// A fresh, empty latent cache for this layer.
    pub(crate) fn new_cache(&self, b: &B) -> Result<B::MlaCache> {
        b.mla_cache(&self.dims)
    }

    /// Runs the rows of `x` (the normed layer input) through the layer: the projections over
    /// every row, the attention on each piece's rows with that piece's cache, causally.
    pub(crate) fn forward(
        &self,
        b: &B,
        x: &B::Act,
        pieces: &mut [PieceState<'_, B::MlaCache>],
    ) -> Result<B::Act> {
        let [qa, c, g] = matmul_each(b, [&self.q_a_proj, &self.kv_a_proj, &self.g_proj], x)?;
        let qa = b.rmsnorm(&qa, &self.q_a_norm, self.q_lora, self.eps)?;
        let q = b.matmul(&self.q_b_proj, &qa)?;
        if pieces.len() > 1 {
            let mut caches: Vec<_> = pieces
                .iter_mut()
                .map(|p| (&mut *p.state, p.rows.clone()))
                .collect();
            if let Some(o) = b.mla_attend_pieces(&self.dims, &self.attn, &mut caches, &q, &c)? {
                let o = b.sigmoid_gate(&o, &g)?;
                return b.matmul(&self.o_proj, &o);
            }
        }
        let o = each_piece(b, [&q, &c], pieces, |cache, [q, c]| {
            b.mla_attend(&self.dims, &self.attn, cache, q, c)
        })?;
        let o = b.sigmoid_gate(&o, &g)?;
        b.matmul(&self.o_proj, &o)
    }
}
