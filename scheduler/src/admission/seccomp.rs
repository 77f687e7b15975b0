//! Seccomp for the containers given vGPUs.
//!
//! The shim reaches a container's programs through the `/etc/ld.so.preload`
//! the device plugin mounts read-only. Without a seccomp profile (what
//! kubelet runs a container with unless its `seccompDefault` is on), any
//! user in the container, root or not, can make a user namespace, mount
//! over that file inside it and run programs the shim never sees: a real
//! node's test took 16 GiB under a 1 GiB cap so. The runtime's default
//! profile refuses the user namespace. So a vGPU container that names no
//! profile, and whose pod names none, is given `RuntimeDefault`; one whose
//! profile is `Unconfined` is refused like a privileged one. A `Localhost`
//! profile is the cluster's own choice and is kept.

use k8s_openapi::api::core::v1::{Container, Pod, SeccompProfile};
use serde_json::{json, Value};

/// The profile type that lets every system call through.
const UNCONFINED: &str = "Unconfined";

fn profile_type(profile: Option<&SeccompProfile>) -> Option<&str> {
    profile.map(|profile| profile.type_.as_str())
}

/// The seccomp profile type `container` runs with: its own, else its pod's
/// (None: neither names one).
fn effective<'a>(pod: &'a Pod, container: &'a Container) -> Option<&'a str> {
    let own = container
        .security_context
        .as_ref()
        .and_then(|context| context.seccomp_profile.as_ref());
    let pods = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.security_context.as_ref())
        .and_then(|context| context.seccomp_profile.as_ref());
    profile_type(own).or(profile_type(pods))
}

/// Every container of `pod` (init containers after the others) with the
/// JSON pointer of its entry.
fn containers(pod: &Pod) -> impl Iterator<Item = (String, &Container)> {
    let spec = pod.spec.as_ref();
    let main = spec
        .map(|spec| spec.containers.iter())
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, container)| (format!("/spec/containers/{index}"), container));
    let init = spec
        .and_then(|spec| spec.init_containers.as_ref())
        .map(|containers| containers.iter())
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, container)| (format!("/spec/initContainers/{index}"), container));
    main.chain(init)
}

/// The name of a container given vGPUs (`is_vgpu`) that runs `Unconfined`.
pub fn unconfined_vgpu_container(
    pod: &Pod,
    is_vgpu: impl Fn(&Container) -> bool,
) -> Option<String> {
    containers(pod)
        .find(|(_, container)| is_vgpu(container) && effective(pod, container) == Some(UNCONFINED))
        .map(|(_, container)| container.name.clone())
}

/// The name of a container given vGPUs (`is_vgpu`) that runs with no
/// profile (neither its own nor its pod's).
pub fn unprofiled_vgpu_container(
    pod: &Pod,
    is_vgpu: impl Fn(&Container) -> bool,
) -> Option<String> {
    containers(pod)
        .find(|(_, container)| is_vgpu(container) && effective(pod, container).is_none())
        .map(|(_, container)| container.name.clone())
}

/// JSON patch operations giving `RuntimeDefault` to every container given
/// vGPUs that runs with no profile.
pub fn runtime_default_patch(pod: &Pod, is_vgpu: impl Fn(&Container) -> bool) -> Vec<Value> {
    let profile = json!({"type": "RuntimeDefault"});
    containers(pod)
        .filter(|(_, container)| is_vgpu(container) && effective(pod, container).is_none())
        .map(|(pointer, container)| match container.security_context {
            Some(_) => json!({
                "op": "add",
                "path": format!("{pointer}/securityContext/seccompProfile"),
                "value": profile,
            }),
            None => json!({
                "op": "add",
                "path": format!("{pointer}/securityContext"),
                "value": {"seccompProfile": profile},
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    fn gpu(container: &Container) -> bool {
        container.name.starts_with("gpu")
    }

    #[test]
    fn vgpu_containers_without_a_profile_get_the_runtimes_default() {
        let found = pod(json!({"spec": {
            "containers": [
                {"name": "gpu-a"},
                {"name": "sidecar"},
                {"name": "gpu-b", "securityContext": {"runAsUser": 1000}},
                {"name": "gpu-c", "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}},
            ],
            "initContainers": [{"name": "gpu-init"}],
        }}));
        assert_eq!(
            runtime_default_patch(&found, gpu),
            vec![
                json!({"op": "add", "path": "/spec/containers/0/securityContext",
                       "value": {"seccompProfile": {"type": "RuntimeDefault"}}}),
                json!({"op": "add", "path": "/spec/containers/2/securityContext/seccompProfile",
                       "value": {"type": "RuntimeDefault"}}),
                json!({"op": "add", "path": "/spec/initContainers/0/securityContext",
                       "value": {"seccompProfile": {"type": "RuntimeDefault"}}}),
            ]
        );
        assert_eq!(unconfined_vgpu_container(&found, gpu), None);
    }

    #[test]
    fn a_pods_profile_covers_its_containers_and_a_containers_own_wins() {
        let runtime_default = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "gpu-a"}],
        }}));
        assert!(runtime_default_patch(&runtime_default, gpu).is_empty());
        assert_eq!(unconfined_vgpu_container(&runtime_default, gpu), None);

        let unconfined_pod = pod(json!({"spec": {
            "securityContext": {"seccompProfile": {"type": "Unconfined"}},
            "containers": [
                {"name": "sidecar"},
                {"name": "gpu-a", "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
                {"name": "gpu-b"},
            ],
        }}));
        assert_eq!(
            unconfined_vgpu_container(&unconfined_pod, gpu).as_deref(),
            Some("gpu-b")
        );
        let unconfined_container = pod(json!({"spec": {
            "containers": [{"name": "gpu-a", "securityContext": {"seccompProfile": {"type": "Unconfined"}}}],
        }}));
        assert_eq!(
            unconfined_vgpu_container(&unconfined_container, gpu).as_deref(),
            Some("gpu-a")
        );
        // A container without vGPUs may run as it likes.
        let sidecar = pod(json!({"spec": {
            "containers": [{"name": "sidecar", "securityContext": {"seccompProfile": {"type": "Unconfined"}}}],
        }}));
        assert_eq!(unconfined_vgpu_container(&sidecar, gpu), None);
        assert!(runtime_default_patch(&sidecar, gpu).is_empty());
    }
}
