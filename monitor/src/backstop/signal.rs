//! Signalling a host process the backstop judged, and no other: the PID is
//! pinned with a pidfd first, and the process behind it must still belong
//! to the owner it was judged for (its cgroup and mounts say so); a process
//! that exited and whose PID was reused in between is never signalled.

use std::io;
use thiserror::Error;

/// Why a process was not signalled.
#[derive(Debug, Error)]
pub enum SignalError {
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("process {pid} no longer belongs to whom it was judged for: its PID was reused")]
    Moved { pid: u32 },
    #[error("process {pid}: {op}")]
    Io {
        pid: u32,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

/// Sends `signal` to host process `pid` if `still_owned(pid)` says, once
/// the PID is pinned, that it is still the process judged.
pub fn signal_owned(
    pid: u32,
    still_owned: impl FnOnce(u32) -> bool,
    signal: i32,
) -> Result<(), SignalError> {
    let io_error = |op| {
        let source = io::Error::last_os_error();
        if source.raw_os_error() == Some(libc::ESRCH) {
            SignalError::Gone { pid }
        } else {
            SignalError::Io { pid, op, source }
        }
    };
    // SAFETY: pidfd_open takes a PID and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io_error("pidfd_open"));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    if !still_owned(pid) {
        return Err(SignalError::Moved { pid });
    }
    use std::os::fd::AsRawFd;
    // SAFETY: a pidfd we own, a signal number, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc != 0 {
        return Err(io_error("pidfd_send_signal"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_signalled_and_a_gone_one_is_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        signal_owned(child.id(), |_| true, libc::SIGKILL).expect("signalled");
        let status = child.wait().expect("wait");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(matches!(
            signal_owned(child.id(), |_| true, libc::SIGKILL),
            Err(SignalError::Gone { .. })
        ));
        // No longer the process judged: left alone.
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        assert!(matches!(
            signal_owned(other.id(), |_| false, libc::SIGKILL),
            Err(SignalError::Moved { .. })
        ));
        other.kill().expect("kill");
        let _ = other.wait();
    }
}
