//! Who a DRA claim's region belongs to and what it was granted: the record
//! the DRA driver writes when it prepares a claim, read by the node monitor
//! to name the claim's series by namespace, pods and claim, and to put back
//! the claim's limits when they were changed from inside.
//!
//! The record lives in [`CLAIM_RECORDS_DIR`] under the regions' directory,
//! not in the claim's own directory (`claim-<uid>/`): that one is mounted
//! into the claim's containers, which could rewrite anything kept there. A
//! reader still trusts nothing about the file ([`read_record`]): it may be a
//! FIFO, a link or huge, and its text is never echoed.
//!
//! The format is lines of `key=value` (`namespace`, `claim`, one `pod` line
//! per pod the claim is reserved for, one `device` line per GPU granted), so
//! that it needs no parser beyond this one; unknown keys are ignored.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The prefix of a claim's region directory, `claim-<uid>` (no `_`: it is
/// not a pod's container).
pub const CLAIM_DIR_PREFIX: &str = "claim-";
/// The owner file's name in a claim's directory, where drivers before the
/// records directory kept it (read for naming only: containers can write it).
pub const CLAIM_OWNER_FILE: &str = "claim.owner";
/// The directory of claim records, under the regions' directory. Its name
/// starts with a dot: no pod's container or claim is named so.
pub const CLAIM_RECORDS_DIR: &str = ".claims";
/// The most a record may hold (a claim on every GPU of a node with a long
/// list of pods fits many times over).
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// Where the record of the claim whose region directory is `dir_name`
/// (`claim-<uid>`) lives, under the regions' directory `containers_dir`.
pub fn record_path(containers_dir: &Path, dir_name: &str) -> PathBuf {
    containers_dir
        .join(CLAIM_RECORDS_DIR)
        .join(format!("{dir_name}.owner"))
}

/// One GPU a claim was granted, as the driver prepared it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimGrant {
    pub uuid: String,
    /// Device memory granted, in bytes.
    pub memory_bytes: u64,
    /// Compute share in percent.
    pub cores_percent: u32,
    /// Borrowing allowed up to this percent, if any.
    pub burst_percent: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimOwner {
    pub namespace: String,
    pub claim: String,
    /// The pods the claim was reserved for when it was prepared.
    pub pods: Vec<String>,
    /// What the claim was granted (none in records written before grants
    /// were recorded).
    pub grants: Vec<ClaimGrant>,
}

