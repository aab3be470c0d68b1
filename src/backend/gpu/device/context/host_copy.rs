//! Host copies into mapped ranges, spread over the rayon pool.

use rayon::prelude::*;

/// Copies `src` into a mapped range on several threads. A streamed expert is 17.5 MB; one
/// core copies that in a few milliseconds, host time on the path the read pipe must hide.
pub(super) fn parallel_copy(dst: wgpu::WriteOnly<'_, [u8]>, src: &[u8]) {
    parallel_copy_parts(dst, &[(0, src)]);
}

/// Copies each `(offset, bytes)` part (increasing, non-overlapping offsets within `dst`)
/// to its place in `dst`, in 1 MB pieces spread over the rayon pool; on the calling thread
/// when there is less than 4 MB in all.
pub(super) fn parallel_copy_parts(dst: wgpu::WriteOnly<'_, [u8]>, parts: &[(usize, &[u8])]) {
    const CHUNK: usize = 1 << 20;
    let total: usize = parts.iter().map(|p| p.1.len()).sum();
    let mut pieces = Vec::with_capacity(total.div_ceil(CHUNK) + parts.len());
    let (mut rest, mut at) = (dst, 0usize);
    for &(off, src) in parts {
        let (_, tail) = rest.split_at(off - at);
        let (mut head, tail) = tail.split_at(src.len());
        (rest, at) = (tail, off + src.len());
        for s in src.chunks(CHUNK) {
            let (piece, more) = head.split_at(s.len());
            pieces.push((Chunk(piece), s));
            head = more;
        }
    }
    if total < 4 * CHUNK {
        for (mut d, s) in pieces {
            d.0.copy_from_slice(s);
        }
        return;
    }
    pieces
        .into_par_iter()
        .for_each(|(mut d, s)| d.0.copy_from_slice(s));
}

/// A disjoint piece of a mapped range, movable to a copy thread.
struct Chunk<'a>(wgpu::WriteOnly<'a, [u8]>);

// SAFETY: `WriteOnly<[u8]>` lacks `Send` only because its impl asks `T: Sized`; like a
// `&mut [u8]`, it is an exclusive pointer, and the chunks come from `split_at`, so no two
// threads ever touch the same bytes.
unsafe impl Send for Chunk<'_> {}
