//! What the scheduler extender and the device plugin tell each other.
//!
//! # The protocol
//!
//! Kubelet's `Allocate` call names the devices it picked, not the pod they
//! are for, so the plugin must work out which pod it is serving. vgpu makes
//! that unambiguous by construction, with no lock object that could outlive
//! its pod:
//!
//! 1. **Inventory.** The plugin publishes its node's GPUs as the node
//!    annotation [`NODE_INVENTORY_ANNOTATION`] ([`NodeInventory`], JSON,
//!    versioned), on start and on any change. It shows it is alive by
//!    renewing the node's Lease ([`crate::node_lease`]); the extender gives
//!    nothing new to a node whose Lease ran out.
//! 2. **Decision.** When the extender binds a pod, it writes its choice
//!    (node, and per container the GPUs with memory and cores) as the pod
//!    annotation [`DECISION_ANNOTATION`] ([`Decision`]) in the Binding
//!    itself, whose annotations the API server merges into the pod: a pod
//!    is bound with its decision or not at all.
//! 3. **One pending pod per node.** A pod is *pending* on a node from its
//!    decision until the plugin has allocated all its GPU containers
//!    ([`ALLOCATED_ANNOTATION`]) or kubelet has finished admitting it
//!    ([`kubelet_has_admitted`]), whichever comes first: kubelet calls
//!    `Allocate` for every container while it admits a pod, so an admitted
//!    pod will see no more calls (a container whose resources no vgpu plugin
//!    serves runs without its vGPU instead of blocking the node, and its
//!    decision still counts against the GPUs). The extender never binds a
//!    second vGPU pod to a node that has a pending one, unless the node's
//!    plugin can tell its pending pods apart ([`NodeInventory::several_pending`]:
//!    it asks kubelet's PodResources API which of them kubelet is admitting,
//!    since kubelet lists a pod from the start of its admission and admits
//!    one at a time). This state is derived, not stored:
//!    the extender computes it from the pods it watches, so a deleted,
//!    failed or finished pod stops being pending at once, and a restart of
//!    the extender loses nothing (it rebuilds from the API). Kubelet admits
//!    pods one at a time, so serialising per node costs one admission's time
//!    per pod and nothing else.
//! 4. **Allocate.** The plugin takes the node's pending pod (of several, the
//!    one kubelet lists), checks that the
//!    request matches its next unallocated GPU container (init containers
//!    first, in order, then the others, as kubelet admits them, by device
//!    count), prepares the container's region on the host, and answers
//!    with that container's environment and mounts. The region is the
//!    container's record on the node; the plugin appends the container to
//!    [`ALLOCATED_ANNOTATION`] after the answer (kubelet admits one pod at
//!    a time and waits for the answer, so the answer waits for no API
//!    call), retrying until the API server takes it, with the pod's UID as
//!    a precondition, unless kubelet's status shows the pod admitted by
//!    then (which ends its pending as the record would: in a burst, most
//!    pods, each spared a write every pod watcher receives). A plugin that
//!    tells pending pods apart ([`NodeInventory::several_pending`]) writes
//!    no annotation at all: the extender binds to its node without waiting,
//!    so no one waits for it. Until then it merges the record into every
//!    pod it reads. It may read the pod from a watch, which can be behind:
//!    kubelet's list must show the pod and no pod the watch has not shown;
//!    otherwise it reads the pods afresh. A decision is fixed once its pod
//!    is bound, but for a resize, which reaches the container's region
//!    through the node monitor. A request that matches no pending pod
//!    fails with a message kubelet shows in the pod's events; nothing is
//!    guessed.
//! 5. **Restarts.** Plugin, kubelet and extender keep no state of their own
//!    that the annotations and the regions on the node do not hold, so any
//!    of them may restart at any point. A plugin reads its records back
//!    from the regions (`<pod UID>_<container>`) and publishes those the
//!    annotation lacks (of pods kubelet has not admitted yet): a plugin that dies after preparing a region leaves
//!    a container that was served, or a pod whose admission failed
//!    (kubelet reports it; its controller replaces it), never a container
//!    served twice or a later container matched to the wrong record.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use vgpu_node_contract::region::limits::granted::DeviceShare;

/// Node annotation holding the plugin's [`NodeInventory`].
pub const NODE_INVENTORY_ANNOTATION: &str = "vgpu.io/node-gpus";
/// Pod annotation holding the extender's [`Decision`].
pub const DECISION_ANNOTATION: &str = "vgpu.io/decision";
/// Pod annotation listing the containers the plugin has allocated
/// (JSON array of container names).
pub const ALLOCATED_ANNOTATION: &str = "vgpu.io/allocated";
/// Version of the JSON formats in this module.
pub const FORMAT_VERSION: u32 = 1;

