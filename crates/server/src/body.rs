//! Reading a request body within the server's limits: at most `--max-body-bytes`, all of it
//! within `--body-timeout` of the handler asking for it.
//!
//! A body over the limit is refused with 413 only after what the client is still sending has
//! been read and thrown away (up to [`drain_bound`] bytes, within the same timeout): a client
//! that writes its whole body before reading the answer (most do) would otherwise hit a
//! connection the server closed with its bytes unread, which the kernel answers with a reset,
//! and see a broken pipe instead of the 413. A client that asked `Expect: 100-continue` has
//! sent nothing yet and is answered at once.
//!
//! It knows nothing of JSON or of the routes: it returns the bytes.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::error::ApiError;

/// What a body may be.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyLimits {
    /// Most bytes (`--max-body-bytes`).
    pub max_bytes: usize,
    /// Longest time for all of it to arrive (`--body-timeout`).
    pub timeout: Duration,
}

/// Most bytes of an over-limit body read (and dropped) before the 413: four times the limit,
/// and at least 64 MiB, so a body a client might plausibly send is read to its end. Bigger
/// ones get the 413 after that many bytes, and the connection closes under them.
pub(crate) fn drain_bound(limit: usize) -> usize {
    limit.saturating_mul(4).max(64 << 20)
}

/// `body`, whose request had `headers`, read whole within `limits`. `peer` is for the log.
///
/// # Errors
/// 413 ([`ApiError::too_large`]) when it is, or says it is, over `limits.max_bytes`; 408 when
/// it has not all arrived within `limits.timeout`; 400 when the connection failed under it.
pub(crate) async fn read(
    headers: &HeaderMap,
    body: Body,
    limits: BodyLimits,
    peer: Option<SocketAddr>,
) -> Result<Bytes, ApiError> {
    let deadline = Instant::now() + limits.timeout;
    let limit = limits.max_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let mut frames = body.into_data_stream();
    if declared.is_some_and(|n| n > limit as u64) {
        let waits_for_go_ahead = headers
            .get(header::EXPECT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"));
        // Reading would send `100 Continue` and invite the body we are about to refuse.
        if !waits_for_go_ahead {
            drain(&mut frames, deadline, drain_bound(limit)).await;
        }
        tracing::debug!(target: "kiln::serve", peer = %shown(peer), declared, limit, "refused a body over --max-body-bytes (Content-Length)");
        return Err(ApiError::too_large(limit));
    }
    let mut bytes = Vec::with_capacity(declared.map_or(0, |n| n as usize).min(limit));
    loop {
        match tokio::time::timeout_at(deadline, frames.next()).await {
            Err(_) => {
                tracing::info!(
                    target: "kiln::serve",
                    peer = %shown(peer),
                    received = bytes.len(),
                    declared,
                    "gave up on a request body that did not arrive within {} s (--body-timeout)",
                    limits.timeout.as_secs_f64()
                );
                return Err(timed_out(limits.timeout));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(ApiError::invalid(format!(
                    "the request body could not be read: {e}"
                )));
            }
            Ok(Some(Ok(chunk))) => {
                if bytes.len() + chunk.len() > limit {
                    let read = bytes.len() + chunk.len();
                    drop(bytes);
                    drain(
                        &mut frames,
                        deadline,
                        drain_bound(limit).saturating_sub(read),
                    )
                    .await;
                    tracing::debug!(target: "kiln::serve", peer = %shown(peer), limit, "refused a body that grew past --max-body-bytes");
                    return Err(ApiError::too_large(limit));
                }
                bytes.extend_from_slice(&chunk);
            }
        }
    }
    Ok(Bytes::from(bytes))
}

/// Reads and drops what is left of a body, until it ends, `bound` bytes have gone, it fails,
/// or `deadline` passes. Returns the bytes dropped.
async fn drain<S, E>(frames: &mut S, deadline: Instant, bound: usize) -> usize
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
{
    let mut dropped = 0usize;
    while dropped <= bound {
        match tokio::time::timeout_at(deadline, frames.next()).await {
            Ok(Some(Ok(chunk))) => dropped += chunk.len(),
            _ => break,
        }
    }
    dropped
}

/// The client's address for the log (`?` when the listener did not say).
fn shown(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "?".into(), |p| p.to_string())
}

