//! The claims this node has prepared, kept in a file so that a restarted
//! driver answers kubelet's repeated `NodePrepareResources` with what it
//! answered before, and knows what to release.
//!
//! The file is rewritten atomically after every change. One that cannot
//! be read is moved aside (never deleted) and the driver starts from an
//! empty record: preparing a claim again gives the same answer (the
//! region and CDI spec are named by the claim's UID), and releasing an
//! unrecorded claim still removes what is named by its UID.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_cluster::file_error::{io_error, FileError};

/// The file's format version.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Io(#[from] FileError),
}

/// One device of a prepared claim, as kubelet was told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_device_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
}

/// A prepared claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub devices: Vec<PreparedDevice>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct File {
    version: u32,
    /// By claim UID.
    claims: BTreeMap<String, PreparedClaim>,
}

/// The record, and where it is kept.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    claims: BTreeMap<String, PreparedClaim>,
}

impl Checkpoint {
    /// Reads the record at `path`; a missing file is an empty record, and
    /// an unreadable one is moved aside (its new path is returned with
    /// the reason) and counts as empty.
    pub fn load(path: &Path) -> Result<(Self, Option<(PathBuf, String)>), CheckpointError> {
        let empty = |path: &Path| Self {
            path: path.to_path_buf(),
            claims: BTreeMap::new(),
        };
        let text = match std::fs::read(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok((empty(path), None))
            }
            Err(source) => return Err(io_error(path, "read")(source).into()),
        };
        let reason = match serde_json::from_slice::<File>(&text) {
            Ok(file) if file.version == FORMAT_VERSION => {
                return Ok((
                    Self {
                        path: path.to_path_buf(),
                        claims: file.claims,
                    },
                    None,
                ))
            }
            Ok(file) => format!(
                "format version {} (this driver reads {FORMAT_VERSION})",
                file.version
            ),
            Err(error) => error.to_string(),
        };
        let mut aside = path.as_os_str().to_owned();
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        aside.push(format!(".unreadable-{stamp}"));
        let aside = PathBuf::from(aside);
        std::fs::rename(path, &aside).map_err(io_error(path, "move aside"))?;
        Ok((empty(path), Some((aside, reason))))
    }

    pub fn get(&self, uid: &str) -> Option<&PreparedClaim> {
        self.claims.get(uid)
    }

    pub fn claims(&self) -> &BTreeMap<String, PreparedClaim> {
        &self.claims
    }

    /// Records `claim` as prepared and saves.
    pub fn insert(&mut self, uid: &str, claim: PreparedClaim) -> Result<(), CheckpointError> {
        let previous = self.claims.insert(uid.to_string(), claim);
        self.save().inspect_err(|_| {
            // Keep memory and file in step: what could not be saved is
            // not recorded.
            match &previous {
                Some(previous) => {
                    self.claims.insert(uid.to_string(), previous.clone());
                }
                None => {
                    self.claims.remove(uid);
                }
            }
        })
    }

    /// Forgets `uid` and saves (nothing to do for an unknown claim).
    pub fn remove(&mut self, uid: &str) -> Result<(), CheckpointError> {
        match self.claims.remove(uid) {
            None => Ok(()),
            Some(previous) => self.save().inspect_err(|_| {
                self.claims.insert(uid.to_string(), previous);
            }),
        }
    }

    fn save(&self) -> Result<(), CheckpointError> {
        if let Some(parent) = self.path.parent() {
            std::fs::create_dir_all(parent).map_err(io_error(parent, "create directory"))?;
        }
        let file = File {
            version: FORMAT_VERSION,
            claims: self.claims.clone(),
        };
        let json = serde_json::to_vec_pretty(&file)
            .map_err(|error| io_error(&self.path, "encode")(std::io::Error::other(error)))?;
        let mut temporary = self.path.as_os_str().to_owned();
        temporary.push(".tmp");
        let temporary = PathBuf::from(temporary);
        let mut out = std::fs::File::create(&temporary).map_err(io_error(&temporary, "create"))?;
        out.write_all(&json)
            .map_err(io_error(&temporary, "write"))?;
        out.sync_all().map_err(io_error(&temporary, "sync"))?;
        std::fs::rename(&temporary, &self.path).map_err(io_error(&self.path, "rename"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            devices: vec![PreparedDevice {
                requests: vec!["gpu".into()],
                pool: "node-a".into(),
                device: "gpu-0".into(),
                cdi_device_ids: vec!["vgpu.io/claim=u1".into()],
                share_id: Some("s".into()),
            }],
        }
    }

    #[test]
    fn survives_a_reload_and_moves_a_corrupt_file_aside() {
        let dir = std::env::temp_dir().join(format!("vgpu-checkpoint-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("prepared.json");
        let (mut checkpoint, aside) = Checkpoint::load(&path).expect("load");
        assert!(aside.is_none());
        checkpoint.insert("u1", claim()).expect("insert");
        let (again, _) = Checkpoint::load(&path).expect("reload");
        assert_eq!(again.get("u1"), Some(&claim()));
        let (mut again, _) = Checkpoint::load(&path).expect("reload");
        again.remove("u1").expect("remove");
        again
            .remove("u1")
            .expect("removing an unknown claim is fine");
        assert!(Checkpoint::load(&path)
            .expect("reload")
            .0
            .get("u1")
            .is_none());

        std::fs::write(&path, b"{not json").expect("corrupt");
        let (empty, aside) = Checkpoint::load(&path).expect("load corrupt");
        assert!(empty.claims().is_empty());
        let (aside, reason) = aside.expect("moved aside");
        assert_eq!(std::fs::read(&aside).expect("kept"), b"{not json");
        assert!(!reason.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
