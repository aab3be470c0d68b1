//! The HTTP side: axum routes, the API key, body limits, the queue hand-off to the
//! engine (429 when full), and the answers (one JSON or server-sent events).

use super::anthropic;
use super::api_error::ApiError;
use super::engine::{EngineShared, Event, Field, Job, JobKind, Outcome};
use super::openai;
use super::prompt::render_request;
use super::request::{chat_request, completion_request, Defaults, GenParams, Limits};
use super::sse::{event_stream, SseFrame};
use crate::tokenizer::Tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{Stream, StreamExt};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// Everything a handler needs.
pub struct App {
    /// The queue to the engine.
    pub jobs: mpsc::SyncSender<Job>,
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
}

/// The page at `/`.
const PAGE: &str = include_str!("page.html");

/// The router.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .fallback(|| async { ApiError::status(404, "no such route").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError::status(405, "this route does not take that method").into_response()
        })
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// Compares two keys in time that depends only on their lengths.
pub fn keys_match(given: &[u8], want: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != want.len());
    for (i, &w) in want.iter().enumerate() {
        diff |= w ^ given.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v.as_bytes();
        return v
            .strip_prefix(b"Bearer ")
            .or_else(|| v.strip_prefix(b"bearer "));
    }
    headers.get("x-api-key").map(HeaderValue::as_bytes)
}

/// The key check (everything but `/` and `/health`) and the status counter.
async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let open = matches!(req.uri().path(), "/" | "/health");
    let resp = match (&app.api_key, open) {
        (Some(key), false)
            if !bearer(req.headers()).is_some_and(|k| keys_match(k, key.as_bytes())) =>
        {
            ApiError::status(
                401,
                "a valid API key is required: Authorization: Bearer KEY",
            )
            .into_response()
        }
        _ => next.run(req).await,
    };
    app.shared.metrics.count_status(resp.status().as_u16());
    resp
}

async fn health(State(app): State<Arc<App>>) -> Json<Value> {
    let m = &app.shared.metrics;
    let busy = m.busy.load(Ordering::Relaxed);
    Json(json!({
        "status": "ok",
        "model": app.model_name,
        "backend": app.backend_name,
        "queue_depth": m.queue_depth.load(Ordering::Relaxed),
        "state": if busy { "busy" } else { "idle" },
    }))
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

/// Raises a job's cancel flag when the handler or its stream is dropped (the client left).
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl App {
    /// Reads a body of at most `body_limit` bytes within `body_timeout`. Past the limit
    /// the rest is read and dropped, up to four times the limit, so the client is still
    /// reading when the 413 comes instead of meeting a closed socket.
    async fn body(&self, body: Body) -> Result<Bytes, ApiError> {
        let limit = self.body_limit;
        let read = async move {
            let mut data = body.into_data_stream();
            let mut buf: Vec<u8> = Vec::new();
            let mut seen = 0usize;
            while let Some(chunk) = data.next().await {
                let Ok(chunk) = chunk else {
                    return Err(ApiError::status(400, "the request body broke off"));
                };
                seen = seen.saturating_add(chunk.len());
                if seen <= limit {
                    buf.extend_from_slice(&chunk);
                } else if seen > limit.saturating_mul(4) {
                    break;
                }
            }
            if seen > limit {
                return Err(ApiError::status(
                    413,
                    format!("the request body is over {limit} bytes"),
                ));
            }
            Ok(Bytes::from(buf))
        };
        match tokio::time::timeout(self.body_timeout, read).await {
            Err(_) => Err(ApiError::status(
                408,
                "the request body did not arrive in time",
            )),
            Ok(r) => r,
        }
    }

    fn check_model(&self, p: &GenParams) -> Result<(), ApiError> {
        match p.model.as_deref() {
            Some(m) if !m.is_empty() && m != self.model_name => Err(ApiError {
                param: Some("model".into()),
                ..ApiError::status(
                    404,
                    format!(
                        "model {m:?} is not served here; this server serves {:?}",
                        self.model_name
                    ),
                )
            }),
            _ => Ok(()),
        }
    }

    /// Checks the prompt against the context and queues the job.
    fn submit(
        &self,
        ids: Vec<u32>,
        mut params: GenParams,
        kind: JobKind,
    ) -> Result<(String, UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
        params
            .sampling
            .validate()
            .map_err(|e| ApiError::status(400, format!("{e:#}")))?;
        if ids.is_empty() {
            return Err(ApiError::status(400, "the prompt is empty"));
        }
        if ids.len() >= self.context {
            return Err(ApiError::status(
                400,
                format!(
                    "the prompt is {} tokens; the context holds {} (--max-tokens / K3_MAXT), \
                     with room for at least one generated token",
                    ids.len(),
                    self.context
                ),
            ));
        }
        params.max_tokens = params.max_tokens.min(self.context - ids.len());
        let id = format!("{:x}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            id: id.clone(),
            ids,
            params,
            kind,
            events: tx,
            cancel: cancel.clone(),
            queued: Instant::now(),
        };
        let depth = &self.shared.metrics.queue_depth;
        depth.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(job) {
            Ok(()) => Ok((id, rx, CancelOnDrop(cancel))),
            Err(e) => {
                depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    mpsc::TrySendError::Full(_) => ApiError {
                        retry_after: Some(1),
                        ..ApiError::status(429, "the queue is full; retry shortly")
                    },
                    mpsc::TrySendError::Disconnected(_) => {
                        ApiError::status(503, "the engine has stopped")
                    }
                })
            }
        }
    }
}

