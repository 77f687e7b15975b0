//! The gRPC services kubelet calls: plugin registration (who the driver
//! is and where its DRA service listens) and the DRA service itself.

use crate::api::dra_v1 as dra;
use crate::api::registration;
use crate::authority::AuthorityFix;
use crate::checkpoint::PreparedClaim;
use crate::driver::Driver;
use crate::slice::DRIVER_NAME;
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use vgpu_cluster::file_error::{io_error, FileError};
use vgpu_cluster::report::with_causes;

/// The registration `type` of a DRA driver.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA service version the driver serves, as kubelet names it.
pub const DRA_SERVICE: &str = "v1.DRAPlugin";
/// The driver's registration socket, in kubelet's plugin registry.
pub const REGISTRATION_SOCKET: &str = "vgpu.io-reg.sock";
/// The DRA service's socket, in the driver's own directory.
pub const DRA_SOCKET: &str = "dra.sock";

#[derive(Debug, Error)]
pub enum ServiceError {
    #[error(transparent)]
    Io(#[from] FileError),
    #[error("gpu-health: start thread")]
    HealthThread(#[source] std::io::Error),
    #[error("serving gRPC")]
    Serve(#[from] tonic::transport::Error),
}

/// A claim kubelet named that could not be read.
#[derive(Debug, Error)]
#[error("reading ResourceClaim {namespace}/{name}")]
pub struct ClaimReadError {
    pub namespace: String,
    pub name: String,
    #[source]
    pub source: kube::Error,
}

/// Where claims are read from (the API server; a table in tests).
#[tonic::async_trait]
pub trait Claims: Send + Sync + 'static {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ClaimReadError>;
}

#[tonic::async_trait]
impl Claims for kube::Client {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ClaimReadError> {
        kube::Api::<ResourceClaim>::namespaced(self.clone(), namespace)
            .get(name)
            .await
            .map_err(|source| ClaimReadError {
                namespace: namespace.to_string(),
                name: name.to_string(),
                source,
            })
    }
}

fn response(prepared: &PreparedClaim) -> dra::NodePrepareResourceResponse {
    dra::NodePrepareResourceResponse {
        devices: prepared
            .devices
            .iter()
            .map(|device| dra::Device {
                request_names: device.requests.clone(),
                pool_name: device.pool.clone(),
                device_name: device.device.clone(),
                cdi_device_ids: device.cdi_device_ids.clone(),
                share_id: device.share_id.clone(),
            })
            .collect(),
        error: String::new(),
    }
}

/// `DRAPlugin` v1.
pub struct DraService {
    driver: Arc<Driver>,
    claims: Arc<dyn Claims>,
    /// Counts the claims prepared ([`crate::publish::PREPARED_ANNOTATION`]).
    prepared: watch::Sender<u64>,
}

impl DraService {
    pub fn new(driver: Arc<Driver>, claims: Arc<dyn Claims>, prepared: watch::Sender<u64>) -> Self {
        Self {
            driver,
            claims,
            prepared,
        }
    }

    async fn prepare_one(&self, claim: &dra::Claim) -> dra::NodePrepareResourceResponse {
        let failed = |error: String| {
            tracing::warn!(
                "cannot prepare claim {}/{} ({}): {error}",
                claim.namespace,
                claim.name,
                claim.uid
            );
            dra::NodePrepareResourceResponse {
                devices: Vec::new(),
                error,
            }
        };
        if let Some(prepared) = self.driver.prepared(&claim.uid) {
            return response(&prepared);
        }
        let object = match self.claims.get(&claim.namespace, &claim.name).await {
            Ok(object) => object,
            Err(error) => return failed(with_causes(&error)),
        };
        let driver = Arc::clone(&self.driver);
        let uid = claim.uid.clone();
        // Files and a region: off the async workers.
        match tokio::task::spawn_blocking(move || driver.prepare(&uid, &object)).await {
            Ok(Ok(prepared)) => {
                self.prepared.send_modify(|count| *count += 1);
                response(&prepared)
            }
            Ok(Err(error)) => failed(with_causes(&error)),
            Err(error) => failed(format!("preparing stopped: {error}")),
        }
    }
}

#[tonic::async_trait]
impl dra::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<dra::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra::NodePrepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for claim in &request.get_ref().claims {
            claims.insert(claim.uid.clone(), self.prepare_one(claim).await);
        }
        Ok(Response::new(dra::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<dra::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra::NodeUnprepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for claim in request.into_inner().claims {
            let driver = Arc::clone(&self.driver);
            let uid = claim.uid.clone();
            let error = match tokio::task::spawn_blocking(move || driver.unprepare(&uid)).await {
                Ok(Ok(())) => String::new(),
                Ok(Err(error)) => with_causes(&error),
                Err(error) => format!("releasing stopped: {error}"),
            };
            if !error.is_empty() {
                tracing::warn!(
                    "cannot release claim {}/{} ({}): {error}",
                    claim.namespace,
                    claim.name,
                    claim.uid
                );
            }
            claims.insert(claim.uid, dra::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(dra::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// `pluginregistration` v1.
pub struct RegistrationService {
    /// The DRA socket as kubelet reaches it.
    endpoint: String,
}

#[tonic::async_trait]
impl registration::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<registration::InfoRequest>,
    ) -> Result<Response<registration::PluginInfo>, Status> {
        Ok(Response::new(registration::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: DRIVER_NAME.into(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![DRA_SERVICE.into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("kubelet registered the driver");
        } else {
            tracing::error!("kubelet refused the driver: {}", status.error);
        }
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

fn listen(path: &Path) -> Result<UnixListenerStream, ServiceError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_error(path, "create directory"))?;
    }
    // A socket left by an earlier run of the driver.
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            return Err(io_error(path, "remove stale socket")(error).into())
        }
        _ => {}
    }
    Ok(UnixListenerStream::new(
        UnixListener::bind(path).map_err(io_error(path, "listen"))?,
    ))
}

/// Where the driver listens.
#[derive(Clone, Debug)]
pub struct Sockets {
    /// The DRA service's socket.
    pub dra: PathBuf,
    /// The same socket as kubelet reaches it (what registration answers).
    pub dra_endpoint: String,
    /// The registration socket, in kubelet's plugin registry.
    pub registration: PathBuf,
}

/// Serves both services until `shutdown` turns true; `prepared` counts the
/// claims prepared. The DRA service
/// listens before the registration socket appears, so kubelet never finds
/// a driver it cannot call.
pub async fn serve(
    driver: Arc<Driver>,
    claims: Arc<dyn Claims>,
    prepared: watch::Sender<u64>,
    sockets: &Sockets,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ServiceError> {
    let dra_incoming = listen(&sockets.dra)?;
    let stopped = |mut shutdown: watch::Receiver<bool>| async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    let dra_server = Server::builder()
        .add_service(dra::dra_plugin_server::DraPluginServer::new(
            DraService::new(driver, claims, prepared),
        ))
        .serve_with_incoming_shutdown(dra_incoming, stopped(shutdown.clone()));
    // Kubelet's registration client sends the socket's path as the HTTP/2
    // authority; see `authority`.
    let registration_incoming =
        listen(&sockets.registration)?.map(|connection| connection.map(AuthorityFix::new));
    let registration_server = Server::builder()
        .add_service(registration::registration_server::RegistrationServer::new(
            RegistrationService {
                endpoint: sockets.dra_endpoint.clone(),
            },
        ))
        .serve_with_incoming_shutdown(registration_incoming, stopped(shutdown));
    tracing::info!(
        "serving DRA on {} and registration on {}",
        sockets.dra.display(),
        sockets.registration.display()
    );
    let (dra, registration) = tokio::join!(dra_server, registration_server);
    // Gone: kubelet deregisters the driver when its socket disappears.
    let _ = std::fs::remove_file(&sockets.registration);
    dra?;
    registration?;
    Ok(())
}
