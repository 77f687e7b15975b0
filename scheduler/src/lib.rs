//! `vgpu-scheduler`: the kube-scheduler HTTP extender of vgpu.
//!
//! It picks, for every pod that asks for vGPUs, a node and the GPUs on it,
//! writes that choice into the pod (`vgpu.io/decision`) and binds the pod;
//! the device plugin on the node then hands each container exactly those
//! GPUs. The protocol between the two is described in
//! [`vgpu_cluster::decision`].
//!
//! The modules, in layers that import only downwards (a test checks
//! that no two modules import each other, directly or through others):
//!
//! 1. [`vocabulary`]: the annotations and labels read and written, with
//!    pure readers of them (leaf modules). [`bounded`]: reading JSON from
//!    the network within bounds.
//! 2. What a pod asks for is read by [`vgpu_cluster::requests`] (the
//!    device plugin checks decisions against the same reading). [`api`]:
//!    the Kubernetes client,
//!    knowing nothing of the extender's state. [`leader`]: leader
//!    election among replicas.
//! 3. [`cache`]: the cluster as the watches show it, each kind applying
//!    its own events.
//! 4. [`placement`]: pure functions over a snapshot of the cache: where
//!    pods and claims' slices go, and why not elsewhere. [`admission`]:
//!    the webhooks (mutation, claim look-ups, KubeShare labels,
//!    conversion).
//! 5. [`extender`]: kube-scheduler's verbs, with the bind's API writes.
//!    [`claim_controller`]: binds Elastic GPU claims to the ElasticGPUs
//!    it provisions.
//! 6. [`server`]: the HTTP(S) server, metrics and views. [`cli`]: the
//!    flags. This file: starting it all.

pub mod admission;
pub mod api;
pub mod bounded;
pub mod cache;
pub mod claim_controller;
pub mod cli;
pub mod extender;
pub mod leader;
pub mod placement;
pub mod server;
pub mod vocabulary;

