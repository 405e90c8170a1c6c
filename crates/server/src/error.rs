//! Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with the
//! status that says whose fault it is. Every rejection the server makes, the framework's
//! included (malformed JSON, an oversized body, an unknown path), goes out in this shape, or,
//! on the routes of another API, in that API's ([`Dialect`]: Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`, Ollama's `{"error": "..."}`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::api::response::{ErrorBody, ErrorDetail};

/// Whose error shape a client parses: the API its route belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}` (the Messages API).
    Anthropic,
    /// `{"error": "message"}` (`/api/*`).
    Ollama,
}

impl Dialect {
    /// The dialect of the route at `path`.
    pub fn of_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Dialect::Anthropic
        } else if path.starts_with("/api/") {
            Dialect::Ollama
        } else {
            Dialect::OpenAi
        }
    }
}

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_api_key`, `queue_full`, ...), if there is one.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400: a value the server cannot use.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_field(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// 400 naming the field whose prompt does not fit in the context or the KV cache
    /// (OpenAI's `context_length_exceeded`, which clients such as the Codex CLI act on).
    pub fn context_length_exceeded(param: &str, message: impl Into<String>) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            ..Self::invalid_field(param, message)
        }
    }

    /// 401: no key, or the wrong one.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
            )
        }
    }

    /// 404: no such route.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, what)
    }

    /// 405: the route exists, the method does not.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed on this path",
        )
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {limit} bytes (--max-body-bytes)"),
        )
    }

    /// 404: no served model has this name (OpenAI's `model_not_found`).
    pub fn model_not_found(name: &str, known: &[&str]) -> Self {
        Self {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model {:?} is not served here; this server serves {}",
                    // A name is at most 64 bytes; a longer one is not echoed whole.
                    name.chars().take(80).collect::<String>(),
                    known.join(", ")
                ),
            )
        }
    }

    /// 503: the model could not be loaded.
    pub fn model_unavailable(alias: &str, why: &str) -> Self {
        Self {
            code: Some("model_unavailable"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("loading the model {alias} failed: {why}"),
            )
        }
    }

    /// 503: no room was made to load the model in time (the models that would have to unload
    /// stayed busy).
    pub fn no_room_for_model(alias: &str, waited: std::time::Duration) -> Self {
        Self {
            code: Some("model_busy"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "loading the model {alias} needs room that the models running requests \
                     did not give within {} s (--models-room-wait); retry later",
                    waited.as_secs_f64()
                ),
            )
        }
    }

    /// 503: the model is still loading.
    pub fn loading() -> Self {
        Self {
            code: Some("model_loading"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
            )
        }
    }

    /// 503: too many requests waiting already.
    pub fn queue_full(max_queue: usize) -> Self {
        Self {
            code: Some("queue_full"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the server is busy: its queue of {max_queue} sequences (--max-queue) is full; retry later"
                ),
            )
        }
    }

    /// 503: more embedding jobs are waiting than `--max-queue` allows.
    pub fn embedding_queue_full(max_queue: usize) -> Self {
        Self {
            code: Some("queue_full"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the server is busy: {max_queue} embedding requests (--max-queue) are waiting; retry later"
                ),
            )
        }
    }

    /// 503: the server is stopping and takes no new work.
    pub fn shutting_down() -> Self {
        Self {
            code: Some("shutting_down"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            )
        }
    }

    /// 503: the server stopped before the request finished (the grace period ran out).
    pub fn cut_off() -> Self {
        Self {
            code: Some("shutting_down"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server shut down before this request finished",
            )
        }
    }

    /// 415: a POST body not declared as JSON.
    pub fn not_json(content_type: Option<&str>) -> Self {
        let given = content_type.map_or_else(|| "none".to_string(), |t| format!("{t:?}"));
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "the body must be sent as Content-Type: application/json (given: {given}); \
                 with curl, add -H 'Content-Type: application/json'"
            ),
        )
    }

    /// 403: a request addressed to a name other than this machine's own, to a server that
    /// listens on loopback without a key (what DNS rebinding sends).
    pub fn foreign_host(host: &str, bound: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            format!(
                "Host {host:?} is not a loopback name: a server listening on {bound} without \
                 --api-key answers only localhost, 127.0.0.1 and [::1] (so that web pages \
                 cannot reach it by DNS rebinding); listen on another address or set --api-key"
            ),
        )
    }

    /// 500: kiln failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The body, as sent alone or as a stream's data event.
    pub(crate) fn envelope(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }

    /// The body (`{"error": {...}}`) as a JSON value.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(self.envelope()).unwrap_or_default()
    }

    /// Anthropic's `error.type` for this status.
    fn anthropic_kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The body in `dialect`'s shape, as sent alone or as a stream's error event.
    pub fn body_in(&self, dialect: Dialect) -> serde_json::Value {
        match dialect {
            Dialect::OpenAi => self.body(),
            Dialect::Anthropic => serde_json::json!({
                "type": "error",
                "error": {"type": self.anthropic_kind(), "message": self.message},
            }),
            Dialect::Ollama => serde_json::json!({"error": self.message}),
        }
    }

    /// The answer in `dialect`'s shape.
    pub fn response_in(&self, dialect: Dialect) -> Response {
        (self.status, axum::Json(self.body_in(dialect))).into_response()
    }
}

impl IntoResponse for ApiError {
    /// OpenAI's shape; the error rides along in the answer's extensions, so that
    /// `in_dialect` can write it in another API's shape on that API's routes.
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.envelope())).into_response();
        response.extensions_mut().insert(self);
        response
    }
}

/// An answer on the route at `path`, its error (if it is one the server made) rewritten in
/// that route's [`Dialect`].
pub fn in_dialect(path: &str, response: Response) -> Response {
    let dialect = Dialect::of_path(path);
    if dialect == Dialect::OpenAi {
        return response;
    }
    match response.extensions().get::<ApiError>() {
        Some(error) => error.response_in(dialect),
        None => response,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_openai_type_by_status() {
        let body = ApiError::invalid_field("temperature", "bad").body();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "temperature");
        assert!(body["error"]["code"].is_null());
        assert_eq!(
            ApiError::unauthorized().body()["error"]["type"],
            "authentication_error"
        );
        assert_eq!(
            ApiError::queue_full(3).body()["error"]["type"],
            "server_error"
        );
    }

    #[test]
    fn each_api_reads_its_own_error_shape() {
        let e = ApiError::invalid_field("max_tokens", "max_tokens must be at least 1");
        let anthropic = e.body_in(Dialect::of_path("/v1/messages"));
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "invalid_request_error");
        assert_eq!(
            anthropic["error"]["message"],
            "max_tokens must be at least 1"
        );
        assert_eq!(
            ApiError::queue_full(3).body_in(Dialect::Anthropic)["error"]["type"],
            "overloaded_error"
        );
        let ollama = e.body_in(Dialect::of_path("/api/chat"));
        assert_eq!(
            ollama,
            serde_json::json!({"error": "max_tokens must be at least 1"})
        );
        assert_eq!(
            Dialect::of_path("/v1/messages/count_tokens"),
            Dialect::Anthropic
        );
        assert_eq!(Dialect::of_path("/v1/chat/completions"), Dialect::OpenAi);
        assert_eq!(Dialect::of_path("/v1/messagesx"), Dialect::OpenAi);
    }
}
