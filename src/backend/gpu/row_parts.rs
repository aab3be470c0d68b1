//! Activations in parts: how an activation's rows are cut into parts that each fit one
//! binding, and the copies that move rows across parts.

use super::device::buffers::{GpuAct, GpuRows};
use super::GpuBackend;
use anyhow::{anyhow, ensure, Result};
use std::borrow::Cow;

impl GpuBackend {
    /// Rows of one activation part at most: what one binding of the model's widest per-row
    /// buffer takes ([`crate::backend::Backend::fit_rows`]), or fewer where
    /// [`super::GpuOptions::part_rows`] asks; no bound before a model sets its widest row.
    pub fn part_rows(&self) -> usize {
        self.part_rows
    }

    /// The rows of each part of an activation of `rows` rows: one part when they fit,
    /// else parts of [`Self::part_rows`] and the rest.
    pub fn part_sizes(&self, rows: usize) -> Vec<usize> {
        let per = self.part_rows.max(1);
        if rows <= per {
            return vec![rows];
        }
        (0..rows.div_ceil(per))
            .map(|j| per.min(rows - j * per))
            .collect()
    }

    /// A `[rows, cols]` activation in parts, for kernels to write every element of.
    pub(crate) fn alloc_rows(&self, rows: usize, cols: usize) -> GpuRows {
        GpuRows {
            parts: self
                .part_sizes(rows)
                .into_iter()
                .map(|n| self.alloc(n, cols))
                .collect(),
            rows,
            cols,
        }
    }

    /// `x` cut as [`Self::part_sizes`] cuts its rows: `x` itself, as every activation the
    /// ops make is; a copy only for one made before the part rows changed.
    pub(crate) fn uniform<'a>(&self, x: &'a GpuRows) -> Result<Cow<'a, GpuRows>> {
        let one_fits = x.parts.len() == 1 && x.rows <= self.part_rows;
        if one_fits || x.part_sizes() == self.part_sizes(x.rows) {
            return Ok(Cow::Borrowed(x));
        }
        let out = self.alloc_rows(x.rows, x.cols);
        self.copy_rows(x, 0, &out, 0, x.rows)?;
        Ok(Cow::Owned(out))
    }

    /// Every row of `x` in one buffer, for an op that needs the whole window in one
    /// binding (the routed experts): its part when it has one, else a copy of the parts.
    pub(crate) fn joined<'a>(&self, x: &'a GpuRows, op: &str) -> Result<Cow<'a, GpuAct>> {
        if let [one] = x.parts.as_slice() {
            return Ok(Cow::Borrowed(one));
        }
        let bytes = (x.rows * x.cols * 4) as u64;
        ensure!(
            bytes <= self.ctx.max_binding,
            "{op}: {} rows of {} values exceed the adapter's binding limit of {} B \
             (the prefill window bounds a pass's rows)",
            x.rows,
            x.cols,
            self.ctx.max_binding
        );
        let out = GpuRows::one(self.alloc(x.rows, x.cols));
        self.copy_rows(x, 0, &out, 0, x.rows)?;
        out.parts
            .into_iter()
            .next()
            .map(Cow::Owned)
            .ok_or_else(|| anyhow!("internal: {op}: a joined activation has no part"))
    }

    /// Copies `count` rows from row `from` of `src` to row `to` of `dst` (both of one
    /// width): one buffer copy for each stretch within one part of each.
    pub(crate) fn copy_rows(
        &self,
        src: &GpuRows,
        from: usize,
        dst: &GpuRows,
        to: usize,
        count: usize,
    ) -> Result<()> {
        ensure!(
            src.cols == dst.cols && from + count <= src.rows && to + count <= dst.rows,
            "internal: a copy of rows {from}..{} of a {}x{} activation to rows {to}.. of a {}x{} one",
            from + count,
            src.rows,
            src.cols,
            dst.rows,
            dst.cols
        );
        let row = (src.cols * 4) as u64;
        let (mut si, mut so) = (0, from);
        let (mut di, mut d_off) = (0, to);
        let mut left = count;
        while left > 0 {
            let (s, d) = match (src.parts.get(si), dst.parts.get(di)) {
                (Some(s), Some(d)) => (s, d),
                _ => anyhow::bail!("internal: a row copy ran past an activation's parts"),
            };
            if so >= s.rows {
                so -= s.rows;
                si += 1;
                continue;
            }
            if d_off >= d.rows {
                d_off -= d.rows;
                di += 1;
                continue;
            }
            let n = left.min(s.rows - so).min(d.rows - d_off);
            self.ctx.copy(
                &s.buf,
                so as u64 * row,
                &d.buf,
                d_off as u64 * row,
                n as u64 * row,
            );
            so += n;
            d_off += n;
            left -= n;
        }
        Ok(())
    }
}

/// The one part of an activation an op reads whole (a weight): an error naming `what`
/// when it has several.
pub(crate) fn whole<'a>(x: &'a GpuRows, op: &str, what: &str) -> Result<&'a GpuAct> {
    match x.parts.as_slice() {
        [one] => Ok(one),
        parts => Err(anyhow!(
            "{op}: {what} ({}x{}) is in {} row parts; a weight is read whole",
            x.rows,
            x.cols,
            parts.len()
        )),
    }
}

/// The parts of one op's outputs, in row order, as one activation of `cols` columns.
pub(crate) fn rows_of(parts: Vec<GpuAct>, cols: usize) -> GpuRows {
    GpuRows {
        rows: parts.iter().map(|p| p.rows).sum(),
        cols,
        parts,
    }
}
