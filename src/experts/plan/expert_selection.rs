//! Reading fewer experts than the router chose, where the user allows it (the default is
//! exact): keep each token's top experts up to a share of its routing weight
//! (`--expert-top-p`, the C engine's `K3_TOPP`), and skip an expert that no cache holds when
//! every token gave it less than a weight (`--skip-uncached-below`). The kept weights of a
//! token are scaled back to the sum its router gave, so the layer's output keeps its scale.

use crate::routed_expert::Route;
use anyhow::{bail, Result};

/// Which routed experts a layer may leave out.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertSelection {
    /// Keep each token's heaviest experts until they hold this share of its weight (0, 1].
    pub top_p: Option<f32>,
    /// Skip an expert held by no cache when each token's weight for it is below this.
    pub skip_uncached_below: Option<f32>,
}

impl ExpertSelection {
    /// The exact selection: every expert the router chose.
    pub fn exact() -> Self {
        Self::default()
    }

    /// Checks the settings, naming the flag of a bad one.
    pub fn validated(self) -> Result<Self> {
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("--expert-top-p / K3_TOPP must be in (0, 1], got {p}");
            }
        }
        if let Some(w) = self.skip_uncached_below {
            if !(w.is_finite() && w >= 0.0) {
                bail!("--skip-uncached-below must be a routing weight >= 0, got {w}");
            }
        }
        Ok(self)
    }

    /// True when no expert is ever left out.
    pub fn is_exact(&self) -> bool {
        self.top_p.is_none() && self.skip_uncached_below.is_none()
    }
}

/// Keeps the heaviest experts of `route` until their weight reaches `p` of its total (at
/// least one), scaled back to that total.
pub fn keep_top_p(route: &mut Route, p: f32) {
    let total: f32 = route.iter().map(|&(_, w)| w).sum();
    if route.len() <= 1 || total <= 0.0 {
        return;
    }
    let mut order: Vec<usize> = (0..route.len()).collect();
    // Stable on ties, so the choice does not depend on the sort.
    order.sort_by(|&a, &b| route[b].1.total_cmp(&route[a].1));
    let mut kept = 0.0f32;
    let mut keep = vec![false; route.len()];
    for &i in &order {
        keep[i] = true;
        kept += route[i].1;
        if kept >= p * total {
            break;
        }
    }
    let mut i = 0;
    route.retain(|_| {
        i += 1;
        keep[i - 1]
    });
    rescale(route, total);
}

/// Drops `skipped` experts from every route, scaling each changed route back to its total.
/// A route that would lose every expert keeps them all.
pub fn drop_experts(routes: &mut [Route], skipped: &[u32]) {
    for route in routes {
        let total: f32 = route.iter().map(|&(_, w)| w).sum();
        if route.iter().all(|(e, _)| skipped.contains(e)) {
            continue;
        }
        let before = route.len();
        route.retain(|(e, _)| !skipped.contains(e));
        if route.len() != before {
            rescale(route, total);
        }
    }
}

/// The experts of `ids` to skip: not cached (`cached[i]` false) and given less than `below`
/// by every token that chose them, as listed in `routes`; never all of a token's experts.
pub fn uncached_to_skip(ids: &[u32], cached: &[bool], routes: &[Route], below: f32) -> Vec<u32> {
    let mut skip: Vec<u32> = ids
        .iter()
        .zip(cached)
        .filter(|(_, &c)| !c)
        .map(|(&id, _)| id)
        .filter(|id| {
            routes
                .iter()
                .flat_map(|r| r.iter())
                .filter(|(e, _)| e == id)
                .all(|&(_, w)| w < below)
        })
        .collect();
    // A token none of whose experts would remain keeps its heaviest one.
    for route in routes {
        if !route.is_empty() && route.iter().all(|(e, _)| skip.contains(e)) {
            if let Some(&(keep, _)) = route.iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
                skip.retain(|&e| e != keep);
            }
        }
    }
    skip
}

fn rescale(route: &mut Route, total: f32) {
    let kept: f32 = route.iter().map(|&(_, w)| w).sum();
    if kept > 0.0 {
        let s = total / kept;
        for (_, w) in route.iter_mut() {
            *w *= s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(r: &Route) -> f32 {
        r.iter().map(|&(_, w)| w).sum()
    }

    #[test]
    fn top_p_keeps_the_heaviest_up_to_the_share_and_keeps_the_total() {
        let mut r: Route = vec![(7, 0.1), (3, 0.5), (9, 0.3), (1, 0.1)];
        keep_top_p(&mut r, 0.75);
        let ids: Vec<u32> = r.iter().map(|&(e, _)| e).collect();
        assert_eq!(ids, vec![3, 9]);
        assert!((sum(&r) - 1.0).abs() < 1e-6);
        assert!((r[0].1 - 0.625).abs() < 1e-6);
        let mut all: Route = vec![(1, 0.2), (2, 0.2)];
        keep_top_p(&mut all, 1.0);
        assert_eq!(all.len(), 2);
        let mut one: Route = vec![(1, 0.9), (2, 0.1)];
        keep_top_p(&mut one, 0.01);
        assert_eq!(one, vec![(1, 1.0)]);
    }

    #[test]
    fn uncached_light_experts_are_skipped_but_never_a_whole_token() {
        let routes: Vec<Route> = vec![
            vec![(1, 0.6), (2, 0.05), (3, 0.35)],
            vec![(2, 0.5), (4, 0.5)],
        ];
        // 2 is light for token 0 but heavy for token 1: kept. 3 is cached: kept.
        let ids = [1, 2, 3, 4];
        let skip = uncached_to_skip(&ids, &[false, false, true, false], &routes, 0.4);
        assert_eq!(skip, Vec::<u32>::new());
        let routes: Vec<Route> = vec![vec![(1, 0.6), (2, 0.05), (3, 0.35)]];
        let skip = uncached_to_skip(&[1, 2, 3], &[false, false, false], &routes, 0.4);
        assert_eq!(skip, vec![2, 3]);
        let mut r = routes.clone();
        drop_experts(&mut r, &skip);
        assert_eq!(r[0], vec![(1, 1.0)]);
        // Every expert light and uncached: the heaviest stays.
        let routes: Vec<Route> = vec![vec![(5, 0.2), (6, 0.1)]];
        assert_eq!(
            uncached_to_skip(&[5, 6], &[false, false], &routes, 0.5),
            vec![6]
        );
    }

    #[test]
    fn bad_settings_name_their_flag() {
        let e = ExpertSelection {
            top_p: Some(1.5),
            ..Default::default()
        }
        .validated();
        assert!(e.unwrap_err().to_string().contains("--expert-top-p"));
        let e = ExpertSelection {
            skip_uncached_below: Some(f32::NAN),
            ..Default::default()
        }
        .validated();
        assert!(e.unwrap_err().to_string().contains("--skip-uncached-below"));
        assert!(ExpertSelection::exact().validated().unwrap().is_exact());
    }
}
