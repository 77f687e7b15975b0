//! A fake kubelet speaking the real device plugin API over unix sockets:
//! it serves `Registration` on `kubelet.sock`, connects back to a
//! registered plugin, follows its `ListAndWatch` stream, and admits pods as
//! kubelet's device manager does (per GPU container, init containers first:
//! `GetPreferredAllocation` over the free healthy devices, then `Allocate`).

use k8s_openapi::api::core::v1::{Container, Pod};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use vgpu_device_plugin::api::v1beta1 as api;
use vgpu_device_plugin::api::v1beta1::device_plugin_client::DevicePluginClient;
use vgpu_device_plugin::api::v1beta1::registration_server::{Registration, RegistrationServer};
use vgpu_device_plugin::unix_channel::connect_unix;

struct RegistrationService {
    registrations: mpsc::UnboundedSender<api::RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let request = request.into_inner();
        if request.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported version {}",
                request.version
            )));
        }
        let _ = self.registrations.send(request);
        Ok(Response::new(api::Empty {}))
    }
}

pub struct FakeKubelet {
    pub dir: PathBuf,
    sender: mpsc::UnboundedSender<api::RegisterRequest>,
    registrations: mpsc::UnboundedReceiver<api::RegisterRequest>,
    server: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
}

impl FakeKubelet {
    /// Starts serving `dir/kubelet.sock`.
    pub fn start(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("device plugin dir");
        let (sender, registrations) = mpsc::unbounded_channel();
        let mut kubelet = Self {
            dir: dir.to_path_buf(),
            sender,
            registrations,
            server: None,
        };
        kubelet.serve();
        kubelet
    }

    fn serve(&mut self) {
        let socket = self.dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind kubelet.sock");
        let (stop, mut stopping) = watch::channel(false);
        let service = RegistrationService {
            registrations: self.sender.clone(),
        };
        let task = tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    let _ = stopping.wait_for(|s| *s).await;
                })
                .await;
        });
        self.server = Some((stop, task));
    }

    /// Stops serving and removes `kubelet.sock`.
    pub async fn stop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let _ = std::fs::remove_file(self.dir.join("kubelet.sock"));
    }

    /// Serves `kubelet.sock` again after [`Self::stop`], leaving the other
    /// sockets in place (a kubelet that does not clean the directory).
    pub fn start_again(&mut self) {
        self.serve();
    }

    /// Restarts as kubelet does: everything in the directory is removed
    /// (plugin sockets included) and a new `kubelet.sock` appears.
    pub async fn restart(&mut self) {
        self.stop().await;
        for entry in std::fs::read_dir(&self.dir).expect("read dir").flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        self.serve();
    }

    /// The next registration, within `timeout`.
    pub async fn next_registration(&mut self, timeout: Duration) -> api::RegisterRequest {
        tokio::time::timeout(timeout, self.registrations.recv())
            .await
            .expect("the plugin registers in time")
            .expect("registration channel open")
    }

    /// Whether a registration arrived (without waiting).
    pub fn try_registration(&mut self) -> Option<api::RegisterRequest> {
        self.registrations.try_recv().ok()
    }

    /// Connects to the plugin that registered with `registration`.
    pub async fn connect(&self, registration: &api::RegisterRequest) -> PluginConn {
        let socket = self.dir.join(&registration.endpoint);
        let channel = connect_unix(&socket).await.expect("connect to the plugin");
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(api::Empty {})
            .await
            .expect("options")
            .into_inner();
        let mut stream = client
            .list_and_watch(api::Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        let (devices_tx, devices) = watch::channel(None);
        let task = tokio::spawn(async move {
            while let Ok(Some(update)) = stream.message().await {
                let _ = devices_tx.send(Some(update.devices));
            }
        });
        PluginConn {
            client,
            options,
            devices,
            in_use: HashSet::new(),
            task,
        }
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(true);
            task.abort();
        }
    }
}

/// GPU devices a container asks for (limits, else requests).
pub fn gpu_count(container: &Container, resource: &str) -> usize {
    let resources = container.resources.as_ref();
    let quantity = resources
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        .or_else(|| {
            resources
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get(resource))
        });
    quantity.map_or(0, |q| q.0.parse().expect("integer quantity"))
}

