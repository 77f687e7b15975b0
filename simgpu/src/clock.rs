//! Clocks: `CLOCK_MONOTONIC` nanoseconds (system-wide, shared by every
//! process through the state file) and wall-clock microseconds for NVML.

/// Reads a clock as nanoseconds.
fn read(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both clocks always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn now_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// Wall-clock (`CLOCK_REALTIME`) now, in microseconds since the epoch.
pub fn realtime_us() -> u64 {
    read(libc::CLOCK_REALTIME) / 1_000
}

/// Sleeps (no busy spinning) until `CLOCK_MONOTONIC` reaches `deadline_ns`.
pub fn sleep_until(deadline_ns: u64) {
    while now_ns() < deadline_ns {
        let ts = libc::timespec {
            tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `ts` is a valid absolute time; the remainder pointer may be
        // NULL with TIMER_ABSTIME. EINTR simply loops.
        unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
    }
}

/// Parses a kernel duration such as `20us`, `1ms`, `30ms`, `500ns` or `2s`
/// (a whole or decimal number followed by a unit) into nanoseconds.
pub fn parse_duration(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let scale: f64 = match unit {
        "ns" => 1.0,
        "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    };
    let value: f64 = number.parse().ok()?;
    let ns = value * scale;
    if !ns.is_finite() || ns > 3.6e12 {
        return None;
    }
    Some(ns.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20us"), Some(20_000));
        assert_eq!(parse_duration("1ms"), Some(1_000_000));
        assert_eq!(parse_duration("30ms"), Some(30_000_000));
        assert_eq!(parse_duration("500ns"), Some(500));
        assert_eq!(parse_duration("1.5ms"), Some(1_500_000));
        assert_eq!(parse_duration("2s"), Some(2_000_000_000));
        assert_eq!(parse_duration("ms"), None);
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("10min"), None);
        assert_eq!(parse_duration("1.ms"), None);
        assert_eq!(parse_duration("99999s"), None);
    }

    #[test]
    fn sleeping_reaches_deadline() {
        let start = now_ns();
        sleep_until(start + 2_000_000);
        assert!(now_ns() >= start + 2_000_000);
    }
}
