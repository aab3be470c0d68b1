//! Attention over a batch's pieces, one a segment: a block's projections run over every
//! row, the part that needs a sequence's own state (the KDA recurrence, the MLA attention)
//! on each piece.

use crate::backend::Backend;
use anyhow::{Context, Result};
use std::ops::Range;

/// A piece as an attention block runs it: its segment's state for the layer, its rows
/// among the pass's rows, and, in a pass of several segments, how an error names it.
pub(crate) struct PieceState<'p, S> {
    /// The segment's state of this layer.
    pub state: &'p mut S,
    /// The piece's rows among the pass's rows.
    pub rows: Range<usize>,
    /// Where the piece is, for errors (`None` in a pass of one segment).
    pub at: Option<String>,
}

/// Runs `f` on each piece's rows of `xs` (activations over the same rows) with the piece's
/// state and returns the outputs in row order; `f` gets `xs` themselves when one piece
/// holds every row. Several pieces go through [`Backend::map_pieces`], which may run two
/// at once.
pub(crate) fn each_piece<B: Backend, S: Send, const N: usize>(
    b: &B,
    xs: [&B::Act; N],
    pieces: &mut [PieceState<'_, S>],
    f: impl Fn(&mut S, [&B::Act; N]) -> Result<B::Act> + Sync,
) -> Result<B::Act> {
    let rows = xs.first().map_or(0, |x| b.shape(x).0);
    if let [one] = pieces {
        if one.rows.len() == rows {
            return named(f(one.state, xs), &one.at);
        }
    }
    let mut items = Vec::with_capacity(pieces.len());
    for p in pieces.iter_mut() {
        let cut: Vec<B::Act> = xs
            .iter()
            .map(|x| b.slice_rows(x, p.rows.start, p.rows.len()))
            .collect::<Result<_>>()?;
        items.push((&mut *p.state, cut, &p.at));
    }
    let outs = b.map_pieces(&mut items, &|(state, cut, at)| {
        let refs: [&B::Act; N] = std::array::from_fn(|i| &cut[i]);
        named(f(state, refs), at)
    });
    let outs: Vec<B::Act> = outs.into_iter().collect::<Result<_>>()?;
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
