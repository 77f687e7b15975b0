//! The `DevicePlugin` gRPC service kubelet calls.

use crate::allocate;
use crate::api::v1beta1 as api;
use crate::api::v1beta1::device_plugin_server::DevicePlugin;
use crate::cluster::{Cluster, ClusterError};
use crate::devices;
use crate::pod_cache::{NotShown, PodCache};
use crate::pod_resources::KubeletPodsClient;
use crate::protocol::{self, PendingPod, ProtocolError, Reading};
use crate::records::{PodName, Records};
use futures_util::Stream;
use k8s_openapi::api::core::v1::Pod;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Mutex};
use tonic::{Request, Response, Status};
use vgpu_cluster::decision::InventoryGpu;
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::RequestRules;
use vgpu_node_agent::allocation::{self, RegionPlan, Settings, ENV_VISIBLE_DEVICES};

/// How long `Allocate` waits out an API server outage (a restart of the
/// server or of etcd) before failing: kubelet fails the pod for good when
/// `Allocate` fails, so riding out a restart is worth the wait.
const API_OUTAGE_PATIENCE: Duration = Duration::from_secs(25);

/// How long `Allocate` waits for the watch of the node's pods to show a
/// pod kubelet lists before it reads the pods afresh.
const WATCH_CATCH_UP: Duration = Duration::from_millis(250);

/// Calls `call` again while the API server cannot answer, for up to
/// [`API_OUTAGE_PATIENCE`] from `since`.
async fn through_outage<T, F, Fut>(
    since: Instant,
    what: &str,
    mut call: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClusterError>>,
{
    let mut delay = Duration::from_millis(100);
    loop {
        match call().await {
            Err(error) if error.is_outage() && since.elapsed() + delay < API_OUTAGE_PATIENCE => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "{what}: the API server did not answer; asking again"
                );
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            result => return result,
        }
    }
}

/// What the service works with; shared by every server generation.
pub struct PluginState {
    pub cluster: Cluster,
    pub settings: Settings,
    /// How pods' requests are read, to check their decisions against.
    pub requests: RequestRules,
    /// The node's GPUs with their current health.
    pub gpus: watch::Sender<Vec<InventoryGpu>>,
    /// One `Allocate` at a time (kubelet admits one pod at a time anyway).
    allocate_lock: Mutex<()>,
    /// Kubelet's PodResources API, which tells several pending pods apart
    /// ([`protocol::pending_pod`]); `None`: not asked.
    pod_resources: Option<KubeletPodsClient>,
    /// The node's pods as watched, and as this plugin wrote them.
    pub pods: PodCache,
    /// The containers served whose record is not published yet.
    pub records: Arc<Records>,
}

impl PluginState {
    pub fn new(
        cluster: Cluster,
        settings: Settings,
        requests: RequestRules,
        gpus: Vec<InventoryGpu>,
        pod_resources_socket: Option<PathBuf>,
        records: Arc<Records>,
    ) -> Arc<Self> {
        Arc::new(Self {
            cluster,
            settings,
            requests,
            gpus: watch::Sender::new(gpus),
            allocate_lock: Mutex::new(()),
            pod_resources: pod_resources_socket.map(KubeletPodsClient::new),
            pods: PodCache::default(),
            records,
        })
    }

    /// How pods' requests are read on this node with `gpus`.
    fn reading<'a>(&'a self, gpus: &'a [InventoryGpu]) -> Reading<'a> {
        Reading {
            rules: &self.requests,
            gpus,
        }
    }

    /// The pod kubelet is admitting: among the watched pods where kubelet
    /// confirms it, else among the pods read afresh.
    async fn pending_pod(
        &self,
        since: Instant,
        gpus: &[InventoryGpu],
    ) -> Result<PendingPod, Status> {
        match self.pending_among_watched(gpus).await {
            Ok(pod) => return Ok(pod),
            Err(why) => tracing::debug!("reading the node's pods afresh: {why}"),
        }
        // Taken before the pods are read: a record published meanwhile is
        // in one or the other.
        let unpublished = self.records.unpublished();
        let pods = unpublished.merge(self.pods_on_node(since).await?);
        self.pending_among(&pods, gpus).await
    }

