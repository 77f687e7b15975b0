//! What this process has allocated, so every free path can give back exactly
//! what was charged.
//!
//! The table maps an allocation's identity (device pointer, array, module,
//! context, physical handle or pool) to the device, kind and size charged for
//! it. It is guarded by a tiny lock of our own rather than `std::sync::Mutex`
//! because a forked child must be able to take the table over even if
//! another thread held the lock at the moment of `fork` (see
//! [`AllocationTable::after_fork_in_child`]).

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use vgpu_common::region::MemoryKind;

/// What an entry stands for; part of the key, since handles of different
/// kinds come from different number spaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    DevicePointer,
    Array,
    Module,
    Context,
    PhysicalHandle,
    Pool,
}

/// What was charged for one resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    pub device: usize,
    pub kind: MemoryKind,
    pub bytes: u64,
    /// Context the resource belongs to (0 when not tied to one).
    pub context: usize,
    /// Pool a stream-ordered allocation came from (0 for none); the pool,
    /// not the allocation, carries the charge.
    pub pool: usize,
}

pub struct AllocationTable {
    locked: AtomicBool,
    entries: UnsafeCell<Option<HashMap<(Resource, u64), Charge>>>,
}

// SAFETY: `entries` is only touched while `locked` is held (see `with`).
unsafe impl Sync for AllocationTable {}

impl AllocationTable {
    pub const fn new() -> Self {
        Self {
            locked: AtomicBool::new(false),
            entries: UnsafeCell::new(None),
        }
    }

    fn lock(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // Critical sections are a hash-map operation long; a holder
                // that is descheduled gets the CPU back this way.
                std::thread::yield_now();
            }
        }
    }

    fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// Runs `f` on the entries under the lock.
    pub fn with<T>(&self, f: impl FnOnce(&mut HashMap<(Resource, u64), Charge>) -> T) -> T {
        self.lock();
        // SAFETY: the lock gives this thread exclusive access to `entries`.
        let entries = unsafe { &mut *self.entries.get() };
        let map = entries.get_or_insert_with(|| HashMap::with_capacity(1024));
        let result = f(map);
        self.unlock();
        result
    }

    pub fn insert(&self, resource: Resource, id: u64, charge: Charge) -> Option<Charge> {
        self.with(|map| map.insert((resource, id), charge))
    }

    pub fn remove(&self, resource: Resource, id: u64) -> Option<Charge> {
        self.with(|map| map.remove(&(resource, id)))
    }

    pub fn get(&self, resource: Resource, id: u64) -> Option<Charge> {
        self.with(|map| map.get(&(resource, id)).copied())
    }

    /// Removes and returns every entry tied to `context`.
    pub fn drain_context(&self, context: usize) -> Vec<((Resource, u64), Charge)> {
        self.with(|map| {
            let keys: Vec<(Resource, u64)> = map
                .iter()
                .filter(|(_, charge)| charge.context == context)
                .map(|(key, _)| *key)
                .collect();
            keys.into_iter()
                .filter_map(|key| map.remove(&key).map(|charge| (key, charge)))
                .collect()
        })
    }

    /// `pthread_atfork` prepare handler: no other thread may be inside the
    /// table while the address space is copied.
    pub fn before_fork(&self) {
        self.lock();
    }

    /// `pthread_atfork` parent handler.
    pub fn after_fork_in_parent(&self) {
        self.unlock();
    }

    /// `pthread_atfork` child handler: the child's charges start empty (its
    /// parent's allocations stay charged to the parent's slot).
    pub fn after_fork_in_child(&self) {
        // SAFETY: the prepare handler took the lock, and the child has a
        // single thread, so nothing else can be using `entries`.
        let entries = unsafe { &mut *self.entries.get() };
        if let Some(map) = entries.as_mut() {
            map.clear();
        }
        self.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(context: usize) -> Charge {
        Charge {
            device: 0,
            kind: MemoryKind::Data,
            bytes: 10,
            context,
            pool: 0,
        }
    }

    #[test]
    fn insert_remove_and_drain() {
        let table = AllocationTable::new();
        table.insert(Resource::DevicePointer, 1, charge(7));
        table.insert(Resource::Array, 1, charge(7));
        table.insert(Resource::DevicePointer, 2, charge(8));
        assert_eq!(table.get(Resource::Array, 1), Some(charge(7)));
        assert_eq!(table.drain_context(7).len(), 2);
        assert_eq!(table.remove(Resource::DevicePointer, 1), None);
        assert_eq!(table.remove(Resource::DevicePointer, 2), Some(charge(8)));
    }

    #[test]
    fn child_handler_clears_and_unlocks() {
        let table = AllocationTable::new();
        table.insert(Resource::Module, 3, charge(1));
        table.before_fork();
        table.after_fork_in_child();
        assert_eq!(table.get(Resource::Module, 3), None);
    }
}
