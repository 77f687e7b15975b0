//! The node's repair of a region file its container damaged.
//!
//! In a container the node set up, the region file is the one host file
//! the container may write. Root in the container can grow it (writes past
//! its end, `fallocate`, even with `FALLOC_FL_KEEP_SIZE`, which adds disk
//! blocks and leaves the size alone) and fill the node's disk, or shrink or
//! scribble over it so the node's tools refuse it. Neither is anything a
//! shim does: the node puts the file back to a region of the right size,
//! holding no more disk than a region needs, initialised afresh where its
//! header no longer reads as one. The limits it is given are only the
//! region's own copy: what is enforced is the node's grant beside it.

use super::file::{io_error, Region, RegionError};
use super::layout::REGION_BYTES;
use super::limits::RegionLimits;
use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The disk a region file may hold: its size rounded up to a MiB, and one
/// MiB more for filesystems that allocate in large blocks. More can only be
/// a container's own doing.
pub const REGION_DISK_ALLOWANCE: u64 = ((REGION_BYTES as u64).div_ceil(1 << 20) + 1) << 20;

/// A region file's size and the disk it holds, as `stat` gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileExtent {
    /// `st_size`.
    pub size: u64,
    /// `st_blocks` in bytes: what the file takes on disk, preallocated
    /// blocks past its end included.
    pub allocated: u64,
}

impl FileExtent {
    /// Whether this is a region file as the node left it: the region's size,
    /// within [`REGION_DISK_ALLOWANCE`] on disk.
    pub fn intact(&self) -> bool {
        self.size == REGION_BYTES as u64 && self.allocated <= REGION_DISK_ALLOWANCE
    }
}

impl From<&std::fs::Metadata> for FileExtent {
    fn from(meta: &std::fs::Metadata) -> Self {
        Self {
            size: meta.len(),
            allocated: meta.blocks().saturating_mul(512),
        }
    }
}

/// What [`Region::repair`] found and put right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repaired {
    /// The file as it was found.
    pub found: FileExtent,
    /// Its header no longer read as a region's: it was initialised afresh
    /// (the container's own accounting in it is lost; the node's grant and
    /// the driver's counts are not).
    pub reinitialised: bool,
}

impl Region {
    /// Puts the region file at `path` back to an intact region: the right
    /// size, no more disk than [`REGION_DISK_ALLOWANCE`], and a valid
    /// header (initialised with `limits` where it was not). Never waits on
    /// the container: no `flock` or mutex its processes could hold forever.
    /// `None` when the file was intact and its header valid.
    pub fn repair(
        path: &Path,
        limits: &RegionLimits,
    ) -> Result<Option<(Self, Repaired)>, RegionError> {
        // O_NOFOLLOW: the node's own path is never a link; O_NONBLOCK: a
        // FIFO in its place cannot hold the caller.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(|source| io_error(path, "open", source))?;
        let meta = file
            .metadata()
            .map_err(|source| io_error(path, "stat", source))?;
        if !meta.file_type().is_file() {
            return Err(RegionError::Corrupt {
                path: path.to_path_buf(),
                what: "not a regular file".into(),
            });
        }
        let found = FileExtent::from(&meta);
        if !found.intact() {
            // Shrinking releases every block past the new end, those
            // preallocated past the old end too: grow by a byte first so
            // the last step is always a shrink.
            for length in [REGION_BYTES as u64 + 1, REGION_BYTES as u64] {
                file.set_len(length)
                    .map_err(|source| io_error(path, "ftruncate", source))?;
            }
        }
        let region = Region::map(file, path)?;
        let ready = region
            .layout()
            .header
            .ready
            .load(std::sync::atomic::Ordering::Acquire)
            == 1;
        let reinitialised = !ready || region.validate().is_err();
        if reinitialised {
            region.initialise(limits, false)?;
        }
        if found.intact() && !reinitialised {
            return Ok(None);
        }
        Ok(Some((
            region,
            Repaired {
                found,
                reinitialised,
            },
        )))
    }
}
