//! What keeps a container given vGPUs inside the shim's reach, and the
//! words for what breaks it: a privileged container sees every GPU of its
//! node and reaches them around the shim; one running seccomp `Unconfined`,
//! or with no profile at all, can make a user namespace and mount over the
//! shim's preload file ([`crate::admission::seccomp`]).
//!
//! Admission refuses the first two and gives the third `RuntimeDefault`
//! ([`crate::admission::mutate`], and the chart's own policies in the API
//! server). A pod created while admission was not in force (before the
//! install, in the second after it before the API server applies new
//! policies, or while the webhook was off) never went through it, so
//! placement checks all three again before it records a decision
//! ([`crate::extender::scheduler::Scheduler::confinement_refusal`]).

use crate::admission::reach::{
    added_capability, guarded_host_path, host_namespace, unmasked_proc, GuardedPaths,
};
use crate::admission::seccomp::{unconfined_vgpu_container, unprofiled_vgpu_container};
use crate::vocabulary::claims::claim_uses;
use crate::vocabulary::kubeshare::LABEL_PREFIX;
use k8s_openapi::api::core::v1::{Container, Pod};
use thiserror::Error;
use vgpu_cluster::requests::{asks_for_vgpu, ResourceNames};

/// A container given vGPUs that is not confined to the shim's reach.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Breach {
    #[error("container {0} asks for vGPUs and is privileged: a privileged container sees every GPU of its node and bypasses vgpu's memory cap and compute share; drop `privileged`")]
    Privileged(String),
    #[error("container {0} asks for vGPUs and runs seccomp Unconfined: it could make a user namespace, mount over /etc/ld.so.preload there and run programs outside vgpu's memory cap and compute share; use RuntimeDefault or a Localhost profile")]
    Unconfined(String),
    #[error("container {0} asks for vGPUs and names no seccomp profile, nor does its pod: it could make a user namespace, mount over /etc/ld.so.preload there and run programs outside vgpu's memory cap and compute share; vgpu's admission gives such a container RuntimeDefault")]
    Unprofiled(String),
    #[error("container {0} asks for vGPUs and adds the capability {1}: beyond Pod Security's baseline set, a capability (SYS_ADMIN above all) lets it unmount the shim's preload file or hide the node's mounts and run programs outside vgpu's memory cap and compute share; drop it")]
    Capability(String, String),
    #[error("container {0} asks for vGPUs and mounts /proc Unmasked: it could reach what the container runtime hides of the node and take the shim away; use the Default procMount")]
    UnmaskedProc(String),
    #[error("the pod asks for vGPUs and sets {0}: sharing the node's namespaces, its processes could reach other containers' processes and the vGPU regions they map; drop {0}")]
    HostNamespace(&'static str),
    #[error("the pod asks for vGPUs and its volume {volume} mounts the node's {path}, which overlaps {guarded}: from there its containers could rewrite vgpu's files (other containers' regions and grants, the shim) or reach the node's processes; mount another path")]
    HostPath {
        volume: String,
        path: String,
        guarded: String,
    },
}

/// Which containers of a pod are given vGPUs: those asking for vGPU
/// resources, those an Elastic GPU claim annotation names, and the one a
/// KubeShare pod's `sharedgpu/` labels go to (its first container, whose
/// resources admission writes from them: as created, it names none).
pub struct VgpuContainers<'a> {
    names: &'a ResourceNames,
    claimed: Vec<String>,
    labelled: Option<String>,
}

impl<'a> VgpuContainers<'a> {
    pub fn of(pod: &Pod, names: &'a ResourceNames) -> Self {
        let claimed = claim_uses(pod)
            .map(|uses| uses.into_iter().map(|u| u.container).collect())
            .unwrap_or_default();
        let kubeshare = pod
            .metadata
            .labels
            .iter()
            .flatten()
            .any(|(key, _)| key.starts_with(LABEL_PREFIX));
        let labelled = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.containers.first())
            .filter(|_| kubeshare)
            .map(|container| container.name.clone());
        Self {
            names,
            claimed,
            labelled,
        }
    }

    /// Whether `container` is given vGPUs.
    pub fn contains(&self, container: &Container) -> bool {
        asks_for_vgpu(container, self.names)
            || self.claimed.contains(&container.name)
            || self.labelled.as_deref() == Some(container.name.as_str())
    }
}

/// Every container of `pod`, init containers after the others.
fn all_containers(pod: &Pod) -> impl Iterator<Item = &Container> {
    pod.spec.iter().flat_map(|spec| {
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
    })
}

