//! The monitor's pass: rescan, read every region and NVML, decide and write
//! effective shares, clean up, and publish a snapshot for `/metrics`.

use crate::arbitration::{arbitrate, Contender, Load};
use crate::cleanup::{self, Janitor, Reaper, Verdict};
use crate::discovery::{Discovery, DiscoveryConfig};
use crate::events::{EventRecorder, PodRef};
use crate::metrics::{self, ContainerDevice, ContainerSummary, Snapshot};
use crate::names::PodRecord;
use crate::names::{ApiState, PodDirectory, Presence};
use crate::unenforced::{self, Container, HostProc};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use vgpu_cluster::decision::{region_limits, DeviceGrant, NodeLimits};
use vgpu_node_contract::region::{monotonic_ns, SHARE_FULL, SHARE_UNLIMITED};
use vgpu_node_contract::shim_env::UtilizationPolicy;
use vgpu_nvml_host::{GpuSample, Sampler};

/// How often dead slots are looked for and cleanup is judged.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Most utilization samples kept per container device.
const MAX_HISTORY: usize = 1024;

/// What the monitor does, independent of how it was configured.
#[derive(Clone, Debug)]
pub struct MonitorConfig {
    pub discovery: DiscoveryConfig,
    /// Time between passes.
    pub interval: Duration,
    /// A container launched work within this long ago is active.
    pub active_window: Duration,
    /// Achieved utilization is measured over this long.
    pub utilization_window: Duration,
    /// Write effective shares (otherwise only observe).
    pub arbitration: bool,
    /// Remove regions of deleted pods after this long; `None`: never.
    pub cleanup_grace: Option<Duration>,
    /// Also emit HAMi's metric names.
    pub hami_names: bool,
    /// Load NVML (from this path, or the default name when `None`).
    pub nvml: Option<Option<PathBuf>>,
    /// What the node adds to the limits a decision grants (the device
    /// plugin's policy, swap and memory scaling): what a grant comes to in
    /// a region.
    pub node: NodeLimits,
    /// Restore the limits a region's decision granted when they were
    /// changed from inside.
    pub restore: bool,
}

impl MonitorConfig {
    /// Defaults for a region directory (tests, the bench).
    pub fn for_root(root: PathBuf) -> Self {
        Self {
            discovery: DiscoveryConfig {
                root,
                region_file: "region.cache".into(),
                max_containers: 1024,
            },
            interval: Duration::from_millis(100),
            active_window: Duration::from_secs(1),
            utilization_window: Duration::from_secs(1),
            arbitration: true,
            cleanup_grace: Some(Duration::from_secs(300)),
            hami_names: false,
            nvml: None,
            node: NodeLimits::default(),
            restore: true,
        }
    }
}

/// What `/metrics` and `/healthz` read, shared with the HTTP server.
pub struct Shared {
    snapshot: RwLock<Arc<Snapshot>>,
    rendered: Mutex<Option<(u64, axum::body::Bytes)>>,
    hami_names: bool,
    heartbeat_ns: AtomicU64,
    stale_after: Duration,
}

