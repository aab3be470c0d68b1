//! Kimi Delta Attention layer (docs/model.md#kda-layer): projections here, the fused step in
//! the backend.

use super::format_policy::FormatPolicy;
use super::loader::Loader;
use crate::backend::{matmul_each, Backend, KdaDims, KdaStepInputs, KdaStepWeights};
use crate::config::Config;
use crate::quant::DenseFormat;
use anyhow::Result;

/// Weights of one KDA layer (`model.layers.{i}.self_attn.*`).
pub struct Kda<B: Backend> {
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
    pub fn dims(cfg: &Config) -> KdaDims {
        KdaDims {
            heads: cfg.kda.num_heads,
            head_dim: cfg.kda.head_dim,
            conv_k: cfg.kda.conv_kernel,
            lower_bound: cfg.kda.gate_lower_bound,
            norm_eps: cfg.rms_norm_eps,
        }
    }

    /// Loads layer `i`. The small gate projections stay bf16: they cost little and set decay.
    pub fn load(ld: &Loader<'_, B>, i: usize, policy: &FormatPolicy) -> Result<Self> {
        let dims = Self::dims(&ld.ckpt.config);
        let p = format!("model.layers.{i}.self_attn.");
        let m = |n: &str, f: DenseFormat| ld.matrix(&format!("{p}{n}.weight"), f);
        let a_log = ld.vector(&format!("{p}A_log"))?;
        let a_log = &a_log[..dims.heads.min(a_log.len())];
        Ok(Self {
            dims,
            q_proj: m("q_proj", policy.dense)?,
            k_proj: m("k_proj", policy.dense)?,
            v_proj: m("v_proj", policy.dense)?,
            g_proj: m("g_proj", policy.dense)?,
            o_proj: m("o_proj", policy.dense)?,
            f_a_proj: m("f_a_proj", DenseFormat::Bf16)?,
            f_b_proj: m("f_b_proj", DenseFormat::Bf16)?,
            b_proj: m("b_proj", DenseFormat::Bf16)?,
            step: KdaStepWeights {
                conv_q: ld.vector_act(&format!("{p}q_conv1d.weight"))?,
                conv_k: ld.vector_act(&format!("{p}k_conv1d.weight"))?,
                conv_v: ld.vector_act(&format!("{p}v_conv1d.weight"))?,
                a_log: ld.backend.upload(a_log, 1, a_log.len())?,
                dt_bias: ld.vector_act(&format!("{p}dt_bias"))?,
                o_norm: ld.vector_act(&format!("{p}o_norm.weight"))?,
            },
        })
    }

    /// Fresh recurrent state for this layer.
    pub fn new_state(&self, b: &B) -> Result<B::KdaState> {
        b.kda_state(&self.dims)
    }

    /// Runs the chunk's rows (normed layer input `x`) through the layer, in order.
    pub fn forward(&self, b: &B, state: &mut B::KdaState, x: &B::Act) -> Result<B::Act> {
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
        let inp = KdaStepInputs {
            q: &q,
            k: &k,
            v: &v,
            f: &f,
            beta: &beta,
            gate: &gate,
        };
        let o = b.kda_step(&self.dims, &self.step, state, inp)?;
        b.matmul(&self.o_proj, &o)
    }
}
