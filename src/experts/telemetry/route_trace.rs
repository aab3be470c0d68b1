//! Routing traces (`--route-trace FILE`, `K3_ROUTE_TRACE`) and the routing tap that records
//! them and the usage history's counts during a run.
//!
//! A trace is JSON lines. The first line is a [`TraceHeader`]; every other line is a
//! [`TraceRecord`]: the routes of one MoE layer for one chunk (the tokens of one forward
//! pass), in the order the engine ran them, so a replay sees the same lookups in the same
//! order:
//!
//! ```text
//! {"format":"k3-route-trace","version":1,"layers":4,"moe_layers":[1,2,3],"experts":32,"top_k":4,"expert_bytes":8448,"source":"..."}
//! {"pos":0,"layer":1,"load":[3,9,17],"experts":[[9,3],[17,3]],"weights":[[0.6,0.4],[0.5,0.5]]}
//! ```
//!
//! `pos` is the context position of the chunk's first token; `experts[r]` / `weights[r]`
//! are token `pos + r`'s experts and routing weights (after `--expert-top-p`); `load` is the
//! chunk's distinct experts in the order the engine looks them up and reads them (shard and
//! offset order). Experts that `--skip-uncached-below` then leaves out are still listed.

use crate::atomic_file::AtomicFile;
use crate::platform::input_file::{self, FileKind};
use crate::routed_expert::Route;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The `format` field of a trace's header.
pub const TRACE_FORMAT: &str = "k3-route-trace";
/// The trace version this build reads and writes.
pub const TRACE_VERSION: u32 = 1;

/// First line of a trace: what model the routes come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// [`TRACE_VERSION`].
    pub version: u32,
    /// Layers of the model.
    pub layers: usize,
    /// Which layers are MoE layers.
    pub moe_layers: Vec<usize>,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token routes to.
    pub top_k: usize,
    /// Bytes of one expert (one cache slot).
    pub expert_bytes: u64,
    /// Where the routes come from: a snapshot path or the synthetic model's parameters.
    pub source: String,
}

impl TraceHeader {
    /// A header of the current format and version.
    pub fn new(
        layers: usize,
        moe_layers: Vec<usize>,
        experts: usize,
        top_k: usize,
        expert_bytes: u64,
        source: String,
    ) -> Self {
        Self {
            format: TRACE_FORMAT.into(),
            version: TRACE_VERSION,
            layers,
            moe_layers,
            experts,
            top_k,
            expert_bytes,
            source,
        }
    }
}

/// The routes of one MoE layer for one chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Context position of the chunk's first token.
    pub pos: usize,
    /// The MoE layer.
    pub layer: usize,
    /// The chunk's distinct experts in lookup (load) order.
    pub load: Vec<u32>,
    /// Each token's experts.
    pub experts: Vec<Vec<u32>>,
    /// Each token's routing weights, matching `experts`.
    pub weights: Vec<Vec<f32>>,
}

/// A whole trace: a header and its records in run order.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteTrace {
    /// What model the routes come from.
    pub header: TraceHeader,
    /// The records, in the order the engine ran them.
    pub records: Vec<TraceRecord>,
}

impl RouteTrace {
    /// An empty trace for `header`.
    pub fn new(header: TraceHeader) -> Self {
        Self {
            header,
            records: Vec::new(),
        }
    }

    /// Tokens the trace covers: the rows of every chunk, counted at its first MoE layer.
    pub fn tokens(&self) -> usize {
        let first = self.header.moe_layers.first().copied();
        self.records
            .iter()
            .filter(|r| Some(r.layer) == first)
            .map(|r| r.experts.len())
            .sum()
    }

