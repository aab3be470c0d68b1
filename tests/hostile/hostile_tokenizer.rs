//! Degenerate tokenizer files are refused at load, naming the file and the entry, before
//! they size an allocation or make encoding loop: empty added tokens, added ids far
//! outside the vocabulary, ranks beyond the file, overlapping specials, oversized files.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k3::tokenizer::hf_json::byte_to_char;
use k3::tokenizer::Tokenizer;
use serde_json::{json, Value};

fn synthetic() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/synthetic")
}

/// A copy of the synthetic tiktoken tokenizer whose `tokenizer_config.json` is `edit`ed.
fn tiktoken_dir(edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        synthetic().join("tiktoken.model"),
        dir.path().join("tiktoken.model"),
    )
    .unwrap();
    let raw = std::fs::read_to_string(synthetic().join("tokenizer_config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&raw).unwrap();
    edit(&mut cfg);
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    dir
}

fn add_token(cfg: &mut Value, id: &str, content: &str) {
    cfg["added_tokens_decoder"][id] = json!({"content": content, "special": true});
}

/// Ranks of the synthetic `tiktoken.model`: the first added id.
const N_BASE: u32 = 3840;

fn load_err(dir: &Path) -> String {
    format!("{:#}", Tokenizer::from_dir(dir).unwrap_err())
}

#[test]
fn the_unmodified_fixture_loads() {
    let dir = tiktoken_dir(|_| {});
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.num_base_tokens(), N_BASE);
}

#[test]
fn an_added_token_with_empty_content_is_refused_naming_the_file_and_id() {
    let dir = tiktoken_dir(|c| add_token(c, "4000", ""));
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer_config.json")
            && err.contains("added_tokens_decoder[4000]")
            && err.contains("empty"),
        "{err}"
    );
}

#[test]
fn tokenize_with_an_empty_added_token_ends_with_an_error() {
    let dir = tiktoken_dir(|c| add_token(c, "4000", ""));
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "tokenize",
            dir.path().to_str().unwrap(),
            "--special",
            "<|open|>hi",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("k3 tokenize still runs after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("empty"), "{err}");
}

#[test]
fn added_token_ids_far_above_the_vocabulary_are_refused_before_allocating() {
    for id in ["2147483648", "4000000000", "10000000", "4294967295"] {
        let dir = tiktoken_dir(|c| add_token(c, id, "<|far|>"));
        let err = load_err(dir.path());
        assert!(
            err.contains("tokenizer_config.json") && err.contains(id) && err.contains("<|far|>"),
            "id {id}: {err}"
        );
    }
    // The last id k3 accepts still loads, and names its range.
    let dir = tiktoken_dir(|c| add_token(c, &(N_BASE + 65535).to_string(), "<|last|>"));
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.special_id("<|last|>"), Some(N_BASE + 65535));
}

#[test]
fn a_special_that_begins_another_is_refused() {
    let dir = tiktoken_dir(|c| add_token(c, "4000", "<|open|>x"));
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer_config.json")
            && err.contains("\"<|open|>\"")
            && err.contains("\"<|open|>x\"")
            && err.contains("prefix"),
        "{err}"
    );
}

#[test]
fn the_same_special_at_two_ids_is_refused() {
    let dir = tiktoken_dir(|c| add_token(c, "4000", "<|open|>"));
    let err = load_err(dir.path());
    assert!(
        err.contains("appears twice") && err.contains("4000"),
        "{err}"
    );
}

fn write_model(dir: &Path, lines: &str) {
    std::fs::write(dir.join("tiktoken.model"), lines).unwrap();
}

#[test]
fn a_rank_beyond_the_file_is_refused_before_the_table_grows() {
    let dir = tiktoken_dir(|_| {});
    let mut text = std::fs::read_to_string(synthetic().join("tiktoken.model")).unwrap();
    text.push_str("eHh4eHh4eA== 1073741824\n");
    write_model(dir.path(), &text);
    let err = load_err(dir.path());
    assert!(
        err.contains("tiktoken.model:3841")
            && err.contains("1073741824")
            && err.contains("3841 entries"),
        "{err}"
    );
}

#[test]
fn a_duplicate_rank_is_refused() {
    let dir = tiktoken_dir(|_| {});
    let mut text = std::fs::read_to_string(synthetic().join("tiktoken.model")).unwrap();
    text.push_str("eHh4eHh4eA== 5\n");
    write_model(dir.path(), &text);
    let err = load_err(dir.path());
    assert!(err.contains("rank 5 appears twice"), "{err}");
}

