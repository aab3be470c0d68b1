//! One constrained generation: llguidance's matcher over the K3 trie, asked for the ids the
//! grammar allows before each token and told which one was sampled.

use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory};

use super::reply_grammar::{reply_lark, OutputConstraint, ReplyFrame};
use super::token_env::K3TokEnv;
use crate::tokenizer::Tokenizer;

/// Compiles constraints for one tokenizer; built once (the trie and the lexer's token
/// slices cost milliseconds), shared by every request.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    /// Builds the trie of `tok` with `eos_ids` as the ids a finished grammar allows.
    pub fn new(tok: &Tokenizer, eos_ids: &[u32]) -> Result<Self> {
        let env = K3TokEnv::new(tok, eos_ids)?.into_env();
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A fresh constraint for one reply; a schema llguidance cannot compile is an error
    /// that says why.
    pub fn constrain(&self, c: &OutputConstraint, frame: ReplyFrame) -> Result<TokenConstraint> {
        let lark = reply_lark(c, frame)?;
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| anyhow!("the output constraint does not compile: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("the output constraint does not compile: {e}");
        }
        Ok(TokenConstraint {
            matcher,
            mask: None,
        })
    }
}

/// The grammar state of one reply.
pub struct TokenConstraint {
    matcher: Matcher,
    /// The mask of the current step, computed once.
    mask: Option<SimpleVob>,
}

impl Clone for TokenConstraint {
    /// An independent copy (its own parser state and lexer caches), so each of a request's
    /// choices advances its own constraint.
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
        }
    }
}

impl TokenConstraint {
    /// Computes the mask of the current step now, so the first pick does not pay for it
    /// (a server does this where the request is read, off the engine's thread).
    pub fn prepare(&mut self) -> Result<()> {
        self.current_mask().map(|_| ())
    }

    /// Sets every logit the grammar does not allow now to -inf (ids past the tokenizer's
    /// vocabulary included). Once the grammar is complete only end-of-sequence ids remain.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.current_mask()?;
        if mask.num_set() == 0 {
            bail!("the output constraint allows no token here (the grammar is stuck)");
        }
        let n = mask.len().min(logits.len());
        for (id, l) in logits[..n].iter_mut().enumerate() {
            if !mask.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
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
        if self.matcher.is_stopped() {
            // Past the end: only the end-of-sequence ids the mask allowed come here.
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| anyhow!("token {id} does not fit the output constraint: {e}"))
    }

    /// Whether the constrained text is complete.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn current_mask(&mut self) -> Result<&SimpleVob> {
        if self.mask.is_none() {
            let m = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| anyhow!("the output constraint failed: {e}"))?;
            self.mask = Some(m);
        }
        self.mask
            .as_ref()
            .ok_or_else(|| anyhow!("the output constraint has no mask"))
    }
}
