//! Reproducible random tensor contents, generated in independent blocks so that any
//! block-aligned chunking, ordering or parallelism yields the same bytes.
//!
//! Every block of [`BLOCK_ELEMS`] elements has its own ChaCha8 stream keyed by
//! (seed, tensor name, block index): a tensor's values depend on nothing else.

use half::{bf16, f16};

use crate::checkpoint::schema::TensorKind;
use crate::checkpoint::tensor::Dtype;
use crate::quant::round_half_away;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Elements per independently seeded block.
pub(crate) const BLOCK_ELEMS: usize = 1 << 16;

/// RMS of the eight E2M1 magnitudes `0, 0.5, 1, 1.5, 2, 3, 4, 6` drawn uniformly.
const E2M1_UNIFORM_RMS: f64 = 2.926;
/// E8M0 exponent bias: a scale byte `s` means `2^(s - 127)`.
const E8M0_BIAS: i32 = 127;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Init {
    /// Approximately normal (Irwin-Hall of 4 uniforms: bounded tails, no outliers).
    Normal { mean: f32, std: f32 },
    /// `ln(U(lo, hi))`, the usual KDA `A_log` initialisation.
    LogUniform { lo: f32, hi: f32 },
    /// Uniform bytes: every E2M1 nibble code equally likely.
    Bytes,
    /// E8M0 exponents `base - 1 ..= base + 1`, uniformly.
    E8m0 { base: u8 },
}

impl Init {
    /// Projection weights: std `1/sqrt(fan_in)` keeps activations O(1).
    pub(crate) fn projection(fan_in: usize) -> Init {
        Init::Normal {
            mean: 0.0,
            std: 1.0 / (fan_in.max(1) as f32).sqrt(),
        }
    }

    /// MXFP4 scales for a matrix with `fan_in` columns so that dequantized weights of
    /// uniform random nibbles have std about `1/sqrt(fan_in)`.
    pub(crate) fn mxfp4_scales(fan_in: usize) -> Init {
        let target = 1.0 / (E2M1_UNIFORM_RMS * (fan_in.max(1) as f64).sqrt());
        let exp = target.log2().round() as i32 + E8M0_BIAS;
        // Keep room for the ±1 jitter inside the finite, non-zero scale range 1..=254.
        let base = exp.clamp(2, 253) as u8;
        Init::E8m0 { base }
    }
}

/// The initialisation of a text tensor, chosen by its kind so that activations stay O(1)
/// through every layer: projections `N(0, 1/fan_in)`, norms `1 + noise`, the AttnRes
/// mixing vectors small enough that the depth softmax is neither flat nor saturated, KDA
/// decay parameters in their usual ranges, MXFP4 experts with uniform nibbles and scales
/// matched to the fan-in.
pub(crate) fn init_for(kind: TensorKind, shape: &[usize]) -> Init {
    let numel: usize = shape.iter().product();
    let last = shape.last().copied().unwrap_or(1);
    let small = |std: f32| Init::Normal { mean: 0.0, std };
    match kind {
        TensorKind::ExpertPacked => Init::Bytes,
        TensorKind::ExpertScale => Init::mxfp4_scales(last * crate::config::MXFP4_GROUP),
        // Scores are dot products of unit-RMS rows with this vector: std 1 over H terms.
        TensorKind::ResProj => Init::projection(numel),
        TensorKind::Norm => Init::Normal {
            mean: 1.0,
            std: 0.02,
        },
        TensorKind::ALog => Init::LogUniform { lo: 1.0, hi: 16.0 },
        TensorKind::DtBias => small(0.1),
        TensorKind::Conv => small(0.5),
        TensorKind::RouterBias => small(0.02),
        TensorKind::Embedding => small(1.0),
        TensorKind::Matrix if shape.len() >= 2 => Init::projection(last),
        TensorKind::Matrix => small(0.02),
    }
}

/// The initialisation of the vision stand-ins, which a text engine never reads.
pub(crate) const VISION_INIT: Init = Init::Normal {
    mean: 0.0,
    std: 0.02,
};

/// Identity of one tensor's random stream.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamKey {
    seed: u64,
    name_hash: [u64; 2],
}

impl StreamKey {
    /// The stream of tensor `name` under `seed`.
    pub(crate) fn new(seed: u64, name: &str) -> StreamKey {
        StreamKey {
            seed,
            name_hash: [
                fnv1a(name, 0xcbf2_9ce4_8422_2325),
                fnv1a(name, 0x6c62_272e_07bb_0142),
            ],
        }
    }

    fn block_rng(&self, block: u64) -> ChaCha8Rng {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&self.name_hash[0].to_le_bytes());
        key[16..24].copy_from_slice(&self.name_hash[1].to_le_bytes());
        key[24..].copy_from_slice(&block.to_le_bytes());
        ChaCha8Rng::from_seed(key)
    }
}

