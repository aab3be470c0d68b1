//! Latent MoE block (model doc §4.4): router, latent down-projection, routed experts in
//! native MXFP4, latent norm and up-projection, plus the fused shared experts.

use super::format_policy::FormatPolicy;
use super::glu_mlp::GluMlp;
use super::loader::Loader;
use crate::backend::{Backend, ExpertAssignment, Glu, RouterParams};
use crate::checkpoint::Checkpoint;
use crate::experts::{DirectReader, LoadedExpert};
use crate::quant::DenseFormat;
use crate::stats::Stats;
use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Instant;

/// Weights of one MoE layer (`model.layers.{i}.block_sparse_moe.*`).
pub struct Moe<B: Backend> {
    layer: usize,
    gate: B::Mat,
    bias: Vec<f32>,
    down: B::Mat,
    up: B::Mat,
    norm: Option<B::Act>,
    shared: Option<GluMlp<B>>,
    router: RouterParams,
    latent: usize,
    eps: f32,
}

impl<B: Backend> Moe<B> {
    /// Loads layer `i`. The router stays bf16, which the kernels widen exactly to f32.
    pub fn load(ld: &Loader<'_, B>, i: usize, policy: &FormatPolicy) -> Result<Self> {
        let cfg = &ld.ckpt.config;
        let p = format!("model.layers.{i}.block_sparse_moe.");
        let shared = if cfg.num_shared_experts > 0 {
            Some(GluMlp::load(ld, &format!("{p}shared_experts."), policy.dense)?)
        } else {
            None
        };
        Ok(Self {
            layer: i,
            gate: ld.matrix(&format!("{p}gate.weight"), DenseFormat::Bf16)?,
            bias: ld.vector(&format!("{p}gate.e_score_correction_bias"))?,
            down: ld.matrix(&format!("{p}routed_expert_down_proj.weight"), policy.dense)?,
            up: ld.matrix(&format!("{p}routed_expert_up_proj.weight"), policy.dense)?,
            norm: if cfg.latent_moe_use_norm {
                Some(ld.vector_act(&format!("{p}routed_expert_norm.weight"))?)
            } else {
                None
            },
            shared,
            router: RouterParams {
                top_k: cfg.num_experts_per_token,
                renormalize: cfg.moe_renormalize,
                scaling: cfg.routed_scaling_factor,
            },
            latent: cfg.routed_expert_hidden_size,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Applies the block to every row of `x` (the normed, mixed FFN input).
    pub fn forward(
        &self,
        b: &B,
        ck: &Checkpoint,
        reader: &DirectReader,
        x: &B::Act,
        glu: Glu,
        stats: &mut Stats,
    ) -> Result<B::Act> {
        let routes = b.router_topk(&b.matmul(&self.gate, x)?, &self.bias, self.router)?;
        // Experts run in id order, so each row sums its experts in the same order whatever
        // the chunk size: chunked prefill stays bit-identical to one token at a time.
        let mut by_expert: BTreeMap<u32, Vec<(usize, f32)>> = BTreeMap::new();
        for (row, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                by_expert.entry(e).or_default().push((row, w));
            }
        }
        let t0 = Instant::now();
        let loaded: Vec<LoadedExpert> = by_expert
            .keys()
            .map(|&e| reader.read(ck, self.layer, e))
            .collect::<Result<_>>()?;
        stats.eload += t0.elapsed();
        stats.expert_lookups += loaded.len() as u64;
        stats.bytes_streamed += loaded.iter().map(|l| l.len() as u64).sum::<u64>();
        let assignments: Vec<ExpertAssignment<'_>> = loaded
            .iter()
            .zip(by_expert.into_values())
            .map(|(l, tokens)| Ok(ExpertAssignment { weights: l.weights(&ck.config)?, tokens }))
            .collect::<Result<_>>()?;
        let z = b.matmul(&self.down, x)?;
        let u = b.moe_experts(&z, &assignments, glu)?;
        let u = match &self.norm {
            Some(w) => b.rmsnorm(&u, w, self.latent, self.eps)?,
            None => u,
        };
        let y = b.matmul(&self.up, &u)?;
        match &self.shared {
            Some(s) => b.add(&y, &s.forward(b, x, glu)?),
            None => Ok(y),
        }
    }
}
