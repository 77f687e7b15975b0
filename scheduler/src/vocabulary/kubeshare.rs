//! KubeShare 2.0's pod labels, read by the admission webhook and turned
//! into vgpu's own requests.
//!
//! KubeShare users describe a pod's GPU share in labels, because Kubernetes
//! does not allow fractional extended resources: `sharedgpu/gpu_request`
//! (guaranteed fraction of one GPU, or a whole number of GPUs),
//! `sharedgpu/gpu_limit` (up to which it may run while the GPU is idle),
//! `sharedgpu/gpu_mem` (bytes), `sharedgpu/gpu_model`, `sharedgpu/priority`
//! (0 to 100; 0, the default, is an *opportunistic* pod) and the
//! coscheduling group labels. A pod that only carries labels asks for no
//! resource, so kubelet would never call the device plugin for it; the
//! webhook therefore writes the same request in vgpu's resources and
//! annotations ([`crate::admission::kubeshare`]), which everything
//! downstream reads as it reads any other vGPU pod.
//!
//! Decimal values are read exactly (no floating point): `0.6` of 5 pods is
//! 3 pods, not 3.0000000000000004 rounded up to 4.

use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;
use thiserror::Error;
use vgpu_cluster::resources::{parse_whole_quantity, GPU_MODEL_ANNOTATION};

/// Every KubeShare label starts so; a pod with one is a KubeShare pod.
pub const LABEL_PREFIX: &str = "sharedgpu/";
/// Guaranteed fraction of one GPU ("0.5"), or whole GPUs ("2").
pub const GPU_REQUEST_LABEL: &str = "sharedgpu/gpu_request";
/// Fraction of the GPU the pod may use while the GPU is otherwise idle.
pub const GPU_LIMIT_LABEL: &str = "sharedgpu/gpu_limit";
/// Device memory cap in bytes.
pub const GPU_MEMORY_LABEL: &str = "sharedgpu/gpu_mem";
/// Only GPUs of this model.
pub const GPU_MODEL_LABEL: &str = "sharedgpu/gpu_model";
/// 0 (default): opportunistic; 1 to 100: guaranteed.
pub const PRIORITY_LABEL: &str = "sharedgpu/priority";
/// The coscheduling group's name.
pub const GROUP_NAME_LABEL: &str = "sharedgpu/group_name";
/// The same, under the name KubeShare's label list gives it.
pub const POD_GROUP_NAME_LABEL: &str = "sharedgpu/pod_group_name";
/// How many pods the group has.
pub const GROUP_HEADCOUNT_LABEL: &str = "sharedgpu/group_headcount";
/// The least fraction of the group that must be placed together.
pub const GROUP_THRESHOLD_LABEL: &str = "sharedgpu/group_threshold";

/// The labels this module knows; any other `sharedgpu/` label is refused
/// (a misspelt one would otherwise be ignored without a word).
const KNOWN_LABELS: [&str; 9] = [
    GPU_REQUEST_LABEL,
    GPU_LIMIT_LABEL,
    GPU_MEMORY_LABEL,
    GPU_MODEL_LABEL,
    PRIORITY_LABEL,
    GROUP_NAME_LABEL,
    POD_GROUP_NAME_LABEL,
    GROUP_HEADCOUNT_LABEL,
    GROUP_THRESHOLD_LABEL,
];

/// The `CUDA_TASK_PRIORITY` of an opportunistic pod's container: below
/// HAMi's low priority (1, the default), so the node monitor's arbitration
/// pauses it whenever any other container on its GPU is active.
pub const OPPORTUNISTIC_TASK_PRIORITY: i32 = 2;

/// Decimal fractions are held in millionths.
const ONE: u64 = 1_000_000;
/// Millionths in one percent.
const PERCENT: u64 = ONE / 100;