/// Makes `name` in `dir` a sparse file of `len` bytes (no disk is used).
fn sparse(dir: &Path, name: &str, len: u64) {
    let f = std::fs::File::create(dir.join(name)).unwrap();
    f.set_len(len).unwrap();
}

#[test]
fn oversized_tokenizer_files_are_refused_before_reading() {
    let dir = tiktoken_dir(|_| {});
    sparse(dir.path(), "tiktoken.model", 300 << 20);
    let err = load_err(dir.path());
    assert!(
        err.contains("tiktoken.model") && err.contains("too large") && err.contains("314572800"),
        "{err}"
    );

    let dir = tiktoken_dir(|_| {});
    sparse(dir.path(), "tokenizer_config.json", 200 << 20);
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer_config.json") && err.contains("too large"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    sparse(dir.path(), "tokenizer.json", 300 << 20);
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer.json") && err.contains("too large"),
        "{err}"
    );
}

/// A byte-level BPE `tokenizer.json`: the 256 byte tokens, `extra` vocabulary entries
/// and the given added tokens.
fn hf_dir(extra: &[(&str, u64)], added: &[(u64, &str)]) -> tempfile::TempDir {
    let mut vocab = serde_json::Map::new();
    for (i, c) in byte_to_char().iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    for (text, id) in extra {
        vocab.insert(text.to_string(), json!(id));
    }
    let added: Vec<Value> = added
        .iter()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true});
    let v = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": bl, "post_processor": null, "decoder": bl,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), v.to_string()).unwrap();
    dir
}

#[test]
fn tokenizer_json_vocabulary_ids_far_above_its_size_are_refused_before_allocating() {
    let ok = hf_dir(&[("ab", 256)], &[(257, "<|a|>")]);
    assert_eq!(Tokenizer::from_dir(ok.path()).unwrap().vocab_size(), 258);
    for id in [4_000_000_000u64, 2_147_483_648, 10_000_000] {
        let dir = hf_dir(&[("ab", id)], &[]);
        let err = load_err(dir.path());
        assert!(
            err.contains("tokenizer.json") && err.contains(&id.to_string()),
            "id {id}: {err}"
        );
    }
}

#[test]
fn a_tokenizer_json_cut_inside_its_decoder_is_an_error_not_a_panic() {
    // The fuzz reproducer (fuzz/artifacts/tokenizer_json_load/): the `tokenizers` crate
    // panics on it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(
            "fuzz/artifacts/tokenizer_json_load/crash-b1fc1a3563b3cf3dc4a248b028a45cb2c329d305",
        ),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer.json") && err.contains("not valid JSON"),
        "{err}"
    );
}

#[test]
fn a_tokenizer_json_with_invalid_utf8_in_a_string_is_an_error_not_a_panic() {
    // The second fuzz reproducer: the `tokenizers` crate panics on it too.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(
            "fuzz/artifacts/tokenizer_json_load/crash-3b5721420996b21781795d67516bc4c1e0432628",
        ),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer.json") && err.contains("not UTF-8"),
        "{err}"
    );
}

#[test]
fn a_megabyte_added_token_is_refused_naming_the_file_the_id_and_its_length() {
    let big = format!("<|{}|>", "x".repeat(1 << 20));
    let dir = tiktoken_dir(|c| add_token(c, "4000", &big));
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer_config.json")
            && err.contains("added_tokens_decoder[4000]")
            && err.contains(&big.len().to_string()),
        "{}",
        &err[..err.len().min(400)]
    );
    assert!(!err.contains("NFA"), "the regex build was reached");
}

#[test]
fn a_tiktoken_file_of_too_many_entries_is_refused_before_its_table_is_built() {
    let dir = tiktoken_dir(|_| {});
    // 60 MiB of one-byte tokens: within the file bound, far over any vocabulary.
    let line = "QQ== 0\n";
    write_model(dir.path(), &line.repeat((60 << 20) / line.len()));
    let t = Instant::now();
    let err = load_err(dir.path());
    assert!(
        err.contains("tiktoken.model")
            && err.contains("8987794 entries")
            && err.contains("4194304"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // A malformed line is quoted short, whatever its length.
    let dir = tiktoken_dir(|_| {});
    write_model(dir.path(), &format!("QQ== 0 {}\n", "x".repeat(1 << 20)));
    let err = load_err(dir.path());
    assert!(
        err.contains("expected `BASE64 RANK`") && err.len() < 1000,
        "{}",
        err.len()
    );
}
