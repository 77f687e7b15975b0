//! The mutating admission webhook: points pods that ask for vGPUs at the
//! vgpu scheduler.
//!
//! Pod specs written for HAMi do not name a scheduler; without this
//! webhook kube-scheduler's default profile would place them, no decision
//! would be recorded, and the device plugin would refuse them at admission.
//! For a pod being created that asks for one of the vGPU resources in any
//! container (init containers too) and names no scheduler, or the default
//! one, the webhook answers with a JSON patch that sets
//! `spec.schedulerName`.
//!
//! A container that asks only for Elastic GPU resources is given the GPU
//! count they come to, and one named by an Elastic GPU claim annotation the
//! claim's share ([`crate::admission::claims`]); a pod whose claims cannot be given is
//! refused, saying why.
//!
//! A privileged container that asks for vGPUs is refused (unless the
//! extender runs with `--allow-privileged-vgpu`): it sees every GPU of its
//! node and can reach them bypassing the shim, so no cap or share would
//! hold it. So is one running seccomp `Unconfined`, and one with no seccomp
//! profile is given the runtime's default ([`crate::admission::seccomp`]):
//! without one, a user namespace takes the shim away. Everything else is allowed unchanged (a pod it cannot read is
//! let through as it is), so a webhook outage cannot stop a cluster's
//! other workloads.

use crate::admission::claims::{claim_patch, ClaimPatchError};
use crate::admission::confinement::{refused_at_admission, VgpuContainers};
use crate::admission::kubeshare::kubeshare_patch;
use crate::admission::look_up::{ClaimAnswers, ClaimLookUpError};
use crate::admission::patch::resource_patch;
use crate::admission::quota::{quota_refusal, AdmissionQuota};
use crate::admission::reach::GuardedPaths;
use crate::admission::review::{Review, WebhookReply};
use crate::admission::seccomp::runtime_default_patch;
use crate::bounded::read_pod;
use crate::vocabulary::claims::{claim_uses, ClaimError, ClaimShare, CLAIM_ANNOTATION_PREFIX};
use crate::vocabulary::kubeshare::KubeShareError;
use base64::Engine;
use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use thiserror::Error;
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::priority::HighPriorityClasses;
use vgpu_cluster::requests::{
    asks_for_vgpu, elastic_count_to_add, parse_pod, RequestDefaults, ResourceNames,
};

/// The scheduler name kube-scheduler uses when a pod names none.
const DEFAULT_SCHEDULER: &str = "default-scheduler";

#[derive(Debug, Deserialize)]
struct ReviewRequest {
    uid: String,
    operation: Option<String>,
    namespace: Option<String>,
    /// The pod, parsed once its shape is checked ([`read_pod`]).
    object: Option<Box<RawValue>>,
}

#[derive(Debug, Serialize)]
struct ReviewResponse {
    uid: String,
    allowed: bool,
    #[serde(rename = "patchType", skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(rename = "warnings", skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Value>,
}

/// What the webhook does beyond pointing pods at the vgpu scheduler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdmissionPolicy {
    /// Let privileged containers ask for vGPUs.
    pub allow_privileged: bool,
    /// Another scheduler name (KubeShare's) whose pods are given ours.
    pub scheduler_alias: Option<String>,
    /// The PriorityClass (name, value) opportunistic pods are given.
    pub opportunistic_class: Option<(String, i32)>,
    /// The node's paths no pod given vGPUs may mount.
    pub guarded_paths: GuardedPaths,
    /// The PriorityClasses whose pods may run vGPU containers above the
    /// default priority ([`vgpu_cluster::requests::priority`]); admission
    /// warns any other pod that asks to.
    pub high_priority_classes: HighPriorityClasses,
}