/// The first container of `pod` given vGPUs that `breaks` names a breach
/// of.
fn first_vgpu_container(
    pod: &Pod,
    given: &VgpuContainers<'_>,
    breaks: impl Fn(&Container) -> Option<Breach>,
) -> Option<Breach> {
    all_containers(pod)
        .filter(|container| given.contains(container))
        .find_map(breaks)
}

/// What admission refuses in `pod` (see [`refused_among`]).
pub fn refused_at_admission(
    pod: &Pod,
    names: &ResourceNames,
    guarded: &GuardedPaths,
) -> Option<Breach> {
    refused_among(pod, &VgpuContainers::of(pod, names), guarded)
}

/// What placement refuses in `pod`: what admission refuses, else a
/// container given vGPUs that runs with no seccomp profile (admission would
/// have given it one).
pub fn unconfined_for_placement(
    pod: &Pod,
    names: &ResourceNames,
    guarded: &GuardedPaths,
) -> Option<Breach> {
    let given = VgpuContainers::of(pod, names);
    refused_among(pod, &given, guarded)
        .or_else(|| unprofiled_vgpu_container(pod, |c| given.contains(c)).map(Breach::Unprofiled))
}

/// The first of, in this order (the chart's policy in the API server asks
/// in the same order, so both name the same breach): a container given
/// vGPUs that is privileged, runs `Unconfined`, adds a capability beyond
/// the baseline or mounts `/proc` unmasked; the pod sharing a node
/// namespace or mounting a guarded path of the node, where it has a
/// container given vGPUs.
fn refused_among(pod: &Pod, given: &VgpuContainers<'_>, guarded: &GuardedPaths) -> Option<Breach> {
    let privileged = |container: &Container| {
        let context = container.security_context.as_ref();
        context
            .and_then(|context| context.privileged)
            .unwrap_or(false)
            .then(|| Breach::Privileged(container.name.clone()))
    };
    let capability = |container: &Container| {
        added_capability(container).map(|added| Breach::Capability(container.name.clone(), added))
    };
    let unmasked = |container: &Container| {
        unmasked_proc(container).then(|| Breach::UnmaskedProc(container.name.clone()))
    };
    if let Some(breach) = first_vgpu_container(pod, given, privileged) {
        return Some(breach);
    }
    if let Some(name) = unconfined_vgpu_container(pod, |c| given.contains(c)) {
        return Some(Breach::Unconfined(name));
    }
    if let Some(breach) = first_vgpu_container(pod, given, capability)
        .or_else(|| first_vgpu_container(pod, given, unmasked))
    {
        return Some(breach);
    }
    if !all_containers(pod).any(|container| given.contains(container)) {
        return None;
    }
    host_namespace(pod).map(Breach::HostNamespace).or_else(|| {
        guarded_host_path(pod, guarded).map(|(volume, path, guarded)| Breach::HostPath {
            volume,
            path,
            guarded,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    fn gpu() -> serde_json::Value {
        json!({"limits": {"nvidia.com/gpu": "1"}})
    }

    #[test]
    fn placement_refuses_what_admission_refuses_and_what_it_would_have_profiled() {
        let names = ResourceNames::default();
        let privileged = pod(json!({"spec": {"containers": [
            {"name": "main", "resources": gpu(), "securityContext": {"privileged": true,
                "seccompProfile": {"type": "RuntimeDefault"}}},
        ]}}));
        assert_eq!(
            refused_at_admission(&privileged, &names, &GuardedPaths::default()),
            Some(Breach::Privileged("main".into()))
        );
        assert_eq!(
            unconfined_for_placement(&privileged, &names, &GuardedPaths::default()),
            Some(Breach::Privileged("main".into()))
        );

        let unconfined = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "Unconfined"}},
            "containers": [{"name": "main", "resources": gpu()}],
        }}));
        assert_eq!(
            unconfined_for_placement(&unconfined, &names, &GuardedPaths::default()),
            Some(Breach::Unconfined("main".into()))
        );

        // Admission lets an unprofiled container through (it gives it a
        // profile); placement sees it was never admitted.
        let unprofiled = pod(json!({"spec": {"initContainers": [
            {"name": "warm", "resources": gpu()},
        ], "containers": [{"name": "main"}]}}));
        assert_eq!(
            refused_at_admission(&unprofiled, &names, &GuardedPaths::default()),
            None
        );
        let breach = unconfined_for_placement(&unprofiled, &names, &GuardedPaths::default())
            .expect("refused");
        assert_eq!(breach, Breach::Unprofiled("warm".into()));
        assert!(
            breach
                .to_string()
                .contains("gives such a container RuntimeDefault"),
            "{breach}"
        );
    }

    #[test]
    fn containers_without_vgpus_and_confined_vgpu_containers_pass() {
        let names = ResourceNames::default();
        let confined = pod(json!({"spec": {"containers": [
            {"name": "main", "resources": gpu(), "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
            {"name": "net", "securityContext": {"privileged": true}},
            {"name": "tool", "securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        ]}}));
        assert_eq!(
            unconfined_for_placement(&confined, &names, &GuardedPaths::default()),
            None
        );
        let by_pod = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}},
            "containers": [{"name": "main", "resources": gpu()}],
        }}));
        assert_eq!(
            unconfined_for_placement(&by_pod, &names, &GuardedPaths::default()),
            None
        );
    }

    #[test]
    fn capabilities_proc_host_namespaces_and_guarded_paths_are_refused_in_that_order() {
        let names = ResourceNames::default();
        let guarded = GuardedPaths::default();
        let refused = |value| refused_at_admission(&pod(value), &names, &guarded);
        let everything = json!({"spec": {
        "hostPID": true,
        "volumes": [{"name": "vgpu", "hostPath": {"path": "/usr/local/vgpu"}}],
        "containers": [
            {"name": "main", "resources": gpu(), "securityContext": {
                "procMount": "Unmasked", "capabilities": {"add": ["SYS_ADMIN"]}}},
        ]}});
        assert_eq!(
            refused(everything.clone()),
            Some(Breach::Capability("main".into(), "SYS_ADMIN".into()))
        );
        let mut unmasked = everything.clone();
        unmasked["spec"]["containers"][0]["securityContext"]
            .as_object_mut()
            .expect("context")
            .remove("capabilities");
        assert_eq!(
            refused(unmasked.clone()),
            Some(Breach::UnmaskedProc("main".into()))
        );
        let mut host = unmasked;
        host["spec"]["containers"][0]
            .as_object_mut()
            .expect("container")
            .remove("securityContext");
        assert_eq!(
            refused(host.clone()),
            Some(Breach::HostNamespace("hostPID"))
        );
        host["spec"]["hostPID"] = json!(false);
        let breach = refused(host.clone()).expect("refused");
        assert_eq!(
            breach,
            Breach::HostPath {
                volume: "vgpu".into(),
                path: "/usr/local/vgpu".into(),
                guarded: "/usr/local/vgpu".into()
            }
        );
        assert!(
            breach
                .to_string()
                .contains("mounts the node's /usr/local/vgpu"),
            "{breach}"
        );
        // The same pod without a vGPU is no business of vgpu's; a sidecar
        // without vGPUs adds what it needs.
        host["spec"]["containers"][0]
            .as_object_mut()
            .expect("container")
            .remove("resources");
        assert_eq!(refused(host), None);
        let sidecar = json!({"spec": {"containers": [
            {"name": "main", "resources": gpu()},
            {"name": "mesh", "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}},
        ]}});
        assert_eq!(refused(sidecar), None);
    }

    #[test]
    fn the_first_container_of_a_kubeshare_pod_is_given_vgpus() {
        let names = ResourceNames::default();
        let labelled = pod(json!({
            "metadata": {"labels": {"sharedgpu/gpu_request": "0.5"}},
            "spec": {"containers": [{"name": "main", "securityContext": {"privileged": true}}, {"name": "log"}]},
        }));
        assert_eq!(
            refused_at_admission(&labelled, &names, &GuardedPaths::default()),
            Some(Breach::Privileged("main".into()))
        );
        let given = VgpuContainers::of(&labelled, &names);
        let spec = labelled.spec.as_ref().expect("spec");
        assert!(given.contains(&spec.containers[0]) && !given.contains(&spec.containers[1]));
    }

    #[test]
    fn a_container_an_elastic_gpu_claim_names_is_given_vgpus() {
        let names = ResourceNames::default();
        let claimed = pod(json!({
            "metadata": {"annotations": {"egpuc.elasticgpu.io/main": "claim-1"}},
            "spec": {"containers": [{"name": "main", "securityContext": {"privileged": true}}]},
        }));
        assert_eq!(
            unconfined_for_placement(&claimed, &names, &GuardedPaths::default()),
            Some(Breach::Privileged("main".into()))
        );
    }
}
