//! The usage history behind pinned experts (`--usage-pins`, `K3_USAGE_PINS`): how often each
//! routed expert of each layer was selected over earlier runs of a model, kept in a file,
//! decayed as new runs add to it. At start the heaviest experts of each layer are pinned
//! (never evicted once read), at most half the layer's slots, fewer while the history is
//! short; at the end the run's selections are merged in and the file rewritten, unless the
//! history is read-only (for A/B runs that must not teach the cache they measure).
//!
//! File layout (little-endian): magic `K3USAGE\0`, u32 version, u32 layers, u32 experts,
//! f64 selections per layer in total, then `layers × experts` f32 decayed counts, then the
//! FNV-1a 64-bit hash of every byte before it.

use crate::atomic_file::write_atomically;
use crate::platform::input_file::{self, FileKind};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"K3USAGE\0";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 4 + 4 + 8;

/// Selections of one layer after which its old counts weigh half: a run adds its counts
/// and the history's existing counts are scaled by 2^(-added / this).
pub const HALF_LIFE_SELECTIONS: f64 = 200_000.0;
/// Selections of a layer per expert below which it gets no pins (too little history).
pub const MIN_SELECTIONS_PER_EXPERT: f64 = 4.0;
/// Selections of a layer per expert from which it gets its full quota of pins.
pub const FULL_SELECTIONS_PER_EXPERT: f64 = 64.0;

/// What the usage pins do in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PinMode {
    /// No history is read or written.
    #[default]
    Off,
    /// Pins from the history, and this run's selections merged back into it.
    On,
    /// Pins from the history; the file is left as it was.
    ReadOnly,
}

impl std::str::FromStr for PinMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" => Ok(PinMode::Off),
            "on" | "1" => Ok(PinMode::On),
            "read-only" | "ro" => Ok(PinMode::ReadOnly),
            _ => bail!("unknown usage-pins mode {s:?}: expected off, on or read-only"),
        }
    }
}

/// Decayed selection counts per (layer, expert) of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct UsageHistory {
    layers: usize,
    experts: usize,
    /// Decayed selections per layer in total (the confidence of its counts).
    selections: f64,
    counts: Vec<f32>,
}

