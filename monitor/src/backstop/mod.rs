//! Caps held from outside the container: from the driver's own accounting
//! (NVML's per-process memory), whatever a container's processes loaded or
//! wrote. The shim refuses an allocation before the driver is asked; a
//! process that never goes through the shim (it unset nothing the node
//! set, but it found the driver's entry points itself, or runs without the
//! preload, or forged its region) is held here instead, after the fact:
//!
//! - [`memory`]: a container whose processes hold more of a GPU's memory
//!   than its grant (plus a margin for what a context holds outside any
//!   allocation), for [`MemoryRule::samples`] samples in a row, has the
//!   process that took it there killed (or, with
//!   [`OverCapAction::Report`], reported).
//! - [`signal`]: signals a host process only while it is still the one
//!   judged (a PID reused in between is never signalled).

pub mod memory;
pub mod signal;

pub use memory::{Breach, MemoryBackstop, MemoryRule, OverCapAction};

use crate::assess::Restore;
use crate::discovery::ContainerRegion;
use std::collections::HashMap;
use vgpu_node_contract::region::MAX_DEVICES;

/// Each region's memory cap on each GPU, as the node granted it (region
/// key and GPU UUID to bytes), and each region's pod (region key to pod
/// UID): from the node's grant where the region has one, else from the
/// pod's decision (`restores`). A region with neither is held by its own
/// limits only where they are the only record there is (`regions_are_the_record`:
/// a monitor with no API, beside `vgpu run` on a workstation, whose
/// regions record the GPUs their shim used); elsewhere by nothing here.
pub fn granted_caps<'a>(
    regions: impl Iterator<Item = &'a ContainerRegion>,
    restores: &[Restore],
    regions_are_the_record: bool,
) -> (HashMap<(String, String), u64>, HashMap<String, String>) {
    let mut caps = HashMap::new();
    let mut pod_of = HashMap::new();
    for region in regions {
        if let Some(uid) = &region.pod_uid {
            pod_of.insert(region.key.clone(), uid.clone());
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
        for (device, uuid) in uuids.iter().enumerate().take(limits.memory_limit.len()) {
            if uuid.is_empty() {
                continue;
            }
            caps.insert(
                (region.key.clone(), uuid.clone()),
                limits.memory_limit[device],
            );
        }
    }
    (caps, pod_of)
}
