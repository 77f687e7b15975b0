//! The per-container region file.
//!
//! Every process of a container maps the same file (its path comes from
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE`), and so does the node monitor. It holds
//! the container's limits per device, the container's memory use per device,
//! and one slot per process with that process's share of the use.
//!
//! # Invariants and how they are kept
//!
//! - **The cap holds across processes.** A reservation checks and raises the
//!   device total under one process-shared *robust* mutex, before the real
//!   allocation is made; so the sum of all processes' memory never exceeds
//!   the cap, however many allocate at once.
//! - **Nothing is lost when a process dies.** A slot is owned by the process
//!   holding an open-file-description lock (`F_OFD_SETLK`) on one byte of the
//!   file (at [`LIVENESS_LOCK_BASE`] + slot index). The kernel drops that lock
//!   when the process dies, whatever its PID namespace, so any other process
//!   (or the monitor on the host) that can take the lock knows the owner is
//!   gone and returns the slot's memory. PID reuse cannot fool this.
//! - **No lock outlives its holder.** If a process dies inside the mutex, the
//!   next locker gets `EOWNERDEAD`, recomputes every total from the slots
//!   (the slots are the source of truth), and carries on.
//! - **Every field is an atomic** (or the mutex), so other processes writing
//!   the mapping concurrently never cause a data race in this one, and a
//!   corrupt value can only produce a wrong number, never undefined behaviour.
//!
//! Layout version 1 is fixed-size; the header carries magic, version and size
//! so a foreign, truncated or older file is refused with a clear error rather
//! than reinterpreted.

use std::cell::UnsafeCell;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use thiserror::Error;

/// Devices per container the region describes (HAMi-core's limit too).
pub const MAX_DEVICES: usize = 16;
/// Process slots per container.
pub const MAX_SLOTS: usize = 1024;
/// `b"VGPUREGN"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUREGN");
/// Bumped on any incompatible layout change.
pub const LAYOUT_VERSION: u32 = 1;
/// Offset of the first slot's liveness byte. Locks may lie beyond the end of
/// the file; this keeps them clear of the data.
pub const LIVENESS_LOCK_BASE: i64 = 1 << 40;

const STATE_FREE: u32 = 0;
const STATE_ACTIVE: u32 = 1;

/// Region header: identifies the file and the container-wide settings.
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
    /// [`crate::shim_env::UtilizationPolicy`] as u32.
    pub policy: AtomicU32,
    pub priority: AtomicI32,
    pub reserved0: AtomicU32,
    pub created_unix_ms: AtomicU64,
}

/// A process-shared robust pthread mutex, padded to a cache line.
#[repr(C, align(64))]
pub struct SharedMutex {
    raw: UnsafeCell<libc::pthread_mutex_t>,
}

/// Per-device limits and container-wide use.
#[repr(C)]
pub struct DeviceRecord {
    /// Device UUID as text (`GPU-...`), NUL padded; written by the shim.
    pub uuid: [AtomicU64; 6],
    /// Memory cap in bytes; 0 means uncapped.
    pub memory_limit: AtomicU64,
    /// Host-memory swap allowance in bytes; 0 means none.
    pub swap_limit: AtomicU64,
    /// Device memory held by the container: contexts, modules and data.
    pub used: AtomicU64,
    pub swap_used: AtomicU64,
    pub peak_used: AtomicU64,
    /// Allocations refused because of the cap.
    pub oom_events: AtomicU64,
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

