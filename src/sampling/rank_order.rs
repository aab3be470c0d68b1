//! A vocabulary's candidates in rank order (highest logit first, lowest id first among
//! equals) by a stable radix sort on the logits' bits. A comparison sort of K3's 163,840
//! logits took milliseconds a row, which a sampled stream pays at every token
//! (docs/perf.md#several-clients-at-once); four counting passes over the key bytes give
//! the same order in a fraction of that.

/// Bits of a radix digit.
const DIGIT_BITS: u32 = 8;
/// Values a digit takes.
const BUCKETS: usize = 1 << DIGIT_BITS;
/// Digits of a 32-bit key.
const DIGITS: usize = 4;

/// A key whose unsigned order is `f32::total_cmp`'s order reversed: the highest value (in
/// total order, so +NaN above +inf and 0.0 above -0.0) gets the lowest key.
fn descending_key(v: f32) -> u32 {
    let b = v.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ascending
}

/// The value a [`descending_key`] was made from.
fn value_of(key: u32) -> f32 {
    let ascending = !key;
    let b = if ascending >> 31 == 1 {
        ascending & 0x7fff_ffff
    } else {
        !ascending
    };
    f32::from_bits(b)
}

/// Reused buffers of [`rank_all`].
#[derive(Default)]
pub(super) struct RankScratch {
    keys: Vec<u64>,
    spare: Vec<u64>,
}

/// `(id, logit)` for every id of `logits`, into `out` in rank order: the order a sort by
/// `b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))` gives. Each item is the key in the upper 32
/// bits and the id below; the ids go in ascending, and each pass is stable, so equal
/// logits keep ascending ids.
pub(super) fn rank_all(logits: &[f32], out: &mut Vec<(u32, f32)>, s: &mut RankScratch) {
    let RankScratch { keys, spare } = s;
    keys.clear();
    keys.extend(
        logits
            .iter()
            .enumerate()
            .map(|(id, &l)| (u64::from(descending_key(l)) << 32) | id as u64),
    );
    let digit = |k: u64, d: usize| ((k >> (32 + DIGIT_BITS as usize * d)) as usize) & (BUCKETS - 1);
    let mut counts = [[0usize; BUCKETS]; DIGITS];
    for &k in keys.iter() {
        for (d, c) in counts.iter_mut().enumerate() {
            c[digit(k, d)] += 1;
        }
    }
    spare.resize(keys.len(), 0);
    for (d, c) in counts.iter().enumerate() {
        // A digit every key shares leaves the order as it is (the exponent byte often).
        if c.contains(&keys.len()) {
            continue;
        }
        let mut at = [0usize; BUCKETS];
        let mut sum = 0;
        for (a, &n) in at.iter_mut().zip(c) {
            *a = sum;
            sum += n;
        }
        for &k in keys.iter() {
            let b = digit(k, d);
            spare[at[b]] = k;
            at[b] += 1;
        }
        std::mem::swap(keys, spare);
    }
    out.clear();
    out.extend(keys.iter().map(|&k| (k as u32, value_of((k >> 32) as u32))));
}

#[cfg(test)]
mod tests {
    use super::{descending_key, rank_all, value_of, RankScratch};

    fn by_sort(logits: &[f32]) -> Vec<(u32, f32)> {
        let mut v: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    /// Bits equal, so -0.0 against 0.0 and NaN payloads count.
    fn bits(v: &[(u32, f32)]) -> Vec<(u32, u32)> {
        v.iter().map(|&(i, l)| (i, l.to_bits())).collect()
    }

    #[test]
    fn keys_order_as_total_cmp_reversed_and_give_their_values_back() {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::MIN,
            1.5,
            -1.5,
        ];
        for &a in &specials {
            assert_eq!(value_of(descending_key(a)).to_bits(), a.to_bits(), "{a}");
            for &b in &specials {
                assert_eq!(
                    descending_key(a).cmp(&descending_key(b)),
                    b.total_cmp(&a),
                    "{a} against {b}"
                );
            }
        }
    }

    #[test]
    fn radix_order_is_the_comparison_sort_order_with_ties_by_id() {
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed
        };
        let mut s = RankScratch::default();
        let mut out = Vec::new();
        for len in [0usize, 1, 2, 3, 17, 256, 1000, 5000, 163_840] {
            // Few distinct values (ties everywhere), spread values, and raw bit patterns
            // (NaNs, infinities, subnormals, both zeros).
            let few: Vec<f32> = (0..len)
                .map(|_| (next() >> 28) as f32 * 0.5 - 3.0)
                .collect();
            let spread: Vec<f32> = (0..len)
                .map(|_| (next() >> 8) as f32 / 65536.0 - 128.0)
                .collect();
            let raw: Vec<f32> = (0..len).map(|_| f32::from_bits(next())).collect();
            for logits in [few, spread, raw] {
                rank_all(&logits, &mut out, &mut s);
                assert_eq!(bits(&out), bits(&by_sort(&logits)), "length {len}");
            }
        }
    }

    #[test]
    fn one_value_everywhere_keeps_the_ids_in_order() {
        let mut out = Vec::new();
        rank_all(&[2.0; 300], &mut out, &mut RankScratch::default());
        assert!(out
            .iter()
            .enumerate()
            .all(|(i, &(id, l))| id as usize == i && l == 2.0));
    }
}