/// Why a KubeShare pod's labels cannot be served.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum KubeShareError {
    #[error("label {label}={value:?}: {reason}")]
    Value {
        label: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("label {0} is not one vgpu knows (KubeShare's are {known})", known = KNOWN_LABELS.join(", "))]
    Unknown(String),
    #[error(
        "label {GPU_REQUEST_LABEL} is missing; a pod with other {LABEL_PREFIX} labels needs it"
    )]
    NoRequest,
    #[error("label {GPU_LIMIT_LABEL}={limit:?} is below {GPU_REQUEST_LABEL}={request:?}")]
    LimitBelowRequest { request: String, limit: String },
    #[error(
        "labels {GROUP_NAME_LABEL}={group:?} and {POD_GROUP_NAME_LABEL}={pod_group:?} disagree"
    )]
    TwoGroupNames { group: String, pod_group: String },
    #[error("label {GROUP_HEADCOUNT_LABEL} is missing; group {0:?} needs its number of pods")]
    NoHeadcount(String),
    #[error("labels {GROUP_HEADCOUNT_LABEL} and {GROUP_THRESHOLD_LABEL} need a group name ({GROUP_NAME_LABEL})")]
    NoGroupName,
    #[error("label {GPU_MODEL_LABEL}={label:?} and annotation {GPU_MODEL_ANNOTATION}={annotation:?} disagree")]
    TwoModels { label: String, annotation: String },
    #[error("container {0:?} already asks for vGPU resources; give a pod either resources or {LABEL_PREFIX} labels, not both")]
    AlsoResources(String),
    #[error("the pod has no container to give the GPU to")]
    NoContainer,
}

/// A device memory cap as a KubeShare pod gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeShareMemory {
    /// `sharedgpu/gpu_mem`, rounded up to whole MiB.
    Mib(u64),
    /// No `gpu_mem`: KubeShare's default, the requested fraction of the GPU's
    /// memory, in percent.
    Percent(u32),
}

/// A coscheduling group as a pod's labels name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLabels {
    pub name: String,
    pub headcount: u32,
    /// In millionths, 1 to 1 000 000; 1 000 000 when the label is absent.
    pub threshold_millionths: u64,
}

impl GroupLabels {
    /// How many of the group's pods must be placed together:
    /// `ceil(headcount x threshold)`, at least 1.
    pub fn quorum(&self) -> u32 {
        let scaled = u64::from(self.headcount) * self.threshold_millionths;
        u32::try_from(scaled.div_ceil(ONE).max(1)).unwrap_or(self.headcount)
    }
}

/// What a KubeShare pod's labels ask for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeShareRequest {
    /// GPUs: 1 for a fraction, the number for whole GPUs.
    pub gpus: u32,
    /// Guaranteed compute per GPU, in percent (100 for whole GPUs).
    pub cores: u32,
    /// Percent up to which it may run while the GPU is idle, when above
    /// `cores`.
    pub burst: Option<u32>,
    pub memory: KubeShareMemory,
    pub model: Option<String>,
    /// 0 to 100; 0 is opportunistic.
    pub priority: u8,
    pub group: Option<GroupLabels>,
}

impl KubeShareRequest {
    /// Whether the pod only borrows capacity no guaranteed pod needs.
    pub fn opportunistic(&self) -> bool {
        self.priority == 0
    }

