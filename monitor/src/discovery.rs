//! Finding container regions under the host directory, and reading them.
//!
//! The device plugin gives each container a host directory
//! `<root>/<podUID>_<container>/` holding its region file. Every pass of the
//! monitor rescans `<root>`: new directories are opened, removed (or
//! replaced) files are dropped, so nothing needs a restart.
//!
//! Region files are written by containers and are untrusted: the last path
//! component must be a regular file (never a symlink, which could point the
//! monitor at another container's region), the size, magic and version are
//! checked, every value read is clamped, and a file that cannot be used
//! costs one log line (repeated only when the file changes, or every
//! [`REJECT_RETRY`]).
//!
//! A region of a container the node set up (its grant beside it) that its
//! container grew, shrank or scribbled over is repaired
//! ([`Region::repair`]) and opened again: a container cannot fill the
//! node's disk through the one host file it may write, nor leave its
//! grant's backstops by breaking its region.

use crate::guard::{GuardError, Guarded};
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use vgpu_node_contract::claim_owner::{
    self, ClaimOwner, ClaimRecordError, CLAIM_DIR_PREFIX, CLAIM_OWNER_FILE,
};
use vgpu_node_contract::region::grant_file::GRANT_FILE;
use vgpu_node_contract::region::{FileExtent, Grant, Region, RegionError, Repaired, REGION_BYTES};

/// How long a file that could not be used is left alone if it does not change.
pub const REJECT_RETRY: Duration = Duration::from_secs(60);
/// How soon a region that is not ready yet (empty, or being initialised) is
/// looked at again.
pub const TRANSIENT_RETRY: Duration = Duration::from_secs(1);

/// Where to look.
#[derive(Clone, Debug)]
pub struct DiscoveryConfig {
    /// The host directory holding one directory per container.
    pub root: PathBuf,
    /// Name of the region file inside each container directory.
    pub region_file: String,
    /// Most containers tracked; directories beyond it are ignored (logged).
    pub max_containers: usize,
}

/// Why one region could not be used.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    #[error("{path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a regular file (symlinks and special files are refused)")]
    NotRegular { path: PathBuf },
    #[error("{path} is {actual} bytes ({allocated} on disk), a region is {expected}")]
    WrongSize {
        path: PathBuf,
        actual: u64,
        allocated: u64,
        expected: u64,
    },
    #[error("{path}")]
    Region {
        path: PathBuf,
        #[source]
        source: RegionError,
    },
    #[error("{path}")]
    Guard {
        path: PathBuf,
        #[source]
        source: GuardError,
    },
}

/// Which file a path named when it was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    pub device: u64,
    pub inode: u64,
    pub size: u64,
    /// What the file takes on disk (`st_blocks` in bytes).
    pub allocated: u64,
    pub modified_ns: i128,
}

impl FileIdentity {
    /// The file's size and what it takes on disk.
    pub fn extent(&self) -> FileExtent {
        FileExtent {
            size: self.size,
            allocated: self.allocated,
        }
    }
}

/// The owner of a DRA claim's region directory, if `name` is one and its
/// record reads (a claim whose record is missing or bad is still measured,
/// named by its directory). The record comes from the records directory the
/// containers are not given; failing that, from the owner file older drivers
/// kept in the claim's own directory, for naming only: its containers can
/// write that one, so its grants are dropped. Neither file is trusted
/// ([`claim_owner::read_record`]) and neither's text is logged.
fn claim_owner(root: &Path, name: &str, dir: &Path) -> Option<ClaimOwner> {
    name.strip_prefix(CLAIM_DIR_PREFIX)?;
    let record = claim_owner::record_path(root, name);
    let error = match claim_owner::read_record(&record) {
        Ok(owner) => return Some(owner),
        Err(ClaimRecordError::Open(error)) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => Some(error),
    };
    let legacy = dir.join(CLAIM_OWNER_FILE);
    if let Some(error) = &error {
        tracing::warn!(
            error = error as &dyn std::error::Error,
            "claim record {}",
            record.display()
        );
    } else if !legacy.exists() {
        tracing::warn!("claim {name}: no record at {}", record.display());
        return None;
    }
    match claim_owner::read_record(&legacy) {
        Ok(owner) => Some(ClaimOwner {
            grants: Vec::new(),
            ..owner
        }),
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "claim owner file {}",
                legacy.display()
            );
            None
        }
    }
}

