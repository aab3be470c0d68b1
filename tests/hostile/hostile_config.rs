//! Hostile or broken `config.json` values: each is refused with an error naming the field and
//! the value, before any allocation that depends on it (issue rows: layers and experts of
//! 2^32 and beyond, a config of hundreds of MB, non-finite or absurd floats, head counts whose
//! products wrap).

use crate::support;

use support::tiny_ckpt;

use k3::config::Config;
use serde_json::{json, Value};
use tiny_ckpt::tiny_config_json;

fn refused(edit: impl FnOnce(&mut Value)) -> String {
    let mut cfg = tiny_config_json();
    edit(&mut cfg);
    match Config::from_json_str(&cfg.to_string(), "config.json") {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => format!("{e:#}"),
    }
}

fn text(cfg: &mut Value) -> &mut Value {
    &mut cfg["text_config"]
}

#[test]
fn huge_layer_counts_are_refused_naming_the_field() {
    for v in [
        json!(1_000_000_000u64),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!(1u64 << 62),
        json!(u64::MAX),
    ] {
        let e = refused(|c| text(c)["num_hidden_layers"] = v.clone());
        assert!(e.contains("text_config.num_hidden_layers"), "{e}");
        assert!(e.contains("out of range"), "{e}");
    }
}

#[test]
fn huge_expert_counts_are_refused_naming_the_field() {
    for v in [
        json!(1_000_000u64),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!(1u64 << 62),
        json!(u64::MAX),
    ] {
        let e = refused(|c| text(c)["num_experts"] = v.clone());
        assert!(e.contains("text_config.num_experts"), "{e}");
        assert!(e.contains("out of range"), "{e}");
    }
}

#[test]
fn many_layers_times_many_experts_is_refused() {
    let e = refused(|c| {
        let t = text(c);
        t["num_hidden_layers"] = json!(1000);
        t["num_experts"] = json!(60000);
        let all: Vec<u64> = (1..=1000).collect();
        t["linear_attn_config"]["kda_layers"] = json!(all);
        t["linear_attn_config"]["full_attn_layers"] = json!([]);
    });
    assert!(e.contains("routed experts"), "{e}");
}

#[test]
fn head_counts_whose_products_would_wrap_are_refused() {
    let e = refused(|c| text(c)["num_attention_heads"] = json!((1u64 << 61) + 2));
    assert!(e.contains("text_config.num_attention_heads"), "{e}");
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn absurd_floats_are_refused() {
    for (field, v) in [
        ("routed_scaling_factor", 1e308),
        ("rms_norm_eps", 5.0),
        ("activation_situ_beta", 1e30),
    ] {
        let e = refused(|c| text(c)[field] = json!(v));
        assert!(e.contains(&format!("text_config.{field}")), "{e}");
        assert!(e.contains("out of range"), "{e}");
    }
    let e = refused(|c| text(c)["linear_attn_config"]["gate_lower_bound"] = json!(-1e9));
    assert!(e.contains("gate_lower_bound"), "{e}");
}

#[test]
fn an_oversized_config_file_is_refused_before_it_is_parsed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    // A list of ints of over 4 MB, as in the hostile case (there 200 MB).
    let ints: Vec<String> = (0..1_000_000).map(|i| i.to_string()).collect();
    std::fs::write(&path, format!("[{}]", ints.join(","))).unwrap();
    let e = format!("{:#}", Config::from_file(&path).unwrap_err());
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains("too large for a model config"), "{e}");
}

#[test]
fn kimi_k3_sized_values_still_pass() {
    let mut cfg = tiny_config_json();
    let t = text(&mut cfg);
    t["hidden_size"] = json!(7168);
    t["num_experts"] = json!(896);
    t["num_experts_per_token"] = json!(16);
    t["routed_expert_hidden_size"] = json!(7168);
    t["moe_intermediate_size"] = json!(3072);
    t["vocab_size"] = json!(163840);
    Config::from_json_str(&cfg.to_string(), "config.json").unwrap();
}

#[test]
fn special_token_ids_outside_the_vocabulary_are_refused_naming_the_field() {
    // tiny: vocab_size 32.
    for id in [json!(32), json!(1_000_000_000u64)] {
        for field in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            let e = refused(|c| c[field] = id.clone());
            assert!(
                e.contains(field) && e.contains("not below vocab_size 32"),
                "{field} = {id}: {e}"
            );
        }
        let e = refused(|c| c["eos_token_id"] = json!([2, id.clone()]));
        assert!(
            e.contains("eos_token_id") && e.contains("vocab_size"),
            "{e}"
        );
    }
    let e = refused(|c| {
        c.as_object_mut().unwrap().remove("eos_token_id");
        text(c)["eos_token_id"] = json!(40);
    });
    assert!(e.contains("text_config.eos_token_id"), "{e}");
}
