//! A small Kimi-format tokenizer for synthetic test models: 256 byte tokens, BPE merges
//! learned from a built-in English/code text, and K3's special tokens at the top.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use base64::Engine as _;

use super::bpe::KIMI_PAT_STR;
use super::special::RESERVED_SPECIAL_TOKENS;

/// The text the merges are learned from (English prose, Rust, Python, JSON, shell).
const CORPUS: &str = include_str!("synthetic_corpus.txt");

/// K3's named added tokens as offsets from `[BOS]` (K3: bos 163584), from the
/// released `tokenizer_config.json`'s `added_tokens_decoder`. `[UNK]` sits just
/// below `[PAD]` at the top of the vocabulary there.
const K3_SPECIALS: &[(u32, &str)] = &[
    (1, "[EOS]"),
    (3, "<|open|>"),
    (4, "<|close|>"),
    (5, "<|sep|>"),
    (6, "[start_header_id]"),
    (7, "[end_header_id]"),
    (9, "[EOT]"),
    (18, "<|media_begin|>"),
    (19, "<|media_content|>"),
    (20, "<|media_end|>"),
    (21, "<|media_pad|>"),
    (65, "<osagent_mode>"),
];

/// Writes `tiktoken.model` and `tokenizer_config.json` for a vocabulary of `vocab_size`
/// ids: BPE ranks fill `0..bos`, added tokens `bos..vocab_size`, with `[BOS]` at bos,
/// `<|end_of_msg|>` at eos (K3's eos), `[PAD]` at pad and K3's other specials at K3's
/// offsets from bos where they fit. Deterministic: same arguments, same files.
pub fn write_synthetic_tokenizer(
    dir: &Path,
    vocab_size: usize,
    bos: u32,
    eos: u32,
    pad: u32,
) -> Result<()> {
    let vocab = u32::try_from(vocab_size)
        .with_context(|| format!("synthetic tokenizer: vocab_size {vocab_size} is too large"))?;
    if bos < 256 {
        bail!(
            "synthetic tokenizer: bos {bos} must be at least 256 (the 256 byte tokens come first)"
        );
    }
    if vocab < bos + RESERVED_SPECIAL_TOKENS {
        bail!(
            "synthetic tokenizer: vocab_size {vocab} must be at least bos + {RESERVED_SPECIAL_TOKENS} \
             = {} (Kimi reserves {RESERVED_SPECIAL_TOKENS} special ids above the BPE ranks)",
            bos + RESERVED_SPECIAL_TOKENS
        );
    }
    for (name, id) in [("eos", eos), ("pad", pad)] {
        if id <= bos || id >= vocab {
            bail!(
                "synthetic tokenizer: {name} {id} must lie in the special range {}..{vocab}",
                bos + 1
            );
        }
    }
    if eos == pad {
        bail!("synthetic tokenizer: eos and pad are both {eos}; they need different ids");
    }
    let ranks = learn_ranks(bos as usize)?;
    let specials = layout_specials(vocab, bos, eos, pad)?;

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut model = String::new();
    for (rank, bytes) in ranks.iter().enumerate() {
        model.push_str(&base64::engine::general_purpose::STANDARD.encode(bytes));
        model.push(' ');
        model.push_str(&rank.to_string());
        model.push('\n');
    }
    let model_path = dir.join("tiktoken.model");
    crate::atomic_file::write_atomically(&model_path, model.as_bytes())?;

    let mut decoder = serde_json::Map::new();
    for (id, name) in &specials {
        // K3 marks the three XTML delimiters non-special so HF decoding keeps them.
        let special = !matches!(name.as_str(), "<|open|>" | "<|close|>" | "<|sep|>");
        decoder.insert(
            id.to_string(),
            serde_json::json!({
                "content": name, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": special,
            }),
        );
    }
    let name_at = |id: u32| specials.get(&id).cloned();
    let mut config = serde_json::json!({
        "added_tokens_decoder": decoder,
        "bos_token": name_at(bos),
        "eos_token": name_at(eos),
        "pad_token": name_at(pad),
        "tokenizer_class": "TikTokenTokenizer",
        "model_max_length": 1_048_576,
    });
    if let Some((&unk, _)) = specials.iter().find(|(_, n)| n.as_str() == "[UNK]") {
        config["unk_token"] = serde_json::json!(name_at(unk));
    }
    let config_path = dir.join("tokenizer_config.json");
    let text = crate::canonical_json::to_string_pretty(&config)?;
    crate::atomic_file::write_atomically(&config_path, text.as_bytes())?;
    Ok(())
}

