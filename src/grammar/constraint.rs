//! One constrained generation: llguidance's matcher over the K3 trie, asked for the ids the
//! grammar allows before each token and told which one was sampled.

use anyhow::{anyhow, bail, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::closing::{JsonCursor, TokenTexts};
use super::reply_grammar::{reply_lark, OutputConstraint, ReplyFrame};
use super::token_env::K3TokEnv;
use crate::tokenizer::Tokenizer;

/// Largest grammar text a constraint may compile to (the schemas and the frame), in bytes.
/// Compile time and memory grow with it; 1 MiB holds the largest real-world schemas.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// llguidance's limits, tighter than its defaults where they bound memory: grammar symbols
/// (its default 500,000 is a few MB of schema) and lexer states (1-2 kB each, so 100,000
/// is at most about 200 MB). Errors leave out the parser state and the grammar.
fn parser_limits() -> ParserLimits {
    ParserLimits {
        max_grammar_size: 200_000,
        max_lexer_states: 100_000,
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// A compile refused because the most allowed at once are running.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompilerBusy {
    /// Compiles allowed at once.
    pub max: usize,
}

impl std::fmt::Display for CompilerBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} output constraints are compiling already, the most allowed at once; retry shortly",
            self.max
        )
    }
}

impl std::error::Error for CompilerBusy {}

/// One compile's place among those allowed at once, given back when dropped.
pub struct CompileSlot<'a> {
    busy: &'a AtomicUsize,
}

impl Drop for CompileSlot<'_> {
    fn drop(&mut self) {
        self.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// llguidance's message as one line of ours: its first line, without the grammar
/// position (`at 2(8): `, a line of the Lark text the client never saw) and without a
/// caught panic's backtrace (it names the build's source paths).
pub fn library_message(e: &str) -> String {
    let line = e.lines().next().unwrap_or("").trim();
    let line = match line.strip_prefix("at ").and_then(|r| r.split_once("): ")) {
        Some((pos, rest)) if pos.chars().all(|c| c.is_ascii_digit() || c == '(') => rest,
        _ => line,
    };
    let mut out: String = line.chars().take(400).collect();
    if out.len() < line.len() {
        out.push_str("...");
    }
    out
}

/// Compiles constraints for one tokenizer; built once (the trie and the lexer's token
/// slices cost milliseconds), shared by every request. At most `max_compiles` compile at
/// once ([`Self::with_max_compiles`]); one more is refused with [`CompilerBusy`].
pub struct GrammarCompiler {
    factory: ParserFactory,
    texts: Arc<TokenTexts>,
    busy: AtomicUsize,
    max_compiles: usize,
}

impl GrammarCompiler {
    /// Builds the trie of `tok` with `eos_ids` as the ids a finished grammar allows.
    pub fn new(tok: &Tokenizer, eos_ids: &[u32]) -> Result<Self> {
        let env = K3TokEnv::new(tok, eos_ids)?.into_env();
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        *factory.limits_mut() = parser_limits();
        Ok(Self {
            factory,
            texts: Arc::new(TokenTexts::new(tok, eos_ids)),
            busy: AtomicUsize::new(0),
            max_compiles: usize::MAX,
        })
    }

    /// Allows at most `n` (at least 1) compiles at once: each holds its grammar's memory
    /// and a thread until done.
    pub fn with_max_compiles(mut self, n: usize) -> Self {
        self.max_compiles = n.max(1);
        self
    }

    /// A place for one compile, or [`CompilerBusy`] when every place is taken.
    pub fn try_slot(&self) -> Result<CompileSlot<'_>, CompilerBusy> {
        let max = self.max_compiles;
        self.busy
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                (b < max).then_some(b + 1)
            })
            .map_err(|_| CompilerBusy { max })?;
        Ok(CompileSlot { busy: &self.busy })
    }

    /// A fresh constraint for one reply, its first mask and shortest reply computed
    /// ([`TokenConstraint::prepare`]); a schema llguidance cannot compile is an error that
    /// says why in one line, a schema the grammar cannot enforce a
    /// [`super::schema_check::SchemaError`] naming its path, and a compile while the most
    /// allowed are running a [`CompilerBusy`].
    pub fn constrain(&self, c: &OutputConstraint, frame: ReplyFrame) -> Result<TokenConstraint> {
        let _slot = self.try_slot()?;
        let lark = reply_lark(c, frame)?;
        if lark.len() > MAX_GRAMMAR_BYTES {
            bail!(
                "the output constraint's grammar is {} bytes; at most {MAX_GRAMMAR_BYTES} are compiled (smaller schemas or fewer tools)",
                lark.len()
            );
        }
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| {
                anyhow!(
                    "the output constraint does not compile: {}",
                    library_message(&format!("{e}"))
                )
            })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!(
                "the output constraint does not compile: {}",
                library_message(&e)
            );
        }
        let mut k = TokenConstraint {
            matcher,
            mask: None,
            texts: self.texts.clone(),
            cursor: JsonCursor::default(),
            shortest: None,
        };
        k.prepare()?;
        Ok(k)
    }
}

/// Longest run of the shortest-reply estimate: a grammar whose shortest reply is longer
/// (a huge `minLength`) closes from that many tokens before the budget's end.
const MAX_CLOSE_STEPS: usize = 1024;

/// The grammar state of one reply.
pub struct TokenConstraint {
    matcher: Matcher,
    /// The mask of the current step, computed once.
    mask: Option<SimpleVob>,
    texts: Arc<TokenTexts>,
    /// Where the reply's JSON stands, for the budget-aware close.
    cursor: JsonCursor,
    /// Tokens the shortest reply takes from the start ([`Self::shortest_reply`]).
    shortest: Option<usize>,
}

