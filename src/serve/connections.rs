//! The accept loop: at most `max_connections` open connections (one more is answered 503
//! with `Retry-After` and closed), request headers that must arrive within
//! `header_timeout`, answers the client must take within `stall_timeout` (a client that
//! stops reading is closed, which cancels its job), and on shutdown every connection
//! finishes its request in flight and closes, or is closed after [`SHUTDOWN_GRACE`].

use super::api_error::ApiError;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

/// Bounds on the connections one client or many may hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Longest wait for a request's headers.
    pub header_timeout: Duration,
    /// Longest a write to the client may wait (the client reads nothing) before the
    /// connection is closed.
    pub stall_timeout: Duration,
}

/// How long connections may take to finish after shutdown begins; then they are closed
/// (a client that reads nothing, or sends half a body, cannot hold the exit).
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A connection whose writes fail once one has waited `stall` without progress: a client
/// that stops reading fills the socket's buffer, and is then closed instead of holding its
/// connection (and its job) open.
struct StallIo<T> {
    inner: T,
    stall: Duration,
    /// Armed while a write waits.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallIo<T> {
    /// Runs a write attempt: disarms on progress, arms on the first wait, fails once the
    /// wait passes `stall`.
    fn watch<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            self.deadline = None;
            return r;
        }
        let stall = self.stall;
        let d = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if d.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing within --stall-timeout",
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Connections over the limit being answered 503 at once, at most; past that they are
/// closed without an answer, so a flood costs a bounded amount.
const REFUSALS_IN_FLIGHT: usize = 64;
/// How long a refused connection may take to receive its answer and close.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Bytes of a refused client's request read (and dropped) before closing.
const REFUSAL_DRAIN: usize = 64 << 10;

/// The whole HTTP answer to a connection over the limit: 503, `Retry-After`, an
/// OpenAI-style error naming the flag.
pub(crate) fn over_limit_answer(max_connections: usize) -> Vec<u8> {
    let e = ApiError {
        retry_after: Some(1),
        ..ApiError::status(
            503,
            format!(
                "the server holds its limit of {max_connections} open connections \
                 (--max-connections); retry shortly"
            ),
        )
    };
    let body = e.body().to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a connection over the limit, then reads what the client sent until it closes
/// (closing with unread bytes would reset the connection and could lose the answer).
async fn refuse(mut stream: TcpStream, answer: Arc<[u8]>) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        stream.write_all(&answer).await?;
        stream.shutdown().await?;
        let mut buf = [0u8; 4096];
        let mut drained = 0;
        while drained < REFUSAL_DRAIN {
            match stream.read(&mut buf).await? {
                0 => break,
                n => drained += n,
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains the connections;
/// `on_refusal` runs for each connection answered 503 over the limit.
pub(crate) async fn serve_connections(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    on_refusal: Arc<dyn Fn() + Send + Sync>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusals = Arc::new(Semaphore::new(REFUSALS_IN_FLIGHT));
    let answer: Arc<[u8]> = over_limit_answer(limits.max_connections).into();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        while tasks.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of descriptors or a connection reset before accept: try again shortly.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the limit: answer 503 on a slot of its own, or (in a flood of them) close.
            if let Ok(r) = refusals.clone().try_acquire_owned() {
                let answer = answer.clone();
                let on_refusal = on_refusal.clone();
                tokio::spawn(async move {
                    let _r = r;
                    on_refusal();
                    refuse(stream, answer).await;
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let _slot = slot;
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(
                    TokioIo::new(StallIo {
                        inner: stream,
                        stall: limits.stall_timeout,
                        deadline: None,
                    }),
                    service,
                );
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    let _ = stop_tx.send(true);
    let drained = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::info!(
            "[K3] serve: closing {} connection(s) still open {}s after the stop",
            tasks.len(),
            SHUTDOWN_GRACE.as_secs()
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
}
