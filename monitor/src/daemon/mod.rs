//! The monitor's pass, in four stages: collect (rescan the containers
//! folder, sample the GPUs), assess each region ([`crate::assess`]) and
//! find GPU processes no region accounts for, act (put back limits
//! changed from inside, hold every container to its memory cap and
//! compute share from NVML's accounting ([`backstops`]), decide and write effective shares,
//! clean up), and publish a snapshot for `/metrics`.

use crate::arbitration::{arbitrate, Contender};
use crate::assess::{
    assess_region, process_util_by_uuid, record_event, record_normal_event, Assessment,
    PassContext, Seen, Tracks,
};
use crate::backstop::{ComputeBackstop, MemoryBackstop};
use crate::cleanup::{self, Janitor, Reaper, Verdict};
use crate::discovery::Discovery;
use crate::events::{EventRecorder, PodRef};
use crate::host_proc::HostProc;
use crate::metrics::{ContainerDevice, Snapshot};
use crate::names::{ApiState, PodDirectory, Presence};
use crate::owners::Owner;
use crate::reported::{ProcessId, Reported};
use crate::unenforced::{self, Container};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vgpu_node_contract::region::{monotonic_ns, SHARE_FULL, SHARE_UNLIMITED};
use vgpu_nvml_host::{GpuSample, Sampler};

mod backstops;

pub use crate::config::MonitorConfig;
pub use crate::shared::Shared;

/// How often dead slots are looked for and cleanup is judged.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What a pass starts from.
struct Collected {
    started: Instant,
    /// Monotonic ns at the start.
    now: u64,
    gpus: Vec<GpuSample>,
    api_state: ApiState,
}

/// The node monitor.
pub struct Monitor {
    config: MonitorConfig,
    discovery: Discovery,
    gpus: Option<Sampler>,
    pods: Arc<PodDirectory>,
    tracks: Tracks,
    /// The anomalies already reported, each once while it lasts.
    reported: Reported,
    host_proc: HostProc,
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
    memory_backstop: MemoryBackstop,
    /// Processes killed for a container's cap, by region key.
    over_cap_kills: HashMap<String, u64>,
    compute_backstop: ComputeBackstop,
    /// Episodes of a container over its share (paused or reported), by
    /// region key.
    compute_pauses: HashMap<String, u64>,
    /// Processes killed for a container's share, by region key.
    over_share_kills: HashMap<String, u64>,
    /// Until when GPU processes found stopped are resumed (set on the
    /// first pass), and those checked so far.
    leftovers_until: Option<Instant>,
    leftovers_checked: HashSet<u32>,
    /// Processes that could not be signalled (each reported once).
    signal_failures: HashSet<u32>,
    /// Who each GPU process belongs to, as found in earlier passes.
    owner_cache: unenforced::OwnerCache,
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
        let memory_rule = config.memory_rule;
        let compute_rule = config.compute_rule;
        Self {
            discovery: Discovery::new(config.discovery.clone()),
            reaper: Reaper::new(config.cleanup_grace.unwrap_or(Duration::MAX)),
            janitor: Janitor::new(),
            config,
            gpus,
            pods,
            tracks: Tracks::new(),
            reported: Reported::default(),
            host_proc: HostProc::default(),
            events: None,
            shared,
            last_sweep: None,
            sweeps: 0,
            generation: 0,
            writes: 0,
            memory_backstop: MemoryBackstop::new(memory_rule),
            over_cap_kills: HashMap::new(),
            compute_backstop: ComputeBackstop::new(compute_rule),
            compute_pauses: HashMap::new(),
            over_share_kills: HashMap::new(),
            leftovers_until: None,
            leftovers_checked: HashSet::new(),
            signal_failures: HashSet::new(),
            owner_cache: unenforced::OwnerCache::new(),
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
    /// container it changed its configured share back and resumes every
    /// process it paused.
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
        self.resume_paused();
    }

    /// One pass.
    pub fn tick(&mut self) {
        let collected = self.collect();
        let mut assessment = self.assess(&collected);
        self.act(&collected, &mut assessment);
        self.publish(collected, assessment);
    }

