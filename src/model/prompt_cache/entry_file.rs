//! One prompt-cache entry on disk: the state at the end of a token prefix, in parts that
//! each carry their length and xxh3 checksum, so a truncated or corrupt file is refused
//! part by part before anything of it is used.
//!
//! ```text
//! "K3PROMPT" | u32 version | part: header (JSON) | part: tokens (u32) | part: logits (f32)
//!            | one part per layer (f32) ...
//! part = u64 byte length | u64 xxh3-64 of the bytes | the bytes      (all little-endian)
//! ```

use crate::model::host_state::{HostLayer, HostState};
pub use crate::model::host_state::{LayerShape, StateShape};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Read;
use xxhash_rust::xxh3::xxh3_64;

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"K3PROMPT";
/// The layout version; an entry of another is stale.
pub const VERSION: u32 = 1;
/// The header part is small; a larger one is not an entry.
const MAX_HEADER_BYTES: u64 = 1 << 20;

/// What an entry says about itself, checked against what the reader expects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// The model and settings the state was computed with ([`super::PromptCache`]'s key).
    pub model_key: u64,
    /// Tokens of the prefix.
    pub tokens: usize,
    /// Logits stored (the vocabulary).
    pub vocab: usize,
    /// Per layer: `true` for KDA, `false` for MLA, and how many values it holds.
    pub layers: Vec<(bool, usize)>,
}

/// A state with the tokens that produced it and the logits after its last token.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The prefix.
    pub tokens: Vec<u32>,
    /// Logits after its last token.
    pub logits: Vec<f32>,
    /// The state after it.
    pub state: HostState,
}

impl Entry {
    /// The header that describes this entry under `model_key`.
    pub fn header(&self, model_key: u64) -> Header {
        Header {
            model_key,
            tokens: self.tokens.len(),
            vocab: self.logits.len(),
            layers: self
                .state
                .layers
                .iter()
                .map(|l| (matches!(l, HostLayer::Kda(_)), l.values().len()))
                .collect(),
        }
    }

    /// Bytes the entry takes on disk.
    pub fn file_bytes(&self) -> u64 {
        let parts = 3 + self.state.layers.len() as u64;
        let header = serde_json::to_vec(&self.header(u64::MAX)).map_or(0, |h| h.len()) as u64;
        12 + parts * 16
            + header
            + (self.tokens.len() * 4 + self.logits.len() * 4 + self.state.bytes()) as u64
    }
}

/// Writes `e` under `model_key` to `out`.
pub fn write(out: &mut impl FnMut(&[u8]) -> Result<()>, e: &Entry, model_key: u64) -> Result<()> {
    out(MAGIC)?;
    out(&VERSION.to_le_bytes())?;
    let header = serde_json::to_vec(&e.header(model_key))?;
    part(out, &header)?;
    part(out, bytemuck::cast_slice(&e.tokens))?;
    part(out, bytemuck::cast_slice(&e.logits))?;
    for l in &e.state.layers {
        part(out, bytemuck::cast_slice(l.values()))?;
    }
    Ok(())
}

fn part(out: &mut impl FnMut(&[u8]) -> Result<()>, bytes: &[u8]) -> Result<()> {
    out(&(bytes.len() as u64).to_le_bytes())?;
    out(&xxh3_64(bytes).to_le_bytes())?;
    out(bytes)
}

/// Why an entry was refused.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    /// Written by another layout version, model or settings, or for other tokens.
    #[error("stale: {0}")]
    Stale(String),
    /// The file ends early.
    #[error("truncated: {0}")]
    Truncated(String),
    /// A part's checksum or shape is wrong.
    #[error("corrupt: {0}")]
    Corrupt(String),
}

/// Reads `len` bytes of part `what`, or says the file ends early.
fn read_exact(r: &mut impl Read, len: u64, what: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let got = r
        .by_ref()
        .take(len)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading the {what}"))?;
    if (got as u64) < len {
        bail!(EntryError::Truncated(format!(
            "the {what} has {got} of its {len} bytes"
        )));
    }
    Ok(buf)
}

/// One part: its length (at most `max`), checksum and bytes, checked.
fn read_part(r: &mut impl Read, what: &str, max: u64) -> Result<Vec<u8>> {
    let head = read_exact(r, 16, &format!("{what}'s length and checksum"))?;
    let len = u64::from_le_bytes(head[..8].try_into()?);
    let sum = u64::from_le_bytes(head[8..].try_into()?);
    if len > max {
        bail!(EntryError::Corrupt(format!(
            "the {what} claims {len} bytes, more than the {max} expected"
        )));
    }
    let bytes = read_exact(r, len, what)?;
    if xxh3_64(&bytes) != sum {
        bail!(EntryError::Corrupt(format!(
            "the {what}'s checksum does not match"
        )));
    }
    Ok(bytes)
}

