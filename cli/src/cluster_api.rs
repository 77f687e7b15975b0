//! How `vgpu`'s Kubernetes verbs (`cordon`, `uncordon`, `resize`) reach the
//! API server: a client from `--kubeconfig` (else `$KUBECONFIG` or
//! `~/.kube/config`, else the pod's service account), on a runtime of
//! their own.

use std::future::Future;
use std::path::Path;
use thiserror::Error;
use vgpu_cluster::client::{make_client, ApiSource, ClientError};

#[derive(Debug, Error)]
pub enum ConnectError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
}

/// Runs `work` with a client for `kubeconfig`, to its end.
pub fn with_client<T, E, F>(
    kubeconfig: Option<&Path>,
    work: impl FnOnce(kube::Client) -> F,
) -> Result<T, E>
where
    F: Future<Output = Result<T, E>>,
    E: From<ConnectError>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| E::from(ConnectError::Runtime(error)))?;
    runtime.block_on(async {
        let source = kubeconfig.map_or(ApiSource::Infer, |path| {
            ApiSource::Kubeconfig(path.to_path_buf())
        });
        let client = make_client(&source)
            .await
            .map_err(|error| E::from(ConnectError::Client(error)))?;
        work(client).await
    })
}
