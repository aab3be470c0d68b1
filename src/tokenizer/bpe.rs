//! Byte-level rank BPE over Kimi's pre-split regex, run by `tiktoken-rs`'s `CoreBPE`
//! (the same Rust engine and `fancy-regex` that Python `tiktoken` uses).

use std::collections::HashSet;
use std::path::Path;

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

/// Kimi's pre-split pattern, copied verbatim from `TikTokenTokenizer.pat_str` in
/// `tokenization_kimi.py` of the moonshotai Kimi-K2 / Kimi-Linear / Kimi-K3 Hugging Face
/// repositories (seen through public copies, e.g. `troy12x/quasar-kimi/tokenization_kimi.py`
/// on GitHub, and identical in every Kimi tokenizer port found). It is o200k's pattern
/// with a leading Han rule and `&&[^\p{Han}]` intersections that keep Han out of the
/// letter rules. Do not "simplify" the `&&`: the regex engine honours them as written.
pub(crate) const KIMI_PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// `tokenization_kimi.py` cuts input into pieces of at most this many characters
/// before calling tiktoken (tiktoken panics on longer inputs).
const MAX_ENCODE_CHARS: usize = 400_000;
/// ... and cuts runs of whitespace / non-whitespace longer than this (tiktoken issue 195).
const MAX_NO_WHITESPACES_CHARS: usize = 25_000;

/// At most the first 80 characters of `s`, for an error that quotes a file's line.
fn short(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

/// Entries a `tiktoken.model` may hold: the largest `vocab_size` the config accepts.
pub(crate) const MAX_TIKTOKEN_RANKS: usize = 1 << 22;

/// Reads `tiktoken.model` (through [`crate::platform::input_file`]) and parses it with
/// [`parse_tiktoken_model`].
pub(crate) fn read_tiktoken_model(path: &Path) -> Result<Vec<Vec<u8>>> {
    let text = crate::platform::input_file::read_text(
        path,
        crate::platform::input_file::FileKind::TiktokenModel,
    )?;
    parse_tiktoken_model(&text, path)
}

/// Parses `tiktoken.model` text: one `base64 rank` line per token. Returns the bytes of
/// each rank in rank order; ranks must be exactly `0..n` and byte strings unique. `path`
/// names the file in errors.
pub(crate) fn parse_tiktoken_model(text: &str, path: &Path) -> Result<Vec<Vec<u8>>> {
    // Ranks run 0..n over n entries, so a rank at or above the entry count is a gap for
    // certain; refusing it before the table grows keeps a rank of 2^30 from sizing it.
    let entries = text.lines().filter(|l| !l.trim().is_empty()).count();
    if entries > MAX_TIKTOKEN_RANKS {
        bail!(
            "{}: {entries} entries, more than the {MAX_TIKTOKEN_RANKS} a vocabulary may hold \
             (config.json's vocab_size bound); refused before reading them",
            path.display()
        );
    }
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; entries];
    for (lineno, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let lineno = lineno + 1;
        let mut parts = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            bail!(
                "{}:{lineno}: expected `BASE64 RANK`, found {:?}",
                path.display(),
                short(line)
            );
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .with_context(|| format!("{}:{lineno}: bad base64 {:?}", path.display(), short(b64)))?;
        let rank: usize = rank
            .parse()
            .with_context(|| format!("{}:{lineno}: bad rank {:?}", path.display(), short(rank)))?;
        if rank >= entries {
            bail!(
                "{}:{lineno}: rank {rank} is out of range: the file has {entries} entries, so \
                 ranks must run 0..{entries}",
                path.display()
            );
        }
        if by_rank[rank].is_some() {
            bail!("{}:{lineno}: rank {rank} appears twice", path.display());
        }
        by_rank[rank] = Some(bytes);
    }
    // Duplicates are looked for once every entry is read, over borrowed bytes: a copy of
    // each would double the table.
    let mut seen: HashSet<&[u8]> = HashSet::with_capacity(entries);
    for (rank, bytes) in by_rank.iter().enumerate() {
        if let Some(b) = bytes {
            if !seen.insert(b) {
                let shown: Vec<u8> = b.iter().copied().take(64).collect();
                bail!(
                    "{}: rank {rank}: the bytes {shown:?} already have another rank",
                    path.display()
                );
            }
        }
    }
    drop(seen);
    if by_rank.is_empty() {
        bail!("{} holds no tokens", path.display());
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(rank, b)| {
            b.with_context(|| {
                format!(
                    "{}: rank {rank} is missing; ranks must run 0..n without gaps",
                    path.display()
                )
            })
        })
        .collect()
}