    /// The pod kubelet is admitting among the pods as watched, where
    /// kubelet's list confirms it. A pod kubelet lists that the watch has
    /// not shown yet is waited for, up to [`WATCH_CATCH_UP`]: kubelet's own
    /// watch of the same API server showed it a moment earlier, and reading
    /// the node's pods afresh is one more request to an API server that is
    /// busiest during a burst of admissions. `Err`: why the pods are to be
    /// read afresh.
    async fn pending_among_watched(&self, gpus: &[InventoryGpu]) -> Result<PendingPod, String> {
        let listed =
            match &self.pod_resources {
                Some(client) => Some(client.kubelet_pods().await.map_err(|e| {
                    format!("asking kubelet which pod it admits: {}", with_causes(&e))
                })?),
                None => None,
            };
        // Taken before the pods are read: a record published meanwhile is
        // in one or the other (and none is served meanwhile: `Allocate`
        // holds its lock).
        let unpublished = self.records.unpublished();
        let pods = match &listed {
            Some(listed) => self
                .pods
                .showing(listed, WATCH_CATCH_UP)
                .await
                .map_err(|e| format!("{e} (waited up to {} ms)", WATCH_CATCH_UP.as_millis()))?,
            None => self.pods.pods().ok_or(NotShown::NotListedYet.to_string())?,
        };
        let pods = unpublished.merge(pods);
        self.confirmed_among(&pods, gpus, listed.as_ref())
    }

    /// The pod kubelet is admitting among `pods` as watched (which show
    /// every pod kubelet lists): the pending one kubelet lists (`listed`).
    /// Without kubelet's PodResources API, the one pending pod (the
    /// extender then binds no other to the node before its allocation is
    /// recorded).
    fn confirmed_among(
        &self,
        pods: &[Arc<Pod>],
        gpus: &[InventoryGpu],
        listed: Option<&protocol::KubeletPods>,
    ) -> Result<PendingPod, String> {
        let node = self.cluster.node();
        let found = protocol::pending_pod(node, pods, self.reading(gpus), listed)
            .map_err(|e| with_causes(&e))?;
        if listed.is_some() {
            if let Err(ProtocolError::SeveralPendingPods { count, .. }) =
                protocol::pending_pod(node, pods, self.reading(gpus), None)
            {
                tracing::info!(
                    pod = %found.display(),
                    "{count} pods pending on this node; kubelet is admitting this one"
                );
            }
        }
        Ok(found)
    }

    /// The pod kubelet is admitting among `pods`: the one pending pod, or
    /// of several, the one kubelet's PodResources API lists.
    async fn pending_among(
        &self,
        pods: &[Arc<Pod>],
        gpus: &[InventoryGpu],
    ) -> Result<PendingPod, Status> {
        let node = self.cluster.node();
        let (several, count) = match protocol::pending_pod(node, pods, self.reading(gpus), None) {
            Err(several @ ProtocolError::SeveralPendingPods { count, .. }) => (several, count),
            found => return found.map_err(|e| Status::failed_precondition(with_causes(&e))),
        };
        let Some(client) = &self.pod_resources else {
            return Err(Status::failed_precondition(with_causes(&several)));
        };
        let listed = match client.kubelet_pods().await {
            Ok(listed) => listed,
            Err(error) => {
                return Err(Status::failed_precondition(format!(
                    "{}; asking kubelet which one it admits failed: {}",
                    with_causes(&several),
                    with_causes(&error)
                )))
            }
        };
        match protocol::pending_pod(node, pods, self.reading(gpus), Some(&listed)) {
            Ok(found) => {
                tracing::info!(
                    pod = %found.display(),
                    "{count} pods pending on this node; kubelet is admitting this one"
                );
                Ok(found)
            }
            // Kubelet lists none of them: a kubelet that does not list the
            // pod it admits; say what was pending.
            Err(ProtocolError::NoPendingPod { .. }) => Err(Status::failed_precondition(format!(
                "{}; kubelet's PodResources API lists none of them",
                with_causes(&several)
            ))),
            Err(error) => Err(Status::failed_precondition(with_causes(&error))),
        }
    }

