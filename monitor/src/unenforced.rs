//! Every process on a GPU, with who it belongs to and whether the shim
//! accounts for what it holds.
//!
//! NVML lists every process with a context on a GPU by host PID, with the
//! device memory the driver gives it. Who it belongs to comes from what
//! the node keeps ([`crate::owners`]), never from a region. A process is
//! *unenforced* when what NVML says it holds on a GPU is more than the
//! shim charged to it in its container's region, by more than what a
//! context holds outside any allocation (the backstop's margin): it runs
//! without the shim (the preload did not happen: a failed mount, a static
//! binary, a program that finds the driver's entry points itself), or with
//! a slot it wrote itself. A slot a process forged can only claim memory it
//! holds; it never makes a process look charged for more than it was. The
//! loader only prints "cannot be preloaded ... ignored" into the program's
//! own stderr; this is how the operator hears of it.
//!
//! A shim process inside a container that mounted its own `/proc` sees only
//! its container's PID; the monitor (in the host's PID namespace) finds such
//! a process by the region file it maps and records its host PID in the
//! slot, so the shim's NVML process list works.

use crate::host_proc::HostProc;
use crate::owners::{Owner, Owners};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use vgpu_node_contract::region::{Region, MAX_DEVICES, MAX_SLOTS};
use vgpu_nvml_host::GpuSample;

/// A container region as the census needs it.
pub struct Container<'a> {
    /// The region's directory name (`<pod uid>_<container>`).
    pub key: &'a str,
    pub pod_uid: Option<&'a str>,
    pub region: &'a Region,
    /// The region file's device and inode, to recognise processes that map it.
    pub file: (u64, u64),
    /// The UUID of each of the region's devices, in its order, as the
    /// node's grant names them (empty without a grant: the UUIDs its shim
    /// recorded are read instead).
    pub grant_uuids: &'a [String],
}

impl Container<'_> {
    /// The region's device index of GPU `uuid`.
    fn device_of(&self, uuid: &str) -> Option<usize> {
        if !self.grant_uuids.is_empty() {
            return self.grant_uuids.iter().position(|u| u == uuid);
        }
        (0..MAX_DEVICES).find(|&device| self.region.device_uuid(device).as_deref() == Some(uuid))
    }
}

/// A process using a GPU without the shim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unenforced {
    pub gpu_uuid: String,
    /// Host PID.
    pub pid: u32,
    /// Device memory NVML says it holds (0 when the driver does not say).
    pub used_bytes: u64,
    /// The key of the container it belongs to, when that can be told.
    pub container: Option<String>,
}

/// One process's use of one GPU, with its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessUse {
    pub gpu_uuid: String,
    /// Host PID.
    pub pid: u32,
    pub owner: Owner,
    /// What NVML says it holds.
    pub used_bytes: u64,
    /// What its container's shim charged to it on that GPU (0: none).
    pub charged_bytes: u64,
    /// Percent of the GPU's time its kernels ran over NVML's window (0
    /// when the driver does not say).
    pub sm_percent: u32,
}

/// What one pass found.
#[derive(Debug, Default)]
pub struct Census {
    pub unenforced: Vec<Unenforced>,
    /// Every GPU process NVML lists.
    pub uses: Vec<ProcessUse>,
    /// Slots whose host PID the monitor recorded in this pass.
    pub host_pids_recorded: usize,
}

/// A live slot of a container.
struct Slot {
    container: usize,
    index: usize,
    /// PID inside the container.
    pid: u32,
    /// PID NVML knows it by, as the slot says.
    nvml_pid: u32,
}

/// The owners of the processes seen in earlier passes, by host PID: a
/// process keeps its pod, mounts and regions for its life, so `/proc` is
/// read once per process rather than every pass. Kept only for the PIDs
/// NVML still lists, and to be cleared whenever the regions change.
pub type OwnerCache = HashMap<u32, Owner>;

/// Owners looked up in `/proc` in one pass at most (a few reads each); the
/// processes past it are left to the next passes, neither judged nor
/// reported meanwhile, so that many processes appearing at once (a burst of
/// pods) spread their cost over passes instead of stalling one: 100 at once
/// are all placed within 7 passes (700 ms).
pub const OWNER_LOOKUPS_PER_PASS: usize = 16;