impl Clone for TokenConstraint {
    /// An independent copy (its own parser state and lexer caches), so each of a request's
    /// choices advances its own constraint.
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
            texts: self.texts.clone(),
            cursor: self.cursor.clone(),
            shortest: self.shortest,
        }
    }
}

impl TokenConstraint {
    /// Computes the mask of the current step now, so the first pick does not pay for it
    /// (a server does this where the request is read, off the engine's thread).
    pub fn prepare(&mut self) -> Result<()> {
        self.current_mask()?;
        self.shortest_reply().map(|_| ())
    }

    /// Tokens the reply takes from here when every step takes the closing token (the
    /// lowest allowed id where there is none), found by running a copy of the grammar;
    /// computed once, at the reply's start, where it covers what the schema requires
    /// (required keys, enum values, minimum lengths) and the frame. At most
    /// [`MAX_CLOSE_STEPS`].
    fn shortest_reply(&mut self) -> Result<usize> {
        if let Some(n) = self.shortest {
            return Ok(n);
        }
        let mut m = self.matcher.deep_clone();
        let mut cursor = self.cursor.clone();
        let mut steps = 0;
        while steps < MAX_CLOSE_STEPS && !m.is_stopped() {
            let mask = m.compute_mask_or_eos().map_err(|e| {
                anyhow!(
                    "the output constraint failed: {}",
                    library_message(&format!("{e}"))
                )
            })?;
            let Some(id) = self
                .texts
                .closing_id(&cursor, |id| mask.is_allowed(id))
                .or_else(|| mask.first_bit_set().map(|i| i as u32))
            else {
                break;
            };
            match self.texts.text(id) {
                Some(bytes) => cursor.push_bytes(bytes),
                None => cursor.reset(),
            }
            steps += 1;
            if m.consume_token(id).is_err() {
                break;
            }
        }
        self.shortest = Some(steps);
        Ok(steps)
    }

    /// Sets every logit the grammar does not allow now to -inf (ids past the tokenizer's
    /// vocabulary included). Once the grammar is complete only end-of-sequence ids remain.
    /// With `remaining` tokens of budget left (this one included) and that near what
    /// closing the reply takes, only the allowed token that closes fastest is left, when
    /// there is one (`closing.rs`).
    pub fn mask_logits(&mut self, logits: &mut [f32], remaining: Option<usize>) -> Result<()> {
        let closing = match remaining {
            Some(r) => r <= self.shortest_reply()? + self.cursor.reserve(),
            None => false,
        };
        self.current_mask()?;
        let Some(mask) = self.mask.as_ref() else {
            bail!("the output constraint has no mask");
        };
        if mask.num_set() == 0 {
            bail!("the output constraint allows no token here (the grammar is stuck)");
        }
        if closing {
            if let Some(id) = self
                .texts
                .closing_id(&self.cursor, |id| mask.is_allowed(id))
            {
                for (i, l) in logits.iter_mut().enumerate() {
                    if i != id as usize {
                        *l = f32::NEG_INFINITY;
                    }
                }
                return Ok(());
            }
        }
        let n = mask.len().min(logits.len());
        // A word at a time: inside a string nearly every id is allowed, and a full word
        // needs no per-id test.
        for (w, &bits) in mask.as_slice().iter().enumerate() {
            if bits == u32::MAX {
                continue;
            }
            let base = w * 32;
            for (b, l) in logits[base.min(n)..(base + 32).min(n)]
                .iter_mut()
                .enumerate()
            {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for l in &mut logits[n..] {
            *l = f32::NEG_INFINITY;
        }
        Ok(())
    }

    /// Whether the grammar allows `id` now.
    pub fn allows(&mut self, id: u32) -> Result<bool> {
        Ok(self.current_mask()?.is_allowed(id))
    }

    /// Advances the grammar by the sampled id.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        self.mask = None;
        match self.texts.text(id) {
            Some(bytes) => self.cursor.push_bytes(bytes),
            None => self.cursor.reset(),
        }
        if self.matcher.is_stopped() {
            // Past the end: only the end-of-sequence ids the mask allowed come here.
            return Ok(());
        }
        self.matcher.consume_token(id).map_err(|e| {
            anyhow!(
                "token {id} does not fit the output constraint: {}",
                library_message(&format!("{e}"))
            )
        })
    }

    /// Whether the constrained text is complete.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn current_mask(&mut self) -> Result<&SimpleVob> {
        if self.mask.is_none() {
            let m = self.matcher.compute_mask_or_eos().map_err(|e| {
                anyhow!(
                    "the output constraint failed: {}",
                    library_message(&format!("{e}"))
                )
            })?;
            self.mask = Some(m);
        }
        self.mask
            .as_ref()
            .ok_or_else(|| anyhow!("the output constraint has no mask"))
    }
}

#[cfg(test)]
mod tests {
    use super::library_message;

    #[test]
    fn library_errors_become_one_line_without_positions_or_backtraces() {
        assert_eq!(
            library_message("at 2(8): failed to compile JSON schema: x\n   1 | start: value\n"),
            "failed to compile JSON schema: x"
        );
        assert_eq!(
            library_message(
                "panic: boom\n<backtrace>\n0: /home/u/.cargo/registry/x.rs\n</backtrace>"
            ),
            "panic: boom"
        );
        assert_eq!(library_message("at least one"), "at least one");
        assert!(library_message(&"y".repeat(1000)).ends_with("..."));
    }
}
