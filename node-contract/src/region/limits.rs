//! A region's limits: what its creator writes, the node restores and
//! `vgpu set` changes while the container runs.

use super::layout::{MAX_DEVICES, SHARE_FULL, SHARE_UNLIMITED, UNCAPPED};
use super::{Region, RegionError};
use std::sync::atomic::Ordering;
use thiserror::Error;

/// Limits the creator of a region writes into it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionLimits {
    /// Memory cap in bytes ([`UNCAPPED`] = none).
    pub memory_limit: [u64; MAX_DEVICES],
    /// Host-memory swap allowance in bytes (0 = none).
    pub swap_limit: [u64; MAX_DEVICES],
    /// Compute share in percent, 1-99 ([`UNCAPPED_SHARE`] = none).
    pub sm_limit: [u32; MAX_DEVICES],
    /// Burst share in percent (0 = same as `sm_limit`).
    pub sm_burst: [u32; MAX_DEVICES],
    pub policy: u32,
    pub priority: i32,
}

impl RegionLimits {
    /// These limits as a region stores them: a burst share is never below
    /// the share.
    pub fn as_stored(&self) -> RegionLimits {
        let mut stored = *self;
        for (burst, share) in stored.sm_burst.iter_mut().zip(self.sm_limit) {
            *burst = (*burst).max(share);
        }
        stored
    }

    /// The effective share (basis points) a region starts a device with.
    pub(super) fn initial_effective(&self, device: usize) -> u32 {
        match self.sm_limit[device] {
            0 => SHARE_UNLIMITED,
            share => share * (SHARE_FULL / 100),
        }
    }
}

/// New limits that would put a memory cap below what is already in use.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("device {device}: a cap of {limit} bytes is below the {used} bytes in use")]
pub struct BelowUse {
    pub device: usize,
    pub limit: u64,
    pub used: u64,
}

impl Region {
    /// The limits stored in the region.
    pub fn limits(&self) -> RegionLimits {
        let layout = self.layout();
        let mut limits = RegionLimits {
            policy: layout.header.policy.load(Ordering::Relaxed),
            priority: layout.header.priority.load(Ordering::Relaxed),
            ..RegionLimits::default()
        };
        for (index, device) in layout.devices.iter().enumerate() {
            limits.memory_limit[index] = device.memory_limit.load(Ordering::Relaxed);
            limits.swap_limit[index] = device.swap_limit.load(Ordering::Relaxed);
            limits.sm_limit[index] = device.sm_limit.load(Ordering::Relaxed);
            limits.sm_burst[index] = device.sm_burst.load(Ordering::Relaxed);
        }
        limits
    }

    /// Writes `limits` (as stored) into the header and devices; the
    /// effective shares are left to their owner (the node monitor).
    pub(super) fn store_limits(&self, limits: &RegionLimits) {
        let layout = self.layout();
        let stored = limits.as_stored();
        layout.header.policy.store(stored.policy, Ordering::Relaxed);
        layout
            .header
            .priority
            .store(stored.priority, Ordering::Relaxed);
        for (index, device) in layout.devices.iter().enumerate() {
            device
                .memory_limit
                .store(stored.memory_limit[index], Ordering::Relaxed);
            device
                .swap_limit
                .store(stored.swap_limit[index], Ordering::Relaxed);
            device
                .sm_limit
                .store(stored.sm_limit[index], Ordering::Relaxed);
            device
                .sm_burst
                .store(stored.sm_burst[index], Ordering::Relaxed);
        }
    }

    /// Puts back `granted` where the region's limits differ from it (the
    /// file is writable by the container it limits). An effective share
    /// above what the granted burst allows is brought back to the granted
    /// share. Returns whether anything had been changed.
    pub fn restore_limits(&self, granted: &RegionLimits) -> bool {
        let stored = granted.as_stored();
        let mut changed = self.limits() != stored;
        if changed {
            self.store_limits(granted);
        }
        for (index, device) in self.layout().devices.iter().enumerate() {
            let ceiling = match stored.sm_burst[index] {
                0 => SHARE_UNLIMITED,
                burst => burst * (SHARE_FULL / 100),
            };
            if device.sm_effective.load(Ordering::Relaxed) > ceiling {
                device
                    .sm_effective
                    .store(granted.initial_effective(index), Ordering::Relaxed);
                changed = true;
            }
        }
        changed
    }

    /// Replaces the region's limits while its processes run (the `vgpu`
    /// command's `set`). Refused, changing nothing, when a memory cap would
    /// fall below what the container holds on that device: checked under the
    /// region mutex, so no reservation can slip in between. Each device's
    /// effective share restarts at its new share, which is what the shim
    /// applies until a node monitor arbitrates again.
    pub fn update_limits(
        &self,
        limits: &RegionLimits,
    ) -> Result<Result<(), BelowUse>, RegionError> {
        let layout = self.layout();
        self.with_lock(|| {
            for (device, record) in layout.devices.iter().enumerate() {
                let limit = limits.memory_limit[device];
                let used = record.used.load(Ordering::Relaxed);
                if limit != UNCAPPED && used > limit {
                    return Err(BelowUse {
                        device,
                        limit,
                        used,
                    });
                }
            }
            self.store_limits(limits);
            for (device, record) in layout.devices.iter().enumerate() {
                record
                    .sm_effective
                    .store(limits.initial_effective(device), Ordering::Relaxed);
            }
            Ok(())
        })
    }
}
