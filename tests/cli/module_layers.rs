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
                let declares = [
                    format!("mod {stem};"),
                    format!("pub mod {stem};"),
                    format!("pub(crate) mod {stem};"),
                ]
                .contains(&t.to_string());
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

/// Circles of files that import each other, each one concept's parts; every other file
/// imports only files that do not import it back. A circle here is the files of the
/// component (paths under `src/`, sorted) and why its parts belong together; a circle found
/// passes when its files are all in one listed circle (a listed one may shrink or go).
const ALLOWED_CIRCLES: &[(&[&str], &str)] = &[
    (
        &[
            "experts/io/expert_reader.rs",
            "experts/io/loader_pool.rs",
            "experts/io/piece_read.rs",
        ],
        "one expert's read: the reader, the loader threads that run it and its split into \
         pieces, each handing work to the others",
    ),
    (
        &[
            "quant/bf16.rs",
            "quant/int4.rs",
            "quant/int8.rs",
            "quant/kernel.rs",
            "quant/mxfp4.rs",
            "quant/simd/mod.rs",
        ],
        "the weight formats and their matvec kernels: each format's rows go through the \
         shared matmul drivers and SIMD dispatch, which call back into the format's row kernel",
    ),
    (
        &[
            "serve/http.rs",
            "serve/request_guard.rs",
            "serve/responses/mod.rs",
        ],
        "the HTTP surface: the router, the guard in front of its routes and the Responses \
         API's handlers share the app state and the SSE helpers",
    ),
];

/// The most circles the crate may hold.
const MAX_CIRCLES: usize = 3;

