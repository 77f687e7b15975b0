//! A pass's reading of each region: what its container and each of its
//! devices show (for the metrics), what each device brings to its GPU's
//! arbitration, and the limits to put back if they were changed from
//! inside; the anomalies found on the way are reported once
//! ([`Reported`]).
//!
//! The scheduler's decision (or a DRA claim's record), not the container's
//! own region, says which GPUs a container may use, with what share and at
//! what priority, and the node's configuration says under which policy: the
//! region is writable by the container it limits. Only a monitor with no
//! API behind it (`vgpu run` on a machine without Kubernetes) takes
//! priority and policy from the region, which is then the only record.

use crate::activity::{granted_rate, is_metered, observe, observe_waits, record_history, Track};
use crate::arbitration::{Contender, Load};
use crate::config::MonitorConfig;
use crate::discovery::ContainerRegion;
use crate::events::{EventRecorder, PodRef};
use crate::metrics::{ContainerDevice, ContainerSummary};
use crate::names::{ApiState, PodDirectory, PodRecord};
use crate::reported::Reported;
use crate::unenforced::{ProcessUse, Unenforced};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use vgpu_cluster::decision::DeviceGrant;
use vgpu_node_contract::region::limits::granted::{device_order, region_limits};
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::DEFAULT_PRIORITY;
use vgpu_node_contract::region::{RegionLimits, MAX_DEVICES, SHARE_FULL, SHARE_UNLIMITED};
use vgpu_nvml_host::GpuSample;

/// What is remembered of each container device between passes, by
/// (container key, device index).
pub type Tracks = HashMap<(String, usize), Track>;

/// One container device as its GPU's arbitration sees it.
pub struct Seen {
    pub key: String,
    pub device: usize,
    pub uuid: String,
    pub contender: Contender,
}

/// The limits a container's decision granted, to be put back in its
/// region if they were changed from inside.
pub struct Restore {
    pub key: String,
    pub limits: RegionLimits,
    /// The UUIDs of the GPUs granted, in the limits' device order.
    pub uuids: Vec<String>,
    /// When the decision granting them was made (none for a DRA claim's).
    pub decided_unix_ms: Option<u64>,
    /// The pod the API named, for an Event.
    pub pod: Option<PodRecord>,
}

/// What the regions came to in one pass, in the order read.
#[derive(Default)]
pub struct Assessment {
    pub containers: Vec<ContainerSummary>,
    /// A container's key to its index in `containers`.
    pub container_index: HashMap<String, usize>,
    /// Every container device shown, in the order of `seen`.
    pub devices: Vec<ContainerDevice>,
    pub seen: Vec<Seen>,
    pub restores: Vec<Restore>,
    /// GPU processes no region accounts for.
    pub unenforced: Vec<Unenforced>,
    /// Every GPU process, with its owner.
    pub uses: Vec<ProcessUse>,
}

/// What a pass knows before it reads the regions.
pub struct PassContext<'a> {
    pub config: &'a MonitorConfig,
    pub pods: &'a PodDirectory,
    pub events: Option<&'a EventRecorder>,
    /// Monotonic ns at the start of the pass.
    pub now: u64,
    /// The host's GPUs as NVML sampled them (none without NVML).
    pub gpus: &'a [GpuSample],
}

/// Per GPU UUID, each process's SM utilization as NVML sampled it.
pub fn process_util_by_uuid(gpus: &[GpuSample]) -> HashMap<&str, &HashMap<u32, u32>> {
    gpus.iter()
        .filter(|g| !g.uuid.is_empty())
        .map(|g| (g.uuid.as_str(), &g.process_sm_percent))
        .collect()
}

