//! The container's token bucket for one device, kept in the region so all
//! its processes draw on one budget.
//!
//! A launch may start while the balance is not negative and then spends the
//! device time it is expected to take, possibly going into debt; later
//! launches wait until the share of elapsed wall time has paid the debt.
//! Tokens are credited lazily, only when a launcher finds the balance
//! negative, so a launch with tokens in hand costs two atomic operations and
//! no clock read.

use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::{ComputeBucket, DeviceLimits, SHARE_FULL, SHARE_UNLIMITED};

/// Tokens may accumulate for at most this long of the granted share while
/// the container is idle: enough to absorb sleep overshoot, small enough
/// that a container returning from idle cannot run far over its share.
const BURST_WINDOW_NS: u64 = 50_000_000;
/// Longest single sleep, so a new share from the monitor takes effect soon.
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// Shortest sleep worth making.
const MIN_SLEEP: Duration = Duration::from_micros(20);

/// The share that applies now, in basis points; `None` when uncapped.
/// `ceiling` (basis points, [`SHARE_UNLIMITED`]: none) is the process's
/// own lower share, which applies on top of the container's.
#[inline(always)]
pub fn share(limits: &DeviceLimits, policy: UtilizationPolicy, ceiling: u32) -> Option<u32> {
    let container = match policy {
        UtilizationPolicy::Disable => None,
        UtilizationPolicy::Force => {
            let percent = limits.sm_limit.load(Ordering::Relaxed);
            (percent > 0 && percent < 100).then_some(percent * (SHARE_FULL / 100))
        }
        UtilizationPolicy::Default => {
            let share = limits.sm_effective.load(Ordering::Relaxed);
            (share != SHARE_UNLIMITED && share < SHARE_FULL).then_some(share)
        }
    };
    match container {
        Some(share) => Some(share.min(ceiling)),
        None if ceiling < SHARE_FULL => Some(ceiling),
        None => None,
    }
}

pub use vgpu_node_contract::region::monotonic_ns;

fn credit(bucket: &ComputeBucket, share: u32, now: u64) {
    let last = bucket.refilled_at.load(Ordering::Acquire);
    if now <= last
        || bucket
            .refilled_at
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        // Another launcher credited this interval.
        return;
    }
    if last == 0 {
        // First use: start the clock.
        return;
    }
    let earned = ((now - last) as u128 * share as u128 / SHARE_FULL as u128) as i64;
    let capacity = (BURST_WINDOW_NS as u128 * share as u128 / SHARE_FULL as u128) as i64;
    bucket.capacity_ns.store(capacity as u64, Ordering::Relaxed);
    if let Ok(before) = bucket
        .tokens
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tokens| {
            Some(if tokens >= capacity {
                tokens
            } else {
                tokens.saturating_add(earned).min(capacity)
            })
        })
    {
        let after = if before >= capacity {
            before
        } else {
            before.saturating_add(earned).min(capacity)
        };
        bucket
            .credited_ns
            .fetch_add((after - before).max(0) as u64, Ordering::Relaxed);
    }
}

/// Admits a launch that will occupy the device for `charge_ns`, sleeping
/// while the container is in debt. Returns how long it waited.
pub fn spend(
    bucket: &ComputeBucket,
    limits: &DeviceLimits,
    policy: UtilizationPolicy,
    ceiling: u32,
    charge_ns: u64,
) -> Duration {
    let mut waited = Duration::ZERO;
    loop {
        if bucket.tokens.load(Ordering::Acquire) >= 0 {
            break;
        }
        let Some(share) = share(limits, policy, ceiling) else {
            // The cap was lifted while we waited.
            break;
        };
        credit(bucket, share, monotonic_ns());
        let tokens = bucket.tokens.load(Ordering::Acquire);
        if tokens >= 0 {
            break;
        }
        let sleep = if share == 0 {
            // Paused (a higher-priority container has the device).
            MAX_SLEEP
        } else {
            let deficit = tokens.unsigned_abs() as u128;
            Duration::from_nanos(
                (deficit * SHARE_FULL as u128 / share as u128).min(u64::MAX as u128) as u64,
            )
            .clamp(MIN_SLEEP, MAX_SLEEP)
        };
        std::thread::sleep(sleep);
        waited += sleep;
    }
    bucket
        .tokens
        .fetch_sub(charge_ns.min(i64::MAX as u64) as i64, Ordering::AcqRel);
    bucket.launches.fetch_add(1, Ordering::Relaxed);
    if !waited.is_zero() {
        bucket
            .throttled_ns
            .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
        bucket
            .last_launch_at
            .store(monotonic_ns(), Ordering::Relaxed);
    }
    waited
}

/// Adds `delta_ns` to what the container has been charged (negative
/// refunds): a measured kernel time replacing an estimate.
pub fn correct(bucket: &ComputeBucket, delta_ns: i64) {
    bucket.tokens.fetch_sub(delta_ns, Ordering::AcqRel);
}

