//! Elastic GPU claims given to pods.
//!
//! A pod annotated `egpuc.elasticgpu.io/<container>: <claim>` gets, in that
//! container, the share its `ElasticGPUClaim` (same namespace) requests:
//! the admission webhook reads the claim and adds the vGPU resources it
//! comes to, and from there the pod goes the way of any vGPU pod. The
//! annotation names a container; in a pod of one container any name is
//! accepted (the Elastic GPU README names `test1` for a container called
//! `test-cuda`), and in a pod of several a name that matches none is
//! refused rather than guessed.
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

use crate::api::{ApiError, KubeApi};
use crate::webhook::{json_pointer_token, resource_patch};
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{json, Value};
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

/// Why a pod cannot have the claims it names.
#[derive(Debug, Error, PartialEq, Eq)]
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
    #[error(
        "container {container} asks for vGPU resources itself and names claim {claim}; use one or the other"
    )]
    AlreadyAsks { container: String, claim: String },
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

/// Reads the share a claim object (`elasticgpu.io/v1alpha1`, as JSON)
/// requests.
pub fn claim_share(name: &str, claim: &Value) -> Result<ClaimShare, ClaimError> {
    let bad = |reason: String| ClaimError::BadClaim {
        claim: name.to_string(),
        reason,
    };
    let resources = claim.pointer("/spec/resources");
    let requests = resources
        .and_then(|r| r.get("requests"))
        .filter(|r| r.as_object().is_some_and(|m| !m.is_empty()))
        .or_else(|| resources.and_then(|r| r.get("limits")))
        .and_then(Value::as_object);
    let read = |key: &str| -> Result<Option<(u64, bool)>, ClaimError> {
        let Some(value) = requests.and_then(|r| r.get(key)) else {
            return Ok(None);
        };
        let text = match value {
            Value::Number(number) => number.to_string(),
            Value::String(text) => text.clone(),
            other => return Err(bad(format!("{key} is {other}, not a quantity"))),
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

/// JSON patch operations giving each claimed container its claim's share
/// (in limits and requests, as `names` spells the resources), and the pod
/// [`USES_CLAIMS_ANNOTATION`]. `shares` holds each use's share, in order.
pub fn claim_patch(
    pod: &Pod,
    uses: &[ClaimUse],
    shares: &[ClaimShare],
    names: &ResourceNames,
) -> Result<Vec<Value>, ClaimError> {
    let mut patch = Vec::new();
    let spec = pod.spec.as_ref();
    for (use_, share) in uses.iter().zip(shares) {
        let container = spec.and_then(|spec| {
            if use_.init {
                spec.init_containers.as_ref()?.get(use_.index)
            } else {
                spec.containers.get(use_.index)
            }
        });
        let Some(container) = container else { continue };
        let resources = container.resources.as_ref();
        let mentioned = |name: &str| {
            resources.is_some_and(|r| {
                [&r.limits, &r.requests]
                    .into_iter()
                    .flatten()
                    .any(|m| m.contains_key(name))
            })
        };
        let own = [
            &names.gpu,
            &names.memory,
            &names.memory_percentage,
            &names.cores,
            &names.elastic_memory,
            &names.elastic_cores,
        ];
        if own.iter().any(|name| mentioned(name)) {
            return Err(ClaimError::AlreadyAsks {
                container: use_.container.clone(),
                claim: use_.claim.clone(),
            });
        }
        let amounts = share_amounts(share, names);
        let list = if use_.init {
            "initContainers"
        } else {
            "containers"
        };
        let base = format!("/spec/{list}/{}/resources", use_.index);
        patch.extend(resource_patch(container, &base, &amounts));
    }
    let claims: Vec<&str> = uses.iter().map(|u| u.claim.as_str()).collect();
    patch.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", json_pointer_token(USES_CLAIMS_ANNOTATION)),
        "value": claims.join(","),
    }));
    Ok(patch)
}

/// What the webhook learnt of each claim a pod names: its share, `None`
/// for a claim whose class another provisioner serves (left to it), or
/// why the pod cannot have it.
pub type ClaimAnswers = BTreeMap<String, Result<Option<ClaimShare>, String>>;

/// How long the lookups may take: the webhook's own time limit is 5 s.
const LOOK_UP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(3);

/// Looks up `claims` in `namespace`: each must exist, name a class vgpu
/// provisions (or none), request a share vgpu can give, and be held by no
/// live pod.
pub async fn look_up(api: &KubeApi, namespace: &str, claims: &[String]) -> ClaimAnswers {
    match tokio::time::timeout(LOOK_UP_PATIENCE, look_up_all(api, namespace, claims)).await {
        Ok(answers) => answers,
        Err(_) => claims
            .iter()
            .map(|name| {
                let why = format!(
                    "reading ElasticGPUClaim {namespace}/{name} took over {} s; try again",
                    LOOK_UP_PATIENCE.as_secs()
                );
                (name.clone(), Err(why))
            })
            .collect(),
    }
}

