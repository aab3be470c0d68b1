//! Which rank owns which routed expert of each MoE layer: each layer's experts split into
//! one run of consecutive ids per rank, sized so that each rank's expected share of reads is
//! proportional to its read rate (with uniform routing, its share of the experts).

use anyhow::{bail, Result};
use std::ops::Range;

/// The owner of every routed expert of every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    experts: usize,
    rates: Vec<f64>,
}

impl Placement {
    /// A placement of `experts` routed experts a layer over `rates.len()` ranks, rank `r`
    /// reading at `rates[r]` (any unit; equal rates give a balanced split).
    pub fn new(experts: usize, rates: &[f64]) -> Result<Self> {
        if rates.is_empty() {
            bail!("a placement needs at least one rank");
        }
        for (r, &g) in rates.iter().enumerate() {
            if !g.is_finite() || g <= 0.0 {
                bail!("--rank-read-gbps: rank {r}'s read rate {g} is not a positive number");
            }
        }
        Ok(Self {
            experts,
            rates: rates.to_vec(),
        })
    }

    /// Equal read rates for `ranks` ranks.
    pub fn balanced(experts: usize, ranks: usize) -> Result<Self> {
        Self::new(experts, &vec![1.0; ranks])
    }

    /// Ranks in the placement.
    pub fn ranks(&self) -> usize {
        self.rates.len()
    }

    /// How many experts of layer `layer` each rank owns: the largest-remainder split of
    /// the rates, the leftover experts going to the ranks with the largest remainders, ties
    /// taken in an order that turns with the layer so no rank takes every leftover.
    pub fn counts(&self, layer: usize) -> Vec<usize> {
        let n = self.rates.len();
        let total: f64 = self.rates.iter().sum();
        let exact: Vec<f64> = self
            .rates
            .iter()
            .map(|g| self.experts as f64 * g / total)
            .collect();
        let mut counts: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
        let left = self.experts.saturating_sub(counts.iter().sum());
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            let (fa, fb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
            fb.total_cmp(&fa)
                .then(((a + n - layer % n) % n).cmp(&((b + n - layer % n) % n)))
        });
        for &r in order.iter().take(left) {
            counts[r] += 1;
        }
        counts
    }

    /// The ids rank `rank` owns in layer `layer`.
    pub fn owned(&self, layer: usize, rank: usize) -> Range<u32> {
        let counts = self.counts(layer);
        let start: usize = counts.iter().take(rank).sum();
        let len = counts.get(rank).copied().unwrap_or(0);
        start as u32..(start + len) as u32
    }

    /// The rank that owns expert `id` of layer `layer`.
    pub fn owner(&self, layer: usize, id: u32) -> usize {
        let mut end = 0usize;
        for (r, c) in self.counts(layer).into_iter().enumerate() {
            end += c;
            if (id as usize) < end {
                return r;
            }
        }
        self.rates.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_rates_split_evenly_and_cover_every_expert() {
        let p = Placement::balanced(256, 2).unwrap();
        assert_eq!(p.owned(0, 0), 0..128);
        assert_eq!(p.owned(0, 1), 128..256);
        assert_eq!(p.owner(3, 127), 0);
        assert_eq!(p.owner(3, 128), 1);
        let p = Placement::balanced(8, 3).unwrap();
        let mut total = [0usize; 3];
        for layer in 0..3 {
            let c = p.counts(layer);
            assert_eq!(c.iter().sum::<usize>(), 8);
            for r in 0..3 {
                total[r] += c[r];
            }
            for id in 0..8u32 {
                assert!(p.owned(layer, p.owner(layer, id)).contains(&id));
            }
        }
        // The leftover experts turn over the ranks.
        assert_eq!(total, [8, 8, 8]);
    }

    #[test]
    fn faster_ranks_own_more() {
        let p = Placement::new(300, &[1.0, 2.0]).unwrap();
        assert_eq!(p.counts(0), vec![100, 200]);
        assert!(Placement::new(8, &[1.0, 0.0]).is_err());
        assert!(Placement::new(8, &[f64::NAN]).is_err());
        assert!(Placement::new(8, &[]).is_err());
    }
}