    async fn pods_on_node(&self, since: Instant) -> Result<Vec<Arc<Pod>>, Status> {
        through_outage(since, "listing the node's pods", || {
            self.cluster.pods_on_node()
        })
        .await
        .map(|pods| pods.into_iter().map(Arc::new).collect())
        .map_err(|e| Status::unavailable(with_causes(&e)))
    }

    /// Serves one `Allocate` call (see [`vgpu_cluster::decision`], step 4):
    /// the pending pod's next containers get their regions on the host,
    /// which are their records ([`crate::records`]); the pod's annotation
    /// is published after the answer.
    pub async fn allocate(
        &self,
        request: &api::AllocateRequest,
    ) -> Result<api::AllocateResponse, Status> {
        let called = Instant::now();
        let _one_at_a_time = self.allocate_lock.lock().await;
        let sizes: Vec<usize> = request
            .container_requests
            .iter()
            .map(|c| c.devices_ids.len())
            .collect();
        let gpus = self.gpus.borrow().clone();
        let pod = self.pending_pod(Instant::now(), &gpus).await?;
        let containers = protocol::match_requests(&pod, &sizes)
            .map_err(|e| Status::failed_precondition(with_causes(&e)))?;
        let mut plans = Vec::with_capacity(containers.len());
        for container in &containers {
            let plan = allocate::plan(&self.settings, &pod.uid, container, &gpus).map_err(|e| {
                Status::failed_precondition(format!("pod {}: {}", pod.display(), with_causes(&e)))
            })?;
            plans.push(plan);
        }
        for (plan, request) in plans.iter().zip(&request.container_requests) {
            note_kubelet_choice(&pod, plan, &request.devices_ids);
        }
        let prepared = plans.clone();
        tokio::task::spawn_blocking(move || prepared.iter().try_for_each(allocation::prepare))
            .await
            .map_err(|e| Status::internal(format!("preparing the container directory: {e}")))?
            .map_err(|e| Status::internal(format!("pod {}: {}", pod.display(), with_causes(&e))))?;
        let served: Vec<String> = plans.iter().map(|p| p.holder.name().to_string()).collect();
        self.records.served(
            &pod.uid,
            PodName {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
            },
            &served,
        );
        Ok(self.allocated(&pod.display(), &plans, called))
    }

    /// The answer for containers served; logs them, with the time kubelet
    /// waited for it (kubelet admits a node's pods one at a time, so this
    /// bounds how fast a node starts vGPU pods).
    fn allocated(&self, pod: &str, plans: &[RegionPlan], called: Instant) -> api::AllocateResponse {
        let took_ms = called.elapsed().as_secs_f64() * 1e3;
        for plan in plans {
            tracing::info!(
                pod = %pod,
                took_ms = format_args!("{took_ms:.1}"),
                container = %plan.holder.name(),
                gpus = %plan.envs.get(ENV_VISIBLE_DEVICES).map(String::as_str).unwrap_or_default(),
                dir = %plan.host_dir.display(),
                "allocated"
            );
        }
        api::AllocateResponse {
            container_responses: plans.iter().map(allocate::response).collect(),
        }
    }

