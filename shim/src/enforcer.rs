//! The shim's process-wide state: configuration, the container's region,
//! this process's slot and what it has allocated.
//!
//! State is built once, on the first hooked call, so processes of the
//! container that never touch the GPU (shells, package managers) never open
//! the region. The environment is read only then.
//!
//! Where does a process's configuration come from? A container a node set
//! up has the node's grant mounted read-only at
//! [`GRANT_CONTAINER_PATH`]: its limits, its region and what each context
//! is charged come from there, and the environment may only lower a cap or
//! a share for the process ([`ShimConfig::in_node`]). A grant that is
//! there but cannot be read fails closed, so no process of such a
//! container runs without its limits. Where there is no grant (a
//! workstation: `vgpu run`, or HAMi-core's variables alone) the
//! environment is the configuration, unless the region it names has the
//! node's grant beside it (a node-prepared region used from the host),
//! whose limits then apply.

use crate::context_size;
use crate::driver::cuda as real;
use crate::limiter::Limiter;
use crate::table::{AllocationTable, Charge, Resource};
use crate::uuid::format_uuid;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use vgpu_cuda_abi::cuda::*;
use vgpu_node_contract::region::grant_file::GRANT_CONTAINER_PATH;
use vgpu_node_contract::region::{Grant, GrantError, MemoryKind, Region, MAX_DEVICES};
use vgpu_node_contract::shim_env::ShimConfig;
use vgpu_node_contract::size::human_bytes;

/// How hooked calls behave in this process.
// One instance per process lives in a static, so the size of the small
// variants is irrelevant, and boxing would add a load to every hook.
#[allow(clippy::large_enum_variant)]
pub enum Mode {
    /// Nothing configured: forward every call.
    Passthrough,
    /// Limits configured and the region usable.
    Enforce(Enforcer),
    /// The configuration or region is unusable: refuse GPU work rather than
    /// run without the limits the container was promised.
    FailClosed,
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// How long building the mode took (configuration, logging, region), so the
/// slot claim can report the whole set-up time once.
static SETUP_NANOS: AtomicU64 = AtomicU64::new(0);
/// CPU time of the same span (wall time minus any time the thread waited or
/// was descheduled).
static SETUP_CPU_NANOS: AtomicU64 = AtomicU64::new(0);

fn thread_cpu_nanos() -> u64 {
    vgpu_node_contract::region::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The process's mode, initialising it on first use.
#[inline(always)]
pub fn mode() -> &'static Mode {
    MODE.get_or_init(initialise)
}

fn initialise() -> Mode {
    let started = std::time::Instant::now();
    let cpu_started = thread_cpu_nanos();
    let mode = build_mode();
    SETUP_NANOS.store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    SETUP_CPU_NANOS.store(thread_cpu_nanos() - cpu_started, Ordering::Relaxed);
    mode
}

fn build_mode() -> Mode {
    let config = ShimConfig::from_env();
    let log_level = config.as_ref().map(|c| c.log_level).unwrap_or(1);
    crate::logging::init(log_level);
    let config = match config {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "invalid configuration, GPU calls will fail until it is fixed"
            );
            return Mode::FailClosed;
        }
    };
    let grant = match Grant::open_read_only(std::path::Path::new(GRANT_CONTAINER_PATH)) {
        Ok(grant) => Some(grant),
        Err(GrantError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "this container's grant from its node cannot be read, GPU calls will fail"
            );
            return Mode::FailClosed;
        }
    };
    let Some(grant) = grant else {
        if !config.enforces_anything() {
            tracing::debug!("no limits configured; forwarding calls unchanged");
            return Mode::Passthrough;
        }
        return enforce(config, None);
    };
    let settings = match grant.settings() {
        Ok(settings) => settings,
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "this container's grant from its node cannot be read, GPU calls will fail"
            );
            return Mode::FailClosed;
        }
    };
    let granted = grant.limits().load();
    match ShimConfig::in_node(&settings, &granted, |name| std::env::var(name).ok()) {
        Ok((config, ignored)) => {
            for what in ignored {
                tracing::warn!("not followed: {what}; the node's grant applies");
            }
            enforce(config, Some(grant))
        }
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "invalid configuration, GPU calls will fail until it is fixed"
            );
            Mode::FailClosed
        }
    }
}

