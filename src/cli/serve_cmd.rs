//! `k3 serve`: flags, then the model loads once and `k3::serve` runs on it.

use super::model_args::{ModelArgs, ModelJob};
use super::sampling_args::SamplingArgs;
use super::threads;
use anyhow::{bail, Result};
use clap::Args;
use k3::backend::Backend;
use k3::engine::config::MAX_CONTEXT;
use k3::model::Runner;
use k3::serve::http::ReasoningFormat;
use k3::serve::origin::OriginPolicy;
use k3::serve::request::{Defaults, Limits};
use k3::serve::{serve, ServeOptions};
use k3::session::SnapshotLimits;
use k3::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Flags of `k3 serve`.
#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Snapshot directory (use --demo for the built-in tiny model).
    #[arg(required_unless_present = "demo")]
    pub model: Option<PathBuf>,
    /// Serve the built-in demo model (synthesized into the cache directory once).
    #[arg(long)]
    pub demo: bool,
    /// Address to listen on; anything but loopback without --api-key prints a warning.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Bearer key the API routes require (`Authorization: Bearer KEY` or `x-api-key`).
    #[arg(long, env = "K3_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model id clients name [default: the snapshot directory's name, `k3-demo` with --demo].
    #[arg(long)]
    pub model_name: Option<String>,
    /// Requests that may wait while one runs, counting those still compiling their output
    /// constraint (response_format, forced tool_choice) on the way to the queue; beyond
    /// that, 429 with Retry-After, before any compile.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Sequences in flight at once: each its own state, sampler and stop rules, all advanced
    /// together one batched forward pass a step (a prompt slice for those that prefill, one
    /// token for those that decode); a request of `n` choices takes n, and an `n` above this
    /// is refused; 1 runs one request at a time. The memory plan reserves a full context's
    /// state (--max-tokens / K3_MAXT) for each, as far as memory allows (the `[K3] state:`
    /// line says how many fit); a request that does not fit beside the running ones waits in
    /// the queue.
    #[arg(long, env = "K3_PARALLEL", default_value_t = 4)]
    pub parallel: usize,
    /// Prompt tokens a request feeds per engine step while it prefills (at most the prefill
    /// window), so requests already generating keep producing tokens between slices. A
    /// prompt alone with nothing queued feeds whole windows when the host cache cannot hold
    /// every expert (slices would re-read them).
    #[arg(long, env = "K3_PREFILL_SLICE", default_value_t = 512)]
    pub prefill_slice: usize,
    /// Tokens an answer gets when the request names no max_tokens.
    #[arg(long, default_value_t = 1024)]
    pub max_answer: usize,
    /// Most messages in one request.
    #[arg(long, default_value_t = 1024)]
    pub max_messages: usize,
    /// Largest request body, in MB.
    #[arg(long, default_value_t = 8)]
    pub max_body_mb: usize,
    /// Seconds a client may take to send its request body; slower ones get 408.
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Open connections at most; more are answered 503 with Retry-After and closed.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a client may take to send its request headers.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// State snapshots kept (at the end of each prompt and of its system prompt and tools) so a resent conversation that
    /// differs from what the engine holds (an answer rendered without its think channel)
    /// prefills only from where it differs; 0 turns them off.
    #[arg(long, env = "K3_SNAPSHOTS", default_value_t = 4)]
    pub snapshots: usize,
    /// Memory the state snapshots may take together, in MB (host RAM on the CPU backend,
    /// device memory on the GPU): one holds every KDA layer's state.
    #[arg(long, env = "K3_SNAPSHOT_MB", default_value_t = 1024)]
    pub snapshot_mb: usize,
    /// `Host` names the server answers besides the address it listens on (comma list;
    /// NAME any port, NAME:PORT that port, `*` any): others are refused 403 so a
    /// DNS-rebinding page cannot reach a loopback server. Bound to 0.0.0.0 any is accepted.
    #[arg(long, env = "K3_ALLOW_HOST", value_delimiter = ',')]
    pub allow_host: Vec<String>,
    /// Web page origins that may call the API from a browser besides the server's own page
    /// (comma list of http(s)://NAME[:PORT], or `*`); others are refused 403.
    #[arg(long, env = "K3_ALLOW_ORIGIN", value_delimiter = ',')]
    pub allow_origin: Vec<String>,
    /// Seconds a streaming client may leave its answer unread while the engine waits for
    /// it; past that the request is cancelled and the connection closed.
    #[arg(long, default_value_t = 60)]
    pub stall_timeout: u64,
    /// Thinking when a request does not say: 1 opens the think channel, 0 answers directly.
    #[arg(long, env = "K3_THINK", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub think: u8,
    /// Where an OpenAI chat answer's think text goes: `separate` in `reasoning_content`,
    /// `inline` inside `content` wrapped in `<think>…</think>` (for clients that ignore
    /// `reasoning_content`).
    #[arg(long, env = "K3_REASONING_FORMAT", value_enum, default_value_t = ReasoningFormat::Separate)]
    pub reasoning_format: ReasoningFormat,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub load: ModelArgs,
}

