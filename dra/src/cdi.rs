//! The Container Device Interface spec of a prepared claim: the container
//! runtime applies it to every container that uses the claim. One spec
//! file per claim, `<cdi-dir>/vgpu.io-claim_<uid>.json`, with one device
//! named by the claim's UID (`vgpu.io/claim=<uid>`) whose edits are the
//! shim's environment and mounts, the same for all the claim's containers.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_cluster::file_error::{io_error, FileError};

/// The CDI version the specs are written in (the oldest that has
/// everything they use).
pub const CDI_VERSION: &str = "0.5.0";
/// The CDI kind of a claim's device.
pub const CDI_KIND: &str = "vgpu.io/claim";

#[derive(Debug, Error)]
pub enum CdiError {
    #[error(transparent)]
    Io(#[from] FileError),
    #[error("claim UID {0:?} cannot name a CDI device")]
    BadUid(String),
}

/// A CDI spec file (the subset written here).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<SpecDevice>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecDevice {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=VALUE`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Mount {
    /// A bind mount, read-only or not.
    pub fn bind(host_path: &Path, container_path: &Path, read_only: bool) -> Self {
        let mut options = vec!["rbind".to_string(), "nosuid".into(), "nodev".into()];
        if read_only {
            options.push("ro".into());
        }
        Self {
            host_path: host_path.display().to_string(),
            container_path: container_path.display().to_string(),
            options,
        }
    }
}

/// `uid` if it can name a CDI device and a directory (a Kubernetes UID:
/// hex digits and dashes; CDI allows letters, digits, `-`, `_`, `.`, `:`).
pub fn checked(uid: &str) -> Result<&str, CdiError> {
    let valid = !uid.is_empty()
        && uid.len() <= 128
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    valid
        .then_some(uid)
        .ok_or_else(|| CdiError::BadUid(uid.to_string()))
}

/// The fully qualified CDI name of a claim's device.
pub fn device_id(claim_uid: &str) -> Result<String, CdiError> {
    Ok(format!("{CDI_KIND}={}", checked(claim_uid)?))
}

/// Where a claim's spec is written.
pub fn spec_path(cdi_dir: &Path, claim_uid: &str) -> Result<PathBuf, CdiError> {
    Ok(cdi_dir.join(format!("vgpu.io-claim_{}.json", checked(claim_uid)?)))
}

/// The spec of the claim `claim_uid`.
pub fn claim_spec(claim_uid: &str, env: &BTreeMap<String, String>, mounts: Vec<Mount>) -> Spec {
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: CDI_KIND.into(),
        devices: vec![SpecDevice {
            name: claim_uid.to_string(),
            container_edits: ContainerEdits {
                env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                mounts,
            },
        }],
    }
}

/// Writes `spec` for `claim_uid` atomically (a runtime never reads half a
/// spec); returns its path.
pub fn write_spec(cdi_dir: &Path, claim_uid: &str, spec: &Spec) -> Result<PathBuf, CdiError> {
    let path = spec_path(cdi_dir, claim_uid)?;
    std::fs::create_dir_all(cdi_dir).map_err(io_error(cdi_dir, "create directory"))?;
    let temporary = cdi_dir.join(format!(".vgpu.io-claim_{claim_uid}.json.tmp"));
    let json = serde_json::to_vec_pretty(spec)
        .map_err(|error| io_error(&path, "encode")(std::io::Error::other(error)))?;
    let mut file = std::fs::File::create(&temporary).map_err(io_error(&temporary, "create"))?;
    file.write_all(&json)
        .map_err(io_error(&temporary, "write"))?;
    file.sync_all().map_err(io_error(&temporary, "sync"))?;
    std::fs::rename(&temporary, &path).map_err(io_error(&path, "rename"))?;
    Ok(path)
}

/// Removes the claim's spec; one that is not there is fine.
pub fn remove_spec(cdi_dir: &Path, claim_uid: &str) -> Result<(), CdiError> {
    let path = spec_path(cdi_dir, claim_uid)?;
    match std::fs::remove_file(&path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(io_error(&path, "remove")(error).into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_round_trips_and_is_removed() {
        let dir = std::env::temp_dir().join(format!("vgpu-cdi-{}", std::process::id()));
        let env = BTreeMap::from([("CUDA_DEVICE_SM_LIMIT".to_string(), "30".to_string())]);
        let spec = claim_spec(
            "0b1c-22",
            &env,
            vec![Mount::bind(
                Path::new("/h/lib.so"),
                Path::new("/c/lib.so"),
                true,
            )],
        );
        let path = write_spec(&dir, "0b1c-22", &spec).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"cdiVersion\""), "{text}");
        assert!(text.contains("\"containerEdits\""), "{text}");
        assert!(text.contains("CUDA_DEVICE_SM_LIMIT=30"), "{text}");
        let back: Spec = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, spec);
        assert_eq!(device_id("0b1c-22").expect("id"), "vgpu.io/claim=0b1c-22");
        remove_spec(&dir, "0b1c-22").expect("remove");
        assert!(!path.exists());
        remove_spec(&dir, "0b1c-22").expect("removing twice is fine");
        assert!(matches!(device_id("../x"), Err(CdiError::BadUid(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