/// An open container region.
pub struct ContainerRegion {
    /// The directory name, `<podUID>_<container>`.
    pub key: String,
    /// Pod UID from the directory name, when it has the expected shape.
    pub pod_uid: Option<String>,
    /// Container name from the directory name.
    pub container: String,
    /// For a DRA claim's region (`claim-<uid>`): whom the claim belongs to,
    /// as its driver wrote it.
    pub claim: Option<ClaimOwner>,
    pub dir: PathBuf,
    pub path: PathBuf,
    pub identity: FileIdentity,
    pub opened_at: Instant,
    /// The UUIDs of the GPUs the node's grant names, in the region's
    /// device order (empty: the region has no grant, as a workstation's or
    /// an older node agent's).
    pub grant_uuids: Vec<String>,
    // Field order matters: the guard must be unregistered before the
    // region is unmapped.
    guard: Guarded,
    region: Arc<Region>,
}

impl ContainerRegion {
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// A shared handle (for the janitor thread).
    pub fn region_arc(&self) -> Arc<Region> {
        Arc::clone(&self.region)
    }

    /// The file shrank under the mapping: its contents now read as zeros.
    pub fn faulted(&self) -> bool {
        self.guard.faulted()
    }

    /// Reads everything the monitor needs from the region, clamped.
    pub fn read(&self) -> RegionFigures {
        read_figures(&self.region)
    }
}

pub use vgpu_node_contract::figures::{
    read_figures, split_key, valid_uuid, DeviceFigures, RegionFigures,
};

/// What a rescan changed.
#[derive(Debug, Default)]
pub struct ScanReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Files refused in this pass (each also logged).
    pub refused: usize,
    /// Regions their containers had damaged, repaired in this pass (each
    /// also logged), by key.
    pub repaired: Vec<(String, Repaired)>,
}

struct Rejected {
    identity: Option<FileIdentity>,
    at: Instant,
    retry: Duration,
}

/// The set of open regions, kept in step with the host directory.
pub struct Discovery {
    config: DiscoveryConfig,
    regions: BTreeMap<String, ContainerRegion>,
    rejected: HashMap<String, Rejected>,
    root_error_logged: bool,
    overflow_logged: bool,
    /// Files refused since start (a counter for the metrics).
    pub refused_total: u64,
    /// Regions repaired since start (a counter for the metrics).
    pub repaired_total: u64,
}

impl Discovery {
    pub fn new(config: DiscoveryConfig) -> Self {
        Self {
            config,
            regions: BTreeMap::new(),
            rejected: HashMap::new(),
            root_error_logged: false,
            overflow_logged: false,
            refused_total: 0,
            repaired_total: 0,
        }
    }

    pub fn config(&self) -> &DiscoveryConfig {
        &self.config
    }

    /// The open regions, by key.
    pub fn regions(&self) -> impl Iterator<Item = &ContainerRegion> {
        self.regions.values()
    }

