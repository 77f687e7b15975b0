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
//!
//! A node's monitor lists every GPU's processes each sample, and on a test
//! machine running many simulated nodes its `/proc` holds thousands of
//! processes. So a listing reads `/proc` at most once for all the PIDs it
//! cannot place, and each answer is remembered and checked (two small
//! reads) when asked again, instead of a scan of `/proc` per process.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use vgpu_node_contract::process::nspid;

/// A process as the simulated driver records it: its own PID and the
/// inode of its PID namespace (0: unknown).
pub type Recorded = (u32, u32);

/// Past answers: recorded process to the PID this process's `/proc` shows.
static SEEN: Mutex<Option<HashMap<Recorded, u32>>> = Mutex::new(None);

/// More remembered answers than this and the memo starts over (processes
/// come and go; the memo must not grow with them).
const SEEN_LIMIT: usize = 4096;

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

/// Whether `/proc/<here>` is the recorded process.
fn is(here: u32, (pid, namespace): Recorded) -> bool {
    namespace_of(&format!("/proc/{here}/ns/pid")) == Some(namespace) && innermost(here) == Some(pid)
}

/// The process's PID in its own (innermost) namespace.
fn innermost(here: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{here}/status")).ok()?;
    nspid(&status).and_then(|levels| levels.last().copied())
}

/// One pass over `/proc` for the processes in `wanted`.
fn scan(wanted: &HashSet<Recorded>) -> HashMap<Recorded, u32> {
    let namespaces: HashSet<u32> = wanted.iter().map(|&(_, namespace)| namespace).collect();
    let mut found = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(here) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(namespace) = namespace_of(&format!("/proc/{here}/ns/pid")) else {
            continue;
        };
        if !namespaces.contains(&namespace) {
            continue;
        }
        if let Some(pid) = innermost(here) {
            if wanted.contains(&(pid, namespace)) {
                found.insert((pid, namespace), here);
                if found.len() == wanted.len() {
                    break;
                }
            }
        }
    }
    found
}

/// The PID this process's `/proc` shows for each recorded process, in
/// order; a process it does not show keeps its recorded PID.
pub fn as_seen_here(recorded: &[Recorded]) -> Vec<u32> {
    let own = own_namespace();
    let foreign = |&(_, namespace): &Recorded| namespace != 0 && Some(namespace) != own;
    if !recorded.iter().any(foreign) {
        return recorded.iter().map(|&(pid, _)| pid).collect();
    }
    let mut seen = match SEEN.lock() {
        Ok(guard) => guard,
        // A panic elsewhere while holding it leaves a memo that is only
        // ever checked before use.
        Err(poisoned) => poisoned.into_inner(),
    };
    let memo = seen.get_or_insert_with(HashMap::new);
    let mut answers: HashMap<Recorded, u32> = HashMap::new();
    let mut unknown = HashSet::new();
    for process in recorded.iter().filter(|p| foreign(p)) {
        match memo.get(process) {
            Some(&here) if is(here, *process) => {
                answers.insert(*process, here);
            }
            _ => {
                unknown.insert(*process);
            }
        }
    }
    if !unknown.is_empty() {
        let found = scan(&unknown);
        if memo.len() + found.len() > SEEN_LIMIT {
            memo.clear();
        }
        memo.extend(found.iter().map(|(k, v)| (*k, *v)));
        answers.extend(found);
    }
    recorded
        .iter()
        .map(|process| answers.get(process).copied().unwrap_or(process.0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_of_this_namespace_keep_their_pid() {
        let own = own_namespace().expect("this process's namespace");
        assert_eq!(as_seen_here(&[(7, own), (9, 0)]), vec![7, 9]);
    }

    #[test]
    fn a_namespace_this_proc_does_not_show_keeps_the_recorded_pid() {
        // No process lives in namespace inode 1.
        assert_eq!(as_seen_here(&[(4242, 1)]), vec![4242]);
    }

    #[test]
    fn a_remembered_answer_is_checked_before_it_is_used() {
        let own = own_namespace().expect("this process's namespace");
        let me = std::process::id();
        // A false memo: a PID no process has, in a namespace we are not
        // in, remembered as this very process.
        let stale = (u32::MAX - 1, own.wrapping_add(1));
        {
            let mut seen = SEEN.lock().expect("memo");
            seen.get_or_insert_with(HashMap::new).insert(stale, me);
        }
        assert_eq!(
            as_seen_here(&[stale]),
            vec![stale.0],
            "kept the recorded PID"
        );
        assert!(!is(me, stale));
        assert!(is(me, (me, own)));
    }

    #[test]
    fn a_process_in_a_child_namespace_is_named_by_the_pid_seen_here() {
        // `unshare` forks its command into a new PID namespace, where it is 1.
        let mut unshare = match std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sleep", "60"])
            .spawn()
        {
            Ok(child) => child,
            Err(error) => {
                eprintln!("skipped: unshare cannot run here ({error})");
                return;
            }
        };
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let sleeper = loop {
            let listed = std::fs::read_to_string(&children).unwrap_or_default();
            if let Some(pid) = listed.split_whitespace().next() {
                break pid.parse::<u32>().expect("a PID");
            }
            if let Ok(Some(status)) = unshare.try_wait() {
                eprintln!("skipped: unshare cannot make a PID namespace here ({status})");
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "unshare forked nothing"
            );
            std::thread::yield_now();
        };
        let namespace = namespace_of(&format!("/proc/{sleeper}/ns/pid")).expect("its namespace");
        assert_ne!(Some(namespace), own_namespace());
        let own = own_namespace().expect("ours");
        // Twice: the first answer comes from the scan, the second from the memo.
        for _ in 0..2 {
            assert_eq!(
                as_seen_here(&[(1, namespace), (5, own), (4242, namespace)]),
                vec![sleeper, 5, 4242]
            );
        }
        let _ = unshare.kill();
        let _ = unshare.wait();
    }
}
