//! Serving kubelet: the plugin's unix socket in the device plugin
//! directory, registration with kubelet's `Registration` service, and
//! registering again whenever kubelet restarts.
//!
//! Kubelet announces a restart by recreating `kubelet.sock` (and removing
//! every other socket in the directory). The plugin polls both sockets'
//! identities (device, inode, change time): when its own socket is gone or
//! replaced,
//! it starts a new server generation on a fresh socket; when kubelet's
//! socket is new, it registers (again). Polling needs no inotify support
//! from the host path's file system and costs two `stat` calls a period.

use crate::api::v1beta1 as api;
use crate::api::v1beta1::device_plugin_server::DevicePluginServer;
use crate::api::v1beta1::registration_client::RegistrationClient;
use crate::service::{self, DevicePluginService, PluginState};
use crate::unix_channel::connect_unix;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

/// The device plugin API version this plugin speaks.
pub const API_VERSION: &str = "v1beta1";
/// Kubelet's registration socket, in the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// How long a registration may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping server generation may take to finish its calls.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and as what the plugin registers.
#[derive(Clone, Debug)]
pub struct KubeletSettings {
    /// Kubelet's device plugin directory.
    pub dir: PathBuf,
    /// The plugin's socket name in `dir`.
    pub endpoint: String,
    pub resource_name: String,
    /// How often the sockets are checked.
    pub poll: Duration,
}

#[derive(Debug, Error)]
pub enum KubeletError {
    #[error("{path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach kubelet at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("kubelet at {path} refused the registration: {status}")]
    Refused {
        path: PathBuf,
        status: tonic::Status,
    },
}

/// Which file a path names: device, inode and change time. The time tells
/// a socket recreated between two polls from the old one even when the
/// file system hands out the same inode number again.
type Identity = (u64, u64, i64, i64);

/// The identity of the file at `path`, if it exists.
fn identity(path: &Path) -> Option<Identity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Registers with the kubelet listening at `kubelet_socket`.
pub async fn register(
    kubelet_socket: &Path,
    settings: &KubeletSettings,
) -> Result<(), KubeletError> {
    let channel = connect_unix(kubelet_socket)
        .await
        .map_err(|source| KubeletError::Connect {
            path: kubelet_socket.to_path_buf(),
            source,
        })?;
    let mut client = RegistrationClient::new(channel);
    let mut request = tonic::Request::new(api::RegisterRequest {
        version: API_VERSION.to_string(),
        endpoint: settings.endpoint.clone(),
        resource_name: settings.resource_name.clone(),
        options: Some(service::options()),
    });
    request.set_timeout(REGISTER_TIMEOUT);
    client
        .register(request)
        .await
        .map_err(|status| KubeletError::Refused {
            path: kubelet_socket.to_path_buf(),
            status,
        })?;
    Ok(())
}

/// One server on the plugin socket.
struct Generation {
    socket: PathBuf,
    identity: Option<Identity>,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Generation {
    fn start(state: &Arc<PluginState>, socket: &Path) -> Result<Self, KubeletError> {
        match std::fs::remove_file(socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(KubeletError::Io {
                    path: socket.to_path_buf(),
                    op: "remove stale socket",
                    source,
                })
            }
        }
        let listener = UnixListener::bind(socket).map_err(|source| KubeletError::Io {
            path: socket.to_path_buf(),
            op: "listen",
            source,
        })?;
        let (stop, stopping) = watch::channel(false);
        let service = DevicePluginService::new(Arc::clone(state), stopping.clone());
        let mut shutdown = stopping;
        let server = tokio::spawn(
            Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    service::stopped(&mut shutdown).await;
                }),
        );
        Ok(Self {
            socket: socket.to_path_buf(),
            identity: identity(socket),
            stop,
            server,
        })
    }

    /// Whether the socket this generation listens on is still in place.
    fn socket_intact(&self) -> bool {
        identity(&self.socket).is_some() && identity(&self.socket) == self.identity
    }

    async fn stop(self, remove_socket: bool) {
        let _ = self.stop.send(true);
        let mut server = self.server;
        match tokio::time::timeout(DRAIN_TIMEOUT, &mut server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(
                error = &error as &dyn std::error::Error,
                "device plugin server"
            ),
            Ok(Err(error)) => tracing::warn!(
                error = &error as &dyn std::error::Error,
                "device plugin server task"
            ),
            Err(_) => {
                tracing::warn!(
                    "device plugin server did not drain in {DRAIN_TIMEOUT:?}; closing it"
                );
                server.abort();
            }
        }
        if remove_socket && identity(&self.socket) == self.identity {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// Serves kubelet until `shutdown` becomes true: starts the server,
/// registers, and starts over whenever kubelet restarts.
pub async fn serve(
    state: Arc<PluginState>,
    settings: KubeletSettings,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), KubeletError> {
    let socket = settings.dir.join(&settings.endpoint);
    let kubelet_socket = settings.dir.join(KUBELET_SOCKET);
    loop {
        let generation = Generation::start(&state, &socket)?;
        tracing::info!("serving the device plugin API on {}", socket.display());
        let mut registered_with: Option<Identity> = None;
        let mut failures = 0u32;
        let restart = loop {
            if !generation.socket_intact() {
                tracing::info!(
                    "{} was removed (kubelet restarted?); serving on a new socket",
                    socket.display()
                );
                break true;
            }
            let kubelet = identity(&kubelet_socket);
            if kubelet.is_some() && kubelet != registered_with {
                match register(&kubelet_socket, &settings).await {
                    Ok(()) => {
                        tracing::info!(
                            "registered {} with kubelet ({} devices)",
                            settings.resource_name,
                            state
                                .gpus
                                .borrow()
                                .iter()
                                .map(|g| g.split_count as usize)
                                .sum::<usize>()
                        );
                        registered_with = kubelet;
                        failures = 0;
                    }
                    Err(error) => {
                        failures += 1;
                        if failures == 1 || failures.is_multiple_of(60) {
                            tracing::warn!(
                                error = &error as &dyn std::error::Error,
                                "registering with kubelet (retrying)"
                            );
                        }
                    }
                }
            } else if kubelet.is_none() && registered_with.is_some() {
                tracing::info!("kubelet's socket is gone; waiting for kubelet");
                registered_with = None;
            }
            tokio::select! {
                () = service::stopped(&mut shutdown) => break false,
                () = tokio::time::sleep(settings.poll) => {}
            }
        };
        generation.stop(!restart).await;
        if !restart {
            return Ok(());
        }
    }
}