/// Places the named specials: bos, eos and pad first, then K3's others at their
/// offsets from bos, or at the lowest free id when that slot is taken or out of range.
fn layout_specials(vocab: u32, bos: u32, eos: u32, pad: u32) -> Result<BTreeMap<u32, String>> {
    let mut out = BTreeMap::new();
    out.insert(bos, "[BOS]".to_string());
    out.insert(eos, "<|end_of_msg|>".to_string());
    out.insert(pad, "[PAD]".to_string());
    let slots = K3_SPECIALS
        .iter()
        .map(|&(off, name)| (bos + off, name))
        .chain(std::iter::once((vocab - 2, "[UNK]")));
    for (slot, name) in slots {
        let id = if slot < vocab && !out.contains_key(&slot) {
            slot
        } else {
            match (bos..vocab).find(|i| !out.contains_key(i)) {
                Some(free) => free,
                None => bail!("synthetic tokenizer: no free special id left for {name}"),
            }
        };
        out.insert(id, name.to_string());
    }
    Ok(out)
}

/// Learns byte-level BPE ranks until there are `n_ranks` of them. Merges come from
/// pair counts over the corpus' pre-split pieces (ties: lowest pair of ids); when the
/// corpus has no pairs left, digit groups, space runs and ASCII pairs fill the rest.
fn learn_ranks(n_ranks: usize) -> Result<Vec<Vec<u8>>> {
    let mut vocab: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut index: HashMap<Vec<u8>, u32> = vocab
        .iter()
        .enumerate()
        .map(|(i, b)| (b.clone(), i as u32))
        .collect();

    let regex = fancy_regex::Regex::new(KIMI_PAT_STR)
        .map_err(|e| anyhow::anyhow!("compiling the Kimi pre-split pattern: {e}"))?;
    let mut piece_counts: BTreeMap<&[u8], u64> = BTreeMap::new();
    for m in regex.find_iter(CORPUS) {
        let m = m.map_err(|e| anyhow::anyhow!("splitting the built-in corpus: {e}"))?;
        *piece_counts.entry(m.as_str().as_bytes()).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, u64)> = piece_counts
        .into_iter()
        .filter(|(p, _)| p.len() > 1)
        .map(|(p, c)| (p.iter().map(|&b| b as u32).collect(), c))
        .collect();

    while vocab.len() < n_ranks {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, c) in &words {
            for pair in w.windows(2) {
                *pairs.entry((pair[0], pair[1])).or_default() += c;
            }
        }
        let Some((&(a, b), _)) = pairs
            .iter()
            .max_by(|x, y| x.1.cmp(y.1).then_with(|| y.0.cmp(x.0)))
        else {
            break;
        };
        let mut merged = vocab[a as usize].clone();
        merged.extend_from_slice(&vocab[b as usize]);
        // Two merge paths can spell the same bytes; a rank exists once.
        let id = match index.get(&merged) {
            Some(&id) => id,
            None => {
                let id = vocab.len() as u32;
                index.insert(merged.clone(), id);
                vocab.push(merged);
                id
            }
        };
        for (w, _) in &mut words {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == a && w[i + 1] == b {
                    out.push(id);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
        words.retain(|(w, _)| w.len() > 1);
    }

    let digits = (0..100)
        .map(|n| format!("{n:02}"))
        .chain((0..1000).map(|n| format!("{n:03}")));
    let spaces = (2..=16).map(|n| " ".repeat(n));
    let ascii_pairs = (0x20u8..0x7f)
        .flat_map(|a| (0x20u8..0x7f).map(move |b| String::from_utf8_lossy(&[a, b]).into_owned()));
    // Triples give the release-sized vocabulary (163,584 BPE ranks) of `k3-slice`.
    let ascii_triples = (0x20u8..0x7f).flat_map(|a| {
        (0x20u8..0x7f).flat_map(move |b| {
            (0x20u8..0x7f).map(move |c| String::from_utf8_lossy(&[a, b, c]).into_owned())
        })
    });
    for filler in digits.chain(spaces).chain(ascii_pairs).chain(ascii_triples) {
        if vocab.len() >= n_ranks {
            break;
        }
        let bytes = filler.into_bytes();
        if !index.contains_key(&bytes) {
            index.insert(bytes.clone(), vocab.len() as u32);
            vocab.push(bytes);
        }
    }
    if vocab.len() < n_ranks {
        bail!(
            "synthetic tokenizer: bos {n_ranks} asks for more BPE ranks than the built-in \
             text and fillers provide ({}); use a smaller bos",
            vocab.len()
        );
    }
    Ok(vocab)
}
