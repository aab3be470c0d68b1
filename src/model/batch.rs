//! Several sequences in one forward pass: each sequence's rows (a segment) and where they
//! lie among the pass's rows and sub-batches.
//!
//! [`super::K3Model::forward_batch`] concatenates the segments' rows in segment order. Every
//! op but attention runs over all rows together, so each routed expert is read once a layer
//! for every row routed to it, whatever its sequence; attention (KDA and MLA) runs per piece,
//! a segment's rows within one sub-batch, on that segment's own state.

use super::k3::{Logits, State};
use super::prefill_window::sub_batches;
use crate::backend::Backend;
use anyhow::{bail, Context, Result};
use std::ops::Range;

/// One sequence's rows in a batched forward pass.
pub struct Segment<'s, B: Backend> {
    /// The sequence's state (advanced by `ids.len()`).
    pub state: &'s mut State<B>,
    /// Its tokens this pass: one for a decoding sequence, a slice of its prompt for one prefilling.
    pub ids: &'s [u32],
    /// Which of its logits to return.
    pub want: Logits,
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
    /// Each segment's wanted logits.
    want: Vec<Logits>,
    /// The rows of each sub-batch.
    pub parts: Vec<Range<usize>>,
    /// The pieces of each sub-batch, in row order.
    pub pieces: Vec<Vec<Piece>>,
}

impl RowLayout {
    /// The layout of `segs` in sub-batches of `sub_rows` rows, checking each segment against
    /// a model of `layers` layers and `vocab` token ids.
    pub fn new<B: Backend>(
        segs: &[Segment<'_, B>],
        sub_rows: usize,
        layers: usize,
        vocab: usize,
    ) -> Result<Self> {
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
            if seg.state.layers.len() != layers {
                bail!(
                    "forward: the state{who} holds {} layers; the model has {layers}",
                    seg.state.layers.len()
                );
            }
            if let Some(k) = seg.ids.iter().position(|&id| id as usize >= vocab) {
                let id = seg.ids[k];
                let at = if segs.len() == 1 {
                    String::new()
                } else {
                    format!("{who}, at position {},", seg.state.pos + k)
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
            pos: segs.iter().map(|s| s.state.pos).collect(),
            want: segs.iter().map(|s| s.want).collect(),
            parts,
            pieces,
        })
    }

    /// " of segment `s`" in a pass of several segments; nothing in a pass of one.
    fn name(count: usize, s: usize) -> String {
        if count == 1 {
            String::new()
        } else {
            format!(" of segment {s}")
        }
    }

    /// Rows of the whole pass.
    pub fn rows(&self) -> usize {
        self.segs.last().map_or(0, |r| r.end)
    }

    /// Segments of the pass.
    pub fn len(&self) -> usize {
        self.segs.len()
    }

    /// The first segment's first context position (where the route tap opens its chunk).
    pub fn first_pos(&self) -> usize {
        self.pos.first().copied().unwrap_or(0)
    }

    /// Row `row` of the pass as an error names it: "position P of the context", with its
    /// segment in a pass of several.
    pub fn at_row(&self, row: usize) -> String {
        let s = self.segs.iter().position(|r| r.contains(&row)).unwrap_or(0);
        let p = self.pos[s] + row.saturating_sub(self.segs[s].start);
        format!("position {p} of the context{}", Self::name(self.len(), s))
    }

    /// Row `row` of segment `s`'s logits as an error names it.
    pub fn at_logit_row(&self, s: usize, row: usize) -> String {
        let first = match self.want[s] {
            Logits::All => 0,
            Logits::Last => self.segs[s].len() - 1,
        };
        self.at_row(self.segs[s].start + first + row)
    }

    /// Where the pass's rows are, for an error of a block that runs them all together.
    pub fn at_all(&self) -> String {
        if self.len() == 1 {
            return format!("at position {} of the context", self.pos[0]);
        }
        let at: Vec<String> = (0..self.len())
            .map(|s| format!("segment {s} at {}", self.pos[s]))
            .collect();
        format!("in a batch of {} segments ({})", self.len(), at.join(", "))
    }

    /// Segment `s`'s piece `piece` as an error names it: its first row's position.
    pub fn at_piece(&self, part: usize, piece: &Piece) -> String {
        self.at_row(self.parts[part].start + piece.rows.start)
    }

    /// The rows of sub-batch `part` whose logits are wanted (numbered within it, in order).
    pub fn head_rows(&self, part: usize) -> Vec<Range<usize>> {
        let p = &self.parts[part];
        self.segs
            .iter()
            .zip(&self.want)
            .filter_map(|(r, want)| {
                let r = match want {
                    Logits::All => r.clone(),
                    Logits::Last => r.end - 1..r.end,
                };
                let (a, b) = (r.start.max(p.start), r.end.min(p.end));
                (a < b).then(|| a - p.start..b - p.start)
            })
            .collect()
    }

    /// Each segment's count of logit rows, in segment order.
    pub fn logit_rows(&self) -> Vec<usize> {
        self.segs
            .iter()
            .zip(&self.want)
            .map(|(r, want)| match want {
                Logits::All => r.len(),
                Logits::Last => 1,
            })
            .collect()
    }
}

/// A piece as an attention block runs it: its segment's state for the layer, its rows
/// within the sub-batch, and, in a pass of several segments, how an error names it.
pub struct PieceState<'p, S> {
    /// The segment's state of this layer.
    pub state: &'p mut S,
    /// The piece's rows within the sub-batch.
    pub rows: Range<usize>,
    /// Where the piece is, for errors (`None` in a pass of one segment).
    pub at: Option<String>,
}

