//! The listener: accepts TCP connections and serves each with hyper's HTTP/1, with the limits a
//! server on an open port needs and `axum::serve` does not set (issue #43, slow clients):
//!
//! - a deadline for each request head (`--header-timeout`, hyper's `header_read_timeout`);
//! - an idle timeout for connections with no request in progress (`--keep-alive-timeout`,
//!   kept here in [`Watched`]);
//! - a cap on open connections (`--max-connections`): at the cap it stops accepting, so new
//!   clients wait in the kernel's backlog, until one closes;
//! - a stop in two steps ([`Phase`]): draining (no new connections; open ones finish their
//!   request and close) and aborting (every connection dropped at once).
//!
//! hyper's header timer starts whenever the connection waits for a request head: when it opens
//! and again when a response ends (hyper 1.12, `proto/h1/conn.rs`: `poll_read_head` arms it
//! and `State::idle` asks for the next read at once). So it bounds the wait of an idle
//! kept-alive connection too, and `--keep-alive-timeout` can only be shorter.
//!
//! It knows nothing of the routes (any axum [`Router`]) and reads no bodies: [`crate::body`]
//! reads them, within `--body-timeout`.

use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::Request;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Sleep;
use tower_service::Service;

/// How long connections may take and how many may be open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionLimits {
    /// From the moment a connection waits for a request head (it opened, or its previous
    /// response ended) to the head's last byte.
    pub header_timeout: Duration,
    /// Longest wait for the first byte of the next request on a connection with no request in
    /// progress (at most `header_timeout` in effect: hyper's header timer runs meanwhile).
    pub keep_alive_timeout: Duration,
    /// Most connections open at once (at least 1).
    pub max_connections: usize,
}

/// Where the server is in its life; the listener and every connection watch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Accepting and serving.
    Serving,
    /// Stopping: no new connections; open ones finish the request in progress, then close
    /// (idle ones close at once).
    Draining,
    /// Stopping now: every open connection is dropped, which drops its handler (the engine
    /// thread then cancels its request).
    Aborting,
}

/// How long to wait before accepting again after `accept` failed for want of resources
/// (`EMFILE` and the like): long enough not to spin, short enough that a freed descriptor
/// is used soon.
const ACCEPT_RETRY: Duration = Duration::from_millis(250);

