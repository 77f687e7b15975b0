//! The region file's format: `repr(C)`, made only of atomics and one
//! process-shared mutex, so that every process mapping it (and the node
//! monitor) reads and writes it without data races.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// Devices per container the region describes (HAMi-core's limit too).
pub const MAX_DEVICES: usize = 16;
/// Process slots per container.
pub const MAX_SLOTS: usize = 1024;
/// `b"VGPUREGN"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUREGN");
/// Bumped on any incompatible layout change.
pub const LAYOUT_VERSION: u32 = 2;
/// Offset of the first slot's liveness byte. Locks may lie beyond the end of
/// the file; this keeps them clear of the data.
pub const LIVENESS_LOCK_BASE: i64 = 1 << 40;

pub(super) const STATE_FREE: u32 = 0;
pub(super) const STATE_ACTIVE: u32 = 1;

/// Region header: identifies the file.
#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub header_bytes: AtomicU32,
    pub total_bytes: AtomicU64,
    /// 1 once the creator has finished initialising.
    pub ready: AtomicU32,
    pub device_count: AtomicU32,
    pub slot_count: AtomicU32,
    pub reserved0: AtomicU32,
    pub created_unix_ms: AtomicU64,
}

/// A process-shared robust pthread mutex, padded to a cache line.
#[repr(C, align(64))]
pub struct SharedMutex {
    pub(super) raw: UnsafeCell<libc::pthread_mutex_t>,
}

/// A container's limits, container-wide and per device.
///
/// A region holds one copy, which its creator writes: on a workstation
/// (`vgpu run`, or HAMi-core's variables alone) that copy is what the shim
/// enforces. In a container a node set up, the node's grant file
/// ([`super::grant_file`]) holds the copy that is enforced, in a file the
/// container can only read; the region's own copy then only tells the
/// container what it was granted, and the node monitor puts it back if a
/// process of the container rewrites it.
#[repr(C)]
pub struct Limits {
    /// [`crate::region::UtilizationPolicy`] as u32.
    pub policy: AtomicU32,
    /// Lower is more important.
    pub priority: AtomicI32,
    pub reserved: [AtomicU64; 3],
    pub devices: [DeviceLimits; MAX_DEVICES],
}

/// One device's limits.
#[repr(C)]
pub struct DeviceLimits {
    /// Memory cap in bytes; 0 means uncapped.
    pub memory_limit: AtomicU64,
    /// Host-memory swap allowance in bytes; 0 means none.
    pub swap_limit: AtomicU64,
    /// Configured compute share in percent; 0 means uncapped.
    pub sm_limit: AtomicU32,
    /// Share in percent the container may burst to when the device has idle
    /// capacity (the monitor lends it); equal to `sm_limit` when unset.
    pub sm_burst: AtomicU32,
    /// Share currently granted, in basis points (1/100 of a percent), or
    /// [`SHARE_UNLIMITED`]. Starts at the configured share; the monitor
    /// changes it while programs run and the shim follows.
    pub sm_effective: AtomicU32,
    pub reserved0: AtomicU32,
}

/// A container's use of one device.
#[repr(C)]
pub struct DeviceRecord {
    /// Device UUID as text (`GPU-...`), NUL padded; written by the shim.
    pub uuid: [AtomicU64; 6],
    /// Device memory held by the container: contexts, modules and data.
    pub used: AtomicU64,
    pub swap_used: AtomicU64,
    pub peak_used: AtomicU64,
    /// Allocations refused because of the cap.
    pub oom_events: AtomicU64,
    /// The container's token bucket for this device.
    pub compute: ComputeBucket,
}

/// `sm_effective` value meaning "no compute cap".
pub const SHARE_UNLIMITED: u32 = u32::MAX;
/// Basis points in a whole device.
pub const SHARE_FULL: u32 = 10_000;

/// A container's compute budget on one device, shared by its processes.
///
/// Tokens are nanoseconds of device time. They accrue at the granted share
/// of wall time (up to `capacity_ns`), and every kernel launch spends the
/// device time it is expected to take; a launch waits while the balance is
/// negative. Clock values are `CLOCK_MONOTONIC` nanoseconds, the same in
/// every process on the node.
#[repr(C)]
pub struct ComputeBucket {
    /// Balance in nanoseconds of device time; negative is debt.
    pub tokens: AtomicI64,
    /// When tokens were last credited.
    pub refilled_at: AtomicU64,
    /// Most tokens that may accumulate while the container is idle.
    pub capacity_ns: AtomicU64,
    /// Device time credited to the bucket so far (counter). What launches
    /// have been granted is this less the balance: see [`ComputeBucket::granted_ns`].
    pub credited_ns: AtomicU64,
    /// Time launching threads spent waiting for tokens (counter).
    pub throttled_ns: AtomicU64,
    /// Kernel and graph launches (counter).
    pub launches: AtomicU64,
    /// When a launch was last admitted (coarse: updated on sampled and
    /// throttled launches).
    pub last_launch_at: AtomicU64,
    pub reserved: [AtomicU64; 9],
}

