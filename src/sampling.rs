//! Choosing the next token from logits: presence, frequency and repetition penalties,
//! top-k, top-p, min-p and temperature in llama.cpp's order, drawn with a seeded ChaCha RNG.

mod rank_order;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rank_order::{rank_all, RankScratch};
use rayon::prelude::*;

/// Sampling settings. The filters run in llama.cpp's default order: presence and
/// frequency penalties, repetition penalty, top-k, top-p, min-p, then temperature, so
/// top-p and min-p see the untempered distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 picks the highest logit (ties to the lowest id); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches this; 1 = off.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Penalise ids in the history: positive logits are divided by it, negative ones
    /// multiplied (llama.cpp); 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every id generated
    /// so far (the ids after the prompt, [`Sampler::with_prompt_len`]); 0 = off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from an id's logit once per time it was
    /// generated so far; 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the ChaCha20 RNG, so a run can be replayed.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Checks each field's range; errors name the field and the accepted values.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "temperature {} must be a finite number >= 0 (0 = greedy)",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1] (1 = off)", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p {} must be in [0, 1] (0 = off)", self.min_p);
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            bail!(
                "repetition_penalty {} must be a finite number > 0 (1 = off)",
                self.repetition_penalty
            );
        }
        for (name, p) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !p.is_finite() {
                bail!("{name} {p} must be a finite number (0 = off)");
            }
        }
        Ok(())
    }
}

/// A sampler: the settings plus the RNG state they seeded.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha20Rng,
    /// Ids of a history before this index are the prompt, which presence and frequency
    /// penalties leave out.
    prompt_len: usize,
    /// Scratch: (id, logit) candidates, reused across calls.
    cand: Vec<(u32, f32)>,
    /// Scratch of the radix sort that ranks a whole vocabulary.
    rank: RankScratch,
}

impl Sampler {
    /// Validates the settings and seeds the RNG.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            rng: ChaCha20Rng::seed_from_u64(cfg.seed),
            prompt_len: 0,
            cand: Vec::new(),
            rank: RankScratch::default(),
        })
    }

    /// Counts the first `prompt_len` ids of every history as the prompt: presence and
    /// frequency penalties apply only to the ids after them (without this, to all).
    pub fn with_prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len;
        self
    }

    /// The settings this sampler runs with.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next id from `logits` (one per vocabulary id), penalising ids in
    /// `history` (the prompt, then the ids generated so far). NaN logits count as -inf.
    /// Panics if `logits` is empty.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let work = self.penalized(logits, history);
        self.draw(&work)
    }

    /// [`Self::sample`], also returning the chosen id's log-probability and the `top_n`
    /// most likely ids' (see [`TokenLogprobs`] for which distribution that is).
    pub fn sample_with_logprobs(
        &mut self,
        logits: &[f32],
        history: &[u32],
        top_n: usize,
    ) -> (u32, TokenLogprobs) {
        let work = self.penalized(logits, history);
        let id = self.draw(&work);
        (id, logprobs_of(&work, self.cfg.temperature, id, top_n))
    }

    /// The logits with NaN as -inf, then the presence and frequency penalties, then the
    /// repetition penalty applied.
    fn penalized(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        assert!(
            !logits.is_empty(),
            "Sampler::sample needs at least one logit"
        );
        let cfg = self.cfg;
        let mut work: Vec<f32> = logits
            .iter()
            .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
            .collect();
        let (presence, frequency) = (cfg.presence_penalty, cfg.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            let mut counts: std::collections::HashMap<u32, f32> = Default::default();
            for &id in &history[self.prompt_len.min(history.len())..] {
                *counts.entry(id).or_default() += 1.0;
            }
            for (&id, &n) in &counts {
                if let Some(l) = work.get_mut(id as usize) {
                    *l -= presence + frequency * n;
                }
            }
        }
        if cfg.repetition_penalty != 1.0 {
            let mut seen = vec![false; work.len()];
            for &id in history {
                let Some(flag) = seen.get_mut(id as usize) else {
                    continue;
                };
                if std::mem::replace(flag, true) {
                    continue;
                }
                let l = &mut work[id as usize];
                *l = if *l > 0.0 {
                    *l / cfg.repetition_penalty
                } else {
                    *l * cfg.repetition_penalty
                };
            }
        }
        work
    }

    /// Draws an id from penalised logits: top-k, top-p, min-p, then temperature.
    fn draw(&mut self, work: &[f32]) -> u32 {
        let cfg = self.cfg;
        if cfg.temperature == 0.0 {
            return argmax_lowest(work);
        }

        let cand = &mut self.cand;
        // Highest logit first, lowest id first among equals: every cut below is then
        // deterministic. It is a total order (the ids differ), so a selection of the top k
        // and an unstable sort of them, or a radix sort of the whole vocabulary, give the
        // order a full stable sort gives, in a fraction of its time (`cargo bench --bench
        // sampling`).
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if cfg.top_k > 0 && cfg.top_k < work.len() {
            cand.clear();
            cand.extend(work.iter().enumerate().map(|(i, &l)| (i as u32, l)));
            cand.select_nth_unstable_by(cfg.top_k - 1, by_rank);
            cand.truncate(cfg.top_k);
            cand.sort_unstable_by(by_rank);
        } else {
            rank_all(work, cand, &mut self.rank);
        }
        if cand[0].1 == f32::NEG_INFINITY {
            return cand[0].0;
        }
        let max = cand[0].1;
        if cfg.top_p < 1.0 {
            let probs = softmax(cand, max, 1.0);
            let mut cum = 0.0f64;
            let mut keep = cand.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if cfg.min_p > 0.0 {
            // p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p); the top token always stays.
            let floor = max as f64 + (cfg.min_p as f64).ln();
            let keep = cand
                .iter()
                .take_while(|c| c.1 as f64 >= floor)
                .count()
                .max(1);
            cand.truncate(keep);
        }
        let probs = softmax(cand, max, cfg.temperature);
        let u: f64 = self.rng.random();
        let total: f64 = probs.iter().sum();
        let mut acc = 0.0;
        for (c, p) in cand.iter().zip(&probs) {
            acc += p / total;
            if u < acc {
                return c.0;
            }
        }
        // Rounding left u above the last cumulative sum: the last candidate it is.
        cand[cand.len() - 1].0
    }
}

