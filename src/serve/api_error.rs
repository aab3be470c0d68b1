//! Errors as OpenAI clients expect them: an HTTP status and
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// Seconds a client should wait before retrying (429).
    pub retry_after: Option<u32>,
}

/// The longest message an error carries: one that quotes a client's data (a field name,
/// a model id, a schema) is cut, so an answer never echoes a body back whole.
pub const MESSAGE_MAX: usize = 2048;
/// The longest `param` an error names.
pub const PARAM_MAX: usize = 256;

/// `s` cut to at most `max` bytes at a character boundary, saying how long it was.
pub fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let total = s.len();
    let mut at = max;
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    s.truncate(at);
    s.push_str(&format!("… ({total} bytes in all)"));
    s
}

impl ApiError {
    /// 400 naming `field`.
    pub fn field(field: &str, message: impl std::fmt::Display) -> Self {
        Self {
            status: 400,
            message: clip(format!("{field}: {message}"), MESSAGE_MAX),
            param: Some(clip(field.to_string(), PARAM_MAX)),
            retry_after: None,
        }
    }

    /// An error with a status and no field.
    pub fn status(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: clip(message.into(), MESSAGE_MAX),
            param: None,
            retry_after: None,
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 | 405 | 408 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": clip(self.message.clone(), MESSAGE_MAX),
            "type": self.kind(),
            "param": self.param.clone().map(|p| clip(p, PARAM_MAX)),
            "code": self.status,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(self.body())).into_response();
        // The request log reads the reason from here.
        r.extensions_mut().insert(self.clone());
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_and_params_are_cut() {
        let long = "é".repeat(100_000);
        let e = ApiError::field(&long, &long);
        let body = e.body().to_string();
        assert!(body.len() < MESSAGE_MAX + PARAM_MAX + 300, "{}", body.len());
        assert!(
            e.message.ends_with("bytes in all)"),
            "{}",
            &e.message[e.message.len() - 40..]
        );
        let e = ApiError {
            param: Some(long.clone()),
            message: long,
            ..ApiError::status(400, "")
        };
        assert!(e.body().to_string().len() < MESSAGE_MAX + PARAM_MAX + 300);
    }
}
