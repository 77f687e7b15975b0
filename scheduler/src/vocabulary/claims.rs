//! Elastic GPU claims as pods name them and as claims ask for GPUs: the
//! annotations and request names, and pure readers of them.
//!
//! A pod annotated `egpuc.elasticgpu.io/<container>: <claim>` gets, in that
//! container, the share its `ElasticGPUClaim` (same namespace) requests:
//! the admission webhook reads the claim and adds the vGPU resources it
//! comes to ([`crate::admission::claims`]), and from there the pod goes the
//! way of any vGPU pod. The annotation names a container; in a pod of one
//! container any name is accepted (the Elastic GPU README names `test1` for
//! a container called `test-cuda`), and in a pod of several a name that
//! matches none is refused rather than guessed.
//!
//! Claim requests (`spec.resources.requests`, else `limits`):
//! `gpushare.provisioner.elasticgpu.io/gpu-core` in percent of one GPU
//! (above 100 a multiple of 100: that many whole GPUs) and
//! `/gpu-memory` in GiB when written as a plain number (the README's claim
//! asks for `4`, which as MiB could not even hold a CUDA context), or in
//! bytes when written with a unit (`512Mi`, `4Gi`).
//! One claim serves one pod at a time: the webhook records the claims a
//! pod uses in [`USES_CLAIMS_ANNOTATION`] and refuses a pod whose claim a
//! live pod holds.

use crate::vocabulary::elastic::{Amount, ClaimSpec};
use k8s_openapi::api::core::v1::{Container, Pod};
use std::collections::BTreeMap;
use thiserror::Error;
use vgpu_cluster::resources::{parse_whole_quantity, ResourceNames};

/// Pod annotations naming a claim: this prefix, then a container name.
pub const CLAIM_ANNOTATION_PREFIX: &str = "egpuc.elasticgpu.io/";
/// The provisioner vgpu serves claims for.
pub const PROVISIONER: &str = "gpushare.provisioner.elasticgpu.io";
/// A claim's compute request, percent of one GPU.
pub const CLAIM_CORE: &str = "gpushare.provisioner.elasticgpu.io/gpu-core";
/// A claim's memory request.
pub const CLAIM_MEMORY: &str = "gpushare.provisioner.elasticgpu.io/gpu-memory";
/// Set by the webhook on a pod that uses claims: their names, comma
/// separated (the claims live in the pod's namespace).
pub const USES_CLAIMS_ANNOTATION: &str = "vgpu.io/elasticgpu-claims";

/// The most GPUs a claim may ask for.
const MAX_CLAIM_GPUS: u64 = 16;

/// Why a pod cannot have the claims it names, or a claim cannot be read.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ClaimError {
    #[error("annotation {annotation}: no claim named")]
    NoClaimNamed { annotation: String },
    #[error(
        "annotation {annotation} names no container of this pod, which has {count} ({names}): name one of them"
    )]
    NoSuchContainer {
        annotation: String,
        count: usize,
        names: String,
    },
    #[error("container {container} is named by two claim annotations ({first}, {second})")]
    ContainerClaimedTwice {
        container: String,
        first: String,
        second: String,
    },
    #[error(
        "claim {claim} is named by two annotations of this pod; one claim serves one container"
    )]
    ClaimNamedTwice { claim: String },
    #[error("ElasticGPUClaim {claim}: {reason}")]
    BadClaim { claim: String, reason: String },
}

/// A claim named by a pod, with the container it is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimUse {
    pub annotation: String,
    pub claim: String,
    /// Where the container is: init container or not, and its index.
    pub init: bool,
    pub index: usize,
    pub container: String,
}

/// The share a claim comes to, in the resources vgpu reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimShare {
    /// GPUs (each whole above 1).
    pub count: u64,
    /// Compute per GPU in percent; `None`: not asked (the default applies).
    pub cores: Option<u64>,
    /// Memory per GPU in MiB; `None`: not asked (the default applies).
    pub memory_mib: Option<u64>,
}