/// Reads `region` and adds what it shows to `out`.
pub fn assess_region(
    region: &ContainerRegion,
    context: &PassContext<'_>,
    process_util: &HashMap<&str, &HashMap<u32, u32>>,
    tracks: &mut Tracks,
    reported: &mut Reported,
    out: &mut Assessment,
) {
    let config = context.config;
    let now = context.now;
    let figures = region.read();
    let pod = region
        .pod_uid
        .as_deref()
        .and_then(|uid| context.pods.lookup(uid));
    let (namespace, pod_name) = match (&pod, &region.claim) {
        (Some(pod), _) => (pod.namespace.clone(), pod.name.clone()),
        // A DRA claim's region: its pods share it.
        (None, Some(claim)) => (claim.namespace.clone(), claim.pods.join(",")),
        (None, None) => (
            String::new(),
            region.pod_uid.clone().unwrap_or_else(|| region.key.clone()),
        ),
    };
    // With an API, what the container wrote is never its priority or
    // policy: a forged priority would pause every neighbour.
    let region_is_the_record = context.pods.state() == ApiState::Disabled;
    let priority = pod
        .as_ref()
        .and_then(|p| p.priorities.get(&region.container).copied())
        .unwrap_or(if region_is_the_record {
            figures.priority
        } else {
            DEFAULT_PRIORITY
        });
    let policy_raw = if region_is_the_record {
        figures.policy
    } else {
        config.node.policy as u32
    };
    out.container_index
        .insert(region.key.clone(), out.containers.len());
    // A DRA claim's series are named by the claim.
    let container_name = region
        .claim
        .as_ref()
        .map_or_else(|| region.container.clone(), |claim| claim.claim.clone());
    out.containers.push(ContainerSummary {
        namespace: namespace.clone(),
        pod: pod_name.clone(),
        container: container_name.clone(),
        processes: figures.active_slots,
        ..ContainerSummary::default()
    });
    let policy = UtilizationPolicy::from_u32(policy_raw);
    // A DRA claim's grants, from the driver's record.
    let claim_grants: Option<Vec<DeviceGrant>> = region
        .claim
        .as_ref()
        .filter(|claim| !claim.grants.is_empty())
        .map(|claim| {
            claim
                .grants
                .iter()
                .map(|grant| DeviceGrant {
                    uuid: grant.uuid.clone(),
                    memory_bytes: grant.memory_bytes,
                    cores_percent: grant.cores_percent,
                    burst_percent: grant.burst_percent,
                })
                .collect()
        });
    let granted: Option<&[DeviceGrant]> = pod
        .as_ref()
        .and_then(|p| p.grants.get(&region.container))
        .map(Vec::as_slice)
        .or(claim_grants.as_deref());
    for device in &figures.devices {
        // The decision, not the container's own region, says which GPUs
        // it may use and with what share.
        let mut device = device.clone();
        let mut over_cap_bytes = 0;
        if let Some(grants) = granted {
            match grants.iter().find(|g| g.uuid == device.uuid) {
                Some(grant) => {
                    device.sm_limit = grant.cores_percent;
                    device.sm_burst = grant.burst_percent.unwrap_or(0);
                    // Restoring a cap frees nothing: what was taken above
                    // it while it was raised stays visible. The cap is the
                    // grant's device part (all of it unless the node
                    // scales memory).
                    let cap = config.node.memory(grant.memory_bytes).device;
                    if cap > 0 {
                        over_cap_bytes = device.memory_used.saturating_sub(cap);
                    }
                }
                None => {
                    if reported.misplaced(&region.key, device.index) {
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
        if reported.over_cap(&region.key, device.index, over_cap_bytes > 0) {
            let message = format!(
                "container {} holds {} MiB on GPU {} above the {} MiB its decision granted",
                region.key,
                over_cap_bytes >> 20,
                device.uuid,
                device.memory_used.saturating_sub(over_cap_bytes) >> 20
            );
            tracing::warn!("{message}");
            record_event(context.events, &pod, region, "MemoryOverCap", message);
        }
        let track = tracks
            .entry((region.key.clone(), device.index))
            .or_default();
        let nvml_active = process_util.get(device.uuid.as_str()).is_some_and(|util| {
            figures
                .pids
                .iter()
                .any(|pid| util.get(pid).is_some_and(|u| *u > 0))
        });
        let active = observe(track, device, nvml_active, now, config.active_window);
        let waited = observe_waits(track, device.throttled_ns, now, config.utilization_window);
        let metered = is_metered(policy, device.sm_limit, device.sm_effective);
        let utilization = if metered {
            granted_rate(track, device.granted_ns, now, config.utilization_window)
        } else {
            record_history(track, device.granted_ns, now, config.utilization_window);
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
        out.devices.push(ContainerDevice {
            namespace: namespace.clone(),
            pod: pod_name.clone(),
            container: container_name.clone(),
            figures: device.clone(),
            priority,
            utilization,
            last_kernel_age_seconds: last_kernel.map(|t| now.saturating_sub(t) as f64 / 1e9),
            over_cap_bytes,
        });
        let load = utilization.filter(|_| metered).map(|ratio| Load {
            achieved: (ratio * f64::from(SHARE_FULL)).round() as u32,
            waited,
        });
        out.seen.push(Seen {
            key: region.key.clone(),
            device: device.index,
            uuid: device.uuid.clone(),
            contender: Contender::from_raw(
                region.key.clone(),
                policy_raw,
                priority,
                device.sm_limit,
                device.sm_burst,
                active,
            )
            .with_load(load),
        });
    }
    // The region is writable by the container it limits: what the
    // decision granted is put back if it was changed from inside.
    if let Some(grants) = granted.filter(|_| config.restore) {
        let mut ordered: Vec<&DeviceGrant> = grants.iter().collect();
        // Devices are numbered as the device plugin numbered them; without
        // NVML, in the decision's order.
        device_order(&mut ordered, |g| {
            context
                .gpus
                .iter()
                .find(|s| s.uuid == g.uuid)
                .map(|s| s.index)
        });
        let priority = pod
            .as_ref()
            .and_then(|p| p.priorities.get(&region.container).copied());
        out.restores.push(Restore {
            key: region.key.clone(),
            limits: region_limits(ordered.iter().map(|g| g.share()), priority, &config.node),
            uuids: ordered.iter().map(|g| g.uuid.clone()).collect(),
            decided_unix_ms: pod.as_ref().and_then(|p| p.decided_unix_ms),
            pod,
        });
    }
}

/// An Event on the pod of `region`, when the API names it: a Warning,
/// or with `normal` a Normal one.
pub fn record_event(
    events: Option<&EventRecorder>,
    pod: &Option<PodRecord>,
    region: &ContainerRegion,
    reason: &str,
    message: String,
) {
    record(events, pod, region, reason, message, false);
}

/// A Normal Event on the pod of `region`, when the API names it.
pub fn record_normal_event(
    events: Option<&EventRecorder>,
    pod: &Option<PodRecord>,
    region: &ContainerRegion,
    reason: &str,
    message: String,
) {
    record(events, pod, region, reason, message, true);
}

fn record(
    events: Option<&EventRecorder>,
    pod: &Option<PodRecord>,
    region: &ContainerRegion,
    reason: &str,
    message: String,
    normal: bool,
) {
    let (Some(events), Some(pod), Some(uid)) = (events, pod, region.pod_uid.as_deref()) else {
        return;
    };
    let pod = PodRef {
        namespace: &pod.namespace,
        name: &pod.name,
        uid,
    };
    if normal {
        events.normal(&pod, reason, message);
    } else {
        events.warn(&pod, reason, message);
    }
}

/// What the node granted each region on each GPU, keyed by region key and
/// GPU UUID, and each region's pod.
#[derive(Debug, Default)]
pub struct Granted {
    /// Memory caps in bytes ([`vgpu_node_contract::region::UNCAPPED`]: none).
    pub caps: HashMap<(String, String), u64>,
    /// Compute shares in percent (0: none): the configured share, or the
    /// effective one the monitor lent it where that is more.
    pub shares: HashMap<(String, String), u32>,
    /// Region key to its pod's UID.
    pub pod_of: HashMap<String, String>,
}

/// Each region's memory cap and compute share on each GPU, as the node
/// granted them, and each region's pod: from the node's grant where the
/// region has one, else from the pod's decision (`restores`). A region
/// with neither is held by its own limits only where they are the only
/// record there is (`regions_are_the_record`: a monitor with no API,
/// beside `vgpu run` on a workstation, whose regions record the GPUs their
/// shim used); elsewhere by nothing here.
pub fn granted<'a>(
    regions: impl Iterator<Item = &'a ContainerRegion>,
    restores: &[Restore],
    regions_are_the_record: bool,
) -> Granted {
    let mut granted = Granted::default();
    for region in regions {
        if let Some(uid) = &region.pod_uid {
            granted.pod_of.insert(region.key.clone(), uid.clone());
        }
        let recorded: Vec<String>;
        let (uuids, limits) = if region.region().grant().is_some() {
            (&region.grant_uuids, region.region().limits())
        } else if let Some(restore) = restores.iter().find(|r| r.key == region.key) {
            (&restore.uuids, restore.limits)
        } else if regions_are_the_record {
            recorded = (0..MAX_DEVICES)
                .map(|device| region.region().device_uuid(device).unwrap_or_default())
                .collect();
            (&recorded, region.region().limits())
        } else {
            continue;
        };
        let uncapped_compute =
            UtilizationPolicy::from_u32(limits.policy) == Some(UtilizationPolicy::Disable);
        // The share the monitor lent counts only from a grant: a region
        // without one is the container's to write.
        let lent = region
            .region()
            .grant()
            .is_some()
            .then(|| region.region().enforced_limits());
        for (device, uuid) in uuids.iter().enumerate().take(MAX_DEVICES) {
            if uuid.is_empty() {
                continue;
            }
            let id = (region.key.clone(), uuid.clone());
            granted.caps.insert(id.clone(), limits.memory_limit[device]);
            let effective =
                lent.map(|limits| limits.devices[device].sm_effective.load(Ordering::Acquire));
            let share = match (limits.sm_limit[device], effective) {
                (0, _) | (_, Some(SHARE_UNLIMITED)) => 0,
                _ if uncapped_compute => 0,
                (share, Some(effective)) => share.max(effective.div_ceil(SHARE_FULL / 100)),
                (share, None) => share,
            };
            granted.shares.insert(id, share);
        }
    }
    granted
}