/// The log-probabilities of one sampled token. They are taken over the whole vocabulary
/// from the logits the sampler draws from — after the presence, frequency and repetition
/// penalties (and whatever the caller applied: the grammar mask) and divided by the
/// temperature (1 when greedy) — before top-k, top-p and min-p cut the tail: vLLM's
/// "processed" log-probabilities, the model's distribution as sampling shaped it. Ids the
/// grammar masked have probability 0 and never appear among the alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen id.
    pub id: u32,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The most likely ids and their log-probabilities, most likely first (lowest id first
    /// among equals), at most the number asked for and only ids with probability > 0.
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `id` under `logits / temperature` (temperature 0 counts as 1).
pub fn logprobs_of(logits: &[f32], temperature: f32, id: u32, top_n: usize) -> TokenLogprobs {
    let t = if temperature > 0.0 {
        temperature as f64
    } else {
        1.0
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| ((l as f64 - max) / t).exp()).sum();
    let log_z = max / t + sum.ln();
    let lp = |l: f32| (l as f64 / t - log_z) as f32;
    let logprob = logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&l| lp(l));
    let mut top: Vec<(u32, f32)> = Vec::new();
    if top_n > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
            .collect();
        let order = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if ids.len() > top_n {
            ids.select_nth_unstable_by(top_n - 1, order);
            ids.truncate(top_n);
        }
        ids.sort_by(order);
        top = ids
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    TokenLogprobs { id, logprob, top }
}

/// Candidates a pool thread takes at a time in [`softmax`]: K3's vocabulary splits in ten,
/// a small one runs inline.
const SOFTMAX_CHUNK: usize = 16_384;