    fn counter(&self, kind: MemoryKind) -> &AtomicU64 {
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
    fn set(&self, index: usize) {
        self.words[index / 64].fetch_or(1 << (index % 64), Ordering::AcqRel);
    }

    fn clear(&self, index: usize) {
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
    pub devices: [DeviceRecord; MAX_DEVICES],
    pub slots: [ProcessSlot; MAX_SLOTS],
}

/// Size of a version-1 region file.
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
    fn initial_effective(&self, device: usize) -> u32 {
        match self.sm_limit[device] {
            0 => SHARE_UNLIMITED,
            share => share * (SHARE_FULL / 100),
        }
    }
}

/// Why a region could not be used.
#[derive(Debug, Error)]
pub enum RegionError {
    #[error("region {path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("region {path} is {actual} bytes, expected {expected}: truncated or written by another program; remove it only if no process of the container is running")]
    WrongSize {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("region {path} is not a vgpu region (magic {found:#018x}); refusing to overwrite it")]
    Foreign { path: PathBuf, found: u64 },
    #[error("region {path} has layout version {found}, this build understands {expected}")]
    Version {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("region {path} header is inconsistent: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("region {path}: all {MAX_SLOTS} process slots are held by live processes")]
    SlotsExhausted { path: PathBuf },
    #[error("region {path}: its shared mutex stayed held past the wait (by its container, or by someone who means to block its readers)")]
    Busy { path: PathBuf },
    #[error("region {path}: shared mutex: {what} (error {code})")]
    Mutex {
        path: PathBuf,
        what: &'static str,
        code: i32,
    },
}

/// A reservation the cap did not allow.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("cap {limit} bytes, in use {used} bytes, requested {requested} bytes")]
pub struct CapExceeded {
    pub limit: u64,
    pub used: u64,
    pub requested: u64,
}

/// New limits that would put a memory cap below what is already in use.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("device {device}: a cap of {limit} bytes is below the {used} bytes in use")]
pub struct BelowUse {
    pub device: usize,
    pub limit: u64,
    pub used: u64,
}

/// A mapped region file.
pub struct Region {
    base: NonNull<RegionLayout>,
    /// The open file description that owns this process's liveness lock.
    /// Replaced in a forked child, which must not share its parent's.
    fd: AtomicI32,
    path: PathBuf,
}

// SAFETY: the mapping is shared memory made only of atomics and a
// process-shared mutex; every access goes through those, so it may be used
// from any thread.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of a live mapping of REGION_BYTES made in
        // `map`, not used after this point.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), REGION_BYTES);
        }
        let fd = self.fd.load(Ordering::Acquire);
        if fd >= 0 {
            // SAFETY: the fd was opened by this Region and is owned by it.
            unsafe {
                libc::close(fd);
            }
        }
    }
}

impl Region {
    /// Opens the region at `path`, creating and initialising it with `limits`
    /// if it does not exist. An existing region keeps its own limits (the
    /// first process of a container sets them).
    ///
    /// A new region is built in a private file next to `path` and published
    /// with `link`, which fails if the name exists: processes starting
    /// together never wait for one another, and no half-built region is ever
    /// visible under `path`. An empty file already at `path` (created by a
    /// tool) is initialised in place under `flock` instead.
    pub fn open_or_create(path: &Path, limits: &RegionLimits) -> Result<Self, RegionError> {
        // Bounded: each round either opens the file or loses a creation race
        // to a process that has just published it.
        for _ in 0..8 {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(path)
            {
                Ok(file) => return Self::attach(file, path, limits),
                Err(error) if error.kind() == io::ErrorKind::NotFound => {
                    if let Some(region) = Self::create_and_publish(path, limits)? {
                        return Ok(region);
                    }
                }
                Err(source) => return Err(io_error(path, "open", source)),
            }
        }
        Err(RegionError::Corrupt {
            path: path.to_path_buf(),
            what: "the file keeps appearing and disappearing".into(),
        })
    }

    fn attach(file: File, path: &Path, limits: &RegionLimits) -> Result<Self, RegionError> {
        let size = file_size(&file, path)?;
        if size == REGION_BYTES as u64 {
            let region = Self::map(file, path)?;
            if region.layout().header.ready.load(Ordering::Acquire) == 1 {
                region.validate()?;
                return Ok(region);
            }
            return Self::initialise_locked(region.into_file(), path, limits);
        }
        if size != 0 {
            return Err(RegionError::WrongSize {
                path: path.to_path_buf(),
                actual: size,
                expected: REGION_BYTES as u64,
            });
        }
        Self::initialise_locked(file, path, limits)
    }

