//! Who this process is on the host.
//!
//! NVML names processes by their PID in the host's PID namespace, while
//! `getpid()` inside a container gives the PID in the container's own
//! namespace. The kernel lists a process's PID at every namespace level that
//! the reading `/proc` can see in the `NSpid` line of `/proc/self/status`,
//! outermost first.

/// This process's PID in the outermost PID namespace its `/proc` shows:
/// the host PID wherever `/proc` is the host's (a pod with `hostPID`, a
/// process put in a new PID namespace without a new `/proc`, no container
/// at all). Inside a container that mounted its own `/proc`, only the
/// container's PID is visible and that is what this returns; the node
/// monitor, which sees every level, records the host PID for such a
/// process. `None` when `/proc` cannot be read (the caller falls back to
/// `getpid()`).
pub fn outermost_pid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    nspid(&status).and_then(|levels| levels.first().copied())
}

/// The PIDs of the `NSpid` line of a `/proc/<pid>/status` text, outermost
/// namespace first; `None` when the line is missing or malformed.
pub fn nspid(status: &str) -> Option<Vec<u32>> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))?;
    let levels: Option<Vec<u32>> = line
        .split_whitespace()
        .map(|pid| pid.parse().ok())
        .collect();
    levels.filter(|levels| !levels.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_level_outermost_first() {
        let status = "Name:\tprobe\nTgid:\t1\nNSpid:\t48213\t7\t1\nPPid:\t0\n";
        assert_eq!(nspid(status), Some(vec![48213, 7, 1]));
    }

    #[test]
    fn refuses_a_missing_or_malformed_line() {
        assert_eq!(nspid("Name:\tprobe\n"), None);
        assert_eq!(nspid("NSpid:\t\n"), None);
        assert_eq!(nspid("NSpid:\t12\tx\n"), None);
    }

    #[test]
    fn this_process_outside_any_new_namespace_is_its_own_pid() {
        // The test runner is not in a PID namespace of its own making, so
        // the outermost level /proc shows is the PID getpid() returns, or
        // an outer one when the runner itself is in a container.
        let levels = nspid(&std::fs::read_to_string("/proc/self/status").expect("status"))
            .expect("NSpid line");
        assert_eq!(levels.last().copied(), Some(std::process::id()));
        assert_eq!(outermost_pid(), levels.first().copied());
    }
}
