//! A gRPC channel to one of kubelet's unix sockets (its registration
//! service, its PodResources API).

use hyper_util::rt::TokioIo;
use std::path::Path;
use std::time::Duration;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Error, Uri};

/// How long connecting to a kubelet socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A gRPC channel over the unix socket at `path`.
pub async fn connect_unix(path: &Path) -> Result<Channel, Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}
