//! No silent garbage on the GPU: a non-finite hidden state is named by the MoE layer whose
//! router first sees it (the router's readback is the one the GPU already makes).

use crate::support;

use k3::backend::gpu::GpuOptions;
use k3::checkpoint::Checkpoint;
use k3::experts::ExpertReader;
use k3::generate::prefill;
use k3::model::{FormatPolicy, K3Model, Runner, State};
use k3::stats::Stats;

const PROMPT: [u32; 6] = [768, 5, 300, 17, 999, 42];

#[test]
fn a_non_finite_hidden_state_on_the_gpu_names_the_moe_layer() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let layer = (0..ck.config.num_hidden_layers)
        .find(|&l| ExpertReader::locate(&ck, l, 0).is_ok())
        .unwrap();
    let copy = support::with_nan_tensor(&format!("model.layers.{layer}.input_layernorm.weight"));
    let Some(g) = support::gpu_backend(GpuOptions::default()) else {
        return;
    };
    let ck = Checkpoint::open(copy.path(), &[]).unwrap();
    let m = K3Model::load(ck, g, FormatPolicy::default(), false).unwrap();
    let m = Runner::new(m, support::stream_settings(support::serial_stream())).unwrap();
    let mut st = m.new_state().unwrap();
    let e = prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None).unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains(&format!("layer {layer} (MoE)")),
        "the layer is not named: {msg}"
    );
    assert!(msg.contains("non-finite value (NaN or Inf)"), "{msg}");
}

/// A step of several sequences whose logits are not finite (NaN in the final norm) is
/// refused naming the first segment and its position, as one sequence's step names its own.
#[test]
fn non_finite_logits_of_a_batch_name_the_first_segment() {
    let copy = support::with_nan_tensor("model.norm.weight");
    let Some(m) = support::gpu_model(copy.path(), GpuOptions::default(), support::serial_stream())
    else {
        return;
    };
    let mut states: Vec<State<_>> = (0..3).map(|_| m.new_state().unwrap()).collect();
    let ids = [[5u32], [300], [17]];
    let mut segs = support::last_row_segments(&mut states, &ids);
    let e = m
        .forward_batch(&mut segs, &mut Stats::default(), None, None)
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("the logits hold a non-finite value (NaN or Inf) at position 0 of the context of segment 0"),
        "{msg}"
    );
}
