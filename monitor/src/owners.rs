//! Which container a GPU process belongs to, from facts the node keeps
//! ([`crate::host_proc`]), never from a region: a region is written by the
//! container it describes, and a process that means to escape its cap can
//! write a slot claiming to be another's, or none at all.
//!
//! In order:
//! 1. the grant mounted in the process's mount namespace names its
//!    container's region directory, where its pod (from its cgroup) agrees
//!    (a process in no pod is the host's: its mounts are the node's own);
//! 2. else its pod, from its cgroup, when that pod has one region;
//! 3. else its pod alone (a pod of several vGPU containers whose process
//!    hid its mounts): held to what the pod's containers were granted
//!    together;
//! 4. else no pod at all: a process outside Kubernetes' pods.

use crate::host_proc::HostProc;
use std::collections::HashMap;

/// Who a GPU process belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A container's (or a DRA claim's) region, by its key.
    Region(String),
    /// A pod, by UID, whose container could not be told apart.
    Pod(String),
    /// No pod: a process of the host, or of something other than kubelet.
    Unknown,
}

/// The regions the owners are looked up among.
#[derive(Default)]
pub struct Owners {
    /// Region key to its pod's UID (none for a claim's region).
    pods_of: HashMap<String, Option<String>>,
    /// Pod UID to its regions' keys.
    regions_of: HashMap<String, Vec<String>>,
}

impl Owners {
    /// Over the regions `(key, pod UID)`.
    pub fn new<'a>(regions: impl IntoIterator<Item = (&'a str, Option<&'a str>)>) -> Self {
        let mut owners = Self::default();
        for (key, pod) in regions {
            owners
                .pods_of
                .insert(key.to_string(), pod.map(str::to_string));
            if let Some(pod) = pod {
                owners
                    .regions_of
                    .entry(pod.to_string())
                    .or_default()
                    .push(key.to_string());
            }
        }
        owners
    }

    /// The keys of the regions of pod `uid`.
    pub fn regions_of(&self, uid: &str) -> &[String] {
        self.regions_of.get(uid).map_or(&[], Vec::as_slice)
    }

    /// Who process `pid` (host PID) belongs to.
    pub fn owner_of(&self, pid: u32, proc: &HostProc) -> Owner {
        let pod = proc.pod_uid(pid);
        if let Some(key) = proc.grant_dir(pid) {
            if let Some(region_pod) = self.pods_of.get(&key) {
                // A claim's region has no pod of its own; a container's must
                // be the process's pod, where it is in one (a process in no
                // pod's cgroup is the host's, whose mounts are the node's).
                if region_pod.is_none() || pod.is_none() || *region_pod == pod {
                    return Owner::Region(key);
                }
            }
        }
        let Some(pod) = pod else {
            return Owner::Unknown;
        };
        match self.regions_of(&pod) {
            [only] => Owner::Region(only.clone()),
            _ => Owner::Pod(pod),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const POD_A: &str = "0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d";
    const POD_B: &str = "6f1c0a52-4b7e-4d5e-9b1a-0c2d3e4f5a6b";

    /// A fake `/proc` holding process `pid` with the cgroup and mounts given.
    fn process(root: &Path, pid: u32, pod: Option<&str>, grant_dir: Option<&str>) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("dir");
        let cgroup = match pod {
            Some(uid) => format!("0::/kubepods/besteffort/pod{uid}/0123abcd\n"),
            None => "0::/user.slice\n".to_string(),
        };
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        let mut mounts = String::from("1 0 0:52 / / rw - overlay overlay rw\n");
        if let Some(name) = grant_dir {
            mounts.push_str(&format!(
                "2 1 253:1 /vgpu/containers/{name}/grant /usr/local/vgpu/grant ro - ext4 /dev/vda rw\n"
            ));
        }
        std::fs::write(dir.join("mountinfo"), mounts).expect("mountinfo");
    }

    #[test]
    fn processes_are_owned_by_what_the_kernel_says_of_them() {
        let root = std::env::temp_dir().join(format!("vgpu-owners-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (a_main, a_side, b_main) = (
            format!("{POD_A}_main"),
            format!("{POD_A}_side"),
            format!("{POD_B}_main"),
        );
        let owners = Owners::new([
            (a_main.as_str(), Some(POD_A)),
            (a_side.as_str(), Some(POD_A)),
            (b_main.as_str(), Some(POD_B)),
            ("claim-0b1c", None),
        ]);
        process(&root, 10, Some(POD_A), Some(&a_side));
        process(&root, 11, Some(POD_A), None);
        process(&root, 12, Some(POD_B), None);
        // Pod B's process whose mounts name pod A's region (never possible
        // without CAP_SYS_ADMIN): the pod it runs in wins.
        process(&root, 13, Some(POD_B), Some(&a_main));
        process(&root, 14, Some(POD_B), Some("claim-0b1c"));
        process(&root, 15, None, None);
        process(&root, 16, None, Some(&a_main));
        let proc = HostProc::new(&root);
        assert_eq!(owners.owner_of(10, &proc), Owner::Region(a_side.clone()));
        assert_eq!(owners.owner_of(11, &proc), Owner::Pod(POD_A.into()));
        assert_eq!(owners.owner_of(12, &proc), Owner::Region(b_main.clone()));
        assert_eq!(owners.owner_of(13, &proc), Owner::Region(b_main.clone()));
        assert_eq!(
            owners.owner_of(14, &proc),
            Owner::Region("claim-0b1c".into())
        );
        assert_eq!(owners.owner_of(15, &proc), Owner::Unknown);
        assert_eq!(owners.owner_of(16, &proc), Owner::Region(a_main.clone()));
        assert_eq!(owners.owner_of(99, &proc), Owner::Unknown, "gone");
        let _ = std::fs::remove_dir_all(&root);
    }
}
