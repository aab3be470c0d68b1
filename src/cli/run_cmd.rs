//! `k3 run`: prefill + decode from token ids or text, with the stats lines users parse.

use super::model_args::{ensure_demo, ModelArgs, ModelJob};
use super::sampling_args::SamplingArgs;
use super::threads;
use super::token_output::TokenOutput;
use anyhow::{bail, Context, Result};
use clap::Args;
use k3::atomic_file::write_output;
use k3::backend::Backend;
use k3::generate::{generate, GenerateOptions};
use k3::grammar::{GrammarCompiler, OutputConstraint, ReplyFrame};
use k3::model::trace::Trace;
use k3::model::Runner;
use k3::stats;
use k3::token_picker::TokenPicker;
use k3::tokenizer::{chat_stop_ids, ChatOptions, ChatSplitter, Message, StreamDecoder, Tokenizer};
use std::path::{Path, PathBuf};

/// Flags of `k3 run`.
#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// Snapshot directory (config.json, index, shards). Not needed with --demo.
    #[arg(required_unless_present = "demo")]
    pub model: Option<PathBuf>,
    /// Prompt text (or use --ids for token ids).
    #[arg(conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Synthesize the built-in `tiny` model into the cache directory (once) and run it.
    #[arg(long)]
    pub demo: bool,
    /// Prompt token ids, comma separated (e.g. "1,2,3"); generated ids are printed likewise.
    #[arg(long)]
    pub ids: Option<String>,
    /// Prompt text, as an option (same as the positional PROMPT).
    #[arg(short = 'p', long = "prompt", conflicts_with_all = ["ids", "prompt"])]
    pub prompt_flag: Option<String>,
    /// Wrap the prompt in the chat format and print the think/response streams.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Thinking in --chat: 1 opens the think channel, 0 answers directly.
    #[arg(long, env = "K3_THINK", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub think: u8,
    /// Same as --think 0.
    #[arg(long)]
    pub no_think: bool,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub ngen: usize,
    /// Keep generating past an end-of-sequence id.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Write little-endian f32 logits [prompt positions × vocab] to this file. `-` is
    /// standard output; a FIFO or device is written in place, a symlink is followed, a
    /// regular file is replaced whole at the end of the run.
    #[arg(long, env = "K3_LOGITS", value_name = "PATH")]
    pub dump_logits: Option<PathBuf>,
    /// Per-layer hidden-state dumps (layer_NNN.f32, [positions × hidden]) into this directory.
    #[arg(long, env = "K3_TRACE", value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Write every counter of the run as JSON to this file. `-` is standard output (after
    /// the generated text); a FIFO or device is written in place, a symlink is followed, a
    /// regular file is replaced whole.
    #[arg(long, value_name = "PATH")]
    pub stats_json: Option<PathBuf>,
    /// Constrain the output to a JSON object (with --chat: the response), through the
    /// grammar engine.
    #[arg(long, env = "K3_JSON", conflicts_with = "json_schema", value_parser = clap::builder::FalseyValueParser::new())]
    pub json: bool,
    /// Constrain the output to JSON valid against the JSON schema in this file.
    #[arg(
        long,
        env = "K3_JSON_SCHEMA",
        value_name = "FILE",
        conflicts_with = "ids"
    )]
    pub json_schema: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub load: ModelArgs,
}

/// The output constraint of --json / --json-schema, if any.
fn output_constraint(a: &RunArgs) -> Result<Option<OutputConstraint>> {
    if a.json {
        return Ok(Some(OutputConstraint::JsonObject));
    }
    let Some(path) = &a.json_schema else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--json-schema: cannot read {}", path.display()))?;
    let schema: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "--json-schema: {} is not JSON; give a file holding one JSON schema",
            path.display()
        )
    })?;
    Ok(Some(OutputConstraint::JsonSchema {
        schema,
        strict: true,
    }))
}

/// Parses `"1, 2,3"` into ids, naming the bad entry.
pub(crate) fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("--ids: {t:?} is not a token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give at least one token id, e.g. --ids \"1,2,3\"");
    }
    Ok(ids)
}

/// Runs `k3 run`.
pub(crate) fn run(a: RunArgs) -> Result<()> {
    threads::init(a.load.threads)?;
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => ensure_demo()?,
    };
    a.load.with_model(&dir, RunJob { a: &a, dir: &dir })
}