fn enforce(config: ShimConfig, grant: Option<Grant>) -> Mode {
    match Enforcer::new(config, grant) {
        Ok(enforcer) => Mode::Enforce(enforcer),
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "cannot use the container region, GPU calls will fail"
            );
            Mode::FailClosed
        }
    }
}

const NO_SLOT: usize = usize::MAX;

pub struct Enforcer {
    pub config: ShimConfig,
    pub region: Region,
    region_path: CString,
    slot: AtomicUsize,
    pub table: AllocationTable,
    pub limiter: Limiter,
    /// Primary-context retains this process holds per device.
    primary_retains: [AtomicU32; MAX_DEVICES],
    /// The primary context of each device, once retained (its allocations
    /// are tied to it).
    primary_contexts: [AtomicUsize; MAX_DEVICES],
    /// What a context holds on each device, once measured in this process
    /// (0: not yet; see `context_size`).
    context_bytes: [AtomicU64; MAX_DEVICES],
    /// Pools with a charge in the table (skips pool refresh when zero).
    pools: AtomicUsize,
    last_oom_log_ms: AtomicU64,
    uuids_recorded: AtomicBool,
    warned_device_range: AtomicBool,
}

impl Enforcer {
    fn new(
        config: ShimConfig,
        grant: Option<Grant>,
    ) -> Result<Self, vgpu_node_contract::region::RegionError> {
        let limits = config.limits;
        let path = std::path::Path::new(&config.region_path);
        let region = match grant {
            // The node made the region: a process only attaches to it.
            Some(grant) => Region::open_existing(path)?.with_grant(grant),
            None => {
                let mut region = Region::open_or_create(path, &limits)?;
                // A region a node prepared, used where its mounts are not
                // (a host process given the region's path): its grant
                // beside it holds the limits, as for the node's own tools.
                if let Some(dir) = path.parent() {
                    region.attach_grant_beside(dir, false)?;
                }
                let stored = region.limits();
                if stored.memory_limit != limits.memory_limit || stored.sm_limit != limits.sm_limit
                {
                    tracing::warn!(
                        region = %config.region_path,
                        "limits in the environment differ from the container region's; the region's apply"
                    );
                }
                region
            }
        };
        let region_path = CString::new(config.region_path.clone()).map_err(|_| {
            vgpu_node_contract::region::RegionError::Corrupt {
                path: path.to_path_buf(),
                what: "path contains a NUL byte".into(),
            }
        })?;
        // SAFETY: the handlers are plain functions that only touch
        // async-signal-safe state (see `fork_*`).
        unsafe {
            libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child));
        }
        tracing::debug!(region = %config.region_path, "enforcing limits");
        // Where a node granted the limits, the policy is the grant's.
        let policy = region.limits().utilization_policy();
        let limiter = Limiter::new(policy, &config.share_ceiling);
        Ok(Self {
            config,
            region,
            region_path,
            slot: AtomicUsize::new(NO_SLOT),
            table: AllocationTable::new(),
            limiter,
            primary_retains: Default::default(),
            primary_contexts: Default::default(),
            context_bytes: Default::default(),
            pools: AtomicUsize::new(0),
            last_oom_log_ms: AtomicU64::new(0),
            uuids_recorded: AtomicBool::new(false),
            warned_device_range: AtomicBool::new(false),
        })
    }

    /// This process's slot, claimed on first use. Claiming also returns the
    /// memory of processes of the container that died.
    pub fn slot(&self) -> Result<usize, CUresult> {
        let slot = self.slot.load(Ordering::Acquire);
        if slot != NO_SLOT {
            return Ok(slot);
        }
        let started = std::time::Instant::now();
        let cpu_started = thread_cpu_nanos();
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() } as u32;
        // NVML lists processes by host PID: the slot records it so the
        // process list this shim shows, and the node monitor, can match.
        let host_pid = vgpu_node_contract::process::outermost_pid().unwrap_or(pid);
        let claimed = self.region.claim_slot(pid, host_pid).map_err(|error| {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "cannot claim a process slot"
            );
            CUDA_ERROR_OUT_OF_MEMORY
        })?;
        match self
            .slot
            .compare_exchange(NO_SLOT, claimed, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                match self.region.reclaim_dead_slots(Some(claimed)) {
                    Ok(0) => {}
                    Ok(count) => tracing::info!(count, "returned the memory of exited processes"),
                    Err(error) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "sweeping exited processes failed"
                    ),
                }
                let slot_nanos = started.elapsed().as_nanos() as u64;
                let slot_cpu_nanos = thread_cpu_nanos() - cpu_started;
                let setup_nanos = SETUP_NANOS.swap(0, Ordering::Relaxed);
                let setup_cpu_nanos = SETUP_CPU_NANOS.swap(0, Ordering::Relaxed);
                tracing::debug!(
                    slot = claimed,
                    "ready: set-up took {} ns, cpu {} ns (configuration and region {setup_nanos} ns, process slot {slot_nanos} ns)",
                    setup_nanos + slot_nanos,
                    setup_cpu_nanos + slot_cpu_nanos
                );
                Ok(claimed)
            }
            Err(winner) => {
                // Another thread claimed first; give ours back.
                if let Err(error) = self.region.release_slot(claimed) {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "releasing a surplus slot failed"
                    );
                }
                Ok(winner)
            }
        }
    }

    fn device_index(&self, device: usize) -> Option<usize> {
        if device < MAX_DEVICES {
            return Some(device);
        }
        if !self.warned_device_range.swap(true, Ordering::Relaxed) {
            tracing::warn!(device, "device ordinal beyond {MAX_DEVICES}: not accounted");
        }
        None
    }

    /// Charges `bytes` to `device` if the cap allows it; a refusal is logged.
    pub fn reserve(&self, device: usize, kind: MemoryKind, bytes: u64) -> Result<(), CUresult> {
        self.reserve_or_report(device, kind, bytes, true)
    }

    /// Like [`Enforcer::reserve`] without logging a refusal: for callers
    /// that have another way to serve the allocation.
    pub fn try_reserve(&self, device: usize, kind: MemoryKind, bytes: u64) -> Result<(), CUresult> {
        self.reserve_or_report(device, kind, bytes, false)
    }

    fn reserve_or_report(
        &self,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
        report: bool,
    ) -> Result<(), CUresult> {
        let Some(device) = self.device_index(device) else {
            return Ok(());
        };
        let slot = self.slot()?;
        let attempt = |enforcer: &Self| {
            enforcer
                .region
                .reserve_under(
                    slot,
                    device,
                    kind,
                    bytes,
                    enforcer.config.memory_ceiling[device],
                )
                .map_err(|error| {
                    tracing::error!(
                        error = &error as &dyn std::error::Error,
                        "region reservation failed"
                    );
                    CUDA_ERROR_UNKNOWN
                })
        };
        let refused = match attempt(self)? {
            Ok(()) => return Ok(()),
            Err(_) if self.pools.load(Ordering::Relaxed) > 0 => {
                // Pools may have returned cached memory since they were last
                // looked at: refresh their charges and try once more.
                self.refresh_pools();
                match attempt(self)? {
                    Ok(()) => return Ok(()),
                    Err(refused) => refused,
                }
            }
            Err(refused) => refused,
        };
        if report {
            self.refuse(device, refused);
        }
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn refuse(&self, device: usize, refused: vgpu_node_contract::region::CapExceeded) -> CUresult {
        let now_ms = monotonic_ms();
        let last = self.last_oom_log_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(last) >= 1000
            && self
                .last_oom_log_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                "device {device}: allocation of {} refused: the container holds {} of its {} cap",
                human_bytes(refused.requested),
                human_bytes(refused.used),
                human_bytes(refused.limit),
            );
        }
        CUDA_ERROR_OUT_OF_MEMORY
    }

    /// Returns `bytes` charged to `device`.
    pub fn release(&self, device: usize, kind: MemoryKind, bytes: u64) {
        let Some(device) = self.device_index(device) else {
            return;
        };
        let Ok(slot) = self.slot() else { return };
        match self.region.release(slot, device, kind, bytes) {
            Ok(true) => {}
            Ok(false) => tracing::warn!(device, bytes, "released more than was charged; clamped"),
            Err(error) => tracing::error!(
                error = &error as &dyn std::error::Error,
                "region release failed"
            ),
        }
    }

    /// Charges `bytes` of host-memory swap to `device` if the allowance
    /// permits.
    pub fn reserve_swap(&self, device: usize, bytes: u64) -> Result<(), CUresult> {
        let Some(device) = self.device_index(device) else {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        let slot = self.slot()?;
        match self.region.reserve_swap(slot, device, bytes) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(refused)) => {
                tracing::warn!(
                    "device {device}: {} could not be served from host memory either: the container holds {} of its {} swap",
                    human_bytes(refused.requested),
                    human_bytes(refused.used),
                    human_bytes(refused.limit),
                );
                Err(CUDA_ERROR_OUT_OF_MEMORY)
            }
            Err(error) => {
                tracing::error!(
                    error = &error as &dyn std::error::Error,
                    "region swap reservation failed"
                );
                Err(CUDA_ERROR_UNKNOWN)
            }
        }
    }

    /// Returns what `resource` was charged: swap for spilled allocations,
    /// device memory for everything else.
    pub fn release_charge(&self, resource: Resource, charge: &Charge) {
        if resource == Resource::SpilledPointer {
            let (Some(device), Ok(slot)) = (self.device_index(charge.device), self.slot()) else {
                return;
            };
            if let Err(error) = self.region.release_swap(slot, device, charge.bytes) {
                tracing::error!(
                    error = &error as &dyn std::error::Error,
                    "region swap release failed"
                );
            }
        } else {
            self.release(charge.device, charge.kind, charge.bytes);
        }
    }

    /// Whether allocations on `device` may spill to host memory.
    pub fn may_spill(&self, device: usize) -> bool {
        self.config.oversubscribe
            && device < MAX_DEVICES
            && self.region.device_swap_limit(device) > 0
    }

    /// Sets the charge of `device` from `old` to `new` bytes, unchecked.
    pub fn recharge(&self, device: usize, kind: MemoryKind, old: u64, new: u64) {
        let Some(device) = self.device_index(device) else {
            return;
        };
        let Ok(slot) = self.slot() else { return };
        if let Err(error) = self.region.recharge(slot, device, kind, old, new) {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "region recharge failed"
            );
        }
    }

    /// Runs `allocate` after reserving `bytes` on `device`; on success the
    /// resource it returns is recorded so its free returns the charge, on
    /// failure the reservation is returned at once.
    pub fn charged(
        &self,
        charge: Charge,
        resource: Resource,
        allocate: impl FnOnce() -> (CUresult, u64),
    ) -> CUresult {
        if let Err(code) = self.reserve(charge.device, charge.kind, charge.bytes) {
            return code;
        }
        let (code, id) = allocate();
        if code == CUDA_SUCCESS {
            if let Some(previous) = self.table.insert(resource, id, charge) {
                // The driver reused an identity we thought live: its old
                // charge is stale.
                self.release(previous.device, previous.kind, previous.bytes);
            }
        } else {
            self.release(charge.device, charge.kind, charge.bytes);
        }
        code
    }

    /// Runs `free` and, if it succeeded, returns what `resource` was charged.
    pub fn uncharged(
        &self,
        resource: Resource,
        id: u64,
        free: impl FnOnce() -> CUresult,
    ) -> CUresult {
        let code = free();
        if code == CUDA_SUCCESS {
            if let Some(charge) = self.table.remove(resource, id) {
                self.release_charge(resource, &charge);
                if charge.pool != 0 {
                    self.sync_pool(charge.pool as CUmemoryPool);
                }
            }
        }
        code
    }

    /// The device a context belongs to, for contexts this process created
    /// or retained.
    pub fn device_of_context(&self, context: usize) -> Option<usize> {
        if let Some(device) = self
            .primary_contexts
            .iter()
            .position(|primary| primary.load(Ordering::Acquire) == context)
        {
            return Some(device);
        }
        self.table
            .get(Resource::Context, context as u64)
            .map(|charge| charge.device)
    }

    /// Returns everything charged to a context that no longer exists.
    pub fn release_context_resources(&self, context: usize) {
        self.limiter.forget_context(context);
        for ((resource, id), charge) in self.table.drain_context(context) {
            self.release_charge(resource, &charge);
            if resource == Resource::Pool {
                self.pools.fetch_sub(1, Ordering::Relaxed);
            }
            tracing::trace!(?resource, id, "returned with its context");
        }
    }

    /// Bytes a new context on `device` is charged: what one was measured
    /// to hold in this process, else the configured reserve.
    pub fn context_bytes(&self, device: usize) -> u64 {
        match self.device_index(device) {
            Some(d) => match self.context_bytes[d].load(Ordering::Acquire) {
                0 => self.config.context_reserve,
                measured => measured,
            },
            None => self.config.context_reserve,
        }
    }

    /// A reading of `device` to measure the context about to be created
    /// against; `None` when no measurement is wanted (a reserve was set, or
    /// a context on the device was already measured) or NVML cannot say.
    pub fn before_context(&self, device: usize) -> Option<context_size::Reading> {
        let d = self.device_index(device)?;
        if !self.config.measure_contexts || self.context_bytes[d].load(Ordering::Acquire) != 0 {
            return None;
        }
        context_size::read(d as CUdevice)
    }

    /// Settles the charge of a context just created on `device`, charged
    /// `charged` bytes, against what it measures to hold since `before`.
    /// Returns the bytes the context is now charged.
    pub fn settle_context(
        &self,
        device: usize,
        charged: u64,
        before: Option<context_size::Reading>,
    ) -> u64 {
        let (Some(d), Some(before)) = (self.device_index(device), before) else {
            return charged;
        };
        let measured = context_size::read(d as CUdevice)
            .and_then(|after| context_size::measured(before, after));
        let bytes = match measured {
            Some((bytes, source)) => {
                let bytes = bytes.max(self.config.context_reserve);
                tracing::debug!(
                    device,
                    ?source,
                    "a context holds {} (measured); charging that instead of {}",
                    human_bytes(bytes),
                    human_bytes(charged)
                );
                bytes
            }
            None => {
                tracing::debug!(
                    device,
                    "what the context holds could not be measured; charging {}",
                    human_bytes(charged)
                );
                charged
            }
        };
        // Recorded even when unmeasured, so every context of the device is
        // charged, and released, alike. Two threads measuring at once: the
        // first to finish decides.
        let settled = match self.context_bytes[d].compare_exchange(
            0,
            bytes,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => bytes,
            Err(earlier) => earlier,
        };
        if settled != charged {
            // The context exists: its memory is held whether or not the cap
            // has room, so the charge moves unchecked and later allocations
            // see it.
            self.recharge(device, MemoryKind::Context, charged, settled);
        }
        settled
    }

    /// Primary-context bookkeeping: returns true when this retain is the
    /// process's first on `device` (and so must be charged).
    pub fn primary_retained(&self, device: usize) -> bool {
        self.device_index(device)
            .map(|d| self.primary_retains[d].fetch_add(1, Ordering::AcqRel) == 0)
            .unwrap_or(false)
    }

    /// Remembers the primary context of `device`.
    pub fn note_primary_context(&self, device: usize, context: usize) {
        if let Some(d) = self.device_index(device) {
            self.primary_contexts[d].store(context, Ordering::Release);
        }
    }

    /// The driver destroyed the primary context of `device` (last release or
    /// reset): everything allocated in it is gone too.
    pub fn primary_context_destroyed(&self, device: usize) {
        if let Some(d) = self.device_index(device) {
            let context = self.primary_contexts[d].swap(0, Ordering::AcqRel);
            if context != 0 {
                self.release_context_resources(context);
            }
        }
    }

    /// Undoes `primary_retained` after a failed retain.
    pub fn primary_retain_failed(&self, device: usize) {
        if let Some(d) = self.device_index(device) {
            self.primary_retains[d].fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Returns true when this release drops the process's last retain.
    pub fn primary_released(&self, device: usize) -> bool {
        let Some(d) = self.device_index(device) else {
            return false;
        };
        self.primary_retains[d]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map(|previous| previous == 1)
            .unwrap_or(false)
    }

    /// After a primary-context reset: returns true if the process held it.
    pub fn primary_reset(&self, device: usize) -> bool {
        self.device_index(device)
            .map(|d| self.primary_retains[d].swap(0, Ordering::AcqRel) > 0)
            .unwrap_or(false)
    }

    /// Starts tracking `pool` on `device` (idempotent).
    pub fn track_pool(&self, pool: CUmemoryPool, device: usize) {
        let charge = Charge {
            device,
            kind: MemoryKind::Data,
            bytes: 0,
            context: 0,
            pool: 0,
            host: 0,
        };
        let inserted = self
            .table
            .with(|map| match map.entry((Resource::Pool, pool as u64)) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(charge);
                    true
                }
            });
        if inserted {
            self.pools.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Bytes a pool holds that are not handed out (reusable without growth).
    pub fn pool_cached_bytes(&self, pool: CUmemoryPool) -> u64 {
        let reserved = pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        let used = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        reserved.saturating_sub(used)
    }

    /// Sets a pool's charge to what the driver says it holds now.
    pub fn sync_pool(&self, pool: CUmemoryPool) {
        let reserved = pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        let previous = self.table.with(|map| {
            map.get_mut(&(Resource::Pool, pool as u64)).map(|charge| {
                let old = charge.bytes;
                charge.bytes = reserved;
                (charge.device, old)
            })
        });
        if let Some((device, old)) = previous {
            if old != reserved {
                self.recharge(device, MemoryKind::Data, old, reserved);
            }
        }
    }

    /// Stops tracking a destroyed pool and returns its charge.
    pub fn forget_pool(&self, pool: CUmemoryPool) {
        if let Some(charge) = self.table.remove(Resource::Pool, pool as u64) {
            self.pools.fetch_sub(1, Ordering::Relaxed);
            self.release(charge.device, charge.kind, charge.bytes);
        }
    }

    fn refresh_pools(&self) {
        let pools: Vec<u64> = self.table.with(|map| {
            map.keys()
                .filter(|(resource, _)| *resource == Resource::Pool)
                .map(|(_, id)| *id)
                .collect()
        });
        for pool in pools {
            self.sync_pool(pool as CUmemoryPool);
        }
    }

    /// After `cuInit`: tells the limiter how many devices the process sees
    /// and writes their UUIDs into the region once, for the monitor and for
    /// matching NVML devices to CUDA ordinals.
    pub fn learn_devices(&self) {
        if self.uuids_recorded.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut count = 0i32;
        // SAFETY: valid out-pointer.
        if unsafe { real::cuDeviceGetCount(&mut count) } != CUDA_SUCCESS {
            return;
        }
        self.limiter.set_device_count(count);
        for device in 0..(count.max(0) as usize).min(MAX_DEVICES) {
            let mut uuid = CUuuid::default();
            // SAFETY: valid out-pointer and an ordinal below the count.
            if unsafe { real::cuDeviceGetUuid(&mut uuid, device as CUdevice) } == CUDA_SUCCESS {
                self.region
                    .set_device_uuid(device, &format_uuid(&uuid.bytes));
            }
        }
    }
}

fn pool_attribute(pool: CUmemoryPool, attribute: CUmemPool_attribute) -> u64 {
    let mut value = 0u64;
    // SAFETY: these attributes are 64-bit values written to `value`.
    let code =
        unsafe { real::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) };
    if code == CUDA_SUCCESS {
        value
    } else {
        0
    }
}