impl Shared {
    fn new(hami_names: bool, interval: Duration) -> Self {
        Self {
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            rendered: Mutex::new(None),
            hami_names,
            heartbeat_ns: AtomicU64::new(monotonic_ns()),
            stale_after: (interval * 20).max(Duration::from_secs(5)),
        }
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.snapshot.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn publish(&self, snapshot: Snapshot) {
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(snapshot);
        self.heartbeat_ns.store(monotonic_ns(), Ordering::Release);
    }

    /// The latest snapshot in the text format; rendered once per snapshot,
    /// however many scrapes ask.
    pub fn render(&self) -> axum::body::Bytes {
        let mut cache = self.rendered.lock().unwrap_or_else(|p| p.into_inner());
        let snapshot = self.snapshot();
        if let Some((generation, bytes)) = cache.as_ref() {
            if *generation == snapshot.generation {
                return bytes.clone();
            }
        }
        let bytes = axum::body::Bytes::from(metrics::render(&snapshot, self.hami_names));
        *cache = Some((snapshot.generation, bytes.clone()));
        bytes
    }

    /// Renders without the cache (for measurements).
    pub fn render_uncached(&self) -> Vec<u8> {
        metrics::render(&self.snapshot(), self.hami_names)
    }

    /// Whether the loop has published recently.
    pub fn healthy(&self) -> bool {
        let age = monotonic_ns().saturating_sub(self.heartbeat_ns.load(Ordering::Acquire));
        Duration::from_nanos(age) < self.stale_after
    }
}

/// Per container device: what earlier passes saw.
#[derive(Default)]
struct Track {
    seen: bool,
    launches: u64,
    last_launch_at: u64,
    /// When the counters last showed activity (monotonic ns).
    active_at: Option<u64>,
    /// (monotonic ns, granted ns) samples over the utilization window.
    history: VecDeque<(u64, u64)>,
    /// The effective share this monitor last wrote (to restore on exit).
    wrote: bool,
    /// The region's throttled time at the last pass, and when it last grew
    /// (a launch waited for tokens).
    throttled_ns: u64,
    waited_at: Option<u64>,
}

/// One pass's view of one container device, for arbitration.
struct Seen {
    key: String,
    device: usize,
    uuid: String,
    contender: Contender,
}

/// The node monitor.
pub struct Monitor {
    config: MonitorConfig,
    discovery: Discovery,
    gpus: Option<Sampler>,
    pods: Arc<PodDirectory>,
    tracks: HashMap<(String, usize), Track>,
    /// Region devices already reported as on a GPU their pod was not given.
    misplaced: HashSet<(String, usize)>,
    host_proc: HostProc,
    /// (GPU UUID, host PID) of processes without the shim already reported.
    unenforced_reported: HashSet<(String, u32)>,
    /// (container, device) found holding memory above the granted cap.
    over_cap_reported: HashSet<(String, usize)>,
    /// Times each container's region limits were restored.
    restored: HashMap<String, u64>,
    /// Those of them recorded as an Event on their pod.
    unenforced_evented: HashSet<(String, u32)>,
    events: Option<EventRecorder>,
    reaper: Reaper,
    janitor: Janitor,
    shared: Arc<Shared>,
    last_sweep: Option<Instant>,
    /// Cleanup sweeps done so far.
    sweeps: u64,
    generation: u64,
    /// Effective-share writes so far.
    pub writes: u64,
}

impl Monitor {
    /// A monitor over `config`, naming pods through `pods`. NVML that cannot
    /// be loaded is logged and left out (no host GPU figures).
    pub fn new(config: MonitorConfig, pods: Arc<PodDirectory>) -> Self {
        let gpus = match &config.nvml {
            None => None,
            Some(path) => match Sampler::open(path.as_deref()) {
                Ok(gpus) => Some(gpus),
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "host GPU figures will be missing"
                    );
                    None
                }
            },
        };
        let shared = Arc::new(Shared::new(config.hami_names, config.interval));
        Self {
            discovery: Discovery::new(config.discovery.clone()),
            reaper: Reaper::new(config.cleanup_grace.unwrap_or(Duration::MAX)),
            janitor: Janitor::new(),
            config,
            gpus,
            pods,
            tracks: HashMap::new(),
            misplaced: HashSet::new(),
            host_proc: HostProc::default(),
            unenforced_reported: HashSet::new(),
            unenforced_evented: HashSet::new(),
            over_cap_reported: HashSet::new(),
            restored: HashMap::new(),
            events: None,
            shared,
            last_sweep: None,
            sweeps: 0,
            generation: 0,
            writes: 0,
        }
    }

    /// Records Events on pods through `events` (what a process running
    /// without the shim is reported with).
    pub fn with_events(mut self, events: EventRecorder) -> Self {
        self.events = Some(events);
        self
    }

    pub fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    pub fn config(&self) -> &MonitorConfig {
        &self.config
    }

    pub fn discovery(&self) -> &Discovery {
        &self.discovery
    }

    /// Runs passes every `interval` until `stop`, then gives every
    /// container it changed its configured share back.
    pub fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            let started = Instant::now();
            self.tick();
            let elapsed = started.elapsed();
            if let Some(rest) = self.config.interval.checked_sub(elapsed) {
                std::thread::sleep(rest);
            }
        }
        self.restore_shares();
    }

    /// One pass.
    pub fn tick(&mut self) {
        let started = Instant::now();
        let now = monotonic_ns();
        let scan = self.discovery.rescan(started);
        for key in &scan.removed {
            self.janitor.forget(key);
            self.misplaced.retain(|(misplaced, _)| misplaced != key);
        }
        let gpus = self.sample_gpus();
        let process_util = process_util_by_uuid(&gpus);

        let api_state = self.pods.state();
        let mut devices = Vec::new();
        let mut containers = Vec::new();
        let mut container_index = HashMap::new();
        let mut seen = Vec::new();
        for region in self.discovery.regions() {
            let figures = region.read();
            let pod = region
                .pod_uid
                .as_deref()
                .and_then(|uid| self.pods.lookup(uid));
            let (namespace, pod_name) = match (&pod, &region.claim) {
                (Some(pod), _) => (pod.namespace.clone(), pod.name.clone()),
                // A DRA claim's region: its pods share it.
                (None, Some(claim)) => (claim.namespace.clone(), claim.pods.join(",")),
                (None, None) => (
                    String::new(),
                    region.pod_uid.clone().unwrap_or_else(|| region.key.clone()),
                ),
            };
            let priority = pod
                .as_ref()
                .and_then(|p| p.priorities.get(&region.container).copied())
                .unwrap_or(figures.priority);
            container_index.insert(region.key.clone(), containers.len());
            // A DRA claim's series are named by the claim.
            let container_name = region
                .claim
                .as_ref()
                .map_or_else(|| region.container.clone(), |claim| claim.claim.clone());
            containers.push(ContainerSummary {
                namespace: namespace.clone(),
                pod: pod_name.clone(),
                container: container_name.clone(),
                processes: figures.active_slots,
                ..ContainerSummary::default()
            });
            let policy = UtilizationPolicy::from_u32(figures.policy);
            let granted = pod.as_ref().and_then(|p| p.grants.get(&region.container));
            for device in &figures.devices {
                // The decision, not the container's own region, says which
                // GPUs it may use and with what share.
                let mut device = device.clone();
                let mut over_cap_bytes = 0;
                if let Some(grants) = granted {
                    match grants.iter().find(|g| g.uuid == device.uuid) {
                        Some(grant) => {
                            device.sm_limit = grant.cores_percent;
                            device.sm_burst = grant.burst_percent.unwrap_or(0);
                            // Restoring a cap frees nothing: what was taken
                            // above it while it was raised stays visible.
                            // The cap is the grant's device part (all of
                            // it unless the node scales memory).
                            let cap = self.config.node.memory(grant.memory_bytes).device;
                            if cap > 0 {
                                over_cap_bytes = device.memory_used.saturating_sub(cap);
                            }
                        }
                        None => {
                            if self.misplaced.insert((region.key.clone(), device.index)) {
                                tracing::warn!(
                                    "container {}: its region names GPU {} as device {}, which the scheduler did not give it; that device is left out of metrics and arbitration",
                                    region.key,
                                    device.uuid,
                                    device.index
                                );
                            }
                            continue;
                        }
                    }
                }
                let device = &device;
                let over_cap_key = (region.key.clone(), device.index);
                if over_cap_bytes == 0 {
                    self.over_cap_reported.remove(&over_cap_key);
                } else if self.over_cap_reported.insert(over_cap_key) {
                    let message = format!(
                        "container {} holds {} MiB on GPU {} above the {} MiB its decision granted",
                        region.key,
                        over_cap_bytes >> 20,
                        device.uuid,
                        device.memory_used.saturating_sub(over_cap_bytes) >> 20
                    );
                    tracing::warn!("{message}");
                    record_event(&self.events, &pod, region, "MemoryOverCap", message);
                }
                let track = self
                    .tracks
                    .entry((region.key.clone(), device.index))
                    .or_default();
                let nvml_active = process_util.get(device.uuid.as_str()).is_some_and(|util| {
                    figures
                        .pids
                        .iter()
                        .any(|pid| util.get(pid).is_some_and(|u| *u > 0))
                });
                let active = observe(track, device, nvml_active, now, self.config.active_window);
                let waited = observe_waits(
                    track,
                    device.throttled_ns,
                    now,
                    self.config.utilization_window,
                );
                let metered = is_metered(policy, device.sm_limit, device.sm_effective);
                let utilization = if metered {
                    granted_rate(
                        track,
                        device.granted_ns,
                        now,
                        self.config.utilization_window,
                    )
                } else {
                    record_history(
                        track,
                        device.granted_ns,
                        now,
                        self.config.utilization_window,
                    );
                    process_util.get(device.uuid.as_str()).map(|util| {
                        let total: u32 = figures
                            .pids
                            .iter()
                            .filter_map(|pid| util.get(pid))
                            .fold(0u32, |sum, u| sum.saturating_add(*u));
                        f64::from(total.min(100)) / 100.0
                    })
                };
                let last_kernel = [
                    Some(device.last_launch_at).filter(|t| *t != 0 && *t <= now),
                    track.active_at,
                ]
                .into_iter()
                .flatten()
                .max();
                devices.push(ContainerDevice {
                    namespace: namespace.clone(),
                    pod: pod_name.clone(),
                    container: container_name.clone(),
                    figures: device.clone(),
                    priority,
                    utilization,
                    last_kernel_age_seconds: last_kernel
                        .map(|t| now.saturating_sub(t) as f64 / 1e9),
                    over_cap_bytes,
                });
                let load = utilization.filter(|_| metered).map(|ratio| Load {
                    achieved: (ratio * f64::from(SHARE_FULL)).round() as u32,
                    waited,
                });
                seen.push(Seen {
                    key: region.key.clone(),
                    device: device.index,
                    uuid: device.uuid.clone(),
                    contender: Contender::from_raw(
                        region.key.clone(),
                        figures.policy,
                        priority,
                        device.sm_limit,
                        device.sm_burst,
                        active,
                    )
                    .with_load(load),
                });
            }
            // The region is writable by the container it limits: put back
            // what the decision granted if it was changed from inside.
            if let Some(grants) = granted.filter(|_| self.config.restore) {
                let mut ordered: Vec<&DeviceGrant> = grants.iter().collect();
                // Devices are numbered in NVML (PCI) order, as the device
                // plugin numbered them; without NVML, the decision's order.
                ordered.sort_by_key(|g| gpus.iter().find(|s| s.uuid == g.uuid).map(|s| s.index));
                let priority = pod
                    .as_ref()
                    .and_then(|p| p.priorities.get(&region.container).copied());
                let limits = region_limits(&ordered, priority, &self.config.node);
                if region.region().restore_limits(&limits) {
                    let restored = self.restored.entry(region.key.clone()).or_insert(0);
                    *restored += 1;
                    let message = format!(
                        "container {} changed the limits in its region; the limits its decision granted are restored",
                        region.key
                    );
                    if *restored == 1 {
                        tracing::warn!("{message}");
                        record_event(&self.events, &pod, region, "RegionLimitsChanged", message);
                    } else {
                        tracing::debug!("{message} (again: {} times)", restored);
                    }
                }
            }
            if let Some(summary) = containers.last_mut() {
                summary.limits_restored = self.restored.get(&region.key).copied().unwrap_or(0);
            }
        }

        if self.config.arbitration {
            let busy: HashMap<&str, u32> = gpus
                .iter()
                .filter_map(|g| {
                    Some((
                        g.uuid.as_str(),
                        (g.utilization? * f64::from(SHARE_FULL)).round() as u32,
                    ))
                })
                .collect();
            self.arbitrate(&seen, &busy, &mut devices);
        }
        let unenforced = self.find_unenforced(&gpus);
        for process in &unenforced {
            let summary = process
                .container
                .as_ref()
                .and_then(|key| container_index.get(key))
                .and_then(|&index| containers.get_mut(index));
            if let Some(summary) = summary {
                summary.unenforced_processes += 1;
                summary.unenforced_bytes =
                    summary.unenforced_bytes.saturating_add(process.used_bytes);
            }
        }
        self.sweep(started);
        self.janitor.watchdog(started);

        // Forget what is no longer there.
        let live_keys: HashSet<&str> = self.discovery.regions().map(|r| r.key.as_str()).collect();
        self.tracks
            .retain(|(key, _), _| live_keys.contains(key.as_str()));
        self.restored
            .retain(|key, _| live_keys.contains(key.as_str()));
        self.over_cap_reported
            .retain(|(key, _)| live_keys.contains(key.as_str()));
        self.reaper.retain(&live_keys);

        self.generation = self.generation.wrapping_add(1);
        let snapshot = Snapshot {
            generation: self.generation,
            devices,
            containers,
            gpus,
            unenforced,
            regions: self.discovery.len(),
            refused_total: self.discovery.refused_total,
            reclaimed_total: self.janitor.reclaimed.load(Ordering::Relaxed),
            sweeps_total: self.sweeps,
            api_up: match api_state {
                ApiState::Disabled => None,
                state => Some(state == ApiState::Synced),
            },
            loop_seconds: started.elapsed().as_secs_f64(),
        };
        self.shared.publish(snapshot);
    }

    /// GPU processes no live slot accounts for; each new one is logged
    /// once and, when its pod is known, recorded as an Event on it.
    fn find_unenforced(&mut self, gpus: &[GpuSample]) -> Vec<unenforced::Unenforced> {
        let census = {
            let containers: Vec<Container> = self
                .discovery
                .regions()
                .map(|r| Container {
                    key: &r.key,
                    pod_uid: r.pod_uid.as_deref(),
                    region: r.region(),
                    file: (r.identity.device, r.identity.inode),
                })
                .collect();
            unenforced::census(gpus, &containers, &self.host_proc)
        };
        if census.host_pids_recorded > 0 {
            tracing::debug!(
                "recorded the host PID of {} shim processes",
                census.host_pids_recorded
            );
        }
        let current: HashSet<(String, u32)> = census
            .unenforced
            .iter()
            .map(|u| (u.gpu_uuid.clone(), u.pid))
            .collect();
        for process in &census.unenforced {
            let id = (process.gpu_uuid.clone(), process.pid);
            let message = format!(
                "process {} uses GPU {} ({} MiB) without the vgpu shim: no memory cap or compute share holds it",
                process.pid,
                process.gpu_uuid,
                process.used_bytes >> 20
            );
            if self.unenforced_reported.insert(id.clone()) {
                match &process.container {
                    Some(key) => tracing::warn!("{message}; container {key}"),
                    None => tracing::warn!("{message}; it belongs to no container with a region"),
                }
            }
            // The Event waits until the API names the pod (the first passes
            // may come before the pod list).
            if self.unenforced_evented.contains(&id) {
                continue;
            }
            let region = process
                .container
                .as_ref()
                .and_then(|key| self.discovery.get(key));
            let Some((region, events)) = region.zip(self.events.as_ref()) else {
                continue;
            };
            let Some(uid) = region.pod_uid.as_deref() else {
                continue;
            };
            if let Some(pod) = self.pods.lookup(uid) {
                events.warn(
                    &PodRef {
                        namespace: &pod.namespace,
                        name: &pod.name,
                        uid,
                    },
                    "UnenforcedGPUProcess",
                    format!("{message} (container {})", region.container),
                );
                self.unenforced_evented.insert(id);
            }
        }
        self.unenforced_reported
            .retain(|seen| current.contains(seen));
        self.unenforced_evented
            .retain(|seen| current.contains(seen));
        census.unenforced
    }

    fn sample_gpus(&mut self) -> Vec<GpuSample> {
        let Some(gpus) = self.gpus.as_mut() else {
            return Vec::new();
        };
        let wall_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let window_us = self.config.active_window.as_micros() as u64;
        gpus.sample(wall_us.saturating_sub(window_us).max(1))
    }

    /// Decides every GPU's shares and writes the ones that changed.
    fn arbitrate(
        &mut self,
        seen: &[Seen],
        busy: &HashMap<&str, u32>,
        devices: &mut [ContainerDevice],
    ) {
        let mut by_gpu: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (index, s) in seen.iter().enumerate() {
            by_gpu.entry(s.uuid.as_str()).or_default().push(index);
        }
        for (uuid, members) in &by_gpu {
            let contenders: Vec<Contender> =
                members.iter().map(|&i| seen[i].contender.clone()).collect();
            let decisions = arbitrate(&contenders, busy.get(uuid).copied());
            for (&i, decision) in members.iter().zip(decisions) {
                let Some(target) = decision else { continue };
                let s = &seen[i];
                let Some(region) = self.discovery.get(&s.key) else {
                    continue;
                };
                let record = &region.region().layout().devices[s.device];
                let current = record.sm_effective.load(Ordering::Acquire);
                if current != target {
                    record.sm_effective.store(target, Ordering::Release);
                    self.writes = self.writes.saturating_add(1);
                    tracing::debug!(
                        "region {} device {}: effective share {} -> {}",
                        s.key,
                        s.device,
                        describe(current),
                        describe(target)
                    );
                }
                if let Some(track) = self.tracks.get_mut(&(s.key.clone(), s.device)) {
                    track.wrote = true;
                }
                // Devices are in the same order as `seen`.
                if let Some(device) = devices.get_mut(i) {
                    device.figures.sm_effective = target;
                }
            }
        }
    }

    /// Reclaims dead slots and removes regions of deleted pods (every
    /// [`SWEEP_EVERY`]).
    fn sweep(&mut self, now: Instant) {
        if self
            .last_sweep
            .is_some_and(|last| now.duration_since(last) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        self.sweeps += 1;
        let mut remove = Vec::new();
        for region in self.discovery.regions() {
            if cleanup::has_dead_slot(region.region()) {
                self.janitor.request(&region.key, region.region_arc());
            }
            if self.config.cleanup_grace.is_none() {
                continue;
            }
            let presence = match region.pod_uid.as_deref() {
                Some(uid) => self.pods.presence(uid),
                None => Presence::Unknown,
            };
            let live = cleanup::has_live_process(region.region());
            if self.reaper.judge(&region.key, presence, live, now) == Verdict::Remove {
                remove.push((region.key.clone(), region.dir.clone()));
            }
        }
        for (key, dir) in remove {
            self.discovery.forget(&key);
            self.janitor.forget(&key);
            match cleanup::remove_container_dir(&self.config.discovery.root, &dir) {
                Ok(()) => tracing::info!(
                    "removed {} (pod gone for {} s, no live process)",
                    dir.display(),
                    self.config.cleanup_grace.unwrap_or_default().as_secs()
                ),
                Err(error) => tracing::warn!(error = &error as &dyn std::error::Error, ""),
            }
        }
    }

    /// Gives every container this monitor wrote to its configured share
    /// back (on shutdown: nobody stays paused by a monitor that is gone).
    pub fn restore_shares(&mut self) {
        let mut restored = 0;
        for ((key, device), track) in &self.tracks {
            if !track.wrote {
                continue;
            }
            let Some(region) = self.discovery.get(key) else {
                continue;
            };
            let record = &region.region().layout().devices[*device];
            let share = record.sm_limit.load(Ordering::Relaxed);
            let configured = if share > 0 && share < 100 {
                share * (SHARE_FULL / 100)
            } else {
                SHARE_UNLIMITED
            };
            record.sm_effective.store(configured, Ordering::Release);
            restored += 1;
        }
        if restored > 0 {
            tracing::info!("restored the configured share of {restored} container device(s)");
        }
    }
}

