//! The context a conversation may hold: the checkpoint's `max_position_embeddings` when its
//! config states one, else 131072, unless `--max-tokens` says otherwise; the start-up line
//! says which and what the MLA cache costs a token.

use crate::support;

use k3::config::Config;
use serde_json::json;
use std::process::Command;
use support::tiny_ckpt;

fn parse(cfg: serde_json::Value) -> anyhow::Result<Config> {
    Config::from_json_str(&cfg.to_string(), "config.json")
}

#[test]
fn max_position_embeddings_is_read_from_the_text_config_or_the_root() {
    let base = tiny_ckpt::tiny_config_json();
    assert_eq!(parse(base.clone()).unwrap().max_position_embeddings, None);
    let mut root = base.clone();
    root["max_position_embeddings"] = json!(262144);
    assert_eq!(
        parse(root.clone()).unwrap().max_position_embeddings,
        Some(262144)
    );
    let mut null = base.clone();
    null["max_position_embeddings"] = serde_json::Value::Null;
    assert_eq!(parse(null).unwrap().max_position_embeddings, None);
    for bad in [json!(0), json!("long"), json!(-5)] {
        let mut c = base.clone();
        c["max_position_embeddings"] = bad.clone();
        let e = format!("{:#}", parse(c).unwrap_err());
        assert!(e.contains("max_position_embeddings"), "{bad}: {e}");
    }
}

/// `k3 run` on a copy of the tiny model whose config states `limit` (or nothing).
fn run(limit: Option<usize>, extra: &[&str]) -> String {
    let copy = support::copy_dir(&support::tiny(0));
    if let Some(n) = limit {
        let p = copy.path().join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        cfg["max_position_embeddings"] = json!(n);
        std::fs::write(&p, cfg.to_string()).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("run")
        .arg(copy.path())
        .args([
            "--ids",
            "768,5,6,7",
            "--ngen",
            "2",
            "--quiet",
            "--no-weight-cache",
        ])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("K3_EXPERT_GB")
        .env_remove("K3_MAXT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    err
}

#[test]
fn the_start_up_line_names_the_context_and_where_it_comes_from() {
    let err = run(None, &[]);
    assert!(
        err.contains("[K3] context: 131072 tokens (default; the checkpoint's config states no max_position_embeddings) | MLA cache 40 values x 2 layers x 4 B = 0.3 KB a token, 0.04 GB at the full context, allocated as used"),
        "{err}"
    );
    let err = run(Some(2048), &[]);
    assert!(
        err.contains("[K3] context: 2048 tokens (the checkpoint's max_position_embeddings)"),
        "{err}"
    );
    let err = run(Some(2048), &["--max-tokens", "64"]);
    assert!(
        err.contains("[K3] context: 64 tokens (--max-tokens / K3_MAXT)"),
        "{err}"
    );
}
