//! The K3 layer schedule (docs/model.md#layer-schedule), written once against the op interface.

mod load;

use super::batch::{RowLayout, SegmentRows};
use super::glu_mlp::GluMlp;
use super::kda::Kda;
use super::loader::Startup;
use super::mla::Mla;
use super::moe::{Moe, NextMoe};
use super::pass_observer::PassObserver;
use super::pieces::PieceState;
use super::prefill_window::{moe_row_bytes, row_chunks};
use super::runtime::Runtime;
use super::trace::Trace;
use crate::backend::{split_pieces, Backend, Glu};
use crate::checkpoint::{Checkpoint, TensorSpec};
use crate::experts::plan::expert_plan::ExpertAccess;
use crate::stats::Stats;
use anyhow::{anyhow, bail, Context, Result};

enum Attn<B: Backend> {
    Kda(Kda<B>),
    Mla(Mla<B>),
}

enum Ffn<B: Backend> {
    Dense(GluMlp<B>),
    Moe(Moe<B>),
}

struct Layer<B: Backend> {
    input_norm: B::Act,
    post_norm: B::Act,
    w_attn_res: B::Act,
    w_mlp_res: B::Act,
    attn: Attn<B>,
    ffn: Ffn<B>,
}

/// Recurrent state of one layer.
pub(super) enum LayerState<B: Backend> {
    Kda(B::KdaState),
    Mla(B::MlaCache),
}

/// Everything a conversation carries from token to token: KDA states and MLA caches.
pub struct State<B: Backend> {
    pub(super) layers: Vec<LayerState<B>>,
    /// Tokens consumed so far.
    pub pos: usize,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the window's last row.
    Last,
    /// Every row of the window.
    All,
}

/// One sequence's rows in a batched forward pass ([`K3Model::forward_batch`]).
pub struct Segment<'s, B: Backend> {
    /// The sequence's state (advanced by `ids.len()`).
    pub state: &'s mut State<B>,
    /// Its tokens this pass: one for a decoding sequence, a slice of its prompt for one prefilling.
    pub ids: &'s [u32],
    /// Which of its logits to return.
    pub want: Logits,
}

/// The final mix, norm and lm_head.
struct Output<B: Backend> {
    final_norm: B::Act,
    w_out: B::Act,
    head: B::Mat,
}

/// A loaded K3 model bound to one backend: its weights and the layer schedule. What a
/// pass runs with besides (the expert source, the prefill window, ...) is the
/// [`Runtime`] it is lent.
pub struct K3Model<B: Backend> {
    /// The checkpoint (embeddings and experts are read from it on demand).
    pub ckpt: Checkpoint,
    /// The backend running every op.
    pub backend: B,
    /// The embedding table, read a row per token.
    embed: TensorSpec,
    layers: Vec<Layer<B>>,
    /// `None` on a model of routed experts only ([`K3Model::experts_only`]).
    output: Option<Output<B>>,
    glu: Glu,
    startup: Startup,
}

impl<B: Backend> K3Model<B> {
    /// The most tokens one forward pass may take on this backend: the MoE layer runs the
    /// whole window at once, so its widest row bounds it (no bound on the CPU).
    pub fn max_window(&self) -> usize {
        self.backend.max_rows(moe_row_bytes(&self.ckpt.config))
    }

    /// How the start went: time to ready, the dense load, the weight cache.
    pub fn startup(&self) -> &Startup {
        &self.startup
    }

    /// Waits for a weight-cache write the start left to the background (the model runs
    /// meanwhile) and returns the start's figures with its outcome.
    pub fn finish_startup(&mut self) -> &Startup {
        self.startup.wait_for_cache_write();
        &self.startup
    }