    pub fn get(&self, key: &str) -> Option<&ContainerRegion> {
        self.regions.get(key)
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Stops tracking `key` (its region is unmapped).
    pub fn forget(&mut self, key: &str) -> Option<ContainerRegion> {
        self.rejected.remove(key);
        self.regions.remove(key)
    }

    /// Brings the open set in line with the directory.
    pub fn rescan(&mut self, now: Instant) -> ScanReport {
        let mut report = ScanReport::default();
        let names = match self.list_dirs() {
            Ok(names) => {
                self.root_error_logged = false;
                names
            }
            Err(error) => {
                if !self.root_error_logged {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "cannot list {}",
                        self.config.root.display()
                    );
                    self.root_error_logged = true;
                }
                Vec::new()
            }
        };
        // Drop what disappeared or was replaced, and regions whose file shrank.
        let mut seen = std::collections::HashSet::with_capacity(names.len());
        for name in &names {
            seen.insert(name.as_str());
        }
        let stale: Vec<String> = self
            .regions
            .values()
            .filter(|r| {
                if !seen.contains(r.key.as_str()) {
                    return true;
                }
                if r.faulted() {
                    tracing::warn!(
                        "{}: the file shrank while mapped; dropping it",
                        r.path.display()
                    );
                    return true;
                }
                match identity_of(&r.path) {
                    Ok(now_identity) => {
                        now_identity.device != r.identity.device
                            || now_identity.inode != r.identity.inode
                            || !now_identity.extent().intact()
                    }
                    Err(_) => true,
                }
            })
            .map(|r| r.key.clone())
            .collect();
        for key in stale {
            self.regions.remove(&key);
            tracing::info!("region {key} removed");
            report.removed.push(key);
        }
        self.rejected.retain(|key, _| seen.contains(key.as_str()));

        for name in names {
            if self.regions.contains_key(&name) {
                continue;
            }
            if self.regions.len() >= self.config.max_containers {
                if !self.overflow_logged {
                    tracing::warn!(
                        "more than {} container directories under {}; ignoring the rest",
                        self.config.max_containers,
                        self.config.root.display()
                    );
                    self.overflow_logged = true;
                }
                break;
            }
            let dir = self.config.root.join(&name);
            let path = dir.join(&self.config.region_file);
            let identity = identity_of(&path).ok();
            if let Some(rejected) = self.rejected.get(&name) {
                if rejected.identity == identity && now.duration_since(rejected.at) < rejected.retry
                {
                    continue;
                }
            }
            if identity.is_none() {
                // No region file yet (the container has not started its
                // first GPU process): not an error, look again next pass.
                continue;
            }
            if let Some(repaired) = repair_if_damaged(&name, &dir, &path) {
                self.repaired_total = self.repaired_total.saturating_add(1);
                report.repaired.push((name.clone(), repaired));
            }
            match open_region(&path) {
                Ok((region, guard, identity)) => {
                    let (region, grant_uuids) = attach_grant(region, &dir);
                    let (pod_uid, container) = split_key(&name);
                    let claim = claim_owner(&self.config.root, &name, &dir);
                    tracing::info!("region {name} opened ({})", path.display());
                    self.rejected.remove(&name);
                    report.added.push(name.clone());
                    self.regions.insert(
                        name.clone(),
                        ContainerRegion {
                            key: name,
                            pod_uid,
                            container,
                            claim,
                            dir,
                            path,
                            identity,
                            opened_at: now,
                            grant_uuids,
                            guard,
                            region: Arc::new(region),
                        },
                    );
                }
                Err(error) => {
                    // An empty file, or one its creator is still
                    // initialising, is a normal moment in a region's life:
                    // look again soon, without a warning.
                    let transient = matches!(
                        &error,
                        DiscoveryError::WrongSize { actual: 0, .. }
                            | DiscoveryError::Region {
                                source: RegionError::Corrupt { .. },
                                ..
                            }
                    );
                    if transient {
                        tracing::debug!(
                            error = &error as &dyn std::error::Error,
                            "region {name} not ready"
                        );
                    } else {
                        tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "skipping region {name}"
                        );
                        report.refused += 1;
                        self.refused_total = self.refused_total.saturating_add(1);
                    }
                    let retry = if transient {
                        TRANSIENT_RETRY
                    } else {
                        REJECT_RETRY
                    };
                    self.rejected.insert(
                        name,
                        Rejected {
                            identity,
                            at: now,
                            retry,
                        },
                    );
                }
            }
        }
        report
    }

    /// Container directory names under the root, sorted, at most a bounded
    /// number (symlinks and non-UTF-8 names are skipped).
    fn list_dirs(&self) -> std::io::Result<Vec<String>> {
        let limit = self.config.max_containers.saturating_mul(4).max(64);
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.config.root)? {
            let entry = entry?;
            if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            names.push(name);
            if names.len() >= limit {
                break;
            }
        }
        names.sort();
        Ok(names)
    }
}

