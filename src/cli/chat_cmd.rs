//! `k3 chat`: an interactive conversation that keeps the model state between turns and
//! feeds only each new turn's tokens.

use super::model_args::{ModelArgs, ModelJob};
use super::sampling_args::SamplingArgs;
use super::threads;
use super::token_output::TokenOutput;
use anyhow::{Context, Result};
use clap::Args;
use k3::backend::Backend;
use k3::model::Runner;
use k3::sampling::Sampler;
use k3::session::{DecodeOptions, Finish, Flow, Session};
use k3::tokenizer::{
    chat_stop_ids, Channel, ChatEvent, ChatOptions, ChatSplitter, Message, Tokenizer,
};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Flags of `k3 chat`.
#[derive(Args, Debug)]
pub(crate) struct ChatArgs {
    /// Snapshot directory (use --demo for the built-in tiny model).
    #[arg(required_unless_present = "demo")]
    pub model: Option<PathBuf>,
    /// Chat with the built-in demo model.
    #[arg(long)]
    pub demo: bool,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Thinking: 1 opens the think channel, 0 answers directly (/think on|off switches).
    #[arg(long, env = "K3_THINK", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub think: u8,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 1024)]
    pub max_answer: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub load: ModelArgs,
}

const HELP: &str = "commands: /reset (forget the conversation), /system TEXT, /think on|off, /help, /quit (or Ctrl-D); Ctrl-C stops an answer; start a line with // to send text that begins with /";

/// What one line of input asks for.
#[derive(Debug, PartialEq, Eq)]
enum Line<'a> {
    /// A blank line: nothing happens.
    Empty,
    /// `/quit` or `/exit`.
    Quit,
    /// `/reset`.
    Reset,
    /// `/think on` or `/think off`.
    Think(bool),
    /// `/system TEXT`; no text clears the system message.
    System(Option<&'a str>),
    /// `/help`.
    Help,
    /// A line starting with `/` that is no command (or a command with a wrong argument).
    Unknown(&'a str),
    /// A user turn.
    Text(&'a str),
}

/// What [`read_line_bounded`] read.
#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    /// The input ended before any byte of a line.
    End,
    /// A line (its bytes, newline included, are in the buffer).
    Line,
    /// A line over the limit, read and dropped; its length so far (at least the limit).
    TooLong(usize),
}

/// Reads one line into `buf` (cleared first), keeping at most `limit` bytes: a longer
/// line is read to its end and dropped, so its size costs no memory.
fn read_line_bounded(
    input: &mut impl BufRead,
    buf: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<LineRead> {
    buf.clear();
    let mut seen = 0usize;
    let mut any = false;
    loop {
        let avail = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            break;
        }
        any = true;
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        if seen.saturating_add(take) <= limit {
            buf.extend_from_slice(&avail[..take]);
        } else {
            buf.clear();
        }
        seen = seen.saturating_add(take);
        input.consume(take);
        if done {
            break;
        }
    }
    Ok(if !any {
        LineRead::End
    } else if seen > limit {
        LineRead::TooLong(seen)
    } else {
        LineRead::Line
    })
}

/// Reads a trimmed line: commands start with `/`, `//` escapes a leading slash in text.
fn parse_line(line: &str) -> Line<'_> {
    if line.is_empty() {
        return Line::Empty;
    }
    if line.starts_with("//") {
        return Line::Text(&line[1..]);
    }
    if !line.starts_with('/') {
        return Line::Text(line);
    }
    let (cmd, arg) = line
        .split_once(char::is_whitespace)
        .map_or((line, ""), |(c, a)| (c, a.trim()));
    match (cmd, arg) {
        ("/quit" | "/exit", "") => Line::Quit,
        ("/reset", "") => Line::Reset,
        ("/think", "on") => Line::Think(true),
        ("/think", "off") => Line::Think(false),
        ("/help", "") => Line::Help,
        ("/system", "") => Line::System(None),
        ("/system", text) => Line::System(Some(text)),
        _ => Line::Unknown(line),
    }
}

/// Runs `k3 chat`.
pub(crate) fn run(a: ChatArgs) -> Result<()> {
    threads::init(a.load.threads)?;
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => super::model_args::ensure_demo()?,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the Ctrl-C handler")?;
    a.load.with_model(
        &dir,
        ChatJob {
            a: &a,
            dir: &dir,
            stop: &stop,
        },
    )
}

