//! A minimal HTTP/1.1 client for the extender's endpoints, keeping a few
//! connections alive (used by the tests and the benchmark, and handy for
//! probing a running extender).

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Mutex;
use thiserror::Error;
use tokio::net::TcpStream;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP: {0}")]
    Http(String),
}

/// A client for one extender address.
pub struct ExtenderClient {
    addr: SocketAddr,
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

impl ExtenderClient {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            idle: Mutex::new(Vec::new()),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    async fn connection(&self) -> Result<SendRequest<Full<Bytes>>, ClientError> {
        loop {
            let idle = self
                .idle
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .pop();
            match idle {
                Some(mut sender) => {
                    if sender.ready().await.is_ok() {
                        return Ok(sender);
                    }
                }
                None => break,
            }
        }
        let stream =
            TcpStream::connect(self.addr)
                .await
                .map_err(|source| ClientError::Connect {
                    addr: self.addr,
                    source,
                })?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// Sends one request; returns the status and body.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, Vec<u8>), ClientError> {
        let mut sender = self.connection().await?;
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ClientError::Http(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?
            .to_bytes()
            .to_vec();
        self.idle
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .push(sender);
        Ok((status, body))
    }

    pub async fn post(&self, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), ClientError> {
        self.request("POST", path, body).await
    }

    pub async fn get(&self, path: &str) -> Result<(u16, Vec<u8>), ClientError> {
        self.request("GET", path, Vec::new()).await
    }
}
