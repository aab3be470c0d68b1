//! Activations in row parts: a window whose rows a binding of the widest op cannot hold is
//! kept in parts, and every op on it gives what it gives on the same rows in one part
//! (row-independent ops map over the parts, KDA and MLA run them in order, the routed
//! experts join them).

use crate::support;

use k3::backend::gpu::{GpuBackend, GpuOptions, GpuRows};
use k3::backend::{
    Backend, ExpertAssignment, ExpertPayload, Glu, KdaDims, KdaStepInputs, KdaStepWeights,
    MlaAttnWeights, RouterParams,
};
use k3::quant::{DenseFormat, DenseMatrix, Mxfp4View};
use k3::routed_expert::ExpertWeights;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::rel_l2;

/// Parts against one part: the same kernels on fewer rows a call.
const TOL: f64 = 1e-6;

/// Rows of a part in the parted backend.
const PART: usize = 3;

/// A backend that keeps every activation in one part, and one that cuts them into parts of
/// [`PART`] rows; `None` where no adapter exists.
fn backends() -> Option<(GpuBackend, GpuBackend)> {
    let opts = |part_rows| GpuOptions {
        allow_cpu_adapter: true,
        poison_reused: true,
        part_rows,
        ..Default::default()
    };
    let one = support::gpu_backend(opts(None))?;
    let mut parted = support::gpu_backend(opts(Some(PART)))?;
    // A row of a few bytes: the bindings hold far more rows than the asked part rows.
    parted.fit_rows(16);
    assert_eq!(parted.part_rows(), PART);
    Some((one, parted))
}

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let e = rel_l2(got, want);
    assert!(e <= TOL, "{what}: rel L2 {e:e} > {TOL:e}");
}

/// `v` as `[rows, cols]` on both backends.
fn up(b: &(GpuBackend, GpuBackend), v: &[f32], rows: usize, cols: usize) -> (GpuRows, GpuRows) {
    (
        b.0.upload(v, rows, cols).unwrap(),
        b.1.upload(v, rows, cols).unwrap(),
    )
}

/// Both results on the host, the parted one checked to be in parts.
fn both(b: &(GpuBackend, GpuBackend), r: (GpuRows, GpuRows)) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(r.0.parts.len(), 1);
    assert_eq!(r.1.part_sizes(), b.1.part_sizes(r.1.rows));
    (b.0.download(&r.0).unwrap(), b.1.download(&r.1).unwrap())
}

#[test]
fn rows_cross_part_edges_in_uploads_slices_and_concats() {
    let Some((_, g)) = backends() else {
        return;
    };
    let v: Vec<f32> = (0..10 * 5).map(|i| i as f32).collect();
    let x = g.upload(&v, 10, 5).unwrap();
    assert_eq!(x.part_sizes(), vec![3, 3, 3, 1]);
    assert_eq!(g.download(&x).unwrap(), v);
    // Rows 2..8 start inside the first part and end inside the third.
    let s = g.slice_rows(&x, 2, 6).unwrap();
    assert_eq!(s.part_sizes(), vec![3, 3]);
    assert_eq!(g.download(&s).unwrap(), v[2 * 5..8 * 5]);
    let head = g.slice_rows(&x, 0, 2).unwrap();
    let tail = g.slice_rows(&x, 8, 2).unwrap();
    let whole = g.concat_rows(&[&head, &s, &tail]).unwrap();
    assert_eq!(whole.part_sizes(), vec![3, 3, 3, 1]);
    assert_eq!(g.download(&whole).unwrap(), v);
    let z = g.zeros(7, 4).unwrap();
    assert_eq!(z.part_sizes(), vec![3, 3, 1]);
    assert_eq!(g.download(&z).unwrap(), vec![0.0; 28]);
    let e = g.slice_rows(&x, 8, 3).unwrap_err();
    assert!(
        e.to_string().contains("rows 8..11 of a 10-row activation"),
        "{e}"
    );
}