struct ChatJob<'a> {
    a: &'a ChatArgs,
    dir: &'a Path,
    stop: &'a AtomicBool,
}

impl ModelJob for ChatJob<'_> {
    type Out = ();
    const PROMPT_CACHE: bool = true;
    fn run<B: Backend>(self, model: &mut Runner<B>, _plan: &k3::engine::Plan) -> Result<()> {
        chat_loop(model, self.a, self.dir, self.stop)
    }
}

fn chat_loop<B: Backend>(
    model: &Runner<B>,
    a: &ChatArgs,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<()> {
    let tok = Tokenizer::from_dir(dir)?;
    let mut session = Session::new(model)?;
    let mut sampler = Sampler::new(a.sampling.config())?;
    let mut system = a.system.clone();
    let mut thinking = a.think == 1;
    let mut history: Vec<Message> = Vec::new();
    let stop_ids = chat_stop_ids(&tok, &model.ckpt.config.eos_token_ids);
    eprintln!("[K3] chat ready. {HELP}");
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut buf = Vec::new();
    // No token covers more bytes than the vocabulary's longest, so a line longer than
    // the context times that cannot fit: it is refused before it is tokenized.
    let longest = (0..tok.vocab_size() as u32)
        .filter_map(|id| tok.token_bytes(id).map(<[u8]>::len))
        .max()
        .unwrap_or(1)
        .max(1);
    let line_limit = model.rt.context().saturating_mul(longest);
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        match read_line_bounded(&mut input, &mut buf, line_limit)
            .context("reading standard input")?
        {
            LineRead::End => break,
            LineRead::TooLong(n) => {
                eprintln!(
                    "[K3] that line is {n} bytes; the context of {} tokens (--max-tokens / \
                     K3_MAXT) holds at most {line_limit} bytes of text; it was not sent and \
                     the conversation is kept",
                    model.rt.context()
                );
                continue;
            }
            LineRead::Line => {}
        }
        let line = match std::str::from_utf8(&buf) {
            Ok(l) => l.trim(),
            Err(e) => {
                // A stray byte (a pasted binary, a wrong terminal encoding) costs the line,
                // not the conversation.
                eprintln!(
                    "[K3] that line is not UTF-8 text (invalid byte at offset {}); it was not \
                     sent and the conversation is kept",
                    e.valid_up_to()
                );
                continue;
            }
        };
        let line = match parse_line(line) {
            Line::Empty => continue,
            Line::Quit => break,
            Line::Reset => {
                history.clear();
                session.reset()?;
                eprintln!("[K3] conversation reset");
                continue;
            }
            Line::Think(on) => {
                thinking = on;
                eprintln!("[K3] thinking {}", if thinking { "on" } else { "off" });
                continue;
            }
            Line::System(s) => {
                system = s.map(str::to_string);
                history.clear();
                session.reset()?;
                eprintln!("[K3] system message set; conversation reset");
                continue;
            }
            Line::Help => {
                eprintln!("{HELP}");
                continue;
            }
            Line::Unknown(cmd) => {
                eprintln!("[K3] unknown command {cmd}; {HELP}");
                continue;
            }
            Line::Text(text) => text,
        };
        history.push(Message::user(line.to_string()));
        let mut msgs: Vec<Message> = system.iter().map(|s| Message::system(s.clone())).collect();
        msgs.extend(history.iter().cloned());
        let ids = tok.encode_chat(&msgs, &ChatOptions::generation(thinking))?;
        let context = model.rt.context();
        if ids.len() > context {
            // The turn cannot be answered; the conversation before it stays as it was.
            history.pop();
            eprintln!(
                "[K3] context full: with this line the conversation is {} tokens and the \
                 context holds {context} (--max-tokens / K3_MAXT); the line was not sent. \
                 /reset starts a new conversation",
                ids.len()
            );
            continue;
        }
        // Every generated token but the last is fed back, so prompt + answer positions fit.
        let max_answer = a.max_answer.min(context - ids.len() + 1);
        if !session.tokens().is_empty() && !ids.starts_with(session.tokens()) {
            // The template rendered earlier turns differently from how they were generated.
            eprintln!(
                "[K3] (conversation re-read from the start: {} tokens)",
                ids.len()
            );
        }
        stop.store(false, Ordering::SeqCst);
        let mut out = TokenOutput::Chat {
            splitter: ChatSplitter::new(&tok, thinking, &model.ckpt.config.eos_token_ids)?,
            shown: None,
        };
        let opts = DecodeOptions {
            max_tokens: max_answer,
            stop_ids: &stop_ids,
            cancel: Some(stop),
            ..DecodeOptions::default()
        };
        let mut pick = |logits: &[f32], hist: &[u32]| sampler.sample(logits, hist);
        let g = session.generate(&ids, &opts, &mut pick, &mut |ev| {
            Ok(if out.push(ev.id)? {
                Flow::Stop
            } else {
                Flow::Continue
            })
        })?;
        let answer_ids = g.tokens;
        out.finish()?;
        if stop.swap(false, Ordering::SeqCst) {
            eprintln!("[K3] (stopped)");
        } else if max_answer < a.max_answer && g.finish == Finish::Length {
            eprintln!(
                "[K3] context full: the answer stopped after {max_answer} tokens (the \
                 conversation holds {} of --max-tokens / K3_MAXT {context}); /reset starts a new \
                 conversation",
                ids.len() + max_answer - 1
            );
        }
        let (reasoning, content) = split_answer(
            &tok,
            &answer_ids,
            thinking,
            &model.ckpt.config.eos_token_ids,
        )?;
        history.push(Message::assistant(content, reasoning));
    }
    Ok(())
}