/// Where a model's history lives by default: next to its snapshot.
pub fn default_path(snapshot: &Path) -> PathBuf {
    snapshot.join(".k3_usage")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl UsageHistory {
    /// An empty history for `layers × experts`.
    pub fn empty(layers: usize, experts: usize) -> Self {
        Self {
            layers,
            experts,
            selections: 0.0,
            counts: vec![0.0; layers * experts],
        }
    }

    /// Decayed selections per layer in total.
    pub fn selections(&self) -> f64 {
        self.selections
    }

    /// The decayed count of `expert` in `layer`.
    pub fn count(&self, layer: usize, expert: u32) -> f32 {
        self.counts
            .get(layer * self.experts + expert as usize)
            .copied()
            .unwrap_or(0.0)
    }

    /// Reads the history at `path` for a model of `layers × experts`: `Ok(None)` when there
    /// is no file; an error naming the file and what is wrong when it is corrupt or belongs
    /// to another model shape (the caller reports it and starts empty).
    pub fn load(path: &Path, layers: usize, experts: usize) -> Result<Option<Self>> {
        let bytes = match input_file::read(path, FileKind::UsageHistory) {
            Ok(b) => b,
            Err(e) if input_file::is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        Self::parse(&bytes, layers, experts)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("usage history {}: {e}", path.display()))
    }

    fn parse(b: &[u8], layers: usize, experts: usize) -> Result<Self> {
        if b.len() < HEADER + 8 || &b[..8] != MAGIC {
            bail!("not a k3 usage history (no K3USAGE header)");
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let version = u32_at(8);
        if version != VERSION {
            bail!("version {version}, this build reads version {VERSION}");
        }
        let (l, e) = (u32_at(12) as usize, u32_at(16) as usize);
        if (l, e) != (layers, experts) {
            bail!("made for {l} layers x {e} experts, the model has {layers} x {experts}");
        }
        let want = HEADER + 4 * l * e + 8;
        if b.len() != want {
            bail!("{} bytes, {want} expected: cut short or padded", b.len());
        }
        let body = &b[..want - 8];
        let mut h = [0u8; 8];
        h.copy_from_slice(&b[want - 8..]);
        if u64::from_le_bytes(h) != fnv1a(body) {
            bail!("checksum mismatch: the file is damaged");
        }
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[20..28]);
        let selections = f64::from_le_bytes(s);
        let counts: Vec<f32> = body[HEADER..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if !(selections.is_finite() && selections >= 0.0)
            || counts.iter().any(|c| !(c.is_finite() && *c >= 0.0))
        {
            bail!("a count is negative or not finite");
        }
        Ok(Self {
            layers,
            experts,
            selections,
            counts,
        })
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER + 4 * self.counts.len() + 8);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.layers as u32).to_le_bytes());
        b.extend_from_slice(&(self.experts as u32).to_le_bytes());
        b.extend_from_slice(&self.selections.to_le_bytes());
        for c in &self.counts {
            b.extend_from_slice(&c.to_le_bytes());
        }
        let h = fnv1a(&b);
        b.extend_from_slice(&h.to_le_bytes());
        b
    }

    /// Writes the history to `path` (temporary file, sync, rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_atomically(path, &self.to_bytes())
    }

    /// Merges a run's selections (`layers × experts`, row-major): the old counts decay by
    /// the selections the run adds per layer, then the run's are added.
    pub fn merge(&mut self, run: &[f64]) -> Result<()> {
        if run.len() != self.counts.len() {
            bail!(
                "internal: {} usage counts for a {} x {} history",
                run.len(),
                self.layers,
                self.experts
            );
        }
        let per_layer = (0..self.layers)
            .map(|l| {
                run[l * self.experts..(l + 1) * self.experts]
                    .iter()
                    .sum::<f64>()
            })
            .fold(0.0f64, f64::max);
        let keep = (-per_layer / HALF_LIFE_SELECTIONS).exp2();
        for (c, r) in self.counts.iter_mut().zip(run) {
            *c = (*c as f64 * keep + r) as f32;
        }
        self.selections = self.selections * keep + per_layer;
        Ok(())
    }

    /// The pins of `layer` for a cache of `slots`: its most selected experts, heaviest first,
    /// at most `slots / 2`; none below [`MIN_SELECTIONS_PER_EXPERT`] of history per expert,
    /// the full quota from [`FULL_SELECTIONS_PER_EXPERT`]. Only experts selected more than
    /// the layer's mean are candidates.
    pub fn pins(&self, layer: usize, slots: usize) -> Vec<u32> {
        if layer >= self.layers || self.experts == 0 {
            return Vec::new();
        }
        let row = &self.counts[layer * self.experts..(layer + 1) * self.experts];
        let total: f64 = row.iter().map(|&c| c as f64).sum();
        let per_expert = total / self.experts as f64;
        if per_expert < MIN_SELECTIONS_PER_EXPERT {
            return Vec::new();
        }
        let confidence = ((per_expert - MIN_SELECTIONS_PER_EXPERT)
            / (FULL_SELECTIONS_PER_EXPERT - MIN_SELECTIONS_PER_EXPERT))
            .clamp(0.0, 1.0);
        let quota = ((slots / 2) as f64 * confidence).floor() as usize;
        let mut order: Vec<u32> = (0..self.experts as u32)
            .filter(|&e| row[e as usize] as f64 > per_expert)
            .collect();
        // Heaviest first; ties by id, so the pins do not depend on the sort.
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        order.truncate(quota);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skewed(layers: usize, experts: usize, per_layer: f64) -> Vec<f64> {
        // Expert e of every layer selected in proportion to e + 1.
        let w: f64 = (1..=experts).map(|e| e as f64).sum();
        (0..layers * experts)
            .map(|i| per_layer * ((i % experts) + 1) as f64 / w)
            .collect()
    }

    #[test]
    fn round_trip_and_pins_heaviest_first_capped_at_half() {
        let mut h = UsageHistory::empty(2, 16);
        h.merge(&skewed(2, 16, 16.0 * 100.0)).unwrap();
        let back = UsageHistory::parse(&h.to_bytes(), 2, 16).unwrap();
        assert_eq!(back, h);
        assert_eq!(h.pins(1, 8), vec![15, 14, 13, 12], "half of 8 slots");
        assert_eq!(h.pins(0, 1), Vec::<u32>::new(), "half of one slot is none");
        assert!(h.pins(5, 8).is_empty(), "no such layer");
    }

    #[test]
    fn short_history_pins_nothing_then_grows_its_quota() {
        let mut h = UsageHistory::empty(1, 16);
        h.merge(&skewed(1, 16, 16.0 * 3.0)).unwrap();
        assert!(h.pins(0, 8).is_empty(), "3 selections an expert is too few");
        h.merge(&skewed(1, 16, 16.0 * 31.0)).unwrap();
        let n = h.pins(0, 8).len();
        assert!(n > 0 && n < 4, "partial confidence: {n}");
    }

    #[test]
    fn merging_decays_old_counts() {
        let mut h = UsageHistory::empty(1, 2);
        h.merge(&[HALF_LIFE_SELECTIONS, 0.0]).unwrap();
        h.merge(&[0.0, HALF_LIFE_SELECTIONS]).unwrap();
        assert!((h.count(0, 0) as f64 - HALF_LIFE_SELECTIONS / 2.0).abs() < 1.0);
        assert!((h.count(0, 1) as f64 - HALF_LIFE_SELECTIONS).abs() < 1.0);
        assert!(h.merge(&[1.0]).is_err(), "shape is checked");
    }

    #[test]
    fn corrupt_files_are_refused_with_the_reason() {
        let mut h = UsageHistory::empty(2, 4);
        h.merge(&[1.0; 8]).unwrap();
        let good = h.to_bytes();
        let mut flipped = good.clone();
        flipped[HEADER + 3] ^= 0x40;
        let mut bad_version = good.clone();
        bad_version[8] = 7;
        let cases: [(&[u8], usize, usize, &str); 5] = [
            (b"hello", 2, 4, "no K3USAGE header"),
            (&good[..good.len() - 3], 2, 4, "cut short"),
            (&flipped, 2, 4, "checksum mismatch"),
            (&bad_version, 2, 4, "version 7"),
            (&good, 3, 4, "made for 2 layers x 4 experts"),
        ];
        for (bytes, l, e, want) in cases {
            let err = UsageHistory::parse(bytes, l, e).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        let dir = std::env::temp_dir().join(format!("k3-usage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("u");
        assert_eq!(UsageHistory::load(&p, 2, 4).unwrap(), None, "no file: none");
        std::fs::write(&p, b"garbage").unwrap();
        let err = UsageHistory::load(&p, 2, 4).unwrap_err().to_string();
        assert!(err.contains(&*p.to_string_lossy()), "{err}");
        h.save(&p).unwrap();
        assert_eq!(UsageHistory::load(&p, 2, 4).unwrap(), Some(h));
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!("read-only".parse::<PinMode>().unwrap(), PinMode::ReadOnly);
        assert!("sometimes".parse::<PinMode>().is_err());
    }
}
