//! Changing a running pod's share and memory cap: the user's request, the
//! extender's answer, and the decision they lead to.
//!
//! The user annotates the pod `vgpu.io/resize: cores=20,memory=4Gi` (either
//! or both; per vGPU, for each of the pod's vGPU containers; an optional
//! `asked=<unix ms>` changes nothing but makes a request asked again, after
//! a refusal, a new one). The request is
//! only a request: the extender alone writes the new decision (the
//! admission policy keeps `vgpu.io/decision` its own), after checking the
//! room on the pod's GPUs and that the pod asked for at least as much (a
//! pod is resized within its request, so every bound on a decision, the
//! device plugin's and the monitor's, holds as before). It answers in
//! `vgpu.io/resize-status` (JSON: the request it answers, applied or
//! refused, and why) and in an Event. The node monitor then writes the new
//! limits into the containers' regions, and the shim applies them at once:
//! a lower cap refuses new allocations and frees nothing.

use crate::decision::{Decision, DeviceGrant};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;
use vgpu_node_contract::size::{human_bytes, parse_percent, parse_size};

/// Pod annotation: the user's request.
pub const RESIZE_ANNOTATION: &str = "vgpu.io/resize";
/// Pod annotation: the extender's answer to the request it names.
pub const RESIZE_STATUS_ANNOTATION: &str = "vgpu.io/resize-status";

/// A request that cannot be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ResizeError {
    #[error("{RESIZE_ANNOTATION}: {0:?} is not key=value (cores=20,memory=4Gi)")]
    NotKeyValue(String),
    #[error("{RESIZE_ANNOTATION}: unknown key {0:?} (cores, memory)")]
    UnknownKey(String),
    #[error("{RESIZE_ANNOTATION}: {0} given twice")]
    Twice(&'static str),
    #[error("{RESIZE_ANNOTATION}: cores {0:?} is not a percentage from 1 to 100")]
    Cores(String),
    #[error(
        "{RESIZE_ANNOTATION}: memory {0:?} is not a size with a unit, at least 1Mi (4Gi, 4096Mi)"
    )]
    Memory(String),
    #[error("{RESIZE_ANNOTATION}: names neither cores nor memory (cores=20,memory=4Gi)")]
    Empty,
    #[error("{RESIZE_ANNOTATION}: asked {0:?} is not a time in milliseconds")]
    Asked(String),
}

/// What the user asks each vGPU of the pod to become.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResizeRequest {
    pub cores: Option<u32>,
    pub memory_bytes: Option<u64>,
}

impl ResizeRequest {
    pub fn parse(text: &str) -> Result<Self, ResizeError> {
        let mut request = Self::default();
        for item in text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
        {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| ResizeError::NotKeyValue(item.to_string()))?;
            let value = value.trim();
            match key.trim() {
                "cores" => {
                    if request.cores.is_some() {
                        return Err(ResizeError::Twice("cores"));
                    }
                    let cores = parse_percent(value)
                        .ok()
                        .filter(|&cores| cores >= 1)
                        .ok_or_else(|| ResizeError::Cores(value.to_string()))?;
                    request.cores = Some(cores);
                }
                "memory" => {
                    if request.memory_bytes.is_some() {
                        return Err(ResizeError::Twice("memory"));
                    }
                    // A bare number would be bytes: surely not what was meant.
                    let has_unit = value.ends_with(|c: char| c.is_ascii_alphabetic());
                    let bytes = parse_size(value)
                        .ok()
                        .filter(|&bytes| has_unit && bytes >= 1 << 20)
                        .ok_or_else(|| ResizeError::Memory(value.to_string()))?;
                    request.memory_bytes = Some(bytes);
                }
                // When it was asked: only makes the text new.
                "asked" => {
                    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(ResizeError::Asked(value.to_string()));
                    }
                }
                other => return Err(ResizeError::UnknownKey(other.to_string())),
            }
        }
        if request.cores.is_none() && request.memory_bytes.is_none() {
            return Err(ResizeError::Empty);
        }
        Ok(request)
    }

    /// `decision` with every vGPU of its regular containers resized (init
    /// containers have run and gone), dated `now_unix_ms`. A burst below
    /// the new share is raised to it.
    pub fn apply(&self, decision: &Decision, now_unix_ms: u64) -> Decision {
        let mut resized = decision.clone();
        resized.decided_unix_ms = now_unix_ms;
        for container in resized.containers.iter_mut().filter(|c| !c.init) {
            for grant in &mut container.devices {
                self.apply_to(grant);
            }
        }
        resized
    }

    fn apply_to(&self, grant: &mut DeviceGrant) {
        if let Some(cores) = self.cores {
            grant.cores_percent = cores;
            if let Some(burst) = grant.burst_percent.as_mut() {
                *burst = (*burst).max(cores);
            }
        }
        if let Some(bytes) = self.memory_bytes {
            grant.memory_bytes = bytes;
        }
    }

    /// The request in words, for logs and Events.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(cores) = self.cores {
            parts.push(format!("{cores} % compute"));
        }
        if let Some(bytes) = self.memory_bytes {
            parts.push(format!("{} memory", human_bytes(bytes)));
        }
        parts.join(" and ")
    }
}

