//! A rank of an expert-parallel job opens only its share of the snapshot
//! (`Checkpoint::open_part`, `ranks::setup::files_of_rank`): from a directory holding the
//! config, the index and its shards alone, every expert it owns is there, no other file is
//! opened, and a model of its experts only loads no dense weight and refuses a forward pass.

use crate::support;

use k3::backend::cpu::CpuBackend;
use k3::checkpoint::shards::{index_map, INDEX_FILE};
use k3::checkpoint::{Checkpoint, CONFIG_FILE};
use k3::model::{K3Model, Logits};
use k3::ranks::placement::Placement;
use k3::ranks::setup::files_of_rank;
use k3::stats::Stats;

#[test]
fn a_rank_opens_its_share_alone_and_a_worker_model_has_no_dense_weights() {
    let full = support::tiny(0);
    let index = index_map(&full).unwrap().unwrap();
    let ck = Checkpoint::open(&full, &[]).unwrap();
    let placement = Placement::balanced(ck.config.num_experts, 2).unwrap();
    let own = files_of_rank(&index, &placement, 1);
    assert!(!own.is_empty() && own.len() < ck.shard_count(), "{own:?}");
    let tmp = tempfile::tempdir().unwrap();
    for f in own
        .iter()
        .map(String::as_str)
        .chain([CONFIG_FILE, INDEX_FILE])
    {
        std::fs::copy(full.join(f), tmp.path().join(f)).unwrap();
    }
    // The whole snapshot cannot be opened from the share: it lacks files.
    let e = format!("{:#}", Checkpoint::open(tmp.path(), &[]).err().unwrap());
    assert!(e.contains("not found"), "{e}");
    let part = Checkpoint::open_part(tmp.path(), &[], Some(&own)).unwrap();
    assert_eq!(part.shard_count(), own.len());
    for (layer, id, _) in ck.experts().iter() {
        let owned = placement.owner(layer, id as u32) == 1;
        if owned {
            assert!(
                part.experts().get(layer, id).is_some(),
                "layer {layer} expert {id}"
            );
        }
    }
    let m = K3Model::experts_only(part, CpuBackend::default()).unwrap();
    assert!(
        m.startup().line().contains("no dense weights"),
        "{}",
        m.startup().line()
    );
    let settings = k3::model::RuntimeSettings::default();
    let rt = k3::model::Runtime::new(&m.ckpt.config, &m.backend, settings).unwrap();
    let mut st = m.new_state().unwrap();
    let got = m.forward(
        &rt,
        &mut st,
        &[1],
        Logits::Last,
        &mut Stats::default(),
        None,
    );
    assert!(
        got.is_err(),
        "a model of routed experts only ran a forward pass"
    );
}
