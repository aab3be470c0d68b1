//! Where the bytes of an expert the MoE uploads come from: host views (a cache slot or a
//! read buffer), written through wgpu's staging, or a staging buffer lent to the read
//! (`read_staging.rs`), copied on the device.

use crate::backend::gpu::device::read_staging::LentStaging;
use crate::backend::gpu::GpuBackend;
use crate::quant::Mxfp4View;
use crate::routed_expert::{ExpertWeights, StagedExpert};
use anyhow::{anyhow, ensure, Result};
use rayon::prelude::*;

/// Columns per MXFP4 scale block.
const BLOCK: usize = 32;

/// One tensor's bytes.
#[derive(Clone, Copy)]
pub(in crate::backend::gpu) enum PartSrc<'a> {
    /// In host memory.
    Host(&'a [u8]),
    /// `len` bytes at `offset` of a lent staging buffer; `huge` unless its expert's scales
    /// were scanned while mapped and none exceeds [`FAST_SCALE_MAX`].
    Device {
        buf: &'a wgpu::Buffer,
        offset: u64,
        len: u64,
        huge: bool,
    },
}

impl PartSrc<'_> {
    /// Bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            PartSrc::Host(b) => b.len() as u64,
            PartSrc::Device { len, .. } => *len,
        }
    }
}

/// One MXFP4 matrix's packed nibbles and scale bytes.
#[derive(Clone, Copy)]
pub(in crate::backend::gpu) struct MatSrc<'a> {
    /// Packed E2M1 nibbles.
    pub packed: PartSrc<'a>,
    /// E8M0 scale bytes.
    pub scales: PartSrc<'a>,
}

impl<'a> From<Mxfp4View<'a>> for MatSrc<'a> {
    fn from(m: Mxfp4View<'a>) -> Self {
        Self {
            packed: PartSrc::Host(m.packed),
            scales: PartSrc::Host(m.scales),
        }
    }
}

/// The largest E8M0 scale byte the MXFP4 kernel's fast path takes exactly; a matrix with a
/// larger one needs the per-element path (`SPECIAL` in matvec_mxfp4.wgsl).
pub(in crate::backend::gpu) const FAST_SCALE_MAX: u8 = 240;

/// Scale bytes one thread scans at a time.
const SCAN_CHUNK: usize = 64 << 10;

impl MatSrc<'_> {
    /// Whether the matrix may hold a scale above [`FAST_SCALE_MAX`]: scanned where its scale
    /// bytes are in host memory (a 17th of the matrix), as scanned in lent staging where that
    /// is readable host RAM, assumed where they are on the device.
    pub(crate) fn may_have_huge_scales(&self) -> bool {
        match self.scales {
            // Spread over threads, as the upload's copy of the same bytes is (one thread
            // scanning an expert's 1 MB of scales is host time on the read path); a maximum
            // per 64 bytes vectorizes, an early exit per byte would not.
            PartSrc::Host(b) => b.par_chunks(SCAN_CHUNK).any(|part| {
                part.chunks(64)
                    .any(|c| c.iter().fold(0u8, |m, &s| m.max(s)) > FAST_SCALE_MAX)
            }),
            PartSrc::Device { huge, .. } => huge,
        }
    }
}

/// An expert's three matrices and its `(I, D)`.
#[derive(Clone, Copy)]
pub(in crate::backend::gpu) struct ExpertSrc<'a> {
    /// Gate `[I, D]`.
    pub w1: MatSrc<'a>,
    /// Down `[D, I]`.
    pub w2: MatSrc<'a>,
    /// Up `[I, D]`.
    pub w3: MatSrc<'a>,
    /// `(I, D)`.
    pub dims: (usize, usize),
}

impl<'a> ExpertSrc<'a> {
    /// From host views, their shapes checked against one another and a latent width `d`.
    pub(crate) fn host(w: &ExpertWeights<'a>, d: usize) -> Result<Self> {
        let i = crate::backend::shape_checks::expert_shapes(w, d)?;
        for m in [w.w1, w.w2, w.w3] {
            ensure!(
                m.cols % BLOCK == 0
                    && m.packed.len() == m.rows * m.cols / 2
                    && m.scales.len() == m.rows * m.cols / BLOCK,
                "moe: an expert matrix {}x{} has {} packed / {} scale bytes",
                m.rows,
                m.cols,
                m.packed.len(),
                m.scales.len()
            );
        }
        Ok(Self {
            w1: w.w1.into(),
            w2: w.w2.into(),
            w3: w.w3.into(),
            dims: (i, d),
        })
    }

