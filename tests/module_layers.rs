//! The library's top-level modules form layers (docs/architecture.md, "Module layers"): a
//! module names only modules of lower layers, so the folder import graph has no cycle and
//! no upward edge. This test reads every source file under `src/` (the binary's `cli/`
//! aside: it sits above everything) and fails on an edge the list does not allow, or on a
//! module the list does not place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Lowest layer first; a module may name modules of earlier rows only.
const LAYERS: &[&[&str]] = &[
    &["platform", "atomic_file", "canonical_json", "unique_json"],
    &["stats", "quant", "config", "tokenizer"],
    &["routed_expert"],
    &["checkpoint"],
    &["synth", "backend"],
    &["experts"],
    &["model"],
    &["engine", "sampling", "grammar"],
    &["session"],
    &["generate", "token_picker"],
    &["serve"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file under `src/` belongs to (`src/a.rs` and `src/a/..` are `a`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Every `crate::NAME` in `text`.
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

#[test]
fn every_module_names_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut bad: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let from = module_of(&src, file);
        if matches!(from.as_str(), "cli" | "main" | "lib") {
            continue;
        }
        let Some(from_layer) = layer_of(&from) else {
            bad.entry(format!("{from} (not in LAYERS)"))
                .or_default()
                .push(file.display().to_string());
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for to in crate_paths(&text) {
            if to == from {
                continue;
            }
            match layer_of(&to) {
                Some(l) if l < from_layer => {}
                _ => bad
                    .entry(format!("{from} -> {to}"))
                    .or_default()
                    .push(file.display().to_string()),
            }
        }
    }
    for edges in bad.values_mut() {
        edges.sort();
        edges.dedup();
    }
    assert!(
        bad.is_empty(),
        "imports against the module layers (move the item down or the importer up):\n{bad:#?}"
    );
}

#[test]
fn the_layer_check_sees_an_upward_edge() {
    let paths = crate_paths("use crate::model::K3Model; // not_crate::x, crate::experts");
    assert_eq!(paths, ["model", "experts"]);
    assert!(layer_of("model").unwrap() > layer_of("experts").unwrap());
    assert!(layer_of("no_such_module").is_none());
}
