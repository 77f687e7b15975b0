//! Opening, creating, mapping and checking a region file.

use super::clock::monotonic_ns;
use super::grant_file::{Grant, GrantError};
use super::layout::*;
use super::limits::RegionLimits;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, Ordering};
use thiserror::Error;

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
    #[error(transparent)]
    Grant(#[from] GrantError),
    #[error("region {path}: shared mutex: {what} (error {code})")]
    Mutex {
        path: PathBuf,
        what: &'static str,
        code: i32,
    },
}

/// A mapped region file.
pub struct Region {
    pub(super) base: NonNull<RegionLayout>,
    /// The open file description that owns this process's liveness lock.
    /// Replaced in a forked child, which must not share its parent's.
    pub(super) fd: AtomicI32,
    pub(super) path: PathBuf,
    /// The node's grant, whose limits are the ones enforced, where the
    /// region belongs to a container a node set up.
    grant: Option<Grant>,
    /// The limits enforced: the grant's where one is attached, else the
    /// region's own. Both are mappings this Region owns, which never move
    /// while it lives; kept as a pointer so the hot path reads it without
    /// a branch.
    enforced: NonNull<Limits>,
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

    pub(super) fn initialise(&self, limits: &RegionLimits, fresh: bool) -> Result<(), RegionError> {
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
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        header.created_unix_ms.store(now_ms, Ordering::Relaxed);
        // Compute budgets accrue from now: time that passes before the
        // first launch is credited (up to the bucket's capacity) rather than
        // lost, as it would be if the clock only started at a first refill.
        let now_monotonic = monotonic_ns();
        for device in &layout.devices {
            device
                .compute
                .refilled_at
                .store(now_monotonic, Ordering::Relaxed);
        }
        layout.limits.store(limits);
        layout.limits.start_effective(limits);
        header.ready.store(1, Ordering::Release);
        Ok(())
    }

    pub(super) fn map(file: File, path: &Path) -> Result<Self, RegionError> {
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
            grant: None,
            // SAFETY: `base` is a live mapping of a whole RegionLayout; the
            // field's address is formed without reading it.
            enforced: unsafe {
                NonNull::new_unchecked(std::ptr::addr_of_mut!((*base.as_ptr()).limits))
            },
        })
    }

    fn into_file(self) -> File {
        let fd = self.fd.swap(-1, Ordering::AcqRel);
        drop(self);
        // SAFETY: we took sole ownership of the fd out of the Region above.
        unsafe { File::from_raw_fd(fd) }
    }

    pub(super) fn validate(&self) -> Result<(), RegionError> {
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

    /// Makes `grant`'s limits the ones this region enforces: a region of a
    /// container a node set up, whose own copy of the limits the container
    /// can write.
    pub fn with_grant(mut self, grant: Grant) -> Self {
        self.enforced = NonNull::from(grant.limits());
        self.grant = Some(grant);
        self
    }

    /// Attaches the node's grant that lies beside the region in `dir` (its
    /// directory on the host, [`super::grant_file::GRANT_FILE`]), when
    /// there is one: what the node's own tools read a region with, since
    /// its limits are the grant's. `writable`: mapped to be changed (the
    /// monitor's effective shares, a resize). Returns whether a grant was
    /// there; none leaves the region as it was (a workstation's region has
    /// none), and so does a grant that cannot be read (the error).
    pub fn attach_grant_beside(&mut self, dir: &Path, writable: bool) -> Result<bool, GrantError> {
        let path = dir.join(super::grant_file::GRANT_FILE);
        let opened = if writable {
            Grant::open_writable(&path)
        } else {
            Grant::open_read_only(&path)
        };
        match opened {
            Ok(grant) => {
                self.enforced = NonNull::from(grant.limits());
                self.grant = Some(grant);
                Ok(true)
            }
            Err(GrantError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// The node's grant, when one is attached.
    pub fn grant(&self) -> Option<&Grant> {
        self.grant.as_ref()
    }

    /// The limits enforced: the grant's where one is attached, else the
    /// region's own.
    #[inline(always)]
    pub fn enforced_limits(&self) -> &Limits {
        // SAFETY: `enforced` points into the region's own mapping or the
        // attached grant's, both alive as long as `self`; every field is an
        // atomic.
        unsafe { self.enforced.as_ref() }
    }

    /// The enforced limits, to change them (the node monitor's effective
    /// shares): refused where they are a grant mapped read-only (in the
    /// container it limits).
    pub fn writable_limits(&self) -> Result<&Limits, RegionError> {
        match &self.grant {
            Some(grant) => Ok(grant.writable_limits()?),
            None => Ok(&self.layout().limits),
        }
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
}

pub(super) fn file_size(file: &File, path: &Path) -> Result<u64, RegionError> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| io_error(path, "stat", source))
}

pub(super) fn io_error(path: &Path, op: &'static str, source: io::Error) -> RegionError {
    RegionError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}
