//! A MoE layer's expert plan: from the router's routes to the experts the layer reads.
//! Top-p selection, the distinct experts in canonical (disk) order, the route tap, the
//! backend's resident experts (pinned for the layer), skipping the uncached light ones,
//! and each expert's rows. The MoE block (`model/moe.rs`) keeps only the math.

use crate::backend::ExpertResidency;
use crate::checkpoint::Checkpoint;
use crate::experts::plan::expert_selection::{
    drop_experts, keep_top_p, uncached_to_skip, ExpertSelection,
};
use crate::experts::remote::RemoteExperts;
use crate::experts::ExpertSource;
use crate::routed_expert::Route;
use crate::stats::Stats;
use anyhow::Result;
use std::collections::{HashMap, HashSet};

/// Where a MoE layer's experts come from and which of them a token keeps, as the model
/// holds them.
#[derive(Clone, Copy)]
pub(crate) struct ExpertAccess<'a> {
    /// The checkpoint (the expert table, the canonical order).
    pub ck: &'a Checkpoint,
    /// The caches, the loaders and the route tap.
    pub source: &'a ExpertSource,
    /// Top-p and skipping (`--expert-top-p`, `--skip-uncached-below`).
    pub selection: &'a ExpertSelection,
    /// The other ranks of an expert-parallel job, when this process is its head.
    pub remote: Option<&'a dyn RemoteExperts>,
}

/// What a MoE layer reads and runs for one window.
pub(crate) struct ExpertPlan {
    /// The distinct experts to run, in canonical order.
    pub ids: Vec<u32>,
    /// Per id, whether the backend holds it resident (pinned until the layer is done).
    pub resident: Vec<bool>,
    /// Per expert, the `(row, routing weight)` pairs that chose it, rows in order.
    pub rows: HashMap<u32, Vec<(usize, f32)>>,
}

impl ExpertPlan {
    /// Plans MoE layer `layer` from its router's `routes` under `ex`'s selection: what
    /// top-p or skipping leaves out is counted in `stats`, the routes go to the route tap,
    /// and the experts `residency` holds are pinned there until its next call.
    pub(crate) fn new<R: ExpertResidency + ?Sized>(
        residency: &R,
        ex: ExpertAccess<'_>,
        layer: usize,
        mut routes: Vec<Route>,
        stats: &mut Stats,
    ) -> Result<Self> {
        let (ck, source, sel) = (ex.ck, ex.source, ex.selection);
        let chosen = distinct_experts(&routes).len();
        if let Some(p) = sel.top_p {
            routes.iter_mut().for_each(|r| keep_top_p(r, p));
        }
        let mut ids = distinct_experts(&routes);
        ExpertSource::canonical_order(ck, layer, &mut ids)?;
        if let Some(tap) = source.route_tap() {
            tap.record(layer, &routes, &ids)?;
        }
        // Pinned now, the resident experts stay on the backend until this layer is done.
        let mut resident = residency.pin_resident_experts(layer, &ids)?;
        if let Some(below) = sel.skip_uncached_below {
            let in_host = source.cached(layer, &ids)?;
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
        let mut rows: HashMap<u32, Vec<(usize, f32)>> = HashMap::new();
        for (row, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                rows.entry(e).or_default().push((row, w));
            }
        }
        Ok(Self {
            ids,
            resident,
            rows,
        })
    }

    /// The experts a guess for MoE layer `layer` reads ahead from its router's `routes`:
    /// at most `limit`, the heaviest by the weight the rows gave them together, in
    /// canonical order.
    pub(crate) fn guesses(
        ck: &Checkpoint,
        layer: usize,
        routes: &[Route],
        limit: usize,
    ) -> Result<Vec<u32>> {
        let mut ids = most_chosen(routes, limit);
        ExpertSource::canonical_order(ck, layer, &mut ids)?;
        Ok(ids)
    }
}

/// Up to `limit` distinct experts of `routes`, the heaviest first: by the routing weight
/// the rows gave them together (ties: the smaller id).
fn most_chosen(routes: &[Route], limit: usize) -> Vec<u32> {
    let mut weight: HashMap<u32, f64> = HashMap::new();
    for &(e, w) in routes.iter().flatten() {
        *weight.entry(e).or_default() += f64::from(w);
    }
    let mut by: Vec<(f64, u32)> = weight.into_iter().map(|(e, w)| (w, e)).collect();
    by.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    by.into_iter().take(limit).map(|(_, e)| e).collect()
}

/// The distinct experts of `routes`, in first-seen order.
fn distinct_experts(routes: &[Route]) -> Vec<u32> {
    let mut seen = HashSet::new();
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