/// The header of an entry, checked against `model_key` and the token count its name gives.
pub fn read_header(r: &mut impl Read, model_key: u64, tokens: usize) -> Result<Header> {
    let start = read_exact(r, 12, "file header")?;
    if &start[..8] != MAGIC {
        bail!(EntryError::Corrupt("not a k3 prompt-cache entry".into()));
    }
    let version = u32::from_le_bytes(start[8..12].try_into()?);
    if version != VERSION {
        bail!(EntryError::Stale(format!(
            "written by entry layout {version} (this k3 uses {VERSION})"
        )));
    }
    let raw = read_part(r, "header", MAX_HEADER_BYTES)?;
    let h: Header = serde_json::from_slice(&raw)
        .map_err(|e| EntryError::Corrupt(format!("the header is not valid: {e}")))?;
    if h.model_key != model_key {
        bail!(EntryError::Stale(format!(
            "written for model key {:016x}, this model and its settings are {model_key:016x}",
            h.model_key
        )));
    }
    if h.tokens != tokens {
        bail!(EntryError::Corrupt(format!(
            "the header says {} tokens, the file name {tokens}",
            h.tokens
        )));
    }
    Ok(h)
}

/// Checks the header `h` against `shape`, the model's own, before any part is read: the
/// vocabulary and every layer's kind and size must be the model's. An entry that checks
/// out against its key yet not against the model was made by other code or edited.
pub fn check_shape(h: &Header, shape: &StateShape) -> Result<()> {
    if h.vocab != shape.vocab {
        bail!(EntryError::Corrupt(format!(
            "the header says a vocabulary of {}, the model's is {}",
            h.vocab, shape.vocab
        )));
    }
    if h.layers.len() != shape.layers.len() {
        bail!(EntryError::Corrupt(format!(
            "the header lists {} layers, the model has {}",
            h.layers.len(),
            shape.layers.len()
        )));
    }
    for (i, (&(kda, n), want)) in h.layers.iter().zip(&shape.layers).enumerate() {
        let fits = match *want {
            LayerShape::Kda(values) => kda && n == values,
            LayerShape::Mla(row) => !kda && Some(n) == h.tokens.checked_mul(row),
        };
        if !fits {
            let (kind, expected) = match *want {
                LayerShape::Kda(values) => ("KDA", values),
                LayerShape::Mla(row) => ("MLA", h.tokens.saturating_mul(row)),
            };
            let found = if kda { "KDA" } else { "MLA" };
            bail!(EntryError::Corrupt(format!(
                "the header's layer {i} is a {found} state of {n} values; the model's is a \
                 {kind} state of {expected}"
            )));
        }
    }
    Ok(())
}

/// Bytes of `n` f32 or u32 values, or why the header cannot be right.
fn bytes_of(n: usize, what: &str) -> Result<u64> {
    n.checked_mul(4)
        .map(|b| b as u64)
        .ok_or_else(|| EntryError::Corrupt(format!("the {what} claims {n} values")).into())
}

/// Refuses values that are not finite: a stored state is one a run reached, and a run
/// stops at the first NaN or infinity, so such an entry was damaged after its checksums.
fn check_finite(v: &[f32], what: &str) -> Result<()> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!(EntryError::Corrupt(format!(
            "the {what} holds {} at value {i}",
            v[i]
        )));
    }
    Ok(())
}

/// Reads a whole entry whose header was `h`, checking each part and that its tokens are
/// `want` (the prefix the reader is about to skip).
pub fn read_body(r: &mut impl Read, h: &Header, want: &[u32]) -> Result<Entry> {
    let raw = read_part(r, "token part", bytes_of(h.tokens, "token part")?)?;
    ensure!(
        raw.len() == h.tokens * 4,
        EntryError::Corrupt(format!("the token part holds {} bytes", raw.len()))
    );
    let tokens: Vec<u32> = bytemuck::pod_collect_to_vec(&raw);
    if tokens != want {
        bail!(EntryError::Stale(
            "its tokens differ from the prompt's (a name collision)".into()
        ));
    }
    let raw = read_part(r, "logit part", bytes_of(h.vocab, "logit part")?)?;
    ensure!(
        raw.len() as u64 == bytes_of(h.vocab, "logit part")?,
        EntryError::Corrupt(format!("the logit part holds {} bytes", raw.len()))
    );
    let logits: Vec<f32> = bytemuck::pod_collect_to_vec(&raw);
    check_finite(&logits, "logit part")?;
    let mut layers = Vec::with_capacity(h.layers.len());
    for (i, &(kda, n)) in h.layers.iter().enumerate() {
        let what = format!("layer {i} part");
        let raw = read_part(r, &what, bytes_of(n, &what)?)?;
        ensure!(
            raw.len() as u64 == bytes_of(n, &what)?,
            EntryError::Corrupt(format!("the layer {i} part holds {} bytes", raw.len()))
        );
        let v: Vec<f32> = bytemuck::pod_collect_to_vec(&raw);
        check_finite(&v, &what)?;
        layers.push(if kda {
            HostLayer::Kda(v)
        } else {
            HostLayer::Mla(v)
        });
    }
    let mut rest = [0u8; 1];
    if r.read(&mut rest).context("reading past the last part")? != 0 {
        bail!(EntryError::Corrupt("bytes follow the last part".into()));
    }
    Ok(Entry {
        tokens,
        logits,
        state: HostState {
            pos: h.tokens,
            layers,
        },
    })
}
