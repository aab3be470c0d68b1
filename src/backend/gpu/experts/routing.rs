//! The routing tables of one MoE call, built on the host: work items per arena group, the
//! gather tables that feed each (expert, token) pair its input row, and the scatter CSR
//! that sums each token's experts back in expert-list order.

use crate::backend::ExpertAssignment;
use anyhow::{ensure, Result};

/// Routing of one call: work items (slot, first pair, pairs), grouped by arena set, gather
/// tables, scatter CSR.
pub(super) struct Routing {
    /// `[items × 3] | token of pair | pair | csr offsets (rows + 1) | pair ids | weight bits`.
    pub(super) words: Vec<u32>,
    pub(super) tok_map: u32,
    pub(super) id_map: u32,
    pub(super) csr: u32,
    pub(super) csr_pairs: u32,
    pub(super) csr_weights: u32,
    pub(super) pairs: usize,
    /// Pairs 0 .. tiled_pairs go through the chunk kernel.
    pub(super) tiled_pairs: usize,
    /// Per group (arena set): its one-pair items and its tiled items, each as (first item,
    /// count).
    pub(super) group_items: Vec<[(u32, u32); 2]>,
}

/// Builds the routing tables; `place[e]` is expert e's (group, slot). An expert with at
/// least `tiled.0` tokens gets items of up to `tiled.1` consecutive pairs (for the chunk
/// kernel), listed after the group's one-pair items (for the matvec); `tiled.0 == 0` gives
/// one-pair items only. The tiled experts' pairs are numbered first, so the chunk kernel's
/// outputs are one block of rows (`tiled_pairs`). Each token's pairs are listed in expert
/// list order, so the scatter sums a row's experts in the same order whatever arenas or
/// kernels they go through.
pub(super) fn build_routing(
    experts: &[ExpertAssignment<'_>],
    rows: usize,
    place: &[(usize, u32)],
    groups: usize,
    tiled: (usize, usize),
) -> Result<Routing> {
    let is_tiled = |n: usize| tiled.0 > 0 && tiled.1 > 0 && n >= tiled.0;
    // Pair ids: the tiled experts' first, then the others, each in group then list order.
    let mut first_pair = vec![0u32; experts.len()];
    let mut next = 0u32;
    let mut tiled_pairs = 0;
    for want_tiled in [true, false] {
        for g in 0..groups {
            for (e, ex) in experts.iter().enumerate() {
                if place[e].0 == g && is_tiled(ex.tokens.len()) == want_tiled {
                    first_pair[e] = next;
                    next += ex.tokens.len() as u32;
                }
            }
        }
        if want_tiled {
            tiled_pairs = next as usize;
        }
    }
    let mut tok_of_pair = vec![0u32; next as usize];
    let mut items = Vec::new();
    let mut group_items = Vec::with_capacity(groups);
    for g in 0..groups {
        let first_item = items.len() / 3;
        let mut tiles = Vec::new();
        for (e, ex) in experts.iter().enumerate() {
            let (eg, slot) = place[e];
            if eg != g {
                continue;
            }
            let p0 = first_pair[e];
            for (k, &(t, _)) in ex.tokens.iter().enumerate() {
                ensure!(t < rows, "moe: token row {t} out of range ({rows} rows)");
                tok_of_pair[p0 as usize + k] = t as u32;
            }
            let n = ex.tokens.len();
            if is_tiled(n) {
                for k in (0..n).step_by(tiled.1) {
                    tiles.extend([slot, p0 + k as u32, tiled.1.min(n - k) as u32]);
                }
            } else {
                items.extend((0..n as u32).flat_map(|k| [slot, p0 + k, 1]));
            }
        }
        let one = (first_item as u32, (items.len() / 3 - first_item) as u32);
        items.extend(tiles);
        let tiled_first = one.0 + one.1;
        group_items.push([one, (tiled_first, items.len() as u32 / 3 - tiled_first)]);
    }
    let mut per_token: Vec<Vec<(u32, f32)>> = vec![Vec::new(); rows];
    for (e, ex) in experts.iter().enumerate() {
        for (j, &(t, w)) in ex.tokens.iter().enumerate() {
            per_token[t].push((first_pair[e] + j as u32, w));
        }
    }
    let pairs = tok_of_pair.len();
    let mut words = items;
    let tok_map = words.len() as u32;
    words.extend(&tok_of_pair);
    let id_map = words.len() as u32;
    words.extend(0..pairs as u32);
    let csr = words.len() as u32;
    let mut off = 0u32;
    words.push(0);
    for t in &per_token {
        off += t.len() as u32;
        words.push(off);
    }
    let csr_pairs = words.len() as u32;
    words.extend(per_token.iter().flatten().map(|&(p, _)| p));
    let csr_weights = words.len() as u32;
    words.extend(per_token.iter().flatten().map(|&(_, w)| w.to_bits()));
    Ok(Routing {
        words,
        tok_map,
        id_map,
        csr,
        csr_pairs,
        csr_weights,
        pairs,
        tiled_pairs,
        group_items,
    })
}

#[cfg(test)]
mod tests {
    use super::build_routing;
    use crate::backend::ExpertAssignment;

    fn expert(tokens: &[usize]) -> ExpertAssignment<'static> {
        ExpertAssignment {
            key: None,
            payload: crate::backend::ExpertPayload::Resident,
            tokens: tokens.iter().map(|&t| (t, 0.5)).collect(),
        }
    }

    /// Items as (slot, first pair, pairs) triples.
    fn items(words: &[u32], (first, count): (u32, u32)) -> Vec<[u32; 3]> {
        (first..first + count)
            .map(|i| {
                let b = 3 * i as usize;
                [words[b], words[b + 1], words[b + 2]]
            })
            .collect()
    }

    #[test]
    fn tiled_experts_take_the_first_pairs_in_runs_of_a_tile() {
        // Experts 0 and 2 have 5 and 3 tokens (tiled from 3, tiles of 2); expert 1 has 1.
        let experts = [expert(&[0, 1, 2, 3, 4]), expert(&[2]), expert(&[1, 3, 4])];
        // Experts 0 and 1 in group 0 (slots 4 and 7), expert 2 in group 1 (slot 0).
        let place = [(0, 4), (0, 7), (1, 0)];
        let rt = build_routing(&experts, 5, &place, 2, (3, 2)).unwrap();
        assert_eq!((rt.pairs, rt.tiled_pairs), (9, 8));
        let g0 = rt.group_items[0];
        let g1 = rt.group_items[1];
        // Tiled pairs: expert 0 → 0..5, expert 2 → 5..8; expert 1's one pair is 8.
        assert_eq!(items(&rt.words, g0[0]), vec![[7, 8, 1]]);
        assert_eq!(
            items(&rt.words, g0[1]),
            vec![[4, 0, 2], [4, 2, 2], [4, 4, 1]]
        );
        assert_eq!(items(&rt.words, g1[0]), Vec::<[u32; 3]>::new());
        assert_eq!(items(&rt.words, g1[1]), vec![[0, 5, 2], [0, 7, 1]]);
        // Each pair's token, and each token's pairs in expert list order.
        let tok = &rt.words[rt.tok_map as usize..][..rt.pairs];
        assert_eq!(tok, &[0, 1, 2, 3, 4, 1, 3, 4, 2]);
        let csr = &rt.words[rt.csr as usize..][..6];
        let pairs = &rt.words[rt.csr_pairs as usize..][..rt.pairs];
        let of = |t: usize| &pairs[csr[t] as usize..csr[t + 1] as usize];
        assert_eq!(of(2), &[2, 8]);
        assert_eq!(of(3), &[3, 6]);
    }

    #[test]
    fn without_tiling_every_pair_is_its_own_item() {
        let experts = [expert(&[0, 1, 2, 3, 4])];
        let rt = build_routing(&experts, 5, &[(0, 3)], 1, (0, 0)).unwrap();
        assert_eq!(rt.tiled_pairs, 0);
        assert_eq!(rt.group_items[0][1].1, 0);
        assert_eq!(items(&rt.words, rt.group_items[0][0]).len(), 5);
        assert!(build_routing(&[expert(&[5])], 5, &[(0, 0)], 1, (0, 0)).is_err());
    }
}