    /// Reads the KubeShare labels of `labels`; `None` when there are none.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Option<Self>, KubeShareError> {
        let mut ours = labels
            .iter()
            .filter(|(key, _)| key.starts_with(LABEL_PREFIX));
        if ours.clone().next().is_none() {
            return Ok(None);
        }
        if let Some((key, _)) = ours.find(|(key, _)| !KNOWN_LABELS.contains(&key.as_str())) {
            return Err(KubeShareError::Unknown(key.clone()));
        }
        let get = |key: &str| label(labels, key);
        let request_text = get(GPU_REQUEST_LABEL).ok_or(KubeShareError::NoRequest)?;
        let request = fraction(GPU_REQUEST_LABEL, request_text)?;
        if request == 0 {
            return Err(value_error(
                GPU_REQUEST_LABEL,
                request_text,
                "must be above 0",
            ));
        }
        let limit = get(GPU_LIMIT_LABEL)
            .map(|text| fraction(GPU_LIMIT_LABEL, text).map(|limit| (text, limit)))
            .transpose()?;
        if let Some((text, limit)) = limit {
            if limit < request {
                return Err(KubeShareError::LimitBelowRequest {
                    request: request_text.into(),
                    limit: text.into(),
                });
            }
        }
        let (gpus, cores, burst) = if request > ONE {
            if request % ONE != 0 {
                return Err(value_error(
                    GPU_REQUEST_LABEL,
                    request_text,
                    "above 1 it must be a whole number of GPUs",
                ));
            }
            let gpus = u32::try_from(request / ONE)
                .map_err(|_| value_error(GPU_REQUEST_LABEL, request_text, "too many GPUs"))?;
            (gpus, 100, None)
        } else {
            if let Some((text, limit)) = limit {
                if limit > ONE {
                    return Err(value_error(
                        GPU_LIMIT_LABEL,
                        text,
                        "may not exceed 1 for a fraction of a GPU",
                    ));
                }
            }
            let cores = percent_up(request);
            let burst = limit
                .map(|(_, limit)| percent_up(limit))
                .filter(|b| *b > cores);
            (1, cores, burst)
        };
        let memory = match get(GPU_MEMORY_LABEL) {
            Some(text) => {
                let bytes = parse_whole_quantity(text).map_err(|_| {
                    value_error(GPU_MEMORY_LABEL, text, "not a whole number of bytes")
                })?;
                if bytes == 0 {
                    return Err(value_error(GPU_MEMORY_LABEL, text, "must be above 0"));
                }
                KubeShareMemory::Mib(bytes.div_ceil(1 << 20))
            }
            None => KubeShareMemory::Percent(cores),
        };
        let model = match get(GPU_MODEL_LABEL) {
            Some("") => return Err(value_error(GPU_MODEL_LABEL, "", "empty; name a GPU model")),
            other => other.map(str::to_string),
        };
        let priority = match get(PRIORITY_LABEL) {
            None => 0,
            Some(text) => text
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= 100)
                .ok_or_else(|| {
                    value_error(PRIORITY_LABEL, text, "not a whole number from 0 to 100")
                })?,
        };
        Ok(Some(Self {
            gpus,
            cores,
            burst,
            memory,
            model,
            priority,
            group: group_labels(labels)?,
        }))
    }

    /// The coscheduling group the labels name, if any (checked as
    /// [`KubeShareRequest::from_labels`] checks it).
    pub fn group_from_labels(
        labels: &BTreeMap<String, String>,
    ) -> Result<Option<GroupLabels>, KubeShareError> {
        group_labels(labels)
    }
}

/// The group key (`namespace/name`) and labels of a pod, `None` if it names
/// no group, or why its group labels cannot be read.
pub fn group_of(pod: &Pod) -> Result<Option<(String, GroupLabels)>, KubeShareError> {
    let Some(labels) = pod.metadata.labels.as_ref() else {
        return Ok(None);
    };
    let Some(group) = KubeShareRequest::group_from_labels(labels)? else {
        return Ok(None);
    };
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    Ok(Some((format!("{namespace}/{}", group.name), group)))
}

/// The trimmed value of label `key`.
fn label<'a>(labels: &'a BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    labels.get(key).map(|value| value.trim())
}