/// Probabilities of the candidates' `logit / temperature`, stabilised by the largest logit.
/// The exponentials (a millisecond a row over K3's vocabulary, one core) are taken in
/// chunks on the pool; the sum runs in candidate order, so every value is the one a single
/// thread computes.
fn softmax(cand: &[(u32, f32)], max: f32, temperature: f32) -> Vec<f64> {
    let t = temperature as f64;
    let mut e = vec![0.0f64; cand.len()];
    let exps = |(out, c): (&mut [f64], &[(u32, f32)])| {
        for (o, c) in out.iter_mut().zip(c) {
            *o = ((c.1 as f64 - max as f64) / t).exp();
        }
    };
    let wide = cand.len() > SOFTMAX_CHUNK;
    if wide {
        e.par_chunks_mut(SOFTMAX_CHUNK)
            .zip(cand.par_chunks(SOFTMAX_CHUNK))
            .for_each(exps);
    } else {
        exps((&mut e, cand));
    }
    let sum: f64 = e.iter().sum();
    let scale = |out: &mut [f64]| out.iter_mut().for_each(|x| *x /= sum);
    if wide {
        e.par_chunks_mut(SOFTMAX_CHUNK).for_each(scale);
    } else {
        scale(&mut e);
    }
    e
}

/// Index of the largest value; the lowest index wins a tie, NaN never wins (0 when nothing
/// but NaN). Two passes in blocks of 16 values that the compiler vectorizes (the
/// maximum lane by lane, then the first block that holds it): a greedy pick reads a
/// vocabulary's logits a row and step, and one compare-and-branch a value does not vectorize
/// (`cargo bench --bench sampling`).
pub fn argmax_lowest(values: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; ARGMAX_LANES];
    let blocks = values.chunks_exact(ARGMAX_LANES);
    let tail = blocks.remainder();
    for b in blocks {
        for (m, &v) in lanes.iter_mut().zip(b) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = tail
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let block = values
        .chunks(ARGMAX_LANES)
        .position(|b| b.iter().fold(false, |any, &v| any | (v == max)))
        .unwrap_or(0);
    let rest = &values[(block * ARGMAX_LANES).min(values.len())..];
    (block * ARGMAX_LANES + rest.iter().position(|&v| v == max).unwrap_or(0)) as u32
}