    /// Answers `GetPreferredAllocation`: replicas of the GPUs the pending
    /// pod's next containers were given. Never fails: without a decision
    /// the answer just spreads over GPUs.
    pub async fn preferred(
        &self,
        request: &api::PreferredAllocationRequest,
    ) -> api::PreferredAllocationResponse {
        let gpus = self.gpus.borrow().clone();
        let pod = match self.pending_pod(Instant::now(), &gpus).await {
            Ok(pod) => Some(pod),
            Err(status) => {
                tracing::debug!(
                    "preferred allocation without a decision: {}",
                    status.message()
                );
                None
            }
        };
        let next: Vec<Vec<String>> = pod
            .as_ref()
            .map(|pod| {
                pod.decision
                    .containers
                    .iter()
                    .filter(|c| !pod.allocated.contains(&c.name))
                    .map(|c| c.devices.iter().map(|d| d.uuid.clone()).collect())
                    .collect()
            })
            .unwrap_or_default();
        let container_responses = request
            .container_requests
            .iter()
            .enumerate()
            .map(|(i, c)| api::ContainerPreferredAllocationResponse {
                device_i_ds: devices::preferred(
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    usize::try_from(c.allocation_size).unwrap_or(0),
                    next.get(i).map(Vec::as_slice).unwrap_or_default(),
                    &gpus,
                ),
            })
            .collect();
        api::PreferredAllocationResponse {
            container_responses,
        }
    }
}

/// Kubelet counts replicas; the GPUs come from the decision. Say so when
/// kubelet picked replicas of other GPUs (its accounting of replicas is
/// then off from the real use, which only the scheduler tracks).
fn note_kubelet_choice(pod: &PendingPod, plan: &RegionPlan, ids: &[String]) {
    let decided = plan
        .envs
        .get(ENV_VISIBLE_DEVICES)
        .map(String::as_str)
        .unwrap_or_default();
    let elsewhere: Vec<&str> = ids
        .iter()
        .filter(|id| {
            devices::parse_device_id(id)
                .is_none_or(|(uuid, _)| !decided.split(',').any(|d| d == uuid))
        })
        .map(String::as_str)
        .collect();
    if !elsewhere.is_empty() {
        tracing::info!(
            pod = %pod.display(),
            container = %plan.holder.name(),
            "kubelet picked replicas {elsewhere:?} outside the decided GPUs {decided}; the decision applies"
        );
    }
}

/// One server generation's view of the plugin state. When the generation
/// stops (kubelet restarted), its `ListAndWatch` streams end so the server
/// can shut down.
pub struct DevicePluginService {
    state: Arc<PluginState>,
    stopping: watch::Receiver<bool>,
}

impl DevicePluginService {
    pub fn new(state: Arc<PluginState>, stopping: watch::Receiver<bool>) -> Self {
        Self { state, stopping }
    }
}

/// Resolves once `flag` is true (or its sender is gone).
pub async fn stopped(flag: &mut watch::Receiver<bool>) {
    loop {
        if *flag.borrow_and_update() {
            return;
        }
        if flag.changed().await.is_err() {
            return;
        }
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let gpus = self.state.gpus.subscribe();
        let stopping = self.stopping.clone();
        let stream = futures_util::stream::unfold(
            (gpus, stopping, true),
            |(mut gpus, mut stopping, first)| async move {
                if !first {
                    tokio::select! {
                        changed = gpus.changed() => changed.ok()?,
                        () = stopped(&mut stopping) => return None,
                    }
                }
                let devices = devices::kubelet_devices(&gpus.borrow_and_update());
                Some((
                    Ok(api::ListAndWatchResponse { devices }),
                    (gpus, stopping, false),
                ))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        Ok(Response::new(self.state.preferred(request.get_ref()).await))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        match self.state.allocate(request.get_ref()).await {
            Ok(response) => Ok(Response::new(response)),
            Err(status) => {
                tracing::warn!("Allocate refused: {}", status.message());
                Err(status)
            }
        }
    }

    async fn pre_start_container(
        &self,
        _request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// The options the plugin registers with.
pub fn options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}