/// Why a pod being created is refused (422, with this as the message).
#[derive(Debug, Error)]
enum Refusal {
    #[error(transparent)]
    Claims(#[from] ClaimError),
    #[error(transparent)]
    ClaimPatch(#[from] ClaimPatchError),
    #[error(transparent)]
    LookUp(#[from] ClaimLookUpError),
    #[error("ElasticGPUClaim {0} was not looked up")]
    NotLookedUp(String),
    #[error(transparent)]
    KubeShare(#[from] KubeShareError),
}

/// The namespace of a pod being created and the Elastic GPU claims it
/// names in its `egpuc.elasticgpu.io/<container>` annotations, for the
/// caller to look up (the claims, the namespace's quota) before
/// [`mutate`]; `None` when the body is no pod creation.
pub fn to_look_up(body: &[u8]) -> Option<(String, Vec<String>)> {
    let review: Review<ReviewRequest> = serde_json::from_slice(body).ok()?;
    let request = review.request?;
    if !matches!(request.operation.as_deref(), None | Some("CREATE")) {
        return None;
    }
    let pod = read_pod(request.object?.get()).ok()?;
    let mut claims: Vec<String> = pod
        .metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(key, _)| key.starts_with(CLAIM_ANNOTATION_PREFIX))
        .map(|(_, claim)| claim.trim().to_string())
        .filter(|claim| !claim.is_empty())
        .collect();
    claims.sort();
    claims.dedup();
    let namespace = request
        .namespace
        .or(pod.metadata.namespace)
        .unwrap_or_else(|| "default".into());
    Some((namespace, claims))
}

/// Answers one `AdmissionReview` for pods. `scheduler_name` is the name
/// vGPU pods are given; `names` are the resources that make a pod a vGPU
/// pod; `claims` what was learnt of the Elastic GPU claims the pod names
/// ([`to_look_up`]); `quota` what the pod's namespace holds, when a
/// quota limits its vGPU resources.
pub fn mutate(
    body: &[u8],
    scheduler_name: &str,
    names: &ResourceNames,
    policy: &AdmissionPolicy,
    claims: &ClaimAnswers,
    quota: Option<&AdmissionQuota>,
) -> WebhookReply {
    let (api_version, request) = match Review::<ReviewRequest>::read(body, "AdmissionReview") {
        Ok(read) => read,
        Err(reply) => return reply,
    };
    let api_version = api_version.unwrap_or_else(|| "admission.k8s.io/v1".into());
    let mut response = ReviewResponse {
        uid: request.uid,
        allowed: true,
        patch_type: None,
        patch: None,
        warnings: Vec::new(),
        status: None,
    };
    let creating = matches!(request.operation.as_deref(), None | Some("CREATE"));
    let pod = request
        .object
        .map(|object| read_pod(object.get()))
        .transpose();
    let refused = match &pod {
        Ok(Some(pod)) if creating && !policy.allow_privileged => {
            refused_at_admission(pod, names, &policy.guarded_paths).map(|breach| breach.to_string())
        }
        _ => None,
    };
    let over_quota = match (&pod, quota) {
        (Ok(Some(pod)), Some(quota)) if creating => quota_refusal(pod, names, quota),
        _ => None,
    };
    let forbidden = over_quota
        .map(|reason| format!("exceeded quota: {reason}"))
        .or_else(|| {
            refused.map(|reason| {
                format!("{reason} (or install vgpu with scheduler.webhook.allowPrivileged=true to accept this)")
            })
        });
    if let Some(message) = forbidden {
        tracing::info!("admission review {}: refused: {message}", response.uid);
        response.allowed = false;
        response.status = Some(json!({
            "code": 403,
            "reason": "Forbidden",
            "message": message,
        }));
        return reply(&api_version, &response);
    }
    match pod {
        Ok(Some(pod)) if creating => {
            let class = policy
                .opportunistic_class
                .as_ref()
                .map(|(name, value)| (name.as_str(), *value));
            let read = claimed_shares(&pod, names, claims).and_then(|claimed| {
                let kubeshare = kubeshare_patch(&pod, names, class, !claimed.is_empty())?;
                Ok((claimed, kubeshare))
            });
            let (claimed, kubeshare) = match read {
                Ok(read) => read,
                Err(refusal) => {
                    let message = with_causes(&refusal);
                    tracing::info!("admission review {}: refused: {message}", response.uid);
                    response.allowed = false;
                    response.status = Some(json!({
                        "code": 422,
                        "reason": "Invalid",
                        "message": message,
                    }));
                    return reply(&api_version, &response);
                }
            };
            let mut patch = elastic_device_counts(&pod, names);
            let uses_claims = !claimed.is_empty();
            patch.extend(claimed);
            let labelled = kubeshare.is_some();
            if let Some((kubeshare, warning)) = kubeshare {
                patch.extend(kubeshare);
                response.warnings.extend(warning);
            }
            // Where the pod asks to run above the default priority and may
            // not, it is placed at the default: said now, and again by an
            // Event when it is bound.
            let lowered = parse_pod(&pod, names, &RequestDefaults::default())
                .ok()
                .and_then(|request| {
                    policy
                        .high_priority_classes
                        .lowered(&request, &names.priority)
                });
            response.warnings.extend(lowered);
            let aliased = policy.scheduler_alias.is_some()
                && pod.spec.as_ref().is_some_and(|spec| {
                    spec.node_name.is_none()
                        && spec.scheduler_name.as_deref() == policy.scheduler_alias.as_deref()
                });
            if needs_vgpu_scheduler(&pod, names)
                || aliased
                || ((uses_claims || labelled) && unscheduled_for_default(&pod))
            {
                patch.push(json!({
                    "op": "add",
                    "path": "/spec/schedulerName",
                    "value": scheduler_name,
                }));
            }
            if !policy.allow_privileged {
                let given = VgpuContainers::of(&pod, names);
                patch.extend(runtime_default_patch(&pod, |c| given.contains(c)));
            }
            if !patch.is_empty() {
                response.patch_type = Some("JSONPatch");
                response.patch = Some(
                    base64::engine::general_purpose::STANDARD
                        .encode(Value::from(patch).to_string()),
                );
            }
        }
        Ok(_) => {}
        // A pod too large to read safely could hide a privileged vGPU
        // container: refused rather than let through unread.
        Err(error) if error.too_large() => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "admission review {}: refused",
                response.uid
            );
            response.allowed = false;
            response.status = Some(json!({
                "code": 413,
                "reason": "RequestEntityTooLarge",
                "message": format!("vgpu webhook: {error}"),
            }));
        }
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "admission review {}: unreadable pod",
                response.uid
            );
            response
                .warnings
                .push(format!("vgpu webhook could not read the pod: {error}"));
        }
    }
    reply(&api_version, &response)
}

