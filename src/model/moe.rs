//! Latent MoE block (docs/model.md#moe-layer): router, latent down-projection, routed experts
//! in native MXFP4, latent norm and up-projection, plus the fused shared experts.

use super::format_policy::FormatPolicy;
use super::glu_mlp::GluMlp;
use super::loader::Loader;
use crate::backend::{Backend, ExpertAssignment, Glu, RouterParams};
use crate::checkpoint::model_tensors::MoeTensors;
use crate::experts::plan::expert_plan::{ExpertAccess, ExpertPlan};
use crate::experts::plan::prefetch::guess_limit;
use crate::experts::Supplied;
use crate::quant::DenseFormat;
use crate::routed_expert::ExpertKey;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::cell::OnceCell;
use std::time::{Duration, Instant};

mod ranked;
#[cfg(feature = "mpi")]
pub(crate) use ranked::expert_rows;

/// The MoE layer after this one and the hidden state its router is scored on to guess
/// which experts it will read (`--prefetch`).
pub(crate) struct NextMoe<'a, B: Backend> {
    /// The next MoE layer.
    pub moe: &'a Moe<B>,
    /// Its router's input as far as this layer can tell.
    pub x: &'a B::Act,
}

/// Weights of one MoE layer (`model.layers.{i}.block_sparse_moe.*`).
pub(crate) struct Moe<B: Backend> {
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
    /// Loads layer `i`'s tensors `t`. The router stays bf16, which the kernels widen exactly
    /// to f32.
    pub(crate) fn load(
        ld: &Loader<'_, B>,
        i: usize,
        t: &MoeTensors,
        policy: &FormatPolicy,
    ) -> Result<Self> {
        let cfg = &ld.ckpt.config;
        let shared = if cfg.num_shared_experts > 0 {
            Some(GluMlp::load(ld, &t.shared, policy.dense)?)
        } else {
            None
        };
        Ok(Self {
            layer: i,
            gate: ld.decision_matrix(&t.gate, DenseFormat::Bf16)?,
            bias: ld.decision_vector(&t.bias)?,
            down: ld.matrix(&t.down, policy.dense)?,
            up: ld.matrix(&t.up, policy.dense)?,
            norm: t.norm.as_ref().map(|n| ld.vector_act(n)).transpose()?,
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

    /// Applies the block to every row of `x` (the normed, mixed FFN input, `[rows, hidden]`):
    /// `up · norm(Σ_e w_e · expert_e(down · x)) + shared(x)`, the sum over each row's top-k
    /// experts. With `next`, once this layer's first reads are in flight, the next MoE
    /// layer's likely experts are read ahead behind them.
    // The model's per-layer context (checkpoint, expert source, activation, selection) is
    // passed apart rather than bundled: each piece is borrowed from a different owner.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        b: &B,
        ex: ExpertAccess<'_>,
        x: &B::Act,
        glu: Glu,
        next: Option<NextMoe<'_, B>>,
        stats: &mut Stats,
    ) -> Result<B::Act> {
        if let Some(remote) = ex.remote {
            return self.forward_ranked(b, ex, remote, x, glu, next, stats);
        }
        let routeless = Routeless::default();
        let plan = self.route(b, ex, x, stats, &mut || {
            self.routeless(b, x, glu, &routeless)
        })?;
        let u = self.experts_while_reading(b, ex, &plan, x, glu, next, &routeless, stats)?;
        self.finish(b, u, routeless.shared.into_inner())
    }

    /// Each row's top-k experts and weights (the router on `x`), and where their bytes are.
    /// `meanwhile` goes to the device behind the router where the backend takes it
    /// ([`Backend::router_topk_then`]); the wait for the routes counts without it.
    fn route(
        &self,
        b: &B,
        ex: ExpertAccess<'_>,
        x: &B::Act,
        stats: &mut Stats,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<ExpertPlan> {
        let t = Instant::now();
        let mut beside = Duration::ZERO;
        let mut timed = || {
            let t = Instant::now();
            let r = meanwhile();
            beside += t.elapsed();
            r
        };
        // scores: [rows, experts]
        let scores = b.matmul(&self.gate, x)?;
        let routes = b.router_topk_then(&scores, &self.bias, self.router, &mut timed)?;
        stats.router_wait += t.elapsed().saturating_sub(beside);
        ExpertPlan::new(b, ex, self.layer, routes, stats)
    }

    /// What needs no route, into whichever of `r` is not yet set: the latent projection
    /// `z = down · x` and the shared expert's output.
    fn routeless(&self, b: &B, x: &B::Act, glu: Glu, r: &Routeless<B::Act>) -> Result<()> {
        if r.z.get().is_none() {
            let _ = r.z.set(b.matmul(&self.down, x)?);
        }
        if let (Some(s), None) = (&self.shared, r.shared.get()) {
            let _ = r.shared.set(s.forward(b, x, glu)?);
        }
        Ok(())
    }

    /// The latent sum `u = Σ_e w_e · expert_e(z)`, `z = down · x` (`[rows, latent]`). The
    /// expert source reads the planned experts; what needs no routed expert (the next
    /// layer's guesses, then `z` and the shared expert where the router did not take them
    /// into `routeless`) runs once the first reads are in flight, and each batch of experts
    /// is accumulated as it arrives.
    #[allow(clippy::too_many_arguments)]
    fn experts_while_reading(
        &self,
        b: &B,
        ex: ExpertAccess<'_>,
        plan: &ExpertPlan,
        x: &B::Act,
        glu: Glu,
        next: Option<NextMoe<'_, B>>,
        routeless: &Routeless<B::Act>,
        stats: &mut Stats,
    ) -> Result<B::Act> {
        let ck = ex.ck;
        let (rows, _) = b.shape(x);
        let mut u = b.zeros(rows, self.latent)?;
        let mut handoff = Duration::ZERO;
        let mut guess_stats = Stats::default();
        let mut prework = || -> Result<()> {
            // Guesses go first: their router readback then waits for nothing else, and
            // the loaders take them only once this layer's own reads are all served.
            if let Some(n) = &next {
                n.moe.read_ahead(b, ex, n.x, &mut guess_stats)?;
            }
            self.routeless(b, x, glu, routeless)
        };
        let mut consume = |batch: &[Supplied<'_>]| -> Result<()> {
            let z = routeless.z.get().ok_or_else(|| {
                anyhow!(
                    "internal: MoE layer {} consumed experts before its latent projection",
                    self.layer
                )
            })?;
            let t = Instant::now();
            let assignments: Vec<ExpertAssignment<'_>> = batch
                .iter()
                .map(|s| {
                    Ok(ExpertAssignment {
                        key: Some(ExpertKey {
                            layer: self.layer,
                            id: s.id(),
                        }),
                        payload: s.payload(&ck.config)?,
                        tokens: plan.rows.get(&s.id()).cloned().unwrap_or_default(),
                    })
                })
                .collect::<Result<_>>()?;
            let r = b.moe_accumulate(&mut u, z, &assignments, glu);
            handoff += t.elapsed();
            r
        };
        ex.source.stream(
            ck,
            self.layer,
            &plan.ids,
            &plan.resident,
            stats,
            &mut prework,
            &mut consume,
        )?;
        stats.expert_handoff += handoff;
        *stats = stats.plus(&guess_stats);
        Ok(u)
    }

    /// `up · norm(u) + shared`: the latent sum back to the hidden width, `[rows, hidden]`.
    fn finish(&self, b: &B, u: B::Act, shared: Option<B::Act>) -> Result<B::Act> {
        let u = match &self.norm {
            Some(w) => b.rmsnorm(&u, w, self.latent, self.eps)?,
            None => u,
        };
        let y = b.matmul(&self.up, &u)?;
        match shared {
            Some(s) => b.add(&y, &s),
            None => Ok(y),
        }
    }
}

impl<B: Backend> Moe<B> {
    /// Scores this layer's router on `x` and reads ahead the experts it picks that no cache
    /// holds: the heaviest first, at most [`guess_limit`] of them. The pass asks the
    /// prefetch gate before it builds `x` (`K3Model::next_moe_guess`).
    fn read_ahead(&self, b: &B, ex: ExpertAccess<'_>, x: &B::Act, stats: &mut Stats) -> Result<()> {
        let source = ex.source;
        let t = Instant::now();
        let routes = b.router_topk(&b.matmul(&self.gate, x)?, &self.bias, self.router)?;
        let router = t.elapsed();
        stats.router_wait += router;
        let limit = guess_limit(self.router.top_k, source.config().load_threads);
        let mut ids = ExpertPlan::guesses(ex.ck, self.layer, &routes, limit)?;
        // A guess reads only the experts this process owns.
        if let Some(r) = ex.remote {
            ids.retain(|&id| r.owner(self.layer, id) == 0);
        }
        source.prefetch(ex.ck, self.layer, &ids, router, stats)
    }
}

/// A MoE layer's work that needs no route (`z = down · x` and the shared expert's output),
/// set once, by the router's wait or behind the experts' reads.
pub(crate) struct Routeless<A> {
    z: OnceCell<A>,
    shared: OnceCell<A>,
}

impl<A> Default for Routeless<A> {
    fn default() -> Self {
        Self {
            z: OnceCell::new(),
            shared: OnceCell::new(),
        }
    }
}
