//! Shape checks every backend runs before an op, written once so the messages agree.

use super::{KdaDims, MlaDims};

use crate::routed_expert::ExpertWeights;
use anyhow::{ensure, Result};

/// `(rows, cols)` of an activation.
pub(crate) type Shape = (usize, usize);

/// Two operands of an elementwise op must have the same shape.
pub(crate) fn same_shape(op: &str, a: Shape, b: Shape) -> Result<()> {
    ensure!(
        a == b,
        "{op}: shapes differ ({}x{} vs {}x{})",
        a.0,
        a.1,
        b.0,
        b.1
    );
    Ok(())
}

/// The pieces of a batch (one a sequence) cover the `n` rows of the op's inputs, in order.
pub(crate) fn pieces_cover(op: &str, pieces: &[std::ops::Range<usize>], n: usize) -> Result<()> {
    let mut next = 0;
    for rows in pieces {
        ensure!(
            rows.start == next && rows.end <= n,
            "{op}: pieces {pieces:?} do not cover the {n} rows in order"
        );
        next = rows.end;
    }
    ensure!(next == n, "{op}: pieces end at row {next} of the {n} rows");
    Ok(())
}

/// The six per-token inputs of the KDA step, in the order q, k, v, f, beta, gate.
/// Returns the number of rows.
pub(crate) fn kda_inputs(d: &KdaDims, inputs: [Shape; 6]) -> Result<usize> {
    let (p, n) = (d.width(), inputs[0].0);
    let names = ["q", "k", "v", "f", "beta", "gate"];
    let widths = [p, p, p, p, d.heads, p];
    for ((name, (rows, cols)), want) in names.iter().zip(inputs).zip(widths) {
        ensure!(
            rows == n && cols == want,
            "kda_step: input {name} is {rows}x{cols}, expected {n}x{want}"
        );
    }
    Ok(n)
}

/// The query `[n, heads·(nope+rope)]` and latent `[n, kv_lora+rope]` of MLA attention.
pub(crate) fn mla_inputs(d: &MlaDims, q: Shape, c: Shape) -> Result<()> {
    let qw = d.heads * (d.nope + d.rope);
    let cw = d.kv_lora + d.rope;
    ensure!(
        q.1 == qw && c.1 == cw && q.0 == c.0,
        "mla_attend: q is {}x{}, c is {}x{}; expected n x {qw} and n x {cw}",
        q.0,
        q.1,
        c.0,
        c.1
    );
    Ok(())
}

/// The MoE accumulator must have the latent's shape.
pub(crate) fn moe_accumulator(acc: Shape, z: Shape) -> Result<()> {
    ensure!(
        acc == z,
        "moe: accumulator is {}x{}, latent is {}x{}",
        acc.0,
        acc.1,
        z.0,
        z.1
    );
    Ok(())
}

/// An expert's three matrices against one another and the latent width `d`: w1 and w3
/// `[I, d]`, w2 `[d, I]`. Returns `I`.
pub(crate) fn expert_shapes(w: &ExpertWeights<'_>, d: usize) -> Result<usize> {
    let i = w.w1.rows;
    ensure!(
        w.w1.cols == d && w.w3.cols == d && w.w3.rows == i && w.w2.rows == d && w.w2.cols == i,
        "moe: expert shapes w1 {}x{}, w3 {}x{}, w2 {}x{} do not fit latent width {d}",
        w.w1.rows,
        w.w1.cols,
        w.w3.rows,
        w.w3.cols,
        w.w2.rows,
        w.w2.cols
    );
    Ok(i)
}

/// The parts of a row concatenation: at least one, all of one width. Returns the width.
pub(crate) fn concat_rows(parts: impl IntoIterator<Item = Shape>) -> Result<usize> {
    let mut cols = None;
    for (i, (_, c)) in parts.into_iter().enumerate() {
        match cols {
            None => cols = Some(c),
            Some(w) => ensure!(
                w == c,
                "concat_rows: part {i} has {c} columns, the first has {w}"
            ),
        }
    }
    cols.ok_or_else(|| anyhow::anyhow!("concat_rows: no parts"))
}
