//! Latent MoE block (docs/model.md#moe-layer): router, latent down-projection, routed experts
//! in native MXFP4, latent norm and up-projection, plus the fused shared experts.

use super::expert_selection::{drop_experts, keep_top_p, uncached_to_skip, ExpertSelection};
use super::format_policy::FormatPolicy;
use super::glu_mlp::GluMlp;
use super::loader::Loader;
use crate::backend::{Backend, ExpertAssignment, Glu, RouterParams};
use crate::checkpoint::Checkpoint;
use crate::experts::prefetch::guess_limit;
use crate::experts::{ExpertSource, Supplied};
use crate::quant::DenseFormat;
use crate::routed_expert::ExpertKey;
use crate::stats::Stats;
use anyhow::{anyhow, Result};
use std::cell::OnceCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The MoE layer after this one and the hidden state its router is scored on to guess
/// which experts it will read (`--prefetch`).
pub struct NextMoe<'a, B: Backend> {
    /// The next MoE layer.
    pub moe: &'a Moe<B>,
    /// Its router's input as far as this layer can tell.
    pub x: &'a B::Act,
}

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
            Some(GluMlp::load(
                ld,
                &format!("{p}shared_experts."),
                policy.dense,
            )?)
        } else {
            None
        };
        Ok(Self {
            layer: i,
            gate: ld.decision_matrix(&format!("{p}gate.weight"), DenseFormat::Bf16)?,
            bias: ld.decision_vector(&format!("{p}gate.e_score_correction_bias"))?,
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

    /// Applies the block to every row of `x` (the normed, mixed FFN input). With `next`,
    /// once this layer's first reads are in flight, the next MoE layer's likely experts are
    /// read ahead behind them.
    // The model's per-layer context (checkpoint, expert source, activation, selection) is
    // passed apart rather than bundled: each piece is borrowed from a different owner.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        b: &B,
        ck: &Checkpoint,
        source: &ExpertSource,
        x: &B::Act,
        glu: Glu,
        sel: &ExpertSelection,
        next: Option<NextMoe<'_, B>>,
        stats: &mut Stats,
    ) -> Result<B::Act> {
        let t = Instant::now();
        let mut routes = b.router_topk(&b.matmul(&self.gate, x)?, &self.bias, self.router)?;
        stats.router_wait += t.elapsed();
        let chosen = distinct_experts(&routes).len();
        if let Some(p) = sel.top_p {
            routes.iter_mut().for_each(|r| keep_top_p(r, p));
        }
        let mut ids = distinct_experts(&routes);
        ExpertSource::canonical_order(ck, self.layer, &mut ids)?;
        if let Some(tap) = source.route_tap() {
            tap.record(self.layer, &routes, &ids)?;
        }
        // Pinned now, the resident experts stay on the backend until this layer is done.
        let mut resident = b.pin_resident_experts(self.layer, &ids)?;
        if let Some(below) = sel.skip_uncached_below {
            let in_host = source.cached(self.layer, &ids)?;
            let cached: Vec<bool> = in_host
                .iter()
                .zip(&resident)
                .map(|(h, r)| *h || *r)
                .collect();
            let skip = uncached_to_skip(&ids, &cached, &routes, below);
            if !skip.is_empty() {
                drop_experts(&mut routes, &skip);
                let keep: Vec<bool> = ids.iter().map(|id| !skip.contains(id)).collect();
                let mut k = keep.iter();
                resident.retain(|_| *k.next().unwrap_or(&true));
                let mut k = keep.iter();
                ids.retain(|_| *k.next().unwrap_or(&true));
            }
        }
        stats.experts_skipped += (chosen - ids.len()) as u64;
        stats.bytes_skipped += ((chosen - ids.len()) * ck.config.expert_bytes()) as u64;
        let mut by_expert: HashMap<u32, Vec<(usize, f32)>> = HashMap::new();
        for (row, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                by_expert.entry(e).or_default().push((row, w));
            }
        }
        let (rows, _) = b.shape(x);
        let mut u = b.zeros(rows, self.latent)?;
        let mut handoff = Duration::ZERO;
        // The latent projection and the shared expert need no routed expert: they run once
        // the first reads are in flight, not before them.
        let z = OnceCell::new();
        let shared = OnceCell::new();
        let mut guess_stats = Stats::default();
        let mut prework = || -> Result<()> {
            // Guesses go first: their router readback then waits for nothing else, and
            // the loaders take them only once this layer's own reads are all served.
            if let Some(n) = &next {
                n.moe.read_ahead(b, ck, source, n.x, &mut guess_stats)?;
            }
            let _ = z.set(b.matmul(&self.down, x)?);
            if let Some(s) = &self.shared {
                let _ = shared.set(s.forward(b, x, glu)?);
            }
            Ok(())
        };
        let mut consume = |batch: &[Supplied<'_>]| -> Result<()> {
            let z = z.get().ok_or_else(|| {
                anyhow!(
                    "internal: MoE layer {} consumed experts before its latent projection",
                    self.layer
                )
            })?;
            let t = Instant::now();
            let assignments: Vec<ExpertAssignment<'_>> = batch
                .iter()
                .map(|s| {
                    let (weights, staged) = match s {
                        Supplied::Host(l) => match l.staged(&ck.config) {
                            Some(st) => (None, Some(st)),
                            None => (Some(l.weights(&ck.config)?), None),
                        },
                        Supplied::Resident(_) => (None, None),
                    };
                    Ok(ExpertAssignment {
                        key: Some(ExpertKey {
                            layer: self.layer,
                            id: s.id(),
                        }),
                        weights,
                        staged,
                        tokens: by_expert.get(&s.id()).cloned().unwrap_or_default(),
                    })
                })
                .collect::<Result<_>>()?;
            let r = b.moe_accumulate(&mut u, z, &assignments, glu);
            handoff += t.elapsed();
            r
        };
        source.stream(
            ck,
            self.layer,
            &ids,
            &resident,
            stats,
            &mut prework,
            &mut consume,
        )?;
        stats.expert_handoff += handoff;
        *stats = stats.plus(&guess_stats);
        let u = match &self.norm {
            Some(w) => b.rmsnorm(&u, w, self.latent, self.eps)?,
            None => u,
        };
        let y = b.matmul(&self.up, &u)?;
        match shared.into_inner() {
            Some(s) => b.add(&y, &s),
            None => Ok(y),
        }
    }
}

