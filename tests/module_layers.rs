//! The library's top-level modules form layers (docs/architecture.md, "Module layers"): a
//! module names only modules of lower layers, so the folder import graph has no cycle and
//! no upward edge. This test reads every source file under `src/` (the binary's `cli/`
//! aside: it sits above everything) and fails on an edge the list does not allow, or on a
//! module the list does not place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Lowest layer first; a module may name modules of earlier rows only.
const LAYERS: &[&[&str]] = &[
    &[
        "platform",
        "atomic_file",
        "canonical_json",
        "unique_json",
        "json_kind",
    ],
    &["stats", "quant", "config", "tokenizer"],
    &["routed_expert"],
    &["checkpoint"],
    &["synth", "backend"],
    &["experts"],
    &["model"],
    &["sampling", "grammar", "ranks"],
    &["session"],
    &["engine", "generate", "token_picker"],
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

/// Strings that exist only in the research code: a product build without the `lab` feature
/// must contain none of them.
const LAB_MARKERS: &[&str] = &["\"K3_LAB_", "cache_policy_sim", "cache_policy_synth"];

/// Whether the module of `file` (or a module above it) is declared under
/// `#[cfg(feature = "lab")]` by its parent.
fn lab_gated(src: &Path, file: &Path) -> bool {
    let mut path = file.to_path_buf();
    while let Some(parent_dir) = path.parent().map(Path::to_path_buf) {
        if path == src || parent_dir.as_path() == src.parent().unwrap_or(src) {
            return false;
        }
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        // The declaring file: `dir/mod.rs`, or `dir.rs` beside the directory, or lib/main.
        let candidates = [
            parent_dir.join("mod.rs"),
            parent_dir.with_extension("rs"),
            parent_dir.join("lib.rs"),
            parent_dir.join("main.rs"),
        ];
        for decl in candidates.iter().filter(|p| p.is_file() && **p != path) {
            let text = std::fs::read_to_string(decl).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let t = line.trim();
                let declares = t == format!("mod {stem};") || t == format!("pub mod {stem};");
                if declares && i > 0 && lines[i - 1].trim() == "#[cfg(feature = \"lab\")]" {
                    return true;
                }
            }
        }
        path = parent_dir;
    }
    false
}

#[test]
fn research_code_is_only_in_lab_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut outside = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim_start).collect();
        // A line names research code unless it is a comment or is itself gated (the
        // attribute on the line before: a `mod` declaration, an enum variant, a call).
        let code_names_lab = lines.iter().enumerate().any(|(i, t)| {
            let gated = i > 0 && lines[i - 1] == "#[cfg(feature = \"lab\")]";
            !t.starts_with("//") && !gated && LAB_MARKERS.iter().any(|m| t.contains(m))
        });
        if code_names_lab && !lab_gated(&src, file) {
            outside.push(file.display().to_string());
        }
    }
    assert!(
        outside.is_empty(),
        "research code outside a module declared under #[cfg(feature = \"lab\")]: {outside:#?}"
    );
}