/// How a request was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Applied,
    Refused,
}

/// The extender's answer, as the status annotation holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResizeStatus {
    /// The request answered, as the user wrote it.
    pub request: String,
    pub outcome: Outcome,
    /// Why, in words: what was applied, or what stood in the way.
    pub message: String,
    pub answered_unix_ms: u64,
}

impl ResizeStatus {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The request a pod's annotations make that no status answers yet.
pub fn unanswered(annotations: Option<&BTreeMap<String, String>>) -> Option<&str> {
    let annotations = annotations?;
    let request = annotations.get(RESIZE_ANNOTATION)?;
    let answered = annotations
        .get(RESIZE_STATUS_ANNOTATION)
        .and_then(|text| serde_json::from_str::<ResizeStatus>(text).ok())
        .is_some_and(|status| status.request == *request);
    (!answered).then_some(request.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::ContainerDecision;

    #[test]
    fn requests_are_read_strictly() {
        assert_eq!(
            ResizeRequest::parse("cores=20, memory=4Gi"),
            Ok(ResizeRequest {
                cores: Some(20),
                memory_bytes: Some(4 << 30)
            })
        );
        assert_eq!(
            ResizeRequest::parse("memory=512Mi").map(|r| r.memory_bytes),
            Ok(Some(512 << 20))
        );
        assert_eq!(
            ResizeRequest::parse("cores=20,asked=1764201600000"),
            ResizeRequest::parse("cores=20")
        );
        for (text, error) in [
            ("", ResizeError::Empty),
            ("cores", ResizeError::NotKeyValue("cores".into())),
            ("gpus=2", ResizeError::UnknownKey("gpus".into())),
            ("cores=0", ResizeError::Cores("0".into())),
            ("cores=101", ResizeError::Cores("101".into())),
            ("cores=-5", ResizeError::Cores("-5".into())),
            ("memory=4096", ResizeError::Memory("4096".into())),
            ("memory=1k", ResizeError::Memory("1k".into())),
            ("memory=lots", ResizeError::Memory("lots".into())),
            ("cores=20,cores=30", ResizeError::Twice("cores")),
            ("cores=20,asked=soon", ResizeError::Asked("soon".into())),
        ] {
            assert_eq!(ResizeRequest::parse(text), Err(error), "{text:?}");
        }
    }

    fn grant(cores: u32, burst: Option<u32>) -> DeviceGrant {
        DeviceGrant {
            uuid: "GPU-a".into(),
            memory_bytes: 8 << 30,
            cores_percent: cores,
            burst_percent: burst,
        }
    }

    #[test]
    fn a_request_resizes_every_regular_container_and_raises_a_lower_burst() {
        let decision = Decision {
            version: 1,
            node: "n1".into(),
            decided_unix_ms: 1,
            containers: vec![
                ContainerDecision {
                    name: "setup".into(),
                    init: true,
                    devices: vec![grant(50, None)],
                    priority: None,
                },
                ContainerDecision {
                    name: "main".into(),
                    init: false,
                    devices: vec![grant(50, Some(60))],
                    priority: Some(1),
                },
            ],
        };
        let request = ResizeRequest::parse("cores=70,memory=4Gi").expect("valid");
        let resized = request.apply(&decision, 99);
        assert_eq!(resized.decided_unix_ms, 99);
        assert_eq!(
            resized.containers[0], decision.containers[0],
            "init untouched"
        );
        let main = &resized.containers[1].devices[0];
        assert_eq!(
            (main.cores_percent, main.burst_percent, main.memory_bytes),
            (70, Some(70), 4 << 30)
        );
        assert_eq!(request.describe(), "70 % compute and 4 GiB memory");
    }

    #[test]
    fn a_request_is_unanswered_until_a_status_names_it() {
        let mut annotations = BTreeMap::new();
        assert_eq!(unanswered(Some(&annotations)), None);
        annotations.insert(RESIZE_ANNOTATION.to_string(), "cores=20".to_string());
        assert_eq!(unanswered(Some(&annotations)), Some("cores=20"));
        let status = ResizeStatus {
            request: "cores=20".into(),
            outcome: Outcome::Applied,
            message: String::new(),
            answered_unix_ms: 5,
        };
        annotations.insert(RESIZE_STATUS_ANNOTATION.to_string(), status.to_json());
        assert_eq!(unanswered(Some(&annotations)), None);
        annotations.insert(RESIZE_ANNOTATION.to_string(), "cores=30".to_string());
        assert_eq!(unanswered(Some(&annotations)), Some("cores=30"));
        annotations.insert(RESIZE_STATUS_ANNOTATION.to_string(), "garbage".to_string());
        assert_eq!(unanswered(Some(&annotations)), Some("cores=30"));
    }
}