/// The answer's think and response texts, for the next turn's rendering (`eos` ends it
/// as it ended the generation).
fn split_answer(
    tok: &Tokenizer,
    ids: &[u32],
    thinking: bool,
    eos: &[u32],
) -> Result<(Option<String>, String)> {
    let mut splitter = ChatSplitter::new(tok, thinking, eos)?;
    let (mut think, mut resp) = (String::new(), String::new());
    let mut push = |ev: ChatEvent| {
        if let ChatEvent::Text { channel, text } = ev {
            match channel {
                Channel::Think => think.push_str(&text),
                _ => resp.push_str(&text),
            }
        }
    };
    for &id in ids {
        for ev in splitter.push(id)? {
            push(ev);
        }
    }
    for ev in splitter.finish() {
        push(ev);
    }
    Ok((if thinking { Some(think) } else { None }, resp))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_line_over_the_limit_is_read_through_and_dropped() {
        use super::{read_line_bounded, LineRead};
        let text = format!("short\n{}\nnext", "x".repeat(1000));
        let mut input = std::io::BufReader::with_capacity(16, text.as_bytes());
        let mut buf = Vec::new();
        let mut read = || {
            let r = read_line_bounded(&mut input, &mut buf, 100).unwrap();
            (r, String::from_utf8(buf.clone()).unwrap())
        };
        assert_eq!(read(), (LineRead::Line, "short\n".into()));
        let (r, kept) = read();
        assert_eq!(r, LineRead::TooLong(1001));
        assert!(kept.len() <= 100, "{}", kept.len());
        assert_eq!(read(), (LineRead::Line, "next".into()));
        assert_eq!(read().0, LineRead::End);
    }

    use super::{parse_line, Line};

    #[test]
    fn lines_are_commands_text_or_unknown() {
        assert_eq!(parse_line(""), Line::Empty);
        assert_eq!(parse_line("/quit"), Line::Quit);
        assert_eq!(parse_line("/exit"), Line::Quit);
        assert_eq!(parse_line("/reset"), Line::Reset);
        assert_eq!(parse_line("/think on"), Line::Think(true));
        assert_eq!(parse_line("/think  off"), Line::Think(false));
        assert_eq!(parse_line("/think maybe"), Line::Unknown("/think maybe"));
        assert_eq!(
            parse_line("/system be brief"),
            Line::System(Some("be brief"))
        );
        assert_eq!(parse_line("/system"), Line::System(None));
        assert_eq!(parse_line("/systemx"), Line::Unknown("/systemx"));
        assert_eq!(parse_line("/frobnicate"), Line::Unknown("/frobnicate"));
        assert_eq!(parse_line("/quit now"), Line::Unknown("/quit now"));
        assert_eq!(parse_line("//usr is a path"), Line::Text("/usr is a path"));
        assert_eq!(parse_line("hello"), Line::Text("hello"));
    }
}