fn identity_of(path: &Path) -> std::io::Result<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path)?;
    Ok(FileIdentity {
        device: meta.dev(),
        inode: meta.ino(),
        size: meta.size(),
        allocated: meta.blocks().saturating_mul(512),
        modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
    })
}

/// Repairs the region at `path` when its container damaged it (grown,
/// shrunk, holding more disk than a region, or no longer a region's
/// header), where the node set the container up: its grant in `dir` reads.
/// A region without a grant (a workstation's) is left as it is. Returns
/// what was repaired (the caller tells it); a failure is logged.
fn repair_if_damaged(key: &str, dir: &Path, path: &Path) -> Option<Repaired> {
    let grant = Grant::open_read_only(&dir.join(GRANT_FILE)).ok()?;
    match Region::repair(path, &grant.limits().load()) {
        Ok(Some((_, repaired))) => Some(repaired),
        Ok(None) => None,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "region {key}: cannot repair it"
            );
            None
        }
    }
}

/// Attaches the node's grant beside the region, when there is one: its
/// limits are then the region's, and the monitor writes its effective
/// shares there. Returns the grant's device UUIDs (empty without a grant,
/// or with one that cannot be read, which is logged: the region's own
/// limits are then read).
fn attach_grant(mut region: Region, dir: &Path) -> (Region, Vec<String>) {
    match region.attach_grant_beside(dir, true) {
        Ok(_) => {}
        Err(error) => tracing::warn!(
            error = &error as &dyn std::error::Error,
            "the region's own limits are read instead"
        ),
    }
    let uuids = region
        .grant()
        .and_then(|grant| grant.settings().ok())
        .map(|settings| settings.device_uuids)
        .unwrap_or_default();
    (region, uuids)
}

