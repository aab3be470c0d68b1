//! The messages between the head and the other ranks, as bytes: a request carries the rows
//! of one MoE layer's latent `z` a rank needs and, per expert, which of them chose it; a
//! reply carries each expert's output rows and the rank's read counters. Little-endian
//! words; every length is checked against the bytes that came.

use crate::experts::remote::ExpertRows;
use anyhow::{anyhow, bail, ensure, Result};

/// What the head asks of a rank.
#[derive(Debug, PartialEq)]
pub enum Request {
    /// Run `experts` of MoE layer `layer` on `z` (`rows × cols` values; the experts' rows
    /// index into it).
    Work {
        /// The MoE layer.
        layer: usize,
        /// Values a row.
        cols: usize,
        /// The rows the experts need.
        z: Vec<f32>,
        /// The experts, in canonical order.
        experts: Vec<ExpertRows>,
    },
    /// The job is over: leave the loop.
    Stop,
}

/// A rank's read counters for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCounts {
    /// Experts looked up.
    pub lookups: u64,
    /// Of them, found in a cache (host or the backend's tier).
    pub hits: u64,
    /// Bytes read from disk.
    pub bytes: u64,
    /// Nanoseconds the disk had a read in flight.
    pub busy_ns: u64,
}

/// A rank's answer to a [`Request::Work`].
#[derive(Debug, PartialEq)]
pub enum Reply {
    /// Each expert's output rows, in the request's order, and what the rank read.
    Done {
        /// `(id, rows × cols values)`.
        outputs: Vec<(u32, Vec<f32>)>,
        /// The rank's counters for this request.
        counts: ReadCounts,
    },
    /// The rank could not run the request.
    Failed(String),
}

const WORK: u32 = 1;
const STOP: u32 = 2;
const DONE: u32 = 3;
const FAILED: u32 = 4;

/// Builds the request for `experts` of `layer` from the whole layer's `z` (`cols` values a
/// row): only the rows some expert needs travel, renumbered in increasing order.
pub fn work_request(layer: usize, z: &[f32], cols: usize, experts: &[ExpertRows]) -> Vec<u8> {
    let mut used: Vec<usize> = experts
        .iter()
        .flat_map(|e| e.rows.iter().copied())
        .collect();
    used.sort_unstable();
    used.dedup();
    let mut out = Vec::new();
    put(&mut out, WORK);
    put(&mut out, layer as u32);
    put(&mut out, cols as u32);
    put(&mut out, used.len() as u32);
    put(&mut out, experts.len() as u32);
    for e in experts {
        put(&mut out, e.id);
        put(&mut out, e.rows.len() as u32);
        for r in &e.rows {
            // `used` holds every row of every expert, so the search always finds it.
            put(&mut out, used.binary_search(r).unwrap_or(0) as u32);
        }
    }
    for &r in &used {
        for v in &z[r * cols..(r + 1) * cols] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// The stop request.
pub fn stop_request() -> Vec<u8> {
    STOP.to_le_bytes().to_vec()
}

impl Request {
    /// Reads a request from `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { b: bytes, at: 0 };
        match r.u32()? {
            STOP => Ok(Request::Stop),
            WORK => {
                let layer = r.u32()? as usize;
                let cols = r.u32()? as usize;
                let rows = r.u32()? as usize;
                let n = r.u32()? as usize;
                let mut experts = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    let id = r.u32()?;
                    let m = r.u32()? as usize;
                    let mut idx = Vec::with_capacity(m.min(1 << 20));
                    for _ in 0..m {
                        let i = r.u32()? as usize;
                        ensure!(i < rows, "request: row {i} of expert {id} past {rows} rows");
                        idx.push(i);
                    }
                    experts.push(ExpertRows { id, rows: idx });
                }
                let z = r.f32s(rows * cols)?;
                r.end()?;
                Ok(Request::Work {
                    layer,
                    cols,
                    z,
                    experts,
                })
            }
            k => bail!("request: unknown kind {k}"),
        }
    }
}

impl Reply {
    /// The reply as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Reply::Done { outputs, counts } => {
                put(&mut out, DONE);
                for v in [counts.lookups, counts.hits, counts.bytes, counts.busy_ns] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                put(&mut out, outputs.len() as u32);
                for (id, y) in outputs {
                    put(&mut out, *id);
                    out.extend_from_slice(&(y.len() as u64).to_le_bytes());
                    for v in y {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
            Reply::Failed(msg) => {
                put(&mut out, FAILED);
                out.extend_from_slice(msg.as_bytes());
            }
        }
        out
    }

    /// Reads a reply from `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { b: bytes, at: 0 };
        match r.u32()? {
            DONE => {
                let counts = ReadCounts {
                    lookups: r.u64()?,
                    hits: r.u64()?,
                    bytes: r.u64()?,
                    busy_ns: r.u64()?,
                };
                let n = r.u32()? as usize;
                let mut outputs = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    let id = r.u32()?;
                    let len = usize::try_from(r.u64()?)?;
                    outputs.push((id, r.f32s(len)?));
                }
                r.end()?;
                Ok(Reply::Done { outputs, counts })
            }
            FAILED => Ok(Reply::Failed(
                String::from_utf8_lossy(&bytes[r.at..]).into_owned(),
            )),
            k => bail!("reply: unknown kind {k}"),
        }
    }
}

fn put(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// A cursor over a message's bytes.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                anyhow!(
                    "message cut short: {n} bytes wanted at byte {} of {}",
                    self.at,
                    self.b.len()
                )
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| anyhow!("message: {n} values overflow"))?;
        let s = self.take(bytes)?;
        Ok(s.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn end(&self) -> Result<()> {
        ensure!(
            self.at == self.b.len(),
            "message has {} bytes past its end",
            self.b.len() - self.at
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_carries_only_the_rows_its_experts_need() {
        let z: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let experts = vec![
            ExpertRows {
                id: 7,
                rows: vec![1, 3],
            },
            ExpertRows {
                id: 9,
                rows: vec![3],
            },
        ];
        let req = Request::decode(&work_request(4, &z, 3, &experts)).unwrap();
        let want = Request::Work {
            layer: 4,
            cols: 3,
            z: vec![3.0, 4.0, 5.0, 9.0, 10.0, 11.0],
            experts: vec![
                ExpertRows {
                    id: 7,
                    rows: vec![0, 1],
                },
                ExpertRows {
                    id: 9,
                    rows: vec![1],
                },
            ],
        };
        assert_eq!(req, want);
        assert_eq!(Request::decode(&stop_request()).unwrap(), Request::Stop);
        let cut = work_request(4, &z, 3, &experts);
        assert!(Request::decode(&cut[..cut.len() - 1]).is_err());
    }

    #[test]
    fn replies_round_trip_and_short_ones_are_refused() {
        let r = Reply::Done {
            outputs: vec![(3, vec![1.5, -0.0]), (5, vec![])],
            counts: ReadCounts {
                lookups: 2,
                hits: 1,
                bytes: 99,
                busy_ns: 7,
            },
        };
        let b = r.encode();
        assert_eq!(Reply::decode(&b).unwrap(), r);
        assert!(Reply::decode(&b[..b.len() - 2]).is_err());
        let f = Reply::Failed("shard gone".into());
        assert_eq!(Reply::decode(&f.encode()).unwrap(), f);
    }
}