/// Why a record's text could not be used. Line numbers, never the text: a
/// record may have been written by someone who wants it logged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClaimOwnerError {
    #[error("line {0} is not key=value")]
    NotKeyValue(usize),
    #[error("line {0}: a device line is uuid,memory bytes,cores percent,burst percent (or empty)")]
    BadDevice(usize),
    #[error("no {0} line")]
    Missing(&'static str),
    #[error("a value holds a line break or a comma")]
    LineBreak,
}

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClaimRecordError {
    #[error("cannot open it")]
    Open(#[source] std::io::Error),
    #[error("cannot read it")]
    Read(#[source] std::io::Error),
    #[error("it is not a regular file")]
    NotRegular,
    #[error("it is over {MAX_RECORD_BYTES} bytes")]
    TooLarge,
    #[error("it is not UTF-8 text")]
    NotText,
    #[error(transparent)]
    Format(#[from] ClaimOwnerError),
}

/// Reads the record at `path` without trusting the file: a link is not
/// followed, a FIFO or device neither blocks nor is read (opened without
/// blocking, then only a regular file is read), and at most
/// [`MAX_RECORD_BYTES`] are read.
pub fn read_record(path: &Path) -> Result<ClaimOwner, ClaimRecordError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(ClaimRecordError::Open)?;
    let metadata = file.metadata().map_err(ClaimRecordError::Read)?;
    if !metadata.file_type().is_file() {
        return Err(ClaimRecordError::NotRegular);
    }
    // The size may change after the check: the read itself is bounded.
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(ClaimRecordError::Read)?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(ClaimRecordError::TooLarge);
    }
    let text = String::from_utf8(bytes).map_err(|_| ClaimRecordError::NotText)?;
    Ok(ClaimOwner::parse(&text)?)
}

impl ClaimOwner {
    /// The file's text; names with a line break cannot be written (no
    /// Kubernetes name has one).
    pub fn to_text(&self) -> Result<String, ClaimOwnerError> {
        let values = [&self.namespace, &self.claim].into_iter().chain(&self.pods);
        if values.into_iter().any(|value| value.contains('\n'))
            || self
                .grants
                .iter()
                .any(|grant| grant.uuid.contains(['\n', ',']))
        {
            return Err(ClaimOwnerError::LineBreak);
        }
        Ok(self.to_string())
    }

    pub fn parse(text: &str) -> Result<Self, ClaimOwnerError> {
        let mut owner = Self::default();
        let (mut namespace, mut claim) = (false, false);
        for (number, line) in text
            .lines()
            .enumerate()
            .map(|(index, line)| (index + 1, line))
            .filter(|(_, line)| !line.trim().is_empty())
        {
            let (key, value) = line
                .split_once('=')
                .ok_or(ClaimOwnerError::NotKeyValue(number))?;
            match key {
                "namespace" => (owner.namespace, namespace) = (value.to_string(), true),
                "claim" => (owner.claim, claim) = (value.to_string(), true),
                "pod" => owner.pods.push(value.to_string()),
                "device" => owner
                    .grants
                    .push(parse_grant(value).ok_or(ClaimOwnerError::BadDevice(number))?),
                _ => {}
            }
        }
        if !namespace {
            return Err(ClaimOwnerError::Missing("namespace"));
        }
        if !claim {
            return Err(ClaimOwnerError::Missing("claim"));
        }
        Ok(owner)
    }
}

/// `uuid,memory bytes,cores percent,burst percent or empty`.
fn parse_grant(value: &str) -> Option<ClaimGrant> {
    let mut fields = value.split(',');
    let uuid = fields.next().filter(|uuid| !uuid.is_empty())?.to_string();
    let memory_bytes = fields.next()?.parse().ok()?;
    let cores_percent = fields.next()?.parse().ok().filter(|p| *p <= 100)?;
    let burst_percent = match fields.next()? {
        "" => None,
        burst => Some(burst.parse().ok().filter(|p| *p <= 100)?),
    };
    if fields.next().is_some() {
        return None;
    }
    Some(ClaimGrant {
        uuid,
        memory_bytes,
        cores_percent,
        burst_percent,
    })
}

impl fmt::Display for ClaimOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "namespace={}", self.namespace)?;
        writeln!(f, "claim={}", self.claim)?;
        for pod in &self.pods {
            writeln!(f, "pod={pod}")?;
        }
        for grant in &self.grants {
            let burst = grant.burst_percent.map(|b| b.to_string());
            writeln!(
                f,
                "device={},{},{},{}",
                grant.uuid,
                grant.memory_bytes,
                grant.cores_percent,
                burst.as_deref().unwrap_or("")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_what_it_cannot_read() {
        let owner = ClaimOwner {
            namespace: "ml".into(),
            claim: "train-gpu-x7".into(),
            pods: vec!["train-0".into(), "train-1".into()],
            grants: vec![
                ClaimGrant {
                    uuid: "GPU-a".into(),
                    memory_bytes: 4 << 30,
                    cores_percent: 30,
                    burst_percent: Some(60),
                },
                ClaimGrant {
                    uuid: "GPU-b".into(),
                    memory_bytes: 1 << 30,
                    cores_percent: 100,
                    burst_percent: None,
                },
            ],
        };
        let text = owner.to_text().expect("text");
        assert_eq!(
            text,
            "namespace=ml\nclaim=train-gpu-x7\npod=train-0\npod=train-1\n\
             device=GPU-a,4294967296,30,60\ndevice=GPU-b,1073741824,100,\n"
        );
        assert_eq!(ClaimOwner::parse(&text), Ok(owner));
        assert_eq!(
            ClaimOwner::parse("namespace=a\nclaim=b\nlater=ignored\n").map(|o| o.pods.len()),
            Ok(0)
        );
        assert_eq!(
            ClaimOwner::parse("claim=b\n"),
            Err(ClaimOwnerError::Missing("namespace"))
        );
        assert_eq!(
            ClaimOwner::parse("namespace=a\nnonsense\n"),
            Err(ClaimOwnerError::NotKeyValue(2))
        );
        for device in [
            "GPU-a,1,101,",
            "GPU-a,1,30",
            ",1,30,",
            "GPU-a,x,30,",
            "GPU-a,1,30,5,6",
        ] {
            assert_eq!(
                ClaimOwner::parse(&format!("namespace=a\nclaim=b\ndevice={device}\n")),
                Err(ClaimOwnerError::BadDevice(3)),
                "{device}"
            );
        }
        let bad = ClaimOwner {
            namespace: "a\nb".into(),
            ..ClaimOwner::default()
        };
        assert_eq!(bad.to_text(), Err(ClaimOwnerError::LineBreak));
    }

    #[test]
    fn a_record_is_read_only_from_a_small_regular_file_and_never_echoed() {
        let dir = std::env::temp_dir().join(format!("vgpu-claim-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let good = dir.join("good");
        std::fs::write(&good, "namespace=a\nclaim=b\n").expect("write");
        assert_eq!(read_record(&good).expect("read").claim, "b");

        let secret = dir.join("secret");
        std::fs::write(&secret, "token-that-must-not-leak\n").expect("write");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&secret, &link).expect("symlink");
        let error = read_record(&link).expect_err("a link is not followed");
        assert!(matches!(error, ClaimRecordError::Open(_)), "{error:?}");
        let error = read_record(&secret).expect_err("not a record");
        assert!(!format!("{error} {error:?}").contains("token"), "{error:?}");

        let fifo = dir.join("fifo");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: `name` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        // Opening a FIFO with no writer would block without O_NONBLOCK.
        assert!(matches!(
            read_record(&fifo),
            Err(ClaimRecordError::NotRegular)
        ));
        assert!(matches!(
            read_record(Path::new("/dev/zero")),
            Err(ClaimRecordError::NotRegular)
        ));

        let big = dir.join("big");
        std::fs::write(&big, vec![b'x'; MAX_RECORD_BYTES as usize + 1]).expect("write");
        assert!(matches!(read_record(&big), Err(ClaimRecordError::TooLarge)));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn records_live_outside_the_claims_directory() {
        let path = record_path(Path::new("/var/vgpu/containers"), "claim-0b1c");
        assert_eq!(
            path,
            Path::new("/var/vgpu/containers/.claims/claim-0b1c.owner")
        );
    }
}