fn describe(share: u32) -> String {
    if share == SHARE_UNLIMITED {
        "unlimited".into()
    } else {
        format!("{}.{:02} %", share / 100, share % 100)
    }
}

/// Whether the shim meters the container's launches on the device (counts
/// them and charges device time): a cap is in force.
fn is_metered(policy: Option<UtilizationPolicy>, sm_limit: u32, sm_effective: u32) -> bool {
    match policy {
        Some(UtilizationPolicy::Force) => sm_limit > 0 && sm_limit < 100,
        Some(UtilizationPolicy::Default) => sm_effective < SHARE_FULL,
        _ => false,
    }
}

/// Updates the activity record from the counters; returns whether the
/// container device is active (launched within `window`).
fn observe(
    track: &mut Track,
    device: &crate::discovery::DeviceFigures,
    nvml_active: bool,
    now: u64,
    window: Duration,
) -> bool {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    let launched = track.seen && device.launches != track.launches;
    let stamped = device.last_launch_at != track.last_launch_at
        && device.last_launch_at <= now
        && now.saturating_sub(device.last_launch_at) <= window_ns;
    if launched || stamped || nvml_active {
        track.active_at = Some(now);
    }
    track.seen = true;
    track.launches = device.launches;
    track.last_launch_at = device.last_launch_at;
    track
        .active_at
        .is_some_and(|at| now.saturating_sub(at) <= window_ns)
}

