//! One routed expert's six MXFP4 tensors in memory, wherever the read put them.

use super::LentRegion;

use crate::config::Config;
use crate::platform::aligned_buf::AlignedBuf;
use crate::quant::Mxfp4View;
use crate::routed_expert::{ExpertPayload, ExpertWeights, StagedExpert};
use anyhow::{anyhow, Context, Result};
use std::ops::Range;

/// One expert's bytes and where each of its six tensors lies in them.
pub struct LoadedExpert {
    /// The expert's id within its layer.
    pub id: u32,
    buf: ExpertBytes,
    parts: [Range<usize>; 6],
}

/// Host-visible memory a backend hands over with an expert's bytes in it (a mapped
/// readback of its VRAM tier), read where it is: the expert needs no copy of its own.
pub trait HostBytes: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

/// Where a loaded expert's bytes are.
pub enum ExpertBytes {
    /// Host memory of our own.
    Host(AlignedBuf),
    /// A region the backend lent (its upload staging), handed to it as it is.
    Lent(Box<dyn LentRegion>),
    /// Host memory the backend handed over, read in place.
    Handed(Box<dyn HostBytes>),
}

impl ExpertBytes {
    /// The bytes while the host can still see them: our memory, the memory handed over, or
    /// a lent region before its backend takes it.
    pub fn host_view(&mut self) -> &[u8] {
        match self {
            ExpertBytes::Host(b) => b,
            ExpertBytes::Handed(h) => h.bytes(),
            ExpertBytes::Lent(r) => r.bytes_mut(),
        }
    }
}

impl LoadedExpert {
    /// An expert of id `id` whose six tensors lie at `parts` of `buf` (a read's result).
    pub fn new(id: u32, buf: ExpertBytes, parts: [Range<usize>; 6]) -> Self {
        Self { id, buf, parts }
    }

    /// An expert with no bytes, for cache-policy tests.
    #[cfg(test)]
    pub(crate) fn empty(id: u32) -> Self {
        Self::new(
            id,
            ExpertBytes::Host(AlignedBuf::new(0)),
            Default::default(),
        )
    }

    /// Bytes of the six tensors.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|r| r.len()).sum()
    }

    /// True when the expert holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An expert of id `id` from its six tensors' bytes back to back in `bytes`, in the
    /// order of [`LoadedExpert::weights`] (w1 packed, w1 scales, w2 packed, w2 scales, w3
    /// packed, w3 scales) with the given lengths: bytes a backend brings back from its tier.
    pub fn from_parts(id: u32, bytes: &[u8], lens: [usize; 6]) -> Result<Self> {
        let total: usize = lens.iter().sum();
        if total != bytes.len() {
            return Err(anyhow!(
                "internal: expert {id}: {} bytes for parts of {total}",
                bytes.len()
            ));
        }
        let mut buf = AlignedBuf::new(total);
        buf.copy_from_slice(bytes);
        Ok(Self {
            id,
            buf: ExpertBytes::Host(buf),
            parts: back_to_back(lens),
        })
    }

    /// An expert of id `id` whose six tensors lie back to back in `mem`, as for
    /// [`LoadedExpert::from_parts`], kept where they are: the bytes are not copied.
    pub fn from_handed(id: u32, mem: Box<dyn HostBytes>, lens: [usize; 6]) -> Result<Self> {
        let total: usize = lens.iter().sum();
        let have = mem.bytes().len();
        if total != have {
            return Err(anyhow!(
                "internal: expert {id}: {have} bytes for parts of {total}"
            ));
        }
        Ok(Self {
            id,
            buf: ExpertBytes::Handed(mem),
            parts: back_to_back(lens),
        })
    }

    /// Where the expert's bytes are, as a backend runs it: host views of its three MXFP4
    /// matrices (gate w1, down w2, up w3), or the region the backend lent for the read.
    pub fn payload(&self, cfg: &Config) -> Result<ExpertPayload<'_>> {
        let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
        let buf: &[u8] = match &self.buf {
            ExpertBytes::Host(b) => b,
            ExpertBytes::Handed(h) => h.bytes(),
            ExpertBytes::Lent(r) => {
                return Ok(ExpertPayload::Staged(StagedExpert {
                    region: r.as_any(),
                    dims: (i, d),
                    parts: self.parts.clone().map(|p| p.start as u64..p.end as u64),
                }))
            }
        };
        let p = |k: usize| &buf[self.parts[k].clone()];
        Ok(ExpertPayload::Host(ExpertWeights {
            w1: Mxfp4View::new(i, d, p(0), p(1))
                .with_context(|| format!("expert {} w1", self.id))?,
            w2: Mxfp4View::new(d, i, p(2), p(3))
                .with_context(|| format!("expert {} w2", self.id))?,
            w3: Mxfp4View::new(i, d, p(4), p(5))
                .with_context(|| format!("expert {} w3", self.id))?,
        }))
    }

    /// The expert as the backend lent it for the read, when it was (then there are no
    /// host views of it: [`LoadedExpert::weights`] refuses).
    pub fn staged(&self, cfg: &Config) -> Option<StagedExpert<'_>> {
        match self.payload(cfg) {
            Ok(ExpertPayload::Staged(s)) => Some(s),
            _ => None,
        }
    }

    /// Views the bytes as the expert's three MXFP4 matrices (gate w1, down w2, up w3).
    pub fn weights(&self, cfg: &Config) -> Result<ExpertWeights<'_>> {
        match self.payload(cfg)? {
            ExpertPayload::Host(w) => Ok(w),
            ExpertPayload::Staged(_) | ExpertPayload::Resident => Err(anyhow!(
                "internal: expert {} was read into memory the backend lent; hand it over with payload()",
                self.id
            )),
        }
    }
}

/// The ranges of six parts of `lens` bytes lying back to back from 0.
fn back_to_back(lens: [usize; 6]) -> [Range<usize>; 6] {
    let mut at = 0;
    lens.map(|n| {
        at += n;
        at - n..at
    })
}
