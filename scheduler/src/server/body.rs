//! Reading a request's body within a size, a time and a listener's
//! budget of bytes held at once.
//!
//! The size limit alone would let many clients each hold a body just under
//! it, and a client that sends its body slowly hold its connection for
//! ever; so every byte read is first reserved from the listener's budget
//! (released when the request is answered), and the whole body must
//! arrive before a deadline. Bytes are reserved as they arrive, not as the
//! `Content-Length` announces them, so a client that announces much and
//! sends little holds only what it sent.

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use std::sync::Arc;
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// Why a body was not read.
#[derive(Debug, Error)]
pub enum BodyError {
    #[error("request body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("request body did not arrive in time")]
    TooSlow,
    #[error("too many request bodies are being read; retry")]
    Busy,
    #[error("reading the request body failed")]
    Read(#[source] axum::Error),
}

impl BodyError {
    /// The HTTP status to answer.
    pub fn status(&self) -> u16 {
        match self {
            Self::TooLarge { .. } => 413,
            Self::TooSlow => 408,
            Self::Busy => 503,
            Self::Read(_) => 400,
        }
    }
}

/// A listener's budget of body bytes held at once.
#[derive(Clone, Debug)]
pub struct Budget(Arc<Semaphore>);

impl Budget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> Self {
        Self(Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))))
    }

    /// Bytes not held now.
    pub fn available(&self) -> usize {
        self.0.available_permits()
    }
}

/// A body read, holding its bytes of the budget until dropped.
#[derive(Debug)]
pub struct ReadBody {
    pub bytes: Bytes,
    _held: Held,
}

#[derive(Debug)]
struct Held {
    budget: Arc<Semaphore>,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.add_permits(self.bytes);
    }
}

/// Reads `body` (announced as `announced` bytes, when it says) of at most
/// `limit` bytes before `deadline`, holding its bytes of `budget`.
pub async fn read_body(
    body: Body,
    announced: Option<u64>,
    limit: usize,
    deadline: Instant,
    budget: &Budget,
) -> Result<ReadBody, BodyError> {
    if announced.is_some_and(|length| length > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    let mut body = body;
    let mut held = Held {
        budget: budget.0.clone(),
        bytes: 0,
    };
    let mut buffer: Vec<u8> = Vec::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::TooSlow),
            Ok(None) => break,
            Ok(Some(Err(error))) => return Err(BodyError::Read(error)),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            // Trailers: nothing to keep.
            continue;
        };
        if buffer.len() + data.len() > limit {
            return Err(BodyError::TooLarge { limit });
        }
        // A frame is at most the connection's read buffer, far below the
        // budget, so this waits only for other requests to be answered.
        let wanted = u32::try_from(data.len()).map_err(|_| BodyError::TooLarge { limit })?;
        match tokio::time::timeout_at(deadline, budget.0.acquire_many(wanted)).await {
            Ok(Ok(permit)) => {
                permit.forget();
                held.bytes += data.len();
            }
            Ok(Err(_)) | Err(_) => return Err(BodyError::Busy),
        }
        buffer.extend_from_slice(&data);
    }
    Ok(ReadBody {
        bytes: Bytes::from(buffer),
        _held: held,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn bodies_hold_their_bytes_of_the_budget_until_dropped() {
        let budget = Budget::new(100);
        let read = read_body(Body::from(vec![7u8; 60]), Some(60), 80, soon(), &budget)
            .await
            .expect("within limit and budget");
        assert_eq!(read.bytes.len(), 60);
        assert_eq!(budget.available(), 40);
        // A second body of 60 bytes does not fit the budget now.
        let busy = read_body(
            Body::from(vec![7u8; 60]),
            None,
            80,
            Instant::now() + Duration::from_millis(50),
            &budget,
        )
        .await
        .expect_err("over budget");
        assert!(matches!(busy, BodyError::Busy), "{busy:?}");
        assert_eq!(budget.available(), 40, "a refused body holds nothing");
        drop(read);
        assert_eq!(budget.available(), 100);
    }

    #[tokio::test]
    async fn bodies_past_the_limit_are_refused_announced_or_not() {
        let budget = Budget::new(1000);
        let announced = read_body(Body::empty(), Some(81), 80, soon(), &budget)
            .await
            .expect_err("announced too large");
        assert_eq!(announced.status(), 413);
        let sent = read_body(Body::from(vec![0u8; 81]), None, 80, soon(), &budget)
            .await
            .expect_err("sent too large");
        assert_eq!(sent.status(), 413);
        assert_eq!(budget.available(), 1000);
    }

    #[tokio::test]
    async fn a_body_that_does_not_arrive_in_time_is_refused() {
        let budget = Budget::new(1000);
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        let pending = Body::from_stream(stream);
        sender
            .send(Ok(Bytes::from_static(b"{")))
            .await
            .expect("send");
        let slow = read_body(
            pending,
            Some(10),
            80,
            Instant::now() + Duration::from_millis(100),
            &budget,
        )
        .await
        .expect_err("too slow");
        assert_eq!(slow.status(), 408);
        assert_eq!(budget.available(), 1000);
        drop(sender);
    }
}
