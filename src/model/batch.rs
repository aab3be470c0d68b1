//! Several sequences in one forward pass: each sequence's rows (a segment) and where they
//! lie among the pass's rows and sub-batches.
//!
//! [`super::K3Model::forward_batch`] concatenates the segments' rows in segment order. Every
//! op but attention runs over all rows together, so each routed expert is read once a layer
//! for every row routed to it, whatever its sequence; attention (KDA and MLA) runs per piece,
//! a segment's rows within one sub-batch, on that segment's own state.

use super::prefill_window::sub_batches;
use anyhow::{bail, Result};
use std::ops::Range;

/// What the layout needs of one segment.
pub(super) struct SegmentRows<'a> {
    /// Its tokens this pass.
    pub ids: &'a [u32],
    /// Its first context position.
    pub pos: usize,
    /// Whether it wants every row's logits (else only its last row's).
    pub all: bool,
}

/// A segment's rows within one sub-batch: attention runs on them with the segment's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    /// The segment (its index in the pass).
    pub seg: usize,
    /// Its rows, numbered within the sub-batch.
    pub rows: Range<usize>,
}

/// Where the rows of a pass's segments lie.
#[derive(Clone, Debug)]
pub(super) struct RowLayout {
    /// Each segment's rows among the pass's rows.
    segs: Vec<Range<usize>>,
    /// Each segment's first context position.
    pos: Vec<usize>,
    /// Whether each segment wants every row's logits (else its last row's).
    all: Vec<bool>,
    /// The rows of each sub-batch.
    pub parts: Vec<Range<usize>>,
    /// The pieces of each sub-batch, in row order.
    pub pieces: Vec<Vec<Piece>>,
}

