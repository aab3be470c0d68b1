//! Each CPU op against hand-computed values or a direct (un-fused, un-absorbed) formula.

use crate::support;

use k3::backend::cpu::{CpuAct, CpuBackend};
use k3::backend::{
    Backend, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights, MlaDims, RouterParams,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::rel_l2;

fn act(data: Vec<f32>, rows: usize, cols: usize) -> CpuAct {
    CpuAct::new(data, rows, cols).unwrap()
}

fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn rmsnorm_matches_hand_values_and_groups() {
    let b = CpuBackend::new();
    let x = act(vec![1.0, 2.0, 3.0, 4.0], 1, 4);
    let w = act(vec![1.0, 1.0, 2.0, 0.5], 1, 4);
    let y = b.rmsnorm(&x, &w, 4, 1e-5).unwrap();
    let want = [
        0.3651481282381064,
        0.7302962564762128,
        2.1908887694286383,
        0.7302962564762128,
    ];
    for (g, w) in y.data.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{g} vs {w}");
    }
    // Two groups of 2 normalize independently.
    let x = act(vec![3.0, 4.0, -1.0, 1.0], 1, 4);
    let w = act(vec![1.0, 1.0], 1, 2);
    let y = b.rmsnorm(&x, &w, 2, 0.0).unwrap();
    let r1 = (12.5f64).sqrt();
    let want = [3.0 / r1, 4.0 / r1, -1.0, 1.0];
    for (g, w) in y.data.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-6);
    }
}

#[test]
fn situ_and_silu_match_hand_values() {
    let b = CpuBackend::new();
    let g = act(vec![1.0, -3.0], 1, 2);
    let u = act(vec![2.0, -30.0], 1, 2);
    let y = b
        .glu(
            &g,
            &u,
            Glu::Situ {
                beta: 4.0,
                linear_beta: 25.0,
            },
        )
        .unwrap();
    assert!((f64::from(y.data[0]) - 1.4293511315552199).abs() < 1e-6);
    assert!((f64::from(y.data[1]) - 2.5111755618341545).abs() < 1e-5);
    let y = b
        .glu(&act(vec![1.0], 1, 1), &act(vec![2.0], 1, 1), Glu::Silu)
        .unwrap();
    assert!((f64::from(y.data[0]) - 1.4621171572600098).abs() < 1e-6);
}

#[test]
fn sigmoid_gate_and_add() {
    let b = CpuBackend::new();
    let x = act(vec![2.0, -1.0], 1, 2);
    let g = act(vec![0.0, 100.0], 1, 2);
    assert_eq!(b.sigmoid_gate(&x, &g).unwrap().data, vec![1.0, -1.0]);
    assert_eq!(b.add(&x, &g).unwrap().data, vec![2.0, 99.0]);
    assert!(b.add(&x, &act(vec![1.0], 1, 1)).is_err());
}

#[test]
fn causal_conv_keeps_history_across_calls() {
    // One channel, K = 3, taps [a, b, c] oldest first: out_t = silu(a·x_{t-2} + b·x_{t-1} + c·x_t).
    let taps = [0.5f32, -1.0, 2.0];
    let xs = [1.0f32, 2.0, -3.0, 0.5];
    let mut hist = vec![0.0f32; 2];
    let silu = |v: f64| v * sig(v);
    for (t, &x) in xs.iter().enumerate() {
        let out = k3::backend::cpu::conv_silu_step(&taps, &mut hist, &[x], 3);
        let at = |i: isize| {
            if i < 0 {
                0.0
            } else {
                f64::from(xs[i as usize])
            }
        };
        let t = t as isize;
        let want = silu(0.5 * at(t - 2) - 1.0 * at(t - 1) + 2.0 * at(t));
        assert!(
            (f64::from(out[0]) - want).abs() < 1e-6,
            "t={t}: {} vs {want}",
            out[0]
        );
    }
}

