//! The memory-pressure guard on a whole model: a simulated critical signal (the same
//! `PressureSource` trait the macOS dispatch source and Linux PSI implement) halves the
//! host expert cache at the next forward pass, once per settle period, and the logits stay
//! those of a run without pressure (a smaller cache changes what is read, not the result).

use crate::support;

use k3::experts::cache::pressure_guard::{CacheSize, PressureGuard, POLL_EVERY};
use k3::experts::{IoMode, StreamConfig};
use k3::model::{FormatPolicy, Logits, Runner, RuntimeSettings};
use k3::platform::memory_pressure::{PressureLevel, PressureSource};
use k3::stats::Stats;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Critical once the test raises it, normal before.
struct Raised(Arc<AtomicBool>);

impl PressureSource for Raised {
    fn level(&self) -> (PressureLevel, String) {
        if self.0.load(Ordering::SeqCst) {
            (PressureLevel::Critical, "simulated".into())
        } else {
            (PressureLevel::Normal, "simulated".into())
        }
    }
}

const PROMPT: [u32; 6] = [768, 5, 300, 17, 999, 42];

/// The tiny model with a host cache of 4 slots a layer, watched by `pressure`.
fn model(pressure: Option<PressureGuard>) -> Runner<k3::backend::cpu::CpuBackend> {
    support::cpu_model_with(
        &support::tiny(0),
        FormatPolicy::default(),
        RuntimeSettings {
            pressure,
            ..support::stream_settings(StreamConfig {
                mode: IoMode::Buffered,
                pipe: false,
                load_threads: 1,
                slots_per_layer: 4,
            })
        },
    )
}

/// The logits of every prompt token; with `raise`, the pressure is raised after the third
/// token, when the layer caches already hold experts (and the guard may poll again).
fn run(m: &Runner<k3::backend::cpu::CpuBackend>, raise: Option<&AtomicBool>) -> Vec<f32> {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut all = Vec::new();
    for (i, &t) in PROMPT.iter().enumerate() {
        if i == 3 {
            if let Some(r) = raise {
                assert_eq!(m.rt.experts().slots_per_layer(), 4);
                r.store(true, Ordering::SeqCst);
                std::thread::sleep(POLL_EVERY);
            }
        }
        all.extend(
            m.forward(&mut st, &[t], Logits::Last, &mut stats, None)
                .unwrap(),
        );
    }
    all
}

#[test]
fn a_critical_signal_halves_the_host_cache_and_keeps_the_logits() {
    let want = run(&model(None), None);
    let raised = Arc::new(AtomicBool::new(false));
    let guard = PressureGuard::new(Box::new(Raised(raised.clone())), CacheSize::PerLayer(4), 1);
    let pressed = model(Some(guard));
    let got = run(&pressed, Some(&raised));
    // One cut at the first pass after the raise; the next waits for the signal to settle (10 s).
    assert_eq!(pressed.rt.experts().slots_per_layer(), 2);
    assert_eq!(
        pressed.rt.pressure_cache_size(),
        Some(CacheSize::PerLayer(2))
    );
    assert_eq!(got, want);
    assert!(got.iter().all(|v| v.is_finite()));
}
