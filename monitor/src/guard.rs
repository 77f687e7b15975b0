//! Survives region files that shrink under the monitor.
//!
//! A region is a shared file mapping, and the file belongs to a container,
//! which may truncate it while the monitor has it mapped. Touching a mapped
//! page beyond the new end of the file raises `SIGBUS`, which would kill the
//! monitor. Every mapping the monitor reads is registered here; a `SIGBUS`
//! inside a registered mapping replaces the whole mapping with private
//! zero-filled memory (so the faulting access is retried and reads zeros)
//! and flags it, and the monitor drops that region on its next pass with a
//! log line. A `SIGBUS` anywhere else keeps its default action (the process
//! dies, as it should for a bug of its own).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;
use thiserror::Error;

/// Most mappings guarded at once (each region is one).
pub const MAX_GUARDED: usize = 4096;

struct Slot {
    /// Start address; 0 when the slot is free.
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
    /// Claimed by a [`Guarded`] (set before `start`, cleared after it).
    taken: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
    taken: AtomicBool::new(false),
};

static SLOTS: [Slot; MAX_GUARDED] = [FREE; MAX_GUARDED];
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Why a mapping could not be guarded.
#[derive(Debug, Error)]
pub enum GuardError {
    #[error("cannot install the SIGBUS handler")]
    Install(#[source] std::io::Error),
    #[error("more than {MAX_GUARDED} mappings are guarded already")]
    Full,
}

/// A registered mapping; unregistered on drop (drop it before unmapping).
pub struct Guarded {
    index: usize,
}

impl Guarded {
    /// Registers `len` bytes mapped at `start`.
    pub fn register(start: *const u8, len: usize) -> Result<Self, GuardError> {
        install()?;
        for (index, slot) in SLOTS.iter().enumerate() {
            if slot
                .taken
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                slot.faulted.store(false, Ordering::Release);
                slot.len.store(len, Ordering::Release);
                slot.start.store(start as usize, Ordering::Release);
                return Ok(Self { index });
            }
        }
        Err(GuardError::Full)
    }

    /// Whether an access to the mapping faulted (the file shrank); the
    /// mapping now reads zeros and must be dropped.
    pub fn faulted(&self) -> bool {
        SLOTS[self.index].faulted.load(Ordering::Acquire)
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let slot = &SLOTS[self.index];
        slot.start.store(0, Ordering::Release);
        slot.len.store(0, Ordering::Release);
        slot.taken.store(false, Ordering::Release);
    }
}

fn install() -> Result<(), GuardError> {
    let mut error = None;
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler
        // has the SA_SIGINFO signature and only touches atomics and makes
        // the mmap/sigaction system calls (see `on_sigbus`).
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut())
        };
        if rc == 0 {
            INSTALLED.store(true, Ordering::Release);
        } else {
            error = Some(std::io::Error::last_os_error());
        }
    });
    match error {
        Some(error) => Err(GuardError::Install(error)),
        None if INSTALLED.load(Ordering::Acquire) => Ok(()),
        None => Err(GuardError::Install(std::io::Error::other(
            "an earlier attempt failed",
        ))),
    }
}

/// The `SIGBUS` handler. Async-signal-safe in practice: atomics, and the
/// raw `mmap` and `sigaction` system calls (glibc's wrappers take no locks).
extern "C" fn on_sigbus(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler;
    // si_addr is the faulting address for SIGBUS.
    let address = unsafe { (*info).si_addr() } as usize;
    for slot in SLOTS.iter() {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start == 0 || address < start || address - start >= len {
            continue;
        }
        // SAFETY: [start, start + len) is a mapping the monitor registered
        // and still holds (it unregisters before unmapping); replacing it
        // with anonymous memory at the same address keeps every reference
        // into it valid, now reading zeros.
        let replaced = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if replaced != libc::MAP_FAILED {
            slot.faulted.store(true, Ordering::Release);
            return;
        }
        break;
    }
    // Not ours (or the replacement failed): fall back to the default action
    // so the retried access kills the process as it would have.
    // SAFETY: restoring SIG_DFL with a zeroed sigaction is valid.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_truncated_mapping_reads_zeros_instead_of_killing_the_process() {
        let path = std::env::temp_dir().join(format!("vgpu-guard-{}", std::process::id()));
        let mut file = std::fs::File::create_new(&path)
            .or_else(|_| {
                std::fs::remove_file(&path)?;
                std::fs::File::create_new(&path)
            })
            .expect("create");
        let len = 3 * 4096;
        file.write_all(&vec![7u8; len]).expect("fill");
        // SAFETY: mapping a file we own with its length.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let guard = Guarded::register(base.cast(), len).expect("register");
        let last = base as usize + len - 1;
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { std::ptr::read_volatile(last as *const u8) }, 7);
        file.set_len(100).expect("truncate");
        // SAFETY: inside the mapping; beyond the file's end now, so this
        // faults and the guard replaces the mapping.
        assert_eq!(unsafe { std::ptr::read_volatile(last as *const u8) }, 0);
        assert!(guard.faulted());
        drop(guard);
        // SAFETY: unmapping what we mapped.
        unsafe { libc::munmap(base, len) };
        let _ = std::fs::remove_file(&path);
    }
}