/// Direct formulation of KDA over a whole sequence: explicit convolution over the full
/// input history and the delta rule as matrices, `S_t = (I − β k kᵀ) diag(α) S_{t−1} + β k vᵀ`.
#[allow(clippy::too_many_arguments)]
fn kda_direct(
    d: &KdaDims,
    conv: [&[f32]; 3],
    a_log: &[f32],
    dt_bias: &[f32],
    o_norm: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    f: &[f32],
    beta: &[f32],
    gate: &[f32],
    n: usize,
) -> Vec<f64> {
    let (p, dk, kk) = (d.width(), d.head_dim, d.conv_k);
    let conv_at = |w: &[f32], x: &[f32], t: usize, c: usize| {
        let mut acc = 0.0f64;
        for j in 0..kk {
            let src = t as isize - (kk as isize - 1) + j as isize;
            if src >= 0 {
                acc += f64::from(w[c * kk + j]) * f64::from(x[src as usize * p + c]);
            }
        }
        acc * sig(acc)
    };
    let mut s = vec![vec![vec![0.0f64; dk]; dk]; d.heads];
    let mut out = vec![0.0f64; n * p];
    for t in 0..n {
        for h in 0..d.heads {
            let ch = |x: &[f32], w: &[f32]| -> Vec<f64> {
                (0..dk).map(|i| conv_at(w, x, t, h * dk + i)).collect()
            };
            let (mut qh, mut kh, vh) = (ch(q, conv[0]), ch(k, conv[1]), ch(v, conv[2]));
            let nq = (qh.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
            let nk = (kh.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
            qh.iter_mut().for_each(|x| *x /= nq * (dk as f64).sqrt());
            kh.iter_mut().for_each(|x| *x /= nk);
            let a = f64::from(a_log[h]).exp();
            let alpha: Vec<f64> = (0..dk)
                .map(|i| {
                    let z = f64::from(f[t * p + h * dk + i]) + f64::from(dt_bias[h * dk + i]);
                    (f64::from(d.lower_bound.unwrap()) * sig(a * z)).exp()
                })
                .collect();
            let b = sig(f64::from(beta[t * d.heads + h]));
            // A = (I − β k kᵀ) diag(α)
            let sh = &mut s[h];
            let mut next = vec![vec![0.0f64; dk]; dk];
            for r in 0..dk {
                for c in 0..dk {
                    let mut acc = 0.0;
                    for m in 0..dk {
                        let id = if r == m { 1.0 } else { 0.0 };
                        acc += (id - b * kh[r] * kh[m]) * alpha[m] * sh[m][c];
                    }
                    next[r][c] = acc + b * kh[r] * vh[c];
                }
            }
            *sh = next;
            let o: Vec<f64> = (0..dk)
                .map(|c| (0..dk).map(|r| sh[r][c] * qh[r]).sum())
                .collect();
            let rms =
                (o.iter().map(|x| x * x).sum::<f64>() / dk as f64 + f64::from(d.norm_eps)).sqrt();
            for c in 0..dk {
                let g = sig(f64::from(gate[t * p + h * dk + c]));
                out[t * p + h * dk + c] = o[c] / rms * f64::from(o_norm[c]) * g;
            }
        }
    }
    out
}

#[test]
fn kda_step_matches_direct_matrix_formulation() {
    let mut rng = StdRng::seed_from_u64(7);
    let d = KdaDims {
        heads: 3,
        head_dim: 8,
        conv_k: 4,
        lower_bound: Some(-5.0),
        norm_eps: 1e-5,
    };
    let (p, n) = (d.width(), 7);
    let conv: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, p * 4, 0.7)).collect();
    let a_log = randn(&mut rng, 3, 1.0);
    let dt_bias = randn(&mut rng, p, 0.3);
    let o_norm: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
    let [q, k, v, f, gate] = std::array::from_fn(|_| randn(&mut rng, n * p, 1.0));
    let beta = randn(&mut rng, n * 3, 2.0);
    let want = kda_direct(
        &d,
        [&conv[0], &conv[1], &conv[2]],
        &a_log,
        &dt_bias,
        &o_norm,
        &q,
        &k,
        &v,
        &f,
        &beta,
        &gate,
        n,
    );
    let b = CpuBackend::new();
    let w = KdaStepWeights {
        conv_q: act(conv[0].clone(), 1, p * 4),
        conv_k: act(conv[1].clone(), 1, p * 4),
        conv_v: act(conv[2].clone(), 1, p * 4),
        a_log: act(a_log.clone(), 1, 3),
        dt_bias: act(dt_bias.clone(), 1, p),
        o_norm: act(o_norm.clone(), 1, 8),
    };
    // Whole sequence at once, and split 3 + 4 through the carried state: both equal the direct form.
    let mk = |x: &[f32], r: std::ops::Range<usize>, c: usize| {
        act(x[r.start * c..r.end * c].to_vec(), r.len(), c)
    };
    let run = |ranges: &[std::ops::Range<usize>]| {
        let mut st = b.kda_state(&d).unwrap();
        let mut out = Vec::new();
        for r in ranges {
            let (qa, ka, va, fa, ba, ga) = (
                mk(&q, r.clone(), p),
                mk(&k, r.clone(), p),
                mk(&v, r.clone(), p),
                mk(&f, r.clone(), p),
                mk(&beta, r.clone(), 3),
                mk(&gate, r.clone(), p),
            );
            let o = b
                .kda_step(
                    &d,
                    &w,
                    &mut st,
                    KdaStepInputs {
                        q: &qa,
                        k: &ka,
                        v: &va,
                        f: &fa,
                        beta: &ba,
                        gate: &ga,
                    },
                )
                .unwrap();
            out.extend(o.data);
        }
        out
    };
    let whole = run(std::slice::from_ref(&(0..n)));
    let split = run(&[0..3, 3..n]);
    assert!(
        rel_l2(&whole, &want) < 1e-5,
        "rel L2 {}",
        rel_l2(&whole, &want)
    );
    assert_eq!(
        whole, split,
        "state carried across calls must give identical results"
    );
}

