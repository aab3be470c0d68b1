//! The HTTP side: axum routes (behind the API key and body-limit guard of
//! `request_guard.rs`) and the answers (one JSON or server-sent events); the queue hand-off
//! to the engine (429 when full) is `handoff.rs`.

use super::anthropic;
use super::api_error::ApiError;
use super::constrain::Api;
use super::context_edits;
use super::engine::EngineShared;
use super::job::{Delta, Event, Field, Job, JobKind, Outcome};
use super::openai;
use super::openai_body::{chat_request, completion_request};
use super::prompt::render_request;
use super::request::{ChatRequest, Defaults, Limits};
use super::request_guard;
use super::responses::{self, ResponseStore};
use super::sse::{event_stream, SseFrame};
use crate::grammar::GrammarCompiler;
use crate::tokenizer::{MarkedIds, Tokenizer};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue};
use axum::middleware;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::Stream;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tokio::sync::mpsc::Receiver;

/// Everything a handler needs.
pub struct App {
    /// The queue to the engine.
    pub jobs: mpsc::SyncSender<Job>,
    /// Requests the queue holds, counting those whose output constraint compiles on their
    /// way to it (`--queue`, at least 1).
    pub queue: usize,
    /// Counters and the running job, shared with the engine.
    pub shared: Arc<EngineShared>,
    /// The model's tokenizer.
    pub tok: Arc<Tokenizer>,
    /// The id `/v1/models` lists and requests must name (or leave out).
    pub model_name: String,
    /// The backend's name, for `/health`.
    pub backend_name: String,
    /// Bearer key, if one is required.
    pub api_key: Option<String>,
    /// Request limits.
    pub limits: Limits,
    /// Defaults for fields a request leaves out.
    pub defaults: Defaults,
    /// Tokens the context holds (prompt plus answer).
    pub context: usize,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// Longest wait for a request's body.
    pub body_timeout: Duration,
    /// Request ids.
    pub next_id: AtomicU64,
    /// Where a chat answer's think text goes.
    pub reasoning_format: ReasoningFormat,
    /// Requests in flight at once (`--parallel`), for `/health`.
    pub parallel: usize,
    /// The running prefill's progress, for `/health`.
    pub prefill: Arc<crate::model::prefill_progress::PrefillProgress>,
    /// Compiles output constraints (None when the model names no end-of-sequence id).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// Which `Host` and `Origin` headers are answered.
    pub origins: super::origin::OriginPolicy,
    /// Longest wait for a streaming client to read before its request is dropped.
    pub stall_timeout: Duration,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: ResponseStore,
}

/// Where a chat answer's think text goes (`--reasoning-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningFormat {
    /// In `reasoning_content`, apart from `content`.
    #[default]
    Separate,
    /// Inside `content`, wrapped in `<think>…</think>`, for clients that ignore
    /// `reasoning_content`.
    Inline,
}

/// The header that reports the seed a request's sampler used.
pub const SEED_HEADER: &str = "x-k3-seed";

/// The page at `/`.
const PAGE: &str = include_str!("page.html");

/// The router.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .fallback(|| async { ApiError::status(404, "no such route").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError::status(405, "this route does not take that method").into_response()
        })
        .layer(middleware::from_fn_with_state(
            app.clone(),
            request_guard::guard,
        ))
        .with_state(app)
}

async fn health(State(app): State<Arc<App>>) -> Json<Value> {
    let m = &app.shared.metrics;
    let busy = m.busy.load(Ordering::Relaxed);
    let mut body = json!({
        "status": "ok",
        "model": app.model_name,
        "backend": app.backend_name,
        "queue_depth": m.queue_depth.load(Ordering::Relaxed),
        "state": if busy { "busy" } else { "idle" },
        "live": app.shared.live.snapshot(),
        "prefill": app.prefill.view(),
        "parallel": app.parallel,
        "sequences": app.shared.sequences.lock().map(|s| json!(*s)).unwrap_or(json!([])),
    });
    // An expert-parallel job's head lists its ranks.
    let ranks = m.ranks();
    if !ranks.is_empty() {
        body["ranks"] = crate::ranks::ranks_json(&ranks);
    }
    Json(body)
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.shared.metrics.render(),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(openai::models(&app.model_name))
}

async fn model(
    State(app): State<Arc<App>>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let Ok(Path(id)) = id else {
        // A path that is not UTF-8 once percent-decoded (`/v1/models/%ff`).
        return ApiError {
            param: Some("model".into()),
            ..ApiError::status(404, "the model id in the path is not UTF-8 text")
        }
        .into_response();
    };
    if id == app.model_name {
        return Json(openai::model_entry(&app.model_name)).into_response();
    }
    ApiError {
        param: Some("model".into()),
        ..ApiError::status(
            404,
            format!(
                "model {id:?} is not served here; this server serves {:?}",
                app.model_name
            ),
        )
    }
    .into_response()
}