fn group_labels(labels: &BTreeMap<String, String>) -> Result<Option<GroupLabels>, KubeShareError> {
    let get = |key: &str| label(labels, key);
    let name = match (get(GROUP_NAME_LABEL), get(POD_GROUP_NAME_LABEL)) {
        (Some(a), Some(b)) if a != b => {
            return Err(KubeShareError::TwoGroupNames {
                group: a.into(),
                pod_group: b.into(),
            })
        }
        (Some(""), _) | (_, Some("")) => {
            return Err(value_error(GROUP_NAME_LABEL, "", "empty; name the group"))
        }
        (Some(name), _) | (None, Some(name)) => Some(name.to_string()),
        (None, None) => None,
    };
    let headcount = get(GROUP_HEADCOUNT_LABEL);
    let threshold = get(GROUP_THRESHOLD_LABEL);
    let Some(name) = name else {
        if headcount.is_some() || threshold.is_some() {
            return Err(KubeShareError::NoGroupName);
        }
        return Ok(None);
    };
    let headcount_text = headcount.ok_or_else(|| KubeShareError::NoHeadcount(name.clone()))?;
    let headcount = headcount_text
        .parse::<u32>()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| {
            value_error(
                GROUP_HEADCOUNT_LABEL,
                headcount_text,
                "not a whole number of pods, 1 or more",
            )
        })?;
    let threshold_millionths = match threshold {
        None => ONE,
        Some(text) => {
            let value = fraction(GROUP_THRESHOLD_LABEL, text)?;
            if value == 0 || value > ONE {
                return Err(value_error(
                    GROUP_THRESHOLD_LABEL,
                    text,
                    "must be above 0 and at most 1",
                ));
            }
            value
        }
    };
    Ok(Some(GroupLabels {
        name,
        headcount,
        threshold_millionths,
    }))
}

fn value_error(label: &'static str, value: &str, reason: &'static str) -> KubeShareError {
    KubeShareError::Value {
        label,
        value: value.to_string(),
        reason,
    }
}

/// A non-negative decimal (`"0.5"`, `"2"`, `"1.0"`, `".25"`) in millionths.
fn fraction(label: &'static str, text: &str) -> Result<u64, KubeShareError> {
    let malformed = || value_error(label, text, "not a decimal number such as 0.5 or 2");
    let (whole, decimals) = text.split_once('.').unwrap_or((text, ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && decimals.is_empty()) || !digits(whole) || !digits(decimals) {
        return Err(malformed());
    }
    if decimals.len() > 6 {
        return Err(value_error(label, text, "more than 6 decimals"));
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| malformed())?
    };
    let mut millionths: u64 = 0;
    for (place, digit) in decimals.bytes().enumerate() {
        millionths += u64::from(digit - b'0') * 10u64.pow(5 - place as u32);
    }
    whole
        .checked_mul(ONE)
        .and_then(|w| w.checked_add(millionths))
        .ok_or_else(|| value_error(label, text, "too large"))
}