impl RowLayout {
    /// The layout of `segs` in sub-batches of `sub_rows` rows, checking each segment's ids
    /// against a vocabulary of `vocab`.
    pub(crate) fn new(segs: &[SegmentRows<'_>], sub_rows: usize, vocab: usize) -> Result<Self> {
        if segs.is_empty() {
            bail!("forward: a batch with no segments");
        }
        let mut ranges = Vec::with_capacity(segs.len());
        let mut start = 0;
        for (s, seg) in segs.iter().enumerate() {
            let who = Self::name(segs.len(), s);
            if seg.ids.is_empty() {
                bail!("forward: empty window{who}");
            }
            if let Some(k) = seg.ids.iter().position(|&id| id as usize >= vocab) {
                let id = seg.ids[k];
                let at = if segs.len() == 1 {
                    String::new()
                } else {
                    format!("{who}, at position {},", seg.pos + k)
                };
                bail!(
                    "token id {id}{at} is out of range: the model's vocab_size is {vocab} \
                     (ids 0..{vocab})"
                );
            }
            ranges.push(start..start + seg.ids.len());
            start += seg.ids.len();
        }
        let parts = sub_batches(start, sub_rows);
        let pieces = parts
            .iter()
            .map(|p| {
                ranges
                    .iter()
                    .enumerate()
                    .filter_map(|(seg, r)| {
                        let (a, b) = (r.start.max(p.start), r.end.min(p.end));
                        (a < b).then(|| Piece {
                            seg,
                            rows: a - p.start..b - p.start,
                        })
                    })
                    .collect()
            })
            .collect();
        Ok(Self {
            segs: ranges,
            pos: segs.iter().map(|s| s.pos).collect(),
            all: segs.iter().map(|s| s.all).collect(),
            parts,
            pieces,
        })
    }

    /// " of segment `s`" in a pass of several segments; nothing in a pass of one.
    pub(crate) fn name(count: usize, s: usize) -> String {
        if count == 1 {
            String::new()
        } else {
            format!(" of segment {s}")
        }
    }

    /// Rows of the whole pass.
    pub(crate) fn rows(&self) -> usize {
        self.segs.last().map_or(0, |r| r.end)
    }

    /// Segments of the pass.
    pub(crate) fn len(&self) -> usize {
        self.segs.len()
    }

    /// The first segment's first context position (where the route tap opens its chunk).
    pub(crate) fn first_pos(&self) -> usize {
        self.pos.first().copied().unwrap_or(0)
    }

    /// Row `row` of the pass as an error names it: "position P of the context", with its
    /// segment in a pass of several.
    pub(crate) fn at_row(&self, row: usize) -> String {
        let s = self.segs.iter().position(|r| r.contains(&row)).unwrap_or(0);
        let p = self.pos[s] + row.saturating_sub(self.segs[s].start);
        format!("position {p} of the context{}", Self::name(self.len(), s))
    }

    /// Row `row` of segment `s`'s logits as an error names it.
    pub(crate) fn at_logit_row(&self, s: usize, row: usize) -> String {
        let first = if self.all[s] {
            0
        } else {
            self.segs[s].len() - 1
        };
        self.at_row(self.segs[s].start + first + row)
    }

    /// Where the pass's rows are, for an error of a block that runs them all together.
    pub(crate) fn at_all(&self) -> String {
        if self.len() == 1 {
            return format!("at position {} of the context", self.pos[0]);
        }
        let at: Vec<String> = (0..self.len())
            .map(|s| format!("segment {s} at {}", self.pos[s]))
            .collect();
        format!("in a batch of {} segments ({})", self.len(), at.join(", "))
    }

    /// Segment `s`'s piece `piece` as an error names it: its first row's position.
    pub(crate) fn at_piece(&self, part: usize, piece: &Piece) -> String {
        self.at_row(self.parts[part].start + piece.rows.start)
    }

    /// The rows of sub-batch `part` whose logits are wanted (numbered within it, in order).
    pub(crate) fn head_rows(&self, part: usize) -> Vec<Range<usize>> {
        let p = &self.parts[part];
        self.segs
            .iter()
            .zip(&self.all)
            .filter_map(|(r, &all)| {
                let r = if all { r.clone() } else { r.end - 1..r.end };
                let (a, b) = (r.start.max(p.start), r.end.min(p.end));
                (a < b).then(|| a - p.start..b - p.start)
            })
            .collect()
    }

    /// Each segment's count of logit rows, in segment order.
    pub(crate) fn logit_rows(&self) -> Vec<usize> {
        self.segs
            .iter()
            .zip(&self.all)
            .map(|(r, &all)| if all { r.len() } else { 1 })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(ids: &[&[u32]], all: &[bool], sub_rows: usize) -> Result<RowLayout> {
        let segs: Vec<SegmentRows<'_>> = ids
            .iter()
            .zip(all)
            .map(|(&ids, &all)| SegmentRows { ids, pos: 10, all })
            .collect();
        RowLayout::new(&segs, sub_rows, 100)
    }

    #[test]
    fn pieces_cut_segments_at_sub_batch_edges() {
        let l = layout(&[&[1], &[1, 2, 3, 4, 5], &[1]], &[false, true, false], 4).unwrap();
        assert_eq!(l.parts, vec![0..4, 4..7]);
        let p = |seg, rows| Piece { seg, rows };
        assert_eq!(l.pieces[0], vec![p(0, 0..1), p(1, 1..4)]);
        assert_eq!(l.pieces[1], vec![p(1, 0..2), p(2, 2..3)]);
        assert_eq!(l.head_rows(0), vec![0..1, 1..4]);
        assert_eq!(l.head_rows(1), vec![0..2, 2..3]);
        assert_eq!(l.logit_rows(), vec![1, 5, 1]);
        assert_eq!(l.at_row(5), "position 14 of the context of segment 1");
        assert_eq!(
            l.at_logit_row(2, 0),
            "position 10 of the context of segment 2"
        );
    }

    #[test]
    fn a_bad_segment_is_named() {
        let e = layout(&[&[1], &[]], &[false, false], 4).unwrap_err();
        assert_eq!(e.to_string(), "forward: empty window of segment 1");
        let e = layout(&[&[1], &[2, 300]], &[false, false], 4).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("token id 300 of segment 1, at position 11, is out of range"),
            "{e}"
        );
        let e = layout(&[&[300]], &[false], 4).unwrap_err();
        assert!(
            e.to_string().starts_with("token id 300 is out of range"),
            "{e}"
        );
        assert!(layout(&[], &[], 4).is_err());
    }
}
