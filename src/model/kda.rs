//! Kimi Delta Attention layer (docs/model.md#kda-layer): projections here, the fused step in
//! the backend.

use super::format_policy::FormatPolicy;
use super::loader::Loader;
use super::pieces::{each_piece, PieceState};
use crate::backend::{matmul_each, Backend, KdaDims, KdaStepInputs, KdaStepWeights};
use crate::checkpoint::model_tensors::KdaTensors;
use crate::config::Config;
use crate::quant::DenseFormat;
use anyhow::Result;

/// Weights of one KDA layer (`model.layers.{i}.self_attn.*`).
pub(crate) struct Kda<B: Backend> {
    dims: KdaDims,
    q_proj: B::Mat,
    k_proj: B::Mat,
    v_proj: B::Mat,
    g_proj: B::Mat,
    o_proj: B::Mat,
    f_a_proj: B::Mat,
    f_b_proj: B::Mat,
    b_proj: B::Mat,
    step: KdaStepWeights<B::Act>,
}

impl<B: Backend> Kda<B> {
    /// Shapes of the layer from the config.
    pub(crate) fn dims(cfg: &Config) -> KdaDims {
        KdaDims {
            heads: cfg.kda.num_heads,
            head_dim: cfg.kda.head_dim,
            conv_k: cfg.kda.conv_kernel,
            lower_bound: cfg.kda.gate_lower_bound,
            norm_eps: cfg.rms_norm_eps,
        }
    }

    /// Loads the layer's tensors `t`. The small gate projections stay bf16: they cost little
    /// and set decay.
    pub(crate) fn load(ld: &Loader<'_, B>, t: &KdaTensors, policy: &FormatPolicy) -> Result<Self> {
        let dims = Self::dims(&ld.ckpt.config);
        let a_log = ld.vector(&t.a_log)?;
        let a_log = &a_log[..dims.heads.min(a_log.len())];
        let dense = policy.dense;
        Ok(Self {
            dims,
            q_proj: ld.matrix(&t.q_proj, dense)?,
            k_proj: ld.matrix(&t.k_proj, dense)?,
            v_proj: ld.matrix(&t.v_proj, dense)?,
            g_proj: ld.matrix(&t.g_proj, dense)?,
            o_proj: ld.matrix(&t.o_proj, dense)?,
            f_a_proj: ld.matrix(&t.f_a_proj, DenseFormat::Bf16)?,
            f_b_proj: ld.matrix(&t.f_b_proj, DenseFormat::Bf16)?,
            b_proj: ld.matrix(&t.b_proj, DenseFormat::Bf16)?,
            step: KdaStepWeights {
                conv_q: ld.vector_act(&t.q_conv)?,
                conv_k: ld.vector_act(&t.k_conv)?,
                conv_v: ld.vector_act(&t.v_conv)?,
                a_log: ld.backend.upload(a_log, 1, a_log.len())?,
                dt_bias: ld.vector_act(&t.dt_bias)?,
                o_norm: ld.vector_act(&t.o_norm)?,
            },
        })
    }

    /// Fresh recurrent state for this layer.
    pub(crate) fn new_state(&self, b: &B) -> Result<B::KdaState> {
        b.kda_state(&self.dims)
    }

    /// Runs the rows of `x` (the normed layer input) through the layer: the projections over
    /// every row, the recurrence on each piece's rows with that piece's state, in order.
    pub(crate) fn forward(
        &self,
        b: &B,
        x: &B::Act,
        pieces: &mut [PieceState<'_, B::KdaState>],
    ) -> Result<B::Act> {
        let [q, k, v, fa, beta, gate] = matmul_each(
            b,
            [
                &self.q_proj,
                &self.k_proj,
                &self.v_proj,
                &self.f_a_proj,
                &self.b_proj,
                &self.g_proj,
            ],
            x,
        )?;
        let f = b.matmul(&self.f_b_proj, &fa)?;
        let acts = [&q, &k, &v, &f, &beta, &gate];
        if pieces.len() > 1 {
            let inp = KdaStepInputs::of(acts);
            let mut states: Vec<_> = pieces
                .iter_mut()
                .map(|p| (&mut *p.state, p.rows.clone()))
                .collect();
            if let Some(o) = b.kda_step_pieces(&self.dims, &self.step, &mut states, inp)? {
                return b.matmul(&self.o_proj, &o);
            }
        }
        let o = each_piece(b, acts, pieces, |state, xs| {
            b.kda_step(&self.dims, &self.step, state, KdaStepInputs::of(xs))
        })?;
        b.matmul(&self.o_proj, &o)
    }
}