    /// From a staging buffer this backend lent to the read, its part lengths checked
    /// against its `(I, D)` and the latent width `d`. Takes the buffer for the device: the
    /// caller must submit the copies it records before the expert is dropped.
    pub(crate) fn staged(s: &StagedExpert<'a>, d: usize) -> Result<Self> {
        let lent = s.region.downcast_ref::<LentStaging>().ok_or_else(|| {
            anyhow!("internal: an expert was read into memory another backend lent")
        })?;
        let (i, sd) = s.dims;
        ensure!(
            sd == d && d % BLOCK == 0 && i % BLOCK == 0,
            "moe: a staged expert of [{i}, {sd}] does not fit latent width {d}"
        );
        let m = (i * d) as u64;
        let want = [m / 2, m / BLOCK as u64];
        for (k, r) in s.parts.iter().enumerate() {
            ensure!(
                r.end - r.start == want[k % 2],
                "moe: a staged expert's tensor {k} has {} bytes, [{i}, {d}] needs {}",
                r.end - r.start,
                want[k % 2]
            );
        }
        // Scanned before the buffer is unmapped for the device, where that is cheap.
        let scales = [1, 3, 5].map(|k| s.parts[k].clone());
        let huge = lent.any_byte_above(&scales, FAST_SCALE_MAX).unwrap_or(true);
        let (buf, lead) = lent.for_device();
        let part = |k: usize| PartSrc::Device {
            buf,
            offset: lead + s.parts[k].start,
            len: s.parts[k].end - s.parts[k].start,
            huge,
        };
        let mat = |k: usize| MatSrc {
            packed: part(k),
            scales: part(k + 1),
        };
        Ok(Self {
            w1: mat(0),
            w2: mat(2),
            w3: mat(4),
            dims: (i, d),
        })
    }

    /// Whether any of the three matrices may hold a scale above [`FAST_SCALE_MAX`].
    pub(crate) fn may_have_huge_scales(&self) -> bool {
        [self.w1, self.w2, self.w3]
            .iter()
            .any(MatSrc::may_have_huge_scales)
    }
}

/// The parts' host bytes, when every part is in host memory.
pub(in crate::backend::gpu) fn all_host<'a>(
    parts: &[(u64, PartSrc<'a>)],
) -> Option<Vec<(u64, &'a [u8])>> {
    parts
        .iter()
        .map(|&(o, p)| match p {
            PartSrc::Host(b) => Some((o, b)),
            PartSrc::Device { .. } => None,
        })
        .collect()
}

impl GpuBackend {
    /// Writes `parts` (`(offset in buf, bytes)`) into `buf` in stream order: host bytes
    /// through one staging copy where they lie back to back, lent staging by device copies.
    pub(in crate::backend::gpu) fn write_srcs(
        &self,
        buf: &wgpu::Buffer,
        parts: &[(u64, PartSrc<'_>)],
    ) {
        let host: Vec<(u64, &[u8])> = parts
            .iter()
            .filter_map(|&(o, p)| match p {
                PartSrc::Host(b) => Some((o, b)),
                PartSrc::Device { .. } => None,
            })
            .collect();
        self.ctx.write_parts(buf, &host);
        for &(o, p) in parts {
            if let PartSrc::Device {
                buf: src,
                offset,
                len,
                ..
            } = p
            {
                self.ctx.copy(src, offset, buf, o, len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MatSrc, PartSrc, FAST_SCALE_MAX};

    fn scales(b: &[u8]) -> MatSrc<'_> {
        MatSrc {
            packed: PartSrc::Host(&[]),
            scales: PartSrc::Host(b),
        }
    }

    /// One scale byte above the limit, anywhere (in a whole chunk or the tail), is found.
    #[test]
    fn huge_scales_are_found_anywhere() {
        let mut b = vec![FAST_SCALE_MAX; 200];
        assert!(!scales(&b).may_have_huge_scales());
        for at in [0, 63, 64, 130, 199] {
            b[at] = FAST_SCALE_MAX + 1;
            assert!(scales(&b).may_have_huge_scales(), "byte {at}");
            b[at] = 0;
        }
        assert!(!scales(&[]).may_have_huge_scales());
    }
}
