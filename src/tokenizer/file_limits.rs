//! Size limits on the tokenizer files, checked before a byte is read: a `tiktoken.model`
//! or `tokenizer.json` of hundreds of MB would cost gigabytes as strings and JSON trees
//! before any entry is checked.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Largest `tiktoken.model` read (Kimi K3's is about 2.6 MB: 163584 short lines).
pub const MAX_TIKTOKEN_MODEL_BYTES: u64 = 64 << 20;
/// Largest `tokenizer_config.json` read (Kimi K3's is a few KB, templates included).
pub const MAX_TOKENIZER_CONFIG_BYTES: u64 = 16 << 20;
/// Largest `tokenizer.json` read (the largest byte-level BPE ones shipped are near 20 MB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 64 << 20;

/// Reads a file of at most `limit` bytes; a larger one (or one that grows past the limit
/// while it is read) is refused naming the file and the limit.
pub fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len > limit {
        bail!(
            "{}: {len} bytes is too large for a tokenizer file (the limit is {limit} bytes)",
            path.display()
        );
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > limit {
        bail!(
            "{}: grew past {limit} bytes while it was read; too large for a tokenizer file",
            path.display()
        );
    }
    Ok(bytes)
}

/// [`read_limited`] for a text file: invalid UTF-8 is refused naming the file.
pub fn read_limited_text(path: &Path, limit: u64) -> Result<String> {
    String::from_utf8(read_limited(path, limit)?)
        .with_context(|| format!("{} is not UTF-8 text", path.display()))
}