    /// Rescans the containers folder (what the scan removed is forgotten),
    /// samples the GPUs, and notes whether the API vouches for the pods.
    fn collect(&mut self) -> Collected {
        let started = Instant::now();
        let now = monotonic_ns();
        let scan = self.discovery.rescan(started);
        if !scan.added.is_empty() || !scan.removed.is_empty() {
            // A process's region may be new: find every owner again.
            self.owner_cache.clear();
        }
        for key in &scan.removed {
            self.janitor.forget(key);
            self.reported.region_removed(key);
        }
        for (key, repaired) in &scan.repaired {
            let found = repaired.found;
            self.tell(
                Some(key),
                "GPURegionRepaired",
                format!(
                    "region {key}: its container damaged the region file ({} bytes long, {} bytes on disk{}); repaired to a {} byte region, its grant holds as before",
                    found.size,
                    found.allocated,
                    if repaired.reinitialised { ", its header overwritten" } else { "" },
                    vgpu_node_contract::region::REGION_BYTES,
                ),
            );
        }
        let gpus = self.sample_gpus();
        // What each GPU offers bounds decisions asking for a share of its
        // memory (names.rs).
        let scaling = self.config.node.memory_scaling;
        self.pods.set_offered(gpus.iter().filter_map(|gpu| {
            gpu.memory_total
                .map(|total| (gpu.uuid.clone(), scaling.offered(total)))
        }));
        Collected {
            started,
            now,
            gpus,
            api_state: self.pods.state(),
        }
    }

    /// Reads every region, and finds the GPU processes no region accounts
    /// for (counted to the container they run in, when known).
    fn assess(&mut self, collected: &Collected) -> Assessment {
        let context = PassContext {
            config: &self.config,
            pods: &self.pods,
            events: self.events.as_ref(),
            now: collected.now,
            gpus: &collected.gpus,
        };
        let process_util = process_util_by_uuid(&collected.gpus);
        let mut assessment = Assessment::default();
        for region in self.discovery.regions() {
            assess_region(
                region,
                &context,
                &process_util,
                &mut self.tracks,
                &mut self.reported,
                &mut assessment,
            );
        }
        let census = self.find_unenforced(&collected.gpus);
        assessment.unenforced = census.unenforced;
        assessment.uses = census.uses;
        for process in &assessment.uses {
            let Owner::Region(key) = &process.owner else {
                continue;
            };
            if let Some(summary) = assessment
                .container_index
                .get(key)
                .and_then(|&index| assessment.containers.get_mut(index))
            {
                summary.gpu_memory_bytes =
                    summary.gpu_memory_bytes.saturating_add(process.used_bytes);
                summary.gpu_time_ratio += f64::from(process.sm_percent) / 100.0;
            }
        }
        for process in &assessment.unenforced {
            let summary = process
                .container
                .as_ref()
                .and_then(|key| assessment.container_index.get(key))
                .and_then(|&index| assessment.containers.get_mut(index));
            if let Some(summary) = summary {
                summary.unenforced_processes += 1;
                summary.unenforced_bytes =
                    summary.unenforced_bytes.saturating_add(process.used_bytes);
            }
        }
        assessment
    }

    /// Puts back the limits containers changed in their regions, decides
    /// every GPU's shares and writes those that changed, reclaims dead
    /// slots and removes regions of deleted pods, and forgets what is no
    /// longer there.
    fn act(&mut self, collected: &Collected, assessment: &mut Assessment) {
        self.restore_limits(assessment);
        self.hold_grants(collected, assessment);
        if self.config.arbitration {
            // The contention rule weighs what the containers achieved
            // against how busy NVML saw each GPU with their work: the time
            // of processes no shim meters (unenforced) is no loss between
            // the containers, and would read as one.
            let unmetered: HashSet<(&str, u32)> = assessment
                .unenforced
                .iter()
                .map(|u| (u.gpu_uuid.as_str(), u.pid))
                .collect();
            let mut unmetered_percent: HashMap<&str, u32> = HashMap::new();
            for u in &assessment.uses {
                if unmetered.contains(&(u.gpu_uuid.as_str(), u.pid)) {
                    *unmetered_percent.entry(u.gpu_uuid.as_str()).or_insert(0) += u.sm_percent;
                }
            }
            let busy: HashMap<&str, u32> = collected
                .gpus
                .iter()
                .filter_map(|g| {
                    let busy = (g.utilization? * f64::from(SHARE_FULL)).round() as u32;
                    let unmetered = unmetered_percent.get(g.uuid.as_str()).copied().unwrap_or(0);
                    Some((
                        g.uuid.as_str(),
                        busy.saturating_sub(unmetered.min(100) * (SHARE_FULL / 100)),
                    ))
                })
                .collect();
            self.arbitrate(&assessment.seen, &busy, &mut assessment.devices);
        }
        self.sweep(collected.started);
        self.janitor.watchdog(collected.started);
        self.forget_gone();
    }

