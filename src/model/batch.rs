//! Several sequences in one forward pass: each sequence's rows (a segment) and where they
//! lie among the pass's rows.
//!
//! [`super::K3Model::forward_batch`] concatenates the segments' rows in segment order. Every
//! op but attention runs over all rows together, so each routed expert is read once a layer
//! for every row routed to it, whatever its sequence; attention (KDA and MLA) runs on each
//! segment's rows with that segment's own state.

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

/// Where the rows of a pass's segments lie.
#[derive(Clone, Debug)]
pub(super) struct RowLayout {
    /// Each segment's rows among the pass's rows.
    segs: Vec<Range<usize>>,
    /// Each segment's first context position.
    pos: Vec<usize>,
    /// Whether each segment wants every row's logits (else its last row's).
    all: Vec<bool>,
}

impl RowLayout {
    /// The layout of `segs`, checking each segment's ids against a vocabulary of `vocab`.
    pub(crate) fn new(segs: &[SegmentRows<'_>], vocab: usize) -> Result<Self> {
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
        Ok(Self {
            segs: ranges,
            pos: segs.iter().map(|s| s.pos).collect(),
            all: segs.iter().map(|s| s.all).collect(),
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

    /// Segment `s`'s rows among the pass's rows.
    pub(crate) fn segment(&self, s: usize) -> Range<usize> {
        self.segs.get(s).cloned().unwrap_or(0..0)
    }

    /// Segment `s` as an error of its attention names it: its first row's position.
    pub(crate) fn at_segment(&self, s: usize) -> String {
        self.at_row(self.segment(s).start)
    }

    /// The rows whose logits are wanted, in order: each segment's last row, or all of its
    /// rows.
    pub(crate) fn head_rows(&self) -> Vec<Range<usize>> {
        self.segs
            .iter()
            .zip(&self.all)
            .map(|(r, &all)| if all { r.clone() } else { r.end - 1..r.end })
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

    fn layout(ids: &[&[u32]], all: &[bool]) -> Result<RowLayout> {
        let segs: Vec<SegmentRows<'_>> = ids
            .iter()
            .zip(all)
            .map(|(&ids, &all)| SegmentRows { ids, pos: 10, all })
            .collect();
        RowLayout::new(&segs, 100)
    }

    #[test]
    fn segments_lie_in_order_among_the_rows() {
        let l = layout(&[&[1], &[1, 2, 3, 4, 5], &[1]], &[false, true, false]).unwrap();
        assert_eq!((l.rows(), l.len()), (7, 3));
        assert_eq!(
            [l.segment(0), l.segment(1), l.segment(2)],
            [0..1, 1..6, 6..7]
        );
        assert_eq!(l.head_rows(), vec![0..1, 1..6, 6..7]);
        assert_eq!(l.logit_rows(), vec![1, 5, 1]);
        assert_eq!(l.at_segment(1), "position 10 of the context of segment 1");
        assert_eq!(l.at_row(5), "position 14 of the context of segment 1");
        assert_eq!(
            l.at_logit_row(2, 0),
            "position 10 of the context of segment 2"
        );
    }

    #[test]
    fn a_bad_segment_is_named() {
        let e = layout(&[&[1], &[]], &[false, false]).unwrap_err();
        assert_eq!(e.to_string(), "forward: empty window of segment 1");
        let e = layout(&[&[1], &[2, 300]], &[false, false]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("token id 300 of segment 1, at position 11, is out of range"),
            "{e}"
        );
        let e = layout(&[&[300]], &[false]).unwrap_err();
        assert!(
            e.to_string().starts_with("token id 300 is out of range"),
            "{e}"
        );
        assert!(layout(&[], &[]).is_err());
    }
}
