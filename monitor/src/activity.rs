//! What the monitor remembers of each container device between passes:
//! its launch counters (is it active?), its throttled time (did it wait
//! for tokens?), and its granted device time over the utilization window
//! (what it achieved); and whether the shim meters it at all.

use crate::discovery::DeviceFigures;
use std::collections::VecDeque;
use std::time::Duration;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::SHARE_FULL;

/// Most utilization samples kept per container device.
const MAX_HISTORY: usize = 1024;

/// Per container device: what earlier passes saw.
#[derive(Default)]
pub struct Track {
    pub seen: bool,
    pub launches: u64,
    pub last_launch_at: u64,
    /// When the counters last showed activity (monotonic ns).
    pub active_at: Option<u64>,
    /// (monotonic ns, granted ns) samples over the utilization window.
    pub history: VecDeque<(u64, u64)>,
    /// Whether this monitor wrote the device's effective share (given
    /// back on exit).
    pub wrote: bool,
    /// The region's throttled time at the last pass, and when it last grew
    /// (a launch waited for tokens).
    pub throttled_ns: u64,
    pub waited_at: Option<u64>,
}

/// Whether the shim meters the container's launches on the device (counts
/// them and charges device time): a cap is in force.
pub fn is_metered(policy: Option<UtilizationPolicy>, sm_limit: u32, sm_effective: u32) -> bool {
    match policy {
        Some(UtilizationPolicy::Force) => sm_limit > 0 && sm_limit < 100,
        Some(UtilizationPolicy::Default) => sm_effective < SHARE_FULL,
        _ => false,
    }
}

/// Updates the activity record from the counters; returns whether the
/// container device is active (launched within `window`).
pub fn observe(
    track: &mut Track,
    device: &DeviceFigures,
    nvml_active: bool,
    now: u64,
    window: Duration,
) -> bool {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    let launched = track.seen && device.launches != track.launches;
    let stamped = device.last_launch_at != track.last_launch_at
        && device.last_launch_at <= now
        && now.saturating_sub(device.last_launch_at) <= window_ns;
    if launched || stamped || nvml_active {
        track.active_at = Some(now);
    }
    track.seen = true;
    track.launches = device.launches;
    track.last_launch_at = device.last_launch_at;
    track
        .active_at
        .is_some_and(|at| now.saturating_sub(at) <= window_ns)
}

/// Whether a launch of the container device waited for tokens within
/// `window` (its throttled time grew).
pub fn observe_waits(track: &mut Track, throttled_ns: u64, now: u64, window: Duration) -> bool {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    if throttled_ns > track.throttled_ns && track.seen {
        track.waited_at = Some(now);
    }
    track.throttled_ns = throttled_ns;
    track
        .waited_at
        .is_some_and(|at| now.saturating_sub(at) <= window_ns)
}

pub fn record_history(track: &mut Track, granted: u64, now: u64, window: Duration) {
    let window_ns = window.as_nanos().min(u128::from(u64::MAX)) as u64;
    track.history.push_back((now, granted));
    // Keep the newest sample at least `window` old as the base.
    while track.history.len() > 1
        && track
            .history
            .get(1)
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= window_ns)
    {
        track.history.pop_front();
    }
    while track.history.len() > MAX_HISTORY {
        track.history.pop_front();
    }
}

/// Granted device time per wall time since the base sample, 0..=1.
pub fn granted_rate(track: &mut Track, granted: u64, now: u64, window: Duration) -> Option<f64> {
    record_history(track, granted, now, window);
    let (t0, g0) = *track.history.front()?;
    let elapsed = now.saturating_sub(t0);
    if elapsed == 0 {
        return None;
    }
    let used = granted.saturating_sub(g0);
    Some((used as f64 / elapsed as f64).clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_node_contract::region::SHARE_UNLIMITED;

    #[test]
    fn activity_follows_the_counters_and_expires() {
        let mut track = Track::default();
        let window = Duration::from_secs(1);
        let mut device = DeviceFigures {
            launches: 5,
            ..DeviceFigures::default()
        };
        assert!(
            !observe(&mut track, &device, false, 1_000, window),
            "first sight is a baseline"
        );
        device.launches = 6;
        assert!(observe(&mut track, &device, false, 2_000, window));
        assert!(observe(&mut track, &device, false, 500_000_000, window));
        assert!(!observe(&mut track, &device, false, 1_100_000_000, window));
        device.last_launch_at = 1_200_000_000;
        assert!(observe(&mut track, &device, false, 1_300_000_000, window));
        // A stamp from the future (garbage) does not count.
        device.last_launch_at = u64::MAX;
        assert!(!observe(&mut track, &device, false, 9_000_000_000, window));
        assert!(
            observe(&mut track, &device, true, 9_100_000_000, window),
            "NVML says busy"
        );
    }

    #[test]
    fn a_wait_counts_while_the_throttled_time_grew_within_the_window() {
        let mut track = Track::default();
        let window = Duration::from_secs(1);
        let device = DeviceFigures::default();
        observe(&mut track, &device, false, 1_000, window);
        assert!(!observe_waits(&mut track, 0, 1_000, window));
        assert!(observe_waits(&mut track, 5_000, 2_000, window), "grew");
        assert!(
            observe_waits(&mut track, 5_000, 900_000_000, window),
            "still within the window"
        );
        assert!(!observe_waits(&mut track, 5_000, 1_100_000_000, window));
        // A counter that went back (a new region) is no wait, and the
        // next growth is measured from it.
        assert!(!observe_waits(&mut track, 10, 1_200_000_000, window));
        assert!(observe_waits(&mut track, 20, 1_300_000_000, window));
    }

    #[test]
    fn utilization_is_granted_time_over_the_window() {
        let mut track = Track::default();
        let window = Duration::from_secs(1);
        assert_eq!(granted_rate(&mut track, 0, 1_000_000_000, window), None);
        for step in 1..=20u64 {
            let now = 1_000_000_000 + step * 100_000_000;
            let rate = granted_rate(&mut track, step * 30_000_000, now, window);
            if step >= 10 {
                let rate = rate.expect("rate");
                assert!((rate - 0.3).abs() < 1e-9, "{rate}");
            }
        }
        assert!(track.history.len() <= 12);
        // Counters going backwards (garbage) give 0, not a panic.
        assert_eq!(
            granted_rate(&mut track, 0, 3_100_000_000, window),
            Some(0.0)
        );
        assert_eq!(
            granted_rate(&mut track, u64::MAX, 3_200_000_000, window),
            Some(1.0)
        );
    }

    #[test]
    fn metering_depends_on_the_cap_in_force() {
        assert!(is_metered(Some(UtilizationPolicy::Default), 30, 3000));
        assert!(is_metered(Some(UtilizationPolicy::Default), 0, 0), "paused");
        assert!(!is_metered(
            Some(UtilizationPolicy::Default),
            0,
            SHARE_UNLIMITED
        ));
        assert!(is_metered(
            Some(UtilizationPolicy::Force),
            30,
            SHARE_UNLIMITED
        ));
        assert!(!is_metered(Some(UtilizationPolicy::Disable), 30, 3000));
        assert!(!is_metered(None, 30, 3000));
    }
}
