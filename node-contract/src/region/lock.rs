//! The region's process-shared robust mutex, and the per-slot liveness
//! locks that tell a live owner from a dead one.

use super::file::io_error;
use super::file::{Region, RegionError};
use super::layout::LIVENESS_LOCK_BASE;
use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Region {
    pub(super) fn init_mutex(&self) -> Result<(), RegionError> {
        let raw = self.layout().lock.raw.get();
        // SAFETY: `attr` is a local initialised by pthread_mutexattr_init
        // before use; `raw` points into our mapping, which no other process
        // uses until `ready` is set.
        let code = unsafe {
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            let code = libc::pthread_mutex_init(raw, &attr);
            libc::pthread_mutexattr_destroy(&mut attr);
            code
        };
        if code != 0 {
            return Err(self.mutex_error("init", code));
        }
        Ok(())
    }

    /// Runs `f` holding the region mutex. If the previous holder died inside
    /// it, totals are first rebuilt from the slots.
    pub(super) fn with_lock<T>(&self, f: impl FnOnce() -> T) -> Result<T, RegionError> {
        self.with_lock_waiting(None, f)
    }

    /// [`Region::with_lock`], waiting at most `wait` for the mutex when given.
    pub(super) fn with_lock_waiting<T>(
        &self,
        wait: Option<Duration>,
        f: impl FnOnce() -> T,
    ) -> Result<T, RegionError> {
        let raw = self.layout().lock.raw.get();
        let code = match wait {
            // SAFETY: `raw` is the process-shared robust mutex initialised by
            // the region's creator; it lives as long as the mapping.
            None => unsafe { libc::pthread_mutex_lock(raw) },
            Some(wait) => {
                let deadline = realtime_after(wait);
                // SAFETY: as above; `deadline` is a valid timespec read
                // during the call.
                unsafe { libc::pthread_mutex_timedlock(raw, &deadline) }
            }
        };
        match code {
            0 => {}
            libc::ETIMEDOUT => {
                return Err(RegionError::Busy {
                    path: self.path.clone(),
                })
            }
            libc::EOWNERDEAD => {
                self.recount_totals();
                // SAFETY: we hold the mutex (EOWNERDEAD grants it).
                let rc = unsafe { libc::pthread_mutex_consistent(raw) };
                if rc != 0 {
                    return Err(self.mutex_error("consistent", rc));
                }
            }
            other => return Err(self.mutex_error("lock", other)),
        }
        let result = f();
        // SAFETY: locked above by this thread.
        unsafe {
            libc::pthread_mutex_unlock(raw);
        }
        Ok(result)
    }

    /// Rebuilds every device total from the active slots. Called with the
    /// mutex held, after a holder died mid-update.
    pub(super) fn recount_totals(&self) {
        let layout = self.layout();
        for (device, record) in layout.devices.iter().enumerate() {
            let (mut used, mut swap) = (0u64, 0u64);
            // Every slot, not only the flagged ones: this is the rare
            // recovery path and must not trust a bitmap a dead holder may
            // have been updating.
            for slot in layout.slots.iter().filter(|s| s.is_active()) {
                used = used.saturating_add(slot.devices[device].device_bytes());
                swap = swap.saturating_add(slot.devices[device].swap.load(Ordering::Relaxed));
            }
            record.used.store(used, Ordering::Relaxed);
            record.swap_used.store(swap, Ordering::Relaxed);
        }
    }

    pub(super) fn try_lock_liveness(&self, index: usize) -> Result<bool, RegionError> {
        let fd = self.fd.load(Ordering::Acquire);
        let lock = liveness_flock(index, libc::F_WRLCK);
        // SAFETY: F_OFD_SETLK reads only `lock`.
        let rc = unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &lock) };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
            _ => Err(io_error(&self.path, "fcntl(F_OFD_SETLK)", err)),
        }
    }

    pub(super) fn unlock_liveness(&self, index: usize) {
        let fd = self.fd.load(Ordering::Acquire);
        let lock = liveness_flock(index, libc::F_UNLCK);
        // SAFETY: F_OFD_SETLK reads only `lock`; unlocking cannot fail in a
        // way that leaves state to repair.
        unsafe {
            libc::fcntl(fd, libc::F_OFD_SETLK, &lock);
        }
    }

    /// Whether the process owning slot `index` is alive (someone holds its
    /// liveness lock).
    pub fn slot_is_live(&self, index: usize) -> Result<bool, RegionError> {
        let fd = self.fd.load(Ordering::Acquire);
        let mut probe = liveness_flock(index, libc::F_WRLCK);
        // SAFETY: F_OFD_GETLK reads and writes only `probe`.
        let rc = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut probe) };
        if rc != 0 {
            return Err(io_error(
                &self.path,
                "fcntl(F_OFD_GETLK)",
                io::Error::last_os_error(),
            ));
        }
        Ok(probe.l_type != libc::F_UNLCK as i16)
    }

    pub(super) fn mutex_error(&self, what: &'static str, code: i32) -> RegionError {
        RegionError::Mutex {
            path: self.path.clone(),
            what,
            code,
        }
    }
}

/// `CLOCK_REALTIME` plus `wait`: the deadline `pthread_mutex_timedlock`
/// takes.
fn realtime_after(wait: Duration) -> libc::timespec {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only `now`.
    unsafe {
        libc::clock_gettime(libc::CLOCK_REALTIME, &mut now);
    }
    let nanos = i64::from(wait.subsec_nanos()) + now.tv_nsec;
    let seconds = i64::try_from(wait.as_secs())
        .unwrap_or(i64::MAX)
        .saturating_add(now.tv_sec)
        .saturating_add(nanos / 1_000_000_000);
    libc::timespec {
        tv_sec: seconds,
        tv_nsec: nanos % 1_000_000_000,
    }
}

fn liveness_flock(index: usize, kind: i32) -> libc::flock {
    // SAFETY: flock is plain old data; all-zero is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as i16;
    lock.l_whence = libc::SEEK_SET as i16;
    lock.l_start = LIVENESS_LOCK_BASE + index as i64;
    lock.l_len = 1;
    lock
}
