//! The node's grant: what a node granted one container (or claim), in a
//! file of its own that the container can only read.
//!
//! A region is mapped read-write by every process of its container, so
//! nothing in it can bind a process that means to get out of its limits.
//! The grant holds the limits that are enforced ([`Limits`], the same form
//! as a region's own copy), the settings a container must not choose for
//! itself (what each context is charged, whether memory may spill to host
//! memory), and where the container finds its region. The node writes it
//! beside the region on the host ([`GRANT_FILE`]) and mounts it read-only
//! at [`GRANT_CONTAINER_PATH`], a path no variable can move: the shim
//! finding a file there knows a node set its container up, and takes its
//! limits from nowhere else. The node monitor maps it writable on the host
//! to change the effective shares it arbitrates, and a resize its limits.
//!
//! Like a region, every field is an atomic, so a reader never races the
//! node's writes; the file is made whole in a private file and published
//! with `link`, so no reader ever sees half of one.

use super::layout::{Limits, MAX_DEVICES};
use super::limits::RegionLimits;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use thiserror::Error;

/// Where a container a node set up finds its grant. Fixed, so that neither
/// the environment nor a file of the container's can move it.
pub const GRANT_CONTAINER_PATH: &str = "/usr/local/vgpu/grant";
/// The grant's name in its region's directory on the host.
pub const GRANT_FILE: &str = "grant";
/// `b"VGPUGRNT"` read as a little-endian u64.
pub const GRANT_MAGIC: u64 = u64::from_le_bytes(*b"VGPUGRNT");
/// Bumped on any incompatible layout change.
pub const GRANT_VERSION: u32 = 1;
/// Bytes of the region's path a grant holds (NUL padded).
pub const REGION_PATH_BYTES: usize = 256;

/// Each context is charged what the shim measures it to hold, at least
/// the grant's `context_reserve`.
const FLAG_MEASURE_CONTEXTS: u32 = 1;
/// Allocations beyond the cap may spill to host memory, up to each
/// device's swap allowance.
const FLAG_OVERSUBSCRIBE: u32 = 2;

/// The whole file.
#[repr(C)]
pub struct GrantLayout {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub total_bytes: AtomicU32,
    /// 1 once written whole.
    pub ready: AtomicU32,
    /// `FLAG_*` bits.
    pub flags: AtomicU32,
    /// Device memory charged for each CUDA context (the floor under what
    /// is measured, with `FLAG_MEASURE_CONTEXTS`).
    pub context_reserve: AtomicU64,
    /// The region's path in the container, NUL padded.
    pub region_path: [AtomicU64; REGION_PATH_BYTES / 8],
    /// The UUID of each GPU granted, in the order the container numbers
    /// them, NUL padded: how the node tells which of NVML's GPUs a device
    /// of the grant is, without asking the container.
    pub device_uuids: [[AtomicU64; UUID_BYTES / 8]; MAX_DEVICES],
    pub reserved: [AtomicU64; 8],
    pub limits: Limits,
}

/// Bytes of a device UUID a grant holds (NUL padded): NVML's longest.
pub const UUID_BYTES: usize = 48;

/// Size of a grant file.
pub const GRANT_BYTES: usize = std::mem::size_of::<GrantLayout>();

/// What a grant says besides its limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantSettings {
    /// The region's path as the container sees it.
    pub region_path: String,
    /// Bytes charged per CUDA context: exactly this, or the floor under
    /// what is measured when `measure_contexts`.
    pub context_reserve: u64,
    pub measure_contexts: bool,
    /// Whether allocations may spill to host memory (each device's swap
    /// allowance is in the limits).
    pub oversubscribe: bool,
    /// The UUID of each GPU granted, in the container's order.
    pub device_uuids: Vec<String>,
}

/// Why a grant could not be used.
#[derive(Debug, Error)]
pub enum GrantError {
    #[error("grant {path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "grant {path} is {actual} bytes, expected {expected}: not a grant this build can read"
    )]
    WrongSize {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("grant {path} is not a vgpu grant (magic {found:#018x})")]
    Foreign { path: PathBuf, found: u64 },
    #[error("grant {path} has layout version {found}, this build understands {GRANT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("grant {path}: {what}")]
    Invalid { path: PathBuf, what: String },
    #[error("grant {path} is mapped read-only: its limits are the node's to change")]
    ReadOnly { path: PathBuf },
    #[error("grant {path} already exists with other settings or limits; refusing to change a running container's grant this way")]
    Mismatch { path: PathBuf },
}

