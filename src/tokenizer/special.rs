//! The added (special) tokens of a Kimi snapshot: `tokenizer_config.json`'s
//! `added_tokens_decoder`, laid over the reserved id range above the BPE ranks.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// How many ids above the last BPE rank Kimi reserves for added tokens. The
/// reference loader (`tokenization_kimi.py` of Kimi K3) names every id in
/// `[n_base, n_base + 256)`, using `<|reserved_token_{id}|>` for ids the config
/// leaves unnamed; K3's vocabulary (163584 ranks + 256) ends exactly there.
pub const RESERVED_SPECIAL_TOKENS: u32 = 256;

/// One entry of `added_tokens_decoder`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedToken {
    /// The token's text, for example `<|open|>`.
    pub content: String,
    /// The config's `special` flag (K3 marks `<|open|>`, `<|close|>`, `<|sep|>` false).
    pub special: bool,
}

/// Most added tokens above the BPE ranks: far above the 256 Kimi reserves, low enough that
/// a mistyped id (2^31, 4e9) is refused before the special table is sized by it.
pub const MAX_ADDED_TOKENS: u32 = 1 << 16;

/// Longest added token, in bytes: Kimi's are under 32. The specials become one alternation
/// regex, and a token of a megabyte overflows its NFA size limit.
pub const MAX_ADDED_TOKEN_BYTES: usize = 1024;

/// Reads `added_tokens_decoder` from a `tokenizer_config.json` (size-limited, see
/// [`crate::platform::input_file`]) with [`parse_added_tokens`].
pub fn read_added_tokens(path: &Path) -> Result<BTreeMap<u32, AddedToken>> {
    let text = crate::platform::input_file::read_text(
        path,
        crate::platform::input_file::FileKind::TokenizerConfig,
    )?;
    parse_added_tokens(&text, path)
}

/// Parses `added_tokens_decoder` from `tokenizer_config.json` text; `path` names the file
/// in errors. A token with empty content is refused: it would match everywhere in text.
pub fn parse_added_tokens(text: &str, path: &Path) -> Result<BTreeMap<u32, AddedToken>> {
    let json: serde_json::Value = crate::unique_json::parse_str(text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let Some(decoder) = json.get("added_tokens_decoder") else {
        return Ok(BTreeMap::new());
    };
    let Some(decoder) = decoder.as_object() else {
        bail!(
            "{}: `added_tokens_decoder` must be an object mapping id -> {{content, special}}",
            path.display()
        );
    };
    let mut out = BTreeMap::new();
    for (key, entry) in decoder {
        let id: u32 = key.parse().with_context(|| {
            format!(
                "{}: `added_tokens_decoder` key {key:?} is not a token id",
                path.display()
            )
        })?;
        let Some(content) = entry.get("content").and_then(|c| c.as_str()) else {
            bail!(
                "{}: `added_tokens_decoder[{id}]` has no string `content`",
                path.display()
            );
        };
        if content.is_empty() {
            bail!(
                "{}: `added_tokens_decoder[{id}]` has empty `content`; an added token needs \
                 text (an empty one matches everywhere and encoding never ends)",
                path.display()
            );
        }
        if content.len() > MAX_ADDED_TOKEN_BYTES {
            bail!(
                "{}: `added_tokens_decoder[{id}]` is {} bytes long; an added token may be at \
                 most {MAX_ADDED_TOKEN_BYTES} bytes (the special tokens are matched by one regex)",
                path.display(),
                content.len()
            );
        }
        let special = entry
            .get("special")
            .and_then(|s| s.as_bool())
            .unwrap_or(true);
        out.insert(
            id,
            AddedToken {
                content: content.to_string(),
                special,
            },
        );
    }
    Ok(out)
}

/// Names every id of the reserved range `[n_base, max(n_base + 256, last added id + 1))`,
/// the way the reference loader builds tiktoken's `special_tokens` map.
pub fn special_table(
    n_base: u32,
    added: &BTreeMap<u32, AddedToken>,
    config: &Path,
) -> Result<Vec<String>> {
    if let Some((&id, tok)) = added.range(..n_base).next() {
        bail!(
            "{}: added token {:?} has id {id}, which is a BPE rank of tiktoken.model \
             (ranks end at {}); added tokens must sit above the ranks",
            config.display(),
            tok.content,
            n_base.saturating_sub(1)
        );
    }
    let bound = n_base.saturating_add(MAX_ADDED_TOKENS);
    if let Some((&id, tok)) = added.range(bound..).next() {
        bail!(
            "{}: added token {:?} has id {id}, beyond the {MAX_ADDED_TOKENS} ids above the \
             BPE ranks (0..{n_base}) that k3 accepts for added tokens (Kimi reserves {})",
            config.display(),
            tok.content,
            RESERVED_SPECIAL_TOKENS
        );
    }
    let end = added
        .keys()
        .next_back()
        .map_or(0, |&last| last + 1)
        .max(n_base.saturating_add(RESERVED_SPECIAL_TOKENS));
    let mut names = Vec::with_capacity((end - n_base) as usize);
    let mut seen = std::collections::HashSet::new();
    for id in n_base..end {
        let name = added
            .get(&id)
            .map_or_else(|| format!("<|reserved_token_{id}|>"), |t| t.content.clone());
        if !seen.insert(name.clone()) {
            bail!(
                "{}: the added token {name:?} appears twice (again at id {id}); \
                 each special token needs one id",
                config.display()
            );
        }
        names.push(name);
    }
    refuse_prefix_overlaps(&names, config)?;
    Ok(names)
}

/// Refuses a special token that begins another (`<|a|>` and `<|a|>b`): the BPE engine
/// tries specials in an arbitrary order, so which one such text becomes would depend on
/// hashing, not on the longest match.
fn refuse_prefix_overlaps(names: &[String], config: &Path) -> Result<()> {
    let mut sorted: Vec<&str> = names.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    // In sorted order a prefix sits right before the first string it begins.
    for pair in sorted.windows(2) {
        if pair[1].starts_with(pair[0]) {
            bail!(
                "{}: the added token {:?} begins the added token {:?}; special tokens must \
                 not be prefixes of one another",
                config.display(),
                pair[0],
                pair[1]
            );
        }
    }
    Ok(())
}
