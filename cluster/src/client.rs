//! How the vgpu daemons (device plugin, node monitor, scheduler extender)
//! reach the Kubernetes API server: one place that turns a command-line
//! choice into a `kube::Client`, with errors that say which input was wrong
//! and keep the underlying cause.

use kube::config::{
    InClusterError, InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError,
};
use kube::{Client, Config};
use std::path::PathBuf;
use thiserror::Error;

/// How the API server is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiSource {
    /// A URL, without authentication (`kubectl proxy`, tests).
    Url(String),
    /// A kubeconfig file.
    Kubeconfig(PathBuf),
    /// The pod's service account (`KUBERNETES_SERVICE_HOST` and the token
    /// and CA files under `/var/run/secrets/kubernetes.io/serviceaccount`).
    InCluster,
    /// The pod's service account, else `$KUBECONFIG` / `~/.kube/config`.
    Infer,
}

/// Why no client could be made.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("API server URL {url:?}")]
    Url {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("kubeconfig {path}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error("in-cluster configuration")]
    InCluster(#[source] InClusterError),
    #[error("Kubernetes client configuration (service account, $KUBECONFIG or ~/.kube/config)")]
    Infer(#[source] InferConfigError),
    #[error("Kubernetes client")]
    Client(#[source] kube::Error),
}

/// Builds a client for `source`. Nothing is sent to the server yet.
pub async fn make_client(source: &ApiSource) -> Result<Client, ClientError> {
    let config = match source {
        ApiSource::Url(url) => {
            let uri = url.parse().map_err(|source| ClientError::Url {
                url: url.clone(),
                source,
            })?;
            Config::new(uri)
        }
        ApiSource::Kubeconfig(path) => {
            let kubeconfig_error = |source| ClientError::Kubeconfig {
                path: path.clone(),
                source,
            };
            let kubeconfig = Kubeconfig::read_from(path).map_err(kubeconfig_error)?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(kubeconfig_error)?
        }
        ApiSource::InCluster => Config::incluster().map_err(ClientError::InCluster)?,
        ApiSource::Infer => Config::infer().await.map_err(ClientError::Infer)?,
    };
    Client::try_from(config).map_err(ClientError::Client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[tokio::test]
    async fn bad_inputs_are_named_in_the_error_with_their_cause() {
        let Err(error) = make_client(&ApiSource::Url("http://bad host:1".into())).await else {
            panic!("a URL with a space was accepted");
        };
        assert!(matches!(error, ClientError::Url { .. }), "{error}");
        assert!(error.to_string().contains("bad host"), "{error}");
        assert!(error.source().is_some(), "the parse error is kept");

        let missing = PathBuf::from("/nonexistent/vgpu/kubeconfig");
        let Err(error) = make_client(&ApiSource::Kubeconfig(missing)).await else {
            panic!("a missing kubeconfig was accepted");
        };
        assert!(
            error.to_string().contains("/nonexistent/vgpu/kubeconfig"),
            "{error}"
        );
        assert!(error.source().is_some(), "the read error is kept");

        assert!(make_client(&ApiSource::Url("http://127.0.0.1:1".into()))
            .await
            .is_ok());
    }
}
