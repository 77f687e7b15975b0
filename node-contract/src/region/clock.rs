//! The clock compute budgets use.

/// `CLOCK_MONOTONIC` in nanoseconds, the clock compute budgets use.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Clock `id` (`CLOCK_MONOTONIC`, `CLOCK_THREAD_CPUTIME_ID`, ...) in
/// nanoseconds.
pub fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe {
        libc::clock_gettime(id, &mut now);
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
