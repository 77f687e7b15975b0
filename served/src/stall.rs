//! Connections whose clients must keep reading.
//!
//! An answer goes out as fast as its client reads it. A client that asks
//! and then reads nothing (a large answer, or a watch of the views whose
//! events pile up) would otherwise keep its connection, its place under
//! the connection limits and the task writing to it for as long as it
//! likes: the read timeouts never apply, since nothing more is read. Here
//! a write (or flush) that cannot go on for the write timeout fails with
//! `TimedOut`, and hyper then closes the connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `inner`, whose writes may wait for its reader at most `limit` at a time.
pub struct StallLimited<I> {
    inner: I,
    limit: Duration,
    /// Armed while a write, flush or shutdown waits for the client; cleared
    /// as soon as one goes on.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<I> StallLimited<I> {
    pub fn new(inner: I, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `progress` as it came, with the stall timer cleared when it came
    /// and armed (or the connection failed, once the timer has run out)
    /// when it must wait.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        progress: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if progress.is_ready() {
            self.stalled = None;
            return progress;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.stalled = None;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing of its answer for {limit:?}"),
                )))
            }
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for StallLimited<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for StallLimited<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let progress = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch(cx, progress)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let progress = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch(cx, progress)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let progress = Pin::new(&mut this.inner).poll_flush(cx);
        this.watch(cx, progress)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let progress = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.watch(cx, progress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_write_the_reader_never_takes_fails_after_the_limit() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut limited = StallLimited::new(near, Duration::from_secs(5));
        let started = tokio::time::Instant::now();
        let error = limited
            .write_all(&[7; 1024])
            .await
            .expect_err("64 bytes fit, the rest waits for a reader that never comes");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        let mut taken = vec![0; 64];
        far.read_exact(&mut taken).await.expect("what fitted");
        assert_eq!(taken, vec![7; 64]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_keeps_reading_however_slowly_is_served_in_full() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut limited = StallLimited::new(near, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut piece = [0; 64];
            // 64 bytes every 4 s: each wait is shorter than the limit,
            // their sum (64 s) far longer.
            while got.len() < 1024 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                let n = far.read(&mut piece).await.expect("read");
                got.extend_from_slice(&piece[..n]);
            }
            got
        });
        limited.write_all(&[9; 1024]).await.expect("served");
        limited.flush().await.expect("flushed");
        assert_eq!(reader.await.expect("reader"), vec![9; 1024]);
    }
}
