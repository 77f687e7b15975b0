//! What else a pod given vGPUs may not ask for, since each reaches past
//! the shim or into other containers' vGPU state on the node:
//!
//! - a capability beyond Pod Security's baseline set on a vGPU container
//!   (`SYS_ADMIN` unmounts the shim's preload file or hides the node's
//!   mounts, even under `RuntimeDefault`);
//! - `procMount: Unmasked` on a vGPU container;
//! - the node's PID or IPC namespace (`hostPID`, `hostIPC`): other
//!   containers' processes, and what they map;
//! - a `hostPath` volume onto vgpu's folder on the node (the regions, the
//!   grants, the shim and its preload file), a folder that holds it, or
//!   the node's `/proc`.
//!
//! The capabilities are compared as Pod Security's baseline level compares
//! them: by name exactly as written. A path is compared by its components
//! (`//` and `.` dropped); a symbolic link on the node that leads into
//! vgpu's folder is not followed (admission cannot see the node's disk).

use k8s_openapi::api::core::v1::{Container, Pod};

/// The capabilities Pod Security's baseline level lets a container add.
pub const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// vgpu's folder on the nodes unless told otherwise (the chart's
/// `hostDir`).
pub const DEFAULT_HOST_DIR: &str = "/usr/local/vgpu";

/// The node's paths no pod given vGPUs may mount: vgpu's folder and the
/// node's `/proc`, each as its components joined by `/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardedPaths(Vec<String>);

impl Default for GuardedPaths {
    fn default() -> Self {
        Self::new(DEFAULT_HOST_DIR)
    }
}

impl GuardedPaths {
    /// The paths guarded with vgpu's folder at `host_dir`.
    pub fn new(host_dir: &str) -> Self {
        Self(vec![normalize(host_dir), "/proc".to_string()])
    }

    /// The guarded path `path` (a path on the node) overlaps: the same, a
    /// path inside it, or a folder holding it.
    pub fn overlapped_by(&self, path: &str) -> Option<&str> {
        let path = normalize(path);
        let within = |outer: &str, inner: &str| {
            inner == outer || outer == "/" || inner.starts_with(&format!("{outer}/"))
        };
        self.0
            .iter()
            .find(|guarded| within(guarded, &path) || within(&path, guarded))
            .map(String::as_str)
    }
}

/// `path` as `/` and its components, without empty ones and `.`.
fn normalize(path: &str) -> String {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect();
    format!("/{}", parts.join("/"))
}

/// The first capability `container` adds beyond the baseline set.
pub fn added_capability(container: &Container) -> Option<String> {
    container
        .security_context
        .as_ref()?
        .capabilities
        .as_ref()?
        .add
        .iter()
        .flatten()
        .find(|added| !BASELINE_CAPABILITIES.contains(&added.as_str()))
        .cloned()
}

/// Whether `container` mounts `/proc` unmasked.
pub fn unmasked_proc(container: &Container) -> bool {
    container
        .security_context
        .as_ref()
        .and_then(|context| context.proc_mount.as_deref())
        == Some("Unmasked")
}

/// The node namespace `pod` shares (`hostPID` before `hostIPC`), as the
/// field that asks for it.
pub fn host_namespace(pod: &Pod) -> Option<&'static str> {
    let spec = pod.spec.as_ref()?;
    if spec.host_pid == Some(true) {
        Some("hostPID")
    } else if spec.host_ipc == Some(true) {
        Some("hostIPC")
    } else {
        None
    }
}

/// The first `hostPath` volume of `pod` onto a guarded path: (volume, its
/// path as written, the guarded path).
pub fn guarded_host_path(pod: &Pod, guarded: &GuardedPaths) -> Option<(String, String, String)> {
    pod.spec
        .as_ref()?
        .volumes
        .iter()
        .flatten()
        .find_map(|volume| {
            let path = &volume.host_path.as_ref()?.path;
            let overlapped = guarded.overlapped_by(path)?;
            Some((volume.name.clone(), path.clone(), overlapped.to_string()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn container(context: serde_json::Value) -> Container {
        serde_json::from_value(json!({"name": "main", "securityContext": context}))
            .expect("container")
    }

    #[test]
    fn capabilities_beyond_the_baseline_are_named_as_written() {
        let allowed = container(json!({"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN"]}}));
        assert_eq!(added_capability(&allowed), None);
        let admin = container(json!({"capabilities": {"add": ["CHOWN", "SYS_ADMIN"]}}));
        assert_eq!(added_capability(&admin).as_deref(), Some("SYS_ADMIN"));
        // Pod Security compares names as written: a prefixed one is not in
        // the baseline set.
        let prefixed = container(json!({"capabilities": {"add": ["CAP_CHOWN"]}}));
        assert_eq!(added_capability(&prefixed).as_deref(), Some("CAP_CHOWN"));
        let dropped = container(json!({"capabilities": {"drop": ["ALL"]}}));
        assert_eq!(added_capability(&dropped), None);
    }

    #[test]
    fn procmount_unmasked_only() {
        assert!(unmasked_proc(&container(json!({"procMount": "Unmasked"}))));
        assert!(!unmasked_proc(&container(json!({"procMount": "Default"}))));
        assert!(!unmasked_proc(&container(json!({}))));
    }

    #[test]
    fn host_paths_onto_vgpus_folder_a_folder_holding_it_or_proc_are_guarded() {
        let guarded = GuardedPaths::new("/usr/local/vgpu/");
        for (path, hit) in [
            ("/usr/local/vgpu", Some("/usr/local/vgpu")),
            ("/usr/local/vgpu/containers/x_main", Some("/usr/local/vgpu")),
            ("//usr/./local//vgpu/", Some("/usr/local/vgpu")),
            ("/usr", Some("/usr/local/vgpu")),
            ("/", Some("/usr/local/vgpu")),
            ("/proc/1/root", Some("/proc")),
            ("/usr/local/vgpu-other", None),
            ("/usr/lib", None),
            ("/data", None),
            ("/processes", None),
        ] {
            assert_eq!(guarded.overlapped_by(path), hit, "{path}");
        }
    }

    #[test]
    fn the_first_guarded_host_path_and_host_namespace_are_named() {
        let pod: Pod = serde_json::from_value(json!({"spec": {
        "hostIPC": true,
        "containers": [{"name": "main"}],
        "volumes": [
            {"name": "data", "hostPath": {"path": "/data"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "vgpu", "hostPath": {"path": "/usr/local/vgpu/containers"}},
        ]}}))
        .expect("pod");
        assert_eq!(
            guarded_host_path(&pod, &GuardedPaths::default()),
            Some((
                "vgpu".into(),
                "/usr/local/vgpu/containers".into(),
                "/usr/local/vgpu".into()
            ))
        );
        assert_eq!(host_namespace(&pod), Some("hostIPC"));
    }
}
