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

impl ApiError {
    /// 400 naming `field`.
    pub fn field(field: &str, message: impl std::fmt::Display) -> Self {
        Self {
            status: 400,
            message: format!("{field}: {message}"),
            param: Some(field.to_string()),
            retry_after: None,
        }
    }

    /// An error with a status and no field.
    pub fn status(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 | 405 | 408 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
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
