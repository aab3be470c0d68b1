//! A conversation with the model: the state of everything fed so far, so a new turn only
//! feeds its own tokens (prefix reuse), and a decode loop that can be stopped.

use crate::backend::Backend;
use crate::generate::prefill;
use crate::model::{K3Model, Logits, State};
use crate::sampling::Sampler;
use crate::stats::Stats;
use anyhow::Result;

/// What the decode loop should do after a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now (the token is still part of the conversation).
    Stop,
}

/// Model state plus the tokens it has consumed.
pub struct Session<'m, B: Backend> {
    model: &'m K3Model<B>,
    state: State<B>,
    tokens: Vec<u32>,
    last_logits: Vec<f32>,
    chunk: usize,
    /// Counters since the session started.
    pub stats: Stats,
}

impl<'m, B: Backend> Session<'m, B> {
    /// An empty conversation; prompts are prefilled `chunk` tokens at a time.
    pub fn new(model: &'m K3Model<B>, chunk: usize) -> Result<Self> {
        Ok(Self {
            model,
            state: model.new_state()?,
            tokens: Vec::new(),
            last_logits: Vec::new(),
            chunk,
            stats: Stats::default(),
        })
    }

    /// Tokens consumed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets everything.
    pub fn reset(&mut self) -> Result<()> {
        self.state = self.model.new_state()?;
        self.tokens.clear();
        self.last_logits.clear();
        Ok(())
    }

    /// Feeds `ids` after what was consumed.
    pub fn feed(&mut self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.last_logits = prefill(
            self.model,
            &mut self.state,
            ids,
            self.chunk,
            false,
            &mut self.stats,
            None,
        )?;
        self.tokens.extend_from_slice(ids);
        Ok(())
    }

    /// Brings the session to exactly `ids`: feeds only the new suffix when what was consumed
    /// is a prefix of `ids`, else starts over. Returns how many tokens were fed.
    pub fn sync_to(&mut self, ids: &[u32]) -> Result<usize> {
        if !ids.starts_with(&self.tokens) {
            self.reset()?;
        }
        let new = ids[self.tokens.len()..].to_vec();
        self.feed(&new)?;
        Ok(new.len())
    }

    /// Samples tokens until `on_token` says stop or `max` tokens; every token generated is
    /// fed back, so the conversation can go on from where it stopped.
    pub fn generate(
        &mut self,
        max: usize,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> Result<Flow>,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if self.last_logits.is_empty() {
            return Ok(out);
        }
        for _ in 0..max {
            let id = sampler.sample(&self.last_logits, &self.tokens);
            out.push(id);
            let flow = on_token(id)?;
            self.last_logits =
                self.model
                    .forward(&mut self.state, &[id], Logits::Last, &mut self.stats, None)?;
            self.tokens.push(id);
            if flow == Flow::Stop {
                break;
            }
        }
        Ok(out)
    }
}