/// One GPU as the plugin advertises it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryGpu {
    pub uuid: String,
    pub index: u32,
    pub model: String,
    /// The GPU's physical memory.
    pub memory_bytes: u64,
    /// The memory it offers containers when the node scales memory
    /// (`vgpu_node_contract::region::limits::scaling`, HAMi's `deviceMemoryScaling`): what the
    /// extender counts grants against. Absent (a node without scaling, or
    /// a plugin older than the field): [`Self::memory_bytes`]; an extender
    /// older than the field counts the physical memory, so it never
    /// oversubscribes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered_memory_bytes: Option<u64>,
    pub sm_count: u32,
    /// How many containers may share it at most.
    pub split_count: u32,
    /// NUMA node, if known.
    pub numa: Option<u32>,
    /// NVLink island: the GPUs of the node joined by NVLink, directly or
    /// through an NVSwitch, share one number (the lowest NVML index among
    /// them). `None`: no active NVLink (or a plugin that does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_island: Option<u32>,
    pub healthy: bool,
    /// SM utilization the node agent measures, smoothed, in percent
    /// (0-100): what the `load-aware` policies place by. `None` until
    /// measured, or from an agent that does not measure it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_percent: Option<u32>,
}

impl InventoryGpu {
    /// The memory grants on this GPU may add up to.
    pub fn offered_bytes(&self) -> u64 {
        self.offered_memory_bytes.unwrap_or(self.memory_bytes)
    }
}

/// A node's GPUs, as published by its plugin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventory {
    pub version: u32,
    pub gpus: Vec<InventoryGpu>,
    /// The node's plugin tells which pending pod an `Allocate` serves from
    /// kubelet's PodResources API, so the node may hold several pending
    /// pods at once. False (or absent, as from an older plugin or one that
    /// cannot reach that API): one at a time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub several_pending: bool,
}

/// One GPU granted to a container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceGrant {
    pub uuid: String,
    /// Device memory cap in bytes.
    pub memory_bytes: u64,
    /// Compute share in percent (100: the whole GPU, exclusively).
    pub cores_percent: u32,
    /// How far above its share the container may run while the GPU has
    /// idle capacity (the node monitor lends it and takes it back), in
    /// percent; absent: never above the share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_percent: Option<u32>,
}

impl DeviceGrant {
    /// The grant's memory, share and burst, as the node's limits are made
    /// from them (`vgpu_node_contract::region::limits::granted`).
    pub fn share(&self) -> DeviceShare {
        DeviceShare {
            memory_bytes: self.memory_bytes,
            cores_percent: self.cores_percent,
            burst_percent: self.burst_percent,
        }
    }
}

/// What one container gets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDecision {
    pub name: String,
    /// An init container (kubelet admits those first).
    pub init: bool,
    pub devices: Vec<DeviceGrant>,
    /// `CUDA_TASK_PRIORITY` for the container, if requested.
    pub priority: Option<i32>,
}

/// The extender's choice for a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    pub version: u32,
    pub node: String,
    pub decided_unix_ms: u64,
    /// GPU containers only, in kubelet's admission order.
    pub containers: Vec<ContainerDecision>,
}

/// An annotation that could not be used.
#[derive(Debug, Error)]
pub enum FormatError {
    #[error("{annotation}: not valid JSON of the expected shape")]
    Json {
        annotation: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{annotation}: format version {found}, this build understands {FORMAT_VERSION}")]
    Version {
        annotation: &'static str,
        found: u32,
    },
    #[error("{annotation}: {what}")]
    Invalid {
        annotation: &'static str,
        what: String,
    },
}

fn parse<T: for<'de> Deserialize<'de>>(
    annotation: &'static str,
    text: &str,
) -> Result<T, FormatError> {
    serde_json::from_str(text).map_err(|source| FormatError::Json { annotation, source })
}

impl NodeInventory {
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let inventory: Self = parse(NODE_INVENTORY_ANNOTATION, text)?;
        if inventory.version != FORMAT_VERSION {
            return Err(FormatError::Version {
                annotation: NODE_INVENTORY_ANNOTATION,
                found: inventory.version,
            });
        }
        if let Some(gpu) = inventory.gpus.iter().find(|g| g.split_count == 0) {
            return Err(FormatError::Invalid {
                annotation: NODE_INVENTORY_ANNOTATION,
                what: format!("{} has a split count of 0", gpu.uuid),
            });
        }
        Ok(inventory)
    }