/// The current context and its device, if a context is current.
pub fn current_context() -> Option<(usize, usize)> {
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    if unsafe { real::cuCtxGetCurrent(&mut context) } != CUDA_SUCCESS || context.is_null() {
        return None;
    }
    let mut device: CUdevice = 0;
    // SAFETY: valid out-pointer.
    if unsafe { real::cuCtxGetDevice(&mut device) } != CUDA_SUCCESS || device < 0 {
        return None;
    }
    Some((device as usize, context as usize))
}

fn monotonic_ms() -> u64 {
    vgpu_node_contract::region::monotonic_ns() / 1_000_000
}

extern "C" fn fork_prepare() {
    if let Some(Mode::Enforce(enforcer)) = MODE.get() {
        enforcer.table.before_fork();
        enforcer.limiter.before_fork();
    }
}

extern "C" fn fork_parent() {
    if let Some(Mode::Enforce(enforcer)) = MODE.get() {
        enforcer.limiter.after_fork_in_parent();
        enforcer.table.after_fork_in_parent();
    }
}

extern "C" fn fork_child() {
    if let Some(Mode::Enforce(enforcer)) = MODE.get() {
        enforcer.table.after_fork_in_child();
        enforcer.limiter.after_fork_in_child();
        // The child must not share the parent's liveness lock, or it could
        // take the parent's slot for its own.
        enforcer.region.reopen_after_fork(&enforcer.region_path);
        enforcer.slot.store(NO_SLOT, Ordering::Release);
        for retains in &enforcer.primary_retains {
            retains.store(0, Ordering::Relaxed);
        }
        for context in &enforcer.primary_contexts {
            context.store(0, Ordering::Relaxed);
        }
        enforcer.pools.store(0, Ordering::Relaxed);
    }
}
