//! Sampler: greedy ties, filters, repetition penalty, seeded reproducibility.

use k3::sampling::{Sampler, SamplerConfig};

fn sampler(cfg: SamplerConfig) -> Sampler {
    Sampler::new(cfg).unwrap()
}

fn counts(s: &mut Sampler, logits: &[f32], history: &[u32], n: usize) -> Vec<usize> {
    let mut c = vec![0; logits.len()];
    for _ in 0..n {
        c[s.sample(logits, history) as usize] += 1;
    }
    c
}

#[test]
fn greedy_takes_the_max_and_the_lowest_id_on_ties() {
    let mut s = sampler(SamplerConfig::default());
    assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9], &[]), 1);
    assert_eq!(s.sample(&[1.0; 7], &[]), 0);
    assert_eq!(s.sample(&[0.0, 5.0, 1.0, 5.0], &[]), 1);
    assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN], &[]), 1);
    assert_eq!(s.sample(&[f32::NEG_INFINITY; 3], &[]), 0);
}

#[test]
fn same_seed_same_stream_other_seed_other_stream() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let cfg = SamplerConfig {
        temperature: 1.0,
        seed: 42,
        ..SamplerConfig::default()
    };
    let run = |cfg: SamplerConfig| {
        let mut s = sampler(cfg);
        (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
    };
    let a = run(cfg);
    assert_eq!(a, run(cfg));
    assert_ne!(a, run(SamplerConfig { seed: 43, ..cfg }));
    // Sampling at temperature 1 visits more than the argmax.
    assert!(a.iter().any(|&x| x != a[0]));
}

#[test]
fn top_p_one_keeps_everything_and_follows_the_distribution() {
    let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln(), (4.0f32).ln()];
    let mut s = sampler(SamplerConfig {
        temperature: 1.0,
        top_p: 1.0,
        seed: 7,
        ..SamplerConfig::default()
    });
    let c = counts(&mut s, &logits, &[], 20_000);
    for (i, &n) in c.iter().enumerate() {
        let expect = 20_000.0 * (i + 1) as f64 / 10.0;
        assert!(
            (n as f64 - expect).abs() < expect * 0.1,
            "id {i}: {n} vs {expect}"
        );
    }
}

#[test]
fn top_p_cuts_the_tail() {
    // p = 0.5, 0.3, 0.2: top_p 0.6 keeps ids 0 and 1 only; 0.45 keeps id 0 only.
    let logits = [(0.5f32).ln(), (0.3f32).ln(), (0.2f32).ln()];
    let mut s = sampler(SamplerConfig {
        temperature: 1.0,
        top_p: 0.6,
        seed: 1,
        ..SamplerConfig::default()
    });
    let c = counts(&mut s, &logits, &[], 2000);
    assert_eq!(c[2], 0);
    assert!(c[0] > 0 && c[1] > 0);
    let mut s = sampler(SamplerConfig {
        temperature: 1.0,
        top_p: 0.45,
        seed: 1,
        ..SamplerConfig::default()
    });
    assert_eq!(counts(&mut s, &logits, &[], 500), vec![500, 0, 0]);
}

#[test]
fn top_k_one_is_greedy_even_at_high_temperature() {
    let mut s = sampler(SamplerConfig {
        temperature: 5.0,
        top_k: 1,
        seed: 9,
        ..SamplerConfig::default()
    });
    assert_eq!(
        counts(&mut s, &[1.0, 4.0, 3.9, 4.0], &[], 300),
        vec![0, 300, 0, 0]
    );
    let mut s = sampler(SamplerConfig {
        temperature: 1.0,
        top_k: 2,
        seed: 9,
        ..SamplerConfig::default()
    });
    let c = counts(&mut s, &[1.0, 4.0, 3.9, 0.5], &[], 1000);
    assert!(c[0] == 0 && c[3] == 0 && c[1] > 0 && c[2] > 0);
}

#[test]
fn all_equal_logits_sample_uniformly_and_greedy_picks_zero() {
    let logits = [2.5f32; 4];
    let mut s = sampler(SamplerConfig {
        temperature: 1.0,
        seed: 3,
        ..SamplerConfig::default()
    });
    let c = counts(&mut s, &logits, &[], 8000);
    assert!(c.iter().all(|&n| (n as i64 - 2000).abs() < 250), "{c:?}");
    let mut s = sampler(SamplerConfig {
        top_k: 1,
        temperature: 1.0,
        ..SamplerConfig::default()
    });
    assert_eq!(s.sample(&logits, &[]), 0);
}

#[test]
fn min_p_edges() {
    // p = 0.6, 0.3, 0.1. min_p 0.4 keeps p >= 0.24: ids 0 and 1.
    let logits = [(0.6f32).ln(), (0.3f32).ln(), (0.1f32).ln()];
    let cfg = SamplerConfig {
        temperature: 1.0,
        seed: 5,
        ..SamplerConfig::default()
    };
    let mut s = sampler(SamplerConfig { min_p: 0.4, ..cfg });
    let c = counts(&mut s, &logits, &[], 2000);
    assert!(c[2] == 0 && c[1] > 0, "{c:?}");
    // min_p 0 is off: every id appears.
    let mut s = sampler(SamplerConfig { min_p: 0.0, ..cfg });
    assert!(counts(&mut s, &logits, &[], 2000).iter().all(|&n| n > 0));
    // min_p 1 keeps only what ties with the top.
    let mut s = sampler(SamplerConfig { min_p: 1.0, ..cfg });
    assert_eq!(counts(&mut s, &logits, &[], 300), vec![300, 0, 0]);
    let mut s = sampler(SamplerConfig { min_p: 1.0, ..cfg });
    let c = counts(&mut s, &[1.0, 3.0, 3.0], &[], 1000);
    assert!(c[0] == 0 && c[1] > 0 && c[2] > 0, "{c:?}");
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let greedy = |penalty: f32, logits: &[f32], history: &[u32]| {
        sampler(SamplerConfig {
            repetition_penalty: penalty,
            ..SamplerConfig::default()
        })
        .sample(logits, history)
    };
    // 3.0 / 2 = 1.5 < 2.0: the repeated id loses.
    assert_eq!(greedy(2.0, &[3.0, 2.0], &[0]), 1);
    assert_eq!(greedy(1.0, &[3.0, 2.0], &[0]), 0);
    // Negative: -1.0 * 2 = -2.0 < -1.5.
    assert_eq!(greedy(2.0, &[-1.0, -1.5], &[0]), 1);
    // A repeated id is penalised once however often it appears; ids past the vocab are ignored.
    assert_eq!(greedy(2.0, &[3.0, 1.4], &[0, 0, 0, 99]), 0);
    // A penalty below 1 rewards repetition.
    assert_eq!(greedy(0.5, &[1.0, 1.5], &[0]), 0);
}

#[test]
fn invalid_settings_are_refused_by_name() {
    for (cfg, field) in [
        (
            SamplerConfig {
                temperature: -1.0,
                ..SamplerConfig::default()
            },
            "temperature",
        ),
        (
            SamplerConfig {
                top_p: 0.0,
                ..SamplerConfig::default()
            },
            "top_p",
        ),
        (
            SamplerConfig {
                min_p: 1.5,
                ..SamplerConfig::default()
            },
            "min_p",
        ),
        (
            SamplerConfig {
                repetition_penalty: 0.0,
                ..SamplerConfig::default()
            },
            "repetition_penalty",
        ),
    ] {
        let err = Sampler::new(cfg).err().unwrap().to_string();
        assert!(err.starts_with(field), "{err}");
    }
}