fn reply(api_version: &str, response: &ReviewResponse) -> WebhookReply {
    let body = json!({
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "response": response,
    });
    WebhookReply {
        status: 200,
        body: body.to_string().into_bytes(),
    }
}

/// The patch giving the pod's claimed containers their claims' shares
/// (empty when it names no claim), or why the pod cannot have them.
fn claimed_shares(
    pod: &Pod,
    names: &ResourceNames,
    claims: &ClaimAnswers,
) -> Result<Vec<Value>, Refusal> {
    let uses = claim_uses(pod)?;
    // Claims of classes another provisioner serves are left to it.
    let mut ours = Vec::with_capacity(uses.len());
    let mut shares: Vec<ClaimShare> = Vec::with_capacity(uses.len());
    for claim_use in uses {
        match claims.get(&claim_use.claim) {
            Some(Ok(Some(share))) => {
                shares.push(*share);
                ours.push(claim_use);
            }
            Some(Ok(None)) => {}
            Some(Err(why)) => return Err(why.clone().into()),
            None => return Err(Refusal::NotLookedUp(claim_use.claim)),
        }
    }
    if ours.is_empty() {
        return Ok(Vec::new());
    }
    Ok(claim_patch(pod, &ours, &shares, names)?)
}

/// JSON patch operations adding the GPU count to every container that asks
/// only for Elastic GPU resources: kubelet calls a device plugin's
/// `Allocate` only for a resource the plugin offers, and vgpu's plugin
/// offers the GPU count. The count goes into limits and requests alike
/// (an extended resource's request must equal its limit).
fn elastic_device_counts(pod: &Pod, names: &ResourceNames) -> Vec<Value> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let mut patch = Vec::new();
    let lists = [
        ("containers", spec.containers.as_slice()),
        (
            "initContainers",
            spec.init_containers.as_deref().unwrap_or_default(),
        ),
    ];
    for (list, containers) in lists {
        for (index, container) in containers.iter().enumerate() {
            let Some(count) = elastic_count_to_add(container, names) else {
                continue;
            };
            let amounts =
                std::collections::BTreeMap::from([(names.gpu.clone(), count.to_string())]);
            let base = format!("/spec/{list}/{index}/resources");
            patch.extend(resource_patch(container, &base, &amounts));
        }
    }
    patch
}

/// Whether `pod` asks for a vGPU, is not bound yet, and names no scheduler
/// or the default one.
fn needs_vgpu_scheduler(pod: &Pod, names: &ResourceNames) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    let asks = |container: &Container| asks_for_vgpu(container, names);
    unscheduled_for_default(pod)
        && (spec.containers.iter().any(asks) || spec.init_containers.iter().flatten().any(asks))
}