struct RunJob<'a> {
    a: &'a RunArgs,
    dir: &'a Path,
}

impl ModelJob for RunJob<'_> {
    type Out = ();
    const PROMPT_CACHE: bool = true;
    fn run<B: Backend>(self, model: &mut Runner<B>, _plan: &k3::engine::Plan) -> Result<()> {
        run_model(model, self.a, self.dir)
    }
}

/// Waits for a weight-cache write the start left to the background, so the run's figures
/// hold its outcome, and prints the start-up line.
fn finish_startup<B: Backend>(model: &mut Runner<B>) -> serde_json::Value {
    let s = model.model.finish_startup();
    eprintln!("{}", s.line());
    s.json()
}

fn run_model<B: Backend>(model: &mut Runner<B>, a: &RunArgs, dir: &Path) -> Result<()> {
    let cfg = &model.ckpt.config;
    let text = a.prompt.clone().or_else(|| a.prompt_flag.clone());
    let tok = if a.ids.is_some() {
        None
    } else {
        Some(Tokenizer::from_dir(dir)?)
    };
    let thinking = a.think == 1 && !a.no_think;
    let ids = match (&a.ids, &text, &tok) {
        (Some(s), _, _) => parse_ids(s)?,
        (None, Some(t), Some(tk)) if a.chat => {
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(Message::system(s.clone()));
            }
            msgs.push(Message::user(t.clone()));
            tk.encode_chat(&msgs, &ChatOptions::generation(thinking))?
        }
        (None, Some(t), Some(tk)) => tk.try_encode(t)?,
        (None, None, Some(tk)) if a.demo => tk.try_encode("Once upon a time")?,
        _ => bail!("give a prompt: text (k3 run MODEL \"text\") or token ids (--ids \"1,2,3\")"),
    };
    let mut output = match &tok {
        None => TokenOutput::Ids { first: true },
        Some(tk) if a.chat => TokenOutput::Chat {
            splitter: ChatSplitter::new(tk, thinking, &cfg.eos_token_ids)?,
            shown: None,
        },
        Some(tk) => TokenOutput::Text(StreamDecoder::new(tk, false)),
    };
    let stop: Vec<u32> = match &tok {
        _ if a.ignore_eos => Vec::new(),
        Some(tk) => chat_stop_ids(tk, &cfg.eos_token_ids),
        None => cfg.eos_token_ids.clone(),
    };
    let context = model.rt.context();
    if ids.len() > context {
        bail!(
            "context full: the prompt is {} tokens and the context holds {context} \
             (--max-tokens / K3_MAXT): raise it or shorten the prompt",
            ids.len()
        );
    }
    // Every generated token but the last is fed back, so prompt + ngen positions fit.
    let ngen = a.ngen.min(context - ids.len() + 1);
    let trace = a.trace.as_deref().map(Trace::create).transpose()?;
    eprintln!("{}", stats::prompt_line(ids.len(), a.ngen, a.sampling.temp));
    let opts = GenerateOptions {
        ngen,
        max_window: None,
        all_logits: a.dump_logits.is_some(),
        stop_ids: &stop,
        trace: trace.as_ref(),
    };
    let constraint = match (output_constraint(a)?, &tok) {
        (None, _) => None,
        (Some(_), None) => bail!("--json and --json-schema need a text prompt, not --ids"),
        (Some(c), Some(tk)) => {
            let frame = if a.chat {
                ReplyFrame::Chat {
                    thinking,
                    think_tokens: ngen / 2,
                }
            } else {
                ReplyFrame::Bare
            };
            let compiler = GrammarCompiler::new(tk, &cfg.eos_token_ids)?;
            Some(compiler.constrain(&c, frame)?)
        }
    };
    let sampler = k3::sampling::Sampler::new(a.sampling.config())?;
    let picker =
        std::cell::RefCell::new(TokenPicker::new(sampler, constraint, None).with_budget(ngen));
    let mut pick = |logits: &[f32], hist: &[u32]| picker.borrow_mut().pick(logits, hist);
    let quiet = a.load.quiet;
    let mut on_token = |ev: &k3::generate::TokenEvent| -> Result<()> {
        if let Some(e) = picker.borrow_mut().take_error() {
            return Err(e);
        }
        output.push(ev.id)?;
        if !quiet && ev.index > 0 {
            eprintln!("{}", stats::token_line(ev.index, ev.secs, &ev.stats));
        }
        Ok(())
    };
    let g = generate(model, &ids, &opts, &mut pick, &mut on_token);
    if let Some(t) = &trace {
        match &g {
            Ok(_) => {
                t.finish()?;
            }
            // The layers recorded before the failure are what finds it (a non-finite
            // layer): keep them, whole rows each; a trace whose own write failed is gone.
            Err(_) => {
                if let Err(e) = t.finish() {
                    eprintln!("[K3] {e:#}");
                }
            }
        }
    }
    let g = g?;
    output.finish()?;
    let startup = finish_startup(model);
    if ngen < a.ngen && g.tokens.len() == ngen && !g.tokens.last().is_some_and(|t| stop.contains(t))
    {
        eprintln!(
            "[K3] context full: stopped after {ngen} tokens ({} of prompt, --max-tokens / K3_MAXT {context})",
            ids.len()
        );
    }
    if g.cached_tokens > 0 {
        eprintln!(
            "[K3] prompt cache: {} of {} prompt tokens loaded, {} prefilled",
            g.cached_tokens,
            ids.len(),
            g.prefilled_tokens
        );
    }
    eprintln!(
        "{}",
        stats::prefill_line(g.prefilled_tokens, g.prefill_secs)
    );
    eprintln!(
        "{}",
        stats::decode_line(g.tokens.len(), g.decode_secs, &g.decode_stats)
    );
    let total = g.prefill_stats.plus(&g.decode_stats);
    eprintln!("{}", stats::time_line(&total, stats::rss_gb()));
    eprintln!("{}", stats::disk_line(&total));
    let pool = (model.backend.unified_pool())
        .then(|| model.backend.expert_tier_slots())
        .transpose()?;
    let tiers = match pool {
        Some(n) => serde_json::json!({"expert_tiers": "unified pool", "pool_slots": n}),
        None if model.backend.expert_tier_slots()? > 0 => {
            serde_json::json!({"expert_tiers": "host cache + VRAM tier"})
        }
        None => serde_json::json!({"expert_tiers": "host cache"}),
    };
    if let Some(line) = stats::tiers_line(&total, pool) {
        eprintln!("{line}");
    }
    let modes = model.rt.experts().auto_policy_modes()?;
    if let Some(line) = stats::policy_line(modes) {
        eprintln!("{line}");
    }
    for (phase, s) in [("prefill", &g.prefill_stats), ("decode", &g.decode_stats)] {
        if let Some(line) = stats::prefetch_line(phase, s) {
            eprintln!("{line}");
        }
    }
    eprintln!("{}", stats::overlap_line(g.decode_secs, &g.decode_stats));
    if let Some(line) = stats::skipped_line(&total) {
        eprintln!("{line}");
    }
    let ranks = k3::ranks::figures(&total);
    if let Some(line) = k3::ranks::ranks_line(&ranks) {
        eprintln!("{line}");
    }
    if let Some(path) = &a.stats_json {
        let mut json = stats::run_json(ids.len(), &g, &total);
        json["startup"] = startup;
        if !ranks.is_empty() {
            json["ranks"] = k3::ranks::ranks_json(&ranks);
        }
        if let Some((recency, layers)) = modes {
            json["cache_policy_auto"] =
                serde_json::json!({"layers": layers, "layers_evicting_by_recency": recency});
        }
        if let (Some(all), Some(tiers)) = (json.as_object_mut(), tiers.as_object()) {
            all.extend(tiers.clone());
        }
        write_output(path, serde_json::to_string_pretty(&json)?.as_bytes())
            .with_context(|| format!("writing --stats-json {}", path.display()))?;
    }
    if let Some(path) = &a.dump_logits {
        write_logits(path, &g.prompt_logits)?;
        eprintln!(
            "[K3] logits: {} positions x {} -> {}",
            ids.len(),
            model.vocab_size(),
            path.display()
        );
    }
    Ok(())
}

fn write_logits(path: &Path, logits: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_output(path, &bytes).with_context(|| format!("writing --dump-logits {}", path.display()))
}
