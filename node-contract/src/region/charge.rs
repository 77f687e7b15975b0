//! Charging and returning device memory and swap against the caps.

use super::file::{Region, RegionError};
use super::layout::{MemoryKind, UNCAPPED};
use std::sync::atomic::Ordering;
use thiserror::Error;

/// A reservation the cap did not allow.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("cap {limit} bytes, in use {used} bytes, requested {requested} bytes")]
pub struct CapExceeded {
    pub limit: u64,
    pub used: u64,
    pub requested: u64,
}

impl Region {
    /// Reserves `bytes` of device memory of `kind` for `slot` on `device`,
    /// failing if that would take the container over the device's cap.
    pub fn reserve(
        &self,
        slot: usize,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<Result<(), CapExceeded>, RegionError> {
        self.reserve_under(slot, device, kind, bytes, UNCAPPED)
    }

    /// [`Region::reserve`] under a cap of `ceiling` bytes too, where that is
    /// lower than the enforced one ([`UNCAPPED`]: none): a process's own
    /// environment may lower its container's cap for it, never raise it.
    pub fn reserve_under(
        &self,
        slot: usize,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
        ceiling: u64,
    ) -> Result<Result<(), CapExceeded>, RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let limits = &self.enforced_limits().devices[device];
        let counter = layout.slots[slot].devices[device].counter(kind);
        self.with_lock(|| {
            let used = record.used.load(Ordering::Relaxed);
            let limit = lower_cap(limits.memory_limit.load(Ordering::Relaxed), ceiling);
            let new_used = used.saturating_add(bytes);
            if limit != UNCAPPED && new_used > limit {
                record.oom_events.fetch_add(1, Ordering::Relaxed);
                return Err(CapExceeded {
                    limit,
                    used,
                    requested: bytes,
                });
            }
            record.used.store(new_used, Ordering::Relaxed);
            counter.fetch_add(bytes, Ordering::Relaxed);
            record.peak_used.fetch_max(new_used, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Returns `bytes` of `kind` held by `slot` on `device`. Returning more
    /// than the slot holds is clamped (and reported as `false`) so a bug can
    /// never wrap a counter around.
    pub fn release(
        &self,
        slot: usize,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<bool, RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let counter = layout.slots[slot].devices[device].counter(kind);
        self.with_lock(|| {
            let held = counter.load(Ordering::Relaxed);
            let returned = bytes.min(held);
            counter.store(held - returned, Ordering::Relaxed);
            let used = record.used.load(Ordering::Relaxed);
            record
                .used
                .store(used.saturating_sub(returned), Ordering::Relaxed);
            returned == bytes
        })
    }

    /// Reserves `bytes` of host-memory swap for `slot` on `device`, failing
    /// if that would take the container over the device's swap allowance.
    pub fn reserve_swap(
        &self,
        slot: usize,
        device: usize,
        bytes: u64,
    ) -> Result<Result<(), CapExceeded>, RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let limits = &self.enforced_limits().devices[device];
        let counter = &layout.slots[slot].devices[device].swap;
        self.with_lock(|| {
            let used = record.swap_used.load(Ordering::Relaxed);
            let limit = limits.swap_limit.load(Ordering::Relaxed);
            let new_used = used.saturating_add(bytes);
            if new_used > limit {
                record.oom_events.fetch_add(1, Ordering::Relaxed);
                return Err(CapExceeded {
                    limit,
                    used,
                    requested: bytes,
                });
            }
            record.swap_used.store(new_used, Ordering::Relaxed);
            counter.fetch_add(bytes, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Returns `bytes` of swap held by `slot` on `device` (clamped like
    /// [`Region::release`]).
    pub fn release_swap(
        &self,
        slot: usize,
        device: usize,
        bytes: u64,
    ) -> Result<bool, RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let counter = &layout.slots[slot].devices[device].swap;
        self.with_lock(|| {
            let held = counter.load(Ordering::Relaxed);
            let returned = bytes.min(held);
            counter.store(held - returned, Ordering::Relaxed);
            let used = record.swap_used.load(Ordering::Relaxed);
            record
                .swap_used
                .store(used.saturating_sub(returned), Ordering::Relaxed);
            returned == bytes
        })
    }

    /// Host-memory swap the container holds for `device`.
    pub fn device_swap_used(&self, device: usize) -> u64 {
        self.layout().devices[device]
            .swap_used
            .load(Ordering::Acquire)
    }

    /// Swap allowance of `device` (0 = none).
    pub fn device_swap_limit(&self, device: usize) -> u64 {
        self.enforced_limits().devices[device]
            .swap_limit
            .load(Ordering::Relaxed)
    }

    /// Moves `slot`'s charge of `kind` on `device` from `old_bytes` to
    /// `new_bytes` in one step, without a cap check. For memory the driver
    /// already holds (a pool that grew by more than was reserved for it):
    /// the books must show it even if that means exceeding the cap, so the
    /// next reservation is refused.
    pub fn recharge(
        &self,
        slot: usize,
        device: usize,
        kind: MemoryKind,
        old_bytes: u64,
        new_bytes: u64,
    ) -> Result<(), RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let counter = layout.slots[slot].devices[device].counter(kind);
        self.with_lock(|| {
            let held = counter.load(Ordering::Relaxed);
            let returned = old_bytes.min(held);
            counter.store(held - returned + new_bytes, Ordering::Relaxed);
            let used = record.used.load(Ordering::Relaxed);
            let new_used = used.saturating_sub(returned).saturating_add(new_bytes);
            record.used.store(new_used, Ordering::Relaxed);
            record.peak_used.fetch_max(new_used, Ordering::Relaxed);
        })
    }

    /// Device memory the container holds on `device`.
    pub fn device_used(&self, device: usize) -> u64 {
        self.layout().devices[device].used.load(Ordering::Acquire)
    }

    /// Memory cap of `device` (0 = uncapped).
    pub fn device_limit(&self, device: usize) -> u64 {
        self.enforced_limits().devices[device]
            .memory_limit
            .load(Ordering::Relaxed)
    }
}

/// The lower of two memory caps, where [`UNCAPPED`] is no cap at all.
pub fn lower_cap(cap: u64, other: u64) -> u64 {
    match (cap, other) {
        (UNCAPPED, other) => other,
        (cap, UNCAPPED) => cap,
        (cap, other) => cap.min(other),
    }
}
