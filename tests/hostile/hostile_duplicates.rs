//! Duplicates and overlaps: a key given twice in any JSON file k3 trusts (config, shard
//! index, shard header, tokenizer files) and two tensors over the same bytes of a shard are
//! refused naming both entries, instead of the last one silently winning.

use crate::support;

use k3::checkpoint::shards::{parse_header, parse_index};
use k3::config::Config;
use k3::tokenizer::special::parse_added_tokens;
use k3::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::path::Path;

/// A safetensors file of `header` JSON followed by `data` bytes.
fn shard(header: &str, data: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data, 0);
    b
}

fn header_err(header: &str, data: usize) -> String {
    let mut entries = HashMap::new();
    match parse_header(
        0,
        &shard(header, data),
        Path::new("s.safetensors"),
        &mut entries,
    ) {
        Ok(()) => "accepted".to_string(),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn a_config_key_given_twice_is_refused_naming_it() {
    let mut text = support::tiny_ckpt::tiny_config_json().to_string();
    // A top-level key again, at the end, with another value.
    text.truncate(text.len() - 1);
    text.push_str(r#", "eos_token_id": 3}"#);
    let e = format!(
        "{:#}",
        Config::from_json_str(&text, "config.json").unwrap_err()
    );
    assert!(
        e.contains("config.json")
            && e.contains("key `eos_token_id` appears twice in the top-level object"),
        "{e}"
    );
}

#[test]
fn a_tensor_listed_twice_in_the_index_is_refused_naming_it() {
    let text = r#"{"weight_map": {"model.norm.weight": "a.safetensors",
        "model.norm.weight": "b.safetensors"}}"#;
    let e = format!(
        "{:#}",
        parse_index(text, Path::new("index.json")).unwrap_err()
    );
    assert!(
        e.contains("index.json")
            && e.contains("key `model.norm.weight` appears twice in `weight_map`"),
        "{e}"
    );
}

#[test]
fn a_tensor_listed_twice_in_a_shard_header_is_refused_naming_it() {
    let h = r#"{"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}"#;
    let e = header_err(h, 16);
    assert!(
        e.contains("s.safetensors") && e.contains("key `model.norm.weight` appears twice"),
        "{e}"
    );
}

#[test]
fn overlapping_tensor_byte_ranges_are_refused_naming_both() {
    let h = r#"{"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "model.embed_tokens.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}"#;
    let e = header_err(h, 24);
    assert!(
        e.contains("`model.norm.weight`")
            && e.contains("`model.embed_tokens.weight`")
            && e.contains("overlap"),
        "{e}"
    );
    // Adjacent ranges and empty tensors are fine.
    let ok = r#"{"a.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b.w": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "c.w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}"#;
    assert_eq!(header_err(ok, 16), "accepted");
}

#[test]
fn a_token_given_twice_in_tokenizer_files_is_refused_naming_it() {
    let cfg = r#"{"added_tokens_decoder": {"300": {"content": "<|a|>", "special": true},
        "300": {"content": "<|b|>", "special": true}}}"#;
    let e = format!(
        "{:#}",
        parse_added_tokens(cfg, Path::new("tokenizer_config.json")).unwrap_err()
    );
    assert!(
        e.contains("tokenizer_config.json") && e.contains("key `300` appears twice"),
        "{e}"
    );
    let json = br#"{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "a": 2}, "merges": []}}"#;
    let e = format!(
        "{:#}",
        Tokenizer::from_hf_json_bytes(json, Path::new("tokenizer.json")).unwrap_err()
    );
    assert!(
        e.contains("tokenizer.json") && e.contains("key `a` appears twice in `model.vocab`"),
        "{e}"
    );
}