/// Runs `k3 serve`.
pub(crate) fn run(mut a: ServeArgs) -> Result<()> {
    threads::init(a.load.threads)?;
    if a.queue == 0 || a.queue > 4096 {
        bail!("--queue must be between 1 and 4096, got {}", a.queue);
    }
    if a.max_body_mb == 0 || a.max_body_mb > 1024 {
        bail!(
            "--max-body-mb must be between 1 and 1024, got {}",
            a.max_body_mb
        );
    }
    if a.body_timeout == 0 || a.body_timeout > 3600 {
        bail!(
            "--body-timeout must be between 1 and 3600 seconds, got {}",
            a.body_timeout
        );
    }
    if a.max_connections == 0 || a.max_connections > 65536 {
        bail!(
            "--max-connections must be between 1 and 65536, got {}",
            a.max_connections
        );
    }
    if a.header_timeout == 0 || a.header_timeout > 3600 {
        bail!(
            "--header-timeout must be between 1 and 3600 seconds, got {}",
            a.header_timeout
        );
    }
    if a.parallel == 0 || a.parallel > 64 {
        bail!(
            "--parallel / K3_PARALLEL must be between 1 and 64, got {}",
            a.parallel
        );
    }
    if a.prefill_slice == 0 || a.prefill_slice > k3::session::MAX_WINDOW {
        bail!(
            "--prefill-slice / K3_PREFILL_SLICE must be between 1 and {}, got {}",
            k3::session::MAX_WINDOW,
            a.prefill_slice
        );
    }
    if a.snapshots > 64 {
        bail!(
            "--snapshots / K3_SNAPSHOTS must be between 0 and 64, got {}",
            a.snapshots
        );
    }
    if a.snapshot_mb > 1 << 20 {
        bail!(
            "--snapshot-mb / K3_SNAPSHOT_MB must be at most {} (1 TB), got {}",
            1 << 20,
            a.snapshot_mb
        );
    }
    if a.max_answer == 0 {
        bail!("--max-answer must be at least 1");
    }
    // 0 started a server that refused every request.
    if a.max_messages == 0 || a.max_messages > 1 << 20 {
        bail!(
            "--max-messages must be between 1 and {}, got {}",
            1 << 20,
            a.max_messages
        );
    }
    if a.stall_timeout == 0 || a.stall_timeout > 3600 {
        bail!(
            "--stall-timeout must be between 1 and 3600 seconds, got {}",
            a.stall_timeout
        );
    }
    // Checked here, before the model loads; the server builds the policy again once bound.
    OriginPolicy::new(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        &a.allow_host,
        &a.allow_origin,
    )?;
    let sampling = a.sampling.config();
    sampling.validate()?;
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => super::model_args::ensure_demo()?,
    };
    let name = match (&a.model_name, a.demo) {
        (Some(n), _) => n.clone(),
        (None, true) => "k3-demo".to_string(),
        (None, false) => dir
            .canonicalize()
            .unwrap_or_else(|_| dir.clone())
            .file_name()
            .map_or_else(|| "k3".to_string(), |n| n.to_string_lossy().into_owned()),
    };
    let snapshots = SnapshotLimits {
        count: a.snapshots,
        bytes: a.snapshot_mb << 20,
    };
    // The RAM plan reserves them; the context comes from the plan, once the model is loaded.
    a.load.stream.snapshots = snapshots;
    let opts = ServeOptions {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        model_name: name,
        queue: a.queue,
        limits: Limits {
            max_messages: a.max_messages,
            // Beyond what is left of the context a request's max_tokens is clamped, not
            // refused; only a number no context could hold is.
            max_tokens: MAX_CONTEXT,
            default_max_tokens: a.max_answer,
            ..Limits::default()
        },
        defaults: Defaults {
            sampling,
            thinking: a.think == 1,
        },
        context: 0,
        state_budget: 0,
        state_sequences: 0,
        snapshots,
        body_limit: a.max_body_mb << 20,
        body_timeout: Duration::from_secs(a.body_timeout),
        http_threads: 2,
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(a.header_timeout),
        reasoning_format: a.reasoning_format,
        allow_hosts: a.allow_host.clone(),
        allow_origins: a.allow_origin.clone(),
        stall_timeout: Duration::from_secs(a.stall_timeout),
        parallel: a.parallel,
        prefill_slice: a.prefill_slice,
    };
    a.load.with_model(&dir, ServeJob { dir: &dir, opts })
}

struct ServeJob<'a> {
    dir: &'a Path,
    opts: ServeOptions,
}

impl ModelJob for ServeJob<'_> {
    type Out = ();
    const PROMPT_CACHE: bool = true;
    fn parallel(&self) -> usize {
        self.opts.parallel
    }
    fn run<B: Backend>(mut self, model: &mut Runner<B>, plan: &k3::engine::Plan) -> Result<()> {
        let tok = Tokenizer::from_dir(self.dir)?;
        self.opts.context = model.rt.context();
        self.opts.state_budget = usize::try_from(plan.state.total_bytes()).unwrap_or(usize::MAX);
        self.opts.state_sequences = plan.state.sequences;
        serve(model, tok, self.opts)
    }
}
