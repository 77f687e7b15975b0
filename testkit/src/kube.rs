//! A real Kubernetes API server for a test: etcd and kube-apiserver, built
//! from their published Go modules by `tests/cluster/build` and started by
//! `tests/cluster/controlplane.py up --api-only` (the one launcher the
//! Python cluster tests use too), with RBAC, TLS and an admin kubeconfig.
//!
//! Each test gets its own, so what one test's extender watches is only that
//! test's nodes and pods. There is no controller manager: nothing deletes
//! pods of unknown nodes, gives namespaces service accounts or binds pods;
//! the test does what it needs itself.
//!
//! The binaries take minutes to build once per pinned version; the README's
//! test command builds them before the Rust tests run.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a control plane may take to come up on a busy 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// etcd and kube-apiserver, stopped (exactly those processes) on drop.
pub struct ApiServer {
    launcher: Child,
    dir: PathBuf,
    kubeconfig: PathBuf,
}

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lives in the workspace")
        .to_path_buf()
}

impl ApiServer {
    /// Starts one and waits until it answers `/readyz`. Panics with the
    /// launcher's own words when it cannot (binaries missing, a component
    /// that does not become healthy).
    pub fn start() -> Self {
        let dir = crate::unique_temp_dir("kube-apiserver");
        let script = repository().join("tests/cluster/controlplane.py");
        let mut launcher = Command::new("python3")
            .arg(&script)
            .args(["up", "--api-only", "--dir"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("starting {}: {error}", script.display()));
        let stdout = launcher.stdout.take().expect("piped stdout");
        let stderr = launcher.stderr.take().expect("piped stderr");
        // The launcher says where the kubeconfig is once everything is
        // healthy; read that line (or the end of its output) on a thread so
        // that the wait has a deadline.
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sender = Some(sender);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(path) = line.split("export KUBECONFIG=").nth(1) {
                    if let Some(sender) = sender.take() {
                        let _ = sender.send(Some(PathBuf::from(path.trim())));
                    }
                }
            }
            // Read to the end, not just to that line: the launcher prints
            // another right after it, and a pipe closed by then failed that
            // print (BrokenPipeError), which made the launcher stop the
            // control plane it had just started (seen as refused
            // connections a moment after `start` returned).
            if let Some(sender) = sender {
                let _ = sender.send(None);
            }
        });
        let errors = std::thread::spawn(move || {
            let mut text = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                text.push_str(&line);
                text.push('\n');
            }
            text
        });
        match receiver.recv_timeout(START_TIMEOUT) {
            Ok(Some(kubeconfig)) => Self {
                launcher,
                dir,
                kubeconfig,
            },
            outcome => {
                let _ = launcher.kill();
                let _ = launcher.wait();
                let said = errors.join().unwrap_or_default();
                let why = if outcome.is_err() {
                    format!("not up after {} s", START_TIMEOUT.as_secs())
                } else {
                    "it stopped".to_string()
                };
                panic!(
                    "the test control plane (etcd, kube-apiserver; `tests/cluster/build` makes them) \
                     did not start: {why}\n{said}"
                );
            }
        }
    }

    /// The admin kubeconfig (client certificate in `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where the control plane keeps its data, certificates and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client with the admin kubeconfig.
    pub async fn client(&self) -> kube::Client {
        vgpu_cluster::client::make_client(&vgpu_cluster::client::ApiSource::Kubeconfig(
            self.kubeconfig.clone(),
        ))
        .await
        .expect("a client for the test API server")
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // SIGTERM: the launcher stops the processes it started, by pid.
        // SAFETY: kill(2) with the pid of our own child, which has not been
        // reaped yet (it is waited for just below), so the pid is still ours.
        unsafe {
            libc::kill(self.launcher.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.launcher.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Binds pod `namespace/name` to `node` as kube-scheduler does: through the
/// `binding` subresource, the only way a real server lets `spec.nodeName`
/// be set on an existing pod.
pub async fn bind_pod(client: &kube::Client, namespace: &str, name: &str, node: &str) {
    bind_pod_annotated(client, namespace, name, node, Default::default()).await;
}

/// Binds as [`bind_pod`] does, with `annotations` in the Binding, which the
/// API server merges into the pod (as the extender records its decision).
pub async fn bind_pod_annotated(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    node: &str,
    annotations: std::collections::BTreeMap<String, String>,
) {
    use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..ObjectReference::default()
        },
    };
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
    pods.create_subresource::<_, serde_json::Value>(
        "binding",
        name,
        &kube::api::PostParams::default(),
        &binding,
    )
    .await
    .unwrap_or_else(|error| panic!("bind pod {namespace}/{name} to {node}: {error}"));
}

/// Sets the phase of pod `namespace/name` as kubelet does, through the
/// `status` subresource (a patch of the pod itself leaves it unchanged);
/// answers the pod as written.
pub async fn set_pod_phase(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    phase: &str,
) -> k8s_openapi::api::core::v1::Pod {
    use kube::api::{Patch, PatchParams};
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client.clone(), namespace);
    let status = serde_json::json!({ "status": { "phase": phase } });
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|error| panic!("set pod {namespace}/{name} {phase}: {error}"))
}