/// Whether a launch of the container device waited for tokens within
/// `window` (its throttled time grew).
fn observe_waits(track: &mut Track, throttled_ns: u64, now: u64, window: Duration) -> bool {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    if throttled_ns > track.throttled_ns && track.seen {
        track.waited_at = Some(now);
    }
    track.throttled_ns = throttled_ns;
    track
        .waited_at
        .is_some_and(|at| now.saturating_sub(at) <= window_ns)
}

fn record_history(track: &mut Track, granted: u64, now: u64, window: Duration) {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    track.history.push_back((now, granted));
    // Keep the newest sample at least `window` old as the base.
    while track.history.len() > 1
        && track
            .history
            .get(1)
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= window_ns)
    {
        track.history.pop_front();
    }
    while track.history.len() > MAX_HISTORY {
        track.history.pop_front();
    }
}

/// Granted device time per wall time since the base sample, 0..=1.
fn granted_rate(track: &mut Track, granted: u64, now: u64, window: Duration) -> Option<f64> {
    record_history(track, granted, now, window);
    let (t0, g0) = *track.history.front()?;
    let elapsed = now.saturating_sub(t0);
    if elapsed == 0 {
        return None;
    }
    let used = granted.saturating_sub(g0);
    Some((used as f64 / elapsed as f64).clamp(0.0, 1.0))
}