/// A fraction of at most 1, in whole percent, rounded up so the pod gets at
/// least what it asked for.
fn percent_up(millionths: u64) -> u32 {
    u32::try_from(millionths.div_ceil(PERCENT))
        .unwrap_or(100)
        .min(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn read(pairs: &[(&str, &str)]) -> Result<Option<KubeShareRequest>, KubeShareError> {
        KubeShareRequest::from_labels(&labels(pairs))
    }

    #[test]
    fn the_seed_pods_labels_are_half_a_gpu_bursting_to_all_of_it() {
        let request = read(&[
            (GPU_REQUEST_LABEL, "0.5"),
            (GPU_LIMIT_LABEL, "1.0"),
            (GPU_MODEL_LABEL, "NVIDIA-GeForce-GTX-1080"),
        ])
        .expect("valid")
        .expect("a KubeShare pod");
        assert_eq!(
            request,
            KubeShareRequest {
                gpus: 1,
                cores: 50,
                burst: Some(100),
                memory: KubeShareMemory::Percent(50),
                model: Some("NVIDIA-GeForce-GTX-1080".into()),
                priority: 0,
                group: None,
            }
        );
        assert!(request.opportunistic());
    }

    #[test]
    fn whole_gpus_memory_priority_and_groups() {
        let request = read(&[
            (GPU_REQUEST_LABEL, "2"),
            (GPU_MEMORY_LABEL, "1073741825"),
            (PRIORITY_LABEL, "100"),
            (GROUP_NAME_LABEL, "a"),
            (GROUP_HEADCOUNT_LABEL, "5"),
            (GROUP_THRESHOLD_LABEL, "0.6"),
        ])
        .expect("valid")
        .expect("a KubeShare pod");
        assert_eq!((request.gpus, request.cores, request.burst), (2, 100, None));
        // One byte over 1 GiB is rounded up to the next MiB.
        assert_eq!(request.memory, KubeShareMemory::Mib(1025));
        assert!(!request.opportunistic());
        let group = request.group.expect("a group");
        // 5 x 0.6 is exactly 3 (in floating point it would round up to 4).
        assert_eq!(group.quorum(), 3);
        let small = GroupLabels {
            name: "g".into(),
            headcount: 5,
            threshold_millionths: 200_000,
        };
        assert_eq!(small.quorum(), 1);
        let tiny = GroupLabels {
            name: "g".into(),
            headcount: 3,
            threshold_millionths: 1,
        };
        assert_eq!(tiny.quorum(), 1);
    }

    #[test]
    fn pod_group_name_is_the_same_label_and_fractions_round_up_to_whole_percent() {
        let request = read(&[
            (GPU_REQUEST_LABEL, "0.333"),
            (POD_GROUP_NAME_LABEL, "b"),
            (GROUP_HEADCOUNT_LABEL, "2"),
        ])
        .expect("valid")
        .expect("a KubeShare pod");
        assert_eq!(request.cores, 34);
        assert_eq!(request.group.expect("group").threshold_millionths, ONE);
        assert_eq!(read(&[("app", "x")]), Ok(None));
    }

    #[test]
    fn bad_labels_are_refused_naming_the_label() {
        let cases: [(&[(&str, &str)], &str); 14] = [
            (&[(GPU_REQUEST_LABEL, "1.5")], "whole number of GPUs"),
            (&[(GPU_REQUEST_LABEL, "0")], "above 0"),
            (&[(GPU_REQUEST_LABEL, "half")], "not a decimal"),
            (&[(GPU_REQUEST_LABEL, "-0.5")], "not a decimal"),
            (&[(GPU_REQUEST_LABEL, "0.1234567")], "6 decimals"),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), (GPU_LIMIT_LABEL, "0.4")],
                "below",
            ),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), (GPU_LIMIT_LABEL, "1.5")],
                "may not exceed 1",
            ),
            (&[(GPU_LIMIT_LABEL, "1.0")], "is missing"),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), (PRIORITY_LABEL, "101")],
                "0 to 100",
            ),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), (GPU_MEMORY_LABEL, "lots")],
                "bytes",
            ),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), ("sharedgpu/gpu_requests", "1")],
                "not one vgpu knows",
            ),
            (
                &[(GPU_REQUEST_LABEL, "0.5"), (GROUP_NAME_LABEL, "a")],
                "headcount",
            ),
            (
                &[
                    (GPU_REQUEST_LABEL, "0.5"),
                    (GROUP_NAME_LABEL, "a"),
                    (GROUP_HEADCOUNT_LABEL, "2"),
                    (GROUP_THRESHOLD_LABEL, "1.2"),
                ],
                "at most 1",
            ),
            (
                &[
                    (GPU_REQUEST_LABEL, "0.5"),
                    (GROUP_NAME_LABEL, "a"),
                    (POD_GROUP_NAME_LABEL, "b"),
                    (GROUP_HEADCOUNT_LABEL, "2"),
                ],
                "disagree",
            ),
        ];
        for (pairs, expected) in cases {
            let error = read(pairs).expect_err("refused").to_string();
            assert!(error.contains(expected), "{pairs:?}: {error}");
        }
        let error = read(&[(GPU_REQUEST_LABEL, "0.5"), (GROUP_HEADCOUNT_LABEL, "2")])
            .expect_err("no group name")
            .to_string();
        assert!(error.contains(GROUP_NAME_LABEL), "{error}");
    }
}
