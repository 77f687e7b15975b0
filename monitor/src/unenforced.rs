//! Processes on a GPU that no container's shim accounts for.
//!
//! Every process running under the shim holds a live slot in its
//! container's region, which records its PID and its host PID (as far as
//! the process's own `/proc` shows it). NVML lists every process with a
//! context on a GPU by host PID. A process that NVML lists and no live slot
//! accounts for runs without the shim: the preload did not happen (a mount
//! that failed, a wrong path, a static binary, a tenant who unset it), so no
//! cap and no share holds it. The loader only prints "cannot be preloaded
//! ... ignored" into the program's own stderr; this is how the operator
//! hears of it.
//!
//! A shim process inside a container that mounted its own `/proc` sees only
//! its container's PID; the monitor (in the host's PID namespace) finds such
//! a process by the region file it maps and records its host PID in the
//! slot, so it counts as accounted and the shim's NVML process list works.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use vgpu_node_contract::process::nspid;
use vgpu_node_contract::region::{Region, MAX_SLOTS};
use vgpu_nvml_host::GpuSample;

/// A container region as the census needs it.
pub struct Container<'a> {
    /// The region's directory name (`<pod uid>_<container>`).
    pub key: &'a str,
    pub pod_uid: Option<&'a str>,
    pub region: &'a Region,
    /// The region file's device and inode, to recognise processes that map it.
    pub file: (u64, u64),
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

/// What one pass found.
#[derive(Debug, Default)]
pub struct Census {
    pub unenforced: Vec<Unenforced>,
    /// Slots whose host PID the monitor recorded in this pass.
    pub host_pids_recorded: usize,
}

/// Reads `/proc` (the host's, with `hostPID`) for the facts the census needs.
pub struct HostProc {
    root: PathBuf,
}

impl Default for HostProc {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl HostProc {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The process's PIDs, outermost namespace first.
    fn nspid(&self, pid: u32) -> Option<Vec<u32>> {
        let status = std::fs::read_to_string(self.root.join(format!("{pid}/status"))).ok()?;
        nspid(&status)
    }

    /// The PID namespace's identity (`pid:[inode]`).
    fn pid_namespace(&self, pid: u32) -> Option<PathBuf> {
        std::fs::read_link(self.root.join(format!("{pid}/ns/pid"))).ok()
    }

    /// The pod UID in the process's cgroup path (kubelet's layout, either
    /// cgroup driver: `pod<uid>` with dashes or underscores).
    fn pod_uid(&self, pid: u32) -> Option<String> {
        let cgroup = std::fs::read_to_string(self.root.join(format!("{pid}/cgroup"))).ok()?;
        pod_uid_in_cgroup(&cgroup)
    }

    /// `(device, inode)` of every file the process maps.
    fn mapped_files(&self, pid: u32) -> HashSet<(u64, u64)> {
        std::fs::read_to_string(self.root.join(format!("{pid}/maps")))
            .map(|maps| maps.lines().filter_map(mapped_file).collect())
            .unwrap_or_default()
    }
}

/// `(device, inode)` of the file a `/proc/<pid>/maps` line maps.
fn mapped_file(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    let device = fields.nth(3)?;
    let inode: u64 = fields.next()?.parse().ok()?;
    let (major, minor) = device.split_once(':')?;
    let (major, minor) = (
        u64::from_str_radix(major, 16).ok()?,
        u64::from_str_radix(minor, 16).ok()?,
    );
    (inode != 0).then_some((libc::makedev(major as u32, minor as u32), inode))
}

/// The pod UID kubelet puts in a container's cgroup path, if any.
pub fn pod_uid_in_cgroup(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        path.split('/').find_map(|part| {
            let rest = part.strip_prefix("kubepods-").map_or(part, |p| p);
            let at = rest.find("pod")?;
            let uid = rest[at + 3..].trim_end_matches(".slice");
            let uid = uid.replace('_', "-");
            let shaped = uid.len() == 36 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
            shaped.then_some(uid)
        })
    })
}

