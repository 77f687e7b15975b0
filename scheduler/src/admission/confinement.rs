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

/// The name of a privileged container of `pod` given vGPUs.
fn privileged_vgpu_container(pod: &Pod, given: &VgpuContainers<'_>) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|container| {
            let privileged = container
                .security_context
                .as_ref()
                .and_then(|context| context.privileged)
                .unwrap_or(false);
            privileged && given.contains(container)
        })
        .map(|container| container.name.clone())
}

/// What admission refuses in `pod`: a container given vGPUs that is
/// privileged, else one that runs `Unconfined`.
pub fn refused_at_admission(pod: &Pod, names: &ResourceNames) -> Option<Breach> {
    refused_among(pod, &VgpuContainers::of(pod, names))
}

/// What placement refuses in `pod`: what admission refuses, else a
/// container given vGPUs that runs with no seccomp profile (admission would
/// have given it one).
pub fn unconfined_for_placement(pod: &Pod, names: &ResourceNames) -> Option<Breach> {
    let given = VgpuContainers::of(pod, names);
    refused_among(pod, &given)
        .or_else(|| unprofiled_vgpu_container(pod, |c| given.contains(c)).map(Breach::Unprofiled))
}

fn refused_among(pod: &Pod, given: &VgpuContainers<'_>) -> Option<Breach> {
    privileged_vgpu_container(pod, given)
        .map(Breach::Privileged)
        .or_else(|| unconfined_vgpu_container(pod, |c| given.contains(c)).map(Breach::Unconfined))
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
            refused_at_admission(&privileged, &names),
            Some(Breach::Privileged("main".into()))
        );
        assert_eq!(
            unconfined_for_placement(&privileged, &names),
            Some(Breach::Privileged("main".into()))
        );

        let unconfined = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "Unconfined"}},
            "containers": [{"name": "main", "resources": gpu()}],
        }}));
        assert_eq!(
            unconfined_for_placement(&unconfined, &names),
            Some(Breach::Unconfined("main".into()))
        );

        // Admission lets an unprofiled container through (it gives it a
        // profile); placement sees it was never admitted.
        let unprofiled = pod(json!({"spec": {"initContainers": [
            {"name": "warm", "resources": gpu()},
        ], "containers": [{"name": "main"}]}}));
        assert_eq!(refused_at_admission(&unprofiled, &names), None);
        let breach = unconfined_for_placement(&unprofiled, &names).expect("refused");
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
        assert_eq!(unconfined_for_placement(&confined, &names), None);
        let by_pod = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}},
            "containers": [{"name": "main", "resources": gpu()}],
        }}));
        assert_eq!(unconfined_for_placement(&by_pod, &names), None);
    }

    #[test]
    fn the_first_container_of_a_kubeshare_pod_is_given_vgpus() {
        let names = ResourceNames::default();
        let labelled = pod(json!({
            "metadata": {"labels": {"sharedgpu/gpu_request": "0.5"}},
            "spec": {"containers": [{"name": "main", "securityContext": {"privileged": true}}, {"name": "log"}]},
        }));
        assert_eq!(
            refused_at_admission(&labelled, &names),
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
            unconfined_for_placement(&claimed, &names),
            Some(Breach::Privileged("main".into()))
        );
    }
}