/// Runs `f` on each piece's rows of `xs` (activations over the same rows) with the piece's
/// state and returns the outputs in row order; `f` gets `xs` themselves when one piece
/// holds every row.
pub fn each_piece<B: Backend, S, const N: usize>(
    b: &B,
    xs: [&B::Act; N],
    pieces: &mut [PieceState<'_, S>],
    mut f: impl FnMut(&mut S, [&B::Act; N]) -> Result<B::Act>,
) -> Result<B::Act> {
    let rows = xs.first().map_or(0, |x| b.shape(x).0);
    if let [one] = pieces {
        if one.rows.len() == rows {
            return named(f(one.state, xs), &one.at);
        }
    }
    let mut outs = Vec::with_capacity(pieces.len());
    for p in pieces.iter_mut() {
        let cut: Vec<B::Act> = xs
            .iter()
            .map(|x| b.slice_rows(x, p.rows.start, p.rows.len()))
            .collect::<Result<_>>()?;
        let refs: [&B::Act; N] = std::array::from_fn(|i| &cut[i]);
        outs.push(named(f(p.state, refs), &p.at)?);
    }
    let refs: Vec<&B::Act> = outs.iter().collect();
    b.concat_rows(&refs)
}

/// `r` with the piece's place as context, when it has one.
fn named<T>(r: Result<T>, at: &Option<String>) -> Result<T> {
    match at {
        Some(at) => r.with_context(|| format!("attention at {at}")),
        None => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use Logits::*;

    fn layout(ids: &[&[u32]], want: &[Logits], sub_rows: usize) -> Result<RowLayout> {
        let mut states: Vec<State<CpuBackend>> = ids
            .iter()
            .map(|_| State {
                layers: Vec::new(),
                pos: 10,
            })
            .collect();
        let segs: Vec<Segment<'_, CpuBackend>> = states
            .iter_mut()
            .zip(ids)
            .zip(want)
            .map(|((state, ids), &want)| Segment { state, ids, want })
            .collect();
        RowLayout::new(&segs, sub_rows, 0, 100)
    }

    #[test]
    fn pieces_cut_segments_at_sub_batch_edges() {
        let l = layout(&[&[1], &[1, 2, 3, 4, 5], &[1]], &[Last, All, Last], 4).unwrap();
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
        let e = layout(&[&[1], &[]], &[Last, Last], 4).unwrap_err();
        assert_eq!(e.to_string(), "forward: empty window of segment 1");
        let e = layout(&[&[1], &[2, 300]], &[Last, Last], 4).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("token id 300 of segment 1, at position 11, is out of range"),
            "{e}"
        );
        let e = layout(&[&[300]], &[Last], 4).unwrap_err();
        assert!(
            e.to_string().starts_with("token id 300 is out of range"),
            "{e}"
        );
        assert!(layout(&[], &[], 4).is_err());
    }
}