/// A mapped grant file.
pub struct Grant {
    base: NonNull<GrantLayout>,
    writable: bool,
    path: PathBuf,
}

// SAFETY: the mapping is shared memory made only of atomics; every access
// goes through those, so it may be used from any thread.
unsafe impl Send for Grant {}
// SAFETY: as above.
unsafe impl Sync for Grant {}

impl Drop for Grant {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of a live mapping of GRANT_BYTES made
        // in `map`, not used after this point.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), GRANT_BYTES);
        }
    }
}

impl Grant {
    /// Writes the grant at `path` (the node, preparing a container), or
    /// opens the one already there if it says the same: a retried
    /// preparation keeps its grant; one that says otherwise is refused,
    /// changing nothing. Readable by everyone, writable by its owner.
    pub fn create(
        path: &Path,
        settings: &GrantSettings,
        limits: &RegionLimits,
    ) -> Result<Self, GrantError> {
        if settings.region_path.len() >= REGION_PATH_BYTES || settings.region_path.contains('\0') {
            return Err(GrantError::Invalid {
                path: path.to_path_buf(),
                what: format!(
                    "region path {:?} is longer than {} bytes or holds a NUL",
                    settings.region_path,
                    REGION_PATH_BYTES - 1
                ),
            });
        }
        if settings.device_uuids.len() > MAX_DEVICES
            || settings
                .device_uuids
                .iter()
                .any(|uuid| uuid.len() >= UUID_BYTES || uuid.contains('\0'))
        {
            return Err(GrantError::Invalid {
                path: path.to_path_buf(),
                what: format!(
                    "device UUIDs {:?}: at most {MAX_DEVICES}, each shorter than {UUID_BYTES} bytes",
                    settings.device_uuids
                ),
            });
        }
        let existing = match Self::open_writable(path) {
            Ok(grant) => Some(grant),
            Err(GrantError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => None,
            Err(error) => return Err(error),
        };
        if let Some(grant) = existing {
            return if grant.settings()? == *settings && grant.limits().load() == limits.as_stored()
            {
                Ok(grant)
            } else {
                Err(GrantError::Mismatch {
                    path: path.to_path_buf(),
                })
            };
        }
        let mut private = path.as_os_str().to_owned();
        private.push(format!(".new.{}", std::process::id()));
        let private = PathBuf::from(private);
        let _ = std::fs::remove_file(&private);
        let built = Self::build(&private, settings, limits);
        let published = built.and_then(|mut grant| match std::fs::hard_link(&private, path) {
            Ok(()) => {
                grant.path = path.to_path_buf();
                Ok(grant)
            }
            Err(source) => Err(io_error(path, "link", source)),
        });
        let _ = std::fs::remove_file(&private);
        published
    }

    fn build(
        private: &Path,
        settings: &GrantSettings,
        limits: &RegionLimits,
    ) -> Result<Self, GrantError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC)
            .open(private)
            .map_err(|source| io_error(private, "create", source))?;
        file.set_len(GRANT_BYTES as u64)
            .map_err(|source| io_error(private, "ftruncate", source))?;
        let grant = Self::map(&file, private, true)?;
        let layout = grant.layout();
        layout.magic.store(GRANT_MAGIC, Ordering::Relaxed);
        layout.version.store(GRANT_VERSION, Ordering::Relaxed);
        layout
            .total_bytes
            .store(GRANT_BYTES as u32, Ordering::Relaxed);
        let mut flags = 0;
        if settings.measure_contexts {
            flags |= FLAG_MEASURE_CONTEXTS;
        }
        if settings.oversubscribe {
            flags |= FLAG_OVERSUBSCRIBE;
        }
        layout.flags.store(flags, Ordering::Relaxed);
        layout
            .context_reserve
            .store(settings.context_reserve, Ordering::Relaxed);
        store_text(&layout.region_path, &settings.region_path);
        for (words, uuid) in layout.device_uuids.iter().zip(&settings.device_uuids) {
            store_text(words, uuid);
        }
        layout.limits.store(limits);
        layout.limits.start_effective(limits);
        layout.ready.store(1, Ordering::Release);
        Ok(grant)
    }

    /// Opens the grant at `path` to read it (the shim, in the container it
    /// limits).
    pub fn open_read_only(path: &Path) -> Result<Self, GrantError> {
        Self::open(path, false)
    }

    /// Opens the grant at `path` to change its limits (the node monitor,
    /// `vgpu`).
    pub fn open_writable(path: &Path) -> Result<Self, GrantError> {
        Self::open(path, true)
    }

    fn open(path: &Path, writable: bool) -> Result<Self, GrantError> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)
            .map_err(|source| io_error(path, "open", source))?;
        let metadata = file
            .metadata()
            .map_err(|source| io_error(path, "stat", source))?;
        if !metadata.is_file() || metadata.len() != GRANT_BYTES as u64 {
            return Err(GrantError::WrongSize {
                path: path.to_path_buf(),
                actual: metadata.len(),
                expected: GRANT_BYTES as u64,
            });
        }
        let grant = Self::map(&file, path, writable)?;
        grant.validate()?;
        Ok(grant)
    }

    fn map(file: &File, path: &Path, writable: bool) -> Result<Self, GrantError> {
        let protection = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mapping a file we opened (read-write where `writable`),
        // with the exact length the caller checked or set; MAP_SHARED so the
        // node's changes reach every reader. The mapping outlives the fd.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                GRANT_BYTES,
                protection,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io_error(path, "mmap", io::Error::last_os_error()));
        }
        let base = NonNull::new(ptr.cast::<GrantLayout>()).ok_or_else(|| GrantError::Invalid {
            path: path.to_path_buf(),
            what: "mmap returned null".into(),
        })?;
        Ok(Self {
            base,
            writable,
            path: path.to_path_buf(),
        })
    }

    fn validate(&self) -> Result<(), GrantError> {
        let layout = self.layout();
        let magic = layout.magic.load(Ordering::Relaxed);
        if magic != GRANT_MAGIC {
            return Err(GrantError::Foreign {
                path: self.path.clone(),
                found: magic,
            });
        }
        let version = layout.version.load(Ordering::Relaxed);
        if version != GRANT_VERSION {
            return Err(GrantError::Version {
                path: self.path.clone(),
                found: version,
            });
        }
        if layout.total_bytes.load(Ordering::Relaxed) != GRANT_BYTES as u32 {
            return Err(self.invalid("its size field does not match its layout".into()));
        }
        if layout.ready.load(Ordering::Acquire) != 1 {
            return Err(self.invalid("never finished being written".into()));
        }
        self.settings().map(|_| ())
    }

    fn invalid(&self, what: String) -> GrantError {
        GrantError::Invalid {
            path: self.path.clone(),
            what,
        }
    }

    fn layout(&self) -> &GrantLayout {
        // SAFETY: `base` points to a live mapping of GRANT_BYTES for as long
        // as `self` lives, and every field is an atomic; a read-only mapping
        // is only ever loaded from (`writable_limits` guards the stores).
        unsafe { self.base.as_ref() }
    }

    /// The file this grant maps.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the grant says besides its limits; a region path that is not
    /// an absolute path of text is refused.
    pub fn settings(&self) -> Result<GrantSettings, GrantError> {
        let layout = self.layout();
        let region_path = load_text(&layout.region_path)
            .filter(|path| path.starts_with('/'))
            .ok_or_else(|| self.invalid("its region path is not an absolute path".into()))?;
        let mut device_uuids = Vec::new();
        for words in &layout.device_uuids {
            match load_text(words) {
                Some(uuid) if !uuid.is_empty() => device_uuids.push(uuid),
                Some(_) => break,
                None => return Err(self.invalid("a device UUID is not text".into())),
            }
        }
        let flags = layout.flags.load(Ordering::Relaxed);
        Ok(GrantSettings {
            region_path,
            context_reserve: layout.context_reserve.load(Ordering::Relaxed),
            measure_contexts: flags & FLAG_MEASURE_CONTEXTS != 0,
            oversubscribe: flags & FLAG_OVERSUBSCRIBE != 0,
            device_uuids,
        })
    }

    /// The limits the node granted.
    #[inline(always)]
    pub fn limits(&self) -> &Limits {
        &self.layout().limits
    }

    /// The limits, to change them; refused on a read-only mapping.
    pub fn writable_limits(&self) -> Result<&Limits, GrantError> {
        if self.writable {
            Ok(&self.layout().limits)
        } else {
            Err(GrantError::ReadOnly {
                path: self.path.clone(),
            })
        }
    }

    /// How many devices the grant caps or shares (the rest are uncapped).
    pub fn devices_limited(&self) -> usize {
        let limits = self.limits().load();
        (0..MAX_DEVICES)
            .rev()
            .find(|device| limits.memory_limit[*device] != 0 || limits.sm_limit[*device] != 0)
            .map_or(0, |last| last + 1)
    }
}