async fn look_up_all(api: &KubeApi, namespace: &str, claims: &[String]) -> ClaimAnswers {
    let pods = api.pods_in(namespace).await;
    let mut answers = ClaimAnswers::new();
    for name in claims {
        let answer = match api.get_elastic_claim(namespace, name).await {
            Err(ApiError::NotFound(_)) => Err(format!(
                "ElasticGPUClaim {name} not found in namespace {namespace}"
            )),
            Err(error) => Err(format!(
                "reading ElasticGPUClaim {namespace}/{name}: {error}"
            )),
            Ok(claim) => check_claim(api, namespace, name, &claim, &pods).await,
        };
        answers.insert(name.clone(), answer);
    }
    answers
}

async fn check_claim(
    api: &KubeApi,
    namespace: &str,
    name: &str,
    claim: &Value,
    pods: &Result<Vec<Pod>, ApiError>,
) -> Result<Option<ClaimShare>, String> {
    let class = claim
        .pointer("/spec/elasticGPUClassName")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty());
    if let Some(class) = class {
        let provisioner = match api.get_elastic_class(class).await {
            Ok(object) => object
                .get("provisioner")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            Err(ApiError::NotFound(_)) => {
                return Err(format!(
                    "ElasticGPUClaim {name}: its class {class} does not exist"
                ))
            }
            Err(error) => return Err(format!("reading ElasticGPUClass {class}: {error}")),
        };
        if provisioner != PROVISIONER {
            tracing::debug!(
                "ElasticGPUClaim {namespace}/{name}: class {class} is provisioned by {provisioner:?}; left to it"
            );
            return Ok(None);
        }
    }
    let share = claim_share(name, claim).map_err(|e| e.to_string())?;
    let pods = pods
        .as_ref()
        .map_err(|error| format!("listing the pods of namespace {namespace}: {error}"))?;
    let holder = pods.iter().find(|pod| {
        let live = pod.metadata.deletion_timestamp.is_none()
            && !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            );
        live && claims_held(pod).contains(&name)
    });
    if let Some(holder) = holder {
        return Err(format!(
            "ElasticGPUClaim {name} is in use by pod {namespace}/{}; one claim serves one pod at a time",
            holder.metadata.name.as_deref().unwrap_or_default()
        ));
    }
    Ok(Some(share))
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

    fn claim(requests: Value) -> Value {
        json!({"spec": {"elasticGPUClassName": "c", "resources": {"requests": requests}}})
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
        let limits = json!({"spec": {"resources": {"limits": {CLAIM_CORE: 5}}}});
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
    fn the_patch_gives_the_container_its_share_and_records_the_claim() {
        let names = ResourceNames::default();
        let readme = pod(
            &[("egpuc.elasticgpu.io/test1", "gpushare-egpuc-1")],
            &["test-cuda"],
            &[],
        );
        let uses = claim_uses(&readme).expect("uses");
        let share = ClaimShare {
            count: 1,
            cores: Some(10),
            memory_mib: Some(4096),
        };
        let patch = claim_patch(&readme, &uses, &[share], &names).expect("patch");
        let amounts = json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "10", "nvidia.com/gpumem": "4096"});
        assert_eq!(
            patch,
            vec![
                json!({"op": "add", "path": "/spec/containers/0/resources", "value": {}}),
                json!({"op": "add", "path": "/spec/containers/0/resources/limits", "value": amounts}),
                json!({"op": "add", "path": "/spec/containers/0/resources/requests", "value": amounts}),
                json!({"op": "add", "path": "/metadata/annotations/vgpu.io~1elasticgpu-claims", "value": "gpushare-egpuc-1"}),
            ]
        );
        // A container that asks for vGPUs itself cannot also take a claim.
        let mut asking = readme.clone();
        if let Some(spec) = asking.spec.as_mut() {
            spec.containers[0].resources = Some(
                serde_json::from_value(json!({"limits": {"nvidia.com/gpu": "1"}}))
                    .expect("resources"),
            );
        }
        let error = claim_patch(&asking, &uses, &[share], &names).expect_err("both");
        assert!(
            error.to_string().contains("use one or the other"),
            "{error}"
        );
        let mut held = readme;
        held.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(USES_CLAIMS_ANNOTATION.into(), "a, b".into());
        assert_eq!(claims_held(&held), vec!["a", "b"]);
    }
}
