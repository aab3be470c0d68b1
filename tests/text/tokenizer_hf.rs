//! Snapshots that ship a Hugging Face `tokenizer.json`: a small byte-level BPE written
//! here, loaded through `Tokenizer::from_dir`, checked against the `tokenizers` crate.

use std::path::Path;

use k3::tokenizer::hf_json::byte_to_char;
use k3::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::{json, Value};

/// Words whose byte-level spellings get chained merges, so the vocabulary holds
/// multi-byte tokens for ASCII, CJK and emoji.
const WORDS: &[&str] = &[
    "the", " the", "hello", " world", "ing", " 你好", "世界", "😀", " token", "izer",
];

/// Added tokens: three special, one not (like K3's `<|open|>` family in reverse).
const ADDED: &[(&str, bool)] = &[
    ("<|open|>", true),
    ("<|close|>", true),
    ("<|end_of_msg|>", true),
    ("<|sep|>", false),
];

fn byte_level(s: &str) -> Vec<String> {
    let table = byte_to_char();
    s.bytes().map(|b| table[b as usize].to_string()).collect()
}

/// A tokenizer.json with the 256 byte tokens, chained merges for `WORDS`, and `ADDED`
/// above the model vocabulary; `decoder` and `pre_tokenizer` are given so tests can
/// write inconsistent files too.
fn tokenizer_json(pre_tokenizer: Value, decoder: Value) -> Value {
    let mut vocab = serde_json::Map::new();
    let mut next = 0u32;
    for piece in byte_to_char() {
        vocab.insert(piece.to_string(), json!(next));
        next += 1;
    }
    let mut merges = Vec::new();
    for word in WORDS {
        let parts = byte_level(word);
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            let merged = format!("{acc}{p}");
            if !vocab.contains_key(&merged) {
                merges.push(json!([acc, p]));
                vocab.insert(merged.clone(), json!(next));
                next += 1;
            }
            acc = merged;
        }
    }
    let added: Vec<Value> = ADDED
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({"id": next + i as u32, "content": content, "single_word": false,
                   "lstrip": false, "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
}

fn byte_level_json() -> Value {
    let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true});
    tokenizer_json(bl.clone(), bl)
}

fn write(dir: &Path, v: &Value) {
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_string_pretty(v).unwrap(),
    )
    .unwrap();
}

fn load() -> (tempfile::TempDir, Tokenizer, tokenizers::Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &byte_level_json());
    let ours = Tokenizer::from_dir(dir.path()).unwrap();
    let theirs = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    (dir, ours, theirs)
}

const TEXTS: &[&str] = &[
    "hello world, the tokenizer is tokenizing",
    "你好世界，你好 世界",
    "emoji 😀😀 and 👩‍👩‍👧 family\n\ttabs  and  spaces ",
    "",
];

#[test]
fn loads_and_round_trips_like_the_tokenizers_crate() {
    let (_dir, ours, theirs) = load();
    assert_eq!(
        ours.num_base_tokens() as usize,
        theirs.get_vocab_size(false)
    );
    assert_eq!(ours.vocab_size(), theirs.get_vocab_size(true));
    for text in TEXTS {
        let ids = ours.encode(text);
        let want = theirs.encode(*text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(ours.decode(&ids, false).unwrap(), *text);
        assert_eq!(theirs.decode(&ids, false).unwrap(), *text);
    }
    // The learned merges are in use: "hello" is one token, not five bytes.
    assert_eq!(ours.encode("hello").len(), 1);
    assert_eq!(ours.encode(" 你好").len(), 1);
    assert_eq!(
        ours.token_bytes(ours.encode("😀")[0]).unwrap(),
        "😀".as_bytes()
    );
}

#[test]
fn added_tokens_are_special_and_only_parsed_when_asked() {
    let (_dir, ours, theirs) = load();
    let text = "<|open|>user<|sep|>hello<|close|><|end_of_msg|>";
    let ids = ours.encode_with_special(text);
    assert_eq!(ids, theirs.encode(text, false).unwrap().get_ids().to_vec());
    for (name, _) in ADDED {
        let id = ours.special_id(name).unwrap();
        assert!(ours.is_special(id), "{name}");
        assert!(ids.contains(&id), "{name} not matched in {ids:?}");
        assert_eq!(ours.token_bytes(id).unwrap(), name.as_bytes());
    }
    assert!(!ours.is_special(ours.encode("hello")[0]));
    assert_eq!(ours.decode(&ids, true).unwrap(), text);
    assert_eq!(ours.decode(&ids, false).unwrap(), "userhello");

    // Ordinary encoding leaves every added-token string as text, the non-special
    // `<|sep|>` included, and round-trips it.
    let plain = ours.encode(text);
    assert!(plain.iter().all(|&id| !ours.is_special(id)), "{plain:?}");
    assert_eq!(ours.decode(&plain, false).unwrap(), text);
}

#[test]
fn stream_decode_equals_whole_decode() {
    let (_dir, ours, _) = load();
    for show_special in [false, true] {
        let text = "<|open|>你好😀 world<|close|>";
        let ids = ours.encode_with_special(text);
        let mut dec = StreamDecoder::new(&ours, show_special);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(id).unwrap());
        }
        streamed.push_str(&dec.finish());
        assert_eq!(streamed, ours.decode(&ids, show_special).unwrap());
    }
    // Byte tokens split inside the emoji: nothing half-printed, same text at the end.
    // The vocabulary starts with the 256 byte tokens in byte order.
    let byte_ids: Vec<u32> = "😀".bytes().map(u32::from).collect();
    for &id in &byte_ids {
        assert_eq!(ours.token_bytes(id).unwrap(), [id as u8]);
    }
    let mut dec = StreamDecoder::new(&ours, false);
    let parts: Vec<String> = byte_ids.iter().map(|&id| dec.push(id).unwrap()).collect();
    assert_eq!(parts, ["", "", "", "😀"]);
}

#[test]
fn missing_and_unsupported_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(
        err.contains("tiktoken.model") && err.contains("tokenizer.json"),
        "{err}"
    );

    // Sentencepiece-style: Metaspace pre-tokenizer and decoder.
    let ms = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                    "split": true});
    write(dir.path(), &tokenizer_json(ms.clone(), ms));
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(
        err.contains("tokenizer.json") && err.contains("Metaspace") && err.contains("ByteLevel"),
        "{err}"
    );

    // A ByteLevel decoder without the ByteLevel pre-tokenizer would decode bytes the
    // encoder never produced.
    let ws = json!({"type": "Whitespace"});
    let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true});
    write(dir.path(), &tokenizer_json(ws, bl));
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("pre-tokenizer"), "{err}");

    std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("tokenizer.json"), "{err}");
}