/// Serves `app` on `listener` until `phase` leaves [`Phase::Serving`], then waits for the open
/// connections to finish (or be aborted) and returns.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    mut phase: watch::Receiver<Phase>,
) {
    let max_connections = limits.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut connections = JoinSet::new();
    let mut at_limit = false;
    let mut accept_failing = false;
    loop {
        if *phase.borrow_and_update() != Phase::Serving {
            break;
        }
        // A slot before `accept`: at the limit, connections wait in the kernel's backlog
        // (and their clients see a slow connect), not in a task here holding a descriptor.
        let open = max_connections - slots.available_permits();
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                // One warning per episode: it ends once at most half the slots are taken, so
                // clients queueing for each slot that frees do not repeat it.
                if at_limit && open <= max_connections / 2 {
                    at_limit = false;
                    tracing::info!(
                        target: "kiln::serve",
                        open,
                        "{open} connections open, under half of --max-connections again"
                    );
                }
                slot
            }
            Err(_) => {
                if !at_limit {
                    at_limit = true;
                    tracing::warn!(
                        target: "kiln::serve",
                        open = max_connections,
                        "{max_connections} connections open, the --max-connections limit: new clients wait until one closes"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                    _ = phase.changed() => continue,
                    Some(_) = connections.join_next() => continue,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => {
                    if accept_failing {
                        accept_failing = false;
                        tracing::info!(target: "kiln::serve", "accepting connections again");
                    }
                    accepted
                }
                Err(e) => {
                    if !is_connection_error(&e) {
                        if !accept_failing {
                            accept_failing = true;
                            tracing::warn!(
                                target: "kiln::serve",
                                error = %e,
                                "cannot accept connections (out of file descriptors? see `ulimit -n` and --max-connections); retrying"
                            );
                        }
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                    continue;
                }
            },
            _ = phase.changed() => continue,
            Some(_) = connections.join_next() => continue,
        };
        connections.spawn(connection(
            stream,
            peer,
            app.clone(),
            limits,
            phase.clone(),
            slot,
        ));
    }
    // Refuse new clients at once rather than leave them in the backlog.
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Errors of one incoming connection (it was reset before `accept`), not of the listener.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until it closes, times out, or the server stops. `_slot` is its
/// place under `--max-connections`, given back when this returns.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: ConnectionLimits,
    mut phase: watch::Receiver<Phase>,
    _slot: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::default());
    let io = TokioIo::new(Watched::new(
        stream,
        limits.keep_alive_timeout,
        activity.clone(),
    ));
    let service = hyper::service::service_fn({
        let activity = activity.clone();
        move |mut request: Request<Incoming>| {
            let busy = Busy::start(&activity);
            request.extensions_mut().insert(ConnectInfo(peer));
            let mut app = app.clone();
            async move {
                let response = app.call(request).await?;
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| Tracked { body, _busy: busy }),
                )
            }
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut conn = pin!(builder.serve_connection(io, service));
    let mut watching = true;
    let result = loop {
        let now = *phase.borrow_and_update();
        match now {
            Phase::Serving => {}
            Phase::Draining => conn.as_mut().graceful_shutdown(),
            Phase::Aborting => {
                tracing::debug!(target: "kiln::serve", %peer, "connection dropped: the server is stopping now");
                return;
            }
        }
        tokio::select! {
            result = conn.as_mut() => break result,
            changed = phase.changed(), if watching => {
                // The sender gone: the server is going away and will drop this task.
                watching = changed.is_ok();
            }
        }
    };
    match result {
        Err(e) if e.is_timeout() => tracing::info!(
            target: "kiln::serve",
            %peer,
            "closed a connection that sent no complete request head within {} s (--header-timeout)",
            limits.header_timeout.as_secs_f64()
        ),
        _ if activity.idle_expired.load(Ordering::Relaxed) => {
            if activity.requests.load(Ordering::Relaxed) == 0 {
                tracing::info!(
                    target: "kiln::serve",
                    %peer,
                    "closed a connection that sent nothing for {} s (--keep-alive-timeout)",
                    limits.keep_alive_timeout.as_secs_f64()
                );
            } else {
                tracing::debug!(
                    target: "kiln::serve",
                    %peer,
                    "closed a kept-alive connection idle for {} s (--keep-alive-timeout)",
                    limits.keep_alive_timeout.as_secs_f64()
                );
            }
        }
        Err(e) => {
            tracing::debug!(target: "kiln::serve", %peer, error = %e, "connection ended with an error")
        }
        Ok(()) => {}
    }
}

/// What one connection is doing, shared by its socket ([`Watched`]) and its requests
/// ([`Busy`]).
#[derive(Debug, Default)]
struct Activity {
    /// Requests whose response has not ended (hyper serves one at a time; pipelined ones wait).
    in_flight: AtomicUsize,
    /// Requests started on this connection.
    requests: AtomicU64,
    /// Bumped each time `in_flight` drops to 0: a new idle period begins.
    idle_periods: AtomicU64,
    /// Set when the keep-alive timeout closed the connection.
    idle_expired: AtomicBool,
}

/// A request from its head to the end of its response (when hyper drops the body).
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Busy {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.requests.fetch_add(1, Ordering::Relaxed);
        Self(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle_periods.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A response body that keeps its request [`Busy`] until hyper has sent it all (or dropped
/// it, the client gone): a long stream is not an idle connection.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The connection's socket, which ends an idle period that lasts `keep_alive`: while no
/// request is in flight and nothing has arrived since the last response ended (or since the
/// connection opened), a read that would wait past `keep_alive` fails instead. hyper, idle,
/// takes that as the end of the connection.
struct Watched {
    stream: TcpStream,
    keep_alive: Duration,
    activity: Arc<Activity>,
    /// The idle period this socket last saw ([`Activity::idle_periods`]).
    period: u64,
    /// A byte has arrived in this idle period: the next request has begun, and hyper's header
    /// timeout governs it.
    heard: bool,
    /// The end of the idle period, armed at its first read that waits.
    idle_until: Option<Pin<Box<Sleep>>>,
}

impl Watched {
    fn new(stream: TcpStream, keep_alive: Duration, activity: Arc<Activity>) -> Self {
        Self {
            stream,
            keep_alive,
            activity,
            period: 0,
            heard: false,
            idle_until: None,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let period = this.activity.idle_periods.load(Ordering::Acquire);
        if period != this.period {
            this.period = period;
            this.heard = false;
            this.idle_until = None;
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.heard = true;
                this.idle_until = None;
            }
            Poll::Pending
                if !this.heard && this.activity.in_flight.load(Ordering::Acquire) == 0 =>
            {
                let keep_alive = this.keep_alive;
                let idle_until = this
                    .idle_until
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(keep_alive)));
                if idle_until.as_mut().poll(cx).is_ready() {
                    this.activity.idle_expired.store(true, Ordering::Relaxed);
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle past --keep-alive-timeout",
                    )));
                }
            }
            _ => {}
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::get;
    use futures_util::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const GET: &[u8] = b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n";

    struct Running {
        addr: SocketAddr,
        phase: watch::Sender<Phase>,
        serving: tokio::task::JoinHandle<()>,
    }

    /// The listener on a free port with `limits`, serving `/ok` (a short answer) and `/slow`
    /// (a body in three parts 150 ms apart).
    async fn start(limits: ConnectionLimits) -> Running {
        let app = Router::new().route("/ok", get(|| async { "ok" })).route(
            "/slow",
            get(|| async {
                let parts = futures_util::stream::iter(0..3).then(|i| async move {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Ok::<_, std::convert::Infallible>(Bytes::from(format!("{i}")))
                });
                Body::from_stream(parts)
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (phase, watching) = watch::channel(Phase::Serving);
        let serving = tokio::spawn(serve(listener, app, limits, watching));
        Running {
            addr,
            phase,
            serving,
        }
    }

    fn limits(header: u64, keep_alive: u64, max_connections: usize) -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_millis(header),
            keep_alive_timeout: Duration::from_millis(keep_alive),
            max_connections,
        }
    }

    /// Everything the server sends until it closes (or 5 s pass), and when it closed.
    async fn read_to_close(stream: &mut TcpStream) -> (String, Instant) {
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got)).await;
        (String::from_utf8_lossy(&got).into_owned(), Instant::now())
    }

    /// Reads one response to `GET /ok` (it ends with the body `ok`).
    async fn read_ok(stream: &mut TcpStream) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"\r\n\r\nok") {
            let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
                .await
                .expect("an answer within 5 s")
                .expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    #[tokio::test]
    async fn a_half_sent_head_is_closed_after_the_header_timeout() {
        // A head that has begun is not idle: the shorter keep-alive timeout does not apply.
        let server = start(limits(500, 100, 8)).await;
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        let sent = Instant::now();
        stream
            .write_all(b"GET /ok HTTP/1.1\r\nhost:")
            .await
            .expect("write");
        let (got, closed) = read_to_close(&mut stream).await;
        let took = closed - sent;
        assert!(got.is_empty(), "{got}");
        assert!(took >= Duration::from_millis(450), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }

    #[tokio::test]
    async fn an_idle_connection_closes_after_the_keep_alive_timeout() {
        let server = start(limits(2000, 200, 8)).await;
        // Nothing sent at all.
        let mut silent = TcpStream::connect(server.addr).await.expect("connect");
        let opened = Instant::now();
        let (_, closed) = read_to_close(&mut silent).await;
        assert!(closed - opened >= Duration::from_millis(150));
        assert!(
            closed - opened < Duration::from_millis(1500),
            "{:?}",
            closed - opened
        );
        // Idle after a request: closed, while a head that has begun gets the header timeout.
        let mut kept = TcpStream::connect(server.addr).await.expect("connect");
        kept.write_all(GET).await.expect("write");
        read_ok(&mut kept).await;
        let answered = Instant::now();
        let (rest, closed) = read_to_close(&mut kept).await;
        assert!(rest.is_empty(), "{rest}");
        assert!(closed - answered >= Duration::from_millis(150));
        assert!(
            closed - answered < Duration::from_millis(1500),
            "{:?}",
            closed - answered
        );
    }

    #[tokio::test]
    async fn a_kept_alive_connection_serves_requests_within_the_timeout() {
        let server = start(limits(2000, 300, 8)).await;
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            stream.write_all(GET).await.expect("write");
            read_ok(&mut stream).await;
        }
    }

    #[tokio::test]
    async fn a_response_longer_than_the_keep_alive_timeout_is_not_idle() {
        let server = start(limits(2000, 100, 8)).await;
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        stream
            .write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let (got, _) = read_to_close(&mut stream).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        // Chunked: each part is `1\r\nN\r\n`.
        for part in ["\r\n0\r\n", "\r\n1\r\n", "\r\n2\r\n"] {
            assert!(got.contains(part), "{got}");
        }
    }

    #[tokio::test]
    async fn at_max_connections_the_next_client_waits_for_a_slot() {
        let server = start(limits(600, 600, 2)).await;
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(server.addr).await.expect("connect");
            s.write_all(b"GET /ok HTTP/1.1\r\n").await.expect("write");
            stalled.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        // The kernel completes the handshake; the server does not take it yet.
        let mut waiting = TcpStream::connect(server.addr).await.expect("connect");
        waiting.write_all(GET).await.expect("write");
        let got = read_ok(&mut waiting).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(450),
            "served before a slot was free: {took:?}"
        );
    }

    #[tokio::test]
    async fn draining_closes_idle_connections_and_lets_a_response_finish() {
        let server = start(limits(5000, 5000, 8)).await;
        let mut idle = TcpStream::connect(server.addr).await.expect("connect");
        idle.write_all(GET).await.expect("write");
        read_ok(&mut idle).await;
        let mut busy = TcpStream::connect(server.addr).await.expect("connect");
        busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.phase.send_replace(Phase::Draining);
        let (rest, _) = read_to_close(&mut idle).await;
        assert!(rest.is_empty(), "{rest}");
        let (got, _) = read_to_close(&mut busy).await;
        assert!(got.contains("\r\n2\r\n"), "the stream was cut: {got}");
        tokio::time::timeout(Duration::from_secs(2), server.serving)
            .await
            .expect("the listener returns once its connections closed")
            .expect("no panic");
        assert!(
            TcpStream::connect(server.addr).await.is_err(),
            "still accepting"
        );
    }

    #[tokio::test]
    async fn aborting_drops_a_response_in_progress() {
        let server = start(limits(5000, 5000, 8)).await;
        let mut busy = TcpStream::connect(server.addr).await.expect("connect");
        busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.phase.send_replace(Phase::Draining);
        server.phase.send_replace(Phase::Aborting);
        let (got, _) = read_to_close(&mut busy).await;
        assert!(!got.contains("\r\n2\r\n"), "{got}");
        tokio::time::timeout(Duration::from_secs(1), server.serving)
            .await
            .expect("the listener returns at once")
            .expect("no panic");
    }
}