#[test]
fn row_ops_on_parts_match_one_part() {
    let Some(b) = backends() else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(21);
    let (rows, c) = (11, 96);
    let x = rand_vec(&mut rng, rows * c, 2.0);
    let y = rand_vec(&mut rng, rows * c, 2.0);
    let nw = rand_vec(&mut rng, c, 1.0);
    let (x0, x1) = up(&b, &x, rows, c);
    let (y0, y1) = up(&b, &y, rows, c);
    let (w0, w1) = up(&b, &nw, 1, c);
    let (g0, g1) = (&b.0, &b.1);
    let (a, p) = both(&b, (g0.add(&x0, &y0).unwrap(), g1.add(&x1, &y1).unwrap()));
    close("add", &p, &a);
    let (a, p) = both(
        &b,
        (
            g0.sigmoid_gate(&x0, &y0).unwrap(),
            g1.sigmoid_gate(&x1, &y1).unwrap(),
        ),
    );
    close("sigmoid_gate", &p, &a);
    let glu = Glu::Silu;
    let (a, p) = both(
        &b,
        (
            g0.glu(&x0, &y0, glu).unwrap(),
            g1.glu(&x1, &y1, glu).unwrap(),
        ),
    );
    close("glu", &p, &a);
    let (a, p) = both(
        &b,
        (
            g0.rmsnorm(&x0, &w0, c, 1e-6).unwrap(),
            g1.rmsnorm(&x1, &w1, c, 1e-6).unwrap(),
        ),
    );
    close("rmsnorm", &p, &a);
    let (a, p) = both(
        &b,
        (
            g0.attn_res_mix(&[&y0], &x0, &w0, 1e-6).unwrap(),
            g1.attn_res_mix(&[&y1], &x1, &w1, 1e-6).unwrap(),
        ),
    );
    close("attn_res_mix", &p, &a);
    let wm =
        DenseMatrix::from_f32(40, c, rand_vec(&mut rng, 40 * c, 0.5), DenseFormat::F32).unwrap();
    let wn =
        DenseMatrix::from_f32(24, c, rand_vec(&mut rng, 24 * c, 0.5), DenseFormat::Bf16).unwrap();
    let (m0, m1) = (
        g0.load_matrix(wm.clone()).unwrap(),
        g1.load_matrix(wm).unwrap(),
    );
    let (n0, n1) = (
        g0.load_matrix(wn.clone()).unwrap(),
        g1.load_matrix(wn).unwrap(),
    );
    let (a, p) = both(
        &b,
        (g0.matmul(&m0, &x0).unwrap(), g1.matmul(&m1, &x1).unwrap()),
    );
    close("matmul", &p, &a);
    let many0 = g0.matmul_many(&[&m0, &n0], &x0).unwrap();
    let many1 = g1.matmul_many(&[&m1, &n1], &x1).unwrap();
    for (k, (o, q)) in many0.into_iter().zip(many1).enumerate() {
        let (a, p) = both(&b, (o, q));
        close(&format!("matmul_many {k}"), &p, &a);
    }
    let (l0, l1) = up(&b, &rand_vec(&mut rng, rows * 40, 3.0), rows, 40);
    let params = RouterParams {
        top_k: 4,
        renormalize: true,
        scaling: 2.0,
    };
    let bias = rand_vec(&mut rng, 40, 0.1);
    let r0 = g0.router_topk(&l0, &bias, params).unwrap();
    let r1 = g1.router_topk(&l1, &bias, params).unwrap();
    assert_eq!(r1.len(), rows);
    assert_eq!(r1, r0, "router: each row's route, in row order");
    // A weight in parts is refused, named.
    let (_, tall) = up(&b, &rand_vec(&mut rng, 4 * 32, 1.0), 4, 32);
    let e = g1.rmsnorm(&x1, &tall, 32, 1e-6).unwrap_err();
    assert!(
        e.to_string()
            .contains("rmsnorm: the weight (4x32) is in 2 row parts"),
        "{e}"
    );
}

