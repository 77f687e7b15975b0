//! Process slots: claimed by each process that uses the GPU, returned
//! (with their memory) when it exits or dies.

use super::file::{Region, RegionError};
use super::layout::{MAX_SLOTS, STATE_ACTIVE, STATE_FREE};
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Region {
    /// Claims a free slot for process `pid` (as `getpid()` gives it), whose
    /// PID on the host is `host_pid` (0: not known), returning its index. A
    /// slot left by a dead process is reclaimed on the way.
    pub fn claim_slot(&self, pid: u32, host_pid: u32) -> Result<usize, RegionError> {
        let start = pid as usize % MAX_SLOTS;
        for step in 0..MAX_SLOTS {
            let index = (start + step) % MAX_SLOTS;
            if !self.try_lock_liveness(index)? {
                continue;
            }
            let slot = &self.layout().slots[index];
            if slot.is_active() {
                self.return_slot_memory(index, None)?;
            }
            slot.pid.store(pid, Ordering::Relaxed);
            slot.host_pid.store(host_pid, Ordering::Relaxed);
            slot.generation.fetch_add(1, Ordering::Relaxed);
            self.layout().active.set(index);
            slot.state.store(STATE_ACTIVE, Ordering::Release);
            return Ok(index);
        }
        Err(RegionError::SlotsExhausted {
            path: self.path.clone(),
        })
    }

    /// Returns the memory of every slot whose owner has died. `own` is a slot
    /// this process holds (skipped). Returns how many slots were reclaimed.
    pub fn reclaim_dead_slots(&self, own: Option<usize>) -> Result<usize, RegionError> {
        self.reclaim_dead_slots_waiting(own, None)
    }

    /// [`Region::reclaim_dead_slots`] for a caller that must not wait on a
    /// mutex the region's container may hold for ever (the node monitor):
    /// gives up with [`RegionError::Busy`] after `wait` for each slot.
    pub fn reclaim_dead_slots_within(&self, wait: Duration) -> Result<usize, RegionError> {
        self.reclaim_dead_slots_waiting(None, Some(wait))
    }

    fn reclaim_dead_slots_waiting(
        &self,
        own: Option<usize>,
        wait: Option<Duration>,
    ) -> Result<usize, RegionError> {
        let mut reclaimed = 0;
        let layout = self.layout();
        for index in layout.active.indices() {
            if Some(index) == own {
                continue;
            }
            if self.try_lock_liveness(index)? {
                if layout.slots[index].is_active() {
                    if let Err(error) = self.return_slot_memory(index, wait) {
                        self.unlock_liveness(index);
                        return Err(error);
                    }
                    layout.slots[index]
                        .state
                        .store(STATE_FREE, Ordering::Release);
                    reclaimed += 1;
                }
                layout.active.clear(index);
                self.unlock_liveness(index);
            }
        }
        Ok(reclaimed)
    }

    /// Indices of the slots that are active now.
    pub fn active_slots(&self) -> impl Iterator<Item = usize> + '_ {
        let layout = self.layout();
        layout
            .active
            .indices()
            .filter(|index| layout.slots[*index].is_active())
    }

    /// Gives up `index` (a process that stops using the GPU cleanly).
    pub fn release_slot(&self, index: usize) -> Result<(), RegionError> {
        self.return_slot_memory(index, None)?;
        let layout = self.layout();
        layout.slots[index]
            .state
            .store(STATE_FREE, Ordering::Release);
        layout.active.clear(index);
        self.unlock_liveness(index);
        Ok(())
    }

    fn return_slot_memory(&self, index: usize, wait: Option<Duration>) -> Result<(), RegionError> {
        let layout = self.layout();
        let slot = &layout.slots[index];
        self.with_lock_waiting(wait, || {
            for (record, held) in layout.devices.iter().zip(slot.devices.iter()) {
                let bytes = held.device_bytes();
                let used = record.used.load(Ordering::Relaxed);
                record
                    .used
                    .store(used.saturating_sub(bytes), Ordering::Relaxed);
                let swap = held.swap.swap(0, Ordering::Relaxed);
                let swap_used = record.swap_used.load(Ordering::Relaxed);
                record
                    .swap_used
                    .store(swap_used.saturating_sub(swap), Ordering::Relaxed);
                held.context.store(0, Ordering::Relaxed);
                held.module.store(0, Ordering::Relaxed);
                held.data.store(0, Ordering::Relaxed);
            }
        })
    }

    /// Replaces the liveness file description after `fork`: the child must
    /// not share its parent's, or it would appear to own the parent's slot.
    /// Async-signal-safe (only `open` and `close`), so a fork handler may
    /// call it.
    pub fn reopen_after_fork(&self, path_cstr: &std::ffi::CStr) -> bool {
        // SAFETY: open/close are async-signal-safe; the path is a valid
        // C string owned by the caller.
        let fresh = unsafe { libc::open(path_cstr.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        let old = self.fd.swap(fresh, Ordering::AcqRel);
        if old >= 0 {
            // SAFETY: the inherited fd belongs to this Region; closing the
            // child's copy leaves the parent's lock in place.
            unsafe {
                libc::close(old);
            }
        }
        fresh >= 0
    }
}
