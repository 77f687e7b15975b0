//! What a region holds, read as figures: its devices' limits and use, its
//! process slots. Region files are written by the containers they limit, so
//! every value read may be garbage: counts are bounded by the fixed layout
//! and sums saturate. The node monitor and the `vgpu` command read regions
//! through this one module.
//!
//! Also the naming of the node's container directories, which both sides
//! must agree on: `<podUID>_<container>` for the device plugin's.

use crate::region::{Region, MAX_DEVICES, MAX_SLOTS};
use std::sync::atomic::Ordering;

/// Longest device UUID accepted as a label value.
const MAX_UUID_LEN: usize = 48;

/// One device record of a region, as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceFigures {
    /// The container's ordinal for the device (the record's index).
    pub index: usize,
    pub uuid: String,
    pub memory_used: u64,
    pub memory_limit: u64,
    pub swap_used: u64,
    pub swap_limit: u64,
    pub peak_used: u64,
    pub oom_events: u64,
    /// Sums over the active process slots.
    pub context: u64,
    pub module: u64,
    pub data: u64,
    /// Raw percent values as stored.
    pub sm_limit: u32,
    pub sm_burst: u32,
    /// Basis points or `SHARE_UNLIMITED`, as stored.
    pub sm_effective: u32,
    pub granted_ns: u64,
    pub throttled_ns: u64,
    pub launches: u64,
    pub last_launch_at: u64,
}

/// A region's contents, as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionFigures {
    pub policy: u32,
    pub priority: i32,
    /// Devices with a recorded, well-formed UUID, by index.
    pub devices: Vec<DeviceFigures>,
    /// Slots marked active (their owners may have died since).
    pub active_slots: usize,
    /// Host PIDs of the active slots (the slot's PID when the host PID is
    /// unknown), for matching NVML's per-process figures.
    pub pids: Vec<u32>,
}

/// Reads a region's figures. Every value may be garbage (the file belongs
/// to the container): counts are bounded by the fixed layout and sums
/// saturate.
pub fn read_figures(region: &Region) -> RegionFigures {
    let layout = region.layout();
    let mut context = [0u64; MAX_DEVICES];
    let mut module = [0u64; MAX_DEVICES];
    let mut data = [0u64; MAX_DEVICES];
    let mut pids = Vec::new();
    let mut active_slots = 0usize;
    // `active_slots` walks a bitmap of MAX_SLOTS bits: bounded whatever it holds.
    for index in region.active_slots().take(MAX_SLOTS) {
        let slot = &layout.slots[index];
        active_slots += 1;
        let pid = slot.nvml_pid();
        if pid != 0 {
            pids.push(pid);
        }
        for (device, held) in slot.devices.iter().enumerate() {
            context[device] = context[device].saturating_add(held.context.load(Ordering::Relaxed));
            module[device] = module[device].saturating_add(held.module.load(Ordering::Relaxed));
            data[device] = data[device].saturating_add(held.data.load(Ordering::Relaxed));
        }
    }
    pids.sort_unstable();
    pids.dedup();
    let enforced = region.enforced_limits();
    let devices = layout
        .devices
        .iter()
        .zip(&enforced.devices)
        .enumerate()
        .filter_map(|(index, (record, limits))| {
            let uuid = region.device_uuid(index).filter(|u| valid_uuid(u))?;
            let bucket = &record.compute;
            Some(DeviceFigures {
                index,
                uuid,
                memory_used: record.used.load(Ordering::Relaxed),
                memory_limit: limits.memory_limit.load(Ordering::Relaxed),
                swap_used: record.swap_used.load(Ordering::Relaxed),
                swap_limit: limits.swap_limit.load(Ordering::Relaxed),
                peak_used: record.peak_used.load(Ordering::Relaxed),
                oom_events: record.oom_events.load(Ordering::Relaxed),
                context: context[index],
                module: module[index],
                data: data[index],
                sm_limit: limits.sm_limit.load(Ordering::Relaxed),
                sm_burst: limits.sm_burst.load(Ordering::Relaxed),
                sm_effective: limits.sm_effective.load(Ordering::Relaxed),
                granted_ns: bucket.granted_ns(),
                throttled_ns: bucket.throttled_ns.load(Ordering::Relaxed),
                launches: bucket.launches.load(Ordering::Relaxed),
                last_launch_at: bucket.last_launch_at.load(Ordering::Relaxed),
            })
        })
        .collect();
    RegionFigures {
        policy: enforced.policy.load(Ordering::Relaxed),
        priority: enforced.priority.load(Ordering::Relaxed),
        devices,
        active_slots,
        pids,
    }
}

/// A device UUID fit to be a label value: what NVIDIA prints (`GPU-` or
/// `MIG-` and hex with dashes), loosely: ASCII letters, digits, `-`, `_`,
/// `:` and `.`, at most 48 bytes.
pub fn valid_uuid(uuid: &str) -> bool {
    !uuid.is_empty()
        && uuid.len() <= MAX_UUID_LEN
        && uuid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b':' | b'.'))
}

/// Splits `<podUID>_<container>`. Pod UIDs contain no `_` and container
/// names are DNS labels, so the first `_` separates them.
pub fn split_key(key: &str) -> (Option<String>, String) {
    match key.split_once('_') {
        Some((uid, container)) if !uid.is_empty() => (Some(uid.to_string()), container.to_string()),
        _ => (None, key.to_string()),
    }
}

/// One process slot of a region, as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotFigures {
    /// The slot's index in the region.
    pub index: usize,
    /// PID as the process sees itself (`getpid()`).
    pub pid: u32,
    /// PID on the host (0: not known).
    pub host_pid: u32,
    /// Whether the process still holds its liveness lock; `None` when the
    /// probe failed.
    pub live: Option<bool>,
    /// Device memory charged to the process, per device index, only the
    /// devices it holds any on.
    pub memory: Vec<(usize, u64)>,
    /// Host-memory swap charged to the process, per device index.
    pub swap: Vec<(usize, u64)>,
}

/// The region's active process slots (their owners may have died since:
/// see [`SlotFigures::live`]).
pub fn read_slots(region: &Region) -> Vec<SlotFigures> {
    let layout = region.layout();
    region
        .active_slots()
        .take(MAX_SLOTS)
        .map(|index| {
            let slot = &layout.slots[index];
            let per_device = |bytes: &dyn Fn(usize) -> u64| {
                (0..MAX_DEVICES)
                    .map(|device| (device, bytes(device)))
                    .filter(|(_, held)| *held != 0)
                    .collect::<Vec<_>>()
            };
            SlotFigures {
                index,
                pid: slot.pid.load(Ordering::Relaxed),
                host_pid: slot.host_pid.load(Ordering::Relaxed),
                live: region.slot_is_live(index).ok(),
                memory: per_device(&|device| slot.devices[device].device_bytes()),
                swap: per_device(&|device| slot.devices[device].swap.load(Ordering::Relaxed)),
            }
        })
        .collect()
}

/// Whether any active slot of `region` is held by a live process. A probe
/// that fails counts as live (never treat a region as idle on uncertainty).
pub fn has_live_process(region: &Region) -> bool {
    region
        .active_slots()
        .take(MAX_SLOTS)
        .any(|slot| region.slot_is_live(slot).unwrap_or(true))
}