/// Waits for a job's end; text deltas are already in the outcome.
pub(super) async fn wait_outcome(rx: &mut Receiver<Event>) -> Result<Box<Outcome>, ApiError> {
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta(..) => {}
            Event::Done(o) => return Ok(o),
            Event::Failed(m) => return Err(ApiError::status(500, m)),
        }
    }
    Err(ApiError::status(500, "the engine dropped the request"))
}

/// An SSE response.
pub(super) fn sse_response<S>(s: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    Sse::new(s)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Adds the seed header to a response.
pub(super) fn with_seed(mut r: Response, seed: u64) -> Response {
    r.headers_mut().insert(SEED_HEADER, HeaderValue::from(seed));
    r
}

async fn chat(State(app): State<Arc<App>>, body: Body) -> Result<Response, ApiError> {
    let app = &app;
    let bytes = app.body(body).await?;
    let mut req = chat_request(&bytes, &app.limits, &app.defaults)?;
    app.check_model(&req.params)?;
    let ids = chat_ids_marked(app, &mut req)?;
    let place = app.queue_place()?;
    req.params.constraint = app.constrain(&place, &req, Api::OpenAi, ids.len())?;
    let (stream, include_usage) = (req.params.stream, req.params.include_usage);
    let (seed, n) = (req.params.sampling.seed, req.params.n);
    let kind = JobKind::Chat {
        thinking: req.thinking,
        single_tool_call: req.single_tool_call,
    };
    let inline = app.reasoning_format == ReasoningFormat::Inline;
    let (id, mut rx, guard) = app.submit(place, ids, req.params, kind, inline)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        let r = Json(openai::chat_completion(&id, &model, &o)).into_response();
        return Ok(with_seed(r, seed));
    }
    let first: Vec<SseFrame> = (0..n)
        .map(|i| {
            let role = json!({"role": "assistant", "content": ""});
            SseFrame::from(openai::chat_chunk(&id, &model, i, role, None).to_string())
        })
        .collect();
    let frame = move |ev: Event| match ev {
        Event::Delta(d) => (
            vec![SseFrame::from(
                openai::chat_delta_chunk(&id, &model, &d).to_string(),
            )],
            false,
        ),
        Event::Done(o) => {
            let mut out: Vec<SseFrame> = openai::chat_final_chunks(&id, &model, &o, include_usage)
                .iter()
                .map(|v| SseFrame::from(v.to_string()))
                .collect();
            out.push(SseFrame::done());
            (out, true)
        }
        Event::Failed(m) => (
            vec![
                SseFrame::from(ApiError::status(500, m).body().to_string()),
                SseFrame::done(),
            ],
            true,
        ),
    };
    Ok(with_seed(
        sse_response(event_stream(first, rx, guard, frame)),
        seed,
    ))
}

async fn completions(State(app): State<Arc<App>>, body: Body) -> Result<Response, ApiError> {
    let app = &app;
    let bytes = app.body(body).await?;
    let req = completion_request(&bytes, &app.limits, &app.defaults)?;
    app.check_model(&req.params)?;
    let ids = app
        .tok
        .try_encode(&req.prompt)
        .map_err(|e| ApiError::field("prompt", format!("{e:#}")))?;
    let (stream, seed) = (req.params.stream, req.params.sampling.seed);
    let place = app.queue_place()?;
    let (id, mut rx, guard) = app.submit(place, ids, req.params, JobKind::Completion, false)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        let r = Json(openai::completion(&id, &model, &o)).into_response();
        return Ok(with_seed(r, seed));
    }
    let frame = move |ev: Event| match ev {
        Event::Delta(
            d @ Delta {
                field: Field::Content,
                ..
            },
        ) => (
            vec![SseFrame::from(
                openai::completion_delta_chunk(&id, &model, &d).to_string(),
            )],
            false,
        ),
        Event::Delta(_) => (Vec::new(), false),
        Event::Done(o) => {
            let mut out: Vec<SseFrame> = o
                .choices
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut last =
                        openai::completion_chunk(&id, &model, i, "", Some(c.finish.as_str()));
                    if i + 1 == o.choices.len() {
                        last["usage"] = openai::usage(&o);
                        last["system_fingerprint"] = json!(openai::fingerprint(o.seed));
                    }
                    SseFrame::from(last.to_string())
                })
                .collect();
            out.push(SseFrame::done());
            (out, true)
        }
        Event::Failed(m) => (
            vec![
                SseFrame::from(ApiError::status(500, m).body().to_string()),
                SseFrame::done(),
            ],
            true,
        ),
    };
    Ok(with_seed(
        sse_response(event_stream(Vec::new(), rx, guard, frame)),
        seed,
    ))
}