use crate::api::{ApiError, ApiSource, KubeApi};
use crate::cache::state::SharedState;
use crate::extender::{Config, Scheduler};
pub use crate::server::routes::Surface;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Why the extender could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("listener address")]
    Listener(#[source] std::io::Error),
    #[error(transparent)]
    Metrics(#[from] server::metrics::MetricsError),
}

/// A running extender: API watches and the server.
pub struct Running {
    pub local_addr: SocketAddr,
    pub scheduler: Arc<Scheduler>,
    server: JoinHandle<()>,
    /// Servers on further listeners ([`Running::serve_also`]).
    more_servers: Vec<JoinHandle<()>>,
    /// What the routers of every listener share.
    shared: server::routes::Shared,
    watches: Vec<JoinHandle<()>>,
    /// Set once: every server stops accepting.
    shutdown: tokio::sync::watch::Sender<bool>,
    /// The election, when this is one of several replicas.
    election: Option<(kube::Client, leader::LeaderConfig)>,
}

/// Starts the extender on `listener` (every route: [`Surface::All`]), with
/// its state fed by the API at `source`. It answers at once; filter and
/// bind refuse until the first complete lists of pods and nodes are in
/// (`GET /readyz`).
pub async fn start(
    config: Config,
    source: &ApiSource,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    election: Option<leader::LeaderConfig>,
) -> Result<Running, StartError> {
    let client = api::make_client(source).await.map_err(StartError::Api)?;
    let state = Arc::new(SharedState::with_unbound_grace(config.unbound_grace));
    let mut watches = cache::watch::watch_cluster(
        &client,
        &state,
        config
            .placement_confinement
            .as_ref()
            .map(|confinement| confinement.skipped_namespaces.as_slice()),
    );
    watches.push(tokio::spawn(cache::expiry::expire_unbound_decisions(
        state.clone(),
    )));
    let mut scheduler = Scheduler::new(config, state, Some(KubeApi::new(client.clone())));
    if let Some(election) = &election {
        let leadership = Arc::new(leader::Leadership::default());
        scheduler = scheduler.with_leadership(leadership.clone());
        watches.push(tokio::spawn(leader::run(
            client.clone(),
            election.clone(),
            leadership,
        )));
    }
    let scheduler = Arc::new(scheduler);
    watches.push(tokio::spawn(claim_controller::run(
        KubeApi::new(client.clone()),
        scheduler.clone(),
    )));
    watches.push(tokio::spawn(extender::resize::answer_resizes(
        scheduler.clone(),
    )));
    let local_addr = listener.local_addr().map_err(StartError::Listener)?;
    let (shutdown, _) = tokio::sync::watch::channel(false);
    let shared = server::routes::Shared::new(
        scheduler.clone(),
        Arc::new(server::metrics::ServerMetrics::new()?),
        shutdown.subscribe(),
    );
    let server = spawn_server(&shared, Surface::All, listener, tls, stopped(&shutdown));
    Ok(Running {
        local_addr,
        scheduler,
        server,
        more_servers: Vec::new(),
        shared,
        watches,
        shutdown,
        election: election.map(|e| (client, e)),
    })
}

/// Serves the routes of `surface` on `listener` within the configured
/// limits until `stop` completes.
fn spawn_server(
    shared: &server::routes::Shared,
    surface: Surface,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    let router = server::routes::routes(surface, shared);
    let limits = shared.limits().clone();
    tokio::spawn(async move {
        server::serve::serve_with(listener, router, tls, &limits, stop).await;
    })
}

/// Completes once `shutdown` is set.
fn stopped(shutdown: &tokio::sync::watch::Sender<bool>) -> impl std::future::Future<Output = ()> {
    let mut receiver = shutdown.subscribe();
    async move {
        let _ = receiver.wait_for(|stop| *stop).await;
    }
}

impl Running {
    /// Serves the routes of `surface` on `listener` too (HTTPS when
    /// `tls` is given), e.g. the webhooks over HTTPS for the API server
    /// beside every route on loopback for kube-scheduler; answers the
    /// address it listens on. Each listener has its own connection limit
    /// and budget of body bytes.
    pub fn serve_also(
        &mut self,
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
        surface: Surface,
    ) -> Result<SocketAddr, StartError> {
        let address = listener.local_addr().map_err(StartError::Listener)?;
        self.more_servers.push(spawn_server(
            &self.shared,
            surface,
            listener,
            tls,
            stopped(&self.shutdown),
        ));
        Ok(address)
    }

    /// Shows on `/metrics` when the certificate in `files` ends.
    pub fn report_certificate(&self, files: Arc<server::CertificateFiles>) {
        self.shared.metrics().report_certificate(files);
    }

    /// Waits until the state is synced, up to `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.scheduler.ready() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Runs until `signal` completes, then stops accepting, gives binds in
    /// flight up to `drain` to finish, and returns.
    pub async fn serve_until(
        mut self,
        signal: impl std::future::Future<Output = ()>,
        drain: Duration,
    ) {
        // A server that ends on its own (it only does by failing) stops the
        // whole extender, so a restart brings every port back, rather than
        // serving on without its webhook port.
        let more = &mut self.more_servers;
        let any_more_ended = async move {
            if more.is_empty() {
                std::future::pending::<()>().await;
            }
            let _ = futures_util::future::select_all(more.iter_mut()).await;
        };
        tokio::select! {
            _ = signal => {}
            _ = &mut self.server => tracing::error!("the server stopped by itself; stopping"),
            _ = any_more_ended => tracing::error!("a second server stopped by itself; stopping"),
        }
        self.shutdown.send_replace(true);
        let deadline = tokio::time::Instant::now() + drain;
        self.scheduler.stop_serving();
        while self.scheduler.binds_in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Binds are done: another replica may take over at once.
        if let Some((client, election)) = self.election.take() {
            leader::release_lease(client, &election).await;
        }
        self.stop();
    }

    /// Stops everything at once, as a crash would: open connections and
    /// binds in flight are dropped wherever they are.
    pub fn stop(self) {
        self.shutdown.send_replace(true);
        self.server.abort();
        for server in &self.more_servers {
            server.abort();
        }
        for watch in &self.watches {
            watch.abort();
        }
    }
}
