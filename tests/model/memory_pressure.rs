//! The memory-pressure guard on a whole model: a simulated critical signal (the same
//! `PressureSource` trait the macOS dispatch source and Linux PSI implement) halves the
//! host expert cache at the next forward pass, once per settle period, and the logits stay
//! those of a run without pressure (a smaller cache changes what is read, not the result).

use crate::support;

use k3::experts::cache::pressure_guard::{CacheSize, PressureGuard};
use k3::experts::{IoMode, StreamConfig};
use k3::model::{FormatPolicy, K3Model, Logits};
use k3::platform::memory_pressure::{PressureLevel, PressureSource};
use k3::stats::Stats;

struct AlwaysCritical;

impl PressureSource for AlwaysCritical {
    fn level(&self) -> (PressureLevel, String) {
        (PressureLevel::Critical, "simulated".into())
    }
}

const PROMPT: [u32; 6] = [768, 5, 300, 17, 999, 42];

fn model() -> K3Model<k3::backend::cpu::CpuBackend> {
    support::cpu_model(
        &support::tiny(0),
        FormatPolicy::default(),
        StreamConfig {
            mode: IoMode::Buffered,
            pipe: false,
            load_threads: 1,
            slots_per_layer: 4,
        },
    )
}

/// The logits of every prompt token; with `guard`, installed after the third token, when
/// the layer caches already hold experts.
fn run(
    m: &mut K3Model<k3::backend::cpu::CpuBackend>,
    mut guard: Option<PressureGuard>,
) -> Vec<f32> {
    let mut st = m.new_state().unwrap();
    let mut stats = Stats::default();
    let mut all = Vec::new();
    for (i, &t) in PROMPT.iter().enumerate() {
        if i == 3 {
            if let Some(g) = guard.take() {
                assert_eq!(m.experts().slots_per_layer(), 4);
                m.set_pressure_guard(Some(g));
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
    let want = run(&mut model(), None);
    let mut pressed = model();
    let guard = PressureGuard::new(Box::new(AlwaysCritical), CacheSize::PerLayer(4), 1);
    let got = run(&mut pressed, Some(guard));
    // One cut at the first pass; the next waits for the signal to settle (10 s).
    assert_eq!(pressed.experts().slots_per_layer(), 2);
    assert_eq!(pressed.pressure_cache_size(), Some(CacheSize::PerLayer(2)));
    assert_eq!(got, want);
    assert!(got.iter().all(|v| v.is_finite()));
}