    /// Builds a region in a private file and links it to `path`. `None` when
    /// another process published one first.
    fn create_and_publish(path: &Path, limits: &RegionLimits) -> Result<Option<Self>, RegionError> {
        let mut private = path.as_os_str().to_owned();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        private.push(format!(".new.{}.{nanos}", std::process::id()));
        let private = PathBuf::from(private);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&private)
            .map_err(|source| io_error(&private, "create", source))?;
        let built = file
            .set_len(REGION_BYTES as u64)
            .map_err(|source| io_error(&private, "ftruncate", source))
            .and_then(|()| Self::map(file, path))
            .and_then(|region| region.initialise(limits, true).map(|()| region));
        let published = built.and_then(|region| match std::fs::hard_link(&private, path) {
            Ok(()) => Ok(Some(region)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(source) => Err(io_error(path, "link", source)),
        });
        let _ = std::fs::remove_file(&private);
        published
    }

    /// Opens an existing region without creating it (monitor, tools, tests).
    pub fn open_existing(path: &Path) -> Result<Self, RegionError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| io_error(path, "open", source))?;
        let size = file_size(&file, path)?;
        if size != REGION_BYTES as u64 {
            return Err(RegionError::WrongSize {
                path: path.to_path_buf(),
                actual: size,
                expected: REGION_BYTES as u64,
            });
        }
        let region = Self::map(file, path)?;
        if region.layout().header.ready.load(Ordering::Acquire) != 1 {
            return Err(RegionError::Corrupt {
                path: path.to_path_buf(),
                what: "never finished initialising".into(),
            });
        }
        region.validate()?;
        Ok(region)
    }

    fn initialise_locked(
        file: File,
        path: &Path,
        limits: &RegionLimits,
    ) -> Result<Self, RegionError> {
        // flock serialises creators; the kernel drops it if the holder dies,
        // so a creator killed half-way only leaves a file the next one redoes.
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_error(path, "flock", io::Error::last_os_error()));
        }
        let size = file_size(&file, path)?;
        let fresh = size == 0;
        if fresh {
            file.set_len(REGION_BYTES as u64)
                .map_err(|source| io_error(path, "ftruncate", source))?;
        } else if size != REGION_BYTES as u64 {
            return Err(RegionError::WrongSize {
                path: path.to_path_buf(),
                actual: size,
                expected: REGION_BYTES as u64,
            });
        }
        let region = Self::map(file, path)?;
        let header = &region.layout().header;
        if header.ready.load(Ordering::Acquire) == 1 {
            // Another process finished while we waited for the lock.
            region.validate()?;
        } else {
            let magic = header.magic.load(Ordering::Relaxed);
            if magic != 0 && magic != MAGIC {
                return Err(RegionError::Foreign {
                    path: path.to_path_buf(),
                    found: magic,
                });
            }
            region.initialise(limits, fresh)?;
        }
        let fd = region.fd.load(Ordering::Relaxed);
        // SAFETY: fd is open and owned by `region`.
        unsafe {
            libc::flock(fd, libc::LOCK_UN);
        }
        Ok(region)
    }

    fn initialise(&self, limits: &RegionLimits, fresh: bool) -> Result<(), RegionError> {
        let layout = self.layout();
        if !fresh {
            // A dead creator may have left partial state: start from zero.
            // (A file just extended from empty is zero already; clearing it
            // would fault in every page for nothing.)
            // SAFETY: the region is not ready, so no other process uses it
            // (they all wait on the flock we hold), and REGION_BYTES is its
            // mapped size.
            unsafe {
                std::ptr::write_bytes(self.base.as_ptr().cast::<u8>(), 0, REGION_BYTES);
            }
        }
        self.init_mutex()?;
        let header = &layout.header;
        header.magic.store(MAGIC, Ordering::Relaxed);
        header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        header
            .header_bytes
            .store(std::mem::size_of::<Header>() as u32, Ordering::Relaxed);
        header
            .total_bytes
            .store(REGION_BYTES as u64, Ordering::Relaxed);
        header
            .device_count
            .store(MAX_DEVICES as u32, Ordering::Relaxed);
        header.slot_count.store(MAX_SLOTS as u32, Ordering::Relaxed);
        header.policy.store(limits.policy, Ordering::Relaxed);
        header.priority.store(limits.priority, Ordering::Relaxed);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        header.created_unix_ms.store(now_ms, Ordering::Relaxed);
        // Compute budgets accrue from now: time that passes before the
        // first launch is credited (up to the bucket's capacity) rather than
        // lost, as it would be if the clock only started at a first refill.
        let now_monotonic = monotonic_ns();
        for (index, device) in layout.devices.iter().enumerate() {
            device
                .compute
                .refilled_at
                .store(now_monotonic, Ordering::Relaxed);
            device
                .sm_effective
                .store(limits.initial_effective(index), Ordering::Relaxed);
        }
        self.store_limits(limits);
        header.ready.store(1, Ordering::Release);
        Ok(())
    }

    fn init_mutex(&self) -> Result<(), RegionError> {
        let raw = self.layout().lock.raw.get();
        // SAFETY: `attr` is a local initialised by pthread_mutexattr_init
        // before use; `raw` points into our mapping, which no other process
        // uses until `ready` is set.
        let code = unsafe {
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            let code = libc::pthread_mutex_init(raw, &attr);
            libc::pthread_mutexattr_destroy(&mut attr);
            code
        };
        if code != 0 {
            return Err(self.mutex_error("init", code));
        }
        Ok(())
    }

    fn map(file: File, path: &Path) -> Result<Self, RegionError> {
        // SAFETY: mapping a file we opened read-write, with the exact length
        // the caller checked or set; MAP_SHARED so all processes see one copy.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io_error(path, "mmap", io::Error::last_os_error()));
        }
        let base =
            NonNull::new(ptr.cast::<RegionLayout>()).ok_or_else(|| RegionError::Corrupt {
                path: path.to_path_buf(),
                what: "mmap returned null".into(),
            })?;
        Ok(Self {
            base,
            fd: AtomicI32::new(file.into_raw_fd()),
            path: path.to_path_buf(),
        })
    }

    fn into_file(self) -> File {
        let fd = self.fd.swap(-1, Ordering::AcqRel);
        drop(self);
        // SAFETY: we took sole ownership of the fd out of the Region above.
        unsafe { File::from_raw_fd(fd) }
    }

    fn validate(&self) -> Result<(), RegionError> {
        let header = &self.layout().header;
        let magic = header.magic.load(Ordering::Relaxed);
        if magic != MAGIC {
            return Err(RegionError::Foreign {
                path: self.path.clone(),
                found: magic,
            });
        }
        let version = header.version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(RegionError::Version {
                path: self.path.clone(),
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        let checks = [
            (
                "header size",
                header.header_bytes.load(Ordering::Relaxed) as u64,
                std::mem::size_of::<Header>() as u64,
            ),
            (
                "total size",
                header.total_bytes.load(Ordering::Relaxed),
                REGION_BYTES as u64,
            ),
            (
                "device count",
                header.device_count.load(Ordering::Relaxed) as u64,
                MAX_DEVICES as u64,
            ),
            (
                "slot count",
                header.slot_count.load(Ordering::Relaxed) as u64,
                MAX_SLOTS as u64,
            ),
        ];
        for (what, found, expected) in checks {
            if found != expected {
                return Err(RegionError::Corrupt {
                    path: self.path.clone(),
                    what: format!("{what} is {found}, expected {expected}"),
                });
            }
        }
        Ok(())
    }

    /// The mapped layout.
    pub fn layout(&self) -> &RegionLayout {
        // SAFETY: `base` points to a live mapping of REGION_BYTES for as long
        // as `self` lives, and every field is an atomic or the mutex cell.
        unsafe { self.base.as_ref() }
    }

    /// The file this region maps.
    pub fn path(&self) -> &Path {
        &self.path
    }

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
    fn store_limits(&self, limits: &RegionLimits) {
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

    /// Whether the process owning slot `index` is alive (someone holds its
    /// liveness lock).
    pub fn slot_is_live(&self, index: usize) -> Result<bool, RegionError> {
        let fd = self.fd.load(Ordering::Acquire);
        let mut probe = liveness_flock(index, libc::F_WRLCK);
        // SAFETY: F_OFD_GETLK reads and writes only `probe`.
        let rc = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut probe) };
        if rc != 0 {
            return Err(io_error(
                &self.path,
                "fcntl(F_OFD_GETLK)",
                io::Error::last_os_error(),
            ));
        }
        Ok(probe.l_type != libc::F_UNLCK as i16)
    }

    /// Reserves `bytes` of device memory of `kind` for `slot` on `device`,
    /// failing if that would take the container over the device's cap.
    pub fn reserve(
        &self,
        slot: usize,
        device: usize,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<Result<(), CapExceeded>, RegionError> {
        let layout = self.layout();
        let record = &layout.devices[device];
        let counter = layout.slots[slot].devices[device].counter(kind);
        self.with_lock(|| {
            let used = record.used.load(Ordering::Relaxed);
            let limit = record.memory_limit.load(Ordering::Relaxed);
            let new_used = used.saturating_add(bytes);
            if limit > 0 && new_used > limit {
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
        let counter = &layout.slots[slot].devices[device].swap;
        self.with_lock(|| {
            let used = record.swap_used.load(Ordering::Relaxed);
            let limit = record.swap_limit.load(Ordering::Relaxed);
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
        self.layout().devices[device]
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
        self.layout().devices[device]
            .memory_limit
            .load(Ordering::Relaxed)
    }

    /// Records the device's UUID (as the shim learns it from the driver).
    pub fn set_device_uuid(&self, device: usize, uuid: &str) {
        let mut bytes = [0u8; 48];
        let len = uuid.len().min(bytes.len());
        bytes[..len].copy_from_slice(&uuid.as_bytes()[..len]);
        for (word, chunk) in self.layout().devices[device]
            .uuid
            .iter()
            .zip(bytes.chunks_exact(8))
        {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(chunk);
            word.store(u64::from_le_bytes(raw), Ordering::Relaxed);
        }
    }

    /// The device's UUID, if one was recorded and it is valid text.
    pub fn device_uuid(&self, device: usize) -> Option<String> {
        let mut bytes = Vec::with_capacity(48);
        for word in &self.layout().devices[device].uuid {
            bytes.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
        bytes.truncate(end);
        String::from_utf8(bytes).ok().filter(|s| !s.is_empty())
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

    /// Runs `f` holding the region mutex. If the previous holder died inside
    /// it, totals are first rebuilt from the slots.
    fn with_lock<T>(&self, f: impl FnOnce() -> T) -> Result<T, RegionError> {
        self.with_lock_waiting(None, f)
    }

    /// [`Region::with_lock`], waiting at most `wait` for the mutex when given.
    fn with_lock_waiting<T>(
        &self,
        wait: Option<Duration>,
        f: impl FnOnce() -> T,
    ) -> Result<T, RegionError> {
        let raw = self.layout().lock.raw.get();
        let code = match wait {
            // SAFETY: `raw` is the process-shared robust mutex initialised by
            // the region's creator; it lives as long as the mapping.
            None => unsafe { libc::pthread_mutex_lock(raw) },
            Some(wait) => {
                let deadline = realtime_after(wait);
                // SAFETY: as above; `deadline` is a valid timespec read
                // during the call.
                unsafe { libc::pthread_mutex_timedlock(raw, &deadline) }
            }
        };
        match code {
            0 => {}
            libc::ETIMEDOUT => {
                return Err(RegionError::Busy {
                    path: self.path.clone(),
                })
            }
            libc::EOWNERDEAD => {
                self.recount_totals();
                // SAFETY: we hold the mutex (EOWNERDEAD grants it).
                let rc = unsafe { libc::pthread_mutex_consistent(raw) };
                if rc != 0 {
                    return Err(self.mutex_error("consistent", rc));
                }
            }
            other => return Err(self.mutex_error("lock", other)),
        }
        let result = f();
        // SAFETY: locked above by this thread.
        unsafe {
            libc::pthread_mutex_unlock(raw);
        }
        Ok(result)
    }

    /// Rebuilds every device total from the active slots. Called with the
    /// mutex held, after a holder died mid-update.
    fn recount_totals(&self) {
        let layout = self.layout();
        for (device, record) in layout.devices.iter().enumerate() {
            let (mut used, mut swap) = (0u64, 0u64);
            // Every slot, not only the flagged ones: this is the rare
            // recovery path and must not trust a bitmap a dead holder may
            // have been updating.
            for slot in layout.slots.iter().filter(|s| s.is_active()) {
                used = used.saturating_add(slot.devices[device].device_bytes());
                swap = swap.saturating_add(slot.devices[device].swap.load(Ordering::Relaxed));
            }
            record.used.store(used, Ordering::Relaxed);
            record.swap_used.store(swap, Ordering::Relaxed);
        }
    }

    fn try_lock_liveness(&self, index: usize) -> Result<bool, RegionError> {
        let fd = self.fd.load(Ordering::Acquire);
        let lock = liveness_flock(index, libc::F_WRLCK);
        // SAFETY: F_OFD_SETLK reads only `lock`.
        let rc = unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &lock) };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
            _ => Err(io_error(&self.path, "fcntl(F_OFD_SETLK)", err)),
        }
    }

    fn unlock_liveness(&self, index: usize) {
        let fd = self.fd.load(Ordering::Acquire);
        let lock = liveness_flock(index, libc::F_UNLCK);
        // SAFETY: F_OFD_SETLK reads only `lock`; unlocking cannot fail in a
        // way that leaves state to repair.
        unsafe {
            libc::fcntl(fd, libc::F_OFD_SETLK, &lock);
        }
    }

    fn mutex_error(&self, what: &'static str, code: i32) -> RegionError {
        RegionError::Mutex {
            path: self.path.clone(),
            what,
            code,
        }
    }
}

/// `CLOCK_REALTIME` plus `wait`: the deadline `pthread_mutex_timedlock`
/// takes.
fn realtime_after(wait: Duration) -> libc::timespec {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only `now`.
    unsafe {
        libc::clock_gettime(libc::CLOCK_REALTIME, &mut now);
    }
    let nanos = i64::from(wait.subsec_nanos()) + now.tv_nsec;
    let seconds = i64::try_from(wait.as_secs())
        .unwrap_or(i64::MAX)
        .saturating_add(now.tv_sec)
        .saturating_add(nanos / 1_000_000_000);
    libc::timespec {
        tv_sec: seconds,
        tv_nsec: nanos % 1_000_000_000,
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds, the clock compute budgets use.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

fn liveness_flock(index: usize, kind: i32) -> libc::flock {
    // SAFETY: flock is plain old data; all-zero is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as i16;
    lock.l_whence = libc::SEEK_SET as i16;
    lock.l_start = LIVENESS_LOCK_BASE + index as i64;
    lock.l_len = 1;
    lock
}

fn file_size(file: &File, path: &Path) -> Result<u64, RegionError> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| io_error(path, "stat", source))
}

fn io_error(path: &Path, op: &'static str, source: io::Error) -> RegionError {
    RegionError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vgpu-region-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        dir
    }

    fn limits(cap: u64) -> RegionLimits {
        let mut limits = RegionLimits::default();
        limits.memory_limit[0] = cap;
        limits
    }

    #[test]
    fn limits_changed_from_inside_are_restored_and_reported() {
        let path = temp_path("restore");
        let mut granted = limits(4 << 30);
        granted.sm_limit[0] = 30;
        granted.sm_burst[0] = 50;
        granted.priority = 3;
        let region = Region::open_or_create(&path, &granted).expect("create");
        assert!(!region.restore_limits(&granted), "nothing to restore");
        let device = &region.layout().devices[0];
        // Lent up to the burst by the monitor: allowed.
        device.sm_effective.store(5000, Ordering::Relaxed);
        assert!(!region.restore_limits(&granted));
        // Raised from inside.
        device.memory_limit.store(64 << 30, Ordering::Relaxed);
        region.layout().header.policy.store(2, Ordering::Relaxed);
        assert!(region.restore_limits(&granted));
        assert_eq!(region.limits(), granted.as_stored());
        device
            .sm_effective
            .store(SHARE_UNLIMITED, Ordering::Relaxed);
        assert!(region.restore_limits(&granted));
        assert_eq!(device.sm_effective.load(Ordering::Relaxed), 3000);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn layout_size_is_stable() {
        // A change here is a layout change: bump LAYOUT_VERSION.
        assert_eq!(std::mem::size_of::<Header>(), 56);
        assert_eq!(std::mem::size_of::<SharedMutex>(), 64);
        assert_eq!(std::mem::size_of::<DeviceRecord>(), 240);
        assert_eq!(std::mem::size_of::<ProcessSlot>(), 24 + 32 * MAX_DEVICES);
    }

    #[test]
    fn reserve_respects_cap_and_release_returns() {
        let path = temp_path("cap");
        let region = Region::open_or_create(&path, &limits(1000)).expect("create");
        let slot = region.claim_slot(1, 0).expect("slot");
        assert_eq!(
            region.reserve(slot, 0, MemoryKind::Data, 600).expect("io"),
            Ok(())
        );
        let refused = region
            .reserve(slot, 0, MemoryKind::Data, 401)
            .expect("io")
            .expect_err("over cap");
        assert_eq!(
            refused,
            CapExceeded {
                limit: 1000,
                used: 600,
                requested: 401
            }
        );
        assert_eq!(
            region
                .reserve(slot, 0, MemoryKind::Module, 400)
                .expect("io"),
            Ok(())
        );
        assert_eq!(region.device_used(0), 1000);
        assert!(region.release(slot, 0, MemoryKind::Data, 600).expect("io"));
        assert!(
            !region
                .release(slot, 0, MemoryKind::Module, 500)
                .expect("io"),
            "over-release is clamped"
        );
        assert_eq!(region.device_used(0), 0);
        assert_eq!(
            region.layout().devices[0]
                .oom_events
                .load(Ordering::Relaxed),
            1
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn concurrent_creators_end_up_sharing_one_region() {
        let dir = std::env::temp_dir().join(format!("vgpu-region-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("region");
        let regions: Vec<Region> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..16)
                .map(|_| {
                    scope.spawn(|| Region::open_or_create(&path, &limits(1 << 30)).expect("open"))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        for (pid, region) in regions.iter().enumerate() {
            let slot = region.claim_slot(pid as u32, 0).expect("slot");
            region
                .reserve(slot, 0, MemoryKind::Data, 1)
                .expect("io")
                .expect("fits");
        }
        for region in &regions {
            assert_eq!(
                region.device_used(0),
                16,
                "every opener sees every reservation"
            );
        }
        let names: Vec<_> = std::fs::read_dir(&dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("region")],
            "no private files left behind"
        );
        drop(regions);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_empty_file_is_initialised_in_place() {
        let path = temp_path("empty");
        std::fs::write(&path, b"").expect("create empty");
        let region = Region::open_or_create(&path, &limits(77)).expect("initialise");
        assert_eq!(region.device_limit(0), 77);
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len(),
            REGION_BYTES as u64
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn swap_has_its_own_allowance_and_is_returned_with_the_slot() {
        let path = temp_path("swap");
        let mut with_swap = limits(1000);
        with_swap.swap_limit[0] = 500;
        let region = Region::open_or_create(&path, &with_swap).expect("create");
        let other = Region::open_existing(&path).expect("attach");
        let theirs = other.claim_slot(9, 0).expect("slot");
        assert_eq!(other.reserve_swap(theirs, 0, 400).expect("io"), Ok(()));
        assert!(other.reserve_swap(theirs, 0, 101).expect("io").is_err());
        assert_eq!(region.device_swap_used(0), 400);
        assert_eq!(region.device_used(0), 0, "swap is not device memory");
        drop(other);
        assert_eq!(region.reclaim_dead_slots(None).expect("sweep"), 1);
        assert_eq!(region.device_swap_used(0), 0);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn existing_region_keeps_its_limits() {
        let path = temp_path("keep");
        let first = Region::open_or_create(&path, &limits(1000)).expect("create");
        let second = Region::open_or_create(&path, &limits(5)).expect("attach");
        assert_eq!(second.device_limit(0), 1000);
        drop(first);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn refuses_truncated_foreign_and_future_files() {
        let path = temp_path("bad");
        std::fs::write(&path, b"hello").expect("write");
        assert!(matches!(
            Region::open_or_create(&path, &limits(1)),
            Err(RegionError::WrongSize { .. })
        ));
        assert_eq!(
            std::fs::read(&path).expect("read"),
            b"hello",
            "left untouched"
        );

        let mut foreign = vec![0u8; REGION_BYTES];
        foreign[..8].copy_from_slice(b"SOMEELSE");
        foreign[24] = 1; // ready
        std::fs::write(&path, &foreign).expect("write");
        assert!(matches!(
            Region::open_or_create(&path, &limits(1)),
            Err(RegionError::Foreign { .. })
        ));

        let mut future = vec![0u8; REGION_BYTES];
        future[..8].copy_from_slice(b"VGPUREGN");
        future[8] = 99;
        future[24] = 1;
        std::fs::write(&path, &future).expect("write");
        let err = Region::open_or_create(&path, &limits(1))
            .err()
            .expect("refused");
        assert!(
            matches!(err, RegionError::Version { found: 99, .. }),
            "{err}"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn slot_of_a_dead_owner_is_reclaimed() {
        let path = temp_path("dead");
        let region = Region::open_or_create(&path, &limits(1 << 20)).expect("create");
        // A second open file description stands in for another process.
        let other = Region::open_existing(&path).expect("attach");
        let theirs = other.claim_slot(2, 0).expect("slot");
        other
            .reserve(theirs, 0, MemoryKind::Data, 4096)
            .expect("io")
            .expect("fits");
        assert!(region.slot_is_live(theirs).expect("probe"));
        assert_eq!(
            region.reclaim_dead_slots(None).expect("sweep"),
            0,
            "owner alive"
        );
        drop(other); // closes its file description: the kernel drops its lock
        assert!(!region.slot_is_live(theirs).expect("probe"));
        assert_eq!(region.reclaim_dead_slots(None).expect("sweep"), 1);
        assert_eq!(region.device_used(0), 0);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_process_that_dies_holding_the_mutex_blocks_no_one() {
        let path = temp_path("owner-dead");
        let region = Region::open_or_create(&path, &limits(1000)).expect("create");
        let slot = region.claim_slot(4, 0).expect("slot");
        region
            .reserve(slot, 0, MemoryKind::Data, 100)
            .expect("io")
            .expect("fits");
        // A total that disagrees with the slots, as a holder killed between
        // its two writes would leave it.
        region.layout().devices[0]
            .used
            .store(999, Ordering::Relaxed);
        // SAFETY: the child only locks the shared mutex and exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: the region's robust mutex, in shared memory.
            unsafe {
                libc::pthread_mutex_lock(region.layout().lock.raw.get());
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        // The next locker inherits the mutex, rebuilds the totals and goes on.
        assert_eq!(
            region.reserve(slot, 0, MemoryKind::Data, 900).expect("io"),
            Ok(())
        );
        assert_eq!(region.device_used(0), 1000);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn totals_are_rebuilt_from_slots_after_a_recount() {
        let path = temp_path("recount");
        let region = Region::open_or_create(&path, &limits(0)).expect("create");
        let slot = region.claim_slot(3, 0).expect("slot");
        region
            .reserve(slot, 0, MemoryKind::Data, 100)
            .expect("io")
            .expect("fits");
        // Simulate a holder that died between updating the total and the slot.
        region.layout().devices[0]
            .used
            .store(12345, Ordering::Relaxed);
        region.recount_totals();
        assert_eq!(region.device_used(0), 100);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn limits_updated_while_running_refuse_a_cap_below_use() {
        let path = temp_path("update");
        let mut first = limits(1000);
        first.sm_limit[0] = 60;
        let region = Region::open_or_create(&path, &first).expect("create");
        let slot = region.claim_slot(4, 0).expect("slot");
        region
            .reserve(slot, 0, MemoryKind::Data, 600)
            .expect("io")
            .expect("fits");
        let mut lower = first;
        lower.memory_limit[0] = 500;
        lower.sm_limit[0] = 20;
        assert_eq!(
            region.update_limits(&lower).expect("io"),
            Err(BelowUse {
                device: 0,
                limit: 500,
                used: 600
            })
        );
        assert_eq!(region.limits(), first.as_stored(), "nothing changed");
        lower.memory_limit[0] = 600;
        region.update_limits(&lower).expect("io").expect("at use");
        assert_eq!(region.limits(), lower.as_stored());
        let device = &region.layout().devices[0];
        assert_eq!(device.sm_effective.load(Ordering::Relaxed), 2000);
        lower.sm_limit[0] = 0;
        region.update_limits(&lower).expect("io").expect("uncapped");
        assert_eq!(device.sm_effective.load(Ordering::Relaxed), SHARE_UNLIMITED);
        let _ = std::fs::remove_file(&path);
    }
}
