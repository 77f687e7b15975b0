//! What a connection is doing, and how long it may go on doing it.
//!
//! Three allowances, each for its own phase of an HTTP/1.1 connection:
//! - a new connection's first byte within `header_timeout` (a connection
//!   that says nothing is closed);
//! - a request's headers within `header_timeout` of its first byte;
//! - between requests, `idle_timeout` of silence before the connection is
//!   closed.
//!
//! hyper's own header timeout counts from the end of the previous answer,
//! so it closes an idle kept-alive connection after the header allowance
//! (10 s). Go's HTTP clients (the API server's webhook calls,
//! kube-scheduler's extender calls) keep an idle connection 90 s and send a
//! POST on it without retrying when it turns out closed: one closed by the
//! server just as the client reuses it fails that call ("write: broken
//! pipe"). With an idle allowance longer than the client's, the client
//! closes its idle connections first, and no call meets a closing one.
//!
//! The age limit likewise never closes an idle connection: the next answer
//! says `connection: close`, and the client opens another.

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION};
use hyper::{Request, Response};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

/// Where a connection stands, and since when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Accepted (or its TLS handshake done); nothing of a request yet.
    Opened(Instant),
    /// Between requests: the last answer ended then.
    Idle(Instant),
    /// A request's first byte came then; its headers are not all in.
    Head(Instant),
    /// A request is being handled or answered: its body's and its answer's
    /// own limits apply (`body_timeout`, `write_timeout`).
    Answering,
}

/// Why a connection's allowance ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// It sent nothing within the header allowance of opening.
    Silent,
    /// Its request's headers did not all come within the header allowance.
    SlowHead,
    /// Nothing came within the idle allowance of its last answer.
    Idle,
}

/// One connection's phase, shared by its reads ([`Watched`]), its requests
/// ([`Clocked`]) and the task that serves it ([`ConnectionClock::expired`]).
pub struct ConnectionClock {
    phase: watch::Sender<Phase>,
    close_after_answer: AtomicBool,
}

impl ConnectionClock {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            phase: watch::Sender::new(Phase::Opened(Instant::now())),
            close_after_answer: AtomicBool::new(false),
        })
    }

    /// Starts the connection's clock again, as if it had just opened (after
    /// a TLS handshake, which has its own allowance).
    pub fn reopened(&self) {
        self.phase.send_replace(Phase::Opened(Instant::now()));
    }

    /// Bytes came from the client: a request begins, unless one is in hand.
    fn bytes_read(&self) {
        self.phase.send_if_modified(|phase| match phase {
            Phase::Opened(_) | Phase::Idle(_) => {
                *phase = Phase::Head(Instant::now());
                true
            }
            Phase::Head(_) | Phase::Answering => false,
        });
    }

    fn answering(&self) {
        self.phase.send_replace(Phase::Answering);
    }

    fn answered(&self) {
        self.phase.send_replace(Phase::Idle(Instant::now()));
    }

    /// From now on, every answer tells the client to close the connection
    /// (hyper then closes it once the answer is written).
    pub fn close_after_answer(&self) {
        self.close_after_answer.store(true, Ordering::Relaxed);
    }

    /// Completes when the connection's allowance for its phase runs out;
    /// never while a request is being answered.
    pub async fn expired(&self, header_timeout: Duration, idle_timeout: Duration) -> Expiry {
        let mut phases = self.phase.subscribe();
        loop {
            let phase = *phases.borrow_and_update();
            let deadline = match phase {
                Phase::Opened(since) => Some((since + header_timeout, Expiry::Silent)),
                Phase::Head(since) => Some((since + header_timeout, Expiry::SlowHead)),
                Phase::Idle(since) => Some((since + idle_timeout, Expiry::Idle)),
                Phase::Answering => None,
            };
            let changed = match deadline {
                None => phases.changed().await,
                Some((at, expiry)) => tokio::select! {
                    () = tokio::time::sleep_until(at) => {
                        // A change that came with the deadline wins.
                        if phases.has_changed().unwrap_or(false) {
                            continue;
                        }
                        return expiry;
                    }
                    changed = phases.changed() => changed,
                },
            };
            if changed.is_err() {
                // The sender lives in `self`: it cannot be gone while
                // borrowed. Nothing more can happen, so nothing expires.
                return std::future::pending().await;
            }
        }
    }
}