#[test]
fn absorbed_mla_equals_unabsorbed() {
    let mut rng = StdRng::seed_from_u64(3);
    let d = MlaDims {
        heads: 3,
        kv_lora: 16,
        nope: 8,
        rope: 4,
        v: 6,
        norm_eps: 1e-5,
    };
    let n = 5;
    let qw = d.nope + d.rope;
    let q = randn(&mut rng, n * d.heads * qw, 1.0);
    let c = randn(&mut rng, n * (d.kv_lora + d.rope), 1.0);
    let kv_norm: Vec<f32> = randn(&mut rng, d.kv_lora, 0.3)
        .iter()
        .map(|x| 1.0 + x)
        .collect();
    let wk = randn(&mut rng, d.heads * d.nope * d.kv_lora, 0.3);
    let wv = randn(&mut rng, d.heads * d.v * d.kv_lora, 0.3);
    let b = CpuBackend::new();
    let w = MlaAttnWeights {
        kv_norm: act(kv_norm.clone(), 1, d.kv_lora),
        wk: act(wk.clone(), d.heads * d.nope, d.kv_lora),
        wv: act(wv.clone(), d.heads * d.v, d.kv_lora),
    };
    let mut cache = b.mla_cache(&d).unwrap();
    let got = b
        .mla_attend(
            &d,
            &w,
            &mut cache,
            &act(q.clone(), n, d.heads * qw),
            &act(c.clone(), n, d.kv_lora + d.rope),
        )
        .unwrap();
    // Un-absorbed: materialize K = Wk·L and V = Wv·L per head and position.
    let cw = d.kv_lora + d.rope;
    let lat: Vec<Vec<f64>> = (0..n)
        .map(|t| {
            let l = &c[t * cw..t * cw + d.kv_lora];
            let ms = l.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / d.kv_lora as f64;
            let r = 1.0 / (ms + 1e-5).sqrt();
            l.iter()
                .zip(&kv_norm)
                .map(|(&x, &g)| f64::from(x) * r * f64::from(g))
                .collect()
        })
        .collect();
    let mut want = vec![0.0f64; n * d.heads * d.v];
    for t in 0..n {
        for h in 0..d.heads {
            let kvec = |s: usize| -> Vec<f64> {
                (0..d.nope)
                    .map(|i| {
                        (0..d.kv_lora)
                            .map(|j| f64::from(wk[(h * d.nope + i) * d.kv_lora + j]) * lat[s][j])
                            .sum()
                    })
                    .collect()
            };
            let vvec = |s: usize| -> Vec<f64> {
                (0..d.v)
                    .map(|i| {
                        (0..d.kv_lora)
                            .map(|j| f64::from(wv[(h * d.v + i) * d.kv_lora + j]) * lat[s][j])
                            .sum()
                    })
                    .collect()
            };
            let qt = &q[(t * d.heads + h) * qw..(t * d.heads + h + 1) * qw];
            let scores: Vec<f64> = (0..=t)
                .map(|s| {
                    let kv = kvec(s);
                    let nope: f64 = (0..d.nope).map(|i| f64::from(qt[i]) * kv[i]).sum();
                    let rope: f64 = (0..d.rope)
                        .map(|i| f64::from(qt[d.nope + i]) * f64::from(c[s * cw + d.kv_lora + i]))
                        .sum();
                    (nope + rope) / (qw as f64).sqrt()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (s, es) in e.iter().enumerate() {
                let vv = vvec(s);
                for i in 0..d.v {
                    want[(t * d.heads + h) * d.v + i] += es / z * vv[i];
                }
            }
        }
    }
    assert!(
        rel_l2(&got.data, &want) < 1e-5,
        "rel L2 {}",
        rel_l2(&got.data, &want)
    );
    assert_eq!(cache.len, n);
}

#[test]
fn router_ties_go_to_lower_id_and_bias_only_selects() {
    let b = CpuBackend::new();
    let p = RouterParams {
        top_k: 2,
        renormalize: true,
        scaling: 1.0,
    };
    // Experts 1, 2, 3 tie; the lower ids win.
    let logits = act(vec![-1.0, 0.5, 0.5, 0.5], 1, 4);
    let r = b.router_topk(&logits, &[0.0; 4], p).unwrap();
    assert_eq!(r[0].iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!((r[0][0].1 - 0.5).abs() < 1e-7 && (r[0][1].1 - 0.5).abs() < 1e-7);
    // A bias pulls expert 0 in, but its weight comes from its unbiased score.
    let r = b.router_topk(&logits, &[1.0, 0.0, 0.0, 0.0], p).unwrap();
    assert_eq!(r[0][0].0, 0);
    let (s0, s1) = (sig(-1.0), sig(0.5));
    assert!((f64::from(r[0][0].1) - s0 / (s0 + s1)).abs() < 1e-6);
    assert!((f64::from(r[0][1].1) - s1 / (s0 + s1)).abs() < 1e-6);
    // Scaling without renormalization.
    let p2 = RouterParams {
        top_k: 1,
        renormalize: false,
        scaling: 2.5,
    };
    let r = b.router_topk(&logits, &[0.0; 4], p2).unwrap();
    assert!((f64::from(r[0][0].1) - 2.5 * s1).abs() < 1e-6);
    assert!(
        b.router_topk(&logits, &[0.0; 3], p).is_err(),
        "bias length is checked"
    );
}

#[test]
fn attn_res_mix_matches_direct_formula() {
    let mut rng = StdRng::seed_from_u64(11);
    let (rows, cols) = (3, 10);
    let bank: Vec<CpuAct> = (0..3)
        .map(|_| act(randn(&mut rng, rows * cols, 2.0), rows, cols))
        .collect();
    let cur = act(randn(&mut rng, rows * cols, 2.0), rows, cols);
    let w = act(randn(&mut rng, cols, 1.0), 1, cols);
    let refs: Vec<&CpuAct> = bank.iter().collect();
    let got = CpuBackend::new()
        .attn_res_mix(&refs, &cur, &w, 1e-5)
        .unwrap();
    let mut want = vec![0.0f64; rows * cols];
    for r in 0..rows {
        let entries: Vec<&[f32]> = bank.iter().map(|b| b.row(r)).chain([cur.row(r)]).collect();
        let scores: Vec<f64> = entries
            .iter()
            .map(|e| {
                let ms = e.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / cols as f64;
                e.iter()
                    .zip(&w.data)
                    .map(|(&x, &wv)| f64::from(x) / (ms + 1e-5).sqrt() * f64::from(wv))
                    .sum()
            })
            .collect();
        let z: f64 = scores.iter().map(|s| s.exp()).sum();
        for (e, s) in entries.iter().zip(&scores) {
            for c in 0..cols {
                want[r * cols + c] += s.exp() / z * f64::from(e[c]);
            }
        }
    }
    assert!(
        rel_l2(&got.data, &want) < 1e-6,
        "rel L2 {}",
        rel_l2(&got.data, &want)
    );
    // With an empty bank the mix is the identity.
    let only = CpuBackend::new().attn_res_mix(&[], &cur, &w, 1e-5).unwrap();
    assert_eq!(only.data, cur.data);
}
