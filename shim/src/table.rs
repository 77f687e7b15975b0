//! What this process has allocated, so every free path can give back exactly
//! what was charged.
//!
//! The table maps an allocation's identity (device pointer, array, module,
//! context, physical handle or pool) to the device, kind and size charged for
//! it. It is guarded by a tiny lock of our own rather than `std::sync::Mutex`
//! because a forked child must be able to take the table over even if
//! another thread held the lock at the moment of `fork` (see
//! [`AllocationTable::after_fork_in_child`]).

use crate::lock::ForkSafeLock;
use std::collections::HashMap;
use vgpu_node_contract::region::MemoryKind;

/// What an entry stands for; part of the key, since handles of different
/// kinds come from different number spaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    DevicePointer,
    Array,
    Module,
    /// A CUDA 12 library (`cuLibraryLoad*`).
    Library,
    Context,
    PhysicalHandle,
    Pool,
    /// A device allocation served from mapped host memory (swap).
    SpilledPointer,
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
    /// Host address of a spilled allocation (0 for device memory).
    pub host: usize,
}

type Entries = HashMap<(Resource, u64), Charge>;

pub struct AllocationTable {
    entries: ForkSafeLock<Option<Entries>>,
}

impl AllocationTable {
    pub const fn new() -> Self {
        Self {
            entries: ForkSafeLock::new(None),
        }
    }

    /// Runs `f` on the entries under the lock.
    pub fn with<T>(&self, f: impl FnOnce(&mut Entries) -> T) -> T {
        self.entries
            .with(|entries| f(entries.get_or_insert_with(|| HashMap::with_capacity(1024))))
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
        self.entries.before_fork();
    }

    /// `pthread_atfork` parent handler.
    pub fn after_fork_in_parent(&self) {
        self.entries.after_fork_in_parent();
    }

    /// `pthread_atfork` child handler: the child's charges start empty (its
    /// parent's allocations stay charged to the parent's slot).
    pub fn after_fork_in_child(&self) {
        self.entries.after_fork_in_child(|entries| {
            if let Some(map) = entries.as_mut() {
                map.clear();
            }
        });
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
            host: 0,
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
