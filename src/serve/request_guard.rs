//! What every request passes before its handler: the `Host` and `Origin` checks of
//! `origin.rs` (with CORS answers for an allowed cross-site origin), the API key
//! (everything but `/` and `/health`), an immediate 413 for a declared body over the
//! limit, the status counter, and a log line for every request answered with an error.

use super::anthropic;
use super::api_error::ApiError;
use super::http::App;
use super::origin::Admit;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::stream::StreamExt;
use std::sync::Arc;
use std::time::Duration;

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

/// Whether a path is Anthropic's, whose errors have Anthropic's shape.
fn anthropic_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Headers a preflight may ask for when it names none.
const CORS_HEADERS: &str = "authorization, content-type, x-api-key, anthropic-version";

/// Adds the CORS headers an allowed cross-site origin's answer carries.
fn with_cors(mut r: Response, admit: &Admit) -> Response {
    if let Admit::Cors(origin) = admit {
        if let Ok(v) = HeaderValue::from_str(origin) {
            let h = r.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
            h.insert(header::VARY, HeaderValue::from_static("origin"));
            h.insert(
                header::ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static("x-k3-seed, retry-after"),
            );
        }
    }
    r
}

/// The answer to a CORS preflight from an allowed origin: 204 with the methods and the
/// headers it asked for.
fn preflight(req: &Request) -> Response {
    let asked = req
        .headers()
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or(HeaderValue::from_static(CORS_HEADERS));
    let mut r = axum::http::StatusCode::NO_CONTENT.into_response();
    let h = r.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(600));
    r
}

/// The `Host` and `Origin` checks, then the key check (everything but `/` and `/health`),
/// an immediate 413 for a declared `Content-Length` over the body limit, and the status
/// counter.
pub(super) async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let route = req.uri().path().to_string();
    let path = route.as_str();
    let open = matches!(path, "/" | "/health");
    let anthropic = anthropic_path(path);
    let admit = app.origins.check(
        req.headers().get(header::HOST).map(HeaderValue::as_bytes),
        req.headers().get(header::ORIGIN).map(HeaderValue::as_bytes),
    );
    let admit = match admit {
        Ok(a) => a,
        Err(refusal) => {
            let e = ApiError::status(403, refusal.0);
            let r = if anthropic {
                anthropic::error_response(e)
            } else {
                e.into_response()
            };
            app.shared.metrics.count_status(403);
            tracing::info!("{}", refusal_line(method.as_str(), &route, &r));
            return r;
        }
    };
    let is_preflight = req.method() == axum::http::Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if is_preflight && matches!(admit, Admit::Cors(_)) {
        let r = with_cors(preflight(&req), &admit);
        app.shared.metrics.count_status(r.status().as_u16());
        return r;
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let refusal = match (&app.api_key, open) {
        (Some(key), false)
            if !bearer(req.headers()).is_some_and(|k| keys_match(k, key.as_bytes())) =>
        {
            Some(ApiError::status(
                401,
                "a valid API key is required: Authorization: Bearer KEY (or x-api-key: KEY)",
            ))
        }
        _ if declared.is_some_and(|n| n > app.body_limit as u64) => Some(ApiError::status(
            413,
            format!(
                "the request body is over {} bytes (--max-body-mb)",
                app.body_limit
            ),
        )),
        _ => None,
    };
    let resp = match refusal {
        Some(e) => {
            if e.status == 413 {
                drain_briefly(req.into_body(), app.body_limit).await;
            }
            let mut r = if anthropic {
                anthropic::error_response(e)
            } else {
                e.into_response()
            };
            if r.status().as_u16() == 413 {
                // The body was not read whole: the connection cannot carry another request.
                r.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            r
        }
        None => next.run(req).await,
    };
    let status = resp.status().as_u16();
    app.shared.metrics.count_status(status);
    if status >= 400 {
        tracing::info!("{}", refusal_line(method.as_str(), &route, &resp));
    }
    with_cors(resp, &admit)
}

/// The log line of a request answered with an error: the route, the status, and the
/// reason the answer gives (its field first), on one line.
fn refusal_line(method: &str, route: &str, resp: &Response) -> String {
    let status = resp.status();
    let what = if status.is_server_error() {
        "failed"
    } else {
        "refused"
    };
    let reason = match resp.extensions().get::<ApiError>() {
        Some(e) => e.message.replace(['\n', '\r'], " "),
        // Axum's own answers (no such route, a method the route lacks).
        None => status.canonical_reason().unwrap_or("error").to_string(),
    };
    format!(
        "[K3] serve: {what} {method} {route}: {}: {reason}",
        status.as_u16()
    )
}

/// Reads and drops what arrives of an oversized body for a moment (up to four times the
/// limit, at most [`DRAIN_SECS`]), so a client still sending reads the 413 instead of a
/// reset, and one that sends nothing gets it at once.
async fn drain_briefly(body: Body, limit: usize) {
    let mut data = body.into_data_stream();
    let read = async {
        let mut seen = 0usize;
        while let Some(Ok(chunk)) = data.next().await {
            seen = seen.saturating_add(chunk.len());
            if seen > limit.saturating_mul(4) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(DRAIN_SECS), read).await;
}

/// Longest wait for the rest of an oversized body before its 413.
const DRAIN_SECS: u64 = 1;
