//! What the host's `/proc` (the monitor runs with `hostPID`) says of a
//! process: facts the kernel keeps, which the process cannot write.
//!
//! - its cgroup path, which names its pod (kubelet's layout);
//! - its mount table, which names the grant the node mounted into its
//!   container (a container without `CAP_SYS_ADMIN` cannot mount, and a
//!   process that `chroot`s away hides its mounts rather than forging one);
//! - its PID namespace and its PIDs in each namespace;
//! - the files it maps;
//! - whether it is stopped.

use std::collections::HashSet;
use std::path::PathBuf;
use vgpu_node_contract::process::nspid;
use vgpu_node_contract::region::grant_file::{GRANT_CONTAINER_PATH, GRANT_FILE};

/// Reads `/proc` (the host's, with `hostPID`).
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

    fn read(&self, pid: u32, file: &str) -> Option<String> {
        std::fs::read_to_string(self.root.join(format!("{pid}/{file}"))).ok()
    }

    /// The process's PIDs, outermost namespace first.
    pub fn nspid(&self, pid: u32) -> Option<Vec<u32>> {
        nspid(&self.read(pid, "status")?)
    }

    /// The PID namespace's identity (`pid:[inode]`).
    pub fn pid_namespace(&self, pid: u32) -> Option<PathBuf> {
        std::fs::read_link(self.root.join(format!("{pid}/ns/pid"))).ok()
    }

    /// The pod UID in the process's cgroup path.
    pub fn pod_uid(&self, pid: u32) -> Option<String> {
        pod_uid_in_cgroup(&self.read(pid, "cgroup")?)
    }

    /// The directory name of the grant mounted at [`GRANT_CONTAINER_PATH`]
    /// in the process's mount namespace: which region a node set its
    /// container up with.
    pub fn grant_dir(&self, pid: u32) -> Option<String> {
        grant_dir_in_mountinfo(&self.read(pid, "mountinfo")?)
    }

    /// Whether the process is stopped by a signal (state `T`).
    pub fn is_stopped(&self, pid: u32) -> bool {
        self.read(pid, "stat")
            .is_some_and(|stat| state_in_stat(&stat) == Some('T'))
    }

    /// `(device, inode)` of every file the process maps.
    pub fn mapped_files(&self, pid: u32) -> HashSet<(u64, u64)> {
        self.read(pid, "maps")
            .map(|maps| maps.lines().filter_map(mapped_file).collect())
            .unwrap_or_default()
    }
}

/// `(device, inode)` of the file a `/proc/<pid>/maps` line maps.
pub fn mapped_file(line: &str) -> Option<(u64, u64)> {
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

/// The state letter of a `/proc/<pid>/stat` line: the field after the
/// name, which may itself hold spaces and parentheses.
pub fn state_in_stat(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// The pod UID kubelet puts in a container's cgroup path, if any (either
/// cgroup driver: `pod<uid>` with dashes or underscores).
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

/// The region directory whose grant is mounted at
/// [`GRANT_CONTAINER_PATH`], from a `/proc/<pid>/mountinfo`: the mount's
/// root (its path in the filesystem it came from) ends in
/// `<directory>/grant`, whatever folder the node keeps its regions in.
pub fn grant_dir_in_mountinfo(mountinfo: &str) -> Option<String> {
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let root = fields.nth(3)?;
        let mount_point = fields.next()?;
        if mount_point != GRANT_CONTAINER_PATH {
            return None;
        }
        let dir = root.strip_suffix(GRANT_FILE)?.strip_suffix('/')?;
        let name = dir.rsplit('/').next()?;
        let safe = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        safe.then(|| name.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_is_read_past_a_name_with_spaces_and_parentheses() {
        assert_eq!(state_in_stat("42 (a (b) c) T 1 42 42 0"), Some('T'));
        assert_eq!(state_in_stat("7 (sleep) S 1 7 7 0"), Some('S'));
        assert_eq!(state_in_stat("7 no name"), None);
    }

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

    #[test]
    fn the_grant_mount_names_its_region_directory() {
        let mountinfo = "\
1411 1353 0:52 / / rw,relatime master:640 - overlay overlay rw,lowerdir=/x
1420 1411 253:1 /usr/local/vgpu/libvgpu.so /usr/local/vgpu/libvgpu.so ro,relatime - ext4 /dev/vda rw
1421 1411 253:1 /tmp/node-1/vgpu/containers/0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d_main/region.cache /usr/local/vgpu/container/region.cache rw,relatime - ext4 /dev/vda rw
1422 1411 253:1 /tmp/node-1/vgpu/containers/0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d_main/grant /usr/local/vgpu/grant ro,relatime - ext4 /dev/vda rw
";
        assert_eq!(
            grant_dir_in_mountinfo(mountinfo).as_deref(),
            Some("0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d_main")
        );
        let claim = "22 1 253:1 /vgpu/containers/claim-0b1c/grant /usr/local/vgpu/grant ro - ext4 /dev/vda rw\n";
        assert_eq!(grant_dir_in_mountinfo(claim).as_deref(), Some("claim-0b1c"));
        // Nothing else at that path counts, nor a file of another name.
        let other = "22 1 0:40 / /usr/local/vgpu/grant rw - tmpfs tmpfs rw\n";
        assert_eq!(grant_dir_in_mountinfo(other), None);
        let renamed = "22 1 253:1 /a/b/notgrant /usr/local/vgpu/grant ro - ext4 /dev/vda rw\n";
        assert_eq!(grant_dir_in_mountinfo(renamed), None);
        assert_eq!(grant_dir_in_mountinfo("garbage"), None);
    }
}