/// Writes `text` into `words`, NUL padded (the caller checked it fits).
fn store_text(words: &[AtomicU64], text: &str) {
    let mut bytes = vec![0u8; words.len() * 8];
    let len = text.len().min(bytes.len());
    bytes[..len].copy_from_slice(&text.as_bytes()[..len]);
    for (word, chunk) in words.iter().zip(bytes.chunks_exact(8)) {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(chunk);
        word.store(u64::from_le_bytes(raw), Ordering::Relaxed);
    }
}

/// The NUL-padded text in `words`; `None` when it is not UTF-8.
fn load_text(words: &[AtomicU64]) -> Option<String> {
    let mut bytes = Vec::with_capacity(words.len() * 8);
    for word in words {
        bytes.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
    }
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    bytes.truncate(end);
    String::from_utf8(bytes).ok()
}

fn io_error(path: &Path, op: &'static str, source: io::Error) -> GrantError {
    GrantError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("vgpu-grant-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        path
    }

    fn settings() -> GrantSettings {
        GrantSettings {
            region_path: "/usr/local/vgpu/container/region.cache".into(),
            context_reserve: 256 << 20,
            measure_contexts: true,
            oversubscribe: false,
            device_uuids: vec!["GPU-5e1f2a3b-0000-4000-8000-000000000001".into()],
        }
    }

    fn limits() -> RegionLimits {
        let mut limits = RegionLimits::default();
        limits.memory_limit[0] = 1 << 30;
        limits.sm_limit[0] = 30;
        limits
    }

    #[test]
    fn a_grant_reads_back_as_written_and_a_retry_keeps_it() {
        let path = temp_path("roundtrip");
        let grant = Grant::create(&path, &settings(), &limits()).expect("create");
        assert_eq!(grant.settings().expect("settings"), settings());
        assert_eq!(grant.limits().load(), limits().as_stored());
        assert_eq!(
            grant.limits().devices[0]
                .sm_effective
                .load(Ordering::Relaxed),
            3000
        );
        assert_eq!(grant.devices_limited(), 1);
        drop(grant);
        Grant::create(&path, &settings(), &limits()).expect("same again");
        let mut other = limits();
        other.memory_limit[0] = 2 << 30;
        assert!(matches!(
            Grant::create(&path, &settings(), &other),
            Err(GrantError::Mismatch { .. })
        ));
        let mode = std::fs::metadata(&path).expect("stat").permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o644
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_read_only_grant_refuses_to_be_changed() {
        let path = temp_path("read-only");
        drop(Grant::create(&path, &settings(), &limits()).expect("create"));
        let grant = Grant::open_read_only(&path).expect("open");
        assert!(matches!(
            grant.writable_limits(),
            Err(GrantError::ReadOnly { .. })
        ));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn files_that_are_not_whole_grants_are_refused() {
        let path = temp_path("bad");
        std::fs::write(&path, b"short").expect("write");
        assert!(matches!(
            Grant::open_read_only(&path),
            Err(GrantError::WrongSize { .. })
        ));
        std::fs::write(&path, vec![0u8; GRANT_BYTES]).expect("write");
        assert!(matches!(
            Grant::open_read_only(&path),
            Err(GrantError::Foreign { found: 0, .. })
        ));
        let long = GrantSettings {
            region_path: format!("/{}", "x".repeat(REGION_PATH_BYTES)),
            ..settings()
        };
        assert!(matches!(
            Grant::create(&temp_path("long"), &long, &limits()),
            Err(GrantError::Invalid { .. })
        ));
        let _ = std::fs::remove_file(&path);
    }
}
