//! The Elastic GPU claim controller on a real API server: claims bound to
//! ElasticGPUs it creates, reasons in a `Ready` condition for those it
//! cannot bind (a claim of another shape among them, which keeps all it
//! holds), a waiting claim bound once the cluster makes room, a class
//! created after its claim, and both reclaim policies.
//!
//! The definitions installed here are looser than the published ones
//! (any fields): only so can a claim of another shape be stored, as it can
//! under definitions other than the chart's.

use crate::harness::*;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, PostParams};
use serde_json::{json, Value};
use std::future::Future;
use std::time::Duration;
use vgpu_scheduler::vocabulary::elastic::{
    ElasticGpu, ElasticGpuClaim, ElasticGpuClass, FINALIZER, RECLAIM_POLICY_ANNOTATION,
    STORED_VERSION,
};

const PROVISIONER: &str = "gpushare.provisioner.elasticgpu.io";
const CORE: &str = "gpushare.provisioner.elasticgpu.io/gpu-core";
const MEMORY: &str = "gpushare.provisioner.elasticgpu.io/gpu-memory";
/// How long the controller may take to get somewhere (a claim waiting for
/// room is tried again at most every 5 s).
const PATIENCE: Duration = Duration::from_secs(40);

/// A definition of `kind` (`plural`) in group elasticgpu.io that takes
/// any fields.
fn loose_definition(kind: &str, plural: &str, namespaced: bool) -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.elasticgpu.io")},
        "spec": {
            "group": "elasticgpu.io",
            "names": {"kind": kind, "listKind": format!("{kind}List"), "plural": plural,
                      "singular": kind.to_lowercase()},
            "scope": if namespaced { "Namespaced" } else { "Cluster" },
            "versions": [{
                "name": "v1alpha1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    }))
    .expect("a definition")
}

/// Polls `check` until it answers, or fails the test after [`PATIENCE`].
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(answer) = check().await {
            return answer;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real API server with Elastic GPU's definitions installed and served.
async fn server_with_definitions() -> (RealServer, kube::Client) {
    let (server, client) = real_api_server().await;
    let definitions = kube::Api::<CustomResourceDefinition>::all(client.clone());
    for (kind, plural, namespaced) in [
        ("ElasticGPUClaim", "elasticgpuclaims", true),
        ("ElasticGPUClass", "elasticgpuclasses", false),
        ("ElasticGPU", "elasticgpus", false),
    ] {
        definitions
            .create(
                &PostParams::default(),
                &loose_definition(kind, plural, namespaced),
            )
            .await
            .unwrap_or_else(|e| panic!("install {plural}: {e}"));
    }
    let claims = kube::Api::<ElasticGpuClaim>::all(client.clone());
    let classes = kube::Api::<ElasticGpuClass>::all(client.clone());
    let gpus = kube::Api::<ElasticGpu>::all(client.clone());
    eventually("the definitions served", || async {
        let served = claims.list(&Default::default()).await.is_ok()
            && classes.list(&Default::default()).await.is_ok()
            && gpus.list(&Default::default()).await.is_ok();
        served.then_some(())
    })
    .await;
    (server, client)
}

struct Elastic {
    h: Harness,
}

impl Elastic {
    fn claims(&self) -> kube::Api<ElasticGpuClaim> {
        kube::Api::namespaced(self.h.api.client().clone(), NAMESPACE)
    }

    fn gpus(&self) -> kube::Api<ElasticGpu> {
        kube::Api::all(self.h.api.client().clone())
    }

    async fn add_class(&self, name: &str, annotations: Value) {
        let class: ElasticGpuClass = serde_json::from_value(json!({
            "apiVersion": STORED_VERSION, "kind": "ElasticGPUClass",
            "metadata": {"name": name, "annotations": annotations},
            "provisioner": PROVISIONER,
        }))
        .expect("a class");
        kube::Api::<ElasticGpuClass>::all(self.h.api.client().clone())
            .create(&PostParams::default(), &class)
            .await
            .unwrap_or_else(|e| panic!("create class {name}: {e}"));
    }

    /// Creates claim `name` with `spec` (written as given).
    async fn add_claim(&self, name: &str, spec: Value) -> ElasticGpuClaim {
        let claim: ElasticGpuClaim = serde_json::from_value(json!({
            "apiVersion": STORED_VERSION, "kind": "ElasticGPUClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec,
        }))
        .expect("a claim");
        self.claims()
            .create(&PostParams::default(), &claim)
            .await
            .unwrap_or_else(|e| panic!("create claim {name}: {e}"))
    }

    async fn claim(&self, name: &str) -> Option<ElasticGpuClaim> {
        self.claims()
            .get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("read claim {name}: {e}"))
    }

    /// Waits until claim `name` stands for `reason`; answers it then.
    async fn standing(&self, name: &str, reason: &str) -> ElasticGpuClaim {
        eventually(&format!("claim {name} {reason}"), || async {
            let claim = self.claim(name).await?;
            let standing = claim.condition("Ready")?.reason.as_deref()?;
            (standing == reason).then_some(claim)
        })
        .await
    }

    /// Creates claim `name` and waits until it stands for `reason`.
    async fn standing_after_add(&self, name: &str, spec: Value, reason: &str) -> ElasticGpuClaim {
        self.add_claim(name, spec).await;
        self.standing(name, reason).await
    }

    /// Waits until claim `name` is bound; answers it and its ElasticGPU.
    async fn bound(&self, name: &str) -> (ElasticGpuClaim, ElasticGpu) {
        let claim = self.standing(name, "Provisioned").await;
        assert_eq!(claim.phase(), Some("Bound"));
        let egpu = claim.elastic_gpu_name().expect("named").to_string();
        let gpu = self
            .gpus()
            .get(&egpu)
            .await
            .unwrap_or_else(|e| panic!("read ElasticGPU {egpu}: {e}"));
        (claim, gpu)
    }

    async fn delete_claim(&self, name: &str) {
        self.claims()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete claim {name}: {e}"));
        eventually(&format!("claim {name} gone"), || async {
            self.claim(name).await.is_none().then_some(())
        })
        .await;
    }
}

fn memory(gib: u64) -> Value {
    json!({"elasticGPUClassName": "shared", "resources": {"requests": {MEMORY: gib}}})
}

#[tokio::test]
async fn claims_are_bound_refused_in_words_retried_on_room_and_reclaimed() {
    let (server, client) = server_with_definitions().await;
    let h = Harness::start_on(test_config(), server, client).await;
    h.add_nodes(vec![node("n1", &[gpu("NVIDIA A10", 24)])])
        .await;
    let elastic = Elastic { h };
    elastic.add_class("shared", json!({})).await;
    elastic
        .add_class("kept", json!({ RECLAIM_POLICY_ANNOTATION: "Retain" }))
        .await;

    // Bound at once (Immediate): an ElasticGPU recording its claim and slice.
    let big = elastic.add_claim("big", memory(20)).await;
    let (claim, gpu) = elastic.bound("big").await;
    assert!(claim
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER));
    let gpu_json = json!(gpu);
    assert_eq!(gpu_json["spec"]["claimRef"]["uid"], json!(big.metadata.uid));
    assert_eq!(gpu_json["spec"]["gpuShare"]["gpuName"], uuid("n1", 0));
    assert_eq!(gpu_json["status"]["phase"], "Bound");

    // No room left for 10 GiB more: it waits, saying why.
    let waiting = elastic
        .standing_after_add("waiting", memory(10), "NoCapacity")
        .await;
    assert_eq!(waiting.phase(), Some("Pending"));

    // A claim of another shape: a clear reason, and nothing of it lost.
    let odd_spec = json!({"elasticGPUClassName": ["shared"], "keep": "me"});
    let odd = elastic
        .standing_after_add("odd", odd_spec.clone(), "InvalidObject")
        .await;
    let message = odd.condition("Ready").and_then(|c| c.message.clone());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("does not have the published shape")),
        "{message:?}"
    );
    assert_eq!(json!(odd.spec), odd_spec, "its spec is as written");
    assert!(odd.metadata.finalizers.is_none(), "nothing provisioned");

    // A request vgpu cannot read as a share.
    let bad = elastic
        .standing_after_add(
            "bad",
            json!({"elasticGPUClassName": "shared", "resources": {"requests": {CORE: 150}}}),
            "InvalidRequest",
        )
        .await;
    let message = bad.condition("Ready").and_then(|c| c.message.clone());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("multiple of 100")),
        "{message:?}"
    );

    // A class created after its claim: the claim is bound then.
    let orphan_spec =
        json!({"elasticGPUClassName": "later", "resources": {"requests": {CORE: 10, MEMORY: 1}}});
    elastic
        .standing_after_add("orphan", orphan_spec, "ClassNotFound")
        .await;
    elastic.add_class("later", json!({})).await;
    elastic.bound("orphan").await;

    // The big claim deleted (policy Delete): its ElasticGPU goes, and the
    // room it leaves is given to the waiting claim.
    let big_gpu = gpu.metadata.name.clone().expect("named");
    elastic.delete_claim("big").await;
    assert!(elastic
        .gpus()
        .get_opt(&big_gpu)
        .await
        .expect("read")
        .is_none());
    elastic.bound("waiting").await;

    // Policy Retain: the ElasticGPU stays, released.
    elastic
        .add_claim(
            "retained",
            json!({"elasticGPUClassName": "kept", "resources": {"requests": {CORE: 5, MEMORY: 1}}}),
        )
        .await;
    let (_, kept) = elastic.bound("retained").await;
    elastic.delete_claim("retained").await;
    let kept = kept.metadata.name.expect("named");
    let released = elastic.gpus().get(&kept).await.expect("kept");
    assert_eq!(released.phase(), Some("Released"));
    for name in ["waiting", "odd", "bad", "orphan"] {
        elastic.delete_claim(name).await;
    }
}