/// Compares the GPUs' processes with the containers' live slots.
pub fn census(gpus: &[GpuSample], containers: &[Container], proc: &HostProc) -> Census {
    // (container, slot index, PID in the container, PID NVML knows it by)
    let mut slots = Vec::new();
    for (c, container) in containers.iter().enumerate() {
        let layout = container.region.layout();
        for index in container.region.active_slots().take(MAX_SLOTS) {
            let slot = &layout.slots[index];
            slots.push((c, index, slot.pid.load(Ordering::Relaxed), slot.nvml_pid()));
        }
    }
    let mut accounted: HashSet<u32> = slots.iter().map(|s| s.3).collect();
    let mut census = Census::default();
    for gpu in gpus {
        for process in &gpu.compute_processes {
            if accounted.contains(&process.pid) {
                continue;
            }
            // Which region does it map? Only a shim process maps one.
            let files = proc.mapped_files(process.pid);
            let mapped = containers
                .iter()
                .enumerate()
                .find(|(_, container)| files.contains(&container.file));
            if let Some((c, _)) = mapped {
                let inner = proc.nspid(process.pid).and_then(|l| l.last().copied());
                let slot = slots
                    .iter()
                    .find(|s| s.0 == c && Some(s.2) == inner && s.3 != process.pid);
                if let Some(&(_, index, _, _)) = slot {
                    containers[c].region.layout().slots[index]
                        .host_pid
                        .store(process.pid, Ordering::Relaxed);
                    census.host_pids_recorded += 1;
                    accounted.insert(process.pid);
                    continue;
                }
            }
            let container = mapped
                .map(|(c, _)| c)
                .or_else(|| attribute(process.pid, containers, &slots, proc));
            census.unenforced.push(Unenforced {
                gpu_uuid: gpu.uuid.clone(),
                pid: process.pid,
                used_bytes: process.used_bytes.unwrap_or(0),
                container: container.map(|c| containers[c].key.to_string()),
            });
        }
    }
    census
}

/// The container an unaccounted process belongs to: its pod (from its
/// cgroup) when that pod has one container with a region, else the
/// container whose shim processes share its PID namespace.
fn attribute(
    pid: u32,
    containers: &[Container],
    slots: &[(usize, usize, u32, u32)],
    proc: &HostProc,
) -> Option<usize> {
    if let Some(pod) = proc.pod_uid(pid) {
        let of_pod: Vec<usize> = (0..containers.len())
            .filter(|&c| containers[c].pod_uid == Some(pod.as_str()))
            .collect();
        if let [only] = of_pod[..] {
            return Some(only);
        }
    }
    let namespace = proc.pid_namespace(pid)?;
    // The host's own namespace says nothing: every host process shares it.
    if proc.pid_namespace(1).as_ref() == Some(&namespace) {
        return None;
    }
    slots
        .iter()
        .find(|s| proc.pid_namespace(s.3).as_ref() == Some(&namespace))
        .map(|s| s.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_uids_come_from_either_cgroup_driver() {
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6f1c0a52_4b7e_4d5e_9b1a_0c2d3e4f5a6b.slice/cri-containerd-abc.scope\n";
        let cgroupfs =
            "12:memory:/kubepods/besteffort/pod0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d/0123abcd\n";
        assert_eq!(
            pod_uid_in_cgroup(systemd).as_deref(),
            Some("6f1c0a52-4b7e-4d5e-9b1a-0c2d3e4f5a6b")
        );
        assert_eq!(
            pod_uid_in_cgroup(cgroupfs).as_deref(),
            Some("0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d")
        );
        assert_eq!(pod_uid_in_cgroup("0::/user.slice/user-0.slice\n"), None);
        assert_eq!(pod_uid_in_cgroup("0::/kubepods/podnot-a-uid/x\n"), None);
    }

    #[test]
    fn maps_lines_name_device_and_inode() {
        let line =
            "7f3c2a000000-7f3c2a100000 rw-s 00000000 fd:01 1311013 /var/lib/vgpu/region.cache";
        assert_eq!(mapped_file(line), Some((libc::makedev(0xfd, 1), 1311013)));
        assert_eq!(
            mapped_file("7f3c2a000000-7f3c2a100000 rw-p 00000000 00:00 0 "),
            None
        );
        assert_eq!(mapped_file("garbage"), None);
    }
}
