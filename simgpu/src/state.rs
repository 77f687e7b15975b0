//! The shared state file: what every process using the simulated GPU sees.
//!
//! Layout (all little-endian, offsets fixed by the device count):
//!
//! | offset | content |
//! | --- | --- |
//! | 0 | [`Header`]: magic, layout version, header size, file size, counts, offsets |
//! | 4096 | 16 × [`DeviceRecord`]: total and used bytes, `busy_until_ns`, ring head, robust process-shared mutex, busy ns, last injected XID event, who holds the device in wall timing, whose turn is next and whose work ran last, and the switches between processes (count and device time) |
//! | `slots_offset` | 256 × [`SlotRecord`]: pid, per-device used bytes, busy ns, context count |
//! | `rings_offset` | per device, 65536 × [`KernelRecord`] (start, end, pid) |
//!
//! A slot is owned by a live process while that process holds an
//! open-file-description lock (`F_OFD_SETLK`) on byte `2^40 + slot` of the
//! file. A slot whose byte someone else can lock belongs to a dead process;
//! its memory is subtracted from the device totals ("reclaimed"), which is
//! how memory of a SIGKILLed process comes back.
//!
//! The file is created and initialised once under `flock`; a file with a
//! different layout (say, another device count) is replaced when no live
//! process uses it, and is an error otherwise.

use std::cell::UnsafeCell;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, PoisonError};

use crate::clock;
use crate::config::{Config, MAX_DEVICES};

/// Process slots in the file.
pub const MAX_SLOTS: usize = 256;
/// Kernel records kept per device.
pub const RING_CAPACITY: u64 = 65_536;
/// "SIMGPU" followed by the format generation.
const MAGIC: u64 = 0x5349_4d47_5055_0001;
/// 2: device records gained the last holder and the switch counters.
/// 3: the header gained the XID generation (a futex word).
const LAYOUT_VERSION: u32 = 4;
const PAGE: u64 = 4096;
/// Slot liveness lock bytes live far beyond the end of the file.
const LOCK_BASE: i64 = 1 << 40;
const NO_SLOT: usize = usize::MAX;

/// File header.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: u32,
    header_size: u32,
    file_size: u64,
    device_count: u32,
    slot_count: u32,
    ring_capacity: u64,
    devices_offset: u64,
    slots_offset: u64,
    rings_offset: u64,
    created_realtime_us: u64,
    /// Bumped after every injected XID (on any device), a futex word:
    /// NVML event sets sleep on it, as a real driver's event wait blocks.
    xid_generation: AtomicU32,
    _reserved: u32,
}

/// One device, as every process sees it.
#[repr(C)]
pub struct DeviceRecord {
    /// Memory of the device in bytes (fixed at creation).
    pub total: AtomicU64,
    /// Bytes in use by all processes: the driver's own record.
    pub used: AtomicU64,
    /// When the last queued kernel ends (`CLOCK_MONOTONIC` ns); in wall
    /// timing, when the last kernel ended.
    pub busy_until_ns: AtomicU64,
    /// Kernel records ever appended to this device's ring.
    pub ring_head: AtomicU64,
    mutex: UnsafeCell<libc::pthread_mutex_t>,
    /// Kernel time ever scheduled on the device (ns, all processes; updated
    /// with the ring, under the mutex).
    pub busy_ns: AtomicU64,
    /// The last injected XID event: sequence number in the high 32 bits
    /// (0: none yet), XID in the low 32 bits. Written by
    /// `simgpu_inject_xid`, read by NVML event sets.
    pub xid_event: AtomicU64,
    /// Wall timing: the next ticket in the queue for the device.
    pub ticket_next: AtomicU32,
    /// Wall timing: the ticket whose holder may take the device next (a
    /// futex word: waiters sleep on it).
    pub ticket_serving: AtomicU32,
    /// Wall timing: slot + 1 of the process holding the device (its turn),
    /// 0 when it is free. Taking the device is a compare-and-swap of this
    /// from 0, so two processes' kernels never overlap whatever the tickets
    /// say.
    pub holder: AtomicU32,
    /// Wall timing: slot + 1 of the process whose turn came last (whose
    /// work the device holds loaded); 0 before any, [`GONE`] once that
    /// process has exited. The next turn of another process is a switch.
    pub last_holder: AtomicU32,
    /// Wall timing: switches between processes completed on the device.
    pub switches: AtomicU64,
    /// Wall timing: device time those switches took (ns), given to no
    /// process.
    pub switch_ns: AtomicU64,
}

/// [`DeviceRecord::last_holder`] of a process that has exited: the turn of
/// whichever process comes next, even one in the same slot, is a switch.
const GONE: u32 = u32::MAX;

/// One process's accounting.
#[repr(C)]
pub struct SlotRecord {
    /// The owner's PID in its own PID namespace (`getpid()`).
    pub pid: AtomicU32,
    /// The inode of the owner's PID namespace, so that a reader in another
    /// namespace can name the process as it sees it (what the kernel does
    /// for NVML). PID-namespace inodes fit 32 bits.
    pub pid_namespace: AtomicU32,
    pub claimed_realtime_us: AtomicU64,
    /// When the owner started, in clock ticks after boot (`/proc/<pid>/stat`,
    /// the same in every namespace): with its own PID, how a reader that may
    /// not read the owner's namespace (no `CAP_SYS_PTRACE`, as a node
    /// monitor with every capability dropped) still finds it.
    pub start_ticks: AtomicU64,
    pub used: [AtomicU64; MAX_DEVICES],
    /// Kernel time this process ever scheduled per device (ns; updated with
    /// the device's ring, under its mutex).
    pub busy_ns: [AtomicU64; MAX_DEVICES],
    pub contexts: [AtomicU32; MAX_DEVICES],
}

impl SlotRecord {
    fn is_empty(&self) -> bool {
        self.pid.load(Ordering::Acquire) == 0
            && self.used.iter().all(|u| u.load(Ordering::Acquire) == 0)
            && self.contexts.iter().all(|c| c.load(Ordering::Acquire) == 0)
    }
}