/// Whether `pod` is not bound yet and names no scheduler or the default one.
fn unscheduled_for_default(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    let default_scheduler = match spec.scheduler_name.as_deref() {
        None | Some("") | Some(DEFAULT_SCHEDULER) => true,
        Some(_) => false,
    };
    spec.node_name.is_none() && default_scheduler
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(pod: Value) -> Vec<u8> {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE",
                "object": pod,
            }
        })
        .to_string()
        .into_bytes()
    }

    fn pod(limits: Value, scheduler: Option<&str>) -> Value {
        // With a seccomp profile already, so that only what a test is about
        // is patched (seccomp: `seccomp_is_defaulted_for_vgpu_containers`).
        let mut spec = json!({
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}]
        });
        if let Some(name) = scheduler {
            spec["schedulerName"] = json!(name);
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec})
    }

    fn answer(body: &[u8]) -> Value {
        let reply = mutate(
            body,
            "vgpu-scheduler",
            &ResourceNames::default(),
            &AdmissionPolicy::default(),
            &ClaimAnswers::new(),
            None,
        );
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        let value: Value = serde_json::from_slice(&reply.body).expect("json");
        assert_eq!(value["kind"], "AdmissionReview");
        assert_eq!(
            value["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(value["response"]["allowed"], true);
        value["response"].clone()
    }

    fn patch_of(response: &Value) -> Option<Value> {
        let text = response["patch"].as_str()?;
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("base64");
        Some(serde_json::from_slice(&bytes).expect("patch json"))
    }

    #[test]
    fn vgpu_pods_get_the_vgpu_scheduler() {
        for scheduler in [None, Some("default-scheduler"), Some("")] {
            let response = answer(&review(pod(json!({"nvidia.com/gpu": "1"}), scheduler)));
            assert_eq!(
                patch_of(&response),
                Some(
                    json!([{"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"}])
                ),
                "{scheduler:?}"
            );
        }
        let elastic = answer(&review(pod(json!({"elasticgpu.io/gpu-core": "50"}), None)));
        assert!(patch_of(&elastic).is_some());
        // An init container alone is enough.
        let mut init_only = pod(json!({}), None);
        init_only["spec"]["initContainers"] = json!([
            {"name": "warm", "image": "cuda", "resources": {"requests": {"nvidia.com/gpu": "1"}}}
        ]);
        assert!(patch_of(&answer(&review(init_only))).is_some());
    }

    #[test]
    fn elastic_requests_get_the_gpu_count_kubelet_allocates_by() {
        let mut elastic = pod(json!({"elasticgpu.io/gpu-core": "200"}), None);
        elastic["spec"]["containers"][0]["resources"]["requests"] =
            json!({"elasticgpu.io/gpu-core": "200"});
        elastic["spec"]["initContainers"] = json!([
            {"name": "warm", "image": "cuda", "resources": {"limits": {"elasticgpu.io/gpu-memory": "256"}}},
            {"name": "plain", "image": "busybox"}
        ]);
        assert_eq!(
            patch_of(&answer(&review(elastic))),
            Some(json!([
                {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "2"},
                {"op": "add", "path": "/spec/containers/0/resources/requests/nvidia.com~1gpu", "value": "2"},
                {"op": "add", "path": "/spec/initContainers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
                {"op": "add", "path": "/spec/initContainers/0/resources/requests", "value": {"nvidia.com/gpu": "1"}},
                {"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"},
            ]))
        );
        // A pod for another scheduler still needs kubelet to call the plugin.
        let other = pod(json!({"elasticgpu.io/gpu-memory": "256"}), Some("elastic"));
        assert_eq!(
            patch_of(&answer(&review(other))),
            Some(json!([
                {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
                {"op": "add", "path": "/spec/containers/0/resources/requests", "value": {"nvidia.com/gpu": "1"}},
            ]))
        );
        // A count already there is left as it is.
        let counted = pod(
            json!({"elasticgpu.io/gpu-core": "200", "nvidia.com/gpu": "2"}),
            Some("elastic"),
        );
        assert_eq!(patch_of(&answer(&review(counted))), None);
    }

    fn claimed_pod(privileged_container: bool) -> Value {
        let mut claimed = pod(json!({}), None);
        claimed["metadata"]["annotations"] =
            json!({"egpuc.elasticgpu.io/test1": "gpushare-egpuc-1"});
        if privileged_container {
            privileged(&mut claimed, 0);
        }
        claimed
    }

    fn answer_with(pod: &Value, claims: &ClaimAnswers) -> Value {
        let reply = mutate(
            &review(pod.clone()),
            "vgpu-scheduler",
            &ResourceNames::default(),
            &AdmissionPolicy::default(),
            claims,
            None,
        );
        serde_json::from_slice(&reply.body).expect("json")
    }

    #[test]
    fn claimed_containers_get_the_share_or_the_reason() {
        let share = ClaimShare {
            count: 1,
            cores: Some(10),
            memory_mib: Some(4096),
        };
        let body = review(claimed_pod(false));
        assert_eq!(
            to_look_up(&body),
            Some(("default".to_string(), vec!["gpushare-egpuc-1".to_string()]))
        );
        let ours = ClaimAnswers::from([("gpushare-egpuc-1".to_string(), Ok(Some(share)))]);
        let answered = answer_with(&claimed_pod(false), &ours);
        let patch = patch_of(&answered["response"]).expect("patched");
        let paths: Vec<&str> = patch
            .as_array()
            .expect("ops")
            .iter()
            .map(|op| op["path"].as_str().expect("path"))
            .collect();
        assert_eq!(
            paths,
            vec![
                "/spec/containers/0/resources/limits/nvidia.com~1gpu",
                "/spec/containers/0/resources/limits/nvidia.com~1gpucores",
                "/spec/containers/0/resources/limits/nvidia.com~1gpumem",
                "/spec/containers/0/resources/requests",
                "/metadata/annotations/vgpu.io~1elasticgpu-claims",
                "/spec/schedulerName",
            ]
        );
        // A claim another provisioner serves: the pod passes unchanged.
        let theirs = ClaimAnswers::from([("gpushare-egpuc-1".to_string(), Ok(None))]);
        let answered = answer_with(&claimed_pod(false), &theirs);
        assert_eq!(answered["response"]["allowed"], true);
        assert_eq!(patch_of(&answered["response"]), None);
        // A claim that cannot be given: refused with the reason.
        let taken = ClaimAnswers::from([(
            "gpushare-egpuc-1".to_string(),
            Err(ClaimLookUpError::InUse {
                namespace: "default".into(),
                name: "gpushare-egpuc-1".into(),
                holder: "a".into(),
            }),
        )]);
        let answered = answer_with(&claimed_pod(false), &taken);
        assert_eq!(answered["response"]["allowed"], false);
        assert_eq!(answered["response"]["status"]["code"], 422);
        assert!(answered["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("in use by pod default/a")));
        // A privileged container named by a claim is refused as one asking
        // for vGPUs.
        let answered = answer_with(&claimed_pod(true), &ours);
        assert_eq!(answered["response"]["status"]["code"], 403);
    }

    #[test]
    fn everything_else_passes_unchanged() {
        let cases = [
            pod(json!({"cpu": "1"}), None),
            pod(json!({"nvidia.com/gpu": "1"}), Some("my-scheduler")),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
        ];
        for case in cases {
            let response = answer(&review(case.clone()));
            assert_eq!(patch_of(&response), None, "{case}");
        }
        let mut bound = pod(json!({"nvidia.com/gpu": "1"}), None);
        bound["spec"]["nodeName"] = json!("n1");
        assert_eq!(patch_of(&answer(&review(bound))), None);
        // An update is never changed.
        let mut update: Value =
            serde_json::from_slice(&review(pod(json!({"nvidia.com/gpu": "1"}), None)))
                .expect("json");
        update["request"]["operation"] = json!("UPDATE");
        assert_eq!(patch_of(&answer(update.to_string().as_bytes())), None);
    }

    #[test]
    fn an_unreadable_pod_is_allowed_with_a_warning() {
        let response = answer(&review(json!({"spec": {"containers": "not a list"}})));
        assert_eq!(patch_of(&response), None);
        let warning = response["warnings"][0].as_str().expect("warning");
        assert!(warning.contains("could not read the pod"), "{warning}");
    }

    #[test]
    fn malformed_reviews_are_refused_in_words() {
        let names = ResourceNames::default();
        for (body, words) in [
            (&b"{"[..], "not an AdmissionReview"),
            (br#"{"kind":"Pod"}"#, "expected kind AdmissionReview"),
            (br#"{"kind":"AdmissionReview"}"#, "no request"),
            (
                br#"{"kind":"AdmissionReview","request":{}}"#,
                "not an AdmissionReview",
            ),
        ] {
            let reply = mutate(
                body,
                "vgpu-scheduler",
                &names,
                &AdmissionPolicy::default(),
                &ClaimAnswers::new(),
                None,
            );
            assert_eq!(reply.status, 400);
            let text = String::from_utf8_lossy(&reply.body);
            assert!(text.contains(words), "{text}");
        }
    }

    #[test]
    fn configured_resource_names_are_the_ones_looked_for() {
        let names = ResourceNames {
            gpu: "example.com/vgpu".into(),
            ..ResourceNames::default()
        };
        let reply = mutate(
            &review(pod(json!({"example.com/vgpu": "1"}), None)),
            "gpu-sched",
            &names,
            &AdmissionPolicy::default(),
            &ClaimAnswers::new(),
            None,
        );
        let value: Value = serde_json::from_slice(&reply.body).expect("json");
        let patch = patch_of(&value["response"]).expect("patched");
        assert_eq!(patch[0]["value"], "gpu-sched");
        let reply = mutate(
            &review(pod(json!({"nvidia.com/gpu": "1"}), None)),
            "gpu-sched",
            &names,
            &AdmissionPolicy::default(),
            &ClaimAnswers::new(),
            None,
        );
        let value: Value = serde_json::from_slice(&reply.body).expect("json");
        assert_eq!(patch_of(&value["response"]), None);
    }

    fn privileged(pod: &mut Value, container: usize) {
        pod["spec"]["containers"][container]["securityContext"] = json!({"privileged": true});
    }

    fn reply_to(pod: &Value, policy: AdmissionPolicy) -> Value {
        let policy = &policy;
        let reply = mutate(
            &review(pod.clone()),
            "vgpu-scheduler",
            &ResourceNames::default(),
            policy,
            &ClaimAnswers::new(),
            None,
        );
        assert_eq!(reply.status, 200);
        serde_json::from_slice(&reply.body).expect("json")
    }

    #[test]
    fn privileged_vgpu_containers_are_refused_with_the_reason() {
        let mut vgpu = pod(json!({"nvidia.com/gpu": "1"}), Some("vgpu-scheduler"));
        privileged(&mut vgpu, 0);
        let value = reply_to(&vgpu, AdmissionPolicy::default());
        let response = &value["response"];
        assert_eq!(response["allowed"], false);
        assert_eq!(response["status"]["code"], 403);
        let message = response["status"]["message"].as_str().expect("message");
        assert!(message.contains("container main"), "{message}");
        assert!(message.contains("bypasses"), "{message}");
        assert_eq!(patch_of(response), None);

        // Allowed (and pointed at the scheduler) when the chart says so.
        let mut unscheduled = pod(json!({"nvidia.com/gpu": "1"}), None);
        privileged(&mut unscheduled, 0);
        let value = reply_to(
            &unscheduled,
            AdmissionPolicy {
                allow_privileged: true,
                ..AdmissionPolicy::default()
            },
        );
        assert_eq!(value["response"]["allowed"], true);
        assert!(patch_of(&value["response"]).is_some());
    }

    #[test]
    fn seccomp_is_defaulted_for_vgpu_containers_and_unconfined_is_refused() {
        let mut bare = pod(json!({"nvidia.com/gpu": "1"}), Some("vgpu-scheduler"));
        bare["spec"]
            .as_object_mut()
            .expect("spec")
            .remove("securityContext");
        assert_eq!(
            patch_of(&answer(&review(bare.clone()))),
            Some(
                json!([{"op": "add", "path": "/spec/containers/0/securityContext",
                         "value": {"seccompProfile": {"type": "RuntimeDefault"}}}])
            )
        );
        let mut unconfined = bare.clone();
        unconfined["spec"]["securityContext"] = json!({"seccompProfile": {"type": "Unconfined"}});
        let value = reply_to(&unconfined, AdmissionPolicy::default());
        let response = &value["response"];
        assert_eq!(response["allowed"], false);
        assert_eq!(response["status"]["code"], 403);
        let message = response["status"]["message"].as_str().expect("message");
        assert!(message.contains("container main"), "{message}");
        assert!(message.contains("Unconfined"), "{message}");
        assert!(message.contains("allowPrivileged"), "{message}");
        // The chart's allowPrivileged accepts it, and changes nothing.
        let allowed = reply_to(
            &bare,
            AdmissionPolicy {
                allow_privileged: true,
                ..AdmissionPolicy::default()
            },
        );
        assert_eq!(allowed["response"]["allowed"], true);
        assert_eq!(patch_of(&allowed["response"]), None);
        // A pod without vGPUs is not touched.
        let mut plain = pod(json!({"cpu": "1"}), None);
        plain["spec"]["securityContext"] = json!({"seccompProfile": {"type": "Unconfined"}});
        let value = reply_to(&plain, AdmissionPolicy::default());
        assert_eq!(value["response"]["allowed"], true);
        assert_eq!(patch_of(&value["response"]), None);
    }

    #[test]
    fn privileged_containers_without_vgpus_and_updates_pass() {
        // A privileged sidecar beside a vGPU container: only the container
        // that asks is judged.
        let mut sidecar = pod(json!({"nvidia.com/gpu": "1"}), None);
        sidecar["spec"]["containers"]
            .as_array_mut()
            .expect("containers")
            .push(json!({"name": "agent", "image": "x", "securityContext": {"privileged": true}}));
        assert_eq!(
            reply_to(&sidecar, AdmissionPolicy::default())["response"]["allowed"],
            true
        );
        let mut plain = pod(json!({"cpu": "1"}), None);
        privileged(&mut plain, 0);
        assert_eq!(
            reply_to(&plain, AdmissionPolicy::default())["response"]["allowed"],
            true
        );
    }

    /// `pod` with the JSON patch's operations applied (the webhook writes
    /// only `add`).
    fn patched(mut pod: Value, patch: &Value) -> Value {
        for op in patch.as_array().expect("ops") {
            assert_eq!(op["op"], "add", "{op}");
            let path = op["path"].as_str().expect("path");
            let (parent, last) = path.rsplit_once('/').expect("a pointer");
            let last = last.replace("~1", "/").replace("~0", "~");
            let target = pod
                .pointer_mut(parent)
                .unwrap_or_else(|| panic!("{parent} exists before {op}"));
            target
                .as_object_mut()
                .unwrap_or_else(|| panic!("{parent} is an object"))
                .insert(last, op["value"].clone());
        }
        pod
    }

    fn kubeshare_pod(labels: Value, scheduler: Option<&str>) -> Value {
        let mut spec = json!({"containers": [{"name": "pytorch", "image": "riyazhu/mnist:test"}]});
        if let Some(name) = scheduler {
            spec["schedulerName"] = json!(name);
        }
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "mnist", "labels": labels}, "spec": spec})
    }

    fn kubeshare_policy() -> AdmissionPolicy {
        AdmissionPolicy {
            scheduler_alias: Some("kubeshare-scheduler".into()),
            opportunistic_class: Some(("vgpu-opportunistic".into(), -100)),
            ..AdmissionPolicy::default()
        }
    }

    #[test]
    fn kubeshare_labels_become_the_requests_the_extender_reads() {
        let seed = kubeshare_pod(
            json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0",
                   "sharedgpu/gpu_model": "NVIDIA-GeForce-GTX-1080"}),
            Some("kubeshare-scheduler"),
        );
        let value = reply_to(&seed, kubeshare_policy());
        assert_eq!(value["response"]["allowed"], true);
        let patch = patch_of(&value["response"]).expect("patched");
        let pod_value = patched(seed, &patch);
        assert_eq!(pod_value["spec"]["schedulerName"], "vgpu-scheduler");
        // The container the labels go to is a vGPU container: it gets the
        // runtime's seccomp profile like any other.
        assert_eq!(
            pod_value["spec"]["containers"][0]["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        // Opportunistic (no sharedgpu/priority): the chart's class, its
        // value, and no preempting of others.
        assert_eq!(pod_value["spec"]["priorityClassName"], "vgpu-opportunistic");
        assert_eq!(pod_value["spec"]["priority"], -100);
        assert_eq!(pod_value["spec"]["preemptionPolicy"], "Never");
        let limits = &pod_value["spec"]["containers"][0]["resources"]["limits"];
        assert_eq!(
            limits,
            &pod_value["spec"]["containers"][0]["resources"]["requests"]
        );
        assert_eq!(limits["nvidia.com/priority"], "2");
        let pod: Pod = serde_json::from_value(pod_value).expect("a pod");
        let request = vgpu_cluster::requests::parse_pod(
            &pod,
            &ResourceNames::default(),
            &vgpu_cluster::requests::RequestDefaults::default(),
        )
        .expect("the extender reads it");
        let container = &request.containers[0];
        assert_eq!((container.count, container.cores), (1, 50));
        assert_eq!(
            container.memory,
            vgpu_cluster::requests::MemoryRequest::Percent(50)
        );
        assert_eq!(
            container.priority,
            Some(crate::vocabulary::kubeshare::OPPORTUNISTIC_TASK_PRIORITY)
        );
        assert_eq!(request.burst_percent, Some(100));
        assert_eq!(
            request.selectors.model.as_deref(),
            Some("nvidia-geforce-gtx-1080")
        );
    }

    #[test]
    fn guaranteed_kubeshare_pods_keep_the_default_priority() {
        let pod_value = kubeshare_pod(
            json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_mem": "1073741824",
                   "sharedgpu/priority": "100"}),
            None,
        );
        let value = reply_to(&pod_value, kubeshare_policy());
        let pod_value = patched(pod_value, &patch_of(&value["response"]).expect("patched"));
        assert_eq!(pod_value["spec"]["schedulerName"], "vgpu-scheduler");
        assert!(
            pod_value["spec"].get("priorityClassName").is_none(),
            "{pod_value}"
        );
        let limits = &pod_value["spec"]["containers"][0]["resources"]["limits"];
        assert_eq!(limits["nvidia.com/gpu"], "2");
        assert_eq!(limits["nvidia.com/gpucores"], "100");
        assert_eq!(limits["nvidia.com/gpumem"], "1024");
        assert!(limits.get("nvidia.com/priority").is_none(), "{limits}");
        // A pod naming its own class keeps it, opportunistic or not.
        let mut named = kubeshare_pod(json!({"sharedgpu/gpu_request": "0.2"}), None);
        named["spec"]["priorityClassName"] = json!("batch");
        let value = reply_to(&named, kubeshare_policy());
        let named = patched(named, &patch_of(&value["response"]).expect("patched"));
        assert_eq!(named["spec"]["priorityClassName"], "batch");
        assert!(named["spec"].get("priority").is_none(), "{named}");
    }

    #[test]
    fn bad_kubeshare_labels_are_refused_and_the_alias_alone_is_renamed() {
        for (labels, words) in [
            (
                json!({"sharedgpu/gpu_request": "1.5"}),
                "whole number of GPUs",
            ),
            (
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "0.2"}),
                "below",
            ),
            (
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/group_name": "a"}),
                "group_headcount",
            ),
        ] {
            let value = reply_to(&kubeshare_pod(labels.clone(), None), kubeshare_policy());
            assert_eq!(value["response"]["allowed"], false, "{labels}");
            assert_eq!(value["response"]["status"]["code"], 422);
            let message = value["response"]["status"]["message"]
                .as_str()
                .expect("message");
            assert!(message.contains(words), "{labels}: {message}");
        }
        // Labels and resources at once: which to believe is not guessed.
        let mut both = pod(json!({"nvidia.com/gpu": "1"}), None);
        both["metadata"]["labels"] = json!({"sharedgpu/gpu_request": "0.5"});
        let value = reply_to(&both, kubeshare_policy());
        assert_eq!(value["response"]["allowed"], false);
        // A KubeShare pod without GPU labels is only given our scheduler;
        // without an alias configured, it is left alone.
        let plain = kubeshare_pod(json!({"app": "web"}), Some("kubeshare-scheduler"));
        let value = reply_to(&plain, kubeshare_policy());
        let patch = patch_of(&value["response"]).expect("renamed");
        assert_eq!(
            patch,
            json!([{"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"}])
        );
        assert_eq!(
            patch_of(&reply_to(&plain, AdmissionPolicy::default())["response"]),
            None
        );
        // Several containers: the first gets the GPU, and the user is told.
        let mut two = kubeshare_pod(json!({"sharedgpu/gpu_request": "0.5"}), None);
        two["spec"]["containers"]
            .as_array_mut()
            .expect("list")
            .push(json!({"name": "sidecar", "image": "x"}));
        let value = reply_to(&two, kubeshare_policy());
        let warning = value["response"]["warnings"][0]
            .as_str()
            .expect("a warning");
        assert!(warning.contains("\"pytorch\""), "{warning}");
    }
}
