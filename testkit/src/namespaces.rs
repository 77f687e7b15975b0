//! Processes in PID namespaces of their own, as in pods: their `getpid()`
//! is not the PID NVML and the host know them by.

use std::process::Command;

fn wrapped(program: &str, args: &[String], command: &Command) -> Command {
    let mut wrapped = Command::new(program);
    wrapped
        .args(args)
        .arg(command.get_program())
        .args(command.get_args())
        .env_clear();
    for (key, value) in command.get_envs() {
        if let Some(value) = value {
            wrapped.env(key, value);
        }
    }
    wrapped
}

/// `command` as PID 1 of a new PID namespace that still sees the host's
/// `/proc` (`unshare --pid --fork`; needs root).
pub fn in_new_pid_namespace(command: &Command) -> Command {
    let args = ["--pid", "--fork", "--kill-child"].map(String::from);
    wrapped("unshare", &args, command)
}

/// `command` as PID 1 of a new PID namespace with its own `/proc` mounted,
/// as in a container: the process cannot see its host PID at all.
pub fn in_new_pid_namespace_with_own_proc(command: &Command) -> Command {
    let args = ["--pid", "--fork", "--kill-child", "--mount-proc"].map(String::from);
    wrapped("unshare", &args, command)
}

/// `command` in the PID namespace of host process `pid` (`nsenter`; needs
/// root), as another process of the same container.
pub fn in_pid_namespace_of(pid: u32, command: &Command) -> Command {
    let args = [
        "--target".to_string(),
        pid.to_string(),
        "--pid".to_string(),
        "--".to_string(),
    ];
    wrapped("nsenter", &args, command)
}

/// The host PID of the one process that `unshare --fork` or `nsenter`
/// (host PID `parent`) started.
pub fn forked_child(parent: u32) -> u32 {
    let path = format!("/proc/{parent}/task/{parent}/children");
    let children = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let pids: Vec<u32> = children
        .split_whitespace()
        .map(|pid| pid.parse().expect("pid"))
        .collect();
    assert_eq!(pids.len(), 1, "{parent} has one child: {pids:?}");
    pids[0]
}