    /// Fresh state: zero KDA states, empty MLA caches.
    pub fn new_state(&self) -> Result<State<B>> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match &l.attn {
                    Attn::Kda(k) => LayerState::Kda(k.new_state(&self.backend)?),
                    Attn::Mla(m) => LayerState::Mla(m.new_cache(&self.backend)?),
                })
            })
            .collect::<Result<_>>()?;
        Ok(State { layers, pos: 0 })
    }

    /// The gated linear unit the MLPs and experts use.
    pub fn glu(&self) -> Glu {
        self.glu
    }

    /// Layers of the model.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Vocabulary size (width of a logits row).
    pub fn vocab_size(&self) -> usize {
        self.ckpt.config.vocab_size
    }

    fn embed(&self, ids: &[u32]) -> Result<B::Act> {
        let v = self.ckpt.config.vocab_size;
        let mut rows = Vec::with_capacity(ids.len() * self.ckpt.config.hidden_size);
        for &id in ids {
            if id as usize >= v {
                bail!("token id {id} is out of range: the model's vocab_size is {v} (ids 0..{v})");
            }
            rows.extend(self.ckpt.read_row_f32(&self.embed.name, id as usize)?);
        }
        self.backend
            .upload(&rows, ids.len(), self.ckpt.config.hidden_size)
    }

    /// Runs `ids` (one window of the prompt) through every layer, advancing `st`, and
    /// returns the logits of the last row or of every row, row-major. The pass is
    /// layer-major: every row goes through layer L (each routed expert read once for all
    /// the rows that chose it) before any goes to layer L+1. Stats, progress, the trace and the NaN checks are the `PassObserver`'s.
    pub fn forward(
        &self,
        rt: &Runtime,
        st: &mut State<B>,
        ids: &[u32],
        want: Logits,
        stats: &mut Stats,
        trace: Option<&Trace>,
    ) -> Result<Vec<f32>> {
        self.forward_until(rt, st, ids, want, stats, trace, None)?
            .ok_or_else(|| anyhow::anyhow!("internal: a pass without a cancel flag was cancelled"))
    }

    /// [`Self::forward`] that checks `cancel` before each layer, so a long window stops
    /// within one layer's time: None when it was raised. A pass stopped part-way leaves
    /// `st` part-advanced (the layers before the stop saw the window, the rest did not);
    /// the caller restores or resets it.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_until(
        &self,
        rt: &Runtime,
        st: &mut State<B>,
        ids: &[u32],
        want: Logits,
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Option<Vec<f32>>> {
        let mut segs = [Segment {
            state: st,
            ids,
            want,
        }];
        match self.forward_batch(rt, &mut segs, stats, trace, cancel)? {
            None => Ok(None),
            Some(logits) => logits
                .into_iter()
                .next()
                .map(Some)
                .ok_or_else(|| anyhow::anyhow!("internal: a pass of one segment returned none")),
        }
    }

    /// Runs every segment's rows through the model in one layer-major pass and returns each
    /// segment's logits (as [`Self::forward`] would for it alone), or None when `cancel` was
    /// raised (checked before each layer; the states are then part-advanced, as in
    /// [`Self::forward_until`]). The rows of all segments are concatenated in segment order:
    /// the embedding, the residual mixes and norms, the dense MLPs, the MoE layers (each
    /// routed expert read once a layer for every row routed to it, whatever its sequence)
    /// and the head run over all of them; attention runs on each segment's rows with its own
    /// state.
    pub fn forward_batch(
        &self,
        rt: &Runtime,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        self.forward_pass(rt, segs, stats, trace, cancel, rt.prefetch)
    }

    /// Whether the host cache holds every routed expert of every MoE layer, so that no
    /// pass reads one.
    pub(crate) fn every_expert_cached(&self, rt: &Runtime) -> Result<bool> {
        let cfg = &self.ckpt.config;
        let moe_layers = (0..cfg.num_hidden_layers).filter(|&i| cfg.is_moe_layer(i));
        rt.experts.holds_every_expert(moe_layers, cfg.num_experts)
    }

    /// [`Self::forward_batch`] with the next MoE layer's guesses on or off (`read_ahead`):
    /// a pass that can read no expert has nothing to guess.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_pass(
        &self,
        rt: &Runtime,
        segs: &mut [Segment<'_, B>],
        stats: &mut Stats,
        trace: Option<&Trace>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
        read_ahead: bool,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let raised = || cancel.is_some_and(|c| c.load(std::sync::atomic::Ordering::SeqCst));
        let cfg = &self.ckpt.config;
        let layout = self.layout(segs)?;
        rt.relieve_memory_pressure(cfg, &self.backend)?;
        let ids: Vec<u32> = segs.iter().flat_map(|s| s.ids.iter().copied()).collect();
        // h: the residual stream, [rows, hidden].
        let mut h = self.embed(&ids)?;
        let mut obs = PassObserver::begin(&rt.experts, &rt.progress, stats, trace, &layout)?;
        // bank: the blocks' banked inputs, each [rows, hidden].
        let mut bank: Vec<B::Act> = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if raised() {
                return Ok(None);
            }
            // ls[s]: segment s's state of layer i.
            let mut ls: Vec<&mut LayerState<B>> = segs
                .iter_mut()
                .filter_map(|s| s.state.layers.get_mut(i))
                .collect();
            // p: the residual stream after attention, [rows, hidden].
            let p = self.attention_block(i, layer, &mut ls, &layout, h, &mut bank)?;
            obs.attention_done();
            // The prefetch hook: the next MoE layer's router input as far as it exists now,
            // scored while this layer's experts are read (None when read-ahead is off or the
            // prefetch gate skips this pass).
            let guess = self.next_moe_guess(rt, read_ahead, i, &p, &bank, obs.stats())?;
            let next = guess.as_ref().map(|(moe, x)| NextMoe { moe, x });
            // f: the feed-forward output, [rows, hidden].
            let f = self.ffn_block(rt, i, &p, &bank, next, &layout, &mut obs)?;
            h = self.backend.add(&p, &f)?;
            obs.ffn_done();
            obs.layer_output(&self.backend, i, &h, cfg.hidden_size)?;
        }
        obs.layers_done();
        let logits = self.head(rt, &h, &bank, &layout)?;
        obs.head_done(&logits, self.vocab_size())?;
        for s in segs.iter_mut() {
            s.state.pos += s.ids.len();
        }
        Ok(Some(logits))
    }

    /// Where the segments' rows lie, each segment's state and ids checked, and the pass
    /// within the rows the backend runs at once.
    fn layout(&self, segs: &[Segment<'_, B>]) -> Result<RowLayout> {
        for (s, seg) in segs.iter().enumerate() {
            if seg.state.layers.len() != self.layers.len() {
                bail!(
                    "forward: the state{} holds {} layers; the model has {}",
                    RowLayout::name(segs.len(), s),
                    seg.state.layers.len(),
                    self.layers.len()
                );
            }
        }
        let rows: Vec<SegmentRows<'_>> = segs
            .iter()
            .map(|s| SegmentRows {
                ids: s.ids,
                pos: s.state.pos,
                all: s.want == Logits::All,
            })
            .collect();
        let layout = RowLayout::new(&rows, self.ckpt.config.vocab_size)?;
        if layout.rows() > self.max_window() {
            bail!(
                "forward: a pass of {} rows is more than this backend runs at once ({}); \
                 send fewer segments or shorter prompt slices",
                layout.rows(),
                self.max_window()
            );
        }
        Ok(layout)
    }

    /// Layer `i`'s input mix, norm and attention over the rows of `h`, advancing the
    /// segments' states `ls`; returns the residual stream after attention. A layer that
    /// opens a block banks its raw input into `bank` (and its residual restarts from the
    /// attention).
    fn attention_block(
        &self,
        i: usize,
        layer: &Layer<B>,
        ls: &mut [&mut LayerState<B>],
        layout: &RowLayout,
        h: B::Act,
        bank: &mut Vec<B::Act>,
    ) -> Result<B::Act> {
        let b = &self.backend;
        let cfg = &self.ckpt.config;
        let (eps, h_dim) = (cfg.rms_norm_eps, cfg.hidden_size);
        // x: the normed attention input, [rows, hidden].
        let x = if bank.is_empty() {
            b.rmsnorm(&h, &layer.input_norm, h_dim, eps)?
        } else {
            let refs: Vec<&B::Act> = bank.iter().collect();
            let mixed = b.attn_res_mix(&refs, &h, &layer.w_attn_res, eps)?;
            b.rmsnorm(&mixed, &layer.input_norm, h_dim, eps)?
        };
        // a: the attention output, [rows, hidden].
        let a = self.attend(i, layer, ls, layout, &x)?;
        // The raw layer input is banked after the mix; the prefix restarts at a bank.
        if i % cfg.attn_res_block_size == 0 {
            bank.push(h);
            Ok(a)
        } else {
            b.add(&h, &a)
        }
    }

    /// Layer `i`'s attention over the normed input `x`: the projections over all its rows,
    /// the recurrence or attention on each segment's rows with that segment's state.
    fn attend(
        &self,
        i: usize,
        layer: &Layer<B>,
        ls: &mut [&mut LayerState<B>],
        layout: &RowLayout,
        x: &B::Act,
    ) -> Result<B::Act> {
        let b = &self.backend;
        let pieces = ls.iter_mut().enumerate().map(|(s, st)| {
            let at = (layout.len() > 1).then(|| layout.at_segment(s));
            (&mut **st, layout.segment(s), at)
        });
        let mismatch =
            || anyhow::anyhow!("internal: layer {i} state does not match its attention kind");
        match &layer.attn {
            Attn::Kda(k) => {
                let mut ps = pieces
                    .map(|(st, rows, at)| match st {
                        LayerState::Kda(state) => Ok(PieceState { state, rows, at }),
                        LayerState::Mla(_) => Err(mismatch()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                k.forward(b, x, &mut ps)
            }
            Attn::Mla(m) => {
                let mut ps = pieces
                    .map(|(st, rows, at)| match st {
                        LayerState::Mla(state) => Ok(PieceState { state, rows, at }),
                        LayerState::Kda(_) => Err(mismatch()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                m.forward(b, x, &mut ps)
            }
        }
    }

    /// Layer `i`'s feed-forward input (the residual mix over `bank` and `p`, normed) and its
    /// dense MLP or MoE block; a MoE layer reads `next`'s likely experts ahead behind its own.
    // The pass's pieces (runtime, bank, layout, observer) have different owners and lives.
    #[allow(clippy::too_many_arguments)]
    fn ffn_block(
        &self,
        rt: &Runtime,
        i: usize,
        p: &B::Act,
        bank: &[B::Act],
        next: Option<NextMoe<'_, B>>,
        layout: &RowLayout,
        obs: &mut PassObserver<'_>,
    ) -> Result<B::Act> {
        let b = &self.backend;
        let layer = &self.layers[i];
        // x: the normed FFN input, [rows, hidden].
        let x = self.ffn_input(layer, bank, p)?;
        match &layer.ffn {
            Ffn::Dense(mlp) => mlp.forward(b, &x, self.glu),
            // Every row at once: each routed expert runs once for its rows.
            Ffn::Moe(moe) => moe
                .forward(
                    b,
                    ExpertAccess {
                        ck: &self.ckpt,
                        source: &rt.experts,
                        selection: &rt.selection,
                        remote: rt.remote.as_deref(),
                    },
                    &x,
                    self.glu,
                    next,
                    obs.stats(),
                )
                .with_context(|| format!("layer {i} (MoE) {}", layout.at_all())),
        }
    }

    /// `layer`'s feed-forward input: the residual mix of the bank and `p` (the stream after
    /// attention), normed.
    fn ffn_input(&self, layer: &Layer<B>, bank: &[B::Act], p: &B::Act) -> Result<B::Act> {
        let b = &self.backend;
        let cfg = &self.ckpt.config;
        let (eps, h_dim) = (cfg.rms_norm_eps, cfg.hidden_size);
        let refs: Vec<&B::Act> = bank.iter().collect();
        let mixed = b.attn_res_mix(&refs, p, &layer.w_mlp_res, eps)?;
        b.rmsnorm(&mixed, &layer.post_norm, h_dim, eps)
    }

    /// With `read_ahead`, a MoE layer next and the prefetch gate judging its guesses worth
    /// making this pass: that layer and its router's input as far as layer `i` can tell
    /// (its own mix and norm over `p`: its attention's output is all the input lacks),
    /// every row at once. The gate is asked first, so a pass that does not guess builds
    /// no input for it.
    fn next_moe_guess(
        &self,
        rt: &Runtime,
        read_ahead: bool,
        i: usize,
        p: &B::Act,
        bank: &[B::Act],
        stats: &mut Stats,
    ) -> Result<Option<(&Moe<B>, B::Act)>> {
        let (true, Some(Ffn::Moe(_)), Some(n)) = (
            read_ahead,
            self.layers.get(i).map(|l| &l.ffn),
            self.layers.get(i + 1),
        ) else {
            return Ok(None);
        };
        let Ffn::Moe(m) = &n.ffn else {
            return Ok(None);
        };
        if !rt.experts.should_guess(i + 1, stats)? {
            return Ok(None);
        }
        Ok(Some((m, self.ffn_input(n, bank, p)?)))
    }

    /// The final mix, norm and lm_head over the rows whose logits the segments want (each
    /// segment's last row or every row); returns each segment's logits, row-major.
    fn head(
        &self,
        rt: &Runtime,
        h: &B::Act,
        bank: &[B::Act],
        layout: &RowLayout,
    ) -> Result<Vec<Vec<f32>>> {
        let b = &self.backend;
        let cfg = &self.ckpt.config;
        let (eps, h_dim) = (cfg.rms_norm_eps, cfg.hidden_size);
        let o = self.output.as_ref().ok_or_else(|| {
            anyhow!("this model holds routed experts only (a rank of an expert-parallel job): it has no output head")
        })?;
        let wanted = layout.head_rows();
        let rows: usize = wanted.iter().map(|r| r.len()).sum();
        // x, xs: the wanted rows of the stream and of each bank entry, [rows, hidden].
        let picked;
        let (x, xs): (&B::Act, Vec<&B::Act>) = if rows == layout.rows() {
            (h, bank.iter().collect())
        } else {
            let bank_w: Vec<B::Act> = bank
                .iter()
                .map(|e| gather_rows(b, e, &wanted))
                .collect::<Result<_>>()?;
            picked = (gather_rows(b, h, &wanted)?, bank_w);
            (&picked.0, picked.1.iter().collect())
        };
        // out: the normed head input, [rows, hidden].
        let out = b.rmsnorm(
            &b.attn_res_mix(&xs, x, &o.w_out, eps)?,
            &o.final_norm,
            h_dim,
            eps,
        )?;
        let v = self.vocab_size();
        let lens: Vec<usize> = layout.logit_rows().iter().map(|n| n * v).collect();
        if rows <= rt.head_rows {
            // One call: each segment's logits come straight from the device's.
            return b.download_pieces(&b.matmul(&o.head, &out)?, &lens);
        }
        // Every wanted row's logits, in row order (which is segment order); the head's
        // output rows are the widest of the pass, so they go in calls of `head_rows`.
        let mut logits = Vec::new();
        for r in row_chunks(rows, rt.head_rows) {
            let piece = if r.len() == rows {
                b.matmul(&o.head, &out)?
            } else {
                b.matmul(&o.head, &b.slice_rows(&out, r.start, r.len())?)?
            };
            let got = b.download(&piece)?;
            // One call's logits are moved, not copied: they are megabytes a step.
            if logits.is_empty() {
                logits = got;
            } else {
                logits.extend(got);
            }
        }
        if let [n] = lens[..] {
            if logits.len() != n {
                bail!("internal: the head returned other than the segment's logits");
            }
            return Ok(vec![logits]);
        }
        split_pieces(&logits, &lens)
    }
}

/// The rows `ranges` of `x` as one activation.
fn gather_rows<B: Backend>(b: &B, x: &B::Act, ranges: &[std::ops::Range<usize>]) -> Result<B::Act> {
    let mut parts: Vec<B::Act> = ranges
        .iter()
        .map(|r| b.slice_rows(x, r.start, r.len()))
        .collect::<Result<_>>()?;
    if parts.len() == 1 {
        if let Some(p) = parts.pop() {
            return Ok(p);
        }
    }
    let refs: Vec<&B::Act> = parts.iter().collect();
    b.concat_rows(&refs)
}