/// Compares the GPUs' processes with what the containers' shims charged.
/// `margin` is what a process may hold beyond its charge (a context's
/// memory outside any allocation).
pub fn census(
    gpus: &[GpuSample],
    containers: &[Container],
    proc: &HostProc,
    margin: u64,
    cache: &mut OwnerCache,
) -> Census {
    // Built only when a process's owner is not remembered.
    let mut owners: Option<Owners> = None;
    let mut namespaces: Option<HashMap<PathBuf, usize>> = None;
    let mut slots = Vec::new();
    for (c, container) in containers.iter().enumerate() {
        let layout = container.region.layout();
        for index in container.region.active_slots().take(MAX_SLOTS) {
            let slot = &layout.slots[index];
            slots.push(Slot {
                container: c,
                index,
                pid: slot.pid.load(Ordering::Relaxed),
                nvml_pid: slot.nvml_pid(),
            });
        }
    }
    let mut census = Census::default();
    let mut recorded: HashSet<u32> = HashSet::new();
    let mut lookups = 0;
    for gpu in gpus {
        for process in &gpu.compute_processes {
            let owner = match cache.get(&process.pid) {
                Some(owner) => owner.clone(),
                None if lookups >= OWNER_LOOKUPS_PER_PASS => continue,
                None => {
                    lookups += 1;
                    let owners = owners.get_or_insert_with(|| {
                        Owners::new(containers.iter().map(|c| (c.key, c.pod_uid)))
                    });
                    let owner = owner_of(
                        process.pid,
                        owners,
                        containers,
                        &slots,
                        &mut namespaces,
                        proc,
                    );
                    cache.insert(process.pid, owner.clone());
                    owner
                }
            };
            let own = match &owner {
                Owner::Region(key) => containers.iter().position(|c| c.key == key),
                _ => None,
            };
            if let Some(c) = own {
                if !recorded.contains(&process.pid) {
                    if let Some(slot) =
                        record_host_pid(process.pid, c, &containers[c], &slots, proc)
                    {
                        slots[slot].nvml_pid = process.pid;
                        recorded.insert(process.pid);
                        census.host_pids_recorded += 1;
                    }
                }
            }
            let used = process.used_bytes.unwrap_or(0);
            let has_slot = own.is_some_and(|c| {
                slots
                    .iter()
                    .any(|s| s.container == c && s.nvml_pid == process.pid)
            });
            let charged = own.map_or(0, |c| {
                charged_to(process.pid, &containers[c], c, &slots, &gpu.uuid)
            });
            if !has_slot || used > charged.saturating_add(margin) {
                census.unenforced.push(Unenforced {
                    gpu_uuid: gpu.uuid.clone(),
                    pid: process.pid,
                    used_bytes: used,
                    container: own.map(|c| containers[c].key.to_string()),
                });
            }
            census.uses.push(ProcessUse {
                gpu_uuid: gpu.uuid.clone(),
                pid: process.pid,
                owner,
                used_bytes: used,
                charged_bytes: charged,
                sm_percent: gpu
                    .process_sm_percent
                    .get(&process.pid)
                    .copied()
                    .unwrap_or(0),
            });
        }
    }
    let listed: HashSet<u32> = gpus
        .iter()
        .flat_map(|gpu| gpu.compute_processes.iter().map(|p| p.pid))
        .collect();
    cache.retain(|pid, _| listed.contains(pid));
    census
}

/// Who process `pid` belongs to ([`Owners`]). A process of no pod is the
/// host's (on a workstation, `vgpu run`'s; no tenant's, whose processes are
/// all in their pod's cgroup): it belongs to the region it maps, if any,
/// else to the region mapped by a process of its PID namespace (not the
/// host's own), as the other processes of a `vgpu run` container are.
/// `namespaces` (the PID namespace of each region's processes) is read
/// once, when first needed.
fn owner_of(
    pid: u32,
    owners: &Owners,
    containers: &[Container],
    slots: &[Slot],
    namespaces: &mut Option<HashMap<PathBuf, usize>>,
    proc: &HostProc,
) -> Owner {
    let owner = owners.owner_of(pid, proc);
    if owner != Owner::Unknown {
        return owner;
    }
    let files = proc.mapped_files(pid);
    if let Some(mapped) = containers.iter().find(|c| files.contains(&c.file)) {
        return Owner::Region(mapped.key.to_string());
    }
    let Some(namespace) = proc.pid_namespace(pid) else {
        return Owner::Unknown;
    };
    if proc.pid_namespace(1).as_ref() == Some(&namespace) {
        return Owner::Unknown;
    }
    let namespaces = namespaces.get_or_insert_with(|| {
        let mut found = HashMap::new();
        for slot in slots {
            let Some(namespace) = proc.pid_namespace(slot.nvml_pid) else {
                continue;
            };
            if !found.contains_key(&namespace)
                && proc
                    .mapped_files(slot.nvml_pid)
                    .contains(&containers[slot.container].file)
            {
                found.insert(namespace, slot.container);
            }
        }
        found
    });
    namespaces.get(&namespace).map_or(Owner::Unknown, |&c| {
        Owner::Region(containers[c].key.to_string())
    })
}

/// What the slots of `container` naming `pid` charged on the GPU `uuid`.
fn charged_to(pid: u32, container: &Container, c: usize, slots: &[Slot], uuid: &str) -> u64 {
    let Some(device) = container.device_of(uuid).filter(|d| *d < MAX_DEVICES) else {
        return 0;
    };
    let layout = container.region.layout();
    slots
        .iter()
        .filter(|s| s.container == c && s.nvml_pid == pid)
        .map(|s| layout.slots[s.index].devices[device].device_bytes())
        .fold(0u64, u64::saturating_add)
}

/// Records the host PID of a shim process of `container` that knows only
/// its own (it mapped the region, and a slot holds its in-container PID but
/// not this host PID). Returns the index in `slots` of the slot it
/// recorded it in.
fn record_host_pid(
    pid: u32,
    c: usize,
    container: &Container,
    slots: &[Slot],
    proc: &HostProc,
) -> Option<usize> {
    if slots.iter().any(|s| s.container == c && s.nvml_pid == pid) {
        return None;
    }
    if !proc.mapped_files(pid).contains(&container.file) {
        return None;
    }
    let inner = proc.nspid(pid).and_then(|l| l.last().copied());
    let found = slots
        .iter()
        .position(|s| s.container == c && Some(s.pid) == inner && s.nvml_pid != pid)?;
    container.region.layout().slots[slots[found].index]
        .host_pid
        .store(pid, Ordering::Relaxed);
    Some(found)
}