/// Opens a region without following a symlink in its last component: the
/// file is first opened as a path (`O_PATH | O_NOFOLLOW`, which never
/// blocks, even on a FIFO), checked to be a regular file of the right size,
/// and then reopened through `/proc/self/fd`, which names exactly that
/// inode, so nothing can be swapped in between.
pub fn open_region(path: &Path) -> Result<(Region, Guarded, FileIdentity), DiscoveryError> {
    let io = |op, source| DiscoveryError::Io {
        path: path.to_path_buf(),
        op,
        source,
    };
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io(
            "open",
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"),
        )
    })?;
    // SAFETY: a valid C string; the returned fd is owned below.
    let fd = unsafe {
        libc::open(
            c_path.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io("open", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(|e| io("stat", e))?;
    if !meta.file_type().is_file() {
        return Err(DiscoveryError::NotRegular {
            path: path.to_path_buf(),
        });
    }
    if !FileExtent::from(&meta).intact() {
        return Err(DiscoveryError::WrongSize {
            path: path.to_path_buf(),
            actual: meta.len(),
            allocated: meta.blocks().saturating_mul(512),
            expected: REGION_BYTES as u64,
        });
    }
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let identity = FileIdentity {
        device: meta.dev(),
        inode: meta.ino(),
        size: meta.len(),
        allocated: meta.blocks().saturating_mul(512),
        modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
    };
    let through = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let region = Region::open_existing(&through).map_err(|source| DiscoveryError::Region {
        path: path.to_path_buf(),
        source,
    })?;
    drop(file);
    let base = region.layout() as *const _ as *const u8;
    let guard = Guarded::register(base, REGION_BYTES).map_err(|source| DiscoveryError::Guard {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((region, guard, identity))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_node_contract::region::RegionLimits;

    fn temp_root(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vgpu-disc-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("root");
        dir
    }

    fn config(root: &Path) -> DiscoveryConfig {
        DiscoveryConfig {
            root: root.to_path_buf(),
            region_file: "region.cache".into(),
            max_containers: 8,
        }
    }

    fn make_region(root: &Path, key: &str) -> Region {
        let dir = root.join(key);
        std::fs::create_dir_all(&dir).expect("dir");
        Region::open_or_create(&dir.join("region.cache"), &RegionLimits::default()).expect("region")
    }

    #[test]
    fn picks_up_and_drops_regions_without_restart() {
        let root = temp_root("scan");
        let mut discovery = Discovery::new(config(&root));
        assert!(discovery.rescan(Instant::now()).added.is_empty());
        let _a = make_region(&root, "uid-a_main");
        std::fs::create_dir_all(root.join("uid-b_side")).expect("dir without region");
        let report = discovery.rescan(Instant::now());
        assert_eq!(report.added, vec!["uid-a_main".to_string()]);
        let region = discovery.get("uid-a_main").expect("tracked");
        assert_eq!(region.pod_uid.as_deref(), Some("uid-a"));
        assert_eq!(region.container, "main");
        let _b = make_region(&root, "uid-b_side");
        assert_eq!(
            discovery.rescan(Instant::now()).added,
            vec!["uid-b_side".to_string()]
        );
        std::fs::remove_dir_all(root.join("uid-a_main")).expect("remove");
        assert_eq!(
            discovery.rescan(Instant::now()).removed,
            vec!["uid-a_main".to_string()]
        );
        assert_eq!(discovery.len(), 1);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn refuses_symlinks_wrong_sizes_and_logs_once() {
        let root = temp_root("refuse");
        let real = make_region(&root, "uid-real_c");
        std::fs::create_dir_all(root.join("uid-link_c")).expect("dir");
        std::os::unix::fs::symlink(real.path(), root.join("uid-link_c/region.cache"))
            .expect("symlink");
        std::fs::create_dir_all(root.join("uid-short_c")).expect("dir");
        std::fs::write(root.join("uid-short_c/region.cache"), b"short").expect("write");
        let mut discovery = Discovery::new(config(&root));
        let report = discovery.rescan(Instant::now());
        assert_eq!(report.added, vec!["uid-real_c".to_string()]);
        assert_eq!(report.refused, 2);
        // Unchanged files are not retried (nor logged) on the next pass.
        assert_eq!(discovery.rescan(Instant::now()).refused, 0);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_replaced_file_is_reopened() {
        let root = temp_root("replace");
        let _first = make_region(&root, "uid_c");
        let mut discovery = Discovery::new(config(&root));
        discovery.rescan(Instant::now());
        let first_inode = discovery.get("uid_c").expect("open").identity.inode;
        std::fs::remove_file(root.join("uid_c/region.cache")).expect("rm");
        let _second = make_region(&root, "uid_c");
        let report = discovery.rescan(Instant::now());
        assert_eq!(report.removed, vec!["uid_c".to_string()]);
        // Reopened on the same pass or the next.
        discovery.rescan(Instant::now());
        let second_inode = discovery.get("uid_c").expect("reopened").identity.inode;
        assert_ne!(first_inode, second_inode);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn keys_split_into_pod_uid_and_container() {
        assert_eq!(
            split_key("1b4e28ba-2fa1-11d2-883f-0016d3cca427_train"),
            (
                Some("1b4e28ba-2fa1-11d2-883f-0016d3cca427".to_string()),
                "train".to_string()
            )
        );
        assert_eq!(split_key("plain"), (None, "plain".to_string()));
        assert_eq!(split_key("_x"), (None, "_x".to_string()));
    }

    #[test]
    fn uuids_must_be_label_safe() {
        assert!(valid_uuid("GPU-0123abcd-0000-1111-2222-333344445555"));
        assert!(!valid_uuid(""));
        assert!(!valid_uuid("GPU\"}\n evil"));
        assert!(!valid_uuid(&"A".repeat(49)));
    }
}