    /// Writes the trace to `path` (JSON lines; an output a user names: through a
    /// temporary file, or in place into a FIFO, a device or `-`).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut f = AtomicFile::output(path)?;
        let mut line = serde_json::to_vec(&self.header)?;
        line.push(b'\n');
        f.write_all(&line)?;
        for r in &self.records {
            let mut line = serde_json::to_vec(r)?;
            line.push(b'\n');
            f.write_all(&line)?;
        }
        f.commit()
            .with_context(|| format!("writing route trace {}", path.display()))?;
        Ok(())
    }

    /// Reads and checks a trace, naming the file, line and field of what is wrong.
    pub fn read(path: &Path) -> Result<Self> {
        let kind = FileKind::RouteTrace;
        let f = input_file::open(path, kind)?.file;
        // Bounded: a file that grows while it is read stops at the kind's bound.
        let mut lines = BufReader::new(f.take(kind.max_bytes())).lines();
        let first = lines
            .next()
            .transpose()
            .with_context(|| format!("reading route trace {}", path.display()))?
            .with_context(|| format!("route trace {} is empty", path.display()))?;
        let header: TraceHeader = serde_json::from_str(&first).with_context(|| {
            format!(
                "route trace {} line 1: not a {TRACE_FORMAT} header",
                path.display()
            )
        })?;
        if header.format != TRACE_FORMAT || header.version != TRACE_VERSION {
            bail!(
                "route trace {} line 1: format {:?} version {}, this build reads {TRACE_FORMAT:?} version {TRACE_VERSION}",
                path.display(),
                header.format,
                header.version
            );
        }
        if header.experts == 0 || header.experts > u32::MAX as usize || header.top_k == 0 {
            bail!(
                "route trace {} line 1: experts {} and top_k {} must be at least 1",
                path.display(),
                header.experts,
                header.top_k
            );
        }
        if let Some(&l) = header.moe_layers.iter().find(|&&l| l >= header.layers) {
            bail!(
                "route trace {} line 1: MoE layer {l} is beyond the {} layers",
                path.display(),
                header.layers
            );
        }
        let mut records = Vec::new();
        for (i, line) in lines.enumerate() {
            let n = i + 2;
            let line = line.with_context(|| format!("reading route trace {}", path.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            let r: TraceRecord = serde_json::from_str(&line)
                .with_context(|| format!("route trace {} line {n}", path.display()))?;
            check_record(&header, &r)
                .with_context(|| format!("route trace {} line {n}", path.display()))?;
            records.push(r);
        }
        Ok(Self { header, records })
    }
}

fn check_record(h: &TraceHeader, r: &TraceRecord) -> Result<()> {
    if !h.moe_layers.contains(&r.layer) {
        bail!("field layer: {} is not a MoE layer of the header", r.layer);
    }
    if r.experts.len() != r.weights.len() {
        bail!(
            "fields experts and weights: {} token rows against {}",
            r.experts.len(),
            r.weights.len()
        );
    }
    for (row, (e, w)) in r.experts.iter().zip(&r.weights).enumerate() {
        if e.len() != w.len() {
            bail!(
                "token {}: {} experts against {} weights",
                r.pos + row,
                e.len(),
                w.len()
            );
        }
        if let Some(&x) = e.iter().find(|&&x| x as usize >= h.experts) {
            bail!(
                "field experts: expert {x} of token {} is beyond the {} experts",
                r.pos + row,
                h.experts
            );
        }
    }
    if let Some(&x) = r.load.iter().find(|&&x| x as usize >= h.experts) {
        bail!("field load: expert {x} is beyond the {} experts", h.experts);
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(&x) = r.load.iter().find(|&&x| !seen.insert(x)) {
        bail!("field load: expert {x} is listed twice");
    }
    if r.experts.iter().flatten().any(|x| !seen.contains(x)) {
        bail!("field load: does not list every expert the tokens route to");
    }
    Ok(())
}

/// Records what the MoE layers route during a run: a trace (`--route-trace`) and the
/// per-expert selection counts the usage history learns from. Shared by every layer through
/// the expert source, so it locks once per layer and chunk.
pub struct RouteTap {
    inner: Mutex<TapState>,
}

struct TapState {
    pos: usize,
    trace: Option<(PathBuf, RouteTrace)>,
    /// Selections per (layer, expert), `layers × experts`.
    usage: Vec<f64>,
    experts: usize,
}

impl RouteTap {
    /// A tap for a model of `header`'s shape, recording a trace into `trace` when given.
    pub fn new(header: TraceHeader, trace: Option<PathBuf>) -> Self {
        let experts = header.experts;
        let usage = vec![0.0; header.layers * experts];
        Self {
            inner: Mutex::new(TapState {
                pos: 0,
                trace: trace.map(|p| (p, RouteTrace::new(header))),
                usage,
                experts,
            }),
        }
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, TapState>> {
        self.inner
            .lock()
            .map_err(|_| anyhow::anyhow!("route tap poisoned"))
    }

    /// A forward pass over tokens from context position `pos` begins.
    pub fn begin_chunk(&self, pos: usize) -> Result<()> {
        self.state()?.pos = pos;
        Ok(())
    }

    /// `layer` routed `routes` (one per token of the chunk) and will look up `load`.
    pub fn record(&self, layer: usize, routes: &[Route], load: &[u32]) -> Result<()> {
        let mut st = self.state()?;
        let experts = st.experts;
        for &(e, _) in routes.iter().flatten() {
            if let Some(c) = st.usage.get_mut(layer * experts + e as usize) {
                *c += 1.0;
            }
        }
        let pos = st.pos;
        if let Some((_, t)) = &mut st.trace {
            t.records.push(TraceRecord {
                pos,
                layer,
                load: load.to_vec(),
                experts: routes
                    .iter()
                    .map(|r| r.iter().map(|&(e, _)| e).collect())
                    .collect(),
                weights: routes
                    .iter()
                    .map(|r| r.iter().map(|&(_, w)| w).collect())
                    .collect(),
            });
        }
        Ok(())
    }

    /// Whether the tap records a trace (`--route-trace`), whose records carry the context
    /// position of the pass that made them.
    pub fn records_trace(&self) -> Result<bool> {
        Ok(self.state()?.trace.is_some())
    }

    /// Selections per (layer, expert) so far, `layers × experts` row-major.
    pub fn usage(&self) -> Result<Vec<f64>> {
        Ok(self.state()?.usage.clone())
    }

    /// Writes the trace, when one is recorded; returns its path and record count.
    pub fn write_trace(&self) -> Result<Option<(PathBuf, usize)>> {
        let st = self.state()?;
        match &st.trace {
            Some((path, t)) => {
                t.write(path)?;
                Ok(Some((path.clone(), t.records.len())))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> TraceHeader {
        TraceHeader::new(3, vec![1, 2], 8, 2, 100, "test".into())
    }

    #[test]
    fn tap_records_round_trip_through_a_file() {
        let dir = std::env::temp_dir().join(format!("k3-route-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let tap = RouteTap::new(header(), Some(path.clone()));
        tap.begin_chunk(0).unwrap();
        let routes = vec![vec![(3, 0.75), (1, 0.25)], vec![(1, 0.5), (7, 0.5)]];
        tap.record(1, &routes, &[1, 3, 7]).unwrap();
        tap.record(2, &routes[..1], &[3, 1]).unwrap();
        tap.begin_chunk(2).unwrap();
        tap.record(1, &routes[1..], &[1, 7]).unwrap();
        assert_eq!(tap.write_trace().unwrap(), Some((path.clone(), 3)));
        let t = RouteTrace::read(&path).unwrap();
        assert_eq!(t.records.len(), 3);
        assert_eq!(t.records[2].pos, 2);
        assert_eq!(t.records[0].experts, vec![vec![3, 1], vec![1, 7]]);
        assert_eq!(t.records[0].weights[0], vec![0.75, 0.25]);
        assert_eq!(t.tokens(), 3);
        let u = tap.usage().unwrap();
        assert_eq!(u[8 + 1], 3.0, "layer 1 expert 1: three selections");
        assert_eq!(u[2 * 8 + 3], 1.0);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_traces_name_file_line_and_field() {
        let dir = std::env::temp_dir().join(format!("k3-route-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let h = serde_json::to_string(&header()).unwrap();
        let cases = [
            ("", "is empty"),
            ("{\"format\":1}", "line 1: not a k3-route-trace header"),
            (
                &h.replace("\"version\":1", "\"version\":9"),
                "version 9, this build reads",
            ),
            (
                &format!("{h}\n{{\"pos\":0,\"layer\":0,\"load\":[],\"experts\":[],\"weights\":[]}}"),
                "line 2: field layer: 0 is not a MoE layer",
            ),
            (
                &format!("{h}\n{{\"pos\":0,\"layer\":1,\"load\":[9],\"experts\":[[9]],\"weights\":[[1.0]]}}"),
                "expert 9 of token 0 is beyond the 8 experts",
            ),
            (
                &format!("{h}\n{{\"pos\":0,\"layer\":1,\"load\":[2],\"experts\":[[3]],\"weights\":[[1.0]]}}"),
                "does not list every expert",
            ),
            (
                &format!("{h}\n{{\"pos\":0,\"layer\":1,\"load\":[3],\"experts\":[[3]],\"weights\":[]}}"),
                "1 token rows against 0",
            ),
        ];
        for (i, (text, want)) in cases.iter().enumerate() {
            let p = dir.join(format!("bad{i}.jsonl"));
            std::fs::write(&p, text).unwrap();
            let e = format!("{:#}", RouteTrace::read(&p).unwrap_err());
            assert!(
                e.contains(want) && e.contains(&*p.to_string_lossy()),
                "case {i}: {e}"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
