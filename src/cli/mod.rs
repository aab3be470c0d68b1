//! Subcommands and the flags they share, each flag with its environment-variable alias.

#[cfg(feature = "lab")]
mod bench_cache;
mod bench_cmd;
mod bench_prefill;
mod bench_reader;
mod bench_streams;
mod cache_args;
mod chat_cmd;
mod devices_cmd;
mod inspect_cmd;
pub(crate) mod log;
mod model_args;
mod prompt_cache_args;
mod rank_args;
mod run_cmd;
mod sampling_args;
mod serve_cmd;
mod stream_args;
mod synth_cmd;
mod threads;
mod token_output;
mod tokenize_cmd;

use clap::{Parser, Subcommand};

/// k3 — run Kimi K3 on one machine, streaming routed experts from disk.
#[derive(Parser, Debug)]
#[command(
    name = "k3",
    version,
    about,
    long_about = None,
    after_help = "Log lines: the engine's start-up, warning and progress lines go to stderr, \
                  filtered by K3_LOG (else RUST_LOG; default info): K3_LOG=warn keeps warnings \
                  and errors, K3_LOG=debug adds detail, K3_LOG=k3::serve=debug,info raises \
                  one part. The stats lines of `k3 run` are always printed."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate from token ids (prefill in windows, then decode) and print the stats lines.
    Run(run_cmd::RunArgs),
    /// Interactive chat that keeps the conversation's state between turns.
    Chat(chat_cmd::ChatArgs),
    /// OpenAI-compatible HTTP server (chat, completions, Anthropic messages, a web page).
    Serve(serve_cmd::ServeArgs),
    /// Print the token ids of a text (or its tokens with --json).
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Print the text of token ids.
    Detokenize(tokenize_cmd::DetokenizeArgs),
    /// Write a random-weight checkpoint in the published K3 format.
    Synth(synth_cmd::SynthArgs),
    /// Check a snapshot: config summary, layer schedule, bytes by class, missing tensors.
    Inspect(inspect_cmd::InspectArgs),
    /// Benchmarks that compare the engine with a plain baseline in the same run.
    Bench(bench_cmd::BenchArgs),
    /// List GPU adapters: backend, type, driver, limits, features.
    Devices(devices_cmd::DevicesArgs),
}

/// Runs the chosen subcommand.
pub(crate) fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Command::Run(a) => run_cmd::run(a),
        Command::Chat(a) => chat_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Tokenize(a) => tokenize_cmd::tokenize(a),
        Command::Detokenize(a) => tokenize_cmd::detokenize(a),
        Command::Synth(a) => synth_cmd::run(a),
        Command::Inspect(a) => inspect_cmd::run(a),
        Command::Bench(a) => bench_cmd::run(a),
        Command::Devices(a) => devices_cmd::run(a),
    }
}

/// Splits a `K3_DIRS` / `--dirs` value on `;` or `,`.
pub(crate) fn split_dirs(s: &str) -> Vec<std::path::PathBuf> {
    s.split([';', ','])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .collect()
}

/// Starts MPI when `mpirun` (Open MPI, or an MPICH-style launcher) started this process;
/// `None` otherwise, so a plain run behaves as without the `mpi` feature.
#[cfg(feature = "mpi")]
pub(crate) fn ranks_start() -> anyhow::Result<Option<k3::ranks::world::RankGuard>> {
    let launched = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if !launched {
        return Ok(None);
    }
    k3::ranks::world::init().map(Some)
}

/// `rank R on host H: ` in a job of several ranks, so an error says which process it is.
pub(crate) fn rank_prefix() -> String {
    #[cfg(feature = "mpi")]
    if let Some(i) = k3::ranks::world::info().filter(|i| i.size > 1) {
        if i.rank != 0 {
            return format!("rank {} on host {}: ", i.rank, i.host);
        }
    }
    String::new()
}