fn process_util_by_uuid(gpus: &[GpuSample]) -> HashMap<&str, &HashMap<u32, u32>> {
    gpus.iter()
        .filter(|g| !g.uuid.is_empty())
        .map(|g| (g.uuid.as_str(), &g.process_sm_percent))
        .collect()
}

/// A Warning Event on the pod of `region`, when the API names it.
fn record_event(
    events: &Option<EventRecorder>,
    pod: &Option<PodRecord>,
    region: &crate::discovery::ContainerRegion,
    reason: &str,
    message: String,
) {
    let (Some(events), Some(pod), Some(uid)) = (events, pod, region.pod_uid.as_deref()) else {
        return;
    };
    events.warn(
        &PodRef {
            namespace: &pod.namespace,
            name: &pod.name,
            uid,
        },
        reason,
        message,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::DeviceFigures;

    #[test]
    fn activity_follows_the_counters_and_expires() {
        let mut track = Track::default();
        let window = Duration::from_secs(1);
        let mut device = DeviceFigures {
            launches: 5,
            ..DeviceFigures::default()
        };
        assert!(
            !observe(&mut track, &device, false, 1_000, window),
            "first sight is a baseline"
        );
        device.launches = 6;
        assert!(observe(&mut track, &device, false, 2_000, window));
        assert!(observe(&mut track, &device, false, 500_000_000, window));
        assert!(!observe(&mut track, &device, false, 1_100_000_000, window));
        device.last_launch_at = 1_200_000_000;
        assert!(observe(&mut track, &device, false, 1_300_000_000, window));
        // A stamp from the future (garbage) does not count.
        device.last_launch_at = u64::MAX;
        assert!(!observe(&mut track, &device, false, 9_000_000_000, window));
        assert!(
            observe(&mut track, &device, true, 9_100_000_000, window),
            "NVML says busy"
        );
    }

    #[test]
    fn utilization_is_granted_time_over_the_window() {
        let mut track = Track::default();
        let window = Duration::from_secs(1);
        assert_eq!(granted_rate(&mut track, 0, 1_000_000_000, window), None);
        for step in 1..=20u64 {
            let now = 1_000_000_000 + step * 100_000_000;
            let rate = granted_rate(&mut track, step * 30_000_000, now, window);
            if step >= 10 {
                let rate = rate.expect("rate");
                assert!((rate - 0.3).abs() < 1e-9, "{rate}");
            }
        }
        assert!(track.history.len() <= 12);
        // Counters going backwards (garbage) give 0, not a panic.
        assert_eq!(
            granted_rate(&mut track, 0, 3_100_000_000, window),
            Some(0.0)
        );
        assert_eq!(
            granted_rate(&mut track, u64::MAX, 3_200_000_000, window),
            Some(1.0)
        );
    }

    #[test]
    fn metering_depends_on_the_cap_in_force() {
        assert!(is_metered(Some(UtilizationPolicy::Default), 30, 3000));
        assert!(is_metered(Some(UtilizationPolicy::Default), 0, 0), "paused");
        assert!(!is_metered(
            Some(UtilizationPolicy::Default),
            0,
            SHARE_UNLIMITED
        ));
        assert!(is_metered(
            Some(UtilizationPolicy::Force),
            30,
            SHARE_UNLIMITED
        ));
        assert!(!is_metered(Some(UtilizationPolicy::Disable), 30, 3000));
        assert!(!is_metered(None, 30, 3000));
    }
}