impl ComputeBucket {
    /// Device time charged to launches so far, corrections included: every
    /// charge is taken from the balance, and every credit added to it, so
    /// charges = credits - balance (kept this way so a launch does not have
    /// to update a second counter).
    pub fn granted_ns(&self) -> u64 {
        let credited = self.credited_ns.load(Ordering::Acquire) as i128;
        let balance = self.tokens.load(Ordering::Acquire) as i128;
        (credited - balance).clamp(0, u64::MAX as i128) as u64
    }
}

/// One process's use of one device.
#[repr(C)]
pub struct SlotDevice {
    pub context: AtomicU64,
    pub module: AtomicU64,
    pub data: AtomicU64,
    pub swap: AtomicU64,
}

impl SlotDevice {
    /// Device memory this process holds on the device.
    pub fn device_bytes(&self) -> u64 {
        self.context
            .load(Ordering::Relaxed)
            .saturating_add(self.module.load(Ordering::Relaxed))
            .saturating_add(self.data.load(Ordering::Relaxed))
    }

    pub(super) fn counter(&self, kind: MemoryKind) -> &AtomicU64 {
        match kind {
            MemoryKind::Context => &self.context,
            MemoryKind::Module => &self.module,
            MemoryKind::Data => &self.data,
        }
    }
}

/// One process of the container.
#[repr(C)]
pub struct ProcessSlot {
    pub state: AtomicU32,
    /// PID inside the container's PID namespace.
    pub pid: AtomicU32,
    /// PID on the host, when known (0 otherwise).
    pub host_pid: AtomicU32,
    pub reserved0: AtomicU32,
    /// Incremented each time the slot is claimed.
    pub generation: AtomicU64,
    pub devices: [SlotDevice; MAX_DEVICES],
}

impl ProcessSlot {
    /// The PID NVML knows this process by: its host PID when the slot
    /// records one, else its own (the same outside PID namespaces).
    pub fn nvml_pid(&self) -> u32 {
        match self.host_pid.load(Ordering::Relaxed) {
            0 => self.pid.load(Ordering::Relaxed),
            host => host,
        }
    }

    pub fn is_active(&self) -> bool {
        self.state.load(Ordering::Acquire) == STATE_ACTIVE
    }
}

/// One bit per slot that may be active, so sweeps and readers visit only
/// those slots instead of touching every page of the slot table. A bit is
/// set before its slot becomes active and cleared after it is freed, so it
/// may be stale-set (the slot is then checked and skipped) but never
/// stale-clear for an active slot.
#[repr(C)]
pub struct ActiveSlots {
    pub words: [AtomicU64; MAX_SLOTS / 64],
}

impl ActiveSlots {
    pub(super) fn set(&self, index: usize) {
        self.words[index / 64].fetch_or(1 << (index % 64), Ordering::AcqRel);
    }

    pub(super) fn clear(&self, index: usize) {
        self.words[index / 64].fetch_and(!(1 << (index % 64)), Ordering::AcqRel);
    }

    /// Indices whose bit is set, in order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.words
            .iter()
            .enumerate()
            .flat_map(|(word_index, word)| {
                let mut bits = word.load(Ordering::Acquire);
                std::iter::from_fn(move || {
                    if bits == 0 {
                        return None;
                    }
                    let bit = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    Some(word_index * 64 + bit)
                })
            })
    }
}

/// The whole file.
#[repr(C)]
pub struct RegionLayout {
    pub header: Header,
    pub lock: SharedMutex,
    pub active: ActiveSlots,
    pub limits: Limits,
    pub devices: [DeviceRecord; MAX_DEVICES],
    pub slots: [ProcessSlot; MAX_SLOTS],
}

/// Size of a region file of this layout.
pub const REGION_BYTES: usize = std::mem::size_of::<RegionLayout>();

/// What device memory a reservation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    Context,
    Module,
    Data,
}

/// A memory cap of this many bytes is no cap at all (HAMi-core's encoding,
/// kept everywhere a cap is stored: region, environment, configuration).
pub const UNCAPPED: u64 = 0;
/// A compute share of this many percent is no cap at all.
pub const UNCAPPED_SHARE: u32 = 0;