/// A ticket being served whose holder has not taken the device for this
/// long belongs to a process that died waiting: the next one is served.
/// (A live waiter is woken when its turn comes and takes the device within
/// microseconds.)
const ORPHAN_TICKET_NS: u64 = 1_000_000_000;
/// How long a thread waiting for the device sleeps before it checks
/// whether the holder or the ticket being served belongs to a dead process.
const OCCUPANCY_CHECK_NS: i64 = 10_000_000;
/// How long a reader of a device's ring waits for its mutex before it reads
/// without it (see `Shared::lock_record_to_read`).
const READER_PATIENCE_NS: u64 = 20_000_000;

/// One kernel execution on a device's timeline.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelRecord {
    pub start_ns: u64,
    pub end_ns: u64,
    /// The launching process's PID in its own namespace.
    pub pid: u32,
    /// Its slot plus one (0: unknown), so that a reader in another PID
    /// namespace can name it as it sees it ([`Shared::busy_between`]).
    pub slot: u32,
}

fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// Where things are in a file for a given device count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    devices: usize,
    devices_offset: u64,
    slots_offset: u64,
    rings_offset: u64,
    ring_bytes: u64,
    file_size: u64,
}

impl Layout {
    fn for_devices(devices: usize) -> Layout {
        let devices_offset = PAGE;
        let slots_offset = devices_offset
            + round_up(
                (std::mem::size_of::<DeviceRecord>() * MAX_DEVICES) as u64,
                PAGE,
            );
        let rings_offset =
            slots_offset + round_up((std::mem::size_of::<SlotRecord>() * MAX_SLOTS) as u64, PAGE);
        let ring_bytes = RING_CAPACITY * std::mem::size_of::<KernelRecord>() as u64;
        Layout {
            devices,
            devices_offset,
            slots_offset,
            rings_offset,
            ring_bytes,
            file_size: rings_offset + devices as u64 * ring_bytes,
        }
    }
}

/// Why the state file could not be used.
#[derive(Debug)]
pub enum StateError {
    Io(String),
    Incompatible(String),
    NoFreeSlot,
    Lock(i32),
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Io(m) => write!(f, "state file: {m}"),
            StateError::Incompatible(m) => {
                write!(f, "state file in use with another configuration: {m}")
            }
            StateError::NoFreeSlot => {
                write!(f, "state file: all {MAX_SLOTS} process slots are in use")
            }
            StateError::Lock(e) => write!(f, "state file: device lock failed (errno {e})"),
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn io_err(what: &str, path: &Path) -> StateError {
    StateError::Io(format!(
        "{what} {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    ))
}

/// A mapped state file with this process's slot.
pub struct Shared {
    fd: libc::c_int,
    base: *mut u8,
    layout: Layout,
    own_slot: AtomicUsize,
    reclaim: Mutex<()>,
    pid: u32,
    pid_namespace: u32,
    start_ticks: u64,
    /// The machine's device index of each of this process's devices.
    visible: Vec<usize>,
}

// SAFETY: `base` points to a MAP_SHARED mapping that lives as long as the
// process (Shared values are leaked); all shared fields are atomics or are
// accessed under the robust process-shared mutex.
unsafe impl Send for Shared {}
// SAFETY: see above.
unsafe impl Sync for Shared {}

/// Held device mutex; unlocks on drop.
pub struct DeviceGuard<'a> {
    mutex: *mut libc::pthread_mutex_t,
    _shared: &'a Shared,
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the mutex was locked by this thread in `lock_device`.
        unsafe { libc::pthread_mutex_unlock(self.mutex) };
    }
}

/// A process's turn on a device (wall timing), as it was taken.
#[derive(Clone, Copy, Debug)]
pub struct Turn {
    /// Hands the device on ([`Shared::release_device`]).
    pub ticket: u32,
    /// When the device's last work ended.
    pub free_since: u64,
    /// Another process's work ran on the device last: it switches.
    pub switched: bool,
}

/// Busy time inside a window, for the device and per process.
#[derive(Debug, Default)]
pub struct Busy {
    pub total_ns: u64,
    pub per_pid: Vec<(u32, u64)>,
}

impl Shared {
    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header and is at least one page.
        unsafe { &*(self.base as *const Header) }
    }

    /// The machine's device behind this process's device `ordinal` (the
    /// process may see only some devices: `SIMGPU_VISIBLE_DEVICES`).
    fn physical(&self, ordinal: usize) -> usize {
        self.visible[ordinal]
    }

    /// The XID generation now. Read before looking at the devices' XID
    /// words: an injection after the look has changed it by then.
    pub fn xid_generation(&self) -> u32 {
        self.header().xid_generation.load(Ordering::Acquire)
    }

    /// Tells every NVML event wait, in any process, that an XID was
    /// injected (after its device's word was written).
    pub fn xid_injected(&self) {
        let word = &self.header().xid_generation;
        word.fetch_add(1, Ordering::AcqRel);
        futex_wake_all(word);
    }

