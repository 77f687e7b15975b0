//! The limits a region enforces, read and changed: the grant's where one is
//! attached, with the region's own copy put back beside them.

use super::file::{Region, RegionError};
use super::layout::UNCAPPED;
use super::limits::{BelowUse, RegionLimits};
use std::sync::atomic::Ordering;

impl Region {
    /// The limits enforced: the node's grant where one is attached, else
    /// the region's own.
    pub fn limits(&self) -> RegionLimits {
        self.enforced_limits().load()
    }

    /// Puts back `granted` where the enforced limits, or the region's own
    /// copy of them (which the container it limits can write), differ from
    /// it; see [`Limits::restore`]. Returns whether anything had been
    /// changed.
    pub fn restore_limits(&self, granted: &RegionLimits) -> Result<bool, RegionError> {
        let mut changed = self.writable_limits()?.restore(granted);
        if self.grant().is_some() {
            changed |= self.layout().limits.restore(granted);
        }
        Ok(changed)
    }

    /// Replaces the limits while the container's processes run (`vgpu set`,
    /// a resize). Refused, changing nothing, when a memory cap would fall
    /// below what the container holds on that device: checked under the
    /// region mutex, so no reservation can slip in between. Each device's
    /// effective share restarts at its new share, which is what the shim
    /// applies until a node monitor arbitrates again.
    pub fn update_limits(
        &self,
        limits: &RegionLimits,
    ) -> Result<Result<(), BelowUse>, RegionError> {
        let layout = self.layout();
        let enforced = self.writable_limits()?;
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
            for copy in [Some(enforced), self.grant().map(|_| &layout.limits)]
                .into_iter()
                .flatten()
            {
                copy.store(limits);
                copy.start_effective(limits);
            }
            Ok(())
        })
    }
}