async fn messages(State(app): State<Arc<App>>, body: Body) -> Response {
    match messages_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => anthropic::error_response(e),
    }
}

/// A chat request's prompt ids, with how many of them come before the point where the
/// conversation's next request is expected to part from it (`GenParams::snapshot_at`) and
/// before each message boundary the prompt cache keeps (`GenParams::boundaries`).
pub(super) fn chat_ids(app: &App, req: &ChatRequest) -> Result<MarkedIds, ApiError> {
    app.tok
        .encode_prompt_marked(&render_request(req)?)
        .map_err(|e| ApiError::status(400, format!("encoding the prompt: {e:#}")))
}

/// A chat request's prompt ids, its marks set on `req.params` for the engine.
pub(super) fn chat_ids_marked(app: &App, req: &mut ChatRequest) -> Result<Vec<u32>, ApiError> {
    let m = chat_ids(app, req)?;
    req.params.snapshot_at = m.divergence;
    req.params.boundaries = m.boundaries;
    Ok(m.ids)
}

/// A `/v1/messages` prompt after its context edits.
struct EditedPrompt {
    marked: MarkedIds,
    applied: Vec<context_edits::AppliedEdit>,
}

/// A `/v1/messages` request's prompt ids after its context edits, which see the unedited
/// prompt's length; what each applied edit cleared.
fn edited_chat_ids(
    app: &App,
    req: &mut anthropic::MessagesRequest,
) -> Result<EditedPrompt, ApiError> {
    let marked = chat_ids(app, &req.chat)?;
    if req.edits.is_empty() {
        return Ok(EditedPrompt {
            marked,
            applied: Vec::new(),
        });
    }
    let mut count = |t: &str| app.tok.try_encode(t).map_or(0, |v| v.len());
    let applied = context_edits::apply(
        &req.edits,
        &mut req.chat.messages,
        marked.ids.len(),
        &mut count,
    );
    if applied.is_empty() {
        return Ok(EditedPrompt { marked, applied });
    }
    Ok(EditedPrompt {
        marked: chat_ids(app, &req.chat)?,
        applied,
    })
}

async fn messages_inner(app: &Arc<App>, body: Body) -> Result<Response, ApiError> {
    let bytes = app.body(body).await?;
    let mut read = anthropic::messages_request(&bytes, &app.limits, &app.defaults)?;
    app.check_model(&read.chat.params)?;
    let EditedPrompt { marked, applied } = edited_chat_ids(app, &mut read)?;
    let mut req = read.chat;
    req.params.snapshot_at = marked.divergence;
    req.params.boundaries = marked.boundaries;
    let ids = marked.ids;
    let place = app.queue_place()?;
    req.params.constraint = app.constrain(&place, &req, Api::Anthropic, ids.len())?;
    let input_tokens = ids.len();
    let (stream, seed) = (req.params.stream, req.params.sampling.seed);
    let kind = JobKind::Chat {
        thinking: req.thinking,
        single_tool_call: req.single_tool_call,
    };
    let (id, mut rx, guard) = app.submit(place, ids, req.params, kind, false)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        let mut v = anthropic::message(&id, &model, &o);
        if !applied.is_empty() {
            v["context_management"] = anthropic::applied_edits(&applied);
        }
        let r = Json(v).into_response();
        return Ok(with_seed(r, seed));
    }
    let mut events = anthropic::StreamEvents::new(&id, &model, input_tokens);
    if !applied.is_empty() {
        events.context_management = Some(anthropic::applied_edits(&applied));
    }
    let first = events.start();
    let frame = move |ev: Event| events.frame(ev);
    Ok(with_seed(
        sse_response(event_stream(first, rx, guard, frame)),
        seed,
    ))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as `/v1/messages` would
/// render it, without generating.
async fn count_tokens(State(app): State<Arc<App>>, body: Body) -> Response {
    let inner = async {
        let bytes = app.body(body).await?;
        let mut req = anthropic::read_request(
            &bytes,
            &app.limits,
            &app.defaults,
            anthropic::MessagesRoute::CountTokens,
        )?;
        app.check_model(&req.chat.params)?;
        let ids = edited_chat_ids(&app, &mut req)?.marked.ids;
        Ok::<_, ApiError>(Json(json!({"input_tokens": ids.len()})).into_response())
    };
    match inner.await {
        Ok(r) => r,
        Err(e) => anthropic::error_response(e),
    }
}