/// The claims `pod` names, each with its container; refuses what is
/// ambiguous or contradictory. Empty when it names none.
pub fn claim_uses(pod: &Pod) -> Result<Vec<ClaimUse>, ClaimError> {
    let Some(annotations) = &pod.metadata.annotations else {
        return Ok(Vec::new());
    };
    let named: Vec<(&String, &String)> = annotations
        .iter()
        .filter(|(key, _)| key.starts_with(CLAIM_ANNOTATION_PREFIX))
        .collect();
    if named.is_empty() {
        return Ok(Vec::new());
    }
    let spec = pod.spec.as_ref();
    let containers: Vec<(bool, usize, &Container)> = spec
        .map(|spec| {
            let init = spec.init_containers.iter().flatten().enumerate();
            let app = spec.containers.iter().enumerate();
            init.map(|(i, c)| (true, i, c))
                .chain(app.map(|(i, c)| (false, i, c)))
                .collect()
        })
        .unwrap_or_default();
    let apps: Vec<&(bool, usize, &Container)> =
        containers.iter().filter(|(init, _, _)| !init).collect();
    let mut uses: Vec<ClaimUse> = Vec::with_capacity(named.len());
    for (annotation, claim) in named {
        let claim = claim.trim();
        if claim.is_empty() {
            return Err(ClaimError::NoClaimNamed {
                annotation: annotation.clone(),
            });
        }
        let wanted = &annotation[CLAIM_ANNOTATION_PREFIX.len()..];
        let found =
            containers
                .iter()
                .find(|(_, _, c)| c.name == wanted)
                .or(match apps.as_slice() {
                    [only] if containers.len() == 1 => Some(*only),
                    _ => None,
                });
        let Some(&(init, index, container)) = found else {
            let names: Vec<&str> = containers.iter().map(|(_, _, c)| c.name.as_str()).collect();
            return Err(ClaimError::NoSuchContainer {
                annotation: annotation.clone(),
                count: names.len(),
                names: names.join(", "),
            });
        };
        if uses.iter().any(|u| u.claim == claim) {
            return Err(ClaimError::ClaimNamedTwice {
                claim: claim.to_string(),
            });
        }
        if let Some(earlier) = uses.iter().find(|u| u.init == init && u.index == index) {
            return Err(ClaimError::ContainerClaimedTwice {
                container: container.name.clone(),
                first: earlier.annotation.clone(),
                second: annotation.clone(),
            });
        }
        uses.push(ClaimUse {
            annotation: annotation.clone(),
            claim: claim.to_string(),
            init,
            index,
            container: container.name.clone(),
        });
    }
    Ok(uses)
}

/// Reads the share a claim (its spec, in `elasticgpu.io/v1alpha1`)
/// requests.
pub fn claim_share(name: &str, spec: &ClaimSpec) -> Result<ClaimShare, ClaimError> {
    let bad = |reason: String| ClaimError::BadClaim {
        claim: name.to_string(),
        reason,
    };
    let resources = spec.resources.as_ref();
    let requests = resources
        .and_then(|r| r.requests.as_ref())
        .filter(|requests| !requests.is_empty())
        .or_else(|| resources.and_then(|r| r.limits.as_ref()));
    let read = |key: &str| -> Result<Option<(u64, bool)>, ClaimError> {
        let Some(amount) = requests.and_then(|r| r.get(key)) else {
            return Ok(None);
        };
        let text = match amount {
            Amount::Number(number) => number.to_string(),
            Amount::Text(text) => text.clone(),
            Amount::Other(other) => return Err(bad(format!("{key} is {other}, not a quantity"))),
        };
        let plain = text.trim().bytes().all(|b| b.is_ascii_digit());
        parse_whole_quantity(&text)
            .map(|amount| Some((amount, plain)))
            .map_err(|error| bad(format!("{key}: {error}")))
    };
    let cores = read(CLAIM_CORE)?
        .map(|(amount, _)| amount)
        .filter(|&c| c > 0);
    let memory = read(CLAIM_MEMORY)?.filter(|&(amount, _)| amount > 0);
    if cores.is_none() && memory.is_none() {
        return Err(bad(format!(
            "requests neither {CLAIM_CORE} nor {CLAIM_MEMORY}"
        )));
    }
    let memory_mib = match memory {
        None => None,
        Some((gib, true)) => Some(
            gib.checked_mul(1024)
                .ok_or_else(|| bad(format!("{CLAIM_MEMORY} {gib} GiB is too large")))?,
        ),
        Some((bytes, false)) => {
            if bytes % (1 << 20) != 0 {
                return Err(bad(format!(
                    "{CLAIM_MEMORY} must be whole MiB ({bytes} bytes is not)"
                )));
            }
            Some(bytes >> 20)
        }
    };
    match cores {
        Some(c) if c > 100 => {
            if c % 100 != 0 {
                return Err(bad(format!(
                    "{CLAIM_CORE} {c}: above 100 it must be a multiple of 100 (whole GPUs)"
                )));
            }
            if c / 100 > MAX_CLAIM_GPUS {
                return Err(bad(format!(
                    "{CLAIM_CORE} {c}: at most {MAX_CLAIM_GPUS} GPUs"
                )));
            }
            if memory_mib.is_some() {
                return Err(bad(format!(
                    "{CLAIM_CORE} {c} asks for whole GPUs, which come with all their memory; leave {CLAIM_MEMORY} out"
                )));
            }
            Ok(ClaimShare {
                count: c / 100,
                cores: Some(100),
                memory_mib: None,
            })
        }
        cores => Ok(ClaimShare {
            count: 1,
            cores,
            memory_mib,
        }),
    }
}

