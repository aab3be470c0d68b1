//! `k3 tokenize` and `k3 detokenize`: check prompts the way llama.cpp's tokenize tool does.

use super::run_cmd::parse_ids;
use anyhow::{Context, Result};
use clap::Args;
use k3::tokenizer::Tokenizer;
use std::io::Read;
use std::path::PathBuf;

/// Flags of `k3 tokenize`.
#[derive(Args, Debug)]
pub(crate) struct TokenizeArgs {
    /// Snapshot directory (tiktoken.model + tokenizer_config.json).
    pub model: PathBuf,
    /// Text to tokenize; `-` or nothing reads standard input.
    pub text: Option<String>,
    /// Print `[{"id":..,"bytes":"..."}]` with each token's bytes instead of the id list.
    #[arg(long)]
    pub json: bool,
    /// Recognize special-token strings such as <|open|> in the text.
    #[arg(long)]
    pub special: bool,
}

/// Flags of `k3 detokenize`.
#[derive(Args, Debug)]
pub(crate) struct DetokenizeArgs {
    /// Snapshot directory.
    pub model: PathBuf,
    /// Token ids, comma separated.
    #[arg(long)]
    pub ids: String,
    /// Render special tokens by name instead of hiding them.
    #[arg(long)]
    pub show_special: bool,
}

/// Runs `k3 tokenize`.
pub(crate) fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::from_dir(&a.model)?;
    let text = match a.text.as_deref() {
        Some("-") | None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading standard input")?;
            s
        }
        Some(t) => t.to_string(),
    };
    let ids = if a.special {
        tok.try_encode_with_special(&text)?
    } else {
        tok.try_encode(&text)?
    };
    if a.json {
        let items: Vec<serde_json::Value> = ids
            .iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                serde_json::json!({ "id": id, "bytes": String::from_utf8_lossy(bytes), "hex": hex(bytes) })
            })
            .collect();
        println!("{}", serde_json::to_string(&items)?);
    } else {
        let s: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", s.join(","));
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `k3 detokenize`.
pub(crate) fn detokenize(a: DetokenizeArgs) -> Result<()> {
    let tok = Tokenizer::from_dir(&a.model)?;
    println!("{}", tok.decode(&parse_ids(&a.ids)?, a.show_special)?);
    Ok(())
}