    /// The pass's snapshot, for `/metrics`.
    fn publish(&mut self, collected: Collected, assessment: Assessment) {
        self.generation = self.generation.wrapping_add(1);
        let snapshot = Snapshot {
            generation: self.generation,
            devices: assessment.devices,
            containers: assessment.containers,
            gpus: collected.gpus,
            unenforced: assessment.unenforced,
            regions: self.discovery.len(),
            refused_total: self.discovery.refused_total,
            repaired_total: self.discovery.repaired_total,
            reclaimed_total: self.janitor.reclaimed.load(Ordering::Relaxed),
            reclaims_held_total: self.janitor.held_total.load(Ordering::Relaxed),
            sweeps_total: self.sweeps,
            api_up: match collected.api_state {
                ApiState::Disabled => None,
                state => Some(state == ApiState::Synced),
            },
            loop_seconds: collected.started.elapsed().as_secs_f64(),
        };
        self.shared.publish(snapshot);
    }

    /// The region is writable by the container it limits: what its
    /// decision granted is put back when it was changed from inside (the
    /// first time logged and recorded as an Event, then counted).
    fn restore_limits(&mut self, assessment: &mut Assessment) {
        for restore in &assessment.restores {
            let resized = self
                .reported
                .decision_remade(&restore.key, restore.decided_unix_ms);
            let Some(region) = self.discovery.get(&restore.key) else {
                continue;
            };
            match region.region().restore_limits(&restore.limits) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "container {}: its limits cannot be restored",
                        restore.key
                    );
                    continue;
                }
            }
            if resized {
                // The decision changed (a resize the extender applied), not
                // the region: its new limits are the container's now.
                let message = format!(
                    "container {}: its decision was resized; the new limits are in its region",
                    restore.key
                );
                tracing::info!("{message}");
                record_normal_event(
                    self.events.as_ref(),
                    &restore.pod,
                    region,
                    "Resized",
                    message,
                );
                continue;
            }
            let restored = self.reported.limits_restored(&restore.key);
            let message = format!(
                "container {} changed the limits in its region; the limits its decision granted are restored",
                restore.key
            );
            if restored == 1 {
                tracing::warn!("{message}");
                record_event(
                    self.events.as_ref(),
                    &restore.pod,
                    region,
                    "RegionLimitsChanged",
                    message,
                );
            } else {
                tracing::debug!("{message} (again: {} times)", restored);
            }
        }
        for (key, &index) in &assessment.container_index {
            if let Some(summary) = assessment.containers.get_mut(index) {
                summary.limits_restored = self.reported.restorations(key);
            }
        }
    }

    /// Forgets what is remembered of regions no longer there.
    fn forget_gone(&mut self) {
        let live_keys: HashSet<&str> = self.discovery.regions().map(|r| r.key.as_str()).collect();
        self.tracks
            .retain(|(key, _), _| live_keys.contains(key.as_str()));
        self.reported.keep_live(&live_keys);
        self.reaper.retain(&live_keys);
    }

    /// GPU processes no live slot accounts for; each new one is logged
    /// once and, when its pod is known, recorded as an Event on it.
    fn find_unenforced(&mut self, gpus: &[GpuSample]) -> unenforced::Census {
        let census = {
            let containers: Vec<Container> = self
                .discovery
                .regions()
                .map(|r| Container {
                    key: &r.key,
                    pod_uid: r.pod_uid.as_deref(),
                    region: r.region(),
                    file: (r.identity.device, r.identity.inode),
                    grant_uuids: &r.grant_uuids,
                })
                .collect();
            unenforced::census(
                gpus,
                &containers,
                &self.host_proc,
                self.config.memory_rule.margin_per_process,
                &mut self.owner_cache,
            )
        };
        if census.host_pids_recorded > 0 {
            tracing::debug!(
                "recorded the host PID of {} shim processes",
                census.host_pids_recorded
            );
        }
        let current: HashSet<ProcessId> = census
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
            if self.reported.unenforced(&id) {
                match &process.container {
                    Some(key) => tracing::warn!("{message}; container {key}"),
                    None => tracing::warn!("{message}; it belongs to no container with a region"),
                }
            }
            // The Event waits until the API names the pod (the first passes
            // may come before the pod list).
            if self.reported.unenforced_evented(&id) {
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
                self.reported.mark_unenforced_evented(id);
            }
        }
        self.reported.keep_unenforced(&current);
        census
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
                let Ok(limits) = region.region().writable_limits() else {
                    continue;
                };
                let record = &limits.devices[s.device];
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
            let Ok(limits) = region.region().writable_limits() else {
                continue;
            };
            let record = &limits.devices[*device];
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