/// The vGPU resources (as `names` spells them) a container holding a claim
/// of `share` asks for: what the webhook writes into the container, and
/// what the claim controller places when it provisions the claim.
pub fn share_amounts(share: &ClaimShare, names: &ResourceNames) -> BTreeMap<String, String> {
    let mut amounts = BTreeMap::new();
    amounts.insert(names.gpu.clone(), share.count.to_string());
    if let Some(cores) = share.cores {
        amounts.insert(names.cores.clone(), cores.to_string());
    }
    if let Some(mib) = share.memory_mib {
        amounts.insert(names.memory.clone(), mib.to_string());
    }
    amounts
}

/// A claim as the extender's state names it: `namespace/name`.
pub fn claim_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The claims a pod holds, as [`claim_key`]s.
pub fn claim_keys_held(pod: &Pod) -> Vec<String> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("");
    claims_held(pod)
        .into_iter()
        .map(|claim| claim_key(namespace, claim))
        .collect()
}

/// The claims a pod holds, as the webhook recorded them.
pub fn claims_held(pod: &Pod) -> Vec<&str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(USES_CLAIMS_ANNOTATION))
        .map(|text| {
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn pod(annotations: &[(&str, &str)], containers: &[&str], init: &[&str]) -> Pod {
        let list = |names: &[&str]| -> Vec<Value> {
            names
                .iter()
                .map(|n| json!({"name": n, "image": "cuda"}))
                .collect()
        };
        let mut spec = json!({"containers": list(containers)});
        if !init.is_empty() {
            spec["initContainers"] = json!(list(init));
        }
        let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "annotations": annotations},
            "spec": spec,
        }))
        .expect("pod")
    }

    fn claim(requests: Value) -> ClaimSpec {
        serde_json::from_value(
            json!({"elasticGPUClassName": "c", "resources": {"requests": requests}}),
        )
        .expect("a claim's spec")
    }

    #[test]
    fn the_annotation_names_a_container_or_the_only_one() {
        // The README's pod: annotation test1, container test-cuda.
        let readme = pod(
            &[("egpuc.elasticgpu.io/test1", "gpushare-egpuc-1")],
            &["test-cuda"],
            &[],
        );
        let uses = claim_uses(&readme).expect("uses");
        assert_eq!(
            (
                uses[0].claim.as_str(),
                uses[0].container.as_str(),
                uses[0].init,
                uses[0].index
            ),
            ("gpushare-egpuc-1", "test-cuda", false, 0)
        );
        let two = pod(
            &[
                ("egpuc.elasticgpu.io/b", "one"),
                ("egpuc.elasticgpu.io/warm", "two"),
            ],
            &["a", "b"],
            &["warm"],
        );
        let uses = claim_uses(&two).expect("uses");
        assert_eq!(
            uses.iter()
                .map(|u| (u.container.as_str(), u.init, u.index))
                .collect::<Vec<_>>(),
            vec![("b", false, 1), ("warm", true, 0)]
        );
        assert!(claim_uses(&pod(&[], &["a"], &[])).expect("none").is_empty());
    }

    type RefusalCase<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);

    #[test]
    fn ambiguity_and_contradictions_are_refused_in_words() {
        let cases: &[RefusalCase] = &[
            (
                &[("egpuc.elasticgpu.io/test1", "c1")],
                &["a", "b"],
                "names no container of this pod, which has 2 (a, b)",
            ),
            (&[("egpuc.elasticgpu.io/a", " ")], &["a"], "no claim named"),
            (
                &[
                    ("egpuc.elasticgpu.io/a", "c1"),
                    ("egpuc.elasticgpu.io/b", "c1"),
                ],
                &["a", "b"],
                "named by two annotations",
            ),
        ];
        for (annotations, containers, words) in cases {
            let error = claim_uses(&pod(annotations, containers, &[])).expect_err(words);
            assert!(error.to_string().contains(words), "{error}");
        }
    }

    #[test]
    fn claim_requests_come_to_a_share() {
        let cases = [
            // The README's claim: 10 % and 4 GiB.
            (
                json!({CLAIM_CORE: 10, CLAIM_MEMORY: 4}),
                ClaimShare {
                    count: 1,
                    cores: Some(10),
                    memory_mib: Some(4096),
                },
            ),
            (
                json!({CLAIM_CORE: "30", CLAIM_MEMORY: "512Mi"}),
                ClaimShare {
                    count: 1,
                    cores: Some(30),
                    memory_mib: Some(512),
                },
            ),
            (
                json!({CLAIM_MEMORY: "2"}),
                ClaimShare {
                    count: 1,
                    cores: None,
                    memory_mib: Some(2048),
                },
            ),
            (
                json!({CLAIM_CORE: 200}),
                ClaimShare {
                    count: 2,
                    cores: Some(100),
                    memory_mib: None,
                },
            ),
        ];
        for (requests, expected) in cases {
            assert_eq!(
                claim_share("c", &claim(requests.clone())),
                Ok(expected),
                "{requests}"
            );
        }
        // Limits serve when there are no requests.
        let limits: ClaimSpec =
            serde_json::from_value(json!({"resources": {"limits": {CLAIM_CORE: 5}}}))
                .expect("a claim's spec");
        assert_eq!(claim_share("c", &limits).expect("limits").cores, Some(5));
        for (requests, words) in [
            (json!({}), "requests neither"),
            (json!({CLAIM_CORE: 150}), "multiple of 100"),
            (json!({CLAIM_CORE: 200, CLAIM_MEMORY: 4}), "leave"),
            (json!({CLAIM_MEMORY: "1.5"}), "whole number"),
            (json!({CLAIM_MEMORY: "100k"}), "whole MiB"),
            (json!({CLAIM_CORE: [1]}), "not a quantity"),
            (json!({CLAIM_CORE: 2000}), "at most 16 GPUs"),
        ] {
            let error = claim_share("c", &claim(requests.clone())).expect_err(words);
            assert!(error.to_string().contains(words), "{requests}: {error}");
            assert!(
                error.to_string().starts_with("ElasticGPUClaim c: "),
                "{error}"
            );
        }
    }

    #[test]
    fn the_claims_a_pod_holds_are_read_from_its_annotation() {
        let mut held = pod(&[], &["a"], &[]);
        held.metadata.namespace = Some("ns".into());
        held.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(USES_CLAIMS_ANNOTATION.into(), "a, b,".into());
        assert_eq!(claims_held(&held), vec!["a", "b"]);
        assert_eq!(claim_keys_held(&held), vec!["ns/a", "ns/b"]);
        assert!(claim_keys_held(&pod(&[], &["a"], &[])).is_empty());
    }
}