impl<B: Backend> Moe<B> {
    /// Scores this layer's router on `x` and reads ahead the experts it picks that no cache
    /// holds: the heaviest first, at most [`guess_limit`] of them; nothing on a pass where
    /// the prefetch gate judges the layer's guesses not to pay.
    fn read_ahead(
        &self,
        b: &B,
        ck: &Checkpoint,
        source: &ExpertSource,
        x: &B::Act,
        stats: &mut Stats,
    ) -> Result<()> {
        if !source.should_guess(self.layer, stats)? {
            return Ok(());
        }
        let t = Instant::now();
        let routes = b.router_topk(&b.matmul(&self.gate, x)?, &self.bias, self.router)?;
        let router = t.elapsed();
        stats.router_wait += router;
        let limit = guess_limit(self.router.top_k, source.config().load_threads);
        let mut ids = most_chosen(&routes, limit);
        ExpertSource::canonical_order(ck, self.layer, &mut ids)?;
        source.prefetch(ck, self.layer, &ids, router, stats)
    }
}

/// Up to `limit` distinct experts of `routes`, the heaviest first: by the routing weight
/// the rows gave them together (ties: the smaller id).
fn most_chosen(routes: &[crate::routed_expert::Route], limit: usize) -> Vec<u32> {
    let mut weight: HashMap<u32, f64> = HashMap::new();
    for &(e, w) in routes.iter().flatten() {
        *weight.entry(e).or_default() += f64::from(w);
    }
    let mut by: Vec<(f64, u32)> = weight.into_iter().map(|(e, w)| (w, e)).collect();
    by.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    by.into_iter().take(limit).map(|(_, e)| e).collect()
}

/// The distinct experts of `routes`, in first-seen order.
fn distinct_experts(routes: &[crate::routed_expert::Route]) -> Vec<u32> {
    let mut seen = std::collections::HashSet::new();
    routes
        .iter()
        .flatten()
        .map(|&(e, _)| e)
        .filter(|e| seen.insert(*e))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_keep_the_most_chosen_experts() {
        let routes = vec![
            vec![(4, 0.5), (2, 0.5)],
            vec![(2, 0.5), (9, 0.5)],
            vec![(2, 0.5), (4, 0.5)],
        ];
        assert_eq!(most_chosen(&routes, 2), vec![2, 4]);
        assert_eq!(most_chosen(&routes, 8), vec![2, 4, 9]);
        // One token: its heaviest experts, whatever their ids.
        let one = vec![vec![(1, 0.1), (7, 0.6), (3, 0.3)]];
        assert_eq!(most_chosen(&one, 2), vec![7, 3]);
        assert!(most_chosen(&[], 4).is_empty());
    }
}