/// Lanes of [`argmax_lowest`]'s maximum: an AVX-512 register of f32.
const ARGMAX_LANES: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    /// The first place of the maximum, by the slow and obvious route (no NaN in its inputs).
    fn argmax_by_scan(values: &[f32]) -> u32 {
        let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        values.iter().position(|&v| v == max).unwrap_or(0) as u32
    }

    #[test]
    fn argmax_takes_the_first_of_the_largest_at_any_length() {
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            // Few distinct values, so ties are common.
            (seed >> 28) as f32 - 8.0
        };
        for len in [1, 2, 15, 16, 17, 31, 33, 100, 1000, 163_840] {
            let v: Vec<f32> = (0..len).map(|_| next()).collect();
            assert_eq!(argmax_lowest(&v), argmax_by_scan(&v), "length {len}");
        }
        // The maximum in the tail past the last whole block, and tied with an earlier one.
        let mut v = vec![0.0f32; 35];
        v[34] = 2.0;
        assert_eq!(argmax_lowest(&v), 34);
        v[3] = 2.0;
        assert_eq!(argmax_lowest(&v), 3);
        assert_eq!(argmax_lowest(&[f32::NEG_INFINITY; 5]), 0);
        assert_eq!(argmax_lowest(&[f32::NAN, 1.0, f32::NAN, 3.0]), 3);
        assert_eq!(argmax_lowest(&[f32::NAN; 4]), 0);
        assert_eq!(argmax_lowest(&[]), 0);
    }

    fn sampler(cfg: SamplerConfig) -> Sampler {
        Sampler::new(cfg).unwrap()
    }

    fn penalties(presence: f32, frequency: f32) -> SamplerConfig {
        SamplerConfig {
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..SamplerConfig::default()
        }
    }

    /// Top-k by selection draws what the whole vocabulary draws with every id outside the k
    /// highest (ties by lowest id) masked to -inf: the same candidates in the same order, the
    /// same probabilities, the same random numbers.
    #[test]
    fn top_k_by_selection_draws_as_the_masked_vocabulary_does() {
        let mut seed = 11u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            // Few distinct values, so ties cross the k-th place.
            (seed >> 26) as f32 * 0.25
        };
        for (top_k, top_p, min_p) in [
            (1, 1.0, 0.0),
            (5, 1.0, 0.0),
            (40, 0.9, 0.0),
            (40, 1.0, 0.05),
        ] {
            let logits: Vec<f32> = (0..1000).map(|_| next()).collect();
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let mut masked = vec![f32::NEG_INFINITY; logits.len()];
            for &i in &order[..top_k] {
                masked[i] = logits[i];
            }
            let cfg = |top_k| SamplerConfig {
                temperature: 0.8,
                top_k,
                top_p,
                min_p,
                seed: 5,
                ..SamplerConfig::default()
            };
            let (mut by_k, mut by_mask) = (sampler(cfg(top_k)), sampler(cfg(0)));
            for step in 0..200 {
                assert_eq!(
                    by_k.sample(&logits, &[]),
                    by_mask.sample(&masked, &[]),
                    "top-k {top_k}, top-p {top_p}, min-p {min_p}, draw {step}"
                );
            }
        }
    }

    #[test]
    fn presence_and_frequency_count_only_the_generated_ids() {
        let s = sampler(penalties(0.5, 0.25)).with_prompt_len(2);
        // Prompt [3, 1]; generated 1, 1, 2.
        let got = s.penalized(&[1.0; 4], &[3, 1, 1, 1, 2]);
        assert_eq!(got, vec![1.0, 0.0, 0.25, 1.0]);
        // Without a prompt length every id of the history counts.
        let s = sampler(penalties(0.5, 0.25));
        let got = s.penalized(&[1.0; 4], &[3, 1, 1, 1, 2]);
        assert_eq!(got, vec![1.0, -0.25, 0.25, 0.25]);
    }

    #[test]
    fn presence_and_frequency_come_before_the_repetition_penalty() {
        let cfg = SamplerConfig {
            repetition_penalty: 2.0,
            ..penalties(1.0, 0.0)
        };
        // (2 - 1) / 2, not 2 / 2 - 1.
        assert_eq!(sampler(cfg).penalized(&[2.0], &[0]), vec![0.5]);
    }

    #[test]
    fn penalties_leave_nan_and_masked_ids_at_minus_infinity_and_skip_unknown_ids() {
        let s = sampler(penalties(-2.0, 2.0));
        let got = s.penalized(&[f32::NAN, f32::NEG_INFINITY, 0.5], &[0, 1, 9]);
        assert_eq!(got, vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.5]);
    }

    /// The penalties as the server applied them before the sampler saw the logits: on the
    /// raw logits, before NaN became -inf.
    fn before_sampler(
        logits: &[f32],
        generated: &[u32],
        presence: f32,
        frequency: f32,
    ) -> Vec<f32> {
        let mut out = logits.to_vec();
        let mut counts: std::collections::HashMap<u32, f32> = Default::default();
        for &id in generated {
            *counts.entry(id).or_default() += 1.0;
        }
        for (&id, &n) in &counts {
            if let Some(l) = out.get_mut(id as usize) {
                *l -= presence + frequency * n;
            }
        }
        out
    }

    #[test]
    fn penalties_in_the_sampler_give_the_same_ids_and_logprobs_as_before_it() {
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let vocab = 64;
        let prompt: Vec<u32> = (0..10).map(|_| rng.random_range(0..vocab)).collect();
        for round in 0..50u64 {
            let mut logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-8.0..8.0)).collect();
            logits[3] = f32::NAN;
            logits[7] = f32::NEG_INFINITY;
            let generated: Vec<u32> = (0..20).map(|_| rng.random_range(0..vocab + 2)).collect();
            let history: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
            let cfg = SamplerConfig {
                temperature: if round % 2 == 0 { 0.0 } else { 0.8 },
                top_k: 40,
                top_p: 0.9,
                repetition_penalty: 1.3,
                presence_penalty: 0.7,
                frequency_penalty: -0.3,
                seed: round,
                ..SamplerConfig::default()
            };
            let old_cfg = SamplerConfig {
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                ..cfg
            };
            let shaped = before_sampler(&logits, &generated, 0.7, -0.3);
            let want = sampler(old_cfg).sample_with_logprobs(&shaped, &history, 5);
            let got = sampler(cfg)
                .with_prompt_len(prompt.len())
                .sample_with_logprobs(&logits, &history, 5);
            assert_eq!(got, want, "round {round}");
        }
    }

    #[test]
    fn a_penalty_that_is_not_a_number_is_refused_by_name() {
        let e = Sampler::new(penalties(f32::NAN, 0.0))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("presence_penalty"), "{e}");
        let e = Sampler::new(penalties(0.0, f32::INFINITY))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("frequency_penalty"), "{e}");
    }
}