    /// Sleeps while the XID generation is still `seen`, at most `timeout`.
    pub fn wait_for_xid(&self, seen: u32, timeout: std::time::Duration) {
        let timeout_ns = i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX);
        futex_wait(&self.header().xid_generation, seen, timeout_ns);
    }

    /// Shared record of this process's device `ordinal`.
    pub fn device(&self, ordinal: usize) -> &DeviceRecord {
        self.record(self.physical(ordinal))
    }

    /// Shared record of the machine's device `index` (< device_count).
    fn record(&self, index: usize) -> &DeviceRecord {
        assert!(index < self.layout.devices);
        // SAFETY: the device table holds MAX_DEVICES records inside the
        // mapping and index is in range; records are only accessed through
        // atomics or under their mutex.
        unsafe {
            &*(self
                .base
                .add(self.layout.devices_offset as usize)
                .cast::<DeviceRecord>()
                .add(index))
        }
    }

    fn slot(&self, index: usize) -> &SlotRecord {
        assert!(index < MAX_SLOTS);
        // SAFETY: the slot table holds MAX_SLOTS records inside the mapping.
        unsafe {
            &*(self
                .base
                .add(self.layout.slots_offset as usize)
                .cast::<SlotRecord>()
                .add(index))
        }
    }

    fn ring(&self, device: usize) -> *mut KernelRecord {
        assert!(device < self.layout.devices);
        // SAFETY: ring `device` lies inside the mapping (file_size covers
        // `devices` rings); only a pointer is formed here.
        unsafe {
            self.base
                .add((self.layout.rings_offset + device as u64 * self.layout.ring_bytes) as usize)
                .cast::<KernelRecord>()
        }
    }

    fn lock_slot_byte(&self, slot: usize, kind: libc::c_short) -> Result<bool, StateError> {
        let mut fl: libc::flock = {
            // SAFETY: flock is plain old data; all-zero is valid.
            unsafe { std::mem::zeroed() }
        };
        fl.l_type = kind;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + slot as i64;
        fl.l_len = 1;
        // SAFETY: `fd` is our open state file and `fl` a valid flock struct.
        let rc = unsafe { libc::fcntl(self.fd, libc::F_OFD_SETLK, &mut fl) };
        if rc == 0 {
            return Ok(true);
        }
        match errno() {
            libc::EAGAIN | libc::EACCES => Ok(false),
            e => Err(StateError::Io(format!("F_OFD_SETLK failed (errno {e})"))),
        }
    }

    /// Subtracts a slot's memory from the devices and empties it. The caller
    /// holds the slot's lock (or is its owner).
    fn clear_slot(&self, index: usize) {
        let rec = self.slot(index);
        for d in 0..self.layout.devices {
            let bytes = rec.used[d].swap(0, Ordering::AcqRel);
            if bytes > 0 {
                sat_sub(&self.record(d).used, bytes);
            }
            rec.contexts[d].store(0, Ordering::Release);
            rec.busy_ns[d].store(0, Ordering::Release);
            // The device may still hold this process's work loaded; a new
            // owner of the slot is another process all the same.
            let _ = self.record(d).last_holder.compare_exchange(
                index as u32 + 1,
                GONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        rec.pid.store(0, Ordering::Release);
    }

    /// Hands on every device that the dead owner of `index` held (wall
    /// timing): it may have exited before its device thread let go. The
    /// caller holds the slot's lock, so no live process holds a device
    /// with it; waiters would find the dead holder by its slot, but not
    /// once a new process uses that slot, and would wait for ever.
    fn free_dead_holds(&self, index: usize) {
        for machine in 0..self.layout.devices {
            let rec = self.record(machine);
            if rec.holder.load(Ordering::Acquire) == index as u32 + 1 {
                let serving = rec.ticket_serving.load(Ordering::Acquire);
                self.hand_on(machine, index as u32 + 1, serving);
            }
        }
    }

    /// This process's slot, claimed on first use.
    pub fn ensure_slot(&self) -> Result<usize, StateError> {
        let own = self.own_slot.load(Ordering::Acquire);
        if own != NO_SLOT {
            return Ok(own);
        }
        let guard = self.reclaim.lock().unwrap_or_else(PoisonError::into_inner);
        let own = self.own_slot.load(Ordering::Acquire);
        if own != NO_SLOT {
            return Ok(own);
        }
        let mut claimed = None;
        'search: for pass in 0..2 {
            for i in 0..MAX_SLOTS {
                if pass == 0 && !self.slot(i).is_empty() {
                    continue;
                }
                if self.lock_slot_byte(i, libc::F_WRLCK as libc::c_short)? {
                    claimed = Some(i);
                    break 'search;
                }
            }
        }
        let index = claimed.ok_or(StateError::NoFreeSlot)?;
        // A previous owner died: give its memory back before reusing.
        self.clear_slot(index);
        self.free_dead_holds(index);
        let rec = self.slot(index);
        rec.claimed_realtime_us
            .store(clock::realtime_us(), Ordering::Release);
        rec.pid_namespace
            .store(self.pid_namespace, Ordering::Release);
        rec.start_ticks.store(self.start_ticks, Ordering::Release);
        rec.pid.store(self.pid, Ordering::Release);
        self.own_slot.store(index, Ordering::Release);
        drop(guard);
        register_exit_handler();
        self.reclaim_dead();
        Ok(index)
    }

    /// Releases the memory of every slot whose owner has died.
    pub fn reclaim_dead(&self) {
        let _guard = self.reclaim.lock().unwrap_or_else(PoisonError::into_inner);
        let own = self.own_slot.load(Ordering::Acquire);
        for i in 0..MAX_SLOTS {
            if i == own || self.slot(i).is_empty() {
                continue;
            }
            if let Ok(true) = self.lock_slot_byte(i, libc::F_WRLCK as libc::c_short) {
                self.clear_slot(i);
                self.free_dead_holds(i);
                let _ = self.lock_slot_byte(i, libc::F_UNLCK as libc::c_short);
            }
        }
    }

    /// Charges `bytes` of device memory to this process, or `Ok(false)` when
    /// the device does not have that much free (after reclaiming dead
    /// processes' memory).
    pub fn charge(&self, device: usize, bytes: u64) -> Result<bool, StateError> {
        let device = self.physical(device);
        let slot = self.ensure_slot()?;
        if bytes == 0 {
            return Ok(true);
        }
        let rec = self.record(device);
        let total = rec.total.load(Ordering::Acquire);
        let try_add = || {
            rec.used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    used.checked_add(bytes).filter(|&sum| sum <= total)
                })
                .is_ok()
        };
        if !try_add() {
            self.reclaim_dead();
            if !try_add() {
                return Ok(false);
            }
        }
        self.slot(slot).used[device].fetch_add(bytes, Ordering::AcqRel);
        Ok(true)
    }

    /// Gives back bytes charged earlier by this process.
    pub fn uncharge(&self, device: usize, bytes: u64) {
        let device = self.physical(device);
        if bytes == 0 {
            return;
        }
        sat_sub(&self.record(device).used, bytes);
        let own = self.own_slot.load(Ordering::Acquire);
        if own != NO_SLOT {
            sat_sub(&self.slot(own).used[device], bytes);
        }
    }

    /// Counts a context of this process on `device` (delta +1 or -1).
    pub fn count_context(&self, device: usize, created: bool) -> Result<(), StateError> {
        let device = self.physical(device);
        let slot = self.ensure_slot()?;
        let counter = &self.slot(slot).contexts[device];
        if created {
            counter.fetch_add(1, Ordering::AcqRel);
        } else {
            let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some(c.saturating_sub(1))
            });
        }
        Ok(())
    }

    /// Locks the machine's device `device`'s robust mutex, recovering it
    /// from a dead owner.
    fn lock_record(&self, device: usize) -> Result<DeviceGuard<'_>, StateError> {
        let mutex = self.record(device).mutex.get();
        // SAFETY: the mutex was initialised (pshared, robust) when the file was.
        let rc = unsafe { libc::pthread_mutex_lock(mutex) };
        match rc {
            0 => {}
            libc::EOWNERDEAD => {
                // The owner died holding it; the protected data is always
                // consistent between single stores, so just mark it so.
                // SAFETY: we own the mutex after EOWNERDEAD.
                unsafe { libc::pthread_mutex_consistent(mutex) };
            }
            e => return Err(StateError::Lock(e)),
        }
        Ok(DeviceGuard {
            mutex,
            _shared: self,
        })
    }

    /// Locks device `device`'s mutex to read the ring, for at most
    /// [`READER_PATIENCE_NS`]: past that the holder is a process stopped
    /// inside its launch (a node monitor pausing it, a debugger), which a
    /// real driver's readers (NVML) never wait for, and the ring is read
    /// without the lock (`None`): a record being written may be missed.
    fn lock_record_to_read(&self, device: usize) -> Result<Option<DeviceGuard<'_>>, StateError> {
        let mutex = self.record(device).mutex.get();
        let mut deadline = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid out-pointer; CLOCK_REALTIME is what
        // pthread_mutex_timedlock measures its deadline on.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut deadline) };
        let nanos = deadline.tv_nsec as u64 + READER_PATIENCE_NS;
        deadline.tv_sec += (nanos / 1_000_000_000) as libc::time_t;
        deadline.tv_nsec = (nanos % 1_000_000_000) as libc::c_long;
        // SAFETY: the mutex was initialised (pshared, robust) when the file was.
        let rc = unsafe { libc::pthread_mutex_timedlock(mutex, &deadline) };
        match rc {
            0 => {}
            libc::EOWNERDEAD => {
                // As in `lock_record`.
                // SAFETY: we own the mutex after EOWNERDEAD.
                unsafe { libc::pthread_mutex_consistent(mutex) };
            }
            libc::ETIMEDOUT => return Ok(None),
            e => return Err(StateError::Lock(e)),
        }
        Ok(Some(DeviceGuard {
            mutex,
            _shared: self,
        }))
    }

    /// Queues a kernel of `duration_ns` on `device`: it starts when the
    /// device is free, now, and `not_before_ns` (its stream's last work) all
    /// hold, and occupies the device exclusively. Returns (start, end).
    pub fn run_kernel(
        &self,
        device: usize,
        not_before_ns: u64,
        duration_ns: u64,
    ) -> Result<(u64, u64), StateError> {
        let device = self.physical(device);
        let slot = self.ensure_slot()?;
        let rec = self.record(device);
        let (start, end) = {
            let _guard = self.lock_record(device)?;
            let start = clock::now_ns()
                .max(rec.busy_until_ns.load(Ordering::Acquire))
                .max(not_before_ns);
            let end = start.saturating_add(duration_ns);
            rec.busy_until_ns.store(end, Ordering::Release);
            let head = rec.ring_head.load(Ordering::Acquire);
            let record = KernelRecord {
                start_ns: start,
                end_ns: end,
                pid: self.pid,
                slot: slot as u32 + 1,
            };
            // SAFETY: the index is below RING_CAPACITY, inside this device's
            // ring, and we hold the device mutex that guards the ring.
            unsafe {
                self.ring(device)
                    .add((head % RING_CAPACITY) as usize)
                    .write_volatile(record)
            };
            rec.ring_head.store(head + 1, Ordering::Release);
            rec.busy_ns.fetch_add(duration_ns, Ordering::AcqRel);
            self.slot(slot).busy_ns[device].fetch_add(duration_ns, Ordering::AcqRel);
            (start, end)
        };
        Ok((start, end))
    }

    /// Wall timing: waits for this process's turn on `device` and takes
    /// it. Tickets are served in order, and a process keeps the device
    /// while it has work queued (at most a time slice while others wait),
    /// as a GPU time-slices contexts: another context's work, its events
    /// included, progresses only in its own turns. Returns the ticket (to
    /// hand the device on with [`Shared::release_device`]), when the
    /// device's last work ended, and whether another process's work ran
    /// last (a switch, see [`Shared::record_switch`]).
    pub fn acquire_device(&self, device: usize) -> Result<Turn, StateError> {
        let machine = self.physical(device);
        let slot = self.ensure_slot()?;
        let me = slot as u32 + 1;
        let rec = self.record(machine);
        let mut ticket = rec.ticket_next.fetch_add(1, Ordering::AcqRel);
        // The free device's turn this waiter has seen unclaimed, and since when.
        let mut unclaimed: Option<(u32, u64)> = None;
        loop {
            let serving = rec.ticket_serving.load(Ordering::Acquire);
            if serving == ticket {
                if rec
                    .holder
                    .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let last = rec.last_holder.swap(me, Ordering::AcqRel);
                    return Ok(Turn {
                        ticket,
                        free_since: rec.busy_until_ns.load(Ordering::Acquire),
                        switched: last != 0 && last != me,
                    });
                }
            } else if (ticket.wrapping_sub(serving) as i32) < 0 {
                // Our turn passed while we did not take it (passed over as
                // a dead process's): queue again.
                ticket = rec.ticket_next.fetch_add(1, Ordering::AcqRel);
                continue;
            }
            if futex_wait(&rec.ticket_serving, serving, OCCUPANCY_CHECK_NS) {
                continue;
            }
            // Nothing moved for a while: the holder, or the owner of the
            // ticket being served, may have died.
            let holder = rec.holder.load(Ordering::Acquire);
            if holder != 0 {
                unclaimed = None;
                self.recover_dead_holder(machine, slot, holder, serving);
                continue;
            }
            let now = clock::now_ns();
            match unclaimed {
                Some((seen, since)) if seen == serving => {
                    if now.saturating_sub(since) > ORPHAN_TICKET_NS {
                        self.pass_over(machine, serving);
                        unclaimed = None;
                    }
                }
                _ => unclaimed = Some((serving, now)),
            }
        }
    }

    /// Wall timing: whether `device` is free for this process now: nobody
    /// else holds it or waits for it.
    pub fn device_idle(&self, device: usize) -> bool {
        let rec = self.record(self.physical(device));
        let own = self.own_slot.load(Ordering::Acquire);
        let holder = rec.holder.load(Ordering::Acquire);
        let waiting = rec
            .ticket_next
            .load(Ordering::Acquire)
            .wrapping_sub(rec.ticket_serving.load(Ordering::Acquire));
        match holder {
            0 => waiting == 0,
            // Held by this process (its device thread about to let go):
            // only its own ticket is out.
            holder => own != NO_SLOT && holder as usize == own + 1 && waiting == 1,
        }
    }

    /// Wall timing: whether another process waits for `device`.
    pub fn device_wanted(&self, device: usize) -> bool {
        let rec = self.record(self.physical(device));
        let next = rec.ticket_next.load(Ordering::Acquire);
        let serving = rec.ticket_serving.load(Ordering::Acquire);
        next.wrapping_sub(serving) > 1
    }

    /// Wall timing: hands `device`, taken with `ticket`, to the next ticket;
    /// its work ended at `idle_since`.
    pub fn release_device(&self, device: usize, ticket: u32, idle_since: u64) {
        let machine = self.physical(device);
        let Ok(slot) = self.ensure_slot() else { return };
        self.record(machine)
            .busy_until_ns
            .fetch_max(idle_since, Ordering::AcqRel);
        self.hand_on(machine, slot as u32 + 1, ticket);
    }

    /// Wall timing: the device, held, has switched to this process's work
    /// at a cost of `cost_ns` of device time, which no process is given.
    pub fn record_switch(&self, device: usize, cost_ns: u64) {
        let rec = self.record(self.physical(device));
        rec.switch_ns.fetch_add(cost_ns, Ordering::AcqRel);
        rec.switches.fetch_add(1, Ordering::AcqRel);
    }

    /// Wall timing: (switches between processes, device time they took)
    /// on `device` so far.
    pub fn switches(&self, device: usize) -> (u64, u64) {
        let rec = self.record(self.physical(device));
        (
            rec.switches.load(Ordering::Acquire),
            rec.switch_ns.load(Ordering::Acquire),
        )
    }

    /// Wall timing: a kernel of this process runs on `device` (held) from
    /// `start` to `end`: it goes on the ring and is counted, as a queued
    /// kernel is in timeline timing (its part after now counts once it has
    /// run).
    pub fn record_kernel(&self, device: usize, start: u64, end: u64) -> Result<(), StateError> {
        let machine = self.physical(device);
        let slot = self.ensure_slot()?;
        let rec = self.record(machine);
        let _guard = self.lock_record(machine)?;
        let head = rec.ring_head.load(Ordering::Acquire);
        let record = KernelRecord {
            start_ns: start,
            end_ns: end.max(start),
            pid: self.pid,
            slot: slot as u32 + 1,
        };
        // SAFETY: the index is below RING_CAPACITY, inside this device's
        // ring, and we hold the device mutex that guards the ring.
        unsafe {
            self.ring(machine)
                .add((head % RING_CAPACITY) as usize)
                .write_volatile(record)
        };
        rec.ring_head.store(head + 1, Ordering::Release);
        let ns = record.end_ns - record.start_ns;
        rec.busy_ns.fetch_add(ns, Ordering::AcqRel);
        self.slot(slot).busy_ns[machine].fetch_add(ns, Ordering::AcqRel);
        rec.busy_until_ns.fetch_max(record.end_ns, Ordering::AcqRel);
        Ok(())
    }

    /// Frees `device` held by `holder` (slot + 1) and serves the ticket
    /// after `ticket`.
    fn hand_on(&self, machine: usize, holder: u32, ticket: u32) {
        let rec = self.record(machine);
        if rec
            .holder
            .compare_exchange(holder, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        // Only if the turn is still the holder's.
        let _ = rec.ticket_serving.compare_exchange(
            ticket,
            ticket.wrapping_add(1),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        futex_wake_all(&rec.ticket_serving);
    }

    /// Serves the ticket after `serving`, whose owner never took the device.
    fn pass_over(&self, machine: usize, serving: u32) {
        let rec = self.record(machine);
        if rec
            .ticket_serving
            .compare_exchange(
                serving,
                serving.wrapping_add(1),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            futex_wake_all(&rec.ticket_serving);
        }
    }

    /// If `holder` (slot + 1) died holding `device` (the ticket `serving`),
    /// the device moves on.
    fn recover_dead_holder(&self, machine: usize, own_slot: usize, holder: u32, serving: u32) {
        let slot = holder as usize - 1;
        if slot == own_slot || slot >= MAX_SLOTS || self.slot_is_live(slot) {
            return;
        }
        self.hand_on(machine, holder, serving);
    }

    /// Whether a live process holds `slot` (its lock byte is taken).
    fn slot_is_live(&self, slot: usize) -> bool {
        let mut fl: libc::flock = {
            // SAFETY: flock is plain old data; all-zero is valid.
            unsafe { std::mem::zeroed() }
        };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + slot as i64;
        fl.l_len = 1;
        // SAFETY: our open state file and a valid flock struct.
        let rc = unsafe { libc::fcntl(self.fd, libc::F_OFD_GETLK, &mut fl) };
        // If the lock cannot be tested, assume the holder lives: waiting
        // longer is the smaller harm than running two kernels at once.
        rc != 0 || fl.l_type != libc::F_UNLCK as libc::c_short
    }

    /// Kernel time `device` has spent so far, for one process (`Some(pid)`)
    /// or all of them: the cumulative scheduled time less the part of the
    /// queued kernels that lies after now. Exact however long the history:
    /// only the queued tail of the ring is read. A pid without a slot (never
    /// used the device, or gone) has 0.
    pub fn elapsed_busy(&self, device: usize, pid: Option<u32>) -> Result<u64, StateError> {
        let device = self.physical(device);
        if pid == Some(0) {
            return Ok(0);
        }
        let rec = self.record(device);
        let _guard = self.lock_record_to_read(device)?;
        let scheduled = match pid {
            None => rec.busy_ns.load(Ordering::Acquire),
            Some(p) => (0..MAX_SLOTS)
                .map(|i| self.slot(i))
                .filter(|s| s.pid.load(Ordering::Acquire) == p)
                .map(|s| s.busy_ns[device].load(Ordering::Acquire))
                .sum(),
        };
        let now = clock::now_ns();
        let head = rec.ring_head.load(Ordering::Acquire);
        let mut ahead = 0u64;
        for k in 0..head.min(RING_CAPACITY) {
            let index = (head - 1 - k) % RING_CAPACITY;
            // SAFETY: index < RING_CAPACITY inside the ring; the mutex is held.
            let r = unsafe { self.ring(device).add(index as usize).read_volatile() };
            if r.end_ns <= now {
                // Records are appended in time order: the rest has ended.
                break;
            }
            if pid.is_none_or(|p| p == r.pid) {
                ahead += r.end_ns - r.start_ns.max(now);
            }
        }
        Ok(scheduled.saturating_sub(ahead))
    }

    /// Kernel time on `device` inside `[from_ns, to_ns)`.
    pub fn busy_between(
        &self,
        device: usize,
        from_ns: u64,
        to_ns: u64,
    ) -> Result<Busy, StateError> {
        let device = self.physical(device);
        let mut busy = Busy::default();
        if to_ns <= from_ns {
            return Ok(busy);
        }
        // (PID in its namespace, slot + 1, ns) of each launcher.
        let mut by_launcher: Vec<(u32, u32, u64)> = Vec::new();
        let rec = self.record(device);
        let guard = self.lock_record_to_read(device)?;
        let head = rec.ring_head.load(Ordering::Acquire);
        let count = head.min(RING_CAPACITY);
        for k in 0..count {
            let index = (head - 1 - k) % RING_CAPACITY;
            // SAFETY: index < RING_CAPACITY inside the ring; the mutex is held.
            let r = unsafe { self.ring(device).add(index as usize).read_volatile() };
            if r.end_ns <= from_ns {
                // Records are appended in time order and never overlap.
                break;
            }
            let start = r.start_ns.max(from_ns);
            let end = r.end_ns.min(to_ns);
            if end > start {
                let ns = end - start;
                busy.total_ns += ns;
                match by_launcher
                    .iter_mut()
                    .find(|(pid, slot, _)| (*pid, *slot) == (r.pid, r.slot))
                {
                    Some(entry) => entry.2 += ns,
                    None => by_launcher.push((r.pid, r.slot, ns)),
                }
            }
        }
        // The ring is read; naming may read /proc, which other processes'
        // launches need not wait for.
        drop(guard);
        // Named as this reader sees each process (as NVML names them by
        // host PID): through the slot that launched, while it still holds
        // the same process.
        let recorded: Vec<crate::pids::Recorded> = by_launcher
            .iter()
            .map(|&(pid, slot, _)| self.recorded_launcher(pid, slot))
            .collect();
        let seen = crate::pids::as_seen_here(&recorded);
        for (here, (_, _, ns)) in seen.into_iter().zip(by_launcher) {
            match busy.per_pid.iter_mut().find(|(pid, _)| *pid == here) {
                Some(entry) => entry.1 += ns,
                None => busy.per_pid.push((here, ns)),
            }
        }
        Ok(busy)
    }

    /// The process with PID `pid` (in its own namespace) that launched from
    /// `slot` (plus one), as [`crate::pids`] can find it: with its
    /// namespace and start time while the slot is still its own.
    fn recorded_launcher(&self, pid: u32, slot: u32) -> crate::pids::Recorded {
        let unknown = crate::pids::Recorded {
            pid,
            namespace: 0,
            start_ticks: 0,
        };
        let Some(index) = (slot as usize).checked_sub(1).filter(|&i| i < MAX_SLOTS) else {
            return unknown;
        };
        let rec = self.slot(index);
        if rec.pid.load(Ordering::Acquire) != pid {
            return unknown;
        }
        crate::pids::Recorded {
            pid,
            namespace: rec.pid_namespace.load(Ordering::Acquire),
            start_ticks: rec.start_ticks.load(Ordering::Acquire),
        }
    }

    /// Live processes on `device`: (pid, used bytes), after reclaiming dead
    /// ones. A process appears while it has memory or a context there.
    pub fn processes(&self, device: usize) -> Vec<(u32, u64)> {
        let device = self.physical(device);
        self.reclaim_dead();
        let mut recorded = Vec::new();
        let mut used_bytes = Vec::new();
        for i in 0..MAX_SLOTS {
            let rec = self.slot(i);
            let pid = rec.pid.load(Ordering::Acquire);
            if pid == 0 {
                continue;
            }
            let used = rec.used[device].load(Ordering::Acquire);
            if used > 0 || rec.contexts[device].load(Ordering::Acquire) > 0 {
                recorded.push(crate::pids::Recorded {
                    pid,
                    namespace: rec.pid_namespace.load(Ordering::Acquire),
                    start_ticks: rec.start_ticks.load(Ordering::Acquire),
                });
                used_bytes.push(used);
            }
        }
        crate::pids::as_seen_here(&recorded)
            .into_iter()
            .zip(used_bytes)
            .collect()
    }

    /// (total, used) of a device after reclaiming dead processes' memory.
    pub fn memory(&self, device: usize) -> (u64, u64) {
        let device = self.physical(device);
        self.reclaim_dead();
        let rec = self.record(device);
        (
            rec.total.load(Ordering::Acquire),
            rec.used.load(Ordering::Acquire),
        )
    }

    /// Called at process exit: gives this process's memory back at once.
    fn release_own_slot(&self) {
        let own = self.own_slot.swap(NO_SLOT, Ordering::AcqRel);
        if own != NO_SLOT {
            self.clear_slot(own);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Only a Shared that lost the publication race is dropped; it never
        // claimed a slot.
        // SAFETY: base/len describe our own mapping, fd our own descriptor.
        unsafe {
            libc::munmap(self.base.cast(), self.layout.file_size as usize);
            libc::close(self.fd);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout_ns`. Returns
/// false when the time ran out. The word lives in the shared mapping, so
/// this is a process-shared (not private) futex.
fn futex_wait(word: &AtomicU32, expected: u32, timeout_ns: i64) -> bool {
    let timeout = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned 32-bit atomic; the timeout is a
    // valid relative timespec; the unused arguments may be NULL/0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &timeout as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    !(rc != 0 && errno() == libc::ETIMEDOUT)
}

/// Wakes every thread (of any process) sleeping on `word`.
fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE reads
    // nothing else.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

fn sat_sub(counter: &AtomicU64, bytes: u64) {
    let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        Some(v.saturating_sub(bytes))
    });
}

/// Reads a `T` at `offset` of the file with pread.
fn pread_value<T: Copy>(fd: libc::c_int, offset: u64) -> Option<T> {
    let mut value = std::mem::MaybeUninit::<T>::zeroed();
    let size = std::mem::size_of::<T>();
    // SAFETY: the buffer is `size` writable bytes owned by us.
    let n = unsafe { libc::pread(fd, value.as_mut_ptr().cast(), size, offset as libc::off_t) };
    if n != size as isize {
        return None;
    }
    // SAFETY: fully written by pread; T is plain data (integers only).
    Some(unsafe { value.assume_init() })
}

/// Plain-integer mirror of [`Header`] for reading with pread.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawHeader {
    magic: u64,
    version: u32,
    header_size: u32,
    file_size: u64,
    device_count: u32,
    slot_count: u32,
    ring_capacity: u64,
    devices_offset: u64,
    slots_offset: u64,
    rings_offset: u64,
    created_realtime_us: u64,
    xid_generation: u32,
    _reserved: u32,
}

/// Checks that an existing file matches the layout and device sizes we need.
fn validate(fd: libc::c_int, size: u64, layout: &Layout, cfg: &Config) -> Result<(), String> {
    let h: RawHeader = pread_value(fd, 0).ok_or("header unreadable")?;
    if h.magic != MAGIC || h.version != LAYOUT_VERSION {
        return Err("not a simgpu state file of this version".into());
    }
    if h.header_size as usize != std::mem::size_of::<Header>()
        || h.file_size != layout.file_size
        || size != layout.file_size
        || h.slot_count as usize != MAX_SLOTS
        || h.ring_capacity != RING_CAPACITY
        || h.devices_offset != layout.devices_offset
        || h.slots_offset != layout.slots_offset
        || h.rings_offset != layout.rings_offset
    {
        return Err("layout differs".into());
    }
    if h.device_count as usize != cfg.machine_devices {
        return Err(format!(
            "it has {} devices, SIMGPU_DEVICES asks for {}",
            h.device_count, cfg.machine_devices
        ));
    }
    for (i, &want) in cfg.machine_memory.iter().enumerate() {
        let offset = layout.devices_offset + (i * std::mem::size_of::<DeviceRecord>()) as u64;
        let total: u64 = pread_value(fd, offset).ok_or("device table unreadable")?;
        if total != want {
            return Err(format!(
                "device {i} has {total} bytes, the configuration asks for {want}"
            ));
        }
    }
    Ok(())
}

/// True when some process holds a slot lock in this file.
fn any_live_slot(fd: libc::c_int) -> bool {
    (0..MAX_SLOTS).any(|i| {
        let mut fl: libc::flock = {
            // SAFETY: flock is plain old data; all-zero is valid.
            unsafe { std::mem::zeroed() }
        };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + i as i64;
        fl.l_len = 1;
        // SAFETY: valid fd and flock struct.
        let rc = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) };
        rc == 0 && fl.l_type != libc::F_UNLCK as libc::c_short
    })
}

/// Sizes a fresh (empty) file and writes its header, devices and mutexes.
fn initialise(
    fd: libc::c_int,
    layout: &Layout,
    cfg: &Config,
    path: &Path,
) -> Result<(), StateError> {
    // Every process on the machine shares the device, whichever user runs
    // it (a container's non-root user too), as every user may open a real
    // GPU's device nodes: the creator's umask must not narrow that. Only
    // the file's owner may change its mode; another user's file was made
    // so already, so a failure here changes nothing.
    // SAFETY: fchmod on an open descriptor of our own.
    unsafe { libc::fchmod(fd, 0o666) };
    // SAFETY: fd is an open, writable file.
    if unsafe { libc::ftruncate(fd, layout.file_size as libc::off_t) } != 0 {
        return Err(io_err("cannot size", path));
    }
    let len = layout.devices_offset as usize + std::mem::size_of::<DeviceRecord>() * MAX_DEVICES;
    // SAFETY: mapping the first `len` bytes of a file at least that long.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io_err("cannot map", path));
    }
    let base = base.cast::<u8>();
    // SAFETY: the mapping is fresh, zero-filled, large enough for the header
    // and the device table, and nobody else maps it before the magic is set
    // (others wait on flock and validate the magic).
    unsafe {
        let header = base.cast::<Header>();
        (*header).version = LAYOUT_VERSION;
        (*header).header_size = std::mem::size_of::<Header>() as u32;
        (*header).file_size = layout.file_size;
        (*header).device_count = layout.devices as u32;
        (*header).slot_count = MAX_SLOTS as u32;
        (*header).ring_capacity = RING_CAPACITY;
        (*header).devices_offset = layout.devices_offset;
        (*header).slots_offset = layout.slots_offset;
        (*header).rings_offset = layout.rings_offset;
        (*header).created_realtime_us = clock::realtime_us();
        let devices = base
            .add(layout.devices_offset as usize)
            .cast::<DeviceRecord>();
        for i in 0..MAX_DEVICES {
            let d = devices.add(i);
            let total = cfg.machine_memory.get(i).copied().unwrap_or(0);
            (*d).total.store(total, Ordering::Release);
            init_robust_mutex((*d).mutex.get());
        }
        (*header).magic.store(MAGIC, Ordering::Release);
        libc::munmap(base.cast(), len);
    }
    Ok(())
}

/// Initialises a process-shared robust mutex in place.
///
/// # Safety
/// `m` must point to writable memory for a `pthread_mutex_t` nobody uses yet.
unsafe fn init_robust_mutex(m: *mut libc::pthread_mutex_t) {
    // SAFETY: standard attribute lifecycle on a local attribute object; `m`
    // is valid per the caller's contract.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        libc::pthread_mutex_init(m, &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
    }
}

fn c_path(path: &Path) -> Result<CString, StateError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| StateError::Io(format!("bad path {}", path.display())))
}

fn same_file(fd: libc::c_int, path: &CString) -> bool {
    // SAFETY: stat buffers are plain data; fd and path are valid.
    unsafe {
        let mut a: libc::stat = std::mem::zeroed();
        let mut b: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut a) == 0
            && libc::stat(path.as_ptr(), &mut b) == 0
            && a.st_dev == b.st_dev
            && a.st_ino == b.st_ino
    }
}

fn open_rw(path: &CString, extra: libc::c_int) -> libc::c_int {
    // SAFETY: path is a valid C string.
    unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | extra,
            0o666 as libc::c_uint,
        )
    }
}

/// Opens (creating or replacing as needed) and maps the state file.
fn open(cfg: &Config) -> Result<Shared, StateError> {
    let path = cfg.state_path.as_path();
    let cpath = c_path(path)?;
    let layout = Layout::for_devices(cfg.machine_devices);
    for _attempt in 0..16 {
        let fd = open_rw(&cpath, libc::O_CREAT);
        if fd < 0 {
            return Err(io_err("cannot open", path));
        }
        let close = |fd| {
            // SAFETY: closing our own descriptor (also drops its flock).
            unsafe { libc::close(fd) };
        };
        // SAFETY: fd is valid; flock blocks until we own the init lock.
        while unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            if errno() != libc::EINTR {
                close(fd);
                return Err(io_err("cannot flock", path));
            }
        }
        if !same_file(fd, &cpath) {
            // Replaced while we waited: start over with the new file.
            close(fd);
            continue;
        }
        let size = {
            // SAFETY: plain fstat into a zeroed buffer.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is valid.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                close(fd);
                return Err(io_err("cannot stat", path));
            }
            st.st_size as u64
        };
        if size == 0 {
            if let Err(e) = initialise(fd, &layout, cfg, path) {
                close(fd);
                return Err(e);
            }
        } else if let Err(reason) = validate(fd, size, &layout, cfg) {
            if any_live_slot(fd) {
                close(fd);
                return Err(StateError::Incompatible(format!(
                    "{}: {reason}",
                    path.display()
                )));
            }
            // Nobody uses it: replace it with a fresh file, atomically.
            // SAFETY: getpid has no preconditions.
            let tmp = format!("{}.new.{}", path.display(), unsafe { libc::getpid() });
            let ctmp = c_path(Path::new(&tmp))?;
            let tfd = open_rw(&ctmp, libc::O_CREAT | libc::O_TRUNC);
            if tfd < 0 {
                close(fd);
                return Err(io_err("cannot create", Path::new(&tmp)));
            }
            let made = initialise(tfd, &layout, cfg, Path::new(&tmp));
            // SAFETY: both paths are valid C strings.
            let renamed =
                made.is_ok() && unsafe { libc::rename(ctmp.as_ptr(), cpath.as_ptr()) } == 0;
            close(tfd);
            close(fd);
            if !renamed {
                // SAFETY: valid C string.
                unsafe { libc::unlink(ctmp.as_ptr()) };
                made?;
                return Err(io_err("cannot replace", path));
            }
            continue;
        }
        // SAFETY: mapping the whole validated file, shared with other users.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.file_size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: fd is valid; releasing the init lock.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        if base == libc::MAP_FAILED {
            close(fd);
            return Err(io_err("cannot map", path));
        }
        let shared = Shared {
            fd,
            base: base.cast(),
            layout,
            own_slot: AtomicUsize::new(NO_SLOT),
            reclaim: Mutex::new(()),
            // SAFETY: getpid has no preconditions.
            pid: unsafe { libc::getpid() } as u32,
            pid_namespace: crate::pids::own_namespace().unwrap_or(0),
            start_ticks: crate::pids::start_ticks("self").unwrap_or(0),
            visible: cfg.visible.clone(),
        };
        if shared.header().magic.load(Ordering::Acquire) != MAGIC {
            return Err(StateError::Io(format!(
                "{}: header vanished",
                path.display()
            )));
        }
        return Ok(shared);
    }
    Err(StateError::Io(format!(
        "{}: keeps being replaced by other processes",
        path.display()
    )))
}

static SHARED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
/// The descriptor of the published Shared, for the fork handler.
static SHARED_FD: AtomicI32 = AtomicI32::new(-1);
static ATFORK: Once = Once::new();
static ATEXIT: Once = Once::new();
static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The state file of this process (opened on first use, again after fork).
pub fn shared() -> Result<&'static Shared, StateError> {
    let current = SHARED.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: published Shared values are leaked, hence 'static.
        return Ok(unsafe { &*current });
    }
    let cfg = crate::config::get().map_err(|()| StateError::Io("bad configuration".into()))?;
    let fresh = match open(cfg) {
        Ok(s) => Box::into_raw(Box::new(s)),
        Err(e) => {
            if !REPORTED.swap(true, Ordering::AcqRel) {
                crate::ffi::warn(&e.to_string());
            }
            return Err(e);
        }
    };
    ATFORK.call_once(|| {
        // SAFETY: registering a plain extern "C" handler.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    });
    match SHARED.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            // SAFETY: `fresh` is the published, leaked value.
            let s = unsafe { &*fresh };
            SHARED_FD.store(s.fd, Ordering::Release);
            Ok(s)
        }
        Err(existing) => {
            // SAFETY: `fresh` came from Box::into_raw above and was never
            // published; `existing` is a published, leaked value.
            unsafe {
                drop(Box::from_raw(fresh));
                Ok(&*existing)
            }
        }
    }
}

/// The published Shared, if any, without opening it.
fn current() -> Option<&'static Shared> {
    let p = SHARED.load(Ordering::Acquire);
    // SAFETY: published values are leaked, hence 'static.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// In a fork child: forget the parent's slot and descriptor (closing it so
/// the parent's slot lock dies with the parent). The CUDA process state
/// above this layer forgets itself (its own fork handler).
extern "C" fn after_fork_child() {
    SHARED.store(std::ptr::null_mut(), Ordering::Release);
    let fd = SHARED_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: close is async-signal-safe; the fd is the inherited copy.
        unsafe { libc::close(fd) };
    }
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(s) = current() {
            s.release_own_slot();
        }
    });
}

fn register_exit_handler() {
    ATEXIT.call_once(|| {
        // SAFETY: registering a plain extern "C" handler.
        unsafe { libc::atexit(at_exit) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_page_aligned_and_fits() {
        let l = Layout::for_devices(16);
        assert_eq!(l.slots_offset % PAGE, 0);
        assert_eq!(l.rings_offset % PAGE, 0);
        assert!(std::mem::size_of::<Header>() as u64 <= PAGE);
        assert_eq!(std::mem::size_of::<KernelRecord>(), 24);
        assert_eq!(l.file_size, l.rings_offset + 16 * RING_CAPACITY * 24);
        assert_eq!(
            std::mem::size_of::<RawHeader>(),
            std::mem::size_of::<Header>()
        );
    }
}
