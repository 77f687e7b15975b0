//! Process IDs across PID namespaces, as the kernel gives them to NVML.
//!
//! Real NVML names every process by its PID in the host's namespace, even
//! to a caller inside a container. The simulated driver records each
//! process's own PID with its namespace and its start time, and a reader in
//! another namespace looks the process up in its own `/proc` (its `NSpid`
//! ends with the recorded PID, and it is in the recorded namespace, or,
//! where the reader may not read that, as a node monitor with every
//! capability dropped may not, it started at the recorded time). A reader
//! that sees the host's `/proc` therefore gets host PIDs, as from NVML; a
//! reader in a container with its own `/proc` cannot see other namespaces'
//! processes and gets the recorded PID (real NVML would still say the host
//! PID).
//!
//! A node's monitor lists every GPU's processes each sample, and on a test
//! machine running many simulated nodes its `/proc` holds thousands of
//! processes. So a listing reads `/proc` at most once for all the PIDs it
//! cannot place, and each answer is remembered and checked (two small
//! reads) when asked again, instead of a scan of `/proc` per process.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use vgpu_node_contract::process::nspid;

/// A process as the simulated driver records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Recorded {
    /// Its PID in its own namespace.
    pub pid: u32,
    /// The inode of its PID namespace (0: unknown).
    pub namespace: u32,
    /// When it started, in clock ticks after boot (0: unknown).
    pub start_ticks: u64,
}

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

/// When process `which` (`self` or a PID) started, in clock ticks after
/// boot: field 22 of `/proc/<which>/stat`, readable by anyone.
pub fn start_ticks(which: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{which}/stat")).ok()?;
    // The name (field 2) may hold spaces and parentheses: count from the
    // last `)`, after which field 3 starts.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `/proc/<here>` is the recorded process: its namespace where this
/// process may read it, else its start time.
fn is(here: u32, recorded: Recorded) -> bool {
    if innermost(here) != Some(recorded.pid) {
        return false;
    }
    match namespace_of(&format!("/proc/{here}/ns/pid")) {
        Some(namespace) => namespace == recorded.namespace,
        None => {
            recorded.start_ticks != 0
                && start_ticks(&here.to_string()) == Some(recorded.start_ticks)
        }
    }
}

/// The process's PID in its own (innermost) namespace.
fn innermost(here: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{here}/status")).ok()?;
    nspid(&status).and_then(|levels| levels.last().copied())
}

/// One pass over `/proc` for the processes in `wanted`.
fn scan(wanted: &HashSet<Recorded>) -> HashMap<Recorded, u32> {
    let namespaces: HashSet<u32> = wanted.iter().map(|r| r.namespace).collect();
    let pids: HashSet<u32> = wanted.iter().map(|r| r.pid).collect();
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
        let namespace = namespace_of(&format!("/proc/{here}/ns/pid"));
        if namespace.is_some_and(|namespace| !namespaces.contains(&namespace)) {
            continue;
        }
        let Some(pid) = innermost(here).filter(|pid| pids.contains(pid)) else {
            continue;
        };
        let matched = match namespace {
            Some(namespace) => wanted
                .iter()
                .find(|r| r.pid == pid && r.namespace == namespace),
            // Not ours to read: told apart by when it started.
            None => start_ticks(&here.to_string()).and_then(|ticks| {
                wanted
                    .iter()
                    .find(|r| r.pid == pid && r.start_ticks != 0 && r.start_ticks == ticks)
            }),
        };
        if let Some(recorded) = matched {
            found.insert(*recorded, here);
            if found.len() == wanted.len() {
                break;
            }
        }
    }
    found
}

/// The PID this process's `/proc` shows for each recorded process, in
/// order; a process it does not show keeps its recorded PID.
pub fn as_seen_here(recorded: &[Recorded]) -> Vec<u32> {
    let own = own_namespace();
    let foreign = |r: &Recorded| r.namespace != 0 && Some(r.namespace) != own;
    if !recorded.iter().any(foreign) {
        return recorded.iter().map(|r| r.pid).collect();
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
        .map(|process| answers.get(process).copied().unwrap_or(process.pid))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(pid: u32, namespace: u32, start_ticks: u64) -> Recorded {
        Recorded {
            pid,
            namespace,
            start_ticks,
        }
    }

    #[test]
    fn a_process_start_time_is_read_past_a_name_with_spaces_and_parentheses() {
        let ticks = start_ticks("self").expect("this process's start");
        assert!(ticks > 0);
        assert_eq!(start_ticks(&std::process::id().to_string()), Some(ticks));
        assert_eq!(start_ticks("0"), None);
    }

    #[test]
    fn processes_of_this_namespace_keep_their_pid() {
        let own = own_namespace().expect("this process's namespace");
        assert_eq!(
            as_seen_here(&[recorded(7, own, 0), recorded(9, 0, 0)]),
            vec![7, 9]
        );
    }

    #[test]
    fn a_namespace_this_proc_does_not_show_keeps_the_recorded_pid() {
        // No process lives in namespace inode 1.
        assert_eq!(as_seen_here(&[recorded(4242, 1, 0)]), vec![4242]);
    }

    #[test]
    fn a_remembered_answer_is_checked_before_it_is_used() {
        let own = own_namespace().expect("this process's namespace");
        let me = std::process::id();
        // A false memo: a PID no process has, in a namespace we are not
        // in, remembered as this very process.
        let stale = recorded(u32::MAX - 1, own.wrapping_add(1), 0);
        {
            let mut seen = SEEN.lock().expect("memo");
            seen.get_or_insert_with(HashMap::new).insert(stale, me);
        }
        assert_eq!(
            as_seen_here(&[stale]),
            vec![stale.pid],
            "kept the recorded PID"
        );
        assert!(!is(me, stale));
        assert!(is(me, recorded(me, own, 0)));
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
                as_seen_here(&[
                    recorded(1, namespace, 0),
                    recorded(5, own, 0),
                    recorded(4242, namespace, 0)
                ]),
                vec![sleeper, 5, 4242]
            );
        }
        // By its start time where the namespace is not to be read: the
        // same process, and no other of that PID.
        let ticks = start_ticks(&sleeper.to_string()).expect("its start");
        let by_start = recorded(1, namespace.wrapping_add(7), ticks);
        assert_eq!(
            scan(&HashSet::from([by_start])).get(&by_start),
            None,
            "namespace readable here: it decides"
        );
        let _ = unshare.kill();
        let _ = unshare.wait();
    }
}
