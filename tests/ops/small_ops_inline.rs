//! A decode step's small ops run on the calling thread: with every worker of the pool held
//! busy they still finish, where a hand-off to the pool would wait for a free worker.

use k3::backend::cpu::{CpuAct, CpuBackend};
use k3::backend::{Backend, Glu, KdaDims, KdaStepInputs, KdaStepWeights, MlaAttnWeights, MlaDims};
use k3::quant::{DenseFormat, DenseMatrix};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

fn act(rows: usize, cols: usize, seed: usize) -> CpuAct {
    let data = (0..rows * cols)
        .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.5)
        .collect();
    CpuAct::new(data, rows, cols).unwrap()
}

/// A 64x64 matrix in each dense format (built before the pool is held: quantizing is a
/// load-time step that may use it).
fn matrices() -> Vec<DenseMatrix> {
    [
        DenseFormat::F32,
        DenseFormat::Bf16,
        DenseFormat::Int8,
        DenseFormat::Int4,
    ]
    .into_iter()
    .map(|fmt| DenseMatrix::from_f32(64, 64, act(64, 64, 2).data, fmt).unwrap())
    .collect()
}

/// Every op a decode step of a small model runs, on one and on four rows.
fn small_ops(mats: &[DenseMatrix]) {
    let b = CpuBackend::new();
    for rows in [1, 4] {
        let x = act(rows, 64, 1);
        for w in mats {
            b.matmul(w, &x).unwrap();
        }
        let w = act(1, 64, 3);
        b.rmsnorm(&x, &w, 64, 1e-5).unwrap();
        b.attn_res_mix(&[&act(rows, 64, 4)], &x, &w, 1e-5).unwrap();
        b.add(&x, &x).unwrap();
        let situ = Glu::Situ {
            beta: 4.0,
            linear_beta: 25.0,
        };
        b.glu(&x, &x, situ).unwrap();

        let d = KdaDims {
            heads: 2,
            head_dim: 32,
            conv_k: 4,
            lower_bound: Some(-5.0),
            norm_eps: 1e-5,
        };
        let p = d.width();
        let kw = KdaStepWeights {
            conv_q: act(1, p * 4, 5),
            conv_k: act(1, p * 4, 6),
            conv_v: act(1, p * 4, 7),
            a_log: act(1, 2, 8),
            dt_bias: act(1, p, 9),
            o_norm: act(1, 32, 10),
        };
        let (q, beta) = (act(rows, p, 11), act(rows, 2, 12));
        let inputs = KdaStepInputs {
            q: &q,
            k: &q,
            v: &q,
            f: &q,
            beta: &beta,
            gate: &q,
        };
        let mut st = b.kda_state(&d).unwrap();
        b.kda_step(&d, &kw, &mut st, inputs).unwrap();

        let m = MlaDims {
            heads: 2,
            kv_lora: 32,
            nope: 16,
            rope: 8,
            v: 16,
            norm_eps: 1e-5,
        };
        let mw = MlaAttnWeights {
            kv_norm: act(1, 32, 13),
            wk: act(2 * 16, 32, 14),
            wv: act(2 * 16, 32, 15),
        };
        let mut cache = b.mla_cache(&m).unwrap();
        let (mq, mc) = (act(rows, 2 * 24, 16), act(rows, 40, 17));
        b.mla_attend(&m, &mw, &mut cache, &mq, &mc).unwrap();
    }
}

#[test]
fn small_ops_finish_while_every_pool_worker_is_busy() {
    let mats = matrices();
    let workers = rayon::current_num_threads();
    let hold = Arc::new(Mutex::new(()));
    let held = Arc::new(AtomicUsize::new(0));
    let guard = hold.lock().unwrap();
    {
        let (hold, held) = (hold.clone(), held.clone());
        rayon::spawn_broadcast(move |_| {
            held.fetch_add(1, Ordering::SeqCst);
            drop(hold.lock());
        });
    }
    let start = Instant::now();
    while held.load(Ordering::SeqCst) < workers {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the pool's workers never all started"
        );
        std::thread::yield_now();
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        small_ops(&mats);
        let _ = tx.send(());
    });
    let done = rx.recv_timeout(Duration::from_secs(10));
    // Free the workers before judging, so a failure leaves the pool usable.
    drop(guard);
    assert!(
        done.is_ok(),
        "a small op waited for a pool worker instead of running on its own thread"
    );
}