#[test]
fn kda_and_mla_run_the_parts_in_order() {
    let Some(b) = backends() else {
        return;
    };
    let (g0, g1) = (&b.0, &b.1);
    let mut rng = StdRng::seed_from_u64(22);
    let d = KdaDims {
        heads: 2,
        head_dim: 16,
        conv_k: 4,
        lower_bound: Some(-5.0),
        norm_eps: 1e-6,
    };
    let (p, k, h) = (d.width(), d.conv_k, d.heads);
    let wv = crate::gpu_ops::kda_weight_values(&mut rng, &d);
    let weights = |g: &GpuBackend| KdaStepWeights {
        conv_q: g.upload_weight(&wv[0], 1, p * k).unwrap(),
        conv_k: g.upload_weight(&wv[1], 1, p * k).unwrap(),
        conv_v: g.upload_weight(&wv[2], 1, p * k).unwrap(),
        a_log: g.upload_weight(&wv[3], 1, h).unwrap(),
        dt_bias: g.upload_weight(&wv[4], 1, p).unwrap(),
        o_norm: g.upload_weight(&wv[5], 1, d.head_dim).unwrap(),
    };
    let (kw0, kw1) = (weights(g0), weights(g1));
    let (mut s0, mut s1) = (g0.kda_state(&d).unwrap(), g1.kda_state(&d).unwrap());
    // 8 rows cross two part edges; the state carries into the next call of 4.
    for n in [8, 4] {
        let widths = [p, p, p, p, h, p];
        let ins: Vec<(GpuRows, GpuRows)> = widths
            .iter()
            .map(|&w| up(&b, &rand_vec(&mut rng, n * w, 2.0), n, w))
            .collect();
        let i0: Vec<GpuRows> = ins.iter().map(|x| x.0.clone()).collect();
        let i1: Vec<GpuRows> = ins.iter().map(|x| x.1.clone()).collect();
        let o0 = g0
            .kda_step(&d, &kw0, &mut s0, KdaStepInputs::from_slice(&i0).unwrap())
            .unwrap();
        let o1 = g1
            .kda_step(&d, &kw1, &mut s1, KdaStepInputs::from_slice(&i1).unwrap())
            .unwrap();
        let (a, q) = both(&b, (o0, o1));
        close(&format!("kda_step n={n}"), &q, &a);
        close(
            &format!("kda state after n={n}"),
            &g1.kda_state_read(&s1).unwrap(),
            &g0.kda_state_read(&s0).unwrap(),
        );
    }

    let (m, [nw, wk, wv]) = crate::gpu_ops::small_mla(&mut rng);
    let weights = |g: &GpuBackend| MlaAttnWeights {
        kv_norm: g.upload_weight(&nw, 1, m.kv_lora).unwrap(),
        wk: g.upload_weight(&wk, m.heads * m.nope, m.kv_lora).unwrap(),
        wv: g.upload_weight(&wv, m.heads * m.v, m.kv_lora).unwrap(),
    };
    let (mw0, mw1) = (weights(g0), weights(g1));
    // A weight of more rows than a part is still one part.
    assert_eq!(mw1.wk.parts.len(), 1);
    let (mut c0, mut c1) = (g0.mla_cache(&m).unwrap(), g1.mla_cache(&m).unwrap());
    let (qw, cw) = (m.heads * (m.nope + m.rope), m.cache_row());
    for n in [7, 1, 5] {
        let (q0, q1) = up(&b, &rand_vec(&mut rng, n * qw, 1.0), n, qw);
        let (l0, l1) = up(&b, &rand_vec(&mut rng, n * cw, 1.0), n, cw);
        let o0 = g0.mla_attend(&m, &mw0, &mut c0, &q0, &l0).unwrap();
        let o1 = g1.mla_attend(&m, &mw1, &mut c1, &q1, &l1).unwrap();
        let (a, q) = both(&b, (o0, o1));
        close(&format!("mla_attend n={n}"), &q, &a);
    }
    close(
        "mla cache",
        &g1.mla_cache_read(&c1).unwrap(),
        &g0.mla_cache_read(&c0).unwrap(),
    );
    // The weights as activations of the parted backend are in parts: refused, named.
    let parted = MlaAttnWeights {
        kv_norm: g1.upload(&nw, 1, m.kv_lora).unwrap(),
        wk: g1.upload(&wk, m.heads * m.nope, m.kv_lora).unwrap(),
        wv: g1.upload(&wv, m.heads * m.v, m.kv_lora).unwrap(),
    };
    let (q1, l1) = (
        g1.upload(&vec![0.1; qw], 1, qw).unwrap(),
        g1.upload(&vec![0.1; cw], 1, cw).unwrap(),
    );
    let e = g1.mla_attend(&m, &parted, &mut c1, &q1, &l1).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("mla_attend: wk (24x40) is in 8 row parts"),
        "{e}"
    );
}