/// The rank BPE engine plus the special-token strings it may recognise.
pub(crate) struct RankBpe {
    core: CoreBPE,
    /// A copy of the rank map for the fallback path (CoreBPE keeps its own private).
    ranks: FxHashMap<Vec<u8>, u32>,
    special_names: Vec<String>,
}

impl RankBpe {
    /// Builds the engine from rank bytes (id = index) and special names (id = n_base + index).
    pub(crate) fn new(ranks: &[Vec<u8>], special_names: &[String], pattern: &str) -> Result<Self> {
        let n_base = ranks.len() as u32;
        let encoder: FxHashMap<Vec<u8>, u32> = ranks
            .iter()
            .enumerate()
            .map(|(id, b)| (b.clone(), id as u32))
            .collect();
        if encoder.len() != ranks.len() {
            bail!("tiktoken.model has duplicate byte strings; each rank needs distinct bytes");
        }
        let specials: FxHashMap<String, u32> = special_names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), n_base + i as u32))
            .collect();
        let core = CoreBPE::new(encoder.clone(), specials, pattern)
            .map_err(|e| anyhow::anyhow!("building the BPE with pattern {pattern:?}: {e}"))?;
        Ok(Self {
            core,
            ranks: encoder,
            special_names: special_names.to_vec(),
        })
    }

    /// Encodes text, special-token strings included as ordinary bytes.
    pub(crate) fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode_chunked(text, &HashSet::new())
    }

    /// Encodes text, turning every special-token string into its id.
    pub(crate) fn encode_with_special(&self, text: &str) -> Vec<u32> {
        let allowed: HashSet<&str> = self.special_names.iter().map(String::as_str).collect();
        self.encode_chunked(text, &allowed)
    }

    fn encode_chunked(&self, text: &str, allowed: &HashSet<&str>) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        for chunk in kimi_chunks(text) {
            self.encode_piece(chunk, allowed, &mut out);
        }
        out
    }

    /// Only a regex backtrack limit makes `CoreBPE::encode` fail, which the chunking is
    /// there to prevent; should it happen anyway, halves are encoded instead, which
    /// still round-trips the text.
    fn encode_piece(&self, text: &str, allowed: &HashSet<&str>, out: &mut Vec<u32>) {
        match self.core.encode(text, allowed) {
            Ok((ids, _)) => out.extend(ids),
            Err(_) => {
                let mut mid = text.len() / 2;
                while !text.is_char_boundary(mid) {
                    mid += 1;
                }
                if mid == 0 || mid == text.len() {
                    out.extend(
                        text.bytes()
                            .filter_map(|b| self.ranks.get(&[b][..]).copied()),
                    );
                    return;
                }
                self.encode_piece(&text[..mid], allowed, out);
                self.encode_piece(&text[mid..], allowed, out);
            }
        }
    }
}

/// Python's `str.isspace`, which `tokenization_kimi.py` uses to cut runs; it differs
/// from Rust's `char::is_whitespace` on the information separators U+001C..U+001F.
pub(crate) fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Splits text the way `tokenization_kimi.py`'s `encode` does before tiktoken sees it:
/// 400k-character pieces, each cut so no run of whitespace or non-whitespace exceeds
/// 25k characters. Long inputs tokenize differently at these cuts, so they are kept.
pub(crate) fn kimi_chunks(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut big_start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == MAX_ENCODE_CHARS {
            split_runs(&text[big_start..i], MAX_NO_WHITESPACES_CHARS, &mut out);
            big_start = i;
            count = 0;
        }
        count += 1;
    }
    split_runs(&text[big_start..], MAX_NO_WHITESPACES_CHARS, &mut out);
    out
}

/// `_split_whitespaces_or_nonwhitespaces` from `tokenization_kimi.py`, on char counts.
fn split_runs<'a>(s: &'a str, max_run: usize, out: &mut Vec<&'a str>) {
    let mut run_is_space = s.chars().next().is_some_and(python_isspace);
    let mut run_len = 0usize;
    let mut slice_start = 0;
    for (i, c) in s.char_indices() {
        let now_space = python_isspace(c);
        if run_is_space != now_space {
            run_len = 1;
            run_is_space = now_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[slice_start..i]);
                slice_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[slice_start..]);
}
