//! Process IDs across PID namespaces, as the kernel gives them to NVML.
//!
//! Real NVML names every process by its PID in the host's namespace, even
//! to a caller inside a container. The simulated driver records each
//! process's own PID with its namespace, and a reader in another namespace
//! looks the process up in its own `/proc` (its `NSpid` ends with the
//! recorded PID and it is in the recorded namespace). A reader that sees
//! the host's `/proc` therefore gets host PIDs, as from NVML; a reader in a
//! container with its own `/proc` cannot see other namespaces' processes
//! and gets the recorded PID (real NVML would still say the host PID).

use vgpu_node_contract::process::nspid;

/// The inode of this process's PID namespace.
pub fn own_namespace() -> Option<u32> {
    namespace_of("/proc/self/ns/pid")
}

fn namespace_of(link: &str) -> Option<u32> {
    let target = std::fs::read_link(link).ok()?;
    let text = target.to_str()?;
    text.strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse::<u64>()
        .ok()
        .and_then(|inode| u32::try_from(inode).ok())
}

/// The PID this process's `/proc` shows for the process that is `pid` in
/// PID namespace `namespace` (0: unknown), or `pid` when it shows none.
pub fn as_seen_here(pid: u32, namespace: u32) -> u32 {
    if namespace == 0 || own_namespace() == Some(namespace) {
        return pid;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pid;
    };
    for entry in entries.flatten() {
        let Some(here) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if namespace_of(&format!("/proc/{here}/ns/pid")) != Some(namespace) {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{here}/status")).unwrap_or_default();
        if nspid(&status).and_then(|levels| levels.last().copied()) == Some(pid) {
            return here;
        }
    }
    pid
}
