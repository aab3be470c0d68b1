//! The queue hand-off between a handler and the engine: the request body read within its
//! limits, the model name checked, a place in the queue held (429 when full) while the
//! grammar compiles, and the job submitted with a cancel flag that the client's leaving
//! raises.

use super::api_error::ApiError;
use super::constrain::{self, Api};
use super::http::App;
use super::job::{Event, Job, JobKind};
use super::request::{ChatRequest, GenParams};
use axum::body::{Body, Bytes};
use futures_util::stream::StreamExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc::Receiver;

/// Raises a job's cancel flag when the handler or its stream is dropped (the client left).
pub(super) struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl App {
    /// Reads a body of at most `body_limit` bytes within `body_timeout`. Past the limit
    /// the rest is read and dropped, up to four times the limit, so the client is still
    /// reading when the 413 comes instead of meeting a closed socket.
    pub(super) async fn body(&self, body: Body) -> Result<Bytes, ApiError> {
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

    pub(super) fn check_model(&self, p: &GenParams) -> Result<(), ApiError> {
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

    /// Checks the prompt against the context and queues the job; `inline_reasoning` puts
    /// think text into content.
    /// A place in the queue, or a 429 when every place is taken: queued requests and
    /// requests compiling their output constraint on the way to the queue share the
    /// `--queue` places, so a full queue refuses a request before its compile.
    pub(super) fn queue_place(&self) -> Result<QueuePlace<'_>, ApiError> {
        let depth = &self.shared.metrics.queue_depth;
        depth
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| {
                (d < self.queue).then_some(d + 1)
            })
            .map_err(|_| queue_full())?;
        Ok(QueuePlace {
            depth,
            queued: false,
        })
    }

    /// Queues a job in the place `place` holds.
    pub(super) fn submit(
        &self,
        place: QueuePlace<'_>,
        ids: Vec<u32>,
        mut params: GenParams,
        kind: JobKind,
        inline_reasoning: bool,
    ) -> Result<(String, Receiver<Event>, CancelOnDrop), ApiError> {
        params
            .sampling
            .validate()
            .map_err(|e| ApiError::status(400, format!("{e:#}")))?;
        if ids.is_empty() {
            return Err(ApiError::status(400, "the prompt is empty"));
        }
        // Each choice is a sequence of its own, and they run together.
        if params.n > self.parallel.max(1) {
            return Err(ApiError::field(
                "n",
                format!(
                    "{} choices run as {} sequences at once; this server runs at most {} (--parallel / K3_PARALLEL)",
                    params.n,
                    params.n,
                    self.parallel.max(1)
                ),
            ));
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
        let id = format!("{:x}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let left = self.context - ids.len();
        if params.max_tokens > left {
            tracing::info!(
                "[K3] serve: request {id}: max_tokens {} clamped to {left}: the prompt is {} tokens of a {}-token context",
                params.max_tokens,
                ids.len(),
                self.context
            );
            params.max_tokens = left;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(super::engine::EVENTS_IN_FLIGHT);
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            id: id.clone(),
            ids,
            params,
            kind,
            inline_reasoning,
            events: tx,
            stall_timeout: self.stall_timeout,
            cancel: cancel.clone(),
            queued: Instant::now(),
        };
        let mut place = place;
        match self.jobs.try_send(job) {
            Ok(()) => {
                // The engine frees the place when it takes the job.
                place.queued = true;
                Ok((id, rx, CancelOnDrop(cancel)))
            }
            Err(e) => {
                drop(place);
                Err(match e {
                    mpsc::TrySendError::Full(_) => queue_full(),
                    mpsc::TrySendError::Disconnected(_) => {
                        ApiError::status(503, "the engine has stopped")
                    }
                })
            }
        }
    }
}

/// The 429 of a full queue.
fn queue_full() -> ApiError {
    ApiError {
        retry_after: Some(1),
        ..ApiError::status(429, "the queue is full; retry shortly")
    }
}

/// A request's place in the engine's queue ([`App::queue_place`]), held while its output
/// constraint compiles: dropped before [`App::submit`] queues the job, it frees the place.
pub(super) struct QueuePlace<'a> {
    depth: &'a AtomicUsize,
    /// Whether the job went into the queue, which now owns the place.
    queued: bool,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        if !self.queued {
            self.depth.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl App {
    /// Compiles a chat request's output constraint for a prompt of `prompt_len` tokens, on
    /// this worker thread (the runtime moves its other tasks away meanwhile), while the
    /// request holds its queue `_place`.
    pub(super) fn constrain(
        &self,
        _place: &QueuePlace<'_>,
        req: &ChatRequest,
        api: Api,
        prompt_len: usize,
    ) -> Result<Option<constrain::RequestConstraint>, ApiError> {
        if constrain::output_constraint(req, api)?.is_none() {
            return Ok(None);
        }
        let budget = req
            .params
            .max_tokens
            .min(self.context.saturating_sub(prompt_len));
        tokio::task::block_in_place(|| {
            constrain::compile(self.grammar.as_deref(), req, api, budget)
        })
    }
}