/// `text` with comments, string and char literals blanked, so braces and paths inside
/// them are not read as code.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                i += 1;
            }
            i += 2;
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'#') | Some(b'"')) && {
            let prev = if i > 0 { b[i - 1] } else { b' ' };
            !(prev.is_ascii_alphanumeric() || prev == b'_')
        } {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            i = j + close.len();
            out.push_str("\"\"");
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the former is blanked.
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.push_str("' '");
                    i = e + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The module path of a file under `src/` (`a/b.rs` and `a/b/mod.rs` are `[a, b]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

fn ident_at(b: &[u8], i: usize) -> usize {
    let mut j = i;
    while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
        j += 1;
    }
    j
}

/// The paths a `use` tree or an inline path spells from `i` (just after a `::`): each
/// path's segments, a `{…}` group expanded into its members.
fn path_tree(b: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut segs = prefix;
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b.get(i) == Some(&b'{') {
            i += 1;
            loop {
                while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b',') {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    return i + 1;
                }
                i = path_tree(b, i, segs.clone(), out);
            }
        }
        let end = ident_at(b, i);
        if end == i {
            out.push(segs);
            return i;
        }
        let word = String::from_utf8_lossy(&b[i..end]).to_string();
        i = end;
        if word != "self" {
            segs.push(word);
        }
        let mut k = i;
        while k < b.len() && b[k].is_ascii_whitespace() {
            k += 1;
        }
        if b[k..].starts_with(b"::") {
            i = k + 2;
        } else {
            // `as name` and the rest of the item belong to no module.
            out.push(segs);
            return i;
        }
    }
}

/// Every file a file names through `crate::…` or `super::…` paths, as module paths
/// (`self::` and a child's own name reach only the file's own children).
fn named_modules(file_module: &[String], code: &str) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    // The inline modules (`mod tests { … }`) open at each brace depth.
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'{' {
            depth += 1;
            i += 1;
            continue;
        }
        if c == b'}' {
            depth = depth.saturating_sub(1);
            while inline.last().is_some_and(|(d, _)| *d > depth) {
                inline.pop();
            }
            i += 1;
            continue;
        }
        let starts_word = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if !starts_word || !(c.is_ascii_alphabetic() || c == b'_') {
            i += 1;
            continue;
        }
        let end = ident_at(b, i);
        let word = &code[i..end];
        if word == "mod" {
            let name_at = end
                + b[end..]
                    .iter()
                    .take_while(|x| x.is_ascii_whitespace())
                    .count();
            let name_end = ident_at(b, name_at);
            let brace_at = name_end
                + b[name_end..]
                    .iter()
                    .take_while(|x| x.is_ascii_whitespace())
                    .count();
            if name_end > name_at && b.get(brace_at) == Some(&b'{') {
                inline.push((depth + 1, code[name_at..name_end].to_string()));
            }
            i = name_end.max(end);
            continue;
        }
        let preceded_by_path = i >= 2 && &b[i - 2..i] == b"::";
        if (word == "crate" || word == "super") && !preceded_by_path && b[end..].starts_with(b"::")
        {
            let mut here: Vec<String> = file_module.to_vec();
            here.extend(inline.iter().map(|(_, n)| n.clone()));
            let mut paths = Vec::new();
            let stop = path_tree(b, i, Vec::new(), &mut paths);
            for segs in paths {
                let mut base = if segs.first().map(String::as_str) == Some("crate") {
                    Vec::new()
                } else {
                    here.clone()
                };
                let mut rest = segs.iter().skip(usize::from(segs[0] == "crate")).peekable();
                while rest.peek().map(|s| s.as_str()) == Some("super") {
                    base.pop();
                    rest.next();
                }
                base.extend(rest.cloned());
                out.push(base);
            }
            i = stop.max(end);
            continue;
        }
        i = end;
    }
    out
}

/// The file-level import graph: for each file under `src/` (the binary's `cli/` aside),
/// the files its `crate::` and `super::` paths reach.
fn import_graph(src: &Path) -> BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // Joined with `/` on every OS, as ALLOWED_CIRCLES names them.
    let rel = |f: &Path| {
        let parts: Vec<String> = f
            .strip_prefix(src)
            .unwrap()
            .components()
            .map(|c| c.as_os_str().to_string_lossy().to_string())
            .collect();
        parts.join("/")
    };
    let files: Vec<PathBuf> = files
        .into_iter()
        .filter(|f| {
            let r = rel(f);
            !r.starts_with("cli/") && r != "main.rs"
        })
        .collect();
    let by_module: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|f| (module_path(src, f), rel(f)))
        .collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let from = rel(file);
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let mut to = std::collections::BTreeSet::new();
        for path in named_modules(&module_path(src, file), &code) {
            // The longest prefix of the path that is a file's module.
            let target = (0..=path.len())
                .rev()
                .find_map(|n| by_module.get(&path[..n]));
            if let Some(t) = target.filter(|t| **t != from) {
                to.insert(t.clone());
            }
        }
        graph.insert(from, to);
    }
    graph
}

/// The strongly connected components of more than one file, each sorted, in order.
fn circles(graph: &BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<Vec<String>> {
    // Kosaraju: finish order on the graph, then components on the reversed graph.
    let names: Vec<&String> = graph.keys().collect();
    let index: BTreeMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let fwd: Vec<Vec<usize>> = names
        .iter()
        .map(|n| {
            graph[*n]
                .iter()
                .filter_map(|t| index.get(t).copied())
                .collect()
        })
        .collect();
    let mut rev = vec![Vec::new(); names.len()];
    for (a, outs) in fwd.iter().enumerate() {
        for &b in outs {
            rev[b].push(a);
        }
    }
    let mut seen = vec![false; names.len()];
    let mut order = Vec::new();
    for start in 0..names.len() {
        if seen[start] {
            continue;
        }
        seen[start] = true;
        let mut stack = vec![(start, 0usize)];
        while let Some((node, next)) = stack.pop() {
            if next < fwd[node].len() {
                stack.push((node, next + 1));
                let t = fwd[node][next];
                if !seen[t] {
                    seen[t] = true;
                    stack.push((t, 0));
                }
            } else {
                order.push(node);
            }
        }
    }
    let mut comp = vec![usize::MAX; names.len()];
    let mut out = Vec::new();
    for &start in order.iter().rev() {
        if comp[start] != usize::MAX {
            continue;
        }
        let id = out.len();
        let mut members = vec![];
        let mut stack = vec![start];
        comp[start] = id;
        while let Some(n) = stack.pop() {
            members.push(names[n].clone());
            for &p in &rev[n] {
                if comp[p] == usize::MAX {
                    comp[p] = id;
                    stack.push(p);
                }
            }
        }
        members.sort();
        out.push(members);
    }
    let mut big: Vec<Vec<String>> = out.into_iter().filter(|c| c.len() > 1).collect();
    big.sort();
    big
}

#[test]
fn files_import_each_other_in_a_circle_only_where_allowed() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = circles(&import_graph(&src));
    let allowed: Vec<Vec<String>> = ALLOWED_CIRCLES
        .iter()
        .map(|(files, _)| files.iter().map(|f| f.to_string()).collect())
        .collect();
    let unlisted: Vec<&Vec<String>> = found
        .iter()
        .filter(|c| !allowed.iter().any(|a| c.iter().all(|f| a.contains(f))))
        .collect();
    assert!(
        unlisted.is_empty(),
        "files that import each other in a circle (break it, or list it in ALLOWED_CIRCLES \
         with why it is one concept's parts):\n{unlisted:#?}"
    );
    assert!(
        ALLOWED_CIRCLES.len() <= MAX_CIRCLES,
        "{} allowed circles; at most {MAX_CIRCLES}",
        ALLOWED_CIRCLES.len()
    );
}

#[test]
fn the_circle_check_reads_paths_and_sees_a_circle() {
    let code = code_only(
        "use super::{a::X, b}; // crate::c\nfn f() { crate::d::e(); \"crate::s\"; }\n\
         mod tests { use super::*; use super::super::g; }",
    );
    let got = named_modules(&["m".to_string(), "n".to_string()], &code);
    let want: Vec<Vec<&str>> = vec![
        vec!["m", "a", "X"],
        vec!["m", "b"],
        vec!["d", "e"],
        vec!["m", "n", "*"],
        vec!["m", "g"],
    ];
    let got: Vec<Vec<&str>> = got
        .iter()
        .map(|p| p.iter().map(String::as_str).collect())
        .collect();
    assert_eq!(got[..2], want[..2]);
    assert_eq!(got[2], want[2]);
    assert_eq!(got[4], want[4]);
    let mut graph = BTreeMap::new();
    for (a, b) in [("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")] {
        graph
            .entry(a.to_string())
            .or_insert_with(std::collections::BTreeSet::new)
            .insert(b.to_string());
    }
    graph.entry("w".to_string()).or_default();
    assert_eq!(circles(&graph), vec![vec!["x", "y", "z"]]);
}
