//! Where regions and the shim are, and how regions are named.
//!
//! A region is `<root>/<dir>/region.cache`. The device plugin names its
//! directories `<podUID>_<container>`; `vgpu run` names its own
//! `local-<name>`, which has no `_`, so the node monitor shows it under
//! that name and never takes it for a pod's (it only removes directories
//! of pods the Kubernetes API says are gone).

use std::ffi::OsStr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_cluster::file_error::{io_error, FileError};
use vgpu_node_contract::figures::split_key;

/// The directory the device plugin writes and the node monitor watches.
pub const NODE_CONTAINERS_DIR: &str = "/usr/local/vgpu/containers";
/// The region file in each directory (the plugin's and monitor's default).
pub const REGION_FILE: &str = "region.cache";
/// Prefix of the directories `vgpu run` makes.
pub const LOCAL_PREFIX: &str = "local-";
/// Where the Helm chart installs the shim on nodes.
pub const INSTALLED_LIBRARY: &str = "/usr/local/vgpu/libvgpu.so";
const LIBRARY_NAME: &str = "libvgpu.so";

#[derive(Debug, Error)]
pub enum PlaceError {
    #[error("{file}: {}", file.source)]
    Io {
        #[from]
        file: FileError,
    },
    #[error("{path} is not a private directory of this user (owner {owner}, mode {mode:o}); choose another with --root")]
    Unsafe {
        path: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error("no shim found: looked for {looked}; name one with --library")]
    NoLibrary { looked: String },
    #[error("--library {0}: no such file")]
    MissingLibrary(PathBuf),
    #[error("no region {target:?} in {roots}")]
    NotFound { target: String, roots: String },
}

/// The effective user ID.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The default root: the node's directory for root, else the user's
/// runtime directory, else a private directory under /tmp.
pub fn default_root() -> PathBuf {
    let uid = effective_uid();
    if uid == 0 {
        return PathBuf::from(NODE_CONTAINERS_DIR);
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("vgpu"),
        _ => std::env::temp_dir().join(format!("vgpu-{uid}")),
    }
}

/// The roots `ls`, `inspect` and `set` look in: the one given, else the
/// default and, for other users, the node's directory too.
pub fn search_roots(given: Option<&Path>) -> Vec<PathBuf> {
    if let Some(root) = given {
        return vec![root.to_path_buf()];
    }
    let mut roots = vec![default_root()];
    let node = PathBuf::from(NODE_CONTAINERS_DIR);
    if !roots.contains(&node) {
        roots.push(node);
    }
    roots
}

/// Makes `root` if missing. The node's directory is readable by all (the
/// monitor and plugin run as root); any other root is the user's own
/// (0700), and one found there must be owned by the user and closed to
/// others, or another user could swap regions under it.
pub fn ensure_root(root: &Path) -> Result<(), PlaceError> {
    let shared = root == Path::new(NODE_CONTAINERS_DIR);
    let mode = if shared { 0o755 } else { 0o700 };
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(root)
    {
        Ok(()) => {}
        Err(error) => return Err(io_error(root, "create directory")(error).into()),
    }
    let meta = std::fs::symlink_metadata(root).map_err(io_error(root, "stat"))?;
    let uid = effective_uid();
    let private = meta.is_dir() && meta.uid() == uid && meta.mode() & 0o022 == 0;
    if !shared && !private && uid != 0 {
        return Err(PlaceError::Unsafe {
            path: root.to_path_buf(),
            owner: meta.uid(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

/// The directory of the local region `name`.
pub fn local_dir(root: &Path, name: &str) -> PathBuf {
    root.join(format!("{LOCAL_PREFIX}{name}"))
}

/// Who made a region, from its directory's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `vgpu run --name NAME`.
    Local { name: String },
    /// The device plugin, for a pod's container.
    Kubernetes { pod_uid: String, container: String },
    /// Anything else (a region made by hand).
    Other,
}

impl Origin {
    pub fn of_dir(dir_name: &str) -> Self {
        if let Some(name) = dir_name.strip_prefix(LOCAL_PREFIX) {
            if !name.contains('_') {
                return Self::Local {
                    name: name.to_string(),
                };
            }
        }
        match split_key(dir_name) {
            (Some(pod_uid), container) => Self::Kubernetes { pod_uid, container },
            (None, _) => Self::Other,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Local { .. } => "local",
            Self::Kubernetes { .. } => "kubernetes",
            Self::Other => "other",
        }
    }
}

/// The name of the directory holding `region` (a region file).
pub fn dir_name_of(region: &Path) -> String {
    region
        .parent()
        .and_then(Path::file_name)
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Finds the region file `target` names: a path (containing `/`) to a
/// region file or its directory, else a local region's name or a
/// directory's name in one of `roots`.
pub fn resolve(target: &str, roots: &[PathBuf]) -> Result<PathBuf, PlaceError> {
    let as_file = |dir: &Path| {
        if dir.is_dir() {
            dir.join(REGION_FILE)
        } else {
            dir.to_path_buf()
        }
    };
    if target.contains('/') {
        let path = as_file(Path::new(target));
        if path.exists() {
            return Ok(path);
        }
    } else {
        for root in roots {
            for dir in [local_dir(root, target), root.join(target)] {
                let path = dir.join(REGION_FILE);
                if path.exists() {
                    return Ok(path);
                }
            }
        }
    }
    Err(PlaceError::NotFound {
        target: target.to_string(),
        roots: roots
            .iter()
            .map(|root| root.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The region files directly under `root`, sorted by directory name;
/// symlinked files are left out (a container can write its directory).
pub fn list_regions(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .map(|entry| entry.path().join(REGION_FILE))
        .filter(|path| std::fs::symlink_metadata(path).is_ok_and(|meta| meta.is_file()))
        .collect();
    found.sort();
    found
}

/// The shim to preload: the one named, else next to this executable, else
/// the node's installed copy.
pub fn find_library(named: Option<&Path>) -> Result<PathBuf, PlaceError> {
    if let Some(path) = named {
        return if path.is_file() {
            Ok(absolute(path))
        } else {
            Err(PlaceError::MissingLibrary(path.to_path_buf()))
        };
    }
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        candidates.push(dir.join(LIBRARY_NAME));
    }
    candidates.push(PathBuf::from(INSTALLED_LIBRARY));
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .ok_or_else(|| PlaceError::NoLibrary {
            looked: candidates
                .iter()
                .map(|path| path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// `path` made absolute: the child may change directory before loading it.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// True when `text` is an environment value naming `library` among others.
pub fn preload_names(text: &OsStr, library: &Path) -> bool {
    text.to_string_lossy()
        .split([' ', ':'])
        .any(|item| Path::new(item) == library)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_error_names_the_path_the_operation_and_the_cause() {
        let error = PlaceError::from(io_error(Path::new("/r"), "stat")(
            std::io::Error::from_raw_os_error(libc::EACCES),
        ));
        assert_eq!(
            error.to_string(),
            "/r: stat: Permission denied (os error 13)"
        );
    }

    #[test]
    fn origins_follow_the_directory_names() {
        assert_eq!(
            Origin::of_dir("local-team"),
            Origin::Local {
                name: "team".into()
            }
        );
        assert_eq!(
            Origin::of_dir("1b4e28ba-2fa1_main"),
            Origin::Kubernetes {
                pod_uid: "1b4e28ba-2fa1".into(),
                container: "main".into()
            }
        );
        assert!(matches!(
            Origin::of_dir("local-x_y"),
            Origin::Kubernetes { .. }
        ));
        assert_eq!(Origin::of_dir("plain"), Origin::Other);
    }
}
