//! The MoE block when other ranks own some of the routed experts (expert parallel,
//! `src/ranks/`): the head sends each owner its rows before it waits on any, runs its own
//! share meanwhile, and sums every expert's output in the canonical order, as
//! `moe_accumulate` does in one process, so CPU logits are bit-identical to it.

use super::{Moe, NextMoe};
use crate::backend::{Backend, ExpertAssignment, Glu};
use crate::checkpoint::Checkpoint;
use crate::experts::plan::expert_plan::ExpertAccess;
use crate::experts::remote::{ExpertOutputs, ExpertRows, RemoteExperts};
use crate::experts::Supplied;
use crate::routed_expert::ExpertKey;
use crate::stats::Stats;
use anyhow::{anyhow, ensure, Result};
use std::cell::OnceCell;
use std::collections::BTreeMap;

/// One expert's output on the rows `rows` of the host latent `z` (`cols` values a row):
/// `W2·glu(W1·z, W3·z)` unweighted, `rows.len() × cols` values in `rows`' order. It runs
/// `moe_accumulate` on those rows alone with weight 1 into zeros, so each value is the one
/// a single process adds, times its routing weight, into the layer's sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_rows<B: Backend>(
    b: &B,
    ck: &Checkpoint,
    layer: usize,
    s: &Supplied<'_>,
    z: &[f32],
    cols: usize,
    rows: &[usize],
    glu: Glu,
) -> Result<Vec<f32>> {
    let m = rows.len();
    if m == 0 {
        return Ok(Vec::new());
    }
    let mut x = Vec::with_capacity(m * cols);
    for &r in rows {
        let row = z.get(r * cols..(r + 1) * cols).ok_or_else(|| {
            anyhow!(
                "expert {} of layer {layer}: row {r} is outside the {} rows sent",
                s.id(),
                z.len() / cols.max(1)
            )
        })?;
        x.extend_from_slice(row);
    }
    let zx = b.upload(&x, m, cols)?;
    let mut acc = b.zeros(m, cols)?;
    let one = ExpertAssignment {
        key: Some(ExpertKey { layer, id: s.id() }),
        payload: s.payload(&ck.config)?,
        tokens: (0..m).map(|j| (j, 1.0)).collect(),
    };
    b.moe_accumulate(&mut acc, &zx, &[one], glu)?;
    b.download(&acc)
}

impl<B: Backend> Moe<B> {
    /// [`Moe::forward`] with the experts `remote` says other ranks own computed there.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_ranked(
        &self,
        b: &B,
        ex: ExpertAccess<'_>,
        remote: &dyn RemoteExperts,
        x: &B::Act,
        glu: Glu,
        next: Option<NextMoe<'_, B>>,
        stats: &mut Stats,
    ) -> Result<B::Act> {
        // The latent rows go to the other ranks before any read starts, so nothing runs
        // behind the router.
        let plan = self.route(b, ex, x, stats, &mut || Ok(()))?;
        let (ck, cols) = (ex.ck, self.latent);
        let (rows, _) = b.shape(x);
        // The other ranks need the latent rows first, so it runs before any read starts.
        let z = b.download(&b.matmul(&self.down, x)?)?;
        let rows_of = |id: u32| -> Vec<usize> {
            plan.rows
                .get(&id)
                .map(|r| r.iter().map(|&(t, _)| t).collect())
                .unwrap_or_default()
        };
        let (mut own, mut own_resident) = (Vec::new(), Vec::new());
        let mut work: BTreeMap<usize, Vec<ExpertRows>> = BTreeMap::new();
        for (k, &id) in plan.ids.iter().enumerate() {
            match remote.owner(self.layer, id) {
                0 => {
                    own.push(id);
                    own_resident.push(plan.resident.get(k).copied().unwrap_or(false));
                }
                r => work.entry(r).or_default().push(ExpertRows {
                    id,
                    rows: rows_of(id),
                }),
            }
        }
        let work: Vec<(usize, Vec<ExpertRows>)> = work.into_iter().collect();
        remote.send(self.layer, &z, cols, &work)?;
        let shared = OnceCell::new();
        let mut guess_stats = Stats::default();
        let mut prework = || -> Result<()> {
            if let Some(n) = &next {
                n.moe.read_ahead(b, ex, n.x, &mut guess_stats)?;
            }
            if let Some(s) = &self.shared {
                let _ = shared.set(s.forward(b, x, glu)?);
            }
            Ok(())
        };
        let mut outputs = ExpertOutputs::new();
        let mut consume = |batch: &[Supplied<'_>]| -> Result<()> {
            for s in batch {
                let y = expert_rows(b, ck, self.layer, s, &z, cols, &rows_of(s.id()), glu)?;
                outputs.insert(s.id(), y);
            }
            Ok(())
        };
        ex.source.stream(
            ck,
            self.layer,
            &own,
            &own_resident,
            stats,
            &mut prework,
            &mut consume,
        )?;
        *stats = stats.plus(&guess_stats);
        outputs.extend(remote.receive(self.layer, stats)?);
        // The sum in canonical order, each term as `moe_accumulate` forms it.
        let mut u = vec![0.0f32; rows * cols];
        for &id in &plan.ids {
            let y = outputs.get(&id).ok_or_else(|| {
                anyhow!(
                    "expert {id} of layer {}: its rank returned no rows for it",
                    self.layer
                )
            })?;
            let pairs = plan.rows.get(&id).map(Vec::as_slice).unwrap_or_default();
            ensure!(
                y.len() == pairs.len() * cols,
                "expert {id} of layer {}: {} values came back for {} rows of {cols}",
                self.layer,
                y.len(),
                pairs.len()
            );
            for (j, &(t, wt)) in pairs.iter().enumerate() {
                for (o, &v) in u[t * cols..(t + 1) * cols]
                    .iter_mut()
                    .zip(&y[j * cols..(j + 1) * cols])
                {
                    *o += wt * v;
                }
            }
        }
        let u = b.upload(&u, rows, cols)?;
        let shared = match shared.into_inner() {
            Some(s) => Some(s),
            None => self
                .shared
                .as_ref()
                .map(|s| s.forward(b, x, glu))
                .transpose()?,
        };
        self.finish(b, u, shared)
    }
}
