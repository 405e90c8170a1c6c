//! What every request passes through before its handler: the browser guard (JSON bodies
//! only, loopback names only on a keyless loopback server), the API key on the routes that
//! compute, and CORS when `--cors` asks for it. Handlers check none of it themselves.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::AppState;
use crate::error::ApiError;

/// `--cors`: answer preflights and allow any origin. The origin and the requested headers are
/// mirrored: the official JS SDK sends `x-stainless-*` headers that a fixed list would refuse
/// at the preflight.
pub(super) fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(AllowOrigin::mirror_request())
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers(AllowHeaders::mirror_request())
        .max_age(std::time::Duration::from_secs(600))
}

/// What a web page in a browser must not be able to do to a server on this machine:
///
/// - send it work without a CORS preflight: a POST body must be declared JSON, which a
///   page cannot send cross-origin without one (HTML forms and `no-cors` fetches send only
///   `text/plain`, form or no content types), and the server answers preflights only with
///   `--cors`;
/// - reach it under another name (DNS rebinding: a page's own host name made to resolve to
///   127.0.0.1): a server listening on a loopback address without `--api-key` answers only
///   requests addressed to a loopback name.
pub(super) async fn guard_browsers(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::POST {
        let content_type = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        if !content_type.is_some_and(is_json) {
            return ApiError::not_json(content_type).into_response();
        }
    }
    if state.options.api_key.is_none() && is_loopback_host(&state.options.host) {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok());
        if let Some(host) = host.filter(|h| !is_loopback_host(strip_port(h))) {
            return ApiError::foreign_host(host, &state.options.host).into_response();
        }
    }
    next.run(request).await
}

/// `application/json` or `application/*+json`, any parameters (`charset=utf-8`) aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json"))
}

/// A host name or address (without a port) that only reaches this machine.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let lower = host.to_ascii_lowercase();
    lower == "localhost"
        || lower.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `host` of a `Host` header's `host[:port]` (IPv6 in brackets).
fn strip_port(value: &str) -> &str {
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    value.rsplit_once(':').map_or(value, |(host, _)| host)
}

/// Errors in the shape of the API whose route was asked ([`crate::error::Dialect`]): the
/// outermost layer, so that the guards' and the framework's refusals are rewritten too.
pub(super) async fn speak_dialect(request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    crate::error::in_dialect(&path, next.run(request).await)
}

/// The keyed routes need the key when the server has one: `Authorization: Bearer KEY`, or
/// `x-api-key: KEY` (what Anthropic's SDKs send).
pub(super) async fn require_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.options.api_key {
        let headers = request.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .or_else(|| {
                headers
                    .get("x-api-key")
                    .and_then(|v| v.to_str().ok())
                    .map(str::trim)
            });
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.trim().as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// The token of an `Authorization` value whose scheme is `Bearer` in any case (RFC 9110: the
/// scheme is case-insensitive), spaces around the token ignored.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, is_json, is_loopback_host, strip_port};

    #[test]
    fn only_json_bodies_and_loopback_names_pass_the_browser_guard() {
        for t in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.api+json",
        ] {
            assert!(is_json(t), "{t}");
        }
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "application/jsonp",
        ] {
            assert!(!is_json(t), "{t}");
        }
        for h in [
            "localhost:8080",
            "LOCALHOST",
            "127.0.0.1:80",
            "127.1.2.3",
            "[::1]:8080",
            "[::1]",
            "app.localhost:3000",
        ] {
            assert!(is_loopback_host(strip_port(h)), "{h}");
        }
        for h in [
            "evil.example:8080",
            "192.168.1.2",
            "localhost.evil.example",
            "[::2]:80",
            "0.0.0.0:8080",
        ] {
            assert!(!is_loopback_host(strip_port(h)), "{h}");
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_spaces_around_the_token_do_not_count() {
        for value in [
            "Bearer sk-1",
            "bearer sk-1",
            "BEARER sk-1",
            "Bearer   sk-1  ",
            " Bearer sk-1",
        ] {
            assert_eq!(bearer_token(value), Some("sk-1"), "{value:?}");
        }
        for value in ["Basic sk-1", "Bearersk-1", "sk-1", ""] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }
}