/// Waits for a job's end; text deltas are already in the outcome.
pub async fn wait_outcome(rx: &mut UnboundedReceiver<Event>) -> Result<Box<Outcome>, ApiError> {
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
fn sse_response<S>(s: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    Sse::new(s)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

async fn chat(State(app): State<Arc<App>>, body: Body) -> Result<Response, ApiError> {
    let app = &app;
    let bytes = app.body(body).await?;
    let req = chat_request(&bytes, &app.limits, &app.defaults)?;
    app.check_model(&req.params)?;
    let ids = app
        .tok
        .encode_prompt(&render_request(&req)?)
        .map_err(|e| ApiError::status(400, format!("encoding the prompt: {e:#}")))?;
    let (stream, include_usage) = (req.params.stream, req.params.include_usage);
    let kind = JobKind::Chat {
        thinking: req.thinking,
    };
    let (id, mut rx, guard) = app.submit(ids, req.params, kind)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        return Ok(Json(openai::chat_completion(&id, &model, &o)).into_response());
    }
    let role = json!({"role": "assistant", "content": ""});
    let first = vec![SseFrame::from(
        openai::chat_chunk(&id, &model, role, None).to_string(),
    )];
    let frame = move |ev: Event| match ev {
        Event::Delta(field, text) => (
            vec![SseFrame::from(
                openai::chat_chunk(&id, &model, openai::text_delta(field, &text), None).to_string(),
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
    Ok(sse_response(event_stream(first, rx, guard, frame)))
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
    let stream = req.params.stream;
    let (id, mut rx, guard) = app.submit(ids, req.params, JobKind::Completion)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        return Ok(Json(openai::completion(&id, &model, &o)).into_response());
    }
    let frame = move |ev: Event| match ev {
        Event::Delta(Field::Content, text) => (
            vec![SseFrame::from(
                openai::completion_chunk(&id, &model, &text, None).to_string(),
            )],
            false,
        ),
        Event::Delta(Field::Reasoning, _) => (Vec::new(), false),
        Event::Done(o) => {
            let mut last = openai::completion_chunk(&id, &model, "", Some(o.finish.as_str()));
            last["usage"] = openai::usage(&o);
            (
                vec![SseFrame::from(last.to_string()), SseFrame::done()],
                true,
            )
        }
        Event::Failed(m) => (
            vec![
                SseFrame::from(ApiError::status(500, m).body().to_string()),
                SseFrame::done(),
            ],
            true,
        ),
    };
    Ok(sse_response(event_stream(Vec::new(), rx, guard, frame)))
}

async fn messages(State(app): State<Arc<App>>, body: Body) -> Response {
    match messages_inner(&app, body).await {
        Ok(r) => r,
        Err(e) => anthropic::error_response(e),
    }
}

async fn messages_inner(app: &Arc<App>, body: Body) -> Result<Response, ApiError> {
    let bytes = app.body(body).await?;
    let req = anthropic::messages_request(&bytes, &app.limits, &app.defaults)?;
    app.check_model(&req.params)?;
    let ids = app
        .tok
        .encode_prompt(&render_request(&req)?)
        .map_err(|e| ApiError::status(400, format!("encoding the prompt: {e:#}")))?;
    let stream = req.params.stream;
    let kind = JobKind::Chat {
        thinking: req.thinking,
    };
    let (id, mut rx, guard) = app.submit(ids, req.params, kind)?;
    let model = app.model_name.clone();
    if !stream {
        let o = wait_outcome(&mut rx).await?;
        drop(guard);
        return Ok(Json(anthropic::message(&id, &model, &o)).into_response());
    }
    let mut events = anthropic::StreamEvents::new(&id, &model);
    let first = events.start();
    let frame = move |ev: Event| events.frame(ev);
    Ok(sse_response(event_stream(first, rx, guard, frame)))
}
