//! `k3 serve`: an OpenAI-compatible (and Anthropic `/v1/messages`) HTTP server over one
//! loaded model. The calling thread is the engine: it owns the model and runs up to
//! `--parallel` generations together, a batched step at a time (`engine.rs`); a tokio runtime on other threads runs the HTTP side
//! ([`http`]) and hands requests over through a bounded queue.

pub mod anthropic;
pub mod api_error;
pub(crate) mod body_json;
pub(crate) mod choice_run;
pub(crate) mod connections;
pub mod constrain;
pub(crate) mod context_edits;
pub(crate) mod engine;
pub(crate) mod field_policy;
mod handoff;
pub(crate) mod histogram;
pub mod http;
pub(crate) mod job;
pub(crate) mod live;
pub(crate) mod logprobs;
pub(crate) mod metrics;
pub(crate) mod openai;
pub mod openai_body;
pub mod origin;
pub mod prompt;
pub mod reply;
pub mod request;
pub mod request_guard;
pub(crate) mod responses;
pub(crate) mod sampling_fields;
pub mod sse;
pub mod stop_strings;

use crate::backend::Backend;
use crate::grammar::GrammarCompiler;
use crate::model::Runner;
use crate::session::SnapshotLimits;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use engine::{run_engine, EngineOptions, EngineShared};
use request::{Defaults, Limits};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Address to listen on.
    pub host: String,
    /// Port (0 picks a free one; the bound address is printed).
    pub port: u16,
    /// Bearer key required on the API routes.
    pub api_key: Option<String>,
    /// The model id clients name.
    pub model_name: String,
    /// Requests that may wait for the engine; one more gets 429.
    pub queue: usize,
    /// Request limits.
    pub limits: Limits,
    /// Defaults for fields a request leaves out.
    pub defaults: Defaults,
    /// Tokens the context holds (prompt plus answer).
    pub context: usize,
    /// The state the memory plan reserves for the sequences together, bytes
    /// (`engine::plan::StateReservation`).
    pub state_budget: usize,
    /// Sequences whose full-context state that reserves.
    pub state_sequences: usize,
    /// State snapshots kept for prompts that diverge from the held conversation.
    pub snapshots: SnapshotLimits,
    /// Largest request body, in bytes.
    pub body_limit: usize,
    /// Longest wait for a request body.
    pub body_timeout: Duration,
    /// HTTP worker threads.
    pub http_threads: usize,
    /// Open connections at most; more are answered 503 with Retry-After and closed.
    pub max_connections: usize,
    /// Longest wait for a request's headers.
    pub header_timeout: Duration,
    /// Where a chat answer's think text goes.
    pub reasoning_format: http::ReasoningFormat,
    /// `Host` names accepted besides the bound address's (`--allow-host`).
    pub allow_hosts: Vec<String>,
    /// Cross-site origins allowed (`--allow-origin`).
    pub allow_origins: Vec<String>,
    /// Longest wait for a streaming client to read before its request is dropped.
    pub stall_timeout: Duration,
    /// Requests in flight at once (`--parallel`).
    pub parallel: usize,
    /// Prompt tokens a prefilling request feeds per engine step (`--prefill-slice`).
    pub prefill_slice: usize,
}