/// 64-bit FNV-1a from a chosen basis; two bases give a 128-bit name identity.
fn fnv1a(s: &str, basis: u64) -> u64 {
    s.bytes().fold(basis, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Fills `out` with the encoded elements that start at element `first_elem` of the
/// tensor. `first_elem` must be a multiple of [`BLOCK_ELEMS`] and `out` a whole number
/// of elements; blocks are generated in parallel.
pub(crate) fn fill(key: StreamKey, init: Init, ty: Dtype, first_elem: u64, out: &mut [u8]) {
    debug_assert_eq!(first_elem % BLOCK_ELEMS as u64, 0);
    debug_assert_eq!(out.len() % ty.size(), 0);
    let first_block = first_elem / BLOCK_ELEMS as u64;
    out.par_chunks_mut(BLOCK_ELEMS * ty.size())
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = key.block_rng(first_block + i as u64);
            fill_block(&mut rng, init, ty, chunk);
        });
}

fn fill_block(rng: &mut ChaCha8Rng, init: Init, ty: Dtype, out: &mut [u8]) {
    match init {
        Init::Bytes => rng.fill_bytes(out),
        Init::E8m0 { base } => {
            for b in out.iter_mut() {
                // Three values, near-uniform: the bias of a 32-bit modulo is negligible.
                let jitter = (rng.next_u32() % 3) as u8;
                *b = base - 1 + jitter;
            }
        }
        Init::Normal { .. } | Init::LogUniform { .. } => {
            for elem in out.chunks_exact_mut(ty.size()) {
                let v = sample(rng, init);
                match ty {
                    Dtype::Bf16 => elem.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    Dtype::F16 => elem.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                    Dtype::F32 => elem.copy_from_slice(&v.to_le_bytes()),
                    // Clamped first: `round_half_away` wants |x| < 2^23; it, not
                    // `f32::round`, so that the bytes are the same on every target.
                    Dtype::U8 => elem[0] = round_half_away(v.clamp(0.0, 255.0)) as u8,
                }
            }
        }
    }
}

fn sample(rng: &mut ChaCha8Rng, init: Init) -> f32 {
    match init {
        Init::Normal { mean, std } => {
            let r = rng.next_u64();
            let sum: u32 = (0..4).map(|i| ((r >> (16 * i)) & 0xffff) as u32).sum();
            // Four uniforms on [0, 1) sum to mean 2, variance 1/3.
            let u = (sum as f32 + 2.0) / 65536.0 - 2.0;
            mean + std * u * 3f32.sqrt()
        }
        Init::LogUniform { lo, hi } => {
            let u = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
            (lo + (hi - lo) * u).ln()
        }
        Init::Bytes | Init::E8m0 { .. } => f32::from(rng.next_u32() as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_f32(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()
    }

    #[test]
    fn chunking_does_not_change_values() {
        let key = StreamKey::new(7, "a.weight");
        let init = Init::projection(64);
        let n = 3 * BLOCK_ELEMS + 100;
        let mut whole = vec![0u8; n * 2];
        fill(key, init, Dtype::Bf16, 0, &mut whole);
        let mut pieces = vec![0u8; n * 2];
        let (a, b) = pieces.split_at_mut(2 * BLOCK_ELEMS * 2);
        fill(key, init, Dtype::Bf16, 2 * BLOCK_ELEMS as u64, b);
        fill(key, init, Dtype::Bf16, 0, a);
        assert_eq!(whole, pieces);
        let mut other = vec![0u8; n * 2];
        fill(
            StreamKey::new(7, "b.weight"),
            init,
            Dtype::Bf16,
            0,
            &mut other,
        );
        assert_ne!(whole, other);
    }

    #[test]
    fn normal_has_requested_moments() {
        let mut buf = vec![0u8; 2 * BLOCK_ELEMS * 2];
        let init = Init::Normal {
            mean: 1.0,
            std: 0.125,
        };
        fill(StreamKey::new(1, "n"), init, Dtype::Bf16, 0, &mut buf);
        let v = as_f32(&buf);
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.005, "mean {mean}");
        assert!((var.sqrt() - 0.125).abs() < 0.005, "std {}", var.sqrt());
    }

    #[test]
    fn log_uniform_stays_in_range() {
        let mut buf = vec![0u8; 1000 * 4];
        let init = Init::LogUniform { lo: 1.0, hi: 16.0 };
        fill(StreamKey::new(1, "A_log"), init, Dtype::F32, 0, &mut buf);
        let v: Vec<f32> = buf
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(v.iter().all(|&x| (0.0..=16f32.ln()).contains(&x)));
        assert!(v.iter().any(|&x| x > 2.0) && v.iter().any(|&x| x < 1.0));
    }

    #[test]
    fn mxfp4_scales_give_unit_fan_in_variance() {
        for fan_in in [32usize, 256, 3072, 3584] {
            let Init::E8m0 { base } = Init::mxfp4_scales(fan_in) else {
                panic!("not an E8M0 init");
            };
            let scale = 2f64.powi(i32::from(base) - E8M0_BIAS);
            let std = scale * E2M1_UNIFORM_RMS * (fan_in as f64).sqrt();
            // Rounding the exponent keeps the std within a factor sqrt(2) of the target.
            assert!(
                (0.7..1.42).contains(&std),
                "fan_in {fan_in}: std·sqrt(in) {std}"
            );
        }
        let mut buf = vec![0u8; 3000];
        fill(
            StreamKey::new(3, "s"),
            Init::mxfp4_scales(3584),
            Dtype::U8,
            0,
            &mut buf,
        );
        let mut seen: Vec<u8> = buf.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 3);
    }
}