/// The pod's GPU containers in kubelet's admission order.
pub fn gpu_containers(pod: &Pod, resource: &str) -> Vec<(String, usize)> {
    let spec = pod.spec.as_ref().expect("pod spec");
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .map(|c| (c.name.clone(), gpu_count(c, resource)))
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// A kubelet's connection to one registered plugin.
pub struct PluginConn {
    pub client: DevicePluginClient<Channel>,
    pub options: api::DevicePluginOptions,
    pub devices: watch::Receiver<Option<Vec<api::Device>>>,
    /// Device IDs kubelet has handed out.
    pub in_use: HashSet<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PluginConn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PluginConn {
    /// Waits until the device list satisfies `check`.
    pub async fn wait_devices(
        &mut self,
        timeout: Duration,
        check: impl Fn(&[api::Device]) -> bool,
    ) -> Vec<api::Device> {
        let matched = {
            let result = tokio::time::timeout(
                timeout,
                self.devices
                    .wait_for(|list| list.as_deref().is_some_and(&check)),
            )
            .await;
            match result {
                Ok(Ok(list)) => Some(list.clone().unwrap_or_default()),
                _ => None,
            }
        };
        match matched {
            Some(list) => list,
            None => panic!(
                "device list never matched; last: {:?}",
                self.devices.borrow().as_ref().map(|l| l
                    .iter()
                    .map(|d| (d.id.clone(), d.health.clone()))
                    .collect::<Vec<_>>())
            ),
        }
    }

    /// Allocates one container of `count` devices as kubelet does.
    /// Returns the device IDs kubelet chose and the plugin's answer.
    pub async fn allocate_one(
        &mut self,
        count: usize,
    ) -> Result<(Vec<String>, api::ContainerAllocateResponse), Status> {
        let mut available: Vec<String> = self
            .devices
            .borrow()
            .iter()
            .flatten()
            .filter(|d| d.health == "Healthy" && !self.in_use.contains(&d.id))
            .map(|d| d.id.clone())
            .collect();
        available.sort();
        assert!(
            available.len() >= count,
            "kubelet has {} free devices, the container needs {count}",
            available.len()
        );
        let mut chosen: Vec<String> = available.iter().take(count).cloned().collect();
        if self.options.get_preferred_allocation_available {
            let preferred = self
                .client
                .get_preferred_allocation(api::PreferredAllocationRequest {
                    container_requests: vec![api::ContainerPreferredAllocationRequest {
                        available_device_i_ds: available.clone(),
                        must_include_device_i_ds: Vec::new(),
                        allocation_size: i32::try_from(count).expect("count"),
                    }],
                })
                .await?
                .into_inner();
            let ids = preferred
                .container_responses
                .into_iter()
                .next()
                .map(|r| r.device_i_ds)
                .unwrap_or_default();
            // Kubelet uses the preference only when it is valid.
            if ids.len() == count && ids.iter().all(|id| available.contains(id)) {
                chosen = ids;
            }
        }
        let response = self
            .client
            .allocate(api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest {
                    devices_ids: chosen.clone(),
                }],
            })
            .await?
            .into_inner();
        assert_eq!(response.container_responses.len(), 1);
        self.in_use.extend(chosen.iter().cloned());
        let answer = response
            .container_responses
            .into_iter()
            .next()
            .expect("one answer");
        Ok((chosen, answer))
    }

    /// Admits `pod`: allocates each GPU container in order.
    pub async fn admit(
        &mut self,
        pod: &Pod,
        resource: &str,
    ) -> Result<Vec<(String, Vec<String>, api::ContainerAllocateResponse)>, Status> {
        let mut out = Vec::new();
        for (name, count) in gpu_containers(pod, resource) {
            let (ids, answer) = self.allocate_one(count).await?;
            out.push((name, ids, answer));
        }
        Ok(out)
    }
}

/// The plugin's configuration for running in-process on `node` in the test
/// folder `dir` (its device-plugin directory is `dir/device-plugins`,
/// where the fake kubelet listens too).
/// The plugin started in-process on [`gpus`] for `node`, its files under
/// `dir`, talking to the API at `source`: its health handle, the sender
/// that stops it, and its task.
pub async fn spawn_in_process(
    node: &str,
    dir: &Path,
    source: &vgpu_cluster::client::ApiSource,
) -> (
    vgpu_node_agent::health::ManualHealthHandle,
    watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), vgpu_device_plugin::PluginError>>,
) {
    use vgpu_node_agent::health::{HealthTracker, ManualHealth};
    let config = in_process_config(node, dir, super::RESOURCE);
    let (health_source, health) = ManualHealth::new(HealthTracker::new([13], Some(Duration::ZERO)));
    let client = vgpu_device_plugin::cluster::make_client(source)
        .await
        .expect("client");
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(vgpu_device_plugin::run(
        config,
        gpus(),
        Box::new(health_source),
        client,
        shutdown,
    ));
    (health, stop, task)
}

pub fn in_process_config(
    node: &str,
    dir: &Path,
    resource: &str,
) -> vgpu_device_plugin::PluginConfig {
    use vgpu_device_plugin::kubelet::KubeletSettings;
    use vgpu_node_agent::allocation::Settings;
    vgpu_device_plugin::PluginConfig {
        node: node.into(),
        kubelet: KubeletSettings {
            dir: dir.join("device-plugins"),
            endpoint: "vgpu.sock".into(),
            resource_name: resource.into(),
            poll: Duration::from_millis(50),
        },
        settings: Settings {
            containers_dir: dir.join("containers"),
            region_file: "region.cache".into(),
            container_dir: "/usr/local/vgpu/container".into(),
            library_host: dir.join("libvgpu.so"),
            library_container: "/usr/local/vgpu/libvgpu.so".into(),
            preload_host: Some(dir.join("ld.so.preload")),
            policy: vgpu_node_contract::region::UtilizationPolicy::Default,
            swap_limit: None,
            memory_scaling: Default::default(),
            context_reserve: None,
        },
        resync: Duration::from_secs(1),
        lease_duration_seconds: 2,
        pod_resources_socket: None,
        resources: Default::default(),
        request_defaults: Default::default(),
        load: None,
    }
}

/// The two 16 GiB GPUs the in-process plugin is given.
pub fn gpus() -> Vec<vgpu_cluster::decision::InventoryGpu> {
    (0..2)
        .map(|index| vgpu_cluster::decision::InventoryGpu {
            offered_memory_bytes: None,
            utilization_percent: None,
            uuid: format!("GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"),
            index,
            model: "Test GPU".into(),
            memory_bytes: 16 << 30,
            sm_count: 132,
            split_count: 10,
            numa: Some(index),
            nvlink_island: None,
            healthy: true,
        })
        .collect()
}