#[test]
fn the_routed_experts_run_on_the_joined_window_and_the_next_op_cuts_it_again() {
    let Some(b) = backends() else {
        return;
    };
    let (g0, g1) = (&b.0, &b.1);
    let mut rng = StdRng::seed_from_u64(23);
    let (rows, d, i) = (10, 64, 32);
    let mx = |rng: &mut StdRng, r: usize, c: usize| -> (Vec<u8>, Vec<u8>) {
        (
            (0..r * c / 2).map(|_| rng.random::<u8>()).collect(),
            (0..r * c / 32)
                .map(|_| rng.random_range(120u8..134))
                .collect(),
        )
    };
    let mats: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..3)
        .map(|_| [mx(&mut rng, i, d), mx(&mut rng, d, i), mx(&mut rng, i, d)])
        .collect();
    let experts: Vec<ExpertAssignment<'_>> = mats
        .iter()
        .enumerate()
        .map(|(e, m)| ExpertAssignment {
            key: None,
            payload: ExpertPayload::Host(ExpertWeights {
                w1: Mxfp4View::new(i, d, &m[0].0, &m[0].1).unwrap(),
                w2: Mxfp4View::new(d, i, &m[1].0, &m[1].1).unwrap(),
                w3: Mxfp4View::new(i, d, &m[2].0, &m[2].1).unwrap(),
            }),
            // Rows on both sides of every part edge.
            tokens: (0..rows)
                .filter(|t| (t + e) % 3 != 1)
                .map(|t| (t, 0.1 + 0.05 * e as f32))
                .collect(),
        })
        .collect();
    let glu = Glu::Situ {
        beta: 4.0,
        linear_beta: 3.0,
    };
    let (z0, z1) = up(&b, &rand_vec(&mut rng, rows * d, 0.5), rows, d);
    let (mut a0, mut a1) = up(&b, &rand_vec(&mut rng, rows * d, 0.5), rows, d);
    // In two calls, as the model feeds experts while they are read.
    let (first, rest) = experts.split_at(1);
    for batch in [first, rest] {
        g0.moe_accumulate(&mut a0, &z0, batch, glu).unwrap();
        g1.moe_accumulate(&mut a1, &z1, batch, glu).unwrap();
    }
    // The accumulator in parts became one part on the first call (copied once a layer,
    // not once a batch), and the next op beside an activation in parts cuts it again.
    assert_eq!(a1.parts.len(), 1, "the accumulator runs as one part");
    let (a, p) = (g0.download(&a0).unwrap(), g1.download(&a1).unwrap());
    close("moe_accumulate", &p, &a);
    let sum = both(&b, (g0.add(&a0, &z0).unwrap(), g1.add(&a1, &z1).unwrap()));
    close("moe_accumulate, then add", &sum.1, &sum.0);

    // A window whose joined rows exceed a binding is refused, naming the op: rows of
    // 256 B in bindings of 8 KiB take parts of 32 rows; 40 rows do not join.
    let Some(mut small) = support::gpu_backend(GpuOptions {
        allow_cpu_adapter: true,
        max_binding: Some(8192),
        ..Default::default()
    }) else {
        return;
    };
    small.fit_rows(d * 4);
    assert_eq!(small.part_rows(), 32);
    let z = small.zeros(40, d).unwrap();
    let mut acc = small.zeros(40, d).unwrap();
    let one = &experts[..1];
    let e = small.moe_accumulate(&mut acc, &z, one, glu).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("moe_accumulate: 40 rows of 64 values exceed the adapter's binding limit"),
        "{e}"
    );
    // No experts: nothing to join, nothing refused.
    small.moe_accumulate(&mut acc, &z, &[], glu).unwrap();
}

#[test]
fn a_non_finite_route_is_named_by_its_row_among_all_parts() {
    let Some((_, g)) = backends() else {
        return;
    };
    let mut logits = vec![0.5f32; 10 * 8];
    // Row 7: in the third part, its second row.
    logits[7 * 8..8 * 8].fill(f32::NAN);
    let x = g.upload(&logits, 10, 8).unwrap();
    assert!(x.parts.len() > 2);
    let params = RouterParams {
        top_k: 2,
        renormalize: true,
        scaling: 1.0,
    };
    let e = g.router_topk(&x, &[0.0; 8], params).unwrap_err();
    assert!(
        e.to_string()
            .contains("non-finite value (NaN or Inf) in row 7 of"),
        "{e}"
    );
}

#[test]
fn the_widest_row_sets_the_part_rows() {
    let opts = GpuOptions {
        allow_cpu_adapter: true,
        max_binding: Some(8192),
        ..Default::default()
    };
    let Some(mut g) = support::gpu_backend(opts) else {
        return;
    };
    // No model yet: every activation is one part.
    assert_eq!(g.part_rows(), usize::MAX);
    assert_eq!(g.upload(&[0.0; 4000], 1000, 4).unwrap().parts.len(), 1);
    // Rows of 1 KiB in bindings of 8 KiB: parts of 8 rows.
    g.fit_rows(1024);
    assert_eq!(g.part_rows(), 8);
    assert_eq!(g.zeros(20, 4).unwrap().part_sizes(), vec![8, 8, 4]);
}