    pub fn to_json(&self) -> String {
        // Serialising plain structs of strings and numbers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

impl Decision {
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let decision: Self = parse(DECISION_ANNOTATION, text)?;
        if decision.version != FORMAT_VERSION {
            return Err(FormatError::Version {
                annotation: DECISION_ANNOTATION,
                found: decision.version,
            });
        }
        if let Some(container) = decision.containers.iter().find(|c| {
            c.devices.is_empty()
                || c.devices
                    .iter()
                    .any(|d| d.cores_percent > 100 || d.burst_percent.is_some_and(|b| b > 100))
        }) {
            return Err(FormatError::Invalid {
                annotation: DECISION_ANNOTATION,
                what: format!(
                    "container {} has no devices, or a share or burst over 100 %",
                    container.name
                ),
            });
        }
        Ok(decision)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The first container not in `allocated`, in admission order.
    pub fn next_unallocated(&self, allocated: &[String]) -> Option<&ContainerDecision> {
        self.containers
            .iter()
            .find(|c| !allocated.contains(&c.name))
    }

    /// Whether every GPU container has been allocated.
    pub fn is_complete(&self, allocated: &[String]) -> bool {
        self.next_unallocated(allocated).is_none()
    }
}

/// Whether kubelet is done admitting a pod, from the pod's status: its
/// phase has left `Pending` (running, or rejected as `Failed`), or kubelet
/// has reported container statuses, which it writes only after admission
/// (so a pod pulling a large image no longer holds its node). Kubelet has
/// made every `Allocate` call for an admitted pod.
pub fn kubelet_has_admitted(phase: Option<&str>, reports_container_statuses: bool) -> bool {
    let still_pending = matches!(phase, None | Some("") | Some("Pending"));
    !still_pending || reports_container_statuses
}

/// Parses [`ALLOCATED_ANNOTATION`].
pub fn parse_allocated(text: &str) -> Result<Vec<String>, FormatError> {
    parse(ALLOCATED_ANNOTATION, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_ends_when_the_phase_moves_or_statuses_appear() {
        assert!(!kubelet_has_admitted(None, false));
        assert!(!kubelet_has_admitted(Some(""), false));
        assert!(!kubelet_has_admitted(Some("Pending"), false));
        assert!(kubelet_has_admitted(Some("Pending"), true));
        assert!(kubelet_has_admitted(Some("Running"), false));
        assert!(kubelet_has_admitted(Some("Failed"), false));
        assert!(kubelet_has_admitted(Some("Succeeded"), false));
        assert!(kubelet_has_admitted(Some("Unknown"), false));
    }

    fn decision() -> Decision {
        Decision {
            version: FORMAT_VERSION,
            node: "node-1".into(),
            decided_unix_ms: 1,
            containers: vec![
                ContainerDecision {
                    name: "setup".into(),
                    init: true,
                    devices: vec![DeviceGrant {
                        uuid: "GPU-a".into(),
                        memory_bytes: 1 << 30,
                        cores_percent: 10,
                        burst_percent: None,
                    }],
                    priority: None,
                },
                ContainerDecision {
                    name: "main".into(),
                    init: false,
                    devices: vec![DeviceGrant {
                        uuid: "GPU-b".into(),
                        memory_bytes: 4 << 30,
                        cores_percent: 50,
                        burst_percent: None,
                    }],
                    priority: Some(0),
                },
            ],
        }
    }

    #[test]
    fn decisions_round_trip_and_track_allocation_order() {
        let original = decision();
        let parsed = Decision::parse(&original.to_json()).expect("parse");
        assert_eq!(parsed, original);
        assert_eq!(
            parsed.next_unallocated(&[]).map(|c| c.name.as_str()),
            Some("setup")
        );
        let allocated = vec!["setup".to_string()];
        assert_eq!(
            parsed.next_unallocated(&allocated).map(|c| c.name.as_str()),
            Some("main")
        );
        assert!(parsed.is_complete(&["setup".into(), "main".into()]));
    }

    #[test]
    fn bad_annotations_are_refused_with_their_name() {
        for text in ["", "{", "[]", r#"{"version":1}"#] {
            let error = Decision::parse(text).expect_err(text);
            assert!(error.to_string().contains(DECISION_ANNOTATION), "{error}");
        }
        let mut future = decision();
        future.version = 7;
        assert!(matches!(
            Decision::parse(&future.to_json()),
            Err(FormatError::Version { found: 7, .. })
        ));
        let mut greedy = decision();
        greedy.containers[1].devices[0].cores_percent = 150;
        assert!(matches!(
            Decision::parse(&greedy.to_json()),
            Err(FormatError::Invalid { .. })
        ));
        let mut bursting = decision();
        bursting.containers[1].devices[0].burst_percent = Some(101);
        assert!(matches!(
            Decision::parse(&bursting.to_json()),
            Err(FormatError::Invalid { .. })
        ));
    }

    #[test]
    fn burst_is_optional_in_the_format() {
        let mut original = decision();
        assert!(!original.to_json().contains("burstPercent"));
        original.containers[1].devices[0].burst_percent = Some(80);
        let text = original.to_json();
        assert!(text.contains(r#""burstPercent":80"#), "{text}");
        assert_eq!(Decision::parse(&text).expect("parse"), original);
    }

    #[test]
    fn inventories_round_trip() {
        let inventory = NodeInventory {
            version: FORMAT_VERSION,
            gpus: vec![InventoryGpu {
                utilization_percent: None,
                offered_memory_bytes: None,
                uuid: "GPU-a".into(),
                index: 0,
                model: "NVIDIA H100".into(),
                memory_bytes: 80 << 30,
                sm_count: 132,
                split_count: 10,
                numa: Some(0),
                nvlink_island: None,
                healthy: true,
            }],
            several_pending: false,
        };
        let text = inventory.to_json();
        assert!(!text.contains("severalPending"), "{text}");
        let parsed = NodeInventory::parse(&text).expect("parse");
        assert_eq!(parsed, inventory);
        let several = NodeInventory {
            several_pending: true,
            ..inventory.clone()
        };
        let text = several.to_json();
        assert!(text.contains(r#""severalPending":true"#), "{text}");
        assert_eq!(NodeInventory::parse(&text).expect("parse"), several);
        // Written by a plugin from before node Leases: its heartbeat is
        // ignored.
        let older = inventory
            .to_json()
            .replacen('{', r#"{"heartbeatUnixMs":1,"#, 1);
        assert_eq!(NodeInventory::parse(&older).expect("parse"), inventory);
        let mut broken = inventory;
        broken.gpus[0].split_count = 0;
        assert!(NodeInventory::parse(&broken.to_json()).is_err());
    }

    #[test]
    fn the_nvlink_island_is_optional_in_the_format() {
        // An inventory from a plugin that predates NVLink islands.
        let old = r#"{"version":1,"heartbeatUnixMs":5,"gpus":[{"uuid":"GPU-a","index":0,
            "model":"m","memoryBytes":1024,"smCount":1,"splitCount":2,"numa":null,"healthy":true}]}"#;
        let mut parsed = NodeInventory::parse(old).expect("parse");
        assert_eq!(parsed.gpus[0].nvlink_island, None);
        assert!(!parsed.to_json().contains("nvlinkIsland"));
        parsed.gpus[0].nvlink_island = Some(2);
        let text = parsed.to_json();
        assert!(text.contains(r#""nvlinkIsland":2"#), "{text}");
        assert_eq!(NodeInventory::parse(&text).expect("parse"), parsed);
    }

    #[test]
    fn offered_memory_is_optional_in_the_format() {
        // An annotation written before the field existed (or by a node
        // without scaling) offers the physical memory.
        let old = r#"{"version":1,"heartbeatUnixMs":5,"gpus":[{"uuid":"GPU-a","index":0,
            "model":"m","memoryBytes":1024,"smCount":1,"splitCount":2,"numa":null,"healthy":true}]}"#;
        let parsed = NodeInventory::parse(old).expect("parse");
        assert_eq!(parsed.gpus[0].offered_memory_bytes, None);
        assert_eq!(parsed.gpus[0].offered_bytes(), 1024);
        assert!(!parsed.to_json().contains("offeredMemoryBytes"));
        let mut scaled = parsed;
        scaled.gpus[0].offered_memory_bytes = Some(2048);
        let text = scaled.to_json();
        assert!(text.contains(r#""offeredMemoryBytes":2048"#), "{text}");
        let back = NodeInventory::parse(&text).expect("parse");
        assert_eq!(back.gpus[0].offered_bytes(), 2048);
        assert_eq!(back.gpus[0].memory_bytes, 1024);
    }

    #[test]
    fn allocated_lists() {
        assert_eq!(
            parse_allocated(r#"["a","b"]"#).expect("parse"),
            vec!["a", "b"]
        );
        assert!(parse_allocated("a,b").is_err());
    }
}