/// Serves `model` until SIGINT or SIGTERM: binds, prints the address, runs the HTTP side
/// on its own threads and the engine on this one.
pub fn serve<B: Backend>(model: &Runner<B>, tok: Tokenizer, opts: ServeOptions) -> Result<()> {
    let listener =
        std::net::TcpListener::bind((opts.host.as_str(), opts.port)).with_context(|| {
            format!(
                "--host/--port: cannot listen on {}:{}",
                opts.host, opts.port
            )
        })?;
    listener
        .set_nonblocking(true)
        .context("setting the listening socket non-blocking")?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let loopback = addr.ip().is_loopback();
    let origins = origin::OriginPolicy::new(addr, &opts.allow_hosts, &opts.allow_origins)?;
    if !loopback && opts.api_key.is_none() {
        tracing::warn!(
            "[K3] serve: WARNING: listening on {} without --api-key / K3_API_KEY: anyone who \
             can reach this address can use the model",
            addr.ip()
        );
    }
    let grammar = grammar_compiler(&tok, &model.ckpt.config.eos_token_ids, opts.queue);
    let tok = Arc::new(tok);
    let shared = Arc::new(EngineShared::default());
    let (jobs_tx, jobs_rx) = mpsc::sync_channel(opts.queue.max(1));
    let app = Arc::new(http::App {
        jobs: jobs_tx,
        queue: opts.queue.max(1),
        shared: shared.clone(),
        tok: tok.clone(),
        model_name: opts.model_name.clone(),
        backend_name: model.backend.name(),
        api_key: opts.api_key.clone(),
        limits: opts.limits,
        defaults: opts.defaults,
        context: opts.context,
        body_limit: opts.body_limit,
        body_timeout: opts.body_timeout,
        next_id: AtomicU64::new(1),
        reasoning_format: opts.reasoning_format,
        prefill: model.rt.progress().clone(),
        parallel: opts.parallel,
        grammar,
        origins,
        stall_timeout: opts.stall_timeout,
        responses: responses::ResponseStore::new(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.http_threads.max(1))
        .thread_name("k3-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let http_shared = shared.clone();
    let limits = connections::ConnectionLimits {
        max_connections: opts.max_connections,
        header_timeout: opts.header_timeout,
        stall_timeout: opts.stall_timeout,
    };
    let http = std::thread::Builder::new()
        .name("k3-http-main".into())
        .spawn(move || -> Result<()> {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .context("handing the socket to the runtime")?;
                let counter = http_shared.clone();
                connections::serve_connections(
                    listener,
                    http::router(app),
                    limits,
                    Arc::new(move || counter.metrics.count_status(503)),
                    shutdown_signal(http_shared),
                )
                .await;
                Ok(())
            })
        })
        .context("starting the HTTP thread")?;
    tracing::info!(
        "[K3] serve: listening on http://{addr} | model {} | backend {}",
        opts.model_name,
        model.backend.name()
    );
    // Returns once the HTTP side has stopped and dropped every sender of the queue.
    let engine_opts = EngineOptions {
        snapshots: opts.snapshots,
        parallel: opts.parallel,
        prefill_slice: opts.prefill_slice,
        state_budget: opts.state_budget,
        state_sequences: opts.state_sequences,
    };
    let engine = run_engine(model, &tok, engine_opts, jobs_rx, &shared);
    let http = http
        .join()
        .map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?;
    engine?;
    http?;
    tracing::info!("[K3] serve: stopped");
    Ok(())
}

/// The compiler of output constraints over `tok`'s vocabulary, built once at startup, with
/// as many compiles at once as the queue holds requests (a compiling request holds a queue
/// place, `App::queue_place` in `handoff.rs`: a full queue answers 429 before compiling); a model whose config names no usable end-of-sequence
/// id serves without one (constrained requests are then refused, naming why).
fn grammar_compiler(tok: &Tokenizer, eos: &[u32], queue: usize) -> Option<Arc<GrammarCompiler>> {
    let t0 = std::time::Instant::now();
    match GrammarCompiler::new(tok, eos) {
        Ok(g) => {
            tracing::info!(
                "[K3] serve: output constraints: a trie of {} tokens in {:.0} ms",
                tok.vocab_size(),
                t0.elapsed().as_secs_f64() * 1e3
            );
            Some(Arc::new(g.with_max_compiles(queue)))
        }
        Err(e) => {
            tracing::warn!("[K3] serve: WARNING: no constrained output (response_format, forced tool_choice): {e:#}");
            None
        }
    }
}

/// Resolves on SIGINT or SIGTERM, after cancelling the running generation and marking
/// the engine as stopping (queued requests are then answered cancelled at once).
async fn shutdown_signal(shared: Arc<EngineShared>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("[K3] serve: stopping (the running requests are cancelled)");
    shared.stopping.store(true, Ordering::SeqCst);
    if let Ok(c) = shared.current.lock() {
        for flag in c.iter() {
            flag.store(true, Ordering::SeqCst);
        }
    }
}