/// A connection's stream, telling its clock when the client sends.
pub struct Watched<I> {
    inner: I,
    clock: Arc<ConnectionClock>,
}

impl<I> Watched<I> {
    pub fn new(inner: I, clock: Arc<ConnectionClock>) -> Self {
        Self { inner, clock }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.bytes_read();
        }
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Marks the connection idle again when dropped: with the answer's body,
/// once hyper has written all of it (or given up on it).
struct AnswerInHand(Arc<ConnectionClock>);

impl Drop for AnswerInHand {
    fn drop(&mut self) {
        self.0.answered();
    }
}

/// A connection's service, telling its clock when a request is handled and
/// when its answer is done, and adding `connection: close` to answers once
/// the connection is to close.
pub struct Clocked<S> {
    inner: S,
    clock: Arc<ConnectionClock>,
}

impl<S> Clocked<S> {
    pub fn new(inner: S, clock: Arc<ConnectionClock>) -> Self {
        Self { inner, clock }
    }
}

type Answer<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

impl<S> hyper::service::Service<Request<Incoming>> for Clocked<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Answer<S::Error>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.clock.answering();
        let in_hand = AnswerInHand(Arc::clone(&self.clock));
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            if in_hand.0.close_after_answer.load(Ordering::Relaxed) {
                response
                    .headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    // Held by the body, so dropped with it.
                    let _ = &in_hand;
                    frame
                }))
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADERS: Duration = Duration::from_secs(10);
    const IDLE: Duration = Duration::from_secs(120);

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_expires_after_the_header_allowance() {
        let clock = ConnectionClock::new();
        let started = Instant::now();
        assert_eq!(clock.expired(HEADERS, IDLE).await, Expiry::Silent);
        assert_eq!(started.elapsed(), HEADERS);
    }

    #[tokio::test(start_paused = true)]
    async fn headers_are_timed_from_their_first_byte_and_idle_from_the_answer() {
        let clock = ConnectionClock::new();
        tokio::time::sleep(Duration::from_secs(4)).await;
        clock.bytes_read();
        let head_started = Instant::now();
        assert_eq!(clock.expired(HEADERS, IDLE).await, Expiry::SlowHead);
        assert_eq!(head_started.elapsed(), HEADERS);

        clock.answering();
        clock.answered();
        let idle_since = Instant::now();
        assert_eq!(clock.expired(HEADERS, IDLE).await, Expiry::Idle);
        assert_eq!(idle_since.elapsed(), IDLE, "idle, not the header allowance");
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_expires_while_an_answer_is_in_hand() {
        let clock = ConnectionClock::new();
        clock.bytes_read();
        clock.answering();
        let waited = tokio::time::timeout(IDLE * 10, clock.expired(HEADERS, IDLE)).await;
        assert!(waited.is_err(), "expired while answering: {waited:?}");
        // Bytes of a pipelined request while answering start nothing.
        clock.bytes_read();
        assert_eq!(*clock.phase.borrow(), Phase::Answering);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_before_the_deadline_moves_it() {
        let clock = Arc::new(ConnectionClock {
            phase: watch::Sender::new(Phase::Idle(Instant::now())),
            close_after_answer: AtomicBool::new(false),
        });
        let waiting = tokio::spawn({
            let clock = Arc::clone(&clock);
            async move { (clock.expired(HEADERS, IDLE).await, Instant::now()) }
        });
        tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
        clock.bytes_read();
        let head_started = Instant::now();
        let (expiry, at) = waiting.await.expect("task");
        assert_eq!(expiry, Expiry::SlowHead);
        assert_eq!(at - head_started, HEADERS);
    }
}