/// 408: the body did not arrive within `--body-timeout`.
fn timed_out(timeout: Duration) -> ApiError {
    ApiError {
        status: StatusCode::REQUEST_TIMEOUT,
        message: format!(
            "the request body did not arrive within {} s (--body-timeout)",
            timeout.as_secs_f64()
        ),
        param: None,
        code: Some("body_timeout"),
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use axum::http::HeaderValue;
    use futures_util::stream;

    use super::*;

    const LIMITS: BodyLimits = BodyLimits {
        max_bytes: 10,
        timeout: Duration::from_secs(5),
    };

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                name.clone(),
                HeaderValue::from_str(value).expect("a header value"),
            );
        }
        map
    }

    /// A body of these chunks, each read once, with a count of the chunks read.
    fn counted(
        chunks: Vec<&'static [u8]>,
    ) -> (Body, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = count.clone();
        let body = Body::from_stream(stream::iter(chunks).map(move |c| {
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, Infallible>(Bytes::from_static(c))
        }));
        (body, count)
    }

    #[tokio::test]
    async fn reads_a_body_within_the_limit() {
        let (body, _) = counted(vec![b"hello", b" you"]);
        let got = read(&HeaderMap::new(), body, LIMITS, None).await;
        assert_eq!(got.expect("read"), Bytes::from_static(b"hello you"));
    }

    #[tokio::test]
    async fn a_body_that_grows_past_the_limit_is_413_after_being_read_to_its_end() {
        let (body, count) = counted(vec![b"0123456", b"789abc", b"more", b"end"]);
        let err = read(&HeaderMap::new(), body, LIMITS, None)
            .await
            .expect_err("over");
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            count.load(std::sync::atomic::Ordering::Relaxed),
            4,
            "drained"
        );
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_413_after_draining() {
        let (body, count) = counted(vec![b"0123456789", b"0123456789"]);
        let h = headers(&[(header::CONTENT_LENGTH, "20")]);
        let err = read(&h, body, LIMITS, None).await.expect_err("over");
        assert_eq!(err, ApiError::too_large(10));
        assert_eq!(
            count.load(std::sync::atomic::Ordering::Relaxed),
            2,
            "drained"
        );
    }

    #[tokio::test]
    async fn expect_continue_over_the_limit_is_answered_without_reading() {
        let (body, count) = counted(vec![b"0123456789", b"0123456789"]);
        let h = headers(&[
            (header::CONTENT_LENGTH, "20"),
            (header::EXPECT, "100-continue"),
        ]);
        let err = read(&h, body, LIMITS, None).await.expect_err("over");
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(count.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_stalled_body_is_408_after_the_timeout() {
        let chunks = stream::iter([Ok::<_, Infallible>(Bytes::from_static(b"{\"a\""))])
            .chain(stream::pending());
        let body = Body::from_stream(chunks);
        let limits = BodyLimits {
            timeout: Duration::from_millis(100),
            ..LIMITS
        };
        let started = Instant::now();
        let err = read(&HeaderMap::new(), body, limits, None)
            .await
            .expect_err("stalled");
        assert_eq!(err.status, StatusCode::REQUEST_TIMEOUT);
        assert_eq!(err.code, Some("body_timeout"));
        let took = started.elapsed();
        assert!(
            took >= limits.timeout && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[test]
    fn the_drain_bound_is_at_least_64_mib_and_four_limits() {
        assert_eq!(drain_bound(1000), 64 << 20);
        assert_eq!(drain_bound(100 << 20), 400 << 20);
        assert_eq!(drain_bound(usize::MAX), usize::MAX);
    }
}