/// Gives back the charge of a launch the driver refused.
pub fn refund(bucket: &ComputeBucket, charge_ns: u64) {
    correct(bucket, -(charge_ns.min(i64::MAX as u64) as i64));
    let _ = bucket
        .launches
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            Some(n.saturating_sub(1))
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: u32 = SHARE_UNLIMITED;

    struct Record {
        bucket: Box<ComputeBucket>,
        limits: Box<DeviceLimits>,
    }

    fn record(share_percent: u32) -> Record {
        // SAFETY: both are all atomics; zero is a valid value of each.
        let (bucket, limits): (Box<ComputeBucket>, Box<DeviceLimits>) =
            unsafe { (Box::new(std::mem::zeroed()), Box::new(std::mem::zeroed())) };
        limits.sm_limit.store(share_percent, Ordering::Relaxed);
        limits
            .sm_effective
            .store(share_percent * 100, Ordering::Relaxed);
        Record { bucket, limits }
    }

    fn spend_default(r: &Record, charge_ns: u64) -> Duration {
        spend(
            &r.bucket,
            &r.limits,
            UtilizationPolicy::Default,
            NONE,
            charge_ns,
        )
    }

    #[test]
    fn shares_by_policy() {
        let r = record(30);
        let l = &r.limits;
        assert_eq!(share(l, UtilizationPolicy::Default, NONE), Some(3000));
        assert_eq!(share(l, UtilizationPolicy::Force, NONE), Some(3000));
        assert_eq!(share(l, UtilizationPolicy::Disable, NONE), None);
        l.sm_effective.store(SHARE_UNLIMITED, Ordering::Relaxed);
        assert_eq!(share(l, UtilizationPolicy::Default, NONE), None);
        assert_eq!(
            share(l, UtilizationPolicy::Force, NONE),
            Some(3000),
            "force ignores the monitor"
        );
        l.sm_effective.store(0, Ordering::Relaxed);
        assert_eq!(
            share(l, UtilizationPolicy::Default, NONE),
            Some(0),
            "paused"
        );
        // A process's own lower share applies on top, never above.
        l.sm_effective.store(3000, Ordering::Relaxed);
        assert_eq!(share(l, UtilizationPolicy::Default, 1000), Some(1000));
        assert_eq!(share(l, UtilizationPolicy::Default, 9000), Some(3000));
        l.sm_effective.store(SHARE_UNLIMITED, Ordering::Relaxed);
        assert_eq!(share(l, UtilizationPolicy::Default, 1000), Some(1000));
        assert_eq!(share(l, UtilizationPolicy::Disable, 1000), Some(1000));
    }

    #[test]
    fn credit_respects_share_and_capacity() {
        let r = record(50);
        let bucket = &r.bucket;
        bucket.tokens.store(-10_000_000, Ordering::Relaxed);
        credit(bucket, 5000, 1_000); // starts the clock
        assert_eq!(bucket.tokens.load(Ordering::Relaxed), -10_000_000);
        credit(bucket, 5000, 1_000 + 4_000_000);
        assert_eq!(
            bucket.tokens.load(Ordering::Relaxed),
            -8_000_000,
            "half of 4 ms"
        );
        credit(bucket, 5000, 1_000 + 4_000_000 + 10_000_000_000);
        assert_eq!(
            bucket.tokens.load(Ordering::Relaxed),
            25_000_000,
            "capped at 50 ms x 50 %"
        );
    }

    #[test]
    fn launches_wait_for_the_debt_to_be_paid() {
        let r = record(50);
        // Tokens in hand: no wait, and the charge becomes debt.
        assert_eq!(spend_default(&r, 2_000_000), Duration::ZERO);
        assert_eq!(r.bucket.tokens.load(Ordering::Relaxed), -2_000_000);
        let started = std::time::Instant::now();
        spend_default(&r, 1_000);
        // 2 ms of debt at a 50 % share takes 4 ms of wall time to pay.
        assert!(
            started.elapsed() >= Duration::from_millis(4),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(r.bucket.launches.load(Ordering::Relaxed), 2);
        assert!(r.bucket.throttled_ns.load(Ordering::Relaxed) >= 4_000_000);
    }

    #[test]
    fn corrections_and_refunds_move_tokens_and_counters() {
        let r = record(50);
        spend_default(&r, 1_000);
        correct(&r.bucket, 500);
        assert_eq!(r.bucket.tokens.load(Ordering::Relaxed), -1_500);
        assert_eq!(r.bucket.granted_ns(), 1_500);
        refund(&r.bucket, 1_500);
        assert_eq!(r.bucket.tokens.load(Ordering::Relaxed), 0);
        assert_eq!(r.bucket.granted_ns(), 0);
        assert_eq!(r.bucket.launches.load(Ordering::Relaxed), 0);
    }
}
